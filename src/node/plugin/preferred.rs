//! GetPreferredAllocation's answer in device IDs: where the devices should
//! come from (a [`Steer`], from the pod matcher or the pairing book), and
//! the usage model's one choice ([`choose`]) over the kubelet's free
//! devices. A shared resource's devices all come from one GPU (a container
//! gets one shared GPU): the steered one if it has room, else by
//! [`Order::BestFit`], else, when no GPU has room, the roomiest
//! ([`Order::Roomiest`]). gpu-count's whole GPUs go by
//! [`Order::NumaWhole`], as the extender's fit chooses them. The kubelet
//! treats the answer as a hint.

use crate::node::matcher::Steer;
use crate::rules::device::{DeviceModel, DeviceRef, Resource, free};
use crate::rules::usage::{Candidate, Order, choose};

/// `size` devices of `model`'s resource out of `available`, with `must`,
/// on the GPU `steer` names when it has room and off those it avoids.
pub(crate) fn hint(
    model: &DeviceModel,
    mut available: Vec<DeviceRef>,
    must: &[DeviceRef],
    size: usize,
    steer: &Steer,
) -> Vec<DeviceRef> {
    available.retain(|d| !steer.avoid.get(d.gpu).copied().unwrap_or(false));
    match model.resource() {
        Resource::GpuCount => whole(model, &available, must, size),
        _ => shared(model, &available, must, size, steer.gpus.first().copied()),
    }
}

/// `size` units from one GPU, `must` included. `prefer`, when given, is the
/// GPU to use if it has room (the one this container gets).
pub fn shared(
    model: &DeviceModel,
    available: &[DeviceRef],
    must: &[DeviceRef],
    size: usize,
    prefer: Option<usize>,
) -> Vec<DeviceRef> {
    let free = free::units_per_gpu(available);
    let target = must.first().map(|d| d.gpu).or_else(|| {
        let (fits, short): (Vec<Candidate>, Vec<Candidate>) = free
            .iter()
            .enumerate()
            .filter(|(_, units)| !units.is_empty())
            .map(|(gpu, units)| Candidate {
                gpu,
                left: [units.len() as u64, 0],
                all: [u64::from(model.units(gpu)), 0],
                ..Candidate::default()
            })
            .partition(|c| c.left[0] >= size as u64);
        let fits = fits
            .into_iter()
            .map(|c| Candidate {
                left: [c.left[0] - size as u64, 0],
                preferred: prefer == Some(c.gpu),
                ..c
            })
            .collect();
        let first = |candidates, order| choose(candidates, 1, order).first().copied();
        first(fits, Order::BestFit).or_else(|| first(short, Order::Roomiest))
    });
    let mut out = must.to_vec();
    if let Some((gpu, units)) = target.and_then(|g| free.get(g).map(|u| (g, u))) {
        out.extend(
            units
                .iter()
                .map(|&unit| DeviceRef { gpu, unit })
                .filter(|d| !must.contains(d))
                .take(size.saturating_sub(must.len())),
        );
    }
    out
}

/// `size` whole GPUs, `must` included, by [`Order::NumaWhole`] over the
/// GPUs' memory.
fn whole(
    model: &DeviceModel,
    available: &[DeviceRef],
    must: &[DeviceRef],
    size: usize,
) -> Vec<DeviceRef> {
    let candidate = |d: &DeviceRef, preferred: bool| {
        let gpu = &model.gpus()[d.gpu];
        Candidate {
            gpu: d.gpu,
            left: [gpu.memory_mib, 0],
            numa: gpu.numa_node,
            preferred,
            ..Candidate::default()
        }
    };
    let fresh = available.iter().filter(|d| !must.contains(d));
    let candidates = must
        .iter()
        .map(|d| candidate(d, true))
        .chain(fresh.clone().map(|d| candidate(d, false)))
        .collect();
    let mut out = must.to_vec();
    for gpu in choose(candidates, size, Order::NumaWhole) {
        out.extend(fresh.clone().find(|d| d.gpu == gpu));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::device::Plan;
    use crate::rules::device::model_tests::{config, gpu};

    /// GPUs of `mib` each (1 MiB per memory device), on the NUMA nodes given.
    fn plan(gpus: &[(u64, Option<u32>)]) -> Plan {
        let gpus = gpus
            .iter()
            .enumerate()
            .map(|(i, &(mib, numa))| gpu(i as u32, mib, numa))
            .collect();
        Plan::new(config(&Resource::ALL, 1), gpus).unwrap()
    }

    fn refs(gpu: usize, units: std::ops::Range<u32>) -> Vec<DeviceRef> {
        units.map(|unit| DeviceRef { gpu, unit }).collect()
    }

    fn gpus_of(v: &[DeviceRef]) -> Vec<usize> {
        let mut g: Vec<usize> = v.iter().map(|d| d.gpu).collect();
        g.dedup();
        g
    }

    #[test]
    fn shared_takes_the_tightest_gpu_that_fits() {
        let p = plan(&[(100, None); 3]);
        let m = p.model(Resource::GpuMemory).unwrap();
        let mut avail = refs(0, 0..100);
        avail.extend(refs(1, 0..30));
        avail.extend(refs(2, 0..60));
        let got = shared(m, &avail, &[], 25, None);
        assert_eq!(got.len(), 25);
        assert_eq!(gpus_of(&got), vec![1]);
        let got = shared(m, &avail, &[], 50, None);
        assert_eq!(gpus_of(&got), vec![2]);
        let got = shared(m, &avail, &[], 100, None);
        assert_eq!(gpus_of(&got), vec![0]);
    }

    #[test]
    fn shared_with_no_fit_hints_the_roomiest_gpu() {
        let p = plan(&[(100, None); 2]);
        let m = p.model(Resource::GpuMemory).unwrap();
        let mut avail = refs(0, 0..10);
        avail.extend(refs(1, 0..40));
        let got = shared(m, &avail, &[], 50, None);
        assert_eq!(got.len(), 40);
        assert_eq!(gpus_of(&got), vec![1]);
    }

    #[test]
    fn shared_honours_must_include_and_preference() {
        let p = plan(&[(100, None); 2]);
        let m = p.model(Resource::GpuMemory).unwrap();
        let mut avail = refs(0, 0..100);
        avail.extend(refs(1, 0..30));
        let must = vec![DeviceRef { gpu: 0, unit: 7 }];
        let got = shared(m, &avail, &must, 5, None);
        assert_eq!(got.len(), 5);
        assert!(got.contains(&must[0]));
        assert_eq!(gpus_of(&got), vec![0]);
        let got = shared(m, &avail, &[], 10, Some(0));
        assert_eq!(gpus_of(&got), vec![0]);
        // A preferred GPU without room is ignored.
        let got = shared(m, &avail, &[], 40, Some(1));
        assert_eq!(gpus_of(&got), vec![0]);
    }

    #[test]
    fn shared_never_repeats_a_device() {
        let p = plan(&[(100, None)]);
        let m = p.model(Resource::GpuMemory).unwrap();
        let avail = refs(0, 0..10);
        let must = refs(0, 0..3);
        let mut got = shared(m, &avail, &must, 6, None);
        got.sort();
        got.dedup();
        assert_eq!(got.len(), 6);
    }

    #[test]
    fn whole_packs_onto_one_numa_node_and_follows_the_steer() {
        let node = |g: usize| (100, Some(if g < 4 { 0 } else { 1 }));
        let p = plan(&(0..7).map(node).collect::<Vec<_>>());
        let m = p.model(Resource::GpuCount).unwrap();
        let avail: Vec<DeviceRef> = [0, 1, 4, 5, 6]
            .iter()
            .map(|&gpu| DeviceRef { gpu, unit: 0 })
            .collect();
        let hinted = |must: &[DeviceRef], size, avoid: Vec<bool>| {
            let steer = Steer {
                gpus: Vec::new(),
                avoid,
            };
            gpus_of(&hint(m, avail.clone(), must, size, &steer))
        };
        // Two GPUs fit node 0 exactly: take them, keep node 1's three together.
        assert_eq!(hinted(&[], 2, vec![]), vec![0, 1]);
        assert_eq!(hinted(&[], 3, vec![]), vec![4, 5, 6]);
        // Must-include on node 1 keeps the rest there.
        assert_eq!(
            hinted(&[DeviceRef { gpu: 6, unit: 0 }], 2, vec![]),
            vec![6, 4]
        );
        // More than a node holds spills over.
        assert_eq!(hinted(&[], 5, vec![]).len(), 5);
        // GPUs the steer avoids are not hinted.
        let off_node_0 = (0..7).map(|g| g < 4).collect();
        assert_eq!(hinted(&[], 2, off_node_0), vec![4, 5]);
    }
}
