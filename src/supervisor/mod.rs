//! The supervisor: spawns one plugin actor per enabled resource and restarts
//! any that stops or fails, with exponential backoff, so one failing
//! resource never takes the others down.

mod actor;

pub use actor::{Supervisor, SupervisorArgs};
