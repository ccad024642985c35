//! The replayed cluster: what each node has left, the one truth every
//! policy reads and every placement is checked against before it counts.

use super::load::{Task, TraceNode};

/// Thousandths of a GPU in one GPU.
pub const GPU: u32 = 1000;

#[derive(Debug, Clone)]
pub struct NodeState {
    pub cpu_free: u64,
    pub memory_free: u64,
    pub cpu: u64,
    pub memory: u64,
    pub model: usize,
    /// Per GPU: thousandths free.
    pub gpus: Vec<u32>,
}

impl NodeState {
    /// Whether the node's CPU, memory and GPU model take `t`, GPUs aside.
    pub fn hosts(&self, t: &Task) -> bool {
        t.cpu_milli <= self.cpu_free && t.memory_mib <= self.memory_free && t.allows(self.model)
    }

    pub fn free_gpus(&self) -> usize {
        self.gpus.iter().filter(|&&f| f == GPU).count()
    }

    /// Whether `t` fits here at all: on one GPU with its share free, or on
    /// as many GPUs free of any work as it takes whole.
    pub fn fits(&self, t: &Task) -> bool {
        self.hosts(t)
            && match (t.num_gpu, t.shared()) {
                (0, _) => true,
                (_, true) => self.gpus.iter().any(|&f| f >= t.gpu_milli),
                (n, false) => self.free_gpus() >= n as usize,
            }
    }

    /// Every set of GPUs `t` could take here, up to GPUs of equal free
    /// room (which leave the node the same): one GPU with room for a
    /// share; for `k` whole GPUs, the first `k` free ones (all free GPUs
    /// of a node are alike); none for a CPU-only task.
    pub fn options(&self, t: &Task) -> Vec<Vec<usize>> {
        if !self.fits(t) {
            return Vec::new();
        }
        if t.num_gpu == 0 {
            return vec![Vec::new()];
        }
        if !t.shared() {
            let free = (0..self.gpus.len()).filter(|&g| self.gpus[g] == GPU);
            return vec![free.take(t.num_gpu as usize).collect()];
        }
        let mut seen = Vec::new();
        (0..self.gpus.len())
            .filter(|&g| self.gpus[g] >= t.gpu_milli)
            .filter(|&g| {
                let new = !seen.contains(&self.gpus[g]);
                seen.push(self.gpus[g]);
                new
            })
            .map(|g| vec![g])
            .collect()
    }

    /// Thousandths of a GPU `t` takes from GPU `g` it is placed on.
    pub fn take(t: &Task) -> u32 {
        if t.shared() { t.gpu_milli } else { GPU }
    }
}

/// Where a task goes: its node and the GPUs it takes there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub node: usize,
    pub gpus: Vec<usize>,
}

pub struct Cluster {
    pub nodes: Vec<NodeState>,
    /// Thousandths of a GPU in all, and allocated.
    pub capacity: u64,
    pub allocated: u64,
    /// Bumped on each node a placement changes: caches keyed by it.
    pub versions: Vec<u64>,
}

impl Cluster {
    pub fn new(nodes: &[TraceNode]) -> Cluster {
        let nodes: Vec<NodeState> = nodes
            .iter()
            .map(|n| NodeState {
                cpu_free: n.cpu_milli,
                memory_free: n.memory_mib,
                cpu: n.cpu_milli,
                memory: n.memory_mib,
                model: n.model,
                gpus: vec![GPU; n.gpus],
            })
            .collect();
        Cluster {
            capacity: nodes
                .iter()
                .map(|n| n.gpus.len() as u64 * u64::from(GPU))
                .sum(),
            allocated: 0,
            versions: vec![0; nodes.len()],
            nodes,
        }
    }

    /// Takes `t`'s resources at `p`, after checking that they are free
    /// there: a policy that places a task where it does not fit is a
    /// defect of the policy, not a figure.
    pub fn apply(&mut self, t: &Task, p: &Placement) {
        let n = &mut self.nodes[p.node];
        assert!(n.hosts(t), "node {} cannot host {t:?}", p.node);
        let mut gpus = p.gpus.clone();
        gpus.sort_unstable();
        gpus.dedup();
        let want = if t.num_gpu == 0 {
            0
        } else if t.shared() {
            1
        } else {
            t.num_gpu as usize
        };
        assert_eq!(gpus.len(), want, "{t:?} placed on GPUs {:?}", p.gpus);
        let take = NodeState::take(t);
        for &g in &gpus {
            let free = n.gpus[g];
            assert!(
                free >= take && (t.shared() || free == GPU),
                "GPU {g} of node {} has {free} free for {t:?}",
                p.node
            );
            n.gpus[g] -= take;
        }
        n.cpu_free -= t.cpu_milli;
        n.memory_free -= t.memory_mib;
        self.allocated += u64::from(take) * gpus.len() as u64;
        self.versions[p.node] += 1;
    }
}
