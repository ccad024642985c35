//! GPU fragmentation, as *Beware of Fragmentation* (Weng et al., USENIX
//! ATC '23) defines it: the free GPU share of a node that a kind of pod
//! could not use. A pod that cannot run on the node at all (too little
//! CPU or memory, too few GPUs free of work, no GPU that holds one of its
//! shares) could use none of it; one that can run there cannot use the
//! GPUs too full for it (for whole GPUs: every GPU already in use); a pod
//! asking no GPU uses none of it. Over the cluster's [`Workload`], the kinds of pods
//! it runs weighted by how common each is, this is the node's expected
//! fragmentation, and the extender's fragmentation policy places each pod
//! where it grows least ([`Workload::fragmentation`]; the extender's
//! `plan::least_fragmenting`).
//!
//! Free GPU is counted in thousandths of a GPU: of a GPU no whole ask
//! holds, the mean of its free shares of memory and of compute. Shares ask
//! devices; what a device is worth is each node's ([`Inventory::amount`]),
//! so one kind of pod is measured on each node as it would be granted
//! there. A kind that may not run on a node ([`NodeSelection`]: a GPU
//! model its pods ask for, say) could use none of its GPUs. The paper
//! weighs a node's CPU alone; memory counts here as CPU does, since the
//! scheduler refuses a pod either way (on the trace's multigpu50 variant,
//! 175 GPUs left unallocated against 186 without it: benches/README).

use std::collections::{BTreeMap, HashMap};

use super::{Inventory, NodeAsk, NodeSelection, NodeUsage, PodAsks};
use crate::rules::device::Resource;

/// Thousandths of a GPU in one GPU.
const GPU: u64 = 1000;

/// The most common kinds of pods, down to this share of the pods, make
/// the workload (the paper's 95 %): the rare ones cost the measure time
/// and move it little.
const KEEP_PERCENT: u64 = 95;

/// And at most this many kinds: a cluster of many small kinds would
/// otherwise make each node's measure cost a pass over each of them (the
/// trace's 95 % are 35 kinds).
const MAX_KINDS: usize = 64;

/// A kind of pod, as fragmentation sees it: the CPU and memory it asks of
/// the node, what its containers ask of GPUs, and the nodes it may run on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Kind {
    pub(crate) node: NodeAsk,
    /// Memory and core devices of each container asking a share, sorted.
    pub(crate) shares: Vec<[u64; 2]>,
    /// GPUs its containers take whole.
    pub(crate) whole: u64,
    pub(crate) nodes: NodeSelection,
}

impl Kind {
    /// The kind of a pod asking `asks`: its app containers' and sidecars'
    /// GPUs (an init container that ends hands its GPUs on, so it asks
    /// nothing more of the node), on the nodes its spec admits.
    pub(crate) fn of(asks: &PodAsks, nodes: NodeSelection) -> Kind {
        let lasting = asks.containers.iter().filter(|c| !c.hands_on());
        let mut kind = Kind {
            node: asks.node,
            nodes,
            ..Kind::default()
        };
        for c in lasting {
            if c.whole() {
                // Counts are the pod's to write: never past u64.
                kind.whole = kind.whole.saturating_add(c.devices.count);
            } else if c.shared() {
                kind.shares.push([c.devices.memory, c.devices.core]);
            }
        }
        kind.shares.sort_unstable();
        kind
    }

    fn asks_gpus(&self) -> bool {
        self.whole > 0 || !self.shares.is_empty()
    }

    /// Whether pods of this kind count in a workload: pods asking nothing
    /// of the node nor GPUs (a DaemonSet's agents, often one a node) fit on any
    /// node and are never stranded; counted, they would only shrink the
    /// other kinds' weights, and with them which moves tie.
    fn weighs(&self) -> bool {
        self.node != NodeAsk::default() || self.asks_gpus()
    }
}

/// The kinds of pods the cluster runs, each with its share of them.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Workload {
    kinds: Vec<(Kind, f64)>,
}

/// A node as fragmentation measures it: its GPUs, what they carry, the
/// CPU and memory it has left and its labels.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NodeRoom<'a> {
    pub(crate) inventory: &'a Inventory,
    pub(crate) usage: &'a NodeUsage,
    pub(crate) free: NodeAsk,
    pub(crate) labels: &'a BTreeMap<String, String>,
}

/// One GPU as a measure reads it, read once per measure of its node.
#[derive(Debug, Clone, Copy)]
struct GpuRoom {
    /// Memory and core free in real units; `None`: it takes no share
    /// (unhealthy, or held whole).
    left: Option<[u64; 2]>,
    /// Thousandths of it free for new work: the mean of its free memory
    /// and core.
    free: u64,
    /// Thousandths of its memory free: all a kind asking no compute can
    /// use of it.
    memory: u64,
    /// Free of any work: a whole ask can take it.
    fresh: bool,
}

impl GpuRoom {
    fn holds(&self, need: [u64; 2]) -> bool {
        self.left
            .is_some_and(|l| l[0] >= need[0] && l[1] >= need[1])
    }
}

impl NodeRoom<'_> {
    fn gpus(&self) -> Vec<GpuRoom> {
        let (inv, u) = (self.inventory, self.usage);
        (0..inv.gpus.len())
            .map(|g| {
                if !inv.gpus[g].healthy || u.gpus[g].held_whole() {
                    return GpuRoom {
                        left: None,
                        free: 0,
                        memory: 0,
                        fresh: false,
                    };
                }
                let cap = inv.capacity(g);
                let left = [Resource::GpuMemory, Resource::GpuCore].map(|r| u.free(inv, g, r));
                let share =
                    |i: usize, r: Resource| (left[i] * GPU).checked_div(cap[r]).unwrap_or(0);
                let memory = share(0, Resource::GpuMemory);
                GpuRoom {
                    left: Some(left),
                    free: (memory + share(1, Resource::GpuCore)) / 2,
                    memory,
                    fresh: !u.gpus[g].carries_shared(),
                }
            })
            .collect()
    }

    /// The free thousandths of GPU that `kind` could not use here.
    fn stranded(&self, kind: &Kind, gpus: &[GpuRoom]) -> u64 {
        // What a kind could use of a GPU is what it asks of it: the
        // compute of a GPU whose memory is full is no loss to pods that
        // ask memory alone (and counting it would steer them away from
        // filling GPUs: 80 % of the fill mix's memory held, not 98 %).
        let memory_only =
            kind.whole == 0 && !kind.shares.is_empty() && kind.shares.iter().all(|s| s[1] == 0);
        let free = |g: &GpuRoom| if memory_only { g.memory } else { g.free };
        let all = gpus.iter().map(free).sum();
        if !kind.asks_gpus() || !kind.node.within(self.free) || !kind.nodes.admits(self.labels) {
            return all;
        }
        if kind.whole > gpus.iter().filter(|g| g.fresh).count() as u64 {
            return all;
        }
        if kind.shares.is_empty() {
            return gpus.iter().filter(|g| !g.fresh).map(free).sum();
        }
        let unit = self.inventory.unit();
        let needs: Vec<[u64; 2]> = kind
            .shares
            .iter()
            .map(|&[memory, core]| {
                [
                    memory.saturating_mul(unit.memory),
                    core.saturating_mul(unit.core),
                ]
            })
            .collect();
        if !needs.iter().all(|&n| gpus.iter().any(|g| g.holds(n))) {
            return all;
        }
        gpus.iter()
            .filter(|g| !needs.iter().any(|&n| g.holds(n)))
            .map(free)
            .sum()
    }
}

impl Workload {
    pub(crate) fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.kinds.len()
    }

    /// The workload of pods counted by kind: the most common kinds down to
    /// [`KEEP_PERCENT`] of the pods, [`MAX_KINDS`] at most (ties in kind
    /// order), each weighted by its share of those; kinds that do not
    /// [`Kind::weighs`] left out. None (empty) while fewer than
    /// `at_least` pods weigh.
    pub(crate) fn of(counts: &HashMap<Kind, u64>, at_least: u64) -> Workload {
        let mut kinds: Vec<(&Kind, u64)> = counts
            .iter()
            .filter(|(k, n)| **n > 0 && k.weighs())
            .map(|(k, n)| (k, *n))
            .collect();
        let total: u64 = kinds.iter().map(|(_, n)| n).sum();
        if total < at_least {
            return Workload::default();
        }
        kinds.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        let mut kept = 0;
        let mut chosen = Vec::new();
        for (k, n) in kinds {
            if kept * 100 >= total * KEEP_PERCENT || chosen.len() == MAX_KINDS {
                break;
            }
            kept += n;
            chosen.push((k.clone(), n as f64));
        }
        chosen.iter_mut().for_each(|(_, w)| *w /= kept as f64);
        Workload { kinds: chosen }
    }

    /// The node's expected fragmentation, in thousandths of a GPU: the
    /// free GPU each kind of pod could not use, weighted by its share.
    pub(crate) fn fragmentation(&self, node: &NodeRoom) -> f64 {
        let gpus = node.gpus();
        self.kinds
            .iter()
            .map(|(kind, w)| w * node.stranded(kind, &gpus) as f64)
            .sum()
    }
}
