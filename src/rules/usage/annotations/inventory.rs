//! A node's GPUs as the usage model sees them: what each can hold, in real
//! units, and what one device of each resource is worth. It is also the
//! `<domain>/gpu-inventory` annotation the node daemon publishes on its
//! Node for the extender.

use serde::{Deserialize, Serialize};

use crate::rules::device::{Gpu, Offer, PerResource, Resource, Units, UnitsError};

/// The only inventory format this build reads.
pub(crate) const INVENTORY_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInfo {
    pub(crate) uuid: String,
    #[serde(rename = "memoryMiB")]
    pub(crate) memory_mib: u64,
    pub(crate) healthy: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) numa_node: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Inventory {
    pub(crate) version: u32,
    #[serde(rename = "memoryUnitMiB")]
    pub(crate) memory_unit_mib: u64,
    pub(crate) cores_per_gpu: u32,
    /// The resources the node offers.
    pub(crate) resources: Vec<Resource>,
    pub gpus: Vec<GpuInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryError {
    #[error("the GPU inventory is not valid JSON: {0}")]
    Json(String),
    #[error(
        "the GPU inventory has version {0}; this build reads version {INVENTORY_VERSION} \
         (upgrade the extender or the node daemon so they match)"
    )]
    Version(u32),
    #[error("the GPU inventory is unusable: {0}")]
    Invalid(#[from] Unusable),
}

/// Why an inventory's numbers cannot be computed with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unusable {
    #[error("memoryUnitMiB is 0")]
    MemoryUnitZero,
    #[error("coresPerGpu {0} does not divide 100")]
    CoresNotDividing100(u32),
    #[error("GPU {0} has an empty uuid")]
    EmptyUuid(usize),
    #[error("GPU uuid {0:?} is listed twice")]
    ListedTwice(String),
    #[error("GPU {uuid} has {memory_mib} MiB, less than one memoryUnitMiB ({unit_mib})")]
    UnderOneUnit {
        uuid: String,
        memory_mib: u64,
        unit_mib: u64,
    },
    #[error("GPU {uuid} has {memory_mib} MiB, more than 2^32 devices of {unit_mib} MiB")]
    OverU32Units {
        uuid: String,
        memory_mib: u64,
        unit_mib: u64,
    },
}

impl From<UnitsError> for Unusable {
    fn from(e: UnitsError) -> Self {
        match e {
            UnitsError::MemoryUnitZero => Unusable::MemoryUnitZero,
            UnitsError::CoresNotDividing100(cores) => Unusable::CoresNotDividing100(cores),
        }
    }
}

impl Inventory {
    /// The node side: every GPU the backend found, healthy.
    pub fn new(gpus: &[Gpu], offer: &Offer) -> Inventory {
        Inventory {
            version: INVENTORY_VERSION,
            memory_unit_mib: offer.units.memory_unit_mib,
            cores_per_gpu: offer.units.cores_per_gpu,
            resources: offer.resources.clone(),
            gpus: gpus
                .iter()
                .map(|g| GpuInfo {
                    uuid: g.uuid.clone(),
                    memory_mib: g.memory_mib,
                    healthy: true,
                    numa_node: g.numa_node,
                })
                .collect(),
        }
    }

    /// Reads the annotation; an unknown version or units that cannot be
    /// computed with are refused, with the reason.
    pub fn parse(text: &str) -> Result<Inventory, InventoryError> {
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let json = |e: serde_json::Error| InventoryError::Json(e.to_string());
        let v: Versioned = serde_json::from_str(text).map_err(json)?;
        if v.version != INVENTORY_VERSION {
            return Err(InventoryError::Version(v.version));
        }
        let inv: Inventory = serde_json::from_str(text).map_err(json)?;
        inv.units().check().map_err(Unusable::from)?;
        inv.check_gpus()?;
        Ok(inv)
    }

    /// Every GPU is named once (usage is counted by UUID: two GPUs of one
    /// name would each count the other's pods, or neither) and holds a
    /// countable number of memory devices.
    fn check_gpus(&self) -> Result<(), Unusable> {
        let mut seen = std::collections::HashSet::new();
        for (i, g) in self.gpus.iter().enumerate() {
            if g.uuid.trim().is_empty() {
                return Err(Unusable::EmptyUuid(i));
            }
            if !seen.insert(g.uuid.as_str()) {
                return Err(Unusable::ListedTwice(g.uuid.clone()));
            }
            let (memory_mib, unit_mib) = (g.memory_mib, self.memory_unit_mib);
            if memory_mib < unit_mib {
                return Err(Unusable::UnderOneUnit {
                    uuid: g.uuid.clone(),
                    memory_mib,
                    unit_mib,
                });
            }
            if u32::try_from(memory_mib / unit_mib).is_err() {
                return Err(Unusable::OverU32Units {
                    uuid: g.uuid.clone(),
                    memory_mib,
                    unit_mib,
                });
            }
        }
        Ok(())
    }

    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an inventory always serialises")
    }

    /// The size of one device of each resource on this node.
    pub(crate) fn units(&self) -> Units {
        Units {
            memory_unit_mib: self.memory_unit_mib,
            cores_per_gpu: self.cores_per_gpu,
        }
    }

    /// What one device is worth: MiB, percent of a GPU, GPUs.
    pub fn unit(&self) -> PerResource<u64> {
        self.units().amounts()
    }

    /// What GPU `g` holds in real units, as far as the kubelet can see it:
    /// its devices times what each is worth. Never more than its memory
    /// (MiB), 100 (percent) or 1 (GPU), so it cannot overflow.
    pub fn capacity(&self, g: usize) -> PerResource<u64> {
        let (units, memory_mib) = (self.units(), self.gpus[g].memory_mib);
        PerResource::from_fn(|r| {
            u64::from(units.per_gpu(r, memory_mib)).saturating_mul(units.amount(r))
        })
    }

    /// `devices` in real units. An amount past `u64` saturates: nothing
    /// holds that much, so it never fits and, held, fills its GPU. Asks
    /// are checked with [`Inventory::overflow`] first, for the reason.
    pub(crate) fn amount(&self, devices: &PerResource<u64>) -> PerResource<u64> {
        let unit = self.unit();
        devices.map(|r, &d| d.saturating_mul(unit[r]))
    }

    /// Why `devices` cannot be counted in real units: the first resource
    /// whose amount is past `u64`.
    pub(crate) fn overflow(&self, devices: &PerResource<u64>) -> Option<String> {
        let unit = self.unit();
        Resource::ALL.into_iter().find_map(|r| {
            devices[r].checked_mul(unit[r]).is_none().then(|| {
                format!(
                    "asks {} {r} devices of {} each, more than 2^64 in all",
                    devices[r], unit[r]
                )
            })
        })
    }

    pub(crate) fn index(&self, uuid: &str) -> Option<usize> {
        self.gpus.iter().position(|g| g.uuid == uuid)
    }

    pub(crate) fn offers(&self, r: Resource) -> bool {
        self.resources.contains(&r)
    }
}
