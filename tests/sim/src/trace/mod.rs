//! Alibaba's GPU-sharing trace (`cluster-trace-gpu-v2023`, the trace of
//! *Beware of Fragmentation*, USENIX ATC '23) as the placement bench and
//! the real components' check of it read it: its files ([`load`]), the
//! replayed cluster every placement is checked against ([`cluster`]), the
//! product's own placement over it ([`product`]), and a sample of it small
//! enough for real kubelets ([`sample`]).

pub mod cluster;
pub mod load;
pub mod product;

use load::{Task, TraceNode};

/// A sample of the trace: `count` of its nodes drawn at random (with
/// `below(n)`, a number under `n`), and its tasks in a random order, then
/// drawn from it at random (the bench's arrivals), until their GPU asks
/// reach `load` percent of the sampled nodes' GPUs.
pub fn sample(
    nodes: &[TraceNode],
    tasks: &[Task],
    count: usize,
    load: u64,
    below: &mut impl FnMut(u64) -> u64,
) -> (Vec<TraceNode>, Vec<Task>) {
    let mut left: Vec<&TraceNode> = nodes.iter().collect();
    let chosen: Vec<TraceNode> = (0..count.min(nodes.len()))
        .map(|_| left.swap_remove(below(left.len() as u64) as usize).clone())
        .collect();
    let capacity = 1000 * chosen.iter().map(|n| n.gpus as u64).sum::<u64>();
    let mut order: Vec<usize> = (0..tasks.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, below(i as u64 + 1) as usize);
    }
    let mut arrived = 0;
    let mut picked = Vec::new();
    for i in 0.. {
        if arrived * 100 >= load * capacity || tasks.is_empty() {
            break;
        }
        let t = &tasks[order
            .get(i)
            .copied()
            .unwrap_or_else(|| below(tasks.len() as u64) as usize)];
        arrived += t.gpu_demand();
        picked.push(t.clone());
    }
    (chosen, picked)
}
