//! The policies *Beware of Fragmentation* (USENIX ATC '23) measures,
//! written from its definitions (and, where the paper leaves a constant
//! open, its simulator's): each scores every node that takes the task and
//! the highest wins, ties broken by a fixed random order of the nodes (the
//! simulator's node names carry a seeded random prefix and it takes the
//! first in name order). Inside the node, a share goes to the GPU with
//! the least room that holds it (Random-fit: a random one), whole GPUs to
//! the first free ones.

use std::collections::HashMap;

use crate::Policy;
use gpu_sim::trace::cluster::{Cluster, GPU, NodeState, Placement};
use gpu_sim::trace::load::{Task, TraceNode};
use gpu_sim::trace::product::Product;

/// The simulator's normalising constants: the largest node's CPU
/// (milli) and GPUs (thousandths).
const MAX_CPU: f64 = 128_000.0;
const MAX_GPU: f64 = 8_000.0;

/// Every policy of the run, by name, each made fresh for each replay.
/// Makes a fresh policy for a replay.
pub type Make<'a> = Box<dyn Fn() -> Box<dyn Policy> + 'a>;

pub fn all<'a>(nodes: &'a [TraceNode], tasks: &'a [Task]) -> Vec<(&'static str, Make<'a>)> {
    let scored =
        |score: Score| move || Box::new(Scored::new(nodes.len(), score)) as Box<dyn Policy>;
    vec![
        (
            "Random-fit",
            Box::new(|| Box::new(RandomFit(fastrand::Rng::with_seed(7))) as Box<dyn Policy>),
        ),
        ("Dot-product", Box::new(scored(Score::DotProduct))),
        ("GPU Clustering", Box::new(scored(Score::Clustering))),
        ("GPU Packing", Box::new(scored(Score::Packing))),
        ("Best-fit", Box::new(scored(Score::BestFit))),
        (
            "FGD",
            Box::new(move || Box::new(Fgd::new(nodes.len(), tasks, false)) as Box<dyn Policy>),
        ),
        (
            "FGD, exact",
            Box::new(move || Box::new(Fgd::new(nodes.len(), tasks, true)) as Box<dyn Policy>),
        ),
        (
            "product binpack",
            Box::new(move || Box::new(Product::new(nodes, "binpack", 100)) as Box<dyn Policy>),
        ),
        (
            "product (shipped profile)",
            Box::new(move || Box::new(Product::new(nodes, "fragmentation", 5)) as Box<dyn Policy>),
        ),
        (
            "product (every node)",
            Box::new(move || {
                Box::new(Product::new(nodes, "fragmentation", 100)) as Box<dyn Policy>
            }),
        ),
    ]
}

/// The GPUs a share or whole ask takes on `n` by the packing rule.
fn best_gpus(n: &NodeState, t: &Task) -> Vec<usize> {
    if t.num_gpu == 0 {
        return Vec::new();
    }
    if t.shared() {
        let g = (0..n.gpus.len())
            .filter(|&g| n.gpus[g] >= t.gpu_milli)
            .min_by_key(|&g| (n.gpus[g], g))
            .expect("the node fits");
        return vec![g];
    }
    n.options(t).swap_remove(0)
}

fn gpu_left(n: &NodeState) -> u64 {
    n.gpus.iter().map(|&f| u64::from(f)).sum()
}

/// Random-fit: any node that takes the task, any GPU there that holds it.
struct RandomFit(fastrand::Rng);

impl Policy for RandomFit {
    fn place(&mut self, c: &Cluster, t: &Task) -> Option<Placement> {
        let fit: Vec<usize> = (0..c.nodes.len()).filter(|&i| c.nodes[i].fits(t)).collect();
        let node = *fit.get(self.0.usize(..fit.len().max(1)))?;
        let n = &c.nodes[node];
        let gpus = if t.shared() {
            let holds: Vec<usize> = (0..n.gpus.len())
                .filter(|&g| n.gpus[g] >= t.gpu_milli)
                .collect();
            vec![holds[self.0.usize(..holds.len())]]
        } else {
            best_gpus(n, t)
        };
        Some(Placement { node, gpus })
    }
}

#[derive(Clone, Copy)]
enum Score {
    /// Least CPU and GPU left once the task is there, half each.
    BestFit,
    /// Smallest dot product of the node's free CPU and GPUs with the
    /// task's ask (Tetris's alignment, as the paper runs it).
    DotProduct,
    /// GPUs already shared first, then nodes already in use, then idle
    /// nodes (the fewer GPUs the better).
    Packing,
    /// Nodes already running tasks of the same GPU class (a share, or k
    /// whole GPUs), then empty nodes, fuller first.
    Clustering,
}

/// A policy that scores nodes, the highest first, ties to the first in a
/// seeded random order of the nodes.
struct Scored {
    score: Score,
    order: Vec<usize>,
    /// Per node, the GPU classes of the tasks on it (Clustering).
    classes: Vec<Vec<u32>>,
}

/// A task's GPU class for Clustering: 0 a share, k for k whole GPUs.
fn class(t: &Task) -> u32 {
    t.whole()
}

pub fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    fastrand::Rng::with_seed(seed).shuffle(&mut order);
    order
}

impl Scored {
    fn new(nodes: usize, score: Score) -> Scored {
        Scored {
            score,
            order: shuffled(nodes, 42),
            classes: vec![Vec::new(); nodes],
        }
    }

    fn value(&self, i: usize, n: &NodeState, t: &Task) -> f64 {
        let ask = t.gpu_demand() as f64;
        let left = gpu_left(n) as f64;
        let free = n.free_gpus();
        match self.score {
            Score::BestFit => {
                -(0.5 * (n.cpu_free - t.cpu_milli) as f64 / MAX_CPU + 0.5 * (left - ask) / MAX_GPU)
            }
            Score::DotProduct => {
                let dot = n.cpu_free as f64 / MAX_CPU * t.cpu_milli as f64 / MAX_CPU
                    + left / MAX_GPU * ask / MAX_GPU;
                -dot / 2.0
            }
            Score::Packing => {
                if t.num_gpu == 0 {
                    return 0.0;
                }
                if free == n.gpus.len() {
                    return (33usize.saturating_sub(free)).max(free) as f64;
                }
                let gpus = best_gpus(n, t);
                let fresh = gpus.iter().filter(|&&g| n.gpus[g] == GPU).count();
                if fresh > 0 {
                    return (50usize.saturating_sub(fresh)).max(33) as f64;
                }
                let used: u32 = gpus.iter().map(|&g| n.gpus[g] * 100 / GPU).sum();
                (100u32.saturating_sub(used / 10)).max(50) as f64
            }
            Score::Clustering => {
                if t.num_gpu == 0 {
                    return 0.0;
                }
                let base = (25.0 * (MAX_GPU - left) / MAX_GPU).floor();
                let on = &self.classes[i];
                let mine = on.contains(&class(t));
                base + if on.is_empty() {
                    25.0
                } else if mine && on.iter().all(|&k| k == class(t)) {
                    75.0
                } else if mine {
                    50.0
                } else {
                    0.0
                }
            }
        }
    }
}

impl Policy for Scored {
    fn place(&mut self, c: &Cluster, t: &Task) -> Option<Placement> {
        let mut best: Option<(f64, usize)> = None;
        for &i in &self.order {
            let n = &c.nodes[i];
            if !n.fits(t) {
                continue;
            }
            let v = self.value(i, n, t);
            if best.is_none_or(|(b, _)| v > b) {
                best = Some((v, i));
            }
        }
        let (_, node) = best?;
        if t.num_gpu > 0 && !self.classes[node].contains(&class(t)) {
            self.classes[node].push(class(t));
        }
        Some(Placement {
            node,
            gpus: best_gpus(&c.nodes[node], t),
        })
    }
}

/// A task type of the target workload: what fragmentation is measured
/// against.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Kind {
    cpu_milli: u64,
    num_gpu: u32,
    gpu_milli: u32,
    models: u32,
}

impl Kind {
    fn of(t: &Task) -> Kind {
        Kind {
            // The scheduler counts an unset CPU request as 100m.
            cpu_milli: if t.cpu_milli == 0 { 100 } else { t.cpu_milli },
            num_gpu: t.num_gpu,
            gpu_milli: if t.num_gpu > 1 { GPU } else { t.gpu_milli },
            models: t.models,
        }
    }
}

/// The fragmentation a task adds on a node, and the GPUs it takes there.
type Move = (f64, Vec<usize>);

/// Fragmentation Gradient Descent: the node and GPU where the node's
/// expected fragmentation for the target workload grows least.
struct Fgd {
    /// Rank by the fragmentation added itself, not the simulator's whole
    /// points of its sigmoid.
    exact: bool,
    /// The target workload: the trace's most common task types, down to
    /// 95 % of its tasks, with their shares of those.
    workload: Vec<(Kind, f64)>,
    order: Vec<usize>,
    /// Per node: its state's version, and each task type's best move
    /// there (fragmentation added, GPUs) at that version.
    memo: Vec<(u64, HashMap<Kind, Move>)>,
}

impl Fgd {
    fn new(nodes: usize, tasks: &[Task], exact: bool) -> Fgd {
        let mut counts: HashMap<Kind, usize> = HashMap::new();
        for t in tasks {
            *counts.entry(Kind::of(t)).or_default() += 1;
        }
        let mut kinds: Vec<(Kind, usize)> = counts.into_iter().collect();
        kinds.sort_by(|a, b| {
            b.1.cmp(&a.1)
                .then_with(|| format!("{:?}", a.0).cmp(&format!("{:?}", b.0)))
        });
        let mut kept = 0;
        let mut workload = Vec::new();
        for (k, n) in kinds {
            if kept * 100 >= tasks.len() * 95 {
                break;
            }
            kept += n;
            workload.push((k, n as f64));
        }
        workload.iter_mut().for_each(|(_, w)| *w /= kept as f64);
        Fgd {
            exact,
            workload,
            order: shuffled(nodes, 42),
            memo: vec![(u64::MAX, HashMap::new()); nodes],
        }
    }

    /// The node's expected fragmentation (thousandths of a GPU) over the
    /// workload: for each type, the free GPU share it could not use.
    fn fragmentation(&self, n: &NodeState, cpu_free: u64, gpus: &[u32]) -> f64 {
        let all: u32 = gpus.iter().sum();
        self.workload
            .iter()
            .map(|(k, w)| {
                let hosts = k.num_gpu > 0
                    && k.cpu_milli <= cpu_free
                    && (k.models == 0 || k.models & (1 << n.model) != 0)
                    && gpus.iter().filter(|&&f| f >= k.gpu_milli).count() >= k.num_gpu as usize;
                let frag = if hosts {
                    gpus.iter().filter(|&&f| f < k.gpu_milli).sum()
                } else {
                    all
                };
                w * f64::from(frag)
            })
            .sum()
    }

    /// The least fragmentation `t` adds on node `i`, and the GPUs of it.
    fn best_move(&self, n: &NodeState, t: &Task) -> (f64, Vec<usize>) {
        let before = self.fragmentation(n, n.cpu_free, &n.gpus);
        let cpu = n.cpu_free - t.cpu_milli;
        n.options(t)
            .into_iter()
            .map(|gpus| {
                let mut after = n.gpus.clone();
                gpus.iter().for_each(|&g| after[g] -= NodeState::take(t));
                (self.fragmentation(n, cpu, &after) - before, gpus)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .expect("the node fits")
    }
}

impl Policy for Fgd {
    fn place(&mut self, c: &Cluster, t: &Task) -> Option<Placement> {
        let kind = Kind::of(t);
        let mut best: Option<(f64, usize, Vec<usize>)> = None;
        for idx in 0..self.order.len() {
            let i = self.order[idx];
            let n = &c.nodes[i];
            if !n.fits(t) {
                continue;
            }
            if self.memo[i].0 != c.versions[i] {
                self.memo[i] = (c.versions[i], HashMap::new());
            }
            let (delta, gpus) = match self.memo[i].1.get(&kind) {
                Some(m) => m.clone(),
                None => {
                    let m = self.best_move(n, t);
                    self.memo[i].1.insert(kind.clone(), m.clone());
                    m
                }
            };
            // The simulator's score: whole points of a sigmoid, so that
            // moves within a few hundredths of a GPU tie (and go to the
            // first node in its order).
            let delta = if self.exact {
                delta
            } else {
                -(100.0 / (1.0 + (delta / 1000.0).exp())).floor()
            };
            if best.as_ref().is_none_or(|(b, _, _)| delta < *b) {
                best = Some((delta, i, gpus));
            }
        }
        best.map(|(_, node, gpus)| Placement { node, gpus })
    }
}
