//! Config that rolls out by itself, and what `/metrics` tells about it and
//! about each GPU: the real binary on a config mounted the way the kubelet
//! mounts a ConfigMap, edited the way the kubelet edits it, beside the
//! kubelet and API-server stand-ins (where the endpoint moves, and the
//! per-GPU series, in-process).

mod support;

use std::time::{Duration, Instant};

use gpu_device_plugin::node::config_watch::digest;
use gpu_sim::apiserver::{ApiServerSim, PodContainer};
use gpu_sim::kubelet::swap_configmap;
use support::*;

const MEM: &str = "doslab.io/gpu-memory";
const CORE: &str = "doslab.io/gpu-core";
const COUNT: &str = "doslab.io/gpu-count";

/// Edits the daemon's ConfigMap to `text` as version `version` (2 on).
fn edit(daemon: &Daemon, version: u32, text: &str) {
    swap_configmap(daemon.config.parent().unwrap(), version, text).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_edit_rolls_out_and_a_broken_one_is_refused_once() {
    let dir = tempfile::tempdir().unwrap();
    let gpus = [("GPU-a", 1024)];
    let toml = mock_config(dir.path(), "watch_config = true", &gpus);
    let daemon = Daemon::start_configmap(&toml, &[]);
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    assert!(
        kubelet
            .wait_until(WAIT, all_listed(&[(MEM, 1024), (CORE, 100), (COUNT, 1)]))
            .await,
        "{}",
        daemon.log_text()
    );
    let addr = http_addr(&daemon);
    assert_eq!(config_sha(&addr), digest(toml.as_bytes()));
    let (_, m) = http_get(&addr, "/metrics");
    let loaded_at = sample(&m, "gpu_device_plugin_config_last_reload_timestamp_seconds").unwrap();
    assert!(loaded_at > 0.0, "{m}");
    assert_eq!(
        sample(
            &m,
            "gpu_device_plugin_config_last_refused_timestamp_seconds"
        ),
        Some(0.0)
    );

    // A new unit: gpu-memory registers again with half the devices.
    let halved = mock_config(
        dir.path(),
        "watch_config = true\nmemory_unit_mib = 2",
        &gpus,
    );
    edit(&daemon, 2, &halved);
    assert!(
        kubelet
            .wait_until(WAIT, registered_times(&[(MEM, 2, 512), (CORE, 1, 100)]))
            .await,
        "{:?}\n{}",
        kubelet.snapshot(),
        daemon.log_text()
    );
    assert_eq!(config_sha(&addr), digest(halved.as_bytes()));
    let (_, m) = http_get(&addr, "/metrics");
    let reloaded_at = sample(&m, "gpu_device_plugin_config_last_reload_timestamp_seconds");
    assert!(reloaded_at.unwrap() >= loaded_at, "{m}");

    // A broken edit: refused once, however long it stays, and the old
    // config keeps serving.
    edit(&daemon, 3, "memory_unit_mib = 0\n");
    wait_for_sample(&addr, RELOADS_REFUSED, 1.0).await;
    // (Why it was refused, the reason naming the key, is checked on the
    // daemon in-process: lifecycle's broken-file reload.)
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        metric(&addr, RELOADS_REFUSED),
        Some(1.0),
        "{}",
        daemon.log_text()
    );
    assert_eq!(metric(&addr, RELOADS_APPLIED), Some(1.0));
    assert_eq!(config_sha(&addr), digest(halved.as_bytes()));
    let (_, m) = http_get(&addr, "/metrics");
    let refused_at = sample(
        &m,
        "gpu_device_plugin_config_last_refused_timestamp_seconds",
    );
    assert!(refused_at.unwrap() > 0.0, "{m}");
    let snapshot = kubelet.snapshot();
    assert!(
        snapshot[MEM].stream_open && snapshot[MEM].devices == 512,
        "{snapshot:?}"
    );
    assert_eq!(http_get(&addr, "/healthz").0, 200);
    kubelet.admit(&[(MEM, 4)]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_listen_moves_on_reload_or_is_refused_when_it_cannot() {
    let dir = tempfile::tempdir().unwrap();
    let gpus = [("GPU-a", 1024)];
    let daemon = App::start(&mock_config(dir.path(), "", &gpus)).await;
    let old = daemon.http.clone();
    assert_eq!(http_get(&old, "/healthz").0, 200);

    // An address in use: refused, saying why, and the old one serves on.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    // mock_config's own http_listen comes first; TOML refuses a duplicate,
    // so the key is swapped in place.
    let with_listen = |line: &str| {
        mock_config(dir.path(), "", &gpus).replace("http_listen = \"127.0.0.1:0\"", line)
    };
    daemon.rewrite(&with_listen(&format!("http_listen = \"{taken_addr}\"")));
    wait_for_sample(&old, RELOADS_REFUSED, 1.0).await;
    let why = daemon.last_reload();
    assert!(
        matches!(&why, Some(Reloaded::Refused(e)) if e.contains("http_listen") && e.contains(&taken_addr)),
        "{why:?}"
    );
    assert_eq!(http_get(&old, "/healthz").0, 200);

    // A free address: the endpoint moves there and the old one closes.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let new = free.local_addr().unwrap().to_string();
    drop(free);
    daemon.rewrite(&with_listen(&format!("http_listen = \"{new}\"")));
    let deadline = Instant::now() + WAIT;
    poll_until(
        deadline,
        || std::net::TcpStream::connect(&new).is_ok(),
        || format!("{:?}", daemon.last_reload()),
    )
    .await;
    assert_eq!(http_get(&new, "/healthz").0, 200);
    poll_until(
        deadline,
        || std::net::TcpStream::connect(&old).is_err(),
        || format!("{old} still listens"),
    )
    .await;
    assert_eq!(metric(&new, RELOADS_REFUSED), Some(1.0));
    wait_for_sample(&new, RELOADS_APPLIED, 1.0).await;
    drop(taken);
    daemon.stop().await;
}

fn container(name: &str, wants: [u64; 3]) -> PodContainer {
    PodContainer {
        name: name.into(),
        init: false,
        restartable: false,
        wants,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_gpu_metrics_follow_the_pods_ledgers_and_health() {
    let dir = tempfile::tempdir().unwrap();
    let files = tempfile::tempdir().unwrap();
    let health = tempfile::tempdir().unwrap();
    let api = ApiServerSim::start().await.unwrap();
    let kubeconfig = files.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let extra = format!(
        "pod_matching = true\nnode_name = \"n\"\nmemory_unit_mib = 256\n\
         [matcher]\nkubeconfig = {:?}\n[health]\npoll_ms = 50\nmock_dir = {:?}",
        kubeconfig.display().to_string(),
        health.path().display().to_string()
    );
    let gpus = [("GPU-a", 1024), ("GPU-b", 1024)];
    let daemon = App::start(&mock_config(dir.path(), &extra, &gpus)).await;
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let listed = [(MEM, 8), (CORE, 200), (COUNT, 2)];
    assert!(
        kubelet.wait_until(WAIT, all_listed(&listed)).await,
        "{}",
        daemon.state()
    );
    let addr = daemon.http.clone();
    let series = |name: &str, gpu: &str| format!("gpu_device_plugin_{name}{{gpu=\"{gpu}\"}}");
    let mode = |gpu: &str, mode: &str| {
        format!("gpu_device_plugin_gpu_mode{{gpu=\"{gpu}\",mode=\"{mode}\"}}")
    };
    for (gpu, _) in gpus {
        wait_for_sample(&addr, &mode(gpu, "free"), 1.0).await;
        wait_for_sample(
            &addr,
            &series("gpu_memory_capacity_bytes", gpu),
            1024.0 * 1048576.0,
        )
        .await;
        wait_for_sample(&addr, &series("gpu_core_capacity_percent", gpu), 100.0).await;
    }

    // A shared pod: 2 memory devices (512 MiB) and 30 % of one GPU.
    let shared = container("app", [2, 30, 0]);
    api.add_pod("default", "shared", "n", std::slice::from_ref(&shared), &[]);
    for ask in shared.asks() {
        kubelet.admit(&[ask]).await.unwrap();
    }
    let pod = api.pod("default", "shared").unwrap();
    let ledger: serde_json::Value = serde_json::from_str(
        pod["metadata"]["annotations"]["doslab.io/gpu-ledger"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let on = ledger["app"]["gpus"][0].as_str().unwrap().to_owned();
    let other = gpus.iter().map(|g| g.0).find(|g| *g != on).unwrap();
    wait_for_sample(
        &addr,
        &series("gpu_memory_granted_bytes", &on),
        512.0 * 1048576.0,
    )
    .await;
    wait_for_sample(&addr, &series("gpu_core_granted_percent", &on), 30.0).await;
    wait_for_sample(&addr, &series("gpu_containers", &on), 1.0).await;
    wait_for_sample(&addr, &mode(&on, "shared"), 1.0).await;
    wait_for_sample(&addr, &mode(&on, "free"), 0.0).await;

    // A whole-GPU pod takes the other one.
    let whole = container("train", [0, 0, 1]);
    api.add_pod("default", "whole", "n", std::slice::from_ref(&whole), &[]);
    kubelet.admit(&whole.asks()).await.unwrap();
    wait_for_sample(&addr, &mode(other, "whole"), 1.0).await;
    wait_for_sample(&addr, &series("gpu_containers", other), 1.0).await;
    wait_for_sample(&addr, &series("gpu_memory_granted_bytes", other), 0.0).await;

    // The shared pod ends: its GPU is free again.
    api.set_phase("default", "shared", "Succeeded");
    wait_for_sample(&addr, &mode(&on, "free"), 1.0).await;
    wait_for_sample(&addr, &series("gpu_memory_granted_bytes", &on), 0.0).await;

    // Health shows per GPU.
    wait_for_sample(&addr, &series("gpu_healthy", other), 1.0).await;
    std::fs::write(health.path().join(other), "").unwrap();
    wait_for_sample(&addr, &series("gpu_healthy", other), 0.0).await;
    wait_for_sample(&addr, &series("gpu_healthy", &on), 1.0).await;
}
