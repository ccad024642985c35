//! The kubelet peer's Dynamic Resource Allocation, on the real control
//! plane and the real scheduler (shipped profile), before the product has
//! a DRA plugin: a test-only driver built on the upstream kubelet plugin
//! helper (`kube-peers dra-test-driver`) registers through the node's
//! plugins_registry, publishes a ResourceSlice, and a pod asking its
//! DeviceClass through a ResourceClaimTemplate is allocated a device of
//! that slice by the scheduler, prepared by the kubelet's DRA manager
//! (retried after a failed prepare, as the kubelet does), given the
//! driver's CDI devices, kept prepared across a kubelet restart (its
//! checkpoint) and unprepared before its final delete.

mod support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams};
use serde_json::Value;

use support::kube::*;

const NS: &str = "dra";
const DRIVER: &str = "test-dra.doslab.io";
const GPU: &str = "GPU-00000000-0000-4000-8000-000000000000";

/// Waits until `check` gives something, polling every 100 ms; panics with
/// `what` and `logs()` after `within`.
async fn until<T>(
    within: Duration,
    what: &str,
    logs: impl Fn() -> String,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(Instant::now() < deadline, "{what}\n{}", logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_is_allocated_by_the_scheduler_prepared_by_the_kubelet_and_unprepared_at_deletion()
{
    let cp = ControlPlane::start();
    let mut node = KubeNode::start(&cp, "node-0", &[(GPU, 16384)], "").await;
    namespace(&cp, NS);
    let sched = Scheduler::start(&cp);
    // The first NodePrepareResources fails: the kubelet must retry it.
    let driver =
        node.start_test_dra_driver(&cp, DRIVER, &["--devices", "2", "--fail-prepares", "1"]);
    let client = cp.admin_client().await;
    let logs = |node: &KubeNode| {
        format!(
            "--- kubelet\n{}\n--- driver\n{}\n--- calls\n{:?}\n--- scheduler\n{}",
            node.kubelet.log_text(),
            driver.proc.log_text(),
            driver.calls(),
            sched.proc.log_text()
        )
    };

    // Registration through the plugin watcher: GetInfo on the driver's
    // registration socket, then NotifyRegistrationStatus.
    let registered = until(
        START,
        "the driver never registered",
        || logs(&node),
        async || driver.calls().into_iter().find(|c| c["op"] == "registered"),
    )
    .await;
    assert_eq!(registered.get("error"), None, "{registered}");

    let slices: Api<DynamicObject> = Api::all_with(client.clone(), &resource("ResourceSlice"));
    let slice = until(
        START,
        "no ResourceSlice published",
        || logs(&node),
        async || driver_slice(&slices).await,
    )
    .await;
    assert_eq!(slice.data["spec"]["nodeName"], "node-0", "{:?}", slice.data);
    assert_eq!(
        slice.data["spec"]["pool"]["name"], "node-0",
        "{:?}",
        slice.data
    );

    cp.apply(&format!(
        "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {{name: test-dra}}\n\
         spec:\n  selectors:\n  - cel: {{expression: 'device.driver == \"{DRIVER}\"'}}\n---\n\
         apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\n\
         metadata: {{name: one, namespace: {NS}}}\n\
         spec:\n  spec:\n    devices:\n      requests:\n      - name: dev\n        \
         exactly: {{deviceClassName: test-dra}}\n"
    ));
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "claimer", "namespace": NS},
        "spec": {
            "schedulerName": "doslab-gpu-scheduler",
            "resourceClaims": [{"name": "dev", "resourceClaimTemplateName": "one"}],
            "containers": [{"name": "main", "image": "app", "resources": {"claims": [{"name": "dev"}]}}],
        }
    }))
    .unwrap();
    create(&client, &pod).await;
    // One failed prepare, then the kubelet's backoff (10 s, jittered by
    // half) before the next.
    let running = wait_pod(&client, NS, "claimer", Duration::from_secs(90), |p| {
        phase(p) == "Running"
    })
    .await
    .unwrap_or_else(|p| panic!("claimer never ran: {p:#?}\n{}", logs(&node)));
    assert_eq!(node_of(&running), "node-0");
    let uid = running.metadata.uid.clone().unwrap();

    // The scheduler allocated one of the driver's devices on this node and
    // reserved the claim for the pod.
    let claim_name = running
        .status
        .as_ref()
        .unwrap()
        .resource_claim_statuses
        .as_ref()
        .unwrap()[0]
        .resource_claim_name
        .clone()
        .unwrap();
    let claims: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), NS, &resource("ResourceClaim"));
    let claim = claims.get(&claim_name).await.unwrap();
    let claim_uid = claim.metadata.uid.clone().unwrap();
    let result = &claim.data["status"]["allocation"]["devices"]["results"][0];
    assert_eq!(result["driver"], DRIVER, "{:?}", claim.data);
    assert_eq!(result["pool"], "node-0", "{:?}", claim.data);
    let device = result["device"].as_str().unwrap();
    assert!(device == "dev-0" || device == "dev-1", "{:?}", claim.data);
    assert_eq!(
        claim.data["status"]["reservedFor"][0]["uid"],
        uid.as_str(),
        "{:?}",
        claim.data
    );

    // NodePrepareResources for that claim: the injected failure, then the
    // retry that succeeded; the kubelet reported the failure as it does.
    let prepares: Vec<Value> = driver
        .calls()
        .into_iter()
        .filter(|c| c["op"] == "prepare")
        .collect();
    assert_eq!(prepares.len(), 2, "{prepares:?}");
    assert!(
        prepares.iter().all(|c| c["claim"] == claim_uid.as_str()),
        "{prepares:?}"
    );
    assert!(prepares[0]["error"].as_str().is_some(), "{prepares:?}");
    assert_eq!(prepares[1].get("error"), None, "{prepares:?}");
    let cdi = format!("{DRIVER}/test={claim_uid}-{device}");
    assert_eq!(prepares[1]["devices"], serde_json::json!([cdi]));
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let failed = events
        .list(&ListParams::default().fields("involvedObject.name=claimer"))
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("FailedPrepareDynamicResources"))
        .unwrap_or_else(|| panic!("no FailedPrepareDynamicResources event\n{}", logs(&node)));
    let message = failed.message.unwrap_or_default();
    assert!(
        message.starts_with("Failed to prepare dynamic resources: ")
            && message.contains("injected prepare failure"),
        "{message}"
    );
    assert_eq!(failed.type_.as_deref(), Some("Warning"));

    // The container gets the driver's CDI device, as the runtime would.
    let record = node.record(NS, "claimer").unwrap();
    assert_eq!(cdi_devices(&record, "main"), [cdi.as_str()], "{record:#}");

    // A kubelet restart: the running pod is admitted again, its claim still
    // prepared from the DRA manager's checkpoint (no new prepare). The new
    // kubelet deletes the node's ResourceSlices at start, as the kubelet
    // does until drivers register again; the driver publishes anew.
    let published = driver_slice(&slices).await.unwrap().metadata.uid;
    let recorded = std::fs::metadata(node.dir.path().join("kubelet/pods/dra_claimer.json"))
        .unwrap()
        .modified()
        .unwrap();
    node.restart_kubelet().await;
    let record = until(
        START,
        "not admitted again after the restart",
        || logs(&node),
        async || {
            let path = node.dir.path().join("kubelet/pods/dra_claimer.json");
            let modified = std::fs::metadata(path).ok()?.modified().ok()?;
            (modified > recorded)
                .then(|| node.record(NS, "claimer"))
                .flatten()
        },
    )
    .await;
    assert_eq!(cdi_devices(&record, "main"), [cdi.as_str()], "{record:#}");
    let prepared = driver
        .calls()
        .iter()
        .filter(|c| c["op"] == "prepare")
        .count();
    assert_eq!(prepared, 2, "{:?}", driver.calls());
    until(
        START,
        "the ResourceSlice was never replaced",
        || logs(&node),
        async || {
            driver_slice(&slices)
                .await
                .filter(|s| s.metadata.uid != published)
        },
    )
    .await;

    // Deletion: the new kubelet unprepares the claim (the driver registered
    // with it again), then deletes the pod for good.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.delete("claimer", &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&client, NS, "claimer", Duration::from_secs(60)).await;
    let unprepares: Vec<Value> = driver
        .calls()
        .into_iter()
        .filter(|c| c["op"] == "unprepare")
        .collect();
    assert_eq!(unprepares.len(), 1, "{:?}\n{}", driver.calls(), logs(&node));
    assert_eq!(unprepares[0]["claim"], claim_uid.as_str());
}

/// The test driver's ResourceSlice, if there is one.
async fn driver_slice(slices: &Api<DynamicObject>) -> Option<DynamicObject> {
    let list = slices.list(&ListParams::default()).await.ok()?;
    list.items
        .into_iter()
        .find(|s| s.data["spec"]["driver"] == DRIVER)
}

fn resource(kind: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("resource.k8s.io", "v1", kind))
}
