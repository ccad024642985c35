//! What HAMi-core needs in a shared grant's container, decided without
//! I/O: the mounts, the envs and the per-container cache key. Data only:
//! the plugin's response composer puts them into the response. The
//! layout follows HAMi's own device plugin (HAMi v2.9.0,
//! pkg/device-plugin/nvidiadevice/nvinternal/plugin/server.go, Allocate):
//! the library read-only, an `ld.so.preload` naming it at
//! `/etc/ld.so.preload`, a cache directory of the container's own with
//! `CUDA_DEVICE_MEMORY_SHARED_CACHE` pointing into it, and the lock
//! directory HAMi-core expects. Two deliberate differences: the cache
//! directory is mounted apart from the library (HAMi nests the library mount
//! inside the writable cache mount, which leaves an empty mount-point file in
//! the host directory), and the lock directory lives under the state
//! directory rather than the host's /tmp.

use std::path::{Path, PathBuf};

use crate::api::Mount;

use super::EnforcementConfig;

/// The library's file name in `library_dir`, as HAMi-core's build names it.
pub const LIBRARY_FILE: &str = "libvgpu.so";
/// glibc reads this file in every process it starts: no image change needed.
pub(crate) const PRELOAD_TARGET: &str = "/etc/ld.so.preload";
/// HAMi-core's node-wide lock (`/tmp/vgpulock/lock`, src/utils.c) is
/// compiled in; every container of the node must share one directory there.
pub(crate) const LOCK_TARGET: &str = "/tmp/vgpulock";
/// The env HAMi-core reads for its usage region's file.
pub(crate) const CACHE_ENV: &str = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
/// The env HAMi-core reads for how it applies `CUDA_DEVICE_SM_LIMIT`.
pub(crate) const CORE_POLICY_ENV: &str = "GPU_CORE_UTILIZATION_POLICY";
/// The usage region's file name in a container's cache directory.
pub(crate) const CACHE_FILE: &str = "vgpu.cache";

/// Whose cache directory: the container when pod matching knows it, else
/// the grant (by the digest of its device IDs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CacheOwner<'a> {
    Container {
        pod_uid: &'a str,
        container: &'a str,
    },
    Grant {
        ids_digest: &'a str,
    },
}

/// A key part as it is when short and plain (pod UIDs, container names are
/// DNS labels), else a digest of it: a directory name never holds a
/// separator, a dot (temporary names start with one) or an odd byte, and
/// stays short.
fn safe_part(part: &str) -> String {
    const MAX: usize = 63;
    let plain = !part.is_empty()
        && part.len() <= MAX
        && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if plain {
        return part.to_owned();
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in part.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("x{h:016x}")
}

/// The cache directory's name: `<pod UID>_<container>` (HAMi's naming, so
/// HAMi's own monitor can read a shared state directory) or
/// `ids-<digest>`. `_` separates because no part can hold one.
pub(crate) fn cache_key(owner: CacheOwner<'_>) -> String {
    match owner {
        CacheOwner::Container { pod_uid, container } => {
            format!("{}_{}", safe_part(pod_uid), safe_part(container))
        }
        CacheOwner::Grant { ids_digest } => format!("ids-{}", safe_part(ids_digest)),
    }
}

/// The host paths under the state directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StateLayout {
    pub(crate) preload_file: PathBuf,
    pub(crate) containers_dir: PathBuf,
    pub(crate) lock_dir: PathBuf,
}

impl StateLayout {
    pub(crate) fn new(state_dir: &Path) -> StateLayout {
        StateLayout {
            preload_file: state_dir.join("ld.so.preload"),
            containers_dir: state_dir.join("containers"),
            lock_dir: state_dir.join("vgpulock"),
        }
    }
}

/// What HAMi-core needs in one shared grant's container. The limit envs
/// themselves (`CUDA_DEVICE_MEMORY_LIMIT_0`, `CUDA_DEVICE_SM_LIMIT`) are
/// the grant's, not the library's: the composer sets them with the grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Preload {
    /// The container's cache directory on the host.
    pub(crate) cache_dir: PathBuf,
    pub(crate) mounts: Vec<Mount>,
    pub(crate) envs: Vec<(String, String)>,
}

fn mount(host: &Path, container: &Path, read_only: bool) -> Mount {
    Mount {
        container_path: container.display().to_string(),
        host_path: host.display().to_string(),
        read_only,
    }
}

/// The mounts and envs of a shared grant owned by `owner` (a whole GPU has
/// nothing to cap, so it never asks).
pub(crate) fn plan(config: &EnforcementConfig, owner: CacheOwner<'_>) -> Preload {
    let layout = StateLayout::new(&config.state_dir);
    let cache_dir = layout.containers_dir.join(cache_key(owner));
    let mounts = vec![
        mount(
            &config.library_dir.join(LIBRARY_FILE),
            &config.container_library_path,
            true,
        ),
        mount(&layout.preload_file, Path::new(PRELOAD_TARGET), true),
        mount(&cache_dir, &config.container_cache_dir, false),
        mount(&layout.lock_dir, Path::new(LOCK_TARGET), false),
    ];
    let envs = vec![
        (
            CACHE_ENV.to_owned(),
            config
                .container_cache_dir
                .join(CACHE_FILE)
                .display()
                .to_string(),
        ),
        (
            CORE_POLICY_ENV.to_owned(),
            config.core_policy.env_value().to_owned(),
        ),
    ];
    Preload {
        cache_dir,
        mounts,
        envs,
    }
}

/// The `ld.so.preload` text: the library's path inside the container.
pub(crate) fn preload_text(config: &EnforcementConfig) -> String {
    format!("{}\n", config.container_library_path.display())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn config() -> EnforcementConfig {
        EnforcementConfig {
            mode: super::super::Mode::HamiCore,
            ..Default::default()
        }
    }

    const POD: CacheOwner<'static> = CacheOwner::Container {
        pod_uid: "0b9d7a0e-3c4f-4c1e-9a63-2f7f0c1d2e3f",
        container: "trainer",
    };

    #[test]
    fn a_shared_grant_preloads_the_library_with_a_cache_of_its_own() {
        let p = plan(&config(), POD);
        let by_target: Vec<(&str, &str, bool)> = p
            .mounts
            .iter()
            .map(|m| (m.container_path.as_str(), m.host_path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            by_target,
            [
                (
                    "/usr/local/vgpu/libvgpu.so",
                    "/usr/local/vgpu/libvgpu.so",
                    true
                ),
                (
                    "/etc/ld.so.preload",
                    "/var/lib/gpu-device-plugin/ld.so.preload",
                    true
                ),
                (
                    "/usr/local/vgpu/cache",
                    "/var/lib/gpu-device-plugin/containers/0b9d7a0e-3c4f-4c1e-9a63-2f7f0c1d2e3f_trainer",
                    false
                ),
                (
                    "/tmp/vgpulock",
                    "/var/lib/gpu-device-plugin/vgpulock",
                    false
                ),
            ]
        );
        assert_eq!(
            p.envs,
            [
                (
                    "CUDA_DEVICE_MEMORY_SHARED_CACHE".to_owned(),
                    "/usr/local/vgpu/cache/vgpu.cache".to_owned()
                ),
                ("GPU_CORE_UTILIZATION_POLICY".to_owned(), "force".to_owned())
            ]
        );
        let lax = EnforcementConfig {
            core_policy: crate::enforcement::CorePolicy::Default,
            ..config()
        };
        let p = plan(&lax, POD);
        assert!(
            p.envs
                .contains(&(CORE_POLICY_ENV.to_owned(), "default".to_owned()))
        );
        assert_eq!(Path::new(&p.mounts[2].host_path), p.cache_dir);
        assert_eq!(preload_text(&config()), "/usr/local/vgpu/libvgpu.so\n");
    }

    #[test]
    fn cache_keys_are_safe_bounded_and_distinct() {
        let keys = [
            cache_key(POD),
            cache_key(CacheOwner::Container {
                pod_uid: "u",
                container: "a-b",
            }),
            cache_key(CacheOwner::Container {
                pod_uid: "u-a",
                container: "b",
            }),
            cache_key(CacheOwner::Container {
                pod_uid: "u",
                container: "../../etc",
            }),
            cache_key(CacheOwner::Container {
                pod_uid: "u",
                container: "../../etd",
            }),
            cache_key(CacheOwner::Container {
                pod_uid: "u",
                container: &"c".repeat(300),
            }),
            cache_key(CacheOwner::Container {
                pod_uid: "",
                container: "a b\n",
            }),
            cache_key(CacheOwner::Grant {
                ids_digest: "00ff00ff00ff00ff",
            }),
        ];
        assert_eq!(keys[1], "u_a-b");
        assert_eq!(keys[7], "ids-00ff00ff00ff00ff");
        for k in &keys {
            assert!(k.len() <= 130, "{k}");
            assert!(!k.starts_with('.'), "{k}");
            assert!(
                k.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
                "{k}"
            );
        }
        assert_eq!(keys.iter().collect::<HashSet<_>>().len(), keys.len());
        // Stable: the same container always gets the same directory.
        assert_eq!(cache_key(POD), keys[0]);
    }
}
