//! DRA's shares as the usage monitor sees them: the claims prepared on this
//! node (its checkpoint, read on the usage probe's thread), each read from
//! the API server with the pods it is reserved for (when first prepared,
//! then every minute, or sooner for a container not known), so that a process
//! found in a pod's container is named by the claim whose GPU it runs on,
//! and each claim's grant is exported beside what its containers use.
//!
//! A claim's grant is the claim's, shared by every container that names
//! it, so its series carry no container; a claim reserved for several pods
//! shows under each. A share caps nothing it does not name: no memory
//! limit is all of the GPU's memory, no core limit all of its compute.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;

use super::checkpoint::{Checkpoint, CheckpointError};
use super::grant::{GrantError, Node, grant};
use crate::node::metrics::{ContainerGrant, ContainerLabels};
use crate::rules::matching::pods::{PodKey, runtime_ids};

/// How long one read of a claim or a pod may take.
const READ: Duration = Duration::from_secs(5);
/// How often a claim is read again all the same (pods reserve it and end),
/// and a claim that could not be read is tried again.
const REREAD: Duration = Duration::from_secs(60);
/// How soon a claim may be read again for a container of its pods not
/// known (one that started since).
const REREAD_STALE: Duration = Duration::from_secs(10);
/// Claims read at once.
const READS: usize = 8;

/// Why a claim's shares could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ShareReadError {
    #[error("the API server did not answer within {READ:?}")]
    Timeout,
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error(transparent)]
    Grant(#[from] GrantError),
}

impl ShareReadError {
    fn missing(&self) -> bool {
        matches!(self, ShareReadError::Api(kube::Error::Api(s)) if s.code == 404)
    }
}

/// A claim prepared here, as the checkpoint names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ClaimRef {
    pub(crate) uid: String,
    pub(crate) namespace: String,
    pub(crate) name: String,
}

/// The claims the checkpoint at `path` says are prepared (blocking).
pub(crate) fn prepared(path: &Path) -> Result<Vec<ClaimRef>, CheckpointError> {
    Ok(Checkpoint::load(path)?
        .claims
        .into_iter()
        .map(|(uid, p)| ClaimRef {
            uid,
            namespace: p.namespace,
            name: p.name,
        })
        .collect())
}

/// A container of a pod that names one or more claims prepared here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClaimContainer {
    pub(crate) pod: PodKey,
    pub(crate) uid: String,
    pub(crate) container: String,
    /// Its runtime ID, once the kubelet has reported one.
    pub(crate) id: Option<String>,
    /// The claims it names, each with the GPUs (UUIDs) it got.
    pub(crate) claims: Vec<(String, Vec<String>)>,
}

impl ClaimContainer {
    /// The labels of this container's processes on `gpu`: through the
    /// first of its claims that holds that GPU.
    pub(crate) fn labels(&self, gpu: &str) -> Option<ContainerLabels> {
        let (claim, _) = self
            .claims
            .iter()
            .find(|(_, gpus)| gpus.iter().any(|g| g == gpu))?;
        Some(ContainerLabels::new(&self.pod, &self.container, gpu).in_claim(claim))
    }
}

/// Containers of a pod that name a claim: each name and runtime ID.
type Naming = Vec<(String, Option<String>)>;

/// One claim read: its grant per GPU and the pods it is reserved for.
struct Known {
    read_at: Instant,
    name: String,
    /// Per GPU UUID: memory MiB and percent of compute.
    grants: BTreeMap<String, (u64, u64)>,
    /// Pod UID → the pod's name and its containers naming this claim.
    pods: BTreeMap<String, (PodKey, Naming)>,
}

/// What the usage monitor knows of DRA's claims, kept across polls: a
/// claim is read from the API server when it is first prepared, again as
/// [`ClaimBook::follow`] says, and forgotten when it is not prepared any
/// more.
pub(crate) struct ClaimBook {
    client: kube::Client,
    node: Node,
    known: HashMap<String, Known>,
    /// Claims that could not be read: when, and why (logged once each).
    failing: HashMap<String, (Instant, String)>,
}

impl ClaimBook {
    pub(crate) fn new(client: kube::Client, node: Node) -> ClaimBook {
        ClaimBook {
            client,
            node,
            known: HashMap::new(),
            failing: HashMap::new(),
        }
    }

    /// Follows `prepared`: reads the claims not read yet, those read
    /// [`REREAD`] ago, and those whose pods are in `stale` (pod UIDs with
    /// a process in a container not known) read [`REREAD_STALE`] ago; a
    /// claim that could not be read is tried again after [`REREAD`].
    pub(crate) async fn follow(&mut self, prepared: &[ClaimRef], stale: &HashSet<String>) {
        let now: HashSet<&str> = prepared.iter().map(|c| c.uid.as_str()).collect();
        self.known.retain(|uid, _| now.contains(uid.as_str()));
        self.failing.retain(|uid, _| now.contains(uid.as_str()));
        let due: Vec<&ClaimRef> = prepared
            .iter()
            .filter(|c| match self.known.get(&c.uid) {
                Some(k) => {
                    let age = k.read_at.elapsed();
                    age >= REREAD
                        || (age >= REREAD_STALE && k.pods.keys().any(|p| stale.contains(p)))
                }
                None => self
                    .failing
                    .get(&c.uid)
                    .is_none_or(|(at, _)| at.elapsed() >= REREAD),
            })
            .collect();
        // A few at a time: a slow API server holds a poll for the
        // batches, not for every claim in turn.
        let mut reads = Vec::with_capacity(due.len());
        for batch in due.chunks(READS) {
            let mut pending = Vec::with_capacity(batch.len());
            for c in batch {
                pending.push(self.read(c));
            }
            let done = futures::future::join_all(pending).await;
            reads.extend(batch.iter().copied().zip(done));
        }
        for (c, read) in reads {
            match read {
                Ok(k) => {
                    if self.failing.remove(&c.uid).is_some() {
                        tracing::info!(claim = %c.name, namespace = %c.namespace, "claim's usage named again");
                    }
                    self.known.insert(c.uid.clone(), k);
                }
                Err(e) => {
                    let why = e.to_string();
                    if self.failing.get(&c.uid).is_none_or(|(_, was)| *was != why) {
                        tracing::warn!(claim = %c.name, namespace = %c.namespace, error = %why, "cannot read the claim or its pods; its usage counts in its GPUs' totals only");
                    }
                    self.failing.insert(c.uid.clone(), (Instant::now(), why));
                }
            }
        }
    }

    /// Every container naming a claim known here.
    pub(crate) fn containers(&self) -> Vec<ClaimContainer> {
        let mut out: BTreeMap<(String, String), ClaimContainer> = BTreeMap::new();
        for k in self.known.values() {
            let gpus: Vec<String> = k.grants.keys().cloned().collect();
            for (uid, (pod, containers)) in &k.pods {
                for (container, id) in containers {
                    let c = out
                        .entry((uid.clone(), container.clone()))
                        .or_insert_with(|| ClaimContainer {
                            pod: pod.clone(),
                            uid: uid.clone(),
                            container: container.clone(),
                            id: id.clone(),
                            claims: Vec::new(),
                        });
                    c.claims.push((k.name.clone(), gpus.clone()));
                }
            }
        }
        let mut out: Vec<ClaimContainer> = out.into_values().collect();
        for c in &mut out {
            c.claims.sort();
        }
        out
    }

    /// Every known claim's grant per pod and GPU.
    pub(crate) fn grants(&self) -> Vec<ContainerGrant> {
        let mut out = Vec::new();
        for k in self.known.values() {
            for (pod, _) in k.pods.values() {
                for (gpu, &(memory_mib, core_percent)) in &k.grants {
                    out.push(ContainerGrant {
                        at: ContainerLabels::new(pod, "", gpu).in_claim(&k.name),
                        memory_mib,
                        core_percent,
                    });
                }
            }
        }
        out.sort_by(|a, b| a.at.cmp(&b.at));
        out
    }

    async fn read(&self, c: &ClaimRef) -> Result<Known, ShareReadError> {
        let read_at = Instant::now();
        let claims: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &c.namespace);
        let claim = timed(claims.get(&c.name)).await?;
        let grants = grant(&claim, &c.uid, &self.node)?;
        let mut per_gpu: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        for g in &grants {
            for &i in &g.gpus {
                let gpu = &self.node.gpus[i];
                let (memory, core) = per_gpu.entry(gpu.uuid.clone()).or_default();
                *memory += g.limits.memory_mib.unwrap_or(gpu.memory_mib);
                *core += g.limits.core_percent.unwrap_or(100);
            }
        }
        let reserved = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_deref())
            .unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &c.namespace);
        let mut known = BTreeMap::new();
        for r in reserved.iter().filter(|r| r.resource == "pods") {
            let pod = match timed(pods.get(&r.name)).await {
                Err(e) if e.missing() => continue,
                read => read?,
            };
            if pod.metadata.uid.as_deref() != Some(r.uid.as_str()) {
                continue;
            }
            let key = PodKey {
                namespace: c.namespace.clone(),
                name: r.name.clone(),
            };
            known.insert(r.uid.clone(), (key, naming(&pod, &c.name)));
        }
        Ok(Known {
            read_at,
            name: c.name.clone(),
            grants: per_gpu,
            pods: known,
        })
    }
}

/// A read within [`READ`].
async fn timed<T>(read: impl Future<Output = Result<T, kube::Error>>) -> Result<T, ShareReadError> {
    match tokio::time::timeout(READ, read).await {
        Err(_) => Err(ShareReadError::Timeout),
        Ok(read) => Ok(read?),
    }
}

/// The containers of `pod` that name ResourceClaim `claim` (directly, or
/// through the claim made from a template), each with its runtime ID.
fn naming(pod: &Pod, claim: &str) -> Naming {
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    let status = pod.status.as_ref();
    let generated = status
        .and_then(|s| s.resource_claim_statuses.as_deref())
        .unwrap_or_default();
    // The pod's own names for the claim.
    let names: HashSet<&str> = spec
        .resource_claims
        .iter()
        .flatten()
        .filter(|r| {
            r.resource_claim_name.as_deref() == Some(claim)
                || generated
                    .iter()
                    .any(|g| g.name == r.name && g.resource_claim_name.as_deref() == Some(claim))
        })
        .map(|r| r.name.as_str())
        .collect();
    let ids = runtime_ids(status);
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter(|c| {
            c.resources
                .as_ref()
                .and_then(|r| r.claims.as_ref())
                .is_some_and(|cs| cs.iter().any(|r| names.contains(r.name.as_str())))
        })
        .map(|c| {
            let id = ids.get(c.name.as_str()).map(|id| (*id).to_owned());
            (c.name.clone(), id)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn containers_naming_a_claim_directly_or_through_a_template_are_found_with_their_ids() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {
                "resourceClaims": [
                    {"name": "direct", "resourceClaimName": "shared"},
                    {"name": "mine", "resourceClaimTemplateName": "t"}
                ],
                "containers": [
                    {"name": "a", "resources": {"claims": [{"name": "mine"}]}},
                    {"name": "b", "resources": {"claims": [{"name": "direct"}]}},
                    {"name": "c"}
                ]
            },
            "status": {
                "resourceClaimStatuses": [{"name": "mine", "resourceClaimName": "p-mine-x"}],
                "containerStatuses": [
                    {"name": "a", "containerID": "containerd://abc", "image": "i", "imageID": "",
                     "ready": true, "restartCount": 0},
                    {"name": "c", "containerID": "containerd://ccc", "image": "i", "imageID": "",
                     "ready": true, "restartCount": 0}
                ]
            }
        }));
        assert_eq!(
            naming(&p, "p-mine-x"),
            vec![("a".into(), Some("abc".into()))]
        );
        assert_eq!(naming(&p, "shared"), vec![("b".into(), None)]);
        assert!(naming(&p, "other").is_empty());
    }

    #[test]
    fn a_process_is_named_by_the_claim_holding_its_gpu() {
        let c = ClaimContainer {
            pod: PodKey {
                namespace: "ns".into(),
                name: "p".into(),
            },
            uid: "u".into(),
            container: "a".into(),
            id: Some("abc".into()),
            claims: vec![
                ("one".into(), vec!["GPU-0".into()]),
                ("two".into(), vec!["GPU-1".into(), "GPU-2".into()]),
            ],
        };
        assert_eq!(c.labels("GPU-2").unwrap().claim, "two");
        assert_eq!(c.labels("GPU-0").unwrap().claim, "one");
        assert_eq!(c.labels("GPU-9"), None);
    }
}
