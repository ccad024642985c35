//! What enforcement needs in a shared grant's container, decided without
//! I/O: HAMi-core's mounts, envs and per-container cache key, and an MPS
//! client's pipe and shared-memory mounts. Data only: the plugin's response
//! composer puts them into the response. HAMi-core's
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
use crate::config::enforcement::{Compute, Mode};

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
/// An MPS client's `/dev/shm`: where MPS servers and clients share memory.
pub(crate) const SHM_TARGET: &str = "/dev/shm";
/// The env an MPS client reads to find its control daemon.
pub(crate) const MPS_PIPE_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";

/// The container owning a cache directory, as pod matching knows it.
/// Without pod matching no Allocate knows its container (a container's
/// gpu-memory and gpu-core Allocates name different device IDs), so a
/// host directory would be made per Allocate and one of a container's two
/// would be left unused: its usage region stays inside the container
/// instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CacheOwner<'a> {
    pub(crate) pod_uid: &'a str,
    pub(crate) container: &'a str,
}

/// A key part as it is when short and plain (pod UIDs, container names are
/// DNS labels), else a digest of it: a directory name never holds a
/// separator, a dot (temporary names start with one) or an odd byte, and
/// stays short.
pub(crate) fn safe_part(part: &str) -> String {
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
/// HAMi's own monitor can read a shared state directory). `_` separates
/// because no part can hold one.
pub(crate) fn cache_key(owner: CacheOwner<'_>) -> String {
    format!(
        "{}_{}",
        safe_part(owner.pod_uid),
        safe_part(owner.container)
    )
}

/// Whose usage region a shared grant's cache directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner<'a> {
    /// A device-plugin grant's container, as pod matching knows it: under
    /// `containers/`, swept when its pod is gone.
    Container(CacheOwner<'a>),
    /// A DRA claim's share (every container using the claim shares its
    /// limit, so they share the region): under `claims/`, which the pod
    /// sweeper never touches; NodeUnprepareResources removes it.
    Claim { uid: &'a str, share: &'a str },
}

impl Owner<'_> {
    /// The owner's cache directory in `layout`.
    pub(crate) fn cache_dir(&self, layout: &StateLayout) -> PathBuf {
        match *self {
            Owner::Container(c) => layout.containers_dir.join(cache_key(c)),
            Owner::Claim { uid, share } => {
                layout
                    .claims_dir
                    .join(format!("{}_{}", safe_part(uid), safe_part(share)))
            }
        }
    }
}

/// One GPU's directory under an MPS root (pipes or logs): the control
/// daemon of each GPU has its own.
pub(crate) fn gpu_dir(root: &Path, uuid: &str) -> PathBuf {
    root.join(safe_part(uuid))
}

/// The host paths under the state directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StateLayout {
    pub(crate) preload_file: PathBuf,
    pub(crate) containers_dir: PathBuf,
    pub(crate) claims_dir: PathBuf,
    pub(crate) lock_dir: PathBuf,
}

impl StateLayout {
    pub(crate) fn new(state_dir: &Path) -> StateLayout {
        StateLayout {
            preload_file: state_dir.join("ld.so.preload"),
            containers_dir: state_dir.join("containers"),
            claims_dir: state_dir.join("claims"),
            lock_dir: state_dir.join("vgpulock"),
        }
    }
}

/// What enforcement adds to one shared grant's container. The limit
/// envs themselves (`CUDA_DEVICE_MEMORY_LIMIT_0`, `CUDA_DEVICE_SM_LIMIT`,
/// and under MPS `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`,
/// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`) are the grant's, not the backend's:
/// the composer sets them with the grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Preload {
    /// The container's HAMi-core cache directory on the host, when it has
    /// one (HAMi-core preloaded, pod matching on).
    pub(crate) cache_dir: Option<PathBuf>,
    pub(crate) mounts: Vec<Mount>,
    pub(crate) envs: Vec<(String, String)>,
    /// The container is an MPS client: the composer sets MPS's limits.
    pub(crate) mps: bool,
}

fn mount(host: &Path, container: &Path, read_only: bool) -> Mount {
    Mount {
        container_path: container.display().to_string(),
        host_path: host.display().to_string(),
        read_only,
    }
}

/// The mounts and envs of a shared grant on the GPU `uuid`, owned by
/// `owner` when it is known (pod matching, a DRA claim) (a whole GPU has nothing to limit,
/// so it never asks). HAMi-core's part when it is preloaded, MPS's when it
/// limits compute.
pub(crate) fn plan(config: &EnforcementConfig, owner: Option<Owner<'_>>, uuid: &str) -> Preload {
    let mut p = Preload {
        cache_dir: None,
        mounts: Vec::new(),
        envs: Vec::new(),
        mps: false,
    };
    if config.mode == Mode::HamiCore {
        hami_core(config, owner, &mut p);
    }
    if config.compute() == Compute::Mps {
        let mps = &config.mps;
        p.mounts.extend([
            mount(
                &gpu_dir(&mps.pipe_dir, uuid),
                &mps.container_pipe_dir,
                false,
            ),
            mount(&mps.shm_dir, Path::new(SHM_TARGET), false),
        ]);
        let pipe = mps.container_pipe_dir.display().to_string();
        p.envs.push((MPS_PIPE_ENV.to_owned(), pipe));
        p.mps = true;
    }
    p
}

/// HAMi-core's part: the library, `ld.so.preload`, the lock directory, and
/// the usage region in the owner's cache directory (or, with no owner
/// known, in the container's own /tmp, which exists because the lock
/// directory is mounted in it).
fn hami_core(config: &EnforcementConfig, owner: Option<Owner<'_>>, p: &mut Preload) {
    let layout = StateLayout::new(&config.state_dir);
    p.mounts.extend([
        mount(
            &config.library_dir.join(LIBRARY_FILE),
            &config.container_library_path,
            true,
        ),
        mount(&layout.preload_file, Path::new(PRELOAD_TARGET), true),
    ]);
    let region = match owner {
        Some(owner) => {
            let cache_dir = owner.cache_dir(&layout);
            p.mounts
                .push(mount(&cache_dir, &config.container_cache_dir, false));
            p.cache_dir = Some(cache_dir);
            config.container_cache_dir.join(CACHE_FILE)
        }
        None => Path::new(LOCK_TARGET)
            .parent()
            .unwrap_or(Path::new("/"))
            .join(CACHE_FILE),
    };
    p.mounts
        .push(mount(&layout.lock_dir, Path::new(LOCK_TARGET), false));
    // Under another compute backend HAMi-core keeps to memory: its
    // throttle would only add to the other's limit.
    let policy = match config.compute() {
        Compute::HamiCore => config.core_policy.env_value(),
        Compute::Mps | Compute::None => super::CorePolicy::Disable.env_value(),
    };
    p.envs.extend([
        (CACHE_ENV.to_owned(), region.display().to_string()),
        (CORE_POLICY_ENV.to_owned(), policy.to_owned()),
    ]);
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
            mode: Mode::HamiCore,
            ..Default::default()
        }
    }

    const POD: CacheOwner<'static> = CacheOwner {
        pod_uid: "0b9d7a0e-3c4f-4c1e-9a63-2f7f0c1d2e3f",
        container: "trainer",
    };

    fn targets(p: &Preload) -> Vec<(&str, &str, bool)> {
        p.mounts
            .iter()
            .map(|m| (m.container_path.as_str(), m.host_path.as_str(), m.read_only))
            .collect()
    }

    fn env<'a>(p: &'a Preload, key: &str) -> Option<&'a str> {
        p.envs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn a_shared_grant_preloads_the_library_with_a_cache_of_its_own() {
        let p = plan(&config(), Some(Owner::Container(POD)), "GPU-a");
        assert_eq!(
            targets(&p),
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
        assert!(!p.mps);
        let lax = EnforcementConfig {
            core_policy: crate::node::enforcement::CorePolicy::Default,
            ..config()
        };
        let p = plan(&lax, Some(Owner::Container(POD)), "GPU-a");
        assert_eq!(env(&p, CORE_POLICY_ENV), Some("default"));
        assert_eq!(
            p.cache_dir.as_deref(),
            Some(Path::new(&p.mounts[2].host_path))
        );
        assert_eq!(preload_text(&config()), "/usr/local/vgpu/libvgpu.so\n");
    }

    /// Without pod matching nothing on the host is the container's: its
    /// gpu-memory and gpu-core Allocates plan the same mounts and envs, so
    /// the kubelet's merge of the two leaves no directory unused.
    #[test]
    fn without_an_owner_the_region_stays_in_the_container() {
        let p = plan(&config(), None, "GPU-a");
        assert_eq!(p.cache_dir, None);
        assert_eq!(env(&p, CACHE_ENV), Some("/tmp/vgpu.cache"));
        let t = targets(&p);
        assert!(
            t.iter().all(|(c, _, _)| *c != "/usr/local/vgpu/cache"),
            "{t:?}"
        );
        // The lock directory's mount is what makes /tmp exist.
        assert!(t.iter().any(|(c, _, _)| *c == LOCK_TARGET), "{t:?}");
        assert_eq!(p, plan(&config(), None, "GPU-a"));
    }

    #[test]
    fn an_mps_client_mounts_its_gpus_pipes_and_the_shared_memory() {
        let mps_only = EnforcementConfig {
            compute: Some(Compute::Mps),
            ..Default::default()
        };
        let p = plan(&mps_only, Some(Owner::Container(POD)), "GPU-a");
        assert!(p.mps);
        assert_eq!(p.cache_dir, None);
        assert_eq!(
            targets(&p),
            [
                (
                    "/var/run/nvidia-mps",
                    "/var/run/gpu-device-plugin/mps/pipe/GPU-a",
                    false
                ),
                ("/dev/shm", "/var/run/gpu-device-plugin/mps/shm", false),
            ]
        );
        assert_eq!(
            p.envs,
            [(MPS_PIPE_ENV.to_owned(), "/var/run/nvidia-mps".to_owned())]
        );
        // Beside HAMi-core: its memory cap and region stay, its throttle
        // goes.
        let both = EnforcementConfig {
            compute: Some(Compute::Mps),
            ..config()
        };
        let p = plan(&both, Some(Owner::Container(POD)), "GPU-b");
        assert!(p.mps && p.cache_dir.is_some());
        assert_eq!(p.mounts.len(), 6);
        assert_eq!(env(&p, CORE_POLICY_ENV), Some("disable"));
        assert_eq!(env(&p, MPS_PIPE_ENV), Some("/var/run/nvidia-mps"));
        // A UUID that is not a plain name is not a path.
        assert!(!gpu_dir(Path::new("/p"), "../../etc").ends_with("etc"));
    }

    #[test]
    fn cache_keys_are_safe_bounded_and_distinct() {
        let c = |pod_uid, container| cache_key(CacheOwner { pod_uid, container });
        let long = "c".repeat(300);
        let keys = [
            cache_key(POD),
            c("u", "a-b"),
            c("u-a", "b"),
            c("u", "../../etc"),
            c("u", "../../etd"),
            c("u", &long),
            c("", "a b\n"),
        ];
        assert_eq!(keys[1], "u_a-b");
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
