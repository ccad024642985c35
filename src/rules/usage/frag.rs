//! GPU fragmentation, as *Beware of Fragmentation* (Weng et al., USENIX
//! ATC '23) defines it: the free GPU share of a node that a kind of pod
//! could not use. A pod that cannot run on the node at all (too little
//! CPU, too few GPUs free of work, no GPU that holds one of its shares)
//! could use none of it; one that can run there cannot use the GPUs too
//! full for it (for whole GPUs: every GPU already in use); a pod asking no
//! GPU uses none of it. Over the cluster's [`Workload`], the kinds of pods
//! it runs weighted by how common each is, this is the node's expected
//! fragmentation, and the extender's fragmentation policy places each pod
//! where it grows least ([`Workload::fragmentation`], `fit::added`).
//!
//! Free GPU is counted in thousandths of a GPU: of a GPU no whole ask
//! holds, the mean of its free shares of memory and of compute. Shares ask
//! devices; what a device is worth is each node's ([`Inventory::amount`]),
//! so one kind of pod is measured on each node as it would be granted
//! there.

use std::collections::HashMap;

use super::{Inventory, NodeUsage, PodAsks};
use crate::rules::device::{PerResource, Resource};

/// Thousandths of a GPU in one GPU.
pub(crate) const GPU: u64 = 1000;

/// The most common kinds of pods, down to this share of the pods, make
/// the workload (the paper's 95 %): the rare ones cost the measure time
/// and move it little.
const KEEP_PERCENT: u64 = 95;

/// A kind of pod, as fragmentation sees it: the CPU it asks of the node
/// and what its containers ask of GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Kind {
    pub(crate) cpu_milli: u64,
    /// Memory and core devices of each container asking a share, sorted.
    pub(crate) shares: Vec<[u64; 2]>,
    /// GPUs its containers take whole.
    pub(crate) whole: u64,
}

impl Kind {
    /// The kind of a pod asking `asks`: its app containers' and sidecars'
    /// GPUs (an init container that ends hands its GPUs on, so it asks
    /// nothing more of the node).
    pub(crate) fn of(asks: &PodAsks) -> Kind {
        let lasting = asks.containers.iter().filter(|c| !c.hands_on());
        let mut kind = Kind {
            cpu_milli: asks.cpu_milli,
            ..Kind::default()
        };
        for c in lasting {
            if c.whole() {
                kind.whole += c.devices.count;
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
}

/// The kinds of pods the cluster runs, each with its share of them.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Workload {
    kinds: Vec<(Kind, f64)>,
}

/// A node as fragmentation measures it: its GPUs, what they carry, and
/// the CPU it has left (`None`: not known, never what stops a pod).
#[derive(Debug, Clone, Copy)]
pub(crate) struct NodeRoom<'a> {
    pub(crate) inventory: &'a Inventory,
    pub(crate) usage: &'a NodeUsage,
    pub(crate) cpu_free: Option<u64>,
}

impl NodeRoom<'_> {
    /// Thousandths of GPU `g` free for new work: none of an unhealthy GPU
    /// or one held whole, else the mean of its free memory and core.
    fn free(&self, g: usize) -> u64 {
        let (inv, u) = (self.inventory, self.usage);
        if !inv.gpus[g].healthy || u.gpus[g].held_whole() {
            return 0;
        }
        let cap = inv.capacity(g);
        let share = |r: Resource| (u.free(inv, g, r) * GPU).checked_div(cap[r]).unwrap_or(0);
        (share(Resource::GpuMemory) + share(Resource::GpuCore)) / 2
    }

    /// Whether GPU `g` takes a share of `need` (real units).
    fn holds(&self, g: usize, need: &PerResource<u64>) -> bool {
        let (inv, u) = (self.inventory, self.usage);
        inv.gpus[g].healthy
            && !u.gpus[g].held_whole()
            && [Resource::GpuMemory, Resource::GpuCore]
                .into_iter()
                .all(|r| u.free(inv, g, r) >= need[r])
    }

    /// Thousandths of a GPU free on the node, all GPUs together.
    pub(crate) fn gpu_free(&self) -> u64 {
        (0..self.inventory.gpus.len()).map(|g| self.free(g)).sum()
    }

    fn free_of_work(&self, g: usize) -> bool {
        let u = &self.usage.gpus[g];
        self.inventory.gpus[g].healthy && !u.held_whole() && !u.carries_shared()
    }

    /// The free thousandths of GPU that `kind` could not use here.
    fn stranded(&self, kind: &Kind, free: &[u64]) -> u64 {
        let all = free.iter().sum();
        let gpus = 0..free.len();
        if !kind.asks_gpus() || self.cpu_free.is_some_and(|c| c < kind.cpu_milli) {
            return all;
        }
        if kind.whole > 0 {
            let fresh = gpus.clone().filter(|&g| self.free_of_work(g)).count() as u64;
            if fresh < kind.whole {
                return all;
            }
        }
        let needs: Vec<PerResource<u64>> = kind
            .shares
            .iter()
            .map(|&[memory, core]| {
                self.inventory.amount(&PerResource {
                    memory,
                    core,
                    count: 0,
                })
            })
            .collect();
        let held: Vec<bool> = gpus
            .clone()
            .map(|g| needs.iter().any(|n| self.holds(g, n)))
            .collect();
        let every_share_held = needs.iter().all(|n| gpus.clone().any(|g| self.holds(g, n)));
        if !every_share_held {
            return all;
        }
        gpus.filter(|&g| {
            if needs.is_empty() {
                !self.free_of_work(g)
            } else {
                !held[g]
            }
        })
        .map(|g| free[g])
        .sum()
    }
}

impl Workload {
    /// The workload of pods counted by kind: the most common kinds down to
    /// [`KEEP_PERCENT`] of the pods (ties in kind order), each weighted by
    /// its share of those.
    pub(crate) fn of(counts: &HashMap<Kind, u64>) -> Workload {
        let total: u64 = counts.values().sum();
        let mut kinds: Vec<(&Kind, u64)> = counts
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| (k, *n))
            .collect();
        kinds.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        let mut kept = 0;
        let mut chosen = Vec::new();
        for (k, n) in kinds {
            if kept * 100 >= total * KEEP_PERCENT {
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
        let free: Vec<u64> = (0..node.inventory.gpus.len())
            .map(|g| node.free(g))
            .collect();
        self.kinds
            .iter()
            .map(|(kind, w)| w * node.stranded(kind, &free) as f64)
            .sum()
    }
}
