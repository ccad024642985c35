//! What each share uses, from the driver: every poll the probe thread asks
//! NVML for each GPU's compute processes (MPS clients included), their
//! device memory and their SM utilisation since the last poll, and reads
//! each process's cgroup in the host's `/proc` for its pod UID and
//! container ID (`cgroup`, pure); the monitor actor names them through the
//! pod matcher's live containers (their statuses' `containerID`) or, for
//! DRA, the containers of the pods its prepared claims are reserved for
//! (`crate::node::dra::shares`), and publishes per container and GPU what
//! is used beside what is granted.
//!
//! A figure the driver does not give is left out, never guessed: NVML has
//! no SM samples for a process it did not see run in the window, and
//! reports no memory per process under some drivers (WDDM). Processes in
//! no pod's container (the MPS server, the host's) count in the GPU's
//! totals only.

mod actor;
mod cgroup;
mod probe;

pub(crate) use actor::{UsageArgs, UsageMonitor};

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::node::dra::shares::ClaimContainer;
use crate::node::matcher::LiveContainer;
use crate::node::metrics::{ContainerLabels, ContainerUsage, GpuUse, UsageSeries};
use probe::GpuProcesses;

/// The series of one sample: per container (named through a claim of
/// `claimed` holding the process's GPU, else through `live`) and GPU, its
/// processes' memory and SM share summed; per GPU that answered, all its
/// processes. The claims' grants are the caller's to add.
fn series(
    gpus: &[GpuProcesses],
    live: &[LiveContainer],
    claimed: &[ClaimContainer],
) -> UsageSeries {
    let named: HashMap<(&str, &str), &LiveContainer> = live
        .iter()
        .filter_map(|c| Some(((c.uid.as_str(), c.id.as_deref()?), c)))
        .collect();
    let in_claims: HashMap<(&str, &str), &ClaimContainer> = claimed
        .iter()
        .filter_map(|c| Some(((c.uid.as_str(), c.id.as_deref()?), c)))
        .collect();
    let mut containers: BTreeMap<ContainerLabels, (Option<u64>, Option<u32>)> = BTreeMap::new();
    let mut totals = Vec::new();
    for gpu in gpus.iter().filter(|g| g.failed.is_none()) {
        // Unknown once one process's is: a partial sum would be a guess.
        let memory = gpu.processes.iter().map(|(p, _)| p.memory_bytes);
        totals.push(GpuUse {
            uuid: gpu.uuid.clone(),
            memory_bytes: memory.sum(),
            processes: gpu.processes.len() as u64,
        });
        for (p, owner) in &gpu.processes {
            let Some(key) = owner
                .as_ref()
                .map(|o| (o.pod_uid.as_str(), o.container_id.as_str()))
            else {
                continue;
            };
            let through_claim = in_claims.get(&key).and_then(|c| c.labels(&gpu.uuid));
            let Some(at) = through_claim.or_else(|| {
                let c = named.get(&key)?;
                Some(ContainerLabels::new(&c.pod, &c.container, &gpu.uuid))
            }) else {
                continue;
            };
            let (memory, sm) = containers.entry(at).or_default();
            add(memory, p.memory_bytes);
            add(sm, p.sm_percent);
        }
    }
    UsageSeries {
        containers: containers
            .into_iter()
            .map(|(at, (memory_bytes, sm_percent))| ContainerUsage {
                at,
                memory_bytes,
                sm_percent,
            })
            .collect(),
        gpus: totals,
        claims: Vec::new(),
    }
}

/// The pods of `claimed` with a process, on a GPU one of their claims
/// holds, in a container neither their claims nor the pod matcher (`live`)
/// know (one started or restarted since their pod was read).
fn strangers(
    gpus: &[GpuProcesses],
    live: &[LiveContainer],
    claimed: &[ClaimContainer],
) -> HashSet<String> {
    let mut held: HashMap<&str, HashSet<&str>> = HashMap::new();
    for c in claimed {
        let on = held.entry(c.uid.as_str()).or_default();
        on.extend(
            c.claims
                .iter()
                .flat_map(|(_, g)| g.iter().map(String::as_str)),
        );
    }
    let known: HashSet<(&str, &str)> = claimed
        .iter()
        .filter_map(|c| Some((c.uid.as_str(), c.id.as_deref()?)))
        .chain(
            live.iter()
                .filter_map(|c| Some((c.uid.as_str(), c.id.as_deref()?))),
        )
        .collect();
    let mut out = HashSet::new();
    for gpu in gpus {
        for o in gpu.processes.iter().filter_map(|(_, owner)| owner.as_ref()) {
            let on_its_claim = held
                .get(o.pod_uid.as_str())
                .is_some_and(|g| g.contains(gpu.uuid.as_str()));
            if on_its_claim && !known.contains(&(o.pod_uid.as_str(), o.container_id.as_str())) {
                out.insert(o.pod_uid.clone());
            }
        }
    }
    out
}

/// Adds a figure the driver may not have given: known only once one is.
fn add<T: std::ops::Add<Output = T> + Copy>(sum: &mut Option<T>, figure: Option<T>) {
    if let Some(f) = figure {
        *sum = Some(sum.map_or(f, |s| s + f));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cgroup::Owner;
    use probe::Process;

    fn process(
        pid: u32,
        memory: Option<u64>,
        sm: Option<u32>,
        owner: Option<(&str, &str)>,
    ) -> (Process, Option<Owner>) {
        let owner = owner.map(|(pod, id)| Owner {
            pod_uid: format!("uid-{pod}"),
            container_id: id.into(),
        });
        (
            Process {
                pid,
                memory_bytes: memory,
                sm_percent: sm,
            },
            owner,
        )
    }

    /// Two processes of one container add up; a process of no known
    /// container (the MPS server, a container without an ID yet, a pod
    /// gone) counts in its GPU's totals only; a GPU the driver failed on
    /// has no series at all; a figure the driver did not give stays
    /// unknown rather than zero.
    #[test]
    fn processes_add_up_per_container_and_per_gpu() {
        let live = [
            LiveContainer::of("p", "app", Some("id-app")),
            LiveContainer::of("p", "side", Some("id-side")),
            LiveContainer::of("q", "app", None),
        ];
        let gpus = [
            GpuProcesses {
                uuid: "GPU-a".into(),
                processes: vec![
                    process(1, Some(100), Some(20), Some(("p", "id-app"))),
                    process(2, Some(50), Some(10), Some(("p", "id-app"))),
                    process(3, Some(70), None, Some(("p", "id-side"))),
                    process(4, Some(1000), None, None),
                    process(5, Some(5), Some(1), Some(("q", "id-unknown"))),
                    process(6, Some(5), Some(1), Some(("gone", "id-x"))),
                ],
                failed: None,
            },
            GpuProcesses {
                uuid: "GPU-b".into(),
                processes: vec![process(7, None, None, Some(("p", "id-app")))],
                failed: None,
            },
            GpuProcesses {
                uuid: "GPU-c".into(),
                processes: Vec::new(),
                failed: Some(probe::ListError::Lost("GPU is lost".into())),
            },
        ];
        let s = series(&gpus, &live, &[]);
        let got: Vec<(&str, &str, Option<u64>, Option<u32>)> = s
            .containers
            .iter()
            .map(|c| {
                (
                    c.at.container.as_str(),
                    c.at.gpu.as_str(),
                    c.memory_bytes,
                    c.sm_percent,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("app", "GPU-a", Some(150), Some(30)),
                ("app", "GPU-b", None, None),
                ("side", "GPU-a", Some(70), None),
            ]
        );
        assert_eq!(
            s.gpus,
            [
                GpuUse {
                    uuid: "GPU-a".into(),
                    memory_bytes: Some(1230),
                    processes: 6
                },
                GpuUse {
                    uuid: "GPU-b".into(),
                    memory_bytes: None,
                    processes: 1
                },
            ]
        );
    }

    /// A DRA container's process is named by the claim holding its GPU;
    /// on a GPU none of its claims holds, by the pod matcher, if at all;
    /// a process of a claim's pod in a container not known marks the pod
    /// to be read again.
    #[test]
    fn dra_processes_are_named_by_their_claims() {
        let claimed = [ClaimContainer {
            pod: crate::rules::matching::pods::PodKey {
                namespace: "ns".into(),
                name: "d".into(),
            },
            uid: "uid-d".into(),
            container: "app".into(),
            id: Some("id-d".into()),
            claims: vec![("d-gpu".into(), vec!["GPU-a".into()])],
        }];
        let live = [LiveContainer::of("d", "app", Some("id-d"))];
        let gpus = [
            GpuProcesses {
                uuid: "GPU-a".into(),
                processes: vec![
                    process(1, Some(100), Some(20), Some(("d", "id-d"))),
                    process(2, Some(10), None, Some(("d", "id-new"))),
                ],
                failed: None,
            },
            GpuProcesses {
                uuid: "GPU-b".into(),
                processes: vec![process(3, Some(7), None, Some(("d", "id-d")))],
                failed: None,
            },
        ];
        let s = series(&gpus, &live, &claimed);
        let got: Vec<(&str, &str, Option<u64>)> = s
            .containers
            .iter()
            .map(|c| (c.at.gpu.as_str(), c.at.claim.as_str(), c.memory_bytes))
            .collect();
        assert_eq!(got, [("GPU-a", "d-gpu", Some(100)), ("GPU-b", "", Some(7))]);
        assert_eq!(
            strangers(&gpus, &[], &claimed),
            HashSet::from(["uid-d".to_owned()])
        );
        // Not on a GPU of its claims, or a container the matcher names.
        assert!(strangers(&gpus[1..], &[], &claimed).is_empty());
        let matched = [LiveContainer::of("d", "plugin", Some("id-new"))];
        assert!(strangers(&gpus, &matched, &claimed).is_empty());
    }
}
