//! The node's GPU inventory on its Node, end to end: the daemon in-process on mock
//! GPUs against the API-server stand-in publishes `doslab.io/gpu-inventory`
//! once the Node is there, rewrites it when a GPU turns unhealthy or a
//! reload changes the units, and patches nothing when nothing changed.

mod support;

use std::time::Instant;

use gpu_sim::apiserver::ApiServerSim;
use serde_json::{Value, json};
use support::*;

const NODE: &str = "gpu-node-1";
const KEY: &str = "doslab.io/gpu-inventory";
const A: &str = "GPU-0000000a-0000-4000-8000-000000000000";
const B: &str = "GPU-0000000b-0000-4000-8000-000000000000";

/// The inventory the Node carries, parsed; null without one.
fn inventory(api: &ApiServerSim) -> Value {
    api.node(NODE)
        .and_then(|n| n["metadata"]["annotations"][KEY].as_str().map(String::from))
        .map_or(Value::Null, |text| serde_json::from_str(&text).unwrap())
}

fn count(api: &ApiServerSim, verb: &str) -> u64 {
    api.requests().get(verb).copied().unwrap_or(0)
}

async fn wait_for(daemon: &App, what: &str, done: impl Fn() -> bool) {
    poll_until(Instant::now() + WAIT, done, || {
        format!("{what}: not within {WAIT:?}\n{}", daemon.state())
    })
    .await;
}

fn expected(unit: u64, a_healthy: bool) -> Value {
    json!({
        "version": 1, "memoryUnitMiB": unit, "coresPerGpu": 100,
        "resources": ["gpu-memory", "gpu-core", "gpu-count"],
        "gpus": [
            {"uuid": A, "memoryMiB": 81920, "healthy": a_healthy},
            {"uuid": B, "memoryMiB": 40960, "healthy": true},
        ],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_carries_its_gpu_inventory_through_health_changes_and_reloads() {
    let dir = tempfile::tempdir().unwrap();
    let files = tempfile::tempdir().unwrap();
    let health = files.path().join("health");
    std::fs::create_dir(&health).unwrap();
    let kubeconfig = files.path().join("kubeconfig");
    let api = ApiServerSim::start().await.unwrap();
    api.write_kubeconfig(&kubeconfig).unwrap();
    let config = |unit: u64| {
        mock_config(
            dir.path(),
            &format!(
                "pod_matching = true\nnode_name = \"{NODE}\"\nmemory_unit_mib = {unit}\n\
                 [matcher]\nkubeconfig = {:?}\n\
                 [health]\npoll_ms = 20\nrecovery_ms = 100\nmock_dir = {:?}",
                kubeconfig.display().to_string(),
                health.display().to_string()
            ),
            &[(A, 81920), (B, 40960)],
        )
    };
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let daemon = App::start(&config(256)).await;

    // No Node yet: the publisher keeps trying, the plugins serve meanwhile.
    let registered = kubelet
        .wait_until(
            WAIT,
            all_listed(&[
                ("doslab.io/gpu-memory", 480),
                ("doslab.io/gpu-core", 200),
                ("doslab.io/gpu-count", 2),
            ]),
        )
        .await;
    assert!(registered, "{}", daemon.state());
    wait_for(&daemon, "a first attempt", || count(&api, "get") >= 1).await;
    api.add_node(NODE, &[], &[("keep", "x")]);
    wait_for(&daemon, "the inventory", || {
        inventory(&api) == expected(256, true)
    })
    .await;
    assert_eq!(count(&api, "patch"), 1);
    let node = api.node(NODE).unwrap();
    assert_eq!(node["metadata"]["annotations"]["keep"], "x");

    // A GPU fails its health check, then recovers: two patches.
    std::fs::write(health.join(A), "").unwrap();
    wait_for(&daemon, "GPU A unhealthy", || {
        inventory(&api) == expected(256, false)
    })
    .await;
    std::fs::remove_file(health.join(A)).unwrap();
    wait_for(&daemon, "GPU A healthy again", || {
        inventory(&api) == expected(256, true)
    })
    .await;
    assert_eq!(count(&api, "patch"), 3);

    // A reload that changes the memory unit rewrites it.
    daemon.rewrite(&config(512));
    wait_for(&daemon, "the new unit", || {
        inventory(&api) == expected(512, true)
    })
    .await;
    assert_eq!(count(&api, "patch"), 4);

    // A reload that changes nothing the inventory says: the publisher
    // reads the Node and leaves it alone.
    let gets = count(&api, "get");
    daemon.rewrite(&config(512).replace("poll_ms = 20", "poll_ms = 30"));
    wait_for(&daemon, "a look at the Node", || count(&api, "get") > gets).await;
    // So does a restarted daemon.
    daemon.stop().await;
    let gets = count(&api, "get");
    let daemon = App::start(&config(512)).await;
    wait_for(&daemon, "the restarted daemon's look", || {
        count(&api, "get") > gets
    })
    .await;
    // Stopped, it patches nothing more: what it did after its look is all
    // counted.
    daemon.stop().await;
    assert_eq!(count(&api, "patch"), 4);
    assert_eq!(inventory(&api), expected(512, true));
}
