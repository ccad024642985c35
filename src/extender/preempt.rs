//! Preemption that frees one GPU (kube-scheduler's `preemptVerb`).
//!
//! The scheduler's own preemption weighs a node's totals of `gpu-memory`
//! and `gpu-core`: it can evict pods spread over several GPUs and still
//! leave no GPU with room, and the preemptor stays Pending after the
//! evictions. Here, for each node the scheduler offers, the victims are
//! pods of lower priority whose going lets every container of the
//! preemptor fit as the filter places it (each share on one GPU, whole
//! GPUs free of work, the node's CPU and memory), checked by the filter's
//! own fit.
//! A node where even all of them going makes no room is dropped.
//!
//! The choice, in this order: the fewest victims; then the lowest highest
//! priority among them; then the lowest sum of their priorities; then the
//! fewest PodDisruptionBudget violations (each by the scheduler's rule,
//! over the set chosen). The scheduler then chooses among the nodes by
//! its own order (fewest violations first).
//!
//! The search is bounded. A greedy pass (every candidate out, then each
//! back in while the pod still fits, highest priority first and, among
//! equals, the smallest holder first) gives a set none of whose pods could
//! stay. Then sets of each size up to it are tried, smallest first, each
//! only if it could beat the best so far, within [`CHECKS_PER_NODE`] fit
//! checks (and [`CHECKS_PER_REQUEST`] over the request's nodes); past that
//! the best found stands. A lone shared container can only go on one GPU,
//! so its sets are drawn from one GPU's pods at a time, every GPU's sets
//! of one size before the next size.
//!
//! Only GPUs, CPU and memory are weighed here. The scheduler's own
//! victims that hold no GPU stay victims: its dry run chose them for what
//! is not weighed here (ports, the pod count, extended resources).
//!
//! Pods still being bound here are not victims (the scheduler may not
//! know them yet) but hold their room; pods the extender bound that the
//! kubelet has not admitted hold theirs by their assignment and can be
//! victims. Pods kube-scheduler nominated after an earlier preemption,
//! of the preemptor's priority or higher, keep their room, as in the
//! filter.

use std::cmp::Reverse;

use super::index::{Holder, Index, NodeRequests, PodName};
use super::plan::{Asking, nominees};
use crate::rules::usage::{Inventory, NodeAsk, NodeUsage, fits};

/// The pods to evict on a node, and how many of them break a budget.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Victims {
    /// Each pod's name and UID (what the scheduler looks it up by).
    pub(crate) pods: Vec<(PodName, String)>,
    pub(crate) budget_violations: i64,
}

/// Fit checks one node's search may make beyond its greedy pass: a few
/// milliseconds.
const CHECKS_PER_NODE: usize = 1024;

/// Fit checks one request's searches may make together beyond their
/// greedy passes (which cost one check per pod of the node): past it,
/// the nodes left get their greedy set. Whatever the scheduler (or
/// anyone reaching the extender) offers, a request costs at most this.
pub(crate) const CHECKS_PER_REQUEST: usize = 64 * CHECKS_PER_NODE;

/// The victims on `node` that make room for `asking`; `None` where no set
/// of lower-priority pods does (or the node publishes no GPUs). `kept`:
/// the UIDs of the scheduler's own victims there; those holding no GPU
/// stay victims (they made room for what is not weighed here: memory,
/// ports, the pod count). `budget`: the request's checks left.
pub(crate) fn victims(
    ix: &Index,
    node: &str,
    asking: &Asking,
    kept: &[&str],
    budget: &mut usize,
) -> Option<Victims> {
    let holders = ix.holders(node)?;
    let inv = holders.inventory;
    let lower = |h: &Holder| h.evictable && h.priority < asking.priority && !h.uid.is_empty();
    let (gone, pods): (Vec<Holder>, Vec<Holder>) = holders
        .pods
        .into_iter()
        .partition(|h| lower(h) && h.holdings.is_empty() && kept.contains(&h.uid.as_str()));
    let (candidates, fixed): (Vec<Holder>, Vec<Holder>) = pods.into_iter().partition(lower);
    let mut base = NodeUsage::empty(inv);
    let mut requests = NodeRequests {
        requested: NodeAsk::default(),
        ..holders.requests
    };
    for h in &fixed {
        for held in &h.holdings {
            base.add(inv, held);
        }
        requests.requested = requests.requested.plus(h.node_ask);
    }
    // Nominees go where they fit with every pod still there, as the
    // filter places them, and stay there whatever is evicted.
    if let Some((held, nominated)) = nominees(ix, node, inv, holders.usage, asking) {
        held.iter().for_each(|h| base.add(inv, h));
        requests.requested = requests.requested.plus(nominated);
    }
    let mut s = Search {
        inv,
        base,
        requests,
        candidates: &candidates,
        asking,
        checks: 0,
    };
    let greedy = s.greedy()?;
    let mut best = Best::of(ix, &candidates, greedy);
    let allowed = CHECKS_PER_NODE.min(*budget);
    let greedy_checks = s.checks;
    s.improve(ix, &s.pools(), &mut best, greedy_checks + allowed);
    *budget = budget.saturating_sub(s.checks - greedy_checks);
    let chosen = best.set.iter().map(|&i| &candidates[i]);
    let pods: Vec<(PodName, String)> = chosen
        .chain(&gone)
        .map(|h| (h.key.clone(), h.uid.clone()))
        .collect();
    let keys: Vec<&PodName> = pods.iter().map(|(k, _)| k).collect();
    Some(Victims {
        budget_violations: ix.budget_violations(&keys),
        pods,
    })
}

/// A set of victims (indexes into the candidates) and how it ranks: the
/// lesser key is the better set.
struct Best {
    set: Vec<usize>,
    key: (usize, i32, i64, i64),
}

impl Best {
    fn of(ix: &Index, candidates: &[Holder], set: Vec<usize>) -> Best {
        let (len, max, sum) = priorities(candidates, &set);
        let keys: Vec<&PodName> = set.iter().map(|&i| &candidates[i].key).collect();
        Best {
            key: (len, max, sum, ix.budget_violations(&keys)),
            set,
        }
    }
}

/// A set's size, highest priority and sum of priorities.
fn priorities(candidates: &[Holder], set: &[usize]) -> (usize, i32, i64) {
    let max = set
        .iter()
        .map(|&i| candidates[i].priority)
        .max()
        .unwrap_or(i32::MIN);
    let sum = set.iter().map(|&i| i64::from(candidates[i].priority)).sum();
    (set.len(), max, sum)
}

struct Search<'a> {
    inv: &'a Inventory,
    /// What stays whatever is evicted: the pods that are no candidates,
    /// and the nominated pods that keep their room.
    base: NodeUsage,
    requests: NodeRequests,
    candidates: &'a [Holder],
    asking: &'a Asking,
    checks: usize,
}

impl Search<'_> {
    /// Whether the pod fits once the candidates marked `out` are gone.
    fn fits_without(&mut self, out: &[bool]) -> bool {
        self.checks += 1;
        let mut usage = self.base.clone();
        let mut requested = self.requests.requested;
        for (c, &gone) in self.candidates.iter().zip(out) {
            if !gone {
                for held in &c.holdings {
                    usage.add(self.inv, held);
                }
                requested = requested.plus(c.node_ask);
            }
        }
        let asks = &self.asking.asks;
        requested.plus(asks.node).within(self.requests.allocatable) && fits(self.inv, &usage, asks)
    }

    /// Every candidate out, then each back in while the pod still fits;
    /// `None` when it does not fit even with all of them out.
    fn greedy(&mut self) -> Option<Vec<usize>> {
        let n = self.candidates.len();
        let mut out = vec![true; n];
        if !self.fits_without(&out) {
            return None;
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| {
            (
                Reverse(self.candidates[i].priority),
                held(&self.candidates[i]),
            )
        });
        for i in order {
            out[i] = false;
            if !self.fits_without(&out) {
                out[i] = true;
            }
        }
        Some((0..n).filter(|&i| out[i]).collect())
    }

    /// The candidates the sets are drawn from, each pool lowest priority
    /// first: those holding GPUs (and those holding only CPU or memory,
    /// when the node is short of them), or for a lone shared container those of one
    /// GPU at a time.
    fn pools(&self) -> Vec<Vec<usize>> {
        let asks = &self.asking.asks;
        let all_stay = self
            .candidates
            .iter()
            .fold(self.requests.requested, |a, c| a.plus(c.node_ask));
        let short = !all_stay.plus(asks.node).within(self.requests.allocatable);
        let useful = |c: &Holder, gpu: Option<&str>| match gpu {
            _ if c.holdings.is_empty() => short,
            None => true,
            Some(g) => c.holdings.iter().any(|h| h.gpus.iter().any(|u| u == g)),
        };
        let pool = |gpu: Option<&str>| {
            let mut p: Vec<usize> = (0..self.candidates.len())
                .filter(|&i| useful(&self.candidates[i], gpu))
                .collect();
            p.sort_by_key(|&i| {
                (
                    self.candidates[i].priority,
                    Reverse(held(&self.candidates[i])),
                )
            });
            p
        };
        let gpu_asks: Vec<_> = asks
            .containers
            .iter()
            .filter(|c| c.whole() || c.shared())
            .collect();
        match gpu_asks.as_slice() {
            [one] if one.shared() => self
                .inv
                .gpus
                .iter()
                .map(|g| pool(Some(g.uuid.as_str())))
                .collect(),
            _ => vec![pool(None)],
        }
    }

    /// Tries the sets of each pool, smallest size first across the pools,
    /// each only where it could rank better than `best`, until `limit`
    /// checks are made.
    fn improve(&mut self, ix: &Index, pools: &[Vec<usize>], best: &mut Best, limit: usize) {
        let mut size = 1;
        while size <= best.set.len() {
            for pool in pools.iter().filter(|p| p.len() >= size) {
                if !self.improve_at(ix, pool, size, best, limit) {
                    return;
                }
            }
            size += 1;
        }
    }

    /// [`Search::improve`] over the sets of `size` of one pool; false once
    /// the checks ran out.
    fn improve_at(
        &mut self,
        ix: &Index,
        pool: &[usize],
        size: usize,
        best: &mut Best,
        limit: usize,
    ) -> bool {
        let mut pick: Vec<usize> = (0..size).collect();
        loop {
            if self.checks >= limit {
                return false;
            }
            let set: Vec<usize> = pick.iter().map(|&j| pool[j]).collect();
            let (len, max, sum) = priorities(self.candidates, &set);
            if (len, max, sum) <= (best.key.0, best.key.1, best.key.2) {
                let mut out = vec![false; self.candidates.len()];
                set.iter().for_each(|&i| out[i] = true);
                if self.fits_without(&out) {
                    let found = Best::of(ix, self.candidates, set);
                    if found.key < best.key {
                        *best = found;
                    }
                }
            }
            if !next_pick(&mut pick, pool.len()) {
                return true;
            }
        }
    }
}

/// How much a pod holds of the node's GPUs: whole GPUs, then MiB.
fn held(c: &Holder) -> (u64, u64) {
    c.holdings.iter().fold((0, 0), |(n, m), h| {
        (
            n.saturating_add(h.amount.count),
            m.saturating_add(h.amount.memory),
        )
    })
}

/// The next `pick.len()` of `n` indexes in lexical order; false after the
/// last.
fn next_pick(pick: &mut [usize], n: usize) -> bool {
    let k = pick.len();
    for i in (0..k).rev() {
        if pick[i] < n - k + i {
            pick[i] += 1;
            for j in i + 1..k {
                pick[j] = pick[j - 1] + 1;
            }
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extender::plan::Planner;
    use crate::extender::test_pods::{app, gpu_node, gpu_pod};
    use crate::rules::usage::Policy;
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;

    const GIB: u64 = 1024;

    /// [`super::victims`] with no victim of the scheduler's to keep and a
    /// request's whole budget.
    fn victims(ix: &Index, node: &str, asking: &Asking) -> Option<Victims> {
        super::victims(ix, node, asking, &[], &mut { CHECKS_PER_REQUEST })
    }

    /// A pod of `priority` holding `mib` of `gpu` on node `n` (bound, its
    /// assignment written, not yet admitted), or whole GPUs for `mib` 0.
    fn holder(name: &str, priority: i32, gpu: &str, mib: u64) -> Pod {
        let wants = if mib == 0 { [0, 0, 1] } else { [mib, 0, 0] };
        let mut p = gpu_pod("ns", name, &[app("app", wants)]);
        let spec = p.spec.get_or_insert_default();
        spec.node_name = Some("n".into());
        spec.priority = Some(priority);
        let assignment = format!(r#"{{"app":["{gpu}"]}}"#);
        p.metadata
            .annotations
            .get_or_insert_default()
            .insert("doslab.io/gpu-assignment".into(), assignment);
        p
    }

    fn preemptor(priority: i32, wants: [u64; 3]) -> Asking {
        asking("high", priority, wants)
    }

    fn asking(name: &str, priority: i32, wants: [u64; 3]) -> Asking {
        let mut p = gpu_pod("ns", name, &[app("app", wants)]);
        p.spec.get_or_insert_default().priority = Some(priority);
        Planner::new("doslab.io", Policy::Binpack)
            .asks(&p)
            .expect("a GPU pod")
    }

    /// A node of two 40 GiB GPUs and `pods` on it.
    fn node(pods: &[Pod]) -> Index {
        let mut ix = Index::new("doslab.io");
        ix.apply_node(gpu_node("n", &[("GPU-a", 40 * GIB), ("GPU-b", 40 * GIB)]));
        for p in pods {
            ix.apply_pod(p.clone());
        }
        ix
    }

    fn names(v: &Victims) -> Vec<&str> {
        let mut n: Vec<&str> = v.pods.iter().map(|(k, _)| k.1.as_str()).collect();
        n.sort();
        n
    }

    /// Two GPUs each 10 GiB free: a 25 GiB share is made room for on one
    /// GPU, by the fewest pods, of the lowest priority, never spread
    /// over both (the scheduler's node totals would take 15 GiB anywhere).
    #[test]
    fn the_fewest_lowest_priority_pods_of_one_gpu_go() {
        let ix = node(&[
            holder("a1", 1, "GPU-a", 10 * GIB),
            holder("a2", 1, "GPU-a", 10 * GIB),
            holder("a3", 1, "GPU-a", 10 * GIB),
            holder("b1", 0, "GPU-b", 10 * GIB),
            holder("b2", 0, "GPU-b", 10 * GIB),
            holder("b3", 0, "GPU-b", 10 * GIB),
        ]);
        let v = victims(&ix, "n", &preemptor(100, [25 * GIB, 0, 0])).unwrap();
        assert_eq!(names(&v).len(), 2);
        assert!(names(&v).iter().all(|n| n.starts_with('b')), "{v:?}");
        assert_eq!(v.budget_violations, 0);
        assert!(
            v.pods
                .iter()
                .all(|(k, uid)| uid == &format!("uid-ns-{}", k.1))
        );

        // One pod rather than two of lower priority; of single pods, the
        // lowest priority.
        let ix = node(&[
            holder("a1", 0, "GPU-a", 5 * GIB),
            holder("a2", 0, "GPU-a", 5 * GIB),
            holder("a3", 0, "GPU-a", 5 * GIB),
            holder("a4", 1, "GPU-a", 15 * GIB),
            holder("b1", 2, "GPU-b", 30 * GIB),
        ]);
        let v = victims(&ix, "n", &preemptor(100, [25 * GIB, 0, 0])).unwrap();
        assert_eq!(names(&v), ["a4"]);
    }

    /// Pods of the preemptor's priority or higher are never victims, and a
    /// node where no set of the others makes room is dropped.
    #[test]
    fn equal_or_higher_priority_pods_stay_and_no_room_drops_the_node() {
        let ix = node(&[
            holder("a1", 100, "GPU-a", 20 * GIB),
            holder("a2", 0, "GPU-a", 10 * GIB),
            holder("b1", 200, "GPU-b", 30 * GIB),
            holder("b2", 0, "GPU-b", 5 * GIB),
        ]);
        let v = victims(&ix, "n", &preemptor(100, [20 * GIB, 0, 0])).unwrap();
        assert_eq!(names(&v), ["a2"]);
        assert_eq!(victims(&ix, "n", &preemptor(100, [25 * GIB, 0, 0])), None);
        assert_eq!(victims(&ix, "n", &preemptor(100, [41 * GIB, 0, 0])), None);
        assert_eq!(victims(&ix, "other", &preemptor(100, [GIB, 0, 0])), None);
    }

    /// A whole-GPU preemptor frees a whole GPU: every pod on the one with
    /// fewer, and none of a GPU held whole by a higher priority.
    #[test]
    fn whole_gpu_preemptors_free_whole_gpus() {
        let ix = node(&[
            holder("a1", 0, "GPU-a", 5 * GIB),
            holder("a2", 0, "GPU-a", 5 * GIB),
            holder("b1", 0, "GPU-b", GIB),
        ]);
        let v = victims(&ix, "n", &preemptor(100, [0, 0, 1])).unwrap();
        assert_eq!(names(&v), ["b1"]);
        let v = victims(&ix, "n", &preemptor(100, [0, 0, 2])).unwrap();
        assert_eq!(names(&v), ["a1", "a2", "b1"]);
        let ix = node(&[holder("a", 500, "GPU-a", 0), holder("b1", 0, "GPU-b", GIB)]);
        assert_eq!(victims(&ix, "n", &preemptor(100, [0, 0, 2])), None);
        let v = victims(&ix, "n", &preemptor(100, [0, 0, 1])).unwrap();
        assert_eq!(names(&v), ["b1"]);
    }

    /// The scheduler's victims that hold no GPU stay (they made room for
    /// what is not weighed here); those holding GPUs are chosen anew. A
    /// spent request budget leaves the greedy set, still one that fits.
    #[test]
    fn the_schedulers_gpu_less_victims_stay_and_a_spent_budget_keeps_the_greedy_set() {
        let mut cpu_only = gpu_pod("ns", "cpu", &[app("app", [0, 0, 0])]);
        let spec = cpu_only.spec.get_or_insert_default();
        spec.node_name = Some("n".into());
        spec.priority = Some(0);
        let ix = node(&[
            holder("a1", 0, "GPU-a", 30 * GIB),
            holder("b1", 0, "GPU-b", 30 * GIB),
            cpu_only,
        ]);
        let kept = ["uid-ns-cpu", "uid-ns-a1"];
        let asking = preemptor(100, [20 * GIB, 0, 0]);
        let v = super::victims(&ix, "n", &asking, &kept, &mut { CHECKS_PER_REQUEST }).unwrap();
        assert_eq!(names(&v).len(), 2, "{v:?}");
        assert!(names(&v).contains(&"cpu"), "{v:?}");
        let mut spent = 0;
        let v = super::victims(&ix, "n", &asking, &[], &mut spent).unwrap();
        assert_eq!(names(&v).len(), 1, "{v:?}");
    }

    /// A node short of the memory the preemptor requests makes room with
    /// a pod holding only memory, though its GPUs already have room; with
    /// the memory left, no pod goes.
    #[test]
    fn memory_the_preemptor_needs_is_freed_too() {
        let request = |mut p: Pod, memory: &str| {
            let c = &mut p.spec.get_or_insert_default().containers[0];
            let q = k8s_openapi::apimachinery::pkg::api::resource::Quantity(memory.into());
            let requests = c
                .resources
                .get_or_insert_default()
                .requests
                .get_or_insert_default();
            requests.insert("memory".into(), q);
            p
        };
        let mut ix = node(&[holder("a1", 0, "GPU-a", 10 * GIB)]);
        let mut n = gpu_node("n", &[("GPU-a", 40 * GIB), ("GPU-b", 40 * GIB)]);
        let q = k8s_openapi::apimachinery::pkg::api::resource::Quantity("8Gi".into());
        let status = n.status.get_or_insert_default();
        status
            .allocatable
            .get_or_insert_default()
            .insert("memory".into(), q);
        ix.apply_node(n);
        let mut hog = request(gpu_pod("ns", "hog", &[app("app", [0, 0, 0])]), "6Gi");
        let spec = hog.spec.get_or_insert_default();
        spec.node_name = Some("n".into());
        spec.priority = Some(0);
        ix.apply_pod(hog);
        let mut high = request(
            gpu_pod("ns", "high", &[app("app", [10 * GIB, 0, 0])]),
            "4Gi",
        );
        high.spec.get_or_insert_default().priority = Some(100);
        let planner = Planner::new("doslab.io", Policy::Binpack);
        let asking = planner.asks(&high).expect("a GPU pod");
        let v = victims(&ix, "n", &asking).unwrap();
        assert_eq!(names(&v), ["hog"]);
        let small = request(high, "2Gi");
        let v = victims(&ix, "n", &planner.asks(&small).unwrap()).unwrap();
        assert!(names(&v).is_empty(), "{v:?}");
    }

    /// A pod whose bind is in flight holds its room and is no victim.
    #[test]
    fn binds_in_flight_hold_their_room_and_stay() {
        let mut ix = node(&[holder("a1", 0, "GPU-a", 30 * GIB)]);
        let mut binding = holder("b1", 0, "GPU-b", 30 * GIB);
        binding.spec.get_or_insert_default().node_name = Some("n".into());
        let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
        ix.reserve(binding, super::super::index::Stage::Binding, until);
        let v = victims(&ix, "n", &preemptor(100, [20 * GIB, 0, 0])).unwrap();
        assert_eq!(names(&v), ["a1"]);
        assert_eq!(victims(&ix, "n", &preemptor(100, [0, 0, 2])), None);
    }

    /// Among sets alike in size and priority, the fewest budget
    /// violations; a budget's pods already disrupted cost nothing.
    #[test]
    fn disruption_budgets_break_ties_and_are_counted_as_the_scheduler_does() {
        let labelled = |name: &str, gpu: &str, app: &str| {
            let mut p = holder(name, 0, gpu, 30 * GIB);
            p.metadata.labels = Some([("app".to_owned(), app.to_owned())].into());
            p
        };
        let mut ix = node(&[
            labelled("a1", "GPU-a", "guarded"),
            labelled("b1", "GPU-b", "free"),
        ]);
        let pdb = |allowed: i32, disrupted: &[&str]| -> PodDisruptionBudget {
            let disrupted: serde_json::Map<String, serde_json::Value> = disrupted
                .iter()
                .map(|d| (d.to_string(), "2026-01-01T00:00:00Z".into()))
                .collect();
            serde_json::from_value(serde_json::json!({
                "metadata": {"namespace": "ns", "name": "guard"},
                "spec": {"selector": {"matchLabels": {"app": "guarded"}}},
                "status": {"disruptionsAllowed": allowed, "disruptedPods": disrupted,
                    "currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1},
            }))
            .unwrap()
        };
        ix.apply_budget(&pdb(0, &[]));
        let v = victims(&ix, "n", &preemptor(100, [20 * GIB, 0, 0])).unwrap();
        assert_eq!((names(&v), v.budget_violations), (vec!["b1"], 0));
        let v = victims(&ix, "n", &preemptor(100, [0, 0, 2])).unwrap();
        assert_eq!(v.budget_violations, 1);
        ix.apply_budget(&pdb(0, &["a1"]));
        let v = victims(&ix, "n", &preemptor(100, [0, 0, 2])).unwrap();
        assert_eq!(v.budget_violations, 0);
        ix.apply_budget(&pdb(1, &[]));
        assert_eq!(ix.budget_violations(&[&("ns".into(), "a1".into())]), 0);
        ix.delete_budget(&pdb(0, &[]));
        ix.apply_budget(&pdb(-1, &[]));
        ix.replace_budgets(&[]);
        let v = victims(&ix, "n", &preemptor(100, [0, 0, 2])).unwrap();
        assert_eq!(v.budget_violations, 0);
    }

    /// A nominated preemptor's room, once its victims are gone, is kept
    /// from pods ranked below it, by the filter and by a second preemption
    /// alike, and not from pods above it.
    #[test]
    fn a_nominated_pod_keeps_the_room_freed_for_it() {
        let mut ix = node(&[holder("a1", 0, "GPU-a", 30 * GIB)]);
        let mut nominee = gpu_pod("ns", "nominee", &[app("app", [30 * GIB, 0, 0])]);
        nominee.spec.get_or_insert_default().priority = Some(100);
        nominee.status.get_or_insert_default().nominated_node_name = Some("n".into());
        ix.apply_pod(nominee);
        let p = Planner::new("doslab.io", Policy::Binpack);
        let low = preemptor(50, [20 * GIB, 0, 0]);
        let high = preemptor(101, [20 * GIB, 0, 0]);
        // GPU-b is the nominee's: no lower priority fits, nor an equal one
        // not nominated here, nor another nominee after it in name order;
        // one before it, or a higher priority, does (a total order, so
        // that of two nominees one always fits).
        let equal = |name: &str, nominated: bool| Asking {
            nominated: nominated.then(|| "n".to_owned()),
            ..asking(name, 100, [20 * GIB, 0, 0])
        };
        assert!(p.fits(&ix, "n", &low).is_err());
        assert!(p.fits(&ix, "n", &equal("aa", false)).is_err());
        assert!(p.fits(&ix, "n", &equal("zz", true)).is_err());
        assert!(p.fits(&ix, "n", &equal("aa", true)).is_ok());
        assert!(p.fits(&ix, "n", &high).is_ok());
        // A lower-priority preemptor may evict a1 but not take GPU-b.
        let v = victims(&ix, "n", &preemptor(60, [20 * GIB, 0, 0])).unwrap();
        assert_eq!(names(&v), ["a1"]);
        // Bound, it holds by its own record; nominated no more.
        let mut bound = holder("nominee", 100, "GPU-b", 30 * GIB);
        bound.status.get_or_insert_default().nominated_node_name = Some("n".into());
        ix.apply_pod(bound);
        assert!(!ix.has_nominated("n"));
        assert!(p.fits(&ix, "n", &high).is_err());
    }
}
