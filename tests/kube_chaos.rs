//! Soak and chaos on the real components (tests/kube): a seeded workload
//! of GPU pods created and deleted on a few nodes (the kubelet peer and
//! the real daemon each) behind kube-scheduler and the real extender, and
//! of pods on ResourceClaims on a node the daemon serves through DRA,
//! while faults land at seeded moments: `kill -9` of a node daemon (during
//! an Allocate, or during a NodePrepareResources), of the extender and of
//! kube-scheduler, a kubelet restart (its checkpoint kept), an API server
//! restart (etcd kept), a reload with a changed config, a slow API server
//! (a delay in front of it) and a GPU going unhealthy and back. Invariants
//! are checked all along, from the API server's pods and claims, the
//! kubelets' records, the CDI specs and the daemons' metrics, and again
//! once the workload drains.
//!
//! The short run without kubelet or API server restarts is in the suite;
//! the one with every fault and the soak are ignored until the defect
//! they still find is fixed (issue 35's closing note). By hand:
//! `cargo test --test kube_chaos -- --ignored --nocapture a_short`
//! (`CHAOS_SEED`, `CHAOS_PODS`, `CHAOS_ARTIFACTS`: a folder for every log
//! and kubelet record), the soak `cargo test --release --test kube_chaos
//! -- --ignored --nocapture soak` (`CHAOS_SEEDS`, `CHAOS_PODS`). A failing
//! run prints its seed and fault schedule; `CHAOS_SEED=<seed>` replays
//! that schedule.

mod support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use support::Lcg;
use support::kube::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NS: &str = "chaos";
/// Device-plugin nodes, `node-0` on; the DRA node is `node-{NODES}`.
const NODES: usize = 3;
const GPUS: usize = 4;
/// The product's DRA driver.
const DRIVER: &str = "gpu.doslab.io";
const GPU_GIB: u64 = 16;
/// Pods alive at once: few enough that any of them fits whatever the
/// others hold (three pods touch at most nine of the twelve GPUs, and
/// hold at most 36 GiB), so a pod Pending is a pod the faults held up.
const LIVE: usize = 4;
/// The bound: no pod that fits stays Pending longer than this
/// after the last fault.
const PENDING: Duration = Duration::from_secs(30);
/// A fault after every this many pods, on average.
const FAULT_EVERY: u64 = 8;
/// What each chunk through the slow API server waits.
const SLOW: Duration = Duration::from_millis(200);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Fault {
    /// `kill -9` of a node daemon (not node 0's, which the soak watches
    /// for leaks), moments after a pod was created: often mid-Allocate.
    DaemonKill,
    /// `kill -9` of the DRA node's daemon moments after a claim's pod was
    /// created: often mid-NodePrepareResources.
    PrepareKill,
    /// `kill -9` of the extender moments after a pod was created: often
    /// mid-bind.
    ExtenderKill,
    SchedulerKill,
    /// `kill -9` of a kubelet and a new one on its checkpoint.
    KubeletRestart,
    /// `kill -9` of kube-apiserver; a new one on the same etcd.
    ApiserverRestart,
    /// A changed config and SIGHUP.
    DaemonReload,
    /// Every client's traffic through the API server delayed a while.
    ApiserverSlow,
    /// One GPU failing its health checks a while, then healthy again.
    GpuUnhealthy,
}

const FAULTS: [Fault; 9] = [
    Fault::DaemonKill,
    Fault::PrepareKill,
    Fault::ExtenderKill,
    Fault::SchedulerKill,
    Fault::KubeletRestart,
    Fault::ApiserverRestart,
    Fault::DaemonReload,
    Fault::ApiserverSlow,
    Fault::GpuUnhealthy,
];

impl Fault {
    /// Whether it strikes one node: the next plugin pod is pinned there
    /// (a device-plugin node), so that its recovery is that node's.
    fn on_node(self) -> bool {
        matches!(
            self,
            Fault::DaemonKill | Fault::KubeletRestart | Fault::DaemonReload | Fault::GpuUnhealthy
        )
    }
}

/// What a pod asks.
#[derive(Clone, Debug)]
enum Shape {
    /// Device-plugin containers: name (`init-*` for init containers) and
    /// (gpu-memory GiB, gpu-core, gpu-count).
    Plugin(Vec<(String, [u64; 3])>),
    /// One container `main` on a ResourceClaim from a template: (memory
    /// GiB, cores) of one GPU, or `None` for a whole GPU.
    Claim(Option<(u64, u64)>),
}

#[derive(Clone, Debug)]
enum Step {
    /// A new pod; if `early`, deleted right after its creation. Before it,
    /// a live pod goes when `LIVE` are: the `victim`-th, modulo.
    Create {
        shape: Shape,
        victim: usize,
        early: bool,
    },
    /// A fault `after` the previous step, on `node` (and its `gpu`) when
    /// it strikes one; a fault that lasts ends `lasts` later.
    Fault {
        fault: Fault,
        node: usize,
        gpu: usize,
        after: Duration,
        lasts: Duration,
    },
}

/// The seed's schedule: `pods` creations, faults among them, every kind
/// in turn in a seeded order.
fn schedule(seed: u64, pods: usize, faults: &[Fault]) -> Vec<Step> {
    let mut rng = Lcg(seed);
    let mut kinds = Vec::new();
    let mut steps = Vec::new();
    for _ in 0..pods {
        steps.push(Step::Create {
            shape: shape(&mut rng),
            victim: rng.below(LIVE as u64) as usize,
            early: rng.below(10) == 0,
        });
        if rng.below(FAULT_EVERY) == 0 {
            if kinds.is_empty() {
                kinds = faults.to_vec();
                for i in (1..kinds.len()).rev() {
                    kinds.swap(i, rng.below(i as u64 + 1) as usize);
                }
            }
            let fault = kinds.pop().unwrap();
            let node = match fault {
                Fault::DaemonKill => 1 + rng.below(NODES as u64 - 1),
                Fault::PrepareKill => NODES as u64,
                // The DRA node's kubelet restarts too.
                Fault::KubeletRestart => rng.below(NODES as u64 + 1),
                _ => rng.below(NODES as u64),
            } as usize;
            // The kill strikes while the claim of the pod just created
            // is being prepared.
            if fault == Fault::PrepareKill
                && let Some(Step::Create { shape, early, .. }) = steps.last_mut()
            {
                *shape = Shape::Claim(claim(&mut rng));
                *early = false;
            }
            steps.push(Step::Fault {
                fault,
                node,
                gpu: rng.below(GPUS as u64) as usize,
                after: Duration::from_millis(rng.below(300)),
                lasts: Duration::from_millis(1000 + rng.below(3000)),
            });
        }
    }
    steps
}

/// Node `n`'s GPUs: [`GPUS`] of [`GPU_GIB`] each.
fn node_gpus(n: usize) -> Vec<(String, u64)> {
    (0..GPUS)
        .map(|g| (gpu_uuid(n, g), GPU_GIB * 1024))
        .collect()
}

/// One whole GPU, an init container before a share, or one to three
/// shares of 1–4 GiB, some with 10–30 % of the GPU's compute; or a claim.
fn shape(rng: &mut Lcg) -> Shape {
    let share = |rng: &mut Lcg| {
        let cores = match rng.below(2) {
            0 => 0,
            _ => 10 * (1 + rng.below(3)),
        };
        [1 + rng.below(4), cores, 0]
    };
    let named = |n: &str, w| (n.to_owned(), w);
    Shape::Plugin(match rng.below(10) {
        0 | 1 => vec![named("main", [0, 0, 1])],
        2 | 3 => vec![named("init-setup", share(rng)), named("main", share(rng))],
        4 | 5 => return Shape::Claim(claim(rng)),
        _ => (0..1 + rng.below(3))
            .map(|c| (format!("c{c}"), share(rng)))
            .collect(),
    })
}

/// A claim's ask: a whole GPU, or 1–4 GiB and 10–30 % of one.
fn claim(rng: &mut Lcg) -> Option<(u64, u64)> {
    match rng.below(4) {
        0 => None,
        _ => Some((1 + rng.below(4), 10 * (1 + rng.below(3)))),
    }
}

/// The ResourceClaimTemplate of a claim's ask.
fn template(ask: Option<(u64, u64)>) -> String {
    ask.map_or("claim-whole".to_owned(), |(m, c)| format!("claim-{m}g-{c}"))
}

/// Every template [`claim`] may name, in the test's namespace.
fn templates() -> String {
    let shares = (1..=4).flat_map(|m| (1..=3).map(move |c| Some((m, 10 * c))));
    std::iter::once(None)
        .chain(shares)
        .map(|ask| {
            let asks = ask.map(|(m, c)| [("memory", format!("{m}Gi")), ("cores", c.to_string())]);
            let asks: Vec<(&str, &str)> = asks
                .iter()
                .flatten()
                .map(|(k, v)| (*k, v.as_str()))
                .collect();
            claim_template(NS, &template(ask), DRIVER, &asks)
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

/// A TCP proxy in front of the API server; while any slow window is open,
/// every chunk it forwards waits [`SLOW`] first: a slow API server, as
/// each of its clients sees it.
struct SlowProxy {
    addr: std::net::SocketAddr,
    windows: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl SlowProxy {
    async fn start(upstream: String) -> SlowProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let windows = Arc::new(AtomicUsize::new(0));
        let open = windows.clone();
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let open = open.clone();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::select! {
                        _ = pipe(dr, uw, open.clone()) => {}
                        _ = pipe(ur, dw, open) => {}
                    }
                });
            }
        });
        SlowProxy {
            addr,
            windows,
            task,
        }
    }

    /// `kubeconfig` rewritten to reach the API server through the proxy.
    fn route(&self, kubeconfig: &Path, apiserver: &str) {
        let text = std::fs::read_to_string(kubeconfig).unwrap();
        assert!(text.contains(apiserver), "{kubeconfig:?} names {apiserver}");
        let text = text.replace(apiserver, &self.addr.to_string());
        std::fs::write(kubeconfig, text).unwrap();
    }

    /// Puts `node`'s daemon and kubelet behind the proxy, each restarted
    /// on its kubeconfig routed through it: every client of the API server
    /// but the controller manager goes through it, so a slow window slows
    /// each of them.
    async fn behind(&self, apiserver: &str, node: &mut KubeNode) {
        self.route(&node.kubeconfig, apiserver);
        self.route(&node.kubelet_kubeconfig(), apiserver);
        node.kill_daemon();
        node.restart_kubelet().await;
    }
}

impl Drop for SlowProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    windows: Arc<AtomicUsize>,
) {
    let mut buf = vec![0; 64 << 10];
    while let Ok(n @ 1..) = from.read(&mut buf).await {
        if windows.load(Ordering::Relaxed) > 0 {
            tokio::time::sleep(SLOW).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// What the checker and the driver share.
#[derive(Default)]
struct Watch {
    /// When the last fault struck, or a lasting one ended.
    last_fault: Option<Instant>,
    /// Live pods (not yet deleted): when each was created.
    created: HashMap<String, Instant>,
    /// Pods the workload deleted or is deleting: a claim's CDI spec goes
    /// once its pod stops, before the pod is gone.
    deleting: HashSet<String>,
    /// When each pod was first seen Running.
    running: HashMap<String, Instant>,
    violations: Vec<String>,
    seen: HashSet<String>,
    checks: u64,
    /// The daemons' pids, by node.
    daemons: Vec<u32>,
    /// Each fault as it struck: its node and GPU.
    strikes: Vec<(Fault, usize, String, Instant)>,
    /// Pods that failed admission for a fault that struck their node
    /// while they were being admitted, by the fault.
    lost: HashMap<String, Fault>,
}

impl Watch {
    /// The fault a pod that failed admission on `node` lost to, if its
    /// failure is one that fault causes and the fault struck that node
    /// (a slow API server: any node) from shortly before the pod was
    /// created. Upstream's windows, or the open defects of the closing
    /// note:
    /// - a daemon or kubelet restart: the kubelet refuses a pod whose
    ///   devices it holds unhealthy (a device plugin not registered again
    ///   yet marks all of its devices so), or whose plugin's call broke
    ///   off as the plugin died; a restarted daemon steers no
    ///   GetPreferredAllocation before its pod cache synced, so the
    ///   kubelet may take another GPU than the one assigned, and the
    ///   kubelet's allocatable is short while the plugins register again
    ///   ("didn't have enough resource");
    /// - a kubelet restart: its first pods are admitted before it frees
    ///   the devices of pods deleted meanwhile, so it offers none on the
    ///   GPU the extender assigned ("the kubelet's ... devices are on"),
    ///   and a re-ask the daemon cannot tell ("no pending pod");
    /// - a GPU gone unhealthy: the daemon refuses the GPU the extender
    ///   assigned before it learnt, or another GPU of the node the
    ///   kubelet offered instead of the one assigned; the kubelet's
    ///   allocatable loses that GPU's devices while still counting those
    ///   in use on it ("didn't have enough resource");
    /// - a slow API server: the daemon's view trails the extender's.
    fn lost_to(&self, node: usize, created: Instant, message: &str) -> Option<Fault> {
        let since = created
            .checked_sub(Duration::from_secs(5))
            .unwrap_or(created);
        let unhealthy = message.contains("cannot allocate unhealthy devices")
            || message.contains("cannot allocate unregistered device")
            || message.contains("rpc error: code = Unavailable");
        self.strikes
            .iter()
            // A slow API server is slow for every node.
            .filter(|(f, n, _, at)| (*n == node || *f == Fault::ApiserverSlow) && *at >= since)
            .find(|(fault, _, gpu, _)| match fault {
                // A restarted daemon steers no GetPreferredAllocation
                // until its pod cache has synced.
                Fault::DaemonKill => {
                    unhealthy
                        || message.contains("by the extender, but the kubelet's")
                        || message.contains("Node didn't have enough resource")
                }
                Fault::KubeletRestart => {
                    unhealthy
                        || message.contains("by the extender, but the kubelet's")
                        || message.contains("no pending pod on this node has a container")
                }
                // The kubelet's devices of that GPU withdrawn, it may
                // also take another pod's GPU for this one.
                // The kubelet's allocatable loses the GPU's devices and
                // still counts those in use on it.
                Fault::GpuUnhealthy => {
                    message.contains(&format!("is assigned [\"{gpu}\"]"))
                        || message.contains("by the extender, but the kubelet's")
                        || message.contains("Node didn't have enough resource")
                }
                // The daemon's watch lags the extender's: the kubelet's
                // devices of a GPU the extender saw freed may still be
                // withdrawn (listed unhealthy) when the kubelet admits.
                Fault::ApiserverSlow => message.contains("by the extender, but the kubelet's"),
                _ => false,
            })
            .map(|(fault, ..)| *fault)
    }

    fn violate(&mut self, what: String) {
        // Keyed by its first line: a state seen on many samples counts once.
        let key = what.lines().next().unwrap_or_default().to_owned();
        if self.seen.insert(key) {
            eprintln!("VIOLATION: {what}");
            self.violations.push(what);
        }
    }

    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        self.checks += 1;
        if !ok {
            self.violate(what());
        }
    }
}

/// What the Running pods hold per GPU: memory GiB, cores, shares, whole
/// holders.
type Held = BTreeMap<String, (u64, u64, usize, usize)>;

/// A pod's GPU asks by container (init containers too): (memory GiB,
/// cores, whole GPUs).
fn asks(pod: &Pod) -> Vec<(String, bool, [u64; 3])> {
    let spec = pod.spec.as_ref().unwrap();
    let init = spec.init_containers.iter().flatten().map(|c| (c, true));
    let app = spec.containers.iter().map(|c| (c, false));
    init.chain(app)
        .filter_map(|(c, init)| {
            let limits = c.resources.as_ref()?.limits.as_ref()?;
            let get = |r: &str| {
                limits
                    .get(&format!("doslab.io/{r}"))
                    .map_or(0, |q| q.0.parse().unwrap())
            };
            let w = [get("gpu-memory"), get("gpu-core"), get("gpu-count")];
            (w != [0; 3]).then(|| (c.name.clone(), init, w))
        })
        .collect()
}

/// Checks a Running pod's grants against its spec and assignment, from
/// its node's kubelet record; what its app containers hold per GPU
/// (memory GiB, cores, whole) is added to `held`.
fn check_running(watch: &mut Watch, pod: &Pod, dirs: &[PathBuf], held: &mut Held) {
    let name = pod.metadata.name.clone().unwrap();
    let node = node_of(pod);
    let Some(dir) = node
        .strip_prefix("node-")
        .and_then(|n| n.parse::<usize>().ok())
        .and_then(|n| dirs.get(n))
    else {
        watch.violate(format!("{name} runs on unknown node {node:?}"));
        return;
    };
    let Some(record) = record_in(dir, NS, &name) else {
        watch.violate(format!("{name} Running with no kubelet record on {node}"));
        return;
    };
    let assignment: BTreeMap<String, Vec<String>> = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("doslab.io/gpu-assignment"))
        .and_then(|a| serde_json::from_str(a).ok())
        .unwrap_or_default();
    let split = splits(&record);
    watch.check(split.is_empty(), || {
        format!("{name}: a container's resources on different GPUs: {split:?}")
    });
    let envs = container_envs(&record);
    for (container, init, [mem, cores, whole]) in asks(pod) {
        let env = envs.get(&container).cloned().unwrap_or_default();
        let mut visible: Vec<String> = env
            .get("NVIDIA_VISIBLE_DEVICES")
            .map(|v| v.split(',').map(str::to_owned).collect())
            .unwrap_or_default();
        visible.sort();
        let mut assigned = assignment.get(&container).cloned().unwrap_or_default();
        assigned.sort();
        watch.check(!visible.is_empty() && visible == assigned, || {
            format!("{name}/{container} sees {visible:?}, assigned {assigned:?}")
        });
        let limit = env.get("CUDA_DEVICE_MEMORY_LIMIT_0").cloned();
        if whole > 0 {
            watch.check(visible.len() == whole as usize && limit.is_none(), || {
                format!("{name}/{container} asked {whole} whole GPUs, got {visible:?} {limit:?}")
            });
        } else {
            let want = format!("{}m", mem * 1024);
            watch.check(limit.as_deref() == Some(want.as_str()), || {
                format!("{name}/{container} asked {want}, got {limit:?}")
            });
            if cores > 0 {
                let sm = env.get("CUDA_DEVICE_SM_LIMIT").cloned();
                watch.check(sm == Some(cores.to_string()), || {
                    format!("{name}/{container} asked {cores} cores, got {sm:?}")
                });
            }
        }
        if init {
            continue;
        }
        for gpu in visible {
            hold(held, gpu, (whole == 0).then_some((mem, cores)));
        }
    }
}

/// A claim pod's ask, from its template's name ([`template`]).
fn claim_ask(pod: &Pod) -> Option<Option<(u64, u64)>> {
    let claims = pod.spec.as_ref()?.resource_claims.as_ref()?;
    let template = claims.first()?.resource_claim_template_name.as_deref()?;
    let rest = template.strip_prefix("claim-")?;
    if rest == "whole" {
        return Some(None);
    }
    let (m, c) = rest.split_once("g-")?;
    Some(Some((m.parse().ok()?, c.parse().ok()?)))
}

/// Checks a Running claim pod against its claim: its container got the
/// CDI device the kubelet prepared, whose envs name the GPU the claim's
/// allocation names with the template's limits; what it holds per GPU
/// is added to `held`. `allocated`: each claim's allocated devices.
fn check_claim(
    watch: &mut Watch,
    pod: &Pod,
    ask: Option<(u64, u64)>,
    dirs: &[PathBuf],
    allocated: &HashMap<String, Vec<String>>,
    held: &mut Held,
) {
    let name = pod.metadata.name.clone().unwrap();
    if watch.deleting.contains(&name) {
        return; // its claim may be unprepared already
    }
    let node = node_of(pod);
    if node != format!("node-{NODES}") {
        watch.violate(format!("{name} on a claim runs on {node:?}"));
        return;
    }
    let claim = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.resource_claim_name.clone())
        .unwrap_or_default();
    let devices = allocated.get(&claim).cloned().unwrap_or_default();
    let gpus: Vec<String> = devices
        .iter()
        .filter_map(|d| d.strip_prefix("gpu-")?.parse().ok())
        .map(|g| gpu_uuid(NODES, g))
        .collect();
    let ids = record_in(&dirs[NODES], NS, &name).map(|r| cdi_devices(&r, "main"));
    let envs = match ids.as_deref() {
        Some([id]) => cdi_envs_in(&dirs[NODES].join("cdi"), id).map(|(_, envs)| envs),
        _ => None,
    };
    let Some(envs) = envs else {
        watch.violate(format!(
            "{name} Running on claim {claim:?} with no prepared CDI device: {ids:?}"
        ));
        return;
    };
    let visible = envs.get("NVIDIA_VISIBLE_DEVICES").cloned();
    watch.check(gpus.len() == 1 && visible.as_ref() == gpus.first(), || {
        format!("{name} sees {visible:?}, its claim {claim:?} is allocated {devices:?}")
    });
    let limits = (
        envs.get("CUDA_DEVICE_MEMORY_LIMIT_0").cloned(),
        envs.get("CUDA_DEVICE_SM_LIMIT").cloned(),
    );
    let want = ask.map_or((None, None), |(m, c)| {
        (Some(format!("{}m", m * 1024)), Some(c.to_string()))
    });
    watch.check(limits == want, || {
        format!("{name} asked {ask:?} of a GPU, got {limits:?}")
    });
    for gpu in gpus {
        hold(held, gpu, ask);
    }
}

/// Counts on `gpu` a container's share of it (memory GiB, cores), or the
/// whole GPU (`None`).
fn hold(held: &mut Held, gpu: String, share: Option<(u64, u64)>) {
    let h = held.entry(gpu).or_default();
    match share {
        None => h.3 += 1,
        Some((memory, cores)) => {
            h.0 += memory;
            h.1 += cores;
            h.2 += 1;
        }
    }
}

/// Each claim's allocated devices, by the claim's name; `None` while the
/// API server does not answer.
async fn allocations(claims: &Api<ResourceClaim>) -> Option<HashMap<String, Vec<String>>> {
    let list = claims.list(&ListParams::default()).await.ok()?;
    Some(
        list.items
            .into_iter()
            .map(|c| {
                let devices = c
                    .status
                    .and_then(|s| s.allocation)
                    .and_then(|a| a.devices)
                    .map(|d| d.results.into_iter().flatten().map(|r| r.device).collect())
                    .unwrap_or_default();
                (c.metadata.name.unwrap_or_default(), devices)
            })
            .collect(),
    )
}

/// One sample of every invariant that holds at any moment.
async fn sample(
    watch: &Mutex<Watch>,
    client: &kube::Client,
    dirs: &[PathBuf],
    now_pending: &mut HashMap<String, Instant>,
) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let Ok(list) = pods.list(&ListParams::default()).await else {
        return; // the API server is down: nothing to read
    };
    // Read after the pods: a Running pod's claim is allocated already.
    let Some(allocated) = allocations(&Api::namespaced(client.clone(), NS)).await else {
        return;
    };
    let mut w = watch.lock().unwrap();
    let now = Instant::now();
    let mut held = BTreeMap::new();
    for pod in &list.items {
        let name = pod.metadata.name.clone().unwrap();
        if phase(pod) == "Running" {
            w.running.entry(name.clone()).or_insert(now);
            now_pending.remove(&name);
            match claim_ask(pod) {
                Some(ask) => check_claim(&mut w, pod, ask, dirs, &allocated, &mut held),
                None => check_running(&mut w, pod, dirs, &mut held),
            }
        } else if pod.metadata.deletion_timestamp.is_none()
            && let Some(created) = w.created.get(&name).copied()
        {
            if phase(pod) == "Failed" && !w.lost.contains_key(&name) {
                let message = pod.status.as_ref().and_then(|s| s.message.clone());
                let node = node_of(pod).trim_start_matches("node-").parse().ok();
                let lost = node.and_then(|n| w.lost_to(n, created, message.as_deref()?));
                match lost {
                    Some(fault) => {
                        eprintln!("{name} lost to {fault:?}: {}", message.unwrap_or_default());
                        w.lost.insert(name.clone(), fault);
                    }
                    None => w.violate(format!("{name} failed\n{message:?}")),
                }
            }
            if w.lost.contains_key(&name) {
                continue;
            }
            let since = w.last_fault.map_or(created, |f| f.max(created));
            w.check(now.duration_since(since) <= PENDING, || {
                format!(
                    "{name} {} past {PENDING:?} after its creation or the last fault\n{:?}",
                    phase(pod),
                    pod.status
                        .as_ref()
                        .map(|s| (&s.reason, &s.message, &s.conditions))
                )
            });
            now_pending.insert(name, created);
        }
    }
    for (gpu, (mem, cores, shares, wholes)) in &held {
        w.check(
            *mem <= GPU_GIB && *cores <= 100 && (*wholes == 0 || (*wholes == 1 && *shares == 0)),
            || {
                format!(
                    "{gpu} over-granted: {mem} GiB, {cores} cores, {shares} shares, {wholes} whole"
                )
            },
        );
    }
    // The daemons' own ledgers, where a daemon is up.
    let daemons = w.daemons.clone();
    drop(w);
    for pid in daemons {
        let Some(addr) = support::listening_addr(pid) else {
            continue;
        };
        let Ok((200, body)) = support::try_http_get(&addr.to_string(), "/metrics") else {
            continue;
        };
        let mut w = watch.lock().unwrap();
        for line in body.lines() {
            let over = |metric: &str, most: f64| {
                let v: f64 = line
                    .strip_prefix(metric)?
                    .rsplit(' ')
                    .next()?
                    .parse()
                    .ok()?;
                Some(v > most)
            };
            if let Some(over) = over(
                "gpu_device_plugin_gpu_memory_granted_bytes{",
                (GPU_GIB << 30) as f64,
            )
            .or_else(|| over("gpu_device_plugin_gpu_core_granted_percent{", 100.0))
            {
                w.check(!over, || format!("a daemon's ledger over-grants: {line}"));
            }
        }
    }
}

/// Retries an API call through restarts and slowness for up to a minute;
/// the last error after that.
async fn retry<T>(mut call: impl AsyncFnMut() -> Result<T, kube::Error>) -> Result<T, kube::Error> {
    let mut last = None;
    let answered = support::poll_within(Instant::now() + Duration::from_secs(60), async || {
        match call().await {
            // An answer of the API server itself is final.
            Err(kube::Error::Api(e)) if e.code < 500 => Some(Err(kube::Error::Api(e))),
            Err(e) => {
                last = Some(e);
                None
            }
            ok => Some(ok),
        }
    })
    .await;
    answered.unwrap_or_else(|| Err(last.expect("tried at least once")))
}

/// `pod` allowed only on node `node`.
fn pinned(mut pod: Pod, node: &str) -> Pod {
    let term = serde_json::json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
        {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}});
    pod.spec.as_mut().unwrap().affinity = Some(serde_json::from_value(term).unwrap());
    pod
}

fn shaped(name: &str, shape: &Shape) -> Pod {
    match shape {
        Shape::Plugin(containers) => {
            let containers: Vec<(&str, [u64; 3])> =
                containers.iter().map(|(n, w)| (n.as_str(), *w)).collect();
            gpu_pod(NS, name, &containers)
        }
        Shape::Claim(ask) => {
            let mut pod = claim_pod(NS, name, &template(*ask));
            // The mutating policy sends pods asking the device plugin's
            // resources to the GPU scheduler; a claim's pod names it.
            pod.spec.as_mut().unwrap().scheduler_name = Some("doslab-gpu-scheduler".into());
            pod
        }
    }
}

/// What a fault cost: when it struck, and the pod created next.
struct Struck {
    fault: Fault,
    at: Instant,
    next: Option<String>,
}

/// What a run measured.
struct Report {
    seed: u64,
    pods: usize,
    faults: BTreeMap<Fault, usize>,
    /// Fault → the next pod (on the fault's node, where it has one) Running.
    recovery: BTreeMap<Fault, Vec<Duration>>,
    checks: u64,
    /// Pods that failed admission for a fault, by the fault.
    lost: BTreeMap<Fault, usize>,
    violations: Vec<String>,
    /// Node 0's daemon (never killed): RSS KiB and fds after start and at
    /// the end.
    rss_kib: (u64, u64),
    fds: (usize, usize),
    took: Duration,
}

/// The daemon's config with its health recovery changed: a reload that
/// applies something.
fn reloaded(config: &str, round: usize) -> String {
    let ms = 500 + 100 * (round % 2);
    let mut out: Vec<String> = config
        .lines()
        .map(|l| {
            if l.starts_with("recovery_ms") {
                format!("recovery_ms = {ms}")
            } else {
                l.to_owned()
            }
        })
        .collect();
    out.push(String::new());
    out.join("\n")
}

async fn run(seed: u64, pods: usize, faults: &[Fault]) -> Report {
    let started = Instant::now();
    let steps = schedule(seed, pods, faults);
    let cp = ControlPlane::start();
    let kubeconfig = kube::config::Kubeconfig::read_from(&cp.admin).unwrap();
    let server = kubeconfig.clusters[0]
        .cluster
        .as_ref()
        .unwrap()
        .server
        .clone()
        .unwrap();
    let apiserver = server.trim_start_matches("https://").to_owned();
    let proxy = SlowProxy::start(apiserver.clone()).await;
    proxy.route(&cp.scheduler, &apiserver);

    // The base rights beside DRA mode's, which the DRA node applies.
    device_plugin_rights_beside_dra(&cp);
    let health: Vec<tempfile::TempDir> = (0..NODES).map(|_| tempfile::tempdir().unwrap()).collect();
    // Per health file, the unhealthy windows open on it.
    let unhealthy: Arc<Mutex<HashMap<PathBuf, usize>>> = Arc::default();
    let mut nodes = Vec::new();
    for (n, health) in health.iter().enumerate() {
        let gpus = node_gpus(n);
        let gpus: Vec<(&str, u64)> = gpus.iter().map(|(u, m)| (u.as_str(), *m)).collect();
        let top = format!(
            "memory_unit_mib = 1024\n[health]\npoll_ms = 200\nrecovery_ms = 500\nmock_dir = {:?}\n",
            health.path().display().to_string()
        );
        let mut node = KubeNode::start(&cp, &format!("node-{n}"), &gpus, &top).await;
        proxy.behind(&apiserver, &mut node).await;
        node.wait_allocatable(&cp).await;
        nodes.push(node);
    }
    let gpus = node_gpus(NODES);
    let gpus: Vec<(&str, u64)> = gpus.iter().map(|(u, m)| (u.as_str(), *m)).collect();
    let tables = "[enforcement]\nmode = \"none\"\n";
    let mut dra = KubeNode::start_dra(&cp, &format!("node-{NODES}"), &gpus, tables).await;
    proxy.behind(&apiserver, &mut dra).await;
    dra.wait_sliced(&cp).await;
    nodes.push(dra);
    namespace(&cp, NS);
    cp.apply(&templates());
    let mut sched = Scheduler::start_unelected(&cp);
    let client = cp.admin_client().await;
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let dirs: Vec<PathBuf> = nodes.iter().map(|n| n.dir.path().to_owned()).collect();

    let watch = Arc::new(Mutex::new(Watch {
        daemons: nodes.iter().map(|n| n.daemon.child.id()).collect(),
        ..Watch::default()
    }));
    let soak_pid = nodes[0].daemon.child.id();
    let rss_start = support::rss_kib(soak_pid);
    let fds_start = support::fds_and_threads(soak_pid).0;
    let stop = Arc::new(AtomicBool::new(false));
    let checker = {
        let (watch, client, dirs, stop) =
            (watch.clone(), client.clone(), dirs.clone(), stop.clone());
        tokio::spawn(async move {
            let mut pending = HashMap::new();
            let mut every = tokio::time::interval(Duration::from_millis(250));
            while !stop.load(Ordering::Relaxed) {
                every.tick().await;
                sample(&watch, &client, &dirs, &mut pending).await;
            }
        })
    };

    let mut live: Vec<String> = Vec::new();
    let mut deleted: Vec<String> = Vec::new();
    // The pods not deleted at once, in creation order.
    let mut order: Vec<String> = Vec::new();
    let mut struck: Vec<Struck> = Vec::new();
    let mut lasting = Vec::new();
    let mut pin: Option<usize> = None;
    // The logs of the processes a fault ended, for the artifacts.
    let mut ended: Vec<(String, String)> = Vec::new();
    let mut restarts = 0;
    for (i, step) in steps.iter().enumerate() {
        match step {
            Step::Create {
                shape,
                victim,
                early,
            } => {
                if live.len() >= LIVE {
                    let victim = live.remove(victim % live.len());
                    wait_running(&watch, &victim).await;
                    delete(&api, &watch, &victim).await;
                    deleted.push(victim);
                }
                let name = format!("p{i}");
                let mut pod = shaped(&name, shape);
                // A claim runs on the DRA node alone: the next plugin pod is pinned.
                if !early
                    && matches!(shape, Shape::Plugin(_))
                    && let Some(n) = pin.take()
                {
                    pod = pinned(pod, &nodes[n].name);
                }
                let made = retry(async || api.create(&PostParams::default(), &pod).await).await;
                if let Err(e) = made {
                    watch
                        .lock()
                        .unwrap()
                        .violate(format!("creating {name}: {e}"));
                    continue;
                }
                watch
                    .lock()
                    .unwrap()
                    .created
                    .insert(name.clone(), Instant::now());
                if *early {
                    delete(&api, &watch, &name).await;
                    deleted.push(name);
                    continue;
                }
                for s in struck.iter_mut().filter(|s| s.next.is_none()) {
                    s.next = Some(name.clone());
                }
                order.push(name.clone());
                live.push(name);
            }
            Step::Fault {
                fault,
                node,
                gpu,
                after,
                lasts,
            } => {
                tokio::time::sleep(*after).await;
                let at = Instant::now();
                let n = &mut nodes[*node];
                match fault {
                    Fault::DaemonKill | Fault::PrepareKill => {
                        ended.push((format!("{}-daemon-{i}.log", n.name), n.daemon.log_text()));
                        n.kill_daemon();
                        watch.lock().unwrap().daemons[*node] = n.daemon.child.id();
                    }
                    Fault::ExtenderKill => {
                        ended.push((format!("extender-{i}.log"), sched.extender.log_text()));
                        sched.kill_extender();
                    }
                    Fault::SchedulerKill => {
                        restarts += 1;
                        sched.kill_scheduler(restarts);
                    }
                    Fault::KubeletRestart => n.restart_kubelet().await,
                    Fault::ApiserverRestart => {
                        cp.restart_apiserver().await;
                    }
                    Fault::DaemonReload => {
                        restarts += 1;
                        n.reload_daemon(reloaded(n.config(), restarts));
                    }
                    Fault::ApiserverSlow => {
                        let windows = proxy.windows.clone();
                        windows.fetch_add(1, Ordering::Relaxed);
                        lasting.push(ends_after(*lasts, &watch, move || {
                            windows.fetch_sub(1, Ordering::Relaxed);
                        }));
                    }
                    Fault::GpuUnhealthy => {
                        // Windows on one GPU may overlap: it is healthy
                        // again when the last one ends.
                        let file = health[*node].path().join(gpu_uuid(*node, *gpu));
                        let open = unhealthy.clone();
                        *open.lock().unwrap().entry(file.clone()).or_insert(0) += 1;
                        std::fs::write(&file, "").unwrap();
                        lasting.push(ends_after(*lasts, &watch, move || {
                            let mut open = open.lock().unwrap();
                            let left = open.get_mut(&file).expect("opened");
                            *left -= 1;
                            if *left == 0 {
                                std::fs::remove_file(&file).unwrap();
                            }
                        }));
                    }
                }
                {
                    let mut w = watch.lock().unwrap();
                    w.last_fault = Some(at);
                    w.strikes.push((*fault, *node, gpu_uuid(*node, *gpu), at));
                }
                if fault.on_node() && *node < NODES {
                    pin = Some(*node);
                }
                struck.push(Struck {
                    fault: *fault,
                    at,
                    next: None,
                });
            }
        }
    }
    for t in lasting {
        t.await.unwrap();
    }

    // Drained of faults: every live pod runs, every deleted one is gone.
    for name in &live {
        wait_running(&watch, name).await;
    }
    for name in &deleted {
        wait_deleted(&api, &watch, name).await;
    }
    // What the API server holds before the drain deletes it: a pod that
    // never ran, its claim.
    let held = support::poll_within(Instant::now() + PENDING, async || {
        let pods = api.list(&ListParams::default()).await.ok()?;
        let claims = Api::<ResourceClaim>::namespaced(client.clone(), NS);
        let claims = claims.list(&ListParams::default()).await.ok()?;
        serde_json::to_string_pretty(&(pods.items, claims.items)).ok()
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    checker.await.unwrap();
    for name in &live {
        delete(&api, &watch, name).await;
    }
    for name in &live {
        wait_deleted(&api, &watch, name).await;
    }
    let rss_end = support::rss_kib(soak_pid);
    let fds_end = support::fds_and_threads(soak_pid).0;
    leaks(&watch, &client, &nodes).await;

    let mut w = watch.lock().unwrap();
    let mut faults = BTreeMap::new();
    let mut recovery: BTreeMap<Fault, Vec<Duration>> = BTreeMap::new();
    for s in &struck {
        *faults.entry(s.fault).or_default() += 1;
        // The pod created next, or if a fault lost it, the first after it
        // that ran.
        let from = s
            .next
            .as_ref()
            .and_then(|n| order.iter().position(|o| o == n));
        let ran = from.and_then(|i| order[i..].iter().find_map(|n| w.running.get(n).copied()));
        match ran {
            Some(ran) => recovery
                .entry(s.fault)
                .or_default()
                .push(ran.saturating_duration_since(s.at)),
            // The schedule's last fault may have no pod after it.
            None if s.next.is_none() => {}
            None => w.violate(format!("no pod ran after {:?}", s.fault)),
        }
    }
    let report = Report {
        seed,
        pods,
        faults,
        recovery,
        checks: w.checks,
        lost: w.lost.values().fold(BTreeMap::new(), |mut m, f| {
            *m.entry(*f).or_default() += 1;
            m
        }),
        violations: std::mem::take(&mut w.violations),
        rss_kib: (rss_start, rss_end),
        fds: (fds_start, fds_end),
        took: started.elapsed(),
    };
    drop(w);
    if !report.violations.is_empty() {
        let faults: Vec<String> = steps
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Step::Fault { fault, node, .. } => Some(format!("{i}:{fault:?}@node-{node}")),
                Step::Create { .. } => None,
            })
            .collect();
        eprintln!(
            "seed {seed} failed; replay: the same test with CHAOS_SEED={seed} CHAOS_PODS={pods}\n\
             fault schedule (step:fault@node): {}\n{}",
            faults.join(" "),
            logs(&cp, &nodes, &sched)
        );
    }
    if let Ok(dir) = std::env::var("CHAOS_ARTIFACTS") {
        let held = held.unwrap_or_default();
        ended.push(("pods-and-claims-before-the-drain.json".into(), held));
        artifacts(Path::new(&dir), &cp, &nodes, &sched, ended);
    }
    report
}

/// Every log of the run under `dir`: the control plane's (the controller
/// manager's too), each kube-scheduler's and kubelet's, the daemons' and
/// the extender's; and `ended`: those a fault ended, and the API server's
/// pods and claims before the drain.
fn artifacts(
    dir: &Path,
    cp: &ControlPlane,
    nodes: &[KubeNode],
    sched: &Scheduler,
    mut ended: Vec<(String, String)>,
) {
    std::fs::create_dir_all(dir).unwrap();
    ended.push(("extender.log".into(), sched.extender.log_text()));
    ended.push(("apiserver.log".into(), cp.apiserver_log()));
    for n in nodes {
        ended.push((format!("{}-daemon.log", n.name), n.daemon.log_text()));
    }
    for (name, text) in ended {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let logs = nodes
        .iter()
        .map(|n| (n.dir.path().to_owned(), format!("{}-", n.name)));
    // The control plane's own folder holds the controller manager's log.
    let control = [cp.dir.path().to_owned(), cp.dir.path().join("state")];
    for (from, prefix) in logs.chain(control.map(|d| (d, String::new()))) {
        for entry in std::fs::read_dir(from).unwrap().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".log") {
                std::fs::copy(entry.path(), dir.join(format!("{prefix}{name}"))).unwrap();
            }
        }
    }
    // What each kubelet recorded of each pod: the devices and envs each
    // container got.
    for n in nodes {
        let records = dir.join(format!("{}-pods", n.name));
        std::fs::create_dir_all(&records).unwrap();
        for entry in std::fs::read_dir(n.dir.path().join("kubelet/pods"))
            .into_iter()
            .flatten()
            .flatten()
        {
            std::fs::copy(entry.path(), records.join(entry.file_name())).unwrap();
        }
    }
    eprintln!("logs under {}", dir.display());
}

/// A lasting fault's end: `undo` once `lasts` is over, which counts as
/// the last fault for the Pending bound.
fn ends_after(
    lasts: Duration,
    watch: &Arc<Mutex<Watch>>,
    undo: impl FnOnce() + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    let watch = watch.clone();
    tokio::spawn(async move {
        tokio::time::sleep(lasts).await;
        undo();
        watch.lock().unwrap().last_fault = Some(Instant::now());
    })
}

/// Waits until pod `name` has been seen Running, within [`PENDING`] of
/// its creation or the last fault; a violation if not.
async fn wait_running(watch: &Mutex<Watch>, name: &str) {
    // The probe ends the wait: its bound moves with each fault.
    let unbounded = Instant::now() + Duration::from_secs(24 * 3600);
    support::poll_within(unbounded, async || {
        let mut w = watch.lock().unwrap();
        if w.running.contains_key(name) || w.lost.contains_key(name) {
            return Some(());
        }
        let created = w.created[name];
        let since = w.last_fault.map_or(created, |f| f.max(created));
        // The checker's own verdict comes first; this only stops the wait.
        if since.elapsed() > PENDING + Duration::from_secs(5) {
            w.violate(format!("{name} never ran"));
            return Some(());
        }
        None
    })
    .await;
}

async fn delete(api: &Api<Pod>, watch: &Mutex<Watch>, name: &str) {
    watch.lock().unwrap().deleting.insert(name.to_owned());
    let done = retry(async || api.delete(name, &DeleteParams::default()).await).await;
    let mut w = watch.lock().unwrap();
    w.created.remove(name);
    if let Err(e) = done
        && !matches!(&e, kube::Error::Api(s) if s.code == 404)
    {
        w.violate(format!("deleting {name}: {e}"));
    }
}

/// Waits until deleted pod `name` is gone from the API server (its
/// kubelet finished it); a violation if it stays.
async fn wait_deleted(api: &Api<Pod>, watch: &Mutex<Watch>, name: &str) {
    let gone = async || matches!(api.get_opt(name).await, Ok(None)).then_some(());
    if support::poll_within(Instant::now() + PENDING, gone)
        .await
        .is_none()
    {
        watch
            .lock()
            .unwrap()
            .violate(format!("deleted pod {name} never went"));
    }
}

/// Once every pod is gone, nothing is held: every daemon's ledger is empty
/// and every GPU healthy, and a pod of each node's every GPU, then a pod
/// of each GPU's whole memory and compute, run: the extender, the
/// daemons and the kubelets' device accounting all see every GPU free.
async fn leaks(watch: &Mutex<Watch>, client: &kube::Client, nodes: &[KubeNode]) {
    let api = &Api::<Pod>::namespaced(client.clone(), NS);
    let (plugin, dra) = nodes.split_at(NODES);
    for node in plugin {
        let addr = support::http_addr(&node.daemon);
        let deadline = Instant::now() + PENDING;
        let held = || {
            let (_, body) = support::http_get(&addr, "/metrics");
            (0..GPUS)
                .map(|g| gpu_uuid(node.name[5..].parse().unwrap(), g))
                .filter_map(|gpu| {
                    let v = |m: &str| {
                        support::sample(&body, &format!("gpu_device_plugin_{m}{{gpu=\"{gpu}\"}}"))
                    };
                    let free = v("gpu_memory_granted_bytes") == Some(0.0)
                        && v("gpu_containers") == Some(0.0)
                        && v("gpu_healthy") == Some(1.0);
                    (!free).then(|| {
                        format!(
                            "{gpu}: {:?} {:?} {:?}",
                            v("gpu_memory_granted_bytes"),
                            v("gpu_containers"),
                            v("gpu_healthy")
                        )
                    })
                })
                .collect::<Vec<_>>()
        };
        let free = support::poll_sync(deadline, || held().is_empty());
        let refused = support::metric(&addr, support::RELOADS_REFUSED).unwrap_or(0.0);
        watch.lock().unwrap().check(refused == 0.0, || {
            format!("{} refused {refused} reloads", node.name)
        });
        watch.lock().unwrap().check(free, || {
            format!("{} holds after the drain: {:?}", node.name, held())
        });
    }
    dra_leaks(watch, client, &dra[0]).await;
    let whole_claims = (0..GPUS).map(|g| shaped(&format!("all-dra-{g}"), &Shape::Claim(None)));
    let whole: Vec<Pod> = plugin
        .iter()
        .map(|n| {
            pinned(
                gpu_pod(
                    NS,
                    &format!("all-{}", n.name),
                    &[("main", [0, 0, GPUS as u64])],
                ),
                &n.name,
            )
        })
        .chain(whole_claims)
        .collect();
    let full: Vec<Pod> = (0..NODES * GPUS)
        .map(|i| gpu_pod(NS, &format!("full-{i}"), &[("main", [GPU_GIB, 100, 0])]))
        .collect();
    for round in [whole, full] {
        for pod in &round {
            let name = pod.metadata.name.clone().unwrap();
            if let Err(e) = api.create(&PostParams::default(), pod).await {
                watch
                    .lock()
                    .unwrap()
                    .violate(format!("creating {name}: {e}"));
            }
        }
        for pod in &round {
            let name = pod.metadata.name.as_deref().unwrap();
            let ran = wait_pod(client, NS, name, Duration::from_secs(60), |p| {
                phase(p) == "Running"
            })
            .await;
            watch.lock().unwrap().check(ran.is_ok(), || {
                format!(
                    "after the drain {name} never ran: {:?}",
                    ran.err().flatten().and_then(|p| p.status)
                )
            });
        }
        for pod in &round {
            let name = pod.metadata.name.as_deref().unwrap();
            delete(api, watch, name).await;
        }
        for pod in &round {
            wait_deleted(api, watch, pod.metadata.name.as_deref().unwrap()).await;
        }
    }
}

/// The DRA node after the drain: no claim is left, and the daemon holds
/// no CDI spec and no prepared claim in its checkpoint.
async fn dra_leaks(watch: &Mutex<Watch>, client: &kube::Client, node: &KubeNode) {
    let deadline = Instant::now() + PENDING;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let left = async || {
        let list = claims.list(&ListParams::default()).await.ok()?;
        Some(
            list.items
                .into_iter()
                .filter_map(|c| c.metadata.name)
                .collect::<Vec<_>>(),
        )
    };
    let gone = support::poll_within(deadline, async || left().await.filter(|l| l.is_empty())).await;
    let left = left().await;
    watch.lock().unwrap().check(gone.is_some(), || {
        format!("claims left after the drain: {left:?}")
    });
    let specs = || -> Vec<String> {
        std::fs::read_dir(node.cdi_dir())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|f| f.starts_with(DRIVER))
            .collect()
    };
    let prepared = || -> serde_json::Value {
        std::fs::read(node.dir.path().join("dra/checkpoint.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .map_or(serde_json::Value::Null, |c| c["claims"].clone())
    };
    let empty = support::poll_sync(deadline, || {
        specs().is_empty() && prepared().as_object().is_some_and(|c| c.is_empty())
    });
    watch.lock().unwrap().check(empty, || {
        format!(
            "{} holds after the drain: CDI specs {:?}, prepared {}",
            node.name,
            specs(),
            prepared()
        )
    });
}

fn print(r: &Report) {
    let ms = |d: Option<&Duration>| d.map_or("-".to_owned(), |d| d.as_millis().to_string());
    eprintln!(
        "chaos seed {}: {} pods, {} faults, {} invariant checks, {} violations, {:.0} s",
        r.seed,
        r.pods,
        r.faults.values().sum::<usize>(),
        r.checks,
        r.violations.len(),
        r.took.as_secs_f64()
    );
    for (fault, n) in &r.faults {
        let mut times = r.recovery.get(fault).cloned().unwrap_or_default();
        times.sort();
        let at = |q: f64| times.get(((times.len() as f64 - 1.0) * q).round() as usize);
        eprintln!(
            "  {fault:?}: {n}, {} pods lost to it, fault → next pod Running p50 {} ms, \
             p99 {} ms, max {} ms",
            r.lost.get(fault).copied().unwrap_or(0),
            ms(at(0.5)),
            ms(at(0.99)),
            ms(times.last())
        );
    }
    eprintln!(
        "  node-0 daemon (never killed): RSS {} → {} KiB, fds {} → {}",
        r.rss_kib.0, r.rss_kib.1, r.fds.0, r.fds.1
    );
}

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{key}: {v:?}")))
        .unwrap_or(default)
}

/// The soak leaves the daemon it never killed where it started: bounded
/// descriptors and memory.
fn assert_flat(r: &Report) {
    assert!(
        r.violations.is_empty(),
        "seed {}: {:#?}",
        r.seed,
        r.violations
    );
    assert!(r.fds.1 <= r.fds.0 + 16, "fds grew: {:?}", r.fds);
    assert!(
        r.rss_kib.1 <= r.rss_kib.0 + 64 * 1024,
        "RSS grew: {:?}",
        r.rss_kib
    );
}

/// The faults that restart no kubelet and no API server. After either,
/// the kubelet admits the pods its list brings in one batch sorted by
/// creation time, which the daemon follows; but creation times are whole
/// seconds, and the kubelet orders pods created in the same second at
/// random: two of them of different asks may then get each other's grants
/// (open: issue 35's closing note).
const IN_ORDER: [Fault; 7] = [
    Fault::DaemonKill,
    Fault::PrepareKill,
    Fault::ExtenderKill,
    Fault::SchedulerKill,
    Fault::DaemonReload,
    Fault::ApiserverSlow,
    Fault::GpuUnhealthy,
];

/// A short run under `faults`: every kind strikes, the invariants hold.
async fn short(faults: &[Fault]) {
    let r = run(env_or("CHAOS_SEED", 1), env_or("CHAOS_PODS", 150), faults).await;
    print(&r);
    for fault in faults {
        assert!(r.faults.contains_key(fault), "{fault:?} never struck");
    }
    assert_flat(&r);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_short_run_under_crashes_reloads_slowness_and_gpu_faults_leaks_nothing() {
    short(&IN_ORDER).await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "open: a claim's pod created just after an API server restart may stay Pending; \
            three or more pods of the same asks admitted out of the matcher's order at once \
            (issue 35's closing note)"]
async fn a_short_run_under_every_fault_leaks_nothing_and_double_books_nothing() {
    short(&FAULTS).await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "the soak: an hour or more; cargo test --release --test kube_chaos -- --ignored soak"]
async fn soak() {
    let seeds: String = env_or("CHAOS_SEEDS", "1,2,3".to_owned());
    for seed in seeds.split(',') {
        let r = run(
            seed.trim().parse().unwrap(),
            env_or("CHAOS_PODS", 10_000),
            &FAULTS,
        )
        .await;
        print(&r);
        assert_flat(&r);
    }
}
