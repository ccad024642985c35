//! The node's GPU inventory on its own Node object: the
//! `<domain>/gpu-inventory` annotation a scheduler extender places pods by.
//!
//! This module is pure: what the annotation says for a node's GPUs, config
//! and health, and the merge patch (if any) that makes a Node carry it.
//! `actor` does the I/O: it publishes at start, on health changes and on
//! reload, retrying with backoff while the API server is away, and never
//! holds anything else up.

mod actor;

pub(crate) use actor::{InventoryArgs, InventoryMsg, InventoryPublisher};

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::config::Config;
use crate::rules::device::{Gpu, Offer, Resource};
use crate::rules::usage::Inventory;

/// What the annotation says for `gpus` under `config`; `healthy[g]` is GPU
/// g's health, and a GPU without an entry counts as healthy (the health
/// monitor has not reported yet). The resources follow `Resource::ALL`, so
/// reordering the config's list changes nothing on the Node.
fn inventory(config: &Config, gpus: &[Gpu], healthy: &[bool]) -> Inventory {
    let offer = Offer {
        resources: Resource::ALL
            .into_iter()
            .filter(|r| config.resources.contains(r))
            .collect(),
        units: config.units(),
    };
    let mut inventory = Inventory::new(gpus, &offer);
    for (g, gpu) in inventory.gpus.iter_mut().enumerate() {
        gpu.healthy = healthy.get(g) != Some(&false);
    }
    inventory
}

/// What the node daemon wants its Node to carry: the annotation's key
/// (`<domain>/gpu-inventory`) and the inventory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Published {
    pub(crate) key: String,
    pub(crate) inventory: Inventory,
}

impl Published {
    pub(crate) fn of(config: &Config, gpus: &[Gpu], healthy: &[bool]) -> Published {
        Published {
            key: format!("{}/gpu-inventory", config.resource_domain),
            inventory: inventory(config, gpus, healthy),
        }
    }
}

/// The JSON merge patch of the Node's annotations that makes them carry
/// `wanted` and no longer carry the `stale` keys (an inventory published
/// under a domain since changed); `None` when they already do. The
/// comparison is by meaning, not by text: another writer's key order or
/// spacing is no reason to patch.
pub(crate) fn patch(
    annotations: &BTreeMap<String, String>,
    wanted: &Published,
    stale: &[String],
) -> Option<Value> {
    let current = annotations
        .get(&wanted.key)
        .and_then(|text| serde_json::from_str::<Value>(text).ok());
    let want = serde_json::to_value(&wanted.inventory).expect("an inventory always serialises");
    let mut changes = serde_json::Map::new();
    if current.as_ref() != Some(&want) {
        changes.insert(wanted.key.clone(), wanted.inventory.to_json().into());
    }
    for key in stale {
        if *key != wanted.key && annotations.contains_key(key) {
            changes.insert(key.clone(), Value::Null);
        }
    }
    (!changes.is_empty()).then(|| json!({ "metadata": { "annotations": changes } }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus() -> Vec<Gpu> {
        vec![
            Gpu {
                uuid: "GPU-a".into(),
                memory_mib: 81920,
                index: 0,
                numa_node: Some(0),
            },
            Gpu {
                uuid: "GPU-b".into(),
                memory_mib: 40960,
                index: 1,
                numa_node: None,
            },
        ]
    }

    fn config() -> Config {
        Config {
            memory_unit_mib: 256,
            cores_per_gpu: 50,
            resources: vec![Resource::GpuCount, Resource::GpuMemory],
            ..Config::default()
        }
    }

    #[test]
    fn renders_the_contract_format() {
        let p = Published::of(&config(), &gpus(), &[true, false]);
        assert_eq!(p.key, "doslab.io/gpu-inventory");
        let v: Value = serde_json::from_str(&p.inventory.to_json()).unwrap();
        assert_eq!(
            v,
            json!({
                "version": 1, "memoryUnitMiB": 256, "coresPerGpu": 50,
                "resources": ["gpu-memory", "gpu-count"],
                "gpus": [
                    {"uuid": "GPU-a", "memoryMiB": 81920, "healthy": true, "numaNode": 0},
                    {"uuid": "GPU-b", "memoryMiB": 40960, "healthy": false},
                ],
            })
        );
    }

    #[test]
    fn a_gpu_without_a_health_report_counts_as_healthy() {
        let inv = inventory(&config(), &gpus(), &[]);
        assert!(inv.gpus.iter().all(|g| g.healthy));
    }

    #[test]
    fn patches_only_what_differs_by_meaning() {
        let wanted = Published::of(&config(), &gpus(), &[true, true]);
        let patch_of = |annotations: &[(&str, &str)], stale: &[String]| {
            let map = annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            patch(&map, &wanted, stale)
        };
        let expected = json!({"metadata": {"annotations": {
            "doslab.io/gpu-inventory": wanted.inventory.to_json()
        }}});
        assert_eq!(patch_of(&[], &[]), Some(expected.clone()));
        assert_eq!(
            patch_of(&[("doslab.io/gpu-inventory", "not json")], &[]),
            Some(expected.clone())
        );
        let unhealthy = Published::of(&config(), &gpus(), &[true, false]);
        assert_eq!(
            patch_of(
                &[("doslab.io/gpu-inventory", &unhealthy.inventory.to_json())],
                &[]
            ),
            Some(expected)
        );
        // The same inventory, re-spaced and re-ordered by someone else.
        let mut v: Value = serde_json::to_value(&wanted.inventory).unwrap();
        v.as_object_mut().unwrap().remove("version");
        v["version"] = 1.into();
        let respaced = serde_json::to_string_pretty(&v).unwrap();
        assert_eq!(
            patch_of(
                &[("doslab.io/gpu-inventory", &respaced), ("other", "x")],
                &[]
            ),
            None
        );
        // A domain that changed: the old key goes, the new one stays.
        let same = wanted.inventory.to_json();
        assert_eq!(
            patch_of(
                &[
                    ("doslab.io/gpu-inventory", &same),
                    ("old.io/gpu-inventory", "{}")
                ],
                &[
                    "old.io/gpu-inventory".into(),
                    "gone.io/gpu-inventory".into()
                ]
            ),
            Some(json!({"metadata": {"annotations": {"old.io/gpu-inventory": null}}}))
        );
    }
}
