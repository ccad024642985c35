//! The TOML config: schema, defaults and validation, and the values the
//! domain takes from it ([`Offer`], [`GpuSource`]); nothing here computes.
//!
//! Every key has a default, so an empty file is a valid config. Unknown keys
//! are refused by serde; every other rule is checked in [`Config::validate`]
//! so that the message names the key and says what would be accepted.
//! The 4 MiB ListAndWatch check needs the real GPUs and lives in
//! `device::plan`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

pub mod dra;
pub mod enforcement;
mod http;
use crate::rules::device::{Gpu, GpuSource, Offer, Resource, Units, UnitsError};
pub use http::HttpConfig;
pub(crate) use http::{DAEMON_LIMITS, EXTENDER_LIMITS};

/// The config a node runs when nothing else is said: the in-cluster default.
pub const DEFAULT_TOML: &str = include_str!("../../config/gpu-device-plugin.toml");

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config is not valid TOML for this plugin: {0}")]
    Parse(String),
    #[error("config key `{key}`: {reason}")]
    Invalid { key: String, reason: String },
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub resource_domain: String,
    pub device_plugin_dir: PathBuf,
    pub resources: Vec<Resource>,
    pub memory_unit_mib: u64,
    pub cores_per_gpu: u32,
    pub pod_matching: bool,
    /// Empty means "take `$NODE_NAME`", resolved by [`Config::parse`].
    pub node_name: String,
    pub log_format: LogFormat,
    /// `/metrics`, `/healthz`, `/readyz`; empty turns the endpoint off.
    pub http_listen: String,
    /// The endpoint's bounds (`DAEMON_LIMITS` by default).
    pub http: HttpConfig,
    /// Reload when the config file's content changes (a ConfigMap edit
    /// reaching the node), as on SIGHUP.
    pub watch_config: bool,
    pub devices: Devices,
    pub health: Health,
    pub usage: Usage,
    pub matcher: Matcher,
    pub allocate: AllocateExtras,
    pub enforcement: enforcement::EnforcementConfig,
    pub dra: dra::DraConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            resource_domain: "doslab.io".into(),
            device_plugin_dir: "/var/lib/kubelet/device-plugins".into(),
            resources: vec![Resource::GpuMemory, Resource::GpuCore, Resource::GpuCount],
            memory_unit_mib: 1,
            cores_per_gpu: 100,
            pod_matching: true,
            node_name: String::new(),
            log_format: LogFormat::Text,
            http_listen: "0.0.0.0:9446".into(),
            http: HttpConfig::default(),
            watch_config: true,
            devices: Devices::default(),
            health: Health::default(),
            usage: Usage::default(),
            matcher: Matcher::default(),
            allocate: AllocateExtras::default(),
            enforcement: Default::default(),
            dra: Default::default(),
        }
    }
}

/// GPU health checks (see `health`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Health {
    /// How often every GPU is checked.
    pub(crate) poll_ms: u64,
    /// How long an unhealthy GPU must pass every check to be Healthy again.
    pub(crate) recovery_ms: u64,
    /// Mock backend only: a file named after a GPU's UUID in this directory
    /// makes that GPU fail its checks. Empty: mock GPUs are always healthy.
    pub(crate) mock_dir: PathBuf,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            poll_ms: 1000,
            recovery_ms: 60_000,
            mock_dir: PathBuf::new(),
        }
    }
}

/// What each share uses, from the driver (see `usage`), with pod matching
/// or DRA.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Usage {
    /// How often each GPU's processes are read; 0 turns it off.
    pub(crate) poll_ms: u64,
    /// The host's `/proc` as the daemon sees it: each process's cgroup
    /// names its pod and container. The driver reports host PIDs, so this
    /// is the host's (the DaemonSet mounts it read-only), not the daemon's
    /// own; a daemon outside a container says `/proc`.
    pub(crate) proc_root: PathBuf,
    /// Mock backend only: `<uuid>.procs` in this directory lists that
    /// GPU's processes, one a line, `pid memory_bytes sm_percent` (`-` for
    /// a figure the driver would not give).
    pub(crate) mock_dir: PathBuf,
}

impl Default for Usage {
    fn default() -> Self {
        Usage {
            poll_ms: 5000,
            proc_root: "/host/proc".into(),
            mock_dir: PathBuf::new(),
        }
    }
}

/// Pod matching (see `matcher`), with `pod_matching = true`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Matcher {
    /// How long an Allocate waits for its pod to reach the pod cache (and
    /// for the cache's first sync, and for an API server that fails).
    pub wait_ms: u64,
    /// A kubeconfig file for the API server; empty: `$KUBECONFIG`, else the
    /// in-cluster service account.
    pub kubeconfig: PathBuf,
    /// Withdraw (list as unhealthy) the devices the kubelet could not use
    /// anyway while a GPU's exclusivity holds: gpu-memory and gpu-core of a
    /// GPU held whole, gpu-count of a GPU carrying shared work. Node
    /// allocatable then says what can really be admitted.
    pub(crate) withdraw_exclusive: bool,
}

impl Default for Matcher {
    fn default() -> Self {
        Matcher {
            wait_ms: 10_000,
            kubeconfig: PathBuf::new(),
            withdraw_exclusive: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Devices {
    pub(crate) backend: Backend,
    pub(crate) mock: Vec<MockGpu>,
    /// Where sysfs is mounted: the GPUs' PCIe roots, and their NUMA nodes
    /// where the driver does not say.
    pub(crate) sysfs_root: PathBuf,
}

impl Default for Devices {
    fn default() -> Self {
        Devices {
            backend: Backend::Nvml,
            mock: Vec::new(),
            sysfs_root: "/sys".into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Backend {
    Nvml,
    Mock,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MockGpu {
    pub(crate) uuid: String,
    pub(crate) memory_mib: u64,
    #[serde(default)]
    pub(crate) numa_node: Option<u32>,
    /// Where it sits on PCI (`0000:3b:00.0`), for DRA's standard attributes.
    #[serde(default)]
    pub(crate) pci_bus_id: Option<String>,
}

/// What operators add to every Allocate response, beside the envs the
/// plugin computes per allocation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AllocateExtras {
    pub(crate) envs: BTreeMap<String, String>,
    pub(crate) mounts: Vec<MountConfig>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MountConfig {
    pub(crate) host_path: PathBuf,
    pub(crate) container_path: PathBuf,
    #[serde(default)]
    pub(crate) read_only: bool,
}

/// The domain of every resource and annotation name: a DNS subdomain
/// outside Kubernetes' own. Reported under `resource_domain`.
pub(crate) fn validate_resource_domain(d: &str) -> Result<(), ConfigError> {
    let ok_chars = d
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
    if d.is_empty() || d.len() > 253 || !ok_chars || d.starts_with(['-', '.']) {
        return Err(invalid(
            "resource_domain",
            format!("{d:?} is not a DNS subdomain (lowercase letters, digits, '-', '.')"),
        ));
    }
    // The kubelet refuses any resource name containing "kubernetes.io/".
    if format!("{d}/").contains("kubernetes.io/") {
        return Err(invalid(
            "resource_domain",
            format!("{d:?} is reserved by Kubernetes; use your own domain"),
        ));
    }
    Ok(())
}

/// Envs the plugin computes per allocation; an operator value would make a
/// container's limits lie, so the config may not set them.
const RESERVED_ENVS: &[&str] = &[
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_DEVICE_MEMORY_LIMIT_0",
    "CUDA_DEVICE_SM_LIMIT",
    "GPU_CORE_UTILIZATION_POLICY",
];

impl Config {
    /// Reads and validates a config file; `node_name` falls back to
    /// `$NODE_NAME`, but is not required here: `check-config` runs off the
    /// node too, where `$NODE_NAME` is not set (see
    /// [`Config::require_node_name`]).
    pub fn read(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::parse(&text, std::env::var("NODE_NAME").ok())
    }

    /// Parses and validates; `env_node_name` is `$NODE_NAME`, passed in so
    /// tests do not depend on the environment.
    pub fn from_toml(text: &str, env_node_name: Option<String>) -> Result<Config, ConfigError> {
        let config = Config::parse(text, env_node_name)?;
        config.require_node_name()?;
        Ok(config)
    }

    /// [`Config::from_toml`] without requiring a node name.
    pub fn parse(text: &str, env_node_name: Option<String>) -> Result<Config, ConfigError> {
        let mut config: Config =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        if config.node_name.is_empty() {
            config.node_name = env_node_name.unwrap_or_default();
        }
        config.validate()?;
        Ok(config)
    }

    /// Pod matching watches this node's pods, and DRA publishes the node's
    /// pool, so either needs the node's name.
    pub fn require_node_name(&self) -> Result<(), ConfigError> {
        if self.pod_matching && self.node_name.is_empty() {
            return Err(invalid(
                "node_name",
                "is empty and $NODE_NAME is not set; pod_matching needs the node's name \
                 (set NODE_NAME from the downward API, or pod_matching = false)",
            ));
        }
        if self.dra.enabled && self.node_name.is_empty() {
            return Err(invalid(
                "node_name",
                "is empty and $NODE_NAME is not set; DRA publishes the node's ResourceSlices \
                 under its name (set NODE_NAME from the downward API)",
            ));
        }
        Ok(())
    }

    /// Every rule a value alone decides (the node's name aside, see
    /// [`Config::require_node_name`]).
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        validate_resource_domain(&self.resource_domain)?;
        self.validate_resources()?;
        self.validate_socket_paths()?;
        self.enforcement.validate()?;
        self.dra
            .validate(&self.resource_domain, self.resources.is_empty())?;
        self.units().check().map_err(|e| match e {
            UnitsError::MemoryUnitZero => invalid(
                "memory_unit_mib",
                "must be at least 1 (MiB per gpu-memory device)",
            ),
            UnitsError::CoresNotDividing100(cores) => invalid(
                "cores_per_gpu",
                format!(
                    "is {cores}; it must divide 100 (1, 2, 4, 5, 10, 20, 25, 50 or 100) so that \
                     every grant is a whole percent for CUDA_DEVICE_SM_LIMIT"
                ),
            ),
        })?;
        if !self.http_listen.is_empty() && self.http_listen.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(invalid(
                "http_listen",
                format!(
                    "{:?} is not an address:port like \"0.0.0.0:9446\" (empty turns it off)",
                    self.http_listen
                ),
            ));
        }
        self.http.validate("http", &DAEMON_LIMITS)?;
        self.validate_devices()?;
        if self.health.poll_ms < 10 {
            return Err(invalid(
                "health.poll_ms",
                "must be at least 10 (milliseconds)",
            ));
        }
        if !(100..=120_000).contains(&self.matcher.wait_ms) {
            return Err(invalid(
                "matcher.wait_ms",
                "must be between 100 and 120000 (milliseconds); the kubelet gives up on an \
                 Allocate after 2 minutes",
            ));
        }
        for (key, dir) in [
            ("health.mock_dir", &self.health.mock_dir),
            ("usage.mock_dir", &self.usage.mock_dir),
        ] {
            if !dir.as_os_str().is_empty() && self.devices.backend != Backend::Mock {
                return Err(invalid(
                    key,
                    "is only read with devices.backend = \"mock\"; remove it",
                ));
            }
        }
        if self.usage.poll_ms != 0 && self.usage.poll_ms < 100 {
            return Err(invalid(
                "usage.poll_ms",
                "must be 0 (off) or at least 100 (milliseconds)",
            ));
        }
        if self.usage.proc_root.is_relative() {
            return Err(invalid("usage.proc_root", "must be an absolute path"));
        }
        self.validate_allocate()
    }

    /// The kernel cannot bind a unix socket whose path does not fit
    /// `sun_path`; caught here, a plugin would fail to bind on every restart.
    fn validate_socket_paths(&self) -> Result<(), ConfigError> {
        if self.device_plugin_dir.as_os_str().is_empty() {
            return Err(invalid(
                "device_plugin_dir",
                "is empty; the kubelet's is /var/lib/kubelet/device-plugins",
            ));
        }
        for &r in &self.resources {
            let socket = self.device_plugin_dir.join(self.endpoint(r));
            let len = socket.as_os_str().len();
            if len > crate::net::uds::MAX_SOCKET_PATH {
                return Err(invalid(
                    "device_plugin_dir",
                    format!(
                        "the socket path {} is {len} bytes, and a unix socket path holds at \
                         most {}; use a shorter device_plugin_dir (or resource_domain)",
                        socket.display(),
                        crate::net::uds::MAX_SOCKET_PATH
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_resources(&self) -> Result<(), ConfigError> {
        if self.resources.is_empty() && !self.dra.enabled {
            return Err(invalid(
                "resources",
                "is empty; enable at least one of \"gpu-memory\", \"gpu-core\", \"gpu-count\" \
                 (or serve the GPUs through DRA: [dra] enabled = true)",
            ));
        }
        for (i, r) in self.resources.iter().enumerate() {
            if self.resources[..i].contains(r) {
                return Err(invalid("resources", format!("lists {:?} twice", r.name())));
            }
        }
        Ok(())
    }

    fn validate_devices(&self) -> Result<(), ConfigError> {
        let mock = &self.devices.mock;
        match self.devices.backend {
            Backend::Nvml if !mock.is_empty() => {
                return Err(invalid(
                    "devices.mock",
                    "is only read with devices.backend = \"mock\"; remove it or switch backend",
                ));
            }
            Backend::Mock if mock.is_empty() => {
                return Err(invalid(
                    "devices.mock",
                    "backend is \"mock\" but no [[devices.mock]] GPU is listed",
                ));
            }
            _ => {}
        }
        if !self.devices.sysfs_root.is_absolute() {
            return Err(invalid(
                "devices.sysfs_root",
                format!(
                    "{} is not an absolute path (sysfs is mounted at /sys)",
                    self.devices.sysfs_root.display()
                ),
            ));
        }
        for (i, gpu) in mock.iter().enumerate() {
            let key = format!("devices.mock[{i}].uuid");
            crate::rules::device::validate_uuid(&gpu.uuid)
                .map_err(|reason| invalid(&key, reason.to_string()))?;
            if mock[..i].iter().any(|g| g.uuid == gpu.uuid) {
                return Err(invalid(key, format!("{:?} is listed twice", gpu.uuid)));
            }
            if gpu.memory_mib == 0 {
                return Err(invalid(
                    format!("devices.mock[{i}].memory_mib"),
                    "must be at least 1",
                ));
            }
            if let Some(bus) = &gpu.pci_bus_id {
                let key = format!("devices.mock[{i}].pci_bus_id");
                let Some(normal) = crate::rules::device::pci_bus_id(bus) else {
                    return Err(invalid(
                        key,
                        format!("{bus:?} is not a PCI bus ID like \"0000:3b:00.0\""),
                    ));
                };
                let same = |g: &MockGpu| {
                    g.pci_bus_id
                        .as_deref()
                        .and_then(crate::rules::device::pci_bus_id)
                        == Some(normal.clone())
                };
                if mock[..i].iter().any(same) {
                    return Err(invalid(key, format!("{bus:?} is listed twice")));
                }
            }
        }
        Ok(())
    }

    fn validate_allocate(&self) -> Result<(), ConfigError> {
        let own_envs = self
            .resources
            .iter()
            .map(|r| self.amount_env(*r))
            .collect::<Vec<_>>();
        for key in self.allocate.envs.keys() {
            let valid = !key.is_empty()
                && !key.starts_with(|c: char| c.is_ascii_digit())
                && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(invalid(
                    format!("allocate.envs.{key}"),
                    "is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
                ));
            }
            if RESERVED_ENVS.contains(&key.as_str()) || own_envs.contains(key) {
                return Err(invalid(
                    format!("allocate.envs.{key}"),
                    "is set by the plugin from each allocation; remove it",
                ));
            }
        }
        for (i, m) in self.allocate.mounts.iter().enumerate() {
            for (name, p) in [
                ("host_path", &m.host_path),
                ("container_path", &m.container_path),
            ] {
                if !p.is_absolute() {
                    return Err(invalid(
                        format!("allocate.mounts[{i}].{name}"),
                        format!("{} is not an absolute path", p.display()),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The size of one device of each resource.
    pub fn units(&self) -> Units {
        Units {
            memory_unit_mib: self.memory_unit_mib,
            cores_per_gpu: self.cores_per_gpu,
        }
    }

    /// What this node advertises.
    pub fn offer(&self) -> Offer {
        Offer {
            resources: self.resources.clone(),
            units: self.units(),
        }
    }

    /// `doslab.io/gpu-memory`.
    pub fn resource_name(&self, r: Resource) -> String {
        format!("{}/{}", self.resource_domain, r.name())
    }

    /// The env carrying a grant's amount, e.g. `DOSLAB_IO_GPU_MEMORY`.
    pub(crate) fn amount_env(&self, r: Resource) -> String {
        format!("{}/{}", self.resource_domain, r.name())
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_uppercase()
                } else {
                    '_'
                }
            })
            .collect()
    }

    /// The socket file a resource's plugin serves on, inside `device_plugin_dir`.
    pub(crate) fn endpoint(&self, r: Resource) -> String {
        format!("{}-{}.sock", self.resource_domain, r.name())
    }

    pub(crate) fn kubelet_socket(&self) -> PathBuf {
        self.device_plugin_dir.join("kubelet.sock")
    }
}

impl From<&Config> for Offer {
    fn from(config: &Config) -> Offer {
        config.offer()
    }
}

/// The mock backend's GPUs carry their list position as their index.
impl From<&Config> for GpuSource {
    fn from(config: &Config) -> GpuSource {
        let devices = &config.devices;
        let sysfs_root = devices.sysfs_root.clone();
        match devices.backend {
            Backend::Nvml => GpuSource::Nvml { sysfs_root },
            Backend::Mock => GpuSource::Listed {
                gpus: devices
                    .mock
                    .iter()
                    .zip(0..)
                    .map(|(m, index)| Gpu {
                        uuid: m.uuid.clone(),
                        memory_mib: m.memory_mib,
                        index,
                        numa_node: m.numa_node,
                    })
                    .collect(),
                // Validated: every one listed is a bus ID.
                pci_bus_ids: devices
                    .mock
                    .iter()
                    .filter_map(|m| {
                        let bus = crate::rules::device::pci_bus_id(m.pci_bus_id.as_deref()?)?;
                        Some((m.uuid.clone(), bus))
                    })
                    .collect(),
                sysfs_root,
            },
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The config of `text` on node `node-a`.
    pub(crate) fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, Some("node-a".into()))
    }

    /// Why `text` is refused.
    pub(crate) fn err_of(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn empty_file_gives_the_documented_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.resource_domain, "doslab.io");
        assert_eq!(
            c.device_plugin_dir,
            PathBuf::from("/var/lib/kubelet/device-plugins")
        );
        assert_eq!(
            c.resources,
            vec![Resource::GpuMemory, Resource::GpuCore, Resource::GpuCount]
        );
        assert_eq!(c.memory_unit_mib, 1);
        assert_eq!(c.cores_per_gpu, 100);
        assert!(c.pod_matching);
        assert_eq!(c.node_name, "node-a");
        assert_eq!(c.devices.backend, Backend::Nvml);
        assert_eq!(c.health, Health::default());
    }

    #[test]
    fn health_keys_are_checked() {
        assert!(err_of("[health]\npoll_ms = 1").contains("health.poll_ms"));
        assert!(err_of("[usage]\npoll_ms = 10").contains("usage.poll_ms"));
        assert!(err_of("[usage]\nproc_root = \"proc\"").contains("usage.proc_root"));
        assert!(err_of("[usage]\nmock_dir = \"/u\"").contains("usage.mock_dir"));
        assert!(err_of("[health]\nmock_dir = \"/x\"").contains("health.mock_dir"));
        assert!(err_of("[health]\npoll = 5").contains("poll"));
        assert!(err_of("[matcher]\nwait_ms = 5").contains("matcher.wait_ms"));
        assert!(err_of("[matcher]\nwait = 5").contains("wait"));
        assert!(err_of("[http]\nmax_connections = 0").contains("`http.max_connections`"));
        // The core policy comes from [enforcement]; an env could undo it.
        let e = err_of("[allocate.envs]\nGPU_CORE_UTILIZATION_POLICY = \"default\"");
        assert!(
            e.contains("allocate.envs.GPU_CORE_UTILIZATION_POLICY"),
            "{e}"
        );
        assert!(err_of("[http]\nidle_timeout_ms = 10").contains("`http.idle_timeout_ms`"));
        assert!(err_of("[http]\nmax_body = 5").contains("max_body"));
        let c = parse("[http]\nheader_timeout_ms = 900").unwrap();
        let limits = c.http.limits(&DAEMON_LIMITS);
        assert_eq!(limits.header_timeout, std::time::Duration::from_millis(900));
        assert_eq!(limits.max_body_bytes, DAEMON_LIMITS.max_body_bytes);
    }

    #[test]
    fn shipped_configs_are_valid() {
        parse(DEFAULT_TOML).unwrap();
        let demo = parse(include_str!("../../config/demo.toml")).unwrap();
        assert_eq!(demo.devices.backend, Backend::Mock);
        let local = include_str!("../../config/local-mock.toml");
        parse(local).unwrap();
    }

    #[test]
    fn explicit_node_name_beats_the_environment() {
        let c = parse("node_name = \"n1\"").unwrap();
        assert_eq!(c.node_name, "n1");
    }

    #[test]
    fn unknown_keys_are_named() {
        assert!(err_of("memory_unit = 2").contains("memory_unit"));
        assert!(err_of("[devices]\nbakend = \"mock\"").contains("bakend"));
    }

    #[test]
    fn bad_values_name_their_key() {
        assert!(err_of("memory_unit_mib = 0").contains("memory_unit_mib"));
        assert!(err_of("cores_per_gpu = 30").contains("cores_per_gpu"));
        assert!(err_of("cores_per_gpu = 200").contains("cores_per_gpu"));
        assert!(err_of("resources = []").contains("resources"));
        assert!(err_of("resources = [\"gpu-core\", \"gpu-core\"]").contains("twice"));
        assert!(err_of("resources = [\"gpu-mem\"]").contains("gpu-mem"));
        assert!(err_of("resource_domain = \"Doslab.IO\"").contains("resource_domain"));
        assert!(err_of("resource_domain = \"kubernetes.io\"").contains("reserved"));
        assert!(err_of("resource_domain = \"x.kubernetes.io\"").contains("reserved"));
        assert!(err_of("device_plugin_dir = \"\"").contains("device_plugin_dir"));
        assert!(err_of("http_listen = \"9446\"").contains("http_listen"));
        assert!(err_of("[devices]\nbackend = \"cuda\"").contains("cuda"));
    }

    #[test]
    fn pod_matching_needs_a_node_name() {
        let e = Config::from_toml("", None).unwrap_err().to_string();
        assert!(e.contains("node_name") && e.contains("NODE_NAME"), "{e}");
        Config::from_toml("pod_matching = false", None).unwrap();
        // Every other rule still holds without one.
        let c = Config::parse("", None).unwrap();
        assert!(c.require_node_name().is_err());
        assert!(
            Config::parse("memory_unit_mib = 0", None)
                .unwrap_err()
                .to_string()
                .contains("memory_unit_mib")
        );
    }

    #[test]
    fn a_socket_path_the_kernel_cannot_bind_is_refused() {
        // "/" + 81 bytes + "/doslab.io-gpu-memory.sock" (26 bytes) = 108 bytes.
        let long = format!("device_plugin_dir = \"/{}\"", "d".repeat(81));
        let e = err_of(&long);
        assert!(
            e.contains("device_plugin_dir") && e.contains("108 bytes"),
            "{e}"
        );
        // One byte shorter fits: 107 is the most a path can take.
        parse(&format!("device_plugin_dir = \"/{}\"", "d".repeat(80))).unwrap();
        // The longest endpoint decides: gpu-core's is 2 bytes shorter.
        parse(&format!(
            "device_plugin_dir = \"/{}\"\nresources = [\"gpu-core\"]",
            "d".repeat(81)
        ))
        .unwrap();
    }

    #[test]
    fn mock_devices_are_checked() {
        assert!(err_of("[devices]\nbackend = \"mock\"").contains("devices.mock"));
        let nvml_with_mock = "[[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 10";
        assert!(err_of(nvml_with_mock).contains("devices.mock"));
        let dup = "[devices]\nbackend = \"mock\"\n[[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 10\n[[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 10";
        assert!(err_of(dup).contains("devices.mock[1].uuid"));
        let zero =
            "[devices]\nbackend = \"mock\"\n[[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 0";
        assert!(err_of(zero).contains("devices.mock[0].memory_mib"));
        let long = format!(
            "[devices]\nbackend = \"mock\"\n[[devices.mock]]\nuuid = \"{}\"\nmemory_mib = 1",
            "a".repeat(64)
        );
        assert!(err_of(&long).contains("devices.mock[0].uuid"));
        let bus = |a: &str, b: &str| {
            format!(
                "[devices]\nbackend = \"mock\"\n[[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 1\npci_bus_id = \"{a}\"\n[[devices.mock]]\nuuid = \"GPU-b\"\nmemory_mib = 1\npci_bus_id = \"{b}\""
            )
        };
        let e = err_of(&bus("0000:3b:00.0", "3b:00.0"));
        assert!(e.contains("devices.mock[1].pci_bus_id"), "{e}");
        // NVML's form and the standard one name the same device.
        let e = err_of(&bus("0000:3b:00.0", "00000000:3B:00.0"));
        assert!(
            e.contains("devices.mock[1].pci_bus_id") && e.contains("twice"),
            "{e}"
        );
        assert!(err_of("[devices]\nsysfs_root = \"sys\"").contains("devices.sysfs_root"));
    }

    #[test]
    fn the_sysfs_root_and_mock_bus_ids_reach_the_gpu_source() {
        assert_eq!(
            GpuSource::from(&parse("").unwrap()),
            GpuSource::Nvml {
                sysfs_root: "/sys".into()
            }
        );
        let c = parse(
            "[devices]\nbackend = \"mock\"\nsysfs_root = \"/host/sys\"\n[[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 1\npci_bus_id = \"00000000:3B:00.0\"\n[[devices.mock]]\nuuid = \"GPU-b\"\nmemory_mib = 1",
        )
        .unwrap();
        let GpuSource::Listed {
            gpus,
            pci_bus_ids,
            sysfs_root,
        } = GpuSource::from(&c)
        else {
            panic!("the mock backend lists its GPUs");
        };
        assert_eq!(gpus.len(), 2);
        // Normalised to the standard form; GPU-b names none.
        assert_eq!(
            pci_bus_ids,
            BTreeMap::from([("GPU-a".to_owned(), "0000:3b:00.0".to_owned())])
        );
        assert_eq!(sysfs_root, PathBuf::from("/host/sys"));
    }

    #[test]
    fn operator_envs_and_mounts_are_checked() {
        let ok = "[allocate]\nenvs = { NVIDIA_DRIVER_CAPABILITIES = \"all\", FOO_1 = \"x\" }\n[[allocate.mounts]]\nhost_path = \"/a\"\ncontainer_path = \"/b\"";
        let c = parse(ok).unwrap();
        assert_eq!(c.allocate.envs["FOO_1"], "x");
        assert!(err_of("[allocate]\nenvs = { \"1X\" = \"y\" }").contains("allocate.envs.1X"));
        assert!(
            err_of("[allocate]\nenvs = { NVIDIA_VISIBLE_DEVICES = \"all\" }")
                .contains("set by the plugin")
        );
        assert!(
            err_of("[allocate]\nenvs = { DOSLAB_IO_GPU_CORE = \"5\" }")
                .contains("set by the plugin")
        );
        let rel = "[[allocate.mounts]]\nhost_path = \"a\"\ncontainer_path = \"/b\"";
        assert!(err_of(rel).contains("allocate.mounts[0].host_path"));
    }

    #[test]
    fn derived_names() {
        let c = parse("resource_domain = \"example.com\"").unwrap();
        assert_eq!(c.resource_name(Resource::GpuCore), "example.com/gpu-core");
        assert_eq!(c.amount_env(Resource::GpuMemory), "EXAMPLE_COM_GPU_MEMORY");
        assert_eq!(c.endpoint(Resource::GpuCount), "example.com-gpu-count.sock");
    }

    #[test]
    fn mock_backend_lists_the_configured_gpus_in_order() {
        let c = parse(include_str!("../../config/demo.toml")).unwrap();
        let gpus = crate::rules::device::discover(&c).unwrap();
        assert_eq!(gpus.len(), c.devices.mock.len());
        for (i, (g, m)) in gpus.iter().zip(&c.devices.mock).enumerate() {
            assert_eq!(
                (g.uuid.as_str(), g.memory_mib, g.index as usize),
                (m.uuid.as_str(), m.memory_mib, i)
            );
        }
    }
}
