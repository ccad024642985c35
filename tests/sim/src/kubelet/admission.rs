//! Pod admission as the kubelet does it for the pods bound to its node:
//! pods are taken as they arrive, those arriving together in creation order
//! (HandlePodAdditions sorts them so), one pod at a time; per pod the init
//! containers first, each container's resources one after another (per
//! resource GetPreferredAllocation, then Allocate), and the devices of the
//! init containers reused by the containers after them, as the device
//! manager's `devicesToReuse` does (a sidecar, an init container with
//! `restartPolicy: Always`, takes from them first like an app container
//! and keeps what it took). A refused pod ends `Failed` (the
//! kubelet's UnexpectedAdmissionError) and its devices go back; the devices
//! of a pod deleted or finished go back when the kubelet next looks.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;

use super::{AllocatedResource, KubeletSim, SimState};
use crate::apiserver::{ApiServerSim, PodContainer, admission_order};
use gpu_device_plugin::rules::device::Resource;
use gpu_device_plugin::rules::usage::quantity::parse_count;

/// One pod the kubelet admitted or refused.
#[derive(Debug)]
pub struct Admission {
    pub(crate) namespace: String,
    pub name: String,
    /// Each container's grants, or why the pod was refused.
    pub result: Result<BTreeMap<String, Vec<AllocatedResource>>, String>,
}

/// A pod's containers with their `doslab.io/…` limits, as the API server
/// stores the pod.
pub fn pod_containers(pod: &Value) -> Vec<PodContainer> {
    let spec = &pod["spec"];
    [("initContainers", true), ("containers", false)]
        .into_iter()
        .flat_map(|(list, init)| {
            spec[list]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |c| PodContainer {
                    name: c["name"].as_str().unwrap_or_default().to_owned(),
                    init,
                    restartable: init && c["restartPolicy"] == "Always",
                    wants: Resource::ALL.map(|r| {
                        let limit = &c["resources"]["limits"][format!("doslab.io/{}", r.name())];
                        limit
                            .as_str()
                            .and_then(|s| parse_count(s, u64::MAX).ok())
                            .or_else(|| limit.as_u64())
                            .unwrap_or(0)
                    }),
                })
        })
        .collect()
}

fn text<'a>(pod: &'a Value, path: &[&str]) -> &'a str {
    path.iter()
        .fold(pod, |v, k| &v[*k])
        .as_str()
        .unwrap_or_default()
}

fn finished(pod: &Value) -> bool {
    matches!(text(pod, &["status", "phase"]), "Succeeded" | "Failed")
}

/// Every device ID of `grants`, per resource.
fn devices<'a>(
    grants: impl IntoIterator<Item = &'a AllocatedResource>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for g in grants {
        out.entry(g.resource.clone())
            .or_default()
            .extend(g.device_ids.iter().cloned());
    }
    out
}

/// Gives `held` (IDs by resource) back to the free devices.
pub(super) fn release(s: &mut SimState, held: &BTreeMap<String, BTreeSet<String>>) {
    for (resource, ids) in held {
        if let Some(used) = s.allocated.get_mut(resource) {
            used.retain(|id| !ids.contains(id));
        }
    }
}

impl KubeletSim {
    /// Admits the pods `api` has bound to `node` since the last call, and
    /// frees the devices of admitted pods that are gone or finished. Marks
    /// each pod `Running` or `Failed`.
    pub async fn admit_bound(&self, api: &ApiServerSim, node: &str) -> Vec<Admission> {
        let pods = api.pods();
        let live: BTreeSet<&str> = pods
            .iter()
            .filter(|p| !finished(p))
            .map(|p| text(p, &["metadata", "uid"]))
            .collect();
        self.shared.update(|s| {
            let gone: Vec<String> = s
                .pods
                .keys()
                .filter(|uid| !live.contains(uid.as_str()))
                .cloned()
                .collect();
            for uid in gone {
                if let Some(held) = s.pods.remove(&uid) {
                    release(s, &held);
                }
            }
        });
        let mut arrived: Vec<&Value> = {
            let state = self.shared.state.lock().expect("kubelet sim lock poisoned");
            pods.iter()
                .filter(|p| text(p, &["spec", "nodeName"]) == node)
                .filter(|p| text(p, &["status", "phase"]) == "Pending")
                .filter(|p| !state.pods.contains_key(text(p, &["metadata", "uid"])))
                .collect()
        };
        arrived.sort_by_key(|p| {
            (
                text(p, &["metadata", "creationTimestamp"]),
                text(p, &["metadata", "namespace"]),
                text(p, &["metadata", "name"]),
            )
        });
        let mut out = Vec::with_capacity(arrived.len());
        for pod in arrived {
            let (namespace, name) = (
                text(pod, &["metadata", "namespace"]),
                text(pod, &["metadata", "name"]),
            );
            let uid = text(pod, &["metadata", "uid"]).to_owned();
            let result = self.admit_pod(&pod_containers(pod)).await;
            let held = result.as_ref().map(|g| devices(g.values().flatten()));
            self.shared.update(|s| {
                s.pods.insert(uid, held.clone().unwrap_or_default());
            });
            let phase = if result.is_ok() { "Running" } else { "Failed" };
            api.set_phase(namespace, name, phase);
            out.push(Admission {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                result,
            });
        }
        out
    }

    /// Admits one pod's containers in the kubelet's order, reusing the init
    /// containers' devices; on a refusal every device of the pod goes back.
    pub(crate) async fn admit_pod(
        &self,
        containers: &[PodContainer],
    ) -> Result<BTreeMap<String, Vec<AllocatedResource>>, String> {
        let mut reusable: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut out: BTreeMap<String, Vec<AllocatedResource>> = BTreeMap::new();
        for c in admission_order(containers) {
            let pool: Vec<AllocatedResource> = reusable
                .iter()
                .map(|(resource, ids)| AllocatedResource {
                    resource: resource.clone(),
                    device_ids: ids.iter().cloned().collect(),
                    response: Default::default(),
                    allocate_took: Duration::ZERO,
                })
                .collect();
            let grants = match self.admit_reusing(&self.arrange(c.asks()), &pool).await {
                Ok(g) => g,
                Err(e) => {
                    let held = devices(out.values().flatten());
                    self.shared.update(|s| release(s, &held));
                    return Err(format!("container {}: {e}", c.name));
                }
            };
            for (resource, ids) in devices(&grants) {
                let pool = reusable.entry(resource).or_default();
                // Init containers add to what the next may reuse; an app
                // container or a sidecar keeps what it took for itself.
                if c.hands_on() {
                    pool.extend(ids);
                } else {
                    pool.retain(|id| !ids.contains(id));
                }
            }
            out.insert(c.name.clone(), grants);
        }
        Ok(out)
    }
}
