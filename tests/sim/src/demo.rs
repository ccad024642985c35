//! The demo (`cargo run -p gpu-sim --bin demo`): the real daemon on the
//! embedded mock config, in a temporary directory, beside the kubelet
//! simulator. Prints what the kubelet sees and what sample containers
//! would get.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::apiserver::{ApiServerSim, PodContainer, admission_order};
use crate::kubelet::{KubeletSim, ResourceView, merged_envs, plugin_sockets};
use gpu_device_plugin::api::{AllocateRequest, ContainerAllocateRequest};
use gpu_device_plugin::config::{Config, ConfigError};
use gpu_device_plugin::rules::device::{KUBELET_MAX_MESSAGE_BYTES, PerResource, Resource};

/// The demo's config: mock GPUs, pod matching on.
const DEMO_TOML: &str = include_str!("../../../config/demo.toml");

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("temporary directory: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Run(#[from] gpu_device_plugin::node::app::RunError),
    #[error(transparent)]
    Extender(#[from] gpu_device_plugin::extender::ExtenderError),
    #[error("{0}")]
    Step(String),
}

/// A sample container: name, init or not, and its gpu-memory (MiB),
/// gpu-core (%) and gpu-count limits.
type Sample = (&'static str, bool, [u64; 3]);

/// A sample pod: name, annotations, containers.
type SamplePod = (
    &'static str,
    &'static [(&'static str, &'static str)],
    &'static [Sample],
);

/// The sample pods, in creation order.
const PODS: &[SamplePod] = &[
    ("trainer", &[], &[("train", false, [40_960, 50, 0])]),
    ("notebook", &[], &[("lab", false, [8_192, 20, 0])]),
    (
        "pipeline",
        &[],
        &[
            ("fetch", true, [2_048, 10, 0]),
            ("prep", false, [4_096, 10, 0]),
            ("serve", false, [16_384, 30, 0]),
        ],
    ),
    (
        "pinned",
        &[
            (
                "doslab.io/gpu-uuid",
                "GPU-0a9f6c24-d815-4e3b-b7c9-5e1f2a8d4b70",
            ),
            ("doslab.io/gpu-assume-time", "1700000000000000000"),
        ],
        &[("infer", false, [8_000, 20, 0])],
    ),
    ("batch", &[], &[("job", false, [0, 0, 1])]),
    ("too-big", &[], &[("huge", false, [90_000, 10, 0])]),
];

const NODE: &str = "demo-node";

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

/// The real daemon on `config`, in this process, until stopped.
pub(super) struct InProcess {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), gpu_device_plugin::node::app::RunError>>,
}

impl InProcess {
    pub(super) fn spawn(config: Config) -> InProcess {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let controls = Box::pin(futures::stream::once(async {
            let _ = stopped.await;
            gpu_device_plugin::node::app::Control::Stop
        }));
        let task = tokio::spawn(gpu_device_plugin::node::app::run(config, None, controls));
        InProcess { stop, task }
    }

    /// Stops it as SIGTERM does and waits for it.
    pub(super) async fn stop(self) -> Result<(), DemoError> {
        let _ = self.stop.send(());
        self.task
            .await
            .map_err(|e| DemoError::Step(format!("daemon task: {e}")))??;
        Ok(())
    }
}

/// Runs the demo, one node and then placement over several, and returns
/// its report.
pub async fn run() -> Result<String, DemoError> {
    let mut out = one_node().await?;
    crate::placement_demo::run(&mut out).await?;
    Ok(out)
}

/// The real daemon beside the kubelet stand-in on one node.
async fn one_node() -> Result<String, DemoError> {
    let dir = tempfile::tempdir()?;
    let mut config = Config::from_toml(DEMO_TOML, None)?;
    config.device_plugin_dir = dir.path().to_owned();
    // The pod matcher talks to a stand-in API server holding the pods.
    let api = ApiServerSim::start().await?;
    // The node's own object, where the daemon publishes its GPU inventory.
    api.add_node(NODE, &[], &[]);
    config.matcher.kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&config.matcher.kubeconfig)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "gpu-sim demo: the daemon on mock GPUs, simulated kubelet and API server, no cluster"
    );
    let _ = writeln!(out, "device-plugin dir: {}\n", dir.path().display());

    let plan = gpu_device_plugin::node::app::plan(&config).await?;
    let _ = writeln!(out, "GPUs (mock backend):");
    for g in plan.gpus() {
        let _ = writeln!(
            out,
            "  #{} {}  {} MiB  NUMA {:?}",
            g.index, g.uuid, g.memory_mib, g.numa_node
        );
    }

    // The daemon starts before the kubelet, as after a node reboot.
    let daemon = InProcess::spawn(config.clone());
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

    admit_pods(&config, &kubelet, &api, &mut out).await;
    let _ = writeln!(
        out,
        "\nAn Allocate no pending pod asks for waits {} ms for one to appear, then fails:",
        config.matcher.wait_ms
    );
    let memory = config.resource_name(Resource::GpuMemory);
    let e = kubelet.admit(&[(&memory, 1000)]).await.err();
    let _ = writeln!(out, "  {}", e.unwrap_or_default());
    let events = api.wait_for_events(1, Duration::from_secs(2)).await;
    let _ = writeln!(out, "\nEvents posted on pods ({}):", events.len());
    for e in events {
        let _ = writeln!(
            out,
            "  {} {}: {}",
            e["regarding"]["name"].as_str().unwrap_or("?"),
            e["reason"].as_str().unwrap_or("?"),
            e["note"].as_str().unwrap_or("?")
        );
    }

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

    daemon.stop().await?;
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
    api.stop();
    Ok(out)
}

/// Creates the sample pods, then admits them one at a time as the kubelet
/// does (init containers first; per container, each resource's
/// GetPreferredAllocation then Allocate), and shows what each got.
async fn admit_pods(config: &Config, kubelet: &KubeletSim, api: &ApiServerSim, out: &mut String) {
    let units = config.units();
    let pods: Vec<Vec<PodContainer>> = PODS
        .iter()
        .map(|(pod, annotations, containers)| {
            let containers: Vec<PodContainer> = containers
                .iter()
                .map(|(name, init, amounts)| {
                    let amounts = PerResource::from(*amounts);
                    PodContainer {
                        name: (*name).into(),
                        init: *init,
                        restartable: false,
                        wants: Resource::ALL.map(|r| amounts[r] / units.amount(r)),
                    }
                })
                .collect();
            api.add_pod("default", pod, NODE, &containers, annotations);
            containers
        })
        .collect();
    // Give the pod cache the moment a real scheduler's binding takes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = writeln!(
        out,
        "\nPods admitted one at a time; the plugin finds each container's pod and GPU \
         and records it on the pod:"
    );
    for ((pod, annotations, _), containers) in PODS.iter().zip(&pods) {
        let note = if annotations.is_empty() {
            ""
        } else {
            " (GPU chosen by the scheduler)"
        };
        let _ = writeln!(out, "  pod {pod}{note}");
        for c in admission_order(containers) {
            let kind = if c.init {
                "init container"
            } else {
                "container"
            };
            let name = &c.name;
            match kubelet.admit(&c.asks()).await {
                Ok(grants) => {
                    let envs = merged_envs(&grants);
                    let shown: Vec<String> = envs
                        .iter()
                        .filter(|(k, _)| k.as_str() != "NVIDIA_DRIVER_CAPABILITIES")
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect();
                    let _ = writeln!(out, "    {kind} {name}: {}", shown.join(" "));
                }
                Err(e) => {
                    let _ = writeln!(out, "    {kind} {name}: rejected: {e}");
                }
            }
        }
        api.set_phase("default", pod, "Running");
        if let Some(p) = api.pod("default", pod) {
            let a = &p["metadata"]["annotations"];
            let _ = writeln!(
                out,
                "    on the pod: doslab.io/gpu-assigned={} doslab.io/gpu-ledger={}",
                a["doslab.io/gpu-assigned"].as_str().unwrap_or("(unset)"),
                a["doslab.io/gpu-ledger"].as_str().unwrap_or("(none)")
            );
        }
    }
}
