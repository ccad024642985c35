//! Which devices and GPU a container gets: from the pod matcher, or, with
//! `pod_matching = false`, from the device IDs alone (with the pairing
//! book's hints). Both paths sit behind [`Placement::steer`] (for
//! GetPreferredAllocation) and [`Placement::grant`] (for Allocate), so the
//! gRPC service only decodes, delegates and encodes.

use std::time::Duration;

use super::allocate::{AllocateError, Grant, ids_grant};
use super::pairing::{LastShared, SplitError};
use crate::device::{DeviceModel, DeviceRef, Resource, packing};
use crate::matcher::{MatcherError, MatcherHandle};

#[derive(Debug, Clone)]
pub enum Placement {
    /// From the IDs, with the pairing hint for GetPreferredAllocation.
    Ids(LastShared),
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
}

impl PlaceError {
    /// The kind of failure, for `rpc_failures_total{reason}`.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            PlaceError::Ids(e) => e.reason(),
            PlaceError::Split(_) => "split_container",
            PlaceError::Matcher(e) => e.reason(),
        }
    }
}

impl Placement {
    pub fn uses_matcher(&self) -> bool {
        matches!(self, Placement::Matcher { .. })
    }

    /// GetPreferredAllocation: `size` devices of `model`'s resource out of
    /// `available`, with `must`, on the GPU the container will get when
    /// that is known, and off the GPUs it should keep off.
    pub(crate) async fn steer(
        &self,
        model: &DeviceModel,
        mut available: Vec<DeviceRef>,
        must: &[DeviceRef],
        size: usize,
    ) -> Vec<DeviceRef> {
        let resource = model.resource();
        let steer = match self {
            Placement::Ids(book) => book.steer(model, &available, size),
            Placement::Matcher { handle, .. } => handle.prefer(resource, size).await,
        };
        available.retain(|d| !steer.avoid.get(d.gpu).copied().unwrap_or(false));
        match resource {
            Resource::GpuCount => {
                packing::whole(&available, must, size, |g| model.gpus()[g].numa_node)
            }
            _ => packing::shared(&available, must, size, steer.gpus.first().copied()),
        }
    }

    /// Allocate: what a container granted `devices` of `model`'s resource
    /// gets. `ids` are the same devices as the kubelet named them.
    pub(crate) async fn grant<'a>(
        &self,
        model: &DeviceModel,
        devices: &[DeviceRef],
        ids: impl Iterator<Item = &'a str>,
    ) -> Result<Grant, PlaceError> {
        match self {
            Placement::Ids(book) => {
                let grant = ids_grant(model, devices)?;
                book.grant(model, devices)?;
                Ok(grant)
            }
            Placement::Matcher { handle, wait } => {
                let d = handle
                    .allocate(model.resource(), devices, ids, *wait)
                    .await?;
                Ok(Grant {
                    gpus: d.gpus,
                    amount: d.amount,
                })
            }
        }
    }
}
