//! What one device of each resource is worth, and which resources a node
//! offers: the two values the device plan and the usage model take from
//! the config, so that neither reads the config itself.

use super::{PerResource, Resource};

/// The size of one device: gpu-memory devices are `memory_unit_mib` MiB,
/// a GPU has `cores_per_gpu` gpu-core devices, gpu-count devices are GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Units {
    pub(crate) memory_unit_mib: u64,
    pub(crate) cores_per_gpu: u32,
}

/// Why a [`Units`] cannot be computed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UnitsError {
    /// A gpu-memory device of 0 MiB.
    MemoryUnitZero,
    /// gpu-core devices that are not a whole percent of a GPU each.
    CoresNotDividing100(u32),
}

impl Units {
    /// Every grant must be a whole percent (`CUDA_DEVICE_SM_LIMIT` takes
    /// percents), so `cores_per_gpu` divides 100; a memory device holds
    /// at least 1 MiB.
    pub(crate) fn check(self) -> Result<(), UnitsError> {
        if self.memory_unit_mib == 0 {
            return Err(UnitsError::MemoryUnitZero);
        }
        if self.cores_per_gpu == 0 || 100 % self.cores_per_gpu != 0 {
            return Err(UnitsError::CoresNotDividing100(self.cores_per_gpu));
        }
        Ok(())
    }

    /// What one device of `r` is worth: MiB, percent of a GPU, GPUs.
    pub fn amount(self, r: Resource) -> u64 {
        match r {
            Resource::GpuMemory => self.memory_unit_mib,
            Resource::GpuCore => u64::from(100 / self.cores_per_gpu),
            Resource::GpuCount => 1,
        }
    }

    /// [`Units::amount`] of every resource.
    pub(crate) fn amounts(self) -> PerResource<u64> {
        PerResource::from_fn(|r| self.amount(r))
    }

    /// Devices of `r` on a GPU with `memory_mib` of memory (memory rounds
    /// down to whole devices).
    pub(crate) fn per_gpu(self, r: Resource, memory_mib: u64) -> u32 {
        match r {
            Resource::GpuMemory => {
                u32::try_from(memory_mib / self.memory_unit_mib).unwrap_or(u32::MAX)
            }
            Resource::GpuCore => self.cores_per_gpu,
            Resource::GpuCount => 1,
        }
    }
}

/// What a node advertises: its enabled resources and the size of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    pub(crate) resources: Vec<Resource>,
    pub(crate) units: Units,
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNITS: Units = Units {
        memory_unit_mib: 256,
        cores_per_gpu: 20,
    };

    #[test]
    fn a_device_is_worth_its_unit() {
        assert_eq!(UNITS.amount(Resource::GpuMemory), 256);
        assert_eq!(UNITS.amount(Resource::GpuCore), 5);
        assert_eq!(UNITS.amount(Resource::GpuCount), 1);
        assert_eq!(UNITS.amounts(), PerResource::from([256, 5, 1]));
    }

    #[test]
    fn a_gpu_holds_whole_devices() {
        assert_eq!(UNITS.per_gpu(Resource::GpuMemory, 1000), 3);
        assert_eq!(UNITS.per_gpu(Resource::GpuMemory, 255), 0);
        assert_eq!(UNITS.per_gpu(Resource::GpuCore, 1000), 20);
        assert_eq!(UNITS.per_gpu(Resource::GpuCount, 1000), 1);
    }

    #[test]
    fn units_that_cannot_be_computed_with_are_refused() {
        UNITS.check().unwrap();
        let with = |memory_unit_mib, cores_per_gpu| Units {
            memory_unit_mib,
            cores_per_gpu,
        };
        assert_eq!(with(0, 100).check(), Err(UnitsError::MemoryUnitZero));
        for cores in [0, 30, 200] {
            assert_eq!(
                with(1, cores).check(),
                Err(UnitsError::CoresNotDividing100(cores))
            );
        }
        for cores in [1, 2, 4, 5, 10, 20, 25, 50, 100] {
            with(1, cores).check().unwrap();
        }
    }
}
