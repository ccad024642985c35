//! What the pods hold on a node's GPUs, added up per GPU.

use k8s_openapi::api::core::v1::Pod;

use super::{Assignment, ContainerAsk, Inventory, Ledger};
use crate::rules::device::{PerResource, Resource};

/// What one container holds: its GPUs and the amounts, in real units
/// (MiB, percent, GPUs). A holding with GPUs counted holds them whole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Holding {
    pub(crate) gpus: Vec<String>,
    pub(crate) amount: PerResource<u64>,
}

impl Holding {
    fn whole(&self) -> bool {
        self.amount.count > 0
    }

    fn holds(&self) -> bool {
        Resource::ALL.iter().any(|&r| self.amount[r] > 0)
    }
}

/// Succeeded or Failed: the kubelet released its devices, so the pod holds
/// nothing, whatever its ledger says, and is no candidate for matching.
pub(crate) fn finished(pod: &Pod) -> bool {
    matches!(phase(pod), Some("Succeeded" | "Failed"))
}

/// Whether `pod` has not started: no phase yet, or `Pending`. The kubelet
/// may be admitting it.
pub(crate) fn pending(pod: &Pod) -> bool {
    matches!(phase(pod), None | Some("Pending"))
}

fn phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref().and_then(|s| s.phase.as_deref())
}

/// What a live pod holds, counted only as far as its spec vouches for its
/// annotations (which any tenant can write on their own pods): a grant or
/// an assignment counts only for a container the spec has, only for a
/// resource that container asks, and always as exactly its ask (its limit
/// in devices), never the amount the annotation claims; entries for other
/// containers or resources count nothing.
///
/// Each resource of each container counts by its ledger entry when the
/// kubelet served it, else, when the container has an assignment, by its
/// ask on the assigned GPUs (bound, not yet admitted, or in the middle of
/// admission: the kubelet serves a container's resources one at a time, and
/// a half-served container still holds the rest). Never both for one
/// resource, so nothing counts twice; and a GPU the kubelet handed whole
/// from an init container to the containers after it counts once, with the
/// first container that holds it. Only a GPU still handed on counts once: a
/// sidecar (restartable init container) or an app container that holds a
/// GPU keeps it, so a later container naming it too holds it again.
///
/// Failing closed: where the record cannot say where an ask is held, it is
/// counted as held on every GPU of the node it could be on (shared asks as
/// a share of each, whole asks as each GPU whole). That is the case for an
/// unreadable ledger ([`super::annotations::ledger::Unread`]: every asked
/// resource, on the container's assigned GPUs when those are readable and
/// known, else anywhere), an unreadable assignment (the resources not in the
/// ledger), and an entry naming GPUs this node lacks, repeating one, or
/// naming too few or too many for the ask. So a garbled record never frees
/// room, and costs at most the pod's own asks on each GPU: nothing for a
/// pod that asks no GPU resource.
pub(crate) fn pod_holdings(
    inv: &Inventory,
    containers: &[ContainerAsk],
    ledger: &Ledger,
    assignment: &Assignment,
) -> Vec<Holding> {
    let mut holdings: Vec<Holding> = Vec::new();
    // The GPUs the kubelet holds whole for the pod's init containers to
    // hand on: counted already.
    let mut handed: Vec<String> = Vec::new();
    for c in containers {
        for mut h in container_holdings(inv, c, ledger, assignment) {
            if !h.whole() {
                holdings.push(h);
                continue;
            }
            let gpus = std::mem::take(&mut h.gpus);
            h.gpus = gpus
                .iter()
                .filter(|g| !handed.contains(g))
                .cloned()
                .collect();
            c.pass_on(&mut handed, &gpus);
            if !h.gpus.is_empty() {
                holdings.push(h);
            }
        }
    }
    holdings
}

/// What container `c` holds: its served resources on its ledger's GPUs,
/// the rest of its ask on its assigned ones, each where the record vouches
/// for it, else anywhere (see [`pod_holdings`]).
fn container_holdings(
    inv: &Inventory,
    c: &ContainerAsk,
    ledger: &Ledger,
    assignment: &Assignment,
) -> Vec<Holding> {
    let ask = inv.amount(&c.devices);
    let anywhere = || every_gpu(inv);
    let unread = ledger.1;
    // Where the assignment puts the container.
    // How many GPUs a record of it names: its whole GPUs, else one.
    let n = if c.whole() {
        c.wants(Resource::GpuCount)
    } else {
        1
    };
    let assigned: Option<Vec<String>> = if unread.assignment {
        Some(anywhere())
    } else {
        assignment.0.get(&c.name).map(|gpus| vouched(inv, gpus, n))
    };
    // The share of a container asking whole GPUs rides inside them
    // (`ContainerAsk::rides_whole`): it holds its GPUs whole and nothing
    // beside, so only its count is held.
    let asked = |r: Resource| c.wants(r) > 0 && (r == Resource::GpuCount || !c.whole());
    let holding = |gpus: Vec<String>, counts: &dyn Fn(Resource) -> bool| Holding {
        gpus,
        amount: PerResource::from_fn(|r| if counts(r) { ask[r] } else { 0 }),
    };
    if unread.ledger {
        // Served or not, every asked resource may be held: where the
        // assignment says, else (served by the daemon alone, or assigned
        // unreadably) anywhere.
        let h = holding(assigned.unwrap_or_else(anywhere), &asked);
        return vec![h].into_iter().filter(Holding::holds).collect();
    }
    let grant = ledger.0.get(&c.name);
    let recorded = |r: Resource| c.wants(r) > 0 && grant.is_some_and(|g| g.amount(r).is_some());
    let any_recorded = Resource::ALL.iter().any(|&r| recorded(r));
    // Whole GPUs are held from the first of the container's resources the
    // kubelet served, whichever came first.
    let served = |r: Resource| asked(r) && (recorded(r) || (c.whole() && any_recorded));
    let served_on = grant
        .filter(|_| any_recorded)
        .map(|g| vouched(inv, &g.gpus, n));
    let rest = assigned
        .map(|gpus| holding(gpus, &|r| asked(r) && !served(r)))
        .filter(Holding::holds);
    match (served_on.map(|gpus| holding(gpus, &served)), rest) {
        (Some(mut s), Some(r)) if s.gpus == r.gpus => {
            s.amount = PerResource::from_fn(|res| s.amount[res].saturating_add(r.amount[res]));
            vec![s]
        }
        (s, r) => s.into_iter().chain(r).collect(),
    }
}

/// `gpus`, when they are exactly `n` distinct GPUs of this node; else
/// (a record the spec does not vouch for) every GPU of the node.
fn vouched(inv: &Inventory, gpus: &[String], n: u64) -> Vec<String> {
    let distinct = gpus.iter().enumerate().all(|(i, g)| !gpus[..i].contains(g));
    let known = gpus.iter().all(|g| inv.index(g).is_some());
    if gpus.len() as u64 == n && distinct && known {
        gpus.to_vec()
    } else {
        every_gpu(inv)
    }
}

fn every_gpu(inv: &Inventory) -> Vec<String> {
    inv.gpus.iter().map(|g| g.uuid.clone()).collect()
}

/// One GPU's usage.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuUsage {
    /// MiB and percent used by shared holdings; GPUs: how many hold it whole.
    pub used: PerResource<u64>,
    /// How many shared holdings are on it.
    pub(crate) sharers: u64,
}

impl GpuUsage {
    pub fn held_whole(&self) -> bool {
        self.used.count > 0
    }

    pub(crate) fn carries_shared(&self) -> bool {
        self.sharers > 0
    }

    /// Carries no work, whole or shared.
    pub(crate) fn idle(&self) -> bool {
        !self.held_whole() && !self.carries_shared()
    }
}

/// Per GPU of an [`Inventory`], in its order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeUsage {
    pub gpus: Vec<GpuUsage>,
}

impl NodeUsage {
    pub(crate) fn empty(inv: &Inventory) -> NodeUsage {
        NodeUsage {
            gpus: vec![GpuUsage::default(); inv.gpus.len()],
        }
    }

    pub(crate) fn of<'a>(
        inv: &Inventory,
        holdings: impl IntoIterator<Item = &'a Holding>,
    ) -> NodeUsage {
        let mut u = NodeUsage::empty(inv);
        for h in holdings {
            u.add(inv, h);
        }
        u
    }

    /// Counts `h`; GPUs this node does not have are ignored. A total past
    /// `u64` (only hostile ledgers add up so far) saturates: the GPU is
    /// full, never wrapped to empty.
    pub(crate) fn add(&mut self, inv: &Inventory, h: &Holding) {
        self.apply(inv, h, |total, n| *total = total.saturating_add(n));
    }

    /// This usage without `h` (which it counted).
    pub(crate) fn without(&self, inv: &Inventory, h: &Holding) -> NodeUsage {
        let mut u = self.clone();
        u.apply(inv, h, |total, n| *total = total.saturating_sub(n));
        u
    }

    fn apply(&mut self, inv: &Inventory, h: &Holding, op: impl Fn(&mut u64, u64)) {
        for g in h.gpus.iter().filter_map(|u| inv.index(u)) {
            let gpu = &mut self.gpus[g];
            if h.whole() {
                op(&mut gpu.used.count, 1);
            } else if h.amount.memory > 0 || h.amount.core > 0 {
                op(&mut gpu.sharers, 1);
                op(&mut gpu.used.memory, h.amount.memory);
                op(&mut gpu.used.core, h.amount.core);
            }
        }
    }

    /// What is left of `r` on GPU `g`, in real units.
    pub(crate) fn free(&self, inv: &Inventory, g: usize, r: Resource) -> u64 {
        inv.capacity(g)[r].saturating_sub(self.gpus[g].used[r])
    }

    /// Per GPU: whether new work of `r` must stay off it (whole and shared
    /// work do not mix; unhealthy GPUs take none).
    pub fn avoid(&self, inv: &Inventory, r: Resource) -> Vec<bool> {
        self.gpus
            .iter()
            .zip(&inv.gpus)
            .map(|(u, info)| {
                !info.healthy
                    || if r == Resource::GpuCount {
                        u.carries_shared()
                    } else {
                        u.held_whole()
                    }
            })
            .collect()
    }
}
