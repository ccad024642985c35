//! The binary's command line: bad configs are refused with the key named,
//! check-config prints the plan.

mod support;

use support::*;

/// The daemon exits at start and check-config fails on `toml`, both
/// naming every one of `names`.
fn refused_at_start_and_by_check_config(toml: &str, names: &[&str]) {
    let mut daemon = Daemon::start(toml);
    let status = daemon.wait_exit(WAIT);
    let log = daemon.log_text();
    assert!(status.is_some_and(|s| !s.success()), "{status:?}: {log}");
    let config = daemon.config.to_str().unwrap();
    let (status, stdout, stderr) = run_to_end(&["check-config", "--config", config], &[]);
    assert!(!status.success(), "check-config: {stdout}");
    for name in names {
        assert!(log.contains(name), "start, {name}: {log}");
        assert!(stderr.contains(name), "check-config, {name}: {stderr}");
    }
}

#[test]
fn a_config_over_the_4_mib_limit_is_refused_with_the_unit_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    let gpus: Vec<(String, u64)> = (0..8).map(|i| (format!("GPU-{i}"), 81920)).collect();
    let gpus: Vec<(&str, u64)> = gpus.iter().map(|(u, m)| (u.as_str(), *m)).collect();
    refused_at_start_and_by_check_config(
        &mock_config(dir.path(), "", &gpus),
        &["memory_unit_mib", "smallest memory_unit_mib that fits is 3"],
    );
    assert!(plugin_sockets(dir.path()).is_empty(), "nothing was served");
}

#[test]
fn a_memory_unit_larger_than_a_gpu_is_refused_naming_the_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let gpus = [("GPU-big", 81920), ("GPU-small", 24576)];
    refused_at_start_and_by_check_config(
        &mock_config(dir.path(), "memory_unit_mib = 32768", &gpus),
        &["memory_unit_mib", "GPU-small", "24576"],
    );
    assert!(plugin_sockets(dir.path()).is_empty(), "nothing was served");
}

#[test]
fn a_socket_directory_the_kernel_cannot_bind_in_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let gpus = [("GPU-a", 64)];
    // A file where the directory should be: every bind would fail.
    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    refused_at_start_and_by_check_config(
        &mock_config(&file, "", &gpus),
        &["device_plugin_dir", "Not a directory"],
    );
    // Socket paths over 107 bytes.
    let long = dir.path().join("d".repeat(100));
    std::fs::create_dir(&long).unwrap();
    refused_at_start_and_by_check_config(
        &mock_config(&long, "", &gpus),
        &["device_plugin_dir", "at most 107"],
    );
    // A directory that does not exist: the daemon refuses it (the kubelet
    // owns it, the DaemonSet mounts it); check-config, maybe off the node,
    // only notes it.
    let missing = dir.path().join("missing");
    let mut daemon = Daemon::start(&mock_config(&missing, "", &gpus));
    let status = daemon.wait_exit(WAIT);
    let log = daemon.log_text();
    assert!(status.is_some_and(|s| !s.success()), "{log}");
    assert!(
        log.contains("device_plugin_dir") && log.contains("No such file"),
        "{log}"
    );
    assert!(!missing.exists(), "the daemon made the kubelet's directory");
    let config = daemon.config.to_str().unwrap();
    let (status, stdout, stderr) = run_to_end(&["check-config", "--config", config], &[]);
    assert!(status.success(), "{stderr}");
    assert!(stdout.contains("note: device_plugin_dir"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_to_a_socket_directory_that_cannot_work_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let gpus = [("GPU-a", 64)];
    let want = [
        ("doslab.io/gpu-memory", 64),
        ("doslab.io/gpu-core", 100),
        ("doslab.io/gpu-count", 1),
    ];
    let (daemon, kubelet) =
        start_listed(dir.path(), &mock_config(dir.path(), "", &gpus), &want).await;
    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    daemon.rewrite(&mock_config(&file, "", &gpus));
    let addr = &daemon.http;
    wait_for_sample(addr, RELOADS_REFUSED, 1.0).await;
    assert_eq!(metric(addr, RELOADS_APPLIED), Some(0.0));
    // Why: the log says, and so does the reload's outcome.
    let why = daemon.last_reload();
    assert!(
        matches!(&why, Some(Reloaded::Refused(e)) if e.contains("device_plugin_dir")),
        "{why:?}"
    );
    // The old config keeps serving, on the same sockets: the refusal was
    // counted once decided, and nothing moved.
    assert!(kubelet.wait_until(WAIT, all_listed(&want)).await);
    assert_eq!(plugin_sockets(dir.path()).len(), 3);
}

#[test]
fn bad_configs_exit_non_zero_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("memory_unit = 4", "memory_unit"),
        ("cores_per_gpu = 7", "cores_per_gpu"),
        ("resources = [\"gpu-mem\"]", "gpu-mem"),
        ("pod_matching = \"yes\"", "pod_matching"),
    ];
    for (toml, key) in cases {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, toml).unwrap();
        let (status, _, stderr) =
            run_to_end(&["--config", path.to_str().unwrap()], &[("NODE_NAME", "n")]);
        assert!(!status.success(), "{toml}");
        assert!(stderr.contains(key), "{toml}: {stderr}");
    }
    let (status, _, stderr) = run_to_end(&["--config", "/nonexistent/x.toml"], &[]);
    assert!(!status.success());
    assert!(stderr.contains("/nonexistent/x.toml"), "{stderr}");
}

#[test]
fn without_nvml_the_daemon_fails_at_start_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "pod_matching = false\ndevice_plugin_dir = {:?}",
        dir.path().display().to_string()
    );
    let mut daemon = Daemon::start(&toml);
    let status = daemon.wait_exit(WAIT).expect("the daemon exits");
    if status.success() {
        return; // a machine with a GPU: nothing to check here
    }
    let log = daemon.log_text();
    assert_eq!(status.code(), Some(1), "an error exit, not a signal: {log}");
    assert!(log.contains("NVML") && log.contains("mock"), "{log}");
}

#[test]
fn check_config_validates_the_shipped_config_off_a_gpu_node() {
    let shipped = ["check-config", "--config", "config/gpu-device-plugin.toml"];
    let (status, stdout, stderr) = run_to_end(&shipped, &[]);
    assert!(status.success(), "{stdout}{stderr}");
    assert!(stdout.starts_with("config OK"), "{stdout}");
    if !stdout.contains("NVML") {
        return; // a GPU node: the plan is printed instead
    }
    assert!(
        stdout.contains("the device plan needs the node's GPUs"),
        "{stdout}"
    );
    if std::env::var_os("NODE_NAME").is_none() {
        assert!(
            stdout.contains("note: ") && stdout.contains("NODE_NAME"),
            "{stdout}"
        );
    }
    // The values are still checked.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    let text = std::fs::read_to_string("config/gpu-device-plugin.toml").unwrap();
    std::fs::write(
        &bad,
        text.replace("cores_per_gpu = 100", "cores_per_gpu = 30"),
    )
    .unwrap();
    let (status, _, stderr) = run_to_end(&["check-config", "--config", bad.to_str().unwrap()], &[]);
    assert!(
        !status.success() && stderr.contains("cores_per_gpu"),
        "{stderr}"
    );
}

#[test]
fn check_config_prints_the_gpus_and_the_plan() {
    let (status, stdout, stderr) =
        run_to_end(&["check-config", "--config", "config/local-mock.toml"], &[]);
    assert!(status.success(), "{stderr}");
    for gpu in [
        "GPU 0 GPU-11111111-2222-4333-8444-555555555555  16384 MiB  NUMA node 0",
        "GPU 1 GPU-66666666-7777-4888-9999-aaaaaaaaaaaa  16384 MiB  NUMA node 0",
    ] {
        assert!(stdout.contains(gpu), "{stdout}");
    }
    assert!(
        stdout.contains("doslab.io/gpu-memory") && stdout.contains("32768 devices"),
        "{stdout}"
    );
    assert!(
        stdout.contains("doslab.io/gpu-core") && stdout.contains("200 devices"),
        "{stdout}"
    );
}
