//! The matcher actor against the API-server stand-in: an Allocate's
//! enforcement step runs in its caller between `reserve` and `commit` (as
//! the plugin's placement runs it), so another Allocate is answered while
//! one is being readied, and the reservation keeps the two apart.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpu_sim::apiserver::{ApiServerSim, PodContainer};
use ractor::Actor;
use tokio::sync::oneshot;

use futures::future::BoxFuture;

use super::{MatcherArgs, MatcherHandle, PodMatcher, Recorded, allocate_ask};
use crate::config::Config;
use crate::node::enforcement::EnforcementError;
use crate::node::metrics::Metrics;
use crate::rules::device::{DeviceRef, Resource};
use crate::rules::matching::{Ask, Decision};

const NODE: &str = "n";
/// Far longer than a match takes: only a matcher stuck on the other
/// Allocate's enforcement step runs out of it.
const ANSWER: Duration = Duration::from_secs(10);

/// A running matcher for one mock GPU of 1024 MiB, against `api`.
async fn matcher(api: &ApiServerSim, dir: &std::path::Path) -> (MatcherHandle, Duration) {
    matcher_with(api, dir, "").await
}

/// [`matcher`] with more `[matcher]` keys.
async fn matcher_with(
    api: &ApiServerSim,
    dir: &std::path::Path,
    keys: &str,
) -> (MatcherHandle, Duration) {
    matcher_of(api, dir, keys, &["GPU-a"]).await
}

/// [`matcher_with`] over mock GPUs of 1024 MiB named `gpus`.
async fn matcher_of(
    api: &ApiServerSim,
    dir: &std::path::Path,
    keys: &str,
    gpus: &[&str],
) -> (MatcherHandle, Duration) {
    let kubeconfig = dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let gpus: String = gpus
        .iter()
        .map(|uuid| format!("[[devices.mock]]\nuuid = {uuid:?}\nmemory_mib = 1024\n"))
        .collect();
    let toml = format!(
        "pod_matching = true\nhttp_listen = \"\"\ndevice_plugin_dir = {:?}\n[matcher]\n\
         kubeconfig = {:?}\n{keys}\n[devices]\nbackend = \"mock\"\n{gpus}",
        dir.display().to_string(),
        kubeconfig.display().to_string()
    );
    let config = Config::from_toml(&toml, Some(NODE.into())).unwrap();
    let gpus = crate::rules::device::discover(&config).unwrap();
    let handle = MatcherHandle::default();
    let args = MatcherArgs::new(
        &config,
        &gpus,
        Arc::new(Metrics::default()),
        Arc::default(),
        &handle,
    );
    let wait = args.wait;
    let (actor, _) = Actor::spawn(None, PodMatcher, args).await.unwrap();
    handle.set(Some(actor));
    (handle, wait)
}

fn app(memory: u64) -> PodContainer {
    PodContainer {
        name: "app".into(),
        init: false,
        restartable: false,
        wants: [memory, 0, 0],
    }
}

fn ledger(api: &ApiServerSim, pod: &str) -> Option<serde_json::Value> {
    api.pod("default", pod).unwrap()["metadata"]["annotations"]
        .get("doslab.io/gpu-ledger")
        .cloned()
}

/// Pods `first` and `second`, each asking 4 gpu-memory devices, and a
/// matcher over them.
async fn first_and_second() -> (ApiServerSim, tempfile::TempDir, MatcherHandle, Duration) {
    let api = ApiServerSim::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    api.add_pod("default", "first", NODE, &[app(4)], &[]);
    api.add_pod("default", "second", NODE, &[app(4)], &[]);
    let (handle, wait) = matcher(&api, dir.path()).await;
    (api, dir, handle, wait)
}

/// An enforcement step that readies every grant at once.
fn ready() -> Prepare {
    Arc::new(|_| Box::pin(async { Ok(()) }))
}

/// The enforcement step a test puts between a decision and its record.
type Prepare =
    Arc<dyn Fn(&Decision) -> BoxFuture<'static, Result<(), EnforcementError>> + Send + Sync>;

/// The lookup of an Allocate of 4 gpu-memory devices on the GPU named
/// `ids`, and its caller's deadline.
fn four_devices(ids: [&str; 4], wait: Duration) -> (Ask, Instant) {
    four_devices_on(0, ids, wait)
}

/// [`four_devices`] on GPU `gpu`.
fn four_devices_on(gpu: usize, ids: [&str; 4], wait: Duration) -> (Ask, Instant) {
    let devices: Vec<DeviceRef> = (0..4).map(|unit| DeviceRef { gpu, unit }).collect();
    allocate_ask(Resource::GpuMemory, &devices, ids.into_iter(), wait)
}

/// Four device IDs, on GPU 0 unless a GPU is named with them.
struct OnGpu(usize, [&'static str; 4]);

impl From<[&'static str; 4]> for OnGpu {
    fn from(ids: [&'static str; 4]) -> Self {
        OnGpu(0, ids)
    }
}

impl From<(usize, [&'static str; 4])> for OnGpu {
    fn from((gpu, ids): (usize, [&'static str; 4])) -> Self {
        OnGpu(gpu, ids)
    }
}

/// An Allocate of 4 gpu-memory devices named `ids`, readied by `prepare`
/// between its reservation and its record.
async fn allocate(
    handle: MatcherHandle,
    wait: Duration,
    ids: impl Into<OnGpu>,
    prepare: Prepare,
) -> Result<String, String> {
    let OnGpu(gpu, ids) = ids.into();
    let (ask, deadline) = four_devices_on(gpu, ids, wait);
    loop {
        let reserved = handle
            .reserve(&ask, deadline)
            .await
            .map_err(|e| e.to_string())?;
        let pod = reserved.decision.pod.clone();
        if let Err(e) = prepare(&reserved.decision).await {
            handle.warn(pod, e.to_string());
            return Err(e.to_string());
        }
        match handle.commit(reserved).await.map_err(|e| e.to_string())? {
            Recorded::Done => return Ok(pod.name),
            Recorded::Again => continue,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocate_is_answered_while_another_ones_enforcement_step_is_blocked() {
    // Two pods asking the same: the first Allocate is first's (created
    // first), and its reservation must send the second to second.
    let (api, _dir, handle, wait) = first_and_second().await;

    // The enforcement step of first's grant blocks until released; that of
    // any other grant returns at once.
    let (entered, blocked) = oneshot::channel::<()>();
    let (release, released) = oneshot::channel::<()>();
    let gate = Arc::new(Mutex::new(Some((entered, released))));
    let prepare: Prepare = Arc::new(move |d| {
        let gate = (d.pod.name == "first")
            .then(|| gate.lock().unwrap().take())
            .flatten();
        Box::pin(async move {
            if let Some((entered, released)) = gate {
                let _ = entered.send(());
                let _ = released.await;
            }
            Ok(())
        })
    });

    let slow = tokio::spawn(allocate(
        handle.clone(),
        wait,
        ["a0", "a1", "a2", "a3"],
        prepare.clone(),
    ));
    blocked.await.expect("first's enforcement step began");
    let fast = tokio::time::timeout(
        ANSWER,
        allocate(handle.clone(), wait, ["b0", "b1", "b2", "b3"], prepare),
    )
    .await
    .expect("answered while the other Allocate's enforcement step is blocked");
    assert_eq!(fast.as_deref(), Ok("second"));
    assert!(ledger(&api, "second").is_some(), "second's grant recorded");
    assert_eq!(ledger(&api, "first"), None, "first's is not, yet");

    release.send(()).unwrap();
    let slow = tokio::time::timeout(ANSWER, slow).await.unwrap().unwrap();
    assert_eq!(slow.as_deref(), Ok("first"));
    assert!(ledger(&api, "first").is_some(), "first's grant recorded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_enforcement_step_records_nothing_and_releases_the_container() {
    let api = ApiServerSim::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    api.add_pod("default", "only", NODE, &[app(4)], &[]);
    let (handle, wait) = matcher(&api, dir.path()).await;
    let refuse: Prepare = Arc::new(|_| {
        Box::pin(async {
            Err(EnforcementError::Io {
                action: "create",
                path: "/nowhere".into(),
                source: std::io::Error::other("refused by the test"),
            })
        })
    });
    let ids = ["a0", "a1", "a2", "a3"];
    let err = allocate(handle.clone(), wait, ids, refuse)
        .await
        .unwrap_err();
    assert!(err.contains("refused by the test"), "{err}");
    assert_eq!(ledger(&api, "only"), None);
    let events = api.wait_for_events(1, ANSWER).await;
    assert!(
        events[0]["note"]
            .as_str()
            .unwrap()
            .contains("refused by the test"),
        "{events:?}"
    );
    // The reservation went with the refusal: the same container is served
    // by the kubelet's next try.
    let served = tokio::time::timeout(ANSWER, allocate(handle, wait, ids, ready()))
        .await
        .unwrap();
    assert_eq!(served.as_deref(), Ok("only"));
    assert!(ledger(&api, "only").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocate_is_decided_while_another_ones_ledger_write_is_in_flight() {
    let (api, _dir, handle, wait) = first_and_second().await;
    let ask = |ids| four_devices(ids, wait);

    // First's decision, then its ledger PATCH held by the API server far
    // longer than the test runs.
    let (first, deadline) = ask(["a0", "a1", "a2", "a3"]);
    let reserved = handle.reserve(&first, deadline).await.unwrap();
    assert_eq!(reserved.decision.pod.name, "first");
    let commit = commit_held(&api, &handle, reserved).await;

    // The matcher decides the next Allocate meanwhile, and the write in
    // flight keeps first's container reserved.
    let (second, deadline) = ask(["b0", "b1", "b2", "b3"]);
    let decided = tokio::time::timeout(ANSWER, handle.reserve(&second, deadline))
        .await
        .expect("decided while the other Allocate's ledger write is in flight")
        .unwrap();
    assert_eq!(decided.decision.pod.name, "second");
    commit.abort();
}

/// Commits `reserved` with the API server holding every request far longer
/// than a test runs, once its ledger PATCH has been sent.
async fn commit_held(
    api: &ApiServerSim,
    handle: &MatcherHandle,
    reserved: super::Reservation,
) -> tokio::task::JoinHandle<Result<Recorded, super::MatcherError>> {
    api.delay(Duration::from_secs(3600));
    let handle = handle.clone();
    let commit = tokio::spawn(async move { handle.commit(reserved).await });
    let patching = tokio::time::Instant::now() + ANSWER;
    while api.requests().get("patch").copied().unwrap_or(0) == 0 {
        assert!(tokio::time::Instant::now() < patching, "no PATCH sent");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    commit
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_not_answered_from_a_ledger_write_still_in_flight() {
    let api = ApiServerSim::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    api.add_pod("default", "only", NODE, &[app(4)], &[]);
    // A short wait, so the held write fails soon.
    let (handle, wait) = matcher_with(&api, dir.path(), "wait_ms = 1000").await;
    let ask = || four_devices(["a0", "a1", "a2", "a3"], wait);
    let (first, deadline) = ask();
    let reserved = handle.reserve(&first, deadline).await.unwrap();
    let commit = commit_held(&api, &handle, reserved).await;

    // The kubelet's retry of the same Allocate while that write is in
    // flight: the reservation makes it look recorded, but it is not yet.
    let (again, deadline) = ask();
    let retry = tokio::spawn({
        let handle = handle.clone();
        async move { handle.reserve(&again, deadline).await }
    });
    let failed = tokio::time::timeout(ANSWER, commit).await.unwrap().unwrap();
    assert!(failed.is_err(), "the held write fails: {failed:?}");
    api.delay(Duration::ZERO);
    let retried = tokio::time::timeout(ANSWER, retry)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(handle.commit(retried).await.unwrap(), Recorded::Done);
    assert!(
        ledger(&api, "only").is_some(),
        "the retry recorded its grant rather than taking the failed write for it"
    );
}

/// Waits until the matcher's pod cache holds exactly the pods `names`.
async fn cached(handle: &MatcherHandle, names: &[&str]) {
    let deadline = Instant::now() + ANSWER;
    loop {
        let live = handle.live().await.unwrap_or_default();
        let mut now: Vec<&str> = live.iter().map(|c| c.pod.name.as_str()).collect();
        now.sort();
        now.dedup();
        if now == names {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "cache holds {now:?}, not {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Found by the chaos test: a pod deleted as it was bound is admitted by
/// the kubelet all the same (it saw the pod bound before it saw it go),
/// and its Allocate, handed to the next pod of the same ask, gave that pod
/// another's grant and left its own Allocate nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_while_pending_keeps_its_allocates_from_the_next_pod() {
    let (api, _dir, handle, wait) = first_and_second().await;
    cached(&handle, &["first", "second"]).await;
    api.delete_pod("default", "first");
    cached(&handle, &["second"]).await;

    let ok = ready();
    let ids = ["a0", "a1", "a2", "a3"];
    let first = allocate(handle.clone(), wait, ids, ok.clone()).await;
    assert_eq!(first.as_deref(), Ok("first"));
    let patches = api.requests().get("patch").copied();
    assert_eq!(patches, None, "nothing to write on a deleted pod");
    // Its grant holds nothing on the GPU: the next pod's fits beside it.
    let ids = ["b0", "b1", "b2", "b3"];
    let second = allocate(handle.clone(), wait, ids, ok).await;
    assert_eq!(second.as_deref(), Ok("second"));
    assert!(ledger(&api, "second").is_some());
}

/// The kubelet's Allocate may reach a pod the watch has not yet shown
/// deleted: its ledger write finds it gone, and it is served as deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_write_finds_it_gone_keeps_its_allocates_from_the_next_pod() {
    let (api, _dir, handle, wait) = first_and_second().await;
    cached(&handle, &["first", "second"]).await;
    api.delete_pod_late("default", "first", Duration::from_secs(3600));

    let ok = ready();
    let first = allocate(handle.clone(), wait, ["a0", "a1", "a2", "a3"], ok.clone()).await;
    assert_eq!(first.as_deref(), Ok("first"));
    assert_eq!(ledger(&api, "second"), None);
    let second = allocate(handle.clone(), wait, ["b0", "b1", "b2", "b3"], ok).await;
    assert_eq!(second.as_deref(), Ok("second"));
    assert!(ledger(&api, "second").is_some());
}

/// A restarted kubelet never saw the deleted pod: it admits none of its
/// containers, so the next pod's Allocate is the next pod's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_restart_forgets_the_pods_deleted_while_pending() {
    let (api, _dir, handle, wait) = first_and_second().await;
    cached(&handle, &["first", "second"]).await;
    api.delete_pod("default", "first");
    cached(&handle, &["second"]).await;

    // A lookup takes the deletion in before the restart.
    handle.prefer(Resource::GpuMemory, 4).await;
    handle.kubelet_restarted((1, 0, 0));
    let ok = ready();
    let second = allocate(handle.clone(), wait, ["b0", "b1", "b2", "b3"], ok).await;
    assert_eq!(second.as_deref(), Ok("second"));
}

/// Found by the chaos test: a kubelet killed between a container's
/// Allocate and its checkpoint asks again, restarted, with other devices.
/// The grant on the ledger is void: the re-ask is that container's, not
/// the next pod's of the same ask (nor refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_the_restarted_kubelet_did_not_checkpoint_is_served_again() {
    let (api, dir, handle, wait) = first_and_second().await;
    let ok = ready();
    let first = allocate(handle.clone(), wait, ["a0", "a1", "a2", "a3"], ok.clone()).await;
    assert_eq!(first.as_deref(), Ok("first"));
    let before = ledger(&api, "first").unwrap();
    // A matcher (the daemon restarted too) that knows first's grant from
    // its pod cache alone.
    let (handle, wait) = matcher(&api, dir.path()).await;
    cached(&handle, &["first", "second"]).await;

    // The kubelet died before its checkpoint named first's devices.
    std::fs::write(
        dir.path().join("kubelet_internal_checkpoint"),
        r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":1}"#,
    )
    .unwrap();
    handle.kubelet_restarted((1, 0, 0));
    let again = allocate(handle.clone(), wait, ["c0", "c1", "c2", "c3"], ok.clone()).await;
    assert_eq!(again.as_deref(), Ok("first"));
    assert_ne!(
        ledger(&api, "first").unwrap(),
        before,
        "the new grant recorded"
    );
    // The same restart told again by another plugin changes nothing.
    handle.kubelet_restarted((1, 0, 0));
    let second = allocate(handle, wait, ["b0", "b1", "b2", "b3"], ok).await;
    assert_eq!(second.as_deref(), Ok("second"));
}

/// A matcher over pod `zero`, Running (no candidate), once its pod cache
/// has listed: the pods a test adds next arrive after that first list.
async fn listed() -> (ApiServerSim, tempfile::TempDir, MatcherHandle, Duration) {
    let api = ApiServerSim::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    api.add_pod("default", "zero", NODE, &[app(4)], &[]);
    api.set_phase("default", "zero", "Running");
    let (handle, wait) = matcher(&api, dir.path()).await;
    cached(&handle, &["zero"]).await;
    (api, dir, handle, wait)
}

/// Pod `name` asking 4 gpu-memory devices, stamped with `assume` as the
/// extender stamps the pods it binds.
fn assumed(api: &ApiServerSim, name: &str, node: &str, assume: &str) {
    let at = [("doslab.io/gpu-assume-time", assume)];
    match node {
        "" => api.add_unscheduled_pod("default", name, "doslab-gpu-scheduler", &[app(4)]),
        node => api.add_pod("default", name, node, &[app(4)], &at),
    }
}

/// Found by the chaos test: the pods bound while the API server restarted
/// reach the kubelet in the list after its watch broke, which it admits
/// by creation time, not in the order they were bound; the node's own
/// watch broke too, and its list brings the same pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pods_a_list_brings_after_a_broken_watch_are_admitted_by_creation_time() {
    let (api, _dir, handle, wait) = listed().await;
    api.outage(true);
    // Bound in the other order than created.
    assumed(&api, "older", NODE, "2");
    assumed(&api, "newer", NODE, "1");
    api.outage(false);
    cached(&handle, &["newer", "older", "zero"]).await;

    let ok = ready();
    let first = allocate(handle.clone(), wait, ["a0", "a1", "a2", "a3"], ok.clone()).await;
    assert_eq!(first.as_deref(), Ok("older"));
    let second = allocate(handle.clone(), wait, ["b0", "b1", "b2", "b3"], ok).await;
    assert_eq!(second.as_deref(), Ok("newer"));
}

/// Bound one at a time, pods reach the kubelet in the order they were
/// bound; a restarted kubelet lists them all at once and admits those
/// still Pending by creation time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_kubelet_admits_its_pending_pods_by_creation_time() {
    for restarted in [false, true] {
        let (api, dir, handle, wait) = listed().await;
        // Created first, bound second.
        assumed(&api, "older", "", "");
        assumed(&api, "newer", NODE, "1");
        cached(&handle, &["newer", "zero"]).await;
        let kubeconfig = dir.path().join("kubeconfig");
        let client = kube::Client::try_from(
            kube::Config::from_custom_kubeconfig(
                kube::config::Kubeconfig::read_from(&kubeconfig).unwrap(),
                &Default::default(),
            )
            .await
            .unwrap(),
        )
        .unwrap();
        let binding = serde_json::json!({
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": "older", "annotations": {"doslab.io/gpu-assume-time": "2"}},
            "target": {"kind": "Node", "name": NODE},
        });
        kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client, "default")
            .create_subresource::<_, serde_json::Value>(
                "binding",
                "older",
                &Default::default(),
                &binding,
            )
            .await
            .unwrap();
        cached(&handle, &["newer", "older", "zero"]).await;
        if restarted {
            handle.kubelet_restarted((1, 0, 0));
        }

        let ok = ready();
        let ids = ["a0", "a1", "a2", "a3"];
        let first = allocate(handle.clone(), wait, ids, ok).await;
        let want = if restarted { "older" } else { "newer" };
        assert_eq!(first.as_deref(), Ok(want), "restarted: {restarted}");
    }
}

/// The annotation `key` of pod `name`.
fn annotation(api: &ApiServerSim, name: &str, key: &str) -> Option<String> {
    let pod = api.pod("default", name).unwrap();
    pod["metadata"]["annotations"][key]
        .as_str()
        .map(str::to_owned)
}

/// Found by the chaos test: two pods asking the same may reach the kubelet
/// in another order than the matcher's: in a batch (a restarted kubelet's
/// first list, a list after a broken watch), sorted by creation time, in
/// seconds, ties in no set order; or, bound just after an API server
/// restart, one at a time to the node's watch, back already, and together
/// in the kubelet's list, later (seed 2: p363 then p362 to the node, p362
/// then p363 to the kubelet). Each then runs on the GPUs assigned to the
/// other, its grant recorded on the other. The kubelet's checkpoint says
/// whose devices are whose: the matcher swaps the two pods' GPU records to
/// match, and the next Allocate is served from the records swapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_the_kubelet_gave_the_other_pod_of_a_batch_moves_with_its_records() {
    let api = ApiServerSim::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    api.add_pod("default", "zero", NODE, &[app(4)], &[]);
    api.set_phase("default", "zero", "Running");
    let (handle, wait) = matcher_of(&api, dir.path(), "", &["GPU-a", "GPU-b"]).await;
    cached(&handle, &["zero"]).await;
    for (name, gpu) in [("p", "GPU-a"), ("q", "GPU-b")] {
        let assignment = format!(r#"{{"app":["{gpu}"]}}"#);
        let at = [
            ("doslab.io/gpu-assignment", assignment.as_str()),
            ("doslab.io/gpu-uuid", gpu),
            ("doslab.io/gpu-assume-time", "1"),
        ];
        api.add_pod("default", name, NODE, &[app(4)], &at);
    }
    cached(&handle, &["p", "q", "zero"]).await;

    // The matcher takes p, first to arrive, for the first Allocate; the
    // kubelet was admitting q, and says so in its checkpoint.
    let ok = ready();
    let ids = ["a0", "a1", "a2", "a3"];
    let first = allocate(handle.clone(), wait, ids, ok.clone()).await;
    assert_eq!(first.as_deref(), Ok("p"));
    let granted = ledger(&api, "p").unwrap();
    let uid = api.pod("default", "q").unwrap()["metadata"]["uid"].clone();
    let entry = serde_json::json!({
        "PodUID": uid, "ContainerName": "app", "ResourceName": "doslab.io/gpu-memory",
        "DeviceIDs": {"-1": ids}, "AllocResp": "CgA=",
    });
    let checkpoint = serde_json::json!({
        "Data": {"PodDeviceEntries": [entry], "RegisteredDevices": {}}, "Checksum": 1,
    });
    std::fs::write(
        dir.path().join("kubelet_internal_checkpoint"),
        checkpoint.to_string(),
    )
    .unwrap();

    // Each pod says so, once both its records are written.
    let events = api.wait_for_events(2, ANSWER).await;
    let told: Vec<&str> = events.iter().filter_map(|e| e["note"].as_str()).collect();
    assert_eq!(told.len(), 2, "the records were not swapped: {events:?}");
    assert!(
        told.iter()
            .all(|n| n.contains("admitted default/q in the place of default/p")),
        "{events:?}"
    );
    assert_eq!(ledger(&api, "q"), Some(granted));
    assert_eq!(ledger(&api, "p"), None);
    let uuid = "doslab.io/gpu-uuid";
    assert_eq!(annotation(&api, "q", uuid).as_deref(), Some("GPU-a"));
    assert_eq!(annotation(&api, "p", uuid).as_deref(), Some("GPU-b"));

    // The kubelet admits p next, on the GPU now assigned to it.
    let ids = ["b0", "b1", "b2", "b3"];
    let second = allocate(handle, wait, (1, ids), ok).await;
    assert_eq!(second.as_deref(), Ok("p"));
    let recorded = ledger(&api, "p").unwrap().to_string();
    assert!(recorded.contains("GPU-b"), "{recorded}");
}
