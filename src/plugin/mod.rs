//! One plugin per enabled resource: an actor that owns the resource's socket
//! and tonic server, registers with the kubelet, and streams device lists.

mod actor;
pub mod allocate;
mod pairing;
mod placement;
mod registration;
pub mod request;
pub mod service;

pub use actor::{PluginActor, PluginArgs, PluginMsg, SETTLE};
pub use pairing::LastShared;
pub use placement::Placement;
