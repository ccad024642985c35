//! Which pod and container an Allocate (or GetPreferredAllocation) is for,
//! and which GPU it gets. Pure: the actor gathers the pods, this
//! decides, the actor records.

pub mod pods;
#[cfg(test)]
pub(crate) mod tests;

use crate::rules::device::Resource;
use crate::rules::usage::{
    ContainerAsk, Holding, Inventory, Ledger, NodeUsage, best_shared, pod_holdings, whole_gpus,
};
use pods::{PodKey, PodView};

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
    pub(crate) uid: String,
    pub(crate) container: String,
    /// The GPUs the container gets; for GetPreferredAllocation of a
    /// container with no GPU yet, the best fit (empty when none fits).
    pub gpus: Vec<usize>,
    /// Amount in the resource's unit.
    pub(crate) amount: u64,
    /// Already served with these very IDs: answer again, record nothing.
    pub(crate) repeat: bool,
    /// The container holds `gpus` whole ([`ContainerAsk::rides_whole`]): a
    /// shared amount rides inside them, with nothing to cap.
    pub(crate) whole: bool,
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
    #[error(
        "{pod}/{container} is assigned {assigned:?} by the extender, but the kubelet's \
         {resource} devices are on {ids:?}; refusing them (the kubelet ignored the preferred \
         allocation, or its view of free devices differs from the pods' ledgers)"
    )]
    Contradicts {
        pod: PodKey,
        container: String,
        resource: Resource,
        ids: Vec<String>,
        assigned: Vec<String>,
    },
    #[error("GPU {uuid} is held whole by another container; {pod} wants a share of it")]
    HeldWhole { pod: PodKey, uuid: String },
    #[error("GPU {uuid} carries shared work; {pod} wants it whole")]
    CarriesShared { pod: PodKey, uuid: String },
    #[error(
        "{pod}/{container} already got GPUs {gpus:?} with its {first}, and the kubelet's \
         {resource} devices are on {ids:?}; refusing them rather than give one container two \
         GPUs' envs"
    )]
    Splits {
        pod: PodKey,
        container: String,
        first: Resource,
        resource: Resource,
        gpus: Vec<String>,
        ids: Vec<String>,
    },
    #[error("{pod} wants {wanted} GPUs whole and only {clear} are clear of other work")]
    NoWholeGpus {
        pod: PodKey,
        wanted: u64,
        clear: u64,
    },
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
    pub(crate) fn pod(&self) -> Option<&PodKey> {
        match self {
            MatchError::NoCandidate { best, .. } => best.as_ref(),
            MatchError::UnknownGpu { pod, .. }
            | MatchError::SpansGpus { pod, .. }
            | MatchError::Contradicts { pod, .. }
            | MatchError::HeldWhole { pod, .. }
            | MatchError::CarriesShared { pod, .. }
            | MatchError::Splits { pod, .. }
            | MatchError::NoWholeGpus { pod, .. }
            | MatchError::Full { pod, .. } => Some(pod),
        }
    }
}

/// What the live pods hold on the node's GPUs: their ledgers, and the
/// assignments of containers not served yet.
pub fn usage(inv: &Inventory, pods: &[PodView]) -> NodeUsage {
    let holdings: Vec<Holding> = pods
        .iter()
        .filter(|p| p.live)
        .flat_map(|p| pod_holdings(inv, &p.containers, &p.ledger, &p.assignment))
        .collect();
    NodeUsage::of(inv, &holdings)
}

/// `view` of a pod being deleted: it keeps what it holds (the kubelet frees
/// its devices only as its containers stop), but it is never admitted
/// again and its device IDs may already be another container's, so its
/// ledger names no IDs an Allocate could repeat.
pub(crate) fn deleting(view: &mut PodView) {
    for grant in view.ledger.0.values_mut() {
        grant.ids.clear();
    }
}

/// Candidates in the order they are served: pods the scheduler stamped
/// with an assume-time first, earliest first; then by creation time; then
/// by namespace/name.
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

fn unserved<'a>(pod: &'a PodView, r: Resource) -> impl Iterator<Item = &'a ContainerAsk> + 'a {
    pod.containers
        .iter()
        .filter(move |c| c.wants(r) > 0 && !pod.ledger.served(&c.name, r))
}

pub fn decide(inv: &Inventory, pods: &[PodView], ask: &Ask) -> Result<Decision, MatchError> {
    decide_with(inv, pods, &usage(inv, pods), ask)
}

/// [`decide`] with the pods' usage already known.
pub(crate) fn decide_with(
    inv: &Inventory,
    pods: &[PodView],
    usage: &NodeUsage,
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
            // container of the pod; otherwise it is asking again. It never
            // asks again for a container while the pod's next ones wait
            // (their devices are checkpointed), so IDs of an app container
            // or a sidecar, which hand nothing on, are the next one's choice.
            let next = unserved(pod, r).find(|c| c.wants(r) == ask.devices);
            match next {
                Some(c) if pod.admitting => {
                    let hands_on = pod
                        .containers
                        .iter()
                        .any(|c| c.name == *container && c.hands_on());
                    let ids = if hands_on { Ids::HandedOn } else { Ids::Chosen };
                    return place(inv, usage, pod, c, ask, ids);
                }
                _ => {
                    let whole = pod
                        .containers
                        .iter()
                        .any(|c| c.name == *container && c.whole());
                    return Ok(Decision {
                        pod: pod.key.clone(),
                        uid: pod.uid.clone(),
                        container: container.clone(),
                        gpus: grant.gpus.iter().filter_map(|g| inv.index(g)).collect(),
                        amount: grant.amount(r).unwrap_or(0),
                        repeat: true,
                        whole,
                    });
                }
            }
        }
    }
    let candidates = ordered(pods);
    // The kubelet admits one pod at a time and serves a container's
    // resources back to back: a container, then a pod, already part-served
    // comes before the candidate order among fresh ones.
    let part_served = |p: &PodView, c: &ContainerAsk| p.ledger.0.contains_key(&c.name);
    let started = |p: &PodView| p.containers.iter().any(|c| part_served(p, c));
    for tier in 0..3 {
        for pod in &candidates {
            let mut fits = unserved(pod, r).filter(|c| c.wants(r) == ask.devices);
            let in_tier = |c: &&ContainerAsk| match tier {
                0 => part_served(pod, c),
                1 => started(pod),
                _ => true,
            };
            if let Some(c) = fits.find(in_tier) {
                return place(inv, usage, pod, c, ask, Ids::Chosen);
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

/// Where an Allocate's device IDs came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ids {
    /// Picked by the kubelet (steered by GetPreferredAllocation).
    Chosen,
    /// An init container's, handed on by the kubelet without a choice.
    HandedOn,
}

/// The GPUs for container `c` of `pod`, checked against what the other
/// pods hold.
fn place(
    inv: &Inventory,
    usage: &NodeUsage,
    pod: &PodView,
    c: &ContainerAsk,
    ask: &Ask,
    ids: Ids,
) -> Result<Decision, MatchError> {
    let r = ask.resource;
    let amount = ask.devices * inv.unit()[r];
    let decision = |gpus: Vec<usize>| Decision {
        pod: pod.key.clone(),
        uid: pod.uid.clone(),
        container: c.name.clone(),
        gpus,
        amount,
        repeat: false,
        whole: c.whole(),
    };
    let uuid = |g: usize| inv.gpus[g].uuid.clone();
    let known = |u: &String, key: &str| {
        inv.index(u).ok_or_else(|| MatchError::UnknownGpu {
            pod: pod.key.clone(),
            uuid: u.clone(),
            key: key.into(),
        })
    };
    let own = pod.ledger.0.get(&c.name);
    let assignment = pod.assignment.0.get(&c.name);
    let assigned: Option<Vec<usize>> = assignment
        .map(|uuids| uuids.iter().map(|u| known(u, "the extender")).collect())
        .transpose()?;
    let others = without_own(inv, usage, pod, c);
    let usage = &others;
    // Whole GPUs the pod's init containers still hand on go to the next
    // container before any fresh one, whichever the kubelet picks of them:
    // never a contradiction. The ledger says exactly which those are, so
    // whole GPUs are checked even when handed on; shared IDs handed on are
    // not followed per GPU, and the assignment says where they run.
    let handed = match c.whole() {
        true => handed_whole(inv, pod, c),
        false => Vec::new(),
    };
    let checked = ids == Ids::Chosen || r == Resource::GpuCount;
    if let Some(assigned) = &assigned {
        let contradicts = ask
            .id_gpus
            .iter()
            .any(|g| !assigned.contains(g) && !handed.contains(g));
        if checked && !ask.id_gpus.is_empty() && contradicts {
            return Err(MatchError::Contradicts {
                pod: pod.key.clone(),
                container: c.name.clone(),
                resource: r,
                ids: ask.id_gpus.iter().map(|&g| uuid(g)).collect(),
                assigned: assigned.iter().map(|&g| uuid(g)).collect(),
            });
        }
    }
    // What the ledger records fixes the GPUs of a container asking whole
    // ones, whichever of its resources came first.
    let recorded: Option<Vec<usize>> = own
        .filter(|g| !g.gpus.is_empty())
        .map(|g| g.gpus.iter().filter_map(|u| inv.index(u)).collect());
    if r == Resource::GpuCount {
        // The kubelet holds the IDs' GPUs for the container, exclusive:
        // those are its GPUs, also when handed on from an init container
        // to another than the assigned one.
        let gpus = match (recorded, assigned) {
            (Some(fixed), _) if !ask.id_gpus.is_empty() && !same_set(&ask.id_gpus, &fixed) => {
                let first = Resource::ALL
                    .into_iter()
                    .find(|&s| own.and_then(|g| g.amount(s)).is_some())
                    .unwrap_or(Resource::GpuMemory);
                return Err(MatchError::Splits {
                    pod: pod.key.clone(),
                    container: c.name.clone(),
                    first,
                    resource: r,
                    gpus: fixed.iter().map(|&g| uuid(g)).collect(),
                    ids: ask.id_gpus.iter().map(|&g| uuid(g)).collect(),
                });
            }
            (Some(fixed), _) => fixed,
            (None, Some(a)) if ask.id_gpus.is_empty() || same_set(&ask.id_gpus, &a) => a,
            _ => ask.id_gpus.clone(),
        };
        if let Some(&g) = gpus.iter().find(|&&g| usage.gpus[g].carries_shared()) {
            return Err(MatchError::CarriesShared {
                pod: pod.key.clone(),
                uuid: uuid(g),
            });
        }
        return Ok(decision(gpus));
    }
    if c.rides_whole(r) {
        // Its share rides inside its whole GPUs: once its count (or another
        // share) is recorded, those; else the extender's; else as many GPUs
        // clear of other work as it asks, those the kubelet's IDs or an init
        // container point at first, then as its count's hint would take
        // them, so its count can follow.
        let gpus = match recorded.or(assigned) {
            Some(gpus) => gpus,
            None => {
                let wanted = c.wants(Resource::GpuCount);
                let first: Vec<usize> = handed.iter().chain(&ask.id_gpus).copied().collect();
                let n = usize::try_from(wanted).unwrap_or(usize::MAX);
                let gpus = whole_gpus(inv, usage, &first, n);
                if (gpus.len() as u64) < wanted {
                    return Err(MatchError::NoWholeGpus {
                        pod: pod.key.clone(),
                        wanted,
                        clear: gpus.len() as u64,
                    });
                }
                gpus
            }
        };
        if let Some(&g) = gpus.iter().find(|&&g| usage.gpus[g].held_whole()) {
            return Err(MatchError::HeldWhole {
                pod: pod.key.clone(),
                uuid: uuid(g),
            });
        }
        if let Some(&g) = gpus.iter().find(|&&g| usage.gpus[g].carries_shared()) {
            return Err(MatchError::CarriesShared {
                pod: pod.key.clone(),
                uuid: uuid(g),
            });
        }
        return Ok(decision(gpus));
    }
    let recorded = own.and_then(|g| g.gpus.first());
    let target = match (assigned.as_deref(), &pod.gpu_uuid, recorded) {
        (Some([g, ..]), _, _) => Some(*g),
        (_, Some(u), _) => Some(known(u, "the scheduler")?),
        (_, None, Some(u)) => inv.index(u),
        _ => None,
    };
    let gpu = match (target, ask.id_gpus.as_slice()) {
        (Some(g), _) => g,
        (None, [g]) => *g,
        (None, []) => {
            let need = inv.amount(&c.devices);
            return Ok(decision(
                best_shared(inv, usage, &need).into_iter().collect(),
            ));
        }
        (None, many) => {
            return Err(MatchError::SpansGpus {
                pod: pod.key.clone(),
                resource: r,
                gpus: many.iter().map(|&g| uuid(g)).collect(),
            });
        }
    };
    if usage.gpus[gpu].held_whole() {
        return Err(MatchError::HeldWhole {
            pod: pod.key.clone(),
            uuid: uuid(gpu),
        });
    }
    let free = usage.free(inv, gpu, r);
    if amount > free {
        return Err(MatchError::Full {
            pod: pod.key.clone(),
            uuid: uuid(gpu),
            resource: r,
            free,
            capacity: inv.capacity(gpu)[r],
            amount,
        });
    }
    Ok(decision(vec![gpu]))
}

/// `usage` less what container `c` of `pod` holds and is assigned, as the
/// usage counts it: a container must not stand in its own way (its own
/// share before its count, or its own assigned ask). A whole GPU an init
/// container hands on to `c` leaves the count too: it is the pod's own.
fn without_own(inv: &Inventory, usage: &NodeUsage, pod: &PodView, c: &ContainerAsk) -> NodeUsage {
    // `pod_holdings` reads the records of the containers it is given only,
    // and fails closed for an unreadable one exactly as the pod's usage did.
    pod_holdings(inv, std::slice::from_ref(c), &pod.ledger, &pod.assignment)
        .iter()
        .fold(usage.clone(), |u, h| u.without(inv, h))
}

/// The whole GPUs the kubelet holds for `next` to take first, per the
/// ledger: those granted to the pod's init containers before it that hand
/// theirs on, less those a sidecar or an app container before it took (the
/// kubelet's `devicesToReuse`).
fn handed_whole(inv: &Inventory, pod: &PodView, next: &ContainerAsk) -> Vec<usize> {
    let mut pool: Vec<usize> = Vec::new();
    for c in pod.containers.iter().take_while(|c| c.name != next.name) {
        let Some(grant) = pod.ledger.0.get(&c.name).filter(|g| g.whole()) else {
            continue;
        };
        let gpus: Vec<usize> = grant.gpus.iter().filter_map(|u| inv.index(u)).collect();
        c.pass_on(&mut pool, &gpus);
    }
    pool
}

fn same_set(a: &[usize], b: &[usize]) -> bool {
    a.iter().all(|g| b.contains(g)) && b.iter().all(|g| a.contains(g))
}

/// `decision` written into `ledger` (the actor patches the result onto the
/// pod).
pub fn record(ledger: &mut Ledger, inv: &Inventory, ask: &Ask, decision: &Decision) {
    let grant = ledger.0.entry(decision.container.clone()).or_default();
    if grant.gpus.is_empty() || ask.resource == Resource::GpuCount {
        grant.gpus = decision
            .gpus
            .iter()
            .map(|&g| inv.gpus[g].uuid.clone())
            .collect();
    }
    grant.set(
        ask.resource,
        decision.amount,
        ask.digest.clone().unwrap_or_default(),
    );
}
