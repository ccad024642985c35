//! GetPreferredAllocation's choice: which of the free devices to hint.
//!
//! gpu-memory and gpu-core: all from one GPU (a container gets one shared
//! GPU), best fit, so the GPU with the largest hole stays free for the
//! largest request. gpu-count: whole GPUs on as few NUMA nodes as possible,
//! again best fit. The kubelet treats the answer as a hint.

use std::collections::BTreeMap;

use super::DeviceRef;

/// Free units of each GPU (indexed by GPU position), in ascending order.
/// The kubelet lists IDs in string order, not unit order, so the units go
/// through a bitset: linear, where a sort of 160,000 units was not.
fn by_gpu(available: &[DeviceRef]) -> Vec<Vec<u32>> {
    let gpus = available.iter().map(|d| d.gpu + 1).max().unwrap_or(0);
    let mut bits: Vec<Vec<u64>> = vec![Vec::new(); gpus];
    let mut counts = vec![0usize; gpus];
    for d in available {
        let word = d.unit as usize / 64;
        let b = &mut bits[d.gpu];
        if b.len() <= word {
            b.resize(word + 1, 0);
        }
        b[word] |= 1 << (d.unit % 64);
        counts[d.gpu] += 1;
    }
    bits.iter()
        .zip(counts)
        .map(|(words, count)| {
            let mut units = Vec::with_capacity(count);
            for (w, &word) in words.iter().enumerate() {
                let mut rest = word;
                while rest != 0 {
                    units.push((w * 64) as u32 + rest.trailing_zeros());
                    rest &= rest - 1;
                }
            }
            units
        })
        .collect()
}

/// `size` units from one GPU, `must` included. `prefer`, when given, is the
/// GPU to use if it has room (the one this container already holds).
pub fn shared(
    available: &[DeviceRef],
    must: &[DeviceRef],
    size: usize,
    prefer: Option<usize>,
) -> Vec<DeviceRef> {
    let free = by_gpu(available);
    let fits = |gpu: &usize| free.get(*gpu).is_some_and(|u| u.len() >= size);
    let target = match must.first() {
        Some(d) => Some(d.gpu),
        None => prefer.filter(fits).or_else(|| {
            let with_free = || free.iter().enumerate().filter(|(_, u)| !u.is_empty());
            let best_fit = with_free()
                .filter(|(_, u)| u.len() >= size)
                .min_by_key(|(gpu, u)| (u.len(), *gpu));
            let roomiest = || with_free().max_by_key(|(gpu, u)| (u.len(), std::cmp::Reverse(*gpu)));
            best_fit.or_else(roomiest).map(|(gpu, _)| gpu)
        }),
    };
    let mut out = must.to_vec();
    if let Some(units) = target.and_then(|g| free.get(g).map(|u| (g, u))) {
        let (gpu, units) = units;
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

/// `size` whole GPUs, `must` included, packed onto the fewest NUMA nodes.
/// `numa(gpu)` is the GPU's node (`None` counts as one node of its own kind).
pub(crate) fn whole(
    available: &[DeviceRef],
    must: &[DeviceRef],
    size: usize,
    numa: impl Fn(usize) -> Option<u32>,
) -> Vec<DeviceRef> {
    let mut out = must.to_vec();
    let mut groups: BTreeMap<Option<u32>, Vec<DeviceRef>> = BTreeMap::new();
    for d in available.iter().filter(|d| !must.contains(d)) {
        groups.entry(numa(d.gpu)).or_default().push(*d);
    }
    for g in groups.values_mut() {
        g.sort_unstable();
    }
    while out.len() < size && !groups.is_empty() {
        let need = size - out.len();
        // Stay on a node already used, else the smallest node that fits
        // the rest, else the largest node.
        let used: Vec<Option<u32>> = out.iter().map(|d| numa(d.gpu)).collect();
        let key = groups
            .iter()
            .filter(|(k, _)| used.contains(k))
            .map(|(k, _)| *k)
            .next()
            .or_else(|| {
                groups
                    .iter()
                    .filter(|(_, g)| g.len() >= need)
                    .min_by_key(|(_, g)| g.len())
                    .map(|(k, _)| *k)
            })
            .or_else(|| groups.iter().max_by_key(|(_, g)| g.len()).map(|(k, _)| *k))
            .expect("groups is not empty");
        let group = groups.remove(&key).expect("key came from groups");
        out.extend(group.into_iter().take(need));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut avail = refs(0, 0..100);
        avail.extend(refs(1, 0..30));
        avail.extend(refs(2, 0..60));
        let got = shared(&avail, &[], 25, None);
        assert_eq!(got.len(), 25);
        assert_eq!(gpus_of(&got), vec![1]);
        let got = shared(&avail, &[], 50, None);
        assert_eq!(gpus_of(&got), vec![2]);
        let got = shared(&avail, &[], 100, None);
        assert_eq!(gpus_of(&got), vec![0]);
    }

    #[test]
    fn shared_with_no_fit_hints_the_roomiest_gpu() {
        let mut avail = refs(0, 0..10);
        avail.extend(refs(1, 0..40));
        let got = shared(&avail, &[], 50, None);
        assert_eq!(got.len(), 40);
        assert_eq!(gpus_of(&got), vec![1]);
    }

    #[test]
    fn shared_honours_must_include_and_preference() {
        let mut avail = refs(0, 0..100);
        avail.extend(refs(1, 0..30));
        let must = vec![DeviceRef { gpu: 0, unit: 7 }];
        let got = shared(&avail, &must, 5, None);
        assert_eq!(got.len(), 5);
        assert!(got.contains(&must[0]));
        assert_eq!(gpus_of(&got), vec![0]);
        let got = shared(&avail, &[], 10, Some(0));
        assert_eq!(gpus_of(&got), vec![0]);
        // A preferred GPU without room is ignored.
        let got = shared(&avail, &[], 40, Some(1));
        assert_eq!(gpus_of(&got), vec![0]);
    }

    #[test]
    fn shared_never_repeats_a_device() {
        let avail = refs(0, 0..10);
        let must = refs(0, 0..3);
        let mut got = shared(&avail, &must, 6, None);
        got.sort();
        got.dedup();
        assert_eq!(got.len(), 6);
    }

    #[test]
    fn whole_packs_onto_one_numa_node() {
        let numa = |g: usize| Some(if g < 4 { 0 } else { 1 });
        let avail: Vec<DeviceRef> = [0, 1, 4, 5, 6]
            .iter()
            .map(|&gpu| DeviceRef { gpu, unit: 0 })
            .collect();
        // Two GPUs fit node 0 exactly: take them, keep node 1's three together.
        let got = whole(&avail, &[], 2, numa);
        assert_eq!(gpus_of(&got), vec![0, 1]);
        let got = whole(&avail, &[], 3, numa);
        assert_eq!(gpus_of(&got), vec![4, 5, 6]);
        // Must-include on node 1 keeps the rest there.
        let got = whole(&avail, &[DeviceRef { gpu: 6, unit: 0 }], 2, numa);
        assert_eq!(gpus_of(&got), vec![6, 4]);
        // More than a node holds spills over.
        let got = whole(&avail, &[], 5, numa);
        assert_eq!(got.len(), 5);
    }
}
