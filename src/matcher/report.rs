//! Each GPU's usage for `/metrics`, recomputed from the pod cache whenever
//! it changes: the same usage model matching decides on, and no API call,
//! however often Prometheus scrapes. The same pass keeps the cache-size
//! gauge current and logs, once per pod while it lasts, each annotation
//! that cannot be read (a garbled ledger or assignment is counted failing
//! closed, and an operator needs to hear of it).

use std::collections::HashSet;

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
        // (pod UID, warning) already logged.
        let mut named: HashSet<(String, String)> = HashSet::new();
        while changes.changed().await.is_ok() {
            let state = pods.state();
            metrics.set_pod_cache(state.len());
            let mut seen = HashSet::new();
            let views: Vec<PodView> = state
                .iter()
                .map(|p| {
                    let (view, warnings) = PodView::from_pod(&keys, p);
                    for w in warnings {
                        let key = (view.uid.clone(), w.to_string());
                        if !named.contains(&key) {
                            tracing::warn!(pod = %view.key, warning = %w, "pod annotation");
                        }
                        seen.insert(key);
                    }
                    view
                })
                .collect();
            named = seen;
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
