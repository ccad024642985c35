//! The scheduler extender over real HTTP, fed the JSON kube-scheduler
//! (v1.32) sends: the Go types of k8s.io/kube-scheduler/extender/v1 have no
//! json tags, so keys are Go field names, and a node-cache-capable
//! scheduler sends `"Nodes": null` with `NodeNames`. The cluster behind it
//! is the in-memory one, with injected faults.

mod support;

use std::sync::Arc;

use gpu_device_plugin::extender::{BindError, Binder, Extender, ExtenderConfig, KubeBinder, start};
use gpu_device_plugin::net::kube_client::from_kubeconfig;
use gpu_sim::apiserver::PodContainer;
use gpu_sim::memory::{MemoryCluster, gpu_node, gpu_pod, node_with};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn c(name: &str, memory: u64, core: u64, count: u64) -> PodContainer {
    PodContainer {
        name: name.into(),
        init: false,
        restartable: false,
        wants: [memory, core, count],
    }
}

/// The pod as kube-scheduler serialises it: no apiVersion, no kind.
fn wire_pod(pod: &Pod) -> Value {
    let mut v = serde_json::to_value(pod).unwrap();
    let obj = v.as_object_mut().unwrap();
    obj.remove("apiVersion");
    obj.remove("kind");
    v
}

struct Setup {
    cluster: MemoryCluster,
    addr: std::net::SocketAddr,
}

/// n1: two 40 GiB GPUs; n2: one 24 GiB GPU; bare: no inventory.
async fn setup(policy: &str) -> Setup {
    setup_with(policy, "").await
}

/// [`setup`] with more `[extender]` keys.
async fn setup_with(policy: &str, keys: &str) -> Setup {
    let cluster = MemoryCluster::new();
    cluster.add_node(gpu_node("n1", &[("GPU-a", 40960), ("GPU-b", 40960)]));
    cluster.add_node(gpu_node("n2", &[("GPU-c", 24576)]));
    cluster.add_node(node_with("bare", None));
    let toml = format!("[extender]\nlisten = \"127.0.0.1:0\"\npolicy = \"{policy}\"\n{keys}");
    let config = ExtenderConfig::from_toml(&toml).unwrap();
    let x = Arc::new(Extender::new(&config, cluster.index(), cluster.clone()));
    let addr = start(&config, x).await.unwrap();
    Setup { cluster, addr }
}

/// POSTs `body` as kube-scheduler does; returns (status, body).
async fn post(addr: std::net::SocketAddr, verb: &str, body: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /{verb} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).await.unwrap();
    let code = text[9..12].parse().unwrap();
    let body = text.split_once("\r\n\r\n").unwrap().1.to_owned();
    (code, body)
}

async fn post_json(addr: std::net::SocketAddr, verb: &str, body: &Value) -> Value {
    let (code, text) = post(addr, verb, &body.to_string()).await;
    assert_eq!(code, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    k.sort();
    k
}

fn bind_args(pod: &str, node: &str) -> Value {
    json!({"PodName": pod, "PodNamespace": "ns", "PodUID": format!("uid-ns-{pod}"), "Node": node})
}

fn annotations(cluster: &MemoryCluster, pod: &str) -> serde_json::Map<String, Value> {
    let p = cluster.pod(&("ns".into(), pod.into())).unwrap();
    let v = serde_json::to_value(p.metadata.annotations.unwrap_or_default()).unwrap();
    v.as_object().unwrap().clone()
}

#[tokio::test]
async fn filter_answers_node_names_key_by_key_with_reasons() {
    let s = setup("binpack").await;
    let pod = gpu_pod("ns", "p", &[c("app", 30720, 0, 0)]);
    let args =
        json!({"Pod": wire_pod(&pod), "Nodes": null, "NodeNames": ["n1", "n2", "bare", "gone"]});
    let r = post_json(s.addr, "filter", &args).await;
    assert_eq!(
        keys(&r),
        [
            "Error",
            "FailedAndUnresolvableNodes",
            "FailedNodes",
            "NodeNames",
            "Nodes"
        ]
    );
    assert_eq!(r["Error"], "");
    assert_eq!(r["Nodes"], Value::Null);
    assert_eq!(r["NodeNames"], json!(["n1"]));
    let never = &r["FailedAndUnresolvableNodes"];
    assert_eq!(
        never["n2"],
        "container app: no GPU has 30720 MiB free (largest 24576 MiB on GPU-c)"
    );
    assert!(
        never["bare"]
            .as_str()
            .unwrap()
            .contains("doslab.io/gpu-inventory")
    );
    assert!(r["FailedNodes"]["gone"].as_str().unwrap().contains("cache"));

    // Fill GPU-a and GPU-b to 20 GiB each: n1 fails now, but may later.
    for (name, gpu) in [("h1", "GPU-a"), ("h2", "GPU-b")] {
        let mut h = gpu_pod("ns", name, &[c("app", 20480, 0, 0)]);
        h.spec.as_mut().unwrap().node_name = Some("n1".into());
        let a = json!({"app": [gpu]}).to_string();
        h.metadata.annotations = Some([("doslab.io/gpu-assignment".to_owned(), a)].into());
        s.cluster.put_pod(h);
    }
    let r = post_json(s.addr, "filter", &args).await;
    assert_eq!(r["NodeNames"], json!([]));
    let reason = r["FailedNodes"]["n1"].as_str().unwrap();
    assert!(
        reason.starts_with("container app: no GPU has 30720 MiB free (largest 20480 MiB on GPU-"),
        "{reason}"
    );
    // A finished pod frees its share at once.
    let mut done = s.cluster.pod(&("ns".into(), "h1".into())).unwrap();
    done.status.as_mut().unwrap().phase = Some("Succeeded".into());
    s.cluster.put_pod(done);
    let r = post_json(s.addr, "filter", &args).await;
    assert_eq!(r["NodeNames"], json!(["n1"]));
}

#[tokio::test]
async fn filter_with_node_objects_returns_the_passing_objects() {
    let s = setup("binpack").await;
    let pod = gpu_pod("ns", "p", &[c("app", 30720, 0, 0)]);
    let node = |name: &str| json!({"metadata": {"name": name, "labels": {"zone": "z"}}});
    let args = json!({"Pod": wire_pod(&pod), "Nodes": {"metadata": {}, "items": [node("n1"), node("n2")]}, "NodeNames": null});
    let r = post_json(s.addr, "filter", &args).await;
    assert_eq!(r["Nodes"]["items"], json!([node("n1")]));
    assert_eq!(r["NodeNames"], Value::Null);
    assert!(r["FailedAndUnresolvableNodes"]["n2"].is_string());
}

#[tokio::test]
async fn pods_without_gpu_asks_pass_everywhere_and_score_nothing() {
    let s = setup("binpack").await;
    let pod = gpu_pod("ns", "cpu", &[c("app", 0, 0, 0)]);
    let args = json!({"Pod": wire_pod(&pod), "Nodes": null, "NodeNames": ["n1", "bare", "gone"]});
    let r = post_json(s.addr, "filter", &args).await;
    assert_eq!(r["NodeNames"], json!(["n1", "bare", "gone"]));
    assert_eq!(r["FailedNodes"], json!({}));
    let r = post_json(s.addr, "prioritize", &args).await;
    assert_eq!(
        r,
        json!([{"Host": "n1", "Score": 0}, {"Host": "bare", "Score": 0}, {"Host": "gone", "Score": 0}])
    );
}

#[tokio::test]
async fn prioritize_binpacks_by_default_and_spreads_when_asked() {
    for (policy, busier_wins) in [("binpack", true), ("spread", false)] {
        let s = setup(policy).await;
        s.cluster.add_node(gpu_node("n3", &[("GPU-d", 40960)]));
        let mut h = gpu_pod("ns", "h", &[c("app", 20480, 0, 0)]);
        h.spec.as_mut().unwrap().node_name = Some("n3".into());
        let a = json!({"app": ["GPU-d"]}).to_string();
        h.metadata.annotations = Some([("doslab.io/gpu-assignment".to_owned(), a)].into());
        s.cluster.put_pod(h);
        s.cluster.add_node(gpu_node("n4", &[("GPU-e", 40960)]));
        let pod = gpu_pod("ns", "p", &[c("app", 10240, 0, 0)]);
        let args = json!({"Pod": wire_pod(&pod), "Nodes": null, "NodeNames": ["n3", "n4", "n2"]});
        let r = post_json(s.addr, "prioritize", &args).await;
        let list = r.as_array().unwrap();
        assert_eq!(keys(&list[0]), ["Host", "Score"]);
        let score = |i: usize| list[i]["Score"].as_i64().unwrap();
        assert!(
            list.iter()
                .all(|h| (0..=10).contains(&h["Score"].as_i64().unwrap()))
        );
        assert_eq!(score(0) > score(1), busier_wins, "{policy}: {r}");
        assert_eq!(list[2]["Host"], "n2");
    }
}

#[tokio::test]
async fn bind_records_the_assignment_then_binds_and_retries_are_idempotent() {
    let s = setup("binpack").await;
    s.cluster
        .put_pod(gpu_pod("ns", "p", &[c("app", 30720, 50, 0)]));
    let r = post_json(s.addr, "bind", &bind_args("p", "n1")).await;
    assert_eq!(r, json!({"Error": ""}));
    let a = annotations(&s.cluster, "p");
    assert_eq!(a["doslab.io/gpu-assignment"], r#"{"app":["GPU-a"]}"#);
    assert_eq!(a["doslab.io/gpu-uuid"], "GPU-a");
    assert_eq!(a["doslab.io/gpu-assigned"], "false");
    let t: u128 = a["doslab.io/gpu-assume-time"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(t > 1_600_000_000_000_000_000, "UnixNano: {t}");
    let p = s.cluster.pod(&("ns".into(), "p".into())).unwrap();
    assert_eq!(p.spec.unwrap().node_name.as_deref(), Some("n1"));

    // The same bind again: OK, nothing new; to another node: a clear no.
    let r = post_json(s.addr, "bind", &bind_args("p", "n1")).await;
    assert_eq!(r["Error"], "");
    assert_eq!(s.cluster.bindings(), 1);
    let r = post_json(s.addr, "bind", &bind_args("p", "n2")).await;
    let e = r["Error"].as_str().unwrap();
    assert!(
        e.contains("ns/p") && e.contains("already bound to node n1"),
        "{e}"
    );

    // Unknown pods and nodes.
    let r = post_json(s.addr, "bind", &bind_args("ghost", "n1")).await;
    assert!(
        r["Error"].as_str().unwrap().contains("does not exist"),
        "{r}"
    );
    s.cluster
        .put_pod(gpu_pod("ns", "q", &[c("app", 1024, 0, 0)]));
    let r = post_json(s.addr, "bind", &bind_args("q", "nowhere")).await;
    assert!(r["Error"].as_str().unwrap().contains("cache"), "{r}");
    assert!(!annotations(&s.cluster, "q").contains_key("doslab.io/gpu-assignment"));
}

/// The API server stores 30000 as `30k` and kube-scheduler sends that: it
/// is 30000 MiB, not "no ask" (which passed every node and bound with no
/// assignment).
#[tokio::test]
async fn round_thousands_in_canonical_form_are_filtered_and_bound_by_amount() {
    let s = setup("binpack").await;
    let pod = gpu_pod("ns", "p", &[c("app", 30000, 0, 0)]);
    let limits = &pod.spec.as_ref().unwrap().containers[0].resources;
    let limit = &limits.as_ref().unwrap().limits.as_ref().unwrap()["doslab.io/gpu-memory"];
    assert_eq!(limit.0, "30k");
    let args = json!({"Pod": wire_pod(&pod), "NodeNames": ["n1", "n2"]});
    let r = post_json(s.addr, "filter", &args).await;
    assert_eq!(r["NodeNames"], json!(["n1"]), "{r}");
    assert_eq!(
        r["FailedAndUnresolvableNodes"]["n2"],
        "container app: no GPU has 30000 MiB free (largest 24576 MiB on GPU-c)"
    );
    s.cluster.put_pod(pod);
    let r = post_json(s.addr, "bind", &bind_args("p", "n1")).await;
    assert_eq!(r, json!({"Error": ""}));
    let a = annotations(&s.cluster, "p");
    assert_eq!(a["doslab.io/gpu-assignment"], r#"{"app":["GPU-a"]}"#);
    // A second 30k pod no longer fits beside it on GPU-a: it goes to GPU-b.
    s.cluster
        .put_pod(gpu_pod("ns", "q", &[c("app", 30000, 0, 0)]));
    let r = post_json(s.addr, "bind", &bind_args("q", "n1")).await;
    assert_eq!(r, json!({"Error": ""}));
    let a = annotations(&s.cluster, "q");
    assert_eq!(a["doslab.io/gpu-assignment"], r#"{"app":["GPU-b"]}"#);
}

/// A limit that is not a whole number of devices is refused on every node
/// with the reason, never read as no ask.
#[tokio::test]
async fn an_unreadable_limit_is_refused_with_the_reason() {
    let s = setup("binpack").await;
    for (bad, why) in [
        ("1.5", "is not a whole number"),
        ("-8k", "is negative"),
        ("8 k", "unknown suffix"),
        ("1e30", "is larger than"),
    ] {
        let mut pod = gpu_pod("ns", "p", &[c("app", 0, 10, 0)]);
        let container = &mut pod.spec.as_mut().unwrap().containers[0];
        let limits = container
            .resources
            .as_mut()
            .unwrap()
            .limits
            .as_mut()
            .unwrap();
        limits.insert(
            "doslab.io/gpu-memory".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity(bad.into()),
        );
        let args = json!({"Pod": wire_pod(&pod), "NodeNames": ["n1", "n2", "bare"]});
        let r = post_json(s.addr, "filter", &args).await;
        assert_eq!(r["NodeNames"], json!([]), "{r}");
        for node in ["n1", "n2", "bare"] {
            let reason = r["FailedAndUnresolvableNodes"][node].as_str().unwrap();
            assert!(
                reason.starts_with("container app: limit doslab.io/gpu-memory quantity")
                    && reason.contains(&format!("{bad:?}"))
                    && reason.contains(why),
                "{bad}: {reason}"
            );
        }
        s.cluster.put_pod(pod);
        let r = post_json(s.addr, "bind", &bind_args("p", "n1")).await;
        let e = r["Error"].as_str().unwrap();
        assert!(e.contains(why), "{bad}: {e}");
        assert!(!annotations(&s.cluster, "p").contains_key("doslab.io/gpu-assignment"));
    }
}

/// A node whose inventory names a GPU twice takes no pod: counted by
/// UUID, both would hold the pods of one and five 40 GiB pods fit on two
/// 40 GiB GPUs.
#[tokio::test]
async fn a_node_with_a_duplicate_gpu_uuid_takes_no_pod() {
    let s = setup("binpack").await;
    s.cluster
        .add_node(gpu_node("dup", &[("GPU-x", 40960), ("GPU-x", 40960)]));
    let pod = gpu_pod("ns", "p", &[c("app", 40960, 0, 0)]);
    let args = json!({"Pod": wire_pod(&pod), "NodeNames": ["dup"]});
    let r = post_json(s.addr, "filter", &args).await;
    assert_eq!(r["NodeNames"], json!([]), "{r}");
    let reason = r["FailedAndUnresolvableNodes"]["dup"].as_str().unwrap();
    assert!(
        reason.contains(r#"GPU uuid "GPU-x" is listed twice"#),
        "{reason}"
    );
    s.cluster.put_pod(pod);
    let r = post_json(s.addr, "bind", &bind_args("p", "dup")).await;
    assert!(r["Error"].as_str().unwrap().contains("listed twice"), "{r}");
    assert_eq!(s.cluster.bindings(), 0);
}

#[tokio::test]
async fn a_failed_binding_leaves_no_annotation_and_reserves_nothing() {
    let s = setup("binpack").await;
    s.cluster
        .put_pod(gpu_pod("ns", "p", &[c("app", 40960, 0, 0)]));
    s.cluster.fail_bindings(1);
    let r = post_json(s.addr, "bind", &bind_args("p", "n2")).await;
    assert!(r["Error"].as_str().unwrap().contains("40960 MiB"), "{r}");
    let r = post_json(s.addr, "bind", &bind_args("p", "n1")).await;
    let e = r["Error"].as_str().unwrap();
    assert!(e.contains("injected Binding failure"), "{e}");
    let a = annotations(&s.cluster, "p");
    assert!(
        !a.keys().any(|k| k.starts_with("doslab.io/")),
        "left behind: {a:?}"
    );
    // Both GPUs of n1 are still free for a pod that needs both.
    let both = gpu_pod("ns", "both", &[c("a", 40960, 0, 0), c("b", 40960, 0, 0)]);
    s.cluster.put_pod(both.clone());
    let args = json!({"Pod": wire_pod(&both), "Nodes": null, "NodeNames": ["n1"]});
    assert_eq!(
        post_json(s.addr, "filter", &args).await["NodeNames"],
        json!(["n1"])
    );
    let r = post_json(s.addr, "bind", &bind_args("both", "n1")).await;
    assert_eq!(r["Error"], "");
}

#[tokio::test]
async fn a_concurrent_write_is_kept_and_the_bind_replans() {
    let s = setup("binpack").await;
    s.cluster
        .put_pod(gpu_pod("ns", "p", &[c("app", 1024, 0, 0)]));
    s.cluster.conflict_next(1);
    let r = post_json(s.addr, "bind", &bind_args("p", "n1")).await;
    assert_eq!(r["Error"], "");
    assert_eq!(s.cluster.bindings(), 1);
    let a = annotations(&s.cluster, "p");
    assert_eq!(a["doslab.io/gpu-assigned"], "false", "{a:?}");

    s.cluster
        .put_pod(gpu_pod("ns", "q", &[c("app", 1024, 0, 0)]));
    s.cluster.conflict_next(10);
    let r = post_json(s.addr, "bind", &bind_args("q", "n1")).await;
    assert!(r["Error"].as_str().unwrap().contains("changed"), "{r}");
    assert_eq!(s.cluster.bindings(), 1);
}

#[tokio::test]
async fn binds_in_flight_count_before_the_watch_shows_them() {
    let s = setup("binpack").await;
    s.cluster
        .put_pod(gpu_pod("ns", "a", &[c("app", 24576, 0, 0)]));
    s.cluster.set_lagging(true);
    let r = post_json(s.addr, "bind", &bind_args("a", "n2")).await;
    assert_eq!(r["Error"], "");
    let b = gpu_pod("ns", "b", &[c("app", 24576, 0, 0)]);
    let args = json!({"Pod": wire_pod(&b), "Nodes": null, "NodeNames": ["n2"]});
    let r = post_json(s.addr, "filter", &args).await;
    assert_eq!(r["NodeNames"], json!([]), "{r}");
    s.cluster.catch_up();
    let r = post_json(s.addr, "filter", &args).await;
    assert_eq!(r["NodeNames"], json!([]), "{r}");
    // Deleted: its share is free at once.
    s.cluster.set_lagging(false);
    s.cluster.delete_pod(&("ns".into(), "a".into()));
    let r = post_json(s.addr, "filter", &args).await;
    assert_eq!(r["NodeNames"], json!(["n2"]), "{r}");
}

/// The filter answer's node names for `pod` over `nodes`.
async fn passes(s: &Setup, pod: &Pod, nodes: &[&str]) -> Value {
    let args = json!({"Pod": wire_pod(pod), "Nodes": null, "NodeNames": nodes});
    post_json(s.addr, "filter", &args).await["NodeNames"].clone()
}

#[tokio::test]
async fn pods_filtered_or_scored_count_before_their_binds_come() {
    // kube-scheduler filters the next pod before the last one's bind: a
    // and b are both judged before either binds.
    let s = setup("binpack").await;
    let pod = |name: &str| gpu_pod("ns", name, &[c("app", 30720, 0, 0)]);
    for name in ["a", "b", "c"] {
        s.cluster.put_pod(pod(name));
    }
    // One node left (n2 has 24 GiB): a is nominated on n1.
    assert_eq!(passes(&s, &pod("a"), &["n1", "n2"]).await, json!(["n1"]));
    assert_eq!(passes(&s, &pod("b"), &["n1", "n2"]).await, json!(["n1"]));
    // Both GPUs of n1 are spoken for: c waits instead of failing its bind.
    assert_eq!(passes(&s, &pod("c"), &["n1", "n2"]).await, json!([]));
    // Filtered again, a pod is judged without its own nomination.
    assert_eq!(passes(&s, &pod("b"), &["n1"]).await, json!(["n1"]));
    // The binds come in any order and each finds its room.
    for name in ["b", "a"] {
        let r = post_json(s.addr, "bind", &bind_args(name, "n1")).await;
        assert_eq!(r["Error"], "", "{name}: {r}");
    }
    let gpu = |name: &str| annotations(&s.cluster, name)["doslab.io/gpu-uuid"].clone();
    assert_ne!(gpu("a"), gpu("b"));

    // Scored: the best node alone at the top, and it is nominated there.
    let small = |name: &str| gpu_pod("ns", name, &[c("app", 16384, 0, 0)]);
    let args = json!({"Pod": wire_pod(&small("d")), "Nodes": null, "NodeNames": ["n1", "n2"]});
    let r = post_json(s.addr, "prioritize", &args).await;
    assert_eq!(
        r,
        json!([{"Host": "n1", "Score": 0}, {"Host": "n2", "Score": 10}])
    );
    assert_eq!(passes(&s, &small("e"), &["n2"]).await, json!([]));
}

#[tokio::test]
async fn nominations_expire() {
    let s = setup_with("binpack", "reservation_ttl_ms = 200\n").await;
    let pod = |name: &str| gpu_pod("ns", name, &[c("app", 24576, 0, 0)]);
    let nominated = std::time::Instant::now();
    assert_eq!(passes(&s, &pod("a"), &["n2"]).await, json!(["n2"]));
    assert_eq!(passes(&s, &pod("b"), &["n2"]).await, json!([]));
    let deadline = std::time::Instant::now() + support::WAIT;
    support::poll_for(
        deadline,
        async || (passes(&s, &pod("b"), &["n2"]).await == json!(["n2"])).then_some(()),
        || "a's nomination never expired".into(),
    )
    .await;
    let held = nominated.elapsed();
    assert!(
        held >= std::time::Duration::from_millis(200),
        "expired after {held:?}"
    );
}

/// Binds `a` on n1, whose Binding lands at once but answers 2 s late,
/// holding n1's line; then `p` (a whole 40 GiB GPU of n1, reserved as it
/// joins the line) waits behind it until its caller hangs up, before
/// its Binding.
async fn hang_up_in_line(s: &Setup) {
    s.cluster
        .put_pod(gpu_pod("ns", "a", &[c("app", 1024, 0, 0)]));
    s.cluster
        .put_pod(gpu_pod("ns", "p", &[c("app", 40960, 0, 0)]));
    s.cluster
        .answer_late("bind", std::time::Duration::from_secs(2));
    let (addr, first) = (s.addr, bind_args("a", "n1").to_string());
    tokio::spawn(async move { post(addr, "bind", &first).await });
    let a = ("ns".to_owned(), "a".to_owned());
    let bound = || {
        let pod = s.cluster.pod(&a);
        pod.and_then(|p| p.spec?.node_name).is_some()
    };
    let deadline = std::time::Instant::now() + support::WAIT;
    support::poll_until(deadline, bound, || "a never bound".into()).await;
    let hang_up = std::time::Duration::from_millis(200);
    let args = bind_args("p", "n1").to_string();
    let call = tokio::time::timeout(hang_up, post(s.addr, "bind", &args)).await;
    assert!(call.is_err(), "the bind answered before the hang-up");
}

#[tokio::test]
async fn a_bind_whose_caller_hangs_up_keeps_nothing() {
    let s = setup("binpack").await;
    hang_up_in_line(&s).await;
    // The handler is dropped with the connection: n1's other GPU is free
    // again, once the server has seen the hang-up.
    let q = gpu_pod("ns", "q", &[c("app", 40960, 0, 0)]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    support::poll_for(
        deadline,
        async || (passes(&s, &q, &["n1"]).await == json!(["n1"])).then_some(()),
        || "n1 still held".into(),
    )
    .await;
    let p = s.cluster.pod(&("ns".into(), "p".into())).unwrap();
    assert!(p.spec.unwrap().node_name.is_none(), "p was bound");
}

/// What the extender logged, from a subscriber on the test's own thread
/// (a current-thread runtime runs the server's handlers there too).
#[derive(Clone, Default)]
struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

impl Logs {
    /// Everything logged since the last call.
    fn take(&self) -> String {
        String::from_utf8(std::mem::take(&mut *self.0.lock().unwrap())).unwrap()
    }
}

#[tokio::test]
async fn only_a_caller_that_hung_up_is_logged_as_abandoning_its_bind() {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .finish();
    let _on_this_thread = tracing::subscriber::set_default(subscriber);
    let s = setup("binpack").await;
    // Refused (n2's GPU is too small), bound, then bound again (nothing
    // to do): the caller waited for each.
    s.cluster
        .put_pod(gpu_pod("ns", "big", &[c("app", 40960, 0, 0)]));
    let r = post_json(s.addr, "bind", &bind_args("big", "n2")).await;
    assert!(r["Error"].as_str().unwrap().contains("40960 MiB"), "{r}");
    for _ in 0..2 {
        let r = post_json(s.addr, "bind", &bind_args("big", "n1")).await;
        assert_eq!(r["Error"], "", "{r}");
    }
    let log = logs.take();
    assert!(log.contains("bind refused"), "{log}");
    assert!(!log.contains("abandoned"), "{log}");

    s.cluster.delete_pod(&("ns".into(), "big".into()));
    hang_up_in_line(&s).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let log = std::cell::RefCell::new(String::new());
    support::poll_until(
        deadline,
        || {
            log.borrow_mut().push_str(&logs.take());
            log.borrow()
                .contains("bind abandoned by its caller before its Binding")
        },
        || log.borrow().clone(),
    )
    .await;
}

#[tokio::test]
async fn a_binding_that_lands_late_counts_as_done_within_the_deadline() {
    let s = setup_with("binpack", "bind_timeout_ms = 400\n").await;
    s.cluster
        .put_pod(gpu_pod("ns", "p", &[c("app", 24576, 0, 0)]));
    s.cluster
        .answer_late("bind", std::time::Duration::from_secs(2));
    let started = std::time::Instant::now();
    let r = post_json(s.addr, "bind", &bind_args("p", "n2")).await;
    let took = started.elapsed();
    assert_eq!(r["Error"], "", "{r}");
    assert!(took < std::time::Duration::from_millis(500), "{took:?}");
    // Bound, and it keeps its assignment: its GPU is not handed out again.
    let a = annotations(&s.cluster, "p");
    assert_eq!(a["doslab.io/gpu-uuid"], "GPU-c");
    let q = gpu_pod("ns", "q", &[c("app", 24576, 0, 0)]);
    assert_eq!(passes(&s, &q, &["n2"]).await, json!([]));
}

#[tokio::test]
async fn a_failed_bind_answers_within_its_deadline_check_included() {
    let s = setup_with("binpack", "bind_timeout_ms = 400\n").await;
    s.cluster
        .put_pod(gpu_pod("ns", "p", &[c("app", 24576, 0, 0)]));
    s.cluster.fail_bindings(1);
    // Whether it landed is read from the API server, slowly.
    s.cluster
        .answer_late("get", std::time::Duration::from_millis(250));
    let started = std::time::Instant::now();
    let r = post_json(s.addr, "bind", &bind_args("p", "n2")).await;
    let took = started.elapsed();
    assert!(r["Error"].as_str().unwrap().contains("injected"), "{r}");
    assert!(took < std::time::Duration::from_millis(500), "{took:?}");
    // A failed Binding wrote nothing.
    let a = annotations(&s.cluster, "p");
    assert!(!a.contains_key("doslab.io/gpu-assignment"), "{a:?}");
    let q = gpu_pod("ns", "q", &[c("app", 24576, 0, 0)]);
    assert_eq!(passes(&s, &q, &["n2"]).await, json!(["n2"]));
}

#[tokio::test]
async fn bad_requests_get_a_clear_error() {
    let s = setup("binpack").await;
    for verb in ["filter", "bind"] {
        let (code, text) = post(s.addr, verb, "{not json").await;
        assert_eq!(code, 200, "{verb}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let e = v["Error"].as_str().unwrap();
        assert!(e.contains(verb) && e.contains("JSON"), "{e}");
    }
    let (code, text) = post(s.addr, "prioritize", "{not json").await;
    assert_eq!(code, 400);
    assert!(text.contains("prioritize"), "{text}");
    let r = post_json(
        s.addr,
        "filter",
        &json!({"Pod": null, "Nodes": null, "NodeNames": ["n1"]}),
    )
    .await;
    assert!(r["Error"].as_str().unwrap().contains("no Pod"), "{r}");
}

/// The real kube client's Binding, against the API-server stand-in: the
/// node and the assignment in one write, and a stale resourceVersion, a
/// wrong UID or a pod already bound a conflict that changes nothing.
#[tokio::test]
async fn the_kube_binder_binds_with_the_assignment_under_preconditions() {
    use gpu_sim::apiserver::ApiServerSim;
    let sim = ApiServerSim::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    sim.write_kubeconfig(&kubeconfig).unwrap();
    let client = from_kubeconfig(&kubeconfig, "extender.kubeconfig")
        .await
        .unwrap();
    let binder = KubeBinder::new(client);
    sim.add_unscheduled_pod("ns", "p", "doslab-gpu-scheduler", &[c("app", 1024, 0, 0)]);
    let key = ("ns".to_owned(), "p".to_owned());

    let pod = binder.get_pod(&key).await.unwrap().unwrap();
    let (rv, uid) = (
        pod.metadata.resource_version.clone().unwrap(),
        pod.metadata.uid.clone().unwrap(),
    );
    let set = [("doslab.io/gpu-uuid".to_owned(), "GPU-a".to_owned())].into();
    let stale = format!("{rv}0");
    for (uid, rv) in [(uid.as_str(), stale.as_str()), ("another", rv.as_str())] {
        let refused = binder.bind(&key, uid, Some(rv), "n1", &set).await;
        assert_eq!(refused.unwrap_err(), BindError::Conflict);
        let p = sim.pod("ns", "p").unwrap();
        assert!(p["spec"]["nodeName"].is_null(), "{p}");
        assert!(
            p["metadata"]["annotations"]["doslab.io/gpu-uuid"].is_null(),
            "{p}"
        );
    }
    binder
        .bind(&key, &uid, Some(&rv), "n1", &set)
        .await
        .unwrap();
    let p = sim.pod("ns", "p").unwrap();
    assert_eq!(p["spec"]["nodeName"], "n1");
    assert_eq!(p["metadata"]["annotations"]["doslab.io/gpu-uuid"], "GPU-a");
    let again = binder.bind(&key, &uid, None, "n2", &set).await;
    assert_eq!(again.unwrap_err(), BindError::Conflict);
    let ghost = ("ns".to_owned(), "ghost".to_owned());
    assert!(binder.get_pod(&ghost).await.unwrap().is_none());
    assert_eq!(
        binder.bind(&ghost, "", None, "n1", &set).await.unwrap_err(),
        BindError::NotFound
    );
}

#[test]
fn the_subcommand_refuses_a_bad_config_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(&path, "[extender]\npolicy = \"fair\"\n").unwrap();
    let path = path.to_str().unwrap();
    let (status, _, err) = support::run_to_end(&["scheduler-extender", "--config", path], &[]);
    assert!(!status.success());
    assert!(err.contains("fair") && err.contains("binpack"), "{err}");

    std::fs::write(
        dir.path().join("config.toml"),
        "[extender]\nlisten = \"here\"\n",
    )
    .unwrap();
    let (status, _, err) = support::run_to_end(&["scheduler-extender", "--config", path], &[]);
    assert!(!status.success());
    assert!(err.contains("extender.listen"), "{err}");
}

/// The extender's `/readyz` against the API-server stand-in: ready once
/// nodes and pods are listed, 503 with each kind's reason from an outage
/// until both are listed again; `extender-ready` (the container's
/// readiness probe) exits 0 and 1 accordingly, with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_index_and_the_probe_subcommand_reports_it() {
    use gpu_sim::apiserver::ApiServerSim;
    use std::time::Instant;
    let sim = ApiServerSim::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    sim.write_kubeconfig(&kubeconfig).unwrap();
    let (_extender, url) = support::start_extender(&kubeconfig).await;
    let addr = url.trim_start_matches("http://").to_owned();
    let probe_config = dir.path().join("probe.toml");
    std::fs::write(&probe_config, format!("[extender]\nlisten = \"{addr}\"\n")).unwrap();
    /// What `/readyz` and the probe said.
    #[derive(Debug)]
    struct Seen {
        code: u16,
        body: String,
        exit: Option<i32>,
        said: String,
    }
    let ask = move || {
        let (code, body) = support::http_get(&addr, "/readyz");
        let config = probe_config.to_str().unwrap();
        let (status, out, err) = support::run_to_end(&["extender-ready", "--config", config], &[]);
        Seen {
            code,
            body,
            exit: status.code(),
            said: out + &err,
        }
    };
    // The extender serves on the runtime's workers while this thread
    // waits for the probe.
    let until = async |done: fn(&Seen) -> bool| {
        support::poll_for(
            Instant::now() + support::WAIT,
            async || Some(ask()).filter(done),
            || format!("{:?}", ask()),
        )
        .await
    };
    let ready = |s: &Seen| s.code == 200 && s.exit == Some(0);
    assert_eq!(until(ready).await.said.trim(), "ready");

    sim.outage(true);
    // Each kind's reason, once each watch has failed.
    let down = until(|s| {
        s.code == 503
            && s.exit == Some(1)
            && [&s.body, &s.said]
                .iter()
                .all(|t| t.contains("nodes: ") && t.contains("pods: "))
    })
    .await;
    for text in [&down.body, &down.said] {
        assert!(
            text.contains("not ready") && text.contains("nodes: ") && text.contains("pods: "),
            "{text}"
        );
    }
    assert!(down.said.contains("503"), "{}", down.said);

    sim.outage(false);
    let back = Instant::now();
    until(ready).await;
    eprintln!("extender ready {:?} after the outage ended", back.elapsed());
}
