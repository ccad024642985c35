//! Warning Events on the pods the matcher could not place, so `kubectl
//! describe pod` says why, on the pods of a GPU that had a fault, and on
//! two pods whose GPU records it swapped. They
//! go through kube-runtime's [`Recorder`]
//! (`events.k8s.io/v1`; a repeat on the same pod within minutes patches the
//! first one's series instead of adding another Event), posted by a task
//! of their own: an Event is a courtesy and never holds up an Allocate.
//!
//! One task fed by a bounded queue rather than a task per Event: a flood
//! of failures (a pod retried by the kubelet, an API server that is down)
//! then costs at most [`QUEUE`] Events waiting, the rest dropped and
//! logged, instead of unbounded requests piling up; and the Recorder's
//! series cache sees one Event at a time, so a repeat finds the first.

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;

use crate::rules::matching::pods::PodKey;

/// Events waiting for the API server beyond this many are dropped.
const QUEUE: usize = 64;
/// One Event's post; the client's own retries of 503s may take longer.
const POST_TIMEOUT: Duration = Duration::from_secs(2);
/// The API server refuses a longer note; client-go's recorder cuts it to
/// this too.
const NOTE_LIMIT: usize = 1024;
/// Who reports the Events (the admission policy in deploy/ checks it).
const CONTROLLER: &str = "gpu-device-plugin";

/// Why a Warning is posted: its reason, as `kubectl describe pod` shows
/// it, and what the daemon was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Why {
    /// A container refused at Allocate.
    AllocateFailed,
    /// An XID on a GPU whose shares are clients of its MPS server: one
    /// client's fault ends them all.
    FaultOnSharedServer,
    /// An XID on a GPU the pod uses otherwise (whole, or HAMi-core shares).
    Fault,
    /// The kubelet admitted the pod in the place of another of the same
    /// asks: their GPU records were swapped to match.
    RecordsSwapped,
}

impl Why {
    fn reason(self) -> &'static str {
        match self {
            Why::AllocateFailed => "GpuAllocateFailed",
            Why::FaultOnSharedServer => "GpuFaultOnSharedServer",
            Why::Fault => "GpuFault",
            Why::RecordsSwapped => "GpuRecordsSwapped",
        }
    }

    fn action(self) -> &'static str {
        match self {
            Why::AllocateFailed | Why::RecordsSwapped => "Allocate",
            Why::FaultOnSharedServer | Why::Fault => "WatchGpuHealth",
        }
    }
}

/// Where the matcher hands its Events; cloning shares the one queue. The
/// posting task ends when the last handle is gone, after the Events
/// already queued.
#[derive(Clone)]
pub(super) struct Events {
    queue: mpsc::Sender<(PodKey, Why, String)>,
}

impl Events {
    /// Starts the task that posts Events as the matcher of `node_name`
    /// (their `reportingInstance`).
    pub(super) fn start(client: Client, node_name: &str) -> Events {
        let reporter = Reporter {
            controller: CONTROLLER.into(),
            instance: Some(node_name.to_owned()),
        };
        let recorder = Recorder::new(client, reporter);
        let (queue, mut queued) = mpsc::channel::<(PodKey, Why, String)>(QUEUE);
        tokio::spawn(async move {
            while let Some((pod, why, message)) = queued.recv().await {
                let (event, regarding) = warning(&pod, why, message);
                let posting = recorder.publish(&event, &regarding);
                match tokio::time::timeout(POST_TIMEOUT, posting).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!(%pod, error = %e, "cannot post event"),
                    Err(_) => tracing::warn!(%pod, "posting an event timed out"),
                }
            }
        });
        Events { queue }
    }

    /// Queues a Warning on `pod` saying `message`; never waits.
    pub(super) fn warn(&self, pod: &PodKey, why: Why, message: &str) {
        match self.queue.try_send((pod.clone(), why, message.to_owned())) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::warn!(%pod, queued = QUEUE, "too many events waiting; dropped one");
            }
            // The matcher is stopping: nobody posts any more.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }
}

/// The Event saying `message` about `pod`, and the reference to the pod.
fn warning(pod: &PodKey, why: Why, mut message: String) -> (Event, ObjectReference) {
    if message.len() > NOTE_LIMIT {
        let mut end = NOTE_LIMIT;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
    }
    let event = Event {
        type_: EventType::Warning,
        reason: why.reason().into(),
        note: Some(message),
        action: why.action().into(),
        secondary: None,
    };
    let regarding = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(pod.name.clone()),
        namespace: Some(pod.namespace.clone()),
        ..Default::default()
    };
    (event, regarding)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_message_is_cut_to_what_the_api_server_takes_on_a_char_boundary() {
        let pod = PodKey {
            namespace: "team-a".into(),
            name: "p".into(),
        };
        // Two-byte characters after one byte: byte 1024 is inside one.
        let long = format!("a{}", "é".repeat(600));
        let (event, regarding) = warning(&pod, Why::AllocateFailed, long);
        let note = event.note.unwrap();
        assert_eq!(note.len(), NOTE_LIMIT - 1);
        assert!(note.starts_with("aé") && note.ends_with('é'));
        assert_eq!(regarding.kind.as_deref(), Some("Pod"));
        assert_eq!(regarding.namespace.as_deref(), Some("team-a"));
        let (event, _) = warning(&pod, Why::FaultOnSharedServer, "short".into());
        assert_eq!(event.note.as_deref(), Some("short"));
        assert_eq!(event.reason, "GpuFaultOnSharedServer");
        assert_eq!(event.type_, EventType::Warning);
    }
}
