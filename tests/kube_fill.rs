//! Binpack's fill through the real kube-scheduler (tests/kube) with the
//! real extender on the shipped profile, on a mixed cluster of GPUs from 16
//! to 80 GiB: seeded shared pods created one at a time, each waited until
//! it runs or the scheduler calls it unschedulable, and the share of GPU
//! memory held at the first unschedulable one. The scheduler stand-in's
//! figure for the same nodes, pods and seeds is printed beside it.

mod support;

use std::time::{Duration, Instant};

use gpu_sim::apiserver::PodContainer;
use gpu_sim::fill::StandIn;
use gpu_sim::scheduler::SchedulerConfig;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use support::kube::*;

const NS: &str = "fill";
/// Pods ask gpu-memory in GiB.
const UNIT: &str = "memory_unit_mib = 1024";
const GIB: u64 = 1024;

/// (node, GPU sizes in GiB): 13 GPUs, 464 GiB. The big node first in name
/// order: among equals a policy takes the first name, so an empty cluster
/// does not steer small pods to the small GPUs by luck of the names.
const NODES: [(&str, &[u64]); 6] = [
    ("node-0", &[80, 80]),
    ("node-1", &[40, 40]),
    ("node-2", &[16, 16, 16, 16]),
    ("node-3", &[16, 16, 16, 16]),
    ("node-4", &[24, 24]),
    ("node-5", &[48]),
];

const SEEDS: [u64; 3] = [1, 2, 3];

/// The target, asserted: binpack holds at least this share of GPU
/// memory (%) when the first pod finds no room.
const TARGET: f64 = 95.0;

/// Memory asks in GiB and how often they come: mostly small replicas, a
/// tail up to 20 GiB, and some 36 GiB asks that only the 40, 48 and 80 GiB
/// GPUs hold.
const MEMORY_GIB: &[(u64, u64)] = &[
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
const CORE_PERCENT: &[(u64, u64)] = &[(10, 3), (20, 3), (25, 2), (30, 2), (50, 1)];

fn weighted(rng: &mut support::Lcg, table: &[(u64, u64)]) -> u64 {
    let total: u64 = table.iter().map(|&(_, w)| w).sum();
    let mut x = rng.below(total);
    for &(v, w) in table {
        if x < w {
            return v;
        }
        x -= w;
    }
    unreachable!("x < total")
}

/// One shared container per pod: (gpu-memory GiB, gpu-core %); more pods
/// than the cluster holds.
fn mix(seed: u64) -> Vec<(u64, u64)> {
    let mut rng = support::Lcg(seed);
    (0..200)
        .map(|_| {
            let memory = weighted(&mut rng, MEMORY_GIB);
            let core = if rng.below(4) == 0 {
                weighted(&mut rng, CORE_PERCENT)
            } else {
                0
            };
            (memory, core)
        })
        .collect()
}

fn total_gib() -> u64 {
    NODES.iter().flat_map(|(_, g)| g.iter()).sum()
}

/// How a fill ended.
struct Fill {
    /// GiB the running pods ask.
    held: u64,
    /// Pods that ran.
    ran: usize,
    /// Pods the node refused (phase Failed): admission failures.
    failed: Vec<String>,
    /// The first unschedulable pod's ask and the scheduler's message.
    refused: Option<((u64, u64), String)>,
}

impl Fill {
    fn share(&self) -> f64 {
        self.held as f64 * 100.0 / total_gib() as f64
    }
}

/// The scheduler's verdict that no node takes the pod.
fn unschedulable(pod: &Pod) -> Option<String> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    conditions
        .iter()
        .find(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        })
        .map(|c| c.message.clone().unwrap_or_default())
}

/// Waits until every node carries its daemon's GPU inventory: until then
/// the extender refuses the node for good, and a pod would be called
/// unschedulable for it.
async fn wait_inventories(cp: &ControlPlane) {
    let nodes: Api<Node> = Api::all(cp.admin_client().await);
    let deadline = Instant::now() + START;
    loop {
        let published = nodes.list(&Default::default()).await.is_ok_and(|list| {
            list.items.len() == NODES.len()
                && list.items.iter().all(|n| {
                    n.metadata
                        .annotations
                        .as_ref()
                        .is_some_and(|a| a.contains_key("doslab.io/gpu-inventory"))
                })
        });
        if published {
            return;
        }
        assert!(Instant::now() < deadline, "GPU inventories never published");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The fill on a fresh control plane with [`NODES`], the real scheduler
/// and extender (binpack, the shipped default).
async fn real_fill(pods: &[(u64, u64)]) -> Fill {
    let cp = ControlPlane::start();
    let mut nodes = Vec::new();
    for (n, (name, sizes)) in NODES.iter().enumerate() {
        let ids: Vec<(String, u64)> = sizes
            .iter()
            .enumerate()
            .map(|(g, gib)| (gpu_uuid(n, g), gib * GIB))
            .collect();
        let ids: Vec<(&str, u64)> = ids.iter().map(|(u, m)| (u.as_str(), *m)).collect();
        nodes.push(KubeNode::start(&cp, name, &ids, UNIT).await);
    }
    namespace(&cp, NS);
    wait_inventories(&cp).await;
    let sched = Scheduler::start(&cp);
    let client = cp.admin_client().await;
    let mut fill = Fill {
        held: 0,
        ran: 0,
        failed: Vec::new(),
        refused: None,
    };
    for (i, &(memory, core)) in pods.iter().enumerate() {
        let name = format!("fill-{i:03}");
        create(&client, &gpu_pod(NS, &name, &[("main", [memory, core, 0])])).await;
        let pod = wait_pod(&client, NS, &name, Duration::from_secs(60), |p| {
            matches!(phase(p), "Running" | "Failed") || unschedulable(p).is_some()
        })
        .await
        .unwrap_or_else(|p| {
            panic!(
                "{name} neither ran nor was unschedulable: {p:#?}\n--- scheduler\n{}\n--- extender\n{}",
                sched.proc.log_text(),
                sched.extender.log_text()
            )
        });
        if let Some(why) = unschedulable(&pod) {
            fill.refused = Some(((memory, core), why));
            break;
        }
        if phase(&pod) == "Failed" {
            fill.failed.push(format!("{name}: {:?}", pod.status));
        } else {
            fill.held += memory;
            fill.ran += 1;
        }
    }
    drop(sched);
    drop(nodes);
    fill
}

/// The same pods through the scheduler stand-in on the shipped config.
async fn standin_fill(pods: &[(u64, u64)], seed: u64) -> f64 {
    let w = StandIn::start(&NODES, "binpack", SchedulerConfig::shipped, seed).await;
    let pods: Vec<Vec<PodContainer>> = pods
        .iter()
        .map(|&(memory, core)| {
            vec![PodContainer {
                name: "main".into(),
                init: false,
                restartable: false,
                wants: [memory * GIB, core, 0],
            }]
        })
        .collect();
    let (held, _) = w.fill(&pods).await;
    held as f64 * 100.0 / (total_gib() * GIB) as f64
}

/// Binpack fills the mixed cluster to the target on every seed
/// before the first pod finds no room, with no pod refused by its node.
#[tokio::test(flavor = "multi_thread")]
async fn binpack_fills_a_mixed_cluster() {
    let started = Instant::now();
    let mut shares = Vec::new();
    for seed in SEEDS {
        let pods = mix(seed);
        let standin = standin_fill(&pods, seed).await;
        let real = real_fill(&pods).await;
        let (ask, why) = real.refused.clone().unwrap_or_default();
        eprintln!(
            "fill seed {seed}: real scheduler {:.1} % of {} GiB held ({} pods ran, {} failed), \
             first unschedulable asks {} GiB / {} % core ({why}); stand-in {standin:.1} %",
            real.share(),
            total_gib(),
            real.ran,
            real.failed.len(),
            ask.0,
            ask.1,
        );
        assert!(
            real.failed.is_empty(),
            "admission failures: {:#?}",
            real.failed
        );
        assert!(
            real.refused.is_some(),
            "seed {seed}: {} pods all ran",
            pods.len()
        );
        shares.push(real.share());
    }
    eprintln!(
        "fill: real scheduler, binpack, seeds {SEEDS:?}: {} % ({:.0} s)",
        shares
            .iter()
            .map(|s| format!("{s:.1}"))
            .collect::<Vec<_>>()
            .join(" / "),
        started.elapsed().as_secs_f64()
    );
    for (seed, share) in SEEDS.iter().zip(&shares) {
        assert!(*share >= TARGET, "seed {seed}: {share:.1} % < {TARGET} %");
    }
}
