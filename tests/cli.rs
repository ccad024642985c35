//! The binary's command line: bad configs are refused with the key named,
//! check-config prints the plan, the demo runs end to end.

#![cfg(feature = "sim")]

mod support;

use support::*;

#[test]
fn a_config_over_the_4_mib_limit_is_refused_with_the_unit_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    let gpus: Vec<(String, u64)> = (0..8).map(|i| (format!("GPU-{i}"), 81920)).collect();
    let gpus: Vec<(&str, u64)> = gpus.iter().map(|(u, m)| (u.as_str(), *m)).collect();
    let toml = mock_config(dir.path(), "", &gpus);
    let path = dir.path().join("c.toml");
    std::fs::write(&path, toml).unwrap();
    for cmd in [vec!["--config"], vec!["check-config", "--config"]] {
        let mut args: Vec<&str> = cmd.clone();
        args.push(path.to_str().unwrap());
        let (status, _, stderr) = run_to_end(&args, &[]);
        assert!(!status.success(), "{cmd:?}");
        assert!(stderr.contains("memory_unit_mib"), "{stderr}");
        assert!(
            stderr.contains("smallest memory_unit_mib that fits is 3"),
            "{stderr}"
        );
    }
    assert!(plugin_sockets(dir.path()).is_empty(), "nothing was served");
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
fn nvml_absence_is_a_clear_error_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nvml.toml");
    let toml = format!(
        "pod_matching = false\ndevice_plugin_dir = {:?}",
        dir.path().display().to_string()
    );
    std::fs::write(&path, toml).unwrap();
    let (status, _, stderr) =
        run_to_end(&["check-config", "--config", path.to_str().unwrap()], &[]);
    if status.success() {
        return; // a machine with a GPU: nothing to check here
    }
    assert_eq!(
        status.code(),
        Some(1),
        "an error exit, not a signal: {stderr}"
    );
    assert!(
        stderr.contains("NVML") && stderr.contains("mock"),
        "{stderr}"
    );
}

#[test]
fn check_config_prints_the_plan() {
    let (status, stdout, stderr) =
        run_to_end(&["check-config", "--config", "config/local-mock.toml"], &[]);
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.contains("doslab.io/gpu-memory") && stdout.contains("32768 devices"),
        "{stdout}"
    );
    assert!(
        stdout.contains("doslab.io/gpu-core") && stdout.contains("200 devices"),
        "{stdout}"
    );
}

#[test]
fn demo_runs_end_to_end() {
    let (status, stdout, stderr) = run_to_end(&["demo"], &[]);
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.contains("doslab.io/gpu-memory      188416    188416"),
        "{stdout}"
    );
    assert!(
        stdout.contains("CUDA_DEVICE_MEMORY_LIMIT_0=40960m"),
        "{stdout}"
    );
    assert!(stdout.contains("unknown device ID"), "{stdout}");
    // Pod matching: the scheduler's GPU is honoured, the too-big pod is
    // refused with an Event, every served pod is marked assigned.
    let pinned = stdout.split("pod pinned").nth(1).unwrap_or_default();
    assert!(
        pinned.lines().nth(1).unwrap_or_default().contains(
            "CUDA_DEVICE_MEMORY_LIMIT_0=8000m CUDA_DEVICE_SM_LIMIT=20 DOSLAB_IO_GPU_CORE=20 \
             DOSLAB_IO_GPU_MEMORY=8000 NVIDIA_VISIBLE_DEVICES=GPU-0a9f6c24"
        ),
        "{stdout}"
    );
    assert_eq!(stdout.matches("gpu-assigned=true").count(), 5, "{stdout}");
    assert!(stdout.contains("too-big GpuAllocateFailed"), "{stdout}");
    assert!(
        stdout.contains("streams ended: yes; plugin sockets left: 0"),
        "{stdout}"
    );
}

#[test]
fn json_logs_are_one_object_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let toml = mock_config(dir.path(), "log_format = \"json\"", &[("GPU-a", 64)]);
    let mut daemon = Daemon::start(&toml);
    let deadline = std::time::Instant::now() + WAIT;
    while !daemon.log_text().contains("waiting for the kubelet")
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    daemon.signal(libc::SIGTERM);
    assert!(daemon.wait_exit(WAIT).unwrap().success());
    let log = daemon.log_text();
    let lines: Vec<&str> = log.lines().collect();
    assert!(lines.len() > 3, "{log}");
    for line in lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            v["level"].is_string() && v["fields"]["message"].is_string(),
            "{line}"
        );
    }
}
