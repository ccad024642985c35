//! The matcher's one write: a container's grant into its pod's ledger, as a
//! JSON merge patch whose precondition is the resourceVersion it was
//! decided on. Apart from the actor so that its round trips can be pinned
//! against a mocked API server (`write_tests`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{Patch, PatchParams};

use super::actor::MatcherArgs;
use crate::rules::matching::pods::PodView;
use crate::rules::matching::{Ask, Decision, record};
use crate::rules::usage::{Keys, Ledger};

/// Pause between attempts at an API server that failed.
const RETRY: Duration = Duration::from_millis(200);

/// Why a ledger write did not land.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum WriteError {
    /// The pod was deleted (or replaced by one of the same name).
    Gone,
    Unreachable(String),
}

/// A write that landed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Landed {
    /// The pod's ledger as written.
    pub(super) ledger: Ledger,
    /// The resourceVersion the patch replaced (its precondition).
    pub(super) replaced: String,
    /// The resourceVersion the patch made.
    pub(super) resource_version: String,
}

/// Writes `d` into the ledger of the pod `view` shows, through `api`, with
/// its resourceVersion as the precondition. On a conflict (someone else
/// wrote: the kubelet's status, a label) or a failure (our own write may
/// have landed), reads the pod again, merges, and patches that version; a
/// pod gone or replaced is [`WriteError::Gone`]. Every call ends by
/// `deadline`.
pub(super) async fn ledger(
    api: &Api<Pod>,
    args: &MatcherArgs,
    mut view: PodView,
    ask: &Ask,
    d: &Decision,
    deadline: Instant,
) -> Result<Landed, WriteError> {
    let keys = &args.keys;
    loop {
        let mut after = view.clone();
        record(&mut after.ledger, &args.node, ask, d);
        let mut annotations = serde_json::json!({ keys.ledger.as_str(): after.ledger.to_json() });
        if after.complete() {
            annotations[keys.assigned.as_str()] = "true".into();
        }
        let patch = serde_json::json!({
            "metadata": { "resourceVersion": view.resource_version, "annotations": annotations }
        });
        let (params, patch) = (PatchParams::default(), Patch::Merge(&patch));
        let patching = api.patch(&d.pod.name, &params, &patch);
        let result = within(deadline, patching).await?;
        args.metrics.count_api_request("patch");
        let retry = match result {
            Ok(pod) => {
                return Ok(Landed {
                    ledger: after.ledger,
                    replaced: view.resource_version,
                    resource_version: pod.metadata.resource_version.unwrap_or_default(),
                });
            }
            Err(kube::Error::Api(s)) if s.code == 404 => return Err(WriteError::Gone),
            Err(kube::Error::Api(s)) if s.code == 409 => None,
            Err(e) => Some(e.to_string()),
        };
        if let Some(e) = &retry {
            if Instant::now() >= deadline {
                return Err(WriteError::Unreachable(e.clone()));
            }
            tracing::warn!(pod = %d.pod, error = %e, "ledger write failed; retrying");
            tokio::time::sleep(RETRY).await;
        }
        // Someone else wrote, or our own write may have landed before the
        // error: read and merge.
        match within(deadline, api.get(&d.pod.name)).await? {
            Ok(pod) => {
                args.metrics.count_api_request("get");
                let (fresh, _) = PodView::from_pod(keys, &pod);
                if fresh.uid != d.uid || !fresh.admitting && !fresh.live {
                    return Err(WriteError::Gone);
                }
                let mut merged = fresh;
                merged.ledger.merge(&view.ledger);
                view = merged;
            }
            Err(kube::Error::Api(s)) if s.code == 404 => return Err(WriteError::Gone),
            Err(e) if Instant::now() >= deadline => {
                return Err(WriteError::Unreachable(e.to_string()));
            }
            Err(e) => {
                tracing::warn!(pod = %d.pod, error = %e, "cannot read pod; retrying");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

/// The client retries 503s and 429s by itself, for longer than an Allocate
/// may wait: every call ends at the deadline.
async fn within<T>(
    deadline: Instant,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<Result<T, kube::Error>, WriteError> {
    tokio::time::timeout_at(deadline.into(), call)
        .await
        .map_err(|_| WriteError::Unreachable("no answer before the deadline".into()))
}

/// A pod's GPU records: the accounting annotations a pod carries of its
/// own (assignment, GPU UUID, assume-time, assigned flag, ledger), by key.
pub(crate) type Records = BTreeMap<String, String>;

/// The GPU records of `pod`.
pub(crate) fn records(keys: &Keys, pod: &Pod) -> Records {
    let ours = keys.pod_records();
    let annotations = pod.metadata.annotations.iter().flatten();
    annotations
        .filter(|(k, _)| ours.contains(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Why a swap did not land.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum SwapError {
    /// A pod was deleted or replaced.
    Gone,
    /// A pod's records changed since they were read: the crossing is
    /// judged again on the next read of the checkpoint.
    Changed,
    Unreachable(String),
}

/// [`within`]'s deadline, passed.
impl From<WriteError> for SwapError {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::Gone => SwapError::Gone,
            WriteError::Unreachable(e) => SwapError::Unreachable(e),
        }
    }
}

/// A pod's records as a swap wrote them.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Moved {
    pub(super) records: Records,
    pub(super) replaced: String,
    pub(super) resource_version: String,
}

/// What a swap wrote: `admitted` landed; `recorded` may not have.
#[derive(Debug)]
pub(crate) struct Swapped {
    pub(super) admitted: Moved,
    pub(super) recorded: Result<Moved, SwapError>,
}

/// One side of a swap: where its pod is, and the pod as the matcher saw it.
pub(super) struct Side<'a> {
    pub(super) api: Api<Pod>,
    pub(super) view: &'a PodView,
}

/// Swaps the GPU records of `admitted` and `recorded` (a
/// [`super::checkpoint::Crossing`]), each write a JSON merge patch with
/// the resourceVersion it read as its precondition, provided neither pod's
/// records moved from what `view` shows. `admitted` first: until the
/// second write lands both carry `recorded`'s records, so the grant the
/// kubelet gave is counted twice meanwhile, never not at all.
pub(super) async fn swap(
    args: &MatcherArgs,
    admitted: Side<'_>,
    recorded: Side<'_>,
    deadline: Instant,
) -> Result<Swapped, SwapError> {
    let (a, a_records) = fresh(args, &admitted, deadline).await?;
    let (r, r_records) = fresh(args, &recorded, deadline).await?;
    let admitted = put(args, &admitted, a, &a_records, &r_records, deadline).await?;
    let recorded = put(args, &recorded, r, &r_records, &a_records, deadline).await;
    Ok(Swapped { admitted, recorded })
}

/// The pod `side` names read again (its resourceVersion) with its records,
/// provided they are still those its view was made of.
async fn fresh(
    args: &MatcherArgs,
    side: &Side<'_>,
    deadline: Instant,
) -> Result<(String, Records), SwapError> {
    let (view, records) = read(args, side, deadline).await?;
    if view.ledger != side.view.ledger || view.assignment != side.view.assignment {
        return Err(SwapError::Changed);
    }
    Ok((view.resource_version, records))
}

/// The pod `side` names as the API server has it now, and its records.
async fn read(
    args: &MatcherArgs,
    side: &Side<'_>,
    deadline: Instant,
) -> Result<(PodView, Records), SwapError> {
    loop {
        match within(deadline, side.api.get(&side.view.key.name)).await? {
            Ok(pod) => {
                args.metrics.count_api_request("get");
                let (view, _) = PodView::from_pod(&args.keys, &pod);
                if view.uid != side.view.uid || !view.live || view.deleting {
                    return Err(SwapError::Gone);
                }
                return Ok((view, records(&args.keys, &pod)));
            }
            Err(kube::Error::Api(s)) if s.code == 404 => return Err(SwapError::Gone),
            Err(e) if Instant::now() >= deadline => {
                return Err(SwapError::Unreachable(e.to_string()));
            }
            Err(e) => {
                tracing::warn!(pod = %side.view.key, error = %e, "cannot read pod; retrying");
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

/// Writes `new` over `old` as the records of the pod `side` names, read at
/// `resource_version`; on a conflict reads it again, which must show `old`
/// still.
async fn put(
    args: &MatcherArgs,
    side: &Side<'_>,
    mut resource_version: String,
    old: &Records,
    new: &Records,
    deadline: Instant,
) -> Result<Moved, SwapError> {
    let mut annotations = serde_json::Map::new();
    for key in old.keys().chain(new.keys()) {
        let value = new
            .get(key)
            .map_or(serde_json::Value::Null, |v| v.as_str().into());
        annotations.insert(key.clone(), value);
    }
    loop {
        let patch = serde_json::json!({
            "metadata": { "resourceVersion": resource_version, "annotations": annotations }
        });
        let (params, patch) = (PatchParams::default(), Patch::Merge(&patch));
        let patching = side.api.patch(&side.view.key.name, &params, &patch);
        let result = within(deadline, patching).await?;
        args.metrics.count_api_request("patch");
        match result {
            Ok(pod) => {
                return Ok(Moved {
                    records: new.clone(),
                    replaced: resource_version,
                    resource_version: pod.metadata.resource_version.unwrap_or_default(),
                });
            }
            Err(kube::Error::Api(s)) if s.code == 404 => return Err(SwapError::Gone),
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) if Instant::now() >= deadline => {
                return Err(SwapError::Unreachable(e.to_string()));
            }
            Err(e) => {
                tracing::warn!(pod = %side.view.key, error = %e, "records swap failed; retrying");
                tokio::time::sleep(RETRY).await;
            }
        }
        // Someone else wrote (the kubelet's status), or ours may have
        // landed before the error.
        let (now, records) = read(args, side, deadline).await?;
        if records == *new {
            return Ok(Moved {
                records,
                replaced: resource_version,
                resource_version: now.resource_version,
            });
        }
        if records != *old {
            return Err(SwapError::Changed);
        }
        resource_version = now.resource_version;
    }
}
