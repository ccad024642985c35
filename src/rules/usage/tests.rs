//! The usage model over hand-built inventories, pods and ledgers.

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::annotations::ledger::LedgerEntry;
use super::node::GpuUsage;
use super::*;
use crate::rules::device::{Gpu, Offer, PerResource, Resource, Units};

/// A node without labels.
static NO_LABELS: std::collections::BTreeMap<String, String> = std::collections::BTreeMap::new();

/// A node that states no allocatable CPU or memory.
const UNBOUNDED: NodeAsk = NodeAsk {
    cpu_milli: u64::MAX,
    memory: u64::MAX,
};

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
        invalid: None,
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
    PodAsks {
        containers,
        ..PodAsks::default()
    }
}

fn assignment(pairs: &[(&str, &[&str])]) -> Assignment {
    Assignment(
        pairs
            .iter()
            .map(|(c, g)| (c.to_string(), g.iter().map(|s| s.to_string()).collect()))
            .collect(),
    )
}

fn grant(gpu: &str, memory: Option<u64>, core: Option<u64>, count: Option<u64>) -> LedgerEntry {
    LedgerEntry {
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
    // devices: beside the init container (counted while the pod lives) it
    // has no room on either GPU, and another GPU would contradict those IDs.
    let p = pod(vec![
        ask("init", true, 20, 10, 0),
        ask("app", false, 16, 10, 0),
    ]);
    let e = fit(&inv, &usage, &p).unwrap_err();
    assert_eq!(e.container, "app");
    assert!(e.reason.contains("must share one GPU with init:"), "{e}");
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
    // the 20, which leaves 12 for the app, on the same GPU, where there is
    // no room for it.
    let p = pod(vec![
        ask("init", true, 20, 0, 0),
        sidecar("proxy", 8, 0, 0),
        ask("app", false, 16, 0, 0),
    ]);
    let e = fit(&inv, &usage, &p).unwrap_err();
    assert_eq!(e.container, "app");
    assert!(
        e.reason.contains("must share one GPU with init, proxy:"),
        "{e}"
    );
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

/// Quantities, inventories and arithmetic that a hostile or merely
/// unusual cluster brings.
mod hostile {
    use super::*;

    fn container(name: &str, limits: &[(&str, &str)]) -> Container {
        Container {
            name: name.into(),
            resources: Some(ResourceRequirements {
                limits: Some(
                    limits
                        .iter()
                        .map(|(k, v)| (format!("doslab.io/{k}"), Quantity(v.to_string())))
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn asks_of(containers: Vec<Container>) -> PodAsks {
        let p = Pod {
            spec: Some(PodSpec {
                containers,
                ..Default::default()
            }),
            ..Default::default()
        };
        PodAsks::from_pod(&Keys::new("doslab.io"), &p)
    }

    #[test]
    fn canonical_quantities_are_asks() {
        let asks = asks_of(vec![container(
            "app",
            &[
                ("gpu-memory", "8k"),
                ("gpu-core", "5e1"),
                ("gpu-count", "0"),
            ],
        )]);
        assert_eq!(asks.invalid(), None);
        assert_eq!(asks.containers[0].devices, PerResource::from([8000, 50, 0]));
    }

    #[test]
    fn an_unreadable_limit_is_an_error_naming_container_resource_and_value() {
        for bad in ["1.5", "-8", "500m", "8 k", "1e30", "x"] {
            let asks = asks_of(vec![
                container("ok", &[("gpu-memory", "4")]),
                container("app", &[("gpu-core", "10"), ("gpu-memory", bad)]),
            ]);
            let e = asks.invalid().unwrap_or_else(|| panic!("{bad:?} read"));
            let text = e.to_string();
            assert!(
                text.starts_with("container app: limit doslab.io/gpu-memory quantity"),
                "{text}"
            );
            assert!(text.contains(&format!("{bad:?}")), "{text}");
            // The rest of the container is still read.
            assert_eq!(asks.containers[1].wants(Resource::GpuCore), 10);
            assert_eq!(asks.containers[0].invalid, None);
        }
    }

    #[test]
    fn every_combination_of_resources_in_hundreds_of_containers_is_read() {
        let values = ["0", "1", "8k", "1Ki"];
        let mut containers = Vec::new();
        let mut want = Vec::new();
        for i in 0..300usize {
            let pick = |shift: usize| values[(i >> shift) % values.len()];
            let (m, c, n) = (pick(0), pick(2), pick(4));
            containers.push(container(
                &format!("c{i}"),
                &[("gpu-memory", m), ("gpu-core", c), ("gpu-count", n)],
            ));
            let count = |v: &str| crate::rules::usage::quantity::parse_count(v, u64::MAX).unwrap();
            want.push(PerResource::from([count(m), count(c), count(n)]));
        }
        let asks = asks_of(containers);
        assert_eq!(asks.invalid(), None);
        let got: Vec<_> = asks.containers.iter().map(|c| c.devices).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn an_ask_whose_amount_overflows_never_fits() {
        let mut inv = inventory(&[1024 * 80]);
        inv.memory_unit_mib = 1024;
        // 2^54 devices of 1024 MiB: 2^64 MiB, which wrapped to 0 and fit.
        let huge = pod(vec![ask("big", false, 1 << 54, 0, 0)]);
        let e = fit(&inv, &NodeUsage::empty(&inv), &huge).unwrap_err();
        assert_eq!(e.container, "big");
        assert!(e.reason.contains("more than 2^64"), "{e}");
        assert!(e.unresolvable, "{e:?}");
        // Held (a hostile assignment), it fills the GPU rather than wrap.
        let holding = Holding {
            gpus: vec!["GPU-0".into()],
            amount: inv.amount(&huge.containers[0].devices),
        };
        let mut usage = NodeUsage::of(&inv, [&holding]);
        usage.add(&inv, &holding);
        assert_eq!(usage.free(&inv, 0, Resource::GpuMemory), 0);
        let small = pod(vec![ask("small", false, 1, 0, 0)]);
        assert!(fit(&inv, &usage, &small).is_err());
        assert_eq!(
            score(
                &inv,
                &usage,
                &small,
                &Assignment::default(),
                Policy::Binpack
            ),
            10
        );
    }

    #[test]
    fn an_inventory_with_duplicate_empty_or_unsized_gpus_is_refused() {
        let text = inventory(&[40960, 40960]).to_json();
        let refused = |text: &str, why: &str| {
            let e = Inventory::parse(text).unwrap_err();
            assert!(matches!(e, InventoryError::Invalid(_)), "{e:?}");
            assert!(e.to_string().contains(why), "{e} lacks {why}");
        };
        refused(
            &text.replace(r#""uuid":"GPU-1""#, r#""uuid":"GPU-0""#),
            r#"GPU uuid "GPU-0" is listed twice"#,
        );
        refused(
            &text.replace(r#""uuid":"GPU-1""#, r#""uuid":" ""#),
            "GPU 1 has an empty uuid",
        );
        refused(
            &text.replacen(r#""memoryMiB":40960"#, r#""memoryMiB":0"#, 1),
            "GPU GPU-0 has 0 MiB, less than one memoryUnitMiB (256)",
        );
        refused(
            &text.replacen(
                r#""memoryMiB":40960"#,
                &format!(r#""memoryMiB":{}"#, u64::MAX),
                1,
            ),
            "more than 2^32 devices",
        );
        let e = Inventory::parse(&text.replace(r#""memoryMiB":40960"#, "\"memoryMiB\":-1"));
        assert!(matches!(e, Err(InventoryError::Json(_))), "{e:?}");
    }
}

/// The fit searches for a placement: it finds one whenever the rules allow
/// one, checked against an exhaustive search written here from the rules.
mod search {
    use super::*;
    use crate::rules::usage::fit::MAX_GPU_CONTAINERS;

    /// The fit's assignment as GPU indexes, per container name.
    fn gpus_of(inv: &Inventory, a: &Assignment, name: &str) -> Vec<usize> {
        a.0[name].iter().map(|u| inv.index(u).unwrap()).collect()
    }

    #[test]
    fn an_init_container_goes_where_the_app_it_hands_on_to_fits() {
        // 32 devices per GPU; GPU-0 has 12 left. The init container alone
        // fits best on GPU-0, but the app it hands its 8 devices to needs 8
        // more beside them: only the empty GPU-1 holds both.
        let inv = inventory(&[8192, 8192]);
        let filler = Holding {
            gpus: vec!["GPU-0".into()],
            amount: inv.amount(&ask("f", false, 20, 10, 0).devices),
        };
        let usage = NodeUsage::of(&inv, [&filler]);
        let p = pod(vec![
            ask("init", true, 8, 0, 0),
            ask("app", false, 16, 0, 0),
        ]);
        let a = fit(&inv, &usage, &p).unwrap();
        assert_eq!(a, assignment(&[("init", &["GPU-1"]), ("app", &["GPU-1"])]));
        check(&inv, &usage, &p, &a).unwrap();
    }

    #[test]
    fn three_containers_of_8_12_and_12_gib_fit_on_20_and_12_gib() {
        let inv = inventory(&[20480, 12288]);
        let usage = NodeUsage::empty(&inv);
        let p = pod(vec![
            ask("a", false, 32, 0, 0),
            ask("b", false, 48, 0, 0),
            ask("c", false, 48, 0, 0),
        ]);
        let a = fit(&inv, &usage, &p).unwrap();
        check(&inv, &usage, &p, &a).unwrap();
        assert_eq!(a.0["a"], ["GPU-0"], "{a:?}");
        assert_ne!(a.0["b"], a.0["c"], "{a:?}");
    }

    #[test]
    fn a_pod_that_cannot_fit_in_all_is_refused_with_the_totals() {
        // 8 + 12 + 13 GiB on 20 and 12 GiB: more than the node has.
        let inv = inventory(&[20480, 12288]);
        let p = pod(vec![
            ask("a", false, 32, 0, 0),
            ask("b", false, 48, 0, 0),
            ask("c", false, 52, 0, 0),
        ]);
        let e = fit(&inv, &NodeUsage::empty(&inv), &p).unwrap_err();
        assert!(e.unresolvable, "{e}");
        assert!(e.reason.contains("33792 MiB"), "{e}");
    }

    #[test]
    fn a_pod_of_too_many_gpu_containers_is_refused_for_good() {
        let inv = inventory(&[81920; 8]);
        let usage = NodeUsage::empty(&inv);
        let many = |n: usize| {
            pod((0..n)
                .map(|i| ask(&format!("c{i}"), false, 1, 0, 0))
                .chain([ask("idle", false, 0, 0, 0)])
                .collect())
        };
        // At the cap it is placed (256 MiB each, all on one GPU).
        let a = fit(&inv, &usage, &many(MAX_GPU_CONTAINERS)).unwrap();
        assert_eq!(a.single_gpu(), Some("GPU-0"));
        for n in [MAX_GPU_CONTAINERS + 1, 6000] {
            let e = fit(&inv, &usage, &many(n)).unwrap_err();
            assert!(e.unresolvable, "{e}");
            assert_eq!(e.container, format!("c{MAX_GPU_CONTAINERS}"));
            assert!(
                e.reason.contains(&format!("{n} containers asking GPUs")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_search_that_runs_out_of_steps_says_it_gave_up() {
        // 17 containers of 11 devices on 8 GPUs of 32: two per GPU, so one
        // is left over, though the node has room for all of them in total;
        // proving it takes more than the search may spend.
        let inv = inventory(&[8192; 8]);
        let p = pod((0..17)
            .map(|i| ask(&format!("c{i}"), false, 11, 0, 0))
            .collect());
        let e = fit(&inv, &NodeUsage::empty(&inv), &p).unwrap_err();
        assert!(e.reason.contains("gave up"), "{e}");
        assert!(!e.unresolvable, "not proven: {e}");
    }

    #[test]
    fn an_ask_larger_than_any_gpu_is_refused_without_overflow() {
        let inv = inventory(&[8192]);
        let p = pod(vec![ask("c", false, u64::MAX / 2, 0, 0)]);
        let e = fit(&inv, &NodeUsage::empty(&inv), &p).unwrap_err();
        assert!(e.unresolvable, "{e}");
        // Refused before any arithmetic, saying why.
        assert!(e.reason.contains("more than 2^64 in all"), "{e}");
        let p = pod(vec![ask("t", false, 0, 0, u64::MAX)]);
        let e = fit(&inv, &NodeUsage::empty(&inv), &p).unwrap_err();
        assert!(e.unresolvable, "{e}");
    }

    /// `cargo test --lib fit_figures -- --ignored --nocapture`: what one
    /// fit costs per node, printed for benches/README.md (nothing asserted on
    /// time).
    #[test]
    #[ignore = "prints figures"]
    fn fit_figures() {
        // 8 × 80 GB, a third full: the bench's big node.
        let inv = inventory(&[81920; 8]);
        let busy: Vec<Holding> = (0..8)
            .map(|g| Holding {
                gpus: vec![format!("GPU-{g}")],
                amount: inv.amount(&ask("f", false, 40 + 10 * g, 30, 0).devices),
            })
            .collect();
        let usage = NodeUsage::of(&inv, &busy);
        let apps = |n: usize, mem: &dyn Fn(usize) -> u64| {
            pod((0..n)
                .map(|i| ask(&format!("c{i}"), false, mem(i), 1, 0))
                .collect())
        };
        let cases = [
            (
                "ordinary pod: init 4 GiB, apps 8 + 2 GiB",
                pod(vec![
                    ask("init", true, 16, 10, 0),
                    ask("app", false, 32, 30, 0),
                    ask("side", false, 8, 0, 0),
                ]),
                2000,
            ),
            ("issue: 8/12/12 GiB", apps(3, &|i| [32, 48, 48][i]), 2000),
            (
                "256 containers of 256 MiB-2.5 GiB (fits)",
                apps(256, &|i| 1 + i as u64 % 10),
                20,
            ),
            (
                "256 containers of 1.5-16 GiB (refused: too much in all)",
                apps(256, &|i| 6 + i as u64 % 60),
                20,
            ),
            (
                "17 containers of 2.75 GiB on 8 × 8 GiB-left GPUs (gives up)",
                apps(17, &|_| 11),
                20,
            ),
            (
                "6,000 containers (refused: over the cap)",
                apps(6000, &|_| 1),
                20,
            ),
        ];
        let small = inventory(&[8192; 8]);
        for (name, p, runs) in cases {
            let (inv, usage) = match name.contains("gives up") {
                true => (&small, NodeUsage::empty(&small)),
                false => (&inv, usage.clone()),
            };
            let start = std::time::Instant::now();
            let mut outcome = String::new();
            for _ in 0..runs {
                outcome = match fit(inv, &usage, &p) {
                    Ok(_) => "placed".into(),
                    Err(e) => format!("refused: {}", e.reason.chars().take(70).collect::<String>()),
                };
            }
            let each = start.elapsed() / runs;
            println!(
                "{name}: {each:?} per node, {:?} over 1,000 nodes ({outcome})",
                each * 1000
            );
        }
    }

    #[test]
    fn pass_on_count_counts_what_pass_on_keeps() {
        // Devices taken from the pool first, then fresh ones.
        for c in [
            ask("i", true, 1, 0, 0),
            sidecar("s", 1, 0, 0),
            ask("a", false, 1, 0, 0),
        ] {
            for pool in 0..6u64 {
                for granted in 0..8u64 {
                    let mut devices: Vec<u64> = (0..pool).collect();
                    let mine: Vec<u64> = (0..granted)
                        .map(|d| if d < pool { d } else { 100 + d })
                        .collect();
                    c.pass_on(&mut devices, &mine);
                    assert_eq!(
                        c.pass_on_count(pool, granted),
                        devices.len() as u64,
                        "{} with {pool} handed on, granted {granted}",
                        c.name
                    );
                }
            }
        }
    }

    /// The rules, container by container in spec order, as the kubelet
    /// meets them; written apart from the fit, which must agree.
    #[derive(Clone)]
    struct Replay<'a> {
        inv: &'a Inventory,
        mem: Vec<u64>,
        core: Vec<u64>,
        whole: Vec<u64>,
        sharers: Vec<u64>,
        /// Whole GPUs the init containers hand on.
        handed: Vec<usize>,
        /// Shared devices they hand on, per resource: how many, on which
        /// GPUs.
        devices: [(u64, Vec<usize>); 2],
    }

    impl<'a> Replay<'a> {
        fn new(inv: &'a Inventory, usage: &NodeUsage) -> Replay<'a> {
            let per = |f: &dyn Fn(&GpuUsage) -> u64| usage.gpus.iter().map(f).collect();
            Replay {
                inv,
                mem: per(&|u| u.used.memory),
                core: per(&|u| u.used.core),
                whole: per(&|u| u.used.count),
                sharers: per(&|u| u.sharers),
                handed: Vec::new(),
                devices: Default::default(),
            }
        }

        /// `c` on `gpus`: why not, if the rules forbid it.
        fn step(&mut self, c: &ContainerAsk, gpus: &[usize]) -> Result<(), String> {
            let inv = self.inv;
            if let Some(r) = Resource::ALL
                .into_iter()
                .find(|&r| c.wants(r) > 0 && !inv.offers(r))
            {
                return Err(format!("{r} not offered"));
            }
            let hands_on = c.init && !c.restartable;
            if c.devices.count > 0 {
                let k = c.devices.count as usize;
                let mut sorted = gpus.to_vec();
                sorted.sort();
                sorted.dedup();
                if sorted.len() != k || gpus.len() != k {
                    return Err(format!("{k} whole GPUs wanted, {gpus:?} given"));
                }
                let reused = gpus.iter().filter(|g| self.handed.contains(g)).count();
                if reused != k.min(self.handed.len()) {
                    return Err(format!("takes {reused} handed on of {:?}", self.handed));
                }
                for &g in gpus.iter().filter(|g| !self.handed.contains(g)) {
                    if !inv.gpus[g].healthy || self.whole[g] > 0 || self.sharers[g] > 0 {
                        return Err(format!("GPU {g} is not free"));
                    }
                    self.whole[g] += 1;
                }
                if hands_on {
                    for &g in gpus {
                        if !self.handed.contains(&g) {
                            self.handed.push(g);
                        }
                    }
                } else {
                    self.handed.retain(|g| !gpus.contains(g));
                }
                return Ok(());
            }
            let wants = [c.devices.memory, c.devices.core];
            if wants == [0, 0] {
                return Ok(());
            }
            let &[g] = gpus else {
                return Err(format!("a shared container on {gpus:?}"));
            };
            let cap = inv.capacity(g);
            let need = inv.amount(&c.devices);
            if !inv.gpus[g].healthy
                || self.whole[g] > 0
                || self.mem[g] + need.memory > cap.memory
                || self.core[g] + need.core > cap.core
            {
                return Err(format!("no room on GPU {g}"));
            }
            for (i, &w) in wants.iter().enumerate() {
                let (n, on) = &self.devices[i];
                if w > 0 && *n > 0 && on != &[g] {
                    return Err(format!("handed devices on {on:?}, placed on {g}"));
                }
            }
            self.mem[g] += need.memory;
            self.core[g] += need.core;
            self.sharers[g] += 1;
            for (i, &w) in wants.iter().enumerate().filter(|(_, w)| **w > 0) {
                let (n, on) = &mut self.devices[i];
                if hands_on {
                    if *n == 0 {
                        on.clear();
                    }
                    *n = (*n).max(w);
                    if !on.contains(&g) {
                        on.push(g);
                    }
                } else {
                    *n = n.saturating_sub(w);
                }
            }
            Ok(())
        }
    }

    /// Whether `a` places every container of `p` by the rules.
    fn check(
        inv: &Inventory,
        usage: &NodeUsage,
        p: &PodAsks,
        a: &Assignment,
    ) -> Result<(), String> {
        let mut replay = Replay::new(inv, usage);
        for c in &p.containers {
            let asks = Resource::ALL.iter().any(|&r| c.wants(r) > 0);
            let gpus: Vec<usize> = match a.0.get(&c.name) {
                Some(uuids) => uuids.iter().map(|u| inv.index(u).unwrap()).collect(),
                None if asks => return Err(format!("{} has no GPUs", c.name)),
                None => continue,
            };
            replay
                .step(c, &gpus)
                .map_err(|e| format!("{}: {e}", c.name))?;
        }
        Ok(())
    }

    /// Every choice of GPUs for every container, in spec order: whether
    /// any places the pod.
    fn exists(replay: &Replay, containers: &[ContainerAsk]) -> bool {
        let Some((c, rest)) = containers.split_first() else {
            return true;
        };
        let n = replay.inv.gpus.len();
        let choices: Vec<Vec<usize>> = match c.devices.count {
            0 => (0..n).map(|g| vec![g]).collect(),
            k => (0u32..1 << n)
                .filter(|m| m.count_ones() as u64 == k)
                .map(|m| (0..n).filter(|g| m & 1 << g != 0).collect())
                .collect(),
        };
        choices.iter().any(|gpus| {
            let mut next = replay.clone();
            next.step(c, gpus).is_ok() && exists(&next, rest)
        })
    }

    fn random_case(rng: &mut fastrand::Rng) -> (Inventory, NodeUsage, PodAsks) {
        let n = 1 + rng.u64(..4) as usize;
        let sizes: Vec<u64> = (0..n)
            .map(|_| [2048, 4096, 8192][rng.u64(..3) as usize])
            .collect();
        let mut inv = inventory(&sizes);
        for g in &mut inv.gpus {
            g.healthy = rng.u64(..100) >= 10;
        }
        if rng.u64(..100) < 10 {
            inv.resources.remove(rng.u64(..3) as usize);
        }
        let mut prior = Vec::new();
        for g in 0..n {
            let uuid = vec![inv.gpus[g].uuid.clone()];
            let devices = inv.capacity(g).memory / 256;
            if rng.u64(..100) < 20 {
                prior.push(Holding {
                    gpus: uuid,
                    amount: inv.amount(&ask("w", false, 0, 0, 1).devices),
                });
            } else if rng.u64(..100) < 50 {
                let (mem, core) = (rng.u64(..devices + 1), rng.u64(..11) * 10);
                prior.push(Holding {
                    gpus: uuid,
                    amount: inv.amount(&ask("s", false, mem, core, 0).devices),
                });
            }
        }
        let usage = NodeUsage::of(&inv, &prior);
        let count = 1 + rng.u64(..4);
        let inits = rng.u64(..count + 1);
        let containers = (0..count)
            .map(|i| {
                let mem = if rng.u64(..100) < 60 {
                    1 + rng.u64(..24)
                } else {
                    0
                };
                let core = if rng.u64(..100) < 40 {
                    10 * (1 + rng.u64(..10))
                } else {
                    0
                };
                let whole = if rng.u64(..100) < 25 {
                    1 + rng.u64(..2)
                } else {
                    0
                };
                let c = ask(&format!("c{i}"), i < inits, mem, core, whole);
                ContainerAsk {
                    restartable: c.init && rng.u64(..100) < 35,
                    ..c
                }
            })
            .collect();
        (inv, usage, pod(containers))
    }

    #[test]
    fn the_fit_places_every_small_pod_the_rules_place() {
        let mut rng = fastrand::Rng::with_seed(0x05ee_df17);
        let (mut placed, mut refused) = (0, 0);
        for case in 0..4000 {
            let (inv, usage, p) = random_case(&mut rng);
            let possible = exists(&Replay::new(&inv, &usage), &p.containers);
            let ctx = || format!("case {case}: {inv:?}\n{usage:?}\n{p:?}");
            match fit(&inv, &usage, &p) {
                Ok(a) => {
                    if let Err(e) = check(&inv, &usage, &p, &a) {
                        panic!("{e}: {a:?}\n{}", ctx());
                    }
                    placed += 1;
                }
                Err(e) => {
                    assert!(
                        !possible,
                        "refused ({e}) though a placement exists\n{}",
                        ctx()
                    );
                    assert!(!e.reason.contains("gave up"), "{e}\n{}", ctx());
                    let mut ideal = inv.clone();
                    ideal.gpus.iter_mut().for_each(|g| g.healthy = true);
                    let empty = NodeUsage::empty(&ideal);
                    let ever = exists(&Replay::new(&ideal, &empty), &p.containers);
                    assert_eq!(e.unresolvable, !ever, "{e}\n{}", ctx());
                    refused += 1;
                }
            }
        }
        // Both outcomes are well represented.
        assert!(
            placed > 1000 && refused > 1000,
            "{placed} placed, {refused} refused"
        );
    }

    #[test]
    fn a_single_shared_container_goes_where_best_shared_says() {
        let mut rng = fastrand::Rng::with_seed(0xbe57);
        for _ in 0..500 {
            let (inv, usage, mut p) = random_case(&mut rng);
            p.containers.truncate(1);
            p.containers[0].devices.count = 0;
            let need = inv.amount(&p.containers[0].devices);
            let Ok(a) = fit(&inv, &usage, &p) else {
                continue;
            };
            if a.0.is_empty() {
                continue;
            }
            assert_eq!(
                gpus_of(&inv, &a, &p.containers[0].name),
                Vec::from_iter(best_shared(&inv, &usage, &need)),
                "{a:?}"
            );
        }
    }
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

/// Fragmentation as the paper defines it, kind by kind.
mod fragmentation {
    use std::collections::HashMap;

    use super::*;

    /// `inv`'s usage with one container `c` on GPU-0.
    fn on_gpu0(inv: &Inventory, c: ContainerAsk) -> NodeUsage {
        let name = c.name.clone();
        let holder = pod(vec![c]);
        let placed = assignment(&[(&name, &["GPU-0"])]);
        NodeUsage::of(
            inv,
            &pod_holdings(inv, &holder.containers, &Ledger::default(), &placed),
        )
    }

    /// Two GPUs of 2,560 MiB (10 devices each); GPU-0 half used.
    fn half_used() -> (Inventory, NodeUsage) {
        let inv = inventory(&[2560, 2560]);
        let usage = on_gpu0(&inv, ask("a", false, 5, 50, 0));
        (inv, usage)
    }

    fn kind(cpu_milli: u64, shares: &[[u64; 2]], whole: u64) -> Kind {
        Kind {
            node: NodeAsk {
                cpu_milli,
                memory: 0,
            },
            shares: shares.to_vec(),
            whole,
            ..Kind::default()
        }
    }

    fn alone(k: Kind) -> Workload {
        Workload::of(&HashMap::from([(k, 1)]), 0)
    }

    #[test]
    fn each_kind_strands_what_it_cannot_use() {
        let (inv, usage) = half_used();
        let room = |free| NodeRoom {
            inventory: &inv,
            usage: &usage,
            free,
            labels: &NO_LABELS,
        };
        let frag = |k: Kind, free| alone(k).fragmentation(&room(free));
        let (any, cpu) = (UNBOUNDED, |cpu_milli| NodeAsk {
            cpu_milli,
            ..UNBOUNDED
        });
        // 60 % shares: GPU-0's free half is too small for one.
        assert_eq!(frag(kind(0, &[[6, 60]], 0), any), 500.0);
        // 20 % shares fit both GPUs: nothing stranded...
        assert_eq!(frag(kind(0, &[[2, 20]], 0), any), 0.0);
        // ...unless the node lacks the CPU they ask: then all of it.
        assert_eq!(frag(kind(4000, &[[2, 20]], 0), cpu(2000)), 1500.0);
        assert_eq!(frag(kind(4000, &[[2, 20]], 0), cpu(4000)), 0.0);
        // Or the memory: a kind asking 8 GiB of a node with 4 left.
        let mut big = kind(0, &[[2, 20]], 0);
        big.node.memory = 8 << 30;
        let memory = NodeAsk {
            memory: 4 << 30,
            ..UNBOUNDED
        };
        assert_eq!(frag(big.clone(), memory), 1500.0);
        assert_eq!(frag(big, any), 0.0);
        // One whole GPU: the half-used one is stranded; two: all is.
        assert_eq!(frag(kind(0, &[], 1), any), 500.0);
        assert_eq!(frag(kind(0, &[], 2), any), 1500.0);
        // A pod asking no GPU uses none of it.
        assert_eq!(frag(kind(100, &[], 0), any), 1500.0);
        // A pod with a share too big for any GPU uses none either.
        assert_eq!(frag(kind(0, &[[2, 20], [11, 10]], 0), any), 1500.0);
    }

    /// A kind whose pods may not run on the node (another GPU model, say)
    /// could use none of its GPUs; on a node it may run on, it strands
    /// what any other kind would.
    #[test]
    fn a_kind_strands_all_of_a_node_it_may_not_run_on() {
        let (inv, usage) = half_used();
        let spec: PodSpec = serde_json::from_value(serde_json::json!({
            "containers": [], "nodeSelector": { "model": "V100" },
        }))
        .unwrap();
        let v100 = Kind {
            nodes: NodeSelection::of(Some(&spec)),
            ..kind(0, &[[2, 20]], 0)
        };
        let labelled = |model: &str| [("model".to_string(), model.to_string())].into();
        let frag = |labels: &std::collections::BTreeMap<String, String>| {
            let room = NodeRoom {
                inventory: &inv,
                usage: &usage,
                free: UNBOUNDED,
                labels,
            };
            alone(v100.clone()).fragmentation(&room)
        };
        assert_eq!(frag(&labelled("V100")), 0.0);
        assert_eq!(frag(&labelled("T4")), 1500.0);
        assert_eq!(frag(&NO_LABELS), 1500.0);
    }

    /// A kind asking memory alone measures a GPU by its free memory: the
    /// compute left on a GPU whose memory is taken is no loss to it.
    #[test]
    fn a_kind_asking_memory_alone_measures_memory() {
        let inv = inventory(&[2560, 2560]);
        // GPU-0: 8 of 10 memory devices and 10 % of compute taken.
        let usage = on_gpu0(&inv, ask("a", false, 8, 10, 0));
        let room = NodeRoom {
            inventory: &inv,
            usage: &usage,
            free: UNBOUNDED,
            labels: &NO_LABELS,
        };
        let frag = |k: Kind| alone(k).fragmentation(&room);
        // 3 devices of memory do not fit GPU-0: its 20 % of memory free
        // is stranded, not the mean with its 90 % of compute (550).
        assert_eq!(frag(kind(0, &[[3, 0]], 0)), 200.0);
        // Asking compute too, the mean is what it could not use.
        assert_eq!(frag(kind(0, &[[3, 10]], 0)), 550.0);
    }

    #[test]
    fn the_workload_weighs_its_most_common_kinds() {
        let (inv, usage) = half_used();
        let room = NodeRoom {
            inventory: &inv,
            usage: &usage,
            free: UNBOUNDED,
            labels: &NO_LABELS,
        };
        let (a, b, c) = (kind(0, &[[6, 60]], 0), kind(0, &[], 1), kind(0, &[], 2));
        let w = Workload::of(&HashMap::from([(a.clone(), 2), (b, 1), (c, 1)]), 0);
        assert_eq!(
            w.fragmentation(&room),
            0.5 * 500.0 + 0.25 * 500.0 + 0.25 * 1500.0
        );
        // Kinds past 95 % of the pods are left out.
        let w = Workload::of(&HashMap::from([(a.clone(), 99), (kind(0, &[], 2), 1)]), 0);
        assert_eq!(w.fragmentation(&room), 500.0);
        // Pods asking nothing (an agent on every node) weigh nothing: the
        // shares keep their whole weight.
        let w = Workload::of(&HashMap::from([(a, 1), (kind(0, &[], 0), 3)]), 0);
        assert_eq!(w.fragmentation(&room), 500.0);
    }

    /// Whole GPUs held, unhealthy GPUs: nothing free there to strand.
    #[test]
    fn gpus_held_whole_or_unhealthy_have_nothing_free() {
        let mut inv = inventory(&[2560, 2560]);
        let usage = on_gpu0(&inv, ask("w", false, 0, 0, 1));
        inv.gpus[1].healthy = false;
        let room = NodeRoom {
            inventory: &inv,
            usage: &usage,
            free: UNBOUNDED,
            labels: &NO_LABELS,
        };
        assert_eq!(alone(kind(100, &[], 0)).fragmentation(&room), 0.0);
    }

    #[test]
    fn a_pods_kind_is_what_stays_on_the_node() {
        let mut asks = pod(vec![
            ask("init", true, 8, 0, 0),
            sidecar("side", 1, 10, 0),
            ask("a", false, 3, 30, 0),
            ask("w", false, 0, 0, 2),
        ]);
        asks.node.cpu_milli = 1500;
        assert_eq!(
            Kind::of(&asks, NodeSelection::default()),
            kind(1500, &[[1, 10], [3, 30]], 2)
        );
        // Counts past u64 together stay at its top, not wrapped to few.
        let hostile = pod(vec![
            ask("a", false, 0, 0, u64::MAX),
            ask("b", false, 0, 0, 2),
        ]);
        assert_eq!(Kind::of(&hostile, NodeSelection::default()).whole, u64::MAX);
    }
}

/// The CPU and memory a pod asks, as kube-scheduler counts them.
#[test]
fn a_pods_node_ask_is_its_containers_or_its_init_peak_and_overhead() {
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "spec": {
            "initContainers": [
                {"name": "side", "restartPolicy": "Always", "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}},
                {"name": "init", "resources": {"requests": {"cpu": "3", "memory": "100Mi"}}},
            ],
            "containers": [
                {"name": "a", "resources": {"requests": {"cpu": "500m", "memory": "2Gi"}}},
                // A limit alone is the request too.
                {"name": "b", "resources": {"limits": {"cpu": "1", "memory": "1500M"}}},
                {"name": "c"},
            ],
            "overhead": {"cpu": "100m", "memory": "0.5"},
        },
    }))
    .unwrap();
    let asks = PodAsks::from_pod(&Keys::new("doslab.io"), &pod);
    // The init container beside the sidecar (3.25) outweighs the app
    // containers beside it (1.75); the overhead comes on top.
    assert_eq!(asks.node.cpu_milli, 3350);
    // Memory the other way round: the app containers and the sidecar
    // (3 GiB and 1.5 GB) outweigh the init container beside the sidecar;
    // half a byte of overhead counts as a whole one.
    assert_eq!(asks.node.memory, (3 << 30) + 1_500_000_000 + 1);
    // An ask past what a u64 of thousandths holds asks the most, not none.
    let huge: Pod = serde_json::from_value(serde_json::json!({
        "spec": {"containers": [{"name": "a", "resources": {"requests": {"memory": "1Ei"}}}]},
    }))
    .unwrap();
    let asks = PodAsks::from_pod(&Keys::new("doslab.io"), &huge);
    assert_eq!(asks.node.memory, u64::MAX / 1000 + 1);
}

/// However many kinds of pods a cluster runs, the workload keeps the 64
/// most common: the measure of each node stays bounded.
#[test]
fn a_workload_keeps_at_most_64_kinds() {
    use std::collections::HashMap;
    let counts: HashMap<Kind, u64> = (0..1000)
        .map(|i| {
            let kind = Kind {
                node: NodeAsk {
                    cpu_milli: i,
                    memory: 0,
                },
                ..Kind::default()
            };
            (kind, 1 + i % 3)
        })
        .collect();
    let inv = inventory(&[2560]);
    let usage = NodeUsage::empty(&inv);
    let room = NodeRoom {
        inventory: &inv,
        usage: &usage,
        free: NodeAsk {
            cpu_milli: 500,
            ..UNBOUNDED
        },
        labels: &NO_LABELS,
    };
    // CPU-only kinds strand all of a free GPU whatever their weights: the
    // weights of the kept kinds still add up to one.
    let f = Workload::of(&counts, 0).fragmentation(&room);
    assert!((f - 1000.0).abs() < 1e-6, "{f}");
    assert_eq!(Workload::of(&counts, 0).len(), 64);
}
