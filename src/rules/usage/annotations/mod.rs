//! Every annotation the node daemon and the scheduler extender read and
//! write, in one place: their keys ([`Keys`], `<domain>/…`, `doslab.io` by
//! default), their formats, and how a pod's records are read.
//!
//! - `gpu-ledger`, on a Pod, written by the node's matcher as the kubelet
//!   serves each container: what it was granted ([`Ledger`], ledger.rs),
//!   `{"<container>": {"gpus": ["GPU-…"], "gpu-memory": 1024, "ids": {…}}}`.
//! - `gpu-assignment`, on a Pod, written by the extender at bind: the GPUs
//!   each container is to get ([`Assignment`], assignment.rs),
//!   `{"<container>": ["GPU-…"]}`.
//! - `gpu-inventory`, on the Node, published by the node daemon: its GPUs
//!   and units ([`Inventory`], inventory.rs), `{"version": 1,
//!   "memoryUnitMiB": 256, "coresPerGpu": 100, "resources": […], "gpus":
//!   [{"uuid": "GPU-…", "memoryMiB": 81920, "healthy": true}]}`.
//! - `gpu-uuid`, `gpu-assume-time` (decimal nanoseconds), `gpu-assigned`
//!   (`"false"`, then `"true"` once served), on a Pod: the plain strings a
//!   scheduler extender and the node exchange, as older readers know them.
//!
//! A pod's accounting annotations (its ledger and its assignment) are
//! read once, by [`Records::read`], for every component: any tenant can
//! write them on their own pods, so an unreadable one is a named condition
//! ([`Garbled`]) that the usage model counts failing closed, never an
//! empty record that would free the pod's room.

pub(crate) mod assignment;
pub(crate) mod inventory;
pub(crate) mod ledger;

use k8s_openapi::api::core::v1::Pod;

use crate::rules::device::{PerResource, Resource};

pub(crate) use assignment::Assignment;
pub use inventory::Inventory;
pub(crate) use inventory::InventoryError;
pub use ledger::Ledger;
pub(crate) use ledger::ids_digest;

/// The annotation keys of a resource domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    pub(crate) assume_time: String,
    pub(crate) gpu_uuid: String,
    pub(crate) assigned: String,
    pub ledger: String,
    /// The extender's per-container GPUs ([`Assignment`]).
    pub(crate) assignment: String,
    /// The node's GPUs ([`Inventory`]), on the Node.
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

    /// The keys of a pod's own GPU records: what the extender assigned it
    /// and the node recorded of it.
    pub(crate) fn pod_records(&self) -> [&String; 5] {
        [
            &self.assignment,
            &self.gpu_uuid,
            &self.assume_time,
            &self.assigned,
            &self.ledger,
        ]
    }
}

/// An accounting annotation of a pod that is there but cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "annotation {key} is not valid ({error}); the pod's GPU asks count as held wherever \
     they may be until it is fixed or the pod ends"
)]
pub(crate) struct Garbled {
    pub(crate) key: String,
    pub(crate) error: String,
}

/// A pod's ledger and assignment as read: a missing annotation is empty; an
/// unreadable one is empty too but marked in the ledger's [`ledger::Unread`]
/// (so the usage model fails closed on it) and named here (so the caller
/// logs it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Records {
    pub(crate) ledger: Ledger,
    pub(crate) assignment: Assignment,
    pub(crate) garbled_ledger: Option<Garbled>,
    pub(crate) garbled_assignment: Option<Garbled>,
}

impl Records {
    pub(crate) fn read(keys: &Keys, pod: &Pod) -> Records {
        let annotation = |key: &str| {
            let annotations = pod.metadata.annotations.as_ref()?;
            annotations.get(key).map(String::as_str)
        };
        let garbled = |key: &String, e: serde_json::Error| Garbled {
            key: key.clone(),
            error: e.to_string(),
        };
        let mut r = Records::default();
        match Ledger::parse(annotation(&keys.ledger)) {
            Ok(ledger) => r.ledger = ledger,
            Err(e) => r.garbled_ledger = Some(garbled(&keys.ledger, e)),
        }
        match Assignment::parse(annotation(&keys.assignment)) {
            Ok(assignment) => r.assignment = assignment,
            Err(e) => r.garbled_assignment = Some(garbled(&keys.assignment, e)),
        }
        r.ledger.1.ledger = r.garbled_ledger.is_some();
        r.ledger.1.assignment = r.garbled_assignment.is_some();
        r
    }

    /// Every annotation that could not be read.
    pub(crate) fn garbled(&self) -> impl Iterator<Item = &Garbled> {
        self.garbled_ledger.iter().chain(&self.garbled_assignment)
    }
}
