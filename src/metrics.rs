//! Counters and gauges for `/metrics` (Prometheus text format) and the
//! readiness of `/readyz`. One [`ResourceMetrics`] per resource, created by
//! the supervisor and kept across plugin restarts, so counters accumulate.
//! Readiness also waits for the other parts that mark themselves unready:
//! the pod matcher until its pod cache synced, and any actor that keeps
//! failing.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// Latency buckets, in seconds.
const BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

#[derive(Debug, Default)]
pub(crate) struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub(crate) fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (i, le) in BUCKETS.iter().enumerate() {
            if secs <= *le {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        for (i, le) in BUCKETS.iter().enumerate() {
            let n = self.buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {n}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

/// Counts the open ListAndWatch streams, so the plugin can tell when the
/// kubelet dropped it (it never reconnects by itself). The streams hold
/// guards; the plugin's check and `/readyz` read the count.
#[derive(Debug, Clone, Default)]
pub(crate) struct Streams(Arc<AtomicUsize>);

impl Streams {
    pub(crate) fn open(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    pub(crate) fn guard(&self) -> StreamGuard {
        self.0.fetch_add(1, Ordering::SeqCst);
        StreamGuard(self.0.clone())
    }
}

/// Held by a stream for its life.
pub(crate) struct StreamGuard(Arc<AtomicUsize>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The two RPCs that do work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Rpc {
    Allocate,
    PreferredAllocation,
}

impl Rpc {
    fn name(self) -> &'static str {
        match self {
            Rpc::Allocate => "allocate",
            Rpc::PreferredAllocation => "get_preferred_allocation",
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct RpcMetrics {
    pub(crate) calls: AtomicU64,
    pub(crate) latency: Histogram,
    failures: Mutex<BTreeMap<&'static str, u64>>,
}

impl RpcMetrics {
    pub(crate) fn record(&self, took: Duration, failure: Option<&'static str>) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.latency.observe(took);
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
    pub(crate) devices: AtomicU64,
    pub(crate) healthy: AtomicU64,
    pub(crate) registered: AtomicBool,
    pub(crate) registrations: AtomicU64,
    pub(crate) lists_sent: AtomicU64,
    pub(crate) list_bytes: AtomicU64,
    pub(crate) streams: Streams,
    pub(crate) allocate: RpcMetrics,
    pub(crate) preferred: RpcMetrics,
}

impl ResourceMetrics {
    pub(crate) fn rpc(&self, rpc: Rpc) -> &RpcMetrics {
        match rpc {
            Rpc::Allocate => &self.allocate,
            Rpc::PreferredAllocation => &self.preferred,
        }
    }

    /// Registered with the kubelet and streaming to it.
    pub(crate) fn ready(&self) -> bool {
        self.registered.load(Ordering::SeqCst) && self.streams.open() > 0
    }
}

/// A per-resource series: name, type, help, how to read it.
type Series = (
    &'static str,
    &'static str,
    &'static str,
    fn(&ResourceMetrics) -> u64,
);

/// A per-GPU gauge: name, help, how to read it from `T`.
type GpuSeries<T> = (&'static str, &'static str, fn(&T) -> u64);

/// Writes one per-GPU gauge over `gpus` (UUID, what it is read from).
fn per_gpu<'a, T: 'a>(
    out: &mut String,
    (name, help, get): GpuSeries<T>,
    gpus: impl Iterator<Item = (&'a str, &'a T)>,
) {
    let _ = writeln!(
        out,
        "# HELP gpu_device_plugin_{name} {help}\n# TYPE gpu_device_plugin_{name} gauge"
    );
    for (uuid, g) in gpus {
        let _ = writeln!(out, "gpu_device_plugin_{name}{{gpu=\"{uuid}\"}} {}", get(g));
    }
}

/// Why a part other than a resource holds readiness back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Hold {
    /// Not up yet (the pod matcher before its pod cache synced).
    Waiting,
    /// Restarted again and again.
    Failing,
    /// Cannot reach the API server (the pod matcher's watch fails), so an
    /// Allocate cannot succeed now.
    Unreachable,
}

/// Every enabled resource's metrics, by resource name.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    resources: RwLock<BTreeMap<String, Arc<ResourceMetrics>>>,
    /// Parts holding readiness back: (name, hold) → why.
    held: Mutex<BTreeMap<(String, Hold), String>>,
    /// Pods of this node in the matcher's cache.
    pod_cache: AtomicU64,
    /// API-server requests the matcher made outside its watch, by verb.
    api_requests: Mutex<BTreeMap<&'static str, u64>>,
    /// Config reloads that went through, and those refused.
    reloads_applied: AtomicU64,
    reloads_refused: AtomicU64,
    /// Restarts of children that ended or failed, by child.
    restarts: Mutex<BTreeMap<String, u64>>,
    /// Enforcement's series; None (absent) with enforcement off.
    enforcement: Mutex<Option<EnforcementSeries>>,
    config: Mutex<ConfigState>,
    /// Per GPU, from the pod matcher's usage model; empty without it.
    gpus: Mutex<Vec<GpuSample>>,
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

/// One GPU's capacity, in real units, and its health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuStatus {
    pub(crate) uuid: String,
    pub(crate) memory_capacity_mib: u64,
    pub(crate) core_capacity_percent: u64,
    pub(crate) healthy: bool,
}

/// Seconds since the Unix epoch, as Prometheus timestamps go.
fn now_unix() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Metrics {
    /// The metrics of `name`, created on first use and kept afterwards.
    pub(crate) fn resource(&self, name: &str) -> Arc<ResourceMetrics> {
        if let Some(m) = self.resources.read().expect("metrics lock").get(name) {
            return m.clone();
        }
        let mut all = self.resources.write().expect("metrics lock");
        all.entry(name.to_owned()).or_default().clone()
    }

    /// Keeps only `names` (a reload switched the others off).
    pub(crate) fn retain(&self, names: &[String]) {
        self.resources
            .write()
            .expect("metrics lock")
            .retain(|n, _| names.contains(n));
    }

    pub(crate) fn set_pod_cache(&self, pods: usize) {
        self.pod_cache.store(pods as u64, Ordering::Relaxed);
    }

    pub(crate) fn count_api_request(&self, verb: &'static str) {
        *self
            .api_requests
            .lock()
            .expect("metrics lock")
            .entry(verb)
            .or_default() += 1;
    }

    /// A config reload went through (`applied`) or was refused.
    pub(crate) fn count_reload(&self, applied: bool) {
        let count = if applied {
            &self.reloads_applied
        } else {
            &self.reloads_refused
        };
        count.fetch_add(1, Ordering::Relaxed);
    }

    /// `child` ended or failed and is being restarted.
    pub(crate) fn count_restart(&self, child: &str) {
        let mut restarts = self.restarts.lock().expect("metrics lock");
        *restarts.entry(child.to_owned()).or_default() += 1;
    }

    /// The config whose file bytes have SHA-256 `sha256` now serves (at
    /// start, or a reload went through).
    pub(crate) fn config_loaded(&self, sha256: String) {
        let mut c = self.config.lock().expect("metrics lock");
        c.sha256 = sha256;
        c.loaded_at = now_unix();
    }

    /// A reload was refused; the loaded config keeps serving.
    pub(crate) fn config_refused(&self) {
        self.config.lock().expect("metrics lock").refused_at = now_unix();
    }

    /// Every GPU's usage, replacing the last (empty: none known).
    pub(crate) fn set_gpus(&self, gpus: Vec<GpuSample>) {
        *self.gpus.lock().expect("metrics lock") = gpus;
    }

    /// Every GPU's capacity and health, replacing the last.
    pub(crate) fn set_gpu_status(&self, gpus: Vec<GpuStatus>) {
        *self.status.lock().expect("metrics lock") = gpus;
    }

    /// Marks `part` unready for `hold` with the reason `why`, or clears
    /// that mark with None.
    pub(crate) fn hold(&self, part: &str, hold: Hold, why: Option<String>) {
        let mut held = self.held.lock().expect("metrics lock");
        let key = (part.to_owned(), hold);
        match why {
            Some(why) => held.insert(key, why),
            None => held.remove(&key),
        };
    }

    /// Clears every mark of `part` (it stopped on purpose; a successor
    /// marks its own).
    pub(crate) fn release(&self, part: &str) {
        self.held
            .lock()
            .expect("metrics lock")
            .retain(|(p, _), _| p != part);
    }

    /// What is not ready yet, each with why; empty when all is.
    pub(crate) fn not_ready(&self) -> Vec<String> {
        let all = self.resources.read().expect("metrics lock");
        let resources = all
            .iter()
            .filter(|(_, m)| !m.ready())
            .map(|(n, _)| format!("{n}: not registered or not streaming"));
        let held = self.held.lock().expect("metrics lock");
        let parts = held.iter().map(|((part, _), why)| format!("{part}: {why}"));
        resources.chain(parts).collect()
    }

    pub(crate) fn render(&self) -> String {
        let all = self.resources.read().expect("metrics lock");
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_build_info The running binary's version and git revision.\n# TYPE gpu_device_plugin_build_info gauge\ngpu_device_plugin_build_info{{version=\"{}\",git=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            crate::GIT_REVISION
        );
        let gauges: [Series; 8] = [
            (
                "devices",
                "gauge",
                "Devices advertised to the kubelet.",
                |m| m.devices.load(Ordering::Relaxed),
            ),
            (
                "devices_healthy",
                "gauge",
                "Devices advertised Healthy.",
                |m| m.healthy.load(Ordering::Relaxed),
            ),
            (
                "registered",
                "gauge",
                "1 when registered with the current kubelet.",
                |m| u64::from(m.registered.load(Ordering::Relaxed)),
            ),
            ("list_streams", "gauge", "Open ListAndWatch streams.", |m| {
                m.streams.open() as u64
            }),
            (
                "registrations_total",
                "counter",
                "Successful registrations with the kubelet.",
                |m| m.registrations.load(Ordering::Relaxed),
            ),
            (
                "reregistrations_total",
                "counter",
                "Registrations after the first (kubelet restarts, reloads, repairs).",
                |m| m.registrations.load(Ordering::Relaxed).saturating_sub(1),
            ),
            (
                "list_messages_total",
                "counter",
                "ListAndWatch messages sent.",
                |m| m.lists_sent.load(Ordering::Relaxed),
            ),
            (
                "list_message_bytes",
                "gauge",
                "Encoded size of the last ListAndWatch message (kubelet limit 4194304).",
                |m| m.list_bytes.load(Ordering::Relaxed),
            ),
        ];
        for (name, kind, help, get) in gauges {
            let _ = writeln!(
                out,
                "# HELP gpu_device_plugin_{name} {help}\n# TYPE gpu_device_plugin_{name} {kind}"
            );
            for (resource, m) in all.iter() {
                let _ = writeln!(
                    out,
                    "gpu_device_plugin_{name}{{resource=\"{resource}\"}} {}",
                    get(m)
                );
            }
        }
        let rpcs = [Rpc::Allocate, Rpc::PreferredAllocation];
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_rpc_total RPCs served.\n# TYPE gpu_device_plugin_rpc_total counter"
        );
        for (resource, m) in all.iter() {
            for rpc in rpcs {
                let n = m.rpc(rpc).calls.load(Ordering::Relaxed);
                let _ = writeln!(
                    out,
                    "gpu_device_plugin_rpc_total{{resource=\"{resource}\",rpc=\"{}\"}} {n}",
                    rpc.name()
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_rpc_failures_total RPCs refused, by reason.\n# TYPE gpu_device_plugin_rpc_failures_total counter"
        );
        for (resource, m) in all.iter() {
            for rpc in rpcs {
                for (reason, n) in m.rpc(rpc).failures.lock().expect("metrics lock").iter() {
                    let _ = writeln!(
                        out,
                        "gpu_device_plugin_rpc_failures_total{{resource=\"{resource}\",rpc=\"{}\",reason=\"{reason}\"}} {n}",
                        rpc.name()
                    );
                }
            }
        }
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_rpc_duration_seconds RPC latency.\n# TYPE gpu_device_plugin_rpc_duration_seconds histogram"
        );
        for (resource, m) in all.iter() {
            for rpc in rpcs {
                let labels = format!("resource=\"{resource}\",rpc=\"{}\"", rpc.name());
                m.rpc(rpc).latency.render(
                    &mut out,
                    "gpu_device_plugin_rpc_duration_seconds",
                    &labels,
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_pod_cache_pods Pods of this node in the pod matcher's cache.\n# TYPE gpu_device_plugin_pod_cache_pods gauge\ngpu_device_plugin_pod_cache_pods {}",
            self.pod_cache.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_api_requests_total API-server requests by the pod matcher, besides its watch.\n# TYPE gpu_device_plugin_api_requests_total counter"
        );
        for (verb, n) in self.api_requests.lock().expect("metrics lock").iter() {
            let _ = writeln!(
                out,
                "gpu_device_plugin_api_requests_total{{verb=\"{verb}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_child_restarts_total Restarts of a child that ended or failed (not those a reload asks for).\n# TYPE gpu_device_plugin_child_restarts_total counter"
        );
        for (child, n) in self.restarts.lock().expect("metrics lock").iter() {
            let _ = writeln!(
                out,
                "gpu_device_plugin_child_restarts_total{{child=\"{child}\"}} {n}"
            );
        }
        self.render_enforcement(&mut out);
        self.render_config(&mut out);
        self.render_gpus(&mut out);
        out
    }

    fn render_config(&self, out: &mut String) {
        let c = self.config.lock().expect("metrics lock");
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_config_info The SHA-256 of the config file serving now.\n# TYPE gpu_device_plugin_config_info gauge\ngpu_device_plugin_config_info{{sha256=\"{}\"}} 1",
            c.sha256
        );
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_config_last_reload_timestamp_seconds When the serving config was loaded (start or reload).\n# TYPE gpu_device_plugin_config_last_reload_timestamp_seconds gauge\ngpu_device_plugin_config_last_reload_timestamp_seconds {}",
            c.loaded_at
        );
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_config_reloads_total Config reloads, applied or refused.\n# TYPE gpu_device_plugin_config_reloads_total counter"
        );
        let reloads = [
            ("applied", &self.reloads_applied),
            ("refused", &self.reloads_refused),
        ];
        for (result, n) in reloads {
            let n = n.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "gpu_device_plugin_config_reloads_total{{result=\"{result}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_config_last_refused_timestamp_seconds When a reload was last refused; 0: never.\n# TYPE gpu_device_plugin_config_last_refused_timestamp_seconds gauge\ngpu_device_plugin_config_last_refused_timestamp_seconds {}",
            c.refused_at
        );
    }

    fn render_gpus(&self, out: &mut String) {
        let status = self.status.lock().expect("metrics lock");
        let every: [GpuSeries<GpuStatus>; 3] = [
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
        for series in every {
            per_gpu(out, series, status.iter().map(|g| (g.uuid.as_str(), g)));
        }
        let gpus = self.gpus.lock().expect("metrics lock");
        let granted: [GpuSeries<GpuSample>; 3] = [
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
        for series in granted {
            per_gpu(out, series, gpus.iter().map(|g| (g.uuid.as_str(), g)));
        }
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_gpu_mode 1 for what the GPU carries: whole, shared or free.\n# TYPE gpu_device_plugin_gpu_mode gauge"
        );
        for g in gpus.iter() {
            for mode in GpuMode::ALL {
                let _ = writeln!(
                    out,
                    "gpu_device_plugin_gpu_mode{{gpu=\"{}\",mode=\"{}\"}} {}",
                    g.uuid,
                    mode.name(),
                    u64::from(g.mode == mode)
                );
            }
        }
    }
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ContainerMemory {
    pub(crate) namespace: String,
    pub(crate) pod: String,
    pub(crate) container: String,
    /// The GPU's UUID.
    pub(crate) gpu: String,
    pub(crate) bytes: u64,
}

impl Metrics {
    /// Replaces enforcement's series; None removes them.
    pub(crate) fn set_enforcement(&self, series: Option<EnforcementSeries>) {
        *self.enforcement.lock().expect("metrics lock") = series;
    }

    fn render_enforcement(&self, out: &mut String) {
        let series = self.enforcement.lock().expect("metrics lock");
        let Some(series) = series.as_ref() else {
            return;
        };
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_enforcement_cache_dirs Per-container enforcement cache directories on the host.\n# TYPE gpu_device_plugin_enforcement_cache_dirs gauge\ngpu_device_plugin_enforcement_cache_dirs {}",
            series.cache_dirs
        );
        let _ = writeln!(
            out,
            "# HELP gpu_device_plugin_container_memory_used_bytes Device memory a container uses on a GPU, as its enforcement library reports it.\n# TYPE gpu_device_plugin_container_memory_used_bytes gauge"
        );
        for m in &series.memory_used {
            let _ = writeln!(
                out,
                "gpu_device_plugin_container_memory_used_bytes{{namespace=\"{}\",pod=\"{}\",container=\"{}\",gpu=\"{}\"}} {}",
                m.namespace, m.pod, m.container, m.gpu, m.bytes
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_failures_and_histograms() {
        let metrics = Metrics::default();
        let m = metrics.resource("doslab.io/gpu-core");
        m.devices.store(200, Ordering::Relaxed);
        m.registrations.store(3, Ordering::Relaxed);
        m.allocate.record(Duration::from_micros(700), None);
        m.allocate
            .record(Duration::from_millis(30), Some("unknown_id"));
        metrics.count_reload(true);
        metrics.count_reload(true);
        metrics.count_restart("plugin gpu-core");
        let text = metrics.render();
        assert!(text.contains("gpu_device_plugin_devices{resource=\"doslab.io/gpu-core\"} 200"));
        assert!(text.contains("gpu_device_plugin_config_reloads_total{result=\"applied\"} 2\n"));
        assert!(text.contains("gpu_device_plugin_config_reloads_total{result=\"refused\"} 0\n"));
        assert!(
            text.contains("gpu_device_plugin_child_restarts_total{child=\"plugin gpu-core\"} 1\n")
        );
        assert!(text.contains(
            "gpu_device_plugin_reregistrations_total{resource=\"doslab.io/gpu-core\"} 2"
        ));
        assert!(text.contains("rpc_total{resource=\"doslab.io/gpu-core\",rpc=\"allocate\"} 2"));
        assert!(text.contains("reason=\"unknown_id\"} 1"));
        assert!(text.contains("rpc=\"allocate\",le=\"0.001\"} 1"));
        assert!(text.contains("rpc=\"allocate\",le=\"+Inf\"} 2"));
        assert!(text.contains(&format!(
            "gpu_device_plugin_build_info{{version=\"{}\",git=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            crate::GIT_REVISION
        )));
        assert_eq!(
            metrics.not_ready(),
            ["doslab.io/gpu-core: not registered or not streaming"]
        );
        metrics.retain(&[]);
        assert!(metrics.not_ready().is_empty());
        metrics.hold("pod matcher", Hold::Waiting, Some("not synced".into()));
        metrics.hold("pod matcher", Hold::Failing, Some("failed".into()));
        metrics.hold("pod matcher", Hold::Waiting, None);
        assert_eq!(metrics.not_ready(), ["pod matcher: failed"]);
    }

    #[test]
    fn enforcement_series_are_absent_until_set() {
        let metrics = Metrics::default();
        assert!(!metrics.render().contains("enforcement_cache_dirs"));
        metrics.set_enforcement(Some(EnforcementSeries {
            cache_dirs: 2,
            memory_used: vec![ContainerMemory {
                namespace: "ns".into(),
                pod: "p".into(),
                container: "app".into(),
                gpu: "GPU-a".into(),
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
