//! The extender's view of the cluster: the Nodes and the non-terminal Pods
//! the reflectors keep, indexed by node so that a filter over a thousand
//! nodes reads only their pods, plus the binds in flight. Pure: the
//! watchers (or a test) feed it events.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};

/// `namespace/name`, the key kube-scheduler's bind call names a pod by.
pub type PodName = (String, String);

#[derive(Debug, Default)]
pub struct Index {
    nodes: HashMap<String, Arc<Node>>,
    pods: HashMap<PodName, Arc<Pod>>,
    /// Pods by `spec.nodeName`.
    by_node: HashMap<String, HashSet<PodName>>,
    /// Binds in flight: the pod as the bind will leave it (assignment
    /// annotations, `spec.nodeName`), counted on its node until the
    /// reflector shows it bound, or it is deleted, or the bind is undone.
    reserved: HashMap<PodName, Arc<Pod>>,
    /// Each reflector's first full list arrived (nodes, pods).
    synced: (bool, bool),
}

pub fn pod_name(pod: &Pod) -> PodName {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.node_name.as_deref()
}

/// Succeeded and Failed pods hold nothing: their GPUs are free at once.
fn terminal(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed"))
}

impl Index {
    pub fn node(&self, name: &str) -> Option<&Arc<Node>> {
        self.nodes.get(name)
    }

    pub fn pod(&self, name: &PodName) -> Option<&Arc<Pod>> {
        self.pods.get(name)
    }

    /// The pods that hold GPUs of `node`: those the reflector shows there
    /// and the binds in flight to it.
    pub fn pods_on<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a Arc<Pod>> + 'a {
        let node = node.to_owned();
        let stored = self
            .by_node
            .get(&node)
            .into_iter()
            .flatten()
            .filter(|k| !self.reserved.contains_key(*k))
            .filter_map(|k| self.pods.get(k));
        let in_flight = self
            .reserved
            .values()
            .filter(move |p| node_of(p) == Some(node.as_str()));
        stored.chain(in_flight)
    }

    pub fn apply_node(&mut self, node: Node) {
        let name = node.metadata.name.clone().unwrap_or_default();
        self.nodes.insert(name, Arc::new(node));
    }

    pub fn delete_node(&mut self, name: &str) {
        self.nodes.remove(name);
    }

    /// Both reflectors have listed once: until then an unknown node or pod
    /// may simply not have arrived.
    pub fn synced(&self) -> bool {
        self.synced == (true, true)
    }

    pub fn replace_nodes(&mut self, nodes: Vec<Node>) {
        self.synced.0 = true;
        self.nodes.clear();
        for n in nodes {
            self.apply_node(n);
        }
    }

    pub fn apply_pod(&mut self, pod: Pod) {
        let key = pod_name(&pod);
        self.unindex(&key);
        if terminal(&pod) {
            self.reserved.remove(&key);
            return;
        }
        if node_of(&pod).is_some() {
            // Bound: from now on the pod's own annotations say what it holds.
            self.reserved.remove(&key);
        }
        if let Some(node) = node_of(&pod) {
            self.by_node
                .entry(node.to_owned())
                .or_default()
                .insert(key.clone());
        }
        self.pods.insert(key, Arc::new(pod));
    }

    pub fn delete_pod(&mut self, key: &PodName) {
        self.unindex(key);
        self.reserved.remove(key);
    }

    /// A relist: pods the watch missed the deletion of are gone.
    pub fn replace_pods(&mut self, pods: Vec<Pod>) {
        self.synced.1 = true;
        let live: HashSet<PodName> = pods.iter().map(pod_name).collect();
        self.pods.clear();
        self.by_node.clear();
        self.reserved.retain(|k, _| live.contains(k));
        for p in pods {
            self.apply_pod(p);
        }
    }

    fn unindex(&mut self, key: &PodName) {
        let Some(old) = self.pods.remove(key) else {
            return;
        };
        if let Some(node) = node_of(&old)
            && let Some(set) = self.by_node.get_mut(node)
        {
            set.remove(key);
            if set.is_empty() {
                self.by_node.remove(node);
            }
        }
    }

    /// Counts `pod` (already carrying its assignment and node) until the
    /// bind is done and seen, or [`Index::release`]d.
    pub fn reserve(&mut self, pod: Pod) {
        self.reserved.insert(pod_name(&pod), Arc::new(pod));
    }

    pub fn release(&mut self, key: &PodName) {
        self.reserved.remove(key);
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    fn on(index: &Index, node: &str) -> Vec<String> {
        let mut v: Vec<String> = index
            .pods_on(node)
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn pods_move_finish_and_reservations_end_when_bound() {
        let mut ix = Index::default();
        ix.apply_pod(pod("a", Some("n1"), "Running"));
        ix.apply_pod(pod("b", None, "Pending"));
        assert_eq!(on(&ix, "n1"), ["a"]);
        assert!(on(&ix, "n2").is_empty());

        // A bind in flight counts on its node, once.
        ix.reserve(pod("b", Some("n2"), "Pending"));
        assert_eq!(on(&ix, "n2"), ["b"]);
        ix.apply_pod(pod("b", None, "Pending"));
        assert_eq!(on(&ix, "n2"), ["b"], "an older version does not end it");
        ix.apply_pod(pod("b", Some("n2"), "Pending"));
        assert_eq!(on(&ix, "n2"), ["b"]);
        assert!(ix.reserved.is_empty());

        // Finished and deleted pods free their share at once.
        ix.apply_pod(pod("a", Some("n1"), "Succeeded"));
        assert!(on(&ix, "n1").is_empty());
        assert!(ix.pod(&("ns".into(), "a".into())).is_none());
        ix.delete_pod(&("ns".into(), "b".into()));
        assert!(on(&ix, "n2").is_empty());

        // An undone bind stops counting; a relist drops what it lacks.
        ix.reserve(pod("c", Some("n1"), "Pending"));
        ix.release(&("ns".into(), "c".into()));
        assert!(on(&ix, "n1").is_empty());
        ix.apply_pod(pod("d", Some("n1"), "Running"));
        ix.reserve(pod("e", Some("n1"), "Pending"));
        ix.replace_pods(vec![pod("f", Some("n1"), "Running")]);
        assert_eq!(on(&ix, "n1"), ["f"]);
    }
}
