//! The extender's bind against a mocked API server: the exact requests
//! [`KubeBinder`] makes for a bind that works, one whose assignment patch
//! meets a conflict, and one whose Binding fails; and none while the index
//! is stale.

use std::sync::{Arc, RwLock};

use hyper::Method;
use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};

use super::wire::ExtenderBindingArgs;
use super::{Extender, ExtenderConfig, Index, KubeBinder};
use crate::mock_api::{self, MockApi, annotations_patch, status};

const POD: &str = "/api/v1/namespaces/ns/pods/p";
const PATCH: &str = "/api/v1/namespaces/ns/pods/p?";
const BINDING: &str = "/api/v1/namespaces/ns/pods/p/binding?";

/// Node `n` with one GPU of 1024 MiB, as its daemon publishes it.
fn node() -> Node {
    let inventory = json!({
        "version": 1, "memoryUnitMiB": 1, "coresPerGpu": 100,
        "resources": ["gpu-memory", "gpu-core", "gpu-count"],
        "gpus": [{ "uuid": "GPU-a", "memoryMiB": 1024, "healthy": true }],
    });
    serde_json::from_value(json!({
        "metadata": {
            "name": "n",
            "annotations": { "doslab.io/gpu-inventory": inventory.to_string() },
        },
    }))
    .expect("a valid Node")
}

/// Pod ns/p at `resource_version`, its one container asking 512 MiB;
/// bound to `node` when given.
fn pod(resource_version: &str, node: Option<&str>) -> Value {
    let limits = json!({ "doslab.io/gpu-memory": "512" });
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "namespace": "ns", "name": "p", "uid": "uid-p",
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

/// The same with every value null: their removal.
fn removal() -> Value {
    let Value::Object(keys) = assignment() else {
        unreachable!("an object")
    };
    Value::Object(keys.into_iter().map(|(k, _)| (k, Value::Null)).collect())
}

fn binding() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": { "name": "p", "namespace": "ns", "uid": "uid-p" },
        "target": { "apiVersion": "v1", "kind": "Node", "name": "n" },
    })
}

/// An extender whose index has listed node `n` and no pods, and the API
/// server it binds on.
fn extender() -> (Extender<KubeBinder>, MockApi) {
    let mut index = Index::new("doslab.io");
    index.replace_nodes(vec![node()]);
    index.replace_pods(Vec::new());
    let (client, api) = mock_api::client();
    let config = ExtenderConfig::default();
    let x = Extender::new(
        &config,
        Arc::new(RwLock::new(index)),
        KubeBinder::new(client),
    );
    (x, api)
}

fn args() -> ExtenderBindingArgs {
    ExtenderBindingArgs {
        pod_name: "p".into(),
        pod_namespace: "ns".into(),
        pod_uid: "uid-p".into(),
        node: "n".into(),
    }
}

/// Expects the assignment's merge patch on the pod at `resource_version`
/// (`annotations` null to remove them), answered `code`.
async fn expect_patch(
    api: &mut MockApi,
    resource_version: &str,
    annotations: Value,
    code: u16,
    answer: Value,
) {
    let mut patch = api.expect_merge_patch(PATCH, code, answer).await;
    let assumed = &mut patch.body["metadata"]["annotations"][ASSUME_TIME];
    if let Some(nanos) = assumed.as_str() {
        let nanos: u128 = nanos.parse().expect("nanoseconds");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        let ago = now.unwrap().as_nanos().checked_sub(nanos);
        assert!(ago.is_some_and(|ns| ns < 60_000_000_000), "{nanos}");
        *assumed = "now".into();
    }
    assert_eq!(patch.body, annotations_patch(resource_version, annotations));
}

#[tokio::test]
async fn a_bind_reads_the_pod_patches_its_assignment_on_that_version_then_binds() {
    let (x, mut api) = extender();
    let scenario = tokio::spawn(async move {
        api.expect(Method::GET, POD, 200, pod("5", None)).await;
        expect_patch(&mut api, "5", assignment(), 200, pod("6", None)).await;
        let post = api.expect(Method::POST, BINDING, 201, json!({})).await;
        assert_eq!(post.body, binding());
        api.done().await;
    });
    x.bind(&args()).await.unwrap();
    drop(x);
    scenario.await.unwrap();
}

#[tokio::test]
async fn a_conflict_on_the_patch_reads_the_pod_again_and_patches_its_new_version() {
    let (x, mut api) = extender();
    let scenario = tokio::spawn(async move {
        api.expect(Method::GET, POD, 200, pod("5", None)).await;
        let conflict = status(409, "Conflict");
        expect_patch(&mut api, "5", assignment(), 409, conflict).await;
        api.expect(Method::GET, POD, 200, pod("7", None)).await;
        expect_patch(&mut api, "7", assignment(), 200, pod("8", None)).await;
        api.expect(Method::POST, BINDING, 201, json!({})).await;
        api.done().await;
    });
    x.bind(&args()).await.unwrap();
    drop(x);
    scenario.await.unwrap();
}

#[tokio::test]
async fn a_failing_binding_removes_the_assignment_from_the_pod_as_read_after_it() {
    let (x, mut api) = extender();
    let scenario = tokio::spawn(async move {
        api.expect(Method::GET, POD, 200, pod("5", None)).await;
        expect_patch(&mut api, "5", assignment(), 200, pod("6", None)).await;
        let failure = status(500, "InternalError");
        api.expect(Method::POST, BINDING, 500, failure).await;
        // Not bound after all: the assignment goes, only from this version.
        api.expect(Method::GET, POD, 200, pod("6", None)).await;
        expect_patch(&mut api, "6", removal(), 200, pod("7", None)).await;
        api.done().await;
    });
    let e = x.bind(&args()).await.unwrap_err();
    assert!(e.contains("creating the Binding failed"), "{e}");
    drop(x);
    scenario.await.unwrap();
}

#[tokio::test]
async fn a_binding_that_landed_although_it_failed_keeps_the_assignment() {
    let (x, mut api) = extender();
    let scenario = tokio::spawn(async move {
        api.expect(Method::GET, POD, 200, pod("5", None)).await;
        expect_patch(&mut api, "5", assignment(), 200, pod("6", None)).await;
        let failure = status(500, "InternalError");
        api.expect(Method::POST, BINDING, 500, failure).await;
        api.expect(Method::GET, POD, 200, pod("7", Some("n"))).await;
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
    assert!(e.contains("not synced with the API server"), "{e}");

    x.index.write().unwrap().replace_pods(Vec::new());
    assert!(x.stale().is_empty());
    let scenario = tokio::spawn(async move {
        api.expect(Method::GET, POD, 200, pod("5", None)).await;
        expect_patch(&mut api, "5", assignment(), 200, pod("6", None)).await;
        api.expect(Method::POST, BINDING, 201, json!({})).await;
        api.done().await;
    });
    x.bind(&args()).await.unwrap();
    drop(x);
    scenario.await.unwrap();
}
