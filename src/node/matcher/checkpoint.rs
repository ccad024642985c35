//! What a restarted kubelet kept of its device allocations: its device
//! manager's checkpoint (`kubelet_internal_checkpoint`, beside its
//! socket), which it writes once a container's Allocates have all
//! answered. A kubelet killed between those Allocates and that write
//! forgets them and, restarted, asks again for that container with other
//! devices; the ledger's grant is then void, and the container must be
//! served again rather than looked past (its re-ask matched to the next
//! pod of the same ask, or refused).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde::Deserialize;
use tokio::io::AsyncReadExt;

use crate::rules::device::Resource;
use crate::rules::matching::pods::PodView;
use crate::rules::usage::Keys;

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
}

/// (pod UID, container, resource name) the kubelet holds devices for.
pub(crate) type Kept = HashSet<(String, String, String)>;

/// Per pod UID, the (container, resource) grants of a ledger that the
/// kubelet no longer holds.
pub(crate) type Void = HashMap<String, HashSet<(String, Resource)>>;

/// Reads the checkpoint at `path`.
pub(crate) async fn read(path: &Path) -> Result<Kept, CheckpointError> {
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
        .map(|e| (e.pod, e.container, e.resource))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::matcher::report::tests::{SHARE, container, view};

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
        let kept = read(&path).await.unwrap();
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
}
