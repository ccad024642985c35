//! MPS, the compute backend NVIDIA's driver enforces: one MPS control
//! daemon per GPU, started and watched by this daemon, so that a shared
//! grant's container is an MPS client whose SMs and memory the driver caps.
//!
//! `control` talks to one GPU's control daemon through
//! `nvidia-cuda-mps-control` (its only documented interface: the pipe
//! protocol behind it is NVIDIA's own); `actor` keeps every GPU's running
//! and says on `/readyz` when one does not answer.
//!
//! Per GPU rather than one per node: a control daemon's servers span every
//! GPU it sees, so one per node would put a server context on GPUs granted
//! whole, and make a fatal fault on one GPU end the clients of all of them;
//! per GPU, a server exists only where a shared grant's client asked for
//! one, and a fault stays on its GPU.

pub(crate) mod actor;
pub(crate) mod control;

pub(crate) use actor::{MpsArgs, MpsDaemons};
pub(crate) use control::{Control, MpsError};
