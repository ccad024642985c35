//! The matching rules over hand-built pods: which container an Allocate
//! serves, and which GPU it gets.

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::ObjectMeta;

use super::pods::{Arrival, PodKey, PodView, PodWarning};
use super::{Ask, Decision, MatchError, decide, record};
use crate::rules::device::Resource::{self, GpuCore, GpuCount, GpuMemory};
use crate::rules::device::{Gpu, Offer, PerResource, Units};
use crate::rules::usage::{Assignment, ContainerAsk, Inventory, Keys, Ledger, ids_digest};

/// Two GPUs of 1000 MiB, 1 MiB and 1 % per device.
fn node() -> Inventory {
    gpus_of_1000_mib(&["GPU-a", "GPU-b"])
}

/// GPUs `uuids` of 1000 MiB each, 1 MiB and 1 % per device.
pub(crate) fn gpus_of_1000_mib(uuids: &[&str]) -> Inventory {
    let gpus: Vec<Gpu> = (0..)
        .zip(uuids)
        .map(|(index, uuid)| Gpu {
            uuid: (*uuid).into(),
            memory_mib: 1000,
            index,
            numa_node: None,
        })
        .collect();
    let offer = Offer {
        resources: Resource::ALL.to_vec(),
        units: Units {
            memory_unit_mib: 1,
            cores_per_gpu: 100,
        },
    };
    Inventory::new(&gpus, &offer)
}

fn container(name: &str, mem: u64, core: u64, count: u64) -> ContainerAsk {
    ContainerAsk {
        name: name.into(),
        init: false,
        restartable: false,
        devices: PerResource {
            memory: mem,
            core,
            count,
        },
        invalid: None,
    }
}

fn pod(name: &str, created: i128, containers: Vec<ContainerAsk>) -> PodView {
    PodView {
        key: PodKey {
            namespace: "default".into(),
            name: name.into(),
        },
        uid: format!("uid-{name}"),
        admitting: true,
        live: true,
        deleting: false,
        assume_time: None,
        arrival: Arrival::default(),
        created,
        gpu_uuid: None,
        assignment: Assignment::default(),
        containers,
        ledger: Ledger::default(),
        resource_version: "1".into(),
    }
}

/// Pods of (name, creation time), each one container `c` asking 10
/// gpu-memory devices: candidates told apart by their order alone.
fn tens(pods: &[(&str, i128)]) -> Vec<PodView> {
    pods.iter()
        .map(|&(name, created)| pod(name, created, vec![container("c", 10, 0, 0)]))
        .collect()
}

fn ask(resource: Resource, devices: u64, gpus: &[usize], ids: &[&str]) -> Ask {
    Ask {
        resource,
        devices,
        digest: (!ids.is_empty()).then(|| ids_digest(ids.iter().copied())),
        id_gpus: gpus.to_vec(),
    }
}

/// Decides and records, as the actor does.
fn serve(pods: &mut [PodView], a: &Ask) -> Result<Decision, MatchError> {
    let d = decide(&node(), pods, a)?;
    if !d.repeat {
        let p = pods.iter_mut().find(|p| p.key == d.pod).unwrap();
        record(&mut p.ledger, &node(), a, &d);
    }
    Ok(d)
}

fn who(d: &Decision) -> (String, String, Vec<usize>) {
    (d.pod.name.clone(), d.container.clone(), d.gpus.clone())
}

/// As the kubelet admits: by arrival; a batch (a list) by creation time,
/// whatever its pods' assume-times.
#[test]
fn order_is_arrival_then_creation_in_a_batch_then_assume_time() {
    let mut pods = tens(&[
        ("later", 1),
        ("batch-new", 8),
        ("batch-old", 7),
        ("one-b", 9),
        ("one-a", 9),
    ]);
    let arrivals = [(3, false), (2, true), (2, true), (1, false), (1, false)];
    for (p, (seq, batch)) in pods.iter_mut().zip(arrivals) {
        p.arrival = Arrival { seq, batch };
    }
    pods[1].assume_time = Some(1);
    pods[2].assume_time = Some(2);
    pods[3].assume_time = Some(1);
    pods[4].assume_time = Some(2);
    let order: Vec<&str> = super::ordered(&pods)
        .iter()
        .map(|p| p.key.name.as_str())
        .collect();
    assert_eq!(order, ["one-b", "one-a", "batch-old", "batch-new", "later"]);
}

#[test]
fn order_is_assume_time_then_creation_then_name() {
    let mut pods = tens(&[
        ("late", 1),
        ("b", 5),
        ("a", 5),
        ("assumed-2", 9),
        ("assumed-1", 9),
    ]);
    pods[3].assume_time = Some(200);
    pods[4].assume_time = Some(100);
    let order: Vec<String> = (0..5)
        .map(|i| who(&serve(&mut pods, &ask(GpuMemory, 10, &[0], &[&format!("id{i}")])).unwrap()).0)
        .collect();
    assert_eq!(order, ["assumed-1", "assumed-2", "late", "a", "b"]);
    let err = serve(&mut pods, &ask(GpuMemory, 10, &[0], &["x"])).unwrap_err();
    assert!(
        matches!(err, MatchError::NoCandidate { best: None, .. }),
        "{err}"
    );
}

#[test]
fn amount_decides_among_candidates_and_no_candidate_names_the_best() {
    let mut pods = vec![
        pod("first", 1, vec![container("c", 20, 0, 0)]),
        pod("second", 2, vec![container("c", 10, 0, 0)]),
    ];
    let d = serve(&mut pods, &ask(GpuMemory, 10, &[1], &["i"])).unwrap();
    assert_eq!(who(&d), ("second".into(), "c".into(), vec![1]));
    assert_eq!(d.amount, 10);
    let err = serve(&mut pods, &ask(GpuMemory, 30, &[1], &["j"])).unwrap_err();
    assert_eq!(
        err,
        MatchError::NoCandidate {
            resource: GpuMemory,
            devices: 30,
            best: Some(pods[0].key.clone())
        }
    );
    assert!(err.to_string().contains("30 gpu-memory"), "{err}");
}

#[test]
fn init_containers_then_app_containers_in_spec_order() {
    let mut pods = vec![pod(
        "p",
        1,
        vec![
            container("init", 10, 0, 0),
            container("app1", 10, 0, 0),
            container("app2", 10, 0, 0),
        ],
    )];
    let names: Vec<String> = ["x", "y", "z"]
        .iter()
        .map(|id| {
            serve(&mut pods, &ask(GpuMemory, 10, &[0], &[id]))
                .unwrap()
                .container
        })
        .collect();
    assert_eq!(names, ["init", "app1", "app2"]);
    assert!(pods[0].complete());
}

/// The kubelet allocates a pod's containers in order, init containers
/// first: an Allocate its init container cannot be is never a pod's first.
/// Found by the chaos test: after a kubelet restart, p194 (an init
/// container of 2 GiB, an app container of 4 GiB) and p195 (4 GiB),
/// created in one second, came in the other order; p195's Allocate went to
/// p194's app container, and p194's own was refused.
#[test]
fn a_pod_not_started_is_asked_for_its_first_container_asking_devices() {
    let mut pods = vec![
        pod(
            "older",
            1,
            vec![
                container("nothing", 0, 0, 0),
                ContainerAsk {
                    init: true,
                    ..container("init", 20, 0, 0)
                },
                container("app", 40, 0, 0),
            ],
        ),
        pod("newer", 2, vec![container("c0", 40, 0, 0)]),
    ];
    let first = serve(&mut pods, &ask(GpuMemory, 40, &[0], &["x"])).unwrap();
    assert_eq!(who(&first).0, "newer");
    let next: Vec<String> = [(20, "y"), (40, "z")]
        .iter()
        .map(|(devices, id)| {
            serve(&mut pods, &ask(GpuMemory, *devices, &[0], &[id]))
                .unwrap()
                .container
        })
        .collect();
    assert_eq!(next, ["init", "app"]);
}

#[test]
fn the_three_resources_in_every_order_land_on_one_gpu() {
    let orders = [
        [GpuMemory, GpuCore, GpuCount],
        [GpuMemory, GpuCount, GpuCore],
        [GpuCore, GpuMemory, GpuCount],
        [GpuCore, GpuCount, GpuMemory],
        [GpuCount, GpuMemory, GpuCore],
        [GpuCount, GpuCore, GpuMemory],
    ];
    for order in orders {
        // The shared container wants memory and core; its IDs for the
        // second resource come from the other GPU (the kubelet ignored the
        // preference): it still gets the first one's GPU.
        let mut pods = vec![
            pod("shared", 1, vec![container("c", 100, 30, 0)]),
            pod("whole", 2, vec![container("c", 0, 0, 1)]),
        ];
        let mut shared_gpu = None;
        for r in order {
            let (devices, ids_gpu) = match r {
                GpuMemory => (100, if shared_gpu.is_some() { 1 } else { 0 }),
                GpuCore => (30, if shared_gpu.is_some() { 1 } else { 0 }),
                GpuCount => (1, 1),
            };
            let d = serve(&mut pods, &ask(r, devices, &[ids_gpu], &[r.name()])).unwrap();
            if r == GpuCount {
                assert_eq!(who(&d), ("whole".into(), "c".into(), vec![1]), "{order:?}");
            } else {
                assert_eq!(d.pod.name, "shared");
                let gpu = *shared_gpu.get_or_insert(d.gpus[0]);
                assert_eq!(d.gpus, vec![gpu], "{order:?}");
            }
        }
        assert!(pods.iter().all(PodView::complete), "{order:?}");
        let g = &pods[0].ledger.0["c"];
        assert_eq!(
            (g.gpus.clone(), g.memory, g.core),
            (vec!["GPU-a".to_string()], Some(100), Some(30))
        );
    }
}

#[test]
fn a_part_served_container_then_pod_comes_before_the_order() {
    let mut pods = vec![
        pod("early", 1, vec![container("c", 10, 20, 0)]),
        pod(
            "busy",
            2,
            vec![container("a", 30, 20, 0), container("b", 10, 20, 0)],
        ),
    ];
    pods[0].assume_time = Some(1);
    // The kubelet admits "busy": its first container's memory...
    assert_eq!(
        serve(&mut pods, &ask(GpuMemory, 30, &[0], &["m1"]))
            .unwrap()
            .pod
            .name,
        "busy"
    );
    // ...then its core: "early" asks the same 20 and comes first in the
    // candidate order, but the container half-served wins.
    let d = serve(&mut pods, &ask(GpuCore, 20, &[1], &["c1"])).unwrap();
    assert_eq!(who(&d), ("busy".into(), "a".into(), vec![0]));
    // The next container of the pod being admitted comes next.
    let d = serve(&mut pods, &ask(GpuMemory, 10, &[1], &["m2"])).unwrap();
    assert_eq!((d.pod.name.as_str(), d.container.as_str()), ("busy", "b"));
}

#[test]
fn scheduler_annotation_wins_and_an_unknown_gpu_is_refused() {
    let mut pods = vec![pod("p", 1, vec![container("c", 10, 0, 0)])];
    pods[0].gpu_uuid = Some("GPU-b".into());
    let d = serve(&mut pods, &ask(GpuMemory, 10, &[0], &["i"])).unwrap();
    assert_eq!(d.gpus, vec![1]);
    let mut pods = vec![pod("p", 1, vec![container("c", 10, 0, 0)])];
    pods[0].gpu_uuid = Some("GPU-zzz".into());
    let err = serve(&mut pods, &ask(GpuMemory, 10, &[0], &["i"])).unwrap_err();
    assert!(matches!(err, MatchError::UnknownGpu { .. }), "{err}");
}

#[test]
fn a_pod_no_longer_pending_is_no_candidate() {
    let mut pods = tens(&[("gone", 1), ("next", 2)]);
    pods[0].admitting = false; // no longer Pending: rejected, or it ran
    let d = serve(&mut pods, &ask(GpuMemory, 10, &[0], &["i"])).unwrap();
    assert_eq!(d.pod.name, "next");
}

/// A preemption's victim, bound before the preemptor and deleted before
/// the kubelet admits it, is admitted all the same (the kubelet stops it
/// afterwards): its Allocate is its own, not the preemptor's of the same
/// ask, which then gets its own.
#[test]
fn a_victim_admitted_while_being_deleted_keeps_its_own_allocate() {
    let mut pods = tens(&[("victim", 1), ("preemptor", 2)]);
    let (view, _) = PodView::from_pod(&Keys::new("doslab.io"), &api_pod(&[], "Pending", true));
    pods[0].admitting = view.admitting;
    let first = serve(&mut pods, &ask(GpuMemory, 10, &[0], &["a"])).unwrap();
    assert_eq!(first.pod.name, "victim");
    let second = serve(&mut pods, &ask(GpuMemory, 10, &[0], &["b"])).unwrap();
    assert_eq!(
        (second.pod.name.as_str(), second.repeat),
        ("preemptor", false)
    );
}

#[test]
fn a_repeated_allocate_gets_the_same_answer_and_records_nothing() {
    let mut pods = tens(&[("p", 1), ("q", 2)]);
    pods[1].admitting = false;
    let first = serve(&mut pods, &ask(GpuMemory, 10, &[1], &["a", "b"])).unwrap();
    let again = serve(&mut pods, &ask(GpuMemory, 10, &[1], &["b", "a"])).unwrap();
    assert!(again.repeat);
    assert_eq!(who(&again), who(&first));
    // The pod went on running; the kubelet asks again after its restart.
    pods[0].admitting = false;
    assert_eq!(
        who(&serve(&mut pods, &ask(GpuMemory, 10, &[1], &["a", "b"])).unwrap()),
        who(&first)
    );
    assert!(!pods[1].ledger.served("c", GpuMemory));
}

/// The kubelet gives a pod's devices to another only once the pod stopped.
/// Found by the chaos test: p583, deleted as it was admitted, stopped
/// before the node saw it deleted; its devices went to p584, whose
/// Allocate the matcher took for p583's asked again, and p584's next
/// container then took p585's grant.
#[test]
fn the_devices_of_a_pod_stopped_unseen_go_to_the_pod_waiting_for_them() {
    let mut pods = tens(&[("p", 1), ("q", 2)]);
    serve(&mut pods, &ask(GpuMemory, 10, &[1], &["a", "b"])).unwrap();
    let reused = serve(&mut pods, &ask(GpuMemory, 10, &[1], &["b", "a"])).unwrap();
    assert_eq!((reused.pod.name.as_str(), reused.repeat), ("q", false));
    assert!(pods[1].ledger.served("c", GpuMemory));
}

#[test]
fn devices_handed_from_an_init_container_serve_the_next_container() {
    let mut pods = vec![pod(
        "p",
        1,
        vec![container("init", 10, 0, 0), container("app", 10, 0, 0)],
    )];
    let ids = ["a", "b"];
    assert_eq!(
        serve(&mut pods, &ask(GpuMemory, 10, &[0], &ids))
            .unwrap()
            .container,
        "init"
    );
    let d = serve(&mut pods, &ask(GpuMemory, 10, &[0], &ids)).unwrap();
    assert_eq!((d.container.as_str(), d.repeat), ("app", false));
    assert!(pods[0].complete());
}

#[test]
fn whole_and_shared_do_not_mix_and_capacity_is_kept() {
    let mut pods = vec![
        pod("whole", 1, vec![container("c", 0, 0, 1)]),
        pod("shared", 2, vec![container("c", 10, 0, 0)]),
    ];
    serve(&mut pods, &ask(GpuCount, 1, &[0], &["w"])).unwrap();
    let err = serve(&mut pods, &ask(GpuMemory, 10, &[0], &["s"])).unwrap_err();
    assert!(matches!(err, MatchError::HeldWhole { .. }), "{err}");
    serve(&mut pods, &ask(GpuMemory, 10, &[1], &["s"])).unwrap();

    let mut pods = vec![
        pod("shared", 1, vec![container("c", 10, 0, 0)]),
        pod("whole", 2, vec![container("c", 0, 0, 1)]),
    ];
    serve(&mut pods, &ask(GpuMemory, 10, &[1], &["s"])).unwrap();
    let err = serve(&mut pods, &ask(GpuCount, 1, &[1], &["w"])).unwrap_err();
    assert!(matches!(err, MatchError::CarriesShared { .. }), "{err}");

    // The ledger is the truth: a container put on GPU-a by the scheduler
    // while its IDs were on GPU-b counts against GPU-a.
    let mut pods = vec![
        pod("big", 1, vec![container("c", 900, 0, 0)]),
        pod("more", 2, vec![container("c", 200, 0, 0)]),
    ];
    pods[0].gpu_uuid = Some("GPU-a".into());
    serve(&mut pods, &ask(GpuMemory, 900, &[1], &["x"])).unwrap();
    let err = serve(&mut pods, &ask(GpuMemory, 200, &[0], &["y"])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "GPU GPU-a has 100 of 1000 gpu-memory left; default/more wants 200"
    );
    // Finished pods free their share.
    pods[0].live = false;
    pods[0].admitting = false;
    serve(&mut pods, &ask(GpuMemory, 200, &[0], &["y"])).unwrap();
}

#[test]
fn ids_from_two_gpus_are_refused_for_a_shared_resource() {
    let mut pods = vec![pod("p", 1, vec![container("c", 10, 0, 0)])];
    let err = serve(&mut pods, &ask(GpuMemory, 10, &[0, 1], &["a"])).unwrap_err();
    assert!(matches!(err, MatchError::SpansGpus { .. }), "{err}");
}

#[test]
fn preferred_allocation_steers_to_the_recorded_or_best_fitting_gpu() {
    let mut pods = vec![
        pod("filler", 1, vec![container("c", 700, 0, 0)]),
        pod("p", 2, vec![container("c", 200, 50, 0)]),
    ];
    serve(&mut pods, &ask(GpuMemory, 700, &[1], &["f"])).unwrap();
    // Best fit: GPU-b has 300 MiB left, enough for 200.
    assert_eq!(
        decide(&node(), &pods, &ask(GpuCore, 50, &[], &[]))
            .unwrap()
            .gpus,
        vec![1]
    );
    serve(&mut pods, &ask(GpuCore, 50, &[1], &["c"])).unwrap();
    // The memory of the same container follows its core.
    assert_eq!(
        decide(&node(), &pods, &ask(GpuMemory, 200, &[], &[]))
            .unwrap()
            .gpus,
        vec![1]
    );
}

fn assign(pod: &mut PodView, pairs: &[(&str, &[&str])]) {
    pod.assignment = Assignment(
        pairs
            .iter()
            .map(|(c, g)| (c.to_string(), g.iter().map(|u| u.to_string()).collect()))
            .collect(),
    );
}

#[test]
fn an_assignment_decides_the_gpu_and_the_order_decides_the_container() {
    let mut pods = vec![pod(
        "p",
        1,
        vec![container("a", 10, 0, 0), container("b", 10, 0, 0)],
    )];
    assign(&mut pods[0], &[("a", &["GPU-b"]), ("b", &["GPU-a"])]);
    // GetPreferredAllocation: the assigned GPU, not the best fit (GPU-a on
    // an empty node).
    let d = decide(&node(), &pods, &ask(GpuMemory, 10, &[], &[])).unwrap();
    assert_eq!(who(&d), ("p".into(), "a".into(), vec![1]));
    let d = serve(&mut pods, &ask(GpuMemory, 10, &[1], &["x"])).unwrap();
    assert_eq!(who(&d), ("p".into(), "a".into(), vec![1]));
    let d = serve(&mut pods, &ask(GpuMemory, 10, &[0], &["y"])).unwrap();
    assert_eq!(who(&d), ("p".into(), "b".into(), vec![0]));
    assert_eq!(pods[0].ledger.0["a"].gpus, ["GPU-b"]);
    // The assignment wins over the seed's single-GPU annotation.
    let mut pods = vec![pod("q", 1, vec![container("c", 10, 0, 0)])];
    pods[0].gpu_uuid = Some("GPU-a".into());
    assign(&mut pods[0], &[("c", &["GPU-b"])]);
    assert_eq!(
        decide(&node(), &pods, &ask(GpuMemory, 10, &[], &[]))
            .unwrap()
            .gpus,
        vec![1]
    );
    assign(&mut pods[0], &[("c", &["GPU-zzz"])]);
    let err = decide(&node(), &pods, &ask(GpuMemory, 10, &[], &[])).unwrap_err();
    assert!(
        matches!(&err, MatchError::UnknownGpu { uuid, .. } if uuid == "GPU-zzz"),
        "{err}"
    );
}

#[test]
fn ids_on_another_gpu_than_the_assignment_are_refused_naming_both() {
    let mut pods = vec![pod("p", 1, vec![container("c", 10, 5, 0)])];
    assign(&mut pods[0], &[("c", &["GPU-b"])]);
    let err = serve(&mut pods, &ask(GpuMemory, 10, &[0], &["x"])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "default/p/c is assigned [\"GPU-b\"] by the extender, but the kubelet's gpu-memory \
         devices are on [\"GPU-a\"]; refusing them (the kubelet ignored the preferred \
         allocation, or its view of free devices differs from the pods' ledgers)"
    );
    assert_eq!(err.pod(), Some(&pods[0].key));
    assert!(!pods[0].ledger.served("c", GpuMemory), "nothing recorded");
    serve(&mut pods, &ask(GpuMemory, 10, &[1], &["x"])).unwrap();
    // Whole GPUs: the IDs must be the assigned GPUs, all of them.
    let mut pods = vec![pod("w", 1, vec![container("t", 0, 0, 1)])];
    assign(&mut pods[0], &[("t", &["GPU-b"])]);
    let err = serve(&mut pods, &ask(GpuCount, 1, &[0], &["a"])).unwrap_err();
    assert!(matches!(err, MatchError::Contradicts { .. }), "{err}");
    let mut pods = vec![pod("w", 1, vec![container("t", 0, 0, 2)])];
    assign(&mut pods[0], &[("t", &["GPU-a", "GPU-b"])]);
    let d = serve(&mut pods, &ask(GpuCount, 2, &[1, 0], &["b", "a"])).unwrap();
    assert_eq!(d.gpus, vec![0, 1]);
}

#[test]
fn devices_handed_on_from_an_init_container_take_the_assigned_gpu() {
    let mut pods = vec![pod(
        "p",
        1,
        vec![
            ContainerAsk {
                init: true,
                ..container("init", 10, 0, 0)
            },
            container("app", 10, 0, 0),
        ],
    )];
    assign(&mut pods[0], &[("init", &["GPU-a"]), ("app", &["GPU-b"])]);
    serve(&mut pods, &ask(GpuMemory, 10, &[0], &["i"])).unwrap();
    // The kubelet gives the app the init container's IDs, on GPU-a, with
    // no choice offered: the assignment still says where it runs.
    let d = serve(&mut pods, &ask(GpuMemory, 10, &[0], &["i"])).unwrap();
    assert_eq!(who(&d), ("p".into(), "app".into(), vec![1]));
}

fn init(name: &str, count: u64) -> ContainerAsk {
    ContainerAsk {
        init: true,
        ..container(name, 0, 0, count)
    }
}

/// A restartable init container (`restartPolicy: Always`).
fn sidecar(name: &str, count: u64) -> ContainerAsk {
    ContainerAsk {
        restartable: true,
        ..init(name, count)
    }
}

#[test]
fn a_sidecar_keeps_its_whole_gpu_so_the_app_naming_it_contradicts() {
    let mut pods = vec![pod(
        "p",
        1,
        vec![sidecar("s", 1), container("app", 0, 0, 1)],
    )];
    assign(&mut pods[0], &[("s", &["GPU-a"]), ("app", &["GPU-b"])]);
    serve(&mut pods, &ask(GpuCount, 1, &[0], &["a"])).unwrap();
    let err = serve(&mut pods, &ask(GpuCount, 1, &[0], &["a"])).unwrap_err();
    assert!(matches!(err, MatchError::Contradicts { .. }), "{err}");
    // An init container's GPU goes to the sidecar, which keeps it: the
    // app has none handed on.
    let mut pods = vec![pod(
        "q",
        1,
        vec![init("i", 1), sidecar("s", 1), container("app", 0, 0, 1)],
    )];
    assign(
        &mut pods[0],
        &[("i", &["GPU-a"]), ("s", &["GPU-a"]), ("app", &["GPU-b"])],
    );
    serve(&mut pods, &ask(GpuCount, 1, &[0], &["a"])).unwrap();
    let d = serve(&mut pods, &ask(GpuCount, 1, &[0], &["a"])).unwrap();
    assert_eq!(who(&d), ("q".into(), "s".into(), vec![0]));
    let err = serve(&mut pods, &ask(GpuCount, 1, &[0], &["a"])).unwrap_err();
    assert!(matches!(err, MatchError::Contradicts { .. }), "{err}");
    let d = serve(&mut pods, &ask(GpuCount, 1, &[1], &["b"])).unwrap();
    assert_eq!(who(&d), ("q".into(), "app".into(), vec![1]));
}

#[test]
fn a_gpu_an_earlier_app_container_took_is_no_longer_handed_on() {
    // Init 2, then two apps of 1: the first takes GPU-a of the two, so the
    // second naming GPU-a again (assigned GPU-b) contradicts.
    let mut pods = vec![pod(
        "p",
        1,
        vec![
            init("i", 2),
            container("app1", 0, 0, 2),
            container("app2", 0, 0, 1),
        ],
    )];
    assign(
        &mut pods[0],
        &[
            ("i", &["GPU-a", "GPU-b"]),
            ("app1", &["GPU-a", "GPU-b"]),
            ("app2", &["GPU-b"]),
        ],
    );
    serve(&mut pods, &ask(GpuCount, 2, &[0, 1], &["a", "b"])).unwrap();
    let d = serve(&mut pods, &ask(GpuCount, 2, &[0, 1], &["a", "b"])).unwrap();
    assert_eq!(who(&d), ("p".into(), "app1".into(), vec![0, 1]));
    let err = serve(&mut pods, &ask(GpuCount, 1, &[0], &["a"])).unwrap_err();
    assert!(matches!(err, MatchError::Contradicts { .. }), "{err}");
}

#[test]
fn whole_gpus_handed_on_from_an_init_container_are_the_ids_gpus() {
    // An assignment that has the app on another GPU than its init
    // container (as the extender wrote before it knew the kubelet hands
    // the init's GPU on): the app runs on the GPU the kubelet holds for it.
    let mut pods = vec![pod("p", 1, vec![init("i", 1), container("app", 0, 0, 1)])];
    assign(&mut pods[0], &[("i", &["GPU-a"]), ("app", &["GPU-b"])]);
    serve(&mut pods, &ask(GpuCount, 1, &[0], &["a"])).unwrap();
    let d = serve(&mut pods, &ask(GpuCount, 1, &[0], &["a"])).unwrap();
    assert_eq!(who(&d), ("p".into(), "app".into(), vec![0]));
    assert_eq!(pods[0].ledger.0["app"].gpus, ["GPU-a"]);
    // Init 2, app 1: the kubelet hands the app either of the two, so the
    // other one than assigned is no contradiction.
    let mut pods = vec![pod("q", 1, vec![init("i", 2), container("app", 0, 0, 1)])];
    assign(
        &mut pods[0],
        &[("i", &["GPU-a", "GPU-b"]), ("app", &["GPU-a"])],
    );
    serve(&mut pods, &ask(GpuCount, 2, &[0, 1], &["a", "b"])).unwrap();
    let d = serve(&mut pods, &ask(GpuCount, 1, &[1], &["b"])).unwrap();
    assert_eq!(who(&d), ("q".into(), "app".into(), vec![1]));
    // A GPU neither assigned nor the init's still contradicts.
    let mut pods = vec![pod("r", 1, vec![init("i", 1), container("app", 0, 0, 1)])];
    assign(&mut pods[0], &[("i", &["GPU-a"]), ("app", &["GPU-a"])]);
    serve(&mut pods, &ask(GpuCount, 1, &[0], &["a"])).unwrap();
    let err = serve(&mut pods, &ask(GpuCount, 1, &[1], &["b"])).unwrap_err();
    assert!(matches!(err, MatchError::Contradicts { .. }), "{err}");
}

#[test]
fn assignments_not_yet_served_count_against_other_pods_but_not_themselves() {
    let mut pods = vec![
        pod("bound", 1, vec![container("c", 900, 0, 0)]),
        pod("more", 2, vec![container("c", 200, 0, 0)]),
    ];
    assign(&mut pods[0], &[("c", &["GPU-a"])]);
    // "more" is admitted first (the kubelet's order is its own).
    let err = serve(&mut pods, &ask(GpuMemory, 200, &[0], &["y"])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "GPU GPU-a has 100 of 1000 gpu-memory left; default/more wants 200"
    );
    // Its best fit steers away from the assigned room.
    assert_eq!(
        decide(&node(), &pods[1..], &ask(GpuMemory, 200, &[], &[]))
            .unwrap()
            .gpus,
        vec![0]
    );
    let usage = super::usage(&node(), &pods);
    assert_eq!(usage.gpus[0].used.memory, 900);
    // The bound pod's own assignment does not stand in its way, and once
    // its ledger has it, it counts once.
    let d = serve(&mut pods, &ask(GpuMemory, 900, &[0], &["x"])).unwrap();
    assert_eq!(who(&d), ("bound".into(), "c".into(), vec![0]));
    let usage = super::usage(&node(), &pods);
    assert_eq!(usage.gpus[0].used.memory, 900);
    // Gone (deleted: not in the store) frees it at once.
    pods.remove(0);
    serve(&mut pods, &ask(GpuMemory, 200, &[0], &["y"])).unwrap();
}

fn api_pod(annotations: &[(&str, &str)], phase: &str, deleting: bool) -> Pod {
    let limits = |mem: &str| {
        Some(ResourceRequirements {
            limits: Some([("doslab.io/gpu-memory".to_string(), Quantity(mem.into()))].into()),
            ..Default::default()
        })
    };
    Pod {
        metadata: ObjectMeta {
            name: Some("p".into()),
            namespace: Some("ns".into()),
            annotations: Some(
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            deletion_timestamp: deleting
                .then(|| k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default())),
            ..Default::default()
        },
        spec: Some(PodSpec {
            init_containers: Some(vec![Container {
                name: "init".into(),
                resources: limits("5"),
                ..Default::default()
            }]),
            containers: vec![Container {
                name: "app".into(),
                resources: limits("1024"),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some(phase.into()),
            ..Default::default()
        }),
    }
}

#[test]
fn pods_are_read_from_the_api_with_bad_annotations_named() {
    let keys = Keys::new("doslab.io");
    let (view, warnings) = PodView::from_pod(
        &keys,
        &api_pod(
            &[
                ("doslab.io/gpu-assume-time", "soon"),
                ("doslab.io/gpu-ledger", "[1,2"),
            ],
            "Pending",
            false,
        ),
    );
    let init = ContainerAsk {
        init: true,
        ..container("init", 5, 0, 0)
    };
    assert_eq!(view.containers, vec![init, container("app", 1024, 0, 0)]);
    assert_eq!(view.assume_time, None);
    assert!(view.admitting && view.live);
    assert_eq!(warnings.len(), 2);
    assert!(
        matches!(&warnings[0], PodWarning::AssumeTime(k, v) if k == "doslab.io/gpu-assume-time" && v == "soon")
    );
    assert!(warnings[1].to_string().contains("doslab.io/gpu-ledger"));

    let (view, warnings) = PodView::from_pod(
        &keys,
        &api_pod(&[("doslab.io/gpu-assignment", "{")], "Pending", false),
    );
    assert_eq!(view.assignment, Assignment::default());
    assert!(
        warnings[0].to_string().contains("doslab.io/gpu-assignment"),
        "{warnings:?}"
    );

    let (view, warnings) = PodView::from_pod(
        &keys,
        &api_pod(
            &[
                ("doslab.io/gpu-assume-time", "1700000000000000000"),
                ("doslab.io/gpu-uuid", "GPU-b"),
                ("doslab.io/gpu-assignment", r#"{"app":["GPU-b"]}"#),
            ],
            "Pending",
            true,
        ),
    );
    assert!(warnings.is_empty());
    assert_eq!(view.assume_time, Some(1_700_000_000_000_000_000));
    assert_eq!(view.gpu_uuid.as_deref(), Some("GPU-b"));
    assert_eq!(view.assignment.0["app"], ["GPU-b"]);
    assert!(
        view.admitting,
        "a pod being deleted is still admitted: the kubelet admits what it was sent"
    );
    let (view, _) = PodView::from_pod(&keys, &api_pod(&[], "Succeeded", false));
    assert!(!view.live && !view.admitting);
}

#[test]
fn the_ids_of_a_pod_being_deleted_go_to_the_next_container() {
    let mut pods = tens(&[("old", 1), ("new", 2)]);
    let first = serve(&mut pods, &ask(GpuMemory, 10, &[1], &["a", "b"])).unwrap();
    assert_eq!(first.pod.name, "old");
    // Being deleted, its devices freed: the kubelet gives the same IDs to
    // the next container, which must not get the old pod's grant.
    pods[0].admitting = false;
    super::deleting(&mut pods[0]);
    let d = serve(&mut pods, &ask(GpuMemory, 10, &[1], &["a", "b"])).unwrap();
    assert_eq!((d.pod.name.as_str(), d.repeat), ("new", false));
}

/// Serves `resources` of a container asking one GPU whole, 100 MiB and
/// 10 %, in that order, the IDs on `gpus`, beside a pod sharing GPU-a.
fn whole_with_share(
    resources: &[Resource],
    gpus: &[&[usize]],
) -> Vec<Result<Decision, MatchError>> {
    let mut pods = vec![
        pod("sharer", 1, vec![container("c", 10, 10, 0)]),
        pod("whole", 2, vec![container("c", 100, 10, 1)]),
    ];
    serve(&mut pods, &ask(GpuMemory, 10, &[0], &["s1"])).unwrap();
    serve(&mut pods, &ask(GpuCore, 10, &[0], &["s2"])).unwrap();
    resources
        .iter()
        .zip(gpus)
        .enumerate()
        .map(|(i, (&r, ids))| {
            let n = match r {
                GpuMemory => 100,
                GpuCore => 10,
                GpuCount => 1,
            };
            serve(&mut pods, &ask(r, n, ids, &[&format!("w{i}")]))
        })
        .collect()
}

#[test]
fn a_share_rides_inside_the_whole_gpu_in_either_order() {
    let gpus = |r: &Result<Decision, MatchError>| {
        let d = r.as_ref().unwrap();
        assert!(d.whole, "{d:?}");
        d.gpus.clone()
    };
    // Count first: memory and core IDs anywhere name its whole GPU.
    let served = whole_with_share(&[GpuCount, GpuMemory, GpuCore], &[&[1], &[0], &[1]]);
    assert_eq!(served.iter().map(gpus).collect::<Vec<_>>(), [[1], [1], [1]]);
    // Memory first, its IDs on the shared GPU-a: the container is placed on
    // the clear GPU-b, and its count follows there.
    let served = whole_with_share(&[GpuMemory, GpuCount, GpuCore], &[&[0], &[1], &[1]]);
    assert_eq!(served.iter().map(gpus).collect::<Vec<_>>(), [[1], [1], [1]]);
    // Its count IDs on another GPU than its share's: refused, not split.
    let served = whole_with_share(&[GpuCore, GpuCount], &[&[1], &[0]]);
    assert_eq!(gpus(&served[0]), [1]);
    let err = served[1].as_ref().unwrap_err();
    assert!(matches!(err, MatchError::Splits { .. }), "{err}");
    assert!(
        err.to_string().contains("GPU-b") && err.to_string().contains("GPU-a"),
        "{err}"
    );
}

#[test]
fn a_share_of_a_whole_container_needs_a_clear_gpu() {
    let mut pods = vec![
        pod(
            "sharer",
            1,
            vec![container("c", 10, 0, 0), container("d", 10, 0, 0)],
        ),
        pod("whole", 2, vec![container("c", 100, 0, 1)]),
    ];
    serve(&mut pods, &ask(GpuMemory, 10, &[0], &["s1"])).unwrap();
    serve(&mut pods, &ask(GpuMemory, 10, &[1], &["s2"])).unwrap();
    let err = serve(&mut pods, &ask(GpuMemory, 100, &[1], &["w"])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "default/whole wants 1 GPUs whole and only 0 are clear of other work"
    );
}

#[test]
fn limits_are_read_as_quantities_and_an_unreadable_one_is_named() {
    let keys = Keys::new("doslab.io");
    let with_app_limit = |q: &str| {
        let mut p = api_pod(&[], "Pending", false);
        let app = &mut p.spec.as_mut().unwrap().containers[0];
        app.resources
            .as_mut()
            .unwrap()
            .limits
            .as_mut()
            .unwrap()
            .insert("doslab.io/gpu-memory".into(), Quantity(q.into()));
        PodView::from_pod(&keys, &p)
    };
    // The API server stores 8000 as 8k.
    let (view, warnings) = with_app_limit("8k");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(view.containers[1].wants(GpuMemory), 8000);
    let (view, warnings) = with_app_limit("1.5");
    assert_eq!(view.containers[1].wants(GpuMemory), 0);
    let [PodWarning::Ask(why)] = warnings.as_slice() else {
        panic!("{warnings:?}");
    };
    assert!(
        why.contains(
            "container app: limit doslab.io/gpu-memory quantity \"1.5\" is not a whole number"
        ),
        "{why}"
    );
}

const NOTHING: [Vec<usize>; 3] = [Vec::new(), Vec::new(), Vec::new()];

/// Per resource in `Resource::ALL`'s order, the GPUs whose devices are
/// withdrawn from the kubelet's lists.
fn withdrawn_gpus(pods: &[PodView]) -> [Vec<usize>; 3] {
    let inv = node();
    let w = crate::node::matcher::report::withdrawn(&inv, pods);
    Resource::ALL.map(|r| (0..2).filter(|&g| w[r][g]).collect())
}

#[test]
fn exclusive_devices_are_withdrawn_once_no_whole_container_waits_for_them() {
    let mut pods = vec![pod("whole", 1, vec![container("c", 100, 10, 1)])];
    // Count first: its GPU is held whole, but its memory and core Allocates
    // still come, on that GPU: nothing withdrawn yet.
    serve(&mut pods, &ask(GpuCount, 1, &[1], &["w0"])).unwrap();
    assert_eq!(withdrawn_gpus(&pods), NOTHING);
    serve(&mut pods, &ask(GpuMemory, 100, &[0], &["w1"])).unwrap();
    assert_eq!(withdrawn_gpus(&pods), [vec![1], vec![], vec![]]);
    serve(&mut pods, &ask(GpuCore, 10, &[1], &["w2"])).unwrap();
    assert_eq!(withdrawn_gpus(&pods), [vec![1], vec![1], vec![]]);
    // A sharer on the other GPU withdraws that GPU's count device.
    pods.push(pod("sharer", 2, vec![container("c", 10, 0, 0)]));
    serve(&mut pods, &ask(GpuMemory, 10, &[0], &["s"])).unwrap();
    assert_eq!(withdrawn_gpus(&pods), [vec![1], vec![1], vec![0]]);
    // The sharer being deleted: the extender gives its GPU to the next
    // pod once it is gone, maybe before this node hears of it.
    pods[1].deleting = true;
    assert_eq!(withdrawn_gpus(&pods), [vec![1], vec![1], vec![]]);
    // Both done: everything goes back.
    for p in &mut pods {
        p.live = false;
        p.admitting = false;
    }
    assert_eq!(withdrawn_gpus(&pods), NOTHING);
}

#[test]
fn a_whole_container_served_share_first_keeps_its_count_device_listed() {
    let mut pods = vec![pod("whole", 1, vec![container("c", 100, 0, 1)])];
    serve(&mut pods, &ask(GpuMemory, 100, &[1], &["w0"])).unwrap();
    assert_eq!(withdrawn_gpus(&pods)[2], Vec::<usize>::new());
    serve(&mut pods, &ask(GpuCount, 1, &[1], &["w1"])).unwrap();
    assert_eq!(withdrawn_gpus(&pods), [vec![1], vec![1], vec![]]);
    // Bound to a GPU by the extender and not admitted yet: its own devices
    // there stay listed, those it does not ask are withdrawn at once.
    let mut bound = pod("bound", 2, vec![container("c", 0, 10, 1)]);
    assign(&mut bound, &[("c", &["GPU-a"])]);
    pods.push(bound);
    assert_eq!(withdrawn_gpus(&pods), [vec![0, 1], vec![1], vec![]]);
}

#[test]
fn withdrawals_are_published_only_when_they_change() {
    let inv = node();
    let tx = tokio::sync::watch::Sender::new(crate::node::matcher::report::Withdrawn::default());
    let mut rx = tx.subscribe();
    let mut pods = vec![pod("whole", 1, vec![container("c", 0, 0, 1)])];
    let publish = |pods: &[PodView]| {
        let w = crate::node::matcher::report::withdrawn(&inv, pods);
        crate::node::matcher::report::publish(&tx, w);
    };
    publish(&pods);
    assert!(
        rx.has_changed().unwrap(),
        "nothing held: the masks got their length"
    );
    rx.mark_unchanged();
    publish(&pods);
    assert!(!rx.has_changed().unwrap(), "the same usage: no new list");
    serve(&mut pods, &ask(GpuCount, 1, &[0], &["w"])).unwrap();
    publish(&pods);
    assert!(rx.has_changed().unwrap());
    assert_eq!(&*rx.borrow_and_update().memory, &[true, false]);
    // A second GPU held whole, then given back.
    pods.push(pod("other", 2, vec![container("c", 0, 0, 1)]));
    serve(&mut pods, &ask(GpuCount, 1, &[1], &["o"])).unwrap();
    publish(&pods);
    assert!(rx.has_changed().unwrap(), "GPU-b held whole now");
    rx.mark_unchanged();
    pods[1].live = false;
    pods[1].admitting = false;
    publish(&pods);
    assert!(rx.has_changed().unwrap());
    assert_eq!(&*rx.borrow_and_update().memory, &[true, false]);
}

/// Forged and garbled ledgers change no placement and free no room.
mod trust {
    use super::*;
    use crate::rules::matching::usage;

    #[test]
    fn a_pod_asking_no_gpu_blocks_none_whatever_its_ledger_claims() {
        let mut forger = pod("forger", 1, vec![container("app", 0, 0, 0)]);
        forger.admitting = false;
        forger.ledger = Ledger::parse(Some(
            r#"{"app":{"gpus":["GPU-a"],"gpu-memory":1000000000000000000},
                "ghost":{"gpus":["GPU-b"],"gpu-count":1}}"#,
        ))
        .unwrap();
        let pods = vec![
            forger,
            pod("shared", 2, vec![container("app", 900, 0, 0)]),
            pod("whole", 3, vec![container("app", 0, 0, 1)]),
        ];
        let d = decide(&node(), &pods, &ask(GpuMemory, 900, &[0], &["m1"])).unwrap();
        assert_eq!((d.pod.name.as_str(), d.gpus), ("shared", vec![0]));
        let d = decide(&node(), &pods, &ask(GpuCount, 1, &[1], &["c1"])).unwrap();
        assert_eq!((d.pod.name.as_str(), d.gpus), ("whole", vec![1]));
        assert_eq!(usage(&node(), &pods).gpus, usage(&node(), &pods[1..]).gpus);
    }

    #[test]
    fn a_ledger_claiming_more_than_the_ask_counts_the_ask() {
        let mut greedy = pod("greedy", 1, vec![container("app", 100, 0, 0)]);
        greedy.admitting = false;
        greedy.ledger = Ledger::parse(Some(
            r#"{"app":{"gpus":["GPU-a"],"gpu-memory":1000,"gpu-core":100}}"#,
        ))
        .unwrap();
        let pods = vec![greedy, pod("next", 2, vec![container("app", 900, 50, 0)])];
        let u = usage(&node(), &pods);
        assert_eq!((u.gpus[0].used.memory, u.gpus[0].used.core), (100, 0));
        let d = decide(&node(), &pods, &ask(GpuMemory, 900, &[0], &["m1"])).unwrap();
        assert_eq!((d.pod.name.as_str(), d.gpus), ("next", vec![0]));
    }

    /// After a restart the matcher knows a running pod only by its
    /// annotations: a garbled ledger must not let a whole-GPU grant onto
    /// the GPU its work is on.
    #[test]
    fn a_garbled_ledger_keeps_the_pods_gpus_from_whole_grants() {
        let keys = Keys::new("doslab.io");
        let garbled = ("doslab.io/gpu-ledger", r#"{"app":"GPU-a"}"#);
        let (running, warnings) = PodView::from_pod(&keys, &api_pod(&[garbled], "Running", false));
        assert!(
            matches!(&warnings[..], [PodWarning::Ledger(k, _)] if k == "doslab.io/gpu-ledger"),
            "{warnings:?}"
        );
        assert!(
            warnings[0].to_string().contains("held wherever"),
            "{}",
            warnings[0]
        );
        let whole = pod("whole", 2, vec![container("app", 0, 0, 1)]);
        let pods = vec![running, whole.clone()];
        for g in [0, 1] {
            let e = decide(&node(), &pods, &ask(GpuCount, 1, &[g], &["c"])).unwrap_err();
            assert!(matches!(e, MatchError::CarriesShared { .. }), "{e}");
        }
        // With a readable assignment, only its GPU stays held.
        let assigned = (
            "doslab.io/gpu-assignment",
            r#"{"init":["GPU-b"],"app":["GPU-b"]}"#,
        );
        let (running, _) =
            PodView::from_pod(&keys, &api_pod(&[garbled, assigned], "Running", false));
        let pods = vec![running, whole];
        let d = decide(&node(), &pods, &ask(GpuCount, 1, &[0], &["c"])).unwrap();
        assert_eq!((d.pod.name.as_str(), d.gpus), ("whole", vec![0]));
        let e = decide(&node(), &pods, &ask(GpuCount, 1, &[1], &["c"])).unwrap_err();
        assert!(matches!(e, MatchError::CarriesShared { .. }), "{e}");
    }
}
