//! The matcher's ledger write against a mocked API server: the exact
//! requests it makes when the patch lands, meets a conflict, finds the pod
//! gone, or fails.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::Method;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use serde_json::{Value, json};

use super::actor::MatcherArgs;
use super::write::{self, Landed, WriteError};
use crate::net::mock_api::{self, MockApi, annotations_patch, status};
use crate::node::metrics::Metrics;
use crate::rules::device::Resource;
use crate::rules::matching::pods::{PodKey, PodView};
use crate::rules::matching::tests::gpus_of_1000_mib;
use crate::rules::matching::{Ask, Decision};
use crate::rules::usage::Keys;
use crate::rules::usage::ids_digest;

const POD: &str = "/api/v1/namespaces/default/pods/p";
const PATCH: &str = "/api/v1/namespaces/default/pods/p?";
const LEDGER: &str = "doslab.io/gpu-ledger";

/// Node `n` with one GPU of 1000 MiB, 1 MiB a device.
fn args() -> MatcherArgs {
    MatcherArgs {
        node_name: "n".into(),
        node: gpus_of_1000_mib(&["GPU-a"]),
        keys: Keys::new("doslab.io"),
        wait: Duration::from_secs(1),
        kubeconfig: Default::default(),
        kubelet_checkpoint: Default::default(),
        metrics: Arc::new(Metrics::default()),
        readiness: Arc::default(),
        withdrawals: None,
        mps: false,
    }
}

/// Pod default/p on `n` at `resource_version`: container `app` asks 4
/// MiB, `side` 2 MiB; `ledger` is its ledger annotation, if any.
fn pod(resource_version: &str, ledger: Option<&str>) -> Value {
    let limits = |mib: &str| json!({ "doslab.io/gpu-memory": mib });
    let container = |name: &str, mib: &str| {
        json!({ "name": name, "image": "cuda",
                "resources": { "limits": limits(mib), "requests": limits(mib) } })
    };
    let annotations: serde_json::Map<String, Value> = ledger
        .map(|l| (LEDGER.to_owned(), l.into()))
        .into_iter()
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "namespace": "default", "name": "p", "uid": "uid-p",
            "resourceVersion": resource_version, "annotations": annotations,
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": { "nodeName": "n", "containers": [container("app", "4"), container("side", "2")] },
        "status": { "phase": "Pending" },
    })
}

/// The pod as the matcher's cache shows it at resourceVersion 7.
fn view() -> PodView {
    let pod: Pod = serde_json::from_value(pod("7", None)).unwrap();
    PodView::from_pod(&Keys::new("doslab.io"), &pod).0
}

/// `app`'s 4 MiB on GPU 0, by the IDs `m0`..`m3`.
fn ask_and_decision() -> (Ask, Decision) {
    let ask = Ask {
        resource: Resource::GpuMemory,
        devices: 4,
        digest: Some(ids_digest(["m0", "m1", "m2", "m3"].into_iter())),
        id_gpus: vec![0],
    };
    let decision = Decision {
        pod: PodKey {
            namespace: "default".into(),
            name: "p".into(),
        },
        uid: "uid-p".into(),
        container: "app".into(),
        gpus: vec![0],
        amount: 4,
        repeat: false,
        whole: false,
    };
    (ask, decision)
}

/// `app`'s grant as the ledger records it.
const APP: &str = r#""app":{"gpus":["GPU-a"],"gpu-memory":4,"ids":{"gpu-memory":"DIGEST"}}"#;

/// The ledger text with `app`'s grant (and `side`'s too with `both`), as
/// the annotation carries it.
fn ledger_text(both: bool) -> String {
    let digest = ids_digest(["m0", "m1", "m2", "m3"].into_iter());
    let app = APP.replace("DIGEST", &digest);
    match both {
        false => format!("{{{app}}}"),
        true => format!(r#"{{{app},"side":{SIDE}}}"#),
    }
}

/// `side`'s grant, written by another Allocate meanwhile.
const SIDE: &str = r#"{"gpus":["GPU-a"],"gpu-memory":2,"ids":{"gpu-memory":"x"}}"#;

/// Expects the ledger's merge patch at `resource_version`, answered `code`.
async fn expect_patch(
    api: &mut MockApi,
    resource_version: &str,
    annotations: Value,
    code: u16,
    answer: Value,
) {
    let patch = api.expect_merge_patch(PATCH, code, answer).await;
    assert_eq!(patch.body, annotations_patch(resource_version, annotations));
}

/// Runs the write with `scenario` answering; returns its result.
async fn write_with(
    scenario: impl AsyncFnOnce(&mut MockApi),
) -> (Result<Landed, WriteError>, Arc<Metrics>) {
    let (client, mut api) = mock_api::client();
    let args = args();
    let (ask, d) = ask_and_decision();
    let deadline = Instant::now() + Duration::from_secs(5);
    let pods = Api::namespaced(client, "default");
    let answering = async {
        scenario(&mut api).await;
        api.done().await;
    };
    let writing = write::ledger(&pods, &args, view(), &ask, &d, deadline);
    let (result, ()) = tokio::join!(writing, answering);
    (result, args.metrics)
}

/// The patches and gets the matcher counted.
fn patches_and_gets(metrics: &Metrics) -> (u64, u64) {
    let text = metrics.render();
    let count = |verb: &str| {
        let series = format!("gpu_device_plugin_api_requests_total{{verb=\"{verb}\"}} ");
        let line = text.lines().find_map(|l| l.strip_prefix(series.as_str()));
        line.map_or(0, |n| n.parse().unwrap())
    };
    (count("patch"), count("get"))
}

#[tokio::test]
async fn a_grant_is_one_merge_patch_of_the_ledger_on_the_version_decided_on() {
    let (result, metrics) = write_with(async |api: &mut MockApi| {
        let only_app = json!({ LEDGER: ledger_text(false) });
        expect_patch(api, "7", only_app, 200, pod("8", Some(&ledger_text(false)))).await;
    })
    .await;
    let landed = result.unwrap();
    assert_eq!(
        (landed.replaced.as_str(), landed.resource_version.as_str()),
        ("7", "8")
    );
    assert_eq!(landed.ledger.to_json(), ledger_text(false));
    assert_eq!(patches_and_gets(&metrics), (1, 0));
}

#[tokio::test]
async fn a_conflict_reads_the_pod_and_patches_its_version_with_the_ledgers_merged() {
    let (result, metrics) = write_with(async |api: &mut MockApi| {
        let only_app = json!({ LEDGER: ledger_text(false) });
        expect_patch(api, "7", only_app, 409, status(409, "Conflict")).await;
        let side = format!(r#"{{"side":{SIDE}}}"#);
        api.expect(Method::GET, POD, 200, pod("9", Some(&side)))
            .await;
        // Both containers served: the pod is assigned.
        let both = json!({ LEDGER: ledger_text(true), "doslab.io/gpu-assigned": "true" });
        expect_patch(api, "9", both, 200, pod("10", Some(&ledger_text(true)))).await;
    })
    .await;
    let landed = result.unwrap();
    assert_eq!(
        (landed.replaced.as_str(), landed.resource_version.as_str()),
        ("9", "10")
    );
    assert_eq!(patches_and_gets(&metrics), (2, 1));
}

#[tokio::test]
async fn a_pod_gone_ends_the_write_at_once() {
    let (result, _) = write_with(async |api: &mut MockApi| {
        let only_app = json!({ LEDGER: ledger_text(false) });
        expect_patch(api, "7", only_app, 404, status(404, "NotFound")).await;
    })
    .await;
    assert_eq!(result.unwrap_err(), WriteError::Gone);
}

#[tokio::test]
async fn a_failed_patch_is_retried_on_the_pod_read_again() {
    let started = Instant::now();
    let (result, _) = write_with(async |api: &mut MockApi| {
        let only_app = json!({ LEDGER: ledger_text(false) });
        expect_patch(
            api,
            "7",
            only_app.clone(),
            500,
            status(500, "InternalError"),
        )
        .await;
        // Our write may have landed before the error: read, then patch.
        api.expect(Method::GET, POD, 200, pod("7", None)).await;
        expect_patch(api, "7", only_app, 200, pod("8", Some(&ledger_text(false)))).await;
    })
    .await;
    assert_eq!(result.unwrap().resource_version, "8");
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "paused before retrying"
    );
}

#[tokio::test]
async fn a_pod_replaced_by_one_of_the_same_name_is_gone() {
    let (result, _) = write_with(async |api: &mut MockApi| {
        let only_app = json!({ LEDGER: ledger_text(false) });
        expect_patch(api, "7", only_app, 409, status(409, "Conflict")).await;
        let mut other = pod("3", None);
        other["metadata"]["uid"] = "uid-other".into();
        api.expect(Method::GET, POD, 200, other).await;
    })
    .await;
    assert_eq!(result.unwrap_err(), WriteError::Gone);
}
