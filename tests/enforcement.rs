//! Enforcement through the real binary: `install-enforcement` (the init
//! container's job) on temporary host directories, and the config's
//! `[enforcement]` checks as `check-config` reports them.

mod support;

use std::path::Path;
use std::process::{Command, Output};

use support::{BIN, real_shared_object};

fn install(from: &Path, to: &Path) -> Output {
    Command::new(BIN)
        .arg("install-enforcement")
        .arg("--from")
        .arg(from)
        .arg("--to")
        .arg(to)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn install_enforcement_puts_a_checked_library_in_place() {
    let host = tempfile::tempdir().unwrap();
    let to = host.path().join("usr/local/vgpu");
    let out = install(&real_shared_object(), &to);
    assert!(out.status.success(), "{}", stderr(&out));
    let dest = to.join("libvgpu.so");
    assert_eq!(
        std::fs::read(&dest).unwrap(),
        std::fs::read(real_shared_object()).unwrap()
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("Replaced"));
    let again = install(&real_shared_object(), &to);
    assert!(String::from_utf8_lossy(&again.stdout).contains("Unchanged"));

    // Not a shared object: refused by name and reason, the old copy kept.
    let text = host.path().join("libvgpu.so.txt");
    std::fs::write(&text, "#!/bin/sh\n").unwrap();
    let out = install(&text, &to);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains(&*text.to_string_lossy()) && err.contains("not an ELF"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&dest).unwrap(),
        std::fs::read(real_shared_object()).unwrap()
    );
    assert_eq!(std::fs::read_dir(&to).unwrap().count(), 1, "a leftover");

    // A host directory that cannot be made: a clear error, nothing written.
    let blocked = host.path().join("blocked");
    std::fs::write(&blocked, "a file").unwrap();
    let out = install(&real_shared_object(), &blocked.join("vgpu"));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("blocked"), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&blocked).unwrap(), "a file");
}

#[test]
fn check_config_names_a_bad_enforcement_path() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    let toml = support::mock_config(
        dir.path(),
        "[enforcement]\nmode = \"hami-core\"\ncontainer_library_path = \"/x/lib vgpu.so\"",
        &[("GPU-a", 1024)],
    );
    std::fs::write(&config, toml).unwrap();
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .arg("check-config")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("enforcement.container_library_path") && err.contains("ld.so.preload"),
        "{err}"
    );
}

const MEMORY: &str = "doslab.io/gpu-memory";
const COUNT: &str = "doslab.io/gpu-count";
const CORE: &str = "doslab.io/gpu-core";
const NODE: &str = "node-1";

/// A node with enforcement on: the kubelet stand-in, the daemon
/// (in-process, or the binary where its log is tested), and the host's
/// library and state directories in a temporary directory.
struct Node<D = support::App> {
    _dir: tempfile::TempDir,
    host: tempfile::TempDir,
    kubelet: support::KubeletSim,
    daemon: D,
}

impl Node {
    /// With the library and pod matching against a fresh API-server
    /// stand-in (the kubeconfig lives in the returned directory).
    async fn start_matching() -> (gpu_sim::apiserver::ApiServerSim, tempfile::TempDir, Node) {
        let api = gpu_sim::apiserver::ApiServerSim::start().await.unwrap();
        let files = tempfile::tempdir().unwrap();
        let kubeconfig = files.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let node = Node::start(true, &support::matching(NODE, &kubeconfig)).await;
        (api, files, node)
    }
}

impl<D: support::Start> Node<D> {
    /// `library`: whether `libvgpu.so` is installed before the start.
    async fn start(library: bool, extra: &str) -> Node<D> {
        let dir = tempfile::tempdir().unwrap();
        let host = tempfile::tempdir().unwrap();
        let lib = host.path().join("vgpu");
        std::fs::create_dir(&lib).unwrap();
        if library {
            install_library(&lib);
        }
        let toml = support::mock_config(
            dir.path(),
            &format!(
                "{extra}\n[health]\npoll_ms = 100\n[enforcement]\nmode = \"hami-core\"\nlibrary_dir = {:?}\nstate_dir = {:?}",
                lib.display().to_string(),
                host.path().join("state").display().to_string()
            ),
            &[("GPU-a", 1024), ("GPU-b", 1024)],
        );
        let kubelet = support::KubeletSim::start(dir.path()).unwrap();
        let daemon = D::start(&toml).await;
        let ok = kubelet
            .wait_until(
                support::WAIT,
                support::all_listed(&[(MEMORY, 2048), (CORE, 200), (COUNT, 2)]),
            )
            .await;
        assert!(ok, "{}", daemon.shown());
        Node {
            _dir: dir,
            host,
            kubelet,
            daemon,
        }
    }

    fn library_dir(&self) -> std::path::PathBuf {
        self.host.path().join("vgpu")
    }

    fn containers(&self) -> std::path::PathBuf {
        self.host.path().join("state/containers")
    }

    fn cache_dirs(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.containers())
            .map(|r| {
                r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    async fn readyz_until(&self, done: impl Fn(u16, &str) -> bool) -> (u16, String) {
        support::get_until(&self.daemon.http_addr(), "/readyz", done).await
    }

    async fn metrics_until(&self, done: impl Fn(&str) -> bool) -> String {
        let addr = self.daemon.http_addr();
        support::get_until(&addr, "/metrics", |_, body| done(body))
            .await
            .1
    }
}

fn install_library(dir: &Path) {
    std::fs::copy(real_shared_object(), dir.join("libvgpu.so")).unwrap();
}

fn mount<'a>(
    r: &'a gpu_device_plugin::api::ContainerAllocateResponse,
    target: &str,
) -> Option<&'a gpu_device_plugin::api::Mount> {
    r.mounts.iter().find(|m| m.container_path == target)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_grant_preloads_the_library_and_a_whole_gpu_does_not() {
    let node = Node::<support::App>::start(true, "").await;
    let grants = node.kubelet.admit(&[(MEMORY, 4)]).await.unwrap();
    let r = &grants[0].response;
    let preload = mount(r, "/etc/ld.so.preload").expect("no ld.so.preload mount");
    assert!(preload.read_only);
    assert_eq!(
        std::fs::read_to_string(&preload.host_path).unwrap(),
        "/usr/local/vgpu/libvgpu.so\n"
    );
    let lib = mount(r, "/usr/local/vgpu/libvgpu.so").expect("no library mount");
    assert!(lib.read_only);
    assert_eq!(
        Path::new(&lib.host_path),
        node.library_dir().join("libvgpu.so")
    );
    assert!(mount(r, "/tmp/vgpulock").is_some());
    assert_eq!(r.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "4m");
    // A gpu-core grant is a cap even alone on the GPU (the default policy).
    assert_eq!(r.envs["GPU_CORE_UTILIZATION_POLICY"], "force");
    // Without pod matching no Allocate knows its container: the usage
    // region stays in the container's /tmp, and nothing is made on the
    // host to be left behind.
    assert_eq!(r.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"], "/tmp/vgpu.cache");
    assert!(mount(r, "/usr/local/vgpu/cache").is_none(), "{r:?}");
    assert!(node.cache_dirs().is_empty(), "{:?}", node.cache_dirs());
    // A container asking both: its two Allocates agree on every mount and
    // on the region's path, so the kubelet's merge drops nothing that was
    // made for it.
    let pair = node.kubelet.admit(&[(MEMORY, 4), (CORE, 2)]).await.unwrap();
    let (m, c) = (&pair[0].response, &pair[1].response);
    let key = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
    assert_eq!(m.envs[key], c.envs[key]);
    assert_eq!(m.mounts, c.mounts);
    assert!(node.cache_dirs().is_empty(), "{:?}", node.cache_dirs());

    let whole = node.kubelet.admit(&[(COUNT, 1)]).await.unwrap();
    assert!(
        whole[0].response.mounts.is_empty(),
        "{:?}",
        whole[0].response
    );
    assert!(
        !whole[0]
            .response
            .envs
            .contains_key("CUDA_DEVICE_MEMORY_SHARED_CACHE")
    );
    let (code, body) = node.readyz_until(|c, _| c == 200).await;
    assert_eq!(code, 200, "{body}");
    let metrics = node
        .metrics_until(|m| {
            support::sample(m, "gpu_device_plugin_enforcement_cache_dirs") == Some(0.0)
        })
        .await;
    assert_eq!(
        support::sample(&metrics, "gpu_device_plugin_enforcement_cache_dirs"),
        Some(0.0),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_library_shared_grants_are_refused_and_readiness_is_false() {
    let node = Node::<support::App>::start(false, "").await;
    let path = node.library_dir().join("libvgpu.so");
    let path = path.display().to_string();
    let (code, body) = node
        .readyz_until(|c, b| c == 503 && b.contains("enforcement"))
        .await;
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("enforcement") && body.contains(&path),
        "{body}"
    );

    let err = node.kubelet.admit(&[(MEMORY, 4)]).await.unwrap_err();
    assert!(
        err.contains(&path) && err.contains("does not exist"),
        "{err}"
    );
    assert!(node.cache_dirs().is_empty(), "{:?}", node.cache_dirs());
    // A whole GPU needs no library.
    let whole = node.kubelet.admit(&[(COUNT, 1)]).await.unwrap();
    assert!(whole[0].response.mounts.is_empty());
    let (_, metrics) = support::http_get(&node.daemon.http, "/metrics");
    assert!(
        metrics.contains(
            "resource=\"doslab.io/gpu-memory\",rpc=\"allocate\",reason=\"enforcement\"} 1"
        ),
        "{metrics}"
    );
    // (That the sweeper tells a change once, not on every check, is its
    // unit test's.)

    // The init container installs it: ready again, and shared grants work.
    install_library(&node.library_dir());
    let (code, body) = node.readyz_until(|c, _| c == 200).await;
    assert_eq!(code, 200, "{body}");
    let grants = node.kubelet.admit(&[(MEMORY, 4)]).await.unwrap();
    assert!(mount(&grants[0].response, "/etc/ld.so.preload").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_pod_matching_directories_follow_pods_and_refusals_reach_the_pod() {
    use gpu_sim::apiserver::PodContainer;
    let (api, _files, node) = Node::start_matching().await;
    let app = |name: &str| PodContainer {
        name: name.into(),
        init: false,
        restartable: false,
        wants: [4, 0, 0],
    };
    api.add_pod("default", "p", NODE, &[app("app")], &[]);
    api.add_pod("default", "q", NODE, &[app("main")], &[]);
    let uid = |name: &str| {
        api.pod("default", name).unwrap()["metadata"]["uid"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    node.kubelet.admit(&[(MEMORY, 4)]).await.unwrap();
    node.kubelet.admit(&[(MEMORY, 4)]).await.unwrap();
    let (p, q) = (format!("{}_app", uid("p")), format!("{}_main", uid("q")));
    let mut both = vec![p.clone(), q.clone()];
    both.sort();
    assert_eq!(node.cache_dirs(), both);

    api.delete_pod("default", "p");
    let deadline = std::time::Instant::now() + support::WAIT;
    support::poll_until(
        deadline,
        || node.cache_dirs().len() <= 1,
        || node.daemon.state(),
    )
    .await;
    assert_eq!(node.cache_dirs(), [q], "{}", node.daemon.state());

    // The library goes away: the next pod's Allocate is refused, an Event
    // on the pod says why, and its ledger records nothing.
    std::fs::remove_file(node.library_dir().join("libvgpu.so")).unwrap();
    api.add_pod("default", "r", NODE, &[app("app")], &[]);
    node.daemon.wait_for_sample(support::POD_CACHE, 2.0).await;
    let err = node.kubelet.admit(&[(MEMORY, 4)]).await.unwrap_err();
    assert!(err.contains("libvgpu.so"), "{err}");
    let event = support::poll_for(
        std::time::Instant::now() + support::WAIT,
        async || {
            let events = api.events();
            events.into_iter().find(|e| e["regarding"]["name"] == "r")
        },
        || "no event".into(),
    )
    .await;
    assert_eq!(event["type"], "Warning");
    assert!(
        event["note"].as_str().unwrap().contains("libvgpu.so"),
        "{event}"
    );
    let r = api.pod("default", "r").unwrap();
    assert!(
        r["metadata"]["annotations"]
            .get("doslab.io/gpu-ledger")
            .is_none(),
        "{r}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_cache_directory_cannot_be_made_records_nothing() {
    use gpu_sim::apiserver::{ApiServerSim, PodContainer};
    let (api, _files, node) = Node::start_matching().await;
    let app = PodContainer {
        name: "app".into(),
        init: false,
        restartable: false,
        wants: [4, 0, 0],
    };
    api.add_pod("default", "p", NODE, std::slice::from_ref(&app), &[]);
    // The library is there, so the check passes; the state directory is a
    // file, so the container's cache directory cannot be made.
    let state = node.host.path().join("state");
    let _ = std::fs::remove_dir_all(&state);
    std::fs::write(&state, "not a directory").unwrap();
    node.daemon.wait_for_sample(support::POD_CACHE, 1.0).await;
    let err = node.kubelet.admit(&[(MEMORY, 4)]).await.unwrap_err();
    assert!(err.contains("enforcement state"), "{err}");
    let ledger = |api: &ApiServerSim| {
        api.pod("default", "p").unwrap()["metadata"]["annotations"]
            .get("doslab.io/gpu-ledger")
            .cloned()
    };
    assert_eq!(ledger(&api), None, "a refused grant is not recorded");
    // Once the directory can be made, the same container is served.
    std::fs::remove_file(&state).unwrap();
    let grants = node.kubelet.admit(&[(MEMORY, 4)]).await.unwrap();
    assert!(mount(&grants[0].response, "/etc/ld.so.preload").is_some());
    assert!(ledger(&api).is_some());
}

#[test]
fn check_config_fails_on_a_node_without_the_library_and_notes_it_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("vgpu");
    let config = dir.path().join("config.toml");
    let toml = support::mock_config(
        dir.path(),
        &format!(
            "[enforcement]\nmode = \"hami-core\"\nlibrary_dir = {:?}",
            lib.display().to_string()
        ),
        &[("GPU-a", 1024)],
    );
    std::fs::write(&config, toml).unwrap();
    let check = || {
        Command::new(BIN)
            .arg("--config")
            .arg(&config)
            .arg("check-config")
            .output()
            .unwrap()
    };
    // Off the node: no library directory, a note.
    let out = check();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("note:") && text.contains(&*lib.to_string_lossy()),
        "{text}"
    );
    // On the node: the directory is there and the library is not a
    // shared object.
    std::fs::create_dir(&lib).unwrap();
    std::fs::write(lib.join("libvgpu.so"), "not a library").unwrap();
    let out = check();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains(&*lib.join("libvgpu.so").to_string_lossy()) && err.contains("not an ELF"),
        "{err}"
    );
    install_library(&lib);
    let out = check();
    assert!(out.status.success(), "{}", stderr(&out));
}
