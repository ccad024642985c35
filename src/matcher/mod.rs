//! Pod matching: which pod and container an Allocate is for, the
//! GPU it gets, and the ledger on the pod that records it.
//!
//! `matching`, `pods` and `ledger` are pure; `actor` does the I/O (pod
//! cache, ledger patches through `write`, events) behind the handle in
//! `api`.

mod actor;
mod api;
pub(crate) mod cache;
pub mod ledger;
pub mod matching;
pub mod pods;
pub mod report;
mod write;

pub(crate) use actor::{MatcherArgs, PodMatcher, READY_NAME};
pub(crate) use api::{LiveContainer, MatcherError, MatcherHandle, MatcherMsg, Prepare, Steer};
pub(crate) use matching::Decision;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod write_tests;
