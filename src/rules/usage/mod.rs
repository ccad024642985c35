//! The one model of GPU usage that the node's pod matcher and the scheduler
//! extender share, so both agree on what is free: the annotations they
//! exchange ([`annotations`]: a node's GPUs, [`Inventory`]; a pod's
//! [`Ledger`] and [`Assignment`]), what pods ask ([`PodAsks`]) and hold
//! ([`Holding`]), the usage that adds up to ([`NodeUsage`]), which GPU has
//! room ([`choose`], for every caller alike), where a pod fits ([`fit`])
//! and how well ([`score`], [`leftover`]).
//!
//! It sits at the bottom of the crate: it imports only the device
//! vocabulary (`crate::rules::device`), never the matcher, the extender or the
//! plugin that use it (`layering.rs` checks).
//!
//! Usage of a GPU is the ledgers of live pods, plus the assignments of pods
//! bound but not yet admitted, plus whatever the caller adds (the
//! extender's binds in flight). Pure: callers bring the pods.

mod affinity;
mod annotations;
mod asks;
mod fit;
mod frag;
mod node;
pub mod quantity;
mod select;

pub(crate) use affinity::NodeSelection;
pub(crate) use annotations::ledger::LedgerEntry;
pub(crate) use annotations::{Assignment, InventoryError, Records, ids_digest};
pub use annotations::{Inventory, Keys, Ledger};
pub(crate) use asks::{ContainerAsk, NodeAsk, PodAsks};
pub use fit::Policy;
pub(crate) use fit::{
    alternatives, best_shared, fit, fits, leftover, room_after, score, whole_gpus,
};
pub(crate) use frag::{Kind, NodeRoom, Workload};
pub(crate) use node::{Holding, NodeUsage, finished, pending, pod_holdings};
pub(crate) use select::{Candidate, Order, choose};

#[cfg(test)]
mod tests;
