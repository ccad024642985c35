//! A kube-scheduler stand-in for the tests and the benchmark: it places the
//! API-server stand-in's Pending pods that name it as their scheduler, as
//! kube-scheduler v1.32 does with an HTTP extender configured, or without
//! one (the node-total placement a GPU-blind scheduler makes).
//!
//! What it keeps of the real scheduler, since the extender depends on it:
//! - one pod at a time, in creation order; a pod that cannot be placed
//!   waits out a per-pod backoff (1 s doubling to 10 s by default) and is
//!   tried again;
//! - binds in the background: once a node is chosen the pod is *assumed*
//!   there and the next pod is filtered at once, before the bind's answer
//!   (kube-scheduler's binding cycle); a failed bind forgets the assumed
//!   pod and backs it off;
//! - its own node-level fit first: per node, allocatable minus the requests
//!   of the pods bound or assumed there, for every resource the pod
//!   requests (the extended ones included, as with `ignoredByScheduler:
//!   false`);
//! - the extender only for pods asking one of its `managedResources` (in
//!   requests or limits of any container, init ones included);
//! - filter: `POST <urlPrefix>/<filterVerb>` with `{"Pod", "Nodes",
//!   "NodeNames"}` (with `nodeCacheCapable`, `Nodes` is `null` and
//!   `NodeNames` the candidates; the Pod without `apiVersion`/`kind`); any
//!   non-200 or a non-empty `Error` fails the attempt unless the extender
//!   is `ignorable`; a node name it returns that was not sent is an error;
//!   `FailedNodes` and `FailedAndUnresolvableNodes` only explain;
//! - a single feasible node is taken without prioritizing; otherwise
//!   prioritize with the same body, each `Score` × weight × 10 (errors there
//!   are ignored: no score), added to the default score plugins that tell
//!   nodes apart here: NodeResourcesFit (LeastAllocated over cpu and
//!   memory, each request at least 100m / 200Mi) and
//!   NodeResourcesBalancedAllocation (cpu and memory as requested), weight
//!   1 each, 0..=100 each, unless the profile disables them; the highest
//!   total wins (ties: first in name order, or random with a seed);
//! - every extender call ends at its `httpTimeout` (default 5 s): the
//!   scheduler hangs up and the attempt fails;
//! - bind: `POST <urlPrefix>/<bindVerb>` with `{"PodName", "PodNamespace",
//!   "PodUID", "Node"}`, success only on 200 and an empty `Error`; without
//!   a binding extender the scheduler creates `pods/<name>/binding` itself;
//! - answers are read with Go's case-insensitive key matching.
//!
//! What it leaves out: the score plugins that score every node alike for
//! these pods (TaintToleration, NodeAffinity, ImageLocality, and
//! PodTopologySpread without constraints), preemption, and the
//! unschedulable queue's wake-up on cluster events (backoff only).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use k8s_openapi::api::core::v1::{Binding, Container, Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

/// kube-scheduler's extender scores are 0..=10 and its node scores
/// 0..=100: an extender's score is scaled by this on top of its weight.
const EXTENDER_SCORE_SCALE: i64 = 10;

/// The shipped config's extender `weight`: the extender scores its best
/// node 10 and every other at most 8, 2,000 points ahead (× weight × 10),
/// more than the score plugins the shipped profile leaves on add together,
/// so the extender's policy decides.
pub const DOSLAB_WEIGHT: i64 = 100;
/// The shipped config's extender `httpTimeout`.
pub const DOSLAB_HTTP_TIMEOUT: Duration = Duration::from_secs(30);
/// The score plugins the shipped GPU profile disables: they spread pods by
/// cpu and memory, against a binpack policy.
pub const DOSLAB_DISABLED_SCORES: [&str; 2] =
    ["NodeResourcesFit", "NodeResourcesBalancedAllocation"];

/// An `extenders:` entry of a KubeSchedulerConfiguration (the verbs the
/// stand-in uses; an empty verb is not called).
#[derive(Debug, Clone)]
pub struct ExtenderConfig {
    pub(crate) url_prefix: String,
    pub(crate) filter_verb: String,
    pub(crate) prioritize_verb: String,
    pub(crate) bind_verb: String,
    pub weight: i64,
    pub(crate) node_cache_capable: bool,
    pub(crate) ignorable: bool,
    /// Resource names; empty: every pod goes to the extender.
    pub(crate) managed_resources: Vec<String>,
    pub http_timeout: Duration,
}

impl ExtenderConfig {
    /// The project's extender at `url_prefix`, configured as deploy/scheduler
    /// configures it (a test in tests/deploy.rs holds the two together).
    pub fn doslab(url_prefix: &str) -> ExtenderConfig {
        ExtenderConfig {
            url_prefix: url_prefix.to_owned(),
            filter_verb: "filter".into(),
            prioritize_verb: "prioritize".into(),
            bind_verb: "bind".into(),
            weight: DOSLAB_WEIGHT,
            node_cache_capable: true,
            ignorable: false,
            managed_resources: ["gpu-memory", "gpu-core", "gpu-count"]
                .iter()
                .map(|r| format!("doslab.io/{r}"))
                .collect(),
            http_timeout: DOSLAB_HTTP_TIMEOUT,
        }
    }

    fn interested(&self, pod: &Pod) -> bool {
        if self.managed_resources.is_empty() {
            return true;
        }
        let spec = pod.spec.as_ref();
        let containers = spec.iter().flat_map(|s| {
            s.containers
                .iter()
                .chain(s.init_containers.iter().flatten())
        });
        containers
            .filter_map(|c| c.resources.as_ref())
            .flat_map(|r| {
                r.requests
                    .iter()
                    .chain(r.limits.iter())
                    .flat_map(|m| m.keys())
            })
            .any(|name| self.managed_resources.contains(name))
    }
}

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// The `schedulerName` of the pods it places.
    pub(crate) name: String,
    pub(crate) extender: Option<ExtenderConfig>,
    /// Ties between top-scoring nodes: `None` takes the first in name
    /// order, `Some(seed)` picks at random, reproducibly.
    pub seed: Option<u64>,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// How often it looks for pending pods.
    pub(crate) poll: Duration,
    /// Score plugins the profile disables (`plugins.score.disabled`).
    pub disabled_scores: Vec<String>,
}

impl SchedulerConfig {
    pub fn new(extender: Option<ExtenderConfig>) -> SchedulerConfig {
        SchedulerConfig {
            name: "doslab-gpu-scheduler".into(),
            extender,
            seed: None,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(10),
            poll: Duration::from_millis(20),
            disabled_scores: Vec::new(),
        }
    }

    /// The GPU profile and extender as deploy/scheduler ships them.
    pub fn shipped(extender_url: &str) -> SchedulerConfig {
        SchedulerConfig {
            disabled_scores: DOSLAB_DISABLED_SCORES.map(String::from).to_vec(),
            ..SchedulerConfig::new(Some(ExtenderConfig::doslab(extender_url)))
        }
    }

    fn scores(&self, plugin: &str) -> bool {
        !self.disabled_scores.iter().any(|d| d == plugin)
    }
}

/// What happened to one pod (by `namespace/name`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    pub attempts: u32,
    pub node: Option<String>,
    /// Why the last attempt failed.
    pub(crate) error: Option<String>,
    /// Why each node was filtered out on the last attempt (node totals or
    /// the extender's `FailedNodes` and `FailedAndUnresolvableNodes`).
    pub filtered: BTreeMap<String, String>,
    /// Binds that failed (each a scheduling error and a backoff).
    pub bind_failures: u32,
    /// When its bind succeeded.
    pub bound_at: Option<Instant>,
}

struct Backoff {
    attempts: u32,
    until: Instant,
}

type Http =
    hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, Body>;

/// What the scheduling loop and its background binds share.
#[derive(Default)]
struct LoopState {
    backoff: HashMap<String, Backoff>,
    outcomes: BTreeMap<String, Outcome>,
    /// Pods chosen a node whose bind has not been seen done: counted on
    /// that node by the node-level fit and the score plugins, and not
    /// scheduled again meanwhile.
    assumed: HashMap<String, (String, Pod)>,
}

struct Scheduler {
    config: SchedulerConfig,
    client: Client,
    http: Http,
    shared: Arc<Mutex<LoopState>>,
    rng: u64,
}

pub struct SchedulerSim {
    shared: Arc<Mutex<LoopState>>,
    task: JoinHandle<()>,
}

impl SchedulerSim {
    /// Starts placing pods through the API server `kubeconfig` reaches.
    pub async fn start(kubeconfig: &Path, config: SchedulerConfig) -> Result<SchedulerSim, String> {
        let client = gpu_device_plugin::net::kube_client::from_kubeconfig(kubeconfig, "kubeconfig")
            .await
            .map_err(|e| e.to_string())?;
        let shared: Arc<Mutex<LoopState>> = Arc::default();
        let http =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http();
        let mut scheduler = Scheduler {
            rng: config.seed.unwrap_or_default(),
            config,
            client,
            http,
            shared: shared.clone(),
        };
        let task = tokio::spawn(async move {
            loop {
                if let Err(e) = scheduler.round().await {
                    tracing::warn!(error = %e, "scheduler stand-in: cannot list");
                }
                tokio::time::sleep(scheduler.config.poll).await;
            }
        });
        Ok(SchedulerSim { shared, task })
    }

    /// Every pod it tried, by `namespace/name`.
    pub fn outcomes(&self) -> BTreeMap<String, Outcome> {
        lock(&self.shared).outcomes.clone()
    }

    pub fn stop(self) {
        self.task.abort();
    }
}

fn lock(shared: &Mutex<LoopState>) -> std::sync::MutexGuard<'_, LoopState> {
    shared.lock().expect("scheduler stand-in state poisoned")
}

/// Records the end of an attempt on `k`: bound to `node`, or failed (and
/// backed off) with `error`.
fn settle(
    shared: &Mutex<LoopState>,
    config: &SchedulerConfig,
    k: &str,
    result: Result<String, String>,
) {
    let mut s = lock(shared);
    match result {
        Ok(node) => {
            let outcome = s.outcomes.entry(k.to_owned()).or_default();
            outcome.node = Some(node);
            outcome.error = None;
            outcome.bound_at = Some(Instant::now());
            s.backoff.remove(k);
        }
        Err(e) => {
            tracing::debug!(pod = %k, error = %e, "scheduler stand-in: unschedulable");
            s.assumed.remove(k);
            s.outcomes.entry(k.to_owned()).or_default().error = Some(e);
            let b = s.backoff.entry(k.to_owned()).or_insert(Backoff {
                attempts: 0,
                until: Instant::now(),
            });
            b.attempts += 1;
            let delay = config
                .initial_backoff
                .saturating_mul(1 << (b.attempts - 1).min(16))
                .min(config.max_backoff);
            b.until = Instant::now() + delay;
        }
    }
}

fn key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// A quantity in thousandths, rounded up (`100m` CPU is 100, `1` is
/// 1000, `1Ki` is 1 024 000); `None` when it does not parse.
fn milli(q: &Quantity) -> Option<i128> {
    gpu_device_plugin::rules::usage::quantity::Quantity::parse(&q.0)
        .ok()?
        .milli()
}

/// A container's requests; an extended resource with only a limit requests
/// the limit (the API server's defaulting).
fn container_requests(c: &Container) -> BTreeMap<String, i128> {
    let Some(r) = &c.resources else {
        return BTreeMap::new();
    };
    let mut out: BTreeMap<String, i128> = BTreeMap::new();
    for (name, q) in r.limits.iter().flatten() {
        out.insert(name.clone(), milli(q).unwrap_or(0));
    }
    for (name, q) in r.requests.iter().flatten() {
        out.insert(name.clone(), milli(q).unwrap_or(0));
    }
    out
}

/// A pod's effective requests, per resource: the larger of its app
/// containers' sum and its largest init container, sidecars counted beside
/// everything that runs after them.
fn pod_requests(pod: &Pod) -> BTreeMap<String, i128> {
    let Some(spec) = &pod.spec else {
        return BTreeMap::new();
    };
    let mut total: BTreeMap<String, i128> = BTreeMap::new();
    for c in &spec.containers {
        for (name, n) in container_requests(c) {
            *total.entry(name).or_default() += n;
        }
    }
    // As kube-scheduler counts sidecars (restartable init containers): each
    // runs beside everything after it, so it adds to the app containers'
    // sum and to every later init container's own request.
    let mut sidecars: BTreeMap<String, i128> = BTreeMap::new();
    let mut init_peak: BTreeMap<String, i128> = BTreeMap::new();
    for c in spec.init_containers.iter().flatten() {
        let sidecar = c.restart_policy.as_deref() == Some("Always");
        for (name, n) in container_requests(c) {
            let beside = sidecars.entry(name.clone()).or_default();
            if sidecar {
                *beside += n;
                *total.entry(name.clone()).or_default() += n;
            }
            let running = if sidecar { *beside } else { n + *beside };
            let peak = init_peak.entry(name).or_default();
            *peak = (*peak).max(running);
        }
    }
    for (name, peak) in init_peak {
        let t = total.entry(name).or_default();
        *t = (*t).max(peak);
    }
    total
}

/// Why `pod` does not fit `node` beside the pods already `bound` there.
fn node_misfit(node: &Node, bound: &[&Pod], pod: &Pod) -> Option<String> {
    if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
        return Some("node(s) were unschedulable".into());
    }
    let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let free = |name: &str| -> i128 {
        let total = allocatable
            .and_then(|a| a.get(name))
            .and_then(milli)
            .unwrap_or(0);
        let used: i128 = bound
            .iter()
            .map(|p| pod_requests(p).get(name).copied().unwrap_or(0))
            .sum();
        total - used
    };
    let max_pods = allocatable.and_then(|a| a.get("pods")).and_then(milli);
    if max_pods.is_some_and(|max| (bound.len() as i128 + 1) * 1000 > max) {
        return Some("Too many pods".into());
    }
    pod_requests(pod)
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .find(|(name, n)| free(name) < *n)
        .map(|(name, _)| format!("Insufficient {name}"))
}

/// Go's encoding/json matches a struct field to the first key equal to its
/// name, else to one equal ignoring case.
fn field<'a>(object: &'a Value, name: &str) -> &'a Value {
    let Some(map) = object.as_object() else {
        return &Value::Null;
    };
    map.get(name)
        .or_else(|| {
            map.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v)
        })
        .unwrap_or(&Value::Null)
}

impl Scheduler {
    /// One pass over the pods waiting for this scheduler, oldest first.
    async fn round(&mut self) -> Result<(), kube::Error> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let selector = format!(
            "spec.nodeName=,spec.schedulerName={},status.phase=Pending",
            self.config.name
        );
        let mut pending = pods
            .list(&ListParams::default().fields(&selector))
            .await?
            .items;
        pending.retain(|p| p.metadata.deletion_timestamp.is_none());
        pending.sort_by(|a, b| {
            let created = |p: &Pod| p.metadata.creation_timestamp.clone().map(|t| t.0);
            (created(a), key(a)).cmp(&(created(b), key(b)))
        });
        // One look at the cluster per round, as the informers' cache: the
        // pods this round places are counted as assumed.
        let mut nodes = Api::<Node>::all(self.client.clone())
            .list(&ListParams::default())
            .await?
            .items;
        nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let all = pods
            .list(&ListParams::default().fields("status.phase!=Succeeded,status.phase!=Failed"))
            .await?
            .items;
        {
            // The informer shows these bound now: no longer assumed.
            let bound: std::collections::HashSet<String> = all
                .iter()
                .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
                .map(key)
                .collect();
            lock(&self.shared).assumed.retain(|k, _| !bound.contains(k));
        }
        for pod in pending {
            let k = key(&pod);
            {
                let s = lock(&self.shared);
                let waits = s.backoff.get(&k).is_some_and(|b| Instant::now() < b.until);
                if waits || s.assumed.contains_key(&k) {
                    continue;
                }
            }
            // The real scheduler's queue drops a pod the moment its
            // informer sees it deleted or bound; a round listed long ago
            // must not spend time on those.
            let ns = pod.metadata.namespace.clone().unwrap_or_default();
            let name = pod.metadata.name.clone().unwrap_or_default();
            let current = Api::<Pod>::namespaced(self.client.clone(), &ns)
                .get_opt(&name)
                .await?;
            let waiting = current.as_ref().is_some_and(|p| {
                p.metadata.deletion_timestamp.is_none()
                    && p.spec
                        .as_ref()
                        .and_then(|s| s.node_name.as_ref())
                        .is_none_or(String::is_empty)
            });
            if !waiting {
                lock(&self.shared).backoff.remove(&k);
                continue;
            }
            let mut filtered = BTreeMap::new();
            let result = self.schedule_one(&pod, &nodes, &all, &mut filtered).await;
            {
                let mut s = lock(&self.shared);
                let outcome = s.outcomes.entry(k.clone()).or_default();
                outcome.attempts += 1;
                outcome.filtered = filtered;
            }
            match result {
                // The binding cycle runs on while the next pod is filtered.
                Ok((node, extender)) => self.bind_in_background(pod, node, extender),
                Err(e) => settle(&self.shared, &self.config, &k, Err(e)),
            }
        }
        Ok(())
    }

    /// Assumes `pod` on `node` and binds it in the background (through
    /// the extender when it binds), as kube-scheduler's binding cycle.
    fn bind_in_background(&self, pod: Pod, node: String, extender: Option<ExtenderConfig>) {
        let k = key(&pod);
        lock(&self.shared)
            .assumed
            .insert(k.clone(), (node.clone(), pod.clone()));
        let (client, http) = (self.client.clone(), self.http.clone());
        let (shared, config) = (self.shared.clone(), self.config.clone());
        tokio::spawn(async move {
            let result = match extender.filter(|e| !e.bind_verb.is_empty()) {
                Some(e) => extender_bind(&http, &e, &pod, &node).await,
                None => bind(&client, &pod, &node).await,
            };
            if result.is_err() {
                lock(&shared)
                    .outcomes
                    .entry(k.clone())
                    .or_default()
                    .bind_failures += 1;
            }
            settle(&shared, &config, &k, result.map(|()| node));
        });
    }

    /// Chooses a node for one pod (and the extender that binds it), or
    /// says why none; `reasons` gets why each filtered node was.
    async fn schedule_one(
        &mut self,
        pod: &Pod,
        nodes: &[Node],
        all: &[Pod],
        reasons: &mut BTreeMap<String, String>,
    ) -> Result<(String, Option<ExtenderConfig>), String> {
        // The scheduler's cache: the pods bound, and those assumed whose
        // bind the list does not show yet.
        let mut placed: HashMap<String, Vec<Pod>> = HashMap::new();
        for p in all.iter().cloned() {
            if let Some(n) = p.spec.as_ref().and_then(|s| s.node_name.clone()) {
                placed.entry(n).or_default().push(p);
            }
        }
        for (node, p) in lock(&self.shared).assumed.values() {
            let on = placed.entry(node.clone()).or_default();
            if !on.iter().any(|q| key(q) == key(p)) {
                on.push(p.clone());
            }
        }
        let mut feasible = Vec::new();
        for node in nodes {
            let name = node.metadata.name.clone().unwrap_or_default();
            let bound: Vec<&Pod> = placed.get(&name).into_iter().flatten().collect();
            match node_misfit(node, &bound, pod) {
                Some(why) => {
                    reasons.insert(name, why);
                }
                None => feasible.push(name),
            }
        }
        let extender = self.config.extender.clone().filter(|e| e.interested(pod));
        if let Some(e) = &extender
            && !feasible.is_empty()
            && !e.filter_verb.is_empty()
        {
            match self.filter(e, pod, &feasible).await {
                Ok((passed, failed)) => {
                    reasons.extend(failed);
                    feasible = passed;
                }
                Err(err) if e.ignorable => {
                    tracing::info!(error = %err, "scheduler stand-in: ignorable extender failed");
                }
                Err(err) => return Err(err),
            }
        }
        let node = match feasible.len() {
            0 => {
                let why: Vec<String> = reasons.iter().map(|(n, r)| format!("{n}: {r}")).collect();
                return Err(format!(
                    "0/{} nodes are available: {}",
                    nodes.len(),
                    why.join("; ")
                ));
            }
            // With one node left there is nothing to prioritize.
            1 => feasible.remove(0),
            _ => {
                let by_node: BTreeMap<&str, i64> = feasible
                    .iter()
                    .map(|n| {
                        let node = nodes.iter().find(|x| x.metadata.name.as_ref() == Some(n));
                        let on: Vec<&Pod> = placed.get(n).into_iter().flatten().collect();
                        let score = node.map_or(0, |node| self.plugin_scores(node, &on, pod));
                        (n.as_str(), score)
                    })
                    .collect();
                self.pick(extender.as_ref(), pod, by_node).await
            }
        };
        Ok((node, extender))
    }

    /// The enabled default score plugins' total for `pod` on `node` beside
    /// the pods `on` it: NodeResourcesFit (LeastAllocated) and
    /// NodeResourcesBalancedAllocation over cpu and memory, weight 1 each.
    fn plugin_scores(&self, node: &Node, on: &[&Pod], pod: &Pod) -> i64 {
        let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
        let alloc = |r: &str| {
            allocatable
                .and_then(|a| a.get(r))
                .and_then(milli)
                .unwrap_or(0)
        };
        // (allocatable, requested counting the non-zero defaults, as
        // requested) per scored resource; ones the node lacks are skipped.
        let resources: Vec<(i128, i128, i128)> = [("cpu", 100), ("memory", 200 << 20)]
            .into_iter()
            .map(|(r, default_units)| {
                let asked = |p: &Pod| pod_requests(p).get(r).copied().unwrap_or(0);
                let non_zero = |p: &Pod| match asked(p) {
                    0 => default_units * if r == "cpu" { 1 } else { 1000 },
                    n => n,
                };
                let all = on.iter().copied().chain([pod]);
                let requested = all.clone().map(non_zero).sum();
                let exact = all.map(asked).sum();
                (alloc(r), requested, exact)
            })
            .filter(|(a, _, _)| *a > 0)
            .collect();
        let mut total = 0;
        if self.config.scores("NodeResourcesFit") && !resources.is_empty() {
            let least: i128 = resources
                .iter()
                .map(|(a, r, _)| if r > a { 0 } else { (a - r) * 100 / a })
                .sum();
            total += (least / resources.len() as i128) as i64;
        }
        if self.config.scores("NodeResourcesBalancedAllocation") {
            let fractions: Vec<f64> = resources
                .iter()
                .map(|(a, _, e)| (*e as f64 / *a as f64).min(1.0))
                .collect();
            let n = fractions.len().max(1) as f64;
            let mean = fractions.iter().sum::<f64>() / n;
            let std = (fractions.iter().map(|f| (f - mean).powi(2)).sum::<f64>() / n).sqrt();
            total += ((1.0 - std) * 100.0) as i64;
        }
        total
    }

    /// The extender's filter: the nodes that pass, and the reasons of
    /// those that do not.
    async fn filter(
        &self,
        e: &ExtenderConfig,
        pod: &Pod,
        nodes: &[String],
    ) -> Result<(Vec<String>, BTreeMap<String, String>), String> {
        let answer = send(&self.http, e, &e.filter_verb, &args(e, pod, nodes)).await?;
        let error = field(&answer, "Error").as_str().unwrap_or_default();
        if !error.is_empty() {
            return Err(error.to_owned());
        }
        let names: Vec<String> = match field(&answer, "NodeNames") {
            Value::Array(names) if e.node_cache_capable => names
                .iter()
                .filter_map(|n| n.as_str().map(String::from))
                .collect(),
            _ => field(field(&answer, "Nodes"), "Items")
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|n| n["metadata"]["name"].as_str().map(String::from))
                .collect(),
        };
        if let Some(stranger) = names.iter().find(|n| !nodes.contains(n)) {
            return Err(format!(
                "extender {:?} claims a filtered node {stranger:?} which is not found in the input node list",
                e.url_prefix
            ));
        }
        let mut failed = BTreeMap::new();
        for map in ["FailedNodes", "FailedAndUnresolvableNodes"] {
            for (node, why) in field(&answer, map).as_object().into_iter().flatten() {
                failed.insert(node.clone(), why.as_str().unwrap_or_default().to_owned());
            }
        }
        Ok((names, failed))
    }

    /// The top-scoring node, from the plugins' `scores` and the
    /// extender's; an extender that cannot prioritize scores nothing.
    async fn pick(
        &mut self,
        e: Option<&ExtenderConfig>,
        pod: &Pod,
        mut scores: BTreeMap<&str, i64>,
    ) -> String {
        let nodes: Vec<String> = scores.keys().map(|n| n.to_string()).collect();
        if let Some(e) = e.filter(|e| !e.prioritize_verb.is_empty()) {
            let body = args(e, pod, &nodes);
            match send(&self.http, e, &e.prioritize_verb, &body).await {
                Ok(Value::Array(list)) => {
                    for hp in &list {
                        let host = field(hp, "Host").as_str().unwrap_or_default();
                        let score = field(hp, "Score").as_i64().unwrap_or(0);
                        if let Some(s) = scores.get_mut(host) {
                            *s += score * e.weight * EXTENDER_SCORE_SCALE;
                        }
                    }
                }
                Ok(other) => tracing::info!(answer = %other, "prioritize: not a host list"),
                Err(err) => tracing::info!(error = %err, "prioritize failed; no scores"),
            }
        }
        let best = scores.values().copied().max().unwrap_or(0);
        let top: Vec<&str> = scores
            .iter()
            .filter(|(_, s)| **s == best)
            .map(|(n, _)| *n)
            .collect();
        let i = match self.config.seed {
            None => 0,
            Some(_) => {
                self.rng = self
                    .rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.rng >> 33) % top.len() as u64) as usize
            }
        };
        top[i].to_owned()
    }
}

async fn extender_bind(
    http: &Http,
    e: &ExtenderConfig,
    pod: &Pod,
    node: &str,
) -> Result<(), String> {
    let body = json!({
        "PodName": pod.metadata.name,
        "PodNamespace": pod.metadata.namespace,
        "PodUID": pod.metadata.uid,
        "Node": node,
    });
    let answer = send(http, e, &e.bind_verb, &body).await?;
    match field(&answer, "Error").as_str().unwrap_or_default() {
        "" => Ok(()),
        error => Err(error.to_owned()),
    }
}

/// The Binding the default binder creates.
async fn bind(client: &Client, pod: &Pod, node: &str) -> Result<(), String> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let name = pod.metadata.name.clone().unwrap_or_default();
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.to_owned()),
            uid: pod.metadata.uid.clone(),
            ..Default::default()
        },
        target: ObjectReference {
            kind: Some("Node".into()),
            name: Some(node.to_owned()),
            ..Default::default()
        },
    };
    Api::<Pod>::namespaced(client.clone(), namespace)
        .create_subresource::<_, Value>("binding", &name, &PostParams::default(), &binding)
        .await
        .map(drop)
        .map_err(|e| format!("binding to {node}: {e}"))
}

/// `POST <urlPrefix>/<verb>` as kube-scheduler's HTTP extender sends it.
async fn send(http: &Http, e: &ExtenderConfig, verb: &str, body: &Value) -> Result<Value, String> {
    let url = format!("{}/{verb}", e.url_prefix.trim_end_matches('/'));
    let request = Request::post(&url)
        .header("Content-Type", "application/json")
        .body(Body::from(body.to_string()))
        .map_err(|err| err.to_string())?;
    let exchange = async {
        let response = http
            .request(request)
            .await
            .map_err(|err| format!("{verb} at {url}: {err}"))?;
        if response.status() != StatusCode::OK {
            return Err(format!(
                "failed {verb} with extender at URL {url}, code {}",
                response.status().as_u16()
            ));
        }
        let bytes = axum::body::to_bytes(Body::new(response.into_body()), 64 << 20)
            .await
            .map_err(|err| format!("{verb} at {url}: {err}"))?;
        serde_json::from_slice(&bytes).map_err(|err| format!("{verb} at {url}: {err}"))
    };
    tokio::time::timeout(e.http_timeout, exchange)
        .await
        .map_err(|_| format!("{verb} at {url}: no answer within {:?}", e.http_timeout))?
}

/// `ExtenderArgs` as Go marshals it: the Pod as the informer holds it (no
/// `apiVersion` or `kind`), and either the candidate names (node cache
/// capable: `Nodes` is an explicit null) or the Node objects.
fn args(e: &ExtenderConfig, pod: &Pod, nodes: &[String]) -> Value {
    let mut pod = serde_json::to_value(pod).expect("a pod serialises");
    if let Some(p) = pod.as_object_mut() {
        p.remove("apiVersion");
        p.remove("kind");
    }
    if e.node_cache_capable {
        json!({"Pod": pod, "Nodes": null, "NodeNames": nodes})
    } else {
        let items: Vec<Value> = nodes
            .iter()
            .map(|n| json!({"metadata": {"name": n}}))
            .collect();
        json!({"Pod": pod, "Nodes": {"metadata": {}, "items": items}, "NodeNames": null})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apiserver::{ApiServerSim, PodContainer};

    /// A recorded extender call: path, content type, body.
    type Call = (String, String, Value);

    /// A fake extender on loopback: records every call and answers with
    /// `answer(verb, body)`; a bind it accepts it carries out through the
    /// API server, as the real extender does.
    struct FakeExtender {
        url: String,
        calls: Arc<Mutex<Vec<Call>>>,
    }

    impl FakeExtender {
        async fn start(
            client: Client,
            answer: impl Fn(&str, &Value) -> (StatusCode, Value) + Send + Sync + 'static,
        ) -> FakeExtender {
            let calls: Arc<Mutex<Vec<Call>>> = Arc::default();
            let answer = Arc::new(answer);
            let recorded = calls.clone();
            let app = axum::Router::new().fallback(move |req: Request<Body>| {
                let (calls, answer, client) = (recorded.clone(), answer.clone(), client.clone());
                async move {
                    let path = req.uri().path().to_owned();
                    let ctype = req
                        .headers()
                        .get("content-type")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    let bytes = axum::body::to_bytes(req.into_body(), 1 << 24)
                        .await
                        .unwrap();
                    let body: Value = serde_json::from_slice(&bytes).unwrap();
                    calls
                        .lock()
                        .unwrap()
                        .push((path.clone(), ctype, body.clone()));
                    let verb = path.rsplit('/').next().unwrap_or_default().to_owned();
                    let (status, answer) = answer(&verb, &body);
                    if verb == "bind" && status == StatusCode::OK && answer["Error"] == "" {
                        let ns = body["PodNamespace"].as_str().unwrap();
                        let name = body["PodName"].as_str().unwrap();
                        let binding = json!({
                            "apiVersion": "v1", "kind": "Binding",
                            "metadata": {"name": name, "namespace": ns, "uid": body["PodUID"]},
                            "target": {"kind": "Node", "name": body["Node"]},
                        });
                        Api::<Pod>::namespaced(client, ns)
                            .create_subresource::<_, Value>(
                                "binding",
                                name,
                                &PostParams::default(),
                                &binding,
                            )
                            .await
                            .unwrap();
                    }
                    axum::http::Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(Body::from(answer.to_string()))
                        .unwrap()
                }
            });
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}/gpu", listener.local_addr().unwrap());
            tokio::spawn(async move {
                let _ = axum::serve(listener, app).await;
            });
            FakeExtender { url, calls }
        }

        fn calls(&self) -> Vec<Call> {
            self.calls.lock().unwrap().clone()
        }
    }

    struct World {
        api: ApiServerSim,
        kubeconfig: tempfile::NamedTempFile,
    }

    impl World {
        async fn start() -> World {
            let api = ApiServerSim::start().await.unwrap();
            let kubeconfig = tempfile::NamedTempFile::new().unwrap();
            api.write_kubeconfig(kubeconfig.path()).unwrap();
            World { api, kubeconfig }
        }

        async fn client(&self) -> Client {
            gpu_device_plugin::net::kube_client::from_kubeconfig(
                self.kubeconfig.path(),
                "kubeconfig",
            )
            .await
            .unwrap()
        }

        async fn scheduler(&self, extender: Option<ExtenderConfig>) -> SchedulerSim {
            let mut config = SchedulerConfig::new(extender);
            config.initial_backoff = Duration::from_millis(50);
            config.max_backoff = Duration::from_millis(200);
            SchedulerSim::start(self.kubeconfig.path(), config)
                .await
                .unwrap()
        }

        /// Creates pod `default/p` asking 30 gpu-memory and has the
        /// scheduler, through `ext`, try it until its outcome is `done`.
        async fn schedule_p(
            &self,
            ext: &FakeExtender,
            done: impl Fn(&Outcome) -> bool,
        ) -> SchedulerSim {
            self.api
                .add_unscheduled_pod("default", "p", "doslab-gpu-scheduler", &gpu("main", 30));
            let sim = self.scheduler(Some(ExtenderConfig::doslab(&ext.url))).await;
            wait_for(&sim, |o| o.get("default/p").is_some_and(&done)).await;
            sim
        }
    }

    fn gpu(name: &str, memory: u64) -> Vec<PodContainer> {
        vec![PodContainer {
            name: name.into(),
            init: false,
            restartable: false,
            wants: [memory, 0, 0],
        }]
    }

    const MEM: &str = "doslab.io/gpu-memory";

    async fn wait_for(sim: &SchedulerSim, done: impl Fn(&BTreeMap<String, Outcome>) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(&sim.outcomes()) {
            assert!(Instant::now() < deadline, "{:?}", sim.outcomes());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn sends_what_kube_scheduler_sends_and_binds_through_the_extender() {
        let w = World::start().await;
        for n in ["n1", "n2", "n3"] {
            w.api.add_node(n, &[(MEM, 100), ("pods", 110)], &[]);
        }
        // n2 is full by the node totals: the extender never hears of it.
        w.api.add_pod("default", "busy", "n2", &gpu("c", 80), &[]);
        let ext = FakeExtender::start(w.client().await, |verb, _| match verb {
            "filter" => (
                StatusCode::OK,
                json!({"NodeNames": ["n1", "n3"], "FailedNodes": {}, "Error": ""}),
            ),
            "prioritize" => (
                StatusCode::OK,
                json!([{"Host": "n1", "Score": 3}, {"Host": "n3", "Score": 7}]),
            ),
            _ => (StatusCode::OK, json!({"Error": ""})),
        })
        .await;
        w.api
            .add_unscheduled_pod("default", "other", "default-scheduler", &gpu("main", 30));
        let sim = w.schedule_p(&ext, |o| o.node.is_some()).await;
        assert_eq!(sim.outcomes()["default/p"].node.as_deref(), Some("n3"));
        assert_eq!(w.api.pod("default", "p").unwrap()["spec"]["nodeName"], "n3");
        assert!(!sim.outcomes().contains_key("default/other"));

        let calls = ext.calls();
        let paths: Vec<&str> = calls.iter().map(|(p, _, _)| p.as_str()).collect();
        assert_eq!(paths, ["/gpu/filter", "/gpu/prioritize", "/gpu/bind"]);
        assert!(calls.iter().all(|(_, t, _)| t == "application/json"));
        let stored = w.api.pod("default", "p").unwrap();
        for (_, _, body) in &calls[..2] {
            let keys: Vec<&String> = body.as_object().unwrap().keys().collect();
            assert_eq!(keys, ["NodeNames", "Nodes", "Pod"]);
            assert_eq!(body["Nodes"], Value::Null);
            assert_eq!(body["NodeNames"], json!(["n1", "n3"]));
            let pod = &body["Pod"];
            assert!(pod.get("apiVersion").is_none() && pod.get("kind").is_none());
            assert_eq!(pod["metadata"]["uid"], stored["metadata"]["uid"]);
            assert_eq!(
                pod["spec"]["containers"][0]["resources"]["limits"][MEM],
                "30"
            );
        }
        assert_eq!(
            calls[2].2,
            json!({"PodName": "p", "PodNamespace": "default",
                   "PodUID": stored["metadata"]["uid"], "Node": "n3"})
        );
    }

    #[tokio::test]
    async fn one_feasible_node_is_bound_without_prioritizing_and_answers_read_case_insensitively() {
        let w = World::start().await;
        w.api.add_node("n1", &[(MEM, 100)], &[]);
        w.api.add_node("n2", &[(MEM, 100)], &[]);
        let ext = FakeExtender::start(w.client().await, |verb, _| match verb {
            "filter" => (
                StatusCode::OK,
                json!({"nodenames": ["n2"], "failedNodes": {"n1": "no GPU has 30 MiB free"}}),
            ),
            _ => (StatusCode::OK, json!({"error": ""})),
        })
        .await;
        let sim = w.schedule_p(&ext, |o| o.node.is_some()).await;
        assert_eq!(sim.outcomes()["default/p"].node.as_deref(), Some("n2"));
        let filtered = &sim.outcomes()["default/p"].filtered;
        assert_eq!(filtered["n1"], "no GPU has 30 MiB free");
        let paths: Vec<String> = ext.calls().into_iter().map(|(p, _, _)| p).collect();
        assert_eq!(paths, ["/gpu/filter", "/gpu/bind"]);
    }

    #[tokio::test]
    async fn extender_failures_leave_the_pod_pending_and_it_is_tried_again() {
        let w = World::start().await;
        w.api.add_node("n1", &[(MEM, 100)], &[]);
        let tries = Arc::new(Mutex::new(0u32));
        let t = tries.clone();
        let ext = FakeExtender::start(w.client().await, move |verb, _| {
            let mut n = t.lock().unwrap();
            match verb {
                // First a 500, then a filter Error, then a bind Error,
                // then all is well.
                "filter" => {
                    *n += 1;
                    match *n {
                        1 => (StatusCode::INTERNAL_SERVER_ERROR, json!({})),
                        2 => (StatusCode::OK, json!({"Error": "inventory unreadable"})),
                        _ => (StatusCode::OK, json!({"NodeNames": ["n1"]})),
                    }
                }
                _ if *n == 3 => (StatusCode::OK, json!({"Error": "patch conflict"})),
                _ => (StatusCode::OK, json!({"Error": ""})),
            }
        })
        .await;
        let sim = w.schedule_p(&ext, |o| o.node.is_some()).await;
        assert_eq!(sim.outcomes()["default/p"].attempts, 4);
        assert_eq!(w.api.pod("default", "p").unwrap()["spec"]["nodeName"], "n1");
        let paths: Vec<String> = ext.calls().into_iter().map(|(p, _, _)| p).collect();
        assert_eq!(
            paths,
            [
                "/gpu/filter",
                "/gpu/filter",
                "/gpu/filter",
                "/gpu/bind",
                "/gpu/filter",
                "/gpu/bind"
            ]
        );
    }

    #[tokio::test]
    async fn a_node_the_extender_was_not_asked_about_is_an_error() {
        let w = World::start().await;
        w.api.add_node("n1", &[(MEM, 100)], &[]);
        let ext = FakeExtender::start(w.client().await, |_, _| {
            (StatusCode::OK, json!({"NodeNames": ["n9"]}))
        })
        .await;
        let sim = w.schedule_p(&ext, |_| true).await;
        let error = sim.outcomes()["default/p"].error.clone().unwrap();
        assert!(error.contains("claims a filtered node \"n9\""), "{error}");
    }

    #[tokio::test]
    async fn without_an_extender_it_binds_by_node_totals_itself() {
        let w = World::start().await;
        w.api.add_node("n1", &[(MEM, 100)], &[]);
        w.api.add_node("n2", &[(MEM, 50)], &[]);
        for (name, memory) in [("a", 60), ("b", 40), ("c", 60)] {
            w.api.add_unscheduled_pod(
                "default",
                name,
                "doslab-gpu-scheduler",
                &gpu("main", memory),
            );
        }
        let sim = w.scheduler(None).await;
        wait_for(&sim, |o| {
            ["default/a", "default/b", "default/c"].iter().all(|k| {
                o.get(*k)
                    .is_some_and(|o| o.attempts >= 2 || o.node.is_some())
            })
        })
        .await;
        let o = sim.outcomes();
        // a: only n1 has 60; b: both have room, the first name wins; c:
        // nothing is left that holds 60 (n1 has 0, n2 50).
        assert_eq!(o["default/a"].node.as_deref(), Some("n1"));
        assert_eq!(o["default/b"].node.as_deref(), Some("n1"));
        assert_eq!(o["default/c"].node, None);
        let why = o["default/c"].error.clone().unwrap();
        assert!(why.contains("Insufficient doslab.io/gpu-memory"), "{why}");
        assert_eq!(
            w.api.pod("default", "c").unwrap()["spec"]["nodeName"],
            Value::Null
        );
        assert_eq!(w.api.requests().get("bind"), Some(&2));
    }

    /// The stand-in's `shipped()` is the GPU profile deploy/scheduler ships.
    #[test]
    fn shipped_config_is_the_deployed_one() {
        let map: Value =
            serde_yaml::from_str(include_str!("../../../deploy/scheduler/configmap.yaml")).unwrap();
        let config: Value =
            serde_yaml::from_str(map["data"]["scheduler.yaml"].as_str().unwrap()).unwrap();
        let ext = &config["extenders"][0];
        assert_eq!(ext["weight"], DOSLAB_WEIGHT);
        let timeout = format!("{}s", DOSLAB_HTTP_TIMEOUT.as_secs());
        assert_eq!(ext["httpTimeout"], timeout.as_str());
        let disabled: Vec<&str> = config["profiles"][0]["plugins"]["score"]["disabled"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        assert_eq!(disabled, DOSLAB_DISABLED_SCORES);
    }

    #[test]
    fn quantities_and_effective_requests() {
        let q = |s: &str| milli(&Quantity(s.into()));
        assert_eq!(q("100m"), Some(100));
        assert_eq!(q("2"), Some(2000));
        assert_eq!(q("1Ki"), Some(1_024_000));
        assert_eq!(q("1.5"), Some(1500));
        assert_eq!(q("1x"), None);
        let pod: Pod = serde_json::from_value(json!({
            "spec": {
                "initContainers": [{"name": "i", "resources": {"limits": {MEM: "70"}}}],
                "containers": [
                    {"name": "a", "resources": {"requests": {MEM: "20"}, "limits": {MEM: "30"}}},
                    {"name": "b", "resources": {"limits": {MEM: "30"}}},
                ],
            }
        }))
        .unwrap();
        // Requests win over limits; the init container's 70 beats 20 + 30.
        assert_eq!(pod_requests(&pod)[MEM], 70_000);

        // A sidecar (10) runs beside the init container after it (50: 60)
        // and beside the app containers (30 + 10 = 40): 60. Without the
        // sidecar being counted it would be 50.
        let init = |name: &str, n: &str, sidecar: bool| {
            let mut c = json!({"name": name, "resources": {"limits": {MEM: n}}});
            if sidecar {
                c["restartPolicy"] = "Always".into();
            }
            c
        };
        let pod = |inits: Vec<Value>, app: &str| -> Pod {
            serde_json::from_value(json!({"spec": {
                "initContainers": inits,
                "containers": [{"name": "a", "resources": {"limits": {MEM: app}}}],
            }}))
            .unwrap()
        };
        let with = pod(vec![init("s", "10", true), init("i", "50", false)], "30");
        assert_eq!(pod_requests(&with)[MEM], 60_000);
        // A big app: the sidecar adds to its sum.
        let big = pod(vec![init("s", "10", true), init("i", "50", false)], "55");
        assert_eq!(pod_requests(&big)[MEM], 65_000);
        // An init container before the sidecar does not run beside it.
        let before = pod(vec![init("i", "50", false), init("s", "10", true)], "30");
        assert_eq!(pod_requests(&before)[MEM], 50_000);
    }
}
