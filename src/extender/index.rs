//! The extender's view of the cluster: each Node's GPUs and what the
//! non-terminal Pods and the binds in flight hold of them, read once when
//! the reflectors (or a test) deliver an object, so that a filter over a
//! thousand nodes only runs the fit. Pure: the watchers feed it events.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::ObjectMeta;
use kube::core::{Selector, SelectorExt};

use crate::rules::usage::quantity::parse_milli;
use crate::rules::usage::{
    Assignment, ContainerAsk, Holding, Inventory, InventoryError, Keys, Kind, Ledger, NodeAsk,
    NodeSelection, NodeUsage, PodAsks, Records, finished, pod_holdings,
};

/// `namespace/name`, the key kube-scheduler's bind call names a pod by.
pub type PodName = (String, String);

/// A node's GPUs as its inventory annotation publishes them.
#[derive(Debug)]
pub(crate) enum Gpus {
    /// No inventory annotation: the device plugin does not run there.
    Unpublished,
    Unreadable(InventoryError),
    /// The usage counts every pod the index holds on the node.
    Published {
        inventory: Inventory,
        usage: NodeUsage,
        requests: NodeRequests,
        /// What pods' node selectors and affinities read.
        labels: BTreeMap<String, String>,
    },
}

/// A node's CPU and memory as kube-scheduler counts them: what it has
/// allocatable (unbounded where the Node states none) and what its pods
/// request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct NodeRequests {
    pub(crate) allocatable: NodeAsk,
    pub(crate) requested: NodeAsk,
}

impl NodeRequests {
    /// What is left for new pods.
    pub(crate) fn free(&self) -> NodeAsk {
        self.allocatable.minus(self.requested)
    }
}

/// What a pod holds, read once from its spec and annotations: its node, its
/// containers' asks, its ledger and its assignment. A malformed annotation
/// is logged and counted failing closed, as on the node
/// ([`crate::rules::usage::pod_holdings`]): it never frees room.
#[derive(Debug)]
struct PodRecord {
    node: Option<String>,
    containers: Vec<ContainerAsk>,
    /// What it asks of its node's CPU and memory, and its kind of pod for
    /// the workload the fragmentation policy measures against.
    node_ask: NodeAsk,
    kind: Kind,
    ledger: Ledger,
    assignment: Assignment,
    /// The pod itself while it is not bound: a bind plans and writes
    /// against it without reading it from the API server first.
    unbound: Option<Arc<Pod>>,
    /// What preemption weighs: who the pod is to the scheduler, how it
    /// ranks, what disruption budgets select it, and, unbound, the node
    /// kube-scheduler nominated it to after evicting pods there for it.
    uid: String,
    priority: i32,
    labels: BTreeMap<String, String>,
    nominated: Option<String>,
}

impl PodRecord {
    fn of(keys: &Keys, pod: &Pod) -> PodRecord {
        let records = Records::read(keys, pod);
        for g in records.garbled() {
            let (namespace, name) = pod_name(pod);
            tracing::warn!(pod = %format!("{namespace}/{name}"), error = %g, "garbled GPU record");
        }
        let node = node_of(pod).map(str::to_owned);
        let asks = PodAsks::from_pod(keys, pod);
        let nominated = pod
            .status
            .as_ref()
            .and_then(|s| s.nominated_node_name.clone());
        PodRecord {
            unbound: node.is_none().then(|| Arc::new(pod.clone())),
            nominated: nominated.filter(|n| !n.is_empty() && node.is_none()),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            priority: priority(pod),
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            node,
            kind: Kind::of(&asks, NodeSelection::of(pod.spec.as_ref())),
            node_ask: asks.node,
            containers: asks.containers,
            ledger: records.ledger,
            assignment: records.assignment,
        }
    }
}

/// What a reservation stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// Filtered or prioritized, its bind not yet begun: the node the
    /// extender expects the scheduler to choose. A new filter of the pod
    /// replaces it.
    Nominated,
    /// A bind is writing it (or wrote it and the watch has yet to show it).
    Binding,
}

#[derive(Debug)]
struct Reservation {
    held: PodRecord,
    stage: Stage,
    /// Every reservation ends by this time at the latest.
    until: Instant,
}

#[derive(Debug)]
pub struct Index {
    keys: Keys,
    nodes: HashMap<String, Gpus>,
    pods: HashMap<PodName, PodRecord>,
    /// Pods by `spec.nodeName`.
    by_node: HashMap<String, HashSet<PodName>>,
    /// Placements not yet seen bound: the pod as its bind will leave it
    /// (assignment annotations, `spec.nodeName`), counted on its node until
    /// the reflector shows it bound, or it is deleted, or the reservation
    /// is released or expires.
    reserved: HashMap<PodName, Reservation>,
    /// Why a kind's objects may be behind the API server, by kind: not
    /// listed yet, or its watch failed and the list after it has not
    /// arrived. Empty while both follow it.
    stale: BTreeMap<&'static str, String>,
    /// Each node's state stamp, from [`STAMPS`]: a new one whenever its
    /// inventory or usage changes, so the planner's memo of what fits
    /// there is used only while nothing did.
    stamps: HashMap<String, u64>,
    /// The stored pods by kind, and how many times a pod was stored or
    /// removed (an update is both).
    kinds: HashMap<Kind, u64>,
    kind_changes: u64,
    /// Unbound pods by the node kube-scheduler nominated them to.
    nominations: HashMap<String, HashSet<PodName>>,
    /// The PodDisruptionBudgets, for the violations a set of victims
    /// makes. Not part of [`Index::synced`]: without them preemption
    /// still frees the right GPU, only blind to budgets.
    budgets: HashMap<PodName, Budget>,
}

/// A PodDisruptionBudget as preemption counts it (as kube-scheduler does):
/// the pods it selects, how many more may go, and those already going.
#[derive(Debug)]
pub(crate) struct Budget {
    /// `None`: an empty or unreadable selector, which selects no pod.
    selector: Option<Selector>,
    allowed: i32,
    disrupted: HashSet<String>,
}

impl Budget {
    fn of(pdb: &PodDisruptionBudget) -> Budget {
        let selector = pdb
            .spec
            .as_ref()
            .and_then(|s| s.selector.clone())
            .filter(|s| {
                s.match_labels.as_ref().is_some_and(|l| !l.is_empty())
                    || s.match_expressions.as_ref().is_some_and(|e| !e.is_empty())
            })
            .and_then(|s| Selector::try_from(s).ok());
        let status = pdb.status.as_ref();
        Budget {
            selector,
            allowed: status.map_or(0, |s| s.disruptions_allowed),
            disrupted: status
                .and_then(|s| s.disrupted_pods.as_ref())
                .map(|d| d.keys().cloned().collect())
                .unwrap_or_default(),
        }
    }
}

/// A pod that holds room on a node, as preemption weighs it.
#[derive(Debug)]
pub(crate) struct Holder {
    pub(crate) key: PodName,
    pub(crate) uid: String,
    pub(crate) priority: i32,
    /// The reflector shows it bound there: kube-scheduler knows it and can
    /// evict it. A bind still in flight holds its room but is no victim.
    pub(crate) evictable: bool,
    pub(crate) holdings: Vec<Holding>,
    pub(crate) node_ask: NodeAsk,
}

/// A node as preemption sees it: its GPUs, CPU and memory, and every pod
/// that holds some of them.
pub(crate) struct Holders<'a> {
    pub(crate) inventory: &'a Inventory,
    /// What they all hold, as the filter counts it.
    pub(crate) usage: &'a NodeUsage,
    pub(crate) requests: NodeRequests,
    pub(crate) pods: Vec<Holder>,
}

/// Node-state stamps, never given twice in the process (so a stamp also
/// tells one index from another).
static STAMPS: AtomicU64 = AtomicU64::new(1);

/// What the index says of a kind before its first list.
const UNLISTED: &str = "not listed yet";

pub fn pod_name(pod: &Pod) -> PodName {
    key_of(&pod.metadata)
}

/// A namespaced object's `namespace/name`.
fn key_of(meta: &ObjectMeta) -> PodName {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.node_name.as_deref()
}

/// The pod's priority as the scheduler reads it: `spec.priority`, which
/// the API server's admission sets from its PriorityClass, 0 without one.
pub(crate) fn priority(pod: &Pod) -> i32 {
    pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

impl Index {
    /// An empty index reading the annotations of `domain`.
    pub fn new(domain: &str) -> Index {
        Index {
            keys: Keys::new(domain),
            nodes: HashMap::new(),
            pods: HashMap::new(),
            by_node: HashMap::new(),
            reserved: HashMap::new(),
            stale: [("nodes", UNLISTED.into()), ("pods", UNLISTED.into())].into(),
            stamps: HashMap::new(),
            kinds: HashMap::new(),
            kind_changes: 0,
            nominations: HashMap::new(),
            budgets: HashMap::new(),
        }
    }

    /// `None`: the node is not in the cache (yet).
    pub(crate) fn gpus(&self, node: &str) -> Option<&Gpus> {
        self.nodes.get(node)
    }

    /// The pods that hold GPUs of `node`: those the reflector shows there
    /// and the binds in flight to it.
    fn held_on<'a>(&'a self, node: &'a str) -> impl Iterator<Item = (&'a PodName, &'a PodRecord)> {
        let stored = self
            .by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter(|k| !self.reserved.contains_key(*k))
            .filter_map(|k| self.pods.get_key_value(k));
        let in_flight = self
            .reserved
            .iter()
            .filter(move |(_, r)| r.held.node.as_deref() == Some(node))
            .map(|(k, r)| (k, &r.held));
        stored.chain(in_flight)
    }

    /// Counts again what the pods on `node` hold of its GPUs.
    fn recount(&mut self, node: &str) {
        let stamp = STAMPS.fetch_add(1, Ordering::Relaxed);
        self.stamps.insert(node.to_owned(), stamp);
        let Some(Gpus::Published { inventory, .. }) = self.nodes.get(node) else {
            return;
        };
        let mut counted = NodeUsage::empty(inventory);
        let mut requested = NodeAsk::default();
        for (_, held) in self.held_on(node) {
            requested = requested.plus(held.node_ask);
            for h in pod_holdings(inventory, &held.containers, &held.ledger, &held.assignment) {
                counted.add(inventory, &h);
            }
        }
        if let Some(Gpus::Published {
            usage, requests, ..
        }) = self.nodes.get_mut(node)
        {
            *usage = counted;
            requests.requested = requested;
        }
    }

    fn recount_all(&mut self) {
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for n in names {
            self.recount(&n);
        }
    }

    /// The nodes whose usage `key` counts in, stored or in flight.
    fn nodes_holding(&self, key: &PodName) -> Vec<String> {
        [self.pods.get(key), self.reserved.get(key).map(|r| &r.held)]
            .into_iter()
            .flatten()
            .filter_map(|h| h.node.clone())
            .collect()
    }

    /// Applies `change` to the pod `key` and counts again the nodes it held
    /// GPUs of before or holds after.
    fn changing(&mut self, key: &PodName, change: impl FnOnce(&mut Self)) {
        let mut touched = self.nodes_holding(key);
        change(self);
        touched.extend(self.nodes_holding(key));
        touched.sort();
        touched.dedup();
        for n in touched {
            self.recount(&n);
        }
    }

    pub fn apply_node(&mut self, node: Node) {
        let name = node.metadata.name.clone().unwrap_or_default();
        let text = node.metadata.annotations.as_ref();
        let gpus = match text.and_then(|a| a.get(&self.keys.inventory)) {
            None => Gpus::Unpublished,
            Some(text) => match Inventory::parse(text) {
                Err(e) => Gpus::Unreadable(e),
                Ok(inventory) => Gpus::Published {
                    usage: NodeUsage::empty(&inventory),
                    inventory,
                    requests: NodeRequests {
                        allocatable: allocatable(&node),
                        requested: NodeAsk::default(),
                    },
                    labels: node.metadata.labels.clone().unwrap_or_default(),
                },
            },
        };
        self.nodes.insert(name.clone(), gpus);
        self.recount(&name);
    }

    pub(crate) fn delete_node(&mut self, name: &str) {
        self.nodes.remove(name);
        self.stamps.remove(name);
    }

    /// `node`'s state stamp; `None` for a node not in the index.
    pub(crate) fn stamp(&self, node: &str) -> Option<u64> {
        self.stamps.get(node).copied()
    }

    /// Both kinds follow the API server: listed, and listed again since
    /// their watch last failed. Until then an unknown node or pod may simply
    /// not have arrived, and a pod bound meanwhile may hold GPUs the index
    /// counts free.
    pub(crate) fn synced(&self) -> bool {
        self.stale.is_empty()
    }

    /// Each kind that does not follow the API server, with why.
    pub(crate) fn stale(&self) -> Vec<String> {
        self.stale
            .iter()
            .map(|(kind, why)| format!("{kind}: {why}"))
            .collect()
    }

    /// The nodes' watch failed (`why`): stale until [`Index::replace_nodes`].
    pub fn unsync_nodes(&mut self, why: String) {
        self.stale.insert("nodes", why);
    }

    /// The pods' watch failed (`why`): stale until [`Index::replace_pods`].
    pub fn unsync_pods(&mut self, why: String) {
        self.stale.insert("pods", why);
    }

    pub fn replace_nodes(&mut self, nodes: Vec<Node>) {
        self.stale.remove("nodes");
        self.nodes.clear();
        self.stamps.clear();
        for n in nodes {
            self.apply_node(n);
        }
    }

    pub fn apply_pod(&mut self, pod: Pod) {
        let key = pod_name(&pod);
        self.changing(&key.clone(), |ix| ix.store(key, &pod));
    }

    /// Keeps `pod` (uncounted: the caller counts its nodes again).
    fn store(&mut self, key: PodName, pod: &Pod) {
        let was = self.unindex(&key);
        // Succeeded and Failed pods hold nothing: their GPUs are free at once.
        if finished(pod) {
            self.reserved.remove(&key);
            self.kind_moved(was.as_ref(), None);
            return;
        }
        if let Some(node) = node_of(pod) {
            // Bound: from now on the pod's own annotations say what it holds.
            self.reserved.remove(&key);
            self.by_node
                .entry(node.to_owned())
                .or_default()
                .insert(key.clone());
        }
        let record = PodRecord::of(&self.keys, pod);
        *self.kinds.entry(record.kind.clone()).or_default() += 1;
        self.kind_moved(was.as_ref(), Some(&record.kind));
        if let Some(node) = &record.nominated {
            let on = self.nominations.entry(node.clone()).or_default();
            on.insert(key.clone());
        }
        self.pods.insert(key, record);
    }

    pub fn delete_pod(&mut self, key: &PodName) {
        self.changing(key, |ix| {
            let was = ix.unindex(key);
            ix.kind_moved(was.as_ref(), None);
            ix.reserved.remove(key);
        });
    }

    /// A relist: pods the watch missed the deletion of are gone.
    pub fn replace_pods(&mut self, pods: Vec<Pod>) {
        self.stale.remove("pods");
        let live: HashSet<PodName> = pods.iter().map(pod_name).collect();
        self.pods.clear();
        self.by_node.clear();
        self.nominations.clear();
        self.kinds.clear();
        self.kind_changes += 1;
        self.reserved.retain(|k, _| live.contains(k));
        for p in pods {
            self.store(pod_name(&p), &p);
        }
        self.recount_all();
    }

    /// Counts a pod of kind `was` (`None`: none) become one of `now`
    /// (`None`: gone) toward [`Index::kinds`]' changes: one for a kind it
    /// left, one for a kind it joined, none for an update that keeps its
    /// kind.
    fn kind_moved(&mut self, was: Option<&Kind>, now: Option<&Kind>) {
        if was != now {
            self.kind_changes += u64::from(was.is_some()) + u64::from(now.is_some());
        }
    }

    /// Forgets the pod, and returns its kind (for [`Index::kind_moved`]).
    fn unindex(&mut self, key: &PodName) -> Option<Kind> {
        let old = self.pods.remove(key)?;
        if let Some(n) = self.kinds.get_mut(&old.kind) {
            *n -= 1;
            if *n == 0 {
                self.kinds.remove(&old.kind);
            }
        }
        for (node, by) in [
            (old.node, &mut self.by_node),
            (old.nominated, &mut self.nominations),
        ] {
            if let Some(node) = node
                && let Some(set) = by.get_mut(&node)
            {
                set.remove(key);
                if set.is_empty() {
                    by.remove(&node);
                }
            }
        }
        Some(old.kind)
    }

    /// Counts `pod` (already carrying its assignment and node) until it is
    /// seen bound, [`Index::release`]d, or `until` passes; replaces the
    /// pod's earlier reservation.
    pub(crate) fn reserve(&mut self, pod: Pod, stage: Stage, until: Instant) {
        let key = pod_name(&pod);
        let held = PodRecord::of(&self.keys, &pod);
        self.changing(&key.clone(), |ix| {
            ix.reserved.insert(key, Reservation { held, stage, until });
        });
    }

    pub(crate) fn release(&mut self, key: &PodName) {
        self.changing(key, |ix| {
            ix.reserved.remove(key);
        });
    }

    /// Ends the pod's reservation if it is only a nomination (a bind in
    /// flight keeps its own).
    pub(crate) fn release_nomination(&mut self, key: &PodName) {
        if self.stage(key) == Some(Stage::Nominated) {
            self.release(key);
        }
    }

    /// Turns a bind's reservation into a nomination ending at `until`: its
    /// bind stopped without knowing whether the Binding landed.
    pub(crate) fn demote(&mut self, key: &PodName, until: Instant) {
        if let Some(r) = self.reserved.get_mut(key) {
            r.stage = Stage::Nominated;
            r.until = r.until.min(until);
        }
    }

    /// The pod `key` as the reflector last showed it, while unbound; `None`
    /// when it is bound, finished, or not seen (yet).
    pub(crate) fn unbound_pod(&self, key: &PodName) -> Option<Arc<Pod>> {
        self.pods.get(key)?.unbound.clone()
    }

    pub(crate) fn stage(&self, key: &PodName) -> Option<Stage> {
        self.reserved.get(key).map(|r| r.stage)
    }

    /// Ends the reservations whose time is up at `now`.
    pub(crate) fn expire(&mut self, now: Instant) {
        let over: Vec<PodName> = self
            .reserved
            .iter()
            .filter(|(_, r)| r.until <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for key in over {
            tracing::info!(pod = ?key, "a GPU reservation expired before its pod was seen bound");
            self.release(&key);
        }
    }

    /// The pods kube-scheduler nominated to `node` after evicting pods
    /// for them, not bound and not being bound here (a bind's reservation
    /// counts on its own), with their priority and asks.
    pub(crate) fn nominated_to(&self, node: &str) -> Vec<(&PodName, i32, PodAsks)> {
        let Some(keys) = self.nominations.get(node) else {
            return Vec::new();
        };
        let mut v: Vec<_> = keys
            .iter()
            .filter(|k| !self.reserved.contains_key(*k))
            .filter_map(|k| self.pods.get_key_value(k))
            .map(|(k, r)| {
                let asks = PodAsks {
                    containers: r.containers.clone(),
                    node: r.node_ask,
                };
                (k, r.priority, asks)
            })
            .collect();
        // Higher priority first, as the scheduler adds them.
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        v
    }

    /// Whether kube-scheduler nominated any pod to `node`.
    pub(crate) fn has_nominated(&self, node: &str) -> bool {
        self.nominations.contains_key(node)
    }

    /// `node`'s GPUs, CPU and memory with each pod that holds some of them;
    /// `None` where the node publishes no GPUs.
    pub(crate) fn holders(&self, node: &str) -> Option<Holders<'_>> {
        let Some(Gpus::Published {
            inventory,
            usage,
            requests,
            ..
        }) = self.nodes.get(node)
        else {
            return None;
        };
        let pods = self
            .held_on(node)
            .map(|(key, held)| Holder {
                key: key.clone(),
                uid: held.uid.clone(),
                priority: held.priority,
                evictable: !self.reserved.contains_key(key),
                holdings: pod_holdings(inventory, &held.containers, &held.ledger, &held.assignment),
                node_ask: held.node_ask,
            })
            .collect();
        Some(Holders {
            inventory,
            usage,
            requests: *requests,
            pods,
        })
    }

    /// How many of `victims` the disruption budgets forbid to evict, each
    /// counted by kube-scheduler's rule (`FilterVictimsWithPDBViolation`):
    /// each budget allows so many more, a pod it already counts as
    /// disrupted costs nothing, an empty selector selects no pod, and a
    /// pod is violating at the first budget it breaks. Unlike the
    /// scheduler, which counts over every possible victim in its order,
    /// this counts over the set chosen.
    pub(crate) fn budget_violations(&self, victims: &[&PodName]) -> i64 {
        let mut allowed: HashMap<&PodName, i32> = HashMap::new();
        let mut violations = 0;
        for key in victims {
            // A pod without labels matches no budget (NotIn would).
            let Some(labels) = self.pods.get(*key).map(|r| &r.labels) else {
                continue;
            };
            if labels.is_empty() {
                continue;
            }
            // The budgets it matches, each one less, until one is broken.
            for (name, b) in &self.budgets {
                if name.0 != key.0
                    || b.disrupted.contains(&key.1)
                    || !b.selector.as_ref().is_some_and(|s| s.matches(labels))
                {
                    continue;
                }
                let left = allowed.entry(name).or_insert(b.allowed);
                *left -= 1;
                if *left < 0 {
                    violations += 1;
                    break;
                }
            }
        }
        violations
    }

    pub fn apply_budget(&mut self, pdb: &PodDisruptionBudget) {
        self.budgets.insert(key_of(&pdb.metadata), Budget::of(pdb));
    }

    pub(crate) fn delete_budget(&mut self, pdb: &PodDisruptionBudget) {
        self.budgets.remove(&key_of(&pdb.metadata));
    }

    pub fn replace_budgets(&mut self, all: &[PodDisruptionBudget]) {
        self.budgets.clear();
        for pdb in all {
            self.apply_budget(pdb);
        }
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// The pods by kind, and a count that grows each time a pod of a kind
    /// comes or goes (how far the counts may have moved since someone last
    /// read them): an update of a pod that keeps its kind, as each pod's
    /// bind and status are, moves nothing, so the workload is learned again
    /// after as many pods in a cluster as in a replay of it.
    pub(crate) fn kinds(&self) -> (&HashMap<Kind, u64>, u64) {
        (&self.kinds, self.kind_changes)
    }
}

/// The Node's allocatable CPU (millicores) and memory (bytes), each
/// unbounded where it states none.
fn allocatable(node: &Node) -> NodeAsk {
    let stated = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let read = |r: &str| {
        stated
            .and_then(|a| a.get(r))
            .and_then(|q| parse_milli(&q.0))
    };
    NodeAsk {
        cpu_milli: read("cpu").unwrap_or(u64::MAX),
        memory: read("memory").map_or(u64::MAX, |m| m / 1000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extender::test_pods::{app, gpu_node, gpu_pod, node_with};
    use k8s_openapi::api::core::v1::{PodSpec, PodStatus};
    use kube::api::ObjectMeta;

    fn pod(name: &str, node: Option<&str>, phase: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: node.map(str::to_owned),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..Default::default()
            }),
        }
    }

    fn later() -> Instant {
        Instant::now() + std::time::Duration::from_secs(60)
    }

    fn on(index: &Index, node: &str) -> Vec<String> {
        let mut v: Vec<String> = index.held_on(node).map(|(k, _)| k.1.clone()).collect();
        v.sort();
        v
    }

    #[test]
    fn each_kind_is_stale_until_listed_and_again_from_a_failed_watch() {
        let mut ix = Index::new("doslab.io");
        assert_eq!(
            ix.stale(),
            ["nodes: not listed yet", "pods: not listed yet"]
        );
        ix.replace_nodes(Vec::new());
        ix.replace_pods(Vec::new());
        assert!(ix.synced() && ix.stale().is_empty());
        ix.unsync_nodes("gone".into());
        ix.unsync_pods("expired".into());
        ix.unsync_pods("refused".into());
        assert!(!ix.synced());
        assert_eq!(ix.stale(), ["nodes: gone", "pods: refused"]);
        ix.replace_pods(Vec::new());
        assert_eq!(ix.stale(), ["nodes: gone"]);
        ix.replace_nodes(Vec::new());
        assert!(ix.synced());
    }

    #[test]
    fn pods_move_finish_and_reservations_end_when_bound() {
        let mut ix = Index::new("doslab.io");
        ix.apply_pod(pod("a", Some("n1"), "Running"));
        ix.apply_pod(pod("b", None, "Pending"));
        assert_eq!(on(&ix, "n1"), ["a"]);
        assert!(on(&ix, "n2").is_empty());

        // A bind in flight counts on its node, once.
        ix.reserve(pod("b", Some("n2"), "Pending"), Stage::Binding, later());
        assert_eq!(on(&ix, "n2"), ["b"]);
        ix.apply_pod(pod("b", None, "Pending"));
        assert_eq!(on(&ix, "n2"), ["b"], "an older version does not end it");
        ix.apply_pod(pod("b", Some("n2"), "Pending"));
        assert_eq!(on(&ix, "n2"), ["b"]);
        assert!(ix.reserved.is_empty());

        // Finished and deleted pods free their share at once.
        ix.apply_pod(pod("a", Some("n1"), "Succeeded"));
        assert!(on(&ix, "n1").is_empty());
        assert!(!ix.pods.contains_key(&("ns".into(), "a".into())));
        ix.delete_pod(&("ns".into(), "b".into()));
        assert!(on(&ix, "n2").is_empty());

        // An undone bind stops counting; a relist drops what it lacks.
        ix.reserve(pod("c", Some("n1"), "Pending"), Stage::Binding, later());
        ix.release(&("ns".into(), "c".into()));
        assert!(on(&ix, "n1").is_empty());
        ix.apply_pod(pod("d", Some("n1"), "Running"));
        ix.reserve(pod("e", Some("n1"), "Pending"), Stage::Binding, later());
        ix.replace_pods(vec![pod("f", Some("n1"), "Running")]);
        assert_eq!(on(&ix, "n1"), ["f"]);
    }

    #[test]
    fn every_reservation_ends_nominations_give_way_and_binds_stay() {
        let mut ix = Index::new("doslab.io");
        let key = |name: &str| ("ns".to_owned(), name.to_owned());
        let now = Instant::now();
        let soon = now + std::time::Duration::from_secs(1);
        ix.reserve(pod("a", Some("n1"), "Pending"), Stage::Nominated, soon);
        ix.reserve(pod("b", Some("n1"), "Pending"), Stage::Binding, later());
        assert_eq!(on(&ix, "n1"), ["a", "b"]);

        // A new filter of a pod ends its nomination, never a bind's hold.
        ix.release_nomination(&key("b"));
        ix.release_nomination(&key("a"));
        assert_eq!(on(&ix, "n1"), ["b"]);

        // A nomination moves with the pod: one node at a time.
        ix.reserve(pod("a", Some("n1"), "Pending"), Stage::Nominated, soon);
        ix.reserve(pod("a", Some("n2"), "Pending"), Stage::Nominated, soon);
        assert_eq!(on(&ix, "n1"), ["b"]);
        assert_eq!(on(&ix, "n2"), ["a"]);

        // Nothing outlives its time; a bind cut short becomes a nomination
        // that ends no later than told.
        ix.expire(now);
        assert_eq!(on(&ix, "n2"), ["a"], "not yet");
        ix.demote(&key("b"), soon);
        assert_eq!(ix.stage(&key("b")), Some(Stage::Nominated));
        ix.expire(soon);
        assert!(on(&ix, "n1").is_empty() && on(&ix, "n2").is_empty());
        assert!(ix.reserved.is_empty());
    }

    /// The workload's count of changes moves when a pod of a kind comes
    /// or goes, not when its bind or status updates it: a real cluster's
    /// pods are updated many times, a replay's once, and both must learn
    /// their workload after the same pods.
    #[test]
    fn kinds_move_when_pods_come_or_go_not_on_updates() {
        let mut ix = Index::new("doslab.io");
        let pod = gpu_pod("ns", "a", &[app("app", [1000, 0, 0])]);
        let moved = |ix: &Index| ix.kinds().1;
        ix.apply_pod(pod.clone());
        assert_eq!(moved(&ix), 1);
        let mut bound = pod.clone();
        bound.spec.get_or_insert_default().node_name = Some("n".into());
        ix.apply_pod(bound.clone());
        ix.apply_pod(bound.clone());
        assert_eq!(moved(&ix), 1);
        // Another kind: one gone, one come.
        ix.apply_pod(gpu_pod("ns", "a", &[app("app", [2000, 0, 0])]));
        assert_eq!(moved(&ix), 3);
        ix.delete_pod(&("ns".into(), "a".into()));
        assert_eq!(moved(&ix), 4);
        ix.delete_pod(&("ns".into(), "a".into()));
        assert_eq!(moved(&ix), 4);
        assert!(ix.kinds().0.is_empty());
    }

    /// GPU memory used per GPU of `node`, as the filter reads it.
    fn used(ix: &Index, node: &str) -> Vec<u64> {
        match ix.gpus(node) {
            Some(Gpus::Published { usage, .. }) => {
                usage.gpus.iter().map(|g| g.used.memory).collect()
            }
            other => panic!("{node}: {other:?}"),
        }
    }

    #[test]
    fn usage_is_counted_again_whenever_a_pod_a_bind_or_a_node_changes() {
        let on_gpu = |name: &str, gpu: &str, served: bool| {
            let mut p = gpu_pod("ns", name, &[app("app", [1000, 0, 0])]);
            p.spec.get_or_insert_default().node_name = Some("n".into());
            let on_pod = p.metadata.annotations.get_or_insert_default();
            let assignment = format!(r#"{{"app":["{gpu}"]}}"#);
            on_pod.insert("doslab.io/gpu-assignment".into(), assignment);
            if served {
                let ledger = format!(r#"{{"app":{{"gpus":["{gpu}"],"gpu-memory":1000}}}}"#);
                on_pod.insert("doslab.io/gpu-ledger".into(), ledger);
            }
            p
        };
        let key = |name: &str| ("ns".to_owned(), name.to_owned());
        let mut ix = Index::new("doslab.io");

        // A pod seen before its node counts once the node arrives.
        ix.apply_pod(on_gpu("a", "GPU-a", false));
        ix.apply_node(gpu_node("n", &[("GPU-a", 4000), ("GPU-b", 4000)]));
        assert_eq!(used(&ix, "n"), [1000, 0]);

        // A bind in flight counts until released; once bound, once.
        ix.reserve(on_gpu("b", "GPU-b", false), Stage::Binding, later());
        assert_eq!(used(&ix, "n"), [1000, 1000]);
        ix.release(&key("b"));
        assert_eq!(used(&ix, "n"), [1000, 0]);
        ix.reserve(on_gpu("b", "GPU-b", false), Stage::Binding, later());
        ix.apply_pod(on_gpu("b", "GPU-b", false));
        assert_eq!(used(&ix, "n"), [1000, 1000]);

        // Served: its ledger replaces its assignment, not adds to it.
        ix.apply_pod(on_gpu("a", "GPU-a", true));
        assert_eq!(used(&ix, "n"), [1000, 1000]);

        // A new inventory is counted against. A pod on a GPU it lacks
        // cannot be told from one naming a GPU falsely, so it fails closed:
        // its ask counts on every GPU of the node.
        ix.apply_node(gpu_node("n", &[("GPU-c", 4000), ("GPU-a", 4000)]));
        assert_eq!(used(&ix, "n"), [1000, 2000]);

        // Deleted pods free their share; a relist counts from scratch.
        ix.delete_pod(&key("a"));
        ix.delete_pod(&key("b"));
        assert_eq!(used(&ix, "n"), [0, 0]);
        ix.replace_pods(vec![
            on_gpu("c", "GPU-c", true),
            on_gpu("d", "GPU-c", false),
        ]);
        assert_eq!(used(&ix, "n"), [2000, 0]);

        ix.apply_node(node_with("n", None));
        assert!(matches!(ix.gpus("n"), Some(Gpus::Unpublished)));
        ix.delete_node("n");
        assert!(ix.gpus("n").is_none());
    }

    /// A tenant writes what it likes on its own pods: a forged ledger on a
    /// pod asking no GPU holds nothing, and a GPU pod that garbles its
    /// records keeps holding its room.
    #[test]
    fn forged_or_garbled_records_free_no_room_and_block_nothing() {
        let annotated = |name: &str, wants, records: &[(&str, &str)]| {
            let mut p = gpu_pod("ns", name, &[app("app", wants)]);
            p.spec.get_or_insert_default().node_name = Some("n".into());
            let on_pod = p.metadata.annotations.get_or_insert_default();
            for (k, v) in records {
                on_pod.insert(format!("doslab.io/{k}"), v.to_string());
            }
            p
        };
        let mut ix = Index::new("doslab.io");
        ix.apply_node(gpu_node("n", &[("GPU-a", 40960), ("GPU-b", 40960)]));
        let forged =
            r#"{"app":{"gpus":["GPU-a","GPU-b"],"gpu-memory":1000000000000000000,"gpu-count":2}}"#;
        ix.apply_pod(annotated("cpu", [0, 0, 0], &[("gpu-ledger", forged)]));
        assert_eq!(used(&ix, "n"), [0, 0]);
        let Some(Gpus::Published { usage, .. }) = ix.gpus("n") else {
            panic!("no usage")
        };
        assert!(usage.gpus.iter().all(|g| !g.held_whole()));

        // A running 40 GiB pod on GPU-a sets its records to garbage: its
        // room stays held, and with no readable record of where, it is
        // held on every GPU it could be on.
        let sound = [
            ("gpu-assignment", r#"{"app":["GPU-a"]}"#),
            (
                "gpu-ledger",
                r#"{"app":{"gpus":["GPU-a"],"gpu-memory":40960}}"#,
            ),
        ];
        ix.apply_pod(annotated("big", [40960, 0, 0], &sound));
        assert_eq!(used(&ix, "n"), [40960, 0]);
        let garbage = [("gpu-assignment", "[1]"), ("gpu-ledger", "{")];
        ix.apply_pod(annotated("big", [40960, 0, 0], &garbage));
        assert_eq!(used(&ix, "n"), [40960, 40960]);
        ix.apply_pod(annotated("big", [40960, 0, 0], &[sound[0], garbage[1]]));
        assert_eq!(used(&ix, "n"), [40960, 0]);
        // Deleted, it frees what it held.
        ix.delete_pod(&("ns".into(), "big".into()));
        assert_eq!(used(&ix, "n"), [0, 0]);
    }
}
