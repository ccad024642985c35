//! The typed handle the plugins call, the matcher's messages, its errors
//! and its time bounds. The supervisor fills the handle when it (re)starts
//! the matcher, so plugins never hold a stale actor.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ractor::{ActorRef, RactorErr, RpcReplyPort, call_t};
use tokio::sync::watch;

use super::checkpoint::{Checkpointed, Crossing};
use super::report::Withdrawn;
use super::write::{Landed, SwapError, Swapped, WriteError};
use crate::node::health::GpuFault;
use crate::rules::device::{DeviceRef, Resource};
use crate::rules::matching::pods::PodKey;
use crate::rules::matching::{Ask, Decision, MatchError};
use crate::rules::usage::ids_digest;

/// Beyond the matcher's own wait (`matcher.wait_ms`), what an Allocate
/// allows for its queue: it answers one lookup at a time.
const QUEUE_SLACK: Duration = Duration::from_secs(5);
/// GetPreferredAllocation must stay fast; without an answer by then the
/// plugin packs on its own.
const PREFER_TIMEOUT: Duration = Duration::from_millis(500);
/// A cleanup pass skips a round rather than wait long for the live pods.
const LIVE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long GetPreferredAllocation waits for a pod the pod cache has not
/// seen yet (the kubelet may ask before the pod's watch event arrives):
/// half of [`PREFER_TIMEOUT`], leaving the rest for the lookup and reply.
pub(super) const UNSEEN_POD_WAIT: Duration =
    Duration::from_millis(PREFER_TIMEOUT.as_millis() as u64 / 2);

/// Which kubelet: its socket's inode and change time (seconds,
/// nanoseconds), new with every kubelet that creates it.
pub(crate) type KubeletId = (u64, i64, i64);

/// Where GetPreferredAllocation should take devices from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Steer {
    /// The GPUs the container will get (empty: no opinion).
    pub(crate) gpus: Vec<usize>,
    /// Per GPU: keep off it (whole and shared work do not mix).
    pub(crate) avoid: Vec<bool>,
}

/// A decision the matcher holds for its caller: no other Allocate is
/// decided onto it until the caller records or releases it.
#[derive(Debug)]
pub(crate) struct Reserved {
    pub(crate) decision: Decision,
    /// The reservation to record; None for a repeat (nothing to record).
    pub(crate) ticket: Option<u64>,
}

/// How a reservation's record went.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// It is on the pod's ledger.
    Done,
    /// Not recorded: the decision no longer holds (its pod went away, the
    /// pods changed, the reservation outlived its caller's deadline).
    /// Decide again.
    Again,
}

/// What the matcher is asked, one at a time; each call carries the port
/// its answer goes to. A call whose caller has gone by the time its turn
/// comes is skipped unanswered.
///
/// An Allocate is three steps so that the matcher never waits on its
/// caller's readying nor on the API server: `Decide` (pure, fast: the
/// container, its GPU, held as a reservation), the caller readies the
/// grant in its own task, then `Record` (the ledger patch, in a task of
/// its own, answered by `Written`). Readied first, recorded second: a
/// grant that cannot be readied leaves no ledger entry, only a reservation
/// that `Release` drops; the other order would leave a ledger entry to
/// take back by another API write, which can fail too.
pub(crate) enum MatcherMsg {
    /// Find the container an Allocate is for and place it, giving up by
    /// `deadline` (the caller's). Reply with the decision, held for the
    /// caller until `deadline` at the latest, or why not; a refusal also
    /// lands as an Event on the pod when one was found.
    Decide {
        ask: Ask,
        deadline: Instant,
        reply: RpcReplyPort<Result<Reserved, MatcherError>>,
    },
    /// Record the reservation `ticket` on its pod's ledger if its decision
    /// still holds.
    Record {
        ticket: u64,
        reply: RpcReplyPort<Result<Recorded, MatcherError>>,
    },
    /// The ledger write of `ticket` ended with `landed`: answer `reply`.
    Written {
        ticket: u64,
        landed: Result<Landed, WriteError>,
        reply: RpcReplyPort<Result<Recorded, MatcherError>>,
    },
    /// Drop the reservation `ticket`, unrecorded (a no-op once recorded or
    /// while its write is in flight).
    Release { ticket: u64 },
    /// Post a Warning Event with `note` on `pod`: why its container was
    /// refused after the matcher decided on it.
    Warn { pod: PodKey, note: String },
    /// An XID on a GPU: a Warning Event on every pod with a container
    /// granted on it.
    Fault { fault: GpuFault },
    /// The kubelet restarted (`kubelet`: its socket's identity, the same
    /// from every plugin that tells of it): it never saw the pods deleted
    /// before, so none of them is admitted any more, and the grants it had
    /// not checkpointed it asks for again.
    KubeletRestarted { kubelet: KubeletId },
    /// The same lookup for GetPreferredAllocation, recording nothing, by
    /// `deadline` (the caller's). Reply with where the devices should come
    /// from (no opinion when nothing was found).
    Prefer {
        ask: Ask,
        deadline: Instant,
        reply: RpcReplyPort<Steer>,
    },
    /// Reply with every container of every pod in the pod cache; None
    /// before the cache's first full list (nothing yet says which pods are
    /// gone).
    Live {
        reply: RpcReplyPort<Option<Vec<LiveContainer>>>,
    },
    /// The kubelet's checkpoint as last read, while a grant may have gone
    /// to another pod than the one recorded: swap the records of each pair
    /// it shows crossed.
    Checkpoint { held: Vec<Checkpointed> },
    /// The swap of the records of `crossing` (its admitted pod, then its
    /// recorded one, in `pods`) ended with `swapped`.
    Swapped {
        crossing: Crossing,
        pods: [PodKey; 2],
        swapped: Result<Swapped, SwapError>,
    },
}

/// Releases a reservation on every way out of an Allocate (a refusal, a
/// timeout, the RPC cancelled); after its record the release is a no-op.
#[derive(Debug)]
struct Held {
    actor: ActorRef<MatcherMsg>,
    ticket: u64,
}

impl Drop for Held {
    fn drop(&mut self) {
        let ticket = self.ticket;
        let _ = self.actor.cast(MatcherMsg::Release { ticket });
    }
}

/// A container of a pod the pod cache holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LiveContainer {
    pub(crate) pod: PodKey,
    pub(crate) uid: String,
    pub(crate) container: String,
    /// Its runtime ID (the status's `containerID` after `://`), once the
    /// kubelet has reported one.
    pub(crate) id: Option<String>,
}

#[cfg(test)]
impl LiveContainer {
    /// Container `container` of pod `ns/<pod>` (UID `uid-<pod>`), with
    /// runtime ID `id`.
    pub(crate) fn of(pod: &str, container: &str, id: Option<&str>) -> LiveContainer {
        LiveContainer {
            pod: PodKey {
                namespace: "ns".into(),
                name: pod.into(),
            },
            uid: format!("uid-{pod}"),
            container: container.into(),
            id: id.map(Into::into),
        }
    }
}

/// Why the matcher gave no container for an Allocate. The text is what
/// the kubelet shows; [`MatcherError::reason`] is what metrics count.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MatcherError {
    #[error("the pod matcher is not running (see the log for why)")]
    Down,
    /// The call failed: `timed_out`, or the matcher stopped meanwhile.
    #[error("the pod matcher did not answer: {detail}")]
    NoAnswer { timed_out: bool, detail: String },
    #[error("node {node}: cannot allocate {amount} {resource} ({devices} devices): {why}")]
    Refused {
        node: String,
        amount: u64,
        resource: Resource,
        devices: u64,
        why: Refusal,
    },
}

/// Why the matcher refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refusal {
    #[error("the pod cache has not synced with the API server within {0} ms")]
    NotSynced(u128),
    #[error("the API server: {0}")]
    ApiServer(String),
    #[error(transparent)]
    Match(#[from] MatchError),
}

impl MatcherError {
    /// The kind of failure, for `rpc_failures_total{reason}`.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            MatcherError::Down
            | MatcherError::NoAnswer {
                timed_out: false, ..
            } => "matcher_down",
            MatcherError::NoAnswer {
                timed_out: true, ..
            } => "timeout",
            MatcherError::Refused { why, .. } => match why {
                Refusal::NotSynced(_) => "not_synced",
                Refusal::ApiServer(_) => "api_server",
                Refusal::Match(e) => match e {
                    MatchError::NoCandidate { .. } => "no_match",
                    MatchError::UnknownGpu { .. } => "unknown_gpu",
                    MatchError::SpansGpus { .. } => "spans_gpus",
                    MatchError::Contradicts { .. } => "contradicts_assignment",
                    MatchError::HeldWhole { .. } => "held_whole",
                    MatchError::CarriesShared { .. } => "carries_shared",
                    MatchError::Splits { .. } => "splits_container",
                    MatchError::NoWholeGpus { .. } => "no_whole_gpus",
                    MatchError::Full { .. } => "full",
                },
            },
        }
    }
}

fn no_answer<T>(e: RactorErr<T>) -> MatcherError {
    MatcherError::NoAnswer {
        timed_out: matches!(e, RactorErr::Timeout),
        detail: e.to_string(),
    }
}

/// The matcher as the plugins see it, across its restarts: the running
/// actor, and the devices it withdraws from the kubelet's lists.
#[derive(Debug, Clone)]
pub(crate) struct MatcherHandle {
    actor: Arc<RwLock<Option<ActorRef<MatcherMsg>>>>,
    /// Outlives every matcher, so a plugin follows one channel for good.
    withdrawals: watch::Sender<Withdrawn>,
}

impl Default for MatcherHandle {
    fn default() -> Self {
        MatcherHandle {
            actor: Arc::default(),
            withdrawals: watch::Sender::new(Withdrawn::default()),
        }
    }
}

impl MatcherHandle {
    pub(crate) fn set(&self, actor: Option<ActorRef<MatcherMsg>>) {
        *self.actor.write().expect("matcher handle poisoned") = actor;
    }

    fn actor(&self) -> Option<ActorRef<MatcherMsg>> {
        self.actor.read().expect("matcher handle poisoned").clone()
    }

    /// Where a matcher publishes what it withdraws.
    pub(crate) fn withdrawals(&self) -> &watch::Sender<Withdrawn> {
        &self.withdrawals
    }

    /// What the matcher withdraws now and after every change.
    pub(crate) fn follow_withdrawals(&self) -> watch::Receiver<Withdrawn> {
        self.withdrawals.subscribe()
    }

    /// Decides which container an Allocate of `ask` is for and holds the
    /// decision for the caller until it commits it, drops it, or
    /// `deadline` passes.
    pub(crate) async fn reserve(
        &self,
        ask: &Ask,
        deadline: Instant,
    ) -> Result<Reservation, MatcherError> {
        let actor = self.actor().ok_or(MatcherError::Down)?;
        let decide = |reply| MatcherMsg::Decide {
            ask: ask.clone(),
            deadline,
            reply,
        };
        let reserved = call_t!(actor, decide, left(deadline)).map_err(no_answer)??;
        let held = reserved.ticket.map(|ticket| Held {
            actor: actor.clone(),
            ticket,
        });
        Ok(Reservation {
            decision: reserved.decision,
            held,
            deadline,
        })
    }

    /// Records `reservation` on its pod's ledger. [`Recorded::Again`]: the
    /// decision no longer holds; reserve again.
    pub(crate) async fn commit(&self, reservation: Reservation) -> Result<Recorded, MatcherError> {
        let Some(held) = &reservation.held else {
            return Ok(Recorded::Done); // a repeat: already on the ledger
        };
        let ticket = held.ticket;
        let record = |reply| MatcherMsg::Record { ticket, reply };
        call_t!(held.actor, record, left(reservation.deadline)).map_err(no_answer)?
    }

    /// Posts a Warning Event with `note` on `pod`: why its container was
    /// refused after the matcher decided on it.
    pub(crate) fn warn(&self, pod: PodKey, note: String) {
        if let Some(actor) = self.actor() {
            let _ = actor.cast(MatcherMsg::Warn { pod, note });
        }
    }

    /// Tells the pods on the GPU of `fault` (nobody, while no matcher runs:
    /// without pod matching nothing says which pod has which GPU).
    pub(crate) fn fault(&self, fault: GpuFault) {
        match self.actor() {
            Some(actor) => {
                let _ = actor.cast(MatcherMsg::Fault { fault });
            }
            None => {
                tracing::info!(uuid = %fault.uuid, "no pod matcher to tell the pods of a GPU fault")
            }
        }
    }

    /// Says the kubelet restarted (see [`MatcherMsg::KubeletRestarted`]).
    pub(crate) fn kubelet_restarted(&self, kubelet: KubeletId) {
        if let Some(actor) = self.actor() {
            let _ = actor.cast(MatcherMsg::KubeletRestarted { kubelet });
        }
    }

    /// The containers of the pods in the pod cache; None when the matcher
    /// is down, slow, or has not synced its cache.
    pub(crate) async fn live(&self) -> Option<Vec<LiveContainer>> {
        let actor = self.actor()?;
        let ms = LIVE_TIMEOUT.as_millis() as u64;
        call_t!(actor, |reply| MatcherMsg::Live { reply }, ms)
            .ok()
            .flatten()
    }

    /// Where `size` devices of `resource` should come from; no opinion
    /// when the matcher is down or slow.
    pub(crate) async fn prefer(&self, resource: Resource, size: usize) -> Steer {
        let Some(actor) = self.actor() else {
            return Steer::default();
        };
        let ask = Ask {
            resource,
            devices: size as u64,
            digest: None,
            id_gpus: Vec::new(),
        };
        let (ms, deadline) = (
            PREFER_TIMEOUT.as_millis() as u64,
            Instant::now() + PREFER_TIMEOUT,
        );
        let prefer = |reply| MatcherMsg::Prefer {
            ask,
            deadline,
            reply,
        };
        call_t!(actor, prefer, ms).unwrap_or_default()
    }
}

/// The milliseconds left until `deadline`, for a call's timeout.
fn left(deadline: Instant) -> u64 {
    deadline
        .saturating_duration_since(Instant::now())
        .as_millis() as u64
}

/// A decision held for its caller, by [`MatcherHandle::reserve`]: no other
/// Allocate is decided onto it until it is committed or dropped (dropping
/// releases it).
#[derive(Debug)]
pub(crate) struct Reservation {
    pub(crate) decision: Decision,
    /// None for a repeat: nothing to record.
    held: Option<Held>,
    /// The caller's: it has given up by then.
    pub(crate) deadline: Instant,
}

/// The lookup of an Allocate of `devices`, named by `ids`, and the time
/// its caller allows for it: the matcher's own `wait` and its queue.
pub(crate) fn allocate_ask<'a>(
    resource: Resource,
    devices: &[DeviceRef],
    ids: impl Iterator<Item = &'a str>,
    wait: Duration,
) -> (Ask, Instant) {
    (
        lookup(resource, devices, ids),
        Instant::now() + wait + QUEUE_SLACK,
    )
}

/// The lookup of an Allocate of `devices`, named by `ids`.
fn lookup<'a>(
    resource: Resource,
    devices: &[DeviceRef],
    ids: impl Iterator<Item = &'a str>,
) -> Ask {
    let mut id_gpus: Vec<usize> = Vec::new();
    for d in devices {
        if !id_gpus.contains(&d.gpu) {
            id_gpus.push(d.gpu);
        }
    }
    Ask {
        resource,
        devices: devices.len() as u64,
        digest: Some(ids_digest(ids)),
        id_gpus,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ractor::{Actor, ActorProcessingErr};

    fn refused(e: MatchError) -> MatcherError {
        MatcherError::Refused {
            node: "n".into(),
            amount: 512,
            resource: Resource::GpuMemory,
            devices: 4,
            why: e.into(),
        }
    }

    #[test]
    fn failures_are_counted_by_kind_and_read_as_before() {
        let pod = PodKey {
            namespace: "default".into(),
            name: "p".into(),
        };
        let e = refused(MatchError::NoCandidate {
            resource: Resource::GpuMemory,
            devices: 4,
            best: None,
        });
        assert_eq!(e.reason(), "no_match");
        assert_eq!(
            e.to_string(),
            "node n: cannot allocate 512 gpu-memory (4 devices): no pending pod on this node has \
             a container waiting for 4 gpu-memory devices"
        );
        let full = refused(MatchError::Full {
            pod: pod.clone(),
            uuid: "GPU-a".into(),
            resource: Resource::GpuMemory,
            free: 1,
            capacity: 2,
            amount: 3,
        });
        assert_eq!(full.reason(), "full");
        let held = refused(MatchError::HeldWhole {
            pod,
            uuid: "GPU-a".into(),
        });
        assert_eq!(held.reason(), "held_whole");
        let synced = MatcherError::Refused {
            node: "n".into(),
            amount: 5,
            resource: Resource::GpuCore,
            devices: 1,
            why: Refusal::NotSynced(500),
        };
        assert_eq!(synced.reason(), "not_synced");
        assert_eq!(
            synced.to_string(),
            "node n: cannot allocate 5 gpu-core (1 devices): the pod cache has not synced with \
             the API server within 500 ms"
        );
    }

    /// A matcher that drops every Allocate unanswered, as one stopping
    /// mid-call does.
    struct Dropping;

    impl Actor for Dropping {
        type Msg = MatcherMsg;
        type State = ();
        type Arguments = ();

        async fn pre_start(
            &self,
            _: ActorRef<MatcherMsg>,
            _: (),
        ) -> Result<(), ActorProcessingErr> {
            Ok(())
        }

        async fn handle(
            &self,
            _: ActorRef<MatcherMsg>,
            _: MatcherMsg,
            _: &mut (),
        ) -> Result<(), ActorProcessingErr> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_missing_matcher_a_lost_call_and_a_timeout_fail_by_kind() {
        let handle = MatcherHandle::default();
        let devices = [DeviceRef { gpu: 0, unit: 0 }];
        let ask = |h: MatcherHandle| async move {
            let ids = ["a"].into_iter();
            let (ask, deadline) = allocate_ask(Resource::GpuMemory, &devices, ids, Duration::ZERO);
            h.reserve(&ask, deadline).await.unwrap_err()
        };
        let down = ask(handle.clone()).await;
        assert_eq!(down.reason(), "matcher_down");
        assert_eq!(
            down.to_string(),
            "the pod matcher is not running (see the log for why)"
        );
        let (actor, task) = Actor::spawn(None, Dropping, ()).await.unwrap();
        handle.set(Some(actor.clone()));
        let lost = ask(handle).await;
        assert_eq!(lost.reason(), "matcher_down");
        assert!(
            lost.to_string()
                .starts_with("the pod matcher did not answer: "),
            "{lost}"
        );
        actor.stop(None);
        task.await.unwrap();
        let late = no_answer(RactorErr::<()>::Timeout);
        assert_eq!(late.reason(), "timeout");
        assert!(
            late.to_string()
                .starts_with("the pod matcher did not answer: ")
        );
    }
}
