//! Which pod and container an Allocate (or GetPreferredAllocation) is for,
//! and which GPU it gets. Pure: the actor gathers the pods, this
//! decides, the actor records.

pub mod pods;
#[cfg(test)]
pub(crate) mod tests;

use crate::rules::device::Resource;
use crate::rules::usage::{
    ContainerAsk, Holding, Inventory, Ledger, LedgerEntry, NodeUsage, best_shared, pod_holdings,
    whole_gpus,
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
pub fn usage<'a>(inv: &Inventory, pods: impl IntoIterator<Item = &'a PodView>) -> NodeUsage {
    let holdings: Vec<Holding> = pods
        .into_iter()
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

/// Candidates in the order the kubelet admits them: by arrival; within a
/// batch by creation time; otherwise pods the scheduler stamped with an
/// assume-time first, earliest first, then by creation time; then by
/// namespace/name.
fn ordered(pods: &[PodView]) -> Vec<&PodView> {
    let mut v: Vec<&PodView> = pods.iter().filter(|p| p.admitting).collect();
    v.sort_by_key(|p| {
        (
            p.arrival.seq,
            p.arrival.batch.then_some(p.created),
            p.assume_time.is_none(),
            p.assume_time,
            p.created,
            &p.key,
        )
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
    let candidates = ordered(pods);
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
                    // The kubelet gives a pod's devices to another only
                    // once the pod stopped: a pod waiting for them is
                    // handed the devices of one stopped before this node
                    // saw it deleted (deleted as it was admitted), not
                    // asked for again.
                    if let Some(placed) = in_order(inv, usage, &candidates, ask)
                        && placed.as_ref().is_ok_and(|d| d.uid != pod.uid)
                    {
                        return placed;
                    }
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
    if let Some(placed) = in_order(inv, usage, &candidates, ask) {
        return placed;
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

/// The first of `candidates`' containers waiting for `ask`, placed: the
/// kubelet admits one pod at a time and serves a container's resources
/// back to back, so a container, then a pod, already part-served comes
/// before the candidate order among fresh ones; and it allocates a pod's
/// containers in order, init containers first, so a pod not started yet
/// is asked for its first container asking devices.
fn in_order(
    inv: &Inventory,
    usage: &NodeUsage,
    candidates: &[&PodView],
    ask: &Ask,
) -> Option<Result<Decision, MatchError>> {
    let r = ask.resource;
    let part_served = |p: &PodView, c: &ContainerAsk| p.ledger.0.contains_key(&c.name);
    let started = |p: &PodView| p.containers.iter().any(|c| part_served(p, c));
    let first = |p: &PodView, c: &ContainerAsk| {
        let asking = |c: &&ContainerAsk| Resource::ALL.into_iter().any(|r| c.wants(r) > 0);
        p.containers.iter().find(asking).map(|f| &f.name) == Some(&c.name)
    };
    for tier in 0..3 {
        for pod in candidates {
            let mut fits = unserved(pod, r).filter(|c| c.wants(r) == ask.devices);
            let in_tier = |c: &&ContainerAsk| match tier {
                0 => part_served(pod, c),
                1 => started(pod),
                _ => first(pod, c),
            };
            if let Some(c) = fits.find(in_tier) {
                return Some(place(inv, usage, pod, c, ask, Ids::Chosen));
            }
        }
    }
    None
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
    let p = Placing::new(inv, usage, pod, c, ask)?;
    p.check_assignment(ids)?;
    let gpus = if ask.resource == Resource::GpuCount {
        p.counted_gpus()?
    } else if c.rides_whole(ask.resource) {
        p.riding_gpus()?
    } else {
        p.shared_gpus()?
    };
    Ok(p.decision(gpus))
}

/// One container's placement under way: what each of [`place`]'s
/// decisions reads.
struct Placing<'a> {
    inv: &'a Inventory,
    /// What the other pods and containers hold: the container must not
    /// stand in its own way.
    usage: NodeUsage,
    pod: &'a PodView,
    c: &'a ContainerAsk,
    ask: &'a Ask,
    /// The ask in the resource's unit.
    amount: u64,
    /// What the ledger records of the container, if anything yet.
    own: Option<&'a LedgerEntry>,
    /// The extender's assignment of the container, if any.
    assigned: Option<Vec<usize>>,
    /// The whole GPUs the pod's init containers still hand on to it.
    handed: Vec<usize>,
}

impl<'a> Placing<'a> {
    fn new(
        inv: &'a Inventory,
        usage: &NodeUsage,
        pod: &'a PodView,
        c: &'a ContainerAsk,
        ask: &'a Ask,
    ) -> Result<Self, MatchError> {
        let mut p = Placing {
            inv,
            usage: without_own(inv, usage, pod, c),
            pod,
            c,
            ask,
            amount: ask.devices * inv.unit()[ask.resource],
            own: pod.ledger.0.get(&c.name),
            assigned: None,
            handed: Vec::new(),
        };
        p.assigned = pod
            .assignment
            .0
            .get(&c.name)
            .map(|uuids| uuids.iter().map(|u| p.known(u, "the extender")).collect())
            .transpose()?;
        // Whole GPUs the pod's init containers still hand on go to the next
        // container before any fresh one, whichever the kubelet picks of
        // them: never a contradiction. The ledger says exactly which those
        // are, so whole GPUs are checked even when handed on; shared IDs
        // handed on are not followed per GPU, and the assignment says where
        // they run.
        if c.whole() {
            p.handed = handed_whole(inv, pod, c);
        }
        Ok(p)
    }

    fn decision(&self, gpus: Vec<usize>) -> Decision {
        Decision {
            pod: self.pod.key.clone(),
            uid: self.pod.uid.clone(),
            container: self.c.name.clone(),
            gpus,
            amount: self.amount,
            repeat: false,
            whole: self.c.whole(),
        }
    }

    fn uuid(&self, g: usize) -> String {
        self.inv.gpus[g].uuid.clone()
    }

    fn uuids(&self, gpus: &[usize]) -> Vec<String> {
        gpus.iter().map(|&g| self.uuid(g)).collect()
    }

    /// The GPU `u` names, refused when this node has none: `key` says who
    /// named it.
    fn known(&self, u: &str, key: &str) -> Result<usize, MatchError> {
        self.inv.index(u).ok_or_else(|| MatchError::UnknownGpu {
            pod: self.pod.key.clone(),
            uuid: u.to_owned(),
            key: key.into(),
        })
    }

    /// The kubelet's IDs may not leave the extender's assignment, when
    /// it chose them (or they are whole GPUs, which the ledger follows).
    fn check_assignment(&self, ids: Ids) -> Result<(), MatchError> {
        let Some(assigned) = &self.assigned else {
            return Ok(());
        };
        let checked = ids == Ids::Chosen || self.ask.resource == Resource::GpuCount;
        let id_gpus = &self.ask.id_gpus;
        let contradicts = id_gpus
            .iter()
            .any(|g| !assigned.contains(g) && !self.handed.contains(g));
        if checked && !id_gpus.is_empty() && contradicts {
            return Err(MatchError::Contradicts {
                pod: self.pod.key.clone(),
                container: self.c.name.clone(),
                resource: self.ask.resource,
                ids: self.uuids(id_gpus),
                assigned: self.uuids(assigned),
            });
        }
        Ok(())
    }

    /// What the ledger records fixes the GPUs of a container asking whole
    /// ones, whichever of its resources came first.
    fn recorded(&self) -> Option<Vec<usize>> {
        self.own
            .filter(|g| !g.gpus.is_empty())
            .map(|g| g.gpus.iter().filter_map(|u| self.inv.index(u)).collect())
    }

    /// A gpu-count ask's GPUs. The kubelet holds the IDs' GPUs for the
    /// container, exclusive: those are its GPUs, also when handed on from
    /// an init container to another than the assigned one.
    fn counted_gpus(&self) -> Result<Vec<usize>, MatchError> {
        let id_gpus = &self.ask.id_gpus;
        let gpus = match (self.recorded(), &self.assigned) {
            (Some(fixed), _) if !id_gpus.is_empty() && !same_set(id_gpus, &fixed) => {
                let first = Resource::ALL
                    .into_iter()
                    .find(|&s| self.own.and_then(|g| g.amount(s)).is_some())
                    .unwrap_or(Resource::GpuMemory);
                return Err(MatchError::Splits {
                    pod: self.pod.key.clone(),
                    container: self.c.name.clone(),
                    first,
                    resource: self.ask.resource,
                    gpus: self.uuids(&fixed),
                    ids: self.uuids(id_gpus),
                });
            }
            (Some(fixed), _) => fixed,
            (None, Some(a)) if id_gpus.is_empty() || same_set(id_gpus, a) => a.clone(),
            _ => id_gpus.clone(),
        };
        self.refuse_shared(&gpus)?;
        Ok(gpus)
    }

    /// The whole GPUs a share rides inside: once its count (or another
    /// share) is recorded, those; else the extender's; else as many GPUs
    /// clear of other work as it asks, those the kubelet's IDs or an init
    /// container point at first, then as its count's hint would take them,
    /// so its count can follow.
    fn riding_gpus(&self) -> Result<Vec<usize>, MatchError> {
        let gpus = match self.recorded().or_else(|| self.assigned.clone()) {
            Some(gpus) => gpus,
            None => {
                let wanted = self.c.wants(Resource::GpuCount);
                let first: Vec<usize> = self
                    .handed
                    .iter()
                    .chain(&self.ask.id_gpus)
                    .copied()
                    .collect();
                let n = usize::try_from(wanted).unwrap_or(usize::MAX);
                let gpus = whole_gpus(self.inv, &self.usage, &first, n);
                if (gpus.len() as u64) < wanted {
                    return Err(MatchError::NoWholeGpus {
                        pod: self.pod.key.clone(),
                        wanted,
                        clear: gpus.len() as u64,
                    });
                }
                gpus
            }
        };
        if let Some(&g) = gpus.iter().find(|&&g| self.usage.gpus[g].held_whole()) {
            return Err(self.held_whole(g));
        }
        self.refuse_shared(&gpus)?;
        Ok(gpus)
    }

    /// A GPU taken whole must carry no shared work.
    fn refuse_shared(&self, gpus: &[usize]) -> Result<(), MatchError> {
        match gpus.iter().find(|&&g| self.usage.gpus[g].carries_shared()) {
            Some(&g) => Err(MatchError::CarriesShared {
                pod: self.pod.key.clone(),
                uuid: self.uuid(g),
            }),
            None => Ok(()),
        }
    }

    fn held_whole(&self, g: usize) -> MatchError {
        MatchError::HeldWhole {
            pod: self.pod.key.clone(),
            uuid: self.uuid(g),
        }
    }

    /// A share's one GPU, with room for it; with nothing pointing at one,
    /// the best fit (none when nothing fits).
    fn shared_gpus(&self) -> Result<Vec<usize>, MatchError> {
        let gpu = match (self.shared_target()?, self.ask.id_gpus.as_slice()) {
            (Some(g), _) => g,
            (None, [g]) => *g,
            (None, []) => {
                let need = self.inv.amount(&self.c.devices);
                return Ok(best_shared(self.inv, &self.usage, &need)
                    .into_iter()
                    .collect());
            }
            (None, many) => {
                return Err(MatchError::SpansGpus {
                    pod: self.pod.key.clone(),
                    resource: self.ask.resource,
                    gpus: self.uuids(many),
                });
            }
        };
        self.check_room(gpu)?;
        Ok(vec![gpu])
    }

    /// The GPU a share was pointed at before the kubelet's IDs: the
    /// extender's assignment, the scheduler's `gpu-uuid`, or the GPU its
    /// other resource is recorded on.
    fn shared_target(&self) -> Result<Option<usize>, MatchError> {
        let recorded = self.own.and_then(|g| g.gpus.first());
        Ok(
            match (self.assigned.as_deref(), &self.pod.gpu_uuid, recorded) {
                (Some([g, ..]), _, _) => Some(*g),
                (_, Some(u), _) => Some(self.known(u, "the scheduler")?),
                (_, None, Some(u)) => self.inv.index(u),
                _ => None,
            },
        )
    }

    /// A share fits only on a GPU nobody holds whole, within what is left.
    fn check_room(&self, gpu: usize) -> Result<(), MatchError> {
        if self.usage.gpus[gpu].held_whole() {
            return Err(self.held_whole(gpu));
        }
        let (r, amount) = (self.ask.resource, self.amount);
        let free = self.usage.free(self.inv, gpu, r);
        if amount > free {
            return Err(MatchError::Full {
                pod: self.pod.key.clone(),
                uuid: self.uuid(gpu),
                resource: r,
                free,
                capacity: self.inv.capacity(gpu)[r],
                amount,
            });
        }
        Ok(())
    }
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

/// What one live container is granted on one GPU, in real units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    pub pod: PodKey,
    pub container: String,
    /// The GPU's UUID.
    pub gpu: String,
    pub memory_mib: u64,
    /// Percent of the GPU's compute (100 for a whole GPU).
    pub core_percent: u64,
    /// Held whole (gpu-count), not a share.
    pub whole: bool,
}

/// Each live container's grant per GPU, from its ledger as far as its
/// spec vouches for it (any tenant can write on its own pods): an amount
/// is at most the container's ask, a GPU must be the node's, and a whole
/// GPU is all of its memory and compute.
pub fn granted(inv: &Inventory, views: &[PodView]) -> Vec<Granted> {
    let mut out = Vec::new();
    for v in views.iter().filter(|v| v.live) {
        for c in &v.containers {
            let Some(entry) = v.ledger.0.get(&c.name) else {
                continue;
            };
            let asked_mib = c
                .wants(Resource::GpuMemory)
                .saturating_mul(inv.memory_unit_mib);
            let asked_percent = c.wants(Resource::GpuCore).saturating_mul(100)
                / u64::from(inv.cores_per_gpu.max(1));
            for gpu in inv.gpus.iter().filter(|g| entry.gpus.contains(&g.uuid)) {
                let whole = c.whole() && entry.whole();
                let (memory_mib, core_percent) = if whole {
                    (gpu.memory_mib, 100)
                } else {
                    (
                        entry.memory.unwrap_or(0).min(asked_mib),
                        entry.core.unwrap_or(0).min(asked_percent),
                    )
                };
                out.push(Granted {
                    pod: v.key.clone(),
                    container: c.name.clone(),
                    gpu: gpu.uuid.clone(),
                    memory_mib,
                    core_percent,
                    whole,
                });
            }
        }
    }
    out
}
