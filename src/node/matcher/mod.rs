//! Pod matching on the node: the pod-matcher actor, which decides through
//! the pure rules of [`crate::rules::matching`] which pod and container an
//! Allocate is for and the GPU it gets, holds the decision as a
//! reservation, and records it in the pod's ledger (the ledger's format is
//! the usage model's, [`crate::rules::usage::Ledger`]).
//!
//! `actor` does the I/O (pod cache, ledger patches through `write`, each in
//! a task of its own) behind the handle in `api` (reserve, commit), and
//! hands its Events to `events`, whose task posts them; `faults` says which
//! pods a GPU fault reaches; `checkpoint` reads the kubelet's record of
//! whose devices are whose (the grants a restarted kubelet lost, the pairs
//! whose grants it gave each other's pod, whose records `write` swaps).

mod actor;
mod api;
pub(crate) mod cache;
mod checkpoint;
mod events;
mod faults;
pub mod report;
mod write;

pub(crate) use crate::rules::matching::Decision;
pub(crate) use actor::{MatcherArgs, PodMatcher};
pub(crate) use api::{
    LiveContainer, MatcherError, MatcherHandle, MatcherMsg, Recorded, Reservation, Steer,
    allocate_ask,
};

#[cfg(test)]
mod actor_tests;
#[cfg(test)]
mod write_tests;
