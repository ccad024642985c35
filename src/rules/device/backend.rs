//! Where GPUs come from: NVML on a real node, the config's list on the mock
//! backend. NVML is loaded at run time (nvml-wrapper uses libloading), so a
//! machine without the driver gets an error here, never a failed start-up
//! link. Callers run [`discover`] off the async threads: NVML blocks.

use nvml_wrapper::Nvml;

use super::Gpu;

/// Where [`discover`] finds the GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GpuSource {
    Nvml,
    /// Stand-in GPUs, reported as listed.
    Listed(Vec<Gpu>),
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoverError {
    #[error(
        "cannot load NVML ({0}); is the NVIDIA driver installed and libnvidia-ml.so.1 visible \
         to this container? Without a GPU, use devices.backend = \"mock\""
    )]
    Load(String),
    #[error("NVML call {call} failed: {source}")]
    Nvml {
        call: &'static str,
        source: nvml_wrapper::error::NvmlError,
    },
}

/// `source` is a [`GpuSource`], or a `&Config`, which names one.
pub(crate) fn discover(source: impl Into<GpuSource>) -> Result<Vec<Gpu>, DiscoverError> {
    match source.into() {
        GpuSource::Listed(gpus) => Ok(gpus),
        GpuSource::Nvml => discover_nvml(),
    }
}

fn discover_nvml() -> Result<Vec<Gpu>, DiscoverError> {
    let nvml = Nvml::init().map_err(|e| DiscoverError::Load(e.to_string()))?;
    let call = |call: &'static str| move |source| DiscoverError::Nvml { call, source };
    let count = nvml.device_count().map_err(call("nvmlDeviceGetCount"))?;
    (0..count)
        .map(|i| {
            let d = nvml
                .device_by_index(i)
                .map_err(call("nvmlDeviceGetHandleByIndex"))?;
            let memory = d.memory_info().map_err(call("nvmlDeviceGetMemoryInfo"))?;
            // Older drivers lack nvmlDeviceGetNumaNodeId; sysfs knows too.
            let numa_node = d.numa_node_id().ok().or_else(|| {
                let bus = d.pci_info().ok()?.bus_id.to_lowercase();
                sysfs_numa_node(&bus)
            });
            Ok(Gpu {
                uuid: d.uuid().map_err(call("nvmlDeviceGetUUID"))?,
                memory_mib: memory.total / (1024 * 1024),
                index: i,
                numa_node,
            })
        })
        .collect()
}

/// What a GPU's attributes say beyond what the device list knows: what
/// NVML reports, none with the mock backend.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Facts {
    /// Product names by UUID.
    pub(crate) products: std::collections::BTreeMap<String, String>,
    pub(crate) driver_version: Option<String>,
    pub(crate) cuda_version: Option<String>,
}

/// What NVML says of the node beyond the GPU list, for DRA's device
/// attributes: product names by UUID, the driver's version and the CUDA
/// version it supports. Best effort: a call that fails leaves its fact out
/// (the mock backend has none).
pub(crate) fn facts(source: impl Into<GpuSource>) -> Facts {
    let mut facts = Facts::default();
    if source.into() != GpuSource::Nvml {
        return facts;
    }
    let Ok(nvml) = Nvml::init() else {
        return facts;
    };
    facts.driver_version = nvml.sys_driver_version().ok();
    facts.cuda_version = nvml.sys_cuda_driver_version().ok().map(|v| {
        // NVML's form: 1000 * major + 10 * minor.
        format!("{}.{}", v / 1000, (v % 1000) / 10)
    });
    for i in 0..nvml.device_count().unwrap_or(0) {
        if let Ok(d) = nvml.device_by_index(i)
            && let (Ok(uuid), Ok(name)) = (d.uuid(), d.name())
        {
            facts.products.insert(uuid, name);
        }
    }
    facts
}

/// NVML's bus ID has an 8-digit domain; sysfs uses 4 (`0000:3b:00.0`).
fn sysfs_numa_node(nvml_bus_id: &str) -> Option<u32> {
    let short = nvml_bus_id.get(4..)?;
    let text = std::fs::read_to_string(format!("/sys/bus/pci/devices/{short}/numa_node")).ok()?;
    // -1 means the platform has no NUMA information.
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_absence_is_a_clear_error() {
        // These test machines have no driver; on a GPU machine this proves nothing.
        if Nvml::init().is_ok() {
            return;
        }
        let e = discover(GpuSource::Nvml).unwrap_err().to_string();
        assert!(e.contains("NVML") && e.contains("mock"), "{e}");
    }
}
