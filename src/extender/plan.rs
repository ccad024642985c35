//! The extender's decisions over a snapshot of the cluster: whether a pod
//! fits a node (and why not), how well, and what a bind writes. Pure but
//! for a memo of its judgements, each kept only while the node's state
//! stamp stays: the usage model does the GPU arithmetic on the nodes'
//! inventories and usage the [`Index`] keeps.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Pod;

use super::RequestError;
use super::index::{Gpus, Index, NodeRequests, PodName, pod_name, priority};
use crate::rules::usage::{
    Assignment, Holding, Inventory, Keys, Ledger, NodeAsk, NodeRoom, NodeUsage, PodAsks, Policy,
    Workload, alternatives, fit, leftover, pod_holdings, room_after, score,
};

/// Why a node is filtered out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FilterRefusal {
    pub(crate) reason: String,
    /// Waiting or preempting pods cannot change it.
    pub(crate) never: bool,
}

/// What a bind writes on the pod, and the pod as it will be once bound
/// (counted while the bind is in flight).
#[derive(Debug, Clone)]
pub(crate) struct BindPlan {
    /// The Binding's annotations, which the API server sets on the pod.
    pub(crate) annotations: BTreeMap<String, String>,
    pub(crate) reserved: Pod,
}

/// How well a node suits a pod under the policy: the greater, the better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Rank {
    /// Binpack: minus the MiB the pod leaves on the GPUs it takes
    /// ([`leftover`]), then 0. Fragmentation: how little fragmentation the
    /// pod adds ([`added_score`]), then whether the node's GPUs already
    /// carry work ([`at_work`]). Spread: 0, 0: the score alone ranks.
    key: [i64; 2],
    /// The policy's 0..=10 ([`score`]): under binpack, the busier node
    /// among those the pod leaves as much room on.
    pub(crate) score: u8,
}

/// 0..=100 for the fragmentation a pod adds to a node (thousandths of a
/// GPU; negative where it takes pieces no other kind of pod could use),
/// 50 for none: the paper's sigmoid of it in GPUs, whole points only, so
/// that moves within a few hundredths of a GPU of each other tie and go
/// by a fixed order ([`at_work`], then the GPUs the pod lands on fullest,
/// then the name): FGD on the trace leaves 291 GPUs unallocated so, 440
/// ranked by the exact amount (10 seeds; benches/README.md, Placement on
/// a trace). The fragmentation a pod adds is a weak signal at that scale,
/// and a fixed order gathers the pods that tie on the same nodes.
fn added_score(added: f64) -> i64 {
    (100.0 / (1.0 + (added / 1000.0).exp())).floor() as i64
}

/// 0 for a node whose GPUs already carry work, -1 for one whose GPUs are
/// all idle: among moves that fragment alike, a pod joins the nodes in use
/// and the idle ones stay whole for the asks that need an idle node. Ties
/// broken by the least room left instead spread those pods (317 GPUs
/// unallocated on the trace against 303; benches/README.md).
fn at_work(usage: &NodeUsage) -> i64 {
    -i64::from(usage.gpus.iter().all(|g| g.idle()))
}

pub struct Planner {
    keys: Keys,
    policy: Policy,
    /// What was judged of each pod shape on each node, while the node's
    /// state stamp stays: a burst's pods come in a few shapes, and
    /// between two of them only the nodes they went to change, so filter
    /// and prioritize over thousands of nodes mostly look up. Beside it,
    /// under the same lock (each judgement reads both), the workload they
    /// were judged against.
    memo: Mutex<Memo>,
}

#[derive(Default)]
struct Memo {
    nodes: HashMap<String, Judged>,
    learned: Learned,
}

/// A node's judgements at one state stamp and workload.
struct Judged {
    stamp: u64,
    generation: u64,
    shapes: Vec<(PodAsks, Result<Rank, FilterRefusal>)>,
}

/// The workload the fragmentation policy measures against, as last
/// learned from the index's pods, and when.
#[derive(Default)]
struct Learned {
    /// The index's count of pod changes when it was learned.
    at: Option<u64>,
    pods: u64,
    /// Grows each time it is learned again: the memo's judgements are of
    /// one generation.
    generation: u64,
    workload: Arc<Workload>,
}

/// The workload is learned again once this share of the pods it was
/// learned from (or [`RELEARN_MIN`] pods, if more) came or went: a kind's
/// weight moves little in between, and each time every node's judgements
/// are made anew.
const RELEARN_DIVISOR: u64 = 16;

/// Below this many pods the workload is not learned, and the
/// fragmentation policy packs as binpack does: a few pods tell little of
/// the kinds to come, and fragmentation measured against them strands
/// room for the first kind not yet seen (the fill test's harder mix, 20 to
/// 50 pods to its first refusal: 78.1 % of GPU memory held against
/// binpack's 84.4 %; on the trace, whose 8,000 tasks it hardly touches,
/// 3-8 GPUs of 6,212 within the seeds' noise; benches/README).
const LEARNED_FROM: u64 = 64;
const RELEARN_MIN: u64 = 8;

impl Learned {
    /// The workload now, and its generation: learned again from the index
    /// when its pods moved enough since, under the fragmentation policy
    /// (the others keep the empty one).
    fn current(&mut self, policy: Policy, ix: &Index) -> (u64, Arc<Workload>) {
        if policy == Policy::Fragmentation {
            let (counts, changes) = ix.kinds();
            let moved = self.at.is_none_or(|at| {
                changes.abs_diff(at) >= (self.pods / RELEARN_DIVISOR).max(RELEARN_MIN)
            });
            if moved {
                self.workload = Arc::new(Workload::of(counts, LEARNED_FROM));
                self.pods = counts.values().sum();
                self.at = Some(changes);
                self.generation += 1;
            }
        }
        (self.generation, self.workload.clone())
    }
}

/// The pod shapes remembered per node; past it a node's memo starts over.
const SHAPES_PER_NODE: usize = 32;

/// A pod the planner places: what it asks, and who it is beside the pods
/// kube-scheduler nominated after a preemption (those ranked above it keep
/// their room from it: [`nominees`]).
#[derive(Debug, Clone)]
pub(crate) struct Asking {
    pub(crate) asks: PodAsks,
    pub(crate) key: PodName,
    pub(crate) priority: i32,
    /// The node kube-scheduler nominated it to, if any.
    pub(crate) nominated: Option<String>,
}

/// A node that fits: its GPUs, their usage, and where the pod would go.
struct Fit<'a> {
    inventory: &'a Inventory,
    usage: Cow<'a, NodeUsage>,
    assignment: Assignment,
    /// Fragmentation: what the pod adds there.
    added: f64,
}

impl Planner {
    pub(crate) fn new(domain: &str, policy: Policy) -> Planner {
        Planner {
            keys: Keys::new(domain),
            policy,
            memo: Mutex::default(),
        }
    }

    fn memo(&self) -> std::sync::MutexGuard<'_, Memo> {
        self.memo.lock().expect("memo lock poisoned")
    }

    /// The pod's asks, where the policy places it: every pod under the
    /// fragmentation policy (a pod asking only CPU strands GPUs where it
    /// takes the CPU they need), else only pods asking GPUs (`None`: not
    /// ours to place, and it costs nothing). A limit that cannot be read
    /// is ours: it is refused in [`Planner::fits`], never read as no ask.
    pub(crate) fn asks(&self, pod: &Pod) -> Option<Asking> {
        let asks = PodAsks::from_pod(&self.keys, pod);
        (asks_gpus(&asks) || self.policy == Policy::Fragmentation).then(|| Asking {
            asks,
            key: pod_name(pod),
            priority: priority(pod),
            nominated: pod
                .status
                .as_ref()
                .and_then(|s| s.nominated_node_name.clone()),
        })
    }

    fn place<'a>(
        &self,
        ix: &'a Index,
        node: &str,
        asking: &Asking,
        workload: &Workload,
    ) -> Result<Fit<'a>, FilterRefusal> {
        let asks = &asking.asks;
        let never = |reason: String| FilterRefusal {
            reason,
            never: true,
        };
        if let Some(e) = asks.invalid() {
            return Err(never(e.to_string()));
        }
        let key = &self.keys.inventory;
        let (inventory, usage, requests, labels) = match ix.gpus(node) {
            None => {
                return Err(FilterRefusal {
                    reason: "node is not in the extender's cache yet".into(),
                    never: false,
                });
            }
            Some(Gpus::Unpublished) => {
                return Err(never(format!(
                    "node has no {key} annotation (the GPU device plugin does not run there, \
                     or is older than the extender); GPU pods cannot be placed on it"
                )));
            }
            Some(Gpus::Unreadable(e)) => return Err(never(format!("annotation {key}: {e}"))),
            Some(Gpus::Published {
                inventory,
                usage,
                requests,
                labels,
            }) => (inventory, usage, *requests, labels),
        };
        let (usage, requests) = match nominees(ix, node, inventory, usage, asking) {
            Some((held, nominated)) => {
                let mut usage = usage.clone();
                held.iter().for_each(|h| usage.add(inventory, h));
                let requested = requests.requested.plus(nominated);
                (
                    Cow::Owned(usage),
                    NodeRequests {
                        requested,
                        ..requests
                    },
                )
            }
            None => (Cow::Borrowed(usage), requests),
        };
        let assignment = fit(inventory, &usage, asks).map_err(|e| FilterRefusal {
            reason: e.to_string(),
            never: e.unresolvable,
        })?;
        let fit = Fit {
            inventory,
            usage,
            assignment,
            added: 0.0,
        };
        Ok(match self.policy {
            Policy::Fragmentation => least_fragmenting(fit, requests, labels, asks, workload),
            Policy::Binpack | Policy::Spread => fit,
        })
    }

    /// Whether every container of the pod fits on `node` at once, and if
    /// so how the node ranks for it.
    pub(crate) fn fits(
        &self,
        ix: &Index,
        node: &str,
        asks: &Asking,
    ) -> Result<Rank, FilterRefusal> {
        self.judge(ix, node, asks)
    }

    /// How `node` ranks for the pod under the policy; `None` where the pod
    /// does not fit.
    pub(crate) fn rank(&self, ix: &Index, node: &str, asks: &Asking) -> Option<Rank> {
        self.judge(ix, node, asks).ok()
    }

    /// Where the pod does not fit on `node`, why; else how it ranks there:
    /// from the memo while the node is as it was and no pod is nominated
    /// there (whose room depends on who asks).
    fn judge(&self, ix: &Index, node: &str, asking: &Asking) -> Result<Rank, FilterRefusal> {
        let mut guard = self.memo();
        let memo = &mut *guard;
        let (generation, workload) = memo.learned.current(self.policy, ix);
        let asks = &asking.asks;
        let stamp = ix.stamp(node).filter(|_| !ix.has_nominated(node));
        let Some(stamp) = stamp else {
            return self.judge_now(ix, node, asking, &workload);
        };
        let memo = &mut memo.nodes;
        if let Some(j) = memo
            .get(node)
            .filter(|j| j.stamp == stamp && j.generation == generation)
            && let Some((_, judged)) = j.shapes.iter().find(|(a, _)| a == asks)
        {
            return judged.clone();
        }
        let judged = self.judge_now(ix, node, asking, &workload);
        // Nodes gone from the index leave the memo once it outgrows it.
        if memo.len() > 2 * ix.node_count() + SHAPES_PER_NODE {
            memo.retain(|n, _| ix.stamp(n).is_some());
        }
        let j = memo.entry(node.to_owned()).or_insert(Judged {
            stamp,
            generation,
            shapes: Vec::new(),
        });
        if j.stamp != stamp || j.generation != generation || j.shapes.len() >= SHAPES_PER_NODE {
            j.stamp = stamp;
            j.generation = generation;
            j.shapes.clear();
        }
        j.shapes.push((asks.clone(), judged.clone()));
        judged
    }

    fn judge_now(
        &self,
        ix: &Index,
        node: &str,
        asking: &Asking,
        workload: &Workload,
    ) -> Result<Rank, FilterRefusal> {
        let asks = &asking.asks;
        if !asks_gpus(asks) && !matches!(ix.gpus(node), Some(Gpus::Published { .. })) {
            // A pod asking no GPU strands none on a node without GPUs
            // (or whose GPUs are unknown here): the kubelet's checks are
            // the scheduler's own.
            return Ok(Rank {
                key: [added_score(0.0), 0],
                score: 0,
            });
        }
        let f = self.place(ix, node, asking, workload)?;
        let key = match self.policy {
            Policy::Fragmentation if !workload.is_empty() => {
                [added_score(f.added), at_work(&f.usage)]
            }
            // Fragmentation with nothing learned yet packs.
            Policy::Binpack | Policy::Fragmentation => {
                let left = leftover(f.inventory, &f.usage, asks, &f.assignment);
                [-i64::try_from(left).unwrap_or(i64::MAX), 0]
            }
            Policy::Spread => [0, 0],
        };
        Ok(Rank {
            key,
            score: score(f.inventory, &f.usage, asks, &f.assignment, self.policy),
        })
    }

    /// Chooses the GPUs of the pod's containers on `node` against the
    /// current state; `None` for a pod the policy does not place. `now_nanos` is
    /// the assume time (UnixNano) the node's matcher orders pods by.
    pub(crate) fn plan_bind(
        &self,
        ix: &Index,
        pod: &Pod,
        node: &str,
        now_nanos: u128,
    ) -> Result<Option<BindPlan>, RequestError> {
        let Some(asking) = self.asks(pod) else {
            return Ok(None);
        };
        if !asks_gpus(&asking.asks) {
            // Placed for its CPU: nothing to write; counted on the node
            // while its bind runs.
            let mut reserved = pod.clone();
            reserved.spec.get_or_insert_default().node_name = Some(node.to_owned());
            return Ok(Some(BindPlan {
                annotations: BTreeMap::new(),
                reserved,
            }));
        }
        let (_, workload) = self.memo().learned.current(self.policy, ix);
        let f = self
            .place(ix, node, &asking, &workload)
            .map_err(|r| RequestError::NoRoom(r.reason))?;
        let k = &self.keys;
        // A Binding only sets annotations: a stale `gpu-uuid` on a pod
        // planned across GPUs stays, and its assignment decides (SPEC §3).
        let mut annotations = BTreeMap::from([
            (k.assignment.clone(), f.assignment.to_json()),
            (k.assume_time.clone(), now_nanos.to_string()),
            (k.assigned.clone(), "false".into()),
        ]);
        if let Some(gpu) = f.assignment.single_gpu() {
            annotations.insert(k.gpu_uuid.clone(), gpu.to_owned());
        }
        let mut reserved = pod.clone();
        let on_pod = reserved.metadata.annotations.get_or_insert_default();
        on_pod.extend(annotations.clone());
        reserved.spec.get_or_insert_default().node_name = Some(node.to_owned());
        Ok(Some(BindPlan {
            annotations,
            reserved,
        }))
    }
}

/// Whether the pod asks GPUs (or a limit that cannot be read, which may).
pub(super) fn asks_gpus(asks: &PodAsks) -> bool {
    asks.invalid().is_some() || asks.containers.iter().any(|c| c.whole() || c.shared())
}

/// `fit` moved to the GPUs of the node where the pod adds the least
/// fragmentation for `workload` (the fit's own choice among equals), with
/// what it adds.
fn least_fragmenting<'a>(
    fit: Fit<'a>,
    requests: NodeRequests,
    labels: &BTreeMap<String, String>,
    asks: &PodAsks,
    workload: &Workload,
) -> Fit<'a> {
    let room = NodeRoom {
        inventory: fit.inventory,
        usage: &fit.usage,
        free: requests.free(),
        labels,
    };
    let before = workload.fragmentation(&room);
    let mut best: Option<(f64, Assignment)> = None;
    for a in alternatives(fit.inventory, &fit.usage, asks, &fit.assignment) {
        let (usage, free) = room_after(&room, asks, &a);
        let after = NodeRoom {
            usage: &usage,
            free,
            ..room
        };
        let added = workload.fragmentation(&after) - before;
        if best.as_ref().is_none_or(|(b, _)| added < *b) {
            best = Some((added, a));
        }
    }
    let (added, assignment) = best.expect("the fit's own assignment is an alternative");
    Fit {
        assignment,
        added,
        ..fit
    }
}

/// Where the pods kube-scheduler nominated to `node` that `asking` must
/// leave room for go on `usage`, each where it fits now, and the CPU and
/// memory they ask; `None` when there are none. Those are the nominees of higher
/// priority and those of equal priority, except, against another nominee
/// of this node, the ones after it in name order. The scheduler counts
/// every nominee of equal priority against another, which its node totals
/// can afford (two nominees that fit the totals together each fit beside
/// the other) but GPUs cannot (two that fit one GPU each in turn may not
/// fit it together), and each would keep the other Pending for good. A
/// nominee that does not fit yet (its victims still terminating) holds
/// nothing: the victims still hold its room.
pub(super) fn nominees(
    ix: &Index,
    node: &str,
    inventory: &Inventory,
    usage: &NodeUsage,
    asking: &Asking,
) -> Option<(Vec<Holding>, NodeAsk)> {
    let nominees: Vec<_> = ix
        .nominated_to(node)
        .into_iter()
        .filter(|(key, priority, _)| {
            let own = asking.nominated.as_deref() == Some(node);
            (*priority, true, Reverse(*key)) > (asking.priority, own, Reverse(&asking.key))
        })
        .collect();
    if nominees.is_empty() {
        return None;
    }
    let mut usage = usage.clone();
    let (mut held, mut node_ask) = (Vec::new(), NodeAsk::default());
    for (_, _, asks) in nominees {
        if let Ok(a) = fit(inventory, &usage, &asks) {
            for h in pod_holdings(inventory, &asks.containers, &Ledger::default(), &a) {
                usage.add(inventory, &h);
                held.push(h);
            }
            node_ask = node_ask.plus(asks.node);
        }
    }
    Some((held, node_ask))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extender::test_pods::{Wants, gpu_node, gpu_pod, node_with};

    fn c(name: &str, init: bool, memory: u64, core: u64, count: u64) -> Wants<'_> {
        Wants {
            name,
            init,
            devices: [memory, core, count],
        }
    }

    /// `pod` bound to `node` with `annotations`.
    fn bound(mut pod: Pod, node: &str, annotations: &[(&str, &str)]) -> Pod {
        pod.spec.get_or_insert_default().node_name = Some(node.into());
        let on_pod = pod.metadata.annotations.get_or_insert_default();
        for (k, v) in annotations {
            on_pod.insert(k.to_string(), v.to_string());
        }
        pod
    }

    fn planner() -> Planner {
        Planner::new("doslab.io", Policy::Binpack)
    }

    fn refusal(p: &Planner, ix: &Index, node: &str, pod: &Pod) -> FilterRefusal {
        p.fits(ix, node, &p.asks(pod).unwrap()).unwrap_err()
    }

    #[test]
    fn refusals_say_why_and_whether_waiting_helps() {
        let mut ix = Index::new("doslab.io");
        ix.apply_node(gpu_node("big", &[("GPU-a", 40960), ("GPU-b", 24576)]));
        ix.apply_node(gpu_node("small", &[("GPU-s", 24576)]));
        ix.apply_node(node_with("bare", None));
        ix.apply_node(node_with("future", Some(r#"{"version":2}"#)));
        ix.apply_node(node_with("garbled", Some("{")));
        // 20480 MiB of GPU-a held by a served pod.
        let ledger = r#"{"app":{"gpus":["GPU-a"],"gpu-memory":20480}}"#;
        let holder = gpu_pod("ns", "holder", &[c("app", false, 20480, 0, 0)]);
        ix.apply_pod(bound(holder, "big", &[("doslab.io/gpu-ledger", ledger)]));
        let p = planner();
        let pod = gpu_pod("ns", "p", &[c("app", false, 30720, 10, 0)]);

        let r = refusal(&p, &ix, "big", &pod);
        assert_eq!(
            r.reason,
            "container app: no GPU has 30720 MiB free (largest 24576 MiB on GPU-b)"
        );
        assert!(!r.never);
        let r = refusal(&p, &ix, "small", &pod);
        assert!(r.never && r.reason.contains("30720 MiB"), "{r:?}");
        let r = refusal(&p, &ix, "bare", &pod);
        assert!(r.never && r.reason.contains("no doslab.io/gpu-inventory annotation"));
        let r = refusal(&p, &ix, "future", &pod);
        assert!(r.never && r.reason.contains("version 2"), "{r:?}");
        let r = refusal(&p, &ix, "garbled", &pod);
        assert!(r.never && r.reason.contains("not valid JSON"), "{r:?}");
        let r = refusal(&p, &ix, "nowhere", &pod);
        assert!(!r.never && r.reason.contains("not in the extender's cache"));

        // A pod asking nothing of ours is not planned at all.
        assert!(
            p.asks(&gpu_pod("ns", "cpu", &[c("app", false, 0, 0, 0)]))
                .is_none()
        );
    }

    /// The memo answers only while the node is as it was: a pod bound
    /// there, gone again, the node gone and back smaller.
    #[test]
    fn judgements_are_remembered_only_while_the_node_stays_as_it_was() {
        let mut ix = Index::new("doslab.io");
        ix.apply_node(gpu_node("n", &[("GPU-a", 1024)]));
        let p = planner();
        let asks = p
            .asks(&gpu_pod("ns", "p", &[c("a", false, 768, 0, 0)]))
            .unwrap();
        assert!(p.fits(&ix, "n", &asks).is_ok());
        let other = gpu_pod("ns", "q", &[c("a", false, 512, 0, 0)]);
        let assigned = [("doslab.io/gpu-assignment", r#"{"a":["GPU-a"]}"#)];
        ix.apply_pod(bound(other.clone(), "n", &assigned));
        assert!(p.fits(&ix, "n", &asks).is_err());
        ix.delete_pod(&crate::extender::pod_name(&other));
        assert!(p.fits(&ix, "n", &asks).is_ok());
        ix.delete_node("n");
        assert!(p.fits(&ix, "n", &asks).is_err());
        ix.apply_node(gpu_node("n", &[("GPU-a", 512)]));
        assert!(p.fits(&ix, "n", &asks).is_err());
    }

    #[test]
    fn all_containers_count_together_and_assignments_count_until_served() {
        let mut ix = Index::new("doslab.io");
        ix.apply_node(gpu_node("n", &[("GPU-a", 40960), ("GPU-b", 40960)]));
        let p = planner();
        let two = gpu_pod(
            "ns",
            "two",
            &[c("a", false, 30000, 0, 0), c("b", false, 30000, 0, 0)],
        );
        assert!(p.fits(&ix, "n", &p.asks(&two).unwrap()).is_ok());
        let three = gpu_pod(
            "ns",
            "three",
            &[
                c("init", true, 30000, 0, 0),
                c("a", false, 30000, 0, 0),
                c("b", false, 30000, 0, 0),
            ],
        );
        assert!(p.fits(&ix, "n", &p.asks(&three).unwrap()).is_err());
        let whole = gpu_pod(
            "ns",
            "whole",
            &[c("w", false, 0, 0, 1), c("s", false, 100, 0, 0)],
        );
        assert!(p.fits(&ix, "n", &p.asks(&whole).unwrap()).is_ok());

        // Bound, not admitted: its assignment holds GPU-a whole.
        let assigned = r#"{"w":["GPU-a"]}"#;
        let w = gpu_pod("ns", "w", &[c("w", false, 0, 0, 1)]);
        ix.apply_pod(bound(
            w.clone(),
            "n",
            &[("doslab.io/gpu-assignment", assigned)],
        ));
        let big = gpu_pod(
            "ns",
            "big",
            &[c("a", false, 30000, 0, 0), c("b", false, 30000, 0, 0)],
        );
        assert!(p.fits(&ix, "n", &p.asks(&big).unwrap()).is_err());
        // Served: its ledger counts, once (the same GPU, whole).
        let ledger = r#"{"w":{"gpus":["GPU-a"],"gpu-count":1}}"#;
        let served = bound(
            w,
            "n",
            &[
                ("doslab.io/gpu-assignment", assigned),
                ("doslab.io/gpu-ledger", ledger),
            ],
        );
        ix.apply_pod(served);
        let one = gpu_pod("ns", "one", &[c("a", false, 40960, 0, 0)]);
        let a = p
            .place(&ix, "n", &p.asks(&one).unwrap(), &Workload::default())
            .unwrap()
            .assignment;
        assert_eq!(a.0["a"], ["GPU-b"]);
        assert!(p.fits(&ix, "n", &p.asks(&big).unwrap()).is_err());
    }

    #[test]
    fn bind_plans_write_the_contract_annotations() {
        let mut ix = Index::new("doslab.io");
        ix.apply_node(gpu_node("n", &[("GPU-a", 40960), ("GPU-b", 40960)]));
        let p = planner();
        let one = gpu_pod(
            "ns",
            "one",
            &[c("i", true, 1000, 0, 0), c("a", false, 1000, 20, 0)],
        );
        let plan = p.plan_bind(&ix, &one, "n", 42).unwrap().unwrap();
        let get = |k: &str| plan.annotations.get(&format!("doslab.io/{k}")).cloned();
        assert_eq!(
            get("gpu-assignment").as_deref(),
            Some(r#"{"a":["GPU-a"],"i":["GPU-a"]}"#)
        );
        assert_eq!(get("gpu-uuid").as_deref(), Some("GPU-a"));
        assert_eq!(get("gpu-assume-time").as_deref(), Some("42"));
        assert_eq!(get("gpu-assigned").as_deref(), Some("false"));
        let reserved = &plan.reserved;
        assert_eq!(
            reserved.spec.as_ref().unwrap().node_name.as_deref(),
            Some("n")
        );
        assert_eq!(
            reserved.metadata.annotations.as_ref().unwrap()["doslab.io/gpu-uuid"],
            "GPU-a"
        );

        // Two GPUs: no single UUID (a Binding cannot remove a stale one;
        // the assignment decides).
        let two = gpu_pod("ns", "two", &[c("w", false, 0, 0, 2)]);
        let plan = p.plan_bind(&ix, &two, "n", 43).unwrap().unwrap();
        assert!(!plan.annotations.contains_key("doslab.io/gpu-uuid"));
        assert_eq!(
            plan.annotations["doslab.io/gpu-assignment"],
            r#"{"w":["GPU-a","GPU-b"]}"#
        );

        let cpu = gpu_pod("ns", "cpu", &[c("app", false, 0, 0, 0)]);
        assert!(p.plan_bind(&ix, &cpu, "n", 44).unwrap().is_none());
        let huge = gpu_pod("ns", "huge", &[c("app", false, 50000, 0, 0)]);
        let e = p.plan_bind(&ix, &huge, "n", 45).unwrap_err();
        assert!(e.to_string().contains("50000 MiB"), "{e}");
    }

    #[test]
    fn binpack_prefers_the_busier_node_and_spread_the_emptier() {
        let mut ix = Index::new("doslab.io");
        ix.apply_node(gpu_node("busy", &[("GPU-a", 40960)]));
        ix.apply_node(gpu_node("idle", &[("GPU-b", 40960)]));
        let ledger = r#"{"app":{"gpus":["GPU-a"],"gpu-memory":20480}}"#;
        let holder = gpu_pod("ns", "holder", &[c("app", false, 20480, 0, 0)]);
        ix.apply_pod(bound(holder, "busy", &[("doslab.io/gpu-ledger", ledger)]));
        let pod = gpu_pod("ns", "p", &[c("app", false, 10240, 0, 0)]);
        let asks = planner().asks(&pod).unwrap();
        let binpack = planner();
        assert!(binpack.rank(&ix, "busy", &asks) > binpack.rank(&ix, "idle", &asks));
        let spread = Planner::new("doslab.io", Policy::Spread);
        assert!(spread.rank(&ix, "busy", &asks) < spread.rank(&ix, "idle", &asks));
        let huge = gpu_pod("ns", "huge", &[c("app", false, 30000, 0, 0)]);
        assert_eq!(
            spread.rank(&ix, "busy", &planner().asks(&huge).unwrap()),
            None
        );
    }

    /// Binpack is best fit across the cluster: a small pod takes the room
    /// that fits it most tightly, on an emptier node if need be, so the
    /// big GPUs stay open for big asks; a whole ask takes the smallest GPU.
    #[test]
    fn binpack_takes_the_tightest_room_anywhere() {
        let mut ix = Index::new("doslab.io");
        ix.apply_node(gpu_node("big", &[("GPU-a", 81920)]));
        ix.apply_node(gpu_node("small", &[("GPU-s", 16384), ("GPU-t", 16384)]));
        ix.apply_node(gpu_node("twin", &[("GPU-u", 16384), ("GPU-v", 16384)]));
        // big is half full (a score of 5), small and twin empty (0 before).
        let ledger = r#"{"app":{"gpus":["GPU-a"],"gpu-memory":40960}}"#;
        let holder = gpu_pod("ns", "holder", &[c("app", false, 40960, 0, 0)]);
        ix.apply_pod(bound(holder, "big", &[("doslab.io/gpu-ledger", ledger)]));
        let p = planner();
        let rank =
            |ix: &Index, pod: &Pod, node: &str| p.rank(ix, node, &p.asks(pod).unwrap()).unwrap();
        let small = gpu_pod("ns", "p", &[c("app", false, 4096, 0, 0)]);
        assert!(rank(&ix, &small, "small") > rank(&ix, &small, "big"));
        assert!(rank(&ix, &small, "small").score < rank(&ix, &small, "big").score);
        // Two containers on one GPU leave it once: 16 - 4 - 4 GiB.
        let two = gpu_pod(
            "ns",
            "two",
            &[c("a", false, 4096, 0, 0), c("b", false, 4096, 0, 0)],
        );
        assert_eq!(rank(&ix, &two, "small").key[0], -8192);
        // Equal room left (GPU-u is full, GPU-v takes it): the busier node.
        let ledger = r#"{"app":{"gpus":["GPU-u"],"gpu-memory":16384}}"#;
        let other = gpu_pod("ns", "other", &[c("app", false, 16384, 0, 0)]);
        ix.apply_pod(bound(other, "twin", &[("doslab.io/gpu-ledger", ledger)]));
        assert_eq!(
            rank(&ix, &small, "twin").key,
            rank(&ix, &small, "small").key
        );
        assert!(rank(&ix, &small, "twin") > rank(&ix, &small, "small"));
        // A whole GPU counts its size: the 16 GiB one, not the 80.
        ix.apply_node(gpu_node("wide", &[("GPU-w", 81920)]));
        let whole = gpu_pod("ns", "w", &[c("w", false, 0, 0, 1)]);
        assert_eq!(rank(&ix, &whole, "small").key[0], -16384);
        assert!(rank(&ix, &whole, "small") > rank(&ix, &whole, "wide"));
    }

    /// `pod` with each container asking `cpu`.
    fn with_cpu(pod: Pod, cpu: &str) -> Pod {
        with_request(pod, "cpu", cpu)
    }

    /// `pod` with each container requesting `amount` of `resource`.
    fn with_request(mut pod: Pod, resource: &str, amount: &str) -> Pod {
        for c in &mut pod.spec.as_mut().unwrap().containers {
            let r = c.resources.get_or_insert_default();
            let q = k8s_openapi::apimachinery::pkg::api::resource::Quantity(amount.into());
            r.requests
                .get_or_insert_default()
                .insert(resource.into(), q);
        }
        pod
    }

    /// `node` with `amount` of `resource` allocatable.
    fn with_allocatable(
        mut node: k8s_openapi::api::core::v1::Node,
        resource: &str,
        amount: &str,
    ) -> k8s_openapi::api::core::v1::Node {
        let q = k8s_openapi::apimachinery::pkg::api::resource::Quantity(amount.into());
        let status = node.status.get_or_insert_default();
        status
            .allocatable
            .get_or_insert_default()
            .insert(resource.into(), q);
        node
    }

    /// Pods of `memory` MiB and `core` % (and `cpu`) bound to `node`,
    /// `count` of them: the workload the policy learns.
    fn workload(ix: &mut Index, node: &str, count: u64, memory: u64, core: u64, cpu: &str) {
        workload_asking(ix, node, count, memory, core, ("cpu", cpu));
    }

    /// [`workload`]'s pods each requesting `amount` of `resource`.
    fn workload_asking(
        ix: &mut Index,
        node: &str,
        count: u64,
        memory: u64,
        core: u64,
        (resource, amount): (&str, &str),
    ) {
        for i in 0..count {
            let pod = gpu_pod(
                "ns",
                &format!("w{memory}-{i}"),
                &[c("app", false, memory, core, 0)],
            );
            ix.apply_pod(bound(with_request(pod, resource, amount), node, &[]));
        }
    }

    fn fragmentation() -> Planner {
        Planner::new("doslab.io", Policy::Fragmentation)
    }

    /// Binpack puts a 30 % share in the 70 % left of a GPU; with a
    /// workload of 60 % shares that strands the 40 % left, so the
    /// fragmentation policy takes the empty GPU, whose 70 % left still
    /// holds one. Until it has seen [`LEARNED_FROM`] pods it packs as
    /// binpack does.
    #[test]
    fn fragmentation_leaves_gpu_room_in_pieces_the_workload_can_use() {
        let mut ix = Index::new("doslab.io");
        ix.apply_node(gpu_node("n", &[("GPU-a", 10240), ("GPU-b", 10240)]));
        ix.apply_node(node_with("elsewhere", None));
        let ledger = r#"{"app":{"gpus":["GPU-a"],"gpu-memory":3072,"gpu-core":30}}"#;
        let holder = gpu_pod("ns", "holder", &[c("app", false, 3072, 30, 0)]);
        ix.apply_pod(bound(holder, "n", &[("doslab.io/gpu-ledger", ledger)]));
        // With the holder, one pod short of learning.
        workload(&mut ix, "elsewhere", LEARNED_FROM - 2, 6144, 60, "1");
        let pod = gpu_pod("ns", "p", &[c("app", false, 3072, 30, 0)]);
        let gpu = |p: &Planner, ix: &Index| {
            let plan = p.plan_bind(ix, &pod, "n", 1).unwrap().unwrap();
            plan.annotations["doslab.io/gpu-uuid"].clone()
        };
        assert_eq!(gpu(&planner(), &ix), "GPU-a");
        assert_eq!(gpu(&fragmentation(), &ix), "GPU-a");
        // Pods asking nothing (a DaemonSet's agents) teach nothing.
        workload(&mut ix, "elsewhere", 8, 0, 0, "0");
        assert_eq!(gpu(&fragmentation(), &ix), "GPU-a");
        let more = gpu_pod("ns", "more", &[c("app", false, 6144, 60, 0)]);
        ix.apply_pod(bound(with_cpu(more, "1"), "elsewhere", &[]));
        assert_eq!(gpu(&fragmentation(), &ix), "GPU-b");
    }

    /// A pod taking the CPU or memory the workload's pods need strands the
    /// node's GPUs: it goes where they are left, though the other node is
    /// fuller.
    #[test]
    fn fragmentation_keeps_cpu_and_memory_beside_free_gpus() {
        for (resource, [tight, roomy, workload_asks, pod_asks]) in [
            ("cpu", ["8", "64", "4", "6"]),
            ("memory", ["8Gi", "64Gi", "4Gi", "6Gi"]),
        ] {
            let mut ix = Index::new("doslab.io");
            let node = |name: &str, gpu: &str, amount: &str| {
                with_allocatable(gpu_node(name, &[(gpu, 10240)]), resource, amount)
            };
            ix.apply_node(node("tight", "GPU-t", tight));
            ix.apply_node(node("roomy", "GPU-r", roomy));
            ix.apply_node(node_with("elsewhere", None));
            let asks = (resource, workload_asks);
            workload_asking(&mut ix, "elsewhere", LEARNED_FROM, 5120, 50, asks);
            let pod = gpu_pod("ns", "p", &[c("app", false, 3072, 30, 0)]);
            let pod = with_request(pod, resource, pod_asks);
            let f = fragmentation();
            let asks = f.asks(&pod).unwrap();
            let (roomy, tight) = (f.rank(&ix, "roomy", &asks), f.rank(&ix, "tight", &asks));
            assert!(roomy > tight, "{resource}: {roomy:?} {tight:?}");
        }
    }

    /// Where a pod fragments two nodes alike and lands on GPUs as full on
    /// each, it joins the node whose GPUs already carry work, though the
    /// idle one comes first by name and would have less room left.
    #[test]
    fn fragmentation_ties_go_to_a_node_at_work() {
        let mut ix = Index::new("doslab.io");
        ix.apply_node(gpu_node("a-idle", &[("GPU-a", 4096)]));
        ix.apply_node(gpu_node("b-busy", &[("GPU-b", 5120), ("GPU-c", 5120)]));
        let ledger = r#"{"app":{"gpus":["GPU-b"],"gpu-memory":512,"gpu-core":5}}"#;
        let holder = gpu_pod("ns", "holder", &[c("app", false, 512, 5, 0)]);
        ix.apply_pod(bound(holder, "b-busy", &[("doslab.io/gpu-ledger", ledger)]));
        // Small shares, which either node holds whatever it takes.
        ix.apply_node(node_with("elsewhere", None));
        workload(&mut ix, "elsewhere", LEARNED_FROM, 512, 5, "0");
        let pod = gpu_pod("ns", "p", &[c("app", false, 2048, 10, 0)]);
        let f = fragmentation();
        let asks = f.asks(&pod).unwrap();
        let (idle, busy) = (f.rank(&ix, "a-idle", &asks), f.rank(&ix, "b-busy", &asks));
        assert_eq!(idle.unwrap().key[0], busy.unwrap().key[0]);
        assert!(busy > idle);
    }

    /// Under fragmentation a pod asking no GPU is placed too (it may take
    /// the CPU beside free GPUs), anywhere, with nothing to write; the
    /// other policies leave it to the scheduler.
    #[test]
    fn pods_asking_only_cpu_are_placed_by_fragmentation_alone() {
        let mut ix = Index::new("doslab.io");
        ix.apply_node(gpu_node("gpus", &[("GPU-a", 10240)]));
        ix.apply_node(node_with("bare", None));
        let cpu = with_cpu(gpu_pod("ns", "cpu", &[c("app", false, 0, 0, 0)]), "2");
        assert!(planner().asks(&cpu).is_none());
        let f = fragmentation();
        let asks = f.asks(&cpu).unwrap();
        assert!(f.fits(&ix, "bare", &asks).is_ok());
        assert!(f.fits(&ix, "gpus", &asks).is_ok());
        let plan = f.plan_bind(&ix, &cpu, "bare", 1).unwrap().unwrap();
        assert!(plan.annotations.is_empty());
        let node = plan.reserved.spec.as_ref().unwrap().node_name.as_deref();
        assert_eq!(node, Some("bare"));
    }
}
