//! Each GPU's usage for `/metrics`, recomputed from the pod cache whenever
//! it changes: the same usage model matching decides on, and no API call,
//! however often Prometheus scrapes. Also the cache's size, and readiness
//! while the cache is stale (its watch failed and the list after it has
//! not arrived: the API server is away, or the cache may miss pods bound
//! since, so an Allocate waits and may fail). From the same
//! usage, the devices the kubelet could not admit work to anyway
//! ([`withdrawn`]), which the plugins list as unhealthy so node allocatable
//! tells the truth about whole GPUs. The same pass logs, once per pod while
//! it lasts, each annotation that cannot be read (a garbled ledger or
//! assignment is counted failing closed, and an operator needs to hear of
//! it).

use std::collections::HashSet;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::actor::MatcherArgs;
use super::cache::PodCache;
use crate::node::metrics::{ContainerGrant, ContainerLabels, GpuMode, GpuSample};
use crate::node::readiness::{Child, Hold};
use crate::rules::device::{PerResource, Resource};
use crate::rules::matching::pods::PodView;
use crate::rules::matching::{granted, usage};
use crate::rules::usage::{Inventory, NodeUsage};

/// Per resource, per GPU of the node: whether its devices are withdrawn
/// from the kubelet's lists. Empty lists: nothing withdrawn.
pub type Withdrawn = PerResource<Arc<[bool]>>;

/// Publishes the usage, the pod count and (when `args.withdrawals` is set)
/// the withdrawn devices after every change of `cache`, and holds
/// readiness back while it is stale, until the cache stops.
pub(super) fn spawn(cache: &PodCache, args: &MatcherArgs) -> JoinHandle<()> {
    let (pods, mut changes) = cache.reader();
    let mut stale = cache.stale();
    let (node, keys, metrics) = (args.node.clone(), args.keys.clone(), args.metrics.clone());
    let readiness = args.readiness.clone();
    let withdrawals = args.withdrawals.clone();
    tokio::spawn(async move {
        // (pod UID, warning) already logged.
        let mut named: HashSet<(String, String)> = HashSet::new();
        loop {
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return;
                    }
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
                    let usage = usage(&node, &views);
                    metrics.set_gpus(samples(&node, &usage));
                    metrics.set_grants(grants(&node, &views));
                    if let Some(tx) = &withdrawals {
                        publish(tx, withdrawn(&node, &views));
                    }
                }
                changed = stale.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let why = stale.borrow_and_update().as_ref().map(|e| {
                        format!("pod cache stale, listing again through the API server: {e}")
                    });
                    readiness.hold(Child::Matcher, Hold::Stale, why);
                }
            }
        }
    })
}

/// Sends `w` only when it differs: each change is a new device list for
/// the kubelet.
pub(crate) fn publish(tx: &watch::Sender<Withdrawn>, w: Withdrawn) {
    tx.send_if_modified(|old| {
        let changed = *old != w;
        if changed {
            *old = w;
        }
        changed
    });
}

/// The devices the kubelet could not admit work to under the usage of
/// `views`: the gpu-count device of a GPU carrying shared work, and the
/// gpu-memory and gpu-core devices of a GPU held whole (whole and shared
/// work never mix, so listing them only overstates node allocatable).
/// Never the devices a whole container on that GPU still waits for: a
/// container asking whole GPUs and a share of them
/// (`ContainerAsk::rides_whole`) gets its share's devices on its own GPUs,
/// and the kubelet may serve its resources in any order, so they stay
/// listed until every such container is fully served. Nor those of a pod
/// being deleted: the extender places the next pod on its GPUs once it is
/// gone, and this node's watch may trail the extender's (a slow API
/// server), so withdrawn until this node sees it gone they would turn the
/// kubelet away from the very GPUs the extender assigned (found by the
/// chaos test).
pub fn withdrawn(inv: &Inventory, views: &[PodView]) -> Withdrawn {
    let staying = || views.iter().filter(|p| !p.deleting);
    let usage = usage(inv, staying());
    let mut waits = PerResource::from_fn(|_| vec![false; inv.gpus.len()]);
    for p in staying().filter(|p| p.admitting) {
        for c in p.containers.iter().filter(|c| c.whole()) {
            let grant = p.ledger.0.get(&c.name);
            // Its GPUs once one resource is served, else the extender's;
            // unknown yet, it holds no GPU whose devices could be withdrawn.
            let gpus = grant
                .map(|g| &g.gpus)
                .filter(|g| !g.is_empty())
                .or_else(|| p.assignment.0.get(&c.name));
            for r in Resource::ALL {
                if c.wants(r) == 0 || grant.and_then(|g| g.amount(r)).is_some() {
                    continue;
                }
                for g in gpus.into_iter().flatten().filter_map(|u| inv.index(u)) {
                    waits[r][g] = true;
                }
            }
        }
    }
    PerResource::from_fn(|r| {
        usage
            .gpus
            .iter()
            .zip(&waits[r])
            .map(|(u, &waits)| {
                let exclusive = match r {
                    Resource::GpuCount => u.carries_shared(),
                    Resource::GpuMemory | Resource::GpuCore => u.held_whole(),
                };
                exclusive && !waits
            })
            .collect()
    })
}

/// Each live container's grant per GPU ([`granted`]), labelled for
/// `/metrics`.
fn grants(inv: &Inventory, views: &[PodView]) -> Vec<ContainerGrant> {
    granted(inv, views)
        .into_iter()
        .map(|g| ContainerGrant {
            at: ContainerLabels::new(&g.pod, &g.container, &g.gpu),
            memory_mib: g.memory_mib,
            core_percent: g.core_percent,
        })
        .collect()
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::rules::matching::pods::{Arrival, PodKey};
    use crate::rules::matching::tests::gpus_of_1000_mib;
    use crate::rules::usage::{Assignment, ContainerAsk, Ledger};

    pub(in crate::node::matcher) fn container(
        name: &str,
        devices: PerResource<u64>,
    ) -> ContainerAsk {
        ContainerAsk {
            name: name.into(),
            init: false,
            restartable: false,
            devices,
            invalid: None,
        }
    }

    pub(in crate::node::matcher) fn view(
        name: &str,
        live: bool,
        containers: Vec<ContainerAsk>,
        ledger: &str,
    ) -> PodView {
        PodView {
            key: PodKey {
                namespace: "ns".into(),
                name: name.into(),
            },
            uid: format!("uid-{name}"),
            admitting: false,
            live,
            deleting: false,
            assume_time: None,
            arrival: Arrival::default(),
            created: 0,
            gpu_uuid: None,
            assignment: Assignment::default(),
            containers,
            ledger: Ledger::parse(Some(ledger)).unwrap(),
            resource_version: "1".into(),
        }
    }

    /// A share's grant is what its ledger records, never more than its
    /// spec asks; a whole GPU is all of it; a finished pod, a container
    /// the spec lacks and a GPU the node lacks give nothing.
    /// A container's asks: 300 MiB and 20 % of one GPU.
    pub(in crate::node::matcher) const SHARE: PerResource<u64> = PerResource {
        memory: 300,
        core: 20,
        count: 0,
    };
    /// A container's asks: one GPU whole.
    pub(in crate::node::matcher) const WHOLE: PerResource<u64> = PerResource {
        memory: 0,
        core: 0,
        count: 1,
    };

    /// Pod `whole` holding GPU-b whole, and pod `done`, finished, that had
    /// a share of GPU-a.
    pub(in crate::node::matcher) fn whole_and_done() -> [PodView; 2] {
        [
            view(
                "whole",
                true,
                vec![container("train", WHOLE)],
                r#"{"train":{"gpus":["GPU-b"],"gpu-count":1}}"#,
            ),
            view(
                "done",
                false,
                vec![container("app", SHARE)],
                r#"{"app":{"gpus":["GPU-a"],"gpu-memory":300}}"#,
            ),
        ]
    }

    #[test]
    fn grants_are_the_ledgers_as_far_as_the_specs_vouch() {
        let inv = gpus_of_1000_mib(&["GPU-a", "GPU-b"]);
        let whole_and_done = whole_and_done();
        let share = SHARE;
        let views = [
            view(
                "shared",
                true,
                vec![container("app", share)],
                r#"{"app":{"gpus":["GPU-a"],"gpu-memory":300,"gpu-core":20},
                   "ghost":{"gpus":["GPU-b"],"gpu-memory":900}}"#,
            ),
            view(
                "greedy",
                true,
                vec![container("app", share)],
                r#"{"app":{"gpus":["GPU-a","GPU-x"],"gpu-memory":999999,"gpu-core":100}}"#,
            ),
            whole_and_done[0].clone(),
            whole_and_done[1].clone(),
        ];
        let got: Vec<(String, String, String, u64, u64)> = grants(&inv, &views)
            .into_iter()
            .map(|g| {
                (
                    g.at.pod,
                    g.at.container,
                    g.at.gpu,
                    g.memory_mib,
                    g.core_percent,
                )
            })
            .collect();
        let want = |pod: &str, c: &str, gpu: &str, m, p| {
            (pod.to_owned(), c.to_owned(), gpu.to_owned(), m, p)
        };
        assert_eq!(
            got,
            [
                want("shared", "app", "GPU-a", 300, 20),
                want("greedy", "app", "GPU-a", 300, 20),
                want("whole", "train", "GPU-b", 1000, 100),
            ]
        );
    }
}
