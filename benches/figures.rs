//! `cargo bench`: prints the figures benches/README.md quotes. Nothing here
//! asserts a time; the machines are noisy, the numbers are for reading.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpu_device_plugin::api::{
    ContainerPreferredAllocationRequest, ContainerPreferredAllocationResponse,
    PreferredAllocationRequest,
};
use gpu_device_plugin::config::Config;
use gpu_device_plugin::node::plugin::codec::PreferredRequest;
use gpu_device_plugin::node::plugin::preferred;
use gpu_device_plugin::rules::device::{Gpu, KUBELET_MAX_MESSAGE_BYTES, Plan, Resource};
use gpu_sim::figures::report;
use gpu_sim::kubelet::{KubeletSim, ResourceView};
use prost::Message;

const BIN: &str = env!("CARGO_BIN_EXE_gpu-device-plugin");
const GIB80: u64 = 81_920;

fn gpus(n: u32) -> Vec<Gpu> {
    (0..n)
        .map(|i| Gpu {
            uuid: format!("GPU-{i:08x}-5b0c-4c8d-a1e6-2f4b8d9c0e11"),
            memory_mib: GIB80,
            index: i,
            numa_node: Some(i / 4),
        })
        .collect()
}

fn wire_figures() {
    let config = Config {
        pod_matching: false,
        ..Config::default()
    };
    let plan = Plan::new(&config, gpus(2)).unwrap();
    let m = plan.model(Resource::GpuMemory).unwrap();
    let healthy = m.wire_len(|_| true);
    let worst = m.worst_case_wire_len();
    println!(
        "ListAndWatch, 2 x 80 GB at 1 MiB: {} devices, {} bytes healthy ({:.2} B/device), {} bytes all unhealthy ({:.2} B/device), limit {}",
        m.device_count(),
        healthy,
        healthy as f64 / m.device_count() as f64,
        worst,
        worst as f64 / m.device_count() as f64,
        KUBELET_MAX_MESSAGE_BYTES
    );
    let most = (1..=16)
        .take_while(|n| Plan::new(&config, gpus(*n)).is_ok())
        .last()
        .unwrap_or(0);
    let per = worst as f64 / m.device_count() as f64;
    println!(
        "largest node at 1 MiB units: {most} x 80 GB GPUs; about {:.0} GiB of GPU memory in all",
        KUBELET_MAX_MESSAGE_BYTES as f64 / per / 1024.0
    );
    let err = Plan::new(&config, gpus(8)).unwrap_err();
    println!("8 x 80 GB at 1 MiB: {err}");

    // The plugin's own work per call, without transport: protobuf decode
    // of the request, ID decode, the GPU choice, and the response's encoding.
    let mut ids: Vec<String> = Vec::new();
    m.for_each_id(|_, id| ids.push(id.to_owned()));
    ids.sort(); // the kubelet lists them in string order
    ids.truncate(160_000);
    let wire = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: ids,
            must_include_device_i_ds: vec![],
            allocation_size: 20_000,
        }],
    }
    .encode_to_vec();
    let mut handler = Vec::new();
    let mut server = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        let request = PreferredRequest::decode(wire.as_slice()).unwrap();
        let decoded = t.elapsed();
        let available = m
            .decode_all(request.containers.checked().unwrap()[0].available.iter())
            .unwrap();
        let chosen = preferred::shared(m, &available, &[], 20_000, None);
        let reply = ContainerPreferredAllocationResponse {
            device_i_ds: chosen.iter().map(|d| m.id(*d)).collect(),
        };
        let bytes = reply.encode_to_vec();
        server.push(t.elapsed());
        handler.push(t.elapsed() - decoded);
        assert!(bytes.len() > 20_000);
    }
    report(
        "GetPreferredAllocation handler alone (decode 160,000 IDs, pack, 20,000 IDs out)",
        handler,
    );
    report(
        "GetPreferredAllocation server side in all (protobuf decode + handler + encode)",
        server,
    );
}

fn mock_toml(dir: &Path, gpus: u32) -> String {
    let mut t = format!(
        "device_plugin_dir = {:?}\npod_matching = false\nhttp_listen = \"\"\n[devices]\nbackend = \"mock\"\n",
        dir.display().to_string()
    );
    for i in 0..gpus {
        t.push_str(&format!(
            "[[devices.mock]]\nuuid = \"GPU-{i:08x}-5b0c-4c8d-a1e6-2f4b8d9c0e11\"\nmemory_mib = {GIB80}\n"
        ));
    }
    t
}

fn spawn(dir: &Path, toml: &str) -> Child {
    let config = dir.join("config.toml");
    std::fs::write(&config, toml).unwrap();
    Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Pod matching on 4 mock GPUs of node `bench-node`, through the
/// kubeconfig in `dir`.
fn matching_toml(dir: &Path) -> String {
    matching_toml_of(dir, 4)
}

/// Pod matching on `gpus` mock GPUs of node `bench-node`.
fn matching_toml_of(dir: &Path, gpus: u32) -> String {
    mock_toml(dir, gpus).replace(
        "pod_matching = false\n",
        "pod_matching = true\nnode_name = \"bench-node\"\nmemory_unit_mib = 256\n",
    ) + &format!(
        "[matcher]\nkubeconfig = {:?}\n",
        dir.join("kubeconfig").display().to_string()
    )
}

/// The daemon with pod matching on 4 mock GPUs of node `bench-node`
/// against `api`, and a kubelet stand-in it has registered with.
async fn matching_daemon(
    dir: &Path,
    api: &gpu_sim::apiserver::ApiServerSim,
    wait: Duration,
) -> (Child, KubeletSim) {
    api.write_kubeconfig(&dir.join("kubeconfig")).unwrap();
    let child = spawn(dir, &matching_toml(dir));
    let kubelet = KubeletSim::start(dir).unwrap();
    assert!(kubelet.wait_until(wait, listed(&names())).await);
    (child, kubelet)
}

fn stop(mut child: Child) {
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
}

fn listed(
    names: &[String],
) -> impl Fn(&std::collections::BTreeMap<String, ResourceView>) -> bool + '_ {
    |s| {
        names
            .iter()
            .all(|n| s.get(n).is_some_and(|v| v.stream_open && v.healthy > 0))
    }
}

fn names() -> Vec<String> {
    ["gpu-memory", "gpu-core", "gpu-count"]
        .iter()
        .map(|r| format!("doslab.io/{r}"))
        .collect()
}

/// Resident memory of a process in KiB: all of it, and its anonymous part
/// (heap and stacks; the rest is the binary's clean, shared file pages).
fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("RssAnon:"))
}

async fn startup_and_memory() {
    let names = names();
    let mut registered = Vec::new();
    let mut samples = Vec::new();
    let mut rss = Vec::new();
    let all_registered = |s: &std::collections::BTreeMap<String, ResourceView>| {
        names
            .iter()
            .all(|n| s.get(n).is_some_and(|v| v.registrations > 0))
    };
    for _ in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = KubeletSim::start(dir.path()).unwrap();
        let t = Instant::now();
        let child = spawn(dir.path(), &mock_toml(dir.path(), 2));
        let wait = Duration::from_secs(20);
        assert!(kubelet.wait_until(wait, all_registered).await);
        registered.push(t.elapsed());
        assert!(kubelet.wait_until(wait, listed(&names)).await);
        samples.push(t.elapsed());
        tokio::time::sleep(Duration::from_millis(500)).await;
        rss.push(rss_kib(child.id()));
        stop(child);
        kubelet.stop().await;
    }
    report(
        "process start to all three resources registered (2 x 80 GB mock)",
        registered,
    );
    report(
        "process start to all three lists received by the kubelet",
        samples,
    );
    rss.sort();
    let (median, max) = (rss[rss.len() / 2], rss[rss.len() - 1]);
    println!(
        "idle daemon resident memory (2 x 80 GB mock, 163,840 gpu-memory devices): median {:.1} MiB (anonymous {:.1}), max {:.1} MiB",
        median.0 as f64 / 1024.0,
        median.1 as f64 / 1024.0,
        max.0 as f64 / 1024.0
    );
}

async fn preferred_allocation_latency() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let child = spawn(dir.path(), &mock_toml(dir.path(), 2));
    let names = names();
    assert!(
        kubelet
            .wait_until(Duration::from_secs(20), listed(&names))
            .await
    );
    let mut free = kubelet.free_devices(&names[0]);
    free.truncate(160_000);
    let mut client = kubelet.client(&names[0]).unwrap();
    let request = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: free,
            must_include_device_i_ds: vec![],
            allocation_size: 20_000,
        }],
    };
    let mut samples = Vec::new();
    let mut client_side = Vec::new();
    for i in 0..220 {
        let t = Instant::now();
        let reply = client
            .get_preferred_allocation(request.clone())
            .await
            .unwrap()
            .into_inner();
        let took = t.elapsed();
        assert_eq!(reply.container_responses[0].device_i_ds.len(), 20_000);
        // The client's own share, paid by the kubelet and not the plugin:
        // encoding the 160,000 IDs, decoding the 20,000 of the reply.
        let reply_bytes = reply.encode_to_vec();
        let t = Instant::now();
        let sent = request.encode_to_vec();
        let got = gpu_device_plugin::api::PreferredAllocationResponse::decode(&reply_bytes[..]);
        let own = t.elapsed();
        assert!(got.is_ok() && !sent.is_empty());
        if i >= 20 {
            samples.push(took);
            client_side.push(own);
        }
    }
    report(
        "GetPreferredAllocation, 160,000 available IDs, real socket",
        samples,
    );
    report(
        "… of which the client's own encode (160,000 IDs) and decode (20,000 IDs)",
        client_side,
    );
    stop(child);
    kubelet.stop().await;
}

/// Kubelet restarts (files wiped, new kubelet.sock) until every resource
/// registered again, and SIGHUP until a changed resource registered again.
async fn lifecycle_latency() {
    let names = names();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = KubeletSim::start(dir.path()).unwrap();
    let toml = mock_toml(dir.path(), 2);
    let child = spawn(dir.path(), &toml);
    let wait = Duration::from_secs(20);
    assert!(kubelet.wait_until(wait, listed(&names)).await);
    let times = |n: u32| {
        let names = names.clone();
        move |s: &std::collections::BTreeMap<String, ResourceView>| {
            names.iter().all(|x| {
                s.get(x)
                    .is_some_and(|v| v.registrations == n && v.stream_open)
            })
        }
    };
    let mut samples = Vec::new();
    for i in 2..=101 {
        let t = Instant::now();
        kubelet.restart().await.unwrap();
        assert!(kubelet.wait_until(wait, times(i)).await);
        samples.push(t.elapsed());
    }
    report(
        "kubelet restart to all three resources registered again",
        samples,
    );

    let memory = names[0].clone();
    let mut samples = Vec::new();
    for i in 0..20u32 {
        let unit = if i % 2 == 0 { 2 } else { 1 };
        let text = toml.replace(
            "pod_matching = false",
            &format!("pod_matching = false\nmemory_unit_mib = {unit}"),
        );
        std::fs::write(dir.path().join("config.toml"), text).unwrap();
        let before = kubelet.snapshot()[&memory].registrations;
        let t = Instant::now();
        unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
        let again = |s: &std::collections::BTreeMap<String, ResourceView>| {
            s.get(&memory)
                .is_some_and(|v| v.registrations == before + 1 && v.stream_open)
        };
        assert!(kubelet.wait_until(wait, again).await);
        samples.push(t.elapsed());
    }
    report(
        "SIGHUP changing memory_unit_mib to gpu-memory registered again",
        samples,
    );
    stop(child);
    kubelet.stop().await;
}

/// Pod matching: API requests per Allocate and Allocate latency over the
/// real socket with a warm pod cache, beside the seed's approach (a LIST of
/// the node's pending pods on every Allocate) against the same API server.
async fn pod_matching_figures() {
    use gpu_device_plugin::rules::matching::pods::PodView;
    use gpu_device_plugin::rules::matching::{Ask, decide, record};
    use gpu_device_plugin::rules::usage::{Inventory, Keys, Ledger};
    use gpu_sim::apiserver::{ApiServerSim, PodContainer};
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{ListParams, Patch, PatchParams};

    const PODS: usize = 200;
    const IDLE: usize = 100;
    let dir = tempfile::tempdir().unwrap();
    let api = ApiServerSim::start().await.unwrap();
    let (child, kubelet) = matching_daemon(dir.path(), &api, Duration::from_secs(20)).await;
    // A busy node: pods without GPUs that the cache holds too.
    for i in 0..IDLE {
        api.add_pod("default", &format!("web-{i}"), "bench-node", &[], &[]);
        api.set_phase("default", &format!("web-{i}"), "Running");
    }
    let wants = |i: usize| [1 + (i % 4) as u64, 1 + (i % 2) as u64, 0];
    for i in 0..PODS {
        let c = PodContainer {
            name: "app".into(),
            init: false,
            restartable: false,
            wants: wants(i),
        };
        api.add_pod("default", &format!("gpu-{i}"), "bench-node", &[c], &[]);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = api.requests();
    let mut took = Vec::new();
    for i in 0..PODS {
        let [m, c, _] = wants(i);
        let asks = [
            ("doslab.io/gpu-memory", m as usize),
            ("doslab.io/gpu-core", c as usize),
        ];
        let grants = kubelet.admit(&asks).await.unwrap();
        took.extend(grants.iter().map(|g| g.allocate_took));
        api.set_phase("default", &format!("gpu-{i}"), "Running");
    }
    let after = api.requests();
    let delta =
        |verb: &str| after.get(verb).copied().unwrap_or(0) - before.get(verb).copied().unwrap_or(0);
    let allocates = took.len() as f64;
    println!(
        "pod matching, API requests per Allocate ({} Allocates, {} pods on the node): \
         LIST {:.2}, GET {:.2}, PATCH {:.2}",
        took.len(),
        PODS + IDLE,
        delta("list") as f64 / allocates,
        delta("get") as f64 / allocates,
        delta("patch") as f64 / allocates,
    );
    report("Allocate with pod matching, warm cache, real socket", took);
    let (rss, anon) = rss_kib(child.id());
    println!(
        "daemon resident memory with pod matching, {} pods cached: {:.1} MiB (anonymous {:.1})",
        PODS + IDLE,
        rss as f64 / 1024.0,
        anon as f64 / 1024.0
    );
    stop(child);

    // The seed's way, in this process against the same API server: LIST
    // the node's pending pods, match, PATCH, on every Allocate.
    let client = {
        let file = kube::config::Kubeconfig::read_from(dir.path().join("kubeconfig")).unwrap();
        let options = kube::config::KubeConfigOptions::default();
        let config = kube::Config::from_custom_kubeconfig(file, &options)
            .await
            .unwrap();
        kube::Client::try_from(config).unwrap()
    };
    let all: kube::Api<Pod> = kube::Api::all(client.clone());
    let pods: kube::Api<Pod> = kube::Api::namespaced(client, "default");
    for i in 0..PODS {
        let c = PodContainer {
            name: "app".into(),
            init: false,
            restartable: false,
            wants: wants(i),
        };
        api.add_pod("default", &format!("seed-{i}"), "bench-node", &[c], &[]);
    }
    let config = Config::from_toml(&matching_toml(dir.path()), None).unwrap();
    let node = Inventory::new(&gpus(4), &config.offer());
    let keys = Keys::new("doslab.io");
    let selector = ListParams::default().fields("spec.nodeName=bench-node,status.phase=Pending");
    let mut took = Vec::new();
    for i in 0..PODS {
        let started = Instant::now();
        let list = all.list(&selector).await.unwrap();
        let views: Vec<PodView> = list
            .items
            .iter()
            .map(|p| PodView::from_pod(&keys, p).0)
            .collect();
        let ask = Ask {
            resource: Resource::GpuMemory,
            devices: wants(i)[0],
            digest: None,
            id_gpus: vec![i % 4],
        };
        let d = decide(&node, &views, &ask).unwrap();
        let mut ledger = Ledger::default();
        record(&mut ledger, &node, &ask, &d);
        let patch = serde_json::json!({"metadata": {"annotations": {keys.ledger.as_str(): ledger.to_json()}}});
        pods.patch(&d.pod.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        took.push(started.elapsed());
        api.set_phase("default", &d.pod.name, "Running");
    }
    report(
        "seed's approach (LIST pending pods + match + PATCH per Allocate, no gRPC)",
        took,
    );
    api.stop();
}

/// What reading each share's usage costs (issue 32's targets: Allocate
/// p99 within noise, resident memory +10 MiB at most): the daemon with
/// pod matching on 8 GPUs × 16 shares, each share's process listed by the
/// (mock) driver and its cgroup in a fake /proc, usage polled every 500 ms
/// (10 times the default's rate); against the same with usage off, in
/// the same run, alternately.
async fn usage_figures() {
    use gpu_sim::apiserver::{ApiServerSim, PodContainer};

    const GPUS: u32 = 8;
    const SHARES: usize = 16 * GPUS as usize;
    for round in 0..2 {
        for on in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let (procs, proc_root) = (dir.path().join("procs"), dir.path().join("proc"));
            std::fs::create_dir_all(&procs).unwrap();
            let api = ApiServerSim::start().await.unwrap();
            api.write_kubeconfig(&dir.path().join("kubeconfig"))
                .unwrap();
            let poll = if on { 500 } else { 0 };
            // The series it exports, read at the end: the work was done.
            let listen = "127.0.0.1:19446";
            let toml = matching_toml_of(dir.path(), GPUS)
                .replace("http_listen = \"\"", &format!("http_listen = \"{listen}\""))
                + &format!(
                    "[usage]\npoll_ms = {poll}\nmock_dir = {:?}\nproc_root = {:?}\n",
                    procs.display().to_string(),
                    proc_root.display().to_string()
                );
            let child = spawn(dir.path(), &toml);
            let kubelet = KubeletSim::start(dir.path()).unwrap();
            assert!(
                kubelet
                    .wait_until(Duration::from_secs(20), listed(&names()))
                    .await
            );
            let mut took = Vec::new();
            let mut lists: std::collections::BTreeMap<String, String> = Default::default();
            for i in 0..SHARES {
                let name = format!("share-{i}");
                let app = PodContainer {
                    name: "app".into(),
                    init: false,
                    restartable: false,
                    // 256 MiB units: 4 GiB and 6 % each, 16 to a GPU.
                    wants: [16, 6, 0],
                };
                api.add_pod("default", &name, "bench-node", &[app], &[]);
                let asks = [("doslab.io/gpu-memory", 16), ("doslab.io/gpu-core", 6)];
                let grants = kubelet.admit(&asks).await.unwrap();
                took.extend(grants.iter().map(|g| g.allocate_took));
                let id = format!("{:064x}", i + 1);
                api.set_running("default", &name, &[("app", &id)]);
                let pod = api.pod("default", &name).unwrap();
                let uid = pod["metadata"]["uid"].as_str().unwrap().replace('-', "_");
                let gpu = grants[0].response.envs["NVIDIA_VISIBLE_DEVICES"].clone();
                let pid = 10_000 + i;
                std::fs::create_dir_all(proc_root.join(pid.to_string())).unwrap();
                let cgroup = format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/\
                     cri-containerd-{id}.scope\n"
                );
                std::fs::write(proc_root.join(format!("{pid}/cgroup")), cgroup).unwrap();
                let list = lists.entry(gpu.clone()).or_default();
                list.push_str(&format!("{pid} {} {}\n", 3u64 << 30, i % 7));
                std::fs::write(procs.join(format!("{gpu}.procs")), list.as_str()).unwrap();
            }
            // Several polls over every share's process.
            tokio::time::sleep(Duration::from_secs(3)).await;
            let what = if on {
                "usage every 500 ms"
            } else {
                "usage off"
            };
            report(
                &format!(
                    "Allocate with pod matching, {SHARES} shares on {GPUS} GPUs, {what} (round {round})"
                ),
                took,
            );
            let (rss, anon) = rss_kib(child.id());
            let series = scrape(listen)
                .lines()
                .filter(|l| l.starts_with("gpu_device_plugin_container_sm_utilization_ratio{"))
                .count();
            println!(
                "daemon resident memory, {SHARES} shares on {GPUS} GPUs, {what}: {:.1} MiB (anonymous {:.1}); \
                 {series} shares' SM series",
                rss as f64 / 1024.0,
                anon as f64 / 1024.0
            );
            stop(child);
            kubelet.stop().await;
            api.stop();
        }
    }
}

/// The body of `GET /metrics` at `addr`.
fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    write!(
        c,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    c.read_to_string(&mut text).unwrap();
    text
}

/// Allocate latency and resident memory of the daemon with pod matching
/// on a node that ran 0, 1,000 and 5,000 pods now finished (completed Job
/// pods): the cache drops finished pods, so both stay flat. Each count is
/// run twice: finished before the daemon starts (its first LIST carries
/// them all, a peak the allocator keeps), and finishing while it runs (the
/// steady state of a node running Jobs).
async fn finished_pods_figures() {
    use gpu_sim::apiserver::{ApiServerSim, PodContainer};

    const GPU_PODS: usize = 50;
    let app = |wants| PodContainer {
        name: "app".into(),
        init: false,
        restartable: false,
        wants,
    };
    let finish = |api: &ApiServerSim, i: usize| {
        let phase = if i.is_multiple_of(10) {
            "Failed"
        } else {
            "Succeeded"
        };
        api.set_phase("jobs", &format!("job-{i}"), phase);
    };
    for (finished, before) in [
        (0, true),
        (1000, true),
        (5000, true),
        (1000, false),
        (5000, false),
    ] {
        let when = if before {
            "before start"
        } else {
            "while running"
        };
        let dir = tempfile::tempdir().unwrap();
        let api = ApiServerSim::start().await.unwrap();
        let job = |i: usize| {
            let name = format!("job-{i}");
            api.add_pod("jobs", &name, "bench-node", &[app([0, 0, 0])], &[]);
        };
        if before {
            for i in 0..finished {
                job(i);
                finish(&api, i);
            }
        }
        let (child, kubelet) = matching_daemon(dir.path(), &api, Duration::from_secs(60)).await;
        if !before {
            // Jobs come and go, 100 at a time, as on a node running them.
            for batch in (0..finished).collect::<Vec<_>>().chunks(100) {
                batch.iter().for_each(|&i| job(i));
                tokio::time::sleep(Duration::from_millis(20)).await;
                batch.iter().for_each(|&i| finish(&api, i));
            }
        }
        for i in 0..GPU_PODS {
            let name = format!("gpu-{i}");
            api.add_pod("default", &name, "bench-node", &[app([1, 1, 0])], &[]);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut took = Vec::new();
        for i in 0..GPU_PODS {
            let asks = [("doslab.io/gpu-memory", 1), ("doslab.io/gpu-core", 1)];
            let grants = kubelet.admit(&asks).await.unwrap();
            took.extend(grants.iter().map(|g| g.allocate_took));
            api.set_phase("default", &format!("gpu-{i}"), "Running");
        }
        report(
            &format!("Allocate with pod matching, {finished} pods finished {when}"),
            took,
        );
        let (rss, anon) = rss_kib(child.id());
        println!(
            "daemon resident memory, {finished} pods finished {when}: {:.1} MiB (anonymous {:.1})",
            rss as f64 / 1024.0,
            anon as f64 / 1024.0
        );
        stop(child);
        kubelet.stop().await;
        api.stop();
    }
}

fn main() {
    // `cargo bench --bench figures -- NAME` runs the sections whose name
    // contains NAME; `cargo bench` passes --bench, `cargo test --benches`
    // nothing.
    let only = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let run = |name: &str| only.as_deref().is_none_or(|o| name.contains(o));
    if run("wire") {
        wire_figures();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        if run("startup") {
            startup_and_memory().await;
        }
        if run("preferred") {
            preferred_allocation_latency().await;
        }
        if run("lifecycle") {
            lifecycle_latency().await;
        }
        if run("matching") {
            pod_matching_figures().await;
        }
        if run("finished") {
            finished_pods_figures().await;
        }
        if run("usage") {
            usage_figures().await;
        }
    });
}
