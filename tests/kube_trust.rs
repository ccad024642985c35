//! Who may do what, on the real kube-apiserver with deploy/ applied as
//! shipped (RBAC and the admission policies): each identity of README's
//! "What each service account can do" tries, with its own token, what the
//! table says it may do (it succeeds) and what it may not (the API server
//! refuses it, with RBAC's 403 or the policy's 422 and message). A tenant,
//! the node daemon (its token bound to its pod on its node), and the GPU
//! scheduler (kube-scheduler and the extender share its account), each on
//! a control plane of its own.

mod support;

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use support::kube::*;

const NS: &str = "tenant";
/// Pods ask gpu-memory in GiB.
const UNIT: &str = "memory_unit_mib = 1024";

/// The API server's answer to one call: Ok, or its HTTP code and message.
async fn outcome<T>(call: impl Future<Output = kube::Result<T>>) -> Result<(), (u16, String)> {
    match call.await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) => Err((s.code, s.message)),
        Err(e) => panic!("no answer from the API server: {e}"),
    }
}

/// Asserts that `what` succeeded.
fn allowed(what: &str, got: Result<(), (u16, String)>) {
    if let Err((code, message)) = got {
        panic!("{what}: refused ({code}) but allowed by README: {message}");
    }
}

/// Asserts that `what` was refused with `code` and a message containing
/// `says`.
fn refused(what: &str, got: Result<(), (u16, String)>, code: u16, says: &str) {
    match got {
        Ok(()) => panic!("{what}: allowed but refused by README"),
        Err((c, message)) => {
            assert_eq!(c, code, "{what}: {message}");
            assert!(message.contains(says), "{what}: {message}\nwanted: {says}");
        }
    }
}

/// A one-container pod of `namespace` (bound to `node` when given) with
/// these annotations and `doslab.io/` limits (resource, quantity as
/// written).
fn pod(
    namespace: &str,
    name: &str,
    node: Option<&str>,
    annotations: Value,
    limits: &[(&str, &str)],
) -> Pod {
    let limits: serde_json::Map<String, Value> = limits
        .iter()
        .map(|(r, q)| (format!("doslab.io/{r}"), json!(q)))
        .collect();
    let mut p = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "spec": {"containers": [{"name": "main", "image": "app", "resources": {"limits": limits}}]}
    });
    if let Some(node) = node {
        p["spec"]["nodeName"] = json!(node);
    }
    serde_json::from_value(p).unwrap()
}

/// A merge patch of pod `name`'s annotations (null removes one).
fn annotations(annotations: Value) -> Patch<Value> {
    Patch::Merge(json!({"metadata": {"annotations": annotations}}))
}

fn pp() -> PatchParams {
    PatchParams::default()
}

/// A Binding of pod `name` to `node` carrying `annotations`.
fn binding(name: &str, node: &str, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": name, "namespace": NS, "annotations": annotations},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node}
    })
}

/// POSTs `body` to `path` as `client`.
async fn post(client: &kube::Client, path: &str, body: &Value) -> kube::Result<Value> {
    let req = http::Request::post(path)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(body).unwrap())
        .unwrap();
    client.request::<Value>(req).await
}

/// A tenant's service account in namespace [`NS`], with every pod right a
/// workload's account may plausibly hold (create, patch, update, status,
/// Bindings): what stops it is the policy, not a missing grant.
async fn tenant(cp: &ControlPlane) -> kube::Client {
    namespace(cp, NS);
    cp.apply(&format!(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: app, namespace: {NS}}}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: pods, namespace: {NS}}}\n\
         rules:\n- apiGroups: [\"\"]\n  resources: [pods, pods/status]\n  verbs: [get, create, patch, update]\n\
         - apiGroups: [\"\"]\n  resources: [pods/binding, bindings]\n  verbs: [create]\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: pods, namespace: {NS}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: pods}}\n\
         subjects: [{{kind: ServiceAccount, name: app, namespace: {NS}}}]\n"
    ));
    ControlPlane::client_as(&cp.token(NS, "app", None)).await
}

const LEDGER: &str = "doslab.io/gpu-ledger";
const ASSIGNMENT: &str = "doslab.io/gpu-assignment";
const ACCOUNTING: &str = "only the node daemon and the GPU scheduler may add, change or remove";

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cannot_write_the_accounting() {
    let cp = ControlPlane::start();
    let client = tenant(&cp).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pp = pp();

    let forged = pod(NS, "forged", None, json!({ LEDGER: "{}" }), &[]);
    refused(
        "a tenant creates a pod with a ledger",
        outcome(pods.create(&PostParams::default(), &forged)).await,
        422,
        "a pod cannot be created with doslab.io/ annotations",
    );
    let mine = pod(
        NS,
        "mine",
        None,
        json!({"keep": "x"}),
        &[("gpu-memory", "8")],
    );
    allowed(
        "a tenant creates a GPU pod",
        outcome(pods.create(&PostParams::default(), &mine)).await,
    );
    allowed(
        "a tenant changes its own annotation and a label",
        outcome(pods.patch(
            "mine",
            &pp,
            &Patch::Merge(
                json!({"metadata": {"annotations": {"keep": "y"}, "labels": {"app": "b"}}}),
            ),
        ))
        .await,
    );
    refused(
        "a tenant adds an assignment",
        outcome(pods.patch("mine", &pp, &annotations(json!({ ASSIGNMENT: "{}" })))).await,
        422,
        ACCOUNTING,
    );
    refused(
        "a tenant adds a ledger through pods/status",
        outcome(pods.patch_status("mine", &pp, &annotations(json!({ LEDGER: "{}" })))).await,
        422,
        ACCOUNTING,
    );
    for path in [
        format!("/api/v1/namespaces/{NS}/pods/mine/binding"),
        format!("/api/v1/namespaces/{NS}/bindings"),
    ] {
        refused(
            &format!("a tenant's Binding carrying a ledger ({path})"),
            outcome(post(
                &client,
                &path,
                &binding("mine", "n", json!({ LEDGER: "{}" })),
            ))
            .await,
            422,
            ACCOUNTING,
        );
    }

    // The GPU scheduler's Binding carries the assignment (and only its
    // Binding may): refused for another pod's UID, and from kube-scheduler's
    // identity; then the tenant may neither rewrite nor remove it.
    let other = pod(NS, "other", None, json!({}), &[]);
    let other = pods.create(&PostParams::default(), &other).await.unwrap();
    let assigning = |uid: Option<&str>| {
        let mut b = binding("mine", "n", json!({ ASSIGNMENT: "{\"main\":[]}" }));
        if let Some(uid) = uid {
            b["metadata"]["uid"] = uid.into();
        }
        b
    };
    let path = format!("/api/v1/namespaces/{NS}/pods/mine/binding");
    let gpu_scheduler = ControlPlane::client_as(&cp.scheduler).await;
    refused(
        "the GPU scheduler's Binding for another pod's UID",
        outcome(post(
            &gpu_scheduler,
            &path,
            &assigning(other.metadata.uid.as_deref()),
        ))
        .await,
        409,
        "Precondition failed: UID",
    );
    let kube_scheduler = cp.client_impersonating("system:kube-scheduler").await;
    refused(
        "kube-scheduler's Binding carrying an assignment",
        outcome(post(&kube_scheduler, &path, &assigning(None))).await,
        422,
        ACCOUNTING,
    );
    let unbound = pods.get("mine").await.unwrap();
    assert!(unbound.spec.unwrap().node_name.is_none());
    assert!(
        !unbound
            .metadata
            .annotations
            .unwrap()
            .contains_key(ASSIGNMENT)
    );
    allowed(
        "the GPU scheduler binds with the assignment",
        outcome(post(&gpu_scheduler, &path, &assigning(None))).await,
    );
    for (what, change) in [
        ("rewrites", json!({ ASSIGNMENT: "{}" })),
        ("removes", json!({ ASSIGNMENT: null })),
    ] {
        refused(
            &format!("a tenant {what} the assignment"),
            outcome(pods.patch("mine", &pp, &annotations(change))).await,
            422,
            ACCOUNTING,
        );
    }
    let kept = pods.get("mine").await.unwrap();
    assert_eq!(kept.spec.unwrap().node_name.as_deref(), Some("n"));
    assert_eq!(
        kept.metadata.annotations.unwrap()[ASSIGNMENT],
        "{\"main\":[]}"
    );
}

/// The limit of `resource` the API server stored for container `main`.
fn stored(pod: &Pod, resource: &str) -> String {
    let limits = pod.spec.as_ref().unwrap().containers[0]
        .resources
        .as_ref()
        .unwrap()
        .limits
        .as_ref()
        .unwrap();
    limits[&format!("doslab.io/{resource}")].0.clone()
}

/// The quantity rule of deploy/quantitypolicy.yaml: a GPU resource is a
/// whole count of devices below 2^32 without a binary suffix; decimal
/// suffixes pass (the API server stores 8000 as 8k).
#[tokio::test(flavor = "multi_thread")]
async fn gpu_asks_are_counts_of_devices() {
    let cp = ControlPlane::start();
    let client = tenant(&cp).await;
    let pods: Api<Pod> = Api::namespaced(client, NS);
    let create = |name: &str, limits: &[(&str, &str)]| {
        let p = pod(NS, name, None, json!({}), limits);
        let pods = pods.clone();
        async move { outcome(pods.create(&PostParams::default(), &p)).await }
    };
    for (i, (resource, written, stored_as)) in [
        ("gpu-memory", "8", "8"),
        ("gpu-memory", "8000", "8k"),
        ("gpu-memory", "8k", "8k"),
        ("gpu-memory", "1536", "1536"),
        ("gpu-memory", "4294967295", "4294967295"),
        ("gpu-memory", "4e9", "4e9"),
        ("gpu-core", "100", "100"),
        ("gpu-count", "2", "2"),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("ok-{i}");
        allowed(
            &format!("{resource}: {written}"),
            create(&name, &[(resource, written)]).await,
        );
        assert_eq!(stored(&pods.get(&name).await.unwrap(), resource), stored_as);
    }
    for (i, (resource, written, shown)) in [
        ("gpu-memory", "4Gi", "4Gi"),
        ("gpu-memory", "3Gi", "3Gi"),
        ("gpu-memory", "1024Ki", "1Mi"),
        ("gpu-memory", "4294967296", "4294967296"),
        ("gpu-memory", "5G", "5G"),
        ("gpu-core", "1Ki", "1Ki"),
        ("gpu-count", "1e10", "10e9"),
    ]
    .into_iter()
    .enumerate()
    {
        refused(
            &format!("{resource}: {written}"),
            create(&format!("wrong-{i}"), &[(resource, written)]).await,
            422,
            &format!("container main: doslab.io/{resource}: {shown} is no count of devices"),
        );
    }
    // Any container, init containers too; another vendor's resources and
    // the pod's own memory are not the policy's business.
    let mut p = pod(NS, "init", None, json!({}), &[("gpu-memory", "8")]);
    let spec = p.spec.as_mut().unwrap();
    let mut init = spec.containers[0].clone();
    init.name = "setup".into();
    init.resources
        .as_mut()
        .unwrap()
        .limits
        .as_mut()
        .unwrap()
        .insert(
            "doslab.io/gpu-memory".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("2Gi".into()),
        );
    spec.init_containers = Some(vec![init]);
    refused(
        "an init container's gpu-memory: 2Gi",
        outcome(pods.create(&PostParams::default(), &p)).await,
        422,
        "container setup: doslab.io/gpu-memory: 2Gi",
    );
    let mut p = pod(NS, "others", None, json!({}), &[("gpu-memory", "8")]);
    let limits = p.spec.as_mut().unwrap().containers[0]
        .resources
        .as_mut()
        .unwrap()
        .limits
        .as_mut()
        .unwrap();
    for (r, q) in [("example.com/gpu-memory", "4Gi"), ("memory", "4Gi")] {
        limits.insert(
            r.into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity(q.into()),
        );
    }
    allowed(
        "other resources in binary suffixes",
        outcome(pods.create(&PostParams::default(), &p)).await,
    );
}

/// `name`'s PodScheduled condition: (status, reason).
fn scheduled(pod: &Pod) -> Option<(String, String)> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    let c = conditions.iter().find(|c| c.type_ == "PodScheduled")?;
    Some((c.status.clone(), c.reason.clone().unwrap_or_default()))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_gpu_scheduler_writes_the_accounting_only_in_its_bindings() {
    let cp = ControlPlane::start();
    let node = KubeNode::start(
        &cp,
        "node-0",
        &[("GPU-0000-0000-4000-8000-000000000000", 16384)],
        UNIT,
    )
    .await;
    namespace(&cp, NS);
    let admin = cp.admin_client().await;
    let as_admin: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let sched: Api<Pod> = Api::namespaced(ControlPlane::client_as(&cp.scheduler).await, NS);
    let pp = pp();
    let post = PostParams::default();

    // Left to no scheduler: stays unbound.
    let mut waiting = pod(NS, "waiting", None, json!({"keep": "x"}), &[]);
    waiting.spec.as_mut().unwrap().scheduler_name = Some("nobody".into());
    as_admin.create(&post, &waiting).await.unwrap();
    let placed = pod(NS, "placed", Some(&node.name), json!({"keep": "x"}), &[]);
    as_admin.create(&post, &placed).await.unwrap();

    // The extender writes the assignment only in its Binding: its account
    // may not patch a pod at all.
    refused(
        "the GPU scheduler patches an unbound pod",
        outcome(sched.patch("waiting", &pp, &annotations(json!({ ASSIGNMENT: "{}" })))).await,
        403,
        "forbidden",
    );
    // A pod's accounting through its status, bound or not.
    let bound = "the GPU scheduler writes doslab.io/ annotations only in a Binding";
    refused(
        "the scheduler assigns an unbound pod through pods/status",
        outcome(sched.patch_status("waiting", &pp, &annotations(json!({ ASSIGNMENT: "{}" }))))
            .await,
        422,
        bound,
    );
    refused(
        "the scheduler rewrites a bound pod's accounting through pods/status",
        outcome(sched.patch_status("placed", &pp, &annotations(json!({ LEDGER: "{}" })))).await,
        422,
        bound,
    );
    // kube-scheduler's own status write (a condition, as on a victim of a
    // preemption) passes on a bound pod.
    allowed(
        "the scheduler sets a condition on a bound pod",
        outcome(sched.patch_status(
            "placed",
            &pp,
            &Patch::Merge(json!({"status": {"conditions": [{
                "type": "DisruptionTarget", "status": "True",
                "reason": "PreemptionByScheduler", "message": "test"
            }]}})),
        ))
        .await,
    );
    refused(
        "the scheduler's account has no pods/ephemeralcontainers",
        outcome(sched.patch_ephemeral_containers(
            "placed",
            &pp,
            &Patch::Merge(json!({"spec": {"ephemeralContainers": []}})),
        ))
        .await,
        403,
        "forbidden",
    );

    // And the real scheduler still schedules under it: the extender's
    // Binding, and kube-scheduler's Unschedulable condition.
    let sched_proc = Scheduler::start(&cp);
    let gpu = gpu_pod(NS, "gpu", &[("main", [8, 30, 0])]);
    let too_big = gpu_pod(NS, "too-big", &[("main", [64, 0, 0])]);
    create(&admin, &gpu).await;
    create(&admin, &too_big).await;
    let ran = wait_pod(&admin, NS, "gpu", Duration::from_secs(60), |p| {
        phase(p) == "Running"
    })
    .await
    .unwrap_or_else(|p| {
        panic!(
            "gpu never ran: {p:#?}\n--- scheduler\n{}\n--- extender\n{}",
            sched_proc.proc.log_text(),
            sched_proc.extender.log_text()
        )
    });
    assert!(
        ran.metadata.annotations.unwrap().contains_key(ASSIGNMENT),
        "the extender's assignment is missing"
    );
    wait_pod(&admin, NS, "too-big", Duration::from_secs(60), |p| {
        scheduled(p).is_some_and(|(s, r)| s == "False" && r == "Unschedulable")
    })
    .await
    .unwrap_or_else(|p| panic!("too-big has no Unschedulable condition: {p:#?}"));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_daemon_writes_only_its_own_nodes_pods_and_node() {
    let cp = ControlPlane::start();
    let node = KubeNode::start(
        &cp,
        "node-0",
        &[("GPU-0000-0000-4000-8000-000000000000", 16384)],
        UNIT,
    )
    .await;
    namespace(&cp, NS);
    cp.apply("apiVersion: v1\nkind: Node\nmetadata: {name: elsewhere}\n");
    let admin = cp.admin_client().await;
    let as_admin: Api<Pod> = Api::namespaced(admin, NS);
    let post = PostParams::default();
    for (name, at) in [
        ("mine", Some("node-0")),
        ("theirs", Some("elsewhere")),
        ("unbound", None),
    ] {
        let mut p = pod(NS, name, at, json!({"keep": "x"}), &[]);
        p.spec.as_mut().unwrap().scheduler_name = Some("nobody".into());
        as_admin.create(&post, &p).await.unwrap();
    }
    let kubeconfig = cp.token(
        "gpu-device-plugin",
        "gpu-device-plugin",
        Some(&format!("gpu-device-plugin-{}", node.name)),
    );
    let client = ControlPlane::client_as(&kubeconfig).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pp = pp();
    let ledger = || annotations(json!({ LEDGER: "{}", "doslab.io/gpu-assigned": "true" }));

    allowed(
        "the daemon writes its ledger on its node's pod",
        outcome(pods.patch("mine", &pp, &ledger())).await,
    );
    let own_node = "the GPU device plugin may only patch pods bound to its own node";
    refused(
        "the daemon writes a ledger on another node's pod",
        outcome(pods.patch("theirs", &pp, &ledger())).await,
        422,
        own_node,
    );
    refused(
        "the daemon writes a ledger on a pod not yet bound",
        outcome(pods.patch("unbound", &pp, &ledger())).await,
        422,
        own_node,
    );
    refused(
        "the daemon changes a foreign annotation",
        outcome(pods.patch("mine", &pp, &annotations(json!({"keep": "y"})))).await,
        422,
        "the GPU device plugin may only change doslab.io/ annotations",
    );
    refused(
        "the daemon relabels its node's pod",
        outcome(pods.patch(
            "mine",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"app": "b"}}})),
        ))
        .await,
        422,
        "may change nothing of a pod or Node but annotations",
    );
    refused(
        "the daemon has no pods/status",
        outcome(pods.patch_status("mine", &pp, &ledger())).await,
        403,
        "forbidden",
    );
    refused(
        "the daemon creates no pod",
        outcome(pods.create(&post, &pod(NS, "new", None, json!({}), &[]))).await,
        403,
        "forbidden",
    );
    // Reading every pod: RBAC cannot narrow a list by field (README).
    allowed(
        "the daemon lists pods",
        outcome(Api::<Pod>::all(client.clone()).list(&Default::default())).await,
    );

    // Its Node: the inventory it published is there; nothing else.
    let nodes: Api<Node> = Api::all(client.clone());
    let own = nodes.get(&node.name).await.unwrap();
    let inventory = own.metadata.annotations.unwrap_or_default();
    assert!(
        inventory.contains_key("doslab.io/gpu-inventory"),
        "the daemon published no inventory: {inventory:?}\n{}",
        node.daemon.log_text()
    );
    let only_inventory = "may only change the doslab.io/gpu-inventory annotation of its Node";
    refused(
        "the daemon annotates its Node otherwise",
        outcome(nodes.patch(&node.name, &pp, &annotations(json!({"example.com/x": "y"})))).await,
        422,
        only_inventory,
    );
    refused(
        "the daemon cordons its Node",
        outcome(nodes.patch(
            &node.name,
            &pp,
            &Patch::Merge(json!({"spec": {"unschedulable": true}})),
        ))
        .await,
        422,
        "may change nothing of a pod or Node but annotations",
    );
    refused(
        "the daemon publishes another Node's inventory",
        outcome(nodes.patch(
            "elsewhere",
            &pp,
            &annotations(json!({"doslab.io/gpu-inventory": "{}"})),
        ))
        .await,
        422,
        "the GPU device plugin may only patch its own Node",
    );

    // Its Warning about a pod of its node, as itself; nothing else.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), NS);
    let event = |name: &str, kind: &str, instance: &str| {
        serde_json::from_value::<k8s_openapi::api::events::v1::Event>(json!({
            "metadata": {"name": name, "namespace": NS},
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "reportingController": "gpu-device-plugin", "reportingInstance": instance,
            "action": "Allocate", "reason": "GpuAllocateFailed", "note": "test", "type": kind,
            "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": NS, "name": "mine"}
        }))
        .unwrap()
    };
    allowed(
        "the daemon posts its Warning",
        outcome(events.create(&post, &event("w", "Warning", "node-0"))).await,
    );
    let warnings = "may only post Warning Events about pods, reported by itself on its own node";
    for (what, e) in [
        ("a Normal event", event("n", "Normal", "node-0")),
        ("another node's Warning", event("o", "Warning", "elsewhere")),
    ] {
        refused(
            &format!("the daemon posts {what}"),
            outcome(events.create(&post, &e)).await,
            422,
            warnings,
        );
    }
    refused(
        "the daemon reads no Secret",
        outcome(
            Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client, NS)
                .list(&Default::default()),
        )
        .await,
        403,
        "forbidden",
    );
}

/// Applies a kustomize tree of the repository as the admin.
fn apply_tree(cp: &ControlPlane, dir: &std::path::Path) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    cp.peers_ok(&[
        "apply",
        "--kubeconfig",
        cp.admin.to_str().unwrap(),
        "-k",
        dir.to_str().unwrap(),
    ]);
}

/// `call` again until the API server's answer satisfies `done` (the
/// policies just applied are enforced a moment later), then that answer.
async fn once_enforced<F, Fut>(
    mut call: F,
    done: impl Fn(&Result<(), (u16, String)>) -> bool,
) -> Result<(), (u16, String)>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), (u16, String)>>,
{
    let deadline = std::time::Instant::now() + START;
    let mut last = None;
    let hit = support::poll_within(deadline, async || {
        let got = call().await;
        let hit = done(&got).then(|| got.clone());
        last = Some(got);
        hit
    })
    .await;
    hit.unwrap_or_else(|| last.expect("called at least once"))
}

/// A ResourceSlice of `driver` on `node` (None: all nodes), one device.
fn slice(name: &str, driver: &str, node: Option<&str>) -> Value {
    let mut s = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {"driver": driver, "pool": {"name": "p", "generation": 0, "resourceSliceCount": 1},
                 "devices": [{"name": "gpu-0"}]}
    });
    match node {
        Some(n) => s["spec"]["nodeName"] = json!(n),
        None => s["spec"]["allNodes"] = json!(true),
    }
    s
}

/// DRA mode (deploy/ with the Component deploy/dra) as shipped: the daemon's token, bound to its pod
/// on its node, does what src/dra calls (its Node read, its slice applied,
/// listed, deleted, claims read) and nothing of the device-plugin mode's
/// pod, Event and Node writes, nor another node's or driver's slices.
#[tokio::test(flavor = "multi_thread")]
async fn the_dra_daemon_writes_only_its_own_nodes_slices_and_reads_claims() {
    use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
    let cp = ControlPlane::start();
    apply_tree(&cp, &support::dra_overlay());
    namespace(&cp, NS);
    cp.apply(
        "apiVersion: v1\nkind: Node\nmetadata: {name: node-0}\n---\n\
         apiVersion: v1\nkind: Node\nmetadata: {name: elsewhere}\n---\n\
         apiVersion: v1\nkind: Pod\nmetadata: {name: gpu-device-plugin-node-0, namespace: gpu-device-plugin}\n\
         spec: {nodeName: node-0, serviceAccountName: gpu-device-plugin, containers: [{name: c, image: x}]}\n",
    );
    let admin = cp.admin_client().await;
    let as_admin: Api<ResourceSlice> = Api::all(admin.clone());
    let theirs =
        serde_json::from_value(slice("theirs", "gpu.doslab.io", Some("elsewhere"))).unwrap();
    as_admin
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "c", "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.doslab.io"}}]}}
    }))
    .unwrap();
    Api::<ResourceClaim>::namespaced(admin, NS)
        .create(&PostParams::default(), &claim)
        .await
        .unwrap();

    let kubeconfig = cp.token(
        "gpu-device-plugin",
        "gpu-device-plugin",
        Some("gpu-device-plugin-node-0"),
    );
    let client = ControlPlane::client_as(&kubeconfig).await;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let apply = PatchParams::apply("gpu.doslab.io").force();
    let put = |s: Value| {
        let slices = slices.clone();
        let apply = apply.clone();
        let name = s["metadata"]["name"].as_str().unwrap().to_owned();
        async move { outcome(slices.patch(&name, &apply, &Patch::Apply(s))).await }
    };
    let own_node = "the GPU device plugin may only write the ResourceSlices of its own node";
    refused(
        "the daemon applies another node's slice",
        once_enforced(
            || put(slice("node-x", "gpu.doslab.io", Some("elsewhere"))),
            |r| r.is_err(),
        )
        .await,
        422,
        own_node,
    );
    // Server-side apply of a new slice is a create: RBAC's create, then
    // the patch that updates it.
    let mine = slice("node-0-gpu.doslab.io", "gpu.doslab.io", Some("node-0"));
    allowed(
        "the daemon applies its node's slice",
        put(mine.clone()).await,
    );
    let mut next = mine.clone();
    next["spec"]["pool"]["generation"] = json!(1);
    allowed("the daemon re-applies its slice", put(next).await);
    allowed(
        "the daemon reads its slice",
        outcome(slices.get("node-0-gpu.doslab.io")).await,
    );
    allowed(
        "the daemon lists its node's slices of its driver",
        outcome(
            slices.list(
                &kube::api::ListParams::default()
                    .fields("spec.nodeName=node-0,spec.driver=gpu.doslab.io"),
            ),
        )
        .await,
    );
    refused(
        "the daemon applies another driver's slice on its node",
        put(slice("node-0-other", "gpu.example.com", Some("node-0"))).await,
        422,
        "the GPU device plugin may only write the ResourceSlices of its driver gpu.doslab.io",
    );
    refused(
        "the daemon applies a slice of all nodes",
        put(slice("everywhere", "gpu.doslab.io", None)).await,
        422,
        own_node,
    );
    let mut changed = slice("theirs", "gpu.doslab.io", Some("elsewhere"));
    changed["spec"]["devices"][0]["name"] = json!("gpu-1");
    refused(
        "the daemon changes another node's slice",
        put(changed).await,
        422,
        own_node,
    );
    refused(
        "the daemon deletes another node's slice",
        outcome(slices.delete("theirs", &Default::default())).await,
        422,
        own_node,
    );
    allowed(
        "the daemon deletes its own slice",
        outcome(slices.delete("node-0-gpu.doslab.io", &Default::default())).await,
    );

    // Claims: read by name, nothing else.
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    allowed("the daemon reads a claim", outcome(claims.get("c")).await);
    let status = Patch::Merge(json!({"status": {"devices": []}}));
    for (what, got) in [
        (
            "lists claims",
            outcome(claims.list(&Default::default())).await,
        ),
        (
            "writes a claim's status",
            outcome(claims.patch_status("c", &pp(), &status)).await,
        ),
        (
            "deletes a claim",
            outcome(claims.delete("c", &Default::default())).await,
        ),
        (
            "creates a claim",
            outcome(claims.create(&PostParams::default(), &claim)).await,
        ),
    ] {
        refused(&format!("the daemon {what}"), got, 403, "forbidden");
    }

    // Nothing of the device-plugin mode's rights is left.
    let nodes: Api<Node> = Api::all(client.clone());
    allowed(
        "the daemon reads its Node",
        outcome(nodes.get("node-0")).await,
    );
    for (what, got) in [
        (
            "lists pods",
            outcome(Api::<Pod>::all(client.clone()).list(&Default::default())).await,
        ),
        (
            "patches its Node",
            outcome(nodes.patch(
                "node-0",
                &pp(),
                &annotations(json!({"doslab.io/gpu-inventory": "{}"})),
            ))
            .await,
        ),
        (
            "lists Nodes",
            outcome(nodes.list(&Default::default())).await,
        ),
        (
            "creates a DeviceClass",
            outcome(
                Api::<k8s_openapi::api::resource::v1::DeviceClass>::all(client.clone()).create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({"metadata": {"name": "x"}, "spec": {}}))
                        .unwrap(),
                ),
            )
            .await,
        ),
    ] {
        refused(&format!("the daemon {what}"), got, 403, "forbidden");
    }
}

/// The opt-in policy of deploy/dra/claims, on the real API server: a pod
/// written for the device plugin is stored with a claim per asking
/// container from the template its asks name, and no share asks left.
#[tokio::test(flavor = "multi_thread")]
async fn device_plugin_asks_become_claims_from_templates() {
    let cp = ControlPlane::start();
    apply_tree(&cp, &support::dra_overlay());
    apply_tree(&cp, std::path::Path::new("deploy/dra/claims"));
    namespace(&cp, NS);
    let pods: Api<Pod> = Api::namespaced(cp.admin_client().await, NS);
    let spec = |containers: Value| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": NS},
            "spec": {"schedulerName": "nobody", "containers": containers}
        }))
        .unwrap()
    };
    let limits = |l: Value| json!({"limits": l});
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let stored = |p: Pod| {
        let pods = pods.clone();
        let dry = dry.clone();
        async move { serde_json::to_value(pods.create(&dry, &p).await.unwrap()).unwrap() }
    };
    // A share, beside cpu, in limits and requests; a container without
    // asks; one asking memory only.
    let share = spec(json!([
        {"name": "main", "image": "app", "resources": {
            "limits": {"cpu": "1", "doslab.io/gpu-memory": "8", "doslab.io/gpu-core": "30"},
            "requests": {"cpu": "1", "doslab.io/gpu-memory": "8", "doslab.io/gpu-core": "30"}}},
        {"name": "sidecar", "image": "app"},
        {"name": "memory", "image": "app", "resources": limits(json!({"doslab.io/gpu-memory": "4"}))}
    ]));
    let deadline = std::time::Instant::now() + START;
    let got = support::poll_for(
        deadline,
        async || {
            Some(stored(share.clone()).await).filter(|g| !g["spec"]["resourceClaims"].is_null())
        },
        || "the claims policy never applied".into(),
    )
    .await;
    assert_eq!(
        got["spec"]["resourceClaims"],
        json!([
            {"name": "gpu-share-0", "resourceClaimTemplateName": "gpu-memory-8-core-30"},
            {"name": "gpu-share-2", "resourceClaimTemplateName": "gpu-memory-4"}
        ])
    );
    let c = &got["spec"]["containers"];
    assert_eq!(
        c[0]["resources"],
        json!({"limits": {"cpu": "1"}, "requests": {"cpu": "1"}, "claims": [{"name": "gpu-share-0"}]})
    );
    assert!(c[1]["resources"].get("claims").is_none(), "{got}");
    assert_eq!(
        c[2]["resources"]["claims"],
        json!([{"name": "gpu-share-2"}])
    );
    // The emptied limits: kept empty or dropped.
    assert!(
        c[2]["resources"]["limits"]
            .as_object()
            .is_none_or(|l| l.is_empty()),
        "{got}"
    );

    // A pod with claims of its own keeps them, the share's added; a
    // quantity as the API server canonicalises it (8000 is 8k) names the
    // template by its integer.
    let mut own = spec(json!([
        {"name": "main", "image": "app", "resources": {
            "limits": {"doslab.io/gpu-memory": "8000", "doslab.io/gpu-core": "30"},
            "claims": [{"name": "nic"}]}}
    ]));
    own.spec.as_mut().unwrap().resource_claims = Some(vec![
        serde_json::from_value(json!({"name": "nic", "resourceClaimName": "nic"})).unwrap(),
    ]);
    let got = stored(own).await;
    assert_eq!(
        got["spec"]["resourceClaims"],
        json!([
            {"name": "nic", "resourceClaimName": "nic"},
            {"name": "gpu-share-0", "resourceClaimTemplateName": "gpu-memory-8000-core-30"}
        ])
    );
    assert_eq!(
        got["spec"]["containers"][0]["resources"]["claims"],
        json!([{"name": "nic"}, {"name": "gpu-share-0"}])
    );

    // Left as written: whole GPUs by count (the DeviceClass maps them), a
    // count beside a share; and an ask that is no count of devices, which
    // the quantity policy then refuses.
    for asks in [
        json!({"doslab.io/gpu-count": "1"}),
        json!({"doslab.io/gpu-count": "1", "doslab.io/gpu-memory": "8"}),
    ] {
        let got = stored(spec(
            json!([{"name": "main", "image": "app", "resources": limits(asks.clone())}]),
        ))
        .await;
        assert!(got["spec"]["resourceClaims"].is_null(), "{got}");
        assert_eq!(got["spec"]["containers"][0]["resources"]["limits"], asks);
    }
    refused(
        "a pod asking gpu-memory in bytes",
        outcome(pods.create(
            &dry,
            &spec(json!([{"name": "main", "image": "app",
                "resources": limits(json!({"doslab.io/gpu-memory": "8Gi"}))}])),
        ))
        .await,
        422,
        "is no count of devices",
    );
}
