//! Which devices and GPU a container gets: from the pod matcher, or, with
//! `pod_matching = false`, from the device IDs alone (with the pairing
//! book's hints). Both paths sit behind [`Placement::steer`] (for
//! GetPreferredAllocation) and [`Placement::grant`] (for Allocate), so the
//! gRPC service only decodes, delegates and has the response composed. A
//! shared grant under enforcement is readied ([`grant::ready`]) between its
//! decision and its record: a container is never placed to run unlimited,
//! and a refused grant leaves no ledger entry or pairing behind. The
//! readying runs here, in the Allocate's own task, never inside the pod
//! matcher: it decides, this readies, it records (the flow is drawn in
//! [`crate::node::grant`]).

use std::sync::Arc;
use std::time::Duration;

use super::allocate::{AllocateError, ids_grant};
use super::pairing::{PairingBook, SplitError};
use super::preferred;
use crate::node::enforcement::{AllocateEnforcement, EnforcementError, Preload};
use crate::node::grant::{self, ContainerGrant, OwnedBy};
use crate::node::matcher::{
    Decision, MatcherError, MatcherHandle, Recorded, Reservation, allocate_ask,
};
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
                let (ask, deadline) =
                    allocate_ask(model.resource(), devices, ids.iter().copied(), *wait);
                loop {
                    let reserved = handle.reserve(&ask, deadline).await?;
                    let grant = grant_of(&reserved.decision);
                    let preload = match enforcement {
                        Some(e) => readied(handle, e, &uuids, &reserved, ask.resource).await?,
                        None => None,
                    };
                    // A grant readied for a decision that no longer holds
                    // keeps what was made for it: the cache directory is
                    // the container's, not this grant's (its other
                    // resource's grant may use the same one), an empty one
                    // grants nothing (the ledger is the record), and the
                    // sweeper removes it with its pod.
                    match handle.commit(reserved).await? {
                        Recorded::Done => return Ok((grant, preload)),
                        Recorded::Again => continue,
                    }
                }
            }
        }
    }
}

/// Enforcement readied for a reservation, by its caller's deadline; a
/// refusal is posted on the pod too, which the matcher found.
async fn readied(
    handle: &MatcherHandle,
    e: &AllocateEnforcement,
    uuids: &[String],
    reserved: &Reservation,
    resource: Resource,
) -> Result<Option<Preload>, PlaceError> {
    let d = &reserved.decision;
    let owner = Some((d.uid.clone(), d.container.clone()));
    let grant = grant_of(d);
    let readying = prepare(e, uuids, &grant, owner);
    match tokio::time::timeout_at(reserved.deadline.into(), readying).await {
        Ok(Ok(preload)) => Ok(preload),
        Ok(Err(e)) => {
            handle.warn(d.pod.clone(), format!("{resource}: {e}"));
            Err(e.into())
        }
        Err(_) => Err(MatcherError::NoAnswer {
            timed_out: true,
            detail: "enforcement did not ready the grant in time".into(),
        }
        .into()),
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

/// Enforcement's cap for `grant` (on GPUs whose UUIDs are `uuids`), owned
/// by the container (pod UID, name) when pod matching knows it.
async fn prepare(
    e: &AllocateEnforcement,
    uuids: &[String],
    grant: &ContainerGrant,
    owner: Option<(String, String)>,
) -> Result<Option<Preload>, EnforcementError> {
    let Some(gpu) = grant.shared_gpu() else {
        return Ok(None);
    };
    let owner = owner.map(|(pod_uid, container)| OwnedBy::Container { pod_uid, container });
    grant::ready(e, uuids[gpu].clone(), owner).await.map(Some)
}
