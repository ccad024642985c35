//! The pure rules: what a GPU offers, what a pod asks and holds, where a
//! share fits, which container an Allocate is for. No I/O: the node daemon
//! and the extender both decide through these, so they cannot disagree.

pub mod device;
pub mod matching;
pub mod usage;
