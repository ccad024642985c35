//! The node's ResourceSlice (`resource.k8s.io/v1`): one pool named after
//! the node, one device per GPU DRA serves ([`slice`], pure), published by
//! server-side apply under the driver's field manager, owned by the Node,
//! its pool generation one past the stored one at every change, and any
//! other slice of this driver and node removed ([`publish`]).
//!
//! With consumable capacity a GPU takes several allocations
//! (`allowMultipleAllocations`), each consuming `memory` (in steps of
//! `memory_unit_mib`) and `cores` (in steps of one of `cores_per_gpu`).
//! Memory defaults to the whole GPU's, so a claim naming no capacity takes
//! it whole; cores default to none, so a claim naming memory alone is a
//! share with no compute limit that leaves the cores to the others, as a
//! pod asking `gpu-memory` alone is with the device plugin (the scheduler
//! applies a capacity's default to every request that does not name it).
//! An unhealthy GPU carries a `NoSchedule` taint.
//!
//! Beside the driver's own attributes a GPU carries Kubernetes' standard
//! ones (`resource.kubernetes.io/`: `numaNode`, `pciBusID`, `pcieRoot`),
//! which claims can match across drivers, e.g. a NIC under the same PCIe
//! root.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node as KubeNode;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};

use super::grant::{CORES, MEMORY, Node, device_name};
use crate::rules::device::Gpu;

pub(crate) use crate::rules::device::Facts;

/// The prefix of Kubernetes' standard device attributes
/// (k8s.io/dynamic-resource-allocation's `deviceattribute`).
const STANDARD: &str = "resource.kubernetes.io/";

/// How the slice publishes the GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) consumable: bool,
    pub(crate) memory_unit_mib: u64,
}

/// The slice's name: the node's and driver's, one per node.
pub(crate) fn slice_name(node: &str, driver: &str) -> String {
    format!("{node}-{driver}")
}

/// The taint an unhealthy GPU carries.
pub(crate) fn unhealthy_key(driver: &str) -> String {
    format!("{driver}/unhealthy")
}

fn mib(n: u64) -> Quantity {
    Quantity(format!("{n}Mi"))
}

fn string(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.to_owned()),
        ..Default::default()
    }
}

fn int(n: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(n),
        ..Default::default()
    }
}

/// The slice of `node`'s GPUs, `healthy[i]` for each, at `generation`.
pub(crate) fn slice(
    node: &Node,
    healthy: &[bool],
    facts: &Facts,
    shape: &Shape,
    generation: i64,
) -> ResourceSlice {
    let devices = node
        .gpus
        .iter()
        .enumerate()
        .map(|(i, gpu)| Device {
            name: device_name(gpu),
            attributes: Some(attributes(gpu, facts)),
            capacity: Some(capacity(gpu, node.cores_per_gpu, shape)),
            allow_multiple_allocations: shape.consumable.then_some(true),
            taints: (!healthy.get(i).copied().unwrap_or(true)).then(|| unhealthy(&node.driver)),
            ..Default::default()
        })
        .collect();
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(&node.pool, &node.driver)),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: node.driver.clone(),
            node_name: Some(node.pool.clone()),
            pool: ResourcePool {
                name: node.pool.clone(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

/// What a claim's selectors can read of a GPU: its identity, its NUMA
/// node and place on PCI, and the product and driver the node reports.
/// A fact the node does not know leaves its attribute out: a NUMA-less
/// GPU publishing -1 would match every other such device.
fn attributes(gpu: &Gpu, facts: &Facts) -> BTreeMap<String, DeviceAttribute> {
    let mut attributes = BTreeMap::from([
        ("uuid".to_owned(), string(&gpu.uuid)),
        ("index".to_owned(), int(gpu.index.into())),
    ]);
    if let Some(numa) = gpu.numa_node {
        attributes.insert("numaNode".into(), int(numa.into()));
        attributes.insert(format!("{STANDARD}numaNode"), int(numa.into()));
    }
    if let Some(pci) = facts.pci.get(&gpu.uuid) {
        attributes.insert(format!("{STANDARD}pciBusID"), string(&pci.bus_id));
        if let Some(root) = &pci.pcie_root {
            attributes.insert(format!("{STANDARD}pcieRoot"), string(root));
        }
    }
    if let Some(p) = facts.products.get(&gpu.uuid) {
        attributes.insert("productName".into(), string(p));
    }
    // Strings: NVIDIA's driver versions ("580.159.04") are no semver.
    for (key, v) in [
        ("driverVersion", &facts.driver_version),
        ("cudaVersion", &facts.cuda_version),
    ] {
        if let Some(v) = v {
            attributes.insert(key.into(), string(v));
        }
    }
    attributes
}

/// A GPU's capacity: its memory alone, or with consumable capacity memory
/// and cores that each allocation consumes in steps (see the module doc
/// for the defaults).
fn capacity(gpu: &Gpu, cores_per_gpu: u32, shape: &Shape) -> BTreeMap<String, DeviceCapacity> {
    let memory = mib(gpu.memory_mib);
    if !shape.consumable {
        let whole = DeviceCapacity {
            request_policy: None,
            value: memory,
        };
        return BTreeMap::from([(MEMORY.to_owned(), whole)]);
    }
    let cores = Quantity(cores_per_gpu.to_string());
    let policy =
        |default: Quantity, min: Quantity, max: &Quantity, step: Quantity| CapacityRequestPolicy {
            default: Some(default),
            valid_range: Some(CapacityRequestPolicyRange {
                min,
                max: Some(max.clone()),
                step: Some(step),
            }),
            valid_values: None,
        };
    let unit = mib(shape.memory_unit_mib);
    let zero = || Quantity("0".into());
    BTreeMap::from([
        (
            MEMORY.to_owned(),
            DeviceCapacity {
                request_policy: Some(policy(memory.clone(), unit.clone(), &memory, unit)),
                value: memory,
            },
        ),
        (
            CORES.to_owned(),
            DeviceCapacity {
                request_policy: Some(policy(zero(), zero(), &cores, Quantity("1".into()))),
                value: cores,
            },
        ),
    ])
}

/// The taint that keeps new claims off an unhealthy GPU.
fn unhealthy(driver: &str) -> Vec<DeviceTaint> {
    vec![DeviceTaint {
        key: unhealthy_key(driver),
        value: None,
        effect: "NoSchedule".into(),
        time_added: None,
    }]
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum PublishError {
    #[error("cannot read Node {0}: {1}")]
    Node(String, kube::Error),
    #[error("cannot {0} ResourceSlices: {1}")]
    Slices(&'static str, kube::Error),
}

/// What [`publish`] left on the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Published {
    pub(crate) generation: i64,
    /// The API server kept `allowMultipleAllocations` (false: it dropped
    /// the field, the cluster has no consumable capacity).
    pub(crate) consumable: bool,
}

/// Publishes the slice of `node`'s GPUs, owned by the Node, its generation
/// one past the stored one, and removes this driver's other slices of the
/// node. Server-side apply under the driver's field manager: the daemon of
/// the node is the slice's only writer, and one call at a time publishes
/// (the DRA actor's), so no update is lost between the read and the apply.
pub(crate) async fn publish(
    client: &kube::Client,
    node: &Node,
    healthy: &[bool],
    facts: &Facts,
    shape: &Shape,
) -> Result<Published, PublishError> {
    let nodes: Api<KubeNode> = Api::all(client.clone());
    let owner = nodes
        .get(&node.pool)
        .await
        .map_err(|e| PublishError::Node(node.pool.clone(), e))?;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let name = slice_name(&node.pool, &node.driver);
    let stored = slices
        .get_opt(&name)
        .await
        .map_err(|e| PublishError::Slices("read", e))?;
    // Every publish is a change (start, reload, health): one past the
    // stored generation.
    let generation = stored.map_or(0, |s| s.spec.pool.generation + 1);
    let mut want = slice(node, healthy, facts, shape, generation);
    want.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: node.pool.clone(),
        uid: owner.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    }]);
    let mut body = serde_json::to_value(&want).expect("a slice serialises");
    body["apiVersion"] = "resource.k8s.io/v1".into();
    body["kind"] = "ResourceSlice".into();
    let params = PatchParams::apply(&node.driver).force();
    let result = slices
        .patch(&name, &params, &Patch::Apply(body))
        .await
        .map_err(|e| PublishError::Slices("apply", e))?;
    remove(&slices, node, Some(&name)).await?;
    let consumable = result
        .spec
        .devices
        .iter()
        .flatten()
        .all(|d| d.allow_multiple_allocations == Some(true));
    Ok(Published {
        generation: result.spec.pool.generation,
        consumable,
    })
}

/// Calls `gone` whenever this node's slice of the driver is found missing:
/// deleted, or absent when the watch (re)lists. The kubelet deletes a
/// node's slices when its DRA manager starts, in the background, so a
/// slice published while the kubelet (re)starts can vanish a moment
/// later; nothing else would publish it again until a change.
pub(crate) async fn watch_missing(client: kube::Client, node: Node, gone: impl Fn()) {
    use futures::StreamExt;
    use kube::runtime::watcher::{self, Event};
    let slices: Api<ResourceSlice> = Api::all(client);
    let name = slice_name(&node.pool, &node.driver);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher::watcher(slices, config).boxed();
    // Whether the current (re)list has shown the slice.
    let mut listed = false;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Delete(_)) => gone(),
            Ok(Event::Init) => listed = false,
            Ok(Event::InitApply(_)) => listed = true,
            Ok(Event::InitDone) if !listed => gone(),
            Ok(_) => {}
            // The watcher backs off and lists again by itself.
            Err(e) => tracing::warn!(error = %e, "cannot watch the ResourceSlice"),
        }
    }
}

/// Removes every slice of this driver and `node`: DRA is off on the node.
pub(crate) async fn withdraw(client: &kube::Client, node: &Node) -> Result<(), PublishError> {
    remove(&Api::all(client.clone()), node, None).await
}

/// Removes this driver's slices of `node` but the one named `keep`.
async fn remove(
    slices: &Api<ResourceSlice>,
    node: &Node,
    keep: Option<&str>,
) -> Result<(), PublishError> {
    let ours = ListParams::default().fields(&format!(
        "spec.nodeName={},spec.driver={}",
        node.pool, node.driver
    ));
    let listed = slices
        .list(&ours)
        .await
        .map_err(|e| PublishError::Slices("list", e))?;
    for s in listed {
        let name = s.metadata.name.unwrap_or_default();
        if Some(name.as_str()) == keep {
            continue;
        }
        tracing::info!(slice = %name, "removing a ResourceSlice");
        match slices.delete(&name, &DeleteParams::default()).await {
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(PublishError::Slices("delete", e)),
            Ok(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::dra::grant::tests::node;

    #[test]
    fn a_consumable_slice_shares_every_gpu_by_memory_and_cores() {
        let n = node();
        let facts = Facts {
            products: BTreeMap::from([("GPU-a".into(), "NVIDIA H100".into())]),
            driver_version: Some("580.159.04".into()),
            cuda_version: Some("13.0".into()),
            ..Default::default()
        };
        let shape = Shape {
            consumable: true,
            memory_unit_mib: 4,
        };
        let s = slice(&n, &[true, false], &facts, &shape, 7);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["metadata"]["name"], "node-a-gpu.doslab.io");
        assert_eq!(v["spec"]["nodeName"], "node-a");
        assert_eq!(
            v["spec"]["pool"],
            serde_json::json!({"name": "node-a", "generation": 7, "resourceSliceCount": 1})
        );
        let d0 = &v["spec"]["devices"][0];
        assert_eq!(d0["name"], "gpu-0");
        assert_eq!(d0["allowMultipleAllocations"], true);
        assert_eq!(
            d0["attributes"]["uuid"],
            serde_json::json!({"string": "GPU-a"})
        );
        assert_eq!(d0["attributes"]["index"], serde_json::json!({"int": 0}));
        assert_eq!(
            d0["attributes"]["productName"],
            serde_json::json!({"string": "NVIDIA H100"})
        );
        assert_eq!(
            d0["attributes"]["driverVersion"],
            serde_json::json!({"string": "580.159.04"})
        );
        assert_eq!(
            d0["capacity"]["memory"],
            serde_json::json!({
                "value": "16384Mi",
                "requestPolicy": {"default": "16384Mi",
                    "validRange": {"min": "4Mi", "max": "16384Mi", "step": "4Mi"}}
            })
        );
        assert_eq!(
            d0["capacity"]["cores"],
            serde_json::json!({
                "value": "100",
                "requestPolicy": {"default": "0",
                    "validRange": {"min": "0", "max": "100", "step": "1"}}
            })
        );
        assert!(d0.get("taints").is_none());
        // The unhealthy GPU is tainted, and only it.
        let d1 = &v["spec"]["devices"][1];
        assert_eq!(
            d1["taints"],
            serde_json::json!([{"key": "gpu.doslab.io/unhealthy", "effect": "NoSchedule"}])
        );
        assert!(d1["attributes"].get("productName").is_none());
    }

    #[test]
    fn gpus_carry_kubernetes_standard_attributes_beside_the_drivers_own() {
        use crate::rules::device::Pci;
        let mut n = node();
        n.gpus[0].numa_node = Some(1);
        let facts = Facts {
            pci: BTreeMap::from([
                (
                    "GPU-a".into(),
                    Pci {
                        bus_id: "0000:3b:00.0".into(),
                        pcie_root: Some("pci0000:3a".into()),
                    },
                ),
                (
                    "GPU-b".into(),
                    Pci {
                        bus_id: "0000:86:00.0".into(),
                        pcie_root: None,
                    },
                ),
            ]),
            ..Default::default()
        };
        let shape = Shape {
            consumable: true,
            memory_unit_mib: 1,
        };
        let v = serde_json::to_value(slice(&n, &[true, true], &facts, &shape, 0)).unwrap();
        let a0 = &v["spec"]["devices"][0]["attributes"];
        for key in ["numaNode", "resource.kubernetes.io/numaNode"] {
            assert_eq!(a0[key], serde_json::json!({"int": 1}), "{key}");
        }
        assert_eq!(
            a0["resource.kubernetes.io/pciBusID"],
            serde_json::json!({"string": "0000:3b:00.0"})
        );
        assert_eq!(
            a0["resource.kubernetes.io/pcieRoot"],
            serde_json::json!({"string": "pci0000:3a"})
        );
        // GPU-b: no NUMA node and no root known, so neither attribute,
        // standard or not, rather than a value matching every such device.
        let a1 = v["spec"]["devices"][1]["attributes"].as_object().unwrap();
        let keys: Vec<&str> = a1.keys().map(String::as_str).collect();
        assert_eq!(keys, ["index", "resource.kubernetes.io/pciBusID", "uuid"]);
    }

    #[test]
    fn without_consumable_capacity_gpus_are_whole() {
        let shape = Shape {
            consumable: false,
            memory_unit_mib: 1,
        };
        let s = slice(&node(), &[true, true], &Facts::default(), &shape, 0);
        let v = serde_json::to_value(&s).unwrap();
        let d = &v["spec"]["devices"][1];
        assert!(d.get("allowMultipleAllocations").is_none());
        assert_eq!(
            d["capacity"],
            serde_json::json!({"memory": {"value": "16384Mi"}})
        );
    }
}
