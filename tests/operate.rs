//! What an operator touches: the manifests in deploy/ (parsed into the
//! Kubernetes API types), the HTTP endpoint of the running binary, and
//! `inspect` against it.

mod support;

use std::path::Path;

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
            ("events".into(), vec!["create".into(), "patch".into()]),
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
    let daemon = App::start(&toml).await;
    let addr = daemon.http.clone();
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
    daemon.ready().await;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_reports_what_the_kubelet_sees() {
    let dir = tempfile::tempdir().unwrap();
    let toml = mock_config(dir.path(), "", &[("GPU-a", 1024), ("GPU-b", 512)]);
    let listed = [
        (MEM, 1536),
        ("doslab.io/gpu-core", 200),
        ("doslab.io/gpu-count", 2),
    ];
    let (_daemon, kubelet) = start_listed(dir.path(), &toml, &listed).await;
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

/// A JSON value whose objects must not repeat a key at any level:
/// serde_json's own map would keep the last value silently.
struct Strict(serde_json::Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Strict(serde_json::Value::Null))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Strict(items.into()))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
        let mut object = serde_json::Map::new();
        while let Some((key, Strict(v))) = map.next_entry::<String, Strict>()? {
            if object.insert(key.clone(), v).is_some() {
                return Err(serde::de::Error::custom(format!("key {key:?} repeats")));
            }
        }
        Ok(Strict(object.into()))
    }
}

/// The daemon's JSON log lines, each parsed strictly: one object a line,
/// with its level and message.
fn json_lines(log: &str) -> Vec<serde_json::Value> {
    log.lines()
        .map(|line| {
            let mut de = serde_json::Deserializer::from_str(line);
            let Strict(v) =
                serde::Deserialize::deserialize(&mut de).unwrap_or_else(|e| panic!("{e}: {line}"));
            assert!(
                v["level"].is_string() && v["fields"]["message"].is_string(),
                "{line}"
            );
            v
        })
        .collect()
}

/// The `fields` of the first line whose message is `message`.
fn fields_of<'a>(lines: &'a [serde_json::Value], message: &str) -> &'a serde_json::Value {
    lines
        .iter()
        .map(|l| &l["fields"])
        .find(|f| f["message"] == message)
        .unwrap_or_else(|| panic!("no {message:?} line in {lines:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_have_unique_keys_numbers_and_signal_names() {
    let dir = tempfile::tempdir().unwrap();
    let mut toml = mock_config(
        dir.path(),
        "log_format = \"json\"",
        &[("GPU-a", 1024), ("GPU-b", 1024)],
    );
    // GPU-a sits on NUMA node 0; GPU-b's node is unknown.
    toml = toml.replacen(
        "memory_mib = 1024\n",
        "memory_mib = 1024\nnuma_node = 0\n",
        1,
    );
    let listed = [
        (MEM, 2048),
        ("doslab.io/gpu-core", 200),
        ("doslab.io/gpu-count", 2),
    ];
    // The binary: its log and the signals are what is tested.
    let mut daemon = Daemon::start(&toml);
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    expect_kubelet(&kubelet, &daemon, &listed, all_listed(&listed)).await;
    kubelet.admit(&[(MEM, 100)]).await.unwrap();
    daemon.signal(libc::SIGHUP);
    wait_for_sample(&http_addr(&daemon), RELOADS_APPLIED, 1.0).await;
    daemon.signal(libc::SIGTERM);
    assert!(daemon.wait_exit(WAIT).unwrap().success());

    let lines = json_lines(&daemon.log_text());
    let gpus: Vec<&serde_json::Value> = lines
        .iter()
        .map(|l| &l["fields"])
        .filter(|f| f["message"] == "GPU")
        .collect();
    assert_eq!(gpus.len(), 2, "{lines:#?}");
    assert_eq!(gpus[0]["numa_node"], 0, "a plain number: {:?}", gpus[0]);
    assert!(gpus[1].get("numa_node").is_none(), "absent: {:?}", gpus[1]);
    assert!(
        gpus.iter()
            .all(|g| g["memory_mib"] == 1024 && g["index"].is_u64())
    );
    assert!(
        fields_of(&lines, "serving")["devices"].is_u64(),
        "{lines:#?}"
    );
    // The actor's name survives in the span, under a key of its own.
    assert!(
        lines
            .iter()
            .any(|l| l["span"]["actor"].as_str() == Some("plugin gpu-memory")),
        "{lines:#?}"
    );
    let signals: Vec<&str> = lines
        .iter()
        .filter(|l| l["fields"]["message"] == "signal received")
        .map(|l| l["fields"]["signal"].as_str().unwrap())
        .collect();
    assert_eq!(signals, ["SIGHUP", "SIGTERM"]);

    // One start-up line says what runs, from where, and how health is checked.
    let start = fields_of(&lines, "starting");
    assert_eq!(start["version"], gpu_device_plugin::VERSION);
    assert_eq!(start["config"], daemon.config.display().to_string());
    assert_eq!(start["backend"], "mock");
    assert_eq!(
        start["resources"],
        "doslab.io/gpu-memory, doslab.io/gpu-core, doslab.io/gpu-count"
    );
    assert_eq!(start["health"], "polling only (mock backend)");
}

#[test]
fn version_and_build_info_carry_the_git_revision() {
    let rev = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or("unknown".into(), |o| {
            String::from_utf8_lossy(&o.stdout).trim().to_owned()
        });
    let version = format!("{} ({rev})", env!("CARGO_PKG_VERSION"));
    let (status, stdout, _) = run_to_end(&["--version"], &[]);
    assert!(status.success());
    assert_eq!(stdout.trim(), format!("gpu-device-plugin {version}"));

    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let daemon = runtime.block_on(App::start(&mock_config(dir.path(), "", &[("GPU-a", 1024)])));
    let (_, m) = http_get(&daemon.http, "/metrics");
    let series = format!(
        "gpu_device_plugin_build_info{{version=\"{}\",git=\"{rev}\"}}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(sample(&m, &series), Some(1.0), "{m}");
}

/// The daemon with pod matching against an API server at `kubeconfig`,
/// once every resource is registered.
async fn matching_daemon(dir: &Path, kubeconfig: &Path) -> (App, KubeletSim, String) {
    let extra = matching("n", kubeconfig);
    let listed = [
        (MEM, 1024),
        ("doslab.io/gpu-core", 100),
        ("doslab.io/gpu-count", 1),
    ];
    let toml = mock_config(dir, &extra, &[("GPU-a", 1024)]);
    let (daemon, kubelet) = start_listed(dir, &toml, &listed).await;
    let addr = daemon.http.clone();
    (daemon, kubelet, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_waits_for_the_pod_matcher_to_sync() {
    let dir = tempfile::tempdir().unwrap();
    let files = tempfile::tempdir().unwrap();
    let kubeconfig = files.path().join("kubeconfig");
    // An API server that was there once: the address answers no more.
    let api = gpu_sim::apiserver::ApiServerSim::start().await.unwrap();
    api.write_kubeconfig(&kubeconfig).unwrap();
    api.stop();
    let (daemon, _kubelet, _) = matching_daemon(dir.path(), &kubeconfig).await;
    // Registered, the resources leave /readyz's reasons; the matcher stays.
    let (code, body) = daemon.readyz_until(|_, body| !body.contains(MEM)).await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("pod matcher"), "{body}");
    assert!(!body.contains(MEM), "the resources are registered: {body}");

    let dir = tempfile::tempdir().unwrap();
    let api = gpu_sim::apiserver::ApiServerSim::start().await.unwrap();
    api.write_kubeconfig(&kubeconfig).unwrap();
    let (daemon, _kubelet, _) = matching_daemon(dir.path(), &kubeconfig).await;
    daemon.ready().await;
}
