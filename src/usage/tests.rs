//! The usage model over hand-built inventories, pods and ledgers.

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::node::GpuUsage;
use super::*;
use crate::device::{Gpu, Offer, PerResource, Resource, Units};
use crate::matcher::ledger::{Grant, Ledger};

/// GPUs of the given MiB, 256 MiB per memory device, 1 % per core device.
fn inventory(mib: &[u64]) -> Inventory {
    let gpus: Vec<Gpu> = mib
        .iter()
        .enumerate()
        .map(|(i, &m)| Gpu {
            uuid: format!("GPU-{i}"),
            memory_mib: m,
            index: i as u32,
            numa_node: None,
        })
        .collect();
    let offer = Offer {
        resources: Resource::ALL.to_vec(),
        units: Units {
            memory_unit_mib: 256,
            cores_per_gpu: 100,
        },
    };
    Inventory::new(&gpus, &offer)
}

fn ask(name: &str, init: bool, mem: u64, core: u64, count: u64) -> ContainerAsk {
    ContainerAsk {
        name: name.into(),
        init,
        restartable: false,
        devices: PerResource {
            memory: mem,
            core,
            count,
        },
    }
}

/// A restartable init container (`restartPolicy: Always`).
fn sidecar(name: &str, mem: u64, core: u64, count: u64) -> ContainerAsk {
    ContainerAsk {
        restartable: true,
        ..ask(name, true, mem, core, count)
    }
}

fn pod(containers: Vec<ContainerAsk>) -> PodAsks {
    PodAsks { containers }
}

fn assignment(pairs: &[(&str, &[&str])]) -> Assignment {
    Assignment(
        pairs
            .iter()
            .map(|(c, g)| (c.to_string(), g.iter().map(|s| s.to_string()).collect()))
            .collect(),
    )
}

fn grant(gpu: &str, memory: Option<u64>, core: Option<u64>, count: Option<u64>) -> Grant {
    Grant {
        gpus: vec![gpu.into()],
        memory,
        core,
        count,
        ..Default::default()
    }
}

#[test]
fn the_inventory_annotation_round_trips_and_refuses_what_it_cannot_read() {
    let inv = inventory(&[81920, 40000]);
    let text = inv.to_json();
    assert!(
        text.starts_with(r#"{"version":1,"memoryUnitMiB":256,"coresPerGpu":100,"resources":["gpu-memory","gpu-core","gpu-count"],"gpus":[{"uuid":"GPU-0","memoryMiB":81920,"healthy":true}"#),
        "{text}"
    );
    assert_eq!(Inventory::parse(&text).unwrap(), inv);
    let v2 = text.replace(r#""version":1"#, r#""version":2"#);
    let err = Inventory::parse(&v2).unwrap_err();
    assert_eq!(err, InventoryError::Version(2));
    assert!(err.to_string().contains("version 2"), "{err}");
    let zero = text.replace(r#""memoryUnitMiB":256"#, r#""memoryUnitMiB":0"#);
    assert!(matches!(
        Inventory::parse(&zero),
        Err(InventoryError::Invalid(_))
    ));
    let odd = text.replace(r#""coresPerGpu":100"#, r#""coresPerGpu":30"#);
    assert!(
        Inventory::parse(&odd)
            .unwrap_err()
            .to_string()
            .contains("coresPerGpu 30")
    );
    assert!(matches!(
        Inventory::parse("{"),
        Err(InventoryError::Json(_))
    ));
}

#[test]
fn capacity_is_what_the_kubelet_sees_in_real_units() {
    let inv = inventory(&[1000]);
    // 1000 MiB in 256 MiB devices: three devices.
    assert_eq!(
        inv.capacity(0),
        PerResource {
            memory: 768,
            core: 100,
            count: 1
        }
    );
    let mut coarse = inv.clone();
    coarse.cores_per_gpu = 20;
    assert_eq!(coarse.capacity(0).core, 100);
    assert_eq!(coarse.amount(&ask("c", false, 2, 3, 0).devices).core, 15);
}

#[test]
fn asks_are_read_from_the_spec_init_containers_first() {
    let keys = Keys::new("doslab.io");
    let limits = |pairs: &[(&str, &str)]| {
        Some(ResourceRequirements {
            limits: Some(
                pairs
                    .iter()
                    .map(|(k, v)| (format!("doslab.io/{k}"), Quantity(v.to_string())))
                    .collect(),
            ),
            ..Default::default()
        })
    };
    let p = Pod {
        spec: Some(PodSpec {
            init_containers: Some(vec![
                Container {
                    name: "init".into(),
                    resources: limits(&[("gpu-memory", "4")]),
                    ..Default::default()
                },
                Container {
                    name: "proxy".into(),
                    resources: limits(&[("gpu-count", "1")]),
                    restart_policy: Some("Always".into()),
                    ..Default::default()
                },
            ]),
            containers: vec![
                Container {
                    name: "app".into(),
                    resources: limits(&[("gpu-memory", "8"), ("gpu-core", "30")]),
                    ..Default::default()
                },
                Container {
                    name: "train".into(),
                    resources: limits(&[("gpu-count", "2")]),
                    ..Default::default()
                },
                Container {
                    name: "sidecar".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(
        PodAsks::from_pod(&keys, &p).containers,
        vec![
            ask("init", true, 4, 0, 0),
            sidecar("proxy", 0, 0, 1),
            ask("app", false, 8, 30, 0),
            ask("train", false, 0, 0, 2),
            ask("sidecar", false, 0, 0, 0),
        ]
    );
}

#[test]
fn usage_is_ledgers_plus_assignments_not_yet_in_the_ledger_never_both() {
    let inv = inventory(&[8192, 8192]);
    let containers = vec![ask("a", false, 4, 10, 0), ask("b", false, 2, 5, 0)];
    // Bound, not yet admitted: both count by their assignment.
    let assigned = assignment(&[("a", &["GPU-0"]), ("b", &["GPU-1"])]);
    let h = pod_holdings(&inv, &containers, &Ledger::default(), &assigned);
    let u = NodeUsage::of(&inv, &h);
    assert_eq!((u.gpus[0].used.memory, u.gpus[0].used.core), (1024, 10));
    assert_eq!((u.gpus[1].used.memory, u.gpus[1].used.core), (512, 5));
    // "a" admitted: its ledger counts (on the GPU the ledger names), its
    // assignment no more.
    let mut ledger = Ledger::default();
    ledger
        .0
        .insert("a".into(), grant("GPU-1", Some(1024), Some(10), None));
    let h = pod_holdings(&inv, &containers, &ledger, &assigned);
    let u = NodeUsage::of(&inv, &h);
    assert_eq!(u.gpus[0], GpuUsage::default());
    assert_eq!((u.gpus[1].used.memory, u.gpus[1].used.core), (1536, 15));
    assert_eq!(u.gpus[1].sharers, 2);
    // Removing a holding frees exactly it (a deleted pod: its holdings are
    // simply not there).
    let freed = u.without(&inv, &h[1]);
    assert_eq!(
        (freed.gpus[1].used.memory, freed.gpus[1].sharers),
        (1024, 1)
    );
    assert_eq!(NodeUsage::of(&inv, &[]), NodeUsage::empty(&inv));
    // A GPU this node lacks is ignored.
    let stray = Holding {
        gpus: vec!["GPU-x".into()],
        amount: inv.amount(&ask("c", false, 1, 1, 0).devices),
    };
    assert_eq!(NodeUsage::of(&inv, [&stray]), NodeUsage::empty(&inv));
}

#[test]
fn a_half_served_container_still_holds_the_rest_of_its_assigned_ask() {
    // The kubelet serves a container's resources one at a time: with its
    // memory in the ledger and its core not yet, the core still counts on
    // the assigned GPU (the burst over ten nodes over-committed gpu-core
    // in exactly that window).
    let inv = inventory(&[8192]);
    let containers = vec![ask("a", false, 4, 60, 0)];
    let assigned = assignment(&[("a", &["GPU-0"])]);
    let mut ledger = Ledger::default();
    ledger
        .0
        .insert("a".into(), grant("GPU-0", Some(1024), None, None));
    let h = pod_holdings(&inv, &containers, &ledger, &assigned);
    let u = NodeUsage::of(&inv, &h);
    assert_eq!((u.gpus[0].used.memory, u.gpus[0].used.core), (1024, 60));
    assert_eq!(u.gpus[0].sharers, 1, "one container, one holding");
    // Once the core is served too, the ledger alone counts it.
    ledger
        .0
        .insert("a".into(), grant("GPU-0", Some(1024), Some(60), None));
    let h = pod_holdings(&inv, &containers, &ledger, &assigned);
    let u = NodeUsage::of(&inv, &h);
    assert_eq!((u.gpus[0].used.memory, u.gpus[0].used.core), (1024, 60));
    // A pod asking 50 % more finds no room on the GPU.
    let next = pod(vec![ask("b", false, 4, 50, 0)]);
    assert!(fit(&inv, &u, &next).is_err());
}

#[test]
fn shared_containers_fit_on_one_gpu_with_room_for_memory_and_core_on_mixed_sizes() {
    // 16 GiB, 80 GiB, 40 GiB.
    let inv = inventory(&[16384, 81920, 40960]);
    let usage = NodeUsage::empty(&inv);
    // 30 GiB fits on the 80 and 40 GiB GPUs: best fit is the 40 GiB one.
    let a = fit(&inv, &usage, &pod(vec![ask("c", false, 120, 50, 0)])).unwrap();
    assert_eq!(a, assignment(&[("c", &["GPU-2"])]));
    // 60 GiB only on the 80 GiB GPU.
    let a = fit(&inv, &usage, &pod(vec![ask("c", false, 240, 10, 0)])).unwrap();
    assert_eq!(a.single_gpu(), Some("GPU-1"));
    // Room for memory is not enough: the core must fit on the same GPU.
    let busy = Holding {
        gpus: vec!["GPU-2".into()],
        amount: inv.amount(&ask("x", false, 0, 90, 0).devices),
    };
    let usage = NodeUsage::of(&inv, [&busy]);
    let a = fit(&inv, &usage, &pod(vec![ask("c", false, 120, 50, 0)])).unwrap();
    assert_eq!(a.single_gpu(), Some("GPU-1"));
}

#[test]
fn containers_of_one_pod_add_up_and_stay_together_when_they_can() {
    let inv = inventory(&[8192, 8192]);
    let usage = NodeUsage::empty(&inv);
    // Init (counted while the pod lives) and two apps: 12 + 12 + 8 devices
    // of 256 MiB = 8 GiB, exactly one GPU.
    let p = pod(vec![
        ask("init", true, 12, 10, 0),
        ask("app", false, 12, 10, 0),
        ask("side", false, 8, 10, 0),
    ]);
    let a = fit(&inv, &usage, &p).unwrap();
    assert_eq!(a.single_gpu(), Some("GPU-0"), "{a:?}");
    // One more device and the last container spills to the other GPU.
    let p = pod(vec![
        ask("init", true, 12, 10, 0),
        ask("app", false, 12, 10, 0),
        ask("side", false, 9, 10, 0),
    ]);
    let a = fit(&inv, &usage, &p).unwrap();
    assert_eq!(a.0["side"], ["GPU-1"]);
    assert_eq!(a.single_gpu(), None);
}

#[test]
fn a_container_handed_its_init_containers_devices_goes_on_their_gpu() {
    // 32 devices of 256 MiB per GPU.
    let inv = inventory(&[8192, 8192]);
    let usage = NodeUsage::empty(&inv);
    // The kubelet hands the app 16 of the init container's 20 memory
    // devices, on GPU-0: beside the init container (counted while the pod
    // lives) it has no room, and GPU-1 would contradict those IDs.
    let p = pod(vec![
        ask("init", true, 20, 10, 0),
        ask("app", false, 16, 10, 0),
    ]);
    let e = fit(&inv, &usage, &p).unwrap_err();
    assert_eq!(e.container, "app");
    assert!(e.reason.contains("init containers on GPU-0"), "{e}");
    assert!(e.unresolvable, "{e}");
    // Core only from the init container, memory fresh: still GPU-0.
    let p = pod(vec![
        ask("init", true, 0, 10, 0),
        ask("app", false, 8, 10, 0),
    ]);
    assert_eq!(fit(&inv, &usage, &p).unwrap().single_gpu(), Some("GPU-0"));
    // Once the apps took all it handed on, the next goes anywhere.
    let p = pod(vec![
        ask("init", true, 12, 10, 0),
        ask("app", false, 12, 10, 0),
        ask("side", false, 0, 81, 0),
    ]);
    let a = fit(&inv, &usage, &p).unwrap();
    assert_eq!(a.0["app"], ["GPU-0"]);
    assert_eq!(a.0["side"], ["GPU-1"]);
}

#[test]
fn a_sidecar_keeps_its_memory_and_hands_none_on() {
    // 32 devices of 256 MiB per GPU.
    let inv = inventory(&[8192, 8192]);
    let usage = NodeUsage::empty(&inv);
    // The sidecar keeps its 20 devices: the app takes fresh ones, on the
    // GPU with room for it.
    let p = pod(vec![
        sidecar("proxy", 20, 10, 0),
        ask("app", false, 16, 10, 0),
    ]);
    let a = fit(&inv, &usage, &p).unwrap();
    assert_eq!(a.0["proxy"], ["GPU-0"]);
    assert_eq!(a.0["app"], ["GPU-1"]);
    // A sidecar takes from what the init containers hand on first: 8 of
    // the 20 on GPU-0, which leaves 12 for the app, also on GPU-0, where
    // there is no room for it.
    let p = pod(vec![
        ask("init", true, 20, 0, 0),
        sidecar("proxy", 8, 0, 0),
        ask("app", false, 16, 0, 0),
    ]);
    let e = fit(&inv, &usage, &p).unwrap_err();
    assert_eq!(e.container, "app");
    assert!(e.reason.contains("init containers on GPU-0"), "{e}");
}

#[test]
fn a_sidecar_keeps_its_whole_gpu_so_the_app_needs_another() {
    let inv = inventory(&[8192, 8192, 8192]);
    let whole = |gpus: &[&str]| Holding {
        gpus: gpus.iter().map(|g| g.to_string()).collect(),
        amount: inv.amount(&ask("w", false, 0, 0, gpus.len() as u64).devices),
    };
    let one_free = NodeUsage::of(&inv, [&whole(&["GPU-0", "GPU-1"])]);
    let two_free = NodeUsage::of(&inv, [&whole(&["GPU-0"])]);
    let p = pod(vec![sidecar("proxy", 0, 0, 1), ask("app", false, 0, 0, 1)]);
    let e = fit(&inv, &one_free, &p).unwrap_err();
    assert_eq!(e.container, "app");
    assert!(!e.unresolvable, "{e}");
    let a = fit(&inv, &two_free, &p).unwrap();
    assert_eq!(a, assignment(&[("proxy", &["GPU-1"]), ("app", &["GPU-2"])]));
    let u = NodeUsage::of(
        &inv,
        &pod_holdings(&inv, &p.containers, &Ledger::default(), &a),
    );
    assert_eq!(
        u.gpus.iter().map(|g| g.used.count).collect::<Vec<_>>(),
        [0, 1, 1]
    );
    // An init container's GPU goes to the sidecar, which keeps it: the app
    // still needs a fresh one.
    let p = pod(vec![
        ask("init", true, 0, 0, 1),
        sidecar("proxy", 0, 0, 1),
        ask("app", false, 0, 0, 1),
    ]);
    assert_eq!(fit(&inv, &one_free, &p).unwrap_err().container, "app");
    let a = fit(&inv, &two_free, &p).unwrap();
    assert_eq!(a.0["init"], ["GPU-1"]);
    assert_eq!(a.0["proxy"], ["GPU-1"]);
    assert_eq!(a.0["app"], ["GPU-2"]);
}

#[test]
fn a_sidecars_whole_gpu_is_not_counted_once_with_the_apps() {
    let inv = inventory(&[8192, 8192]);
    // A ledger (or an assignment from before sidecars were understood)
    // naming one GPU for both: each holds it, the kubelet never hands a
    // sidecar's GPU on.
    let containers = vec![sidecar("proxy", 0, 0, 1), ask("app", false, 0, 0, 1)];
    let mut ledger = Ledger::default();
    for c in ["proxy", "app"] {
        ledger
            .0
            .insert(c.into(), grant("GPU-1", None, None, Some(1)));
    }
    let held = pod_holdings(&inv, &containers, &ledger, &Assignment::default());
    assert_eq!(NodeUsage::of(&inv, &held).gpus[1].used.count, 2, "{held:?}");
    let a = assignment(&[("proxy", &["GPU-1"]), ("app", &["GPU-1"])]);
    let held = pod_holdings(&inv, &containers, &Ledger::default(), &a);
    assert_eq!(NodeUsage::of(&inv, &held).gpus[1].used.count, 2, "{held:?}");
}

#[test]
fn whole_and_shared_work_never_mix_and_unhealthy_gpus_take_none() {
    let mut inv = inventory(&[8192, 8192, 8192]);
    let shared = Holding {
        gpus: vec!["GPU-0".into()],
        amount: inv.amount(&ask("s", false, 1, 1, 0).devices),
    };
    let whole = Holding {
        gpus: vec!["GPU-1".into()],
        amount: inv.amount(&ask("w", false, 0, 0, 1).devices),
    };
    let usage = NodeUsage::of(&inv, [&shared, &whole]);
    assert_eq!(usage.avoid(&inv, Resource::GpuCount), [true, false, false]);
    assert_eq!(usage.avoid(&inv, Resource::GpuMemory), [false, true, false]);
    // A whole ask takes the one free GPU; two cannot be had.
    let one = pod(vec![ask("t", false, 0, 0, 1)]);
    assert_eq!(fit(&inv, &usage, &one).unwrap().single_gpu(), Some("GPU-2"));
    let two = pod(vec![ask("t", false, 0, 0, 2)]);
    let err = fit(&inv, &usage, &two).unwrap_err();
    assert_eq!(
        err.to_string(),
        "container t: wants 2 whole GPUs; 1 of 3 are healthy and free of other work"
    );
    assert!(!err.unresolvable, "fits once the node empties");
    // A shared ask never lands on the GPU held whole, even when it is the
    // best fit by room.
    let s = pod(vec![ask("s2", false, 1, 1, 0)]);
    assert_eq!(fit(&inv, &usage, &s).unwrap().single_gpu(), Some("GPU-0"));
    // Unhealthy: no new work, and it shows in the steer.
    inv.gpus[2].healthy = false;
    assert_eq!(usage.avoid(&inv, Resource::GpuCount), [true, false, true]);
    let err = fit(&inv, &usage, &one).unwrap_err();
    assert!(!err.unresolvable, "{err}");
    inv.gpus.iter_mut().for_each(|g| g.healthy = false);
    let err = fit(&inv, &NodeUsage::empty(&inv), &s).unwrap_err();
    assert_eq!(err.reason, "no GPU is healthy");
    assert!(!err.unresolvable);
}

#[test]
fn reasons_say_what_is_missing_and_whether_it_can_ever_fit() {
    let inv = inventory(&[81920, 40960]);
    let filler = Holding {
        gpus: vec!["GPU-0".into()],
        amount: inv.amount(&ask("f", false, 240, 20, 0).devices),
    };
    let usage = NodeUsage::of(&inv, [&filler]);
    // 30 GiB: 20 GiB left on GPU-0, 40 GiB on GPU-1, so it fits...
    let thirty = pod(vec![ask("c", false, 120, 10, 0)]);
    assert_eq!(
        fit(&inv, &usage, &thirty).unwrap().single_gpu(),
        Some("GPU-1")
    );
    // ...and once GPU-1 is taken whole, it does not, for now.
    let whole = Holding {
        gpus: vec!["GPU-1".into()],
        amount: inv.amount(&ask("w", false, 0, 0, 1).devices),
    };
    let usage = NodeUsage::of(&inv, [&filler, &whole]);
    let err = fit(&inv, &usage, &thirty).unwrap_err();
    assert_eq!(
        err.to_string(),
        "container c: no GPU has 30720 MiB free (largest 20480 MiB on GPU-0)"
    );
    assert!(!err.unresolvable);
    // Core short.
    let core = pod(vec![ask("c", false, 1, 90, 0)]);
    let err = fit(&inv, &usage, &core).unwrap_err();
    assert_eq!(
        err.reason,
        "no GPU has 90 % of its compute free (largest 80 % on GPU-0)"
    );
    // 100 GiB never fits here; neither does a resource the node lacks.
    let huge = pod(vec![ask("c", false, 400, 10, 0)]);
    let err = fit(&inv, &NodeUsage::empty(&inv), &huge).unwrap_err();
    assert!(err.unresolvable, "{err}");
    let mut no_count = inv.clone();
    no_count.resources = vec![Resource::GpuMemory, Resource::GpuCore];
    let err = fit(
        &no_count,
        &NodeUsage::empty(&inv),
        &pod(vec![ask("t", false, 0, 0, 1)]),
    )
    .unwrap_err();
    assert_eq!(err.reason, "asks gpu-count, which this node does not offer");
    assert!(err.unresolvable);
    // Everything held whole.
    let usage = NodeUsage::of(
        &inv,
        [&Holding {
            gpus: vec!["GPU-0".into(), "GPU-1".into()],
            amount: inv.amount(&ask("w", false, 0, 0, 2).devices),
        }],
    );
    assert_eq!(
        fit(&inv, &usage, &thirty).unwrap_err().reason,
        "every healthy GPU is held whole"
    );
}

#[test]
fn binpack_prefers_the_busier_node_and_spread_the_emptier() {
    let inv = inventory(&[8192, 8192]);
    let p = pod(vec![ask("c", false, 8, 10, 0)]);
    let empty = NodeUsage::empty(&inv);
    let busy = NodeUsage::of(
        &inv,
        [&Holding {
            gpus: vec!["GPU-0".into()],
            amount: inv.amount(&ask("f", false, 24, 80, 0).devices),
        }],
    );
    let on_empty = fit(&inv, &empty, &p).unwrap();
    let on_busy = fit(&inv, &busy, &p).unwrap();
    assert_eq!(on_busy.single_gpu(), Some("GPU-0"), "best fit packs");
    let s = |u: &NodeUsage, a: &Assignment, policy| score(&inv, u, &p, a, policy);
    assert_eq!(s(&empty, &on_empty, Policy::Binpack), 1);
    assert_eq!(s(&busy, &on_busy, Policy::Binpack), 5);
    assert_eq!(s(&empty, &on_empty, Policy::Spread), 9);
    assert_eq!(s(&busy, &on_busy, Policy::Spread), 5);
    // A whole GPU counts full.
    let whole = pod(vec![ask("t", false, 0, 0, 2)]);
    let a = fit(&inv, &empty, &whole).unwrap();
    assert_eq!(score(&inv, &empty, &whole, &a, Policy::Binpack), 10);
    assert_eq!(score(&inv, &empty, &whole, &a, Policy::Spread), 0);
}

#[test]
fn the_assignment_annotation_names_a_single_gpu_only_when_there_is_one() {
    let a = assignment(&[("a", &["GPU-0"]), ("b", &["GPU-0"])]);
    assert_eq!(a.single_gpu(), Some("GPU-0"));
    assert_eq!(Assignment::parse(Some(&a.to_json())).unwrap(), a);
    assert_eq!(a.to_json(), r#"{"a":["GPU-0"],"b":["GPU-0"]}"#);
    assert_eq!(assignment(&[("t", &["GPU-0", "GPU-1"])]).single_gpu(), None);
    assert_eq!(Assignment::default().single_gpu(), None);
    assert_eq!(Assignment::parse(None).unwrap(), Assignment::default());
    assert!(Assignment::parse(Some("[")).is_err());
    let keys = Keys::new("example.com");
    assert_eq!(keys.assignment, "example.com/gpu-assignment");
    assert_eq!(keys.inventory, "example.com/gpu-inventory");
    assert_eq!(keys.resources[Resource::GpuCore], "example.com/gpu-core");
}

#[test]
fn whole_gpus_of_init_containers_go_to_the_app_containers_first() {
    let inv = inventory(&[8192, 8192, 8192]);
    let busy = Holding {
        gpus: vec!["GPU-0".into(), "GPU-1".into()],
        amount: inv.amount(&ask("w", false, 0, 0, 2).devices),
    };
    let one_free = NodeUsage::of(&inv, [&busy]);
    // The kubelet hands the init container's GPU to the app: one free GPU
    // is enough, and both name it.
    let p = pod(vec![ask("init", true, 0, 0, 1), ask("app", false, 0, 0, 1)]);
    let a = fit(&inv, &one_free, &p).unwrap();
    assert_eq!(a, assignment(&[("init", &["GPU-2"]), ("app", &["GPU-2"])]));
    // Counted once: the pod holds one GPU whole, not two.
    let held = pod_holdings(&inv, &p.containers, &Ledger::default(), &a);
    let u = NodeUsage::of(&inv, &held);
    assert_eq!(u.gpus[2].used.count, 1, "{held:?}");
    assert_eq!(
        score(&inv, &NodeUsage::empty(&inv), &p, &a, Policy::Binpack),
        3
    );
    // Init 2, app 1: the app takes one of the init's two.
    let empty = NodeUsage::empty(&inv);
    let p = pod(vec![ask("init", true, 0, 0, 2), ask("app", false, 0, 0, 1)]);
    let a = fit(&inv, &empty, &p).unwrap();
    assert_eq!(a.0["init"], ["GPU-0", "GPU-1"]);
    assert_eq!(a.0["app"], ["GPU-0"]);
    // Init 1, app 2: the init's one reused, one fresh.
    let p = pod(vec![ask("init", true, 0, 0, 1), ask("app", false, 0, 0, 2)]);
    let a = fit(&inv, &empty, &p).unwrap();
    assert_eq!(a.0["init"], ["GPU-0"]);
    assert_eq!(a.0["app"], ["GPU-0", "GPU-1"]);
    let u = NodeUsage::of(
        &inv,
        &pod_holdings(&inv, &p.containers, &Ledger::default(), &a),
    );
    assert_eq!(
        u.gpus.iter().map(|g| g.used.count).collect::<Vec<_>>(),
        [1, 1, 0]
    );
    // Two GPUs free and a pod needing max(1, 2 + 1) = 3: no fit, and a
    // node of three fits it once empty.
    let two_free = NodeUsage::of(
        &inv,
        [&Holding {
            gpus: vec!["GPU-0".into()],
            amount: inv.amount(&ask("w", false, 0, 0, 1).devices),
        }],
    );
    let p = pod(vec![
        ask("init", true, 0, 0, 1),
        ask("app", false, 0, 0, 2),
        ask("side", false, 0, 0, 1),
    ]);
    let e = fit(&inv, &two_free, &p).unwrap_err();
    assert_eq!(e.container, "side");
    assert!(!e.unresolvable, "{e}");
    let a = fit(&inv, &empty, &p).unwrap();
    assert_eq!(a.0["side"], ["GPU-2"]);
    // Init containers one after another: the second reuses the first's
    // GPU, and the app gets both of theirs.
    let p = pod(vec![
        ask("init1", true, 0, 0, 1),
        ask("init2", true, 0, 0, 2),
        ask("app", false, 0, 0, 2),
    ]);
    let a = fit(&inv, &two_free, &p).unwrap();
    assert_eq!(a.0["init1"], ["GPU-1"]);
    assert_eq!(a.0["init2"], ["GPU-1", "GPU-2"]);
    assert_eq!(a.0["app"], ["GPU-1", "GPU-2"]);
}

#[test]
fn a_live_pods_ledger_counts_a_gpu_handed_from_init_to_app_once() {
    let inv = inventory(&[8192, 8192]);
    let containers = vec![ask("init", true, 0, 0, 1), ask("app", false, 0, 0, 1)];
    let mut ledger = Ledger::default();
    for c in ["init", "app"] {
        ledger
            .0
            .insert(c.into(), grant("GPU-1", None, None, Some(1)));
    }
    let held = pod_holdings(&inv, &containers, &ledger, &Assignment::default());
    let u = NodeUsage::of(&inv, &held);
    assert_eq!(u.gpus[1].used.count, 1, "{held:?}");
    assert_eq!(u.gpus[0], GpuUsage::default());
}

/// Accounting read from annotations counts only as far as the pod's spec
/// supports it (SPEC §7 Trust): forged, inflated or garbled records.
mod trust {
    use super::*;

    /// Memory, core and whole-GPU use per GPU.
    fn used(inv: &Inventory, h: &[Holding]) -> Vec<(u64, u64, u64)> {
        let u = NodeUsage::of(inv, h);
        u.gpus
            .iter()
            .map(|g| (g.used.memory, g.used.core, g.used.count))
            .collect()
    }

    /// A pod with `annotations` and one container `app` asking `limits`.
    fn api_pod(annotations: &[(&str, &str)], limits: &[(&str, &str)]) -> Pod {
        let mut p = Pod::default();
        p.metadata.annotations = Some(
            annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        p.spec = Some(PodSpec {
            containers: vec![Container {
                name: "app".into(),
                resources: Some(ResourceRequirements {
                    limits: Some(
                        limits
                            .iter()
                            .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                            .collect(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        });
        p
    }

    fn holdings_of(inv: &Inventory, p: &Pod) -> Vec<Holding> {
        let keys = Keys::new("doslab.io");
        let r = Records::read(&keys, p);
        pod_holdings(
            inv,
            &PodAsks::from_pod(&keys, p).containers,
            &r.ledger,
            &r.assignment,
        )
    }

    #[test]
    fn a_pod_asking_no_gpu_holds_nothing_whatever_its_ledger_claims() {
        let inv = inventory(&[16384, 16384]);
        let forged = r#"{"app":{"gpus":["GPU-0","GPU-1"],"gpu-memory":1000000000000000000,"gpu-count":2},
                        "ghost":{"gpus":["GPU-1"],"gpu-memory":16384,"gpu-core":100}}"#;
        let assigned = r#"{"app":["GPU-0"],"ghost":["GPU-1"]}"#;
        let p = api_pod(
            &[
                ("doslab.io/gpu-ledger", forged),
                ("doslab.io/gpu-assignment", assigned),
            ],
            &[("cpu", "1")],
        );
        assert_eq!(holdings_of(&inv, &p), []);
        // Garbled too: nothing asked, nothing held.
        let p = api_pod(&[("doslab.io/gpu-ledger", "{oops")], &[("cpu", "1")]);
        assert_eq!(holdings_of(&inv, &p), []);
    }

    #[test]
    fn a_grant_counts_as_the_containers_ask_for_what_it_asks_only() {
        let inv = inventory(&[16384, 16384]);
        // Asks 4 memory devices (1024 MiB) and no core or whole GPU; the
        // ledger claims far more, a whole GPU, and a container the spec
        // lacks.
        let containers = vec![ask("app", false, 4, 0, 0)];
        let mut ledger = Ledger::default();
        ledger.0.insert(
            "app".into(),
            grant("GPU-0", Some(1 << 40), Some(100), Some(2)),
        );
        ledger
            .0
            .insert("ghost".into(), grant("GPU-1", Some(16384), None, Some(1)));
        let h = pod_holdings(&inv, &containers, &ledger, &Assignment::default());
        assert_eq!(used(&inv, &h), [(1024, 0, 0), (0, 0, 0)]);
        // Claiming less than the ask frees nothing either.
        ledger.0.clear();
        ledger
            .0
            .insert("app".into(), grant("GPU-1", Some(1), None, None));
        let h = pod_holdings(&inv, &containers, &ledger, &Assignment::default());
        assert_eq!(used(&inv, &h), [(0, 0, 0), (1024, 0, 0)]);
    }

    #[test]
    fn a_record_naming_gpus_the_node_lacks_or_too_few_holds_the_ask_everywhere() {
        let inv = inventory(&[16384, 16384]);
        let shared = vec![ask("app", false, 4, 10, 0)];
        let mut ledger = Ledger::default();
        ledger
            .0
            .insert("app".into(), grant("GPU-x", Some(1024), Some(10), None));
        let h = pod_holdings(&inv, &shared, &ledger, &Assignment::default());
        assert_eq!(used(&inv, &h), [(1024, 10, 0), (1024, 10, 0)]);
        // A whole ask of 2 whose ledger names one GPU (twice).
        let whole = vec![ask("train", false, 0, 0, 2)];
        let mut ledger = Ledger::default();
        let mut g = grant("GPU-0", None, None, Some(2));
        g.gpus.push("GPU-0".into());
        ledger.0.insert("train".into(), g);
        let h = pod_holdings(&inv, &whole, &ledger, &Assignment::default());
        assert_eq!(used(&inv, &h), [(0, 0, 1), (0, 0, 1)]);
        // An assignment naming a GPU the node lacks: the same.
        let a = assignment(&[("app", &["GPU-9"])]);
        let h = pod_holdings(&inv, &shared, &Ledger::default(), &a);
        assert_eq!(used(&inv, &h), [(1024, 10, 0), (1024, 10, 0)]);
        // A sound record counts on its GPU only.
        let a = assignment(&[("train", &["GPU-1", "GPU-0"])]);
        let h = pod_holdings(&inv, &whole, &Ledger::default(), &a);
        assert_eq!(used(&inv, &h), [(0, 0, 1), (0, 0, 1)]);
        let a = assignment(&[("app", &["GPU-1"])]);
        let h = pod_holdings(&inv, &shared, &Ledger::default(), &a);
        assert_eq!(used(&inv, &h), [(0, 0, 0), (1024, 10, 0)]);
    }

    #[test]
    fn a_garbled_ledger_never_frees_room_and_is_named() {
        let inv = inventory(&[16384, 16384, 16384]);
        let limits = [("doslab.io/gpu-memory", "4"), ("doslab.io/gpu-core", "10")];
        let assigned = ("doslab.io/gpu-assignment", r#"{"app":["GPU-1"]}"#);
        for garbage in [
            "{not json",
            r#"{"app":5}"#,
            r#"{"app":{"gpus":"GPU-1"}}"#,
            "[]",
        ] {
            let bad = ("doslab.io/gpu-ledger", garbage);
            // Assigned readably: held on its assigned GPU.
            let p = api_pod(&[bad, assigned], &limits);
            let r = Records::read(&Keys::new("doslab.io"), &p);
            let g = r.garbled_ledger.as_ref().expect(garbage);
            assert_eq!(g.key, "doslab.io/gpu-ledger");
            assert!(g.to_string().contains("doslab.io/gpu-ledger"), "{g}");
            assert!(r.ledger.1.ledger && !r.ledger.1.assignment);
            assert_eq!(
                used(&inv, &holdings_of(&inv, &p)),
                [(0, 0, 0), (1024, 10, 0), (0, 0, 0)],
                "{garbage}"
            );
            // Not assigned (served by the daemon alone): held anywhere.
            let p = api_pod(&[bad], &limits);
            assert_eq!(
                used(&inv, &holdings_of(&inv, &p)),
                [(1024, 10, 0); 3],
                "{garbage}"
            );
        }
        // A whole-GPU pod with a garbled ledger holds every GPU whole.
        let p = api_pod(
            &[("doslab.io/gpu-ledger", "null")],
            &[("doslab.io/gpu-count", "1")],
        );
        assert_eq!(used(&inv, &holdings_of(&inv, &p)), [(0, 0, 1); 3]);
    }

    #[test]
    fn a_garbled_assignment_holds_what_the_ledger_has_not_served_anywhere() {
        let inv = inventory(&[16384, 16384]);
        let limits = [("doslab.io/gpu-memory", "4"), ("doslab.io/gpu-core", "10")];
        let bad = ("doslab.io/gpu-assignment", r#"{"app":"GPU-0"}"#);
        // Memory served on GPU-1, core not yet: the core may be anywhere.
        let ledger = (
            "doslab.io/gpu-ledger",
            r#"{"app":{"gpus":["GPU-1"],"gpu-memory":1024}}"#,
        );
        let p = api_pod(&[bad, ledger], &limits);
        let r = Records::read(&Keys::new("doslab.io"), &p);
        assert_eq!(r.garbled().count(), 1);
        assert!(r.garbled_assignment.is_some() && r.ledger.1.assignment);
        assert_eq!(
            used(&inv, &holdings_of(&inv, &p)),
            [(0, 10, 0), (1024, 10, 0)]
        );
        // Fully served: the ledger says it all.
        let ledger = (
            "doslab.io/gpu-ledger",
            r#"{"app":{"gpus":["GPU-1"],"gpu-memory":1024,"gpu-core":10}}"#,
        );
        let p = api_pod(&[bad, ledger], &limits);
        assert_eq!(
            used(&inv, &holdings_of(&inv, &p)),
            [(0, 0, 0), (1024, 10, 0)]
        );
    }
}
