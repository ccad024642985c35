//! The kubelet's free devices of one resource, per GPU: what the node's
//! choices (`plugin::preferred`, the pairing book) read from a device list.
//! The choosing itself is the usage model's.

use super::DeviceRef;

/// How many of `available` are on each of `gpus` GPUs.
pub(crate) fn per_gpu(available: &[DeviceRef], gpus: usize) -> Vec<u32> {
    let mut free = vec![0u32; gpus];
    for d in available {
        if let Some(f) = free.get_mut(d.gpu) {
            *f += 1;
        }
    }
    free
}

/// Free units of each GPU (indexed by GPU position), in ascending order.
/// The kubelet lists IDs in string order, not unit order, so the units go
/// through a bitset: linear, where a sort of 160,000 units was not.
pub(crate) fn units_per_gpu(available: &[DeviceRef]) -> Vec<Vec<u32>> {
    let gpus = available.iter().map(|d| d.gpu + 1).max().unwrap_or(0);
    let mut bits: Vec<Vec<u64>> = vec![Vec::new(); gpus];
    for d in available {
        let word = d.unit as usize / 64;
        let b = &mut bits[d.gpu];
        if b.len() <= word {
            b.resize(word + 1, 0);
        }
        b[word] |= 1 << (d.unit % 64);
    }
    bits.iter()
        .zip(per_gpu(available, gpus))
        .map(|(words, count)| {
            let mut units = Vec::with_capacity(count as usize);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_come_out_ascending_per_gpu_whatever_the_list_order() {
        let d = |gpu, unit| DeviceRef { gpu, unit };
        let available = [d(1, 130), d(0, 3), d(1, 2), d(1, 64), d(0, 1)];
        assert_eq!(units_per_gpu(&available), [vec![1, 3], vec![2, 64, 130]]);
        assert_eq!(per_gpu(&available, 3), [2, 3, 0]);
    }
}
