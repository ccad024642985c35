//! Which nodes a pod may run on, as far as its spec's node labels say:
//! its `nodeSelector` and the terms of its required node affinity, as
//! kube-scheduler's NodeAffinity filter reads them. The scheduler filters
//! by them itself; fragmentation needs them to know that a node's free
//! GPUs are of no use to a kind of pod that may not run there (a GPU-model
//! constraint is the common case), so that it keeps the nodes such a kind
//! needs.
//!
//! Read so as never to refuse a node the scheduler would allow: a term
//! that also names fields (`matchFields`, a node's name) is taken to admit
//! every node, its labels alone cannot say.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelectorRequirement, PodSpec};

/// The nodes a pod's spec admits by their labels.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct NodeSelection {
    /// `nodeSelector`: every label, with this value.
    labels: Vec<(String, String)>,
    /// The required affinity's terms, any one of which must hold (each
    /// all of its requirements); `None` when the pod states none.
    terms: Option<Vec<Vec<Requirement>>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Requirement {
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
    Gt(String, i64),
    Lt(String, i64),
    /// A requirement on fields, or one the scheduler would refuse: holds.
    Any,
}

impl Requirement {
    fn of(r: &NodeSelectorRequirement) -> Requirement {
        let key = r.key.clone();
        let values = r.values.clone().unwrap_or_default();
        let number = || values.first().and_then(|v| v.parse::<i64>().ok());
        match r.operator.as_str() {
            "In" => Requirement::In(key, values),
            "NotIn" => Requirement::NotIn(key, values),
            "Exists" => Requirement::Exists(key),
            "DoesNotExist" => Requirement::DoesNotExist(key),
            "Gt" => number().map_or(Requirement::Any, |n| Requirement::Gt(key, n)),
            "Lt" => number().map_or(Requirement::Any, |n| Requirement::Lt(key, n)),
            _ => Requirement::Any,
        }
    }

    fn holds(&self, labels: &BTreeMap<String, String>) -> bool {
        let number = |k: &String| labels.get(k).and_then(|v| v.parse::<i64>().ok());
        match self {
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => !labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::DoesNotExist(k) => !labels.contains_key(k),
            Requirement::Gt(k, n) => number(k).is_some_and(|v| v > *n),
            Requirement::Lt(k, n) => number(k).is_some_and(|v| v < *n),
            Requirement::Any => true,
        }
    }
}

impl NodeSelection {
    pub(crate) fn of(spec: Option<&PodSpec>) -> NodeSelection {
        let Some(spec) = spec else {
            return NodeSelection::default();
        };
        let terms = spec
            .affinity
            .as_ref()
            .and_then(|a| a.node_affinity.as_ref())
            .and_then(|a| {
                a.required_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .map(|s| {
                s.node_selector_terms
                    .iter()
                    .map(|t| {
                        let fields = t.match_fields.iter().flatten().map(|_| Requirement::Any);
                        let exprs = t.match_expressions.iter().flatten().map(Requirement::of);
                        let mut term: Vec<Requirement> = exprs.chain(fields).collect();
                        if term.contains(&Requirement::Any) {
                            term = vec![Requirement::Any];
                        }
                        term.sort();
                        term
                    })
                    .collect()
            });
        NodeSelection {
            labels: spec
                .node_selector
                .iter()
                .flatten()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            terms,
        }
    }

    /// Whether a node of these labels may run the pod. A term without
    /// requirements admits no node, as the scheduler reads it.
    pub(crate) fn admits(&self, labels: &BTreeMap<String, String>) -> bool {
        let selected = self.labels.iter().all(|(k, v)| labels.get(k) == Some(v));
        selected
            && self.terms.as_ref().is_none_or(|terms| {
                terms
                    .iter()
                    .any(|t| !t.is_empty() && t.iter().all(|r| r.holds(labels)))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn selection(spec: serde_json::Value) -> NodeSelection {
        let mut spec = spec;
        spec["containers"] = json!([]);
        NodeSelection::of(Some(&serde_json::from_value(spec).unwrap()))
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn affinity(terms: serde_json::Value) -> serde_json::Value {
        json!({ "affinity": { "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": { "nodeSelectorTerms": terms }
        }}})
    }

    #[test]
    fn a_pod_stating_nothing_runs_anywhere() {
        assert!(NodeSelection::of(None).admits(&labels(&[])));
        assert!(selection(json!({})).admits(&labels(&[("a", "b")])));
    }

    #[test]
    fn node_selector_labels_must_all_match() {
        let s = selection(json!({ "nodeSelector": { "model": "V100", "zone": "a" } }));
        assert!(s.admits(&labels(&[("model", "V100"), ("zone", "a"), ("x", "y")])));
        assert!(!s.admits(&labels(&[("model", "V100")])));
        assert!(!s.admits(&labels(&[("model", "T4"), ("zone", "a")])));
    }

    #[test]
    fn one_term_of_the_required_affinity_must_hold() {
        let s = selection(affinity(json!([
            { "matchExpressions": [
                { "key": "model", "operator": "In", "values": ["V100", "A100"] },
                { "key": "spot", "operator": "DoesNotExist" },
            ]},
            { "matchExpressions": [{ "key": "gpus", "operator": "Gt", "values": ["4"] }] },
        ])));
        assert!(s.admits(&labels(&[("model", "A100")])));
        assert!(!s.admits(&labels(&[("model", "A100"), ("spot", "")])));
        assert!(s.admits(&labels(&[("model", "T4"), ("gpus", "8")])));
        assert!(!s.admits(&labels(&[("model", "T4"), ("gpus", "4")])));
        assert!(!s.admits(&labels(&[("gpus", "many")])));
        let s = selection(affinity(json!([{ "matchExpressions": [
            { "key": "model", "operator": "NotIn", "values": ["T4"] },
            { "key": "gpus", "operator": "Lt", "values": ["4"] },
            { "key": "rack", "operator": "Exists" },
        ]}])));
        assert!(s.admits(&labels(&[("gpus", "2"), ("rack", "1")])));
        assert!(!s.admits(&labels(&[("model", "T4"), ("gpus", "2"), ("rack", "1")])));
        assert!(!s.admits(&labels(&[("gpus", "2")])));
    }

    /// Fields and what the scheduler would refuse cannot be judged from
    /// labels: such a term admits every node, never fewer than it would.
    #[test]
    fn what_labels_cannot_say_admits() {
        let s = selection(affinity(json!([{
            "matchExpressions": [{ "key": "model", "operator": "In", "values": ["V100"] }],
            "matchFields": [{ "key": "metadata.name", "operator": "In", "values": ["n1"] }],
        }])));
        assert!(s.admits(&labels(&[("model", "T4")])));
        let s = selection(affinity(json!([{ "matchExpressions": [
            { "key": "gpus", "operator": "Gt", "values": ["four"] },
        ]}])));
        assert!(s.admits(&labels(&[])));
        // An empty term admits nothing, nor does an empty list of terms.
        assert!(!selection(affinity(json!([{}]))).admits(&labels(&[])));
        assert!(!selection(affinity(json!([]))).admits(&labels(&[])));
    }
}
