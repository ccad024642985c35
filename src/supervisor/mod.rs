//! The supervisor: spawns one plugin actor per enabled resource, the
//! kubelet watcher and the health monitor; restarts any that ends, with
//! exponential backoff, so one failing part never takes the others down;
//! applies a reloaded config by stopping, starting or restarting only the
//! plugins whose settings changed.

mod actor;

pub use actor::{Supervisor, SupervisorArgs, SupervisorMsg};
