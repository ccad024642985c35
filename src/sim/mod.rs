//! Stand-ins for what the product talks to in a cluster: the kubelet (device
//! plugin registration, ListAndWatch, admission), the API server (pods,
//! nodes, events), kube-scheduler (with or without an extender), and the
//! `demo` that runs the real daemons, and the extender, between them. They
//! serve the demo, the integration tests and the benchmark, and sit behind
//! the default-on `sim` feature so a production image can be built without
//! them (`cargo build --release --no-default-features`).

pub mod apiserver;
pub mod demo;
pub mod gpu_node;
pub mod kubelet;
mod placement_demo;
pub mod scheduler;
