//! gpu-device-plugin: a Kubernetes device plugin that shares NVIDIA GPUs by
//! memory and compute. The design is in `src/DESIGN.md`; `main.rs` is the CLI.

// What main.rs, the stand-ins (gpu-sim, tests/sim), the tests and the
// benches use is `pub`; the rest is `pub(crate)`, so the dead-code lint
// sees what nobody uses.
#![warn(unreachable_pub)]

pub mod config;
pub mod extender;
pub mod kubectl;
#[cfg(test)]
mod layering;
pub mod net;
pub mod node;
pub mod rules;

/// The git revision the binary was built from ("unknown" without git).
pub(crate) const GIT_REVISION: &str = env!("GIT_REVISION");
/// `<crate version> (<git revision>)`, for `--version` and the logs.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("GIT_REVISION"), ")");

/// The kubelet's v1beta1 device-plugin API (messages, clients, servers).
pub mod api {
    /// The API version a plugin registers with and a kubelet accepts; it
    /// belongs to the proto, like the generated package name.
    pub const VERSION: &str = "v1beta1";

    include!(concat!(env!("OUT_DIR"), "/wire/v1beta1.rs"));

    /// The DevicePlugin server over our lazily encoded ListAndWatch list.
    // Generated code says `pub` throughout; only the crate uses it.
    #[allow(unreachable_pub)]
    pub(crate) mod lazy {
        include!(concat!(env!("OUT_DIR"), "/plugin/v1beta1.rs"));
    }
}
