//! The `[dra]` config section: whether the daemon serves GPUs through
//! Dynamic Resource Allocation, under which driver name, where the kubelet's
//! plugin directories, the CDI specs and the checkpoint live, which GPUs DRA
//! serves (the device-plugin resources serve the rest), and whether shares
//! are published as consumable capacity.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::ConfigError;
use crate::rules::device::Gpu;

/// `dra.gpus = ["all"]`: every GPU of the node.
pub(crate) const ALL: &str = "all";
/// The checkpoint's file name in `state_dir`.
const CHECKPOINT_FILE: &str = "checkpoint.json";

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DraConfig {
    pub enabled: bool,
    /// The DRA driver name; empty: `gpu.<resource_domain>`.
    pub driver: String,
    /// The kubelet's plugin watcher directory: the registration socket
    /// `<driver>-reg.sock` is made here.
    pub plugins_registry_dir: PathBuf,
    /// The kubelet's plugin directory: the DRA service listens on
    /// `<plugins_dir>/<driver>/dra.sock`.
    pub plugins_dir: PathBuf,
    /// Where the container runtime reads CDI specs; one per prepared claim.
    pub cdi_dir: PathBuf,
    /// The daemon's own DRA state: the checkpoint of prepared claims.
    pub state_dir: PathBuf,
    /// The GPUs DRA serves: `["all"]`, or UUIDs and NVML indexes. The
    /// device-plugin resources serve the others.
    pub gpus: Vec<String>,
    /// Publish every GPU with `allowMultipleAllocations` and consumable
    /// `memory` and `cores` (Kubernetes 1.36+, or the
    /// DRAConsumableCapacity gate): claims share a GPU. Off: whole GPUs.
    pub consumable_capacity: bool,
}

impl Default for DraConfig {
    fn default() -> Self {
        DraConfig {
            enabled: false,
            driver: String::new(),
            plugins_registry_dir: "/var/lib/kubelet/plugins_registry".into(),
            plugins_dir: "/var/lib/kubelet/plugins".into(),
            cdi_dir: "/var/run/cdi".into(),
            state_dir: "/var/lib/gpu-device-plugin/dra".into(),
            gpus: vec![ALL.into()],
            consumable_capacity: true,
        }
    }
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: format!("dra.{key}"),
        reason: reason.into(),
    }
}

/// Which GPUs DRA serves, as the config says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GpuSelection {
    All,
    /// UUIDs and NVML indexes.
    Listed(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "config key `dra.gpus`: {0:?} names no GPU of this node (list UUIDs or NVML indexes it has, \
     or \"all\")"
)]
pub struct UnknownGpu(pub String);

impl GpuSelection {
    /// Splits the node's GPUs into DRA's and the device plugin's, each in
    /// the node's order.
    pub(crate) fn split(&self, gpus: Vec<Gpu>) -> Result<(Vec<Gpu>, Vec<Gpu>), UnknownGpu> {
        let GpuSelection::Listed(names) = self else {
            return Ok((gpus, Vec::new()));
        };
        let names_gpu = |n: &str, g: &Gpu| g.uuid == n || g.index.to_string() == n;
        if let Some(n) = names.iter().find(|n| !gpus.iter().any(|g| names_gpu(n, g))) {
            return Err(UnknownGpu(n.clone()));
        }
        Ok(gpus
            .into_iter()
            .partition(|g| names.iter().any(|n| names_gpu(n, g))))
    }
}

impl DraConfig {
    /// The driver name: the configured one, else `gpu.<domain>`.
    pub(crate) fn driver_name(&self, resource_domain: &str) -> String {
        if self.driver.is_empty() {
            format!("gpu.{resource_domain}")
        } else {
            self.driver.clone()
        }
    }

    pub(crate) fn selection(&self) -> GpuSelection {
        if self.gpus.iter().any(|g| g == ALL) {
            GpuSelection::All
        } else {
            GpuSelection::Listed(self.gpus.clone())
        }
    }

    /// Where the kubelet's plugin watcher finds the driver.
    pub(crate) fn registration_socket(&self, driver: &str) -> PathBuf {
        self.plugins_registry_dir.join(format!("{driver}-reg.sock"))
    }

    /// Where the kubelet calls NodePrepareResources.
    pub(crate) fn service_socket(&self, driver: &str) -> PathBuf {
        self.plugins_dir.join(driver).join("dra.sock")
    }

    pub(crate) fn checkpoint_file(&self) -> PathBuf {
        self.state_dir.join(CHECKPOINT_FILE)
    }

    /// Every rule a value alone decides; `resources_empty`: the config
    /// serves no device-plugin resource.
    pub(crate) fn validate(
        &self,
        resource_domain: &str,
        resources_empty: bool,
    ) -> Result<(), ConfigError> {
        if !self.enabled {
            return Ok(());
        }
        let driver = self.driver_name(resource_domain);
        validate_driver(&driver)?;
        for (key, path) in [
            ("plugins_registry_dir", &self.plugins_registry_dir),
            ("plugins_dir", &self.plugins_dir),
            ("cdi_dir", &self.cdi_dir),
            ("state_dir", &self.state_dir),
        ] {
            if !path.is_absolute() {
                return Err(invalid(
                    key,
                    format!("{:?} is not an absolute path", path.display()),
                ));
            }
        }
        for (key, socket) in [
            ("plugins_registry_dir", self.registration_socket(&driver)),
            ("plugins_dir", self.service_socket(&driver)),
        ] {
            socket_fits(key, &socket)?;
        }
        self.validate_gpus(resources_empty)
    }

    fn validate_gpus(&self, resources_empty: bool) -> Result<(), ConfigError> {
        if self.gpus.is_empty() {
            return Err(invalid(
                "gpus",
                "is empty; list the GPUs DRA serves (UUIDs or NVML indexes), or [\"all\"]",
            ));
        }
        for (i, g) in self.gpus.iter().enumerate() {
            if self.gpus[..i].contains(g) {
                return Err(invalid("gpus", format!("lists {g:?} twice")));
            }
            if g.is_empty() {
                return Err(invalid("gpus", "lists an empty name"));
            }
        }
        let all = self.gpus.iter().any(|g| g == ALL);
        if all && self.gpus.len() > 1 {
            return Err(invalid(
                "gpus",
                "lists \"all\" beside other GPUs; use [\"all\"] alone",
            ));
        }
        if all && !resources_empty {
            return Err(invalid(
                "gpus",
                "is [\"all\"], and `resources` serves device-plugin resources on the same \
                 GPUs; a GPU is served by one or the other: set resources = [] for a DRA-only \
                 node, or list DRA's GPUs here (the device plugin serves the rest)",
            ));
        }
        Ok(())
    }
}

/// A DRA driver name is a DNS subdomain of at most 63 characters (the
/// ResourceSlice's `spec.driver`).
fn validate_driver(d: &str) -> Result<(), ConfigError> {
    let labels_ok = d.split('.').all(|l| {
        !l.is_empty()
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    });
    if d.is_empty() || d.len() > 63 || !labels_ok {
        return Err(invalid(
            "driver",
            format!(
                "{d:?} is not a DNS subdomain of at most 63 characters (lowercase letters, \
                 digits, '-', '.'), as a DRA driver name must be"
            ),
        ));
    }
    Ok(())
}

fn socket_fits(key: &str, socket: &Path) -> Result<(), ConfigError> {
    let len = socket.as_os_str().len();
    if len > crate::net::uds::MAX_SOCKET_PATH {
        return Err(invalid(
            key,
            format!(
                "the socket path {} is {len} bytes, and a unix socket path holds at most {}; \
                 use a shorter directory (or driver name)",
                socket.display(),
                crate::net::uds::MAX_SOCKET_PATH
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{err_of, parse};

    const DRA_ONLY: &str = "resources = []\n[dra]\nenabled = true\n";

    #[test]
    fn defaults_and_derived_paths() {
        let c = parse(DRA_ONLY).unwrap();
        let d = &c.dra;
        let driver = d.driver_name(&c.resource_domain);
        assert_eq!(driver, "gpu.doslab.io");
        assert_eq!(
            d.registration_socket(&driver),
            Path::new("/var/lib/kubelet/plugins_registry/gpu.doslab.io-reg.sock")
        );
        assert_eq!(
            d.service_socket(&driver),
            Path::new("/var/lib/kubelet/plugins/gpu.doslab.io/dra.sock")
        );
        assert_eq!(d.cdi_dir, Path::new("/var/run/cdi"));
        assert_eq!(d.selection(), GpuSelection::All);
        assert!(d.consumable_capacity);
        // Off by default, and then nothing of it is checked.
        let c = parse("[dra]\ngpus = []").unwrap();
        assert!(!c.dra.enabled);
    }

    #[test]
    fn bad_values_name_their_key() {
        let with = |extra: &str| err_of(&format!("{DRA_ONLY}{extra}"));
        assert!(with("driver = \"GPU.x\"").contains("dra.driver"));
        assert!(with(&format!("driver = \"{}.io\"", "a".repeat(61))).contains("dra.driver"));
        assert!(with("cdi_dir = \"cdi\"").contains("dra.cdi_dir"));
        assert!(with("state_dir = \"\"").contains("dra.state_dir"));
        assert!(with("gpus = []").contains("dra.gpus"));
        assert!(with("gpus = [\"0\", \"0\"]").contains("twice"));
        assert!(with("gpus = [\"all\", \"0\"]").contains("alone"));
        assert!(with("plugins = \"/x\"").contains("plugins"));
        let long = format!("plugins_dir = \"/{}\"", "p".repeat(90));
        assert!(with(&long).contains("dra.plugins_dir"), "{}", with(&long));
        // A node without device-plugin resources must serve DRA.
        assert!(err_of("resources = []").contains("resources"));
    }

    /// A GPU is served by DRA or by the device plugin, never both.
    #[test]
    fn dra_and_the_device_plugin_never_share_a_gpu() {
        let e = err_of("[dra]\nenabled = true");
        assert!(
            e.contains("dra.gpus") && e.contains("resources = []"),
            "{e}"
        );
        parse("[dra]\nenabled = true\ngpus = [\"1\"]").unwrap();
        let gpu = |uuid: &str, index| Gpu {
            uuid: uuid.into(),
            memory_mib: 1,
            index,
            numa_node: None,
        };
        let gpus = vec![gpu("GPU-a", 0), gpu("GPU-b", 1), gpu("GPU-c", 2)];
        let listed = GpuSelection::Listed(vec!["GPU-c".into(), "0".into()]);
        let (dra, rest) = listed.split(gpus.clone()).unwrap();
        assert_eq!(dra, vec![gpus[0].clone(), gpus[2].clone()]);
        assert_eq!(rest, vec![gpus[1].clone()]);
        let (dra, rest) = GpuSelection::All.split(gpus.clone()).unwrap();
        assert_eq!((dra.len(), rest.len()), (3, 0));
        let missing = GpuSelection::Listed(vec!["GPU-z".into()]);
        assert_eq!(missing.split(gpus).unwrap_err(), UnknownGpu("GPU-z".into()));
    }
}
