//! NodePrepareResources and NodeUnprepareResources, whichever API version
//! the kubelet speaks: every claim is read from the API server, checked
//! (allocated, the UID the kubelet named), granted ([`super::grant`]),
//! readied and composed by the grant pipeline a device-plugin Allocate
//! uses too ([`crate::node::grant`]), and written as one CDI spec; each claim is answered on its own,
//! an error for one never fails the others. What is prepared is kept in
//! the checkpoint, so a repeated call answers the same and a restarted
//! daemon unprepares what an earlier one prepared.
//!
//! Calls are taken one at a time (the checkpoint is one file); the claims
//! of one call are read from the API server concurrently.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;

use super::cdi::{self, CdiDir};
use super::checkpoint::{Checkpoint, CheckpointError, Prepared, PreparedDevice};
use super::grant::{GrantError, Node, RequestGrant, grant};
use super::proto::v1;
use crate::node::enforcement::{AllocateEnforcement, EnforcementError, Enforcer};
use crate::node::grant::{self, OwnedBy, ResponseComposer};

/// The most claims one call may name: a kubelet asks for one pod's claims.
pub(crate) const MAX_CLAIMS: usize = 1024;
/// How long reading one claim may take; the kubelet's own call allows 45 s.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Bounds on what the kubelet names a claim by (UIDs are 36 bytes, names
/// and namespaces DNS names).
const MAX_UID: usize = 128;
const MAX_NAME: usize = 253;

/// Why one claim was not prepared or unprepared: the text is the claim's
/// `error` in the kubelet's answer, the one place it is written
/// ([`answer_error`]).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClaimError {
    #[error("claim {uid:?}: {what}")]
    BadName { uid: String, what: String },
    #[error("{claim}: the API server did not answer within {} s", READ_TIMEOUT.as_secs())]
    ReadTimeout { claim: String },
    #[error("{claim} does not exist")]
    Missing { claim: String },
    #[error("{claim}: cannot read it: {source}")]
    Read { claim: String, source: kube::Error },
    #[error(transparent)]
    Grant(#[from] GrantError),
    /// Enforcement could not ready a share of the request.
    #[error("request {request}: {source}")]
    Readying {
        request: String,
        source: EnforcementError,
    },
    /// A share over several GPUs where MPS caps shares: a client process
    /// talks to one control daemon, which serves one GPU.
    #[error(
        "request {request}: a share of {count} GPUs cannot be capped by MPS (a client talks to \
         one GPU's control daemon); ask one GPU per request, or serve such claims with \
         `compute = \"hami-core\"`"
    )]
    MpsSpansGpus { request: String, count: usize },
    /// The CDI spec could not be written or removed.
    #[error(transparent)]
    Spec(EnforcementError),
    #[error("cannot remove {}: {source}", path.display())]
    Remove {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The checkpoint could not record the call's claims (one error for
    /// each of them).
    #[error(transparent)]
    Checkpoint(Arc<CheckpointError>),
}

/// The kubelet's `error` for a claim: empty when it went well.
fn answer_error<T>(uid: &str, verb: &str, a: &Result<T, ClaimError>) -> String {
    match a {
        Ok(_) => String::new(),
        Err(error) => {
            tracing::warn!(claim = %uid, %error, "claim not {verb}");
            error.to_string()
        }
    }
}

/// What prepares claims on this node.
pub(crate) struct Preparer {
    client: kube::Client,
    node: Node,
    composer: ResponseComposer,
    enforcer: Option<Enforcer>,
    cdi: CdiDir,
    checkpoint: PathBuf,
    prepared: tokio::sync::Mutex<Checkpoint>,
}

/// What a preparer is built from.
pub(crate) struct PreparerParts {
    pub(crate) client: kube::Client,
    pub(crate) node: Node,
    pub(crate) composer: ResponseComposer,
    pub(crate) enforcer: Option<Enforcer>,
    pub(crate) cdi: CdiDir,
    pub(crate) checkpoint: PathBuf,
}

impl Preparer {
    /// Loads the checkpoint and removes this driver's CDI specs it does
    /// not name (a daemon that died between writing a spec and recording
    /// it): blocking file work, done before the service is served.
    pub(crate) fn new(parts: PreparerParts) -> Result<Preparer, CheckpointError> {
        let prepared = Checkpoint::load(&parts.checkpoint)?;
        sweep_specs(&parts.cdi, &prepared);
        Ok(Preparer {
            client: parts.client,
            node: parts.node,
            composer: parts.composer,
            enforcer: parts.enforcer,
            cdi: parts.cdi,
            checkpoint: parts.checkpoint,
            prepared: tokio::sync::Mutex::new(prepared),
        })
    }

    /// Prepares every claim; an answer per claim UID.
    pub(crate) async fn prepare(&self, claims: Vec<v1::Claim>) -> v1::NodePrepareResourcesResponse {
        let mut book = self.prepared.lock().await;
        let claims = dedup(claims);
        // Read from the API server only what is not prepared already.
        let hits: Vec<bool> = claims.iter().map(|c| book_hit(&book, c)).collect();
        let reads = claims.iter().zip(hits).map(|(c, hit)| async move {
            check_names(c)?;
            if hit {
                return Ok(None);
            }
            self.read(c).await.map(Some)
        });
        let read = futures::future::join_all(reads).await;
        let rpc = self.enforcer.as_ref().map(Enforcer::for_allocate);
        let mut answers = HashMap::new();
        let mut changed = Vec::new();
        for (c, read) in claims.iter().zip(read) {
            let answer = match read {
                Err(e) => Err(e),
                Ok(None) => Ok(book.claims[&c.uid].devices.clone()),
                Ok(Some(claim)) => match self.prepare_one(c, &claim, rpc.as_ref()).await {
                    Ok(prepared) => {
                        let devices = prepared.devices.clone();
                        book.claims.insert(c.uid.clone(), prepared);
                        changed.push(c.uid.clone());
                        Ok(devices)
                    }
                    Err(e) => Err(e),
                },
            };
            answers.insert(c.uid.clone(), answer);
        }
        if !changed.is_empty()
            && let Err(e) = self.save(&book).await
        {
            // Not recorded: the kubelet calls again for these.
            tracing::error!(error = %e, "cannot record prepared claims");
            let e = Arc::new(e);
            for uid in changed {
                answers.insert(uid, Err(ClaimError::Checkpoint(e.clone())));
            }
        }
        let claims = answers
            .into_iter()
            .map(|(uid, a)| {
                let error = answer_error(&uid, "prepared", &a);
                let devices = a.unwrap_or_default();
                let answer = v1::NodePrepareResourceResponse {
                    devices: devices.into_iter().map(wire_device).collect(),
                    error,
                };
                (uid, answer)
            })
            .collect();
        v1::NodePrepareResourcesResponse { claims }
    }

    /// Unprepares every claim: its CDI spec and cache directories removed,
    /// its record dropped. A claim not prepared here is done already.
    pub(crate) async fn unprepare(
        &self,
        claims: Vec<v1::Claim>,
    ) -> v1::NodeUnprepareResourcesResponse {
        let mut book = self.prepared.lock().await;
        let mut answers = HashMap::new();
        let mut removed = Vec::new();
        for c in dedup(claims) {
            let answer = match book.claims.remove(&c.uid) {
                None => Ok(()),
                Some(p) => {
                    let (p, undone) = blocking(move || {
                        let undone = undo(&p);
                        (p, undone)
                    })
                    .await;
                    match undone {
                        Ok(()) => {
                            removed.push(c.uid.clone());
                            Ok(())
                        }
                        Err(e) => {
                            book.claims.insert(c.uid.clone(), p);
                            Err(e)
                        }
                    }
                }
            };
            answers.insert(c.uid, answer);
        }
        if !removed.is_empty()
            && let Err(e) = self.save(&book).await
        {
            // Its files are gone; a repeated call finds nothing to do.
            tracing::error!(error = %e, "cannot record unprepared claims");
            let e = Arc::new(e);
            for uid in removed {
                answers.insert(uid, Err(ClaimError::Checkpoint(e.clone())));
            }
        }
        let claims = answers
            .into_iter()
            .map(|(uid, a)| {
                let error = answer_error(&uid, "unprepared", &a);
                (uid, v1::NodeUnprepareResourceResponse { error })
            })
            .collect();
        v1::NodeUnprepareResourcesResponse { claims }
    }

    async fn read(&self, c: &v1::Claim) -> Result<ResourceClaim, ClaimError> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &c.namespace);
        let claim = format!("claim {}/{}", c.namespace, c.name);
        match tokio::time::timeout(READ_TIMEOUT, api.get(&c.name)).await {
            Err(_) => Err(ClaimError::ReadTimeout { claim }),
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => Err(ClaimError::Missing { claim }),
            Ok(Err(source)) => Err(ClaimError::Read { claim, source }),
            Ok(Ok(claim)) => Ok(claim),
        }
    }

    /// One claim: its grant's shares readied and composed, its spec
    /// written. A failure leaves nothing behind.
    async fn prepare_one(
        &self,
        c: &v1::Claim,
        claim: &ResourceClaim,
        rpc: Option<&AllocateEnforcement>,
    ) -> Result<Prepared, ClaimError> {
        let grants = grant(claim, &c.uid, &self.node)?;
        let mut caches = Vec::new();
        let composed = self.compose(c, &grants, rpc, &mut caches).await;
        let written = match composed {
            Ok((spec_devices, devices)) => {
                let (cdi, uid) = (self.cdi.clone(), c.uid.clone());
                blocking(move || cdi.write(&uid, spec_devices).map_err(ClaimError::Spec))
                    .await
                    .map(|spec| (spec, devices))
            }
            Err(e) => Err(e),
        };
        match written {
            Ok((spec, devices)) => Ok(Prepared {
                namespace: c.namespace.clone(),
                name: c.name.clone(),
                spec,
                caches,
                devices,
            }),
            Err(e) => {
                let _ = blocking(move || caches.iter().try_for_each(|d| remove_dir(d))).await;
                Err(e)
            }
        }
    }

    /// The CDI devices and the kubelet's answer for `grants`; the cache
    /// directories made go to `caches` as they are made.
    async fn compose(
        &self,
        c: &v1::Claim,
        grants: &[RequestGrant],
        rpc: Option<&AllocateEnforcement>,
        caches: &mut Vec<PathBuf>,
    ) -> Result<(Vec<cdi::Device>, Vec<PreparedDevice>), ClaimError> {
        // Refused before any share is readied.
        if let Some(g) = grants
            .iter()
            .find(|g| g.limits.shared() && g.gpus.len() > 1)
            && rpc.is_some_and(AllocateEnforcement::mps)
        {
            return Err(ClaimError::MpsSpansGpus {
                request: g.request.clone(),
                count: g.gpus.len(),
            });
        }
        let mut spec_devices = Vec::new();
        let mut devices = Vec::new();
        for g in grants {
            let share = g.share_key();
            let uuids: Vec<&str> = g
                .gpus
                .iter()
                .map(|&i| self.node.gpus[i].uuid.as_str())
                .collect();
            let preload = match rpc.filter(|_| g.limits.shared()) {
                Some(rpc) => {
                    let owner = OwnedBy::Claim {
                        uid: c.uid.clone(),
                        share: share.clone(),
                    };
                    let p = grant::ready(rpc, uuids[0].to_owned(), Some(owner))
                        .await
                        .map_err(|source| ClaimError::Readying {
                            request: g.request.clone(),
                            source,
                        })?;
                    caches.extend(p.cache_dir.clone());
                    Some(p)
                }
                None => None,
            };
            let name = CdiDir::device_name(&c.uid, &share);
            let id = self.cdi.device_id(&name);
            let edits = self.composer.edits(&uuids, g.limits, preload);
            spec_devices.push(cdi::Device {
                name,
                container_edits: edits.into(),
            });
            // The share's edits go with its first result only: the kubelet
            // hands a container every listed ID, duplicates included.
            devices.extend(g.results.iter().enumerate().map(|(i, r)| PreparedDevice {
                request: r.request.clone(),
                pool: self.node.pool.clone(),
                device: r.device.clone(),
                cdi_ids: if i == 0 { vec![id.clone()] } else { Vec::new() },
                share_id: r.share_id.clone(),
            }));
        }
        Ok((spec_devices, devices))
    }

    async fn save(&self, book: &Checkpoint) -> Result<(), CheckpointError> {
        let (book, path) = (book.clone(), self.checkpoint.clone());
        tokio::task::spawn_blocking(move || book.save(&path))
            .await
            .expect("checkpoint write panicked")
    }
}

/// Whether `c` is prepared and its spec is still there (a CDI directory on
/// a tmpfs is empty after a reboot, the checkpoint is not).
fn book_hit(book: &Checkpoint, c: &v1::Claim) -> bool {
    book.claims.get(&c.uid).is_some_and(|p| p.spec.exists())
}

/// A claim named twice is answered once.
fn dedup(claims: Vec<v1::Claim>) -> Vec<v1::Claim> {
    let mut seen = std::collections::HashSet::new();
    claims
        .into_iter()
        .filter(|c| seen.insert(c.uid.clone()))
        .collect()
}

fn check_names(c: &v1::Claim) -> Result<(), ClaimError> {
    let bad = |what: &str| {
        Err(ClaimError::BadName {
            uid: c.uid.clone(),
            what: what.to_owned(),
        })
    };
    if c.uid.is_empty() || c.uid.len() > MAX_UID {
        return bad("the UID must be 1 to 128 bytes");
    }
    for (field, v) in [("namespace", &c.namespace), ("name", &c.name)] {
        let ok = !v.is_empty()
            && v.len() <= MAX_NAME
            && v.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !ok {
            return bad(&format!("{field} {v:?} is not a DNS name"));
        }
    }
    Ok(())
}

fn wire_device(d: PreparedDevice) -> v1::Device {
    v1::Device {
        request_names: vec![d.request],
        pool_name: d.pool,
        device_name: d.device,
        cdi_device_ids: d.cdi_ids,
        share_id: d.share_id,
    }
}

/// Removes a prepared claim's spec and cache directories.
fn undo(p: &Prepared) -> Result<(), ClaimError> {
    CdiDir::remove(&p.spec).map_err(ClaimError::Spec)?;
    p.caches.iter().try_for_each(|d| remove_dir(d))
}

fn remove_dir(dir: &Path) -> Result<(), ClaimError> {
    match std::fs::remove_dir_all(dir) {
        Err(source) if source.kind() != std::io::ErrorKind::NotFound => Err(ClaimError::Remove {
            path: dir.to_owned(),
            source,
        }),
        _ => Ok(()),
    }
}

/// Removes the driver's specs in the CDI directory that `book` does not
/// name.
fn sweep_specs(cdi: &CdiDir, book: &Checkpoint) {
    let Ok(entries) = std::fs::read_dir(&cdi.dir) else {
        return;
    };
    let prefix = format!("{}-", cdi.driver);
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        let ours = name.starts_with(&prefix) && name.ends_with(".json");
        if ours && !book.claims.values().any(|p| p.spec == path) {
            tracing::info!(spec = %path.display(), "removing a CDI spec no prepared claim names");
            if let Err(e) = CdiDir::remove(&path) {
                tracing::warn!(error = %e, "cannot remove a stale CDI spec");
            }
        }
    }
}

/// File work off the async threads.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(work)
        .await
        .expect("DRA file work panicked")
}
