//! The daemon through what a node goes through: kubelet restarts, SIGHUP
//! reloads good and bad, GPUs failing and recovering, a plugin that cannot
//! start, with the real binary and signals sent for real.

mod support;

use std::time::Duration;

use support::*;

const GPU_A: &str = "GPU-aaaaaaaa-0000-4000-8000-000000000001";
const GPU_B: &str = "GPU-bbbbbbbb-0000-4000-8000-000000000002";
const MEM: &str = "doslab.io/gpu-memory";
const CORE: &str = "doslab.io/gpu-core";
const COUNT: &str = "doslab.io/gpu-count";
const GPUS: &[(&str, u64)] = &[(GPU_A, 3072), (GPU_B, 1024)];
/// Large lists: the kubelet takes long enough over each that a careless
/// re-registration loses the kubernetes#121994 race.
const BIG: &[(&str, u64)] = &[(GPU_A, 81920), (GPU_B, 81920)];

async fn start(extra: &str) -> (tempfile::TempDir, Daemon, KubeletSim) {
    let dir = tempfile::tempdir().unwrap();
    let (daemon, kubelet) = start_with_kubelet(dir.path(), &mock_config(dir.path(), extra, GPUS));
    (dir, daemon, kubelet)
}

/// What the kubelet lists once the daemon on [`GPUS`] first registered.
const FIRST: &[(&str, u32, usize)] = &[(MEM, 1, 4096), (CORE, 1, 200), (COUNT, 1, 2)];

/// [`start`], once every resource registered.
async fn started(extra: &str) -> (tempfile::TempDir, Daemon, KubeletSim) {
    let (dir, daemon, kubelet) = start(extra).await;
    expect(&kubelet, &daemon, FIRST).await;
    (dir, daemon, kubelet)
}

async fn expect(kubelet: &KubeletSim, daemon: &Daemon, want: &[(&str, u32, usize)]) {
    expect_kubelet(kubelet, daemon, &want, registered_times(want)).await;
}

/// Rewrites the daemon's config to `toml`, sends SIGHUP, and waits for
/// `want`.
async fn reload(kubelet: &KubeletSim, daemon: &Daemon, toml: String, want: &[(&str, u32, usize)]) {
    std::fs::write(&daemon.config, toml).unwrap();
    daemon.signal(libc::SIGHUP);
    expect(kubelet, daemon, want).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_100_kubelet_restarts_without_leaks() {
    let (dir, daemon, mut kubelet) = started("").await;
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
    let (dir, mut daemon, kubelet) = start("resources = [\"gpu-memory\", \"gpu-core\"]").await;
    expect(&kubelet, &daemon, &[(MEM, 1, 4096), (CORE, 1, 200)]).await;

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
    assert!(daemon.log_text().contains("config reloaded"));

    daemon.signal(libc::SIGTERM);
    assert!(daemon.wait_exit(Duration::from_secs(5)).unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_with_a_broken_file_keeps_the_old_config() {
    let (dir, daemon, kubelet) = started("").await;
    let log = || daemon.log_text();
    let broken = [
        "memory_unit_mib = \"lots\"",
        "resources = [\"gpu-mem\"]",
        "[[[",
        "memory_unit_mib = 0",
    ];
    // One at a time: pending signals of one kind coalesce.
    for (i, text) in broken.iter().enumerate() {
        std::fs::write(&daemon.config, text).unwrap();
        daemon.signal(libc::SIGHUP);
        let deadline = std::time::Instant::now() + WAIT;
        while log().matches("reload refused").count() <= i && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            log().matches("reload refused").count(),
            i + 1,
            "{text}:\n{}",
            log()
        );
    }
    assert!(
        log().contains("memory_unit_mib"),
        "the reason names the key"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
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

    std::fs::remove_file(health.path().join(GPU_A)).unwrap();
    expect(
        &kubelet,
        &daemon,
        &[(MEM, 1, 4096), (CORE, 1, 200), (COUNT, 1, 2)],
    )
    .await;
    let log = daemon.log_text();
    assert!(
        log.contains("GPU unhealthy") && log.contains("GPU healthy again"),
        "{log}"
    );
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
    let addr = http_addr(&daemon);
    let deadline = std::time::Instant::now() + WAIT;
    let mut readyz = http_get(&addr, "/readyz");
    while !readyz.1.contains("plugin gpu-core") && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        readyz = http_get(&addr, "/readyz");
    }
    assert_eq!(readyz.0, 503, "{}", readyz.1);
    assert!(readyz.1.contains("plugin gpu-core"), "{}", readyz.1);
    let log = daemon.log_text();
    assert!(log.contains("child ended; restarting"), "{log}");
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
    let (daemon, kubelet) = start_with_kubelet(dir.path(), &mock_config(dir.path(), "", BIG));
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

/// Seconds since midnight of a text log line's timestamp.
fn logged_at(line: &str) -> f64 {
    let time = line.split_whitespace().next().unwrap();
    let (_, clock) = time.split_once('T').unwrap();
    let mut parts = clock.trim_end_matches('Z').split(':');
    let mut secs = 0.0;
    for _ in 0..3 {
        secs = secs * 60.0 + parts.next().unwrap().parse::<f64>().unwrap();
    }
    secs
}

/// The number after `key=` in a text log line.
fn logged_number(line: &str, key: &str) -> Option<u64> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    line[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_socket_nobody_answers_yet_is_retried_on_time_not_per_event() {
    let dir = tempfile::tempdir().unwrap();
    // kubelet.sock is there, but no kubelet listens on it yet.
    drop(std::os::unix::net::UnixListener::bind(dir.path().join("kubelet.sock")).unwrap());
    let daemon = Daemon::start(&mock_config(
        dir.path(),
        "resources = [\"gpu-memory\"]",
        GPUS,
    ));
    // A storm of filesystem events, each one a reason to check.
    let storm = std::time::Instant::now();
    let mut i = 0;
    while storm.elapsed() < Duration::from_millis(1500) {
        let noise = dir.path().join(format!("noise-{}.sock", i % 4));
        std::fs::write(&noise, "").unwrap();
        std::fs::remove_file(&noise).unwrap();
        i += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let log = daemon.log_text();
    let attempts: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("registration failed") || l.contains("early registration attempt"))
        .collect();
    let scheduled: Vec<(f64, u64)> = attempts
        .iter()
        .filter_map(|l| Some((logged_at(l), logged_number(l, "retry_in_ms")?)))
        .collect();
    assert!(scheduled.len() >= 3, "{log}");
    for (n, pair) in scheduled.windows(2).enumerate() {
        let ((then, delay), (now, next)) = (pair[0], pair[1]);
        assert_eq!(next, (delay * 2).min(2000), "attempt {n}:\n{log}");
        assert!(
            (now - then) * 1000.0 >= delay as f64 - 2.0,
            "attempt {n} came {:.1} ms after the one before, not {delay} ms:\n{log}",
            (now - then) * 1000.0
        );
    }
    // Between two scheduled attempts, events bring at most one early one.
    let mut early = 0;
    for line in &attempts {
        if logged_number(line, "retry_in_ms").is_some() {
            early = 0;
        } else {
            early += 1;
            assert!(early <= 1, "{log}");
        }
    }

    let kubelet = KubeletSim::start(dir.path()).unwrap();
    expect(&kubelet, &daemon, &[(MEM, 1, 4096)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_changing_two_resources_settles_them_side_by_side() {
    let (dir, daemon, kubelet) = started("").await;
    let before = daemon.log_text().len();
    let next = mock_config(dir.path(), "memory_unit_mib = 2\ncores_per_gpu = 50", GPUS);
    reload(
        &kubelet,
        &daemon,
        next,
        &[(MEM, 2, 2048), (CORE, 2, 100), (COUNT, 1, 2)],
    )
    .await;
    // From the old plugin's end on: the kubelet may count a registration
    // before the plugin has logged it, so older lines can follow `before`,
    // and the new plugin's line can come after the kubelet saw it.
    fn after_stop(lines: &[&str], what: &str, resource: &str) -> Option<(usize, usize)> {
        let of = |l: &&str| l.contains(&format!("resource={resource}"));
        let from = lines.iter().position(|l| l.contains(" stopped") && of(l))?;
        let at = lines[from..]
            .iter()
            .position(|l| l.contains(what) && of(l))?;
        Some((from, from + at))
    }
    let deadline = std::time::Instant::now() + WAIT;
    let log = loop {
        let log = daemon.log_text();
        let lines: Vec<&str> = log[before..].lines().collect();
        if ["gpu-memory", "gpu-core"]
            .iter()
            .all(|r| after_stop(&lines, "registered with the kubelet", r).is_some())
        {
            break log;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no registration logged after the reload:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let reload: Vec<&str> = log[before..].lines().collect();
    let after_stop = |what: &str, resource: &str| {
        after_stop(&reload, what, resource)
            .unwrap_or_else(|| panic!("no {what:?} for {resource} after it stopped:\n{log}"))
    };
    let resources = ["gpu-memory", "gpu-core"];
    // Each new plugin waits out the settle pause (kubernetes#121994)...
    for r in resources {
        let (stopped, registered) = after_stop("registered with the kubelet", r);
        let paused = logged_at(reload[registered]) - logged_at(reload[stopped]);
        assert!(
            paused >= 0.2,
            "{r} re-registered {paused:.3} s after it stopped:\n{log}"
        );
    }
    // ...but both pauses run at once: the second starts before the first
    // has ended in a registration.
    let settles = resources.map(|r| after_stop("settling before registering", r).1);
    let registered = resources.map(|r| after_stop("registered with the kubelet", r).1);
    assert!(
        settles.iter().max() < registered.iter().min(),
        "the settle pauses ran one after the other:\n{log}"
    );
}
