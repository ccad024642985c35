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

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams};
use serde::Deserialize;
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
    support::poll_for(
        Instant::now() + within,
        async || check().await,
        || format!("{what}\n{}", logs()),
    )
    .await
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
    // The kubelet may also have failed a prepare before the driver saw
    // it: the Node authorizer learns that the pod's claim is the node's a
    // moment after the pod is bound ("no relationship found"), and the
    // kubelet retries; that is an Event of the same reason.
    let failed = events
        .list(&ListParams::default().fields("involvedObject.name=claimer"))
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|e| {
            e.reason.as_deref() == Some("FailedPrepareDynamicResources")
                && e.message
                    .as_deref()
                    .is_some_and(|m| m.contains("injected prepare failure"))
        })
        .unwrap_or_else(|| panic!("no FailedPrepareDynamicResources event\n{}", logs(&node)));
    let message = failed.message.unwrap_or_default();
    assert!(
        message.starts_with("Failed to prepare dynamic resources: "),
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

/// The product's driver on the node, shares of one GPU and whole GPUs.
const GPU_DRIVER: &str = "gpu.doslab.io";

/// A ResourceClaimTemplate `name` of the product's DeviceClass asking
/// `capacity` (memory, cores), or the whole GPU without.
fn template(name: &str, capacity: Option<(&str, &str)>) -> String {
    let asks = capacity.map(|(memory, cores)| [("memory", memory), ("cores", cores)]);
    claim_template(NS, name, GPU_DRIVER, asks.as_ref().map_or(&[], |a| a))
}

/// The CDI spec file in `node`'s CDI directory holding device `id` and
/// the envs it gives a container ([`cdi_envs_in`]).
fn cdi_envs(node: &KubeNode, id: &str) -> (std::path::PathBuf, BTreeMap<String, String>) {
    cdi_envs_in(&node.cdi_dir(), id)
        .unwrap_or_else(|| panic!("no CDI spec holds {id} in {}", node.cdi_dir().display()))
}

/// Waits until `name` runs; its node's CDI device for `main` and that
/// device's envs.
async fn running_with(
    client: &kube::Client,
    node: &KubeNode,
    name: &str,
    logs: &dyn Fn() -> String,
) -> (String, BTreeMap<String, String>) {
    let pod = wait_pod(client, NS, name, Duration::from_secs(90), |p| {
        phase(p) == "Running" || phase(p) == "Failed"
    })
    .await
    .unwrap_or_else(|p| panic!("{name} never ran: {p:#?}\n{}", logs()));
    assert_eq!(phase(&pod), "Running", "{pod:#?}\n{}", logs());
    assert_eq!(node_of(&pod), node.name);
    let ids = cdi_devices(&node.record(NS, name).unwrap(), "main");
    assert_eq!(ids.len(), 1, "{name}: {ids:?}");
    let (_, envs) = cdi_envs(node, &ids[0]);
    (ids[0].clone(), envs)
}

/// The tails of a DRA node's kubelet and daemon and of the scheduler.
fn node_logs(node: &KubeNode, sched: &Proc) -> String {
    format!(
        "--- kubelet\n{}\n--- daemon\n{}\n--- scheduler\n{}",
        tail(&node.kubelet.log_text()),
        tail(&node.daemon.log_text()),
        tail(&sched.log_text())
    )
}

/// Deletes pod `name`, whose claim's CDI device is `id`, and checks that
/// the kubelet had the daemon unprepare it: its spec is gone.
async fn delete_unprepared(
    client: &kube::Client,
    node: &KubeNode,
    name: &str,
    id: &str,
    logs: &dyn Fn() -> String,
) {
    let (spec, _) = cdi_envs(node, id);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.delete(name, &DeleteParams::default()).await.unwrap();
    wait_gone(client, NS, name, Duration::from_secs(60)).await;
    assert!(!spec.exists(), "{} left\n{}", spec.display(), logs());
}

/// Waits for a FailedScheduling Event of pod `name`; its note.
async fn unschedulable(client: &kube::Client, name: &str, logs: &dyn Fn() -> String) -> String {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), NS);
    until(
        Duration::from_secs(60),
        &format!("{name} was never reported unschedulable"),
        logs,
        async || {
            let list = events.list(&ListParams::default()).await.ok()?;
            list.items.into_iter().find_map(|e| {
                let about = e.regarding.as_ref().and_then(|r| r.name.as_deref());
                (e.reason.as_deref() == Some("FailedScheduling") && about == Some(name))
                    .then(|| e.note.unwrap_or_default())
            })
        },
    )
    .await
}

/// The product's DRA plugin on the real components: the kube-scheduler's
/// DynamicResources plugin (default profile, no extender) places claims on
/// the slice the daemon publishes, the kubelet's DRA manager prepares them
/// through the daemon, and each container's CDI edits carry its own limits
/// from the device plugin's composer. Two 8 GiB / 30 % shares land on the
/// GPU a whole-GPU claim left free; a third share waits for room, a claim
/// larger than any GPU waits with the scheduler's reason; deletion
/// unprepares (the CDI spec and the share's enforcement state go); a
/// kubelet restart and a daemon restart between prepare and unprepare lose
/// nothing; an unhealthy GPU is tainted, new claims avoid it and the pods
/// on it show it in their status (the kubelet's health stream, KEP-4680).
#[tokio::test(flavor = "multi_thread")]
async fn shares_and_whole_gpus_through_the_products_dra_plugin() {
    let cp = ControlPlane::start();
    let host = tempfile::tempdir().unwrap();
    let (lib, health) = (host.path().join("lib"), host.path().join("health"));
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::create_dir_all(&health).unwrap();
    std::fs::copy(support::real_shared_object(), lib.join("libvgpu.so")).unwrap();
    let driver = FakeDriver::new(host.path());
    let gpus = [(gpu_uuid(0, 0), 16384), (gpu_uuid(0, 1), 16384)];
    let gpus: Vec<(&str, u64)> = gpus.iter().map(|(u, m)| (u.as_str(), *m)).collect();
    let tables = format!(
        "[enforcement]\nmode = \"hami-core\"\nlibrary_dir = {:?}\nstate_dir = {:?}\n\
         [health]\nmock_dir = {:?}\npoll_ms = 200\nrecovery_ms = 400\n{}",
        lib,
        host.path().join("state"),
        health,
        driver.toml()
    );
    let mut node = KubeNode::start_dra(&cp, "node-0", &gpus, &tables).await;
    namespace(&cp, NS);
    let sched = start_plain_scheduler(&cp);
    let client = cp.admin_client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    cp.apply(&template("share", Some(("8Gi", "30"))));
    cp.apply(&template("whole", None));
    cp.apply(&template("huge", Some(("32Gi", "10"))));
    let logs = |node: &KubeNode| node_logs(node, &sched);

    // A whole GPU: its UUID, no limits.
    create(&client, &claim_pod(NS, "whole-0", "whole")).await;
    let (_, whole) = running_with(&client, &node, "whole-0", &|| logs(&node)).await;
    let taken = whole["NVIDIA_VISIBLE_DEVICES"].clone();
    assert!(gpus.iter().any(|(u, _)| *u == taken), "{whole:?}");
    assert_eq!(whole.get("CUDA_DEVICE_MEMORY_LIMIT_0"), None, "{whole:?}");
    // Two shares, both on the other GPU, each with its own limits.
    let mut shares = BTreeMap::new();
    for name in ["share-1", "share-2"] {
        create(&client, &claim_pod(NS, name, "share")).await;
        let (id, envs) = running_with(&client, &node, name, &|| logs(&node)).await;
        assert_ne!(
            envs["NVIDIA_VISIBLE_DEVICES"], taken,
            "{name} beside a whole GPU"
        );
        assert_eq!(
            envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "8192m",
            "{name}: {envs:?}"
        );
        assert_eq!(envs["CUDA_DEVICE_SM_LIMIT"], "30", "{name}: {envs:?}");
        assert!(
            envs.contains_key("CUDA_DEVICE_MEMORY_SHARED_CACHE"),
            "{envs:?}"
        );
        shares.insert(name, id);
    }
    let share_gpu = whole_other(&gpus, &taken);
    let used_by_share_1 =
        usage_by_claim(&client, &node, &driver, &share_gpu, &|| logs(&node)).await;
    // No room left for a third share; no GPU holds 32 GiB.
    create(&client, &claim_pod(NS, "share-3", "share")).await;
    create(&client, &claim_pod(NS, "huge", "huge")).await;
    for name in ["share-3", "huge"] {
        let note = unschedulable(&client, name, &|| logs(&node)).await;
        assert!(note.contains("claim"), "{name}: {note}");
        assert!(node_of(&pods.get(name).await.unwrap()).is_empty());
    }

    // Deleting share-1 unprepares it: its spec and cache directory go, and
    // share-3 takes the room.
    let (spec, envs) = cdi_envs(&node, &shares["share-1"]);
    let cache = std::path::PathBuf::from(&envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"]);
    pods.delete("share-1", &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&client, NS, "share-1", Duration::from_secs(60)).await;
    assert!(!spec.exists(), "{} left", spec.display());
    let claim_dirs = host.path().join("state/claims");
    let left: Vec<_> = std::fs::read_dir(&claim_dirs)
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert_eq!(
        left.len(),
        1,
        "share-1's enforcement state left: {left:?} ({cache:?})"
    );
    // Its claim unprepared, its series go, granted and used; the driver
    // still lists the process (it has not exited yet), in its GPU's
    // totals only.
    let addr = support::http_addr(&node.daemon);
    support::poll_until(
        Instant::now() + support::WAIT,
        || {
            let scrape = support::http_get(&addr, "/metrics").1;
            !scrape.contains(r#"pod="share-1""#)
        },
        || format!("{used_by_share_1} outlived its claim\n{}", logs(&node)),
    )
    .await;
    let (id3, _) = running_with(&client, &node, "share-3", &|| logs(&node)).await;

    // A kubelet restart with share-2 and share-3 prepared: they stay
    // prepared, the slice the new kubelet wipes is published again, and
    // deleting share-2 afterwards unprepares it.
    node.restart_kubelet().await;
    node.wait_sliced(&cp).await;
    delete_unprepared(&client, &node, "share-2", &shares["share-2"], &|| {
        logs(&node)
    })
    .await;
    // A daemon restart with share-3 prepared: its checkpoint lets the new
    // daemon unprepare it.
    node.restart_daemon();
    node.wait_sliced(&cp).await;
    delete_unprepared(&client, &node, "share-3", &id3, &|| logs(&node)).await;

    // Health: the GPU a share runs on turns unhealthy; its device is
    // tainted NoSchedule, the kubelet hears of it through the health
    // stream and shows it in the pod's status, and the next share goes to
    // the other GPU.
    pods.delete("whole-0", &DeleteParams::default())
        .await
        .unwrap();
    pods.delete("huge", &DeleteParams::default()).await.unwrap();
    wait_gone(&client, NS, "whole-0", Duration::from_secs(60)).await;
    create(&client, &claim_pod(NS, "probe", "share")).await;
    let (_, probe) = running_with(&client, &node, "probe", &|| logs(&node)).await;
    let first = probe["NVIDIA_VISIBLE_DEVICES"].clone();
    let untyped: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), NS, &ApiResource::erase::<Pod>(&()));
    assert_eq!(
        device_health(&untyped, "probe")
            .await
            .map(|h| h.0)
            .as_deref(),
        Some("Healthy")
    );
    std::fs::write(health.join(&first), "").unwrap();
    let slices: Api<DynamicObject> = Api::all_with(client.clone(), &resource("ResourceSlice"));
    until(
        Duration::from_secs(30),
        "the unhealthy GPU's device never tainted",
        || logs(&node),
        async || {
            let list = slices.list(&ListParams::default()).await.ok()?;
            list.items.into_iter().find(|s| {
                s.data["spec"]["devices"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|d| {
                        d["attributes"]["uuid"]["string"] == first.as_str()
                            && d["taints"][0]["effect"] == "NoSchedule"
                    })
            })
        },
    )
    .await;
    let why = until(
        Duration::from_secs(30),
        "the probe's status never showed its device unhealthy",
        || logs(&node),
        async || {
            let (health, why) = device_health(&untyped, "probe").await?;
            (health == "Unhealthy").then_some(why)
        },
    )
    .await;
    let flag = health.join(&first);
    assert_eq!(why, format!("mock health file {} exists", flag.display()));
    create(&client, &claim_pod(NS, "after", "share")).await;
    let (_, after) = running_with(&client, &node, "after", &|| logs(&node)).await;
    assert_ne!(
        after["NVIDIA_VISIBLE_DEVICES"], first,
        "landed on the tainted GPU"
    );
    // Healthy again after the recovery window: the probe's status says so.
    std::fs::remove_file(&flag).unwrap();
    until(
        Duration::from_secs(30),
        "the probe's status never showed its device healthy again",
        || logs(&node),
        async || {
            let (health, _) = device_health(&untyped, "probe").await?;
            (health == "Healthy").then_some(())
        },
    )
    .await;
}

/// The GPU of `gpus` that is not `taken`.
fn whole_other(gpus: &[(&str, u64)], taken: &str) -> String {
    gpus.iter().find(|(u, _)| *u != taken).unwrap().0.to_owned()
}

/// share-1 and share-2 (8 GiB and 30 % each, claims from a template) run
/// on `gpu`; a process of share-1's container uses 1 GiB and 40 % of its
/// SMs there, one of no pod 32 MiB: the daemon's scrape shows each claim's
/// grant and share-1's use, labelled with the claim, within a poll.
/// Returns share-1's used-memory series.
async fn usage_by_claim(
    client: &kube::Client,
    node: &KubeNode,
    driver: &FakeDriver,
    gpu: &str,
    logs: &dyn Fn() -> String,
) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let claim_of = |p: &Pod| -> String {
        let statuses = p.status.as_ref().unwrap().resource_claim_statuses.as_ref();
        statuses.unwrap()[0].resource_claim_name.clone().unwrap()
    };
    let (one, two) = (
        pods.get("share-1").await.unwrap(),
        pods.get("share-2").await.unwrap(),
    );
    driver.process_of(4242, &one);
    driver.process(7, "0::/system.slice/nvidia-mps.service\n");
    driver.lists(gpu, "4242 1073741824 40\n7 33554432 -\n");
    let addr = support::http_addr(&node.daemon);
    let claim = claim_of(&one);
    let labels = format!(
        r#"{{namespace="{NS}",pod="share-1",container="main",gpu="{gpu}",claim="{claim}"}}"#
    );
    let used = format!("gpu_device_plugin_container_memory_used_bytes{labels}");
    let deadline = Instant::now() + support::WAIT;
    support::poll_until(
        deadline,
        || support::metric(&addr, &used) == Some((1u64 << 30) as f64),
        || {
            format!(
                "{used} never read 1 GiB:\n{}\n{}",
                support::http_get(&addr, "/metrics").1,
                logs()
            )
        },
    )
    .await;
    let sm = format!("gpu_device_plugin_container_sm_utilization_ratio{labels}");
    assert_eq!(support::metric(&addr, &sm), Some(0.4));
    for (pod, claim) in [("share-1", claim), ("share-2", claim_of(&two))] {
        let labels =
            format!(r#"{{namespace="{NS}",pod="{pod}",container="",gpu="{gpu}",claim="{claim}"}}"#);
        let memory = format!("gpu_device_plugin_container_memory_granted_bytes{labels}");
        assert_eq!(
            support::metric(&addr, &memory),
            Some((8u64 << 30) as f64),
            "{memory}"
        );
        let core = format!("gpu_device_plugin_container_core_granted_ratio{labels}");
        assert_eq!(support::metric(&addr, &core), Some(0.3), "{core}");
    }
    let total = format!(r#"gpu_device_plugin_gpu_memory_used_bytes{{gpu="{gpu}"}}"#);
    assert_eq!(
        support::metric(&addr, &total),
        Some(((1u64 << 30) + (32 << 20)) as f64)
    );
    used
}

/// The health and message of the device of pod `name`'s claim `gpu` in
/// its container `main`'s `allocatedResourcesStatus`, as the kubelet's
/// DRA manager wrote it from the driver's health stream. Read untyped: the
/// message is newer than the API types the tests are built with.
async fn device_health(pods: &Api<DynamicObject>, name: &str) -> Option<(String, String)> {
    let pod = pods.get(name).await.ok()?.data;
    let container = pod["status"]["containerStatuses"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == "main")?;
    let status = container["allocatedResourcesStatus"]
        .as_array()?
        .iter()
        .find(|s| s["name"] == "claim:gpu")?;
    let device = &status["resources"].as_array()?.first()?;
    Some((
        device["health"].as_str()?.to_owned(),
        device["message"].as_str().unwrap_or_default().to_owned(),
    ))
}

/// Pods on a DRA-only node as they are written today: the shipped
/// Deployment example (deploy/dra/examples, applied as shipped, so in
/// namespace `default`), whose replicas each take their own share from the
/// shipped ResourceClaimTemplate (the deployment and replicaset controllers
/// make the pods, the resourceclaim controller their claims), and a pod
/// asking `doslab.io/gpu-count: 1`, which the shipped DeviceClass's
/// `extendedResourceName` turns into a claim of a whole GPU (the
/// scheduler's DynamicResources plugin makes it, the kubelet's DRA manager
/// prepares it through the daemon).
#[tokio::test(flavor = "multi_thread")]
async fn a_deployment_and_a_gpu_count_pod_through_the_products_dra_plugin() {
    let cp = ControlPlane::start();
    let gpus = [(gpu_uuid(0, 0), 16384), (gpu_uuid(0, 1), 16384)];
    let gpus: Vec<(&str, u64)> = gpus.iter().map(|(u, m)| (u.as_str(), *m)).collect();
    let node = KubeNode::start_dra(&cp, "node-0", &gpus, "[enforcement]\nmode = \"none\"\n").await;
    namespace(&cp, NS);
    // A DRA-only cluster runs no extender and does not install the GPU
    // scheduler's mutating policy (ControlPlane::start applies it): it
    // would hand a pod asking a doslab.io resource to the extender's
    // scheduler, which no one runs here.
    let client = cp.admin_client().await;
    let bindings: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            "MutatingAdmissionPolicyBinding",
        )),
    );
    bindings
        .delete("doslab-gpu-scheduler", &DeleteParams::default())
        .await
        .unwrap();
    let sched = start_plain_scheduler(&cp);
    let logs = || node_logs(&node, &sched);

    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/dra/examples");
    for file in ["templates.yaml", "deployment.yaml"] {
        cp.apply(&std::fs::read_to_string(examples.join(file)).unwrap());
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let replicas = until(
        Duration::from_secs(120),
        "the Deployment's two replicas never ran",
        logs,
        async || {
            let list = pods
                .list(&ListParams::default().labels("app.kubernetes.io/name=gpu-share-demo"))
                .await
                .ok()?;
            let running: Vec<Pod> = list
                .items
                .into_iter()
                .filter(|p| phase(p) == "Running")
                .collect();
            (running.len() == 2).then_some(running)
        },
    )
    .await;
    let mut claims = Vec::new();
    let mut shared = Vec::new();
    for pod in &replicas {
        let name = pod.metadata.name.as_deref().unwrap();
        let status = pod.status.as_ref().unwrap();
        claims.push(
            status.resource_claim_statuses.as_ref().unwrap()[0]
                .resource_claim_name
                .clone(),
        );
        let ids = cdi_devices(&node.record("default", name).unwrap(), "cuda");
        assert_eq!(ids.len(), 1, "{name}: {ids:?}");
        let (_, envs) = cdi_envs(&node, &ids[0]);
        assert_eq!(
            envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "8192m",
            "{name}: {envs:?}"
        );
        assert_eq!(envs["CUDA_DEVICE_SM_LIMIT"], "30", "{name}: {envs:?}");
        shared.push(envs["NVIDIA_VISIBLE_DEVICES"].clone());
    }
    assert_ne!(claims[0], claims[1], "the replicas share one claim");
    assert!(claims.iter().all(Option::is_some), "{claims:?}");
    assert_eq!(shared[0], shared[1], "8 + 8 GiB fit one 16 GiB GPU");

    // gpu-count: 1 on a node that serves no device-plugin resource: the
    // scheduler claims a whole GPU of the class for it, the other GPU.
    let count = gpu_pod(NS, "count", &[("main", [0, 0, 1])]);
    // The API server drops the deleted binding a moment later: a dry-run
    // create tells when.
    let dry = kube::api::PostParams {
        dry_run: true,
        ..Default::default()
    };
    let tenants: Api<Pod> = Api::namespaced(client.clone(), NS);
    until(
        Duration::from_secs(30),
        "the GPU scheduler's mutating policy still applies",
        logs,
        async || {
            let stored = tenants.create(&dry, &count).await.ok()?;
            let name = stored.spec?.scheduler_name;
            (name.as_deref() == Some("default-scheduler")).then_some(())
        },
    )
    .await;
    create(&client, &count).await;
    let pod = wait_pod(&client, NS, "count", Duration::from_secs(90), |p| {
        phase(p) == "Running" || phase(p) == "Failed"
    })
    .await
    .unwrap_or_else(|p| panic!("count never ran: {p:#?}\n{}", logs()));
    assert_eq!(phase(&pod), "Running", "{pod:#?}\n{}", logs());
    assert_eq!(
        pod.spec.as_ref().unwrap().scheduler_name.as_deref(),
        Some("default-scheduler")
    );
    let special = pod
        .status
        .as_ref()
        .and_then(|s| s.extended_resource_claim_status.as_ref())
        .unwrap_or_else(|| panic!("no extended-resource claim: {pod:#?}"));
    assert_eq!(
        special.request_mappings[0].resource_name,
        "doslab.io/gpu-count"
    );
    let ids = cdi_devices(&node.record(NS, "count").unwrap(), "main");
    assert_eq!(ids.len(), 1, "{ids:?}\n{}", logs());
    let (_, whole) = cdi_envs(&node, &ids[0]);
    assert_ne!(whole["NVIDIA_VISIBLE_DEVICES"], shared[0], "{whole:?}");
    assert!(
        gpus.iter()
            .any(|(u, _)| *u == whole["NVIDIA_VISIBLE_DEVICES"]),
        "{whole:?}"
    );
    assert_eq!(whole.get("CUDA_DEVICE_MEMORY_LIMIT_0"), None, "{whole:?}");
    assert_eq!(whole.get("CUDA_DEVICE_SM_LIMIT"), None, "{whole:?}");
    // A second one finds no whole GPU left.
    create(&client, &gpu_pod(NS, "count-2", &[("main", [0, 0, 1])])).await;
    let note = unschedulable(&client, "count-2", &logs).await;
    assert!(!note.is_empty(), "{note}");
}

/// The same burst of shared pods through each path on one cluster:
/// through the extender (the GPU scheduler's profile, the device-plugin
/// resources of `dp-*` nodes) and through DRA (the default profile, no
/// extender, the DRA plugin of `dra-*` nodes of the same shape). Prints
/// pods/s (the burst's size over first create to last bound) and
/// create→bound p50/p99 for each; asserts only that every pod is bound on
/// its own path's nodes.
/// `cargo test --test kube_dra -- --ignored --nocapture pods_per_second`
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a bench: run it on its own (README, DRA)"]
async fn pods_per_second_through_dra_and_through_the_extender() {
    const PODS: usize = 200;
    const SHAPE: [u64; 4] = [81920; 4];
    let cp = ControlPlane::start();
    let gpus = |n: usize| -> Vec<(String, u64)> {
        SHAPE
            .iter()
            .enumerate()
            .map(|(g, m)| (gpu_uuid(n, g), *m))
            .collect()
    };
    let mut nodes = Vec::new();
    for n in 0..2 {
        let ids = gpus(n);
        let ids: Vec<(&str, u64)> = ids.iter().map(|(u, m)| (u.as_str(), *m)).collect();
        let tables = "[enforcement]\nmode = \"none\"\n";
        nodes.push(KubeNode::start_dra(&cp, &format!("dra-{n}"), &ids, tables).await);
    }
    device_plugin_rights_beside_dra(&cp);
    for n in 0..2 {
        let ids = gpus(n + 2);
        let ids: Vec<(&str, u64)> = ids.iter().map(|(u, m)| (u.as_str(), *m)).collect();
        nodes.push(KubeNode::start(&cp, &format!("dp-{n}"), &ids, "memory_unit_mib = 1024").await);
    }
    namespace(&cp, NS);
    cp.apply(&claim_template(NS, "two", GPU_DRIVER, &[("memory", "2Gi")]));
    let extender = Scheduler::start(&cp);
    let plain = start_plain_scheduler(&cp);
    let client = cp.admin_client().await;
    let logs = || {
        format!(
            "--- scheduler\n{}\n--- extender\n{}\n--- plain scheduler\n{}",
            tail(&extender.proc.log_text()),
            tail(&extender.extender.log_text()),
            tail(&plain.log_text())
        )
    };
    let binds = Bindings::watch(&client, NS);
    // 2 GiB each (no compute ask, which would cap a side at 8 GPUs × 100
    // cores): 200 of them take 400 of each side's 640 GiB.
    /// A path's name, its nodes' name prefix, its pod of a name.
    type Path = (&'static str, &'static str, fn(&str) -> Pod);
    let paths: [Path; 2] = [
        ("extender", "dp-", |name| {
            gpu_pod(NS, name, &[("main", [2, 0, 0])])
        }),
        ("DRA", "dra-", |name| claim_pod(NS, name, "two")),
    ];
    for (path, prefix, pod) in &paths {
        // One pod first, so each path's informers and caches are warm.
        let warm = format!("{path}-warm").to_lowercase();
        create(&client, &pod(&warm)).await;
        wait_pod(&client, NS, &warm, START, |p| !node_of(p).is_empty())
            .await
            .unwrap_or_else(|p| panic!("{warm} never bound: {p:#?}\n{}", logs()));
        let mut created = Vec::new();
        for i in 0..PODS {
            let name = format!("{path}-{i:03}").to_lowercase();
            created.push((name.clone(), create(&client, &pod(&name)).await));
        }
        let mut latencies = Vec::new();
        let mut last = created[0].1;
        for (name, at) in &created {
            let p = wait_pod(&client, NS, name, Duration::from_secs(300), |p| {
                !node_of(p).is_empty()
            })
            .await
            .unwrap_or_else(|p| panic!("{name} never bound: {p:#?}\n{}", logs()));
            assert!(node_of(&p).starts_with(prefix), "{name} on {}", node_of(&p));
            let bound = binds.at(name).unwrap_or_else(Instant::now);
            last = last.max(bound);
            latencies.push(bound - *at);
        }
        latencies.sort();
        let spent = (last - created[0].1).as_secs_f64();
        eprintln!(
            "{PODS} shared pods through {path}: {:.1} pods/s ({spent:.1} s), create→bound p50 {:?} p99 {:?}",
            PODS as f64 / spent,
            latencies[PODS / 2],
            latencies[(PODS * 99).div_ceil(100) - 1],
        );
    }
    drop(nodes);
}

/// The shipped example ResourceClaimTemplate `name`
/// (deploy/dra/examples/templates.yaml), in the test's namespace.
fn shipped_template(name: &str) -> String {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/dra/examples/templates.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let mut found = serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde_yaml::Value::deserialize(doc).unwrap())
        .find(|t| t["metadata"]["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no template {name} in templates.yaml"));
    found["metadata"]["namespace"] = NS.into();
    serde_yaml::to_string(&found).unwrap()
}

/// Shares that span GPUs, on the real DRA allocator and kubelet DRA
/// manager: 2 x 20 GiB on a node of four 40 GiB GPUs lands on two
/// distinct GPUs, its CDI spec carrying both and each one's HAMi-core
/// limit; a daemon restart between prepare and unprepare loses nothing;
/// with one GPU free the claim waits (one GPU would hold both shares, the
/// constraint forbids it); a fill of 1- and 2-GPU claims keeps every GPU
/// within its memory.
#[tokio::test(flavor = "multi_thread")]
async fn a_share_over_two_distinct_gpus_through_the_products_dra_plugin() {
    let cp = ControlPlane::start();
    let host = tempfile::tempdir().unwrap();
    let lib = host.path().join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::copy(support::real_shared_object(), lib.join("libvgpu.so")).unwrap();
    let gpus: Vec<(String, u64)> = (0..4).map(|g| (gpu_uuid(0, g), 40960)).collect();
    let gpus: Vec<(&str, u64)> = gpus.iter().map(|(u, m)| (u.as_str(), *m)).collect();
    let tables = format!(
        "[enforcement]\nmode = \"hami-core\"\nlibrary_dir = {:?}\nstate_dir = {:?}\n",
        lib,
        host.path().join("state"),
    );
    let mut node = KubeNode::start_dra(&cp, "node-0", &gpus, &tables).await;
    namespace(&cp, NS);
    let sched = start_plain_scheduler(&cp);
    let client = cp.admin_client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    // The README's template of a share over two GPUs, and a single share.
    let pair = "gpu-memory-20480-core-30-x2";
    cp.apply(&shipped_template(pair));
    cp.apply(&template("single", Some(("20Gi", "10"))));
    cp.apply(&template("whole", None));
    let logs = |node: &KubeNode| node_logs(node, &sched);

    create(&client, &claim_pod(NS, "pair-1", pair)).await;
    let (id, envs) = running_with(&client, &node, "pair-1", &|| logs(&node)).await;
    let visible: BTreeSet<&str> = envs["NVIDIA_VISIBLE_DEVICES"].split(',').collect();
    assert_eq!(visible.len(), 2, "{envs:?}");
    for i in 0..2 {
        let key = format!("CUDA_DEVICE_MEMORY_LIMIT_{i}");
        assert_eq!(envs[&key], "20480m", "{envs:?}");
    }
    assert!(!envs.contains_key("CUDA_DEVICE_MEMORY_LIMIT_2"), "{envs:?}");
    assert_eq!(envs["CUDA_DEVICE_SM_LIMIT"], "30", "{envs:?}");
    // A daemon restart between prepare and unprepare: its checkpoint
    // holds both GPUs, and deletion removes the spec.
    node.restart_daemon();
    node.wait_sliced(&cp).await;
    delete_unprepared(&client, &node, "pair-1", &id, &|| logs(&node)).await;

    // Three GPUs held whole: the one left could hold both shares, but
    // they must be on distinct GPUs.
    for i in 0..3 {
        let name = format!("whole-{i}");
        create(&client, &claim_pod(NS, &name, "whole")).await;
        running_with(&client, &node, &name, &|| logs(&node)).await;
    }
    create(&client, &claim_pod(NS, "pair-2", pair)).await;
    let note = unschedulable(&client, "pair-2", &|| logs(&node)).await;
    assert!(note.contains("claim"), "{note}");
    assert!(node_of(&pods.get("pair-2").await.unwrap()).is_empty());
    for name in ["pair-2", "whole-0", "whole-1", "whole-2"] {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
        wait_gone(&client, NS, name, Duration::from_secs(60)).await;
    }

    // A fill of 1- and 2-GPU claims, more than the node holds.
    let names: Vec<String> = (0..8)
        .map(|i| {
            let kind = if i % 2 == 0 { "pair" } else { "single" };
            format!("{kind}-fill-{i}")
        })
        .collect();
    for name in &names {
        let template = if name.starts_with("pair") {
            pair
        } else {
            "single"
        };
        create(&client, &claim_pod(NS, name, template)).await;
    }
    let settled = until(
        Duration::from_secs(120),
        "the fill never settled",
        || logs(&node),
        async || {
            // Bound pods all running, the others reported unschedulable.
            let list = pods.list(&ListParams::default()).await.ok()?;
            for p in &list.items {
                let name = p.metadata.name.as_deref().unwrap_or_default();
                let settled = match (node_of(p).is_empty(), phase(p)) {
                    (false, ph) => ph == "Running",
                    (true, _) => !scheduling_failures(&client, NS, name).await.is_empty(),
                };
                if !settled {
                    return None;
                }
            }
            Some(list.items)
        },
    )
    .await;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let mut used: BTreeMap<String, u64> = BTreeMap::new();
    for c in claims.list(&ListParams::default()).await.unwrap().items {
        let results = c
            .status
            .and_then(|s| s.allocation)
            .and_then(|a| a.devices)
            .and_then(|d| d.results)
            .unwrap_or_default();
        let devices: BTreeSet<&str> = results.iter().map(|r| r.device.as_str()).collect();
        assert_eq!(devices.len(), results.len(), "one GPU twice: {results:?}");
        for r in &results {
            let memory = &r.consumed_capacity.as_ref().unwrap()["memory"].0;
            let gib: u64 = memory.trim_end_matches("Gi").parse().unwrap();
            *used.entry(r.device.clone()).or_default() += gib;
        }
    }
    assert!(used.values().all(|&gib| gib <= 40), "{used:?}");
    let running = settled.iter().filter(|p| phase(p) == "Running").count();
    eprintln!("fill of 1- and 2-GPU claims: {running} of 8 running, GiB per GPU {used:?}");
    assert!(running >= 4, "{running} running, {used:?}");
}
