//! What the pods hold on a node's GPUs, added up per GPU.

use super::{Assignment, ContainerAsk, Inventory};
use crate::device::{PerResource, Resource};
use crate::matcher::ledger::{Grant, Ledger};

/// What one container holds: its GPUs and the amounts, in real units
/// (MiB, percent, GPUs). A holding with GPUs counted holds them whole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Holding {
    pub(crate) gpus: Vec<String>,
    pub(crate) amount: PerResource<u64>,
}

impl Holding {
    pub(crate) fn from_grant(g: &Grant) -> Holding {
        Holding {
            gpus: g.gpus.clone(),
            amount: PerResource::from_fn(|r| g.amount(r).unwrap_or(0)),
        }
    }

    fn whole(&self) -> bool {
        self.amount.count > 0
    }

    fn holds(&self) -> bool {
        Resource::ALL.iter().any(|&r| self.amount[r] > 0)
    }
}

/// What a live pod holds: each resource of each container by its ledger
/// entry when the kubelet served it, else, when the container has an
/// assignment, by its ask on the assigned GPUs (bound, not yet admitted, or
/// in the middle of admission: the kubelet serves a container's resources
/// one at a time, and a half-served container still holds the rest). Never
/// both for one resource, so nothing counts twice; and a GPU the kubelet
/// handed whole from an init container to the containers after it counts
/// once, with the first container that holds it. Only a GPU still handed
/// on counts once: a sidecar (restartable init container) or an app
/// container that holds a GPU keeps it, so a later container naming it too
/// holds it again.
pub(crate) fn pod_holdings(
    inv: &Inventory,
    containers: &[ContainerAsk],
    ledger: &Ledger,
    assignment: &Assignment,
) -> Vec<Holding> {
    let mut holdings: Vec<Holding> = Vec::new();
    for (name, grant) in &ledger.0 {
        if !containers.iter().any(|c| c.name == *name) {
            holdings.push(Holding::from_grant(grant));
        }
    }
    // The GPUs the kubelet holds whole for the pod's init containers to
    // hand on: counted already.
    let mut handed: Vec<String> = Vec::new();
    for c in containers {
        let grant = ledger.0.get(&c.name);
        let served = grant.map(Holding::from_grant);
        let ask = inv.amount(&c.devices);
        let rest = assignment.0.get(&c.name).map(|gpus| Holding {
            gpus: gpus.clone(),
            amount: PerResource::from_fn(|r| match grant.and_then(|g| g.amount(r)) {
                Some(_) => 0,
                None => ask[r],
            }),
        });
        let own: Vec<Holding> = match (served, rest) {
            (Some(mut s), Some(r)) if s.gpus == r.gpus => {
                s.amount = PerResource::from_fn(|res| s.amount[res].saturating_add(r.amount[res]));
                vec![s]
            }
            (s, r) => s.into_iter().chain(r.filter(Holding::holds)).collect(),
        };
        for mut h in own {
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
