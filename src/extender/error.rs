//! What the extender answers a request it cannot serve. One enum for
//! every verb, so that `server` maps it to the HTTP answer in one place
//! ([`RequestError::answer`]); the Display texts are what kube-scheduler
//! puts on the pod's events.

use super::admission::Busy;
use super::cluster::BindError;
use super::index::PodName;

/// What filter and bind answer while the index is stale.
const NOT_SYNCED: &str = "not synced with the API server; try again shortly";

/// Why the extender refused a filter, prioritize or bind.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("gpu extender: {verb} request is not the JSON kube-scheduler sends: {source}")]
    Malformed {
        verb: &'static str,
        source: serde_json::Error,
    },
    #[error("gpu extender: the {verb} request has no Pod")]
    NoPod { verb: &'static str },
    /// A GPU pod's filter refused before any node was judged.
    #[error("gpu extender: {0}")]
    Filter(Box<RequestError>),
    /// A bind that failed, with which pod and node it was for.
    #[error("gpu extender: cannot bind pod {}/{} to node {node}: {reason}", .pod.0, .pod.1)]
    Bind {
        pod: PodName,
        node: String,
        reason: Box<RequestError>,
    },

    // The reasons a filter or bind gives under `Filter` and `Bind`.
    #[error("{}", NOT_SYNCED)]
    NotSynced,
    #[error(transparent)]
    Busy(#[from] Busy),
    #[error("the binds before it in extender.max_binds_in_flight took too long")]
    QueuedTooLong,
    #[error("{0}")]
    ReadPod(BindError),
    #[error("the pod does not exist")]
    PodGone,
    #[error("the pod is now another one (UID {now}, the scheduler bound UID {scheduled})")]
    Replaced { now: String, scheduled: String },
    #[error("it is already bound to node {0}")]
    BoundElsewhere(String),
    /// The node has no room for the pod now (the planner's reason).
    #[error("{0}")]
    NoRoom(String),
    #[error("the Bindings before it on this node took too long")]
    NodeLineTooLong,
    #[error("creating the Binding failed: {0}")]
    Binding(BindError),
    #[error("creating the Binding failed: {0}; the pod is gone")]
    BindingPodGone(BindError),
    #[error("creating the Binding failed: {failed}; whether it landed is unknown ({check})")]
    BindingUnknown { failed: BindError, check: BindError },
}

impl RequestError {
    /// Why, as a short name that stays the same across releases: the
    /// `outcome` label of the extender's request counter. A filter's or a
    /// bind's is its reason's.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            RequestError::Malformed { .. } => "malformed",
            RequestError::NoPod { .. } => "no_pod",
            RequestError::Filter(reason) => reason.kind(),
            RequestError::Bind { reason, .. } => reason.kind(),
            RequestError::NotSynced => "not_synced",
            RequestError::Busy(_) => "busy",
            RequestError::QueuedTooLong => "queued_too_long",
            RequestError::ReadPod(_) => "read_pod",
            RequestError::PodGone => "pod_gone",
            RequestError::Replaced { .. } => "replaced",
            RequestError::BoundElsewhere(_) => "bound_elsewhere",
            RequestError::NoRoom(_) => "no_room",
            RequestError::NodeLineTooLong => "node_line_too_long",
            RequestError::Binding(_) => "binding",
            RequestError::BindingPodGone(_) => "binding_pod_gone",
            RequestError::BindingUnknown { .. } => "binding_unknown",
        }
    }
}
