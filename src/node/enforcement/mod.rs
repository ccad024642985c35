//! Enforcement: a shared grant is capped inside its container by HAMi-core
//! (`libvgpu.so`, preloaded through a mounted `/etc/ld.so.preload`), by
//! MPS (the container an MPS client of its GPU's control daemon, which the
//! `mps` module runs), or both, and enforcement fails closed: with
//! `mode = "hami-core"` and no loadable library on the host, or
//! `compute = "mps"` and no control daemon answering for the grant's GPU,
//! a shared Allocate is refused rather than answered with a container that
//! would run unlimited.
//!
//! `plan` is pure (its config is `crate::config::enforcement`); `library`, `state` and `region` do the
//! file work; [`Enforcer`] ties them to one config for the plugin, and
//! [`AllocateEnforcement`] readies one Allocate RPC's shared grants.

pub(crate) mod library;
pub(crate) mod mps;
pub(crate) mod plan;
pub(crate) mod region;
pub(crate) mod state;
pub(crate) mod sweeper;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

pub(crate) use crate::config::enforcement::EnforcementConfig;
pub use crate::config::enforcement::{Compute, CorePolicy, Mode, MpsConfig};
pub use library::install_library;
pub(crate) use library::{LibraryError, check_library, write_atomically};
pub use plan::LIBRARY_FILE;
pub(crate) use plan::{CacheOwner, Owner, Preload, cache_key};
pub(crate) use region::{Region, RegionError};
pub(crate) use state::{Keep, Swept};

#[derive(Debug, thiserror::Error)]
pub enum EnforcementError {
    #[error("enforcement library {path}: {reason}")]
    Library { path: PathBuf, reason: LibraryError },
    #[error(transparent)]
    Mps(#[from] crate::node::enforcement::mps::MpsError),
    #[error("enforcement state: cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// `map_err(io("create", path))`: an I/O error of `action` on `path`.
fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> EnforcementError {
    let path = path.to_owned();
    move |source| EnforcementError::Io {
        action,
        path,
        source,
    }
}

/// Enforcement as one config says, for the plugin: `None` from
/// [`Enforcer::new`] when nothing is enforced (no preload, no MPS).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Enforcer {
    config: EnforcementConfig,
    layout: plan::StateLayout,
}

impl Enforcer {
    pub(crate) fn new(config: &EnforcementConfig) -> Option<Enforcer> {
        let enforces = config.mode == Mode::HamiCore || config.compute() == Compute::Mps;
        enforces.then(|| Enforcer {
            config: config.clone(),
            layout: plan::StateLayout::new(&config.state_dir),
        })
    }

    /// Whether shared grants preload HAMi-core: its library to check, its
    /// state directory to sweep.
    pub(crate) fn preloads(&self) -> bool {
        self.config.mode == Mode::HamiCore
    }

    /// The library's host path.
    pub(crate) fn library_path(&self) -> PathBuf {
        self.config.library_dir.join(LIBRARY_FILE)
    }

    /// Whether the library is there and loadable: readiness, and the
    /// first step of every Allocate that preloads it.
    pub(crate) fn check(&self) -> Result<(), EnforcementError> {
        check_library(&self.library_path())
    }

    /// Enforcement for one Allocate RPC.
    pub(crate) fn for_allocate(&self) -> AllocateEnforcement {
        AllocateEnforcement {
            enforcer: self.clone(),
            node_ready: Arc::default(),
        }
    }

    /// Removes the cache directories `keep` does not keep; says how many
    /// are left.
    pub(crate) fn sweep(&self, keep: &Keep) -> Result<Swept, EnforcementError> {
        state::sweep(&self.layout.containers_dir, keep, SystemTime::now())
    }

    /// Directories made before this are stale without pod matching; None
    /// when they never are.
    pub(crate) fn max_age(&self) -> Option<std::time::Duration> {
        let secs = self.config.cache_max_age_s;
        (secs > 0).then(|| std::time::Duration::from_secs(secs))
    }

    /// The usage region of the container whose cache key is `key`; None
    /// until its first CUDA process made one.
    pub(crate) fn usage(&self, key: &str) -> Result<Option<Region>, RegionError> {
        let file = self.cache_file(key);
        if !file.exists() {
            return Ok(None);
        }
        region::read(&file).map(Some)
    }

    fn cache_file(&self, key: &str) -> PathBuf {
        self.layout
            .containers_dir
            .join(key)
            .join(Path::new(plan::CACHE_FILE))
    }
}

/// Enforcement over one Allocate RPC. The node-wide part (the library
/// checked, the state directory's shared parts made) is done at the first
/// shared grant and not again for the RPC's other containers or a grant
/// the matcher decides anew; each grant gets its own fresh cache directory.
/// A failure is not remembered: it refuses the whole RPC anyway.
#[derive(Debug, Clone)]
pub(crate) struct AllocateEnforcement {
    enforcer: Enforcer,
    /// Shared by the clones that go to the blocking tasks.
    node_ready: Arc<AtomicBool>,
}

impl AllocateEnforcement {
    /// Whether shares are MPS clients, each of one GPU's control daemon.
    pub(crate) fn mps(&self) -> bool {
        self.enforcer.config.compute() == Compute::Mps
    }

    /// What enforcement needs in the container of a shared grant on the GPU
    /// `uuid`, owned by `owner` when it is known (pod matching, a claim): HAMi-core's
    /// cache directory made fresh on disk, and MPS's control daemon for the
    /// GPU answering (asked at every grant: a daemon gone since the last
    /// would leave the container unlimited). An error means the grant must
    /// be refused, and nothing is recorded for it.
    pub(crate) fn prepare(
        &self,
        owner: Option<Owner<'_>>,
        uuid: &str,
    ) -> Result<Preload, EnforcementError> {
        let e = &self.enforcer;
        let preload = plan::plan(&e.config, owner, uuid);
        if preload.mps {
            crate::node::enforcement::mps::Control::new(&e.config.mps, uuid).ping()?;
        }
        if e.preloads() && !self.node_ready.load(Ordering::Acquire) {
            e.check()?;
            state::ensure_state(
                &e.config.state_dir,
                &e.layout,
                &plan::preload_text(&e.config),
            )?;
            self.node_ready.store(true, Ordering::Release);
        }
        if let Some(dir) = &preload.cache_dir {
            state::fresh_cache_dir(dir)?;
        }
        Ok(preload)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    const POD: Option<Owner<'static>> = Some(Owner::Container(CacheOwner {
        pod_uid: "uid-1",
        container: "app",
    }));

    fn enforcer(root: &Path) -> Enforcer {
        Enforcer::new(&EnforcementConfig {
            mode: Mode::HamiCore,
            library_dir: root.join("lib"),
            state_dir: root.join("state"),
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn one_allocate_checks_the_library_once() {
        let tmp = tempfile::tempdir().unwrap();
        let e = enforcer(tmp.path());
        let lib = tmp.path().join("lib");
        install_library(&library::tests::real_shared_object(), &lib).unwrap();
        let rpc = e.for_allocate();
        rpc.prepare(POD, "GPU-a").unwrap();
        // Gone after the RPC's first container: its second one is not
        // checked again (the clone is what a blocking task holds)...
        std::fs::remove_file(e.library_path()).unwrap();
        let second = Some(Owner::Container(CacheOwner {
            pod_uid: "uid-1",
            container: "sidecar",
        }));
        let p = rpc.clone().prepare(second, "GPU-a").unwrap();
        assert!(p.cache_dir.unwrap().is_dir());
        // ...but the next RPC is.
        let err = e.for_allocate().prepare(second, "GPU-a").unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");
    }

    #[test]
    fn mode_none_enforces_nothing() {
        assert_eq!(Enforcer::new(&EnforcementConfig::default()), None);
    }

    #[test]
    fn prepare_fails_closed_without_the_library_and_works_with_it() {
        let tmp = tempfile::tempdir().unwrap();
        let e = enforcer(tmp.path());
        let err = e.for_allocate().prepare(POD, "GPU-a").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&*e.library_path().to_string_lossy()), "{msg}");
        assert!(msg.contains("does not exist"), "{msg}");
        assert!(
            !tmp.path().join("state").exists(),
            "state made for a refused grant"
        );

        install_library(
            &library::tests::real_shared_object(),
            &tmp.path().join("lib"),
        )
        .unwrap();
        e.check().unwrap();
        let p = e.for_allocate().prepare(POD, "GPU-a").unwrap();
        let cache_dir = p.cache_dir.clone().unwrap();
        assert!(cache_dir.is_dir());
        for m in &p.mounts {
            assert!(Path::new(&m.host_path).exists(), "{} missing", m.host_path);
        }
        // A wiped state directory is made again on the next Allocate.
        std::fs::remove_dir_all(tmp.path().join("state")).unwrap();
        let p = e.for_allocate().prepare(POD, "GPU-a").unwrap();
        assert_eq!(p.cache_dir.as_ref(), Some(&cache_dir));
        assert!(cache_dir.is_dir());
        // Without pod matching nothing is made on the host.
        let p = e.for_allocate().prepare(None, "GPU-a").unwrap();
        assert_eq!(p.cache_dir, None);

        // Usage: the region HAMi-core writes into the cache directory.
        let key = "uid-1_app";
        std::fs::write(
            cache_dir.join(plan::CACHE_FILE),
            region::tests::region((1, 2), &[("GPU-a", 1 << 30)], &[(1, &[5 << 20])]),
        )
        .unwrap();
        assert_eq!(
            e.usage(key).unwrap().unwrap().devices[0].used_bytes,
            5 << 20
        );
        assert_eq!(e.usage("uid-2_app").unwrap(), None);

        let keep = Keep::Live {
            keys: HashSet::new(),
            as_of: SystemTime::now() + std::time::Duration::from_secs(1),
        };
        assert_eq!(
            e.sweep(&keep).unwrap(),
            Swept {
                removed: 1,
                remaining: 0
            }
        );
    }
}
