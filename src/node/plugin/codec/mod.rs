//! The plugin server's hand-written prost codecs. `build.rs` swaps them in
//! for the generated types of the messages that carry every device ID, so a
//! node of two 80 GB GPUs costs no heap string per device:
//!
//! - [`DeviceListMessage`] (`ListAndWatchResponse`): encoded lazily, straight
//!   from the device model, as the stream sends it.
//! - [`PreferredRequest`] and [`AllocateIdsRequest`]: decoded into one
//!   buffer per ID list, within bounds.
//!
//! Both live here, beside the server that uses them, because nothing else
//! speaks these messages this way; the size rules the encoder writes by stay
//! with the device model, which checks that a list fits the kubelet's limit.

mod list;
mod request;

pub(crate) use list::DeviceListMessage;
pub(crate) use request::{AllocateIdsRequest, Oversize};
pub use request::{MAX_CONTAINERS, PreferredRequest};
