//! DRA through the real binary against the real kube-apiserver: the test
//! plays the kubelet's plugin watcher and DRA manager over the daemon's unix
//! sockets (registration, then NodePrepareResources and
//! NodeUnprepareResources, v1 and v1beta1), with ResourceClaims the admin
//! creates and allocates by hand (no scheduler runs here). Checked: the
//! CDI spec each claim gets (HAMi-core's and MPS's envs and mounts, from
//! the device plugin's own composer), an answer and an error per claim,
//! idempotency, the checkpoint across a daemon restart, unprepare removing
//! the spec and the cache directory, and the node's ResourceSlice.

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpu_device_plugin::node::dra::proto::registration::registration_client::RegistrationClient;
use gpu_device_plugin::node::dra::proto::registration::{InfoRequest, RegistrationStatus};
use gpu_device_plugin::node::dra::proto::v1::dra_plugin_client::DraPluginClient;
use gpu_device_plugin::node::dra::proto::v1::{
    Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest,
};
use gpu_device_plugin::node::dra::proto::v1beta1;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use support::kube::{ControlPlane, namespace};
use support::{App, WAIT, mock_config, poll_for, real_shared_object};
use tonic::transport::Channel;

const NS: &str = "dra";
const NODE: &str = "node-a";
const DRIVER: &str = "gpu.doslab.io";
const GPUS: &[(&str, u64)] = &[("GPU-a", 16384), ("GPU-b", 16384)];

/// The host directories one daemon uses.
struct Host {
    dir: tempfile::TempDir,
}

impl Host {
    fn new() -> Host {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("device-plugins")).unwrap();
        Host { dir }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// A DRA-only mock node's config, `enforcement` its `[enforcement]`.
    fn config(&self, cp: &ControlPlane, enforcement: &str) -> String {
        self.config_of(cp, enforcement, "", GPUS)
    }

    /// [`Host::config`] of `gpus`, `tail` after its `[dra]` keys (more of
    /// them, then any other table).
    fn config_of(
        &self,
        cp: &ControlPlane,
        enforcement: &str,
        tail: &str,
        gpus: &[(&str, u64)],
    ) -> String {
        let extra = format!(
            "resources = []\nnode_name = \"{NODE}\"\n[matcher]\nkubeconfig = {:?}\n\
             [enforcement]\nlibrary_dir = {:?}\nstate_dir = {:?}\n{enforcement}\n\
             [dra]\nenabled = true\nplugins_registry_dir = {:?}\nplugins_dir = {:?}\n\
             cdi_dir = {:?}\nstate_dir = {:?}\n{tail}\n",
            cp.admin,
            self.path("lib"),
            self.path("state"),
            self.path("registry"),
            self.path("plugins"),
            self.path("cdi"),
            self.path("dra"),
        );
        mock_config(&self.path("device-plugins"), &extra, gpus)
    }

    fn registration_socket(&self) -> PathBuf {
        self.path(&format!("registry/{DRIVER}-reg.sock"))
    }
}

async fn channel(path: &Path) -> Channel {
    poll_for(
        Instant::now() + WAIT,
        async || match path.exists() {
            true => gpu_device_plugin::net::uds::connect(path, Duration::from_secs(5))
                .await
                .ok(),
            false => None,
        },
        || format!("{} never served", path.display()),
    )
    .await
}

/// Registers as the kubelet's plugin watcher does; the DRA endpoint.
async fn register(host: &Host) -> PathBuf {
    let mut reg = RegistrationClient::new(channel(&host.registration_socket()).await);
    let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(
        info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    let endpoint = PathBuf::from(&info.endpoint);
    assert_eq!(endpoint, host.path(&format!("plugins/{DRIVER}/dra.sock")));
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    endpoint
}

/// Creates claim `name` and, with `results`, allocates it as the scheduler
/// would (status subresource, as the admin); its UID.
async fn claim(client: &kube::Client, name: &str, results: Option<Value>) -> String {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), NS);
    let c: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": DRIVER}}
        ]}}
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &c).await.unwrap();
    if let Some(results) = results {
        let status = json!({"status": {"allocation": {"devices": {"results": results}}}});
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
    }
    created.metadata.uid.unwrap()
}

fn result(device: &str, capacity: Option<Value>, share: Option<&str>) -> Value {
    let mut r = json!({"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device});
    if let Some(c) = capacity {
        r["consumedCapacity"] = c;
    }
    if let Some(s) = share {
        r["shareID"] = json!(s);
    }
    r
}

fn claim_ref(name: &str, uid: &str) -> Claim {
    Claim {
        namespace: NS.into(),
        uid: uid.into(),
        name: name.into(),
    }
}

/// A CDI spec's one device's envs and mounts' (container path, host path).
fn spec(path: &str) -> (HashMap<String, String>, Vec<(String, String)>) {
    let v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert_eq!(v["kind"], format!("{DRIVER}/claim"));
    let devices = v["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 1, "{v}");
    let edits = &devices[0]["containerEdits"];
    let envs = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let (k, v) = e.as_str().unwrap().split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect();
    let mounts = edits["mounts"]
        .as_array()
        .map(|m| {
            m.iter()
                .map(|m| {
                    let s = |k: &str| m[k].as_str().unwrap().to_owned();
                    (s("containerPath"), s("hostPath"))
                })
                .collect()
        })
        .unwrap_or_default();
    (envs, mounts)
}

/// The CDI spec file a CDI device ID names, in `cdi_dir`.
fn spec_file(host: &Host, uid: &str) -> String {
    host.path(&format!("cdi/{DRIVER}-{uid}.json"))
        .display()
        .to_string()
}

async fn node(client: &kube::Client) -> String {
    let nodes: Api<Node> = Api::all(client.clone());
    let n: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}
    }))
    .unwrap();
    nodes
        .create(&PostParams::default(), &n)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap()
}

/// The node's slice once `done` holds for it.
async fn slice_where(
    client: &kube::Client,
    daemon: &App,
    done: impl Fn(&ResourceSlice) -> bool,
) -> ResourceSlice {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let name = format!("{NODE}-{DRIVER}");
    let found = std::sync::Mutex::new(None);
    until(daemon, "no such slice", async || {
        let slice = slices.get_opt(&name).await.unwrap().filter(&done);
        let there = slice.is_some();
        *found.lock().unwrap() = slice;
        there
    })
    .await;
    found.into_inner().unwrap().unwrap()
}

/// Waits until `done` holds, polling; says `what` when it never does.
async fn until(daemon: &App, what: &str, done: impl AsyncFn() -> bool) {
    poll_for(
        Instant::now() + WAIT,
        async || done().await.then_some(()),
        || format!("{what}:\n{}", daemon.state()),
    )
    .await
}

/// The real control plane with the test's namespace and Node: it, the
/// admin's client and the Node's UID.
async fn cluster() -> (ControlPlane, kube::Client, String) {
    let cp = ControlPlane::start();
    namespace(&cp, NS);
    let admin = cp.admin_client().await;
    let node_uid = node(&admin).await;
    (cp, admin, node_uid)
}

#[tokio::test(flavor = "multi_thread")]
async fn claims_are_prepared_into_cdi_specs_from_the_device_plugins_composer() {
    let (cp, admin, node_uid) = cluster().await;

    let host = Host::new();
    std::fs::create_dir_all(host.path("lib")).unwrap();
    std::fs::copy(real_shared_object(), host.path("lib/libvgpu.so")).unwrap();
    let toml = host.config(&cp, "mode = \"hami-core\"");
    let daemon = App::start(&toml).await;
    let endpoint = register(&host).await;
    let mut dra = DraPluginClient::new(channel(&endpoint).await);

    let share_id = "6f1c2a52-8d5e-4c1a-9a57-0f6f5d1d1c11";
    let share = claim(
        &admin,
        "share",
        Some(json!([result(
            "gpu-1",
            Some(json!({"memory": "8Gi", "cores": "30"})),
            Some(share_id)
        )])),
    )
    .await;
    let whole = claim(&admin, "whole", Some(json!([result("gpu-0", None, None)]))).await;
    let pending = claim(&admin, "pending", None).await;
    let elsewhere = claim(
        &admin,
        "elsewhere",
        Some(json!([result("gpu-9", None, None)])),
    )
    .await;
    let ask = vec![
        claim_ref("share", &share),
        claim_ref("whole", &whole),
        claim_ref("pending", &pending),
        claim_ref("elsewhere", &elsewhere),
        claim_ref("missing", "0d7c4b6e-0000-4000-8000-000000000000"),
        // The name of a claim whose UID is not the one asked for.
        claim_ref("whole", "0d7c4b6e-0000-4000-8000-000000000001"),
    ];
    let answer = dra
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: ask.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.claims.len(), ask.len(), "{answer:?}");
    let error = |uid: &str| answer.claims[uid].error.clone();
    assert!(
        error(&pending).contains("not allocated"),
        "{}",
        error(&pending)
    );
    assert!(error(&elsewhere).contains("gpu-9"), "{}", error(&elsewhere));
    assert!(
        error("0d7c4b6e-0000-4000-8000-000000000000").contains("does not exist"),
        "{answer:?}"
    );
    assert!(
        error("0d7c4b6e-0000-4000-8000-000000000001").contains(&whole),
        "{answer:?}"
    );

    // The share: its GPU by UUID, its limits as HAMi-core reads them, the
    // library preloaded, a cache directory of its own.
    let s = &answer.claims[&share];
    assert_eq!(s.error, "");
    assert_eq!(s.devices.len(), 1);
    let d = &s.devices[0];
    assert_eq!(
        (d.pool_name.as_str(), d.device_name.as_str()),
        (NODE, "gpu-1")
    );
    assert_eq!(d.share_id.as_deref(), Some(share_id));
    assert_eq!(d.request_names, ["gpu"]);
    assert_eq!(
        d.cdi_device_ids,
        [format!("{DRIVER}/claim=claim-{share}-gpu-{share_id}")]
    );
    let (envs, mounts) = spec(&spec_file(&host, &share));
    assert_eq!(envs["NVIDIA_VISIBLE_DEVICES"], "GPU-b");
    assert_eq!(envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "8192m");
    assert_eq!(envs["CUDA_DEVICE_SM_LIMIT"], "30");
    assert_eq!(envs["DOSLAB_IO_GPU_MEMORY"], "8192");
    assert_eq!(envs["DOSLAB_IO_GPU_CORE"], "30");
    assert_eq!(envs["GPU_CORE_UTILIZATION_POLICY"], "force");
    assert_eq!(
        envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"],
        "/usr/local/vgpu/cache/vgpu.cache"
    );
    let cache = mounts
        .iter()
        .find(|(c, _)| c == "/usr/local/vgpu/cache")
        .map(|(_, h)| PathBuf::from(h))
        .expect("no cache directory mounted");
    assert!(cache.starts_with(host.path("state/claims")), "{cache:?}");
    assert!(cache.is_dir());
    assert!(mounts.iter().any(|(c, _)| c == "/etc/ld.so.preload"));

    // The whole GPU: its UUID, nothing to cap.
    let w = &answer.claims[&whole];
    assert_eq!(w.error, "");
    let (envs, mounts) = spec(&spec_file(&host, &whole));
    assert_eq!(envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
    assert!(!envs.contains_key("CUDA_DEVICE_MEMORY_LIMIT_0"), "{envs:?}");
    assert!(!envs.contains_key("CUDA_DEVICE_SM_LIMIT"), "{envs:?}");
    assert!(mounts.is_empty(), "{mounts:?}");

    // Idempotent, and v1beta1 answers alike (without the share ID).
    let again = dra
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![claim_ref("share", &share)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.claims[&share], answer.claims[&share]);
    let mut beta = v1beta1::wire::dra_plugin_client::DraPluginClient::new(channel(&endpoint).await);
    let b = beta
        .node_prepare_resources(v1beta1::wire::NodePrepareResourcesRequest {
            claims: vec![v1beta1::wire::Claim {
                namespace: NS.into(),
                uid: whole.clone(),
                name: "whole".into(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        b.claims[&whole].devices[0].cdi_device_ids,
        w.devices[0].cdi_device_ids
    );

    // The node's slice: both GPUs, shareable by memory and cores, owned by
    // the Node.
    let slice = slice_where(&admin, &daemon, |_| true).await;
    let owner = &slice.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str()),
        ("Node", node_uid.as_str())
    );
    assert_eq!(slice.spec.driver, DRIVER);
    assert_eq!(slice.spec.pool.name, NODE);
    let devices = slice.spec.devices.as_ref().unwrap();
    assert_eq!(devices.len(), 2);
    for d in devices {
        assert_eq!(d.allow_multiple_allocations, Some(true), "{d:?}");
        let cap = d.capacity.as_ref().unwrap();
        assert_eq!(cap["memory"].value.0, "16Gi");
        assert_eq!(cap["cores"].value.0, "100");
    }
    // The kubelet deletes a node's slices when its DRA manager starts, at
    // any moment after the daemon published: a deleted slice comes back.
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    slices
        .delete(&format!("{NODE}-{DRIVER}"), &Default::default())
        .await
        .unwrap();
    let back = slice_where(&admin, &daemon, |s| s.metadata.uid != slice.metadata.uid).await;
    assert_eq!(back.spec.devices.as_ref().map(Vec::len), Some(2));
    // Published anew: the generation starts again (no older slice is left).
    let first = back.spec.pool.generation;

    // A restart keeps what was prepared: the checkpoint answers, and
    // unprepare removes the spec and the cache directory.
    daemon.stop().await;
    let daemon = App::start(&toml).await;
    let endpoint = register(&host).await;
    let mut dra = DraPluginClient::new(channel(&endpoint).await);
    let after = dra
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![claim_ref("whole", &whole)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(after.claims[&whole], answer.claims[&whole]);
    let gone = dra
        .node_unprepare_resources(NodeUnprepareResourcesRequest {
            claims: vec![claim_ref("share", &share), claim_ref("pending", &pending)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(gone.claims.len(), 2);
    assert!(gone.claims.values().all(|c| c.error.is_empty()), "{gone:?}");
    assert!(!Path::new(&spec_file(&host, &share)).exists());
    assert!(!cache.exists());
    assert!(Path::new(&spec_file(&host, &whole)).exists());
    // Again: nothing left to do, and still an answer.
    let twice = dra
        .node_unprepare_resources(NodeUnprepareResourcesRequest {
            claims: vec![claim_ref("share", &share)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(twice.claims[&share].error, "");
    // The restarted daemon published again, one generation on.
    slice_where(&admin, &daemon, |s| s.spec.pool.generation > first).await;
    drop(daemon);

    // Under MPS a share is an MPS client of its GPU's control daemon, which
    // the daemon starts for DRA's GPUs too (played by a script that, as the
    // real binary does, answers only where `-d` started one).
    let mps_host = Host::new();
    let control = mps_host.path("nvidia-cuda-mps-control");
    std::fs::write(
        &control,
        "#!/bin/sh\nrunning=\"$CUDA_MPS_PIPE_DIRECTORY/control.pid\"\n\
         if [ \"$1\" = -d ]; then mkdir -p \"$CUDA_MPS_PIPE_DIRECTORY\" && touch \"$running\"; exit; fi\n\
         cat >/dev/null\n\
         [ -e \"$running\" ] || { echo Cannot find MPS control daemon process; exit 1; }\necho 100\n",
    )
    .unwrap();
    std::fs::set_permissions(
        &control,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mps = format!(
        "compute = \"mps\"\n[enforcement.mps]\ncontrol_binary = {:?}\npipe_dir = {:?}\n\
         log_dir = {:?}\nshm_dir = {:?}\n",
        control,
        mps_host.path("pipe"),
        mps_host.path("log"),
        mps_host.path("shm")
    );
    let _daemon = App::start(&mps_host.config(&cp, &mps)).await;
    let endpoint = register(&mps_host).await;
    let mut dra = DraPluginClient::new(channel(&endpoint).await);
    let mps_share = claim(
        &admin,
        "mps",
        Some(json!([result(
            "gpu-0",
            Some(json!({"memory": "4Gi", "cores": "25"})),
            Some("2b7e1e0a-3c4f-4c1e-9a63-2f7f0c1d2e3f")
        )])),
    )
    .await;
    let answer = dra
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![claim_ref("mps", &mps_share)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.claims[&mps_share].error, "", "{answer:?}");
    let (envs, mounts) = spec(&spec_file(&mps_host, &mps_share));
    assert_eq!(envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    assert_eq!(envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "GPU-a=4096M");
    assert_eq!(envs["CUDA_MPS_PIPE_DIRECTORY"], "/var/run/nvidia-mps");
    assert!(
        mounts
            .iter()
            .any(|(c, h)| c == "/var/run/nvidia-mps"
                && Path::new(h) == mps_host.path("pipe/GPU-a")),
        "{mounts:?}"
    );
    assert!(mounts.iter().any(|(c, _)| c == "/dev/shm"), "{mounts:?}");

    // A share over two GPUs cannot be an MPS client of both: refused,
    // saying why, and nothing written.
    let share = |device, id| {
        result(
            device,
            Some(json!({"memory": "4Gi", "cores": "25"})),
            Some(id),
        )
    };
    let pair = claim(
        &admin,
        "mps-pair",
        Some(json!([
            share("gpu-0", "5c0d8a44-9b1e-4c59-8a2e-3c1f0e9d7b61"),
            share("gpu-1", "6d1e9b55-ac2f-4d6a-9b3f-4d2a1fae8c72")
        ])),
    )
    .await;
    let answer = dra
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![claim_ref("mps-pair", &pair)],
        })
        .await
        .unwrap()
        .into_inner();
    let error = &answer.claims[&pair].error;
    assert!(error.contains("MPS") && error.contains("2 GPUs"), "{error}");
    assert!(!Path::new(&spec_file(&mps_host, &pair)).exists());
}

/// Rewrites the daemon's config to `toml` and has it reload.
fn reload(daemon: &App, toml: &str) {
    daemon.rewrite(toml);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reload_switching_dra_off_removes_the_slice_and_sockets_and_on_again_restores_them() {
    let (cp, admin, _) = cluster().await;
    let host = Host::new();
    let on = host.config(&cp, "");
    let daemon = App::start(&on).await;
    let endpoint = register(&host).await;
    slice_where(&admin, &daemon, |_| true).await;

    // Off: the device plugin's resources serve the GPUs instead.
    let off = on
        .replace("resources = []\n", "")
        .replace("[dra]\nenabled = true", "[dra]\nenabled = false");
    assert_ne!(off, on);
    reload(&daemon, &off);
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let name = format!("{NODE}-{DRIVER}");
    until(&daemon, "the slice stays", async || {
        slices.get_opt(&name).await.unwrap().is_none()
    })
    .await;
    until(&daemon, "a socket stays", async || {
        !endpoint.exists() && !host.registration_socket().exists()
    })
    .await;

    // On again: it serves, registers and publishes as at a start.
    reload(&daemon, &on);
    assert_eq!(register(&host).await, endpoint);
    let slice = slice_where(&admin, &daemon, |_| true).await;
    assert_eq!(slice.spec.devices.as_ref().map(Vec::len), Some(GPUS.len()));
    let whole = claim(&admin, "after", Some(json!([result("gpu-0", None, None)]))).await;
    let mut dra = DraPluginClient::new(channel(&endpoint).await);
    let answer = dra
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![claim_ref("after", &whole)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.claims[&whole].error, "", "{answer:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unhealthy_gpu_taints_its_device_until_it_is_healthy_again() {
    let (cp, admin, _) = cluster().await;
    let host = Host::new();
    let health = host.path("health");
    std::fs::create_dir(&health).unwrap();
    let tail = format!(
        "[health]\npoll_ms = 50\nrecovery_ms = 300\nmock_dir = {:?}\n",
        health.display().to_string()
    );
    let daemon = App::start(&host.config_of(&cp, "", &tail, GPUS)).await;
    register(&host).await;
    // (key, effect) of the taints device `name` carries.
    let taints = |s: &ResourceSlice, name: &str| -> Vec<(String, String)> {
        let devices = s.spec.devices.iter().flatten();
        let device = devices.into_iter().find(|d| d.name == name).unwrap();
        let taints = device.taints.iter().flatten();
        taints.map(|t| (t.key.clone(), t.effect.clone())).collect()
    };
    let clean = |s: &ResourceSlice| taints(s, "gpu-0").is_empty() && taints(s, "gpu-1").is_empty();
    let first = slice_where(&admin, &daemon, clean).await;

    // A file named after GPU-b makes the mock backend call it unhealthy.
    std::fs::write(health.join("GPU-b"), "").unwrap();
    let tainted = slice_where(&admin, &daemon, |s| !taints(s, "gpu-1").is_empty()).await;
    assert_eq!(
        taints(&tainted, "gpu-1"),
        [(format!("{DRIVER}/unhealthy"), "NoSchedule".to_owned())]
    );
    assert!(taints(&tainted, "gpu-0").is_empty());
    assert!(tainted.spec.pool.generation > first.spec.pool.generation);

    std::fs::remove_file(health.join("GPU-b")).unwrap();
    let healed = slice_where(&admin, &daemon, clean).await;
    assert!(healed.spec.pool.generation > tainted.spec.pool.generation);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_server_keeps_the_standard_attributes_of_a_gpu_the_node_places() {
    let (cp, admin, _) = cluster().await;
    let host = Host::new();
    // A sysfs where GPU-a's device sits under the root complex pci0000:3a,
    // linked as the kernel links it; GPU-b names no bus ID.
    let sysfs = host.path("sys");
    std::fs::create_dir_all(sysfs.join("devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0")).unwrap();
    std::fs::create_dir_all(sysfs.join("bus/pci/devices")).unwrap();
    std::os::unix::fs::symlink(
        "../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0",
        sysfs.join("bus/pci/devices/0000:3b:00.0"),
    )
    .unwrap();
    let plain = host.config(&cp, "");
    let toml = plain
        .replace(
            "backend = \"mock\"\n",
            &format!("backend = \"mock\"\nsysfs_root = {:?}\n", sysfs.display().to_string()),
        )
        .replace(
            "uuid = \"GPU-a\"\nmemory_mib = 16384\n",
            "uuid = \"GPU-a\"\nmemory_mib = 16384\nnuma_node = 1\npci_bus_id = \"00000000:3B:00.0\"\n",
        );
    assert!(
        toml.contains("sysfs_root") && toml.contains("pci_bus_id"),
        "{toml}"
    );
    let daemon = App::start(&toml).await;
    register(&host).await;
    let slice = slice_where(&admin, &daemon, |s| {
        s.spec.devices.iter().flatten().count() == 2
    })
    .await;
    let attributes = |name: &str| -> Value {
        let devices = slice.spec.devices.iter().flatten();
        let device = devices.into_iter().find(|d| d.name == name).unwrap();
        serde_json::to_value(&device.attributes).unwrap()
    };
    let a = attributes("gpu-0");
    assert_eq!(a["resource.kubernetes.io/numaNode"], json!({"int": 1}));
    assert_eq!(
        a["resource.kubernetes.io/pciBusID"],
        json!({"string": "0000:3b:00.0"})
    );
    assert_eq!(
        a["resource.kubernetes.io/pcieRoot"],
        json!({"string": "pci0000:3a"})
    );
    let b = attributes("gpu-1");
    let standard: Vec<&String> = b
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("resource.kubernetes.io/"))
        .collect();
    assert!(standard.is_empty(), "{b}");
}

/// `cargo test --test dra -- --ignored --nocapture prepare_figures`: what
/// NodePrepareResources costs over the daemon's unix socket against the
/// real kube-apiserver (each claim read from it, a cache directory and a
/// CDI spec written, the checkpoint saved), one claim and 32 claims in one
/// call, each round unprepared before the next so every one does the full
/// work; and the bytes of the node's ResourceSlice for 8 GPUs, with
/// consumable capacity and without. Prints; asserts only that every claim
/// was prepared.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "figures for the README"]
async fn prepare_figures() {
    const MANY: usize = 32;
    let (cp, admin, _) = cluster().await;
    let host = Host::new();
    std::fs::create_dir_all(host.path("lib")).unwrap();
    std::fs::copy(real_shared_object(), host.path("lib/libvgpu.so")).unwrap();
    let uuids: Vec<String> = (0..8).map(|i| format!("GPU-{i}")).collect();
    let gpus: Vec<(&str, u64)> = uuids.iter().map(|u| (u.as_str(), 81_920)).collect();
    let hami = "mode = \"hami-core\"";
    let daemon = App::start(&host.config_of(&cp, hami, "", &gpus)).await;
    let endpoint = register(&host).await;
    let mut dra = DraPluginClient::new(channel(&endpoint).await);

    let mut claims = Vec::with_capacity(MANY);
    for i in 0..MANY {
        let name = format!("figure-{i}");
        let share = format!("00000000-0000-4000-8000-{i:012}");
        let consumed = json!({"memory": "2Gi", "cores": "10"});
        let results = json!([result(
            &format!("gpu-{}", i % 8),
            Some(consumed),
            Some(&share)
        )]);
        let uid = claim(&admin, &name, Some(results)).await;
        claims.push(claim_ref(&name, &uid));
    }
    for (label, batch, rounds) in [
        ("one claim", &claims[..1], 200),
        ("32 claims in one call", &claims[..], 40),
    ] {
        let mut samples = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let started = Instant::now();
            let answer = dra
                .node_prepare_resources(NodePrepareResourcesRequest {
                    claims: batch.to_vec(),
                })
                .await
                .unwrap()
                .into_inner();
            samples.push(started.elapsed());
            assert!(
                answer.claims.values().all(|c| c.error.is_empty()),
                "{answer:?}"
            );
            dra.node_unprepare_resources(NodeUnprepareResourcesRequest {
                claims: batch.to_vec(),
            })
            .await
            .unwrap();
        }
        gpu_sim::figures::report(&format!("NodePrepareResources, {label}"), samples);
    }

    // The slice as the API server serves it (a watch delivers the same),
    // and without its managedFields.
    let sizes = |s: &ResourceSlice| {
        let mut bare = s.clone();
        bare.metadata.managed_fields = None;
        let bytes = |s: &ResourceSlice| serde_json::to_vec(s).unwrap().len();
        (bytes(s), bytes(&bare))
    };
    let eight = |s: &ResourceSlice| s.spec.devices.as_ref().is_some_and(|d| d.len() == 8);
    let shared = slice_where(&admin, &daemon, eight).await;
    let (all, bare) = sizes(&shared);
    println!(
        "ResourceSlice, 8 GPUs, consumable capacity: {all} bytes, {bare} without managedFields"
    );
    daemon.stop().await;
    let whole_only = "consumable_capacity = false";
    let daemon = App::start(&host.config_of(&cp, hami, whole_only, &gpus)).await;
    let generation = shared.spec.pool.generation;
    let whole = slice_where(&admin, &daemon, |s| {
        s.spec.pool.generation > generation && eight(s)
    })
    .await;
    let (all, bare) = sizes(&whole);
    println!("ResourceSlice, 8 GPUs, whole GPUs only: {all} bytes, {bare} without managedFields");
}
