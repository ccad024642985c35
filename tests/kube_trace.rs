//! A sample of Alibaba's GPU-sharing trace (the trace bench's,
//! `benches/trace`) through the real components: a few dozen of its nodes,
//! each a kubelet peer with the trace node's CPU, memory and GPUs and the
//! real daemon beside it, the real kube-scheduler with the extender under
//! the fragmentation policy, and the sample's tasks created one at a time
//! until their GPU asks reach the sampled GPUs' capacity (the bench's
//! 100 % arrived), each waited until it runs or is unschedulable (then
//! deleted: it arrived and was dropped, as in the replay). The share of
//! the GPUs allocated must be the one the bench's replay of the same
//! sample gives, within a point: the bench's figures are the cluster's.
//!
//! `KUBE_TRACE_VARIANT`: the trace's pod list (default `default`; the
//! nodes carry their GPU model's label, so `gpuspec33`'s model
//! affinities hold as in the replay).

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use gpu_sim::trace::cluster::Cluster;
use gpu_sim::trace::load::{self, MODELS, Task, TraceNode};
use gpu_sim::trace::product::{self, MODEL_LABEL, NAMESPACE, Product};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use support::kube::*;

/// Nodes sampled, and the seed of the sample.
const NODES: usize = 48;
const SEED: u64 = 7;

/// How far (points of the GPU capacity) the real allocation may be from
/// the replay's: the target.
const WITHIN: f64 = 1.0;

/// The policy measured: the one the trace replay measures against FGD.
const POLICY: &str = "fragmentation";

/// The bench's replay of the sample (the extender in process, every node
/// scored: below 100 nodes kube-scheduler filters them all): the cluster
/// it leaves and each task's node.
fn replay(nodes: &[TraceNode], tasks: &[Task]) -> (Cluster, Vec<Option<String>>) {
    let mut cluster = Cluster::new(nodes);
    let mut product = Product::new(nodes, POLICY, 100);
    let placed = tasks
        .iter()
        .map(|t| {
            let p = product.place(&cluster, t)?;
            cluster.apply(t, &p);
            Some(product::node_name(p.node))
        })
        .collect();
    (cluster, placed)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trace_sample_allocates_as_its_replay() {
    let started = Instant::now();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/alibaba-gpu-v2023");
    let all_nodes = load::nodes(&dir).unwrap_or_else(|e| panic!("the trace's nodes: {e}"));
    let variant = std::env::var("KUBE_TRACE_VARIANT").unwrap_or_else(|_| "default".into());
    let all_tasks = load::tasks(&dir, &variant).unwrap_or_else(|e| panic!("its tasks: {e}"));
    let mut rng = support::Lcg(SEED);
    let (nodes, tasks) =
        gpu_sim::trace::sample(&all_nodes, &all_tasks, NODES, 100, &mut |n| rng.below(n));

    let (replayed, replay_nodes) = {
        let (nodes, tasks) = (nodes.clone(), tasks.clone());
        tokio::task::spawn_blocking(move || replay(&nodes, &tasks))
            .await
            .unwrap()
    };
    let replay_share = replayed.allocated as f64 * 100.0 / replayed.capacity as f64;

    let cp = ControlPlane::start();
    let mut kube_nodes = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let name = product::node_name(i);
        // As the replay's inventory: GB of 1,000 MiB, memory units of 1 %
        // of a GPU, so a share asks its thousandths / 10 of both.
        let gb = MODELS[n.model].1;
        let uuids: Vec<String> = (0..n.gpus).map(|g| gpu_uuid(i, g)).collect();
        let gpus: Vec<(&str, u64)> = uuids.iter().map(|u| (u.as_str(), gb * 1000)).collect();
        let (cpu, memory) = (format!("{}m", n.cpu_milli), format!("{}Mi", n.memory_mib));
        let unit = format!("memory_unit_mib = {}", gb * 10);
        // Labelled with the GPU model as the replay's Nodes, for the
        // model affinities.
        let model = format!("{MODEL_LABEL}={}", MODELS[n.model].0);
        let sized = [cpu.as_str(), &memory, "1000", &model];
        kube_nodes.push(KubeNode::start_sized(&cp, &name, &gpus, &unit, sized).await);
    }
    namespace(&cp, NAMESPACE);
    // Pods asking no GPU go through the extender too, as the fragmentation
    // policy wants them (deploy/README: a profile without
    // managedResources); the replay places them likewise.
    let sched = Scheduler::start_edited(&cp, &format!("policy = \"{POLICY}\"\n"), |profile| {
        profile["extenders"][0]
            .as_mapping_mut()
            .unwrap()
            .remove("managedResources");
    });
    let client = cp.admin_client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    // The node a pod that never ran was bound to: its kubelet's and
    // daemon's logs join the scheduler's and the extender's.
    let logs = |node: Option<&str>| {
        let on = kube_nodes.iter().find(|n| Some(n.name.as_str()) == node);
        let (kubelet, daemon) = on.map_or_else(Default::default, |n| {
            (n.kubelet.log_text(), n.daemon.log_text())
        });
        format!(
            "--- scheduler\n{}\n--- extender\n{}\n--- kubelet of {node:?}\n{}\n--- daemon\n{}",
            tail(&sched.proc.log_text()),
            tail(&sched.extender.log_text()),
            tail(&kubelet),
            tail(&daemon),
        )
    };
    let (mut allocated, mut failed, mut elsewhere) = (0u64, Vec::new(), 0usize);
    for (i, t) in tasks.iter().enumerate() {
        let name = format!("t{i:06}");
        let mut pod = product::pod(&name, t);
        pod.metadata.uid = None;
        pod.status = None;
        let ran = create_and_decide(&client, &pod, &logs).await;
        if unschedulable(&ran).is_some() {
            pods.delete(&name, &Default::default()).await.unwrap();
            wait_gone(&client, NAMESPACE, &name, Duration::from_secs(30)).await;
        } else if phase(&ran) == "Failed" {
            failed.push(format!("{name}: {:?}", ran.status));
        } else {
            allocated += t.gpu_demand();
        }
        let node = ran.spec.as_ref().and_then(|s| s.node_name.clone());
        elsewhere += usize::from(node != replay_nodes[i]);
    }
    let real_share = allocated as f64 * 100.0 / replayed.capacity as f64;
    let gpus: usize = nodes.iter().map(|n| n.gpus).sum();
    eprintln!(
        "trace sample ({variant}, seed {SEED}): {} nodes, {gpus} GPUs, {} tasks; allocated: real components \
         {real_share:.1} %, replay {replay_share:.1} %; {elsewhere} tasks placed otherwise ({:.0} s)",
        nodes.len(),
        tasks.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(failed.is_empty(), "admission failures: {failed:#?}");
    assert!(
        (real_share - replay_share).abs() <= WITHIN,
        "real {real_share:.1} % against the replay's {replay_share:.1} %\n{}",
        logs(None)
    );
    drop(sched);
    drop(kube_nodes);
}
