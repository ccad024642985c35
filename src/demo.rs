//! `gpu-device-plugin demo`: the real daemon on the embedded mock config,
//! in a temporary directory, beside the kubelet simulator. Prints what the
//! kubelet sees and what sample containers would get.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::api::{AllocateRequest, ContainerAllocateRequest};
use crate::config::{Config, ConfigError, DEMO_TOML};
use crate::device::{KUBELET_MAX_MESSAGE_BYTES, Resource};
use crate::kubelet_sim::{KubeletSim, ResourceView, merged_envs, plugin_sockets};

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("temporary directory: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Run(#[from] crate::app::RunError),
    #[error("{0}")]
    Step(String),
}

/// The sample containers: name and (resource, amount) requests.
const SAMPLES: &[(&str, &[(Resource, usize)])] = &[
    (
        "trainer",
        &[(Resource::GpuMemory, 40_960), (Resource::GpuCore, 50)],
    ),
    (
        "notebook",
        &[(Resource::GpuCore, 20), (Resource::GpuMemory, 8_192)],
    ),
    (
        "inference",
        &[(Resource::GpuMemory, 20_000), (Resource::GpuCore, 30)],
    ),
    ("batch", &[(Resource::GpuCount, 1)]),
    ("too-big", &[(Resource::GpuMemory, 90_000)]),
];

fn table(config: &Config, kubelet: &BTreeMap<String, ResourceView>, out: &mut String) {
    let _ = writeln!(
        out,
        "  {:<22} {:>9} {:>9} {:>12} {:>10} {:>8}",
        "resource", "devices", "healthy", "list bytes", "bytes/dev", "of 4 MiB"
    );
    for r in &config.resources {
        let name = config.resource_name(*r);
        let v = kubelet.get(&name).cloned().unwrap_or_default();
        let per = v.last_message_bytes as f64 / v.devices.max(1) as f64;
        let share = 100.0 * v.last_message_bytes as f64 / KUBELET_MAX_MESSAGE_BYTES as f64;
        let _ = writeln!(
            out,
            "  {name:<22} {:>9} {:>9} {:>12} {per:>10.1} {share:>7.1}%",
            v.devices, v.healthy, v.last_message_bytes
        );
    }
}

/// Runs the demo and returns its report.
pub async fn run() -> Result<String, DemoError> {
    let dir = tempfile::tempdir()?;
    let mut config = Config::from_toml(DEMO_TOML, None)?;
    config.device_plugin_dir = dir.path().to_owned();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "gpu-device-plugin demo: mock GPUs, simulated kubelet, no cluster"
    );
    let _ = writeln!(out, "device-plugin dir: {}\n", dir.path().display());

    let plan = crate::app::plan(&config).await?;
    let _ = writeln!(out, "GPUs (mock backend):");
    for g in plan.gpus() {
        let _ = writeln!(
            out,
            "  #{} {}  {} MiB  NUMA {:?}",
            g.index, g.uuid, g.memory_mib, g.numa_node
        );
    }

    // The daemon starts before the kubelet, as after a node reboot.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let controls = Box::pin(futures::stream::once(async {
        let _ = stopped.await;
        crate::app::Control::Stop
    }));
    let daemon = tokio::spawn(crate::app::run(config.clone(), None, controls));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let kubelet = KubeletSim::start(dir.path())?;
    let names: Vec<String> = config
        .resources
        .iter()
        .map(|r| config.resource_name(*r))
        .collect();
    let all_listed = |s: &BTreeMap<String, ResourceView>| {
        names
            .iter()
            .all(|n| s.get(n).is_some_and(|v| v.stream_open && v.healthy > 0))
    };
    if !kubelet
        .wait_until(Duration::from_secs(10), all_listed)
        .await
    {
        return Err(DemoError::Step(format!(
            "resources not registered: {:?}",
            kubelet.snapshot()
        )));
    }
    let _ = writeln!(
        out,
        "\nThe kubelet appeared 300 ms after the daemon; all {} resources registered \
         and listed {} ms later:",
        names.len(),
        started.elapsed().as_millis()
    );
    table(&config, &kubelet.snapshot(), &mut out);

    let _ = writeln!(
        out,
        "\nContainers admitted one at a time (GetPreferredAllocation, then Allocate):"
    );
    for (container, requests) in SAMPLES {
        let asks: Vec<(String, usize)> = requests
            .iter()
            .map(|(r, n)| (config.resource_name(*r), *n))
            .collect();
        let asks_ref: Vec<(&str, usize)> = asks.iter().map(|(r, n)| (r.as_str(), *n)).collect();
        let asked = asks
            .iter()
            .map(|(r, n)| format!("{r}={n}"))
            .collect::<Vec<_>>()
            .join(" ");
        let _ = writeln!(out, "  {container} asks {asked}");
        match kubelet.admit(&asks_ref).await {
            Ok(grants) => {
                let envs = merged_envs(&grants);
                for (k, v) in envs
                    .iter()
                    .filter(|(k, _)| k.as_str() != "NVIDIA_DRIVER_CAPABILITIES")
                {
                    let _ = writeln!(out, "      {k}={v}");
                }
                let gpus: Vec<&str> = grants
                    .iter()
                    .filter_map(|g| {
                        g.response
                            .envs
                            .get("NVIDIA_VISIBLE_DEVICES")
                            .map(String::as_str)
                    })
                    .collect();
                if gpus.windows(2).any(|w| w[0] != w[1]) {
                    let _ = writeln!(out, "      (resources landed on different GPUs: {gpus:?})");
                }
            }
            Err(e) => {
                let _ = writeln!(out, "      rejected: {e}");
            }
        }
    }

    let memory = config.resource_name(Resource::GpuMemory);
    if let Some(mut client) = kubelet.client(&memory) {
        let bogus = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec!["not-a-device".into()],
            }],
        };
        let e = client
            .allocate(bogus)
            .await
            .err()
            .map(|s| s.to_string())
            .unwrap_or_default();
        let _ = writeln!(out, "\nAllocate with an unknown ID is refused:\n  {e}");
    }

    let _ = writeln!(out, "\nKubelet view after the admissions:");
    table(&config, &kubelet.snapshot(), &mut out);
    let free: Vec<String> = names
        .iter()
        .map(|n| format!("{n}: {} free", kubelet.free_devices(n).len()))
        .collect();
    let _ = writeln!(out, "  {}", free.join(", "));

    let _ = stop.send(());
    daemon
        .await
        .map_err(|e| DemoError::Step(format!("daemon task: {e}")))??;
    let emptied = kubelet
        .wait_until(Duration::from_secs(5), |s| {
            names
                .iter()
                .all(|n| s.get(n).is_some_and(|v| !v.stream_open && v.devices == 0))
        })
        .await;
    let sockets_left = plugin_sockets(dir.path()).len();
    let _ = writeln!(
        out,
        "\nDaemon stopped: empty device lists sent and streams ended: {}; plugin sockets left: {}",
        if emptied { "yes" } else { "NO" },
        sockets_left
    );
    kubelet.stop().await;
    Ok(out)
}
