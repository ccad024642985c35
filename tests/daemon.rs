//! The daemon (in-process; the real binary where the log or a signal is
//! what is tested) against the kubelet simulator: registration, device
//! lists, preferred allocations, Allocate, bad input, and a clean stop.
//! Without pod matching (these daemons): admission orders that used to put
//! one container's gpu-memory and gpu-core on two GPUs or shared work on a
//! GPU held whole, and requests far larger than any kubelet sends.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use gpu_device_plugin::api::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest,
    PreferredAllocationRequest, RegisterRequest,
};
use gpu_device_plugin::node::plugin::codec::MAX_CONTAINERS;
use gpu_sim::kubelet::{AllocatedResource, merged_envs};
use support::*;
use tonic::Code;

const GPU_A: &str = "GPU-aaaaaaaa-0000-4000-8000-000000000001";
const GPU_B: &str = "GPU-bbbbbbbb-0000-4000-8000-000000000002";
const MEM: &str = "doslab.io/gpu-memory";
const CORE: &str = "doslab.io/gpu-core";
const COUNT: &str = "doslab.io/gpu-count";

/// Two GPUs of 4 GiB and 2 GiB: 6144 memory devices, 200 core, 2 count.
const LISTED: &[(&str, usize)] = &[(MEM, 6144), (CORE, 200), (COUNT, 2)];

fn two_gpus(dir: &std::path::Path) -> String {
    mock_config(dir, "", &[(GPU_A, 4096), (GPU_B, 2048)])
}

async fn started() -> (tempfile::TempDir, App, KubeletSim) {
    let dir = tempfile::tempdir().unwrap();
    let (daemon, kubelet) = start_listed(dir.path(), &two_gpus(dir.path()), LISTED).await;
    (dir, daemon, kubelet)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_all_three_resources_with_every_device_healthy() {
    let (_dir, daemon, kubelet) = started().await;
    let snap = kubelet.snapshot();
    let addr = &daemon.http;
    for (name, _) in LISTED {
        assert_eq!(snap[*name].registrations, 1, "{name}");
        assert!(snap[*name].stream_error.is_none());
        // The daemon's own count agrees with the kubelet's.
        let registered = format!("gpu_device_plugin_registrations_total{{resource=\"{name}\"}}");
        wait_for_sample(addr, &registered, 1.0).await;
    }
    // Short IDs: 2 tag chars at most for two GPUs, so < 20 bytes a device.
    let mem = &snap[MEM];
    assert!(mem.last_message_bytes < 20 * mem.devices, "{mem:?}");
    assert_eq!(http_get(addr, "/readyz").0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_for_a_kubelet_that_is_not_there_yet() {
    let dir = tempfile::tempdir().unwrap();
    // The binary: its log is what is tested.
    let daemon = Daemon::start(&two_gpus(dir.path()));
    // Long enough for several failed attempts and their backoff; the
    // sockets are polled for, as a loaded machine may start them late.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    poll_until(
        std::time::Instant::now() + WAIT,
        || plugin_sockets(dir.path()).len() == 3,
        || {
            format!(
                "plugins serve before any kubelet
{}",
                daemon.shown()
            )
        },
    )
    .await;
    let (code, body) = http_get(&http_addr(&daemon), "/readyz");
    assert_eq!(code, 503, "not ready before it registered: {body}");
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let ok = kubelet.wait_until(WAIT, all_listed(LISTED)).await;
    assert!(ok, "{:?}\n{}", kubelet.snapshot(), daemon.shown());
    // A kubelet that is not up yet is normal at boot: the log says so
    // once per resource, not per retry (the log is what is tested here).
    let log = daemon.log_text();
    assert_eq!(
        log.matches("waiting for the kubelet").count(),
        3,
        "said once per resource:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_ids_are_the_same_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let toml = two_gpus(dir.path());
    let mut ids = Vec::new();
    for _ in 0..2 {
        let daemon = App::start(&toml).await;
        let kubelet = KubeletSim::start(dir.path()).unwrap();
        assert!(kubelet.wait_until(WAIT, all_listed(LISTED)).await);
        // IDs are unique within a resource; memory and core IDs may coincide.
        let set: BTreeSet<(&str, String)> = LISTED
            .iter()
            .flat_map(|(n, _)| kubelet.free_devices(n).into_iter().map(|id| (*n, id)))
            .collect();
        ids.push(set);
        daemon.stop().await;
        kubelet.stop().await;
    }
    assert_eq!(ids[0].len(), 6144 + 200 + 2);
    assert_eq!(ids[0], ids[1]);
    assert!(ids[0].iter().all(|(_, id)| id.len() <= 63));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_allocation_takes_one_gpu_with_the_most_room_left() {
    let (_dir, _daemon, kubelet) = started().await;
    // 3 GiB only fits GPU A; 1 GiB then leaves the most room on GPU B (half
    // of it, where GPU A would be full): a container's second ask is unknown.
    for (size, uuid) in [(3072, GPU_A), (1024, GPU_B)] {
        let grants = kubelet.admit(&[(MEM, size)]).await.unwrap();
        assert_eq!(grants[0].device_ids.len(), size);
        let envs = merged_envs(&grants);
        assert_eq!(envs["NVIDIA_VISIBLE_DEVICES"], uuid, "size {size}");
    }
    // The free IDs now span both GPUs; the hint must still be one GPU.
    let mut client = kubelet.client(MEM).unwrap();
    let free = kubelet.free_devices(MEM);
    let reply = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: free,
                must_include_device_i_ds: vec![],
                allocation_size: 900,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let ids = reply.container_responses[0].device_i_ds.clone();
    assert_eq!(ids.len(), 900);
    let grant = client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!grant.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"].contains(','));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn must_include_ids_are_kept_in_the_hint() {
    let (_dir, _daemon, kubelet) = started().await;
    let mut client = kubelet.client(CORE).unwrap();
    let free = kubelet.free_devices(CORE);
    let must = vec![free[150].clone(), free[151].clone()];
    let reply = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: free,
                must_include_device_i_ds: must.clone(),
                allocation_size: 10,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let ids = &reply.container_responses[0].device_i_ds;
    assert_eq!(ids.len(), 10);
    assert!(must.iter().all(|m| ids.contains(m)));
    assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), 10, "no repeats");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_gets_the_envs_of_spec_4() {
    let (_dir, _daemon, kubelet) = started().await;
    let grants = kubelet.admit(&[(CORE, 25), (MEM, 1500)]).await.unwrap();
    let envs = merged_envs(&grants);
    let gpu = envs["NVIDIA_VISIBLE_DEVICES"].clone();
    assert!(gpu == GPU_A || gpu == GPU_B, "{gpu}");
    assert_eq!(envs["NVIDIA_DRIVER_CAPABILITIES"], "compute,utility");
    assert_eq!(envs["DOSLAB_IO_GPU_MEMORY"], "1500");
    assert_eq!(envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "1500m");
    assert_eq!(envs["DOSLAB_IO_GPU_CORE"], "25");
    assert_eq!(envs["CUDA_DEVICE_SM_LIMIT"], "25");
    // Both shared resources of the container are on one GPU.
    for g in &grants {
        assert_eq!(
            g.response.envs["NVIDIA_VISIBLE_DEVICES"], gpu,
            "{}",
            g.resource
        );
    }
    let whole = kubelet.admit(&[(COUNT, 2)]).await.unwrap();
    let uuids: BTreeSet<&str> = whole[0].response.envs["NVIDIA_VISIBLE_DEVICES"]
        .split(',')
        .collect();
    assert_eq!(uuids, BTreeSet::from([GPU_A, GPU_B]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_duplicate_and_split_ids_are_refused_by_name() {
    let (_dir, _daemon, kubelet) = started().await;
    let mut client = kubelet.client(MEM).unwrap();
    let free = kubelet.free_devices(MEM);
    let allocate = |ids: Vec<String>| AllocateRequest {
        container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
    };
    let e = client
        .allocate(allocate(vec![free[0].clone(), "bogus-7".into()]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("\"bogus-7\""), "{}", e.message());
    let e = client
        .allocate(allocate(vec![free[3].clone(), free[3].clone()]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("twice") && e.message().contains(&free[3]),
        "{}",
        e.message()
    );
    // The first and last free IDs are on different GPUs.
    let e = client
        .allocate(allocate(vec![
            free[0].clone(),
            free[free.len() - 1].clone(),
        ]))
        .await
        .unwrap_err();
    assert!(
        e.message().contains(GPU_A) && e.message().contains(GPU_B),
        "{}",
        e.message()
    );
    let e = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["nope".into()],
                must_include_device_i_ds: vec![],
                allocation_size: 1,
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("\"nope\""));
    // Nothing was lost: a good request still works.
    assert!(kubelet.admit(&[(MEM, 10)]).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_preferred_allocation_requests_are_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let toml = mock_config(
        dir.path(),
        "resources = [\"gpu-memory\"]",
        &[(GPU_A, 81920), (GPU_B, 81920)],
    );
    let (_daemon, kubelet) = start_listed(dir.path(), &toml, &[(MEM, 163_840)]).await;
    let free = kubelet.free_devices(MEM);
    let one = ContainerPreferredAllocationRequest {
        available_device_i_ds: free,
        must_include_device_i_ds: vec![],
        allocation_size: 40_000,
    };
    // Three containers' worth: well over gRPC's default 4 MiB.
    let request = PreferredAllocationRequest {
        container_requests: vec![one.clone(), one.clone(), one],
    };
    let reply = kubelet
        .client(MEM)
        .unwrap()
        .get_preferred_allocation(request)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.container_responses.len(), 3);
    assert!(
        reply
            .container_responses
            .iter()
            .all(|r| r.device_i_ds.len() == 40_000)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_sends_empty_lists_removes_sockets_and_exits_0() {
    // The binary: the signal and the exit status are what is tested.
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(&two_gpus(dir.path()));
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    expect_kubelet(&kubelet, &daemon, &LISTED, all_listed(LISTED)).await;
    daemon.signal(libc::SIGTERM);
    let status = daemon
        .wait_exit(Duration::from_secs(5))
        .expect("exit within 5 s");
    assert!(status.success(), "{status:?}\n{}", daemon.shown());
    let emptied = kubelet
        .wait_until(WAIT, |s| {
            LISTED
                .iter()
                .all(|(n, _)| s.get(*n).is_some_and(|v| !v.stream_open))
        })
        .await;
    assert!(emptied, "{:?}", kubelet.snapshot());
    let snap = kubelet.snapshot();
    for (name, _) in LISTED {
        let v = &snap[*name];
        assert_eq!(v.devices, 0, "{name}: the last list was empty");
        assert!(v.stream_error.is_none(), "{name}: {:?}", v.stream_error);
    }
    assert!(plugin_sockets(dir.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_stand_in_refuses_a_plugin_that_is_not_serving() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let channel = gpu_device_plugin::net::uds::connect(
        &dir.path().join("kubelet.sock"),
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    let mut client = gpu_device_plugin::api::registration_client::RegistrationClient::new(channel);
    let register = |endpoint: &str, name: &str, version: &str| RegisterRequest {
        version: version.into(),
        endpoint: endpoint.into(),
        resource_name: name.into(),
        options: None,
    };
    let e = client
        .register(register("nobody.sock", MEM, "v1beta1"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unknown);
    assert!(e.message().contains("failed to dial"), "{}", e.message());
    let e = client
        .register(register("x.sock", "kubernetes.io/gpu", "v1beta1"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unknown);
    let e = client
        .register(register("x.sock", MEM, "v1alpha"))
        .await
        .unwrap_err();
    assert!(e.message().contains("version"));
    assert!(kubelet.snapshot().is_empty());
}

/// The GPU of every grant of one container.
fn gpus_of(grants: &[AllocatedResource]) -> BTreeSet<String> {
    grants
        .iter()
        .map(|g| g.response.envs["NVIDIA_VISIBLE_DEVICES"].clone())
        .collect()
}

/// Admits each container, each in the order its asks are given, and asserts
/// every one is granted on a single GPU. Returns each container's GPU.
async fn admit_all(kubelet: &KubeletSim, pods: &[&[(&str, usize)]]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, asks) in pods.iter().enumerate() {
        let grants = kubelet
            .admit(asks)
            .await
            .unwrap_or_else(|e| panic!("container {i} {asks:?}: {e}"));
        let gpus = gpus_of(&grants);
        assert_eq!(gpus.len(), 1, "container {i} {asks:?} got {gpus:?}");
        out.extend(gpus);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_core_only_pod_does_not_split_the_containers_after_it() {
    let (_dir, _daemon, kubelet) = started().await;
    admit_all(
        &kubelet,
        &[
            &[(MEM, 100), (CORE, 80)],
            &[(CORE, 30)],
            &[(MEM, 1000), (CORE, 15)],
            &[(CORE, 10), (MEM, 200)],
            &[(MEM, 300), (CORE, 5)],
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_container_reusing_its_init_containers_memory_splits_nothing_after() {
    let (_dir, _daemon, kubelet) = started().await;
    let init = kubelet.admit(&[(MEM, 500)]).await.unwrap();
    // The kubelet hands the init container's memory IDs to the app
    // container, with no GetPreferredAllocation for them.
    let app = kubelet
        .admit_reusing(&[(CORE, 20), (MEM, 500)], &init)
        .await
        .unwrap();
    assert_eq!(gpus_of(&app), gpus_of(&init));
    admit_all(
        &kubelet,
        &[&[(CORE, 90), (MEM, 1000)], &[(MEM, 200), (CORE, 5)]],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_memory_grant_goes_where_compute_is_left() {
    let (_dir, _daemon, kubelet) = started().await;
    // Best fit for 300 MiB is the GPU with 5 % of compute left.
    admit_all(
        &kubelet,
        &[&[(CORE, 95), (MEM, 3000)], &[(MEM, 300), (CORE, 20)]],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_grant_that_cannot_join_the_first_is_refused() {
    let (_dir, daemon, kubelet) = started().await;
    let gpus = admit_all(
        &kubelet,
        &[&[(MEM, 3500), (CORE, 10)], &[(CORE, 95), (MEM, 100)]],
    )
    .await;
    assert_eq!(gpus, [GPU_A, GPU_B]);
    // 500 MiB goes where most of both is left (GPU B, 5 % of compute);
    // 20 % of compute fits only GPU A: the container would get two GPUs.
    let e = kubelet.admit(&[(MEM, 500), (CORE, 20)]).await.unwrap_err();
    assert!(e.contains(GPU_A) && e.contains(GPU_B), "{e}");
    // A memory-only container, then another pod's core-only container: not
    // one container, and not refused.
    let gpus = admit_all(&kubelet, &[&[(MEM, 100)], &[(CORE, 10)]]).await;
    assert_eq!(gpus.len(), 2, "{}", daemon.shown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_gpus_and_shared_work_stay_apart() {
    let (_dir, _daemon, kubelet) = started().await;
    let shared = admit_all(&kubelet, &[&[(MEM, 3000), (CORE, 10)]]).await;
    let whole = kubelet.admit(&[(COUNT, 1)]).await.unwrap();
    let held = whole[0].response.envs["NVIDIA_VISIBLE_DEVICES"].clone();
    assert!(
        !shared.contains(&held),
        "whole GPU {held} carries shared work"
    );
    // Compute alone would pick the GPU held whole (all of its compute free).
    let shared = admit_all(&kubelet, &[&[(CORE, 10), (MEM, 500)]]).await;
    assert!(!shared.contains(&held), "shared work on whole GPU {held}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_requests_are_refused_by_their_bound() {
    let (_dir, daemon, kubelet) = started().await;
    let mut client = kubelet.client(MEM).unwrap();
    let id = kubelet.free_devices(MEM)[0].clone();
    for count in [MAX_CONTAINERS + 1, 300_000] {
        let one = ContainerAllocateRequest {
            devices_ids: vec![id.clone()],
        };
        let e = client
            .allocate(AllocateRequest {
                container_requests: vec![one; count],
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{count}: {e:?}");
        assert!(
            e.message().contains(&format!("at most {MAX_CONTAINERS}")),
            "{}",
            e.message()
        );
        let one = ContainerPreferredAllocationRequest {
            available_device_i_ds: vec![id.clone()],
            must_include_device_i_ds: vec![],
            allocation_size: 1,
        };
        let e = client
            .get_preferred_allocation(PreferredAllocationRequest {
                container_requests: vec![one; count],
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{count}: {e:?}");
        assert!(e.message().contains(&format!("at most {MAX_CONTAINERS}")));
    }
    // Still serving.
    let grants = kubelet.admit(&[(MEM, 10)]).await;
    assert!(grants.is_ok(), "{grants:?}\n{}", daemon.shown());
}
