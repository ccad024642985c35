//! The extender's bind against a mocked API server: the exact requests
//! [`KubeBinder`] makes for a bind that works (with the pod in the index's
//! cache, and without: one Binding carrying the assignment), one whose
//! Binding meets a conflict, and one whose Binding fails; none while the
//! index is stale; binds on several nodes at once and on one node in
//! assume-time order, within their GPUs, and the bounds on binds admitted
//! and running, the places filters keep included.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use hyper::Method;
use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};

use super::wire::{ExtenderArgs, ExtenderBindingArgs};
use super::{Extender, ExtenderConfig, Index, KubeBinder};
use crate::net::mock_api::{self, MockApi, Received, Taken, status};

const POD: &str = "/api/v1/namespaces/ns/pods/p";
const BINDING: &str = "/api/v1/namespaces/ns/pods/p/binding?";

/// Node `name` with GPUs of 1024 MiB named `uuids`, as its daemon
/// publishes them.
fn node_of(name: &str, uuids: &[&str]) -> Node {
    let gpus: Vec<Value> = uuids
        .iter()
        .map(|uuid| json!({ "uuid": uuid, "memoryMiB": 1024, "healthy": true }))
        .collect();
    let inventory = json!({
        "version": 1, "memoryUnitMiB": 1, "coresPerGpu": 100,
        "resources": ["gpu-memory", "gpu-core", "gpu-count"],
        "gpus": gpus,
    });
    serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "annotations": { "doslab.io/gpu-inventory": inventory.to_string() },
        },
    }))
    .expect("a valid Node")
}

/// Node `n` with one GPU of 1024 MiB.
fn node() -> Node {
    node_of("n", &["GPU-a"])
}

/// Pod ns/p at `resource_version`, its one container asking 512 MiB;
/// bound to `node` when given.
fn pod(resource_version: &str, node: Option<&str>) -> Value {
    pod_of("p", resource_version, node, 512)
}

/// Pod ns/`name` (UID `uid-<name>`) at `resource_version`, its one
/// container asking `mib`; bound to `node` when given.
fn pod_of(name: &str, resource_version: &str, node: Option<&str>, mib: u64) -> Value {
    let limits = json!({ "doslab.io/gpu-memory": mib.to_string() });
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "namespace": "ns", "name": name, "uid": format!("uid-{name}"),
            "resourceVersion": resource_version,
        },
        "spec": {
            "nodeName": node,
            "containers": [{
                "name": "app", "image": "cuda",
                "resources": { "limits": limits, "requests": limits },
            }],
        },
        "status": { "phase": "Pending" },
    })
}

const ASSUME_TIME: &str = "doslab.io/gpu-assume-time";

/// The annotations a bind of [`pod`] to `n` writes; the assume time (the
/// bind's clock, in nanoseconds) shows as `now`.
fn assignment() -> Value {
    json!({
        "doslab.io/gpu-assigned": "false",
        "doslab.io/gpu-assignment": r#"{"app":["GPU-a"]}"#,
        ASSUME_TIME: "now",
        "doslab.io/gpu-uuid": "GPU-a",
    })
}

/// The Binding of pod p to `n` on the pod's `resource_version`, carrying
/// [`assignment`].
fn binding(resource_version: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {
            "name": "p", "namespace": "ns", "uid": "uid-p",
            "resourceVersion": resource_version, "annotations": assignment(),
        },
        "target": { "apiVersion": "v1", "kind": "Node", "name": "n" },
    })
}

/// `body` with its assume time (checked to be the bind's clock) shown as
/// `now`.
fn assumed_now(mut body: Value) -> Value {
    let assumed = &mut body["metadata"]["annotations"][ASSUME_TIME];
    let nanos: u128 = assumed
        .as_str()
        .expect("an assume time")
        .parse()
        .expect("nanoseconds");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let ago = now.unwrap().as_nanos().checked_sub(nanos);
    assert!(ago.is_some_and(|ns| ns < 60_000_000_000), "{nanos}");
    *assumed = "now".into();
    body
}

/// Expects pod p's Binding to `n` with its assignment on the pod's
/// `resource_version`, answered `code` with `answer`.
async fn expect_binding(api: &mut MockApi, resource_version: &str, code: u16, answer: Value) {
    let post = api.expect(Method::POST, BINDING, code, answer).await;
    assert_eq!(assumed_now(post.body), binding(resource_version));
}

/// An extender whose index has listed node `n` and no pods, and the API
/// server it binds on.
fn extender() -> (Extender<KubeBinder>, MockApi) {
    extender_with(&ExtenderConfig::default(), vec![node()], Vec::new())
}

/// An extender on `config` whose index has listed `nodes` and `pods`.
fn extender_with(
    config: &ExtenderConfig,
    nodes: Vec<Node>,
    pods: Vec<Value>,
) -> (Extender<KubeBinder>, MockApi) {
    let mut index = Index::new("doslab.io");
    index.replace_nodes(nodes);
    let pods = pods
        .into_iter()
        .map(|p| serde_json::from_value(p).expect("a valid Pod"));
    index.replace_pods(pods.collect());
    let (client, api) = mock_api::client();
    let x = Extender::new(
        config,
        Arc::new(RwLock::new(index)),
        KubeBinder::new(client),
    );
    (x, api)
}

fn args() -> ExtenderBindingArgs {
    args_of("p", "n")
}

/// The scheduler's bind of pod ns/`name` to `node`.
fn args_of(name: &str, node: &str) -> ExtenderBindingArgs {
    ExtenderBindingArgs {
        pod_name: name.into(),
        pod_namespace: "ns".into(),
        pod_uid: format!("uid-{name}"),
        node: node.into(),
    }
}

#[tokio::test]
async fn a_bind_reads_the_pod_then_binds_it_with_its_assignment_on_that_version() {
    let (x, mut api) = extender();
    let scenario = tokio::spawn(async move {
        api.expect(Method::GET, POD, 200, pod("5", None)).await;
        expect_binding(&mut api, "5", 201, json!({})).await;
        api.done().await;
    });
    x.bind(&args()).await.unwrap();
    drop(x);
    scenario.await.unwrap();
}

#[tokio::test]
async fn a_conflict_on_the_binding_reads_the_pod_again_and_binds_its_new_version() {
    let (x, mut api) = extender();
    let scenario = tokio::spawn(async move {
        api.expect(Method::GET, POD, 200, pod("5", None)).await;
        expect_binding(&mut api, "5", 409, status(409, "Conflict")).await;
        api.expect(Method::GET, POD, 200, pod("7", None)).await;
        expect_binding(&mut api, "7", 201, json!({})).await;
        api.done().await;
    });
    x.bind(&args()).await.unwrap();
    drop(x);
    scenario.await.unwrap();
}

/// A failed Binding changed nothing: the pod is read to find out whether
/// it landed after all, and nothing is written back.
#[tokio::test]
async fn a_failing_binding_leaves_nothing_to_undo() {
    let (x, mut api) = extender();
    let scenario = tokio::spawn(async move {
        api.expect(Method::GET, POD, 200, pod("5", None)).await;
        let failure = status(500, "InternalError");
        expect_binding(&mut api, "5", 500, failure).await;
        api.expect(Method::GET, POD, 200, pod("5", None)).await;
        api.done().await;
    });
    let e = x.bind(&args()).await.unwrap_err();
    assert!(e.to_string().contains("creating the Binding failed"), "{e}");
    drop(x);
    scenario.await.unwrap();
}

#[tokio::test]
async fn a_binding_that_landed_although_it_failed_counts_as_bound() {
    let (x, mut api) = extender();
    let scenario = tokio::spawn(async move {
        api.expect(Method::GET, POD, 200, pod("5", None)).await;
        let failure = status(500, "InternalError");
        expect_binding(&mut api, "5", 500, failure).await;
        api.expect(Method::GET, POD, 200, pod("6", Some("n"))).await;
        api.done().await;
    });
    x.bind(&args()).await.unwrap();
    drop(x);
    scenario.await.unwrap();
}

/// From a failed watch until the list after it, a pod bound meanwhile may
/// hold GPUs the index counts free: the bind is refused before any request,
/// and taken again once the kind is listed.
#[tokio::test]
async fn a_bind_on_a_stale_index_is_refused_without_a_request() {
    let (x, mut api) = extender();
    x.index
        .write()
        .unwrap()
        .unsync_pods("watch stream failed".into());
    assert_eq!(x.stale(), ["pods: watch stream failed"]);
    let e = x.bind(&args()).await.unwrap_err();
    assert!(
        e.to_string().contains("not synced with the API server"),
        "{e}"
    );

    x.index.write().unwrap().replace_pods(Vec::new());
    assert!(x.stale().is_empty());
    let scenario = tokio::spawn(async move {
        api.expect(Method::GET, POD, 200, pod("5", None)).await;
        expect_binding(&mut api, "5", 201, json!({})).await;
        api.done().await;
    });
    x.bind(&args()).await.unwrap();
    drop(x);
    scenario.await.unwrap();
}

/// The pod as the reflector showed it is bound at once: the Binding's
/// precondition is that version, and no GET comes first. One request.
#[tokio::test]
async fn a_bind_of_a_pod_the_index_holds_is_one_request() {
    let config = ExtenderConfig::default();
    let (x, mut api) = extender_with(&config, vec![node()], vec![pod("5", None)]);
    let scenario = tokio::spawn(async move {
        expect_binding(&mut api, "5", 201, json!({})).await;
        api.done().await;
    });
    x.bind(&args()).await.unwrap();
    drop(x);
    scenario.await.unwrap();
}

/// A cache behind the API server costs one failed precondition, then the
/// pod is read and bound on its new version.
#[tokio::test]
async fn a_cached_pod_that_moved_on_is_read_and_bound_again() {
    let config = ExtenderConfig::default();
    let (x, mut api) = extender_with(&config, vec![node()], vec![pod("5", None)]);
    let scenario = tokio::spawn(async move {
        expect_binding(&mut api, "5", 409, status(409, "Conflict")).await;
        api.expect(Method::GET, POD, 200, pod("9", None)).await;
        expect_binding(&mut api, "9", 201, json!({})).await;
        api.done().await;
    });
    x.bind(&args()).await.unwrap();
    drop(x);
    scenario.await.unwrap();
}

/// The GPU UUIDs a Binding assigns its pod.
fn bound_gpus(binding: &Received) -> Vec<String> {
    let text = binding.body["metadata"]["annotations"]["doslab.io/gpu-assignment"]
        .as_str()
        .expect("an assignment");
    let by_container: std::collections::BTreeMap<String, Vec<String>> =
        serde_json::from_str(text).expect("assignment JSON");
    by_container.into_values().flatten().collect()
}

/// A request taken is a Binding; its pod.
fn binding_of(t: &Taken) -> String {
    assert_eq!(t.method, Method::POST, "{}", t.uri);
    assert!(t.uri.contains("/binding?"), "{}", t.uri);
    pod_in(&t.uri)
}

/// The pod a request is about: `…/pods/<name>?…` or `…/pods/<name>/binding?…`.
fn pod_in(uri: &str) -> String {
    let rest = uri.split("/pods/").nth(1).expect("a pod's URI");
    rest.split(['/', '?']).next().unwrap_or_default().to_owned()
}

/// Binds on two nodes: both Bindings reach the API server before either
/// is answered, so neither bind waits for the other.
#[tokio::test]
async fn binds_on_different_nodes_run_at_once() {
    let nodes = vec![node_of("n", &["GPU-a"]), node_of("m", &["GPU-b"])];
    let pods = vec![pod_of("p", "5", None, 512), pod_of("q", "5", None, 512)];
    let (x, mut api) = extender_with(&ExtenderConfig::default(), nodes, pods);
    let api_side = async move {
        let first = api.take("a Binding").await;
        let second = api
            .take("the other bind's Binding, the first unanswered")
            .await;
        let mut bound = Vec::new();
        for t in [first, second] {
            let name = binding_of(&t);
            bound.push((name, bound_gpus(&t.answer(201, &json!({})))));
        }
        bound.sort();
        assert_eq!(
            bound,
            [
                ("p".into(), vec!["GPU-a".into()]),
                ("q".into(), vec!["GPU-b".into()])
            ]
        );
        api.done().await;
    };
    let (p, q) = (args_of("p", "n"), args_of("q", "m"));
    let (p, q, ()) = tokio::join!(x.bind(&p), x.bind(&q), api_side);
    p.unwrap();
    q.unwrap();
}

/// Binds on one node plan at once, each around the other's GPUs, and send
/// their Bindings in the order of their assume times, the second only once
/// the first is answered: the node's matcher serves the kubelet in
/// assume-time order, and the kubelet admits pods in the order they were
/// bound there.
#[tokio::test]
async fn binds_on_one_node_plan_at_once_and_bind_in_assume_time_order() {
    let pods = ["p", "q"].map(|n| pod_of(n, "5", None, 768));
    let nodes = vec![node_of("n", &["GPU-a", "GPU-b"])];
    let (x, mut api) = extender_with(&ExtenderConfig::default(), nodes, pods.into());
    let api_side = async {
        let first = api.take("the first Binding").await;
        let beside = api.take_within(Duration::from_millis(300)).await;
        assert!(
            beside.is_none(),
            "a Binding went before the first was answered"
        );
        let mut sent = Vec::new();
        let first_pod = binding_of(&first);
        sent.push((first_pod, first.answer(201, &json!({}))));
        let second = api.take("the second Binding").await;
        let second_pod = binding_of(&second);
        sent.push((second_pod, second.answer(201, &json!({}))));
        let assumed: Vec<u128> = sent
            .iter()
            .map(|(_, b)| {
                let at = b.body["metadata"]["annotations"][ASSUME_TIME].as_str();
                at.expect("an assume time").parse().expect("nanoseconds")
            })
            .collect();
        assert!(assumed[0] < assumed[1], "{assumed:?}");
        let mut gpus: Vec<String> = sent.iter().flat_map(|(_, b)| bound_gpus(b)).collect();
        gpus.sort();
        assert_eq!(gpus, ["GPU-a", "GPU-b"], "768 MiB twice fits no one GPU");
        let mut names: Vec<&str> = sent.iter().map(|(n, _)| n.as_str()).collect();
        names.sort();
        assert_eq!(names, ["p", "q"]);
    };
    let (p, q) = (args_of("p", "n"), args_of("q", "n"));
    let (p, q, ()) = tokio::join!(x.bind(&p), x.bind(&q), api_side);
    p.unwrap();
    q.unwrap();
    api.done().await;
    assert!(x.in_flight.idle(), "idle entries go");
}

/// A GPU pod's filter for `name` (asking `mib`) on node `n`.
fn filter_args(name: &str, mib: u64) -> ExtenderArgs {
    filter_on(name, mib, &["n"])
}

/// A GPU pod's filter for `name` (asking `mib`) on `nodes`.
fn filter_on(name: &str, mib: u64, nodes: &[&str]) -> ExtenderArgs {
    ExtenderArgs {
        pod: Some(serde_json::from_value(pod_of(name, "5", None, mib)).expect("a valid Pod")),
        nodes: None,
        node_names: Some(nodes.iter().map(|n| n.to_string()).collect()),
    }
}

/// With `choose_at_filter` (the default) the filter passes only the node
/// binpack ranks best (the one with a pod on it), so the scheduler binds
/// there without scores; without it, every node the pod fits.
#[tokio::test]
async fn choosing_at_the_filter_passes_the_best_node_alone() {
    let nodes = || vec![node(), node_of("m", &["GPU-b"])];
    let held = || vec![pod_of("q", "5", Some("m"), 512)];
    let every = ExtenderConfig::from_toml("[extender]\nchoose_at_filter = false\n").unwrap();
    let (x, _api) = extender_with(&every, nodes(), held());
    let all = x.filter(&filter_on("p", 256, &["n", "m"])).await.unwrap();
    assert_eq!(
        all.node_names,
        Some(vec!["n".into(), "m".into()]),
        "{all:?}"
    );
    let (x, _api) = extender_with(&ExtenderConfig::default(), nodes(), held());
    let best = x.filter(&filter_on("p", 256, &["n", "m"])).await.unwrap();
    assert_eq!(best.node_names, Some(vec!["m".into()]), "{best:?}");
    let none = x
        .filter(&filter_on("big", 2048, &["n", "m"]))
        .await
        .unwrap();
    assert_eq!(none.node_names, Some(vec![]), "{none:?}");
    let failed = none.failed_nodes.len() + none.failed_and_unresolvable_nodes.len();
    assert_eq!(failed, 2, "each with its reason: {none:?}");
}

/// With one place for a bind: a passing filter keeps it for its pod, so
/// another pod's bind is refused at once and another filter waits, until
/// the first pod's bind (admitted to its kept place) ends; a filter that
/// passes no node keeps nothing; without a wait a full extender answers
/// the filter an error at once.
#[tokio::test]
async fn filters_keep_places_for_their_binds_and_wait_for_one() {
    let one = "[extender]\nmax_binds_queued = 1\nfilter_wait_ms = 5000\n";
    let config = ExtenderConfig::from_toml(one).unwrap();
    let pods = ["p", "q"].map(|n| pod_of(n, "5", None, 256));
    let (x, mut api) = extender_with(&config, vec![node()], pods.into());
    let none = x.filter(&filter_args("big", 2048)).await.unwrap();
    assert_eq!(none.node_names, Some(vec![]), "{none:?}");
    let passed = x.filter(&filter_args("p", 256)).await.unwrap();
    assert_eq!(passed.node_names, Some(vec!["n".into()]), "{passed:?}");
    let e = x.bind(&args_of("q", "n")).await.unwrap_err();
    assert!(e.to_string().contains("extender.max_binds_queued"), "{e}");
    let q_args = filter_args("q", 256);
    let q_filter = x.filter(&q_args);
    tokio::pin!(q_filter);
    let early = tokio::time::timeout(Duration::from_millis(300), &mut q_filter).await;
    assert!(early.is_err(), "q's filter waits: {early:?}");
    let api_side = async {
        api.take("p's Binding").await.answer(201, &json!({}));
    };
    let p = args_of("p", "n");
    let (p, ()) = tokio::join!(x.bind(&p), api_side);
    p.unwrap();
    let q = tokio::time::timeout(Duration::from_secs(2), q_filter)
        .await
        .expect("q's filter passes once p's bind ended")
        .unwrap();
    assert_eq!(q.node_names, Some(vec!["n".into()]), "{q:?}");

    let at_once = one.replace("5000", "0");
    let config = ExtenderConfig::from_toml(&at_once).unwrap();
    let (x, _api) = extender_with(&config, vec![node()], Vec::new());
    assert!(x.filter(&filter_args("p", 256)).await.is_ok());
    let full = tokio::time::timeout(Duration::from_millis(500), x.filter(&filter_args("q", 256)))
        .await
        .expect("answered at once")
        .unwrap_err();
    assert!(
        full.to_string().contains("extender.max_binds_queued"),
        "{full:?}"
    );
}

/// Ten binds at once on one node of two 1024 MiB GPUs, 400 MiB each, the
/// API server answering whatever has come in batches: four bind, two per
/// GPU, and the six refused sent nothing.
#[tokio::test]
async fn a_concurrent_burst_never_puts_a_gpu_over_its_capacity() {
    let names: Vec<String> = (0..10).map(|i| format!("p{i}")).collect();
    let pods = names.iter().map(|n| pod_of(n, "5", None, 400)).collect();
    let nodes = vec![node_of("n", &["GPU-a", "GPU-b"])];
    let (x, mut api) = extender_with(&ExtenderConfig::default(), nodes, pods);
    let api_side = async move {
        let mut per_gpu: std::collections::BTreeMap<String, u64> = Default::default();
        let mut sent = Vec::new();
        while let Some(first) = api.take_within(Duration::from_secs(1)).await {
            let mut batch = vec![first];
            while let Some(t) = api.take_within(Duration::from_millis(50)).await {
                batch.push(t);
            }
            for t in batch {
                let name = binding_of(&t);
                for gpu in bound_gpus(&t.answer(201, &json!({}))) {
                    *per_gpu.entry(gpu).or_default() += 400;
                }
                sent.push(name);
            }
        }
        (per_gpu, sent)
    };
    let all: Vec<_> = names.iter().map(|n| args_of(n, "n")).collect();
    let binds = futures::future::join_all(all.iter().map(|a| x.bind(a)));
    let (results, (per_gpu, mut sent)) = tokio::join!(binds, api_side);
    let mut bound: Vec<String> = names
        .iter()
        .zip(&results)
        .filter(|(_, r)| r.is_ok())
        .map(|(n, _)| n.clone())
        .collect();
    assert_eq!(
        per_gpu,
        [("GPU-a".into(), 800), ("GPU-b".into(), 800)].into(),
        "{results:?}"
    );
    bound.sort();
    sent.sort();
    assert_eq!(bound, sent, "only the binds that sent a Binding are bound");
}

/// `max_binds_queued` binds are admitted; one more, and a second bind of a
/// pod in flight, are refused at once without a request; a place freed is
/// taken again.
#[tokio::test]
async fn binds_past_the_bound_are_refused_at_once() {
    let config = ExtenderConfig::from_toml("[extender]\nmax_binds_queued = 2\n").unwrap();
    let pods = ["p", "q", "r"].map(|n| pod_of(n, "5", None, 256));
    let nodes = vec![node(), node_of("m", &["GPU-b"])];
    let (x, mut api) = extender_with(&config, nodes, pods.into());
    let api_side = async {
        let held = [
            api.take("a Binding").await,
            api.take("a second Binding").await,
        ];
        let at_once = Duration::from_millis(500);
        let (r, p) = (args_of("r", "n"), args_of("p", "n"));
        let e = tokio::time::timeout(at_once, x.bind(&r))
            .await
            .expect("refused at once")
            .unwrap_err();
        assert!(e.to_string().contains("extender.max_binds_queued"), "{e}");
        let e = tokio::time::timeout(at_once, x.bind(&p))
            .await
            .expect("refused at once")
            .unwrap_err();
        assert!(e.to_string().contains("another bind of this pod"), "{e}");
        for t in held {
            binding_of(&t);
            t.answer(201, &json!({}));
        }
    };
    let (p, q) = (args_of("p", "n"), args_of("q", "m"));
    let (p, q, ()) = tokio::join!(x.bind(&p), x.bind(&q), api_side);
    p.unwrap();
    q.unwrap();
    let scenario = tokio::spawn(async move {
        let t = api.take("r's Binding").await;
        assert_eq!(binding_of(&t), "r");
        t.answer(201, &json!({}));
        api.done().await;
    });
    x.bind(&args_of("r", "n")).await.unwrap();
    drop(x);
    scenario.await.unwrap();
}

/// Past `max_binds_in_flight` an admitted bind waits for a running one to
/// end, on any node: one request at a time with one running.
#[tokio::test]
async fn binds_past_those_running_wait_their_turn() {
    let config = ExtenderConfig::from_toml("[extender]\nmax_binds_in_flight = 1\n").unwrap();
    let pods = ["p", "q"].map(|n| pod_of(n, "5", None, 256));
    let nodes = vec![node(), node_of("m", &["GPU-b"])];
    let (x, mut api) = extender_with(&config, nodes, pods.into());
    let api_side = async {
        let mut order = Vec::new();
        for _ in 0..2 {
            let binding = api.take("a Binding").await;
            let name = binding_of(&binding);
            let nothing = api.take_within(Duration::from_millis(300)).await;
            assert!(nothing.is_none(), "a second bind ran beside {name}");
            binding.answer(201, &json!({}));
            order.push(name);
        }
        order.sort();
        assert_eq!(order, ["p", "q"]);
    };
    let (p, q) = (args_of("p", "n"), args_of("q", "m"));
    let (p, q, ()) = tokio::join!(x.bind(&p), x.bind(&q), api_side);
    p.unwrap();
    q.unwrap();
    api.done().await;
}
