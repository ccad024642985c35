//! Which pod and container an Allocate (or GetPreferredAllocation) is for,
//! and which GPU it gets (SPEC §3). Pure: the actor gathers the pods, this
//! decides, the actor records.

use super::ledger::Grant;
use super::pods::{ContainerView, PodKey, PodView};
use crate::config::Config;
use crate::device::{Gpu, Resource};

/// The node's GPUs and what one device of each resource is worth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub uuids: Vec<String>,
    /// Per GPU, the kubelet-visible capacity of each resource, in the
    /// resource's unit, in `Resource::ALL` order.
    pub capacity: Vec<[u64; 3]>,
    /// MiB, percent, GPUs per device, in `Resource::ALL` order.
    pub unit: [u64; 3],
}

impl Node {
    pub fn new(config: &Config, gpus: &[Gpu]) -> Node {
        let unit = Resource::ALL.map(|r| config.unit_amount(r));
        Node {
            uuids: gpus.iter().map(|g| g.uuid.clone()).collect(),
            capacity: gpus
                .iter()
                .map(|g| {
                    Resource::ALL.map(|r| {
                        u64::from(config.units_per_gpu(r, g.memory_mib)) * unit[r as usize]
                    })
                })
                .collect(),
            unit,
        }
    }

    fn index(&self, uuid: &str) -> Option<usize> {
        self.uuids.iter().position(|u| u == uuid)
    }
}

/// What is being asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub resource: Resource,
    /// Number of device IDs.
    pub devices: u64,
    /// For Allocate: the digest of the IDs and the GPUs they are on (each
    /// once, in order). Empty for GetPreferredAllocation.
    pub digest: Option<String>,
    pub id_gpus: Vec<usize>,
}

/// The answer: a container and its GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub pod: PodKey,
    pub uid: String,
    pub container: String,
    /// The GPUs the container gets; for GetPreferredAllocation of a
    /// container with no GPU yet, the best fit (empty when none fits).
    pub gpus: Vec<usize>,
    /// Amount in the resource's unit.
    pub amount: u64,
    /// Already served with these very IDs: answer again, record nothing.
    pub repeat: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MatchError {
    #[error("no pending pod on this node has a container waiting for {devices} {resource} devices")]
    NoCandidate {
        resource: Resource,
        devices: u64,
        /// The first pod waiting for this resource, if any (for an Event).
        best: Option<PodKey>,
    },
    #[error("pod {pod} is assigned GPU {uuid} by {key}, and this node has no such GPU")]
    UnknownGpu {
        pod: PodKey,
        uuid: String,
        key: String,
    },
    #[error(
        "{resource} devices span GPUs {0:?}; a container's {resource} must come from one GPU \
         (no GPU has room for all of {pod}'s request)",
        .gpus
    )]
    SpansGpus {
        pod: PodKey,
        resource: Resource,
        gpus: Vec<String>,
    },
    #[error("GPU {uuid} is held whole by another container; {pod} wants a share of it")]
    HeldWhole { pod: PodKey, uuid: String },
    #[error("GPU {uuid} carries shared work; {pod} wants it whole")]
    CarriesShared { pod: PodKey, uuid: String },
    #[error("GPU {uuid} has {free} of {capacity} {resource} left; {pod} wants {amount}")]
    Full {
        pod: PodKey,
        uuid: String,
        resource: Resource,
        free: u64,
        capacity: u64,
        amount: u64,
    },
}

impl MatchError {
    /// The pod an Event about this error belongs on: the matched pod, or for
    /// no candidate, the first pod waiting for the resource.
    pub fn pod(&self) -> Option<&PodKey> {
        match self {
            MatchError::NoCandidate { best, .. } => best.as_ref(),
            MatchError::UnknownGpu { pod, .. }
            | MatchError::SpansGpus { pod, .. }
            | MatchError::HeldWhole { pod, .. }
            | MatchError::CarriesShared { pod, .. }
            | MatchError::Full { pod, .. } => Some(pod),
        }
    }
}

/// What the live pods' ledgers hold on each GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Per GPU: memory and core used, in `Resource::ALL` order (count unused).
    pub used: Vec<[u64; 3]>,
    pub whole: Vec<bool>,
    pub shared: Vec<bool>,
}

impl Usage {
    pub fn of(node: &Node, pods: &[PodView]) -> Usage {
        let n = node.uuids.len();
        let mut u = Usage {
            used: vec![[0; 3]; n],
            whole: vec![false; n],
            shared: vec![false; n],
        };
        for grant in pods
            .iter()
            .filter(|p| p.live)
            .flat_map(|p| p.ledger.0.values())
        {
            u.add(node, grant);
        }
        u
    }

    fn add(&mut self, node: &Node, grant: &Grant) {
        for gpu in grant.gpus.iter().filter_map(|g| node.index(g)) {
            if grant.whole() {
                self.whole[gpu] = true;
            }
            if grant.shared() && !grant.whole() {
                self.shared[gpu] = true;
                self.used[gpu][0] += grant.memory.unwrap_or(0);
                self.used[gpu][1] += grant.core.unwrap_or(0);
            }
        }
    }

    fn free(&self, node: &Node, gpu: usize, r: Resource) -> u64 {
        node.capacity[gpu][r as usize].saturating_sub(self.used[gpu][r as usize])
    }

    /// GPUs `resource` must stay off: whole grants avoid shared GPUs and
    /// shared grants avoid GPUs held whole.
    pub fn avoid(&self, resource: Resource) -> Vec<bool> {
        if resource == Resource::GpuCount {
            self.shared.clone()
        } else {
            self.whole.clone()
        }
    }
}

/// Candidates in SPEC §3 order: assume-time (pods with one first), then
/// creation, then namespace/name.
fn ordered(pods: &[PodView]) -> Vec<&PodView> {
    let mut v: Vec<&PodView> = pods.iter().filter(|p| p.admitting).collect();
    v.sort_by(|a, b| {
        (a.assume_time.is_none(), a.assume_time, a.created, &a.key).cmp(&(
            b.assume_time.is_none(),
            b.assume_time,
            b.created,
            &b.key,
        ))
    });
    v
}

fn unserved<'a>(pod: &'a PodView, r: Resource) -> impl Iterator<Item = &'a ContainerView> + 'a {
    pod.containers
        .iter()
        .filter(move |c| c.wants(r) > 0 && !pod.ledger.served(&c.name, r))
}

pub fn decide(node: &Node, pods: &[PodView], ask: &Ask) -> Result<Decision, MatchError> {
    decide_with(node, pods, &Usage::of(node, pods), ask)
}

/// [`decide`] with the pods' usage already known.
pub fn decide_with(
    node: &Node,
    pods: &[PodView],
    usage: &Usage,
    ask: &Ask,
) -> Result<Decision, MatchError> {
    let r = ask.resource;
    if let Some(digest) = &ask.digest {
        let served = pods.iter().filter(|p| p.live).find_map(|p| {
            p.ledger
                .0
                .iter()
                .find(|(_, g)| g.ids.get(&r) == Some(digest))
                .map(|(c, g)| (p, c, g))
        });
        if let Some((pod, container, grant)) = served {
            // The kubelet hands an init container's devices on to the next
            // container of the pod; otherwise it is asking again.
            let next = unserved(pod, r).find(|c| c.wants(r) == ask.devices);
            match next {
                Some(c) if pod.admitting => return place(node, usage, pod, c, ask),
                _ => {
                    return Ok(Decision {
                        pod: pod.key.clone(),
                        uid: pod.uid.clone(),
                        container: container.clone(),
                        gpus: grant.gpus.iter().filter_map(|g| node.index(g)).collect(),
                        amount: grant.amount(r).unwrap_or(0),
                        repeat: true,
                    });
                }
            }
        }
    }
    let candidates = ordered(pods);
    // The kubelet admits one pod at a time and serves a container's
    // resources back to back: a container, then a pod, already part-served
    // comes before the SPEC order among fresh ones.
    let part_served = |p: &PodView, c: &ContainerView| p.ledger.0.contains_key(&c.name);
    let started = |p: &PodView| p.containers.iter().any(|c| part_served(p, c));
    for tier in 0..3 {
        for pod in &candidates {
            let mut fits = unserved(pod, r).filter(|c| c.wants(r) == ask.devices);
            let in_tier = |c: &&ContainerView| match tier {
                0 => part_served(pod, c),
                1 => started(pod),
                _ => true,
            };
            if let Some(c) = fits.find(in_tier) {
                return place(node, usage, pod, c, ask);
            }
        }
    }
    Err(MatchError::NoCandidate {
        resource: r,
        devices: ask.devices,
        best: candidates
            .iter()
            .find(|p| unserved(p, r).next().is_some())
            .map(|p| p.key.clone()),
    })
}

/// The GPUs for container `c` of `pod`, checked against what the other
/// pods hold.
fn place(
    node: &Node,
    usage: &Usage,
    pod: &PodView,
    c: &ContainerView,
    ask: &Ask,
) -> Result<Decision, MatchError> {
    let r = ask.resource;
    let amount = ask.devices * node.unit[r as usize];
    let decision = |gpus: Vec<usize>| Decision {
        pod: pod.key.clone(),
        uid: pod.uid.clone(),
        container: c.name.clone(),
        gpus,
        amount,
        repeat: false,
    };
    let uuid = |g: usize| node.uuids[g].clone();
    if r == Resource::GpuCount {
        if let Some(&g) = ask.id_gpus.iter().find(|&&g| usage.shared[g]) {
            return Err(MatchError::CarriesShared {
                pod: pod.key.clone(),
                uuid: uuid(g),
            });
        }
        return Ok(decision(ask.id_gpus.clone()));
    }
    let recorded = pod.ledger.0.get(&c.name).and_then(|g| g.gpus.first());
    let target = match (&pod.gpu_uuid, recorded) {
        (Some(u), _) => Some(node.index(u).ok_or_else(|| MatchError::UnknownGpu {
            pod: pod.key.clone(),
            uuid: u.clone(),
            key: "the scheduler".into(),
        })?),
        (None, Some(u)) => node.index(u),
        (None, None) => None,
    };
    let gpu = match (target, ask.id_gpus.as_slice()) {
        (Some(g), _) => g,
        (None, [g]) => *g,
        (None, []) => return Ok(decision(best_fit(node, usage, c).into_iter().collect())),
        (None, many) => {
            return Err(MatchError::SpansGpus {
                pod: pod.key.clone(),
                resource: r,
                gpus: many.iter().map(|&g| uuid(g)).collect(),
            });
        }
    };
    if usage.whole[gpu] && !pod.ledger.0.get(&c.name).is_some_and(Grant::whole) {
        return Err(MatchError::HeldWhole {
            pod: pod.key.clone(),
            uuid: uuid(gpu),
        });
    }
    let free = usage.free(node, gpu, r);
    if amount > free {
        return Err(MatchError::Full {
            pod: pod.key.clone(),
            uuid: uuid(gpu),
            resource: r,
            free,
            capacity: node.capacity[gpu][r as usize],
            amount,
        });
    }
    Ok(decision(vec![gpu]))
}

/// The GPU with the least room left that still fits all of the container's
/// shared asks, away from whole grants.
fn best_fit(node: &Node, usage: &Usage, c: &ContainerView) -> Option<usize> {
    let need = |r: Resource| c.wants(r) * node.unit[r as usize];
    (0..node.uuids.len())
        .filter(|&g| !usage.whole[g])
        .filter(|&g| {
            [Resource::GpuMemory, Resource::GpuCore]
                .iter()
                .all(|&r| usage.free(node, g, r) >= need(r))
        })
        .min_by_key(|&g| {
            (
                usage.free(node, g, Resource::GpuMemory) - need(Resource::GpuMemory),
                usage.free(node, g, Resource::GpuCore) - need(Resource::GpuCore),
                g,
            )
        })
}

/// `decision` written into `ledger` (the actor patches the result onto the
/// pod).
pub fn record(ledger: &mut super::ledger::Ledger, node: &Node, ask: &Ask, decision: &Decision) {
    let grant = ledger.0.entry(decision.container.clone()).or_default();
    if grant.gpus.is_empty() || ask.resource == Resource::GpuCount {
        grant.gpus = decision
            .gpus
            .iter()
            .map(|&g| node.uuids[g].clone())
            .collect();
    }
    grant.set(
        ask.resource,
        decision.amount,
        ask.digest.clone().unwrap_or_default(),
    );
}
