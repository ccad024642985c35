//! GPU-aware preemption on the real components: the real kube-scheduler on
//! the shipped profile (its `preemptVerb` calling the extender), the
//! kubelet's device manager beside the real daemon, PriorityClasses
//! admitted by the real API server. Each scenario fills a node's GPUs with
//! pods of low priority, one at a time (the extender's binpack fills one
//! GPU before the next), then creates a pod of higher priority that fits
//! nowhere, and reads from the API server what was evicted and whether
//! the preemptor ran.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use support::kube::*;

const NS: &str = "tenant";
/// Pods ask gpu-memory in GiB.
const UNIT: &str = "memory_unit_mib = 1024";
const GIB: u64 = 1024;

/// The priorities the scenarios use, by PriorityClass name.
const CLASSES: [(&str, i32); 6] = [
    ("p1", 1),
    ("p2", 2),
    ("p3", 3),
    ("equal", 1000),
    ("high", 1000),
    ("top", 2000),
];

fn priority_classes(cp: &ControlPlane) {
    let yaml: Vec<String> = CLASSES
        .iter()
        .map(|(name, value)| {
            format!(
                "apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\n\
                 metadata: {{name: {name}}}\nvalue: {value}\n"
            )
        })
        .collect();
    cp.apply(&yaml.join("---\n"));
}

/// A pod of PriorityClass `class` whose one container asks `wants`
/// (GiB of gpu-memory, gpu-core %, whole GPUs).
fn pod(name: &str, class: &str, wants: [u64; 3]) -> Pod {
    let mut p = gpu_pod(NS, name, &[("app", wants)]);
    p.spec.get_or_insert_default().priority_class_name = Some(class.into());
    p
}

fn pods(client: &kube::Client) -> Api<Pod> {
    Api::namespaced(client.clone(), NS)
}

/// The GPUs the extender assigned the pod, from its assignment.
fn gpus_of(pod: &Pod) -> BTreeSet<String> {
    let text = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("doslab.io/gpu-assignment"))
        .map_or("{}", String::as_str);
    let assignment: BTreeMap<String, Vec<String>> = serde_json::from_str(text).unwrap();
    assignment.into_values().flatten().collect()
}

/// Creates `fill` one at a time, each Running before the next; returns
/// each pod's GPUs.
async fn fill(
    client: &kube::Client,
    fill: &[(&str, &str, [u64; 3])],
) -> BTreeMap<String, BTreeSet<String>> {
    let mut on = BTreeMap::new();
    for &(name, class, wants) in fill {
        create(client, &pod(name, class, wants)).await;
        let ran = wait_pod(client, NS, name, Duration::from_secs(60), |p| {
            phase(p) == "Running"
        })
        .await
        .unwrap_or_else(|p| panic!("{name} never ran: {p:#?}"));
        on.insert(name.to_owned(), gpus_of(&ran));
    }
    on
}

/// Deletes every pod of the namespace and waits until they are gone.
async fn clear(client: &kube::Client) {
    let api = pods(client);
    for p in api.list(&Default::default()).await.unwrap().items {
        let name = p.metadata.name.unwrap();
        api.delete(&name, &Default::default()).await.ok();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    support::poll_for(
        deadline,
        async || {
            let left = api.list(&Default::default()).await.unwrap().items;
            left.is_empty().then_some(())
        },
        || "pods never went".into(),
    )
    .await;
}

/// What a preemption did: the pods of `before` evicted (gone or being
/// deleted), their GPUs, and how long the preemptor took to run, if it
/// did within the wait.
#[derive(Debug)]
struct Outcome {
    evicted: BTreeSet<String>,
    gpus: BTreeSet<String>,
    ran_after: Option<Duration>,
}

impl Outcome {
    fn line(&self) -> String {
        let ran = self.ran_after.map_or("not running".into(), |t| {
            format!("running after {:.1} s", t.as_secs_f64())
        });
        format!(
            "{} pods evicted {:?}, on {} GPU(s); {ran}",
            self.evicted.len(),
            self.evicted,
            self.gpus.len()
        )
    }
}

async fn evicted(
    client: &kube::Client,
    before: &BTreeMap<String, BTreeSet<String>>,
) -> (BTreeSet<String>, BTreeSet<String>) {
    let now = pods(client).list(&Default::default()).await.unwrap().items;
    let live: BTreeSet<&str> = now
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| p.metadata.name.as_deref())
        .collect();
    let gone: BTreeSet<String> = before
        .keys()
        .filter(|n| !live.contains(n.as_str()))
        .cloned()
        .collect();
    let gpus = gone.iter().flat_map(|n| before[n].clone()).collect();
    (gone, gpus)
}

/// Creates `preemptor` and waits up to `within` for it to run.
async fn preempt(
    client: &kube::Client,
    preemptor: &Pod,
    before: &BTreeMap<String, BTreeSet<String>>,
    within: Duration,
    until_stuck: bool,
) -> (Outcome, Option<Pod>) {
    let name = preemptor.metadata.name.clone().unwrap();
    let created = create(client, preemptor).await;
    // Running, or (`until_stuck`) stuck: the scheduler's own preemption
    // reports that it finds no victim where the node's totals fit but no
    // GPU does. (Elsewhere that report can be passing: the node's
    // allocatable may lag a GPU's whole device being withdrawn.)
    let settled = wait_pod(client, NS, &name, within, |p| {
        phase(p) == "Running"
            || until_stuck && scheduled_because(p).contains("expected at least one victim")
    })
    .await;
    let ran = settled.ok().filter(|p| phase(p) == "Running").ok_or(());
    let ran_after = ran.is_ok().then(|| created.elapsed());
    let (evicted, gpus) = evicted(client, before).await;
    let outcome = Outcome {
        evicted,
        gpus,
        ran_after,
    };
    (outcome, ran.ok())
}

/// The message of the pod's PodScheduled condition: why it is not
/// scheduled, preemption's outcome included.
fn scheduled_because(pod: &Pod) -> &str {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled")
        .and_then(|c| c.message.as_deref())
        .unwrap_or_default()
}

/// Two 40 GiB GPUs, each with three 12 GiB pods of priorities 1, 2 and 3
/// (4 GiB free on each, 8 in all), and a 20 GiB pod of priority 1000.
/// The scheduler's node totals see 8 GiB free and evict by them; the
/// room is only made by two pods of one GPU.
const SCENARIO_A: [(&str, &str, [u64; 3]); 6] = [
    ("a1", "p1", [12, 0, 0]),
    ("a2", "p2", [12, 0, 0]),
    ("a3", "p3", [12, 0, 0]),
    ("b1", "p1", [12, 0, 0]),
    ("b2", "p2", [12, 0, 0]),
    ("b3", "p3", [12, 0, 0]),
];

async fn scenario_a(
    client: &kube::Client,
    wait: Duration,
    until_stuck: bool,
) -> (Outcome, Option<Pod>) {
    let before = fill(client, &SCENARIO_A).await;
    // Binpack fills one GPU, then the other: a* on one, b* on the other.
    let layout: BTreeSet<BTreeSet<String>> = ["a", "b"]
        .iter()
        .map(|side| {
            before
                .iter()
                .filter(|(n, _)| n.starts_with(side))
                .flat_map(|(_, g)| g.clone())
                .collect()
        })
        .collect();
    assert_eq!(layout.len(), 2, "{before:?}");
    assert!(layout.iter().all(|g| g.len() == 1), "{before:?}");
    preempt(
        client,
        &pod("big", "high", [20, 0, 0]),
        &before,
        wait,
        until_stuck,
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn preemption_frees_one_gpu_with_the_fewest_victims_where_default_preemption_does_not() {
    let cp = ControlPlane::start();
    priority_classes(&cp);
    let nodes = cluster(&cp, NS, &[&[40 * GIB, 40 * GIB]], UNIT).await;
    let client = cp.admin_client().await;

    let sched = Scheduler::start(&cp);
    let (with_verb, ran) = scenario_a(&client, Duration::from_secs(90), false).await;
    let ran = ran.unwrap_or_else(|| panic!("{}\n{}", with_verb.line(), logs(&cp, &nodes, &sched)));
    assert_eq!(with_verb.evicted.len(), 2, "{}", with_verb.line());
    assert_eq!(with_verb.gpus.len(), 1, "{}", with_verb.line());
    // The lowest priorities of the GPU: its p1 and p2 pods.
    let classes: BTreeSet<char> = with_verb
        .evicted
        .iter()
        .map(|n| n.chars().nth(1).unwrap())
        .collect();
    assert_eq!(classes, BTreeSet::from(['1', '2']), "{}", with_verb.line());
    assert_eq!(gpus_of(&ran), with_verb.gpus, "on the GPU freed for it");
    drop(sched);

    // The same on the shipped profile without the verb: kube-scheduler's
    // own preemption, by the node's totals.
    clear(&client).await;
    let sched = Scheduler::start_edited(&cp, "", |profile| {
        let extender = profile["extenders"][0].as_mapping_mut().unwrap();
        extender.remove("preemptVerb");
    });
    let (without, _) = scenario_a(&client, Duration::from_secs(90), true).await;
    eprintln!(
        "preemption, scenario (a), one run on the real components:\n  \
         with the extender's preemptVerb: {}\n  \
         kube-scheduler's own (no verb):  {}",
        with_verb.line(),
        without.line()
    );
    drop(sched);
}

#[tokio::test(flavor = "multi_thread")]
async fn preemption_spares_equal_and_higher_priorities_evicts_nothing_in_vain_and_frees_whole_gpus()
{
    let cp = ControlPlane::start();
    priority_classes(&cp);
    let nodes = cluster(&cp, NS, &[&[40 * GIB, 40 * GIB]], UNIT).await;
    let client = cp.admin_client().await;
    let sched = Scheduler::start(&cp);
    let preempts = || {
        support::metric(
            sched.url.trim_start_matches("http://"),
            "gpu_device_plugin_extender_requests_total{verb=\"preempt\",outcome=\"ok\"}",
        )
        .unwrap_or(0.0)
    };

    // (c) Pods of the preemptor's priority and higher hold the room it
    // needs: each GPU holds one of them (18 GiB) and a p1 pod (12 GiB).
    let before = fill(
        &client,
        &[
            ("eq1", "equal", [18, 0, 0]),
            ("low1", "p1", [12, 0, 0]),
            ("top1", "top", [18, 0, 0]),
            ("low2", "p1", [12, 0, 0]),
        ],
    )
    .await;
    let asked = preempts();
    // (d) No set of lower-priority victims makes 30 GiB on one GPU (a p1
    // pod gives 22), though by the node's totals (20 GiB free, 24 more
    // held by p1 pods) the scheduler's own preemption would evict both.
    // Nothing is evicted in vain.
    create(&client, &pod("vain", "high", [30, 0, 0])).await;
    // The scheduler reports the attempt (its preemption's outcome
    // included) after it weighed the extender's answer.
    let deadline = Instant::now() + Duration::from_secs(60);
    support::poll_for(
        deadline,
        async || {
            let tried = scheduling_failures(&client, NS, "vain").await;
            let reported = tried.iter().any(|note| note.contains("preemption"));
            (reported && preempts() > asked).then_some(())
        },
        || {
            format!(
                "no preemption reported for vain\n{}",
                logs(&cp, &nodes, &sched)
            )
        },
    )
    .await;
    let (gone, _) = evicted(&client, &before).await;
    assert!(gone.is_empty(), "evicted in vain: {gone:?}");
    let vain = pods(&client).get("vain").await.unwrap();
    assert_eq!(node_of(&vain), "", "{vain:#?}");

    // (c) With room a p1 pod frees (the totals short by 2 GiB, as the
    // scheduler needs to offer the node at all), the equal and higher
    // ones stay.
    pods(&client)
        .delete("vain", &Default::default())
        .await
        .unwrap();
    wait_gone(&client, NS, "vain", Duration::from_secs(30)).await;
    let (fits, ran) = preempt(
        &client,
        &pod("fits", "high", [22, 0, 0]),
        &before,
        Duration::from_secs(90),
        false,
    )
    .await;
    assert!(
        ran.is_some(),
        "{}\n{}",
        fits.line(),
        logs(&cp, &nodes, &sched)
    );
    assert_eq!(fits.evicted.len(), 1, "{}", fits.line());
    assert!(
        fits.evicted.iter().all(|n| n.starts_with("low")),
        "{}",
        fits.line()
    );

    // (e) A whole-GPU preemptor frees a whole GPU: the one the fewest
    // lower-priority pods hold. (Its node totals count a GPU carrying
    // shares as no whole GPU, so the scheduler offers the node only where
    // evicting frees a gpu-count it sees: a GPU held whole.)
    clear(&client).await;
    let before = fill(
        &client,
        &[
            ("w1", "p1", [0, 0, 1]),
            ("s1", "p1", [10, 0, 0]),
            ("s2", "p1", [10, 0, 0]),
        ],
    )
    .await;
    assert_ne!(before["w1"], before["s1"], "{before:?}");
    let (whole, ran) = preempt(
        &client,
        &pod("whole", "high", [0, 0, 1]),
        &before,
        Duration::from_secs(90),
        false,
    )
    .await;
    let ran = ran.unwrap_or_else(|| panic!("{}\n{}", whole.line(), logs(&cp, &nodes, &sched)));
    assert_eq!(
        whole.evicted,
        BTreeSet::from(["w1".to_owned()]),
        "{}",
        whole.line()
    );
    assert_eq!(gpus_of(&ran), before["w1"]);

    // (f) Preemptions amid a burst of pods of every priority: once it
    // settles no GPU holds more than its memory, and every pod that
    // asked was bound whole or not at all.
    clear(&client).await;
    let mut rng = support::Lcg(7);
    let classes = ["p1", "p2", "p3", "high"];
    for i in 0..40 {
        let class = classes[rng.below(4) as usize];
        let wants = [4 + rng.below(17), 0, 0];
        create(&client, &pod(&format!("burst-{i:02}"), class, wants)).await;
    }
    let api = pods(&client);
    let mut last = (usize::MAX, Instant::now());
    let seen = std::cell::RefCell::new(String::new());
    let deadline = Instant::now() + Duration::from_secs(240);
    support::poll_for(
        deadline,
        async || {
            let list = api.list(&Default::default()).await.unwrap().items;
            let bound: Vec<&Pod> = list.iter().filter(|p| !node_of(p).is_empty()).collect();
            if bound.len() != last.0 {
                last = (bound.len(), Instant::now());
            }
            let admitted = bound.iter().all(|p| phase(p) == "Running");
            // Pods the scheduler nominated that still wait: where the
            // node's totals fit but no GPU does, it asks for no preemption
            // (src/DESIGN.md, Preemption that frees one GPU).
            let nominated: Vec<String> = list
                .iter()
                .filter(|p| node_of(p).is_empty())
                .filter(|p| {
                    p.status
                        .as_ref()
                        .and_then(|s| s.nominated_node_name.as_ref())
                        .is_some()
                })
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            let stuck: Vec<String> = bound
                .iter()
                .filter(|p| phase(p) != "Running")
                .map(|p| {
                    let s = p.status.as_ref();
                    format!(
                        "{} {} ({}: {})",
                        p.metadata.name.as_deref().unwrap_or(""),
                        phase(p),
                        s.and_then(|s| s.reason.as_deref()).unwrap_or(""),
                        s.and_then(|s| s.message.as_deref()).unwrap_or("")
                    )
                })
                .collect();
            *seen.borrow_mut() = format!(
                "{} bound; nominated, waiting: {nominated:?}; bound, not running: {stuck:?}",
                bound.len()
            );
            let settled = admitted && last.1.elapsed() >= Duration::from_secs(10);
            settled.then_some(())
        },
        || {
            format!(
                "the burst never settled: {}\n{}",
                seen.borrow(),
                logs(&cp, &nodes, &sched)
            )
        },
    )
    .await;
    let mut used: BTreeMap<String, u64> = BTreeMap::new();
    let list = api.list(&Default::default()).await.unwrap().items;
    for p in list.iter().filter(|p| !node_of(p).is_empty()) {
        let ledger: serde_json::Value = serde_json::from_str(
            p.metadata.annotations.as_ref().unwrap()["doslab.io/gpu-ledger"].as_str(),
        )
        .unwrap();
        let grant = &ledger["app"];
        for gpu in grant["gpus"].as_array().unwrap() {
            *used.entry(gpu.as_str().unwrap().into()).or_default() +=
                grant["gpu-memory"].as_u64().unwrap();
        }
    }
    assert!(used.values().all(|&mib| mib <= 40 * GIB), "{used:?}");
    let high_bound = list
        .iter()
        .filter(|p| p.spec.as_ref().unwrap().priority_class_name.as_deref() == Some("high"))
        .filter(|p| !node_of(p).is_empty())
        .count();
    eprintln!(
        "burst of 40 with preemption: {}; {high_bound} of priority high bound; GPUs at {used:?} MiB",
        seen.borrow()
    );
}
