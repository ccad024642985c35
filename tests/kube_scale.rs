//! The extender at cluster scale on the real components (tests/kube): the
//! unmodified kube-apiserver and kube-scheduler on the shipped profile with
//! the real extender, Nodes created by the admin as the daemon publishes
//! them (inventory annotation, GPU allocatable) with no kubelets, and a
//! burst of shared-GPU pods, then as many CPU pods through the same
//! scheduler (which binds those itself).
//!
//! `bursts_bind_at_every_connection_cap`: at the extender's connection cap
//! 4,096 and 16, every pod binds (no livelock), no GPU goes past its
//! capacity, and at most 5 % of binds are refused (a bind is refused only
//! when the place its filter kept expired first). `scale` (ignored; the
//! bench): one cap, the default 1,000 nodes and 2,000 pods. Both print
//! pods/s and create->bound p50/p99 beside the scheduler alone, the
//! extender's filter and bind latency, refusals, the scheduler's
//! connection errors, the extender's RSS and each process's CPU.
//!
//! `KUBE_SCALE_NODES` and `KUBE_SCALE_PODS` set the size,
//! `KUBE_SCALE_CAP` the bench's connection cap (default 64, the shipped
//! one) and `KUBE_SCALE_EXTENDER` more `[extender]` keys for it (e.g.
//! `choose_at_filter = false`), `KUBE_SCALE_LOGS` a folder for the
//! extender's and the scheduler's logs; `cargo test --release --test kube_scale --
//! --ignored --nocapture` runs the bench.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::kube::*;

const NS: &str = "tenant";
const GPUS_PER_NODE: u64 = 8;
/// GiB per GPU; pods ask gpu-memory in GiB (`memoryUnitMiB: 1024`).
const GPU_GIB: u64 = 80;

fn env_or(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Creates `count` Nodes of [`GPUS_PER_NODE`] GPUs of [`GPU_GIB`], each
/// with the inventory annotation and the allocatable its daemon would
/// publish, and Ready (no kubelet renews it; the pods tolerate the taints
/// the node controller adds once it notices).
async fn gpu_nodes(client: &kube::Client, count: usize) {
    let nodes: Api<Node> = Api::all(client.clone());
    futures::stream::iter(0..count)
        .map(|n| gpu_node(&nodes, n))
        .buffer_unordered(CREATORS)
        .try_collect::<()>()
        .await
        .unwrap();
}

/// The requests the test keeps in flight while it creates Nodes and
/// pods, so that creating is not what limits a burst.
const CREATORS: usize = 16;

async fn gpu_node(nodes: &Api<Node>, n: usize) -> Result<(), kube::Error> {
    let name = format!("node-{n}");
    let gpus: Vec<_> = (0..GPUS_PER_NODE)
        .map(|g| json!({ "uuid": gpu_uuid(n, g as usize), "memoryMiB": GPU_GIB * 1024, "healthy": true }))
        .collect();
    let inventory = json!({
        "version": 1, "memoryUnitMiB": 1024, "coresPerGpu": 100,
        "resources": ["gpu-memory", "gpu-core", "gpu-count"], "gpus": gpus,
    });
    let node: Node = serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": { "kubernetes.io/hostname": name },
            "annotations": { "doslab.io/gpu-inventory": inventory.to_string() },
        },
    }))
    .unwrap();
    nodes.create(&PostParams::default(), &node).await?;
    let resources = json!({
        "cpu": "64", "memory": "512Gi", "pods": "250",
        "doslab.io/gpu-memory": (GPU_GIB * GPUS_PER_NODE).to_string(),
        "doslab.io/gpu-core": (100 * GPUS_PER_NODE).to_string(),
        "doslab.io/gpu-count": GPUS_PER_NODE.to_string(),
    });
    let status = json!({ "status": {
        "capacity": resources, "allocatable": resources,
        "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady" }],
    }});
    nodes
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

/// `pod` for the GPU scheduler (named here: the mutating policy may not
/// be in force yet right after the control plane starts), tolerating
/// every taint (no kubelet keeps these Nodes Ready).
fn ours(mut pod: Pod) -> Pod {
    let spec = pod.spec.get_or_insert_default();
    spec.scheduler_name = Some("doslab-gpu-scheduler".into());
    spec.tolerations = Some(vec![
        serde_json::from_value(json!({"operator": "Exists"})).unwrap(),
    ]);
    pod
}

/// What one burst measured.
struct Burst {
    pods_per_s: f64,
    p50: Duration,
    p99: Duration,
}

/// The `p` quantile (0..=100) of `sorted`.
fn quantile<T: Copy + Default>(sorted: &[T], p: usize) -> T {
    match sorted.len() {
        0 => T::default(),
        n => sorted[(n * p).div_ceil(100).max(1) - 1],
    }
}

/// Creates `pods` ([`CREATORS`] at a time) and waits until every one is
/// bound; panics with the logs if one is not within `within`.
async fn burst(
    client: &kube::Client,
    pods: Vec<Pod>,
    within: Duration,
    logs: impl Fn() -> String,
) -> Burst {
    let binds = Bindings::watch(client, NS);
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let start = Instant::now();
    let created: Vec<(String, Instant)> = futures::stream::iter(&pods)
        .map(|pod| async {
            api.create(&PostParams::default(), pod).await?;
            Ok::<_, kube::Error>((pod.metadata.name.clone().unwrap(), Instant::now()))
        })
        .buffer_unordered(CREATORS)
        .try_collect()
        .await
        .unwrap();
    let unbound = || -> Vec<&String> {
        created
            .iter()
            .filter(|(n, _)| binds.at(n).is_none())
            .map(|(n, _)| n)
            .collect()
    };
    support::poll_for(
        start + within,
        async || unbound().is_empty().then_some(()),
        || {
            let unbound = unbound();
            format!(
                "{} pods never bound: {unbound:?}\n{}",
                unbound.len(),
                logs()
            )
        },
    )
    .await;
    let mut latencies: Vec<Duration> = created
        .iter()
        .map(|(n, at)| binds.at(n).unwrap().saturating_duration_since(*at))
        .collect();
    latencies.sort();
    let last = created
        .iter()
        .filter_map(|(n, _)| binds.at(n))
        .max()
        .unwrap();
    Burst {
        pods_per_s: created.len() as f64 / (last - start).as_secs_f64(),
        p50: quantile(&latencies, 50),
        p99: quantile(&latencies, 99),
    }
}

/// GiB and percent held per GPU, keyed by (node, GPU), by the bound pods'
/// assignments; every assignment names GPUs of its own node.
async fn held_per_gpu(client: &kube::Client) -> BTreeMap<(String, String), (u64, u64)> {
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut held: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    for pod in api.list(&ListParams::default()).await.unwrap() {
        let Some(text) = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("doslab.io/gpu-assignment"))
        else {
            continue;
        };
        let node = node_of(&pod).to_owned();
        let n: usize = node.trim_start_matches("node-").parse().unwrap();
        let by_container: BTreeMap<String, Vec<String>> = serde_json::from_str(text).unwrap();
        for c in &pod.spec.as_ref().unwrap().containers {
            let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref());
            let ask = |r: &str| {
                limits
                    .and_then(|l| l.get(&format!("doslab.io/{r}")))
                    .map_or(0, |q| q.0.parse::<u64>().unwrap())
            };
            for gpu in by_container.get(&c.name).into_iter().flatten() {
                assert!(
                    (0..GPUS_PER_NODE).any(|g| gpu_uuid(n, g as usize) == *gpu),
                    "{gpu} is not on {node}"
                );
                let e = held.entry((node.clone(), gpu.clone())).or_default();
                e.0 += ask("gpu-memory");
                e.1 += ask("gpu-core");
            }
        }
    }
    held
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The fields of `/proc/<pid>/stat` after the command (which may hold
/// spaces, in brackets); empty when the process is gone.
fn stat_fields(pid: u32) -> Vec<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')').map_or(Vec::new(), |(_, rest)| {
        rest.split_whitespace().map(str::to_owned).collect()
    })
}

/// CPU seconds each of `pids` and the processes under it have used (user
/// and system), from one read of `/proc`: the control plane's supervisor
/// runs the API server and the controller manager as its children, and
/// they do most of its work.
fn cpu_s<const N: usize>(pids: [u32; N]) -> [f64; N] {
    let all: Vec<(u32, Vec<String>)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .map(|p| (p, stat_fields(p)))
        .collect();
    pids.map(|pid| {
        let mut parents = vec![pid];
        let own = all.iter().find(|(p, _)| *p == pid);
        let mut total = own.map_or(0, |(_, fields)| ticks(fields));
        while let Some(parent) = parents.pop() {
            for (child, fields) in &all {
                if fields.get(1).and_then(|f| f.parse::<u32>().ok()) == Some(parent) {
                    total += ticks(fields);
                    parents.push(*child);
                }
            }
        }
        total as f64 / clock_ticks()
    })
}

/// The CPU seconds of this process alone (the bench: creating pods and
/// watching them bind), its children not counted.
fn own_cpu_s() -> f64 {
    ticks(&stat_fields(std::process::id())) as f64 / clock_ticks()
}

/// User and system clock ticks of a `/proc/<pid>/stat`.
fn ticks(fields: &[String]) -> u64 {
    [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
        .sum()
}

fn clock_ticks() -> f64 {
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) as f64 }
}

/// The scheduler's transport errors talking to the extender at `url`: a
/// connection closed at the cap, reset, or refused.
fn connection_errors<'a>(scheduler_log: &'a str, url: &str) -> Vec<&'a str> {
    scheduler_log
        .lines()
        .filter(|l| l.contains(url))
        .filter(|l| {
            l.contains("EOF") || l.contains("connection reset") || l.contains("connection refused")
        })
        .collect()
}

/// The `verb` requests the extender at `url` served (`ok`) and refused (by
/// reason), from its `/metrics` (asked again while kube-scheduler's
/// connections fill its cap).
fn requests(url: &str, verb: &str) -> BTreeMap<String, u64> {
    let addr = url.strip_prefix("http://").unwrap_or(url);
    let mut body = String::new();
    let answered = support::poll_sync(Instant::now() + support::WAIT, || {
        match support::try_http_get(addr, "/metrics") {
            Ok((200, text)) => body = text,
            _ => return false,
        }
        true
    });
    assert!(answered, "the extender's /metrics did not answer");
    let series = format!("gpu_device_plugin_extender_requests_total{{verb=\"{verb}\",outcome=\"");
    body.lines()
        .filter_map(|l| l.strip_prefix(&series)?.split_once("\"} "))
        .map(|(outcome, n)| (outcome.to_owned(), n.trim().parse().unwrap()))
        .collect()
}

/// The pod writes the API server answered with success, by (verb,
/// subresource), from its `/metrics`: creates and Bindings (`POST`),
/// patches and updates.
async fn pod_writes(client: &kube::Client) -> BTreeMap<(String, String), u64> {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.unwrap();
    let mut writes = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, n)) = rest.split_once("} ") else {
            continue;
        };
        // A label's value by its whole name (`resource` is not the tail
        // of `subresource`).
        let labels = format!(",{labels}");
        let label = |k: &str| {
            let start = labels.find(&format!(",{k}=\""))? + k.len() + 3;
            labels[start..].split('"').next()
        };
        let write = matches!(label("verb"), Some("POST" | "PATCH" | "PUT"));
        let ok = label("code").is_some_and(|c| c.starts_with('2'));
        if label("resource") != Some("pods") || !write || !ok {
            continue;
        }
        let key = (
            label("verb").unwrap().to_owned(),
            label("subresource").unwrap_or("").to_owned(),
        );
        *writes.entry(key).or_default() += n.trim().parse::<f64>().unwrap() as u64;
    }
    writes
}

/// The API server's writes to the burst's `count` GPU pods since `before`
/// (their creates left out), once it has counted a Binding for each:
/// asserts one write per pod, the Binding, and returns them.
async fn writes_per_bind(
    client: &kube::Client,
    before: &BTreeMap<(String, String), u64>,
    count: usize,
) -> BTreeMap<(String, String), u64> {
    let binding = ("POST".to_owned(), "binding".to_owned());
    let since = support::poll_for(
        Instant::now() + support::WAIT,
        async || {
            let since: BTreeMap<_, _> = pod_writes(client)
                .await
                .into_iter()
                .map(|(k, n)| (k.clone(), n - before.get(&k).copied().unwrap_or(0)))
                // A pod's status (kube-scheduler's condition on a pod it
                // could not place yet, the node controller's on a node
                // gone quiet) is not the bind's write, nor is its create.
                .filter(|((verb, sub), n)| {
                    *n > 0 && sub != "status" && !(verb == "POST" && sub.is_empty())
                })
                .collect();
            let counted = since.get(&binding).copied().unwrap_or(0) as usize;
            (counted >= count).then_some(since)
        },
        || "the API server never counted a Binding for every GPU pod".into(),
    )
    .await;
    let want = BTreeMap::from([(binding, count as u64)]);
    assert_eq!(
        since, want,
        "the API server's successful pod writes during the burst"
    );
    since
}

/// The values of `key=<number>` on the log lines holding `message`, sorted.
fn logged(log: &str, message: &str, key: &str) -> Vec<u64> {
    let pattern = format!("{key}=");
    let mut values: Vec<u64> = log
        .lines()
        .filter(|l| l.contains(message))
        .filter_map(|l| {
            let rest = &l[l.find(&pattern)? + pattern.len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect();
    values.sort();
    values
}

/// A control plane with `nodes` GPU Nodes, the shipped scheduler with the
/// extender on `extender_toml`, a burst of `count` shared-GPU pods and
/// then as many CPU pods; asserts every pod binds within `within` and no
/// GPU goes past its capacity, prints the figures and returns the binds
/// refused.
async fn run(nodes: usize, count: usize, extender_toml: &str, within: Duration) -> u64 {
    let cp = ControlPlane::start();
    let client = cp.admin_client().await;
    let made = Instant::now();
    gpu_nodes(&client, nodes).await;
    let made = made.elapsed();
    namespace(&cp, NS);
    let sched = Scheduler::start_with(&cp, extender_toml);
    let logs = || {
        format!(
            "--- extender\n{}\n--- kube-scheduler\n{}",
            sched.extender.log_text(),
            sched.proc.log_text()
        )
    };
    let mut rng = support::Lcg(count as u64);
    let pods = (0..count)
        .map(|i| {
            let mem = [1, 2, 4, 6][rng.below(4) as usize];
            let core = [0, 10, 20][rng.below(3) as usize];
            ours(gpu_pod(
                NS,
                &format!("gpu-{i}"),
                &[("main", [mem, core, 0])],
            ))
        })
        .collect();
    let pids = [cp.pid(), sched.proc.child.id(), sched.extender.child.id()];
    let cpu_before = cpu_s(pids);
    let own_before = own_cpu_s();
    let writes_before = pod_writes(&client).await;
    let gpu = burst(&client, pods, within, logs).await;
    let cpu_after = cpu_s(pids);
    let cpu = [0, 1, 2].map(|i| cpu_after[i] - cpu_before[i]);
    let own = own_cpu_s() - own_before;
    let writes = writes_per_bind(&client, &writes_before, count).await;
    let rss = rss_kib(sched.extender.child.id());

    let extender_log = sched.extender.log_text();
    let mut bind_refusals = requests(&sched.url, "bind");
    let bound = bind_refusals.remove("ok");
    assert_eq!(bound, Some(count as u64), "binds the extender counted ok");
    let mut filter_refusals = requests(&sched.url, "filter");
    filter_refusals.remove("ok");
    let refused: u64 = bind_refusals.values().sum();
    let binds = logged(&extender_log, "bound", "took_ms");
    let filters = logged(&extender_log, "filtered", "took_us");
    let waits = logged(&extender_log, "filtered", "waited_us");
    let scores = logged(&extender_log, "prioritized", "took_us");
    let scheduler_log = sched.proc.log_text();
    let conn_errors = connection_errors(&scheduler_log, &sched.url);
    for line in conn_errors.iter().take(3) {
        eprintln!("  scheduler: {line}");
    }
    let conn_errors = conn_errors.len();
    let held = held_per_gpu(&client).await;
    let over: Vec<_> = held
        .iter()
        .filter(|(_, (mem, core))| *mem > GPU_GIB || *core > 100)
        .collect();
    assert!(over.is_empty(), "GPUs over capacity: {over:?}");
    // How tightly the policy packed the burst: the nodes it opened against
    // the fewest that hold its GiB and percents.
    let nodes_used = held
        .keys()
        .map(|(node, _)| node)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let (gib, core): (u64, u64) = held
        .values()
        .fold((0, 0), |(g, c), (mem, cores)| (g + mem, c + cores));
    let fewest = gib
        .div_ceil(GPU_GIB * GPUS_PER_NODE)
        .max(core.div_ceil(100 * GPUS_PER_NODE));
    let steps: Vec<String> = ["queued_us", "plan_us", "turn_us", "binding_us"]
        .iter()
        .map(|key| {
            let v = logged(&extender_log, "bind steps", key);
            format!(
                "{} {} ms",
                key.trim_end_matches("_us"),
                quantile(&v, 50) / 1000
            )
        })
        .collect();

    let cpu_pods = (0..count)
        .map(|i| ours(gpu_pod(NS, &format!("cpu-{i}"), &[("main", [0, 0, 0])])))
        .collect();
    let cpu_before = cpu_s(pids);
    let own_before = own_cpu_s();
    let alone = burst(&client, cpu_pods, within, logs).await;
    let cpu_after = cpu_s(pids);
    let cpu_alone = [0, 1].map(|i| cpu_after[i] - cpu_before[i]);
    let own_alone = own_cpu_s() - own_before;
    if let Ok(dir) = std::env::var("KUBE_SCALE_LOGS") {
        let dir = std::path::Path::new(&dir);
        std::fs::write(dir.join("extender.log"), sched.extender.log_text()).unwrap();
        std::fs::write(dir.join("kube-scheduler.log"), sched.proc.log_text()).unwrap();
    }
    let config = extender_toml.trim().replace('\n', " ");
    eprintln!(
        "{nodes} nodes x {GPUS_PER_NODE} GPUs (created in {made:.0?}), extender [{config}]:\n\
         \x20 {count} GPU pods through the extender: {:.1} pods/s, create->bound p50 {:.2?} \
         p99 {:.2?}\n\
         \x20 the same scheduler alone, {count} CPU pods: {:.1} pods/s, p50 {:.2?} p99 {:.2?} \
         (ratio {:.2})\n\
         \x20 extender: filter p50 {} us p99 {} us (of which waiting for a bind's place p99 \
         {} us), prioritize p50 {} us p99 {} us, bind p50 {} ms p99 {} ms (p50 of its steps: \
         {}); RSS {} MiB\n\
         \x20 GPU pods on {nodes_used} nodes (the fewest that hold them: {fewest})\n\
         \x20 binds refused {refused} {bind_refusals:?}, filters refused {filter_refusals:?}, \
         scheduler connection errors {conn_errors}; API writes to the GPU pods {writes:?}\n\
         \x20 CPU during the GPU burst: control plane {:.1} s, kube-scheduler {:.1} s, \
         extender {:.1} s ({:.2} ms per pod), the bench {own:.1} s; during the CPU burst: \
         control plane {:.1} s, kube-scheduler {:.1} s, the bench {own_alone:.1} s",
        gpu.pods_per_s,
        gpu.p50,
        gpu.p99,
        alone.pods_per_s,
        alone.p50,
        alone.p99,
        gpu.pods_per_s / alone.pods_per_s,
        quantile(&filters, 50),
        quantile(&filters, 99),
        quantile(&waits, 99),
        quantile(&scores, 50),
        quantile(&scores, 99),
        quantile(&binds, 50),
        quantile(&binds, 99),
        steps.join(", "),
        rss / 1024,
        cpu[0],
        cpu[1],
        cpu[2],
        cpu[2] * 1000.0 / count as f64,
        cpu_alone[0],
        cpu_alone[1],
    );
    refused
}

/// A burst at each connection cap (the default bound on binds admitted
/// follows it: the connections less a quarter, at most 256): every pod binds,
/// no GPU goes past its capacity, and at most 5 % of binds are refused.
#[tokio::test(flavor = "multi_thread")]
async fn bursts_bind_at_every_connection_cap() {
    let nodes = env_or("KUBE_SCALE_NODES", 50);
    let count = env_or("KUBE_SCALE_PODS", 200);
    for cap in [4096, 16] {
        let toml = format!("[extender.http]\nmax_connections = {cap}\n");
        let refused = run(nodes, count, &toml, Duration::from_secs(120)).await;
        assert!(
            refused * 20 <= count as u64,
            "{refused} binds refused of {count} at cap {cap}"
        );
    }
}

/// The bench: a control plane of each size in `KUBE_SCALE_NODES` (default
/// `1000,5000`) in turn, a burst of `KUBE_SCALE_PODS` (default 2,000), the
/// extender at connection cap `KUBE_SCALE_CAP` (default 64, the shipped
/// one).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "the scale bench: minutes of the whole machine"]
async fn scale() {
    let sizes = std::env::var("KUBE_SCALE_NODES").unwrap_or_else(|_| "1000,5000".into());
    let count = env_or("KUBE_SCALE_PODS", 2000);
    let cap = env_or("KUBE_SCALE_CAP", 64);
    let extra = std::env::var("KUBE_SCALE_EXTENDER").unwrap_or_default();
    let toml = format!("{extra}\n[extender.http]\nmax_connections = {cap}\n");
    for nodes in sizes.split(',') {
        let nodes = nodes
            .trim()
            .parse()
            .expect("KUBE_SCALE_NODES: node counts, comma-separated");
        run(nodes, count, &toml, Duration::from_secs(600)).await;
    }
}
