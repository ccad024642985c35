//! Where GPUs come from: NVML on a real node, the config's list on the mock
//! backend. NVML is loaded at run time (nvml-wrapper uses libloading), so a
//! machine without the driver gets an error here, never a failed start-up
//! link. Callers run [`discover`] off the async threads: NVML blocks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nvml_wrapper::Nvml;

use super::{Gpu, pci};

/// Where [`discover`] finds the GPUs, and sysfs's mount point
/// (`devices.sysfs_root`), which says what NVML does not: a NUMA node on
/// older drivers, every GPU's PCIe root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GpuSource {
    Nvml {
        sysfs_root: PathBuf,
    },
    /// Stand-in GPUs, reported as listed, with the PCI bus IDs (extended
    /// BDF) the list gives by UUID.
    Listed {
        gpus: Vec<Gpu>,
        pci_bus_ids: BTreeMap<String, String>,
        sysfs_root: PathBuf,
    },
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
        GpuSource::Listed { gpus, .. } => Ok(gpus),
        GpuSource::Nvml { sysfs_root } => discover_nvml(&sysfs_root),
    }
}

fn discover_nvml(sysfs_root: &Path) -> Result<Vec<Gpu>, DiscoverError> {
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
                let bus = pci::bus_id(&d.pci_info().ok()?.bus_id)?;
                pci::numa_node(sysfs_root, &bus)
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
    pub(crate) products: BTreeMap<String, String>,
    pub(crate) driver_version: Option<String>,
    pub(crate) cuda_version: Option<String>,
    /// Where each GPU sits on PCI, by UUID.
    pub(crate) pci: BTreeMap<String, Pci>,
}

/// A GPU's place on PCI, in the forms of Kubernetes' standard attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pci {
    /// Extended BDF: `0000:3b:00.0`.
    pub(crate) bus_id: String,
    /// `pci0000:3a`; `None` where sysfs does not say.
    pub(crate) pcie_root: Option<String>,
}

impl Pci {
    fn at(sysfs_root: &Path, bus_id: String) -> Pci {
        Pci {
            pcie_root: pci::pcie_root(sysfs_root, &bus_id),
            bus_id,
        }
    }
}

/// What NVML (and sysfs) say of the node beyond the GPU list, for DRA's
/// device attributes: product names by UUID, the driver's version and the
/// CUDA version it supports, each GPU's place on PCI. Best effort: a call
/// that fails leaves its fact out. The mock backend has only the PCI
/// places its list gives.
pub(crate) fn facts(source: impl Into<GpuSource>) -> Facts {
    let mut facts = Facts::default();
    let sysfs_root = match source.into() {
        GpuSource::Nvml { sysfs_root } => sysfs_root,
        GpuSource::Listed {
            pci_bus_ids,
            sysfs_root,
            ..
        } => {
            facts.pci = pci_bus_ids
                .into_iter()
                .map(|(uuid, bus)| (uuid, Pci::at(&sysfs_root, bus)))
                .collect();
            return facts;
        }
    };
    let Ok(nvml) = Nvml::init() else {
        return facts;
    };
    facts.driver_version = nvml.sys_driver_version().ok();
    facts.cuda_version = nvml.sys_cuda_driver_version().ok().map(|v| {
        // NVML's form: 1000 * major + 10 * minor.
        format!("{}.{}", v / 1000, (v % 1000) / 10)
    });
    for i in 0..nvml.device_count().unwrap_or(0) {
        let Ok(d) = nvml.device_by_index(i) else {
            continue;
        };
        let Ok(uuid) = d.uuid() else {
            continue;
        };
        if let Ok(name) = d.name() {
            facts.products.insert(uuid.clone(), name);
        }
        if let Some(bus) = d.pci_info().ok().and_then(|p| pci::bus_id(&p.bus_id)) {
            facts.pci.insert(uuid, Pci::at(&sysfs_root, bus));
        }
    }
    facts
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
        let nvml = GpuSource::Nvml {
            sysfs_root: "/sys".into(),
        };
        let e = discover(nvml).unwrap_err().to_string();
        assert!(e.contains("NVML") && e.contains("mock"), "{e}");
    }

    #[test]
    fn listed_gpus_are_placed_on_pci_through_sysfs() {
        let sysfs = super::pci::tests::sysfs("0\n");
        let listed = GpuSource::Listed {
            gpus: Vec::new(),
            pci_bus_ids: BTreeMap::from([
                ("GPU-a".to_owned(), "0000:3b:00.0".to_owned()),
                ("GPU-b".to_owned(), "0000:3c:00.0".to_owned()),
            ]),
            sysfs_root: sysfs.path().to_owned(),
        };
        let facts = facts(listed);
        assert_eq!(
            facts.pci,
            BTreeMap::from([
                (
                    "GPU-a".to_owned(),
                    Pci {
                        bus_id: "0000:3b:00.0".into(),
                        pcie_root: Some("pci0000:3a".into()),
                    }
                ),
                // Not in this sysfs: its bus ID alone.
                (
                    "GPU-b".to_owned(),
                    Pci {
                        bus_id: "0000:3c:00.0".into(),
                        pcie_root: None,
                    }
                ),
            ])
        );
        // NVML's facts are not made up for mock GPUs.
        assert!(facts.products.is_empty() && facts.driver_version.is_none());
    }
}
