//! gpu-device-plugin: a Kubernetes device plugin that shares NVIDIA GPUs by
//! memory and compute. See the README for the design; `main.rs` is the CLI.

pub mod app;
pub mod config;
pub mod device;
pub mod health;
pub mod http;
pub mod inspect;
pub mod inventory;
pub mod kubelet_watch;
pub mod matcher;
pub mod metrics;
pub mod plugin;
#[cfg(feature = "sim")]
pub mod sim;
pub mod supervisor;
pub mod uds;

/// The kubelet's v1beta1 device-plugin API (messages, clients, servers).
pub mod api {
    /// The API version a plugin registers with and a kubelet accepts; it
    /// belongs to the proto, like the generated package name.
    pub const VERSION: &str = "v1beta1";

    include!(concat!(env!("OUT_DIR"), "/wire/v1beta1.rs"));

    /// The DevicePlugin server over our lazily encoded ListAndWatch list.
    pub mod lazy {
        include!(concat!(env!("OUT_DIR"), "/plugin/v1beta1.rs"));
    }
}
