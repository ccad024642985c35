//! Which GPU has room: the one choice every placement makes, with its
//! policies as named orders. Callers measure their GPUs as [`Candidate`]s
//! (each in its own units: device IDs on the node, real units in the usage
//! model) and [`choose`] ranks them:
//!
//! - [`Order::BestFit`] (binpack over a node's GPUs): the least room left
//!   once the ask is on it, memory before core, so the GPU with the largest
//!   hole stays free for the largest ask. The extender's fit tries GPUs in
//!   this order and the node's pod matcher places a lone container by it
//!   ([`super::best_shared`]); GetPreferredAllocation hints by it from the
//!   kubelet's free IDs of one resource.
//! - [`Order::Roomiest`] (spread): the most room left in the scarcer
//!   resource, as a share of the GPU. Without pod matching, a container's
//!   first shared grant goes there since its second ask is not known yet;
//!   GetPreferredAllocation falls back to it when no GPU holds the ask.
//! - [`Order::NumaWhole`]: whole GPUs on as few NUMA nodes as possible
//!   (stay on a node already used, else the node with the fewest GPUs free
//!   that holds the rest, else the one with the most), best fit within a
//!   node. The node's GetPreferredAllocation, the extender's fit and the
//!   pod matcher (for a container whose share rides inside whole GPUs) all
//!   choose whole GPUs by it (the last two through
//!   [`super::whole_gpus`]), so they agree. Only when that choice leaves a
//!   pod's shared containers no room does the fit's bounded search go on to
//!   the other sets of free GPUs (smallest first); the node then follows
//!   the pod's assignment, so the two still agree.
//!
//! A preferred candidate (the pod's own GPU, the kubelet's must-include)
//! comes first under every order; ties go to the lowest GPU index. The
//! extender's [`super::Policy`] ranks nodes, not GPUs: within a node the
//! choice is the same whatever the policy, so the node never disagrees.

use std::cmp::Ordering;
use std::collections::BTreeMap;

/// One GPU an ask may go to, as its caller measures it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) gpu: usize,
    /// Memory and core free on it once the ask is there (for a whole ask:
    /// all the GPU has, what the ask takes from other work), in units the
    /// caller uses for every candidate alike.
    pub(crate) left: [u64; 2],
    /// Memory and core it holds in all; 0 for one the caller does not
    /// track, which [`Order::Roomiest`] then leaves out.
    pub(crate) all: [u64; 2],
    pub(crate) numa: Option<u32>,
    /// Already the ask's, or where it should go if it can: first.
    pub(crate) preferred: bool,
}

/// How to rank the candidates; the module doc says who uses which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// Least `left`, memory before core (binpack).
    BestFit,
    /// Most of the scarcer tracked resource left, as a share (spread).
    Roomiest,
    /// Fewest NUMA nodes, then [`Order::BestFit`] within one.
    NumaWhole,
}

/// Up to `n` GPUs of `candidates`, the best first under `order`.
pub(crate) fn choose(mut candidates: Vec<Candidate>, n: usize, order: Order) -> Vec<usize> {
    match order {
        Order::BestFit => candidates.sort_by_key(|c| (!c.preferred, c.left, c.gpu)),
        Order::Roomiest => candidates.sort_by(|a, b| {
            (!a.preferred)
                .cmp(&!b.preferred)
                .then_with(|| by_share(scarcest(b), scarcest(a)))
                .then(a.gpu.cmp(&b.gpu))
        }),
        Order::NumaWhole => return numa_whole(candidates, n),
    }
    candidates.into_iter().take(n).map(|c| c.gpu).collect()
}

/// What is left of the candidate's scarcer tracked resource, as the share
/// `(left, all)` of the GPU.
fn scarcest(c: &Candidate) -> (u64, u64) {
    (0..2)
        .filter(|&r| c.all[r] > 0)
        .map(|r| (c.left[r], c.all[r]))
        .min_by(|&a, &b| by_share(a, b))
        .unwrap_or((0, 1))
}

/// Compares two shares `(left, all)` exactly.
fn by_share((a, of_a): (u64, u64), (b, of_b): (u64, u64)) -> Ordering {
    (u128::from(a) * u128::from(of_b)).cmp(&(u128::from(b) * u128::from(of_a)))
}

/// The preferred candidates, then whole NUMA nodes' worth: a node already
/// used, else the node with the fewest candidates that still holds the
/// rest, else the one with the most (a node of unknown NUMA counts as one).
fn numa_whole(candidates: Vec<Candidate>, n: usize) -> Vec<usize> {
    let (mut out, rest): (Vec<Candidate>, Vec<Candidate>) =
        candidates.into_iter().partition(|c| c.preferred);
    out.truncate(n);
    let mut nodes: BTreeMap<Option<u32>, Vec<Candidate>> = BTreeMap::new();
    for c in rest {
        nodes.entry(c.numa).or_default().push(c);
    }
    for on_node in nodes.values_mut() {
        on_node.sort_by_key(|c| (c.left, c.gpu));
    }
    while out.len() < n && !nodes.is_empty() {
        let need = n - out.len();
        let used = nodes.keys().find(|k| out.iter().any(|c| c.numa == **k));
        let fewest = || {
            nodes
                .iter()
                .filter(|(_, on)| on.len() >= need)
                .min_by_key(|(_, on)| on.len())
                .map(|(k, _)| k)
        };
        let most = || nodes.iter().max_by_key(|(_, on)| on.len()).map(|(k, _)| k);
        let node = *used
            .or_else(fewest)
            .or_else(most)
            .expect("nodes is not empty");
        let on_node = nodes.remove(&node).expect("node came from nodes");
        out.extend(on_node.into_iter().take(need));
    }
    out.into_iter().map(|c| c.gpu).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPU with `left` of memory and core left out of 100 each.
    fn gpu(gpu: usize, memory: u64, core: u64) -> Candidate {
        Candidate {
            gpu,
            left: [memory, core],
            all: [100, 100],
            ..Candidate::default()
        }
    }

    #[test]
    fn best_fit_leaves_the_largest_hole_and_breaks_ties_on_core_then_index() {
        let c = vec![
            gpu(0, 50, 0),
            gpu(1, 10, 90),
            gpu(2, 10, 20),
            gpu(3, 10, 20),
        ];
        assert_eq!(choose(c.clone(), 4, Order::BestFit), [2, 3, 1, 0]);
        let mut own = c;
        own[0].preferred = true;
        assert_eq!(choose(own, 1, Order::BestFit), [0]);
    }

    #[test]
    fn roomiest_keeps_the_most_of_the_scarcer_resource_as_a_share() {
        // GPU 0 has the most memory left but little core.
        let c = vec![gpu(0, 90, 5), gpu(1, 40, 40), gpu(2, 40, 60)];
        assert_eq!(choose(c.clone(), 3, Order::Roomiest), [1, 2, 0]);
        // A resource the caller does not track is left out; shares, not
        // amounts: 60 of 200 is less room than 40 of 100.
        let untracked = |gpu, left, all| Candidate {
            gpu,
            left: [left, 0],
            all: [all, 0],
            ..Candidate::default()
        };
        let c = vec![untracked(0, 60, 200), untracked(1, 40, 100)];
        assert_eq!(choose(c, 2, Order::Roomiest), [1, 0]);
    }

    fn whole(gpu: usize, numa: u32, memory: u64) -> Candidate {
        Candidate {
            gpu,
            left: [memory, 0],
            numa: Some(numa),
            ..Candidate::default()
        }
    }

    #[test]
    fn numa_whole_packs_onto_the_fewest_nodes_then_the_smallest_gpus() {
        // Node 0: GPUs 0, 1; node 1: GPUs 4, 5, 6 (GPU 5 the smallest).
        let c = vec![
            whole(0, 0, 80),
            whole(1, 0, 80),
            whole(4, 1, 80),
            whole(5, 1, 40),
            whole(6, 1, 80),
        ];
        // Two fit node 0 exactly: node 1's three stay together.
        assert_eq!(choose(c.clone(), 2, Order::NumaWhole), [0, 1]);
        // One: the node with fewest free, the smallest GPU there.
        assert_eq!(choose(c.clone(), 1, Order::NumaWhole), [0]);
        assert_eq!(choose(c.clone(), 3, Order::NumaWhole), [5, 4, 6]);
        // A preferred GPU on node 1 keeps the rest there.
        let mut own = c.clone();
        own[4].preferred = true;
        assert_eq!(choose(own, 2, Order::NumaWhole), [6, 5]);
        // More than a node holds spills over, the largest node first.
        assert_eq!(choose(c, 4, Order::NumaWhole), [5, 4, 6, 0]);
    }
}
