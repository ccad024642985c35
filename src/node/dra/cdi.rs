//! One CDI spec per prepared claim: a device per request share, carrying
//! the container edits the composer gave it, in `<cdi_dir>/<driver>-<claim
//! UID>.json`, written atomically (a temporary dotted name the runtimes'
//! CDI caches skip, then a rename).
//!
//! Written with serde rather than the `container-device-interface` crate:
//! its library depends on `jsonschema` with default features, which pulls
//! an HTTP client and a second TLS stack (aws-lc-rs, a C build) into the
//! node daemon to write a few lines of JSON; the format here is the
//! spec's (<https://github.com/cncf-tags/container-device-interface>,
//! SPEC.md), checked by the tests.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::node::enforcement::{EnforcementError, write_atomically};
use crate::node::grant::ContainerEdits;

/// The spec version: 0.5.0 is the first that takes the `kind`/`name`
/// forms used here with env and bind mounts, and what the runtimes of
/// Kubernetes 1.34+ (containerd 1.7+, CRI-O 1.28+) all read.
pub(crate) const CDI_VERSION: &str = "0.5.0";
/// The device class: one spec device per claim share.
const CLASS: &str = "claim";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Spec {
    pub(crate) cdi_version: String,
    pub(crate) kind: String,
    pub(crate) devices: Vec<Device>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Device {
    pub(crate) name: String,
    pub(crate) container_edits: Edits,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Edits {
    /// `KEY=value`, sorted by key.
    pub(crate) env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) mounts: Vec<Mount>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Mount {
    pub(crate) host_path: String,
    pub(crate) container_path: String,
    #[serde(rename = "type")]
    pub(crate) kind: String,
    pub(crate) options: Vec<String>,
}

impl From<ContainerEdits> for Edits {
    fn from(e: ContainerEdits) -> Edits {
        let mut env: Vec<(String, String)> = e.envs.into_iter().collect();
        env.sort();
        Edits {
            env: env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
            mounts: e
                .mounts
                .into_iter()
                .map(|m| Mount {
                    host_path: m.host_path,
                    container_path: m.container_path,
                    kind: "bind".into(),
                    options: [
                        "bind",
                        if m.read_only { "ro" } else { "rw" },
                        "nosuid",
                        "nodev",
                    ]
                    .map(String::from)
                    .to_vec(),
                })
                .collect(),
        }
    }
}

/// Where a driver's claim specs are written, and how they are named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CdiDir {
    pub(crate) dir: PathBuf,
    pub(crate) driver: String,
}

impl CdiDir {
    /// The spec kind: `<driver>/claim`.
    pub(crate) fn kind(&self) -> String {
        format!("{}/{CLASS}", self.driver)
    }

    /// A share's device name: unique per claim UID and share, and starting
    /// with a letter whatever the UID is.
    pub(crate) fn device_name(claim_uid: &str, share: &str) -> String {
        let clean = |s: &str| -> String {
            s.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect()
        };
        format!("claim-{}-{}", clean(claim_uid), clean(share))
    }

    /// The fully qualified CDI device ID the kubelet hands the runtime.
    pub(crate) fn device_id(&self, name: &str) -> String {
        format!("{}={name}", self.kind())
    }

    pub(crate) fn spec_path(&self, claim_uid: &str) -> PathBuf {
        let uid: String = claim_uid
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        self.dir.join(format!("{}-{uid}.json", self.driver))
    }

    /// Writes `devices` as the claim's spec, replacing any earlier one.
    pub(crate) fn write(
        &self,
        claim_uid: &str,
        devices: Vec<Device>,
    ) -> Result<PathBuf, EnforcementError> {
        let spec = Spec {
            cdi_version: CDI_VERSION.into(),
            kind: self.kind(),
            devices,
        };
        let path = self.spec_path(claim_uid);
        let json = serde_json::to_vec_pretty(&spec).expect("a CDI spec serialises");
        std::fs::create_dir_all(&self.dir).map_err(|source| EnforcementError::Io {
            action: "create directory",
            path: self.dir.clone(),
            source,
        })?;
        write_atomically(&path, &json, 0o644)?;
        Ok(path)
    }

    /// Removes a claim's spec; gone already is done.
    pub(crate) fn remove(path: &Path) -> Result<(), EnforcementError> {
        match std::fs::remove_file(path) {
            Err(source) if source.kind() != std::io::ErrorKind::NotFound => {
                Err(EnforcementError::Io {
                    action: "remove",
                    path: path.to_owned(),
                    source,
                })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::api::Mount as ApiMount;

    #[test]
    fn a_claims_spec_is_cdi_json_with_sorted_envs_and_bind_mounts() {
        let tmp = tempfile::tempdir().unwrap();
        let cdi = CdiDir {
            dir: tmp.path().join("cdi"),
            driver: "gpu.doslab.io".into(),
        };
        let edits = ContainerEdits {
            envs: HashMap::from([
                ("NVIDIA_VISIBLE_DEVICES".into(), "GPU-a".into()),
                ("CUDA_DEVICE_SM_LIMIT".into(), "30".into()),
            ]),
            mounts: vec![ApiMount {
                container_path: "/etc/ld.so.preload".into(),
                host_path: "/s/ld.so.preload".into(),
                read_only: true,
            }],
        };
        let name = CdiDir::device_name("0b9d-7a0e", "gpu-s/1");
        assert_eq!(name, "claim-0b9d-7a0e-gpu-s_1");
        let devices = vec![Device {
            name: name.clone(),
            container_edits: edits.into(),
        }];
        let path = cdi.write("0b9d-7a0e", devices).unwrap();
        assert_eq!(path, tmp.path().join("cdi/gpu.doslab.io-0b9d-7a0e.json"));
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "cdiVersion": "0.5.0",
                "kind": "gpu.doslab.io/claim",
                "devices": [{
                    "name": "claim-0b9d-7a0e-gpu-s_1",
                    "containerEdits": {
                        "env": ["CUDA_DEVICE_SM_LIMIT=30", "NVIDIA_VISIBLE_DEVICES=GPU-a"],
                        "mounts": [{
                            "hostPath": "/s/ld.so.preload",
                            "containerPath": "/etc/ld.so.preload",
                            "type": "bind",
                            "options": ["bind", "ro", "nosuid", "nodev"]
                        }]
                    }
                }]
            })
        );
        assert_eq!(
            cdi.device_id(&name),
            "gpu.doslab.io/claim=claim-0b9d-7a0e-gpu-s_1"
        );
        // Nothing but the spec is left in the directory.
        let names: Vec<_> = std::fs::read_dir(tmp.path().join("cdi"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1);
        CdiDir::remove(&path).unwrap();
        assert!(!path.exists());
        CdiDir::remove(&path).unwrap();
        // A UID is never a path.
        assert!(cdi.spec_path("../../x").starts_with(&cdi.dir));
        assert_eq!(cdi.spec_path("../../x").parent(), Some(cdi.dir.as_path()));
    }
}
