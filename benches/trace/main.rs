//! `cargo bench --bench trace`: the extender's placement replayed on
//! Alibaba's GPU-sharing trace (`cluster-trace-gpu-v2023`, the trace of
//! *Beware of Fragmentation*, USENIX ATC '23) beside the policies that
//! paper measures, on the same cluster, the same tasks in the same order
//! and the same check of every placement. Prints, per trace variant and
//! policy, the share of the cluster's GPUs allocated as the arrived load
//! grows to 130 % of their capacity, and the GPUs left unallocated at
//! 100 %. Nothing here asserts a number. The trace's files, the replayed
//! cluster and the product's placement over it are `gpu_sim::trace`'s,
//! which `tests/kube_trace.rs` checks against the real components on a
//! sample; the paper's policies are here.
//!
//! `TRACE_DIR`: the trace's folder (default `../shared/traces/
//! alibaba-gpu-v2023` beside the checkout); `TRACE_VARIANTS`: the pod
//! lists to replay (default `default,gpushare100,multigpu50,gpuspec33`);
//! `TRACE_SEEDS`: how many arrival orders each (default 3);
//! `TRACE_POLICIES`: only the policies whose names contain one of these
//! (comma-separated).

mod policies;

use std::path::PathBuf;
use std::time::Instant;

use gpu_sim::trace::cluster::{Cluster, Placement};
use gpu_sim::trace::load::{self, Task};
use gpu_sim::trace::product;

/// A way of choosing where a task goes.
pub trait Policy {
    fn place(&mut self, c: &Cluster, t: &Task) -> Option<Placement>;
}

impl Policy for product::Product {
    fn place(&mut self, c: &Cluster, t: &Task) -> Option<Placement> {
        product::Product::place(self, c, t)
    }
}

/// Arrived load (percent of the GPU capacity) at which the allocation is
/// printed.
const MARKS: [u64; 6] = [50, 80, 100, 110, 120, 130];

struct Run {
    /// Allocated share of the GPU capacity (%) at each of [`MARKS`].
    allocated: Vec<f64>,
    /// GPUs unallocated at 100 % arrived.
    unallocated: f64,
    failed: usize,
    secs: f64,
}

/// The paper's arrivals: the trace's tasks in a random order, then tasks
/// drawn from it at random (with replacement) for as long as it takes;
/// they arrive one at a time until their GPU asks reach 130 % of the
/// cluster's GPUs, and none leaves. A task that fits nowhere is dropped
/// (its ask still counts as arrived).
fn replay(nodes: &[load::TraceNode], tasks: &[Task], seed: u64, policy: &mut dyn Policy) -> Run {
    let mut c = Cluster::new(nodes);
    let mut rng = fastrand::Rng::with_seed(seed);
    let order = policies::shuffled(tasks.len(), seed);
    let start = Instant::now();
    let (mut arrived, mut failed) = (0u64, 0usize);
    let mut allocated = Vec::new();
    let mut unallocated = 0.0;
    for i in 0.. {
        if allocated.len() == MARKS.len() {
            break;
        }
        let t = &tasks[order
            .get(i)
            .copied()
            .unwrap_or_else(|| rng.usize(..tasks.len()))];
        match policy.place(&c, t) {
            Some(p) => c.apply(t, &p),
            None => failed += 1,
        }
        arrived += t.gpu_demand();
        while let Some(&mark) = MARKS.get(allocated.len())
            && arrived * 100 >= mark * c.capacity
        {
            allocated.push(c.allocated as f64 * 100.0 / c.capacity as f64);
            if mark == 100 {
                unallocated = (c.capacity - c.allocated) as f64 / 1000.0;
            }
        }
    }
    Run {
        allocated,
        unallocated,
        failed,
        secs: start.elapsed().as_secs_f64(),
    }
}

fn main() {
    let dir = std::env::var_os("TRACE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/alibaba-gpu-v2023")
        });
    let variants = std::env::var("TRACE_VARIANTS")
        .unwrap_or_else(|_| "default,gpushare100,multigpu50,gpuspec33".into());
    let seeds: u64 = std::env::var("TRACE_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let nodes = load::nodes(&dir).unwrap_or_else(|e| panic!("the trace's nodes: {e} (TRACE_DIR)"));
    let gpus: usize = nodes.iter().map(|n| n.gpus).sum();
    println!("{} nodes, {gpus} GPUs ({})", nodes.len(), dir.display());
    for variant in variants.split(',') {
        let tasks = load::tasks(&dir, variant).unwrap_or_else(|e| panic!("{e}"));
        println!("\n{variant}: {} tasks, {seeds} arrival orders", tasks.len());
        println!(
            "{:<28} {}  unalloc.GPUs@100%  failed  s/run",
            "policy",
            MARKS.map(|m| format!("{m:>5}%")).join(" ")
        );
        let wanted = std::env::var("TRACE_POLICIES").unwrap_or_default();
        let chosen = policies::all(&nodes, &tasks)
            .into_iter()
            .filter(|(name, _)| wanted.is_empty() || wanted.split(',').any(|w| name.contains(w)));
        for (name, make) in chosen {
            let runs: Vec<Run> = (0..seeds)
                .map(|s| replay(&nodes, &tasks, 0x5eed_0000 + s, make().as_mut()))
                .collect();
            let mean =
                |f: &dyn Fn(&Run) -> f64| runs.iter().map(f).sum::<f64>() / runs.len() as f64;
            let marks: Vec<String> = (0..MARKS.len())
                .map(|i| format!("{:>6.1}", mean(&|r| r.allocated[i])))
                .collect();
            println!(
                "{name:<28} {}  {:>17.1}  {:>6.0}  {:>5.1}",
                marks.join(" "),
                mean(&|r| r.unallocated),
                mean(&|r| r.failed as f64),
                mean(&|r| r.secs),
            );
        }
    }
}
