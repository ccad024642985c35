//! Which devices and GPU a container gets: from the pod matcher, or, with
//! `pod_matching = false`, from the device IDs alone (with the pairing
//! book's hints). Both paths sit behind [`Placement::steer`] (for
//! GetPreferredAllocation) and [`Placement::grant`] (for Allocate), so the
//! gRPC service only decodes, delegates and has the response composed. A
//! shared grant under enforcement is readied (library checked, cache
//! directory made) before anything is recorded: a container is never placed
//! to run unlimited, and a refused grant leaves no ledger entry or pairing
//! behind. That file work runs here, in the Allocate's own task (on the
//! blocking pool), never inside the pod matcher: it decides, this readies,
//! it records ([`crate::node::matcher::MatcherMsg`]).

use std::sync::Arc;
use std::time::Duration;

use super::allocate::{AllocateError, ContainerGrant, ids_grant};
use super::pairing::{PairingBook, SplitError};
use super::preferred;
use crate::node::enforcement::{AllocateEnforcement, CacheOwner, EnforcementError, Owner, Preload};
use crate::node::matcher::{Decision, MatcherError, MatcherHandle, Prepare};
use crate::rules::device::{DeviceModel, DeviceRef, Resource};

#[derive(Debug, Clone)]
pub(crate) enum Placement {
    /// From the IDs, with the pairing hint for GetPreferredAllocation.
    Ids(PairingBook),
    /// From the pod matcher, which may wait up to `wait` for a pod.
    Matcher {
        handle: MatcherHandle,
        wait: Duration,
    },
}

/// Why a container gets nothing.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PlaceError {
    /// The request itself is wrong (IDs only).
    #[error(transparent)]
    Ids(#[from] AllocateError),
    /// A container's shared resources would come from two GPUs (IDs only).
    #[error(transparent)]
    Split(#[from] SplitError),
    #[error(transparent)]
    Matcher(#[from] MatcherError),
    /// Enforcement is on and cannot cap this grant.
    #[error(transparent)]
    Enforcement(#[from] EnforcementError),
}

impl PlaceError {
    /// The kind of failure, for `rpc_failures_total{reason}`.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            PlaceError::Ids(e) => e.reason(),
            PlaceError::Split(_) => "split_container",
            PlaceError::Matcher(e) => e.reason(),
            PlaceError::Enforcement(_) => "enforcement",
        }
    }
}

impl Placement {
    pub(crate) fn uses_matcher(&self) -> bool {
        matches!(self, Placement::Matcher { .. })
    }

    /// GetPreferredAllocation: `size` devices of `model`'s resource out of
    /// `available`, with `must`, on the GPU the container will get when
    /// that is known, and off the GPUs it should keep off.
    pub(crate) async fn steer(
        &self,
        model: &DeviceModel,
        available: Vec<DeviceRef>,
        must: &[DeviceRef],
        size: usize,
    ) -> Vec<DeviceRef> {
        let steer = match self {
            Placement::Ids(book) => book.steer(model, &available, size),
            Placement::Matcher { handle, .. } => handle.prefer(model.resource(), size).await,
        };
        preferred::hint(model, available, must, size, &steer)
    }

    /// Allocate: what a container granted `devices` of `model`'s resource
    /// gets, and under `enforcement` (this RPC's) the preload of a shared
    /// grant. `ids` are the same devices as the kubelet named them.
    /// Enforcement readies a shared grant before the pairing book or the
    /// ledger records it, so a refused one leaves nothing behind.
    pub(crate) async fn grant(
        &self,
        model: &DeviceModel,
        devices: &[DeviceRef],
        ids: &[&str],
        enforcement: Option<&AllocateEnforcement>,
    ) -> Result<(ContainerGrant, Option<Preload>), PlaceError> {
        let enforcement = enforcement.filter(|_| model.resource() != Resource::GpuCount);
        let uuids: Arc<[String]> = model.gpus().iter().map(|g| g.uuid.clone()).collect();
        match self {
            Placement::Ids(book) => {
                let grant = ids_grant(model, devices)?;
                let preload = match enforcement {
                    Some(e) => prepare(e, &uuids, &grant, None).await?,
                    None => None,
                };
                book.grant(model, devices)?;
                Ok((grant, preload))
            }
            Placement::Matcher { handle, wait } => {
                let prepare = enforcement.map(|e| {
                    let (e, uuids) = (e.clone(), uuids.clone());
                    let hook: Prepare = Arc::new(move |d: &Decision| {
                        let (e, uuids, grant) = (e.clone(), uuids.clone(), grant_of(d));
                        let owner = Some((d.uid.clone(), d.container.clone()));
                        Box::pin(async move { prepare(&e, &uuids, &grant, owner).await })
                    });
                    hook
                });
                let resource = model.resource();
                let (d, preload) = handle
                    .allocate(resource, devices, ids.iter().copied(), *wait, prepare)
                    .await?;
                Ok((grant_of(&d), preload))
            }
        }
    }
}

/// The grant a matcher's decision gives.
fn grant_of(d: &Decision) -> ContainerGrant {
    ContainerGrant {
        gpus: d.gpus.clone(),
        amount: d.amount,
        whole: d.whole,
    }
}

/// Enforcement's cap for `grant` (on GPUs whose UUIDs are `uuids`), owned by the
/// container (pod UID, name) when pod matching knows it; a grant riding
/// inside whole GPUs has nothing to cap (and no MPS client on it: a whole
/// GPU is its container's alone).
async fn prepare(
    e: &AllocateEnforcement,
    uuids: &[String],
    grant: &ContainerGrant,
    owner: Option<(String, String)>,
) -> Result<Option<Preload>, EnforcementError> {
    // A shared grant is on one GPU.
    let Some(&gpu) = grant.gpus.first().filter(|_| !grant.whole) else {
        return Ok(None);
    };
    let owner = owner.map(|(pod_uid, container)| OwnedBy::Container { pod_uid, container });
    prepare_grant(e, uuids[gpu].clone(), owner).await.map(Some)
}

/// Who owns a grant's cache directory, owned so it can go to the blocking
/// pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OwnedBy {
    Container { pod_uid: String, container: String },
    Claim { uid: String, share: String },
}

/// The one prepare step of a shared grant on the GPU `uuid`, whichever API
/// granted it (an Allocate, a DRA claim): enforcement's file work and MPS
/// check, off the async threads.
pub(crate) async fn prepare_grant(
    e: &AllocateEnforcement,
    uuid: String,
    owner: Option<OwnedBy>,
) -> Result<Preload, EnforcementError> {
    let e = e.clone();
    blocking(move || {
        let owner = owner.as_ref().map(|o| match o {
            OwnedBy::Container { pod_uid, container } => {
                Owner::Container(CacheOwner { pod_uid, container })
            }
            OwnedBy::Claim { uid, share } => Owner::Claim { uid, share },
        });
        e.prepare(owner, &uuid)
    })
    .await
}

/// Enforcement's file work, off the async threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, EnforcementError> + Send + 'static,
) -> Result<T, EnforcementError> {
    tokio::task::spawn_blocking(work)
        .await
        .expect("enforcement file work panicked")
}
