//! End to end on the real components (tests/kube): the unmodified
//! kube-apiserver with deploy/ applied, kube-scheduler on the shipped
//! profile with the real extender, and on each node the kubelet's device
//! manager beside the real daemon. Each test has a control plane of its own.

mod support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use support::kube::*;

const NS: &str = "tenant";
/// Pods ask gpu-memory in GiB.
const UNIT: &str = "memory_unit_mib = 1024";

/// A shared pod, a pod of several containers with an init container, and
/// a whole GPU beside a memory share: each placed by the real scheduler
/// and extender, admitted by the real device manager, each container's
/// envs naming one GPU of its node with its own limits.
#[tokio::test(flavor = "multi_thread")]
async fn pods_run_with_their_grants() {
    let cp = ControlPlane::start();
    let nodes = cluster(&cp, NS, &[&[16384, 16384], &[81920]], UNIT).await;
    let sched = Scheduler::start(&cp);
    let client = cp.admin_client().await;

    // The whole GPU first: it needs a node with two GPUs free.
    let pods = [
        gpu_pod(NS, "whole", &[("w", [0, 0, 1]), ("m", [4, 0, 0])]),
        gpu_pod(NS, "shared", &[("main", [8, 30, 0])]),
        gpu_pod(
            NS,
            "several",
            &[
                ("init-setup", [4, 10, 0]),
                ("a", [6, 20, 0]),
                ("b", [2, 0, 0]),
            ],
        ),
    ];
    // One at a time: the scheduler pops pods created together in any order.
    for pod in &pods {
        create(&client, pod).await;
        let name = pod.metadata.name.as_deref().unwrap();
        let ran = wait_pod(&client, NS, name, Duration::from_secs(60), |p| {
            phase(p) == "Running" || phase(p) == "Failed"
        })
        .await
        .unwrap_or_else(|p| panic!("{name} never ran: {p:#?}\n{}", logs(&cp, &nodes, &sched)));
        assert_eq!(
            phase(&ran),
            "Running",
            "{ran:#?}\n{}",
            logs(&cp, &nodes, &sched)
        );
        let node = nodes.iter().find(|n| n.name == node_of(&ran)).unwrap();
        let record = node.record(NS, name).unwrap();
        assert_eq!(splits(&record), Vec::<String>::new(), "{name}");
        let envs = container_envs(&record);
        let spec = ran.spec.as_ref().unwrap();
        for c in spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
        {
            let limits = c.resources.as_ref().unwrap().limits.clone().unwrap();
            let checkpointed = record["resources"][&c.name]
                .as_object()
                .map_or(0, |r| r.len());
            assert_eq!(checkpointed, limits.len(), "{name}/{}: {record:#}", c.name);
            let env = &envs[&c.name];
            let visible = env
                .get("NVIDIA_VISIBLE_DEVICES")
                .unwrap_or_else(|| panic!("{name}/{}: {env:?}", c.name));
            let ours = |u: &str| u.starts_with(&format!("GPU-{:04x}", node_index(&node.name)));
            assert!(
                visible.split(',').all(ours),
                "{name}/{} sees {visible} on {}",
                c.name,
                node.name
            );
            if let Some(mem) = limits.get("doslab.io/gpu-memory") {
                let gib: u64 = mem.0.parse().unwrap();
                assert_eq!(
                    env.get("CUDA_DEVICE_MEMORY_LIMIT_0"),
                    Some(&format!("{}m", gib * 1024)),
                    "{name}/{}: {env:?}",
                    c.name
                );
            }
            if let Some(core) = limits.get("doslab.io/gpu-core") {
                assert_eq!(
                    env.get("CUDA_DEVICE_SM_LIMIT"),
                    Some(&core.0),
                    "{name}/{}",
                    c.name
                );
            }
            if limits.contains_key("doslab.io/gpu-count") {
                assert_eq!(
                    env.get("CUDA_DEVICE_MEMORY_LIMIT_0"),
                    None,
                    "whole GPU capped"
                );
            }
        }
    }

    // The shared pod's grant on its node's /metrics, labelled as its used
    // memory is, from admission; gone once the pod is.
    let shared = Api::<Pod>::namespaced(client.clone(), NS)
        .get("shared")
        .await
        .unwrap();
    let node = nodes.iter().find(|n| n.name == node_of(&shared)).unwrap();
    let envs = container_envs(&node.record(NS, "shared").unwrap());
    let gpu = &envs["main"]["NVIDIA_VISIBLE_DEVICES"];
    let labels = format!(r#"{{namespace="{NS}",pod="shared",container="main",gpu="{gpu}"}}"#);
    let addr = support::http_addr(&node.daemon);
    let granted = format!("gpu_device_plugin_container_memory_granted_bytes{labels}");
    support::wait_for_sample(&addr, &granted, (8u64 << 30) as f64).await;
    let cores = format!("gpu_device_plugin_container_core_granted_ratio{labels}");
    assert_eq!(support::metric(&addr, &cores), Some(0.3));
    Api::<Pod>::namespaced(client.clone(), NS)
        .delete("shared", &Default::default())
        .await
        .unwrap();
    wait_gone(&client, NS, "shared", Duration::from_secs(60)).await;
    support::poll_until(
        Instant::now() + support::WAIT,
        || support::metric(&addr, &granted).is_none(),
        || format!("{granted} outlived its pod"),
    )
    .await;
    drop(sched);
}

fn node_index(name: &str) -> usize {
    name.trim_start_matches("node-").parse().unwrap()
}

/// Bursts of 40 shared pods through the real scheduler: every pod bound
/// and admitted (0 admission failures), create→bound p99 printed and
/// bounded by the issue's target.
#[tokio::test(flavor = "multi_thread")]
async fn bursts_bind_and_admit() {
    let cp = ControlPlane::start();
    let nodes = cluster(
        &cp,
        NS,
        &[&[81920, 81920], &[40960, 40960], &[16384; 4]],
        UNIT,
    )
    .await;
    let sched = Scheduler::start(&cp);
    let client = cp.admin_client().await;
    let mut rng = support::Lcg(7);
    let binds = Bindings::watch(&client, NS);
    let mut latencies = Vec::new();
    let mut created = Vec::new();
    for i in 0..40 {
        let mem = [1, 2, 4, 6][rng.below(4) as usize];
        let core = [0, 10, 20][rng.below(3) as usize];
        let pod = gpu_pod(NS, &format!("burst-{i}"), &[("main", [mem, core, 0])]);
        created.push((format!("burst-{i}"), create(&client, &pod).await));
    }
    for (name, at) in &created {
        wait_pod(&client, NS, name, Duration::from_secs(60), |p| {
            !node_of(p).is_empty()
        })
        .await
        .unwrap_or_else(|p| panic!("{name} never bound: {p:#?}\n{}", logs(&cp, &nodes, &sched)));
        latencies.push(binds.at(name).unwrap_or_else(Instant::now) - *at);
    }
    let mut failed = Vec::new();
    for (name, _) in &created {
        let p = wait_pod(&client, NS, name, Duration::from_secs(30), |p| {
            phase(p) == "Running" || phase(p) == "Failed"
        })
        .await
        .unwrap();
        if phase(&p) != "Running" {
            failed.push((name.clone(), format!("{:?}", p.status)));
            continue;
        }
        let node = nodes.iter().find(|n| n.name == node_of(&p)).unwrap();
        let split = splits(&node.record(NS, name).unwrap());
        if !split.is_empty() {
            failed.push((name.clone(), format!("split across GPUs: {split:?}")));
        }
    }
    latencies.sort();
    let p99 = latencies[(latencies.len() * 99).div_ceil(100) - 1];
    let refused = refused_binds(&client, NS).await;
    eprintln!(
        "burst of 40 (real scheduler): create→bound p50 {:?}, p99 {:?}, admission failures {}, binds refused {}",
        latencies[latencies.len() / 2],
        p99,
        failed.len(),
        refused.len()
    );
    assert!(
        failed.is_empty(),
        "{failed:#?}\n{}",
        logs(&cp, &nodes, &sched)
    );
    // The issue's target: at most 5 % of a burst's binds refused.
    assert!(refused.len() <= 2, "{refused:#?}");
}

/// A kubelet restart (the device-plugin directory wiped but for the
/// checkpoint, a new kubelet.sock): the daemon registers again, the
/// running pod keeps its grant without a new Allocate, and a pod bound
/// afterwards runs with its own.
#[tokio::test(flavor = "multi_thread")]
async fn kubelet_restart_keeps_grants_and_serves_new_pods() {
    let cp = ControlPlane::start();
    let mut nodes = cluster(&cp, NS, &[&[16384, 16384]], UNIT).await;
    let sched = Scheduler::start(&cp);
    let client = cp.admin_client().await;
    create(&client, &gpu_pod(NS, "before", &[("main", [6, 30, 0])])).await;
    let running = |p: &Pod| phase(p) == "Running" || phase(p) == "Failed";
    let before = wait_pod(&client, NS, "before", Duration::from_secs(60), running)
        .await
        .unwrap();
    assert_eq!(phase(&before), "Running", "{}", logs(&cp, &nodes, &sched));
    let granted = container_envs(&nodes[0].record(NS, "before").unwrap());

    let node = &mut nodes[0];
    let addr = support::http_addr(&node.daemon);
    let series = |name: &str, r: &str| {
        support::metric(
            &addr,
            &format!("gpu_device_plugin_{name}{{resource=\"doslab.io/{r}\"}}"),
        )
    };
    let registered = |r: &str| series("registrations_total", r);
    let listed = |r: &str| series("list_messages_total", r);
    const RESOURCES: [&str; 3] = ["gpu-memory", "gpu-core", "gpu-count"];
    assert_eq!(registered("gpu-memory"), Some(1.0));
    let lists_before = RESOURCES.map(listed);
    node.restart_kubelet().await;
    let restarted = Instant::now();
    // Registered again with the new kubelet (every resource's count is 2)
    // and each resource's devices sent on its new stream, the only one
    // open: the kubelet admits nothing of a resource before it has its
    // devices.
    support::poll_until(
        restarted + START,
        || {
            RESOURCES.iter().zip(lists_before).all(|(r, before)| {
                registered(r) == Some(2.0)
                    && series("list_streams", r) == Some(1.0)
                    && listed(r) > before
            })
        },
        || format!("not registered again\n{}", node.daemon.log_text()),
    )
    .await;
    eprintln!(
        "kubelet restart: every resource registered again after {:?}",
        restarted.elapsed()
    );
    create(&client, &gpu_pod(NS, "after", &[("main", [8, 50, 0])])).await;
    let after = wait_pod(&client, NS, "after", Duration::from_secs(60), running)
        .await
        .unwrap();
    assert_eq!(
        phase(&after),
        "Running",
        "{after:#?}\n{}",
        logs(&cp, &nodes, &sched)
    );
    let node = &nodes[0];
    // The restarted kubelet admitted `before` again from its checkpoint.
    assert_eq!(container_envs(&node.record(NS, "before").unwrap()), granted);
    let record = node.record(NS, "after").unwrap();
    assert_eq!(splits(&record), Vec::<String>::new());
    let env = &container_envs(&record)["main"];
    assert_eq!(
        env.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(String::as_str),
        Some("8192m")
    );
    assert_eq!(
        env.get("CUDA_DEVICE_SM_LIMIT").map(String::as_str),
        Some("50")
    );
}

/// Churn: a full cluster, pods Pending beside it, then room freed. Every
/// pending pod that fits by the product's rules must be bound within 5 s
/// of the room being freed (the issue's target), round after round.
#[tokio::test(flavor = "multi_thread")]
async fn pending_pods_bind_once_room_frees() {
    let cp = ControlPlane::start();
    let nodes = cluster(&cp, NS, &[&[16384, 16384], &[16384, 16384]], UNIT).await;
    let sched = Scheduler::start(&cp);
    let client = cp.admin_client().await;
    let api: kube::Api<Pod> = kube::Api::namespaced(client.clone(), NS);
    let running = |p: &Pod| phase(p) == "Running" || phase(p) == "Failed";
    // Fill: eight 8 GiB pods on four 16 GiB GPUs.
    for i in 0..8 {
        create(
            &client,
            &gpu_pod(NS, &format!("fill-{i}"), &[("main", [8, 0, 0])]),
        )
        .await;
    }
    for i in 0..8 {
        let p = wait_pod(
            &client,
            NS,
            &format!("fill-{i}"),
            Duration::from_secs(60),
            running,
        )
        .await
        .unwrap();
        assert_eq!(phase(&p), "Running", "{}", logs(&cp, &nodes, &sched));
    }
    let mut worst = Duration::ZERO;
    for round in 0..3 {
        let waiting = format!("wait-{round}");
        create(&client, &gpu_pod(NS, &waiting, &[("main", [8, 0, 0])])).await;
        // It stays Pending while every GPU is full: the scheduler tried it
        // and found no place.
        let events: kube::Api<k8s_openapi::api::events::v1::Event> =
            kube::Api::namespaced(client.clone(), NS);
        support::poll_for(
            Instant::now() + Duration::from_secs(60),
            async || {
                let list = events.list(&Default::default()).await.unwrap().items;
                list.iter()
                    .any(|e| {
                        e.reason.as_deref() == Some("FailedScheduling")
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref())
                                == Some(waiting.as_str())
                    })
                    .then_some(())
            },
            || format!("{waiting} never tried"),
        )
        .await;
        let p = api.get(&waiting).await.unwrap();
        assert!(node_of(&p).is_empty(), "{waiting} bound on a full cluster");
        // Free one GPU's half: delete a running pod and wait until it is gone.
        let victim = format!("fill-{round}");
        api.delete(&victim, &Default::default()).await.unwrap();
        wait_gone(&client, NS, &victim, Duration::from_secs(30)).await;
        let freed = Instant::now();
        let bound = wait_pod(&client, NS, &waiting, Duration::from_secs(60), |p| {
            !node_of(p).is_empty()
        })
        .await
        .unwrap_or_else(|p| {
            panic!(
                "{waiting} never bound: {p:#?}\n{}",
                logs(&cp, &nodes, &sched)
            )
        });
        let took = freed.elapsed();
        worst = worst.max(took);
        eprintln!("churn round {round}: bound {took:?} after the room freed");
        let ran = wait_pod(&client, NS, &waiting, Duration::from_secs(30), running)
            .await
            .unwrap();
        assert_eq!(phase(&ran), "Running", "{bound:#?}");
    }
    // The issue's target, not a benchmark: a pod that fits waits ≤ 5 s.
    assert!(worst <= Duration::from_secs(5), "worst {worst:?}");
}

/// One MiB a device (the default unit): a pod written with `8000` is
/// stored by the API server as `8k` and granted 8000 MiB; a pod placed on
/// the node directly (no scheduler) that no GPU can hold is refused by
/// the daemon at admission, Failed with the kubelet's reason, and its
/// Warning Event lands through events.k8s.io with the daemon's identity.
#[tokio::test(flavor = "multi_thread")]
async fn quantities_as_stored_and_refusals_as_events() {
    let cp = ControlPlane::start();
    let (a, b) = (gpu_uuid(0, 0), gpu_uuid(0, 1));
    let node = KubeNode::start(&cp, "node-0", &[(&a, 16384), (&b, 16384)], "").await;
    namespace(&cp, NS);
    let client = cp.admin_client().await;
    let ended = |p: &Pod| phase(p) == "Running" || phase(p) == "Failed";

    let mut pod = gpu_pod(NS, "eight-thousand", &[("main", [8000, 0, 0])]);
    pod.spec.as_mut().unwrap().node_name = Some("node-0".into());
    create(&client, &pod).await;
    let ran = wait_pod(
        &client,
        NS,
        "eight-thousand",
        Duration::from_secs(60),
        ended,
    )
    .await
    .unwrap();
    let stored = &ran.spec.as_ref().unwrap().containers[0]
        .resources
        .as_ref()
        .unwrap()
        .limits
        .as_ref()
        .unwrap()["doslab.io/gpu-memory"];
    assert_eq!(stored.0, "8k", "the API server's canonical form");
    assert_eq!(
        phase(&ran),
        "Running",
        "{ran:#?}\n{}",
        node.daemon.log_text()
    );
    let record = node.record(NS, "eight-thousand").unwrap();
    let limit = container_envs(&record)
        .get("main")
        .and_then(|env| env.get("CUDA_DEVICE_MEMORY_LIMIT_0").cloned());
    assert_eq!(limit.as_deref(), Some("8000m"), "{record:#}");

    let mut pod = gpu_pod(NS, "too-big", &[("main", [20000, 0, 0])]);
    pod.spec.as_mut().unwrap().node_name = Some("node-0".into());
    create(&client, &pod).await;
    let refused = wait_pod(&client, NS, "too-big", Duration::from_secs(60), ended)
        .await
        .unwrap();
    let status = refused.status.as_ref().unwrap();
    assert_eq!(phase(&refused), "Failed");
    assert_eq!(status.reason.as_deref(), Some("UnexpectedAdmissionError"));
    let message = status.message.clone().unwrap_or_default();
    assert!(message.contains("20000"), "{message}");
    let events: kube::Api<k8s_openapi::api::events::v1::Event> =
        kube::Api::namespaced(client.clone(), NS);
    let e = support::poll_for(
        Instant::now() + Duration::from_secs(20),
        async || {
            let list = events.list(&Default::default()).await.unwrap();
            list.items.into_iter().find(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("too-big")
                    && e.reason.as_deref() == Some("GpuAllocateFailed")
            })
        },
        || format!("no GpuAllocateFailed Event\n{}", node.daemon.log_text()),
    )
    .await;
    assert_eq!(e.type_.as_deref(), Some("Warning"));
    assert_eq!(e.reporting_instance.as_deref(), Some("node-0"));
}

/// The notes of the daemon's Events of `reason` on pod `name`.
async fn gpu_events(client: &kube::Client, name: &str, reason: &str) -> Vec<String> {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), NS);
    let list = events.list(&Default::default()).await.unwrap();
    list.items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                && e.reason.as_deref() == Some(reason)
        })
        .filter_map(|e| e.note)
        .collect()
}

/// An XID on a GPU lands as a Warning Event on the pods with a grant on
/// that GPU and on no other: a share's GPU has an application's page
/// fault (XID 31), then the whole GPU a critical fault (XID 79). The
/// daemon posts its Events in order, so once the second one is there the
/// first has reached everyone it would.
#[tokio::test(flavor = "multi_thread")]
async fn an_xid_reaches_the_pods_of_its_gpu_and_no_other() {
    let cp = ControlPlane::start();
    let (a, b) = (gpu_uuid(0, 0), gpu_uuid(0, 1));
    let flags = tempfile::tempdir().unwrap();
    let health = format!(
        "[health]\npoll_ms = 100\nmock_dir = {:?}\n",
        flags.path().display().to_string()
    );
    let node = KubeNode::start(&cp, "node-0", &[(&a, 16384), (&b, 16384)], &health).await;
    namespace(&cp, NS);
    let client = cp.admin_client().await;
    let on_node = |mut pod: Pod| {
        pod.spec.as_mut().unwrap().node_name = Some("node-0".into());
        pod
    };
    create(
        &client,
        &on_node(gpu_pod(NS, "whole", &[("train", [0, 0, 1])])),
    )
    .await;
    create(
        &client,
        &on_node(gpu_pod(NS, "share", &[("infer", [4096, 0, 0])])),
    )
    .await;
    let mut gpu = std::collections::HashMap::new();
    for name in ["whole", "share"] {
        let ran = wait_pod(&client, NS, name, Duration::from_secs(60), |p| {
            phase(p) == "Running"
        })
        .await
        .unwrap_or_else(|p| panic!("{name} not Running: {p:?}\n{}", node.daemon.log_text()));
        let ledger = &ran.metadata.annotations.as_ref().unwrap()["doslab.io/gpu-ledger"];
        let uuid = [&a, &b].into_iter().find(|u| ledger.contains(u.as_str()));
        gpu.insert(name, uuid.unwrap().clone());
    }
    assert_ne!(gpu["whole"], gpu["share"], "a whole GPU carries no share");

    let xid = |uuid: &str, number: &str| {
        std::fs::write(flags.path().join(format!("{uuid}.xid")), number).unwrap();
    };
    xid(&gpu["share"], "31");
    let deadline = || Instant::now() + Duration::from_secs(30);
    let noted = support::poll_for(
        deadline(),
        async || Some(gpu_events(&client, "share", "GpuFault").await).filter(|n| !n.is_empty()),
        || format!("no GpuFault Event on the share\n{}", node.daemon.log_text()),
    )
    .await;
    let want = format!(
        "XID 31 on GPU {}, which this pod's infer uses",
        gpu["share"]
    );
    assert_eq!(noted, [want]);

    xid(&gpu["whole"], "79");
    let noted = support::poll_for(
        deadline(),
        async || Some(gpu_events(&client, "whole", "GpuFault").await).filter(|n| !n.is_empty()),
        || {
            format!(
                "no GpuFault Event on the whole GPU\n{}",
                node.daemon.log_text()
            )
        },
    )
    .await;
    assert_eq!(noted.len(), 1, "{noted:?}");
    assert!(
        noted[0].starts_with(&format!(
            "XID 79 on GPU {}, which this pod's train uses; the GPU is out of service",
            gpu["whole"]
        )),
        "{noted:?}"
    );
    let share = gpu_events(&client, "share", "GpuFault").await;
    assert_eq!(
        share.len(),
        1,
        "the share's GPU had no second fault: {share:?}"
    );
}

/// What a share uses, from the driver, beside what it is granted: the
/// node's GPU lists a process of the pod's container (its cgroup in the
/// host's /proc names the pod's UID and the container ID the kubelet
/// reported) and one of no pod (an MPS server, say); within a poll the
/// daemon's /metrics has the container's used memory and SM share with
/// the labels of its grant, and the GPU's totals count both; every panel
/// of the shipped dashboard has data on the daemon's scrape; once the pod
/// is gone, so are its series.
#[tokio::test(flavor = "multi_thread")]
async fn a_shares_use_from_the_driver_joins_its_grant() {
    let cp = ControlPlane::start();
    let a = gpu_uuid(0, 0);
    let host = tempfile::tempdir().unwrap();
    let driver = FakeDriver::new(host.path());
    let usage = driver.toml();
    // Two GPUs, so that a pod asking more than either passes the kubelet
    // (which counts the node's devices) and is refused by the daemon.
    let b = gpu_uuid(0, 1);
    let node = KubeNode::start(&cp, "node-0", &[(&a, 16384), (&b, 16384)], &usage).await;
    namespace(&cp, NS);
    let client = cp.admin_client().await;
    let mut pod = gpu_pod(NS, "share", &[("infer", [4096, 30, 0])]);
    pod.spec.as_mut().unwrap().node_name = Some("node-0".into());
    create(&client, &pod).await;
    let ran = wait_pod(&client, NS, "share", Duration::from_secs(60), |p| {
        phase(p) == "Running"
    })
    .await
    .unwrap_or_else(|p| panic!("share not Running: {p:?}\n{}", node.daemon.log_text()));
    let ledger = &ran.metadata.annotations.as_ref().unwrap()["doslab.io/gpu-ledger"];
    let a = [a, b]
        .into_iter()
        .find(|u| ledger.contains(u.as_str()))
        .unwrap();
    // PID 4242 is the container's; 7 is in no pod.
    driver.process_of(4242, &ran);
    driver.process(7, "0::/system.slice/nvidia-mps.service\n");
    driver.lists(&a, "4242 1073741824 40\n7 33554432 -\n");

    let addr = support::http_addr(&node.daemon);
    let labels = format!(r#"{{namespace="{NS}",pod="share",container="infer",gpu="{a}"}}"#);
    let used = format!("gpu_device_plugin_container_memory_used_bytes{labels}");
    support::wait_for_sample(&addr, &used, (1u64 << 30) as f64).await;
    let sm = format!("gpu_device_plugin_container_sm_utilization_ratio{labels}");
    assert_eq!(support::metric(&addr, &sm), Some(0.4));
    let granted = format!("gpu_device_plugin_container_memory_granted_bytes{labels}");
    assert_eq!(support::metric(&addr, &granted), Some((4u64 << 30) as f64));
    let gpu = format!(r#"{{gpu="{a}"}}"#);
    let total = format!("gpu_device_plugin_gpu_memory_used_bytes{gpu}");
    assert_eq!(
        support::metric(&addr, &total),
        Some(((1u64 << 30) + (32 << 20)) as f64)
    );
    let processes = format!("gpu_device_plugin_gpu_processes{gpu}");
    assert_eq!(support::metric(&addr, &processes), Some(2.0));

    // Every panel of the shipped dashboard has data on this daemon's
    // scrape, a refused Allocate included (a pod no GPU can hold, placed
    // on the node directly), by Prometheus's own engine.
    let mut pod = gpu_pod(NS, "too-big", &[("main", [20000, 0, 0])]);
    pod.spec.as_mut().unwrap().node_name = Some("node-0".into());
    create(&client, &pod).await;
    wait_pod(&client, NS, "too-big", Duration::from_secs(60), |p| {
        phase(p) == "Failed"
    })
    .await
    .unwrap_or_else(|p| panic!("too-big not refused: {p:?}\n{}", node.daemon.log_text()));
    // The monitoring manifests apply to the real API server as shipped,
    // the PrometheusRule validated by the Prometheus Operator's own CRD.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let crd = support::kube::prometheus_operator_crd("monitoring.coreos.com_prometheusrules.yaml");
    let admin = cp.admin.to_str().unwrap();
    cp.peers_ok(&["apply", "--kubeconfig", admin, "-f", crd.to_str().unwrap()]);
    // Applied once the CRD is Established.
    let applied = support::poll_sync(Instant::now() + support::WAIT, || {
        std::process::Command::new(support::kube::peers())
            .args(["apply", "--kubeconfig", admin, "-k", "deploy/monitoring"])
            .current_dir(root)
            .output()
            .unwrap()
            .status
            .success()
    });
    assert!(applied, "deploy/monitoring never applied");
    let dashboard: ConfigMap = Api::namespaced(client.clone(), "gpu-device-plugin")
        .get("gpu-device-plugin-dashboard")
        .await
        .unwrap();
    let shipped = std::fs::read_to_string(root.join("deploy/monitoring/dashboard.json")).unwrap();
    assert_eq!(dashboard.data.unwrap()["gpu-sharing.json"], shipped);
    assert_eq!(dashboard.metadata.labels.unwrap()["grafana_dashboard"], "1");
    let kind = GroupVersionKind::gvk("monitoring.coreos.com", "v1", "PrometheusRule");
    let rules: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        "gpu-device-plugin",
        &ApiResource::from_gvk_with_plural(&kind, "prometheusrules"),
    );
    let stored = rules.get("gpu-device-plugin").await.unwrap();
    assert_eq!(stored.data["spec"]["groups"].as_array().unwrap().len(), 2);
    let scrape = host.path().join("node-0.prom");
    std::fs::write(&scrape, support::http_get(&addr, "/metrics").1).unwrap();
    let out = std::process::Command::new(support::kube::monitoring())
        .args([
            "panels",
            "--dashboard",
            "deploy/monitoring/dashboard.json",
            "--scrape",
        ])
        .arg(format!("node-0={}", scrape.display()))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    eprintln!("{report}");
    assert!(
        out.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    Api::<Pod>::namespaced(client.clone(), NS)
        .delete("share", &Default::default())
        .await
        .unwrap();
    wait_gone(&client, NS, "share", Duration::from_secs(60)).await;
    // The driver still lists the process (it has not exited yet): no pod
    // names it any more.
    support::poll_until(
        Instant::now() + support::WAIT,
        || support::metric(&addr, &used).is_none() && support::metric(&addr, &sm).is_none(),
        || format!("{used} outlived its pod"),
    )
    .await;
    assert_eq!(support::metric(&addr, &processes), Some(2.0));
}

/// `kubectl gpu top` (the binary as `kubectl-gpu`, as kubectl runs a
/// plugin) on a two-node cluster: what each GPU grants to which pod from
/// the API server, what each share uses from its node's daemon through
/// the API server's pod proxy; as the admin, and as a service account
/// holding only deploy/kubectl-gpu's roles; without the usage role it
/// shows the grants and says why usage is unknown; without the right to
/// list every namespace's pods, `-A` fails saying what it needs.
#[tokio::test(flavor = "multi_thread")]
async fn kubectl_gpu_top_prints_each_gpu_and_its_shares() {
    let cp = ControlPlane::start();
    let ip = support::host_ip();
    let host = tempfile::tempdir().unwrap();
    let driver = FakeDriver::new(host.path());
    let usage = driver.toml();
    let (a, b) = (gpu_uuid(0, 0), gpu_uuid(1, 0));
    let node0 = KubeNode::start_reachable(&cp, "node-0", &[(&a, 16384)], &usage, ip).await;
    let node1 = KubeNode::start_reachable(&cp, "node-1", &[(&b, 16384)], &usage, ip).await;
    namespace(&cp, NS);
    let client = cp.admin_client().await;
    let on = |node: &str, mut pod: Pod| {
        pod.spec.as_mut().unwrap().node_name = Some(node.into());
        pod
    };
    create(
        &client,
        &on("node-0", gpu_pod(NS, "share", &[("infer", [4096, 30, 0])])),
    )
    .await;
    create(
        &client,
        &on("node-1", gpu_pod(NS, "whole", &[("train", [0, 0, 1])])),
    )
    .await;
    let mut running = Vec::new();
    for name in ["share", "whole"] {
        let logs = || format!("{}\n{}", node0.daemon.log_text(), node1.daemon.log_text());
        running.push(
            wait_pod(&client, NS, name, Duration::from_secs(60), |p| {
                phase(p) == "Running"
            })
            .await
            .unwrap_or_else(|p| panic!("{name} not Running: {p:?}\n{}", logs())),
        );
    }
    driver.process_of(4242, &running[0]);
    driver.lists(&a, "4242 1073741824 40\n");

    let plugin = host.path().join("kubectl-gpu");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_gpu-device-plugin"), &plugin).unwrap();
    let top = |kubeconfig: &std::path::Path, args: &[&str]| {
        // The test daemons' pods carry a label of their own (see
        // KubeNode::start_reachable), not the DaemonSet's.
        let out = std::process::Command::new(&plugin)
            .arg("top")
            .args(args)
            .arg("--daemon-selector")
            .arg(format!("{REACHABLE_DAEMON}=true"))
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let errors = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), text, errors)
    };
    // The table's rows, each the cells between runs of spaces.
    let rows = |text: &str| -> Vec<Vec<String>> {
        text.lines()
            .map(|l| {
                l.split("  ")
                    .map(str::trim)
                    .filter(|c| !c.is_empty())
                    .map(Into::into)
                    .collect()
            })
            .collect()
    };
    let want = |used: bool| {
        let (gpu, mine, sm) = if used {
            ("1.0Gi", "1.0Gi", "40%")
        } else {
            ("-", "-", "-")
        };
        vec![
            vec![
                "node-0",
                &a,
                "1 share",
                &format!("4.0Gi/{gpu}"),
                "16.0Gi",
                "30%",
                sm,
            ],
            vec![
                &format!("{NS}/share/infer"),
                &format!("4.0Gi/{mine}"),
                "30%",
                sm,
            ],
            vec![
                "node-1",
                &b,
                "1 share",
                &format!("16.0Gi/{}", if used { "0Mi" } else { "-" }),
                "16.0Gi",
                "100%",
                "-",
            ],
            vec![&format!("{NS}/whole/train"), "16.0Gi/-", "100%", "-"],
        ]
        .into_iter()
        .map(|r| r.into_iter().map(|c| c.to_owned()).collect::<Vec<String>>())
        .collect::<Vec<_>>()
    };
    let admin = cp.admin.clone();
    let printed = support::poll_for(
        Instant::now() + support::WAIT,
        async || {
            let (ok, text, _) = top(&admin, &["-A"]);
            (ok && text.contains("4.0Gi/1.0Gi")).then_some(text)
        },
        || {
            format!(
                "top -A never showed the share's use: {:?}",
                top(&admin, &["-A"])
            )
        },
    )
    .await;
    eprintln!("{printed}");
    assert_eq!(rows(&printed)[1..], want(true)[..], "{printed}");

    // A service account with deploy/kubectl-gpu's roles, bound as its
    // rbac.yaml says: the same table for its namespace.
    cp.peers_ok(&[
        "apply",
        "--kubeconfig",
        cp.admin.to_str().unwrap(),
        "-k",
        &format!("{}/deploy/kubectl-gpu", env!("CARGO_MANIFEST_DIR")),
    ]);
    let bind = |who: &str, usage: bool| {
        let mut yaml = format!(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: {who}, namespace: {NS}}}\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {{name: {who}-nodes}}\n\
             roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: \"gpu-device-plugin:top-nodes\"}}\n\
             subjects: [{{kind: ServiceAccount, name: {who}, namespace: {NS}}}]\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: {who}-pods, namespace: {NS}}}\n\
             roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: \"gpu-device-plugin:top-pods\"}}\n\
             subjects: [{{kind: ServiceAccount, name: {who}, namespace: {NS}}}]\n"
        );
        if usage {
            yaml.push_str(&format!(
                "---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\n\
                 metadata: {{name: {who}-usage, namespace: gpu-device-plugin}}\n\
                 roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: \"gpu-device-plugin:top-usage\"}}\n\
                 subjects: [{{kind: ServiceAccount, name: {who}, namespace: {NS}}}]\n"
            ));
        }
        cp.apply(&yaml);
        cp.token(NS, who, None)
    };
    let viewer = bind("viewer", true);
    let printed = support::poll_for(
        Instant::now() + support::WAIT,
        async || {
            let (ok, text, _) = top(&viewer, &["-n", NS]);
            (ok && text.contains("4.0Gi/1.0Gi")).then_some(text)
        },
        || format!("the viewer's top: {:?}", top(&viewer, &["-n", NS])),
    )
    .await;
    assert_eq!(rows(&printed)[1..], want(true)[..], "{printed}");
    // --node: that node alone.
    let (ok, text, errors) = top(&viewer, &["-n", NS, "--node", "node-1"]);
    assert!(ok, "{errors}");
    assert_eq!(rows(&text)[1..], want(true)[2..], "{text}");
    // Every namespace's pods are not the viewer's to list.
    let (ok, _, errors) = top(&viewer, &["-A"]);
    assert!(!ok);
    assert!(
        errors.contains("refused to list pods in all namespaces")
            && errors.contains("deploy/kubectl-gpu"),
        "{errors}"
    );
    // Without the usage role: the grants, and why usage is unknown.
    let granted_only = bind("granted-only", false);
    let (ok, text, errors) = top(&granted_only, &["-n", NS]);
    assert!(ok, "{errors}");
    let table: Vec<Vec<String>> = rows(&text).into_iter().filter(|r| r.len() > 1).collect();
    assert_eq!(table[1..], want(false)[..], "{text}");
    for node in ["node-0", "node-1"] {
        let note = format!(
            "{node}: usage unknown: not allowed to list pods in namespace gpu-device-plugin"
        );
        assert!(text.contains(&note), "{note} in\n{text}");
    }
}
