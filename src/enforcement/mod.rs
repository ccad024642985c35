//! Enforcement: a shared grant is capped inside its container by HAMi-core
//! (`libvgpu.so`, preloaded through a mounted `/etc/ld.so.preload`), and
//! enforcement fails closed: with `mode = "hami-core"` and no loadable
//! library on the host, a shared Allocate is refused rather than answered
//! with a container that would run unlimited.
//!
//! `config` and `plan` are pure; `library`, `state` and `region` do the
//! file work; [`Enforcer`] ties them to one config for the plugin.

pub(crate) mod config;
pub(crate) mod library;
pub(crate) mod plan;
pub(crate) mod region;
pub(crate) mod state;
pub(crate) mod sweeper;

use std::path::{Path, PathBuf};
use std::time::SystemTime;

pub(crate) use config::EnforcementConfig;
pub use config::{CorePolicy, Mode};
pub use library::install_library;
pub(crate) use library::{LibraryError, check_library};
pub use plan::LIBRARY_FILE;
pub(crate) use plan::{CacheOwner, Grant, Preload, cache_key};
pub(crate) use region::{Region, RegionError};
pub(crate) use state::{Keep, Swept};

#[derive(Debug, thiserror::Error)]
pub enum EnforcementError {
    #[error("enforcement library {path}: {reason}")]
    Library { path: PathBuf, reason: LibraryError },
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
/// [`Enforcer::new`] when the mode is `none`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Enforcer {
    config: EnforcementConfig,
    layout: plan::StateLayout,
}

impl Enforcer {
    pub(crate) fn new(config: &EnforcementConfig) -> Option<Enforcer> {
        (config.mode == Mode::HamiCore).then(|| Enforcer {
            config: config.clone(),
            layout: plan::StateLayout::new(&config.state_dir),
        })
    }

    /// The library's host path.
    pub(crate) fn library_path(&self) -> PathBuf {
        self.config.library_dir.join(LIBRARY_FILE)
    }

    /// Whether the library is there and loadable: readiness, and the
    /// first step of every shared Allocate.
    pub(crate) fn check(&self) -> Result<(), EnforcementError> {
        check_library(&self.library_path())
    }

    /// The mounts and env `grant` adds, with nothing touched on disk.
    pub(crate) fn plan(&self, grant: Grant, owner: CacheOwner<'_>) -> Option<Preload> {
        plan::plan(&self.config, grant, owner)
    }

    /// What `grant` adds to its response, after checking the library and
    /// making the state directory's shared parts (again, if it was wiped)
    /// and a fresh cache directory for `owner`. An error means the grant
    /// must be refused.
    pub(crate) fn prepare(
        &self,
        grant: Grant,
        owner: CacheOwner<'_>,
    ) -> Result<Option<Preload>, EnforcementError> {
        let Some(preload) = self.plan(grant, owner) else {
            return Ok(None);
        };
        self.check()?;
        state::ensure_state(
            &self.config.state_dir,
            &self.layout,
            &plan::preload_text(&self.config),
        )?;
        state::fresh_cache_dir(&preload.cache_dir)?;
        Ok(Some(preload))
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

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    const POD: CacheOwner<'static> = CacheOwner::Container {
        pod_uid: "uid-1",
        container: "app",
    };

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
    fn mode_none_enforces_nothing() {
        assert_eq!(Enforcer::new(&EnforcementConfig::default()), None);
    }

    #[test]
    fn prepare_fails_closed_without_the_library_and_works_with_it() {
        let tmp = tempfile::tempdir().unwrap();
        let e = enforcer(tmp.path());
        let err = e.prepare(Grant::Shared, POD).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&*e.library_path().to_string_lossy()), "{msg}");
        assert!(msg.contains("does not exist"), "{msg}");
        assert!(
            !tmp.path().join("state").exists(),
            "state made for a refused grant"
        );
        // A whole GPU needs no library.
        assert!(e.prepare(Grant::Whole, POD).unwrap().is_none());

        install_library(
            &library::tests::real_shared_object(),
            &tmp.path().join("lib"),
        )
        .unwrap();
        e.check().unwrap();
        let p = e.prepare(Grant::Shared, POD).unwrap().unwrap();
        assert!(p.cache_dir.is_dir());
        for m in &p.mounts {
            assert!(Path::new(&m.host_path).exists(), "{} missing", m.host_path);
        }
        // A wiped state directory is made again on the next Allocate.
        std::fs::remove_dir_all(tmp.path().join("state")).unwrap();
        let p = e.prepare(Grant::Shared, POD).unwrap().unwrap();
        assert!(p.cache_dir.is_dir());

        // Usage: the region HAMi-core writes into the cache directory.
        let key = cache_key(POD);
        std::fs::write(
            p.cache_dir.join(plan::CACHE_FILE),
            region::tests::region((1, 2), &[("GPU-a", 1 << 30)], &[(1, &[5 << 20])]),
        )
        .unwrap();
        assert_eq!(
            e.usage(&key).unwrap().unwrap().devices[0].used_bytes,
            5 << 20
        );
        assert_eq!(e.usage("ids-none").unwrap(), None);

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
