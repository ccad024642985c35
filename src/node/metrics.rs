//! The daemon's series for `/metrics`, on the Prometheus project's own
//! client (`prometheus-client`: types, escaping and the OpenMetrics text
//! come from it).
//!
//! Series come two ways:
//! - counted as things happen, in the library's typed counters, gauges and
//!   histograms: process-wide ones registered once in the [`Registry`],
//!   per-resource ones in that resource's [`ResourceMetrics`];
//! - read at scrape time by [`Scraped`], the registry's collector: the
//!   per-resource series of the resources enabled now (a reload that
//!   switches one off drops its series), the plugin's open streams, and
//!   what its owners replace whole (each GPU's capacity and usage,
//!   enforcement's and the config's series), so a scrape never sees half of
//!   an update.
//!
//! One [`ResourceMetrics`] per resource, created by the supervisor and kept
//! across plugin restarts, so counters accumulate. A resource is ready when
//! registered and streaming; the other parts' readiness is
//! [`crate::node::readiness`]'s.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::node::readiness::Child;
use crate::rules::matching::pods::PodKey;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeMetric, LabelSetEncoder, MetricEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Every series' name starts with it.
const PREFIX: &str = "gpu_device_plugin";

/// RPC latency buckets, in seconds.
const BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// A gauge of a count (devices, bytes): never negative.
type Level = Gauge<u64, AtomicU64>;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    git: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct VerbLabels {
    verb: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReloadLabels {
    /// `applied` or `refused`.
    result: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ChildLabels {
    child: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResourceLabels {
    resource: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RpcLabels {
    resource: String,
    rpc: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct FailureLabels {
    resource: String,
    rpc: &'static str,
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ConfigLabels {
    sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ModeLabels {
    gpu: String,
    mode: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BackendLabels {
    gpu: String,
    backend: &'static str,
}

/// One container on one GPU: the labels every per-share series carries,
/// so dashboards join granted and used on them. A DRA share adds its
/// ResourceClaim; its grant is the claim's, shared by the containers that
/// name it, so it carries no container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ContainerLabels {
    pub(crate) namespace: String,
    pub(crate) pod: String,
    pub(crate) container: String,
    /// The GPU's UUID.
    pub(crate) gpu: String,
    /// The ResourceClaim's name (DRA); empty for the device plugin's.
    pub(crate) claim: String,
}

impl ContainerLabels {
    pub(crate) fn new(pod: &PodKey, container: &str, gpu: &str) -> ContainerLabels {
        ContainerLabels {
            namespace: pod.namespace.clone(),
            pod: pod.name.clone(),
            container: container.to_owned(),
            gpu: gpu.to_owned(),
            claim: String::new(),
        }
    }

    /// The same share, through ResourceClaim `claim`.
    pub(crate) fn in_claim(mut self, claim: &str) -> ContainerLabels {
        self.claim = claim.to_owned();
        self
    }
}

/// `claim` only where there is one. `container` always, even empty (a
/// claim's grant): a scrape that honours the series' labels adds the
/// target's own `container` (the daemon's) to a series without one, and
/// an empty one stops that, then goes on ingestion.
impl EncodeLabelSet for ContainerLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> fmt::Result {
        let mut labels = vec![
            ("namespace", self.namespace.as_str()),
            ("pod", &self.pod),
            ("container", &self.container),
            ("gpu", &self.gpu),
        ];
        if !self.claim.is_empty() {
            labels.push(("claim", &self.claim));
        }
        labels.encode(encoder)
    }
}

/// The two RPCs that do work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Rpc {
    Allocate,
    PreferredAllocation,
}

impl Rpc {
    const ALL: [Rpc; 2] = [Rpc::Allocate, Rpc::PreferredAllocation];

    fn name(self) -> &'static str {
        match self {
            Rpc::Allocate => "allocate",
            Rpc::PreferredAllocation => "get_preferred_allocation",
        }
    }
}

/// One RPC's calls, latency and refusals, of one resource.
#[derive(Debug)]
pub(crate) struct RpcMetrics {
    calls: Counter,
    latency: Histogram,
    /// Refusals by reason; a reason shows once it happened.
    failures: Mutex<BTreeMap<&'static str, u64>>,
}

impl Default for RpcMetrics {
    fn default() -> Self {
        RpcMetrics {
            calls: Counter::default(),
            latency: Histogram::new(BUCKETS),
            failures: Mutex::default(),
        }
    }
}

impl RpcMetrics {
    pub(crate) fn record(&self, took: Duration, failure: Option<&'static str>) {
        self.calls.inc();
        self.latency.observe(took.as_secs_f64());
        if let Some(reason) = failure {
            *self
                .failures
                .lock()
                .expect("metrics lock")
                .entry(reason)
                .or_default() += 1;
        }
    }
}

/// What one resource's plugin reports.
#[derive(Debug, Default)]
pub(crate) struct ResourceMetrics {
    devices: Level,
    healthy: Level,
    /// 1 while registered with the current kubelet.
    registered: Level,
    registrations: Counter,
    /// Registrations after the first (kubelet restarts, reloads, repairs).
    reregistrations: Counter,
    lists_sent: Counter,
    list_bytes: Level,
    allocate: RpcMetrics,
    preferred: RpcMetrics,
    /// How many ListAndWatch streams the running plugin has open: the
    /// plugin owns the count and hands over how to read it at start
    /// ([`ResourceMetrics::read_streams`]); none open until then.
    streams: RwLock<Option<StreamCount>>,
}

/// Reads a plugin's open-stream count (the plugin owns it).
struct StreamCount(Box<dyn Fn() -> usize + Send + Sync>);

impl fmt::Debug for StreamCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StreamCount({})", (self.0)())
    }
}

impl ResourceMetrics {
    pub(crate) fn rpc(&self, rpc: Rpc) -> &RpcMetrics {
        match rpc {
            Rpc::Allocate => &self.allocate,
            Rpc::PreferredAllocation => &self.preferred,
        }
    }

    /// The devices of the list the plugin streams now, and how many of
    /// them are listed healthy.
    pub(crate) fn set_devices(&self, devices: u64, healthy: u64) {
        self.devices.set(devices);
        self.healthy.set(healthy);
    }

    pub(crate) fn set_registered(&self, registered: bool) {
        self.registered.set(u64::from(registered));
    }

    /// A registration with the kubelet went through.
    pub(crate) fn count_registration(&self) {
        if self.registrations.inc() > 0 {
            self.reregistrations.inc();
        }
    }

    /// A ListAndWatch message of `bytes` (encoded) was sent.
    pub(crate) fn count_list(&self, bytes: u64) {
        self.lists_sent.inc();
        self.list_bytes.set(bytes);
    }

    /// Reads the open streams of a plugin that just started from now on.
    pub(crate) fn read_streams(&self, count: impl Fn() -> usize + Send + Sync + 'static) {
        *self.streams.write().expect("metrics lock") = Some(StreamCount(Box::new(count)));
    }

    fn open_streams(&self) -> usize {
        self.streams
            .read()
            .expect("metrics lock")
            .as_ref()
            .map_or(0, |count| (count.0)())
    }

    /// Registered with the kubelet and streaming to it.
    fn ready(&self) -> bool {
        self.registered.get() == 1 && self.open_streams() > 0
    }
}

/// Every series of the daemon.
#[derive(Debug)]
pub(crate) struct Metrics {
    /// The process-wide series below and the [`Scraped`] collector.
    registry: Registry,
    scraped: Arc<Scraped>,
    /// Pods of this node in the matcher's cache.
    pod_cache: Level,
    /// API-server requests the matcher made outside its watch.
    api_requests: Family<VerbLabels, Counter>,
    /// Reloads by result.
    config_reloads: Family<ReloadLabels, Counter>,
    /// Restarts after a failure, by child.
    child_restarts: Family<ChildLabels, Counter>,
}

/// What the scrape reads at its time: the resources enabled now, and the
/// series their owners replace whole.
#[derive(Debug, Default)]
struct Scraped {
    resources: RwLock<BTreeMap<String, Arc<ResourceMetrics>>>,
    config: Mutex<ConfigState>,
    /// Enforcement's series; None (absent) with enforcement off.
    enforcement: Mutex<Option<EnforcementSeries>>,
    /// Per GPU, from the pod matcher's usage model; empty without it.
    gpus: Mutex<Vec<GpuSample>>,
    /// Per live container and GPU, from the same pass.
    grants: Mutex<Vec<ContainerGrant>>,
    /// What the driver says is used; None (absent) with no usage monitor.
    usage: Mutex<Option<UsageSeries>>,
    /// Per GPU, whether its MPS control daemon answers; None (absent)
    /// without MPS.
    mps: Mutex<Option<Vec<(String, bool)>>>,
    /// Every GPU's capacity and health, in every mode.
    status: Mutex<Vec<GpuStatus>>,
}

/// The loaded config and when reloads last went either way.
#[derive(Debug, Default)]
struct ConfigState {
    sha256: String,
    loaded_at: f64,
    refused_at: f64,
}

/// What a GPU carries, as the per-GPU series show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GpuMode {
    Free,
    /// Held whole (gpu-count).
    Whole,
    /// Carrying gpu-memory or gpu-core grants.
    Shared,
}

impl GpuMode {
    const ALL: [GpuMode; 3] = [GpuMode::Free, GpuMode::Whole, GpuMode::Shared];

    fn name(self) -> &'static str {
        match self {
            GpuMode::Free => "free",
            GpuMode::Whole => "whole",
            GpuMode::Shared => "shared",
        }
    }
}

/// One GPU's grants, in real units (from the pod matcher's ledgers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuSample {
    pub(crate) uuid: String,
    pub(crate) memory_granted_mib: u64,
    pub(crate) core_granted_percent: u64,
    pub(crate) containers: u64,
    pub(crate) mode: GpuMode,
}

/// One GPU's capacity, in real units, its health and what holds its
/// shares to their grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuStatus {
    pub(crate) uuid: String,
    pub(crate) memory_capacity_mib: u64,
    pub(crate) core_capacity_percent: u64,
    pub(crate) healthy: bool,
    /// `mps`, `hami-core` or `none`.
    pub(crate) backend: &'static str,
}

/// What enforcement's sweeper last found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct EnforcementSeries {
    /// Per-container cache directories in the state directory.
    pub(crate) cache_dirs: u64,
    /// Device memory per container and GPU, from the usage regions that
    /// could be read.
    pub(crate) memory_used: Vec<ContainerMemory>,
}

/// What one live container is granted on one GPU, in real units: the
/// other side of its `container_memory_used_bytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ContainerGrant {
    pub(crate) at: ContainerLabels,
    pub(crate) memory_mib: u64,
    /// Percent of the GPU's compute (100 for a whole GPU).
    pub(crate) core_percent: u64,
}

/// Device memory one container uses on one GPU, as its enforcement
/// library's usage region says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ContainerMemory {
    pub(crate) at: ContainerLabels,
    pub(crate) bytes: u64,
}

/// What one container's processes use on one GPU, as the driver says;
/// None where it gives no figure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ContainerUsage {
    pub(crate) at: ContainerLabels,
    pub(crate) memory_bytes: Option<u64>,
    /// Percent of the GPU's SMs, summed over its processes.
    pub(crate) sm_percent: Option<u32>,
}

/// One GPU's compute processes, every one the driver lists (in a pod or
/// not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuUse {
    pub(crate) uuid: String,
    /// None when the driver gave no figure for one of its processes.
    pub(crate) memory_bytes: Option<u64>,
    pub(crate) processes: u64,
}

/// What the usage monitor last found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct UsageSeries {
    pub(crate) containers: Vec<ContainerUsage>,
    pub(crate) gpus: Vec<GpuUse>,
    /// The grants of the DRA claims prepared here, per claim and GPU (the
    /// device plugin's come from the pod matcher).
    pub(crate) claims: Vec<ContainerGrant>,
}

/// Seconds since the Unix epoch, as Prometheus timestamps go.
fn now_unix() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Default for Metrics {
    fn default() -> Self {
        let scraped = Arc::<Scraped>::default();
        let pod_cache = Level::default();
        let api_requests = Family::default();
        let config_reloads = Family::<ReloadLabels, Counter>::default();
        // Both outcomes from the start, so "none applied" reads 0, not absent.
        for result in ["applied", "refused"] {
            config_reloads
                .get_or_create(&ReloadLabels { result })
                .inc_by(0);
        }
        let child_restarts = Family::default();
        let build = Family::<BuildLabels, Gauge>::default();
        let version = env!("CARGO_PKG_VERSION");
        let git = crate::GIT_REVISION;
        build.get_or_create(&BuildLabels { version, git }).set(1);
        // The library appends `_total` to a counter's name, and a period to
        // the help.
        let mut registry = Registry::with_prefix(PREFIX);
        let help = "The running binary's version and git revision";
        registry.register("build_info", help, build);
        let help = "Pods of this node in the pod matcher's cache";
        registry.register("pod_cache_pods", help, pod_cache.clone());
        let help = "API-server requests by the pod matcher, besides its watch";
        registry.register("api_requests", help, Family::clone(&api_requests));
        let help = "Config reloads, by whether they were applied or refused";
        registry.register("config_reloads", help, Family::clone(&config_reloads));
        let help = "Restarts of a supervised child after it failed, by child";
        registry.register("child_restarts", help, Family::clone(&child_restarts));
        registry.register_collector(Box::new(scraped.clone()));
        Metrics {
            registry,
            scraped,
            pod_cache,
            api_requests,
            config_reloads,
            child_restarts,
        }
    }
}

impl Metrics {
    /// The metrics of `name`, created on first use and kept afterwards.
    pub(crate) fn resource(&self, name: &str) -> Arc<ResourceMetrics> {
        let resources = &self.scraped.resources;
        if let Some(m) = resources.read().expect("metrics lock").get(name) {
            return m.clone();
        }
        let mut all = resources.write().expect("metrics lock");
        all.entry(name.to_owned()).or_default().clone()
    }

    /// Keeps only `names` (a reload switched the others off).
    pub(crate) fn retain(&self, names: &[String]) {
        (self.scraped.resources.write().expect("metrics lock")).retain(|n, _| names.contains(n));
    }

    pub(crate) fn set_pod_cache(&self, pods: usize) {
        self.pod_cache.set(pods as u64);
    }

    pub(crate) fn count_api_request(&self, verb: &'static str) {
        self.api_requests.get_or_create(&VerbLabels { verb }).inc();
    }

    /// A config reload was applied: every child runs on the new config.
    pub(crate) fn config_applied(&self) {
        self.count_reload("applied");
    }

    fn count_reload(&self, result: &'static str) {
        self.config_reloads
            .get_or_create(&ReloadLabels { result })
            .inc();
    }

    /// The supervisor restarted `child` after it failed.
    pub(crate) fn count_restart(&self, child: &str) {
        let child = child.to_owned();
        self.child_restarts
            .get_or_create(&ChildLabels { child })
            .inc();
    }

    /// The config whose file bytes have SHA-256 `sha256` now serves (at
    /// start, or a reload went through).
    pub(crate) fn config_loaded(&self, sha256: String) {
        let mut c = self.scraped.config.lock().expect("metrics lock");
        c.sha256 = sha256;
        c.loaded_at = now_unix();
    }

    /// A reload was refused; the loaded config keeps serving.
    pub(crate) fn config_refused(&self) {
        self.scraped.config.lock().expect("metrics lock").refused_at = now_unix();
        self.count_reload("refused");
    }

    /// Every GPU's usage, replacing the last (empty: none known).
    pub(crate) fn set_gpus(&self, gpus: Vec<GpuSample>) {
        *self.scraped.gpus.lock().expect("metrics lock") = gpus;
    }

    /// Replaces every container's grants: a container gone is gone from
    /// the next scrape.
    pub(crate) fn set_grants(&self, grants: Vec<ContainerGrant>) {
        *self.scraped.grants.lock().expect("metrics lock") = grants;
    }

    /// Replaces what the driver says is used; None removes it.
    pub(crate) fn set_usage(&self, usage: Option<UsageSeries>) {
        *self.scraped.usage.lock().expect("metrics lock") = usage;
    }

    /// `child` goes on purpose: the series only it kept current go with
    /// it (one that failed, waiting out its backoff, never cleared them).
    pub(crate) fn release(&self, child: Child) {
        match child {
            Child::Mps => self.set_mps(None),
            Child::Usage => self.set_usage(None),
            _ => {}
        }
    }

    /// Replaces whether each GPU's MPS control daemon answers; None
    /// removes it.
    pub(crate) fn set_mps(&self, up: Option<Vec<(String, bool)>>) {
        *self.scraped.mps.lock().expect("metrics lock") = up;
    }

    /// Every GPU's capacity and health, replacing the last.
    pub(crate) fn set_gpu_status(&self, gpus: Vec<GpuStatus>) {
        *self.scraped.status.lock().expect("metrics lock") = gpus;
    }

    /// Replaces enforcement's series; None removes them.
    pub(crate) fn set_enforcement(&self, series: Option<EnforcementSeries>) {
        *self.scraped.enforcement.lock().expect("metrics lock") = series;
    }

    /// The resources not registered with the kubelet or not streaming to
    /// it, each with why; empty when all are.
    pub(crate) fn resources_not_ready(&self) -> Vec<String> {
        let all = self.scraped.resources.read().expect("metrics lock");
        all.iter()
            .filter(|(_, m)| !m.ready())
            .map(|(n, _)| format!("{n}: not registered or not streaming"))
            .collect()
    }

    /// The scrape, in the OpenMetrics text format
    /// ([`crate::net::http::METRICS_CONTENT_TYPE`]).
    pub(crate) fn render(&self) -> String {
        crate::net::http::render_metrics(&self.registry)
    }
}

/// Opens a family of series at scrape time; the library writes its HELP
/// and TYPE lines (a counter's without the `_total` its samples carry).
fn family<'a>(
    encoder: &'a mut DescriptorEncoder,
    name: &'a str,
    help: &str,
    kind: MetricType,
) -> Result<MetricEncoder<'a>, fmt::Error> {
    encoder.encode_descriptor(name, help, None, kind)
}

/// One gauge sample with `labels` in an open family.
fn gauge(family: &mut MetricEncoder, labels: &impl EncodeLabelSet, value: u64) -> fmt::Result {
    ConstGauge::new(value).encode(family.encode_family(labels)?)
}

/// A per-resource series: name, help, type, the resource's metric.
type ResourceSeries = (
    &'static str,
    &'static str,
    MetricType,
    fn(&ResourceMetrics) -> &dyn EncodeMetric,
);

/// A per-GPU gauge: name, help, how to read it from `T`.
type PerGpu<T> = (&'static str, &'static str, fn(&T) -> u64);

/// The RPC families (calls, refusals by reason, latency): their series
/// are per resource and RPC, not per resource alone.
fn encode_rpcs(
    all: &BTreeMap<String, Arc<ResourceMetrics>>,
    encoder: &mut DescriptorEncoder,
) -> fmt::Result {
    use MetricType::Counter;
    let rpcs = || {
        all.iter().flat_map(|(resource, m)| {
            Rpc::ALL.map(|rpc| (resource.clone(), rpc.name(), m.rpc(rpc)))
        })
    };
    let mut f = family(encoder, "rpc", "RPCs served.", Counter)?;
    for (resource, rpc, m) in rpcs() {
        m.calls
            .encode(f.encode_family(&RpcLabels { resource, rpc })?)?;
    }
    let mut f = family(encoder, "rpc_failures", "RPCs refused, by reason.", Counter)?;
    for (resource, rpc, m) in rpcs() {
        for (&reason, &n) in m.failures.lock().expect("metrics lock").iter() {
            let resource = resource.clone();
            let labels = FailureLabels {
                resource,
                rpc,
                reason,
            };
            ConstCounter::new(n).encode(f.encode_family(&labels)?)?;
        }
    }
    let kind = MetricType::Histogram;
    let mut f = family(encoder, "rpc_duration_seconds", "RPC latency.", kind)?;
    for (resource, rpc, m) in rpcs() {
        m.latency
            .encode(f.encode_family(&RpcLabels { resource, rpc })?)?;
    }
    Ok(())
}

impl Scraped {
    fn encode_resources(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        use MetricType::{Counter, Gauge};
        let all = self.resources.read().expect("metrics lock");
        let label = |resource: &str| ResourceLabels {
            resource: resource.to_owned(),
        };
        let series: [ResourceSeries; 7] = [
            (
                "devices",
                "Devices advertised to the kubelet.",
                Gauge,
                |m| &m.devices,
            ),
            (
                "devices_healthy",
                "Devices advertised Healthy.",
                Gauge,
                |m| &m.healthy,
            ),
            (
                "registered",
                "1 when registered with the current kubelet.",
                Gauge,
                |m| &m.registered,
            ),
            (
                "registrations",
                "Successful registrations with the kubelet.",
                Counter,
                |m| &m.registrations,
            ),
            (
                "reregistrations",
                "Registrations after the first (kubelet restarts, reloads, repairs).",
                Counter,
                |m| &m.reregistrations,
            ),
            (
                "list_messages",
                "ListAndWatch messages sent.",
                Counter,
                |m| &m.lists_sent,
            ),
            (
                "list_message_bytes",
                "Encoded size of the last ListAndWatch message (kubelet limit 4194304).",
                Gauge,
                |m| &m.list_bytes,
            ),
        ];
        for (name, help, kind, metric) in series {
            let mut f = family(encoder, name, help, kind)?;
            for (resource, m) in all.iter() {
                metric(m).encode(f.encode_family(&label(resource))?)?;
            }
        }
        let mut f = family(encoder, "list_streams", "Open ListAndWatch streams.", Gauge)?;
        for (resource, m) in all.iter() {
            gauge(&mut f, &label(resource), m.open_streams() as u64)?;
        }
        encode_rpcs(&all, encoder)
    }

    fn encode_config(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let c = self.config.lock().expect("metrics lock");
        let help = "The SHA-256 of the config file serving now.";
        let mut f = family(encoder, "config_info", help, MetricType::Gauge)?;
        let sha256 = c.sha256.clone();
        gauge(&mut f, &ConfigLabels { sha256 }, 1)?;
        let timestamps = [
            (
                "config_last_reload_timestamp_seconds",
                "When the serving config was loaded (start or reload).",
                c.loaded_at,
            ),
            (
                "config_last_refused_timestamp_seconds",
                "When a reload was last refused; 0: never.",
                c.refused_at,
            ),
        ];
        for (name, help, at) in timestamps {
            ConstGauge::new(at).encode(family(encoder, name, help, MetricType::Gauge)?)?;
        }
        Ok(())
    }

    fn encode_gpus(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let status = self.status.lock().expect("metrics lock");
        let every: [PerGpu<GpuStatus>; 3] = [
            (
                "gpu_memory_capacity_bytes",
                "GPU memory the gpu-memory devices cover.",
                |g| g.memory_capacity_mib << 20,
            ),
            (
                "gpu_core_capacity_percent",
                "Compute the gpu-core devices cover, in percent of the GPU.",
                |g| g.core_capacity_percent,
            ),
            (
                "gpu_healthy",
                "1 when the GPU passes its health checks.",
                |g| u64::from(g.healthy),
            ),
        ];
        per_gpu(encoder, every, &status, |g| &g.uuid)?;
        let help = "1, labelled with what holds the GPU's shares to their grants: mps, \
                    hami-core or none (bookkeeping).";
        let mut f = family(encoder, "gpu_backend_info", help, MetricType::Gauge)?;
        for g in status.iter() {
            let labels = BackendLabels {
                gpu: g.uuid.clone(),
                backend: g.backend,
            };
            gauge(&mut f, &labels, 1)?;
        }
        if let Some(up) = self.mps.lock().expect("metrics lock").as_ref() {
            let help = "1 while the GPU's MPS control daemon answers; 0 refuses its shares.";
            let mut f = family(encoder, "mps_control_daemon_up", help, MetricType::Gauge)?;
            for (gpu, up) in up {
                gauge(&mut f, &GpuLabels { gpu: gpu.clone() }, u64::from(*up))?;
            }
        }
        let gpus = self.gpus.lock().expect("metrics lock");
        let granted: [PerGpu<GpuSample>; 3] = [
            (
                "gpu_memory_granted_bytes",
                "GPU memory granted to shared containers, by the pods' ledgers.",
                |g| g.memory_granted_mib << 20,
            ),
            (
                "gpu_core_granted_percent",
                "Compute granted to shared containers, in percent of the GPU.",
                |g| g.core_granted_percent,
            ),
            (
                "gpu_containers",
                "Containers holding the GPU, whole or shared.",
                |g| g.containers,
            ),
        ];
        per_gpu(encoder, granted, &gpus, |g| &g.uuid)?;
        let help = "1 for what the GPU carries: whole, shared or free.";
        let mut f = family(encoder, "gpu_mode", help, MetricType::Gauge)?;
        for g in gpus.iter() {
            for mode in GpuMode::ALL {
                let labels = ModeLabels {
                    gpu: g.uuid.clone(),
                    mode: mode.name(),
                };
                gauge(&mut f, &labels, u64::from(g.mode == mode))?;
            }
        }
        Ok(())
    }

    /// Each live container's grant per GPU, labelled as its used memory
    /// is, so that a dashboard joins granted against used; and each DRA
    /// claim's, per pod and GPU, with no container.
    fn encode_grants(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let matched = self.grants.lock().expect("metrics lock");
        let usage = self.usage.lock().expect("metrics lock");
        let claims = usage.iter().flat_map(|u| &u.claims);
        let grants: Vec<&ContainerGrant> = matched.iter().chain(claims).collect();
        let help = "GPU memory granted to a container on a GPU (all of it for a whole GPU), or to a DRA \
                    claim (its containers together).";
        let name = "container_memory_granted_bytes";
        let mut f = family(encoder, name, help, MetricType::Gauge)?;
        for g in grants.iter() {
            gauge(&mut f, &g.at, g.memory_mib << 20)?;
        }
        let help = "Share of a GPU's compute granted to a container (1 for a whole GPU), or to a DRA \
                    claim (its containers together).";
        let name = "container_core_granted_ratio";
        let mut f = family(encoder, name, help, MetricType::Gauge)?;
        for g in grants.iter() {
            let ratio = g.core_percent as f64 / 100.0;
            ConstGauge::new(ratio).encode(f.encode_family(&g.at)?)?;
        }
        Ok(())
    }

    /// What is used, per container and per GPU. A container's memory is
    /// the driver's count where it gives one, else its enforcement
    /// library's; absent altogether when neither source runs.
    fn encode_used(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let usage = self.usage.lock().expect("metrics lock");
        let enforcement = self.enforcement.lock().expect("metrics lock");
        let regions = enforcement.iter().flat_map(|e| &e.memory_used);
        if usage.is_none() && enforcement.is_none() {
            return Ok(());
        }
        let driver: BTreeMap<&ContainerLabels, u64> = usage
            .iter()
            .flat_map(|u| &u.containers)
            .filter_map(|c| Some((&c.at, c.memory_bytes?)))
            .collect();
        let help = "Device memory a container uses on a GPU: its processes' as the driver \
                    (NVML) counts them, else as its enforcement library reports it.";
        let name = "container_memory_used_bytes";
        let mut f = family(encoder, name, help, MetricType::Gauge)?;
        for (at, bytes) in &driver {
            gauge(&mut f, *at, *bytes)?;
        }
        for m in regions.filter(|m| !driver.contains_key(&m.at)) {
            gauge(&mut f, &m.at, m.bytes)?;
        }
        let Some(usage) = usage.as_ref() else {
            return Ok(());
        };
        let help = "Share of a GPU's SMs a container's processes used over the last poll, \
                    as the driver (NVML) samples it; absent where it has no sample.";
        let name = "container_sm_utilization_ratio";
        let mut f = family(encoder, name, help, MetricType::Gauge)?;
        for c in &usage.containers {
            if let Some(sm) = c.sm_percent {
                ConstGauge::new(f64::from(sm) / 100.0).encode(f.encode_family(&c.at)?)?;
            }
        }
        let known: Vec<(&str, u64)> = (usage.gpus.iter())
            .filter_map(|g| Some((g.uuid.as_str(), g.memory_bytes?)))
            .collect();
        let used: [PerGpu<(&str, u64)>; 1] = [(
            "gpu_memory_used_bytes",
            "Device memory the GPU's compute processes hold, as the driver lists them \
             (in a pod or not); absent when it gives no figure for one of them.",
            |g| g.1,
        )];
        per_gpu(encoder, used, &known, |g| g.0)?;
        let series: [PerGpu<GpuUse>; 1] = [(
            "gpu_processes",
            "Compute processes on the GPU, MPS clients included.",
            |g| g.processes,
        )];
        per_gpu(encoder, series, &usage.gpus, |g| &g.uuid)
    }

    /// Absent altogether with enforcement off.
    fn encode_enforcement(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let series = self.enforcement.lock().expect("metrics lock");
        let Some(series) = series.as_ref() else {
            return Ok(());
        };
        let help = "Per-container enforcement cache directories on the host.";
        let f = family(encoder, "enforcement_cache_dirs", help, MetricType::Gauge)?;
        ConstGauge::new(series.cache_dirs).encode(f)
    }
}

/// Per-GPU gauges of `gpus`, each labelled with its UUID.
fn per_gpu<T, const N: usize>(
    encoder: &mut DescriptorEncoder,
    series: [PerGpu<T>; N],
    gpus: &[T],
    uuid: fn(&T) -> &str,
) -> fmt::Result {
    for (name, help, value) in series {
        let mut f = family(encoder, name, help, MetricType::Gauge)?;
        for g in gpus {
            let gpu = uuid(g).to_owned();
            gauge(&mut f, &GpuLabels { gpu }, value(g))?;
        }
    }
    Ok(())
}

impl Collector for Scraped {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        self.encode_resources(&mut encoder)?;
        self.encode_enforcement(&mut encoder)?;
        self.encode_config(&mut encoder)?;
        self.encode_grants(&mut encoder)?;
        self.encode_used(&mut encoder)?;
        self.encode_gpus(&mut encoder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The sample lines' series names (the name up to its labels).
    fn series_names(text: &str) -> std::collections::BTreeSet<&str> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split(['{', ' ']).next().unwrap())
            .collect()
    }

    /// Container `app` of pod `ns/pod` on GPU-a.
    fn app_of(pod: &str) -> ContainerLabels {
        let key = PodKey {
            namespace: "ns".into(),
            name: pod.into(),
        };
        ContainerLabels::new(&key, "app", "GPU-a")
    }

    fn grant(pod: &str, memory_mib: u64, core_percent: u64) -> ContainerGrant {
        ContainerGrant {
            at: app_of(pod),
            memory_mib,
            core_percent,
        }
    }

    /// A container's grant carries the labels of its used memory, in bytes
    /// and a ratio of the GPU; a container gone is gone at the next update.
    #[test]
    fn grants_join_used_memory_and_go_with_their_container() {
        let metrics = Metrics::default();
        metrics.set_grants(vec![grant("p", 512, 30), grant("q", 1024, 100)]);
        let text = metrics.render();
        let labels = r#"{namespace="ns",pod="p",container="app",gpu="GPU-a"}"#;
        for line in [
            format!("{PREFIX}_container_memory_granted_bytes{labels} 536870912"),
            format!("{PREFIX}_container_core_granted_ratio{labels} 0.3"),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        metrics.set_grants(vec![grant("q", 1024, 100)]);
        let text = metrics.render();
        assert!(!text.contains(r#"pod="p""#), "{text}");
        assert!(text.contains(r#"pod="q""#), "{text}");
    }

    /// Every series the daemon exports, with some state in each: a rename
    /// (or a `_total` the library appends twice) cannot slip through.
    #[test]
    fn the_scrape_holds_exactly_the_series_the_dashboards_read() {
        let metrics = Metrics::default();
        let m = metrics.resource("doslab.io/gpu-memory");
        m.set_devices(4, 3);
        m.set_registered(true);
        m.count_registration();
        m.count_list(100);
        m.rpc(Rpc::Allocate)
            .record(Duration::from_millis(1), Some("unknown_id"));
        metrics.set_pod_cache(2);
        metrics.count_api_request("patch");
        metrics.config_applied();
        metrics.count_restart("pod matcher");
        metrics.config_loaded("abc".into());
        metrics.set_gpu_status(vec![GpuStatus {
            uuid: "GPU-a".into(),
            memory_capacity_mib: 1024,
            core_capacity_percent: 100,
            healthy: true,
            backend: "mps",
        }]);
        metrics.set_mps(Some(vec![("GPU-a".into(), false)]));
        metrics.set_usage(Some(UsageSeries {
            containers: vec![ContainerUsage {
                at: app_of("p"),
                memory_bytes: Some(1),
                sm_percent: Some(1),
            }],
            gpus: vec![GpuUse {
                uuid: "GPU-a".into(),
                memory_bytes: Some(1),
                processes: 1,
            }],
            claims: Vec::new(),
        }));
        metrics.set_gpus(vec![GpuSample {
            uuid: "GPU-a".into(),
            memory_granted_mib: 512,
            core_granted_percent: 30,
            containers: 1,
            mode: GpuMode::Shared,
        }]);
        metrics.set_enforcement(Some(EnforcementSeries {
            cache_dirs: 1,
            memory_used: vec![ContainerMemory {
                at: app_of("p"),
                bytes: 1 << 20,
            }],
        }));
        metrics.set_grants(vec![grant("p", 512, 30)]);
        let text = metrics.render();
        let expected = [
            "build_info",
            "devices",
            "devices_healthy",
            "registered",
            "registrations_total",
            "reregistrations_total",
            "list_streams",
            "list_messages_total",
            "list_message_bytes",
            "rpc_total",
            "rpc_failures_total",
            "rpc_duration_seconds_bucket",
            "rpc_duration_seconds_sum",
            "rpc_duration_seconds_count",
            "pod_cache_pods",
            "api_requests_total",
            "config_reloads_total",
            "child_restarts_total",
            "enforcement_cache_dirs",
            "container_memory_used_bytes",
            "config_info",
            "container_memory_granted_bytes",
            "container_core_granted_ratio",
            "config_last_reload_timestamp_seconds",
            "config_last_refused_timestamp_seconds",
            "gpu_memory_capacity_bytes",
            "gpu_core_capacity_percent",
            "gpu_healthy",
            "gpu_memory_granted_bytes",
            "gpu_core_granted_percent",
            "gpu_containers",
            "gpu_mode",
            "gpu_backend_info",
            "mps_control_daemon_up",
            "container_sm_utilization_ratio",
            "gpu_memory_used_bytes",
            "gpu_processes",
        ]
        .map(|s| format!("{PREFIX}_{s}"));
        let expected: std::collections::BTreeSet<&str> =
            expected.iter().map(String::as_str).collect();
        assert_eq!(series_names(&text), expected, "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(!text.contains("..\n"), "a help ends in one period: {text}");
    }

    #[test]
    fn renders_counters_failures_and_histograms() {
        let metrics = Metrics::default();
        let m = metrics.resource("doslab.io/gpu-core");
        m.set_devices(200, 200);
        for _ in 0..3 {
            m.count_registration();
        }
        m.allocate.record(Duration::from_micros(700), None);
        m.allocate
            .record(Duration::from_millis(30), Some("unknown_id"));
        let text = metrics.render();
        let has = |line: &str| assert!(text.contains(&format!("{line}\n")), "{line}:\n{text}");
        has(r#"gpu_device_plugin_devices{resource="doslab.io/gpu-core"} 200"#);
        has(r#"gpu_device_plugin_registrations_total{resource="doslab.io/gpu-core"} 3"#);
        has(r#"gpu_device_plugin_reregistrations_total{resource="doslab.io/gpu-core"} 2"#);
        has(r#"gpu_device_plugin_rpc_total{resource="doslab.io/gpu-core",rpc="allocate"} 2"#);
        has(
            r#"gpu_device_plugin_rpc_total{resource="doslab.io/gpu-core",rpc="get_preferred_allocation"} 0"#,
        );
        has(
            r#"gpu_device_plugin_rpc_failures_total{resource="doslab.io/gpu-core",rpc="allocate",reason="unknown_id"} 1"#,
        );
        let bucket = r#"gpu_device_plugin_rpc_duration_seconds_bucket{le="#;
        has(&format!(
            r#"{bucket}"0.001",resource="doslab.io/gpu-core",rpc="allocate"}} 1"#
        ));
        has(&format!(
            r#"{bucket}"+Inf",resource="doslab.io/gpu-core",rpc="allocate"}} 2"#
        ));
        has(&format!(
            "gpu_device_plugin_build_info{{version=\"{}\",git=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            crate::GIT_REVISION
        ));
        assert_eq!(
            metrics.resources_not_ready(),
            ["doslab.io/gpu-core: not registered or not streaming"]
        );
        metrics.retain(&[]);
        assert!(!metrics.render().contains("doslab.io/gpu-core"));
        assert!(metrics.resources_not_ready().is_empty());
    }

    #[test]
    fn a_resource_is_ready_while_registered_with_a_stream_open() {
        let metrics = Metrics::default();
        let m = metrics.resource("doslab.io/gpu-memory");
        assert!(!metrics.resources_not_ready().is_empty(), "no plugin yet");
        let streams = Arc::new(AtomicUsize::new(0));
        let open = streams.clone();
        m.read_streams(move || open.load(Ordering::SeqCst));
        m.set_registered(true);
        assert!(!metrics.resources_not_ready().is_empty(), "no stream yet");
        streams.store(1, Ordering::SeqCst);
        assert!(metrics.resources_not_ready().is_empty());
        assert!(
            metrics
                .render()
                .contains("gpu_device_plugin_list_streams{resource=\"doslab.io/gpu-memory\"} 1\n")
        );
        streams.store(0, Ordering::SeqCst);
        assert!(
            !metrics.resources_not_ready().is_empty(),
            "the kubelet dropped it"
        );
    }

    #[test]
    fn reloads_and_restarts_are_counted_by_result_and_child() {
        let metrics = Metrics::default();
        metrics.config_applied();
        metrics.config_refused();
        metrics.config_refused();
        metrics.count_restart("pod matcher");
        let text = metrics.render();
        for line in [
            "gpu_device_plugin_config_reloads_total{result=\"applied\"} 1\n",
            "gpu_device_plugin_config_reloads_total{result=\"refused\"} 2\n",
            "gpu_device_plugin_child_restarts_total{child=\"pod matcher\"} 1\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let metrics = Metrics::default();
        metrics.count_restart("a\"b\\c\nd");
        let text = metrics.render();
        assert!(
            text.contains(r#"gpu_device_plugin_child_restarts_total{child="a\"b\\c\nd"} 1"#),
            "{text}"
        );
    }

    /// The driver's count wins over the enforcement library's for the same
    /// container and GPU; the library still speaks for the others; SM
    /// shares are ratios, absent where the driver had no sample; the
    /// driver's series go with the sample that drops them.
    #[test]
    fn used_memory_comes_from_the_driver_before_the_library() {
        let metrics = Metrics::default();
        metrics.set_enforcement(Some(EnforcementSeries {
            cache_dirs: 2,
            memory_used: vec![
                ContainerMemory {
                    at: app_of("p"),
                    bytes: 1,
                },
                ContainerMemory {
                    at: app_of("q"),
                    bytes: 2,
                },
            ],
        }));
        let usage = |sm| UsageSeries {
            containers: vec![ContainerUsage {
                at: app_of("p"),
                memory_bytes: Some(3 << 20),
                sm_percent: sm,
            }],
            gpus: vec![GpuUse {
                uuid: "GPU-a".into(),
                memory_bytes: Some(4 << 20),
                processes: 2,
            }],
            // A DRA claim's grant: the claim's, no container's.
            claims: vec![ContainerGrant {
                at: ContainerLabels::new(
                    &PodKey {
                        namespace: "ns".into(),
                        name: "d".into(),
                    },
                    "",
                    "GPU-a",
                )
                .in_claim("d-gpu"),
                memory_mib: 2,
                core_percent: 50,
            }],
        };
        metrics.set_usage(Some(usage(Some(25))));
        let text = metrics.render();
        let p = r#"{namespace="ns",pod="p",container="app",gpu="GPU-a"}"#;
        let q = r#"{namespace="ns",pod="q",container="app",gpu="GPU-a"}"#;
        for line in [
            format!("{PREFIX}_container_memory_used_bytes{p} 3145728"),
            format!("{PREFIX}_container_memory_used_bytes{q} 2"),
            format!("{PREFIX}_container_sm_utilization_ratio{p} 0.25"),
            format!(r#"{PREFIX}_gpu_memory_used_bytes{{gpu="GPU-a"}} 4194304"#),
            format!(r#"{PREFIX}_gpu_processes{{gpu="GPU-a"}} 2"#),
            format!(
                r#"{PREFIX}_container_memory_granted_bytes{{namespace="ns",pod="d",container="",gpu="GPU-a",claim="d-gpu"}} 2097152"#
            ),
            format!(
                r#"{PREFIX}_container_core_granted_ratio{{namespace="ns",pod="d",container="",gpu="GPU-a",claim="d-gpu"}} 0.5"#
            ),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        assert_eq!(
            text.matches("container_memory_used_bytes{").count(),
            2,
            "{text}"
        );
        metrics.set_usage(Some(usage(None)));
        assert!(!metrics.render().contains("sm_utilization_ratio{"));
        // Gone from the sample, the library's figure speaks for it again.
        metrics.set_usage(Some(UsageSeries::default()));
        let line = format!("{PREFIX}_container_memory_used_bytes{p} 1");
        let text = metrics.render();
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        assert!(!text.contains("gpu_processes{"), "{text}");
        metrics.set_usage(None);
        metrics.set_enforcement(None);
        let text = metrics.render();
        assert!(!text.contains("used_bytes"));
        assert!(!text.contains("claim="), "{text}");
    }

    /// A child stopped on purpose takes the series only it kept current,
    /// even one that failed and never stopped itself.
    #[test]
    fn a_released_child_takes_its_series() {
        let metrics = Metrics::default();
        metrics.set_mps(Some(vec![("GPU-a".into(), false)]));
        metrics.set_usage(Some(UsageSeries::default()));
        assert!(metrics.render().contains("mps_control_daemon_up{"));
        metrics.release(Child::Matcher);
        assert!(metrics.render().contains("mps_control_daemon_up{"));
        metrics.release(Child::Mps);
        metrics.release(Child::Usage);
        let text = metrics.render();
        assert!(!text.contains("mps_control_daemon_up"), "{text}");
        assert!(!text.contains("gpu_processes"), "{text}");
    }

    #[test]
    fn enforcement_series_are_absent_until_set() {
        let metrics = Metrics::default();
        assert!(!metrics.render().contains("enforcement_cache_dirs"));
        metrics.set_enforcement(Some(EnforcementSeries {
            cache_dirs: 2,
            memory_used: vec![ContainerMemory {
                at: app_of("p"),
                bytes: 5 << 20,
            }],
        }));
        let text = metrics.render();
        assert!(
            text.contains("gpu_device_plugin_enforcement_cache_dirs 2\n"),
            "{text}"
        );
        assert!(text.contains(
            "gpu_device_plugin_container_memory_used_bytes{namespace=\"ns\",pod=\"p\",container=\"app\",gpu=\"GPU-a\"} 5242880\n"
        ));
        metrics.set_enforcement(None);
        assert!(!metrics.render().contains("container_memory_used_bytes"));
    }
}
