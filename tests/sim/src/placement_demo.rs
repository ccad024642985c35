//! The placement part of the demo: a few nodes with mock GPUs of mixed
//! sizes, each running the real daemon beside its own kubelet stand-in,
//! one API-server stand-in, and the kube-scheduler stand-in. The
//! same pods are placed twice: by node totals alone, as kube-scheduler does
//! without help, where some land on a node none of whose GPUs can hold them
//! and its kubelet refuses them; then through the real extender, where
//! every pod that fits a GPU is admitted and the one no GPU can hold is
//! refused by filter. The demo checks what happened and fails otherwise.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::apiserver::{ApiServerSim, PodContainer};
use crate::demo::{DemoError, InProcess};
use crate::gpu_node::GpuNode;
use crate::kubelet::{AllocatedResource, KubeletSim};
use crate::scheduler::{ExtenderConfig, Outcome, SchedulerConfig, SchedulerSim};
use gpu_device_plugin::config::Config;
use serde::Deserialize;

/// The daemons' and the extender's config: see the file.
const PLACEMENT_TOML: &str = include_str!("../../../config/demo-placement.toml");

/// The nodes: name and GPU sizes in GiB. In name order, which is the order
/// in which a scheduler without scores tries them.
const NODES: &[(&str, &[u64])] = &[
    ("node-a", &[24, 24]),
    ("node-b", &[80]),
    ("node-c", &[40, 40, 40, 40]),
];

/// The pods, in creation order: name, GiB of GPU memory, % of a GPU's
/// compute. By node totals train-a goes to node-a (48 GiB, but no GPU over
/// 24) and too-big to node-c (160 GiB, no GPU over 40).
const PODS: &[(&str, u64, u64)] = &[
    ("train-a", 30, 40),
    ("infer", 20, 30),
    ("notebook", 16, 20),
    ("train-b", 36, 50),
    ("too-big", 90, 10),
];

/// The one pod no GPU can hold.
const TOO_BIG: &str = "too-big";

/// A container's entry in a pod's `gpu-ledger` annotation, read as an
/// operator would, from the format SPEC.md gives (the product's own types
/// stay private to it).
#[derive(Deserialize)]
struct Served {
    gpus: Vec<String>,
    #[serde(rename = "gpu-memory", default)]
    memory: Option<u64>,
    #[serde(rename = "gpu-core", default)]
    core: Option<u64>,
}

/// The per-container map in `pod`'s annotation `key`; none when it is absent.
fn per_container<T: serde::de::DeserializeOwned>(
    pod: &serde_json::Value,
    key: &str,
) -> serde_json::Result<BTreeMap<String, T>> {
    let text = pod["metadata"]["annotations"][key].as_str();
    text.map_or(Ok(BTreeMap::new()), serde_json::from_str)
}

/// How long one step (start-up, a placement run) may take.
const STEP: Duration = Duration::from_secs(10);

struct Node {
    gpus: GpuNode,
    kubelet: KubeletSim,
    daemon: InProcess,
    _dir: tempfile::TempDir,
}

/// What became of one pod: the scheduler's outcome and, when it was bound,
/// its kubelet's admission (each container's grants, or the refusal).
struct Placed {
    outcome: Outcome,
    admitted: Option<Result<BTreeMap<String, Vec<AllocatedResource>>, String>>,
}

struct Cluster {
    api: ApiServerSim,
    nodes: Vec<Node>,
    unit_mib: u64,
    files: tempfile::TempDir,
}

/// Polls `done` until it holds; fails naming `what` after [`STEP`].
async fn wait_for(what: &str, mut done: impl FnMut() -> bool) -> Result<(), DemoError> {
    let deadline = Instant::now() + STEP;
    while !done() {
        if Instant::now() > deadline {
            return Err(DemoError::Step(format!("placement: {what}")));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

impl Cluster {
    fn kubeconfig(&self) -> std::path::PathBuf {
        self.files.path().join("kubeconfig")
    }

    /// The API server, then per node its Node object, kubelet and daemon;
    /// returns once every kubelet lists its node's GPUs and every daemon
    /// published its inventory.
    async fn start() -> Result<Cluster, DemoError> {
        let files = tempfile::tempdir()?;
        let api = ApiServerSim::start().await?;
        let kubeconfig = files.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        let mut template: toml::Table = toml::from_str(PLACEMENT_TOML)
            .map_err(|e| gpu_device_plugin::config::ConfigError::Parse(e.to_string()))?;
        template.remove("extender");
        let mut nodes = Vec::new();
        let mut unit_mib = 1;
        for (n, (name, sizes)) in NODES.iter().enumerate() {
            let gpus = GpuNode::new(n, name, sizes);
            let dir = tempfile::tempdir()?;
            let config = node_config(&template, &gpus, dir.path(), &kubeconfig)?;
            unit_mib = config.memory_unit_mib;
            gpus.add_to(&api, unit_mib);
            let kubelet = KubeletSim::start(dir.path())?;
            nodes.push(Node {
                gpus,
                kubelet,
                daemon: InProcess::spawn(config),
                _dir: dir,
            });
        }
        let c = Cluster {
            api,
            nodes,
            unit_mib,
            files,
        };
        for node in &c.nodes {
            let listed = |s: &BTreeMap<_, _>| node.gpus.listed(c.unit_mib, s);
            if !node.kubelet.wait_until(STEP, listed).await {
                return Err(DemoError::Step(format!(
                    "placement: {} not listed: {:?}",
                    node.gpus.name,
                    node.kubelet.snapshot()
                )));
            }
        }
        wait_for("GPU inventories not published", || {
            c.nodes.iter().all(|n| n.gpus.inventory_published(&c.api))
        })
        .await?;
        Ok(c)
    }

    /// Creates [`PODS`] in `namespace` for the scheduler, has it place them
    /// (through `extender` if given) and each node's kubelet admit what
    /// was bound there.
    async fn place(
        &self,
        namespace: &str,
        extender: Option<ExtenderConfig>,
    ) -> Result<BTreeMap<String, Placed>, DemoError> {
        let mut config = SchedulerConfig::new(extender);
        config.initial_backoff = Duration::from_millis(100);
        for (name, gib, core) in PODS {
            let main = PodContainer {
                name: "main".into(),
                init: false,
                restartable: false,
                wants: [gib * 1024 / self.unit_mib, *core, 0],
            };
            self.api
                .add_unscheduled_pod(namespace, name, &config.name, &[main]);
        }
        let sim = SchedulerSim::start(&self.kubeconfig(), config)
            .await
            .map_err(DemoError::Step)?;
        // Every pod bound, or judged on every node.
        let key = |name: &str| format!("{namespace}/{name}");
        let decided = |o: &BTreeMap<String, Outcome>| {
            PODS.iter().all(|(name, ..)| {
                o.get(&key(name))
                    .is_some_and(|o| o.node.is_some() || o.filtered.len() == NODES.len())
            })
        };
        let waited = wait_for("pods not placed", || decided(&sim.outcomes())).await;
        let outcomes = sim.outcomes();
        sim.stop();
        waited?;
        let mut placed: BTreeMap<String, Placed> = PODS
            .iter()
            .map(|(name, ..)| {
                let outcome = outcomes[&key(name)].clone();
                let placed = Placed {
                    outcome,
                    admitted: None,
                };
                (name.to_string(), placed)
            })
            .collect();
        // Each kubelet admits what arrived for it, as the kubelet does.
        let deadline = Instant::now() + STEP;
        while placed
            .values()
            .any(|p| p.outcome.node.is_some() && p.admitted.is_none())
        {
            if Instant::now() > deadline {
                return Err(DemoError::Step("placement: bound pods not admitted".into()));
            }
            for node in &self.nodes {
                for a in node.kubelet.admit_bound(&self.api, &node.gpus.name).await {
                    if let Some(p) = placed.get_mut(&a.name).filter(|_| a.namespace == namespace) {
                        p.admitted = Some(a.result);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(placed)
    }

    async fn stop(self) -> Result<(), DemoError> {
        for node in self.nodes {
            node.daemon.stop().await?;
            node.kubelet.stop().await;
        }
        self.api.stop();
        Ok(())
    }
}

/// A node's daemon config: the template with the node's own keys.
fn node_config(
    template: &toml::Table,
    node: &GpuNode,
    dir: &std::path::Path,
    kubeconfig: &std::path::Path,
) -> Result<Config, DemoError> {
    let mut table = template.clone();
    let path = |p: &std::path::Path| toml::Value::from(p.display().to_string());
    table.insert("device_plugin_dir".into(), path(dir));
    table.insert("node_name".into(), node.name.clone().into());
    if let Some(toml::Value::Table(matcher)) = table.get_mut("matcher") {
        matcher.insert("kubeconfig".into(), path(kubeconfig));
    }
    let mock: Vec<toml::Value> = node
        .gpus
        .iter()
        .map(|(uuid, mib)| {
            let mut gpu = toml::Table::new();
            gpu.insert("uuid".into(), uuid.clone().into());
            gpu.insert("memory_mib".into(), (*mib as i64).into());
            gpu.into()
        })
        .collect();
    if let Some(toml::Value::Table(devices)) = table.get_mut("devices") {
        devices.insert("mock".into(), mock.into());
    }
    Ok(Config::from_toml(&table.to_string(), None)?)
}

/// Runs the placement part, appending its report to `out`.
pub(crate) async fn run(out: &mut String) -> Result<(), DemoError> {
    let cluster = Cluster::start().await?;
    let _ = writeln!(
        out,
        "\nPlacement: {} nodes, each with its own daemon and kubelet stand-in, one API server:",
        cluster.nodes.len()
    );
    for n in &cluster.nodes {
        let sizes: Vec<String> = n
            .gpus
            .gpus
            .iter()
            .map(|(_, mib)| format!("{} GiB", mib / 1024))
            .collect();
        let _ = writeln!(out, "  {}: {}", n.gpus.name, sizes.join(", "));
    }
    let asks: Vec<String> = PODS
        .iter()
        .map(|(name, gib, core)| format!("{name} ({gib} GiB, {core} %)"))
        .collect();
    let _ = writeln!(out, "Pods, oldest first: {}", asks.join(", "));

    let alone = cluster.place("scheduler-alone", None).await?;
    let _ = writeln!(
        out,
        "\nWithout the extender (kube-scheduler by node totals), each node's kubelet admits:"
    );
    let mut refused = 0;
    for (name, ..) in PODS {
        let p = &alone[*name];
        let node = p.outcome.node.as_deref().unwrap_or("(not bound)");
        let what = match &p.admitted {
            Some(Ok(_)) => "admitted".to_owned(),
            Some(Err(e)) => {
                refused += 1;
                format!("REFUSED at admission: {e}")
            }
            None => format!("not bound: {}", p.outcome.error.clone().unwrap_or_default()),
        };
        let _ = writeln!(out, "  {name:<9} -> {node}: {what}");
    }
    let _ = writeln!(out, "  {refused} admission failures");
    if refused == 0 {
        return Err(DemoError::Step(
            "placement: without the extender every pod was admitted; the pods no longer \
             show what node totals miss"
                .into(),
        ));
    }
    for (name, ..) in PODS {
        cluster.api.delete_pod("scheduler-alone", name);
    }

    let mut config = gpu_device_plugin::extender::ExtenderConfig::from_toml(PLACEMENT_TOML)?;
    config.kubeconfig = cluster.kubeconfig();
    let extender = gpu_device_plugin::extender::launch(&config).await?;
    wait_for("the extender did not sync", || extender.synced()).await?;
    let url = format!("http://{}", extender.addr);
    let with = cluster
        .place("with-extender", Some(ExtenderConfig::doslab(&url)))
        .await?;
    let _ = writeln!(
        out,
        "\nWith the extender ({} policy; filter, prioritize, bind), each node's kubelet admits:",
        format!("{:?}", config.policy).to_lowercase()
    );
    let report = with_extender(&cluster, &with, out);
    cluster.stop().await?;
    report
}

/// Prints the run through the extender and checks it: every pod but
/// [`TOO_BIG`] bound and admitted on the GPU the extender chose, none over
/// a GPU's capacity, and [`TOO_BIG`] refused by the extender's filter.
fn with_extender(
    cluster: &Cluster,
    placed: &BTreeMap<String, Placed>,
    out: &mut String,
) -> Result<(), DemoError> {
    let fail = |why: String| {
        Err(DemoError::Step(format!(
            "placement with the extender: {why}"
        )))
    };
    // Per GPU: MiB and % of compute granted.
    let mut used: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut refused = 0;
    for (name, ..) in PODS {
        let p = &placed[*name];
        let Some(node) = &p.outcome.node else {
            let _ = writeln!(out, "  {name:<9} not bound; refused by filter:");
            for (node, why) in &p.outcome.filtered {
                let _ = writeln!(out, "    {node}: {why}");
            }
            let by_extender = p
                .outcome
                .filtered
                .values()
                .any(|w| w.contains("no GPU has"));
            if *name != TOO_BIG || !by_extender {
                return fail(format!("{name} was not bound: {:?}", p.outcome));
            }
            continue;
        };
        let grants = match &p.admitted {
            Some(Ok(grants)) => grants,
            other => {
                refused += 1;
                let _ = writeln!(
                    out,
                    "  {name:<9} -> {node}: REFUSED at admission: {other:?}"
                );
                continue;
            }
        };
        let pod = cluster.api.pod("with-extender", name).unwrap_or_default();
        let assignment = per_container::<Vec<String>>(&pod, "doslab.io/gpu-assignment");
        let ledger = per_container::<Served>(&pod, "doslab.io/gpu-ledger");
        let (Ok(assignment), Ok(ledger)) = (assignment, ledger) else {
            return fail(format!("{name}: unreadable annotations: {pod}"));
        };
        // Every admitted container is in the ledger, and nothing else is:
        // an empty or partial ledger would check nothing below.
        if !ledger.keys().eq(grants.keys()) {
            return fail(format!(
                "{name}: ledger {:?} against admitted containers {:?}",
                ledger.keys().collect::<Vec<_>>(),
                grants.keys().collect::<Vec<_>>()
            ));
        }
        for (container, grant) in &ledger {
            let assigned = assignment.get(container).cloned().unwrap_or_default();
            let visible = crate::kubelet::merged_envs(&grants[container])
                .remove("NVIDIA_VISIBLE_DEVICES")
                .unwrap_or_default();
            if grant.gpus != assigned || visible != assigned.join(",") {
                return fail(format!(
                    "{name}/{container}: assigned {assigned:?}, ledger {:?}, visible {visible}",
                    grant.gpus
                ));
            }
            let (mib, core) = (grant.memory.unwrap_or(0), grant.core.unwrap_or(0));
            let _ = writeln!(
                out,
                "  {name:<9} -> {node} {}: {mib} MiB, {core} % of its compute",
                assigned.join(",")
            );
            for gpu in &assigned {
                let u = used.entry(gpu.clone()).or_default();
                u.0 += mib;
                u.1 += core;
            }
        }
    }
    let _ = writeln!(out, "  {refused} admission failures");
    let _ = writeln!(out, "GPU use after:");
    for node in &cluster.nodes {
        for (uuid, size) in &node.gpus.gpus {
            let (mib, core) = used.get(uuid).copied().unwrap_or_default();
            let _ = writeln!(
                out,
                "  {} {uuid}: {mib} of {size} MiB, {core} % of its compute",
                node.gpus.name
            );
            if mib > *size || core > 100 {
                return fail(format!("{uuid} is over capacity"));
            }
        }
    }
    if refused > 0 {
        return fail(format!("{refused} admission failures"));
    }
    Ok(())
}
