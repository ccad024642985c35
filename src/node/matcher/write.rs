//! The matcher's one write: a container's grant into its pod's ledger, as a
//! JSON merge patch whose precondition is the resourceVersion it was
//! decided on. Apart from the actor so that its round trips can be pinned
//! against a mocked API server (`write_tests`).

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{Patch, PatchParams};

use super::actor::MatcherArgs;
use crate::rules::matching::pods::PodView;
use crate::rules::matching::{Ask, Decision, record};
use crate::rules::usage::Ledger;

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
