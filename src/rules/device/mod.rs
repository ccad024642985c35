//! GPUs and the devices the kubelet sees: the three resources, their device
//! IDs, the wire size of their lists, and the free devices per GPU in a
//! list (the usage model chooses among GPUs).
//! Everything here but the backends and the sysfs reads of `pci` is pure
//! and unit-tested directly.

mod backend;
pub(crate) mod free;
mod ids;
mod model;
mod pci;
mod units;

pub(crate) use backend::{DiscoverError, Facts, GpuSource, discover, facts};
// The facts' PCI places, which only tests build by hand.
#[cfg(test)]
pub(crate) use backend::Pci;
pub(crate) use ids::validate_uuid;
pub(crate) use model::{DeviceModel, DeviceRef, IdError, PlanError, device_entry_len};
pub use model::{KUBELET_MAX_MESSAGE_BYTES, Plan};
pub(crate) use pci::bus_id as pci_bus_id;
pub(crate) use units::{Offer, Units, UnitsError};
// The wire-size rules the plugin's ListAndWatch encoder writes by.
#[cfg(test)]
pub(crate) use model::tests as model_tests;
pub(crate) use model::{HEALTHY, UNHEALTHY, device_len, numa_len, topology_len};

use serde::Deserialize;

/// One of the three extended resources; the kubelet sees each as
/// `<resource_domain>/<name>`.
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

/// One value per resource, so code says `x[Resource::GpuCore]` rather than
/// indexing an array by a cast.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PerResource<T> {
    pub memory: T,
    pub(crate) core: T,
    pub(crate) count: T,
}

impl<T> PerResource<T> {
    pub(crate) fn from_fn(mut f: impl FnMut(Resource) -> T) -> Self {
        PerResource {
            memory: f(Resource::GpuMemory),
            core: f(Resource::GpuCore),
            count: f(Resource::GpuCount),
        }
    }

    pub(crate) fn map<U>(&self, mut f: impl FnMut(Resource, &T) -> U) -> PerResource<U> {
        PerResource::from_fn(|r| f(r, &self[r]))
    }
}

/// In [`Resource::ALL`]'s order: gpu-memory, gpu-core, gpu-count.
impl<T> From<[T; 3]> for PerResource<T> {
    fn from([memory, core, count]: [T; 3]) -> Self {
        PerResource {
            memory,
            core,
            count,
        }
    }
}

impl<T> std::ops::Index<Resource> for PerResource<T> {
    type Output = T;
    fn index(&self, r: Resource) -> &T {
        match r {
            Resource::GpuMemory => &self.memory,
            Resource::GpuCore => &self.core,
            Resource::GpuCount => &self.count,
        }
    }
}

impl<T> std::ops::IndexMut<Resource> for PerResource<T> {
    fn index_mut(&mut self, r: Resource) -> &mut T {
        match r {
            Resource::GpuMemory => &mut self.memory,
            Resource::GpuCore => &mut self.core,
            Resource::GpuCount => &mut self.count,
        }
    }
}
