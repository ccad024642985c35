//! One plugin per enabled resource: an actor that owns the resource's socket
//! and tonic server, registers with the kubelet, and streams device lists.
//!
//! - `actor`: lifecycle (serve, register, heal, stop).
//! - `service`: the gRPC adapter (decode, delegate, encode, record).
//! - `placement`: which devices and GPU a container gets, by the pod
//!   matcher (reserve, ready through [`crate::node::grant`], commit) or by
//!   the IDs with `pairing`'s hints.
//! - `preferred`: GetPreferredAllocation's device IDs, chosen by the usage
//!   model's one GPU selection.
//! - `allocate`: what a container is granted (from the IDs alone without
//!   pod matching); its response is composed by [`crate::node::grant`].
//! - `codec`: the hand-written prost types for the large messages.
//! - `registration`: the Register call to the kubelet.

mod actor;
pub(crate) mod allocate;
pub mod codec;
mod pairing;
mod placement;
pub mod preferred;
mod registration;
#[cfg(test)]
mod same_choice;
pub(crate) mod service;

pub(crate) use actor::{PluginActor, PluginArgs, PluginMsg, SETTLE};
pub(crate) use pairing::PairingBook;
pub(crate) use placement::Placement;
