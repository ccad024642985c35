//! The watcher actor. It does not decide anything: on every relevant event
//! and on every tick it sends its one message, [`CheckPlugins`] (the
//! supervisor has each plugin `Check` itself, which is idempotent, so a
//! burst of events costs a few `stat`s).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;

pub(crate) struct KubeletWatcher;

/// Asks for every plugin to check its socket, kubelet and stream.
pub(crate) type CheckPlugins = Arc<dyn Fn() + Send + Sync>;

#[derive(Clone)]
pub(crate) struct WatcherArgs {
    pub(crate) dir: PathBuf,
    pub(crate) check: CheckPlugins,
    /// The periodic check, for events the filesystem did not deliver.
    pub(crate) tick: Duration,
}

impl WatcherArgs {
    /// What restarts a running watcher when a reload changes it. Left out:
    /// where it sends, the supervisor's, the same across reloads.
    pub(crate) fn restart_key(&self) -> impl PartialEq + '_ {
        let WatcherArgs {
            dir,
            tick,
            check: _,
        } = self;
        (dir, tick)
    }
}

/// What the watcher is told, by its filesystem watch and its ticker;
/// nothing waits for a reply.
pub(crate) enum WatcherMsg {
    /// Something happened to a socket in the directory, or the tick fired:
    /// ask for every plugin to be checked.
    Changed,
}

pub(crate) struct WatcherState {
    check: CheckPlugins,
    _watcher: RecommendedWatcher,
    ticker: JoinHandle<()>,
}

impl Actor for KubeletWatcher {
    type Msg = WatcherMsg;
    type State = WatcherState;
    type Arguments = WatcherArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<WatcherMsg>,
        args: WatcherArgs,
    ) -> Result<WatcherState, ActorProcessingErr> {
        std::fs::create_dir_all(&args.dir)
            .map_err(|e| format!("cannot create {}: {e}", args.dir.display()))?;
        let me = myself.clone();
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            let Ok(event) = res else {
                // A lost or failed event: check everything rather than guess.
                let _ = me.send_message(WatcherMsg::Changed);
                return;
            };
            let sockets = event
                .paths
                .iter()
                .any(|p| p.extension().is_some_and(|e| e == "sock"));
            let relevant = matches!(
                event.kind,
                EventKind::Create(_) | EventKind::Remove(_) | EventKind::Modify(_) | EventKind::Any
            );
            if sockets && relevant {
                let _ = me.send_message(WatcherMsg::Changed);
            }
        })
        .map_err(|e| format!("cannot watch {}: {e}", args.dir.display()))?;
        watcher
            .watch(&args.dir, RecursiveMode::NonRecursive)
            .map_err(|e| format!("cannot watch {}: {e}", args.dir.display()))?;
        let ticker = myself.send_interval(args.tick, || WatcherMsg::Changed);
        tracing::info!(dir = %args.dir.display(), "watching the device-plugin directory");
        Ok(WatcherState {
            check: args.check,
            _watcher: watcher,
            ticker,
        })
    }

    async fn handle(
        &self,
        _: ActorRef<WatcherMsg>,
        msg: WatcherMsg,
        state: &mut WatcherState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WatcherMsg::Changed => (state.check)(),
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<WatcherMsg>,
        state: &mut WatcherState,
    ) -> Result<(), ActorProcessingErr> {
        state.ticker.abort();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    const WAIT: Duration = Duration::from_secs(10);

    async fn watch(dir: &std::path::Path, tick: Duration) -> mpsc::UnboundedReceiver<()> {
        let (tx, checks) = mpsc::unbounded_channel();
        let args = WatcherArgs {
            dir: dir.to_owned(),
            check: Arc::new(move || {
                let _ = tx.send(());
            }),
            tick,
        };
        Actor::spawn(None, KubeletWatcher, args).await.unwrap();
        checks
    }

    #[tokio::test]
    async fn a_socket_appearing_asks_for_a_check() {
        let dir = tempfile::tempdir().unwrap();
        // No tick within the test: only the filesystem event can ask.
        let mut checks = watch(dir.path(), Duration::from_secs(3600)).await;
        std::fs::write(dir.path().join("kubelet.sock"), "").unwrap();
        let asked = tokio::time::timeout(WAIT, checks.recv()).await;
        assert_eq!(asked, Ok(Some(())));
    }

    #[tokio::test]
    async fn the_tick_asks_for_a_check_without_any_event() {
        let dir = tempfile::tempdir().unwrap();
        let mut checks = watch(dir.path(), Duration::from_millis(20)).await;
        let asked = tokio::time::timeout(WAIT, checks.recv()).await;
        assert_eq!(asked, Ok(Some(())));
    }
}
