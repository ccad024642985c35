//! The plumbing both programs stand on: unix sockets (and the relay that
//! mends the kubelet's plugin-watcher authority), and API-server clients.

mod authority;
pub(crate) mod http;
pub mod kube_client;
#[cfg(test)]
pub(crate) mod mock_api;
pub mod uds;
