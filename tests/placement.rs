//! Placement end to end: the real extender binary and ten real node daemons
//! (mock GPUs of mixed sizes, pod matching on, each with its own kubelet
//! stand-in) against one API-server stand-in, driven by the kube-scheduler
//! stand-in calling filter, prioritize and bind over HTTP. Each node's
//! kubelet admits the pods bound to it as they arrive, as the kubelet does.
//! No pod may be bound and then refused, no GPU may go over capacity, whole
//! GPUs stay alone, and every ledger says what the extender assigned.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpu_sim::apiserver::{ApiServerSim, PodContainer};
use gpu_sim::gpu_node::GpuNode;
use gpu_sim::kubelet::{AllocatedResource, merged_envs, pod_containers};
use gpu_sim::scheduler::{Outcome, SchedulerSim};
use serde_json::Value;
use support::*;

/// One gpu-memory device is 1 GiB: pods ask in GiB, lists stay short.
const UNIT_MIB: u64 = 1024;
const SCHEDULER: &str = "doslab-gpu-scheduler";
const NS: &str = "default";

/// Ten nodes, 38 GPUs, sizes in GiB; node-5 alone has eight GPUs.
const NODES: [&[u64]; 10] = [
    &[16; 6],
    &[24; 4],
    &[80; 2],
    &[40; 4],
    &[80, 24, 24],
    &[24; 8],
    &[48; 2],
    &[80; 4],
    &[24],
    &[40, 40, 16, 16],
];

struct Node {
    spec: GpuNode,
    kubelet: KubeletSim,
    daemon: Daemon,
    _dir: tempfile::TempDir,
}

struct World {
    api: ApiServerSim,
    nodes: Vec<Node>,
    extender: Daemon,
    extender_url: String,
    _files: tempfile::TempDir,
}

/// What a pod got from its node's kubelet: the node and each container's
/// grants, or why it was refused.
type Admitted = BTreeMap<
    String,
    (
        String,
        Result<BTreeMap<String, Vec<AllocatedResource>>, String>,
    ),
>;

impl World {
    async fn start() -> World {
        let files = tempfile::tempdir().unwrap();
        let kubeconfig = files.path().join("kubeconfig");
        let api = ApiServerSim::start().await.unwrap();
        api.write_kubeconfig(&kubeconfig).unwrap();
        let mut nodes = Vec::new();
        for (n, sizes) in NODES.iter().enumerate() {
            let spec = GpuNode::new(n, &format!("node-{n}"), sizes);
            spec.add_to(&api, UNIT_MIB);
            let name = &spec.name;
            let dir = tempfile::tempdir().unwrap();
            let mock: Vec<(&str, u64)> = spec.gpus.iter().map(|(u, m)| (u.as_str(), *m)).collect();
            let toml = mock_config(
                dir.path(),
                &format!(
                    "pod_matching = true\nnode_name = \"{name}\"\nmemory_unit_mib = {UNIT_MIB}\n\
                     [matcher]\nkubeconfig = {:?}",
                    kubeconfig.display().to_string()
                ),
                &mock,
            );
            let kubelet = KubeletSim::start(dir.path()).unwrap();
            let daemon = Daemon::start(&toml);
            nodes.push(Node {
                spec,
                kubelet,
                daemon,
                _dir: dir,
            });
        }
        let (extender, extender_url) = start_extender(&kubeconfig);
        let w = World {
            api,
            nodes,
            extender,
            extender_url,
            _files: files,
        };
        for node in &w.nodes {
            let listed = |s: &BTreeMap<_, _>| node.spec.listed(UNIT_MIB, s);
            let ok = node.kubelet.wait_until(WAIT, listed).await;
            assert!(ok, "{}: {}", node.spec.name, node.daemon.log_text());
        }
        // The extender places nothing on a node without its inventory.
        let deadline = Instant::now() + WAIT;
        while !w.nodes.iter().all(|n| n.spec.inventory_published(&w.api)) {
            assert!(Instant::now() < deadline, "inventories not published");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        w
    }

    async fn scheduler(&self, seed: u64) -> SchedulerSim {
        let kubeconfig = self._files.path().join("kubeconfig");
        start_scheduler(&kubeconfig, &self.extender_url, seed).await
    }

    /// Lets every node's kubelet admit what was bound to it, until every
    /// pod in `names` was tried, every bound pod admitted, and every pod
    /// left pending was tried again since the last bind.
    async fn settle(&self, sim: &SchedulerSim, names: &[String], admitted: &mut Admitted) {
        let deadline = Instant::now() + Duration::from_secs(300);
        let key = |name: &String| format!("{NS}/{name}");
        // The bound count, and the attempts of every pod, when it was seen.
        let mut mark: Option<(usize, BTreeMap<String, Outcome>)> = None;
        loop {
            self.admit_round(admitted).await;
            let outcomes = sim.outcomes();
            let tried = names.iter().all(|n| outcomes.contains_key(&key(n)));
            let bound: Vec<&String> = names
                .iter()
                .filter(|n| outcomes.get(&key(n)).is_some_and(|o| o.node.is_some()))
                .collect();
            if tried && bound.iter().all(|n| admitted.contains_key(*n)) {
                match &mark {
                    Some((count, before)) if *count == bound.len() => {
                        let retried = names.iter().all(|n| {
                            let (now, then) = (&outcomes[&key(n)], &before[&key(n)]);
                            now.node.is_some() || now.attempts > then.attempts
                        });
                        if retried {
                            return;
                        }
                    }
                    _ => mark = Some((bound.len(), outcomes.clone())),
                }
            }
            assert!(
                Instant::now() < deadline,
                "not settled: {} of {} bound, {} admitted",
                bound.len(),
                names.len(),
                admitted.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn pod(&self, name: &str) -> Value {
        self.api.pod(NS, name).unwrap()
    }

    /// Every node's kubelet admits what arrived for it, nodes side by side.
    async fn admit_round(&self, admitted: &mut Admitted) {
        let rounds = futures::future::join_all(
            self.nodes
                .iter()
                .map(|n| n.kubelet.admit_bound(&self.api, &n.spec.name)),
        )
        .await;
        for (node, admissions) in self.nodes.iter().zip(rounds) {
            for a in admissions {
                admitted.insert(a.name, (node.spec.name.clone(), a.result));
            }
        }
    }

    /// Admission rounds until `name` is admitted (or refused).
    async fn wait_admitted(&self, name: &str, admitted: &mut Admitted) {
        let deadline = Instant::now() + WAIT;
        while !admitted.contains_key(name) {
            assert!(Instant::now() < deadline, "{name} not admitted");
            self.admit_round(admitted).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every bound pod admitted with its ledger equal to its assignment and
    /// its envs naming the same GPUs; every unbound pod Pending and holding
    /// nothing; no GPU over capacity; whole GPUs alone. Returns (bound,
    /// unbound) and the GiB in use.
    fn check(&self, names: &[String], admitted: &Admitted) -> (usize, usize, u64) {
        // Each refusal with what its node's daemon logged about the pod.
        let failures: Vec<String> = admitted
            .iter()
            .filter_map(|(n, (node, r))| {
                let e = r.as_ref().err()?;
                let log = self
                    .nodes
                    .iter()
                    .find(|x| &x.spec.name == node)?
                    .daemon
                    .log_text();
                let said: Vec<&str> = log.lines().filter(|l| l.contains(n.as_str())).collect();
                Some(format!("{n} on {node}: {e}\n  {}", said.join("\n  ")))
            })
            .collect();
        assert!(
            failures.is_empty(),
            "{} admission failures:\n{}",
            failures.len(),
            failures.join("\n")
        );
        // Per GPU: MiB, core %, whole holders.
        let mut used: BTreeMap<String, (u64, u64, u32)> = BTreeMap::new();
        let (mut bound, mut unbound) = (0, 0);
        for name in names {
            // Deleted pods hold nothing.
            let Some(pod) = self.api.pod(NS, name) else {
                continue;
            };
            let Some(node) = pod["spec"]["nodeName"].as_str() else {
                assert_eq!(pod["status"]["phase"], "Pending", "{name}");
                for key in ["assignment", "ledger", "uuid", "assume-time"] {
                    let key = format!("doslab.io/gpu-{key}");
                    assert_eq!(annotation(&pod, &key), None, "{name} holds {key}");
                }
                unbound += 1;
                continue;
            };
            bound += 1;
            let (admitted_on, grants) = &admitted[name];
            assert_eq!(admitted_on, node, "{name}");
            let grants = grants.as_ref().unwrap();
            assert_eq!(
                annotation(&pod, "doslab.io/gpu-assigned"),
                Some("true"),
                "{name}"
            );
            let parse = |key: &str| -> BTreeMap<String, Value> {
                serde_json::from_str(annotation(&pod, key).unwrap_or("null"))
                    .unwrap_or_else(|e| panic!("{name}: {key}: {e}: {pod}"))
            };
            let ledger = parse("doslab.io/gpu-ledger");
            let assignment = parse("doslab.io/gpu-assignment");
            let asking: Vec<String> = pod_containers(&pod)
                .into_iter()
                .filter(|c| c.wants != [0; 3])
                .map(|c| c.name)
                .collect();
            let mut ledgered: Vec<&String> = ledger.keys().collect();
            ledgered.sort();
            let mut expected: Vec<&String> = asking.iter().collect();
            expected.sort();
            assert_eq!(ledgered, expected, "{name}: {pod}");
            for (container, grant) in &ledger {
                let mut gpus: Vec<String> = serde_json::from_value(grant["gpus"].clone()).unwrap();
                gpus.sort();
                let mut assigned: Vec<String> =
                    serde_json::from_value(assignment[container].clone()).unwrap();
                assigned.sort();
                assert_eq!(gpus, assigned, "{name}/{container}: ledger and assignment");
                let envs = merged_envs(&grants[container]);
                let mut visible: Vec<&str> = envs["NVIDIA_VISIBLE_DEVICES"].split(',').collect();
                visible.sort();
                assert_eq!(visible, gpus, "{name}/{container}: envs and ledger");
                for u in &gpus {
                    let u = used.entry(u.clone()).or_default();
                    if grant["gpu-count"].is_u64() {
                        u.2 += 1;
                    } else {
                        u.0 += grant["gpu-memory"].as_u64().unwrap_or(0);
                        u.1 += grant["gpu-core"].as_u64().unwrap_or(0);
                    }
                }
            }
        }
        let mut gib = 0;
        for node in &self.nodes {
            for (uuid, size) in &node.spec.gpus {
                let (mib, core, whole) = used.get(uuid).copied().unwrap_or_default();
                let at = format!("{} {uuid}", node.spec.name);
                assert!(mib <= *size, "{at}: {mib} MiB of {size} MiB");
                assert!(core <= 100, "{at}: {core} % of the cores");
                assert!(whole <= 1, "{at}: held whole {whole} times");
                assert!(whole == 0 || mib + core == 0, "{at}: whole and shared");
                gib += if whole > 0 { size / 1024 } else { mib / 1024 };
            }
        }
        (bound, unbound, gib)
    }
}

fn annotation<'a>(pod: &'a Value, key: &str) -> Option<&'a str> {
    pod["metadata"]["annotations"][key].as_str()
}

/// A random pod, in GiB and core %: one or two app containers and
/// sometimes an init container, sharing GPUs, one in eight shared asks big;
/// every fifteenth pod takes one or two GPUs whole.
fn random_pod(i: usize, rng: &mut Lcg) -> Vec<PodContainer> {
    if i % 15 == 7 {
        return vec![container("train", false, [0, 0, 1 + rng.below(2)])];
    }
    let shared = |name: &str, init: bool, rng: &mut Lcg| {
        let memory = if rng.below(8) == 0 {
            12 + rng.below(17)
        } else {
            1 + rng.below(8)
        };
        container(name, init, [memory, 5 + rng.below(21), 0])
    };
    let mut v = Vec::new();
    if rng.below(4) == 0 {
        v.push(shared("init", true, rng));
    }
    for n in 0..=rng.below(2) {
        v.push(shared(&format!("app{n}"), false, rng));
    }
    v
}

/// Creates `pods` random pods for the scheduler, oldest first; their names.
fn burst(api: &ApiServerSim, pods: usize, seed: u64) -> Vec<String> {
    let mut rng = Lcg(seed);
    (0..pods)
        .map(|i| {
            let name = format!("pod-{i:03}");
            api.add_unscheduled_pod(NS, &name, SCHEDULER, &random_pod(i, &mut rng));
            name
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_500_pods_over_ten_nodes_is_placed_with_no_admission_failure() {
    let started = Instant::now();
    let w = World::start().await;
    let names = burst(&w.api, 500, 11);
    let sim = w.scheduler(11).await;
    let mut admitted = Admitted::new();
    w.settle(&sim, &names, &mut admitted).await;
    let (bound, unbound, gib) = w.check(&names, &admitted);
    let total: u64 = NODES.iter().flat_map(|n| n.iter()).sum();
    println!(
        "500-pod burst: {bound} bound and admitted, 0 admission failures, {unbound} left \
         Pending unbound; {gib} of {total} GiB in use; {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // The burst asks more than the cluster holds: both kinds are there.
    assert!(
        bound >= 80 && unbound >= 100,
        "{bound} bound, {unbound} not"
    );
    // The scheduler filters each pod before the last one's bind returns:
    // the extender counts the pods it nominated, so binds are not refused
    // for room a pod judged a moment earlier already took.
    let refused: u32 = sim.outcomes().values().map(|o| o.bind_failures).sum();
    assert!(
        refused as usize * 20 <= bound + refused as usize,
        "{refused} binds refused for {bound} bound"
    );

    // A pod only node-5 can hold, and only empty: refused while its pods
    // live, bound there as soon as they are deleted.
    for name in &names {
        if w.pod(name)["spec"]["nodeName"].is_null() {
            w.api.delete_pod(NS, name);
        }
    }
    let whole = "whole-node";
    w.api.add_unscheduled_pod(
        NS,
        whole,
        SCHEDULER,
        &[container("train", false, [0, 0, 8])],
    );
    let key = format!("{NS}/{whole}");
    let deadline = Instant::now() + WAIT;
    while !sim.outcomes().contains_key(&key) {
        assert!(Instant::now() < deadline, "{whole} never tried");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let first = sim.outcomes()[&key].clone();
    assert_eq!(first.node, None);
    assert_eq!(first.filtered.len(), NODES.len(), "{first:?}");
    for name in &names {
        if w.api
            .pod(NS, name)
            .is_some_and(|p| p["spec"]["nodeName"] == "node-5")
        {
            w.api.delete_pod(NS, name);
        }
    }
    w.wait_admitted(whole, &mut admitted).await;
    assert_eq!(sim.outcomes()[&key].node.as_deref(), Some("node-5"));
    let all: Vec<String> = names.iter().cloned().chain([whole.to_owned()]).collect();
    w.check(&all, &admitted);
    let ledger = w.pod(whole)["metadata"]["annotations"]["doslab.io/gpu-ledger"].clone();
    let held: Value = serde_json::from_str(ledger.as_str().unwrap()).unwrap();
    assert_eq!(held["train"]["gpus"].as_array().unwrap().len(), 8);
    sim.stop();
    drop(w.extender);
}
