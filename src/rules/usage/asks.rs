//! What a pod's containers ask for, in devices, read from its spec.

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};

use super::Keys;
use super::quantity::{Quantity, QuantityError, parse_count};
use crate::rules::device::{PerResource, Resource};

/// A limit that is not a whole number of devices: the container's ask
/// cannot be known, so the pod must not be placed or matched as if it
/// asked nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("container {container}: limit {resource} {error}")]
pub(crate) struct AskError {
    pub(crate) container: String,
    pub(crate) resource: String,
    pub(crate) error: QuantityError,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerAsk {
    pub name: String,
    pub(crate) init: bool,
    /// An init container with `restartPolicy: Always` (a sidecar): it runs
    /// beside the app containers for the pod's whole life, so the kubelet
    /// lets it keep its devices and hands none of them on.
    pub(crate) restartable: bool,
    /// The limit of each resource, in devices (0: not asked, or not
    /// readable: see `invalid`).
    pub(crate) devices: PerResource<u64>,
    /// The first limit that is not a whole number of devices.
    pub(crate) invalid: Option<AskError>,
}

impl ContainerAsk {
    pub(crate) fn from_container(keys: &Keys, c: &Container, init: bool) -> ContainerAsk {
        let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref());
        let mut invalid = None;
        let devices = keys.resources.map(|_, name| {
            let Some(q) = limits.and_then(|l| l.get(name)) else {
                return 0;
            };
            parse_count(&q.0, u64::MAX).unwrap_or_else(|error| {
                invalid.get_or_insert(AskError {
                    container: c.name.clone(),
                    resource: name.clone(),
                    error,
                });
                0
            })
        });
        ContainerAsk {
            name: c.name.clone(),
            init,
            restartable: init && c.restart_policy.as_deref() == Some("Always"),
            devices,
            invalid,
        }
    }

    pub fn wants(&self, r: Resource) -> u64 {
        self.devices[r]
    }

    /// An init container that ends before the next starts: the kubelet
    /// hands its devices on to the containers after it (its
    /// `devicesToReuse`). Every other container takes from those first and
    /// keeps what it took.
    pub(crate) fn hands_on(&self) -> bool {
        self.init && !self.restartable
    }

    /// `pool`, the devices the kubelet keeps for the pod's next containers
    /// (its `devicesToReuse`), after this container was granted `granted`:
    /// an init container that hands on adds them, any other container
    /// keeps them, so they leave it.
    pub(crate) fn pass_on<T: PartialEq + Clone>(&self, pool: &mut Vec<T>, granted: &[T]) {
        if self.hands_on() {
            for d in granted {
                if !pool.contains(d) {
                    pool.push(d.clone());
                }
            }
        } else {
            pool.retain(|d| !granted.contains(d));
        }
    }

    /// [`ContainerAsk::pass_on`] by number, for devices all on one GPU
    /// (a shared resource's, which the fit follows by count): what is left
    /// of a pool of `pool` devices once this container was granted
    /// `granted`, taken from the pool first.
    pub(crate) fn pass_on_count(&self, pool: u64, granted: u64) -> u64 {
        let reused = pool.min(granted);
        if self.hands_on() {
            pool + (granted - reused)
        } else {
            pool - reused
        }
    }

    /// Asks GPUs whole; any memory or core it also asks comes with them.
    pub(crate) fn whole(&self) -> bool {
        self.devices.count > 0
    }

    /// Asks a share of one GPU.
    pub(crate) fn shared(&self) -> bool {
        !self.whole() && (self.devices.memory > 0 || self.devices.core > 0)
    }

    /// The one rule for a container asking whole GPUs and gpu-memory or
    /// gpu-core too: its `r` rides inside its whole GPUs. That ask is
    /// recorded in its ledger, but never places it on another GPU, never
    /// counts as shared work on one, and is answered with the container's
    /// whole GPUs and nothing to cap, whichever of its resources the kubelet
    /// serves first.
    pub(crate) fn rides_whole(&self, r: Resource) -> bool {
        self.whole() && r != Resource::GpuCount && self.devices[r] > 0
    }
}

/// What kube-scheduler's NodeResourcesFit counts of a node: CPU in
/// millicores and memory in bytes, as a pod asks them ([`request`]) or a
/// node has them left. A node that states no allocatable amount has
/// `u64::MAX` of it: never what stops a pod.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct NodeAsk {
    pub(crate) cpu_milli: u64,
    pub(crate) memory: u64,
}

impl NodeAsk {
    pub(crate) fn plus(self, other: NodeAsk) -> NodeAsk {
        NodeAsk {
            cpu_milli: self.cpu_milli.saturating_add(other.cpu_milli),
            memory: self.memory.saturating_add(other.memory),
        }
    }

    /// What is left of `self` once `other` is taken (none below 0).
    pub(crate) fn minus(self, other: NodeAsk) -> NodeAsk {
        NodeAsk {
            cpu_milli: self.cpu_milli.saturating_sub(other.cpu_milli),
            memory: self.memory.saturating_sub(other.memory),
        }
    }

    /// Whether this ask fits in `room`, each resource alike.
    pub(crate) fn within(self, room: NodeAsk) -> bool {
        self.cpu_milli <= room.cpu_milli && self.memory <= room.memory
    }
}

/// Init containers, then app containers, in spec order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PodAsks {
    pub(crate) containers: Vec<ContainerAsk>,
    /// The CPU and memory the scheduler counts the pod as asking of its
    /// node ([`request`]).
    pub(crate) node: NodeAsk,
}

impl PodAsks {
    /// The first container's limit that cannot be read.
    pub(crate) fn invalid(&self) -> Option<&AskError> {
        self.containers.iter().find_map(|c| c.invalid.as_ref())
    }

    pub(crate) fn from_pod(keys: &Keys, pod: &Pod) -> PodAsks {
        let spec = pod.spec.as_ref();
        let init = spec
            .into_iter()
            .flat_map(|s| s.init_containers.iter().flatten());
        let app = spec.into_iter().flat_map(|s| &s.containers);
        PodAsks {
            containers: init
                .map(|c| ContainerAsk::from_container(keys, c, true))
                .chain(app.map(|c| ContainerAsk::from_container(keys, c, false)))
                .collect(),
            node: NodeAsk {
                cpu_milli: spec.map_or(0, |s| request(s, "cpu")),
                // Bytes, as the scheduler counts memory: thousandths of a
                // byte rounded up.
                memory: spec.map_or(0, |s| request(s, "memory").div_ceil(1000)),
            },
        }
    }
}

/// A container's request of `resource` in thousandths: its request, else
/// its limit (the API server defaults one to the other), else none; one
/// that cannot be read counts as none (the API server refuses it anyway).
fn container_request(c: &Container, resource: &str) -> u64 {
    let r = c.resources.as_ref();
    let q = r
        .and_then(|r| r.requests.as_ref())
        .and_then(|m| m.get(resource))
        .or_else(|| {
            r.and_then(|r| r.limits.as_ref())
                .and_then(|m| m.get(resource))
        });
    milli(q)
}

/// `q` in thousandths; 0 when absent, unreadable or negative, and past
/// `u64` the most it holds: an ask that large fits no node, never none.
fn milli(q: Option<&k8s_openapi::apimachinery::pkg::api::resource::Quantity>) -> u64 {
    let thousandths = q.and_then(|q| Quantity::parse(&q.0).ok()?.milli());
    thousandths.map_or(0, |m| u64::try_from(m.max(0)).unwrap_or(u64::MAX))
}

/// The pod's request of `resource` (in thousandths) as kube-scheduler
/// counts it: the app containers and sidecars together, or, if more, the
/// peak while init containers run (each beside the sidecars started
/// before it), plus the pod's overhead.
fn request(spec: &PodSpec, resource: &str) -> u64 {
    let (mut sidecars, mut peak) = (0u64, 0u64);
    for c in spec.init_containers.iter().flatten() {
        let asked = container_request(c, resource);
        if c.restart_policy.as_deref() == Some("Always") {
            sidecars = sidecars.saturating_add(asked);
            peak = peak.max(sidecars);
        } else {
            peak = peak.max(sidecars.saturating_add(asked));
        }
    }
    let app = spec
        .containers
        .iter()
        .map(|c| container_request(c, resource))
        .fold(sidecars, u64::saturating_add);
    let overhead = milli(spec.overhead.as_ref().and_then(|o| o.get(resource)));
    app.max(peak).saturating_add(overhead)
}
