//! DRA: the daemon as a Dynamic Resource Allocation kubelet plugin
//! (`[dra]` in the config), beside or instead of the device-plugin
//! resources, on GPUs of its own.
//!
//! - `crate::config::dra`: the `[dra]` section and which GPUs DRA serves.
//! - `proto`: the kubelet's registration and DRA plugin APIs.
//! - `grant`: what an allocated claim grants on this node (pure).
//! - `cdi`: a claim's CDI spec.
//! - `checkpoint`: what is prepared, on disk.
//! - `prepare`: NodePrepareResources / NodeUnprepareResources, through the
//!   grant pipeline the device plugin uses too ([`crate::node::grant`]).
//! - `slices`: the node's ResourceSlice.
//! - `health`: the kubelet's device health stream (KEP-4680).
//! - `shares`: the prepared claims' grants and containers, for the usage
//!   monitor.
//! - `service`: the gRPC adapters; `actor`: the supervised actor.

mod actor;
mod cdi;
mod checkpoint;
mod grant;
mod health;
mod prepare;
pub mod proto;
mod service;
pub(crate) mod shares;
mod slices;

pub use crate::config::dra::{DraConfig, UnknownGpu};
pub(crate) use actor::{DraActor, DraArgs, DraMsg};
pub use checkpoint::CheckpointError;
pub(crate) use grant::Node as DraNode;
