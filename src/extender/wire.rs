//! The JSON kube-scheduler speaks to an extender (k8s.io/kube-scheduler
//! extender/v1). The Go types carry no json tags, so every key is the Go
//! field name; Go reads our answers case-insensitively, but we answer with
//! the exact names anyway.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Filter and prioritize arguments. With `nodeCacheCapable: true` the
/// scheduler sends `Nodes: null` and the candidates in `NodeNames`;
/// otherwise full Node objects in `Nodes` (a NodeList without
/// apiVersion/kind).
#[derive(Debug, Deserialize)]
pub struct ExtenderArgs {
    #[serde(rename = "Pod")]
    pub pod: Option<Pod>,
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames", default)]
    pub node_names: Option<Vec<String>>,
}

/// The nodes kept as sent, so a filter answer returns them untouched.
#[derive(Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct NodeList {
    #[serde(default)]
    pub(crate) items: Vec<Value>,
}

impl ExtenderArgs {
    /// The candidate node names, whichever way they came.
    pub(crate) fn names(&self) -> Vec<String> {
        match (&self.node_names, &self.nodes) {
            (Some(names), _) => names.clone(),
            (None, Some(list)) => list.items.iter().map(node_name).collect(),
            (None, None) => Vec::new(),
        }
    }
}

pub(crate) fn node_name(node: &Value) -> String {
    node["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ExtenderFilterResult {
    #[serde(rename = "Nodes")]
    pub(crate) nodes: Option<NodeList>,
    #[serde(rename = "NodeNames")]
    pub node_names: Option<Vec<String>>,
    #[serde(rename = "FailedNodes")]
    pub(crate) failed_nodes: BTreeMap<String, String>,
    #[serde(rename = "FailedAndUnresolvableNodes")]
    pub(crate) failed_and_unresolvable_nodes: BTreeMap<String, String>,
    #[serde(rename = "Error")]
    pub(crate) error: String,
}

impl ExtenderFilterResult {
    pub(crate) fn error(message: impl Into<String>) -> Self {
        ExtenderFilterResult {
            error: message.into(),
            ..Default::default()
        }
    }
}

/// kube-scheduler's `MaxExtenderPriority`: scores are 0..=10.
pub(crate) const MAX_SCORE: i64 = 10;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority {
    #[serde(rename = "Host")]
    pub host: String,
    /// 0..=10; kube-scheduler multiplies it by the extender's weight.
    #[serde(rename = "Score")]
    pub score: i64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ExtenderBindingArgs {
    #[serde(rename = "PodName")]
    pub pod_name: String,
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    #[serde(rename = "Node")]
    pub node: String,
}

#[derive(Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct ExtenderBindingResult {
    #[serde(rename = "Error")]
    pub(crate) error: String,
}

/// Preempt arguments: the preemptor and, per candidate node, the victims
/// the scheduler's own preemption chose there: UIDs only
/// (`NodeNameToMetaVictims`) with `nodeCacheCapable: true`, whole pods
/// (`NodeNameToVictims`) otherwise.
#[derive(Debug, Deserialize)]
pub struct ExtenderPreemptionArgs {
    #[serde(rename = "Pod")]
    pub pod: Option<Pod>,
    #[serde(rename = "NodeNameToVictims", default)]
    pub node_name_to_victims: Option<BTreeMap<String, Victims>>,
    #[serde(rename = "NodeNameToMetaVictims", default)]
    pub node_name_to_meta_victims: Option<BTreeMap<String, MetaVictims>>,
}

impl ExtenderPreemptionArgs {
    /// The scheduler's candidates, each with its victims by UID, whichever
    /// way they came.
    pub(crate) fn candidates(&self) -> BTreeMap<String, MetaVictims> {
        if let Some(meta) = &self.node_name_to_meta_victims {
            return meta.clone();
        }
        let uid = |p: &Pod| MetaPod {
            uid: p.metadata.uid.clone().unwrap_or_default(),
        };
        self.node_name_to_victims
            .iter()
            .flatten()
            .map(|(node, v)| {
                let pods = v.pods.iter().map(uid).collect();
                let victims = MetaVictims {
                    pods,
                    num_pdb_violations: v.num_pdb_violations,
                };
                (node.clone(), victims)
            })
            .collect()
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct Victims {
    #[serde(rename = "Pods", default)]
    pub pods: Vec<Pod>,
    #[serde(rename = "NumPDBViolations", default)]
    pub num_pdb_violations: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaPod {
    #[serde(rename = "UID")]
    pub uid: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaVictims {
    #[serde(rename = "Pods", default)]
    pub pods: Vec<MetaPod>,
    #[serde(rename = "NumPDBViolations", default)]
    pub num_pdb_violations: i64,
}

/// The nodes kept and their victims: a node left out is no candidate.
#[derive(Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderPreemptionResult {
    #[serde(rename = "NodeNameToMetaVictims")]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}
