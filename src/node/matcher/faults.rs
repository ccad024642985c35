//! Who hears of a GPU fault, and what they are told. An XID on a GPU
//! reaches every live pod with a container granted on it, one Event per
//! pod naming its containers there. Shares served as clients of the GPU's
//! MPS server are told that the server is one fault domain: a fatal fault
//! in any client ends every client of that server (measured on an H200),
//! so a pod whose own code did nothing wrong learns why it died. Whole
//! GPUs and HAMi-core shares hear of the fault on their GPU.

use std::collections::BTreeMap;

use super::events::Why;
use crate::node::health::GpuFault;
use crate::rules::matching::granted;
use crate::rules::matching::pods::{PodKey, PodView};
use crate::rules::usage::Inventory;

/// Per pod with a container granted on the fault's GPU (the grants the
/// metrics show, [`granted`]): why it is told and the Event's note.
/// `mps`: shares on this node are MPS clients.
pub(super) fn notices(
    inv: &Inventory,
    views: &[PodView],
    fault: &GpuFault,
    mps: bool,
) -> Vec<(PodKey, Why, String)> {
    // Per pod: its containers on that GPU, and whether any is a share.
    let mut hit: BTreeMap<PodKey, (Vec<String>, bool)> = BTreeMap::new();
    for g in granted(inv, views)
        .into_iter()
        .filter(|g| g.gpu == fault.uuid)
    {
        let (names, shared) = hit.entry(g.pod).or_default();
        names.push(g.container);
        *shared |= !g.whole;
    }
    let critical = if fault.xid.critical() {
        "; the GPU is out of service until it passes its health checks again"
    } else {
        ""
    };
    hit.into_iter()
        .map(|(pod, (names, shared))| {
            let containers = names.join(", ");
            let (why, note) = if shared && mps {
                let note = format!(
                    "{} on GPU {}, whose MPS server serves this pod's {containers}: the \
                     server is one fault domain, so a fatal fault in any of its clients \
                     ends the work of every client on that GPU, this pod's too{critical}",
                    fault.xid, fault.uuid
                );
                (Why::FaultOnSharedServer, note)
            } else {
                let note = format!(
                    "{} on GPU {}, which this pod's {containers} uses{critical}",
                    fault.xid, fault.uuid
                );
                (Why::Fault, note)
            };
            (pod, why, note)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::health::Xid;
    use crate::node::matcher::report::tests::{SHARE, container, view, whole_and_done};
    use crate::rules::matching::tests::gpus_of_1000_mib;

    fn fault(uuid: &str, xid: u64) -> GpuFault {
        GpuFault {
            uuid: uuid.into(),
            xid: Xid(Some(xid)),
        }
    }

    /// Only live pods with a container granted on the GPU hear of it, once
    /// per pod; MPS clients are told of the shared server.
    #[test]
    fn a_fault_reaches_the_pods_on_its_gpu_and_no_other() {
        let inv = gpus_of_1000_mib(&["GPU-a", "GPU-b"]);
        let share = SHARE;
        let views = [
            view(
                "two-shares",
                true,
                vec![container("a", share), container("b", share)],
                r#"{"a":{"gpus":["GPU-a"],"gpu-memory":300},"b":{"gpus":["GPU-a"],"gpu-memory":300}}"#,
            ),
            view("waiting", true, vec![container("app", share)], "{}"),
        ];
        let views: Vec<PodView> = views.into_iter().chain(whole_and_done()).collect();
        let told = notices(&inv, &views, &fault("GPU-a", 31), true);
        assert_eq!(told.len(), 1, "{told:?}");
        let (pod, why, note) = &told[0];
        assert_eq!(pod.name, "two-shares");
        assert_eq!(*why, Why::FaultOnSharedServer);
        assert!(note.starts_with("XID 31 on GPU GPU-a, whose MPS server serves this pod's a, b"));
        assert!(
            !note.contains("out of service"),
            "31 is an application's: {note}"
        );

        let told = notices(&inv, &views, &fault("GPU-b", 79), true);
        assert_eq!(told.len(), 1, "{told:?}");
        let (pod, why, note) = &told[0];
        assert_eq!(
            (pod.name.as_str(), *why),
            ("whole", Why::Fault),
            "a whole GPU has no MPS server"
        );
        assert!(
            note.contains("train") && note.contains("out of service"),
            "{note}"
        );

        let told = notices(&inv, &views, &fault("GPU-a", 31), false);
        assert_eq!(told[0].1, Why::Fault, "HAMi-core shares share no server");
        assert!(notices(&inv, &views, &fault("GPU-c", 79), true).is_empty());
    }
}
