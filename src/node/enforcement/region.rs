//! HAMi-core's usage region: the file each container's processes map and
//! write their device memory use into (`CUDA_DEVICE_MEMORY_SHARED_CACHE`).
//!
//! The layout is HAMi-core's `shared_region_t`
//! (src/multiprocess/multiprocess_memory_limit.h), read here field by field
//! at fixed offsets of the x86_64/aarch64 Linux ABI (sem_t is 32 bytes,
//! size_t 8). Pinned to region versions 1.1 (HAMi-core ec8979d, shipped by
//! HAMi v2.8.0) and 1.2 (HAMi-core 5091a2f, shipped by HAMi v2.9.0 and
//! built by deploy/Dockerfile): 1.2 made fields atomic, turned an unused
//! word of each process slot into a seqlock and the region's unused tail
//! into a semaphore, so every offset read here is the same in both. Any
//! other version, a wrong magic, a short buffer or counts out of range are
//! refused with an error; nothing here can panic on the bytes.

use std::io::Read;
use std::path::Path;

/// `MULTIPROCESS_SHARED_REGION_MAGIC_FLAG`: `initialized_flag` once set up.
pub(crate) const MAGIC: i32 = 19_920_718;
/// The (major, minor) versions whose layout this reader knows.
pub(crate) const SUPPORTED: [(u32, u32); 2] = [(1, 1), (1, 2)];

const MAX_DEVICES: usize = 16; // CUDA_DEVICE_MAX_COUNT
const MAX_PROCS: usize = 1024; // SHARED_REGION_MAX_PROCESS_NUM
const UUID_LEN: usize = 96;

// shared_region_t: i32 initialized_flag @0, u32 major @4, u32 minor @8,
// i32 sm_init_flag @12, size_t owner_pid @16, sem_t sem @24 (32 bytes),
// u64 device_num @56, char uuids[16][96] @64, u64 limit[16] @1600,
// u64 sm_limit[16] @1728, shrreg_proc_slot_t procs[1024] @1856,
// int proc_num @2008896, then utilization_switch, recent_kernel, priority,
// u64 last_kernel_time @2008912 and 32 bytes (unused[4] in 1.1,
// sem_postinit in 1.2): 2008952 bytes.
const OFF_MAJOR: usize = 4;
const OFF_MINOR: usize = 8;
const OFF_DEVICE_NUM: usize = 56;
const OFF_UUIDS: usize = 64;
const OFF_LIMIT: usize = OFF_UUIDS + MAX_DEVICES * UUID_LEN;
const OFF_PROCS: usize = OFF_LIMIT + 2 * MAX_DEVICES * 8;
const OFF_PROC_NUM: usize = OFF_PROCS + MAX_PROCS * SLOT_LEN;
/// sizeof(shared_region_t); HAMi-core's file is one byte longer.
pub(crate) const REGION_LEN: usize = OFF_PROC_NUM + 16 + 8 + 32;

// shrreg_proc_slot_t: i32 pid @0, i32 hostpid @4, device_memory_t used[16]
// @8 (64 bytes each: context, module, data, offset, total, unused[3]),
// u64 monitorused[16] @1032, device_util_t device_util[16] @1160 (48 bytes
// each), i32 status @1928, then 8 + 16 (1.2) or 24 (1.1) bytes: 1960.
const SLOT_LEN: usize = 1960;
const SLOT_USED: usize = 8;
const DEVICE_MEMORY_LEN: usize = 64;
const DEVICE_MEMORY_TOTAL: usize = 32;
const SLOT_STATUS: usize = 1928;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RegionError {
    #[error("the region is {have} bytes, shorter than HAMi-core's {need}")]
    Truncated { have: usize, need: usize },
    #[error("the region is not initialised (magic {0}, want {MAGIC})")]
    BadMagic(i32),
    #[error("region version {0}.{1} is not one this reader knows (1.1, 1.2)")]
    UnknownVersion(u32, u32),
    #[error("the region claims {0} devices (at most {MAX_DEVICES})")]
    DeviceCount(u64),
    #[error("the region claims {0} processes (0 to {MAX_PROCS})")]
    ProcessCount(i32),
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
}

/// One device of a container as its region says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeviceUsage {
    pub(crate) uuid: String,
    /// The cap HAMi-core enforces, in bytes (0: none).
    pub(crate) limit_bytes: u64,
    /// The memory the container's live processes hold on it, in bytes.
    pub(crate) used_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Region {
    pub(crate) version: (u32, u32),
    pub(crate) devices: Vec<DeviceUsage>,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Parses a region from its bytes (the file's, or a test's).
pub(crate) fn parse(b: &[u8]) -> Result<Region, RegionError> {
    if b.len() < REGION_LEN {
        return Err(RegionError::Truncated {
            have: b.len(),
            need: REGION_LEN,
        });
    }
    let magic = u32_at(b, 0) as i32;
    if magic != MAGIC {
        return Err(RegionError::BadMagic(magic));
    }
    let version = (u32_at(b, OFF_MAJOR), u32_at(b, OFF_MINOR));
    if !SUPPORTED.contains(&version) {
        return Err(RegionError::UnknownVersion(version.0, version.1));
    }
    let device_num = u64_at(b, OFF_DEVICE_NUM);
    let devices = usize::try_from(device_num)
        .ok()
        .filter(|&n| n <= MAX_DEVICES)
        .ok_or(RegionError::DeviceCount(device_num))?;
    let proc_num = u32_at(b, OFF_PROC_NUM) as i32;
    let procs = usize::try_from(proc_num)
        .ok()
        .filter(|&n| n <= MAX_PROCS)
        .ok_or(RegionError::ProcessCount(proc_num))?;
    // Slots whose status is 0 are released (HAMi's own monitor skips them).
    let live: Vec<usize> = (0..procs)
        .map(|p| OFF_PROCS + p * SLOT_LEN)
        .filter(|&slot| u32_at(b, slot + SLOT_STATUS) != 0)
        .collect();
    let devices = (0..devices)
        .map(|d| {
            let raw = &b[OFF_UUIDS + d * UUID_LEN..OFF_UUIDS + (d + 1) * UUID_LEN];
            let end = raw.iter().position(|&c| c == 0).unwrap_or(UUID_LEN);
            let used_bytes = live.iter().fold(0u64, |sum, &slot| {
                let at = slot + SLOT_USED + d * DEVICE_MEMORY_LEN + DEVICE_MEMORY_TOTAL;
                sum.saturating_add(u64_at(b, at))
            });
            DeviceUsage {
                uuid: String::from_utf8_lossy(&raw[..end]).into_owned(),
                limit_bytes: u64_at(b, OFF_LIMIT + d * 8),
                used_bytes,
            }
        })
        .collect();
    Ok(Region { version, devices })
}

/// The region in the file at `path` (a container's cache file). A region
/// being written is read as it stands: a snapshot, as HAMi's monitor reads.
pub(crate) fn read(path: &Path) -> Result<Region, RegionError> {
    let fail = |e: std::io::Error| RegionError::Read {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let mut bytes = Vec::with_capacity(REGION_LEN);
    std::fs::File::open(path)
        .map_err(fail)?
        .take(REGION_LEN as u64)
        .read_to_end(&mut bytes)
        .map_err(fail)?;
    parse(&bytes)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A region as HAMi-core would leave it: `devices` (uuid, limit) and
    /// per process (status, used bytes per device).
    pub(crate) fn region(
        version: (u32, u32),
        devices: &[(&str, u64)],
        procs: &[(i32, &[u64])],
    ) -> Vec<u8> {
        let mut b = vec![0u8; REGION_LEN + 1];
        let put32 =
            |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        let put64 =
            |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        put32(&mut b, 0, MAGIC as u32);
        put32(&mut b, OFF_MAJOR, version.0);
        put32(&mut b, OFF_MINOR, version.1);
        put64(&mut b, OFF_DEVICE_NUM, devices.len() as u64);
        for (d, (uuid, limit)) in devices.iter().enumerate() {
            b[OFF_UUIDS + d * UUID_LEN..][..uuid.len()].copy_from_slice(uuid.as_bytes());
            put64(&mut b, OFF_LIMIT + d * 8, *limit);
        }
        put32(&mut b, OFF_PROC_NUM, procs.len() as u32);
        for (p, (status, used)) in procs.iter().enumerate() {
            let slot = OFF_PROCS + p * SLOT_LEN;
            put32(&mut b, slot, 100 + p as u32);
            put32(&mut b, slot + SLOT_STATUS, *status as u32);
            for (d, bytes) in used.iter().enumerate() {
                // Other fields of device_memory_t are set too: only total counts.
                put64(&mut b, slot + SLOT_USED + d * DEVICE_MEMORY_LEN, 7);
                put64(
                    &mut b,
                    slot + SLOT_USED + d * DEVICE_MEMORY_LEN + DEVICE_MEMORY_TOTAL,
                    *bytes,
                );
            }
        }
        b
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_layout_matches_the_c_struct_size() {
        // sizeof(shared_region_t) on x86_64 for HAMi-core 1.2 (and 1.1).
        assert_eq!(REGION_LEN, 2_008_952);
        assert_eq!(OFF_PROCS, 1856);
        assert_eq!(OFF_PROC_NUM, 2_008_896);
    }

    #[test]
    fn live_processes_are_summed_per_device() {
        for version in SUPPORTED {
            let b = region(
                version,
                &[("GPU-a", 8 * GIB), ("GPU-b", 4 * GIB)],
                &[(1, &[GIB, 0]), (1, &[2 * GIB, 3]), (0, &[5 * GIB, 5])],
            );
            let r = parse(&b).unwrap();
            assert_eq!(r.version, version);
            assert_eq!(
                r.devices,
                [
                    DeviceUsage {
                        uuid: "GPU-a".into(),
                        limit_bytes: 8 * GIB,
                        used_bytes: 3 * GIB
                    },
                    DeviceUsage {
                        uuid: "GPU-b".into(),
                        limit_bytes: 4 * GIB,
                        used_bytes: 3
                    },
                ]
            );
        }
    }

    #[test]
    fn bad_regions_are_refused_not_crashed_on() {
        let good = region((1, 2), &[("GPU-a", GIB)], &[(1, &[1])]);
        for cut in [0, 3, 60, 1856, REGION_LEN - 1] {
            assert_eq!(
                parse(&good[..cut]),
                Err(RegionError::Truncated {
                    have: cut,
                    need: REGION_LEN
                })
            );
        }
        assert_eq!(
            parse(&region((1, 3), &[], &[])),
            Err(RegionError::UnknownVersion(1, 3))
        );
        assert_eq!(
            parse(&region((2, 0), &[], &[])),
            Err(RegionError::UnknownVersion(2, 0))
        );
        let mut b = good.clone();
        b[0] = 0;
        assert!(matches!(parse(&b), Err(RegionError::BadMagic(_))));
        let mut b = good.clone();
        b[OFF_DEVICE_NUM..OFF_DEVICE_NUM + 8].copy_from_slice(&17u64.to_le_bytes());
        assert_eq!(parse(&b), Err(RegionError::DeviceCount(17)));
        for n in [-1i32, 1025] {
            let mut b = good.clone();
            b[OFF_PROC_NUM..OFF_PROC_NUM + 4].copy_from_slice(&n.to_le_bytes());
            assert_eq!(parse(&b), Err(RegionError::ProcessCount(n)));
        }
        // Garbage of every length up to a header never panics.
        for len in 0..200 {
            assert!(parse(&vec![0xffu8; len]).is_err());
        }
    }

    #[test]
    fn read_takes_the_file_and_names_it_when_absent() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("vgpu.cache");
        std::fs::write(&p, region((1, 2), &[("GPU-a", GIB)], &[(1, &[GIB])])).unwrap();
        assert_eq!(read(&p).unwrap().devices[0].used_bytes, GIB);
        let e = read(&dir.path().join("none.cache")).unwrap_err();
        assert!(e.to_string().contains("none.cache"), "{e}");
        std::fs::write(&p, b"short").unwrap();
        assert!(matches!(
            read(&p),
            Err(RegionError::Truncated { have: 5, .. })
        ));
    }
}
