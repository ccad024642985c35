//! Each GPU's usage for `/metrics`, recomputed from the pod cache whenever
//! it changes: the same usage model matching decides on, and no API call,
//! however often Prometheus scrapes. Also the cache's size, and readiness
//! while the cache's watch cannot reach the API server (an Allocate then
//! cannot write its pod's ledger, so it cannot succeed).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use tokio::task::JoinHandle;

use super::actor::{MatcherArgs, READY_NAME};
use super::cache::PodCache;
use super::matching::usage;
use super::pods::PodView;
use crate::metrics::{GpuMode, GpuSample, Hold};
use crate::usage::{Inventory, NodeUsage};

/// How often, while the watch fails, one small LIST checks whether the
/// API server answers again: a watch that resumes sends nothing until a pod
/// changes, so its silence cannot tell that it recovered.
const PROBE: Duration = Duration::from_secs(2);

/// Publishes the usage and the pod count after every change of `cache`,
/// and holds readiness back while its watch fails (until the watch or a
/// probe through `client` gets an answer), until the cache stops.
pub(super) fn spawn(cache: &PodCache, client: &Client, args: &MatcherArgs) -> JoinHandle<()> {
    let (pods, mut changes) = cache.reader();
    let mut failing = cache.failing();
    let (node, keys, metrics) = (args.node.clone(), args.keys.clone(), args.metrics.clone());
    let probe = ListParams::default()
        .fields(&format!("spec.nodeName={}", args.node_name))
        .limit(1);
    let api: Api<Pod> = Api::all(client.clone());
    tokio::spawn(async move {
        let mut unreachable = false;
        loop {
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let views: Vec<PodView> = pods
                        .state()
                        .iter()
                        .map(|p| PodView::from_pod(&keys, p).0)
                        .collect();
                    metrics.set_pod_cache(views.len());
                    metrics.set_gpus(samples(&node, &usage(&node, &views)));
                }
                changed = failing.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let why = failing.borrow_and_update().as_ref().map(|e| {
                        format!("cannot watch pods through the API server: {e}")
                    });
                    unreachable = why.is_some();
                    metrics.hold(READY_NAME, Hold::Unreachable, why);
                }
                () = tokio::time::sleep(PROBE), if unreachable => {
                    metrics.count_api_request("list");
                    if api.list(&probe).await.is_ok() {
                        unreachable = false;
                        metrics.hold(READY_NAME, Hold::Unreachable, None);
                    }
                }
            }
        }
    })
}

fn samples(inv: &Inventory, usage: &NodeUsage) -> Vec<GpuSample> {
    inv.gpus
        .iter()
        .zip(&usage.gpus)
        .map(|(info, u)| GpuSample {
            uuid: info.uuid.clone(),
            memory_granted_mib: u.used.memory,
            core_granted_percent: u.used.core,
            containers: u.used.count + u.sharers,
            mode: if u.held_whole() {
                GpuMode::Whole
            } else if u.carries_shared() {
                GpuMode::Shared
            } else {
                GpuMode::Free
            },
        })
        .collect()
}
