//! GPUs and the devices the kubelet sees: the three resources, their device
//! IDs, the wire size of their lists, and how requests are packed onto GPUs.
//! Everything here but the backends is pure and unit-tested directly.

mod backend;
mod ids;
mod list;
mod model;
pub mod packing;

pub use backend::{DiscoverError, discover};
pub use ids::validate_uuid;
pub use list::DeviceListMessage;
pub use model::{
    DeviceModel, DeviceRef, IdError, KUBELET_MAX_MESSAGE_BYTES, Plan, PlanError, device_entry_len,
};

use serde::Deserialize;

/// One of the three extended resources (SPEC §1).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, serde::Serialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Resource {
    GpuMemory,
    GpuCore,
    GpuCount,
}

impl Resource {
    pub const ALL: [Resource; 3] = [Resource::GpuMemory, Resource::GpuCore, Resource::GpuCount];

    pub fn name(self) -> &'static str {
        match self {
            Resource::GpuMemory => "gpu-memory",
            Resource::GpuCore => "gpu-core",
            Resource::GpuCount => "gpu-count",
        }
    }
}

impl std::fmt::Display for Resource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A physical (or mock) GPU as the backend reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub uuid: String,
    pub memory_mib: u64,
    /// NVML's index: shown to operators, never used in IDs (it can change).
    pub index: u32,
    pub numa_node: Option<u32>,
}
