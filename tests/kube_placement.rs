//! Placement end to end on the real components: ten nodes of mixed GPUs,
//! each the kubelet's device manager beside the real daemon, and the real
//! kube-scheduler on the shipped profile with the real extender, given a
//! burst of 500 random pods, more than the cluster holds. No pod may be
//! bound and then refused, no GPU may go over capacity, whole GPUs stay
//! alone, and every pod's ledger says what the extender assigned and what
//! its containers got from the kubelet. (It replaced the same test on the
//! kube-scheduler and kubelet stand-ins.)

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use serde_json::Value;
use support::kube::*;

const NS: &str = "tenant";
/// Pods ask gpu-memory in GiB.
const UNIT: &str = "memory_unit_mib = 1024";

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

/// A random pod's containers, in GiB and core %: one or two app containers
/// and sometimes an init container, sharing GPUs, one in eight shared asks
/// big; every fifteenth pod takes one or two GPUs whole.
fn random_pod(i: usize, rng: &mut support::Lcg) -> Vec<(String, [u64; 3])> {
    if i % 15 == 7 {
        return vec![("train".into(), [0, 0, 1 + rng.below(2)])];
    }
    let shared = |name: String, rng: &mut support::Lcg| {
        let memory = if rng.below(8) == 0 {
            12 + rng.below(17)
        } else {
            1 + rng.below(8)
        };
        (name, [memory, 5 + rng.below(21), 0])
    };
    let mut v = Vec::new();
    if rng.below(4) == 0 {
        v.push(shared("init-setup".into(), rng));
    }
    for n in 0..=rng.below(2) {
        v.push(shared(format!("app{n}"), rng));
    }
    v
}

fn pod_named(name: &str, containers: &[(String, [u64; 3])]) -> Pod {
    let refs: Vec<(&str, [u64; 3])> = containers.iter().map(|(n, w)| (n.as_str(), *w)).collect();
    gpu_pod(NS, name, &refs)
}

/// Waits until the burst settles: no pod bound for 10 s and every bound
/// pod admitted (Running) or refused (Failed).
async fn settle(pods: &Api<Pod>, cp: &ControlPlane, nodes: &[KubeNode], sched: &Scheduler) {
    let deadline = Instant::now() + Duration::from_secs(400);
    let (mut bound_before, mut since) = (usize::MAX, Instant::now());
    let mut seen = (0, 0);
    let settled = async || {
        let list = pods.list(&Default::default()).await.unwrap().items;
        let bound: Vec<&Pod> = list.iter().filter(|p| !node_of(p).is_empty()).collect();
        if bound.len() != bound_before {
            (bound_before, since) = (bound.len(), Instant::now());
        }
        seen = (bound.len(), list.len());
        let admitted = bound.iter().all(|p| phase(p) != "Pending");
        (admitted && since.elapsed() >= Duration::from_secs(10)).then_some(())
    };
    let done = support::poll_within(deadline, settled).await;
    assert!(
        done.is_some(),
        "not settled: {} of {} bound\n{}",
        seen.0,
        seen.1,
        logs(cp, nodes, sched)
    );
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// Every bound pod Running with its ledger equal to its assignment and its
/// containers' envs naming those GPUs; every unbound pod Pending and
/// holding nothing; no GPU over capacity; whole GPUs alone. Returns
/// (bound, unbound) and the GiB in use.
async fn check(pods: &Api<Pod>, nodes: &[KubeNode]) -> (usize, usize, u64) {
    // Per GPU: MiB, core %, whole holders.
    let mut used: BTreeMap<String, (u64, u64, u32)> = BTreeMap::new();
    let (mut bound, mut unbound, mut failures) = (0, 0, Vec::new());
    for pod in pods.list(&Default::default()).await.unwrap().items {
        let name = pod.metadata.name.clone().unwrap();
        if pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        if node_of(&pod).is_empty() {
            assert_eq!(phase(&pod), "Pending", "{name}");
            for key in ["assignment", "ledger", "uuid", "assume-time"] {
                let key = format!("doslab.io/gpu-{key}");
                assert_eq!(annotation(&pod, &key), None, "{name} holds {key}");
            }
            unbound += 1;
            continue;
        }
        bound += 1;
        if phase(&pod) != "Running" {
            failures.push(format!("{name}: {:?}", pod.status));
            continue;
        }
        let node = nodes.iter().find(|n| n.name == node_of(&pod)).unwrap();
        let record = node.record(NS, &name).unwrap();
        assert_eq!(splits(&record), Vec::<String>::new(), "{name}");
        let envs = container_envs(&record);
        assert_eq!(
            annotation(&pod, "doslab.io/gpu-assigned"),
            Some("true"),
            "{name}"
        );
        let parse = |key: &str| -> BTreeMap<String, Value> {
            serde_json::from_str(annotation(&pod, key).unwrap_or("null"))
                .unwrap_or_else(|e| panic!("{name}: {key}: {e}"))
        };
        let ledger = parse("doslab.io/gpu-ledger");
        let assignment = parse("doslab.io/gpu-assignment");
        let spec = pod.spec.as_ref().unwrap();
        let mut asking: Vec<&String> = spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
            .map(|c| &c.name)
            .collect();
        asking.sort();
        assert_eq!(ledger.keys().collect::<Vec<_>>(), asking, "{name}");
        for (container, grant) in &ledger {
            let mut gpus: Vec<String> = serde_json::from_value(grant["gpus"].clone()).unwrap();
            gpus.sort();
            let mut assigned: Vec<String> =
                serde_json::from_value(assignment[container].clone()).unwrap();
            assigned.sort();
            assert_eq!(gpus, assigned, "{name}/{container}: ledger and assignment");
            let mut visible: Vec<&str> = envs[container]["NVIDIA_VISIBLE_DEVICES"]
                .split(',')
                .collect();
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
    assert!(
        failures.is_empty(),
        "{} admission failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let mut gib = 0;
    for (n, sizes) in NODES.iter().enumerate() {
        for (g, size) in sizes.iter().enumerate() {
            let uuid = gpu_uuid(n, g);
            let (mib, core, whole) = used.get(&uuid).copied().unwrap_or_default();
            let at = format!("node-{n} {uuid}");
            assert!(mib <= size * 1024, "{at}: {mib} MiB of {size} GiB");
            assert!(core <= 100, "{at}: {core} % of the cores");
            assert!(whole <= 1, "{at}: held whole {whole} times");
            assert!(whole == 0 || mib + core == 0, "{at}: whole and shared");
            gib += if whole > 0 { *size } else { mib / 1024 };
        }
    }
    (bound, unbound, gib)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_500_pods_over_ten_nodes_is_placed_with_no_admission_failure() {
    let started = Instant::now();
    let cp = ControlPlane::start();
    let gpus: Vec<Vec<u64>> = NODES
        .iter()
        .map(|n| n.iter().map(|g| g * 1024).collect())
        .collect();
    let gpus: Vec<&[u64]> = gpus.iter().map(Vec::as_slice).collect();
    let nodes = cluster(&cp, NS, &gpus, UNIT).await;
    let sched = Scheduler::start(&cp);
    let client = cp.admin_client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut rng = support::Lcg(11);
    for i in 0..500 {
        create(
            &client,
            &pod_named(&format!("pod-{i:03}"), &random_pod(i, &mut rng)),
        )
        .await;
    }
    settle(&pods, &cp, &nodes, &sched).await;
    let (bound, unbound, gib) = check(&pods, &nodes).await;
    let refused = refused_binds(&client, NS).await;
    let total: u64 = NODES.iter().flat_map(|n| n.iter()).sum();
    eprintln!(
        "500-pod burst (real scheduler and kubelets): {bound} bound and admitted, 0 admission \
         failures, {unbound} left Pending unbound, {} binds refused; {gib} of {total} GiB in \
         use; {:.1} s",
        refused.len(),
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
    assert!(
        refused.len() * 20 <= bound + refused.len(),
        "{} binds refused for {bound} bound: {refused:#?}",
        refused.len()
    );

    // A pod only node-5 can hold, and only empty: not bound while node-5's
    // pods live, bound there once they are deleted.
    for pod in pods.list(&Default::default()).await.unwrap().items {
        if node_of(&pod).is_empty() {
            let name = pod.metadata.name.unwrap();
            pods.delete(&name, &Default::default()).await.unwrap();
        }
    }
    let whole = "whole-node";
    create(&client, &gpu_pod(NS, whole, &[("train", [0, 0, 8])])).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    support::poll_for(
        deadline,
        async || {
            let tried = scheduling_failures(&client, NS, whole).await;
            (!tried.is_empty()).then_some(())
        },
        || format!("{whole} never tried"),
    )
    .await;
    assert!(node_of(&pods.get(whole).await.unwrap()).is_empty());
    for pod in pods.list(&Default::default()).await.unwrap().items {
        if node_of(&pod) == "node-5" {
            let name = pod.metadata.name.unwrap();
            pods.delete(&name, &Default::default()).await.unwrap();
        }
    }
    let ran = wait_pod(&client, NS, whole, Duration::from_secs(120), |p| {
        phase(p) == "Running" || phase(p) == "Failed"
    })
    .await
    .unwrap_or_else(|p| panic!("{whole} never ran: {p:#?}\n{}", logs(&cp, &nodes, &sched)));
    assert_eq!(node_of(&ran), "node-5");
    assert_eq!(phase(&ran), "Running", "{ran:#?}");
    check(&pods, &nodes).await;
    let ledger: Value =
        serde_json::from_str(annotation(&ran, "doslab.io/gpu-ledger").unwrap()).unwrap();
    assert_eq!(ledger["train"]["gpus"].as_array().unwrap().len(), 8);
}
