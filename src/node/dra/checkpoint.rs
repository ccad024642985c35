//! What the daemon has prepared, kept in one JSON file so that unprepare
//! and a restarted daemon know it: per claim UID, the answer the kubelet
//! was given, the CDI spec written and the cache directories made. Written
//! atomically after every change; a file that cannot be read stops the
//! DRA plugin with its path rather than forgetting what was prepared.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::node::enforcement::{EnforcementError, write_atomically};

/// The file's format; a file of another version is refused.
const VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Checkpoint {
    version: u32,
    pub(crate) claims: BTreeMap<String, Prepared>,
}

/// One prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Prepared {
    pub(crate) namespace: String,
    pub(crate) name: String,
    /// The claim's CDI spec.
    pub(crate) spec: PathBuf,
    /// HAMi-core cache directories made for its shares.
    pub(crate) caches: Vec<PathBuf>,
    /// What the kubelet was answered.
    pub(crate) devices: Vec<PreparedDevice>,
}

/// One device of the answer (the DRA API's `Device`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PreparedDevice {
    pub(crate) request: String,
    pub(crate) pool: String,
    pub(crate) device: String,
    pub(crate) cdi_ids: Vec<String>,
    pub(crate) share_id: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("DRA checkpoint {path}: cannot read it: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "DRA checkpoint {path}: {reason}; it says which claims are prepared, so it is not \
         replaced: move it aside only once no pod on this node uses a claim of this driver"
    )]
    Corrupt { path: PathBuf, reason: String },
    #[error(transparent)]
    Write(#[from] EnforcementError),
}

impl Checkpoint {
    /// The checkpoint at `path`; none yet is empty.
    pub(crate) fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Checkpoint {
                    version: VERSION,
                    claims: BTreeMap::new(),
                });
            }
            Err(source) => {
                return Err(CheckpointError::Read {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: path.to_owned(),
            reason,
        };
        let c: Checkpoint = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
        if c.version != VERSION {
            return Err(corrupt(format!(
                "version {} (this daemon reads {VERSION})",
                c.version
            )));
        }
        Ok(c)
    }

    /// Writes the checkpoint to `path` atomically, its directory made.
    pub(crate) fn save(&self, path: &Path) -> Result<(), CheckpointError> {
        let dir = path.parent().unwrap_or(Path::new("/"));
        std::fs::create_dir_all(dir).map_err(|source| EnforcementError::Io {
            action: "create directory",
            path: dir.to_owned(),
            source,
        })?;
        let json = serde_json::to_vec_pretty(self).expect("a checkpoint serialises");
        Ok(write_atomically(path, &json, 0o600)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_survives_a_round_trip_and_a_bad_one_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("dra/checkpoint.json");
        let mut c = Checkpoint::load(&path).unwrap();
        assert!(c.claims.is_empty());
        c.claims.insert(
            "uid-1".into(),
            Prepared {
                namespace: "ns".into(),
                name: "c".into(),
                spec: "/cdi/x.json".into(),
                caches: vec!["/s/claims/uid-1_gpu".into()],
                devices: vec![PreparedDevice {
                    request: "gpu".into(),
                    pool: "node-a".into(),
                    device: "gpu-0".into(),
                    cdi_ids: vec!["gpu.doslab.io/claim=claim-uid-1-gpu".into()],
                    share_id: Some("s".into()),
                }],
            },
        );
        c.save(&path).unwrap();
        assert_eq!(Checkpoint::load(&path).unwrap(), c);

        std::fs::write(&path, b"{\"version\": 1, \"claims\": 7}").unwrap();
        let e = Checkpoint::load(&path).unwrap_err().to_string();
        assert!(
            e.contains(&*path.to_string_lossy()) && e.contains("not replaced"),
            "{e}"
        );
        std::fs::write(&path, b"{\"version\": 9, \"claims\": {}}").unwrap();
        let e = Checkpoint::load(&path).unwrap_err().to_string();
        assert!(e.contains("version 9"), "{e}");
    }
}
