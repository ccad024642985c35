//! The grant pipeline: what a container gets once a frontend has decided
//! its grant (the GPUs and the amount). Both frontends, the device plugin's
//! Allocate and DRA's NodePrepareResources, hand their decided grant here
//! and nothing else does what happens here: [`ready`] readies enforcement
//! for a shared grant (the one trip to the blocking pool: the library
//! check, the container's cache directory, the MPS daemon's answer), and
//! [`ResponseComposer`] composes the envs, mounts and CDI edits
//! ([`compose`]). Nothing here decides or records a grant.
//!
//! One Allocate, hop by hop (each arrow a hop; at most six):
//!
//! ```text
//! kubelet ─1─▶ plugin service (decode, delegate)
//!         ─2─▶ pod matcher: Decide        (reserve the container's GPU)
//!         ─3─▶ grant::ready               (blocking pool, enforcement)
//!         ─4─▶ pod matcher: Record        (the ledger PATCH runs in its own task,
//!                                          the matcher serves others meanwhile)
//!         ─5─▶ pod matcher: Written       (commit; or Again: back to 2)
//!         ─6─▶ grant::compose ─▶ the kubelet's response
//! ```
//!
//! Without pod matching, 2, 4 and 5 are the pairing book's, in the plugin's
//! own task. One DRA prepare:
//!
//! ```text
//! kubelet ─1─▶ DRA service ─2─▶ the claim, read from the API server
//!         ─3─▶ grant::ready per share ─4─▶ grant::compose (CDI edits)
//!         ─5─▶ CDI spec and checkpoint written ─6─▶ the kubelet's response
//! ```
//!
//! Readied before recorded: a grant enforcement cannot ready leaves no
//! ledger entry (the reservation is dropped), whereas the other order
//! would leave an entry to take back by another API write, which can fail
//! too.

pub(crate) mod compose;

pub(crate) use compose::{ContainerEdits, Limits, ResponseComposer};

use crate::node::enforcement::{AllocateEnforcement, CacheOwner, EnforcementError, Owner, Preload};

/// What a container gets: GPUs (indexes; one for a shared resource of a
/// container asking no whole GPU) and an amount in the resource's unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ContainerGrant {
    pub(crate) gpus: Vec<usize>,
    pub(crate) amount: u64,
    /// The container holds `gpus` whole
    /// ([`ContainerAsk::rides_whole`](crate::rules::usage::ContainerAsk::rides_whole)):
    /// a shared amount rides inside them, so its response is the whole
    /// GPUs' and caps nothing, whichever resource the kubelet served first.
    pub(crate) whole: bool,
}

impl ContainerGrant {
    /// The one GPU a shared grant is on; None for whole GPUs (nothing to
    /// cap, and no MPS client on them: a whole GPU is its container's
    /// alone).
    pub(crate) fn shared_gpu(&self) -> Option<usize> {
        self.gpus.first().copied().filter(|_| !self.whole)
    }
}

/// Who owns a grant's cache directory, owned so it can go to the blocking
/// pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OwnedBy {
    Container { pod_uid: String, container: String },
    Claim { uid: String, share: String },
}

/// Readies enforcement for a shared grant on the GPU `uuid`, whichever
/// frontend granted it: enforcement's file work and MPS check, off the
/// async threads.
pub(crate) async fn ready(
    e: &AllocateEnforcement,
    uuid: String,
    owner: Option<OwnedBy>,
) -> Result<Preload, EnforcementError> {
    let e = e.clone();
    tokio::task::spawn_blocking(move || {
        let owner = owner.as_ref().map(|o| match o {
            OwnedBy::Container { pod_uid, container } => {
                Owner::Container(CacheOwner { pod_uid, container })
            }
            OwnedBy::Claim { uid, share } => Owner::Claim { uid, share },
        });
        e.prepare(owner, &uuid)
    })
    .await
    .expect("enforcement file work panicked")
}
