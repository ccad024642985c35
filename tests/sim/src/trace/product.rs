//! The product's placement, as a cluster runs it: kube-scheduler's own
//! filters (CPU, memory, the GPU-model selector, node totals of the GPU
//! resources) over its sample of the nodes, then the extender's filter,
//! which passes the one node its policy ranks best, and its bind, which
//! writes the GPUs. The extender is the real one, called in process over
//! an in-memory cluster whose Nodes publish what the trace's nodes have.

use std::collections::BTreeMap;

use crate::memory::MemoryCluster;
use gpu_device_plugin::extender::wire::{ExtenderArgs, ExtenderBindingArgs};
use gpu_device_plugin::extender::{Extender, ExtenderConfig, pod_name};
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;

use super::cluster::{Cluster, Placement};
use super::load::{MODELS, Task, TraceNode};

/// The namespace of the trace's pods.
pub const NAMESPACE: &str = "trace";

/// The label a GPU-model selector names.
pub const MODEL_LABEL: &str = "gpu.example.com/model";

/// kube-scheduler's look at the nodes: from where the last one stopped,
/// it filters until `size` nodes pass or it has seen every node
/// (`percentageOfNodesToScore`: that share of the nodes, at least 100).
struct Sample {
    size: usize,
    next_start: usize,
}

impl Sample {
    fn new(nodes: usize, percent: usize) -> Sample {
        let size = if nodes < 100 {
            nodes
        } else {
            (nodes * percent / 100).max(100)
        };
        Sample {
            size,
            next_start: 0,
        }
    }

    /// The nodes of this look that `passes`.
    fn take(&mut self, nodes: usize, passes: impl Fn(usize) -> bool) -> Vec<usize> {
        let mut found = Vec::new();
        let mut looked = 0;
        while looked < nodes && found.len() < self.size {
            let i = (self.next_start + looked) % nodes;
            if passes(i) {
                found.push(i);
            }
            looked += 1;
        }
        self.next_start = (self.next_start + looked) % nodes;
        found
    }
}

pub struct Product {
    cluster: MemoryCluster,
    extender: Extender<MemoryCluster>,
    names: Vec<String>,
    /// GPU UUIDs per node, in order.
    uuids: Vec<Vec<String>>,
    /// The GPU scheduler's sample of the nodes, and the default
    /// scheduler's.
    gpu_sample: Sample,
    cpu_sample: Sample,
    /// CPU-only pods go to the GPU scheduler too (the fragmentation
    /// policy places them), not to the default scheduler.
    cpu_pods_ours: bool,
    runtime: tokio::runtime::Runtime,
    placed: usize,
}

/// A GPU of `gb` GB as the node daemon publishes it: 1,000 MiB a GB, in
/// memory units of 1 % of the GPU, so that a share of `gpu_milli`
/// thousandths asks `gpu_milli / 10` units of memory and as many percent
/// of compute (every share in the trace is a whole percent).
fn inventory(gpus: &[String], gb: u64) -> String {
    let gpus: Vec<_> = gpus
        .iter()
        .map(|u| json!({ "uuid": u, "memoryMiB": gb * 1000, "healthy": true }))
        .collect();
    json!({
        "version": 1, "memoryUnitMiB": gb * 10, "coresPerGpu": 100,
        "resources": ["gpu-memory", "gpu-core", "gpu-count"], "gpus": gpus,
    })
    .to_string()
}

fn node(name: &str, n: &TraceNode, uuids: &[String]) -> Node {
    let (model, gb) = MODELS[n.model];
    let gpus = n.gpus as u64;
    let resources = json!({
        "cpu": format!("{}m", n.cpu_milli), "memory": format!("{}Mi", n.memory_mib),
        "pods": "1000",
        "doslab.io/gpu-memory": (100 * gpus).to_string(),
        "doslab.io/gpu-core": (100 * gpus).to_string(),
        "doslab.io/gpu-count": gpus.to_string(),
    });
    serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": { MODEL_LABEL: model },
            "annotations": { "doslab.io/gpu-inventory": inventory(uuids, gb) },
        },
        "status": { "capacity": resources, "allocatable": resources },
    }))
    .expect("a valid Node")
}

/// The name of the trace's `i`-th node, in the replay and on real nodes.
pub fn node_name(i: usize) -> String {
    format!("node-{i:04}")
}

/// Task `t` as pod `trace/<name>` of the GPU scheduler: a share asks its
/// thousandths as percent of one GPU's memory units and cores, whole GPUs
/// `gpu-count`, a GPU-model constraint a required node affinity.
pub fn pod(name: &str, t: &Task) -> Pod {
    let mut limits = BTreeMap::new();
    if t.shared() {
        let percent = (t.gpu_milli / 10).to_string();
        limits.insert("doslab.io/gpu-memory", percent.clone());
        limits.insert("doslab.io/gpu-core", percent);
    } else if t.num_gpu > 0 {
        limits.insert("doslab.io/gpu-count", t.num_gpu.to_string());
    }
    let models: Vec<&str> = (0..MODELS.len())
        .filter(|&m| t.models & (1 << m) != 0)
        .map(|m| MODELS[m].0)
        .collect();
    let affinity = (!models.is_empty()).then(|| {
        json!({ "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": { "nodeSelectorTerms": [
                { "matchExpressions": [{ "key": MODEL_LABEL, "operator": "In", "values": models }] }
            ]}
        }})
    });
    serde_json::from_value(json!({
        "metadata": { "name": name, "namespace": NAMESPACE, "uid": format!("uid-{name}") },
        "spec": {
            "schedulerName": "doslab-gpu-scheduler",
            "affinity": affinity,
            "containers": [{
                "name": "task",
                "image": "task",
                "resources": {
                    "requests": { "cpu": format!("{}m", t.cpu_milli), "memory": format!("{}Mi", t.memory_mib) },
                    "limits": limits,
                },
            }],
        },
        "status": { "phase": "Pending" },
    }))
    .expect("a valid Pod")
}

impl Product {
    /// The extender on `policy` behind a scheduler that filters until
    /// `percent` % of the nodes pass (at least 100, as kube-scheduler's
    /// `percentageOfNodesToScore`).
    pub fn new(nodes: &[TraceNode], policy: &str, percent: usize) -> Product {
        let cluster = MemoryCluster::new();
        let mut names = Vec::new();
        let mut uuids = Vec::new();
        for (i, n) in nodes.iter().enumerate() {
            let name = node_name(i);
            let gpus: Vec<String> = (0..n.gpus).map(|g| format!("GPU-{i:04}-{g}")).collect();
            cluster.add_node(node(&name, n, &gpus));
            names.push(name);
            uuids.push(gpus);
        }
        let config =
            ExtenderConfig::from_toml(&format!("[extender]\npolicy = \"{policy}\"\n")).unwrap();
        // The default scheduler's adaptive share: 50 % less 1 % per 125
        // nodes, at least 5 %.
        let cpu_percent = 50usize.saturating_sub(nodes.len() / 125).max(5);
        Product {
            extender: Extender::new(&config, cluster.index(), cluster.clone()),
            cluster,
            names,
            uuids,
            gpu_sample: Sample::new(nodes.len(), percent),
            cpu_sample: Sample::new(nodes.len(), cpu_percent),
            cpu_pods_ours: policy == "fragmentation",
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap(),
            placed: 0,
        }
    }

    fn next_name(&mut self) -> String {
        self.placed += 1;
        format!("t{:06}", self.placed)
    }

    /// A CPU-only pod is not the GPU scheduler's: the default scheduler
    /// places it, on its default profile (`NodeResourcesFit`'s
    /// LeastAllocated over CPU and memory, which spreads pods) over its
    /// adaptive sample of the nodes.
    fn default_scheduler(&mut self, c: &Cluster, t: &Task) -> Option<Placement> {
        let free = |left: u64, all: u64| (left * 100).checked_div(all).unwrap_or(0);
        let score = |i: usize| {
            let node = &c.nodes[i];
            free(node.cpu_free - t.cpu_milli, node.cpu)
                + free(node.memory_free - t.memory_mib, node.memory)
        };
        // The first of the best, as the look found them.
        let node = self
            .cpu_sample
            .take(c.nodes.len(), |i| c.nodes[i].hosts(t))
            .into_iter()
            .rev()
            .max_by_key(|&i| score(i))?;
        // Bound where the extender sees it: its CPU counts on the node,
        // and it is of the workload.
        let mut pod = pod(&self.next_name(), t);
        pod.spec.get_or_insert_default().node_name = Some(self.names[node].clone());
        self.cluster.put_pod(pod);
        Some(Placement {
            node,
            gpus: Vec::new(),
        })
    }

    /// The GPU scheduler's sample of the nodes its own filters pass. Node
    /// totals: a share needs as much free on the node as it asks, whole
    /// GPUs as many GPUs free of work (the daemon lists the devices of
    /// GPUs carrying work as withdrawn).
    fn feasible(&mut self, c: &Cluster, t: &Task) -> Vec<String> {
        let passes = |i: usize| {
            let node = &c.nodes[i];
            let totals = if t.num_gpu == 0 {
                true
            } else if t.shared() {
                node.gpus.iter().map(|&f| u64::from(f)).sum::<u64>() >= u64::from(t.gpu_milli)
            } else {
                node.free_gpus() >= t.num_gpu as usize
            };
            node.hosts(t) && totals
        };
        self.gpu_sample
            .take(c.nodes.len(), passes)
            .into_iter()
            .map(|i| self.names[i].clone())
            .collect()
    }

    pub fn place(&mut self, c: &Cluster, t: &Task) -> Option<Placement> {
        if t.num_gpu == 0 && !self.cpu_pods_ours {
            return self.default_scheduler(c, t);
        }
        let name = self.next_name();
        let feasible = self.feasible(c, t);
        if feasible.is_empty() {
            return None;
        }
        let pod = pod(&name, t);
        let key = pod_name(&pod);
        self.cluster.put_pod(pod.clone());
        let args = ExtenderArgs {
            pod: Some(pod.clone()),
            nodes: None,
            node_names: Some(feasible),
        };
        let passed = self
            .runtime
            .block_on(self.extender.filter(&args))
            .ok()
            .and_then(|r| r.node_names)
            .unwrap_or_default();
        let Some(chosen) = passed.first() else {
            self.cluster.delete_pod(&key);
            return None;
        };
        let binding = ExtenderBindingArgs {
            pod_name: name.clone(),
            pod_namespace: key.0.clone(),
            pod_uid: format!("uid-{name}"),
            node: chosen.clone(),
        };
        if let Err(e) = self.runtime.block_on(self.extender.bind(&binding)) {
            panic!("a bind after a passing filter failed: {e}");
        }
        let bound = self.cluster.pod(&key).expect("bound");
        let node = self
            .names
            .iter()
            .position(|n| n == chosen)
            .expect("a known node");
        let assignment = bound
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("doslab.io/gpu-assignment"))
            .map(|a| {
                serde_json::from_str::<BTreeMap<String, Vec<String>>>(a).expect("an assignment")
            })
            .unwrap_or_default();
        let gpus = assignment
            .values()
            .flatten()
            .map(|u| {
                self.uuids[node]
                    .iter()
                    .position(|x| x == u)
                    .expect("a GPU of the node")
            })
            .collect();
        Some(Placement { node, gpus })
    }
}
