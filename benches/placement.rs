//! `cargo bench --bench placement`: how well the scheduler extender places
//! GPU pods compared with node-total scheduling (what kube-scheduler does
//! alone), what filter and bind cost at 1,000 nodes, and (`burst`) how the
//! real extender behind the kube-scheduler stand-in binds a 40-pod burst
//! and how full each policy lets the GPUs get; (`harder`) the fill test's
//! harder mix through the same stand-in over ten seeds. Prints figures for
//! benches/README.md; nothing here asserts a number.
//!
//! Both schedulers hand their pods to the same node side: a kubelet
//! stand-in that admits each container resource by resource through the
//! node's real matcher (`matcher::matching::decide`), so an admission
//! failure here is what the node would refuse.
//!
//! Node totals are taken as the kubelet reports them: every device, or,
//! with the node's exclusive devices withdrawn (`matcher.withdraw_exclusive`,
//! issue 17 item 9), less those the node's usage keeps from new work.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_device_plugin::extender::wire::{ExtenderArgs, ExtenderBindingArgs};
use gpu_device_plugin::extender::{Extender, ExtenderConfig, Index, PodName, start};
use gpu_device_plugin::node::matcher::report::withdrawn;
use gpu_device_plugin::rules::device::Resource;
use gpu_device_plugin::rules::matching::pods::PodView;
use gpu_device_plugin::rules::matching::{Ask, decide, record, usage};
use gpu_device_plugin::rules::usage::{Inventory, Keys, Ledger};
use gpu_sim::apiserver::PodContainer;
use gpu_sim::figures::{percentile, report};
use gpu_sim::fill::StandIn;
use gpu_sim::memory::{MemoryCluster, gpu_node, gpu_pod};
use k8s_openapi::api::core::v1::Pod;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

const DOMAIN: &str = "doslab.io";
const NAMESPACE: &str = "bench";
const GIB: u64 = 1024;
const SEED: u64 = 0x5eed_0011;

/// splitmix64: a fixed seed gives every scheduler the same pods.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A value of `table` by its weight.
    fn weighted(&mut self, table: &[(u64, u64)]) -> u64 {
        gpu_sim::fill::weighted(&mut |n| self.next() % n, table)
    }

    /// The index of the highest key, ties broken at random (kube-scheduler
    /// picks at random among the best-scored nodes).
    fn best<K: Ord + Copy>(&mut self, keys: &[K]) -> Option<usize> {
        let top = *keys.iter().max()?;
        let tied: Vec<usize> = (0..keys.len()).filter(|&i| keys[i] == top).collect();
        Some(tied[self.below(tied.len())])
    }
}

/// Memory asks in GiB and how often they come: inference replicas of a few
/// GiB dominate, a tail of 16–40 GiB fine-tuning jobs.
const MEMORY_GIB: &[(u64, u64)] = &[
    (1, 8),
    (2, 10),
    (4, 14),
    (6, 8),
    (8, 14),
    (10, 8),
    (12, 6),
    (16, 12),
    (20, 8),
    (24, 6),
    (32, 4),
    (40, 2),
];
const CORE_PERCENT: &[(u64, u64)] = &[(10, 3), (20, 3), (25, 2), (30, 2), (50, 1)];
const WORKLOAD: &str = "pods of 1 (50 %), 2 (30 %) or 3 (20 %) containers, no init containers; \
    each asks 1–40 GiB (mostly 2–16 GiB), 1 in 4 also 10–50 % of the GPU's compute; \
    1 pod in 20 asks 1 (70 %) or 2 whole GPUs";

fn workload(rng: &mut Rng, n: usize) -> Vec<Vec<PodContainer>> {
    let container = |name: String, wants: [u64; 3]| PodContainer {
        name,
        init: false,
        restartable: false,
        wants,
    };
    (0..n)
        .map(|_| {
            if rng.below(20) == 0 {
                let gpus = if rng.below(10) < 7 { 1 } else { 2 };
                return vec![container("train".into(), [0, 0, gpus])];
            }
            let k = rng.weighted(&[(1, 5), (2, 3), (3, 2)]);
            (0..k)
                .map(|i| {
                    let memory = rng.weighted(MEMORY_GIB) * GIB;
                    let core = if rng.below(4) == 0 {
                        rng.weighted(CORE_PERCENT)
                    } else {
                        0
                    };
                    container(format!("c{i}"), [memory, core, 0])
                })
                .collect()
        })
        .collect()
}

/// Ten nodes: 3 × 8 × 80 GB, 3 × 4 × 40 GB, 2 × 2 × 24 GB and 2 mixed
/// (2 × 80 + 2 × 40 + 2 × 24 GB); 3 TiB of GPU memory in all.
fn mixed_nodes() -> Vec<(String, Vec<(String, u64)>)> {
    let shapes: [&[(u64, usize)]; 4] = [
        &[(80, 8)],
        &[(40, 4)],
        &[(24, 2)],
        &[(80, 2), (40, 2), (24, 2)],
    ];
    let counts = [3, 3, 2, 2];
    let mut nodes = Vec::new();
    for (shape, count) in shapes.iter().zip(counts) {
        for _ in 0..count {
            let n = nodes.len();
            let gpus = shape
                .iter()
                .flat_map(|&(gb, k)| std::iter::repeat_n(gb * GIB, k))
                .enumerate()
                .map(|(g, mib)| (format!("GPU-{n:04}-{g}"), mib))
                .collect();
            nodes.push((format!("node-{n:04}"), gpus));
        }
    }
    nodes
}

fn node_objects(nodes: &[(String, Vec<(String, u64)>)]) -> Vec<k8s_openapi::api::core::v1::Node> {
    nodes
        .iter()
        .map(|(name, gpus)| {
            let gpus: Vec<(&str, u64)> = gpus.iter().map(|(u, m)| (u.as_str(), *m)).collect();
            gpu_node(name, &gpus)
        })
        .collect()
}

fn key_of(name: &str) -> PodName {
    (NAMESPACE.into(), name.into())
}

fn bound_node(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .expect("a placed pod is bound")
}

/// One node's kubelet and device plugin: admits a bound pod container by
/// container, each resource through GetPreferredAllocation then Allocate,
/// as the node's matcher decides them.
struct NodeSide {
    keys: Keys,
    inventory: Inventory,
    pods: Vec<PodView>,
}

impl NodeSide {
    fn new(node: &k8s_openapi::api::core::v1::Node) -> NodeSide {
        let keys = Keys::new(DOMAIN);
        let text = &node.metadata.annotations.as_ref().expect("inventory")[&keys.inventory];
        NodeSide {
            inventory: Inventory::parse(text).expect("a valid inventory"),
            keys,
            pods: Vec::new(),
        }
    }

    /// The pod's ledger once every container is served; on a refusal the
    /// pod fails (`UnexpectedAdmissionError`) and holds nothing.
    fn admit(&mut self, pod: &Pod) -> Result<Ledger, String> {
        let (view, _) = PodView::from_pod(&self.keys, pod);
        let containers = view.containers.clone();
        self.pods.push(view);
        let result = containers.iter().try_for_each(|c| {
            Resource::ALL
                .into_iter()
                .filter(|&r| c.wants(r) > 0)
                .try_for_each(|r| self.allocate(&c.name, r, c.wants(r)))
        });
        let mut admitted = self.pods.pop().expect("pushed above");
        result?;
        admitted.admitting = false;
        let ledger = admitted.ledger.clone();
        self.pods.push(admitted);
        Ok(ledger)
    }

    fn allocate(&mut self, container: &str, r: Resource, devices: u64) -> Result<(), String> {
        let inv = &self.inventory;
        let preferred = Ask {
            resource: r,
            devices,
            digest: None,
            id_gpus: Vec::new(),
        };
        let steer = decide(inv, &self.pods, &preferred).map_err(|e| e.to_string())?;
        let id_gpus = if !steer.gpus.is_empty() {
            steer.gpus
        } else if r == Resource::GpuCount {
            // Unassigned whole GPUs: the kubelet takes free gpu-count
            // devices, steered off GPUs that carry shared work.
            let u = usage(inv, &self.pods);
            let avoid = u.avoid(inv, r);
            let free: Vec<usize> = (0..inv.gpus.len())
                .filter(|&g| !avoid[g] && !u.gpus[g].held_whole())
                .take(devices as usize)
                .collect();
            if (free.len() as u64) < devices {
                return Err(format!("{container}: {devices} whole GPUs are not free"));
            }
            free
        } else {
            return Err(format!("{container}: no GPU can hold its {r}"));
        };
        let pod = self.pods.last().expect("the pod being admitted");
        let ask = Ask {
            resource: r,
            devices,
            digest: Some(format!("{}/{container}/{r}", pod.key)),
            id_gpus,
        };
        let decision = decide(inv, &self.pods, &ask).map_err(|e| e.to_string())?;
        let pod = self.pods.last_mut().expect("the pod being admitted");
        record(&mut pod.ledger, inv, &ask, &decision);
        Ok(())
    }

    fn remove(&mut self, name: &str) {
        self.pods.retain(|p| p.key.name != name);
    }

    /// (MiB held, MiB in all): a GPU held whole counts as full.
    fn memory(&self) -> (u64, u64) {
        let inv = &self.inventory;
        let u = usage(inv, &self.pods);
        (0..inv.gpus.len()).fold((0, 0), |(held, all), g| {
            let cap = inv.capacity(g).memory;
            let used = if u.gpus[g].held_whole() {
                cap
            } else {
                u.gpus[g].used.memory
            };
            (held + used, all + cap)
        })
    }
}

/// A way of choosing a node for a pod.
trait Scheduler {
    /// The pod bound to a node (with whatever the scheduler wrote on it),
    /// or `None` when no node takes it.
    async fn place(&mut self, pod: Pod) -> Option<Pod>;
    /// The node served the pod with this ledger.
    fn admitted(&mut self, pod: &Pod, ledger: &Ledger);
    /// The pod ended (deleted, or failed admission): it holds nothing.
    fn gone(&mut self, name: &str);
    /// What the node's pods hold changed: the devices its plugins list
    /// healthy may have.
    fn node_changed(&mut self, _node: &str, _side: &NodeSide) {}
}

/// The extender, called in process as kube-scheduler would over HTTP:
/// filter over every node, prioritize the ones passed, bind the best.
struct ExtenderScheduler {
    cluster: MemoryCluster,
    extender: Extender<MemoryCluster>,
    names: Vec<String>,
    rng: Rng,
}

impl ExtenderScheduler {
    fn new(policy: &str, nodes: &[k8s_openapi::api::core::v1::Node]) -> Self {
        let cluster = MemoryCluster::new();
        for n in nodes {
            cluster.add_node(n.clone());
        }
        let config =
            ExtenderConfig::from_toml(&format!("[extender]\npolicy = \"{policy}\"\n")).unwrap();
        ExtenderScheduler {
            extender: Extender::new(&config, cluster.index(), cluster.clone()),
            cluster,
            names: nodes
                .iter()
                .map(|n| n.metadata.name.clone().unwrap())
                .collect(),
            rng: Rng(SEED),
        }
    }
}

fn binding(pod: &Pod, node: &str) -> ExtenderBindingArgs {
    ExtenderBindingArgs {
        pod_name: pod.metadata.name.clone().unwrap(),
        pod_namespace: NAMESPACE.into(),
        pod_uid: pod.metadata.uid.clone().unwrap_or_default(),
        node: node.into(),
    }
}

impl Scheduler for ExtenderScheduler {
    async fn place(&mut self, pod: Pod) -> Option<Pod> {
        let key = key_of(pod.metadata.name.as_deref().unwrap());
        self.cluster.put_pod(pod.clone());
        let args = |names: Vec<String>| ExtenderArgs {
            pod: Some(pod.clone()),
            nodes: None,
            node_names: Some(names),
        };
        let passed = self
            .extender
            .filter(&args(self.names.clone()))
            .await
            .ok()
            .and_then(|r| r.node_names)
            .unwrap_or_default();
        let scores = self.extender.prioritize(&args(passed)).unwrap();
        let Some(best) = self
            .rng
            .best(&scores.iter().map(|h| h.score).collect::<Vec<_>>())
        else {
            // Pending forever in this run: it holds nothing.
            self.cluster.delete_pod(&key);
            return None;
        };
        let bound = self.extender.bind(&binding(&pod, &scores[best].host)).await;
        if let Err(e) = bound {
            panic!("a bind after a passing filter failed: {e}");
        }
        self.cluster.pod(&key)
    }

    fn admitted(&mut self, pod: &Pod, ledger: &Ledger) {
        let mut served = self
            .cluster
            .pod(&key_of(pod.metadata.name.as_deref().unwrap()))
            .unwrap();
        served
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(Keys::new(DOMAIN).ledger, ledger.to_json());
        self.cluster.put_pod(served);
    }

    fn gone(&mut self, name: &str) {
        self.cluster.delete_pod(&key_of(name));
    }
}

/// kube-scheduler alone: a node fits when its allocatable totals of each
/// resource, less the requests of the pods bound there, cover the pod's
/// requests. Which GPU serves a container is the node's problem.
struct NodeTotalScheduler {
    /// Per node: allocatable devices, requested devices, pods.
    nodes: Vec<(String, [u64; 3], [u64; 3], u64)>,
    pods: HashMap<String, (usize, [u64; 3])>,
    /// Score by gpu-memory requested (MostAllocated) instead of by pods.
    most_allocated: bool,
    /// Allocatable is what the plugins list healthy with exclusive devices
    /// withdrawn, not every device.
    withdraw: bool,
    rng: Rng,
}

/// The devices of `side` listed healthy, per resource: all of them, less
/// with `withdraw` those its usage withdraws.
fn allocatable(side: &NodeSide, withdraw: bool) -> [u64; 3] {
    let inv = &side.inventory;
    let unit = inv.unit();
    let gone = withdraw.then(|| withdrawn(inv, &side.pods));
    (0..inv.gpus.len()).fold([0; 3], |mut a, g| {
        let cap = inv.capacity(g);
        for (i, r) in Resource::ALL.into_iter().enumerate() {
            if !gone.as_ref().is_some_and(|w| w[r][g]) {
                a[i] += cap[r] / unit[r];
            }
        }
        a
    })
}

impl NodeTotalScheduler {
    fn new(nodes: &[NodeSide], names: &[String], most_allocated: bool, withdraw: bool) -> Self {
        NodeTotalScheduler {
            nodes: nodes
                .iter()
                .zip(names)
                .map(|(n, name)| (name.clone(), allocatable(n, withdraw), [0; 3], 0))
                .collect(),
            pods: HashMap::new(),
            most_allocated,
            withdraw,
            rng: Rng(SEED),
        }
    }
}

impl Scheduler for NodeTotalScheduler {
    async fn place(&mut self, mut pod: Pod) -> Option<Pod> {
        let (view, _) = PodView::from_pod(&Keys::new(DOMAIN), &pod);
        let request = Resource::ALL.map(|r| view.containers.iter().map(|c| c.wants(r)).sum());
        let fits = |(_, alloc, used, _): &(String, [u64; 3], [u64; 3], u64)| {
            (0..3).all(|i| used[i] + request[i] <= alloc[i])
        };
        let feasible: Vec<usize> = (0..self.nodes.len())
            .filter(|&n| fits(&self.nodes[n]))
            .collect();
        // The default scoring ignores extended resources; each GPU pod's
        // default CPU and memory request makes LeastAllocated spread pods
        // by count. MostAllocated on gpu-memory is the packing an operator
        // can configure.
        let keys: Vec<i128> = feasible
            .iter()
            .map(|&n| {
                let (_, alloc, used, pods) = &self.nodes[n];
                if self.most_allocated {
                    i128::from((used[0] + request[0]) * 1000 / alloc[0].max(1))
                } else {
                    -i128::from(*pods)
                }
            })
            .collect();
        let n = feasible[self.rng.best(&keys)?];
        let node = &mut self.nodes[n];
        (0..3).for_each(|i| node.2[i] += request[i]);
        node.3 += 1;
        pod.spec.get_or_insert_default().node_name = Some(node.0.clone());
        self.pods
            .insert(pod.metadata.name.clone().unwrap(), (n, request));
        Some(pod)
    }

    fn admitted(&mut self, _: &Pod, _: &Ledger) {}

    fn gone(&mut self, name: &str) {
        if let Some((n, request)) = self.pods.remove(name) {
            let node = &mut self.nodes[n];
            (0..3).for_each(|i| node.2[i] -= request[i]);
            node.3 -= 1;
        }
    }

    fn node_changed(&mut self, node: &str, side: &NodeSide) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.0 == node) {
            n.1 = allocatable(side, self.withdraw);
        }
    }
}

#[derive(Default)]
struct Outcome {
    offered: usize,
    placed: usize,
    failures: usize,
    /// Of the failures, pods asking whole GPUs.
    whole_failures: usize,
    refused: usize,
    /// Pods running and the share of GPU memory they hold at the first pod
    /// not served (refused, or failed on its node)...
    first_unserved: Option<(usize, f64)>,
    /// ...and at the scheduler's first refusal.
    first_refusal: Option<(usize, f64)>,
    /// The mean share of GPU memory held after each arrival.
    mean_utilisation: f64,
}

fn utilisation(sides: &HashMap<String, NodeSide>) -> f64 {
    let (held, all) = sides
        .values()
        .map(NodeSide::memory)
        .fold((0, 0), |(h, a), (x, y)| (h + x, a + y));
    held as f64 / all as f64
}

/// Offers `pods` in order. Without `lifetime`, nothing ends and the run
/// stops at the scheduler's first refusal; with it, the pod offered
/// `lifetime` arrivals earlier ends before each arrival (if it runs), the
/// same pods at the same time whatever the scheduler.
async fn run(
    mut s: impl Scheduler,
    nodes: &[k8s_openapi::api::core::v1::Node],
    pods: &[Vec<PodContainer>],
    lifetime: Option<usize>,
) -> Outcome {
    let mut sides: HashMap<String, NodeSide> = nodes
        .iter()
        .map(|n| (n.metadata.name.clone().unwrap(), NodeSide::new(n)))
        .collect();
    let name = |i: usize| format!("p{i:05}");
    let mut running: HashMap<String, String> = HashMap::new();
    let mut out = Outcome::default();
    let mut held = 0.0;
    for (i, containers) in pods.iter().enumerate() {
        if let Some(ended) = lifetime.and_then(|l| i.checked_sub(l)).map(name)
            && let Some(node) = running.remove(&ended)
        {
            sides.get_mut(&node).unwrap().remove(&ended);
            s.gone(&ended);
            s.node_changed(&node, &sides[&node]);
        }
        out.offered += 1;
        let served = match s.place(gpu_pod(NAMESPACE, &name(i), containers)).await {
            None => {
                out.refused += 1;
                out.first_refusal
                    .get_or_insert((running.len(), utilisation(&sides)));
                false
            }
            Some(bound) => {
                let node = bound_node(&bound);
                let admitted = sides.get_mut(&node).unwrap().admit(&bound);
                s.node_changed(&node, &sides[&node]);
                match admitted {
                    Ok(ledger) => {
                        s.admitted(&bound, &ledger);
                        running.insert(name(i), node);
                        out.placed += 1;
                        true
                    }
                    Err(_) => {
                        s.gone(&name(i));
                        out.failures += 1;
                        if containers.iter().any(|c| c.wants[2] > 0) {
                            out.whole_failures += 1;
                        }
                        false
                    }
                }
            }
        };
        if !served {
            out.first_unserved
                .get_or_insert((running.len(), utilisation(&sides)));
        }
        held += utilisation(&sides);
        if lifetime.is_none() && out.first_refusal.is_some() {
            break;
        }
    }
    out.mean_utilisation = held / out.offered as f64;
    out
}

async fn placement_figures() {
    const PODS: usize = 2_000;
    const LIFETIME: usize = 140;
    let nodes = mixed_nodes();
    let objects = node_objects(&nodes);
    let names: Vec<String> = nodes.iter().map(|(n, _)| n.clone()).collect();
    let sides: Vec<NodeSide> = objects.iter().map(NodeSide::new).collect();
    let pods = workload(&mut Rng(SEED), PODS);
    println!(
        "placement: 10 nodes (3 × 8 × 80 GB, 3 × 4 × 40 GB, 2 × 2 × 24 GB, 2 × [2 × 80 + 2 × 40 + 2 × 24 GB]; 3 TiB of GPU memory)"
    );
    println!("placement: {PODS} pods, seed {SEED:#x}: {WORKLOAD}");
    let percent = |x: Option<(usize, f64)>| {
        x.map_or("never".into(), |(n, u)| {
            format!("with {n} running, {:.1} % of GPU memory held", u * 100.0)
        })
    };
    let labels = [
        "extender, binpack",
        "extender, spread",
        "extender, fragmentation",
        "node totals, default scoring (spread by pods)",
        "node totals, MostAllocated gpu-memory",
        "node totals, default scoring, exclusive devices withdrawn",
        "node totals, MostAllocated gpu-memory, exclusive devices withdrawn",
    ];
    for (which, label) in labels.iter().enumerate() {
        for lifetime in [None, Some(LIFETIME)] {
            let out = match which {
                0 => {
                    run(
                        ExtenderScheduler::new("binpack", &objects),
                        &objects,
                        &pods,
                        lifetime,
                    )
                    .await
                }
                1 | 2 => {
                    let policy = if which == 1 {
                        "spread"
                    } else {
                        "fragmentation"
                    };
                    run(
                        ExtenderScheduler::new(policy, &objects),
                        &objects,
                        &pods,
                        lifetime,
                    )
                    .await
                }
                n => {
                    // 3, 4: every device listed; 5, 6: exclusive ones
                    // withdrawn. Even: MostAllocated.
                    let s = NodeTotalScheduler::new(&sides, &names, n % 2 == 0, n >= 5);
                    run(s, &objects, &pods, lifetime).await
                }
            };
            let per_1000 = |n: usize| n as f64 * 1000.0 / out.offered as f64;
            match lifetime {
                None => println!(
                    "placement: {label}: filling, nothing ends: first refusal {}; \
                     first pod not served {}; {} admission failures ({} of whole-GPU pods) \
                     in {} pods offered ({:.1} per 1,000)",
                    percent(out.first_refusal),
                    percent(out.first_unserved),
                    out.failures,
                    out.whole_failures,
                    out.offered,
                    per_1000(out.failures),
                ),
                Some(l) => println!(
                    "placement: {label}: each pod lives {l} arrivals: of {} pods {} placed, \
                     {} refused by the scheduler, {} failed admission ({} of them whole-GPU \
                     pods; {:.1} per 1,000); {:.1} % of GPU memory held on average",
                    out.offered,
                    out.placed,
                    out.refused,
                    out.failures,
                    out.whole_failures,
                    per_1000(out.failures),
                    out.mean_utilisation * 100.0,
                ),
            }
        }
    }
}

fn vm_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// One kept-alive HTTP/1.1 connection, as kube-scheduler holds to its
/// extender.
struct Http(BufReader<TcpStream>);

impl Http {
    async fn connect(addr: SocketAddr) -> Http {
        let stream = TcpStream::connect(addr).await.unwrap();
        // Without it the body, written after the head, waits for the head's
        // delayed ACK (40 ms) and the figures measure Nagle; kube-scheduler's
        // Go client has it on (Go sets TCP_NODELAY on every connection).
        stream.set_nodelay(true).unwrap();
        Http(BufReader::new(stream))
    }

    async fn post(&mut self, verb: &str, body: &str) -> String {
        let head = format!(
            "POST /{verb} HTTP/1.1\r\nHost: extender\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            body.len()
        );
        let stream = self.0.get_mut();
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(body.as_bytes()).await.unwrap();
        let mut length = 0;
        loop {
            let mut line = String::new();
            self.0.read_line(&mut line).await.unwrap();
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse().unwrap();
            }
        }
        let mut answer = vec![0; length];
        self.0.read_exact(&mut answer).await.unwrap();
        String::from_utf8(answer).unwrap()
    }
}

/// Filter and bind through the extender's HTTP server on loopback, with
/// 1,000 nodes of 8 × 80 GB and 10,000 bound pods in its cache, under
/// `policy`.
async fn latency_figures(policy: &str) {
    const NODES: usize = 1_000;
    const CACHED: usize = 10_000;
    const TIMED: usize = 500;
    let before = vm_rss_kib();
    let nodes: Vec<_> = (0..NODES)
        .map(|n| {
            let gpus: Vec<(String, u64)> = (0..8)
                .map(|g| (format!("GPU-{n:04}-{g}"), 80 * GIB))
                .collect();
            (format!("node-{n:04}"), gpus)
        })
        .collect();
    let cluster = MemoryCluster::new();
    for n in node_objects(&nodes) {
        cluster.add_node(n);
    }
    let text = format!("[extender]\nlisten = \"127.0.0.1:0\"\npolicy = \"{policy}\"\n");
    let config = ExtenderConfig::from_toml(&text).unwrap();
    let extender = Arc::new(Extender::new(&config, cluster.index(), cluster.clone()));
    // The cache: pods bound through the extender's own bind, ten a node.
    let mut rng = Rng(SEED);
    let shapes = workload(&mut rng, CACHED + TIMED);
    for (i, containers) in shapes[..CACHED].iter().enumerate() {
        let pod = gpu_pod(NAMESPACE, &format!("cached-{i:05}"), containers);
        cluster.put_pod(pod.clone());
        let node = &nodes[i % NODES].0;
        extender.bind(&binding(&pod, node)).await.unwrap();
    }
    let built = vm_rss_kib();
    let cached = cluster.index().read().unwrap().pod_count();
    let addr = start(&config, extender.clone()).await.unwrap();
    let mut http = Http::connect(addr).await;
    let names: Vec<&str> = nodes.iter().map(|(n, _)| n.as_str()).collect();
    let mut filter = Vec::new();
    let mut bind = Vec::new();
    let mut passed_total = 0;
    for (i, containers) in shapes[CACHED..].iter().enumerate() {
        let pod = gpu_pod(NAMESPACE, &format!("timed-{i:05}"), containers);
        cluster.put_pod(pod.clone());
        let body = serde_json::json!({ "Pod": pod, "Nodes": null, "NodeNames": names }).to_string();
        let t = Instant::now();
        let answer = http.post("filter", &body).await;
        filter.push(t.elapsed());
        let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
        let passed = answer["NodeNames"].as_array().unwrap();
        passed_total += passed.len();
        let node = passed[rng.below(passed.len())].as_str().unwrap();
        let b = binding(&pod, node);
        let body = serde_json::json!({
            "PodName": b.pod_name, "PodNamespace": b.pod_namespace,
            "PodUID": b.pod_uid, "Node": b.node,
        })
        .to_string();
        let t = Instant::now();
        let answer = http.post("bind", &body).await;
        bind.push(t.elapsed());
        assert_eq!(answer, r#"{"Error":""}"#, "the bind failed");
    }
    println!(
        "latency, {policy}: {NODES} nodes × 8 × 80 GB, {cached} bound pods in the cache ({TIMED} more bound while timing), \
         HTTP on loopback (kept-alive connection), in-memory API server",
    );
    report(
        &format!(
            "latency, {policy}: filter over all {NODES} node names ({:.0} passed on average)",
            passed_total as f64 / TIMED as f64
        ),
        filter,
    );
    report(
        &format!("latency, {policy}: bind (re-plan, annotate, Binding)"),
        bind,
    );
    // What the extender itself keeps: its index alone, built again from
    // the same objects (the in-memory API server holds a copy of its own).
    let bare = vm_rss_kib();
    let mut index = Index::new(&config.resource_domain);
    for n in node_objects(&nodes) {
        index.apply_node(n);
    }
    for i in 0..CACHED {
        if let Some(pod) = cluster.pod(&key_of(&format!("cached-{i:05}"))) {
            index.apply_pod(pod);
        }
    }
    let with_index = vm_rss_kib();
    println!(
        "latency, {policy}: resident memory {:.1} MiB before the cache, {:.1} MiB with it (+{:.1} MiB, \
         the in-memory API server's copy of the pods included); the extender's index alone: \
         +{:.1} MiB for {} nodes and {} pods",
        mib(before),
        mib(built),
        mib(built - before),
        mib(with_index.saturating_sub(bare)),
        index.node_count(),
        index.pod_count(),
    );
}

/// The burst section's cluster: (node, GPU sizes in GiB); 14 GPUs, 600 GiB.
const BURST_NODES: [(&str, &[u64]); 4] = [
    ("gpu-0", &[80, 80]),
    ("gpu-1", &[40, 40, 40, 40]),
    ("gpu-2", &[24, 24, 24, 24]),
    ("gpu-3", &[80, 40, 24, 24]),
];

/// A burst pod's memory ask in GiB: mostly small inference replicas, some
/// mid-size, a few that need most of a 24 GiB GPU.
fn burst_ask(rng: &mut Rng) -> u64 {
    rng.weighted(&[(1, 25), (2, 25), (4, 20), (8, 20), (20, 10)])
}

fn container(memory: u64) -> PodContainer {
    PodContainer {
        name: "main".into(),
        init: false,
        restartable: false,
        wants: [memory, 0, 0],
    }
}

/// 40 pods created at once: bind refusals and create→bound p50/p99.
async fn one_burst(
    policy: &str,
    config: impl FnOnce(&str) -> gpu_sim::scheduler::SchedulerConfig,
) -> String {
    const PODS: usize = 40;
    let w = StandIn::start(&BURST_NODES, policy, config, SEED).await;
    let mut rng = Rng(SEED);
    let created = Instant::now();
    let names: Vec<String> = (0..PODS)
        .map(|i| format!("{}/burst-{i:02}", gpu_sim::fill::NAMESPACE))
        .collect();
    for i in 0..PODS {
        w.add(
            &format!("burst-{i:02}"),
            &[container(burst_ask(&mut rng) * GIB)],
        );
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let outcomes = loop {
        let o = w.outcomes();
        if names
            .iter()
            .all(|n| o.get(n).is_some_and(|o| o.node.is_some()))
        {
            break o;
        }
        if Instant::now() > deadline {
            break o;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let refused: u32 = names
        .iter()
        .filter_map(|n| outcomes.get(n))
        .map(|o| o.bind_failures)
        .sum();
    let binds = refused as usize + PODS;
    let mut waits: Vec<Duration> = names
        .iter()
        .filter_map(|n| outcomes.get(n)?.bound_at)
        .map(|t| t - created)
        .collect();
    waits.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    format!(
        "{} bound, bind refusals {refused}/{binds} ({:.1} %), create→bound p50 {:.0} ms p99 {:.0} ms",
        waits.len(),
        refused as f64 * 100.0 / binds as f64,
        ms(percentile(&waits, 0.5)),
        ms(percentile(&waits, 0.99)),
    )
}

/// Pods one at a time, each waited for, until the first that nothing
/// holds: the share of GPU memory bound then.
async fn fill(
    policy: &str,
    config: impl FnOnce(&str) -> gpu_sim::scheduler::SchedulerConfig,
    seed: u64,
) -> f64 {
    let total: u64 = BURST_NODES.iter().flat_map(|(_, g)| g.iter()).sum();
    let w = StandIn::start(&BURST_NODES, policy, config, seed).await;
    let mut rng = Rng(seed);
    // More than the cluster holds: the run stops at the first refusal.
    let pods: Vec<Vec<PodContainer>> = (0..1000)
        .map(|_| vec![container(burst_ask(&mut rng) * GIB)])
        .collect();
    let (held, _) = w.fill(&pods).await;
    held as f64 * 100.0 / (total * GIB) as f64
}

/// The fill test's harder mix, drawn from this bench's generator (other
/// pods than the test's for the same seed).
fn harder_mix(seed: u64) -> Vec<Vec<PodContainer>> {
    use gpu_sim::fill::Ask;
    let mut rng = Rng(seed);
    let asks = gpu_sim::fill::harder_mix(&mut |n| rng.next() % n, 200);
    asks.into_iter()
        .map(|ask| match ask {
            Ask::Whole(n) => vec![PodContainer {
                wants: [0, 0, n],
                ..container(0)
            }],
            Ask::Shares(shares) => shares
                .into_iter()
                .enumerate()
                .map(|(c, (memory, core))| PodContainer {
                    name: format!("c{c}"),
                    wants: [memory * GIB, core, 0],
                    ..container(0)
                })
                .collect(),
        })
        .collect()
}

/// The harder mix on the fill test's cluster: the share of GPU memory
/// held (GPUs taken whole counting all of theirs) at the first
/// Unschedulable, one pod at a time; and, on a fresh cluster, once pods
/// have arrived until their asks reach the cluster's memory, those that
/// fit nowhere dropped.
async fn harder_fill(policy: &str, seed: u64) -> (f64, f64) {
    use gpu_sim::scheduler::SchedulerConfig;
    let sizes: HashMap<String, u64> = gpu_sim::fill::NODES
        .iter()
        .flat_map(|(n, g)| {
            g.iter()
                .enumerate()
                .map(move |(i, gib)| (format!("GPU-{n}-{i}"), gib * GIB))
        })
        .collect();
    let total: u64 = sizes.values().sum();
    let pods = harder_mix(seed);
    let held = |w: &StandIn, i: usize| -> u64 {
        if pods[i][0].wants[2] == 0 {
            return pods[i].iter().map(|c| c.wants[0]).sum();
        }
        let pod = w
            .api
            .pod(gpu_sim::fill::NAMESPACE, &format!("fill-{i:03}"))
            .unwrap();
        let assignment = pod["metadata"]["annotations"]["doslab.io/gpu-assignment"]
            .as_str()
            .expect("a bound GPU pod carries its assignment");
        let gpus: HashMap<String, Vec<String>> = serde_json::from_str(assignment).unwrap();
        gpus.values().flatten().map(|uuid| sizes[uuid]).sum()
    };
    let share = |h: u64| h as f64 * 100.0 / total as f64;
    let cluster = || {
        StandIn::start(
            &gpu_sim::fill::NODES,
            policy,
            SchedulerConfig::shipped,
            seed,
        )
    };
    let w = cluster().await;
    let (_, ran) = w.fill(&pods).await;
    let first = share((0..ran).map(|i| held(&w, i)).sum());
    drop(w);
    let w = cluster().await;
    // The paper's arrival: pods come until what they ask reaches the
    // cluster's memory (a whole GPU asking the mean GPU's), none leaves.
    let mean_gpu = total / sizes.len() as u64;
    let mut asked = 0;
    let arrived = pods
        .iter()
        .take_while(|p| {
            let before = asked;
            asked += p
                .iter()
                .map(|c| c.wants[0] + c.wants[2] * mean_gpu)
                .sum::<u64>();
            before < total
        })
        .count();
    let bound = w.arrive(&pods[..arrived]).await;
    let all = share(
        (0..arrived)
            .filter(|&i| bound[i])
            .map(|i| held(&w, i))
            .sum(),
    );
    (first, all)
}

/// The fill test's harder mix through the stand-in, per policy and seed.
async fn harder_figures() {
    const SEEDS: u64 = 10;
    for policy in ["binpack", "fragmentation"] {
        let (mut first, mut all) = (Vec::new(), Vec::new());
        for seed in 1..=SEEDS {
            let (f, a) = harder_fill(policy, seed).await;
            first.push(f);
            all.push(a);
        }
        let show = |v: &[f64]| {
            let each: Vec<String> = v.iter().map(|x| format!("{x:.1}")).collect();
            format!(
                "{} (mean {:.1})",
                each.join(" / "),
                v.iter().sum::<f64>() / v.len() as f64
            )
        };
        println!(
            "harder: {policy}, shipped config, seeds 1-{SEEDS}: GPU memory held at the first Unschedulable {} %; arrived until their asks reach 100 % (the unschedulable dropped), {} %",
            show(&first),
            show(&all)
        );
    }
}

/// The real extender behind the scheduler stand-in: a 40-pod burst, then
/// one pod at a time until the first Unschedulable, for each policy under
/// kube-scheduler's defaults (weight 1, the spreading score plugins on)
/// and under the shipped config.
async fn burst_figures() {
    use gpu_sim::scheduler::{ExtenderConfig as Ext, SchedulerConfig};
    let defaults = |url: &str| {
        let mut e = Ext::doslab(url);
        e.weight = 1;
        SchedulerConfig::new(Some(e))
    };
    type Config = fn(&str) -> SchedulerConfig;
    let configs: [(&str, Config); 2] = [
        ("weight 1, default score plugins", defaults),
        ("shipped config", SchedulerConfig::shipped),
    ];
    for policy in ["binpack", "spread", "fragmentation"] {
        for (what, config) in configs {
            let burst = one_burst(policy, config).await;
            println!("burst: {policy}, {what}: 40 pods: {burst}");
            let mut held = Vec::new();
            for seed in 1..=3 {
                held.push(format!("{:.1}", fill(policy, config, seed).await));
            }
            println!(
                "burst: {policy}, {what}: GPU memory held at the first Unschedulable, seeds 1-3: {} %",
                held.join(" / ")
            );
        }
    }
}

fn main() {
    // `cargo bench --bench placement -- NAME` runs the sections whose name
    // contains NAME (`latency`, `placement`, `burst`, `harder`); `cargo
    // bench` passes --bench.
    let only = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let run = |name: &str| only.as_deref().is_none_or(|o| name.contains(o));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // Latency first: its resident memory is read before the placement
        // runs have grown the heap.
        if run("latency") {
            for policy in ["binpack", "fragmentation"] {
                latency_figures(policy).await;
            }
        }
        if run("placement") {
            placement_figures().await;
        }
        if run("burst") {
            burst_figures().await;
        }
        if run("harder") {
            harder_figures().await;
        }
    });
}
