//! The supervisor: spawns one plugin actor per enabled resource, the pod
//! matcher, the kubelet watcher and the health monitor; restarts any that
//! ends, with exponential backoff, so one failing part never takes the
//! others down; applies a reloaded config by stopping, starting or
//! restarting only the children whose arguments changed.
//!
//! `children` builds each child's arguments and spawns it, `reload` says
//! what a reload changes (both pure of actor state), `actor` holds the
//! restart policy and handles the messages.

mod actor;
mod children;
mod reload;
#[cfg(test)]
mod tests;

pub(crate) use actor::{Supervisor, SupervisorArgs, SupervisorMsg};
