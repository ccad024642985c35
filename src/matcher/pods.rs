//! A node's pods as the matcher sees them: only what matching needs, read
//! from the API's `Pod` once per lookup. Pure, so tests build pods by hand.

use k8s_openapi::api::core::v1::{Container, Pod};

use super::ledger::Ledger;
use crate::device::Resource;

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerView {
    pub name: String,
    /// Devices asked per resource (the limit, in devices), in
    /// `Resource::ALL` order.
    pub wants: [u64; 3],
}

impl ContainerView {
    pub fn wants(&self, r: Resource) -> u64 {
        self.wants[r as usize]
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    pub key: PodKey,
    pub uid: String,
    /// Phase `Pending` and not being deleted: the kubelet may be admitting it.
    pub admitting: bool,
    /// Not `Succeeded` or `Failed`: its grants still occupy GPUs.
    pub live: bool,
    /// `<domain>/gpu-assume-time`, when present and a decimal number.
    pub assume_time: Option<u128>,
    /// creationTimestamp, nanoseconds since the epoch.
    pub created: i128,
    /// `<domain>/gpu-uuid`, set by a scheduler extender.
    pub gpu_uuid: Option<String>,
    /// Init containers, then app containers, in spec order.
    pub containers: Vec<ContainerView>,
    pub ledger: Ledger,
    pub resource_version: String,
}

/// The annotation keys of a resource domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    pub assume_time: String,
    pub gpu_uuid: String,
    pub assigned: String,
    pub ledger: String,
    /// `<domain>/<resource>` in `Resource::ALL` order.
    pub resources: [String; 3],
}

impl Keys {
    pub fn new(domain: &str) -> Keys {
        Keys {
            assume_time: format!("{domain}/gpu-assume-time"),
            gpu_uuid: format!("{domain}/gpu-uuid"),
            assigned: format!("{domain}/gpu-assigned"),
            ledger: format!("{domain}/gpu-ledger"),
            resources: Resource::ALL.map(|r| format!("{domain}/{}", r.name())),
        }
    }
}

/// Why a pod's annotations could not all be read; the pod is still used,
/// with the part left out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodWarning {
    #[error("annotation {0} is not a decimal number: {1:?}")]
    AssumeTime(String, String),
    #[error("annotation {0} is not a valid ledger ({1}); ignoring it")]
    Ledger(String, String),
}

fn wants(keys: &Keys, c: &Container) -> [u64; 3] {
    let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref());
    let get = |i: usize| {
        limits
            .and_then(|l| l.get(&keys.resources[i]))
            .and_then(|q| q.0.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    [get(0), get(1), get(2)]
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
        let ledger = Ledger::parse(annotations.get(&keys.ledger).map(String::as_str))
            .unwrap_or_else(|e| {
                warnings.push(PodWarning::Ledger(keys.ledger.clone(), e.to_string()));
                Ledger::default()
            });
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let deleting = meta.deletion_timestamp.is_some();
        let spec = pod.spec.as_ref();
        let containers = spec
            .into_iter()
            .flat_map(|s| s.init_containers.iter().flatten().chain(&s.containers))
            .map(|c| ContainerView {
                name: c.name.clone(),
                wants: wants(keys, c),
            })
            .collect();
        let view = PodView {
            key: PodKey {
                namespace: meta.namespace.clone().unwrap_or_default(),
                name: meta.name.clone().unwrap_or_default(),
            },
            uid: meta.uid.clone().unwrap_or_default(),
            admitting: matches!(phase, None | Some("Pending")) && !deleting,
            live: !matches!(phase, Some("Succeeded" | "Failed")),
            assume_time,
            created: meta
                .creation_timestamp
                .as_ref()
                .map_or(0, |t| t.0.as_nanosecond()),
            gpu_uuid: annotations
                .get(&keys.gpu_uuid)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty()),
            containers,
            ledger,
            resource_version: meta.resource_version.clone().unwrap_or_default(),
        };
        (view, warnings)
    }

    /// Every GPU resource of every container served.
    pub fn complete(&self) -> bool {
        self.containers.iter().all(|c| {
            Resource::ALL
                .iter()
                .all(|&r| c.wants(r) == 0 || self.ledger.served(&c.name, r))
        })
    }
}
