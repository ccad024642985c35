//! The extender's assignment on a pod, `<domain>/gpu-assignment`: which
//! GPUs each container is to get, written at bind so the node daemon (and
//! the usage model, before the kubelet serves the pod) knows:
//! `{"<container>": ["GPU-…"]}`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Container name → the UUIDs of its GPUs: one for a shared ask, K for a
/// whole ask of K.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub(crate) struct Assignment(pub(crate) BTreeMap<String, Vec<String>>);

impl Assignment {
    /// A missing annotation is no assignment; a malformed one is an error.
    pub(crate) fn parse(text: Option<&str>) -> Result<Assignment, serde_json::Error> {
        text.map_or(Ok(Assignment::default()), serde_json::from_str)
    }

    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an assignment always serialises")
    }

    /// The GPU, when every assigned container uses the same single one
    /// (what `<domain>/gpu-uuid` carries for older readers).
    pub(crate) fn single_gpu(&self) -> Option<&str> {
        let mut gpus = self.0.values().flatten();
        let first = gpus.next()?;
        gpus.all(|g| g == first).then_some(first.as_str())
    }
}
