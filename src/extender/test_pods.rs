//! Pods and nodes as the API server stores them, for the extender's unit
//! tests: a pod asking devices per container, a node publishing its GPUs'
//! inventory as the node daemon does. (The integration tests build theirs
//! with the stand-ins in gpu-sim; a unit test that handed gpu-sim's pods to
//! this crate's functions could not: gpu-sim links a second copy of this
//! crate, whose types are not these. The few in-process tests that use
//! gpu-sim only share a socket or a kubeconfig file with it.)

use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{Value, json};

use crate::config::Config;
use crate::rules::device::{Gpu, Resource};
use crate::rules::usage::Inventory;
use crate::rules::usage::quantity::canonical;

/// One container of a test pod: its name, whether it is an init container,
/// and the devices it asks of gpu-memory, gpu-core and gpu-count.
pub(super) struct Wants<'a> {
    pub(super) name: &'a str,
    pub(super) init: bool,
    pub(super) devices: [u64; 3],
}

/// An app container asking `devices` (gpu-memory, gpu-core, gpu-count).
pub(super) fn app(name: &str, devices: [u64; 3]) -> Wants<'_> {
    Wants {
        name,
        init: false,
        devices,
    }
}

impl Wants<'_> {
    /// Its entry in `containers` or `initContainers`: `doslab.io/…` limits
    /// in canonical form (`8000` is stored as `8k`), requests the same.
    fn spec(&self) -> Value {
        let limits: serde_json::Map<String, Value> = Resource::ALL
            .iter()
            .zip(self.devices)
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| {
                let q = canonical(&n.to_string()).expect("a device count is a quantity");
                (format!("doslab.io/{}", r.name()), q.into())
            })
            .collect();
        json!({"name": self.name, "resources": {"limits": limits.clone(), "requests": limits}})
    }
}

/// An unscheduled Pending pod of `containers`.
pub(super) fn gpu_pod(namespace: &str, name: &str, containers: &[Wants<'_>]) -> Pod {
    let spec = |init: bool| -> Vec<Value> {
        containers
            .iter()
            .filter(|c| c.init == init)
            .map(Wants::spec)
            .collect()
    };
    serde_json::from_value(json!({
        "metadata": { "name": name, "namespace": namespace, "uid": format!("uid-{namespace}-{name}") },
        "spec": { "initContainers": spec(true), "containers": spec(false) },
        "status": { "phase": "Pending" },
    }))
    .expect("a valid Pod")
}

/// A Node publishing `gpus` (UUID, MiB) in its `doslab.io/gpu-inventory`
/// as the node daemon on the default config would: 1 MiB per memory
/// device, 1 % per core device, every resource on.
pub(super) fn gpu_node(name: &str, gpus: &[(&str, u64)]) -> Node {
    let gpus: Vec<Gpu> = (0..)
        .zip(gpus)
        .map(|(index, &(uuid, memory_mib))| Gpu {
            uuid: uuid.into(),
            memory_mib,
            index,
            numa_node: None,
        })
        .collect();
    let inventory = Inventory::new(&gpus, &Config::default().offer());
    node_with(name, Some(&inventory.to_json()))
}

/// A Node with `inventory` as its `doslab.io/gpu-inventory` text, or none.
pub(super) fn node_with(name: &str, inventory: Option<&str>) -> Node {
    let annotations: serde_json::Map<String, Value> = inventory
        .map(|text| ("doslab.io/gpu-inventory".to_owned(), text.into()))
        .into_iter()
        .collect();
    serde_json::from_value(json!({
        "metadata": { "name": name, "annotations": annotations },
    }))
    .expect("a valid Node")
}
