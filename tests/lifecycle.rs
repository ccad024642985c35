//! The daemon through what a node goes through: kubelet restarts, reloads
//! good and bad, GPUs failing and recovering, a plugin that cannot start.
//! In-process, but for the leak count (the process's descriptors and
//! threads), where the real binary runs.

mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpu_device_plugin::api::registration_server::{Registration, RegistrationServer};
use gpu_device_plugin::api::{Empty, RegisterRequest};
use gpu_device_plugin::node::config_watch::digest;
use support::*;
use tonic::{Request, Response, Status};

const GPU_A: &str = "GPU-aaaaaaaa-0000-4000-8000-000000000001";
const GPU_B: &str = "GPU-bbbbbbbb-0000-4000-8000-000000000002";
const MEM: &str = "doslab.io/gpu-memory";
const CORE: &str = "doslab.io/gpu-core";
const COUNT: &str = "doslab.io/gpu-count";
const GPUS: &[(&str, u64)] = &[(GPU_A, 3072), (GPU_B, 1024)];
/// Large lists: the kubelet takes long enough over each that a careless
/// re-registration loses the kubernetes#121994 race.
const BIG: &[(&str, u64)] = &[(GPU_A, 81920), (GPU_B, 81920)];

async fn start(extra: &str) -> (tempfile::TempDir, App, KubeletSim) {
    let dir = tempfile::tempdir().unwrap();
    let (daemon, kubelet) =
        start_with_kubelet(dir.path(), &mock_config(dir.path(), extra, GPUS)).await;
    (dir, daemon, kubelet)
}

/// The binary on [`GPUS`] beside a kubelet, once every resource registered.
async fn started_binary() -> (tempfile::TempDir, Daemon, KubeletSim) {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(&mock_config(dir.path(), "", GPUS));
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    expect(&kubelet, &daemon, FIRST).await;
    (dir, daemon, kubelet)
}

/// What the kubelet lists once the daemon on [`GPUS`] first registered.
const FIRST: &[(&str, u32, usize)] = &[(MEM, 1, 4096), (CORE, 1, 200), (COUNT, 1, 2)];

/// [`start`], once every resource registered.
async fn started(extra: &str) -> (tempfile::TempDir, App, KubeletSim) {
    let (dir, daemon, kubelet) = start(extra).await;
    expect(&kubelet, &daemon, FIRST).await;
    (dir, daemon, kubelet)
}

async fn expect(kubelet: &KubeletSim, daemon: &impl Observed, want: &[(&str, u32, usize)]) {
    expect_kubelet(kubelet, daemon, &want, registered_times(want)).await;
}

/// Rewrites the daemon's config to `toml`, tells it to reload, and waits
/// for `want`.
async fn reload(kubelet: &KubeletSim, daemon: &App, toml: String, want: &[(&str, u32, usize)]) {
    daemon.rewrite(&toml);
    expect(kubelet, daemon, want).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_100_kubelet_restarts_without_leaks() {
    // The binary: its descriptors and threads are counted.
    let (dir, daemon, mut kubelet) = started_binary().await;
    let pid = daemon.child.id();
    let mut first = None;
    for i in 2..=101u32 {
        kubelet.restart().await.unwrap();
        expect(
            &kubelet,
            &daemon,
            &[(MEM, i, 4096), (CORE, i, 200), (COUNT, i, 2)],
        )
        .await;
        let mut sockets = plugin_sockets(dir.path());
        sockets.sort();
        assert_eq!(sockets.len(), 3, "{sockets:?}");
        if i == 11 {
            // Counted after the runtime has warmed up its threads.
            first = Some(fds_and_threads(pid));
        }
    }
    let (fds0, threads0) = first.unwrap();
    let (fds, threads) = fds_and_threads(pid);
    assert!(
        fds <= fds0 + 4,
        "file descriptors grew from {fds0} to {fds}"
    );
    assert!(
        threads <= threads0 + 2,
        "threads grew from {threads0} to {threads}"
    );
    for (name, v) in kubelet.snapshot() {
        assert!(v.stream_error.is_none(), "{name}: {:?}", v.stream_error);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_disables_enables_and_changes_only_what_changed() {
    let (dir, daemon, kubelet) = start("resources = [\"gpu-memory\", \"gpu-core\"]").await;
    expect(&kubelet, &daemon, &[(MEM, 1, 4096), (CORE, 1, 200)]).await;
    let addr = daemon.http.clone();

    // gpu-memory changes (2 MiB units), gpu-core goes, gpu-count comes.
    let next = mock_config(
        dir.path(),
        "resources = [\"gpu-memory\", \"gpu-count\"]\nmemory_unit_mib = 2",
        GPUS,
    );
    reload(&kubelet, &daemon, next, &[(MEM, 2, 2048), (COUNT, 1, 2)]).await;
    let core = kubelet.snapshot()[CORE].clone();
    assert!(
        !core.stream_open && core.devices == 0,
        "gpu-core ended with an empty list: {core:?}"
    );
    let mut sockets = plugin_sockets(dir.path());
    sockets.sort();
    assert_eq!(
        sockets,
        vec!["doslab.io-gpu-count.sock", "doslab.io-gpu-memory.sock"]
    );

    // gpu-core back; gpu-memory and gpu-count untouched (not re-registered).
    let again = mock_config(dir.path(), "memory_unit_mib = 2", GPUS);
    reload(
        &kubelet,
        &daemon,
        again,
        &[(MEM, 2, 2048), (CORE, 2, 200), (COUNT, 1, 2)],
    )
    .await;
    wait_for_sample(&addr, RELOADS_APPLIED, 2.0).await;
    assert_eq!(metric(&addr, RELOADS_REFUSED), Some(0.0));
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_of_a_broken_file_keeps_the_old_config() {
    let (dir, daemon, kubelet) = started("").await;
    let addr = daemon.http.clone();
    let serving = digest(mock_config(dir.path(), "", GPUS).as_bytes());
    assert_eq!(config_sha(&addr), serving);
    let broken = [
        "memory_unit_mib = \"lots\"",
        "resources = [\"gpu-mem\"]",
        "[[[",
        "memory_unit_mib = 0",
    ];
    for (i, text) in broken.iter().enumerate() {
        daemon.rewrite(text);
        wait_for_sample(&addr, RELOADS_REFUSED, (i + 1) as f64).await;
        if i == 0 {
            // Why: the log says, and so does the reload's outcome.
            let Some(Reloaded::Refused(why)) = daemon.last_reload() else {
                panic!("{:?}", daemon.last_reload())
            };
            assert!(
                why.contains("memory_unit_mib"),
                "the reason names the key: {why}"
            );
        }
    }
    assert_eq!(metric(&addr, RELOADS_APPLIED), Some(0.0));
    assert_eq!(config_sha(&addr), serving, "the old config serves on");
    // Each refusal was counted once it was decided: nothing moved.
    expect(&kubelet, &daemon, FIRST).await;
    assert_eq!(plugin_sockets(dir.path()).len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_gpu_turns_its_devices_unhealthy_everywhere_and_back() {
    let health = tempfile::tempdir().unwrap();
    let extra = format!(
        "[health]\npoll_ms = 50\nrecovery_ms = 300\nmock_dir = {:?}",
        health.path().display().to_string()
    );
    let (_dir, daemon, kubelet) = started(&extra).await;
    let addr = daemon.http.clone();
    let healthy = |uuid: &str| format!("gpu_device_plugin_gpu_healthy{{gpu=\"{uuid}\"}}");

    std::fs::write(health.path().join(GPU_A), "").unwrap();
    let degraded = |s: &std::collections::BTreeMap<String, ResourceView>| {
        [(MEM, 1024), (CORE, 100), (COUNT, 1)].iter().all(|(n, h)| {
            s.get(*n)
                .is_some_and(|v| v.stream_open && v.healthy == *h && v.devices > *h)
        })
    };
    assert!(
        kubelet.wait_until(WAIT, degraded).await,
        "{:?}",
        kubelet.snapshot()
    );
    // GPU A's devices cannot be allocated while it is unhealthy.
    assert_eq!(kubelet.free_devices(MEM).len(), 1024);
    wait_for_sample(&addr, &healthy(GPU_A), 0.0).await;
    assert_eq!(metric(&addr, &healthy(GPU_B)), Some(1.0));

    std::fs::remove_file(health.path().join(GPU_A)).unwrap();
    expect(
        &kubelet,
        &daemon,
        &[(MEM, 1, 4096), (CORE, 1, 200), (COUNT, 1, 2)],
    )
    .await;
    wait_for_sample(&addr, &healthy(GPU_A), 1.0).await;
}

/// Found by the chaos test: a reload restarts the health monitor, and a new
/// monitor that only reported changes left a GPU that recovered meanwhile
/// unhealthy for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_recovering_while_a_reload_restarts_the_monitor_is_healthy_again() {
    let health = tempfile::tempdir().unwrap();
    // A recovery window longer than the test: only the new monitor can
    // find the GPU healthy.
    let extra = |recovery_ms: u32| {
        format!(
            "[health]\npoll_ms = 50\nrecovery_ms = {recovery_ms}\nmock_dir = {:?}",
            health.path().display().to_string()
        )
    };
    let (dir, daemon, _kubelet) = started(&extra(600_000)).await;
    let addr = daemon.http.clone();
    let healthy = format!("gpu_device_plugin_gpu_healthy{{gpu=\"{GPU_A}\"}}");
    std::fs::write(health.path().join(GPU_A), "").unwrap();
    wait_for_sample(&addr, &healthy, 0.0).await;

    std::fs::remove_file(health.path().join(GPU_A)).unwrap();
    daemon.rewrite(&mock_config(dir.path(), &extra(599_000), GPUS));
    wait_for_sample(&addr, &healthy, 1.0).await;
    wait_for_sample(&addr, RELOADS_APPLIED, 1.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_cannot_start_is_retried_and_the_others_keep_serving() {
    let (dir, daemon, kubelet) = started("").await;
    // Something else takes gpu-core's socket path: its plugin must restart
    // its server (the socket is gone) and fails to bind, again and again.
    let socket = dir.path().join("doslab.io-gpu-core.sock");
    std::fs::remove_file(&socket).unwrap();
    std::fs::create_dir(&socket).unwrap();
    std::fs::write(socket.join("blocker"), "").unwrap();
    let failing = |s: &std::collections::BTreeMap<String, ResourceView>| {
        s.get(CORE).is_some_and(|v| !v.stream_open)
    };
    assert!(kubelet.wait_until(WAIT, failing).await);
    // A child that keeps failing makes the daemon not ready, by name.
    let addr = daemon.http.clone();
    let readyz = daemon
        .readyz_until(|_, body| body.contains("plugin gpu-core"))
        .await;
    assert_eq!(readyz.0, 503, "{}", readyz.1);
    assert!(readyz.1.contains("plugin gpu-core"), "{}", readyz.1);
    // Unready after three failed starts in a row, each one restarted.
    let restarts = "gpu_device_plugin_child_restarts_total{child=\"plugin gpu-core\"}";
    let (_, m) = http_get(&addr, "/metrics");
    assert!(sample(&m, restarts).is_some_and(|n| n >= 3.0), "{m}");
    assert!(
        !m.contains("child_restarts_total{child=\"plugin gpu-memory\"}"),
        "{m}"
    );
    // The other resources were never disturbed.
    expect(&kubelet, &daemon, &[(MEM, 1, 4096), (COUNT, 1, 2)]).await;

    std::fs::remove_dir_all(&socket).unwrap();
    expect(
        &kubelet,
        &daemon,
        &[(MEM, 1, 4096), (CORE, 2, 200), (COUNT, 1, 2)],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_reloads_in_a_row_each_re_register_the_changed_resource() {
    let dir = tempfile::tempdir().unwrap();
    let (daemon, kubelet) = start_with_kubelet(dir.path(), &mock_config(dir.path(), "", BIG)).await;
    expect(
        &kubelet,
        &daemon,
        &[(MEM, 1, 163840), (CORE, 1, 200), (COUNT, 1, 2)],
    )
    .await;
    for i in 0..20u32 {
        let unit = if i % 2 == 0 { 2 } else { 1 };
        let toml = mock_config(dir.path(), &format!("memory_unit_mib = {unit}"), BIG);
        let devices = 163840 / unit as usize;
        reload(
            &kubelet,
            &daemon,
            toml,
            &[(MEM, i + 2, devices), (CORE, 1, 200), (COUNT, 1, 2)],
        )
        .await;
    }
}

/// A kubelet that refuses every registration, noting when each came.
struct RefusingKubelet(Arc<Mutex<Vec<Instant>>>);

#[tonic::async_trait]
impl Registration for RefusingKubelet {
    async fn register(&self, _: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        self.0.lock().unwrap().push(Instant::now());
        Err(Status::unavailable("not ready yet"))
    }
}

/// Serves a [`RefusingKubelet`] on `<dir>/kubelet.sock`; returns the
/// registration attempts it sees and its task.
fn refusing_kubelet(
    dir: &std::path::Path,
) -> (Arc<Mutex<Vec<Instant>>>, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::UnixListener::bind(dir.join("kubelet.sock")).unwrap();
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let server = RegistrationServer::new(RefusingKubelet(attempts.clone()));
    let task = tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        tonic::transport::Server::builder()
            .add_service(server)
            .serve_with_incoming(incoming)
            .await
            .unwrap();
    });
    (attempts, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_socket_nobody_answers_yet_is_retried_on_time_not_per_event() {
    let dir = tempfile::tempdir().unwrap();
    // A kubelet is there, but refuses to register anything yet.
    let (attempts, refusing) = refusing_kubelet(dir.path());
    let daemon = App::start(&mock_config(
        dir.path(),
        "resources = [\"gpu-memory\"]",
        GPUS,
    ))
    .await;
    // A storm of filesystem events for 1.5 s, one every 2 ms, each one a
    // reason to check.
    let storm = std::time::Instant::now();
    let mut pace = tokio::time::interval(Duration::from_millis(2));
    let mut i = 0;
    while storm.elapsed() < Duration::from_millis(1500) {
        pace.tick().await;
        let noise = dir.path().join(format!("noise-{}.sock", i % 4));
        std::fs::write(&noise, "").unwrap();
        std::fs::remove_file(&noise).unwrap();
        i += 1;
    }
    refusing.abort();
    let attempts = attempts.lock().unwrap().clone();
    assert!(attempts.len() >= 3, "{attempts:?}\n{}", daemon.shown());
    // The retries are scheduled 100, 200, 400, ... ms after each failure,
    // so the k-th window opens no earlier than 100 * (2^k - 1) ms after the
    // first attempt; events bring at most one early attempt per window.
    // Attempts per event, or on a fixed period, come more often.
    let first = attempts[0];
    for (n, at) in attempts.iter().enumerate() {
        let ms = at.duration_since(first).as_millis() as u64;
        let windows = (0..11u32)
            .take_while(|k| 100 * ((1 << k) - 1) <= ms)
            .count();
        assert!(
            n < 2 * windows,
            "attempt {n} came {ms} ms after the first, in window {windows}: {:?}\n{}",
            attempts
                .iter()
                .map(|a| a.duration_since(first).as_millis())
                .collect::<Vec<_>>(),
            daemon.shown()
        );
    }

    let kubelet = KubeletSim::start(dir.path()).unwrap();
    expect(&kubelet, &daemon, &[(MEM, 1, 4096)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_changing_two_resources_settles_them_side_by_side() {
    let (dir, daemon, kubelet) = started("").await;
    let before = kubelet.snapshot();
    let next = mock_config(dir.path(), "memory_unit_mib = 2\ncores_per_gpu = 50", GPUS);
    std::fs::write(&daemon.config, next).unwrap();
    let sent = Instant::now();
    daemon.reload();
    // When the kubelet saw each new registration. It may see one late,
    // never early, so the pauses below are never taken for longer than
    // they were.
    let registered: Mutex<BTreeMap<&str, Instant>> = Mutex::default();
    let want = [(MEM, 2, 2048), (CORE, 2, 100), (COUNT, 1, 2)];
    let settled = registered_times(&want);
    let resources = [MEM, CORE];
    let ok = kubelet
        .wait_until(WAIT, |s| {
            for r in resources {
                if s[r].registrations > before[r].registrations {
                    registered
                        .lock()
                        .unwrap()
                        .entry(r)
                        .or_insert_with(Instant::now);
                }
            }
            settled(s)
        })
        .await;
    assert!(ok, "{:#?}\n{}", kubelet.snapshot(), daemon.shown());
    let registered = registered.into_inner().unwrap();
    // Each new plugin waits out the settle pause (kubernetes#121994) after
    // its old stream ended, which was after the reload began...
    for r in resources {
        let paused = registered[r] - sent;
        assert!(
            paused >= Duration::from_millis(200),
            "{r} re-registered {paused:?} after the reload began:\n{}",
            daemon.shown()
        );
    }
    // ...but both pauses run at once: one after the other, the second
    // registration would come a whole pause after the first.
    let apart = registered[MEM].max(registered[CORE]) - registered[MEM].min(registered[CORE]);
    assert!(
        apart < Duration::from_millis(200),
        "the settle pauses ran one after the other: registrations {apart:?} apart\n{}",
        daemon.shown()
    );
}
