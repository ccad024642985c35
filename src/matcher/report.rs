//! Each GPU's usage for `/metrics`, recomputed from the pod cache whenever
//! it changes: the same usage model matching decides on, and no API call,
//! however often Prometheus scrapes.

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::Store;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::actor::MatcherArgs;
use super::matching::usage;
use super::pods::PodView;
use crate::metrics::{GpuMode, GpuSample};
use crate::usage::{Inventory, NodeUsage};

/// Publishes the usage after every change of `pods` until the cache stops.
pub(super) fn spawn(
    pods: Store<Pod>,
    mut changes: watch::Receiver<u64>,
    args: &MatcherArgs,
) -> JoinHandle<()> {
    let (node, keys, metrics) = (args.node.clone(), args.keys.clone(), args.metrics.clone());
    tokio::spawn(async move {
        while changes.changed().await.is_ok() {
            let views: Vec<PodView> = pods
                .state()
                .iter()
                .map(|p| PodView::from_pod(&keys, p).0)
                .collect();
            metrics.set_gpus(samples(&node, &usage(&node, &views)));
        }
    })
}

fn samples(inv: &Inventory, usage: &NodeUsage) -> Vec<GpuSample> {
    inv.gpus
        .iter()
        .zip(&usage.gpus)
        .enumerate()
        .map(|(g, (info, u))| {
            let capacity = inv.capacity(g);
            GpuSample {
                uuid: info.uuid.clone(),
                memory_capacity_mib: capacity.memory,
                memory_granted_mib: u.used.memory,
                core_capacity_percent: capacity.core,
                core_granted_percent: u.used.core,
                containers: u.used.count + u.sharers,
                mode: if u.held_whole() {
                    GpuMode::Whole
                } else if u.carries_shared() {
                    GpuMode::Shared
                } else {
                    GpuMode::Free
                },
            }
        })
        .collect()
}
