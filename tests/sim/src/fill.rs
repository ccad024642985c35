//! The real extender (reflectors, HTTP) behind the kube-scheduler stand-in,
//! on GPU nodes held in the API-server stand-in, and the fill run on it:
//! pods created one at a time, each waited for, until the first that the
//! scheduler cannot place. The placement bench's burst section and the
//! real-scheduler fill test (tests/kube_fill.rs, which prints the
//! stand-in's figure for its own seeds beside the real one) share it.

use std::collections::BTreeMap;
use std::time::Duration;

use gpu_device_plugin::extender::{ExtenderConfig, Started, launch};
use gpu_device_plugin::rules::usage::Keys;

use crate::apiserver::{ApiServerSim, PodContainer};
use crate::memory::gpu_node;
use crate::scheduler::{Outcome, SchedulerConfig, SchedulerSim};

const DOMAIN: &str = "doslab.io";
/// The namespace of the pods it creates.
pub const NAMESPACE: &str = "standin";
const GIB: u64 = 1024;

/// A cluster of `(node, GPU sizes in GiB)` in the API-server stand-in,
/// with the real extender and the scheduler stand-in pointed at it.
pub struct StandIn {
    pub api: ApiServerSim,
    sim: Option<SchedulerSim>,
    nodes: usize,
    _extender: Started,
    _files: tempfile::TempDir,
}

impl StandIn {
    /// The nodes published (GPU inventories in MiB, and cpu and memory for
    /// the default score plugins), the extender under `policy` synced, and
    /// the scheduler stand-in under `config` (given the extender's URL),
    /// ties broken at random from `seed`.
    pub async fn start(
        nodes: &[(&str, &[u64])],
        policy: &str,
        config: impl FnOnce(&str) -> SchedulerConfig,
        seed: u64,
    ) -> StandIn {
        let files = tempfile::tempdir().unwrap();
        let kubeconfig = files.path().join("kubeconfig");
        let api = ApiServerSim::start().await.unwrap();
        api.write_kubeconfig(&kubeconfig).unwrap();
        let key = Keys::new(DOMAIN).inventory;
        for (name, sizes) in nodes {
            let gpus: Vec<(String, u64)> = sizes
                .iter()
                .enumerate()
                .map(|(i, g)| (format!("GPU-{name}-{i}"), g * GIB))
                .collect();
            let refs: Vec<(&str, u64)> = gpus.iter().map(|(u, m)| (u.as_str(), *m)).collect();
            let node = gpu_node(name, &refs);
            let inventory = node.metadata.annotations.as_ref().unwrap()[&key].clone();
            let memory: u64 = sizes.iter().map(|g| g * GIB).sum();
            let n = sizes.len() as u64;
            api.add_node(
                name,
                &[
                    (&format!("{DOMAIN}/gpu-memory"), memory),
                    (&format!("{DOMAIN}/gpu-core"), 100 * n),
                    (&format!("{DOMAIN}/gpu-count"), n),
                    // Small, so that each pod's default request (100m,
                    // 200Mi) moves LeastAllocated as much as real requests
                    // do on a real node: the default plugins spread.
                    ("cpu", 4),
                    ("memory", 8 << 30),
                    ("pods", 110),
                ],
                &[(&key, &inventory)],
            );
        }
        let toml = format!(
            "[extender]\nlisten = \"127.0.0.1:0\"\npolicy = \"{policy}\"\nkubeconfig = {:?}\n",
            kubeconfig.display().to_string()
        );
        let extender = launch(&ExtenderConfig::from_toml(&toml).unwrap())
            .await
            .unwrap();
        while !extender.synced() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut config = config(&format!("http://{}", extender.addr));
        config.seed = Some(seed);
        config.initial_backoff = Duration::from_millis(100);
        config.max_backoff = Duration::from_secs(1);
        let sim = SchedulerSim::start(&kubeconfig, config).await.unwrap();
        StandIn {
            api,
            sim: Some(sim),
            nodes: nodes.len(),
            _extender: extender,
            _files: files,
        }
    }

    /// Every pod the scheduler tried, by `namespace/name`.
    pub fn outcomes(&self) -> BTreeMap<String, Outcome> {
        self.sim.as_ref().map(|s| s.outcomes()).unwrap_or_default()
    }

    /// Creates pod `name` of [`NAMESPACE`] for the scheduler.
    pub fn add(&self, name: &str, containers: &[PodContainer]) {
        self.api
            .add_unscheduled_pod(NAMESPACE, name, "doslab-gpu-scheduler", containers);
    }

    /// Creates `pods` one at a time, each waited until bound or
    /// unschedulable (filtered out of every node; a refused bind is tried
    /// again), up to the first unschedulable one; returns the GPU memory
    /// (MiB) the bound pods ask and how many they are.
    pub async fn fill(&self, pods: &[Vec<PodContainer>]) -> (u64, usize) {
        let mut held = 0;
        for (i, containers) in pods.iter().enumerate() {
            let name = format!("fill-{i:03}");
            self.add(&name, containers);
            let key = format!("{NAMESPACE}/{name}");
            loop {
                match self.outcomes().get(&key) {
                    Some(o) if o.node.is_some() => break,
                    Some(o)
                        if o.attempts > o.bind_failures
                            && o.bound_at.is_none()
                            && o.filtered.len() == self.nodes =>
                    {
                        return (held, i);
                    }
                    _ => tokio::time::sleep(Duration::from_millis(2)).await,
                }
            }
            held += containers.iter().map(|c| c.wants[0]).sum::<u64>();
        }
        (held, pods.len())
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        if let Some(sim) = self.sim.take() {
            sim.stop();
        }
    }
}
