//! The one model of GPU usage that the node's pod matcher and the scheduler
//! extender share, so both agree on what is free: a node's GPUs
//! ([`Inventory`]), what pods ask ([`PodAsks`]) and hold ([`Holding`]), the
//! usage that adds up to ([`NodeUsage`]), which GPU has room ([`choose`], for
//! every caller alike), where a pod fits ([`fit`]) and how well ([`score`]).
//!
//! Usage of a GPU is the ledgers of live pods, plus the assignments of pods
//! bound but not yet admitted, plus whatever the caller adds (the
//! extender's binds in flight). Pure: callers bring the pods.

mod annotations;
mod asks;
mod fit;
mod inventory;
mod node;
pub(crate) mod quantity;
mod select;

pub use annotations::Keys;
pub(crate) use annotations::{Assignment, Records};
pub(crate) use asks::{ContainerAsk, PodAsks};
pub use fit::Policy;
pub(crate) use fit::{best_shared, fit, score, whole_gpus};
pub use inventory::Inventory;
pub(crate) use inventory::InventoryError;
// Only the stand-ins' in-memory cluster writes an inventory by hand.
#[cfg(feature = "sim")]
pub(crate) use inventory::{GpuInfo, INVENTORY_VERSION};
pub(crate) use node::{Holding, NodeUsage, pod_holdings};
pub(crate) use select::{Candidate, Order, choose};

#[cfg(test)]
mod tests;
