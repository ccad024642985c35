//! A node's pods as the matcher sees them: only what matching needs, read
//! from the API's `Pod` once per lookup. Pure, so tests build pods by hand.

use k8s_openapi::api::core::v1::{Pod, PodStatus};

use crate::rules::device::Resource;
use crate::rules::usage::{
    Assignment, ContainerAsk, Keys, Ledger, PodAsks, Records, finished, pending,
};

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodKey {
    pub(crate) namespace: String,
    pub name: String,
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// How a pod reached this node, as the kubelet's pod config hands pods
/// to admission: one at a time as its watch brings each, in that order,
/// or in a batch (a list after its watch broke, a restarted kubelet's
/// first list) that it admits by creation time. The node's own watch sees
/// the same: its events in the same order, its lists when the API server
/// broke both watches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Arrival {
    /// Which delivery: the pods of a later one are admitted after.
    pub seq: u64,
    /// A batch, whose pods are admitted by creation time; the pods of any
    /// other delivery by assume-time.
    pub batch: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    pub key: PodKey,
    pub(crate) uid: String,
    /// Phase `Pending`: the kubelet may be admitting it. A pod being
    /// deleted too: the kubelet admits every pod it was sent, in order,
    /// and stops it afterwards, so its Allocates come all the same (a
    /// preemption's victim bound a moment before), and handed to the next
    /// pod of the same ask they would give that pod another's grant.
    pub admitting: bool,
    /// Not `Succeeded` or `Failed`: its grants still occupy GPUs.
    pub(crate) live: bool,
    /// It has a deletionTimestamp: its GPUs are free once it is gone.
    pub(crate) deleting: bool,
    /// `<domain>/gpu-assume-time`, when present and a decimal number.
    pub(crate) assume_time: Option<u128>,
    /// How it reached the node; the default, one delivery for every pod,
    /// leaves the order to assume-time.
    pub(crate) arrival: Arrival,
    /// creationTimestamp, nanoseconds since the epoch.
    pub(crate) created: i128,
    /// `<domain>/gpu-uuid`, set by a scheduler extender.
    pub(crate) gpu_uuid: Option<String>,
    /// `<domain>/gpu-assignment`: the extender's GPUs per container.
    pub(crate) assignment: Assignment,
    /// Init containers, then app containers, in spec order.
    pub containers: Vec<ContainerAsk>,
    pub ledger: Ledger,
    pub(crate) resource_version: String,
}

/// Why a pod's annotations could not all be read; the pod is still used,
/// with the part left out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodWarning {
    #[error("annotation {0} is not a decimal number: {1:?}")]
    AssumeTime(String, String),
    /// The pod's asks count as held wherever they may be
    /// ([`crate::rules::usage::pod_holdings`] fails closed), never as nothing.
    #[error(
        "annotation {0} is not a valid ledger ({1}); counting the pod's GPU asks as held \
         wherever they may be"
    )]
    Ledger(String, String),
    #[error(
        "annotation {0} is not a valid GPU assignment ({1}); counting the pod's unserved GPU \
         asks as held wherever they may be"
    )]
    Assignment(String, String),
    /// The container's other resources still match; this one never does.
    #[error("{0}; no device of it is matched to the pod")]
    Ask(String),
}

impl PodView {
    pub fn from_pod(keys: &Keys, pod: &Pod) -> (PodView, Vec<PodWarning>) {
        let meta = &pod.metadata;
        let annotations = meta.annotations.clone().unwrap_or_default();
        let mut warnings = Vec::new();
        let assume_time = annotations.get(&keys.assume_time).and_then(|v| {
            let parsed = v.trim().parse::<u128>().ok();
            if parsed.is_none() {
                warnings.push(PodWarning::AssumeTime(keys.assume_time.clone(), v.clone()));
            }
            parsed
        });
        let records = Records::read(keys, pod);
        if let Some(g) = records.garbled_ledger {
            warnings.push(PodWarning::Ledger(g.key, g.error));
        }
        if let Some(g) = records.garbled_assignment {
            warnings.push(PodWarning::Assignment(g.key, g.error));
        }
        let view = PodView {
            key: PodKey {
                namespace: meta.namespace.clone().unwrap_or_default(),
                name: meta.name.clone().unwrap_or_default(),
            },
            uid: meta.uid.clone().unwrap_or_default(),
            admitting: pending(pod),
            live: !finished(pod),
            deleting: meta.deletion_timestamp.is_some(),
            assume_time,
            arrival: Arrival::default(),
            created: meta
                .creation_timestamp
                .as_ref()
                .map_or(0, |t| t.0.as_nanosecond()),
            gpu_uuid: annotations
                .get(&keys.gpu_uuid)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty()),
            assignment: records.assignment,
            containers: {
                let asks = PodAsks::from_pod(keys, pod);
                let invalid = asks.containers.iter().filter_map(|c| c.invalid.as_ref());
                warnings.extend(invalid.map(|e| PodWarning::Ask(e.to_string())));
                asks.containers
            },
            ledger: records.ledger,
            resource_version: meta.resource_version.clone().unwrap_or_default(),
        };
        (view, warnings)
    }

    /// Every GPU resource of every container served.
    pub(crate) fn complete(&self) -> bool {
        self.containers.iter().all(|c| {
            Resource::ALL
                .iter()
                .all(|&r| c.wants(r) == 0 || self.ledger.served(&c.name, r))
        })
    }
}

/// Each container's runtime ID, by name, as the kubelet reports it in the
/// pod's status (init containers' too: a sidecar runs), without the
/// runtime's scheme (`containerd://`): what a process's cgroup names.
pub(crate) fn runtime_ids(status: Option<&PodStatus>) -> std::collections::HashMap<&str, &str> {
    status
        .into_iter()
        .flat_map(|s| {
            let init = s.init_container_statuses.iter().flatten();
            init.chain(s.container_statuses.iter().flatten())
        })
        .filter_map(|s| {
            let id = s.container_id.as_deref()?;
            Some((
                s.name.as_str(),
                id.split_once("://").map_or(id, |(_, id)| id),
            ))
        })
        .collect()
}
