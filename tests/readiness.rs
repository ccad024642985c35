//! What `/readyz` and `/metrics` say against the daemon in-process: readiness
//! follows whether an Allocate can succeed now (the API server reachable
//! with pod matching on), the pod cache's size follows the cache, and the
//! per-GPU series are there without pod matching too.

mod support;

use gpu_sim::apiserver::ApiServerSim;
use support::*;

const NODE: &str = "node-1";
const GPU: &str = "GPU-aaaaaaaa-0000-4000-8000-000000000001";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_api_server_and_the_pod_count_follows_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let files = tempfile::tempdir().unwrap();
    let api = ApiServerSim::start().await.unwrap();
    let kubeconfig = files.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let toml = mock_config(dir.path(), &matching(NODE, &kubeconfig), &[(GPU, 4096)]);
    let _kubelet = KubeletSim::start(dir.path()).unwrap();
    let daemon = App::start(&toml).await;
    let addr = daemon.http.clone();
    daemon.ready().await;

    // The cache's size follows the watch, with no Allocate asking.
    api.add_pod(
        "default",
        "p1",
        NODE,
        &[container("app", false, [1, 0, 0])],
        &[],
    );
    wait_for_sample(&addr, POD_CACHE, 1.0).await;

    api.outage(true);
    let (_, body) = daemon
        .readyz_until(|c, b| c == 503 && b.contains("API server"))
        .await;
    assert!(body.contains("pod matcher"), "{body}");

    api.outage(false);
    daemon.ready().await;
    api.add_pod(
        "default",
        "p2",
        NODE,
        &[container("app", false, [1, 0, 0])],
        &[],
    );
    wait_for_sample(&addr, POD_CACHE, 2.0).await;
}

/// Without pod matching every GPU's capacity and health are still on
/// `/metrics`, from the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_gpu_capacity_and_health_are_exported_without_pod_matching() {
    let dir = tempfile::tempdir().unwrap();
    let toml = mock_config(dir.path(), "", &[(GPU, 4096)]);
    let daemon = App::start(&toml).await;
    let addr = &daemon.http;
    let series = |name: &str| format!("gpu_device_plugin_{name}{{gpu=\"{GPU}\"}}");
    wait_for_sample(
        addr,
        &series("gpu_memory_capacity_bytes"),
        4096.0 * 1048576.0,
    )
    .await;
    wait_for_sample(addr, &series("gpu_core_capacity_percent"), 100.0).await;
    wait_for_sample(addr, &series("gpu_healthy"), 1.0).await;
}
