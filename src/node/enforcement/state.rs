//! The state directory on the host: the `ld.so.preload` file, HAMi-core's
//! lock directory and one cache directory per container, made fresh at each
//! Allocate (a usage region left by an earlier container would freeze its
//! limits: HAMi-core keeps the limits of the region it finds) and removed
//! when the pod is gone. Everything is created whole or not at all, and a
//! state directory that was wiped (a tmpfs after a reboot) is simply made
//! again.

use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use super::library::write_atomically;
use super::plan::StateLayout;
use super::{EnforcementError, io};

/// Containers may run as any user: HAMi-core creates its region and lock
/// files in these directories from inside them.
const CACHE_DIR_MODE: u32 = 0o777;
const LOCK_DIR_MODE: u32 = 0o1777;
/// Temporary names start with a dot; a crash can leave one behind.
const TMP_PREFIX: &str = ".tmp-";
const OLD_PREFIX: &str = ".old-";
/// A temporary entry this old belongs to no Allocate still running.
const TMP_GRACE: Duration = Duration::from_secs(60);

/// A unique temporary name in this process.
fn unique(prefix: &str, key: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{key}-{}-{n}", std::process::id())
}

fn make_dir(path: &Path, mode: u32) -> Result<(), EnforcementError> {
    match std::fs::create_dir(path) {
        Ok(()) => std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(io("set permissions of", path)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && path.is_dir() => Ok(()),
        Err(e) => Err(io("create directory", path)(e)),
    }
}

/// The state directory's shared parts, made if missing: the directory, the
/// containers' and claims' parents, the lock directory and `ld.so.preload` with
/// `preload` as its text (rewritten atomically only when it differs).
pub(crate) fn ensure_state(
    state_dir: &Path,
    layout: &StateLayout,
    preload: &str,
) -> Result<(), EnforcementError> {
    std::fs::create_dir_all(state_dir).map_err(io("create directory", state_dir))?;
    make_dir(&layout.containers_dir, 0o755)?;
    make_dir(&layout.claims_dir, 0o755)?;
    make_dir(&layout.lock_dir, LOCK_DIR_MODE)?;
    if std::fs::read(&layout.preload_file).ok().as_deref() != Some(preload.as_bytes()) {
        write_atomically(&layout.preload_file, preload.as_bytes(), 0o644)?;
    }
    Ok(())
}

/// Makes `cache_dir` a fresh, empty directory: built under a temporary name
/// and renamed into place, any old one moved aside first and removed after.
pub(crate) fn fresh_cache_dir(cache_dir: &Path) -> Result<(), EnforcementError> {
    let parent = cache_dir.parent().unwrap_or(Path::new("/"));
    let key = cache_dir
        .file_name()
        .map_or_else(Default::default, |n| n.to_string_lossy().into_owned());
    let tmp = parent.join(unique(TMP_PREFIX, &key));
    std::fs::create_dir(&tmp).map_err(io("create directory", &tmp))?;
    let place = || -> Result<(), EnforcementError> {
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(CACHE_DIR_MODE))
            .map_err(io("set permissions of", &tmp))?;
        let old = parent.join(unique(OLD_PREFIX, &key));
        let moved = match std::fs::rename(cache_dir, &old) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => return Err(io("move aside", cache_dir)(e)),
        };
        std::fs::rename(&tmp, cache_dir).map_err(io("rename into place", cache_dir))?;
        if moved {
            std::fs::remove_dir_all(&old).map_err(io("remove", &old))?;
        }
        Ok(())
    };
    place().inspect_err(|_| {
        let _ = std::fs::remove_dir(&tmp);
    })
}

/// Which cache directories to keep in a sweep.
#[derive(Debug, Clone)]
pub(crate) enum Keep {
    /// Those named by `keys` (every container of every pod the pod cache
    /// holds), and any made after `as_of` (the moment the keys were read:
    /// an Allocate may have made one for a pod the keys miss).
    Live {
        keys: HashSet<String>,
        as_of: SystemTime,
    },
    /// Those modified after the bound (without pod matching, nothing says
    /// which containers live).
    NewerThan(SystemTime),
}

/// One entry of the containers directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) modified: SystemTime,
}

/// The entries a sweep removes: cache directories `keep` does not keep, and
/// temporary leftovers older than a minute.
pub(crate) fn stale<'a>(entries: &'a [Entry], keep: &Keep, now: SystemTime) -> Vec<&'a str> {
    entries
        .iter()
        .filter(|e| {
            if e.name.starts_with('.') {
                return now
                    .duration_since(e.modified)
                    .is_ok_and(|age| age > TMP_GRACE);
            }
            match keep {
                Keep::Live { keys, as_of } => !keys.contains(&e.name) && e.modified < *as_of,
                Keep::NewerThan(bound) => e.modified < *bound,
            }
        })
        .map(|e| e.name.as_str())
        .collect()
}

/// What a sweep did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Swept {
    pub(crate) removed: usize,
    /// Cache directories left: the number to export as a metric.
    pub(crate) remaining: usize,
}

/// Removes the stale entries of `containers_dir` (a missing one is empty).
/// A directory that cannot be removed is reported after the others were.
pub(crate) fn sweep(
    containers_dir: &Path,
    keep: &Keep,
    now: SystemTime,
) -> Result<Swept, EnforcementError> {
    let read = match std::fs::read_dir(containers_dir) {
        Ok(read) => read,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Swept::default()),
        Err(e) => return Err(io("list", containers_dir)(e)),
    };
    let mut entries = Vec::new();
    for entry in read {
        let entry = entry.map_err(io("list", containers_dir))?;
        let modified = entry
            .metadata()
            .and_then(|m| m.modified())
            .map_err(io("stat", &entry.path()))?;
        entries.push(Entry {
            name: entry.file_name().to_string_lossy().into_owned(),
            modified,
        });
    }
    let doomed = stale(&entries, keep, now);
    let mut first_error = None;
    let mut removed = 0;
    for name in &doomed {
        let path: PathBuf = containers_dir.join(name);
        let gone = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match gone {
            Ok(()) => removed += 1,
            Err(e) => {
                first_error.get_or_insert_with(|| io("remove", &path)(e));
            }
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let remaining = entries
        .iter()
        .filter(|e| !e.name.starts_with('.') && !doomed.contains(&e.name.as_str()))
        .count();
    Ok(Swept { removed, remaining })
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Duration = Duration::from_secs(1_000_000);

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + T0 + Duration::from_secs(secs)
    }

    fn entry(name: &str, secs: u64) -> Entry {
        Entry {
            name: name.into(),
            modified: at(secs),
        }
    }

    #[test]
    fn stale_keeps_live_and_recent_and_drops_old_leftovers() {
        let entries = [
            entry("live_a", 0),
            entry("gone_b", 0),
            entry("new_c", 100),
            entry(".tmp-x-1-0", 0),
            entry(".tmp-y-1-1", 90),
        ];
        let keep = Keep::Live {
            keys: HashSet::from(["live_a".to_owned()]),
            as_of: at(50),
        };
        assert_eq!(stale(&entries, &keep, at(100)), ["gone_b", ".tmp-x-1-0"]);
        let keep = Keep::NewerThan(at(50));
        assert_eq!(
            stale(&entries, &keep, at(100)),
            ["live_a", "gone_b", ".tmp-x-1-0"]
        );
    }

    fn layout(dir: &Path) -> StateLayout {
        StateLayout::new(dir)
    }

    #[test]
    fn state_is_made_whole_and_again_after_a_wipe() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let l = layout(&state);
        ensure_state(&state, &l, "/usr/local/vgpu/libvgpu.so\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&l.preload_file).unwrap(),
            "/usr/local/vgpu/libvgpu.so\n"
        );
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&l.lock_dir), 0o1777);
        // Written once: the same text leaves the file (its inode) alone.
        let ino = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
        let first = ino(&l.preload_file);
        ensure_state(&state, &l, "/usr/local/vgpu/libvgpu.so\n").unwrap();
        assert_eq!(ino(&l.preload_file), first);
        ensure_state(&state, &l, "/other/libvgpu.so\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&l.preload_file).unwrap(),
            "/other/libvgpu.so\n"
        );
        // Wiped (a tmpfs after a reboot): made again.
        std::fs::remove_dir_all(&state).unwrap();
        ensure_state(&state, &l, "/x.so\n").unwrap();
        assert!(l.containers_dir.is_dir() && l.lock_dir.is_dir());
    }

    #[test]
    fn a_cache_dir_is_fresh_each_time_and_nothing_is_left_half_made() {
        let tmp = tempfile::tempdir().unwrap();
        let l = layout(tmp.path());
        ensure_state(tmp.path(), &l, "/x.so\n").unwrap();
        let dir = l.containers_dir.join("uid_c");
        fresh_cache_dir(&dir).unwrap();
        std::fs::write(dir.join("vgpu.cache"), "old region").unwrap();
        fresh_cache_dir(&dir).unwrap();
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "stale region kept"
        );
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o777
        );
        let names: Vec<_> = std::fs::read_dir(&l.containers_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["uid_c"]);
    }

    #[test]
    fn a_state_dir_that_cannot_be_made_is_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        // A file where the state directory should be (as a read-only or
        // full disk would, this fails even for root).
        let blocked = tmp.path().join("state");
        std::fs::write(&blocked, "in the way").unwrap();
        let e = ensure_state(&blocked, &layout(&blocked), "/x.so\n").unwrap_err();
        assert!(e.to_string().contains(&*blocked.to_string_lossy()), "{e}");
        let e = fresh_cache_dir(&blocked.join("containers/uid_c")).unwrap_err();
        assert!(e.to_string().contains("cannot create directory"), "{e}");
        assert_eq!(std::fs::read_to_string(&blocked).unwrap(), "in the way");
        // A file in the way of the containers directory: nothing else made.
        let state = tmp.path().join("s2");
        std::fs::create_dir(&state).unwrap();
        std::fs::write(state.join("containers"), "").unwrap();
        let e = ensure_state(&state, &layout(&state), "/x.so\n").unwrap_err();
        assert!(e.to_string().contains("containers"), "{e}");
        assert!(!state.join("ld.so.preload").exists());
    }

    #[test]
    fn sweep_removes_gone_pods_and_counts_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let l = layout(tmp.path());
        ensure_state(tmp.path(), &l, "/x.so\n").unwrap();
        for key in ["live_a", "gone_b"] {
            fresh_cache_dir(&l.containers_dir.join(key)).unwrap();
        }
        std::fs::write(l.containers_dir.join("gone_b/vgpu.cache"), "r").unwrap();
        let later = SystemTime::now() + Duration::from_secs(1);
        let keep = Keep::Live {
            keys: HashSet::from(["live_a".to_owned()]),
            as_of: later,
        };
        let swept = sweep(&l.containers_dir, &keep, later).unwrap();
        assert_eq!(
            swept,
            Swept {
                removed: 1,
                remaining: 1
            }
        );
        assert!(l.containers_dir.join("live_a").is_dir());
        assert!(!l.containers_dir.join("gone_b").exists());
        // A wiped state directory sweeps to nothing, without an error.
        std::fs::remove_dir_all(tmp.path().join("containers")).unwrap();
        assert_eq!(
            sweep(&l.containers_dir, &keep, later).unwrap(),
            Swept::default()
        );
    }
}
