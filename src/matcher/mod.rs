//! Pod matching (SPEC §3): which pod and container an Allocate is for, the
//! GPU it gets, and the ledger on the pod that records it.

pub mod ledger;
pub mod matching;
pub mod pods;

#[cfg(test)]
mod tests;
