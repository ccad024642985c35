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

/// The fill test's cluster (tests/kube_fill.rs; the placement bench's
/// harder mix too), as (node, GPU sizes in GiB): 13 GPUs, 464 GiB. The big
/// node first in name order: among equals a policy takes the first name,
/// so an empty cluster does not steer small pods to the small GPUs by luck
/// of the names.
pub const NODES: [(&str, &[u64]); 6] = [
    ("node-0", &[80, 80]),
    ("node-1", &[40, 40]),
    ("node-2", &[16, 16, 16, 16]),
    ("node-3", &[16, 16, 16, 16]),
    ("node-4", &[24, 24]),
    ("node-5", &[48]),
];

/// Memory asks in GiB and how often they come: mostly small replicas, a
/// tail up to 20 GiB, and some 36 GiB asks that only the 40, 48 and 80 GiB
/// GPUs hold.
pub const MEMORY_GIB: &[(u64, u64)] = &[
    (1, 10),
    (2, 12),
    (4, 14),
    (6, 10),
    (8, 12),
    (10, 8),
    (12, 8),
    (16, 8),
    (20, 6),
    (36, 4),
];
/// gpu-core asks (%) of the one pod in four that makes one.
pub const CORE_PERCENT: &[(u64, u64)] = &[(10, 3), (20, 3), (25, 2), (30, 2), (50, 1)];

/// A value of `table` by its weight; `below(n)` draws a number below `n`.
pub fn weighted(below: &mut impl FnMut(u64) -> u64, table: &[(u64, u64)]) -> u64 {
    let total: u64 = table.iter().map(|&(_, w)| w).sum();
    let mut x = below(total);
    for &(v, w) in table {
        if x < w {
            return v;
        }
        x -= w;
    }
    unreachable!("x < total")
}

/// One shared container's ask of the fill mix: (gpu-memory GiB, gpu-core
/// %), one in four asking compute.
pub fn share(below: &mut impl FnMut(u64) -> u64) -> (u64, u64) {
    let memory = weighted(below, MEMORY_GIB);
    let core = if below(4) == 0 {
        weighted(below, CORE_PERCENT)
    } else {
        0
    };
    (memory, core)
}

/// A pod of the harder mix.
#[derive(Debug, Clone)]
pub enum Ask {
    /// Shared containers, each (gpu-memory GiB, gpu-core %).
    Shares(Vec<(u64, u64)>),
    /// Whole GPUs.
    Whole(u64),
}

/// `n` pods of the harder mix: one in twenty asks one or two whole GPUs,
/// the others one to three shared containers of [`share`].
pub fn harder_mix(below: &mut impl FnMut(u64) -> u64, n: usize) -> Vec<Ask> {
    (0..n)
        .map(|_| {
            if below(20) == 0 {
                Ask::Whole(1 + below(2))
            } else {
                let containers = 1 + below(3);
                Ask::Shares((0..containers).map(|_| share(below)).collect())
            }
        })
        .collect()
}

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
            if !self.place(i, containers).await {
                return (held, i);
            }
            held += containers.iter().map(|c| c.wants[0]).sum::<u64>();
        }
        (held, pods.len())
    }

    /// Creates `pods` one at a time, each waited until bound or
    /// unschedulable, the way the trace replay arrives tasks: one that
    /// fits nowhere is deleted and the next comes. Which were bound.
    pub async fn arrive(&self, pods: &[Vec<PodContainer>]) -> Vec<bool> {
        let mut bound = Vec::with_capacity(pods.len());
        for (i, containers) in pods.iter().enumerate() {
            let placed = self.place(i, containers).await;
            if !placed {
                self.api.delete_pod(NAMESPACE, &format!("fill-{i:03}"));
            }
            bound.push(placed);
        }
        bound
    }

    /// Creates pod `fill-<i>` and waits until it is bound (true) or
    /// filtered out of every node (false; a refused bind is tried again).
    async fn place(&self, i: usize, containers: &[PodContainer]) -> bool {
        let name = format!("fill-{i:03}");
        self.add(&name, containers);
        let key = format!("{NAMESPACE}/{name}");
        loop {
            match self.outcomes().get(&key) {
                Some(o) if o.node.is_some() => return true,
                Some(o)
                    if o.attempts > o.bind_failures
                        && o.bound_at.is_none()
                        && o.filtered.len() == self.nodes =>
                {
                    return false;
                }
                _ => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        if let Some(sim) = self.sim.take() {
            sim.stop();
        }
    }
}
