//! gpu-sim: stand-ins for what gpu-device-plugin talks to in a cluster, so
//! its tests, benches and demo run on one machine without a GPU, a kubelet
//! or a cluster: the kubelet (device-plugin registration, ListAndWatch,
//! admission), the API server (pods, nodes, events), kube-scheduler (with or
//! without an extender), an in-memory cluster for the extender alone, and
//! the `demo` that runs the real daemons and the extender between them.
//!
//! A workspace member of its own, a dev-dependency of the product: the
//! product crate and its image carry none of this code.

pub mod apiserver;
pub mod demo;
pub mod figures;
pub mod fill;
pub mod gpu_node;
pub mod kubelet;
pub mod memory;
pub mod mps_control;
mod placement_demo;
pub mod scheduler;
pub mod trace;
