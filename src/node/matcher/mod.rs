//! Pod matching: which pod and container an Allocate is for, the
//! GPU it gets, and the ledger on the pod that records it (the ledger's
//! format is the usage model's, [`crate::rules::usage::Ledger`]).
//!
//! `matching` and `pods` are pure; `actor` does the I/O (pod cache, ledger
//! patches through `write`) behind the handle in `api`, and hands its
//! Events to `events`, whose task posts them.

mod actor;
mod api;
pub(crate) mod cache;
mod events;
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
