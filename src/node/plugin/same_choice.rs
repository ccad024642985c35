//! The node and the extender pick the same GPUs for the same state: the
//! node's GetPreferredAllocation over the kubelet's device lists, and the
//! extender's fit over the equivalent inventory and usage, on random nodes
//! of mixed GPUs across two NUMA nodes, some used in part, some held whole,
//! some unhealthy.

use super::PairingBook;
use super::placement::Placement;
use super::preferred::hint;
use crate::node::matcher::Steer;
use crate::rules::device::model_tests::{config, gpu};
use crate::rules::device::{DeviceModel, DeviceRef, Gpu, Plan, Resource};
use crate::rules::usage::{
    Assignment, ContainerAsk, Holding, Inventory, NodeUsage, PodAsks, best_shared, fit,
};

/// One gpu-memory device is 256 MiB.
const UNIT_MIB: u64 = 256;

/// A node as both sides see it.
struct Node {
    plan: Plan,
    inv: Inventory,
    usage: NodeUsage,
    /// The kubelet's free devices of each resource, in ALL's order.
    available: [Vec<DeviceRef>; 3],
}

impl Node {
    /// `gpus`, of which `healthy`, holding `held`: per GPU, whole or the
    /// memory devices and core percent of its shared work.
    fn new(gpus: Vec<Gpu>, healthy: &[bool], held: &[GpuWork]) -> Node {
        let offer = config(&Resource::ALL, UNIT_MIB);
        let mut inv = Inventory::new(&gpus, &offer);
        let plan = Plan::new(offer, gpus).unwrap();
        let mut holdings = Vec::new();
        let mut available: [Vec<DeviceRef>; 3] = Default::default();
        for (g, info) in inv.gpus.iter_mut().enumerate() {
            info.healthy = healthy[g];
            let (mem, core, whole) = match held[g] {
                GpuWork::Nothing => (0, 0, false),
                GpuWork::Whole => (0, 0, true),
                GpuWork::Shared(mem, core) => (mem, core, false),
            };
            holdings.push(Holding {
                gpus: vec![info.uuid.clone()],
                amount: [mem * UNIT_MIB, core, u64::from(whole)].into(),
            });
            if !healthy[g] {
                continue;
            }
            // The kubelet lists what it has not allocated; a whole GPU's
            // memory and core devices stay listed.
            let units = |r| plan.model(r).unwrap().units(g);
            let free =
                |used: u64, r| (used as u32..units(r)).map(move |unit| DeviceRef { gpu: g, unit });
            available[0].extend(free(mem, Resource::GpuMemory));
            available[1].extend(free(core, Resource::GpuCore));
            available[2].extend(free(u64::from(whole), Resource::GpuCount));
        }
        let usage = NodeUsage::of(&inv, &holdings);
        Node {
            plan,
            inv,
            usage,
            available,
        }
    }

    fn model(&self, r: Resource) -> &DeviceModel {
        self.plan.model(r).unwrap()
    }

    fn available(&self, r: Resource) -> Vec<DeviceRef> {
        let i = Resource::ALL.iter().position(|&x| x == r).unwrap();
        self.available[i].clone()
    }

    /// The extender's GPUs for a pod of one container asking `devices`.
    fn extender(&self, devices: [u64; 3]) -> Option<Vec<usize>> {
        let c = ContainerAsk {
            name: "c".into(),
            init: false,
            restartable: false,
            devices: devices.into(),
            invalid: None,
        };
        let asks = PodAsks {
            containers: vec![c],
            ..PodAsks::default()
        };
        let a: Assignment = fit(&self.inv, &self.usage, &asks).ok()?;
        Some(sorted(a.0["c"].iter().map(|u| self.inv.index(u).unwrap())))
    }

    /// What the pod matcher answers GetPreferredAllocation for a pending
    /// pod without an assignment (its `prefer`): the GPU its decision
    /// takes (`best_shared` for a shared ask, none for a whole one), and
    /// off the GPUs the usage says to avoid.
    fn matcher_steer(&self, r: Resource, need: [u64; 3]) -> Steer {
        let need = self.inv.amount(&need.into());
        Steer {
            gpus: match r {
                Resource::GpuCount => Vec::new(),
                _ => best_shared(&self.inv, &self.usage, &need)
                    .into_iter()
                    .collect(),
            },
            avoid: self.usage.avoid(&self.inv, r),
        }
    }

    /// The node's hint with pod matching, for `size` devices of `r`.
    fn node(&self, r: Resource, size: u64, need: [u64; 3]) -> Vec<usize> {
        let steer = self.matcher_steer(r, need);
        let got = hint(self.model(r), self.available(r), &[], size as usize, &steer);
        assert_eq!(got.len() as u64, size, "{r}: {got:?}");
        sorted(got.iter().map(|d| d.gpu))
    }

    /// The node's whole-GPU hint without pod matching: the pairing book
    /// has seen the kubelet's memory and core lists, as it does once the
    /// node serves shared work.
    async fn node_by_ids(&self, k: u64) -> Vec<usize> {
        let placement = Placement::Ids(PairingBook::default());
        for r in [Resource::GpuMemory, Resource::GpuCore] {
            placement
                .steer(self.model(r), self.available(r), &[], 1)
                .await;
        }
        let r = Resource::GpuCount;
        let got = placement
            .steer(self.model(r), self.available(r), &[], k as usize)
            .await;
        sorted(got.iter().map(|d| d.gpu))
    }
}

#[derive(Debug, Clone, Copy)]
enum GpuWork {
    Nothing,
    Whole,
    /// Memory devices and core percent of shared work.
    Shared(u64, u64),
}

fn sorted(gpus: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut v: Vec<usize> = gpus.collect();
    v.sort_unstable();
    v.dedup();
    v
}

#[tokio::test]
async fn the_node_and_the_extender_pick_the_same_gpus() {
    let mut rng = fastrand::Rng::with_seed(0x5a3e);
    let (mut whole, mut shared) = (0, 0);
    for case in 0..400 {
        let n = rng.usize(4..=8);
        let gpus: Vec<Gpu> = (0..n)
            .map(|i| {
                let mib = [4096, 8192, 16384][rng.usize(..3)];
                gpu(i as u32, mib, Some(rng.u32(..2)))
            })
            .collect();
        let healthy: Vec<bool> = (0..n).map(|_| rng.u8(..100) >= 10).collect();
        let held: Vec<GpuWork> = gpus
            .iter()
            .map(|g| match rng.u8(..100) {
                0..20 => GpuWork::Whole,
                20..55 => {
                    GpuWork::Shared(1 + rng.u64(..g.memory_mib / UNIT_MIB), rng.u64(..=10) * 10)
                }
                _ => GpuWork::Nothing,
            })
            .collect();
        let node = Node::new(gpus, &healthy, &held);
        let ctx = || format!("case {case}: {held:?}, healthy {healthy:?}, {:?}", node.inv);

        let k = rng.u64(1..=3);
        if let Some(chosen) = node.extender([0, 0, k]) {
            let need = [0, 0, k];
            assert_eq!(node.node(Resource::GpuCount, k, need), chosen, "{}", ctx());
            assert_eq!(node.node_by_ids(k).await, chosen, "{}", ctx());
            whole += 1;
        }

        let need = [1 + rng.u64(..40), rng.u64(..=5) * 10, 0];
        if let Some(chosen) = node.extender(need) {
            assert_eq!(
                node.node(Resource::GpuMemory, need[0], need),
                chosen,
                "{}",
                ctx()
            );
            if need[1] > 0 {
                let core = node.node(Resource::GpuCore, need[1], need);
                assert_eq!(core, chosen, "{}", ctx());
            }
            shared += 1;
        }
    }
    // Both kinds of ask were placed often enough to mean something.
    assert!(
        whole > 150 && shared > 150,
        "{whole} whole, {shared} shared"
    );
}

#[tokio::test]
async fn whole_gpus_stay_on_one_numa_node_on_both_sides() {
    // GPUs 0 and 3 on NUMA node 0, 1 and 2 on node 1, all of one size:
    // two whole GPUs fit either node, and the lower-numbered one is taken
    // whole rather than GPUs 0 and 1 across both.
    let numa = [0, 1, 1, 0];
    let gpus = (0..4)
        .map(|i| gpu(i, 8192, Some(numa[i as usize])))
        .collect();
    let node = Node::new(gpus, &[true; 4], &[GpuWork::Nothing; 4]);
    assert_eq!(node.extender([0, 0, 2]), Some(vec![0, 3]));
    assert_eq!(node.node(Resource::GpuCount, 2, [0, 0, 2]), [0, 3]);
    assert_eq!(node.node_by_ids(2).await, [0, 3]);
}
