//! The real Kubernetes components as a test fixture: tests/kube's peers
//! (the unmodified kube-apiserver, kube-controller-manager, kube-scheduler
//! and the kubelet's device manager, plugin watcher and DRA manager), built
//! once into target/, with the real daemon on each node and the real
//! extender beside the scheduler.
//! The deploy/ manifests are applied as shipped, and each component runs
//! as its own identity: the daemon with a token bound to its pod on its
//! node, the scheduler and the extender as `doslab-gpu-scheduler`.

use std::collections::BTreeMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
use serde_json::Value;

use super::{Daemon, mock_config, poll_for, poll_sync, poll_within, start_extender_with};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// How long a component may take to come up on a loaded 2-core machine.
pub const START: Duration = Duration::from_secs(120);

/// The label of a reachable daemon's pod ([`KubeNode::start_reachable`]),
/// for `kubectl gpu top --daemon-selector`.
pub const REACHABLE_DAEMON: &str = "gpu-device-plugin.test/reachable";

/// The peers binary (tests/kube), built when its Go sources or go.sum
/// changed since the last build.
pub fn peers() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| go_binary("tests/kube", "kube-peers"))
}

/// The Prometheus peer (tests/monitoring), built likewise.
pub fn monitoring() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| go_binary("tests/monitoring", "monitoring"))
}

/// The Prometheus Operator's CustomResourceDefinition `file` (under its
/// `example/prometheus-operator-crd/`), from its Go module as the proxy
/// serves it (v0.89.0: the newest the proxy has of the whole module; the
/// API types the rules are decoded with are v0.95.2's).
pub fn prometheus_operator_crd(file: &str) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let out = Command::new("go")
            .args([
                "mod",
                "download",
                "-json",
                "github.com/prometheus-operator/prometheus-operator@v0.89.0",
            ])
            .output()
            .expect("go is needed for the Prometheus Operator's CRDs");
        let info: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(out.status.success(), "go mod download: {info}");
        PathBuf::from(info["Dir"].as_str().unwrap())
    });
    dir.join("example/prometheus-operator-crd").join(file)
}

/// The Go module at `module` (relative to the repository) built as `name`
/// under the target directory, again only when its Go sources or go.sum
/// changed since the last build (a stamp beside it holds their hash).
/// Panics naming the missing tool when `go` is not on PATH.
fn go_binary(module: &str, name: &str) -> PathBuf {
    let src = Path::new(ROOT).join(module);
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(ROOT).join("target"));
    let out = target.join(name);
    let bin = out.join(name);
    let stamp = out.join(format!("{name}.stamp"));
    let hash = source_hash(&src).to_string();
    if bin.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(&hash) {
        return bin;
    }
    std::fs::create_dir_all(&out).unwrap();
    let started = Instant::now();
    let status = Command::new("go")
        .args(["build", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(&src)
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "the tests against real components need Go 1.26+ on PATH to build {module} \
                 (`go build` could not start: {e})"
            )
        });
    assert!(status.success(), "go build of {module} failed: {status}");
    eprintln!("{name} built in {:.0} s", started.elapsed().as_secs_f64());
    std::fs::write(&stamp, hash).unwrap();
    bin
}

fn source_hash(src: &Path) -> u64 {
    let mut names: Vec<PathBuf> = std::fs::read_dir(src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "go")
                || p.file_name()
                    .is_some_and(|n| n == "go.mod" || n == "go.sum")
        })
        .collect();
    names.sort();
    let mut h = DefaultHasher::new();
    for name in names {
        h.write(name.file_name().unwrap().as_encoded_bytes());
        h.write(&std::fs::read(&name).unwrap());
    }
    h.finish()
}

/// A child process killed with its owner.
pub struct Proc {
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    fn spawn(args: &[&std::ffi::OsStr], log: PathBuf) -> Proc {
        let child = Command::new(peers())
            .args(args)
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::options().append(true).open(&log).unwrap())
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        Proc { child, log }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGTERM first, so the kubelet peer's namespace child and the
        // control plane's children go with it.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        let child = &mut self.child;
        if poll_sync(deadline, || matches!(child.try_wait(), Ok(Some(_)))) {
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// etcd, kube-apiserver and kube-controller-manager, with deploy/ applied.
pub struct ControlPlane {
    pub dir: tempfile::TempDir,
    pub admin: PathBuf,
    /// The scheduler's (and so the extender's) identity.
    pub scheduler: PathBuf,
    proc: Proc,
}

/// The client config `kubeconfig` names.
async fn client_config(kubeconfig: &Path) -> kube::Config {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
    kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap()
}

impl ControlPlane {
    pub fn start() -> ControlPlane {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let proc = Proc::spawn(
            &["controlplane".as_ref(), "--dir".as_ref(), state.as_os_str()],
            dir.path().join("controlplane.log"),
        );
        let ready = poll_sync(Instant::now() + START, || state.join("ready").exists());
        assert!(ready, "control plane not ready:\n{}", proc.log_text());
        let admin = state.join("admin.kubeconfig");
        let mut cp = ControlPlane {
            scheduler: dir.path().join("scheduler.kubeconfig"),
            dir,
            admin,
            proc,
        };
        for k in ["deploy", "deploy/scheduler", "deploy/scheduler/mutating"] {
            cp.peers_ok(&[
                "apply",
                "--kubeconfig",
                cp.admin.to_str().unwrap(),
                "-k",
                Path::new(ROOT).join(k).to_str().unwrap(),
            ]);
        }
        cp.scheduler = cp.token("kube-system", "doslab-gpu-scheduler", None);
        cp.wait_policies();
        cp
    }

    /// The process running etcd, the API server and the controller manager.
    pub fn pid(&self) -> u32 {
        self.proc.child.id()
    }

    /// Waits until the API server enforces the applied admission policies:
    /// their informers sync a moment after the apply returns. The probe is
    /// a dry-run pod the shipped quantity policy refuses.
    fn wait_policies(&self) {
        let probe = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "policy-probe", "namespace": "default"},
            "spec": {"containers": [{"name": "c", "image": "x",
                "resources": {"limits": {"doslab.io/gpu-memory": "4Gi"}}}]}
        });
        // start() is called from the tests' multi-threaded runtimes.
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async {
                let pods: Api<Pod> = Api::namespaced(self.admin_client().await, "default");
                let probe: Pod = serde_json::from_value(probe).unwrap();
                let dry = PostParams {
                    dry_run: true,
                    ..Default::default()
                };
                poll_for(
                    Instant::now() + START,
                    async || pods.create(&dry, &probe).await.is_err().then_some(()),
                    || "admission policies never enforced".into(),
                )
                .await;
            })
        });
    }

    /// Runs a peers subcommand to its end; panics with its output on failure.
    pub fn peers_ok(&self, args: &[&str]) {
        let out = Command::new(peers()).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "kube-peers {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A kubeconfig for service account `namespace/name`, its token bound to
    /// `pod` when given.
    pub fn token(&self, namespace: &str, name: &str, pod: Option<&str>) -> PathBuf {
        let out = self.dir.path().join(format!(
            "{namespace}-{name}-{}.kubeconfig",
            pod.unwrap_or("")
        ));
        let mut args = vec![
            "token",
            "--kubeconfig",
            self.admin.to_str().unwrap(),
            "--namespace",
            namespace,
            "--name",
            name,
            "--out",
            out.to_str().unwrap(),
        ];
        if let Some(pod) = pod {
            args.extend(["--pod", pod]);
        }
        self.peers_ok(&args);
        out
    }

    /// Applies YAML manifests as the admin.
    pub fn apply(&self, yaml: &str) {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), yaml).unwrap();
        self.peers_ok(&[
            "apply",
            "--kubeconfig",
            self.admin.to_str().unwrap(),
            "-f",
            file.path().to_str().unwrap(),
        ]);
    }

    /// A client with the identity of `kubeconfig`.
    pub async fn client_as(kubeconfig: &Path) -> kube::Client {
        kube::Client::try_from(client_config(kubeconfig).await).unwrap()
    }

    pub async fn admin_client(&self) -> kube::Client {
        ControlPlane::client_as(&self.admin).await
    }

    /// The admin impersonating `user` (in `system:authenticated`): a
    /// cluster identity such as `system:kube-scheduler`, which no token
    /// here names.
    pub async fn client_impersonating(&self, user: &str) -> kube::Client {
        let mut config = client_config(&self.admin).await;
        config.auth_info.impersonate = Some(user.to_owned());
        config.auth_info.impersonate_groups = Some(vec!["system:authenticated".to_owned()]);
        kube::Client::try_from(config).unwrap()
    }

    /// Kills the API server; the control plane starts a new one on the same
    /// port and etcd a second later. Returns when it answers `/readyz` again,
    /// with the instant it did.
    pub async fn restart_apiserver(&self) -> Instant {
        let pid_file = self.dir.path().join("state/kube-apiserver.pid");
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let client = self.admin_client().await;
        poll_for(
            Instant::now() + START,
            async || {
                let new_pid = std::fs::read_to_string(&pid_file).unwrap_or_default();
                if new_pid.trim() == pid.to_string() {
                    return None;
                }
                let req = http::Request::get("/readyz").body(Vec::new()).unwrap();
                client.request_text(req).await.ok().map(|_| Instant::now())
            },
            || "kube-apiserver never came back".into(),
        )
        .await
    }

    pub fn apiserver_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("state/kube-apiserver.log"))
            .unwrap_or_default()
    }

    pub fn log_text(&self) -> String {
        self.proc.log_text()
    }
}

/// One node: the kubelet peer and the real daemon beside it.
pub struct KubeNode {
    pub name: String,
    pub dir: tempfile::TempDir,
    pub kubelet: Proc,
    pub daemon: Daemon,
    /// The daemon's config, for a restart.
    config: String,
    /// The daemon's kubeconfig (its token bound to its pod).
    pub kubeconfig: PathBuf,
    pub gpus: usize,
    /// The kubelet's own flags (`--node-ip`, capacities), for a restart.
    kubelet_flags: Vec<String>,
}

impl KubeNode {
    /// Node `name` with mock `gpus` (uuid, MiB); `top` adds top-level keys
    /// to the daemon's config (pod matching is on, enforcement off).
    pub async fn start(cp: &ControlPlane, name: &str, gpus: &[(&str, u64)], top: &str) -> KubeNode {
        KubeNode::start_at(cp, name, gpus, top, None, Vec::new()).await
    }

    /// As [`KubeNode::start`], the Node's `cpu`, `memory` and `pods`
    /// capacity as given (quantities), which the scheduler counts and the
    /// kubelet's admission checks.
    pub async fn start_sized(
        cp: &ControlPlane,
        name: &str,
        gpus: &[(&str, u64)],
        top: &str,
        [cpu, memory, pods, labels]: [&str; 4],
    ) -> KubeNode {
        let flags = [
            ("--cpu", cpu),
            ("--memory", memory),
            ("--pods", pods),
            ("--node-labels", labels),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_owned(), value.to_owned()])
        .collect();
        KubeNode::start_at(cp, name, gpus, top, None, flags).await
    }

    /// As [`KubeNode::start`], with the daemon reachable as a DaemonSet's
    /// pod is: its pod on the host network with the container port `http`
    /// its `/metrics` listens on, at `ip` (the node's IP, which the kubelet
    /// reports as the pod's), so the API server's pod proxy reaches it. The
    /// proxy refuses loopback: `ip` is one of [`super::host_ip`]'s.
    pub async fn start_reachable(
        cp: &ControlPlane,
        name: &str,
        gpus: &[(&str, u64)],
        top: &str,
        ip: std::net::IpAddr,
    ) -> KubeNode {
        KubeNode::start_at(cp, name, gpus, top, Some(ip), Vec::new()).await
    }

    async fn start_at(
        cp: &ControlPlane,
        name: &str,
        gpus: &[(&str, u64)],
        top: &str,
        ip: Option<std::net::IpAddr>,
        capacity: Vec<String>,
    ) -> KubeNode {
        let node = KubeNode::launch(cp, name, gpus, ip, capacity, |_, kubeconfig| {
            format!(
                "pod_matching = true\n{top}\n[matcher]\nkubeconfig = {:?}\n\
                 [enforcement]\nmode = \"none\"\n",
                kubeconfig.display().to_string()
            )
        });
        node.wait_allocatable(cp).await;
        node
    }

    /// Node `name` whose mock `gpus` are served by the daemon's DRA plugin
    /// alone (`resources = []`), with DRA mode's objects applied as shipped; `tables` are the daemon's `[enforcement]` and any other
    /// tables of its config. Returns once the node's ResourceSlice lists
    /// every GPU and the node is schedulable.
    pub async fn start_dra(
        cp: &ControlPlane,
        name: &str,
        gpus: &[(&str, u64)],
        tables: &str,
    ) -> KubeNode {
        // DRA mode as shipped: the daemon's rights become DRA's, and the
        // DeviceClass and the ResourceSlice policy come with it.
        let overlay = super::dra_overlay();
        cp.peers_ok(&[
            "apply",
            "--kubeconfig",
            cp.admin.to_str().unwrap(),
            "-k",
            overlay.to_str().unwrap(),
        ]);
        let node = KubeNode::launch(cp, name, gpus, None, Vec::new(), |dir, kubeconfig| {
            format!(
                "resources = []\npod_matching = false\n[matcher]\nkubeconfig = {:?}\n{tables}\n\
                 [dra]\nenabled = true\nplugins_registry_dir = {:?}\nplugins_dir = {:?}\n\
                 cdi_dir = {:?}\nstate_dir = {:?}\n",
                kubeconfig.display().to_string(),
                dir.join("kubelet/plugins_registry"),
                dir.join("kubelet/plugins"),
                dir.join("cdi"),
                dir.join("dra"),
            )
        });
        node.wait_sliced(cp).await;
        node
    }

    /// The kubelet peer and the daemon of node `name`, not yet waited for;
    /// `config(dir, kubeconfig)` gives the daemon's config after its
    /// `node_name`, from the node's directory and the daemon's kubeconfig.
    fn launch(
        cp: &ControlPlane,
        name: &str,
        gpus: &[(&str, u64)],
        ip: Option<std::net::IpAddr>,
        capacity: Vec<String>,
        config: impl FnOnce(&Path, &Path) -> String,
    ) -> KubeNode {
        let mut kubelet_flags = capacity;
        if let Some(ip) = ip {
            kubelet_flags.extend(["--node-ip".into(), ip.to_string()]);
        }
        let dir = tempfile::tempdir().unwrap();
        let plugins = dir.path().join("device-plugins");
        std::fs::create_dir_all(&plugins).unwrap();
        // The kubelet makes its own at start; a DRA driver started first
        // finds them too.
        for sub in ["kubelet/plugins_registry", "kubelet/plugins", "cdi"] {
            std::fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        // The kubelet's own identity, system:node:<name>: the Node
        // authorizer and NodeRestriction judge what it does.
        cp.peers_ok(&[
            "node-kubeconfig",
            "--dir",
            cp.dir.path().join("state").to_str().unwrap(),
            "--node",
            name,
            "--out",
            dir.path().join("kubelet.kubeconfig").to_str().unwrap(),
        ]);
        let kubelet = KubeNode::spawn_kubelet(name, dir.path(), &kubelet_flags);
        // Where a reachable daemon listens: a free port at `ip`.
        let listen = ip.map(|ip| {
            let socket = std::net::TcpListener::bind((ip, 0)).unwrap();
            socket.local_addr().unwrap()
        });
        let (network, ports, labels) = match listen {
            Some(at) => (
                "\n  hostNetwork: true",
                format!(", ports: [{{name: http, containerPort: {}}}]", at.port()),
                format!(", labels: {{{REACHABLE_DAEMON}: \"true\"}}"),
            ),
            None => ("", String::new(), String::new()),
        };
        // The daemon's own pod on this node, as its DaemonSet would make it:
        // its token carries the node's name. Not with the DaemonSet's
        // label: its controller would adopt the pod and delete it (its
        // node affinity excludes these nodes), and the token with it.
        let pod = format!("gpu-device-plugin-{name}");
        cp.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {pod}, namespace: gpu-device-plugin{labels}}}\n\
             spec:\n  nodeName: {name}\n  serviceAccountName: gpu-device-plugin{network}\n  \
             containers: [{{name: plugin, image: gpu-device-plugin{ports}}}]\n"
        ));
        let kubeconfig = cp.token("gpu-device-plugin", "gpu-device-plugin", Some(&pod));
        let top = format!(
            "node_name = \"{name}\"\n{}",
            config(dir.path(), &kubeconfig)
        );
        let mut config = mock_config(&plugins, &top, gpus);
        if let Some(at) = listen {
            config = config.replace(
                "http_listen = \"127.0.0.1:0\"",
                &format!("http_listen = \"{at}\""),
            );
        }
        KubeNode {
            name: name.into(),
            daemon: Daemon::start(&config),
            config,
            kubeconfig,
            kubelet,
            dir,
            gpus: gpus.len(),
            kubelet_flags,
        }
    }

    /// Waits until this node's ResourceSlice lists every GPU and the node
    /// lifecycle controller has lifted the not-ready taint.
    pub async fn wait_sliced(&self, cp: &ControlPlane) {
        let client = cp.admin_client().await;
        let nodes: Api<Node> = Api::all(client.clone());
        let slices: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(client);
        let sliced = async || {
            let untainted = nodes
                .get(&self.name)
                .await
                .is_ok_and(|n| n.spec.and_then(|s| s.taints).is_none_or(|t| t.is_empty()));
            let listed = slices.list(&Default::default()).await.is_ok_and(|l| {
                l.items.iter().any(|s| {
                    s.spec.node_name.as_deref() == Some(&self.name)
                        && s.spec.devices.as_ref().map_or(0, Vec::len) == self.gpus
                })
            });
            (untainted && listed).then_some(())
        };
        poll_for(Instant::now() + START, sliced, || {
            format!(
                "node {} never published its slice\nkubelet:\n{}\ndaemon:\n{}",
                self.name,
                self.kubelet.log_text(),
                self.daemon.log_text()
            )
        })
        .await;
    }

    fn spawn_kubelet(name: &str, dir: &Path, flags: &[String]) -> Proc {
        let paths = ["kubelet.kubeconfig", "kubelet", "device-plugins"].map(|p| dir.join(p));
        let mut args: Vec<&std::ffi::OsStr> = vec![
            "kubelet".as_ref(),
            "--kubeconfig".as_ref(),
            paths[0].as_os_str(),
            "--node".as_ref(),
            name.as_ref(),
            "--root".as_ref(),
            paths[1].as_os_str(),
            "--device-plugins".as_ref(),
            paths[2].as_os_str(),
        ];
        args.extend(flags.iter().map(std::ffi::OsStr::new));
        Proc::spawn(
            &args,
            dir.join(format!(
                "kubelet-{}.log",
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_millis()
            )),
        )
    }

    /// Waits until the Node's allocatable lists every GPU as gpu-count and
    /// some gpu-memory and gpu-core, the Node carries the daemon's GPU
    /// inventory, and the node lifecycle controller has lifted the
    /// not-ready taint. Each resource registers on its own: a pod admitted
    /// before the kubelet has one's devices is admitted without it (the
    /// kubelet drops extended resources its node lacks), so every one must
    /// be listed, not just the count. Until the inventory is there the
    /// extender refuses the node, and a pod would be unschedulable for it.
    pub async fn wait_allocatable(&self, cp: &ControlPlane) {
        let nodes: Api<Node> = Api::all(cp.admin_client().await);
        let allocatable = async || {
            let node = nodes.get(&self.name).await.ok()?;
            let tainted = node
                .spec
                .as_ref()
                .is_some_and(|s| s.taints.as_ref().is_some_and(|t| !t.is_empty()));
            let allocatable = node.status.and_then(|s| s.allocatable).unwrap_or_default();
            let listed = |resource: &str| {
                allocatable
                    .get(resource)
                    .is_some_and(|q| !q.0.is_empty() && q.0 != "0")
            };
            let count = allocatable.get("doslab.io/gpu-count").map(|q| q.0.as_str());
            let inventory = node
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key("doslab.io/gpu-inventory"));
            (!tainted
                && inventory
                && count == Some(self.gpus.to_string().as_str())
                && listed("doslab.io/gpu-memory")
                && listed("doslab.io/gpu-core"))
            .then_some(())
        };
        poll_for(Instant::now() + START, allocatable, || {
            format!(
                "node {} never listed its GPUs\nkubelet:\n{}\ndaemon:\n{}",
                self.name,
                self.kubelet.log_text(),
                self.daemon.log_text()
            )
        })
        .await;
    }

    /// Kills the kubelet and starts a new one, as a kubelet restart does:
    /// the device-plugin directory is wiped but for the checkpoint, and a
    /// new kubelet.sock appears.
    pub async fn restart_kubelet(&mut self) {
        unsafe { libc::kill(self.kubelet.child.id() as i32, libc::SIGKILL) };
        let _ = self.kubelet.child.wait();
        self.kubelet = KubeNode::spawn_kubelet(&self.name, self.dir.path(), &self.kubelet_flags);
    }

    /// The kubelet's plugins_registry (`<root>/plugins_registry`): its
    /// plugin watcher dials each `<driver>-reg.sock` put here (GetInfo, then
    /// NotifyRegistrationStatus) and hands a DRA driver to its DRA manager.
    pub fn plugins_registry(&self) -> PathBuf {
        self.dir.path().join("kubelet/plugins_registry")
    }

    /// The kubelet's plugins directory (`<root>/plugins`): a DRA driver
    /// serves `dra.sock` in `<this>/<driver>/` and names that endpoint in
    /// GetInfo; the kubelet dials whatever endpoint it names.
    pub fn plugins_dir(&self) -> PathBuf {
        self.dir.path().join("kubelet/plugins")
    }

    /// The node's CDI spec directory (the runtime's `/var/run/cdi`), for a
    /// DRA driver to write the specs of the CDI devices it hands out.
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    /// The test-only DRA driver (`kube-peers dra-test-driver`, the upstream
    /// kubelet plugin helper) on this node as `driver`, registered through
    /// the node's plugins_registry and publishing its ResourceSlice as the
    /// admin; `args` adds its flags (`--devices N`, `--fail-prepares N`).
    pub fn start_test_dra_driver(
        &self,
        cp: &ControlPlane,
        driver: &str,
        args: &[&str],
    ) -> TestDraDriver {
        let calls = self.dir.path().join(format!("{driver}.calls"));
        let mut all: Vec<&std::ffi::OsStr> = vec![
            "dra-test-driver".as_ref(),
            "--kubeconfig".as_ref(),
            cp.admin.as_os_str(),
            "--node".as_ref(),
            self.name.as_ref(),
            "--driver".as_ref(),
            driver.as_ref(),
            "--calls".as_ref(),
            calls.as_os_str(),
        ];
        let (registry, plugins) = (self.plugins_registry(), self.plugins_dir());
        all.extend(["--registry".as_ref(), registry.as_os_str()]);
        all.extend(["--plugins".as_ref(), plugins.as_os_str()]);
        all.extend(args.iter().map(std::ffi::OsStr::new));
        let proc = Proc::spawn(&all, self.dir.path().join(format!("{driver}.log")));
        TestDraDriver { proc, calls }
    }

    /// Stops the daemon (SIGTERM, as its pod's deletion does) and starts it
    /// again on the same config.
    pub fn restart_daemon(&mut self) {
        self.replace_daemon(libc::SIGTERM);
    }

    /// Kills the daemon (`kill -9`, as a crash or an OOM kill ends it)
    /// and starts it again on the same config, as its DaemonSet would.
    pub fn kill_daemon(&mut self) {
        self.replace_daemon(libc::SIGKILL);
    }

    /// Ends the daemon with `signal` and starts it again on its config.
    fn replace_daemon(&mut self, signal: i32) {
        self.daemon.signal(signal);
        self.daemon.wait_exit(Duration::from_secs(20));
        self.daemon = Daemon::start(&self.config);
    }

    /// Rewrites the daemon's config file to `toml` and sends it SIGHUP,
    /// as an operator's edit of its ConfigMap and a reload do; a later
    /// restart starts on `toml`.
    pub fn reload_daemon(&mut self, toml: String) {
        std::fs::write(&self.daemon.config, &toml).unwrap();
        self.config = toml;
        self.daemon.signal(libc::SIGHUP);
    }

    /// The daemon's config now.
    pub fn config(&self) -> &str {
        &self.config
    }

    /// The kubelet's kubeconfig (its identity `system:node:<name>`).
    pub fn kubelet_kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubelet.kubeconfig")
    }

    /// What the kubelet recorded for pod `namespace/name`: admitted or not,
    /// the reason, each container's envs, mounts, devices and CDI devices.
    pub fn record(&self, namespace: &str, name: &str) -> Option<Value> {
        record_in(self.dir.path(), namespace, name)
    }
}

/// [`KubeNode::record`] of the node whose directory is `dir`.
pub fn record_in(dir: &Path, namespace: &str, name: &str) -> Option<Value> {
    let path = dir
        .join("kubelet/pods")
        .join(format!("{namespace}_{name}.json"));
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
}

/// The test-only DRA driver of [`KubeNode::start_test_dra_driver`].
pub struct TestDraDriver {
    pub proc: Proc,
    calls: PathBuf,
}

impl TestDraDriver {
    /// What the driver saw so far, one JSON object each, in order:
    /// `{"op": "registered", "error"?}` once the kubelet confirmed its
    /// registration, `{"op": "prepare", "claim": uid, "name", "devices":
    /// [CDI IDs], "error"?}` and `{"op": "unprepare", "claim", "name"}` per
    /// claim of each NodePrepareResources and NodeUnprepareResources.
    pub fn calls(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.calls)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

/// The kube-scheduler on the shipped profile, with the real extender.
pub struct Scheduler {
    pub extender: Daemon,
    pub url: String,
    pub proc: Proc,
    /// What a restart starts again on: kube-scheduler's config file, the
    /// extender's identity and its extra config.
    config: PathBuf,
    kubeconfig: PathBuf,
    extender_toml: String,
}

impl Scheduler {
    /// The shipped `scheduler.yaml` with only the extender's URL and the
    /// kubeconfig set, the extender on its defaults.
    pub fn start(cp: &ControlPlane) -> Scheduler {
        Scheduler::start_with(cp, "")
    }

    /// [`Scheduler::start`], `extender_toml` added to the extender's config.
    pub fn start_with(cp: &ControlPlane, extender_toml: &str) -> Scheduler {
        Scheduler::spawn(cp, extender_toml, true, |_| {})
    }

    /// [`Scheduler::start_with`] on the shipped profile changed by `edit`.
    pub fn start_edited(
        cp: &ControlPlane,
        extender_toml: &str,
        edit: impl FnOnce(&mut serde_yaml::Value),
    ) -> Scheduler {
        Scheduler::spawn(cp, extender_toml, true, edit)
    }

    /// [`Scheduler::start`] with leader election off. A kube-scheduler
    /// that cannot renew its lease within the renew deadline (10 s) exits
    /// for its Deployment to restart it; nothing restarts it here, so a
    /// test that keeps the API server mostly down for longer needs this.
    pub fn start_unelected(cp: &ControlPlane) -> Scheduler {
        Scheduler::spawn(cp, "", false, |_| {})
    }

    fn spawn(
        cp: &ControlPlane,
        extender_toml: &str,
        elect: bool,
        edit: impl FnOnce(&mut serde_yaml::Value),
    ) -> Scheduler {
        let (extender, url) = start_extender_with(&cp.scheduler, extender_toml);
        let mut profile = shipped_profile(&url, &cp.scheduler);
        profile["leaderElection"]["leaderElect"] = elect.into();
        edit(&mut profile);
        let config = cp.dir.path().join("scheduler.yaml");
        std::fs::write(&config, serde_yaml::to_string(&profile).unwrap()).unwrap();
        Scheduler {
            proc: Scheduler::spawn_scheduler(&config, "kube-scheduler.log"),
            extender,
            url,
            config,
            kubeconfig: cp.scheduler.clone(),
            extender_toml: extender_toml.to_owned(),
        }
    }

    /// kube-scheduler on `config`, logging to `log` beside it.
    fn spawn_scheduler(config: &Path, log: &str) -> Proc {
        Proc::spawn(
            &[
                "kube-scheduler".as_ref(),
                "--config".as_ref(),
                config.as_os_str(),
                "--secure-port=0".as_ref(),
            ],
            config.with_file_name(log),
        )
    }

    /// Kills kube-scheduler (`kill -9`) and starts a new one on the same
    /// config, its log a new file (`restart` numbers it).
    pub fn kill_scheduler(&mut self, restart: usize) {
        unsafe { libc::kill(self.proc.child.id() as i32, libc::SIGKILL) };
        let _ = self.proc.child.wait();
        self.proc =
            Scheduler::spawn_scheduler(&self.config, &format!("kube-scheduler-{restart}.log"));
    }

    /// Kills the extender (`kill -9`) and starts a new one on the same
    /// address, the one kube-scheduler calls.
    pub fn kill_extender(&mut self) {
        self.extender.signal(libc::SIGKILL);
        self.extender.wait_exit(Duration::from_secs(20));
        let listen = self.url.trim_start_matches("http://");
        let (extender, _) = super::start_extender_at(&self.kubeconfig, listen, &self.extender_toml);
        self.extender = extender;
    }
}

/// kube-scheduler on its default profile with no extender, as the GPU
/// scheduler's identity: what a cluster serving GPUs through DRA alone
/// runs (its DynamicResources plugin places shares itself).
///
/// `KUBE_PLAIN_SCHEDULER_QPS` (a bench knob) sets its client's rate, the
/// burst twice that (upstream's default: 50 requests/s, bursts of 100).
pub fn start_plain_scheduler(cp: &ControlPlane) -> Proc {
    let config = cp.dir.path().join("plain-scheduler.yaml");
    let rate = std::env::var("KUBE_PLAIN_SCHEDULER_QPS")
        .map(|s| {
            let qps: u32 = s
                .parse()
                .expect("KUBE_PLAIN_SCHEDULER_QPS: requests per second");
            format!("  qps: {qps}\n  burst: {}\n", 2 * qps)
        })
        .unwrap_or_default();
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n\
             leaderElection:\n  leaderElect: false\nclientConnection:\n  kubeconfig: {:?}\n\
             {rate}",
            cp.scheduler.display().to_string()
        ),
    )
    .unwrap();
    Proc::spawn(
        &[
            "kube-scheduler".as_ref(),
            "--config".as_ref(),
            config.as_os_str(),
            "--secure-port=0".as_ref(),
        ],
        cp.dir.path().join("plain-scheduler.log"),
    )
}

/// deploy/scheduler/configmap.yaml's `scheduler.yaml`, its extender at
/// `url` and its client on `kubeconfig`.
pub fn shipped_profile(url: &str, kubeconfig: &Path) -> serde_yaml::Value {
    let map: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(Path::new(ROOT).join("deploy/scheduler/configmap.yaml")).unwrap(),
    )
    .unwrap();
    let mut profile: serde_yaml::Value =
        serde_yaml::from_str(map["data"]["scheduler.yaml"].as_str().unwrap()).unwrap();
    profile["extenders"][0]["urlPrefix"] = url.into();
    if profile.get("clientConnection").is_none() {
        profile["clientConnection"] = serde_yaml::Mapping::new().into();
    }
    profile["clientConnection"]["kubeconfig"] = kubeconfig.display().to_string().into();
    profile
}

/// A pod of `namespace` asking, per container, (gpu-memory, gpu-core,
/// gpu-count) devices; zero asks are left out. Init containers are named
/// `init-*`.
pub fn gpu_pod(namespace: &str, name: &str, containers: &[(&str, [u64; 3])]) -> Pod {
    let spec = |(cname, wants): &(&str, [u64; 3])| {
        let mut limits = serde_json::Map::new();
        for (i, r) in ["gpu-memory", "gpu-core", "gpu-count"].iter().enumerate() {
            if wants[i] > 0 {
                limits.insert(format!("doslab.io/{r}"), wants[i].to_string().into());
            }
        }
        serde_json::json!({"name": cname, "image": "app", "resources": {"limits": limits}})
    };
    let (init, app): (Vec<_>, Vec<_>) = containers.iter().partition(|c| c.0.starts_with("init-"));
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "initContainers": init.into_iter().map(spec).collect::<Vec<_>>(),
            "containers": app.into_iter().map(spec).collect::<Vec<_>>(),
        }
    }))
    .unwrap()
}

/// A ResourceClaimTemplate `namespace/name` of the product's DeviceClass
/// `class`, its one request `gpu` asking `capacity` (name, quantity): none
/// asks a whole GPU.
pub fn claim_template(
    namespace: &str,
    name: &str,
    class: &str,
    capacity: &[(&str, &str)],
) -> String {
    let capacity = if capacity.is_empty() {
        String::new()
    } else {
        let asks: Vec<String> = capacity
            .iter()
            .map(|(k, v)| format!("{k}: \"{v}\""))
            .collect();
        format!(", capacity: {{requests: {{{}}}}}", asks.join(", "))
    };
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\n\
         metadata: {{name: {name}, namespace: {namespace}}}\n\
         spec:\n  spec:\n    devices:\n      requests:\n      - name: gpu\n        \
         exactly: {{deviceClassName: {class}{capacity}}}\n"
    )
}

/// A pod of one container `main` using a claim from `template`.
pub fn claim_pod(namespace: &str, name: &str, template: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [{"name": "main", "image": "app", "resources": {"claims": [{"name": "gpu"}]}}],
        }
    }))
    .unwrap()
}

/// Creates a namespace as the admin, with its `default` ServiceAccount:
/// the controller manager makes that one in its own time, and a pod
/// created before it exists is refused by ServiceAccount admission once
/// its short retry runs out.
pub fn namespace(cp: &ControlPlane, name: &str) {
    cp.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}}}\n---\n\
         apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: default, namespace: {name}}}\n"
    ));
}

/// Creates `pod`; returns the instant it was created.
pub async fn create(client: &kube::Client, pod: &Pod) -> Instant {
    let ns = pod.metadata.namespace.as_deref().unwrap();
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), pod).await.unwrap();
    Instant::now()
}

/// The scheduler's verdict that no node takes the pod.
pub fn unschedulable(pod: &Pod) -> Option<String> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    conditions
        .iter()
        .find(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        })
        .map(|c| c.message.clone().unwrap_or_default())
}

/// Creates `pod` and waits until it runs, fails or is unschedulable (a
/// minute at most, else fails the test with `logs(node)`, `node` the one
/// it was bound to if any); returns it then.
pub async fn create_and_decide(
    client: &kube::Client,
    pod: &Pod,
    logs: impl Fn(Option<&str>) -> String,
) -> Pod {
    let ns = pod.metadata.namespace.as_deref().unwrap();
    let name = pod.metadata.name.clone().unwrap();
    create(client, pod).await;
    wait_pod(client, ns, &name, Duration::from_secs(60), |p| {
        matches!(phase(p), "Running" | "Failed") || unschedulable(p).is_some()
    })
    .await
    .unwrap_or_else(|p| {
        let node = p
            .as_ref()
            .and_then(|p| p.spec.as_ref()?.node_name.as_deref());
        panic!(
            "{name} neither ran nor was unschedulable: {p:#?}\n{}",
            logs(node)
        )
    })
}

/// Waits until pod `namespace/name` satisfies `done`; returns it.
pub async fn wait_pod(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    within: Duration,
    done: impl Fn(&Pod) -> bool,
) -> Result<Pod, Option<Pod>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let last = std::cell::RefCell::new(None);
    let found = poll_within(Instant::now() + within, async || {
        let pod = api.get_opt(name).await.ok().flatten();
        let hit = pod.as_ref().filter(|p| done(p)).cloned();
        *last.borrow_mut() = pod;
        hit
    })
    .await;
    found.ok_or_else(|| last.into_inner())
}

/// The mock GPU `gpu` of node `node`, its UUID telling both apart.
pub fn gpu_uuid(node: usize, gpu: usize) -> String {
    format!("GPU-{node:04x}{gpu:04x}-0000-4000-8000-000000000000")
}

/// The node a pod is bound to; empty while it is not.
pub fn node_of(pod: &Pod) -> &str {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default()
}

/// Each container's envs in a kubelet record ([`KubeNode::record`]), as
/// the device manager hands them to the runtime.
pub fn container_envs(
    record: &Value,
) -> std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>> {
    let mut out = std::collections::BTreeMap::new();
    for (name, opts) in record["containers"].as_object().into_iter().flatten() {
        let envs = opts["Envs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                (
                    e["Name"].as_str().unwrap().to_owned(),
                    e["Value"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        out.insert(name.clone(), envs);
    }
    out
}

/// The CDI device IDs the kubelet handed `container` for its
/// ResourceClaims, in a kubelet record ([`KubeNode::record`]).
pub fn cdi_devices(record: &Value, container: &str) -> Vec<String> {
    record["cdiDevices"][container]
        .as_array()
        .into_iter()
        .flatten()
        .map(|id| id.as_str().unwrap().to_owned())
        .collect()
}

/// The CDI spec file in CDI directory `dir` holding device `id`
/// (`<kind>=<name>`), and the envs that device's edits and the spec's give
/// a container, as the runtime applies them; `None` if no spec holds it.
pub fn cdi_envs_in(dir: &Path, id: &str) -> Option<(PathBuf, BTreeMap<String, String>)> {
    let (kind, name) = id.split_once('=')?;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let Ok(spec) = serde_json::from_slice::<Value>(&std::fs::read(&path).unwrap_or_default())
        else {
            continue;
        };
        let Some(device) = spec["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|d| spec["kind"] == kind && d["name"] == name)
        else {
            continue;
        };
        let envs = [&spec["containerEdits"], &device["containerEdits"]]
            .into_iter()
            .flat_map(|e| e["env"].as_array().cloned().unwrap_or_default())
            .filter_map(|kv| {
                let (k, v) = kv.as_str()?.split_once('=')?;
                Some((k.to_owned(), v.to_owned()))
            })
            .collect();
        return Some((path, envs));
    }
    None
}

/// The device-plugin daemon's rights beside DRA mode's: [`KubeNode::start_dra`]
/// applies DRA mode's kustomize Component, whose ClusterRole replaces the
/// base's; a cluster running both keeps the base ClusterRole and its binding
/// too, under another name, as the chart grants both sets.
pub fn device_plugin_rights_beside_dra(cp: &ControlPlane) {
    let base = |file: &str| {
        std::fs::read_to_string(Path::new(ROOT).join(file))
            .unwrap()
            .replace(
                "\n  name: gpu-device-plugin\n",
                "\n  name: gpu-device-plugin-dp\n",
            )
    };
    cp.apply(&format!(
        "{}\n---\n{}",
        base("deploy/clusterrole.yaml"),
        base("deploy/clusterrolebinding.yaml")
    ));
}

pub fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

type SeenAt = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, Instant>>>;

/// When each pod of a namespace was first seen bound, from a watch (so a
/// burst's latencies do not depend on the order the test polls in).
pub struct Bindings {
    seen: SeenAt,
    task: tokio::task::JoinHandle<()>,
}

impl Bindings {
    pub fn watch(client: &kube::Client, namespace: &str) -> Bindings {
        use futures::StreamExt;
        use kube::runtime::WatchStreamExt;
        let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let seen = SeenAt::default();
        let map = std::sync::Arc::clone(&seen);
        let task = tokio::spawn(async move {
            let mut events = kube::runtime::watcher(api, Default::default())
                .applied_objects()
                .boxed();
            while let Some(event) = events.next().await {
                let Ok(pod) = event else { continue };
                let bound = pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_ref())
                    .is_some();
                if bound && let Some(name) = pod.metadata.name {
                    map.lock().unwrap().entry(name).or_insert_with(Instant::now);
                }
            }
        });
        Bindings { seen, task }
    }

    /// When `name` was first seen bound.
    pub fn at(&self, name: &str) -> Option<Instant> {
        self.seen.lock().unwrap().get(name).copied()
    }
}

impl Drop for Bindings {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits until pod `namespace/name` is gone from the API server.
pub async fn wait_gone(client: &kube::Client, namespace: &str, name: &str, within: Duration) {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    poll_for(
        Instant::now() + within,
        async || {
            api.get_opt(name)
                .await
                .ok()
                .flatten()
                .is_none()
                .then_some(())
        },
        || format!("{namespace}/{name} never went"),
    )
    .await
}

/// Nodes `node-<i>` with `nodes[i]` GPUs of the given MiB each
/// ([`gpu_uuid`]), one daemon per node with `top` in its config, and the
/// tenants' namespace `ns`.
pub async fn cluster(cp: &ControlPlane, ns: &str, nodes: &[&[u64]], top: &str) -> Vec<KubeNode> {
    let mut out = Vec::new();
    for (n, gpus) in nodes.iter().enumerate() {
        let ids: Vec<(String, u64)> = gpus
            .iter()
            .enumerate()
            .map(|(g, mib)| (gpu_uuid(n, g), *mib))
            .collect();
        let ids: Vec<(&str, u64)> = ids.iter().map(|(u, m)| (u.as_str(), *m)).collect();
        out.push(KubeNode::start(cp, &format!("node-{n}"), &ids, top).await);
    }
    namespace(cp, ns);
    out
}

/// Containers whose resources' own Allocate responses name different GPUs
/// (the kubelet merges envs first-wins, which would hide the split).
pub fn splits(record: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for (name, resources) in record["resources"].as_object().into_iter().flatten() {
        let gpus: std::collections::BTreeSet<&str> = resources
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(_, envs)| envs["NVIDIA_VISIBLE_DEVICES"].as_str())
            .collect();
        if gpus.len() > 1 {
            out.push(format!("{name}: {gpus:?}"));
        }
    }
    out
}

/// kube-scheduler's FailedScheduling Events of namespace `ns` that report
/// a failed bind: the extender's refusal ("cannot bind") or the bind call
/// failing (its note names the bind verb's URL). The other notes are the
/// filter's: its failures ("0/N nodes are available") and its errors (the
/// extender not synced yet, no place for a bind), which bind nothing.
pub async fn refused_binds(client: &kube::Client, ns: &str) -> Vec<String> {
    failed_scheduling(client, ns)
        .await
        .into_iter()
        .filter_map(|e| e.note)
        .filter(|note| note.contains("cannot bind") || note.contains("/bind"))
        .collect()
}

/// The notes of kube-scheduler's FailedScheduling Events on pod
/// `ns/name`: each attempt that did not place it, with why.
pub async fn scheduling_failures(client: &kube::Client, ns: &str, name: &str) -> Vec<String> {
    failed_scheduling(client, ns)
        .await
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| e.note.unwrap_or_default())
        .collect()
}

/// kube-scheduler's FailedScheduling Events of namespace `ns`.
async fn failed_scheduling(
    client: &kube::Client,
    ns: &str,
) -> Vec<k8s_openapi::api::events::v1::Event> {
    let events: kube::Api<k8s_openapi::api::events::v1::Event> =
        kube::Api::namespaced(client.clone(), ns);
    let list = events.list(&Default::default()).await.unwrap();
    list.items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("FailedScheduling"))
        .collect()
}

/// The tails of every component's log, for a failing assertion.
pub fn logs(cp: &ControlPlane, nodes: &[KubeNode], sched: &Scheduler) -> String {
    let mut s = format!(
        "--- scheduler\n{}\n--- extender\n{}\n",
        tail(&sched.proc.log_text()),
        tail(&sched.extender.log_text())
    );
    for n in nodes {
        s += &format!(
            "--- {} kubelet\n{}\n--- {} daemon\n{}\n",
            n.name,
            tail(&n.kubelet.log_text()),
            n.name,
            tail(&n.daemon.log_text())
        );
    }
    s + &format!("--- control plane\n{}", tail(&cp.log_text()))
}

pub fn tail(s: &str) -> &str {
    let at = s.len().saturating_sub(6000);
    let at = (at..s.len()).find(|i| s.is_char_boundary(*i)).unwrap_or(0);
    &s[at..]
}

/// The usage monitor's stand-ins under a test's directory: the GPUs'
/// process lists (what NVML would report) and the host's /proc (each
/// process's cgroup).
pub struct FakeDriver {
    procs: PathBuf,
    proc_root: PathBuf,
}

impl FakeDriver {
    pub fn new(host: &Path) -> FakeDriver {
        let driver = FakeDriver {
            procs: host.join("procs"),
            proc_root: host.join("proc"),
        };
        std::fs::create_dir_all(&driver.procs).unwrap();
        driver
    }

    /// The daemon's `[usage]` table: polled every 200 ms, from these.
    pub fn toml(&self) -> String {
        format!(
            "[usage]\npoll_ms = 200\nmock_dir = {:?}\nproc_root = {:?}\n",
            self.procs.display().to_string(),
            self.proc_root.display().to_string()
        )
    }

    /// Process `pid` has `cgroup`.
    pub fn process(&self, pid: u32, cgroup: &str) {
        std::fs::create_dir_all(self.proc_root.join(pid.to_string())).unwrap();
        std::fs::write(self.proc_root.join(format!("{pid}/cgroup")), cgroup).unwrap();
    }

    /// Process `pid` runs in the first container of `pod`, as the kubelet
    /// reported its ID, in the systemd driver's cgroup v2 form.
    pub fn process_of(&self, pid: u32, pod: &Pod) {
        let uid = pod.metadata.uid.clone().unwrap().replace('-', "_");
        let status = pod.status.as_ref().unwrap();
        let container = &status.container_statuses.as_ref().unwrap()[0];
        let id = container.container_id.as_deref().unwrap();
        let id = id.split_once("://").unwrap().1;
        self.process(
            pid,
            &format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/\
                 cri-containerd-{id}.scope\n"
            ),
        );
    }

    /// GPU `gpu` runs `lines` (`pid memory_bytes sm_percent` each).
    pub fn lists(&self, gpu: &str, lines: &str) {
        std::fs::write(self.procs.join(format!("{gpu}.procs")), lines).unwrap();
    }
}
