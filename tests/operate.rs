//! What an operator touches: the manifests in deploy/ (parsed into the
//! Kubernetes API types), the HTTP endpoint of the running binary, and
//! `inspect` against it.

mod support;

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use support::*;

fn manifest<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn manifests_are_valid_and_say_what_matters() {
    let ns: Namespace = manifest("namespace.yaml");
    let ns = ns.metadata.name.unwrap();
    let sa: ServiceAccount = manifest("serviceaccount.yaml");
    assert_eq!(sa.metadata.namespace.as_deref(), Some(ns.as_str()));

    // RBAC: exactly the verbs the plugin uses.
    let role: ClusterRole = manifest("clusterrole.yaml");
    let mut rules: Vec<(String, Vec<String>)> = role
        .rules
        .unwrap()
        .into_iter()
        .flat_map(|r| {
            let verbs = r.verbs.clone();
            r.resources
                .unwrap()
                .into_iter()
                .map(move |res| (res, verbs.clone()))
        })
        .collect();
    rules.sort();
    assert_eq!(
        rules,
        vec![
            ("events".into(), vec!["create".into()]),
            ("nodes".into(), vec!["get".into(), "patch".into()]),
            (
                "pods".into(),
                vec!["get".into(), "list".into(), "watch".into(), "patch".into()]
            ),
        ]
    );
    let binding: ClusterRoleBinding = manifest("clusterrolebinding.yaml");
    assert_eq!(binding.role_ref.name, role.metadata.name.unwrap());
    let subject = &binding.subjects.unwrap()[0];
    assert_eq!(
        (subject.name.as_str(), subject.namespace.as_deref()),
        (sa.metadata.name.as_deref().unwrap(), Some(ns.as_str()))
    );

    // The ConfigMap's TOML is accepted by the config loader.
    let cm: ConfigMap = manifest("configmap.yaml");
    let toml = &cm.data.unwrap()["config.toml"];
    assert_eq!(
        toml,
        gpu_device_plugin::config::DEFAULT_TOML,
        "ConfigMap drifted from config/"
    );
    let config = gpu_device_plugin::config::Config::from_toml(toml, Some("node".into())).unwrap();
    let port: u16 = config
        .http_listen
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();

    let ds: DaemonSet = manifest("daemonset.yaml");
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert_eq!(pod.service_account_name, sa.metadata.name);
    let c = &pod.containers[0];
    let node_name = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .unwrap();
    let field = node_name
        .value_from
        .as_ref()
        .unwrap()
        .field_ref
        .as_ref()
        .unwrap();
    assert_eq!(field.field_path, "spec.nodeName");
    // The device-plugin directory is the host's, mounted where the config says.
    let volumes = pod.volumes.unwrap();
    let host = volumes.iter().find(|v| v.host_path.is_some()).unwrap();
    assert_eq!(
        host.host_path.as_ref().unwrap().path,
        "/var/lib/kubelet/device-plugins"
    );
    let mount = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == host.name)
        .unwrap();
    assert_eq!(Path::new(&mount.mount_path), config.device_plugin_dir);
    // The config is mounted where the args point.
    let cfg_volume = volumes.iter().find(|v| v.config_map.is_some()).unwrap();
    assert_eq!(
        cfg_volume.config_map.as_ref().unwrap().name,
        cm.metadata.name.unwrap()
    );
    let cfg_mount = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == cfg_volume.name)
        .unwrap();
    let args = c.args.clone().unwrap();
    assert_eq!(args[1], format!("{}/config.toml", cfg_mount.mount_path));
    // Probes hit the real port and paths.
    let ports = c.ports.as_ref().unwrap();
    assert_eq!(ports[0].container_port, i32::from(port));
    for (probe, path) in [
        (&c.liveness_probe, "/healthz"),
        (&c.readiness_probe, "/readyz"),
    ] {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(get.path.as_deref(), Some(path));
        let by_name = ports.iter().find(|p| {
            p.name.as_ref()
                == Some(&match &get.port {
                    k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => {
                        s.clone()
                    }
                    k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i) => {
                        i.to_string()
                    }
                })
        });
        assert!(by_name.is_some(), "probe port {:?}", get.port);
    }
    let limits = c.resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert!(limits.contains_key("memory"));
}

#[test]
fn the_kustomization_lists_every_manifest_and_the_demo_pod_asks_our_resources() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let k: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap())
            .unwrap();
    let listed: Vec<&str> = k["resources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for file in [
        "namespace.yaml",
        "serviceaccount.yaml",
        "clusterrole.yaml",
        "clusterrolebinding.yaml",
        "configmap.yaml",
        "daemonset.yaml",
        "service.yaml",
        "admissionpolicy.yaml",
        "admissionpolicybinding.yaml",
    ] {
        assert!(listed.contains(&file), "{file} missing from kustomization");
        assert!(dir.join(file).exists());
    }
    let pod: k8s_openapi::api::core::v1::Pod = manifest("gpu-pod-demo.yaml");
    let limits = pod.spec.unwrap().containers[0]
        .resources
        .clone()
        .unwrap()
        .limits
        .unwrap();
    assert!(
        limits.contains_key("doslab.io/gpu-memory") && limits.contains_key("doslab.io/gpu-core")
    );
}

const MEM: &str = "doslab.io/gpu-memory";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_probes_follow_registration_allocation_and_health() {
    let dir = tempfile::tempdir().unwrap();
    let health = tempfile::tempdir().unwrap();
    let extra = format!(
        "[health]\npoll_ms = 50\nrecovery_ms = 200\nmock_dir = {:?}",
        health.path().display().to_string()
    );
    let toml = mock_config(dir.path(), &extra, &[("GPU-a", 1024), ("GPU-b", 1024)]);
    let daemon = Daemon::start(&toml);
    let addr = http_addr(&daemon);
    assert_eq!(http_get(&addr, "/healthz").0, 200);
    let (code, body) = http_get(&addr, "/readyz");
    assert_eq!(code, 503, "no kubelet yet: {body}");
    assert!(body.contains("doslab.io/gpu-core"), "{body}");

    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let listed = [
        (MEM, 2048),
        ("doslab.io/gpu-core", 200),
        ("doslab.io/gpu-count", 2),
    ];
    assert!(kubelet.wait_until(WAIT, all_listed(&listed)).await);
    let deadline = std::time::Instant::now() + WAIT;
    while http_get(&addr, "/readyz").0 != 200 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(http_get(&addr, "/readyz").0, 200);

    kubelet.admit(&[(MEM, 100)]).await.unwrap();
    let mut client = kubelet.client(MEM).unwrap();
    let bad = gpu_device_plugin::api::AllocateRequest {
        container_requests: vec![gpu_device_plugin::api::ContainerAllocateRequest {
            devices_ids: vec!["zz".into()],
        }],
    };
    assert!(client.allocate(bad).await.is_err());
    let (_, m) = http_get(&addr, "/metrics");
    let mem = |name: &str| {
        sample(
            &m,
            &format!("gpu_device_plugin_{name}{{resource=\"{MEM}\"}}"),
        )
    };
    assert_eq!(mem("devices"), Some(2048.0), "{m}");
    assert_eq!(mem("devices_healthy"), Some(2048.0));
    assert_eq!(mem("registered"), Some(1.0));
    assert_eq!(mem("registrations_total"), Some(1.0));
    assert_eq!(mem("list_streams"), Some(1.0));
    assert_eq!(
        mem("list_message_bytes"),
        Some(kubelet.snapshot()[MEM].last_message_bytes as f64)
    );
    let rpc = |rpc: &str| {
        sample(
            &m,
            &format!("gpu_device_plugin_rpc_total{{resource=\"{MEM}\",rpc=\"{rpc}\"}}"),
        )
    };
    assert_eq!(rpc("allocate"), Some(2.0));
    assert_eq!(rpc("get_preferred_allocation"), Some(1.0));
    let failed = format!(
        "gpu_device_plugin_rpc_failures_total{{resource=\"{MEM}\",rpc=\"allocate\",reason=\"unknown_id\"}}"
    );
    assert_eq!(sample(&m, &failed), Some(1.0));
    assert!(m.contains("gpu_device_plugin_rpc_duration_seconds_count"));

    // A GPU going unhealthy shows in the gauges.
    std::fs::write(health.path().join("GPU-a"), "").unwrap();
    wait_for_sample(
        &addr,
        &format!("gpu_device_plugin_devices_healthy{{resource=\"{MEM}\"}}"),
        1024.0,
    )
    .await;

    // A kubelet restart counts as a re-registration.
    let mut kubelet = kubelet;
    kubelet.restart().await.unwrap();
    wait_for_sample(
        &addr,
        &format!("gpu_device_plugin_reregistrations_total{{resource=\"{MEM}\"}}"),
        1.0,
    )
    .await;
}

/// Polls `/metrics` until `series` reads `value`.
async fn wait_for_sample(addr: &str, series: &str, value: f64) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (_, m) = http_get(addr, "/metrics");
        if sample(&m, series) == Some(value) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{series} never read {value}:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_reports_what_the_kubelet_sees() {
    let dir = tempfile::tempdir().unwrap();
    let toml = mock_config(dir.path(), "", &[("GPU-a", 1024), ("GPU-b", 512)]);
    let daemon = Daemon::start(&toml);
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let listed = [
        (MEM, 1536),
        ("doslab.io/gpu-core", 200),
        ("doslab.io/gpu-count", 2),
    ];
    assert!(
        kubelet.wait_until(WAIT, all_listed(&listed)).await,
        "{}",
        daemon.log_text()
    );
    let dir_arg = dir.path().to_str().unwrap().to_owned();
    let (status, stdout, stderr) =
        tokio::task::spawn_blocking(move || run_to_end(&["inspect", "--dir", &dir_arg], &[]))
            .await
            .unwrap();
    assert!(status.success(), "{stdout}{stderr}");
    let snap = kubelet.snapshot();
    for (socket, name) in [
        ("doslab.io-gpu-memory.sock", MEM),
        ("doslab.io-gpu-core.sock", "doslab.io/gpu-core"),
        ("doslab.io-gpu-count.sock", "doslab.io/gpu-count"),
    ] {
        let v = &snap[name];
        let line = stdout
            .lines()
            .find(|l| l.contains(socket))
            .unwrap_or_else(|| panic!("{stdout}"));
        assert!(
            line.contains(&format!("{} devices, {} healthy", v.devices, v.healthy)),
            "{line}"
        );
        assert!(
            line.contains(&format!("list {} bytes", v.last_message_bytes)),
            "{line}"
        );
        assert!(line.contains("GetPreferredAllocation yes"), "{line}");
    }
    // A dead socket is reported, with a non-zero exit.
    std::os::unix::net::UnixListener::bind(dir.path().join("dead.sock"))
        .map(drop)
        .unwrap();
    let dir_arg = dir.path().to_str().unwrap().to_owned();
    let (status, stdout, _) =
        tokio::task::spawn_blocking(move || run_to_end(&["inspect", "--dir", &dir_arg], &[]))
            .await
            .unwrap();
    assert_eq!(status.code(), Some(2));
    assert!(
        stdout
            .lines()
            .any(|l| l.contains("dead.sock") && l.contains("cannot connect")),
        "{stdout}"
    );
}
