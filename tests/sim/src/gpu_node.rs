//! One GPU node of a simulated cluster, for the placement demo and tests:
//! its mock GPUs, the Node object its kubelet would report to the API
//! server, and the device lists its daemon should give that kubelet.

use std::collections::BTreeMap;

use crate::apiserver::ApiServerSim;
use crate::kubelet::ResourceView;
use gpu_device_plugin::rules::device::Resource;

/// Pods a kubelet admits by default (the Node's `pods` allocatable).
const MAX_PODS: u64 = 110;

#[derive(Debug, Clone)]
pub struct GpuNode {
    pub name: String,
    /// (UUID, MiB), in index order.
    pub gpus: Vec<(String, u64)>,
}

impl GpuNode {
    /// Node `name` with GPUs of `sizes_gib`; `n` (unique in the cluster)
    /// makes the UUIDs unique.
    pub fn new(n: usize, name: &str, sizes_gib: &[u64]) -> GpuNode {
        let gpus = sizes_gib
            .iter()
            .enumerate()
            .map(|(g, gib)| {
                (
                    format!("GPU-{n:04x}{g:04x}-0000-4000-8000-000000000000"),
                    gib * 1024,
                )
            })
            .collect();
        GpuNode {
            name: name.to_owned(),
            gpus,
        }
    }

    /// What its daemon lists per resource, at `unit_mib` MiB per
    /// gpu-memory device and 100 gpu-core devices per GPU.
    pub(crate) fn devices(&self, unit_mib: u64) -> [(String, u64); 3] {
        let count = self.gpus.len() as u64;
        let memory = self.gpus.iter().map(|(_, mib)| mib / unit_mib).sum();
        Resource::ALL.map(|r| {
            let n = match r {
                Resource::GpuMemory => memory,
                Resource::GpuCore => 100 * count,
                Resource::GpuCount => count,
            };
            (format!("doslab.io/{}", r.name()), n)
        })
    }

    /// Creates its Node object with the allocatable its kubelet reports.
    pub fn add_to(&self, api: &ApiServerSim, unit_mib: u64) {
        let devices = self.devices(unit_mib);
        let mut resources: Vec<(&str, u64)> =
            devices.iter().map(|(r, n)| (r.as_str(), *n)).collect();
        resources.push(("pods", MAX_PODS));
        api.add_node(&self.name, &resources, &[]);
    }

    /// True when `kubelet` (the node's stand-in's view) has every resource
    /// streaming with all of [`GpuNode::devices`] healthy.
    pub fn listed(&self, unit_mib: u64, kubelet: &BTreeMap<String, ResourceView>) -> bool {
        self.devices(unit_mib).iter().all(|(r, n)| {
            kubelet
                .get(r)
                .is_some_and(|v| v.stream_open && v.devices as u64 == *n && v.healthy as u64 == *n)
        })
    }

    /// True once its daemon published the GPU inventory on the Node, which
    /// the extender needs before it places anything there.
    pub fn inventory_published(&self, api: &ApiServerSim) -> bool {
        api.node(&self.name)
            .is_some_and(|n| n["metadata"]["annotations"]["doslab.io/gpu-inventory"].is_string())
    }
}
