//! What a restarted kubelet kept of its device allocations: its device
//! manager's checkpoint (`kubelet_internal_checkpoint`, beside its
//! socket), which it writes once a container's Allocates have all
//! answered. A kubelet killed between those Allocates and that write
//! forgets them and, restarted, asks again for that container with other
//! devices; the ledger's grant is then void, and the container must be
//! served again rather than looked past (its re-ask matched to the next
//! pod of the same ask, or refused).
//!
//! It also says which pod the kubelet gave each grant to, which the
//! matcher can only infer: of two pods asking the same that the kubelet may
//! admit in either order (a batch it sorts by creation time, ties in no
//! set order; or lists of its own and the matcher's that hold different
//! pods after a broken watch), the matcher may record on one the grant the
//! other got. [`crossings`] finds such pairs, whose GPU records the
//! matcher then swaps.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::Path;

use serde::Deserialize;
use tokio::io::AsyncReadExt;

use crate::rules::device::Resource;
use crate::rules::matching::pods::PodView;
use crate::rules::usage::{Keys, ids_digest};

/// A bound on what is read: a checkpoint of a few hundred pods is a few
/// hundred KiB.
const MOST: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub(crate) enum CheckpointError {
    #[error("cannot read the kubelet's checkpoint {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("the kubelet's checkpoint {path} is over {MOST} bytes")]
    TooLarge { path: String },
    #[error("cannot parse the kubelet's checkpoint {path}: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
}

/// The checkpoint's shape (the device manager's `checkpoint.Data`), as
/// far as it is read.
#[derive(Deserialize)]
struct File {
    #[serde(rename = "Data")]
    data: Data,
}

#[derive(Deserialize)]
struct Data {
    #[serde(rename = "PodDeviceEntries", default)]
    entries: Option<Vec<Entry>>,
}

#[derive(Deserialize)]
struct Entry {
    #[serde(rename = "PodUID")]
    pod: String,
    #[serde(rename = "ContainerName")]
    container: String,
    #[serde(rename = "ResourceName")]
    resource: String,
    /// The device IDs by NUMA node (a device on several is under each).
    #[serde(rename = "DeviceIDs", default)]
    ids: Option<HashMap<String, Vec<String>>>,
}

/// A container's devices of one resource, as the kubelet holds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Checkpointed {
    pub(crate) pod: String,
    pub(crate) container: String,
    pub(crate) resource: String,
    /// The digest of the device IDs, as a ledger records it.
    pub(crate) digest: String,
}

/// (pod UID, container, resource name) the kubelet holds devices for.
pub(crate) type Kept = HashSet<(String, String, String)>;

/// What `held` keeps.
pub(crate) fn kept(held: &[Checkpointed]) -> Kept {
    held.iter()
        .map(|h| (h.pod.clone(), h.container.clone(), h.resource.clone()))
        .collect()
}

/// Per pod UID, the (container, resource) grants of a ledger that the
/// kubelet no longer holds.
pub(crate) type Void = HashMap<String, HashSet<(String, Resource)>>;

/// Reads the checkpoint at `path`.
pub(crate) async fn read(path: &Path) -> Result<Vec<Checkpointed>, CheckpointError> {
    let shown = || path.display().to_string();
    let mut bytes = Vec::new();
    let file = tokio::fs::File::open(path)
        .await
        .map_err(|source| CheckpointError::Read {
            path: shown(),
            source,
        })?;
    file.take(MOST + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(|source| CheckpointError::Read {
            path: shown(),
            source,
        })?;
    if bytes.len() as u64 > MOST {
        return Err(CheckpointError::TooLarge { path: shown() });
    }
    let file: File = serde_json::from_slice(&bytes).map_err(|source| CheckpointError::Parse {
        path: shown(),
        source,
    })?;
    let entries = file.data.entries.unwrap_or_default();
    Ok(entries
        .into_iter()
        .map(|e| {
            let ids: BTreeSet<String> = e.ids.unwrap_or_default().into_values().flatten().collect();
            Checkpointed {
                pod: e.pod,
                container: e.container,
                resource: e.resource,
                digest: ids_digest(ids.iter().map(String::as_str)),
            }
        })
        .collect())
}

/// The grants on the ledgers of Pending pods that `kept` lacks: the
/// restarted kubelet asks for them again. A Running pod's are kept (the
/// kubelet allocates before it starts a container).
pub(crate) fn void(views: &[PodView], keys: &Keys, kept: &Kept) -> Void {
    let mut void = Void::new();
    for view in views.iter().filter(|v| v.admitting && v.live) {
        for (container, grant) in &view.ledger.0 {
            for r in Resource::ALL
                .into_iter()
                .filter(|&r| grant.amount(r).is_some())
            {
                let held = (
                    view.uid.clone(),
                    container.clone(),
                    keys.resources[r].clone(),
                );
                if !kept.contains(&held) {
                    void.entry(view.uid.clone())
                        .or_default()
                        .insert((container.clone(), r));
                }
            }
        }
    }
    void
}

/// Two pods whose GPU records the matcher keeps on the wrong one: the
/// kubelet holds `admitted`'s devices under grants on `recorded`'s ledger,
/// and `recorded`'s, if it holds any yet, under grants on `admitted`'s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Crossing {
    pub(crate) admitted: String,
    pub(crate) recorded: String,
}

/// The crossings `held` shows among `views`: pairs of live pods, neither
/// being deleted, asking the same of every container, where every grant
/// the kubelet holds for one is on the other's ledger (the same container
/// and resource), and on no third pod's. The kubelet frees a gone pod's
/// devices before it hands them out again, so a pod still live holds no
/// device IDs another pod was granted since.
pub(crate) fn crossings(views: &[PodView], keys: &Keys, held: &[Checkpointed]) -> Vec<Crossing> {
    let current: HashMap<&str, &PodView> = views
        .iter()
        .filter(|v| v.live && !v.deleting)
        .map(|v| (v.uid.as_str(), v))
        .collect();
    // Which pod's ledger has each grant (resource, digest); None on several.
    let mut on: HashMap<(Resource, &str), Option<(&str, &str)>> = HashMap::new();
    for v in current.values() {
        for (container, grant) in &v.ledger.0 {
            for (r, digest) in &grant.ids {
                on.entry((*r, digest.as_str()))
                    .and_modify(|o| *o = None)
                    .or_insert(Some((v.uid.as_str(), container.as_str())));
            }
        }
    }
    // Per pod the kubelet holds grants of ours for: the pod each grant is
    // recorded on, if it is one other pod's under the same container.
    let mut holders: HashMap<&str, Vec<Option<&str>>> = HashMap::new();
    for h in held {
        let Some(r) = Resource::ALL
            .into_iter()
            .find(|&r| keys.resources[r] == h.resource)
        else {
            continue;
        };
        let owner = on.get(&(r, h.digest.as_str())).copied().flatten();
        let other = owner
            .filter(|&(uid, container)| uid != h.pod && container == h.container)
            .map(|(uid, _)| uid);
        holders.entry(h.pod.as_str()).or_default().push(other);
    }
    let only = |pod: &str| -> Option<&str> {
        let owners = holders.get(pod)?;
        let first = (*owners.first()?)?;
        owners.iter().all(|o| *o == Some(first)).then_some(first)
    };
    let mut found = Vec::new();
    for (&admitted, _) in holders.iter().filter(|(p, _)| current.contains_key(*p)) {
        let Some(recorded) = only(admitted) else {
            continue;
        };
        let (Some(a), Some(b)) = (current.get(admitted), current.get(recorded)) else {
            continue;
        };
        let back = holders
            .get(recorded)
            .is_none_or(|_| only(recorded) == Some(admitted));
        // Each pair once: the one whose admitted UID sorts first when both
        // hold grants.
        let first = !holders.contains_key(recorded) || admitted < recorded;
        if back && first && a.containers == b.containers {
            found.push(Crossing {
                admitted: admitted.to_owned(),
                recorded: recorded.to_owned(),
            });
        }
    }
    found.sort_by(|x, y| x.admitted.cmp(&y.admitted));
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::matcher::report::tests::{SHARE, WHOLE, container, view};

    #[tokio::test]
    async fn a_grant_the_kubelet_did_not_checkpoint_is_void_only_on_a_pending_pod() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubelet_internal_checkpoint");
        // As the device manager writes it (DeviceIDs by NUMA node, the
        // Allocate response as bytes, a checksum).
        std::fs::write(
            &path,
            r#"{"Data":{"PodDeviceEntries":[{"PodUID":"uid-pending","ContainerName":"a",
                "ResourceName":"doslab.io/gpu-memory","DeviceIDs":{"-1":["m0"]},"AllocResp":"CgA="}],
                "RegisteredDevices":{"doslab.io/gpu-memory":["m0","m1"]}},"Checksum":1}"#,
        )
        .unwrap();
        let held = read(&path).await.unwrap();
        assert_eq!(held[0].digest, ids_digest(["m0"].into_iter()));
        let kept = kept(&held);
        let both = r#"{"gpus":["GPU-a"],"gpu-memory":300,"gpu-core":20}"#;
        let ledger = format!(r#"{{"a":{both},"b":{both}}}"#);
        let containers = || vec![container("a", SHARE), container("b", SHARE)];
        let mut pending = view("pending", true, containers(), &ledger);
        pending.admitting = true;
        let running = view("running", true, containers(), &ledger);
        let void = void(&[pending, running], &Keys::new("doslab.io"), &kept);
        let want: HashSet<(String, Resource)> = [
            ("a".to_owned(), Resource::GpuCore),
            ("b".to_owned(), Resource::GpuMemory),
            ("b".to_owned(), Resource::GpuCore),
        ]
        .into();
        assert_eq!(void, Void::from([("uid-pending".to_owned(), want)]));

        std::fs::write(&path, "{").unwrap();
        let err = read(&path).await.unwrap_err().to_string();
        assert!(err.contains("kubelet_internal_checkpoint"), "{err}");
    }

    fn held(pod: &str, resource: &str, digest: &str) -> Checkpointed {
        Checkpointed {
            pod: format!("uid-{pod}"),
            container: "a".into(),
            resource: format!("doslab.io/{resource}"),
            digest: digest.into(),
        }
    }

    /// A ledger granting container `a` the IDs of `digests` (resource,
    /// digest) on GPU-b.
    fn granted(digests: &[(&str, &str)]) -> String {
        let ids: serde_json::Map<String, serde_json::Value> = digests
            .iter()
            .map(|(r, d)| ((*r).to_owned(), (*d).into()))
            .collect();
        let grant =
            serde_json::json!({"gpus": ["GPU-b"], "gpu-memory": 300, "gpu-core": 20, "ids": ids});
        serde_json::json!({ "a": grant }).to_string()
    }

    fn pending(name: &str, ledger: &str) -> PodView {
        let mut v = view(name, true, vec![container("a", SHARE)], ledger);
        v.admitting = true;
        v
    }

    #[test]
    fn a_grant_the_kubelet_holds_for_another_pod_of_the_same_asks_is_a_crossing() {
        let keys = Keys::new("doslab.io");
        let both = granted(&[("gpu-memory", "m1"), ("gpu-core", "c1")]);
        let views = [pending("p", "{}"), pending("q", &both)];
        let on_p = [held("p", "gpu-memory", "m1"), held("p", "gpu-core", "c1")];
        let crossed = Crossing {
            admitted: "uid-p".into(),
            recorded: "uid-q".into(),
        };
        assert_eq!(crossings(&views, &keys, &on_p), vec![crossed.clone()]);

        // Served as recorded: nothing crossed.
        let on_q = [held("q", "gpu-memory", "m1"), held("q", "gpu-core", "c1")];
        assert_eq!(crossings(&views, &keys, &on_q), vec![]);

        // Both pods served, each with the other's grant: one swap.
        let other = granted(&[("gpu-memory", "m2"), ("gpu-core", "c2")]);
        let views = [pending("p", &other), pending("q", &both)];
        let mut both_held = on_p.to_vec();
        both_held.extend([held("q", "gpu-memory", "m2"), held("q", "gpu-core", "c2")]);
        assert_eq!(crossings(&views, &keys, &both_held), vec![crossed]);

        // Half its grants held as recorded: not a crossing the swap mends.
        let mixed = [held("p", "gpu-memory", "m1"), held("p", "gpu-core", "c2")];
        assert_eq!(crossings(&views, &keys, &mixed), vec![]);
    }

    #[test]
    fn pods_of_other_asks_or_being_deleted_are_never_crossed() {
        let keys = Keys::new("doslab.io");
        let grant = granted(&[("gpu-memory", "m1")]);
        let on_p = [held("p", "gpu-memory", "m1")];
        let mut other_asks = pending("p", "{}");
        other_asks.containers = vec![container("a", WHOLE)];
        assert_eq!(
            crossings(&[other_asks, pending("q", &grant)], &keys, &on_p),
            vec![]
        );
        let mut deleting = pending("p", "{}");
        deleting.deleting = true;
        assert_eq!(
            crossings(&[deleting, pending("q", &grant)], &keys, &on_p),
            vec![]
        );
        // Recorded on two pods: whose it is cannot be told.
        let views = [
            pending("p", "{}"),
            pending("q", &grant),
            pending("r", &grant),
        ];
        assert_eq!(crossings(&views, &keys, &on_p), vec![]);
    }
}
