//! Tell the daemon when the config file's content changes, so it reloads
//! as on SIGHUP.
//!
//! The kubelet never writes a mounted ConfigMap's file in place: it writes
//! the new data into a fresh timestamped directory beside it, points a
//! temporary `..data_tmp` symlink there and renames it over `..data`, which
//! the file's own symlink goes through. An inotify watch on the file would
//! stay on the old inode, so the directory is watched, and every event in it
//! (plus a slow poll, for filesystems that drop events) leads to one read of
//! the file through its symlinks. An edit is reported only when the bytes
//! differ from the last ones seen, so the kubelet's several renames, and a
//! refused edit seen again, ask once.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::Stream;
use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// How long the directory must be quiet before the file is read: the
/// kubelet's swap is a handful of renames in a row.
const SETTLE: Duration = Duration::from_millis(100);

/// Reads the file anyway this often, in case an event was lost.
const POLL: Duration = Duration::from_secs(5);

/// The SHA-256 of a config file's bytes, in hex, as `sha256sum` prints it:
/// what the metrics call the loaded config's hash.
pub fn digest(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The digest of the file's current content; `None` while it cannot be read
/// (the middle of a swap, or a file removed for good).
fn current(path: &Path) -> Option<String> {
    std::fs::read(path).ok().map(|b| digest(&b))
}

struct FileWatch {
    path: PathBuf,
    last: Option<String>,
    events: mpsc::UnboundedReceiver<()>,
    poll: tokio::time::Interval,
    /// Held for the stream's life: dropping it ends the inotify watch.
    _watcher: notify::RecommendedWatcher,
}

/// The file's content changed: the daemon reloads it (`Control::Edited`)
/// unless those very bytes were the last it tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Edited;

/// [`Edited`] each time the content of `path` changes from what it was
/// when the watch began, or when it was last reported.
pub fn watch(path: &Path) -> notify::Result<impl Stream<Item = Edited> + Unpin + use<>> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (tx, events) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |_: notify::Result<notify::Event>| {
        let _ = tx.send(());
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    let mut poll = tokio::time::interval(POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let state = FileWatch {
        last: current(path),
        path: path.to_path_buf(),
        events,
        poll,
        _watcher: watcher,
    };
    Ok(Box::pin(futures::stream::unfold(state, next)))
}

async fn next(mut s: FileWatch) -> Option<(Edited, FileWatch)> {
    loop {
        tokio::select! {
            event = s.events.recv() => {
                event?;
                // Let the burst of renames finish, then read once.
                tokio::time::sleep(SETTLE).await;
                while s.events.try_recv().is_ok() {}
            }
            _ = s.poll.tick() => {}
        }
        let now = current(&s.path);
        if now.is_some() && now != s.last {
            tracing::info!(config = %s.path.display(), "config file changed");
            s.last = now;
            return Some((Edited, s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    // The stand-in's swap takes and changes only a directory, so no type of
    // this crate crosses to the copy of it that gpu-sim links.
    use gpu_sim::kubelet::swap_configmap;

    #[test]
    fn the_digest_is_sha256_in_hex() {
        assert_eq!(
            digest(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[tokio::test]
    async fn a_kubelet_style_swap_tells_once_and_the_same_bytes_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        swap_configmap(dir.path(), 1, "memory_unit_mib = 1\n").unwrap();
        let mut reloads = watch(&dir.path().join("config.toml")).unwrap();
        // Nothing changed yet.
        let early = tokio::time::timeout(Duration::from_millis(400), reloads.next()).await;
        assert!(early.is_err(), "{early:?}");
        swap_configmap(dir.path(), 2, "memory_unit_mib = 2\n").unwrap();
        let got = tokio::time::timeout(Duration::from_secs(3), reloads.next()).await;
        assert!(matches!(got, Ok(Some(Edited))), "{got:?}");
        // The same bytes again (a resync): no reload.
        swap_configmap(dir.path(), 3, "memory_unit_mib = 2\n").unwrap();
        let again = tokio::time::timeout(Duration::from_millis(600), reloads.next()).await;
        assert!(again.is_err(), "{again:?}");
    }
}
