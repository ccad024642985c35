//! The annotations the node daemon and the scheduler extender read and
//! write, and the per-container GPU assignment the extender leaves on a pod.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::device::{PerResource, Resource};

/// The annotation keys of a resource domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    pub(crate) assume_time: String,
    pub(crate) gpu_uuid: String,
    pub(crate) assigned: String,
    pub ledger: String,
    /// The extender's per-container GPUs ([`Assignment`]).
    pub(crate) assignment: String,
    /// The node's GPUs ([`super::Inventory`]), on the Node.
    pub inventory: String,
    /// `<domain>/<resource>`: the names containers ask by.
    pub(crate) resources: PerResource<String>,
}

impl Keys {
    pub fn new(domain: &str) -> Keys {
        Keys {
            assume_time: format!("{domain}/gpu-assume-time"),
            gpu_uuid: format!("{domain}/gpu-uuid"),
            assigned: format!("{domain}/gpu-assigned"),
            ledger: format!("{domain}/gpu-ledger"),
            assignment: format!("{domain}/gpu-assignment"),
            inventory: format!("{domain}/gpu-inventory"),
            resources: PerResource::from_fn(|r: Resource| format!("{domain}/{}", r.name())),
        }
    }
}

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
