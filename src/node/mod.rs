//! The node daemon: a supervised actor tree serving the kubelet through
//! device plugins and DRA, enforcing each grant, and answering `/metrics`
//! and `/readyz`.

pub mod app;
pub mod config_watch;
pub mod dra;
pub mod enforcement;
pub(crate) mod grant;
pub(crate) mod health;
pub(crate) mod http;
pub mod inspect;
pub(crate) mod inventory;
pub(crate) mod kubelet_watch;
pub mod matcher;
pub(crate) mod metrics;
pub mod plugin;
pub(crate) mod readiness;
pub(crate) mod supervisor;
pub(crate) mod usage;
