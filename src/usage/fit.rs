//! Where a pod fits on a node, and how well: the same answer for the
//! extender's filter and the node's GetPreferredAllocation.

use serde::Deserialize;

use super::{Assignment, ContainerAsk, Holding, Inventory, NodeUsage, PodAsks, pod_holdings};
use crate::device::{PerResource, Resource};
use crate::matcher::ledger::Ledger;

/// At most this many containers of one pod that ask GPUs.
pub(crate) const MAX_GPU_CONTAINERS: usize = 256;

/// Why a pod does not fit on a node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("container {container}: {reason}")]
pub(crate) struct FitError {
    pub(crate) container: String,
    pub(crate) reason: String,
    /// It would not fit even on this node empty with every GPU healthy:
    /// no amount of waiting helps.
    pub(crate) unresolvable: bool,
}

/// How to rank the nodes a pod fits on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Fill busy nodes first, keeping whole nodes free for big pods.
    #[default]
    Binpack,
    /// Spread pods over the emptiest nodes.
    Spread,
}

/// The healthy GPU with the least room left that still holds `need`
/// (memory and core, real units), away from whole-GPU work; among equals,
/// one of `preferred` first, then the lowest index.
pub(crate) fn best_shared(
    inv: &Inventory,
    usage: &NodeUsage,
    need: &PerResource<u64>,
    preferred: &[usize],
) -> Option<usize> {
    let left = |g: usize, r: Resource| usage.free(inv, g, r).saturating_sub(need[r]);
    (0..inv.gpus.len())
        .filter(|&g| holds(inv, usage, g, need))
        .min_by_key(|&g| {
            (
                !preferred.contains(&g),
                left(g, Resource::GpuMemory),
                left(g, Resource::GpuCore),
                g,
            )
        })
}

const SHARED: [Resource; 2] = [Resource::GpuMemory, Resource::GpuCore];

/// Whether GPU `g` is healthy, away from whole-GPU work, and has `need`
/// (memory and core, real units) free.
fn holds(inv: &Inventory, usage: &NodeUsage, g: usize, need: &PerResource<u64>) -> bool {
    inv.gpus[g].healthy
        && !usage.gpus[g].held_whole()
        && SHARED.iter().all(|&r| usage.free(inv, g, r) >= need[r])
}

/// The devices of a resource the kubelet keeps from a pod's init containers
/// and hands to the containers after them before taking fresh ones (its
/// `devicesToReuse`): how many are left, and the GPUs they are on. Sidecars
/// (restartable init containers) take from it like app containers and add
/// nothing.
#[derive(Debug, Clone, Default)]
struct HandedOn {
    devices: u64,
    gpus: Vec<usize>,
}

impl HandedOn {
    /// Init containers run one after another, each reusing what the ones
    /// before it left before taking fresh devices: what they hand on is
    /// the union of their devices.
    fn add(&mut self, devices: u64, gpus: &[usize]) {
        if self.devices == 0 {
            self.gpus.clear();
        }
        self.devices = self.devices.max(devices);
        for g in gpus {
            if !self.gpus.contains(g) {
                self.gpus.push(*g);
            }
        }
    }
}

/// GPUs for every container of the pod at once: each shared container on
/// one GPU with room for its memory and its core, each whole ask on GPUs
/// free of any work. Containers add up as they are placed (init containers
/// count while the pod lives), and a container goes beside the pod's others
/// when it fits there. The kubelet hands a container the devices of the
/// pod's init containers (for every resource of which they left some)
/// before fresh ones: a shared container handed some must go on their GPU,
/// and a whole ask takes the init containers' GPUs first (the pod holds
/// them once), fresh ones only for the rest. A sidecar (restartable init
/// container) takes from them the same way but keeps its devices for the
/// pod's life: it hands nothing on. At Allocate, IDs outside a container's
/// assigned GPUs and the GPUs still handed on by the pod's init containers
/// are refused.
pub(crate) fn fit(
    inv: &Inventory,
    usage: &NodeUsage,
    asks: &PodAsks,
) -> Result<Assignment, FitError> {
    place_all(inv, usage.clone(), asks).map_err(|mut e| {
        let mut ideal = inv.clone();
        ideal.gpus.iter_mut().for_each(|g| g.healthy = true);
        e.unresolvable = place_all(&ideal, NodeUsage::empty(&ideal), asks).is_err();
        e
    })
}

fn place_all(
    inv: &Inventory,
    mut usage: NodeUsage,
    asks: &PodAsks,
) -> Result<Assignment, FitError> {
    let mut out = Assignment::default();
    let mut pods_gpus: Vec<usize> = Vec::new();
    let mut handed: PerResource<HandedOn> = PerResource::default();
    for c in &asks.containers {
        let fail = |reason: String| FitError {
            container: c.name.clone(),
            reason,
            unresolvable: false,
        };
        if let Some(r) = Resource::ALL
            .into_iter()
            .find(|&r| c.wants(r) > 0 && !inv.offers(r))
        {
            return Err(fail(format!("asks {r}, which this node does not offer")));
        }
        let need = inv.amount(&c.devices);
        // The GPUs this container adds to the usage.
        let (gpus, counted) = if c.whole() {
            let h = &mut handed[Resource::GpuCount];
            let reused: Vec<usize> = h
                .gpus
                .iter()
                .take(c.devices.count as usize)
                .copied()
                .collect();
            let fresh = whole(inv, &usage, c, reused.len()).map_err(fail)?;
            let gpus: Vec<usize> = reused.iter().chain(&fresh).copied().collect();
            c.pass_on(&mut h.gpus, &gpus);
            h.devices = h.gpus.len() as u64;
            (gpus, fresh)
        } else if c.shared() {
            let reused: Vec<Resource> = SHARED
                .into_iter()
                .filter(|&r| c.wants(r) > 0 && handed[r].devices > 0)
                .collect();
            let from: Vec<&[usize]> = reused.iter().map(|&r| handed[r].gpus.as_slice()).collect();
            let g = match from.first() {
                None => best_shared(inv, &usage, &need, &pods_gpus)
                    .ok_or_else(|| fail(shortfall(inv, &usage, &need)))?,
                Some(&&[g]) if from.iter().all(|&f| f == [g]) => {
                    if !holds(inv, &usage, g, &need) {
                        return Err(fail(format!(
                            "the kubelet hands it devices of its init containers on {}, \
                             which has no room for it beside them",
                            inv.gpus[g].uuid
                        )));
                    }
                    g
                }
                _ => {
                    return Err(fail(
                        "the kubelet would hand it devices of its init containers on \
                         several GPUs"
                            .into(),
                    ));
                }
            };
            for r in SHARED.into_iter().filter(|&r| c.wants(r) > 0) {
                let h = &mut handed[r];
                // An app container or a sidecar keeps what it was handed.
                if c.hands_on() {
                    h.add(c.wants(r), &[g]);
                } else {
                    h.devices = h.devices.saturating_sub(c.wants(r));
                }
            }
            (vec![g], vec![g])
        } else {
            continue;
        };
        let uuid = |g: &usize| inv.gpus[*g].uuid.clone();
        usage.add(
            inv,
            &Holding {
                gpus: counted.iter().map(uuid).collect(),
                amount: need,
            },
        );
        pods_gpus.extend(&gpus);
        out.0
            .insert(c.name.clone(), gpus.iter().map(uuid).collect());
    }
    Ok(out)
}

/// The first healthy GPUs free of any work, as many as `c` asks beyond the
/// `reused` GPUs its init containers hand it (those are held already).
fn whole(
    inv: &Inventory,
    usage: &NodeUsage,
    c: &ContainerAsk,
    reused: usize,
) -> Result<Vec<usize>, String> {
    let free: Vec<usize> = (0..inv.gpus.len())
        .filter(|&g| {
            let u = &usage.gpus[g];
            inv.gpus[g].healthy && !u.held_whole() && !u.carries_shared()
        })
        .collect();
    let k = c.devices.count;
    let fresh = k as usize - reused;
    if free.len() < fresh {
        let handed = match reused {
            0 => String::new(),
            n => format!(", {n} of them handed on by its init containers"),
        };
        return Err(format!(
            "wants {k} whole GPUs{handed}; {} of {} are healthy and free of other work",
            free.len(),
            inv.gpus.len()
        ));
    }
    Ok(free[..fresh].to_vec())
}

/// Says what is missing for a shared ask no GPU holds.
fn shortfall(inv: &Inventory, usage: &NodeUsage, need: &PerResource<u64>) -> String {
    let open: Vec<usize> = (0..inv.gpus.len())
        .filter(|&g| inv.gpus[g].healthy && !usage.gpus[g].held_whole())
        .collect();
    if open.is_empty() {
        return if inv.gpus.iter().any(|g| g.healthy) {
            "every healthy GPU is held whole".into()
        } else {
            "no GPU is healthy".into()
        };
    }
    let largest = |r: Resource| {
        open.iter()
            .map(|&g| (usage.free(inv, g, r), &inv.gpus[g].uuid))
            .max_by_key(|&(free, _)| free)
            .expect("some GPU is open")
    };
    let (mem, mem_gpu) = largest(Resource::GpuMemory);
    let (core, core_gpu) = largest(Resource::GpuCore);
    if mem < need.memory {
        format!(
            "no GPU has {} MiB free (largest {mem} MiB on {mem_gpu})",
            need.memory
        )
    } else if core < need.core {
        format!(
            "no GPU has {} % of its compute free (largest {core} % on {core_gpu})",
            need.core
        )
    } else {
        format!(
            "no GPU has {} MiB and {} % of its compute free at once",
            need.memory, need.core
        )
    }
}

/// 0..=10: how much a node is worth to the pod under `policy`, from how
/// busy its healthy GPUs are once the pod is on them (a GPU held whole is
/// full; a shared one as full as its fuller resource).
pub(crate) fn score(
    inv: &Inventory,
    usage: &NodeUsage,
    asks: &PodAsks,
    assignment: &Assignment,
    policy: Policy,
) -> u8 {
    let mut after = usage.clone();
    for h in pod_holdings(inv, &asks.containers, &Ledger::default(), assignment) {
        after.add(inv, &h);
    }
    let permille: Vec<u64> = (0..inv.gpus.len())
        .filter(|&g| inv.gpus[g].healthy)
        .map(|g| {
            let u = &after.gpus[g];
            if u.held_whole() {
                return 1000;
            }
            let cap = inv.capacity(g);
            [Resource::GpuMemory, Resource::GpuCore]
                .into_iter()
                .map(|r| (u.used[r] * 1000).checked_div(cap[r]).unwrap_or(1000))
                .max()
                .unwrap_or(0)
                .min(1000)
        })
        .collect();
    if permille.is_empty() {
        return 0;
    }
    let busy = (permille.iter().sum::<u64>() / permille.len() as u64 * 10 + 500) / 1000;
    let busy = busy as u8;
    match policy {
        Policy::Binpack => busy,
        Policy::Spread => 10 - busy,
    }
}
