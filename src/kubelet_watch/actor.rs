//! The watcher actor. It does not decide anything: on every relevant event
//! and on every tick it asks the supervisor to have each plugin `Check`
//! itself, which is idempotent, so a burst of events costs a few `stat`s.

use std::path::PathBuf;
use std::time::Duration;

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;

use crate::supervisor::SupervisorMsg;

pub struct KubeletWatcher;

pub struct WatcherArgs {
    pub dir: PathBuf,
    pub supervisor: ActorRef<SupervisorMsg>,
    /// The periodic check, for events the filesystem did not deliver.
    pub tick: Duration,
}

pub enum WatcherMsg {
    /// Something happened to a socket in the directory, or the tick fired.
    Changed,
}

pub struct WatcherState {
    supervisor: ActorRef<SupervisorMsg>,
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
            supervisor: args.supervisor,
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
            WatcherMsg::Changed => {
                // A stopped supervisor is shutting down: nothing to heal.
                let _ = state.supervisor.send_message(SupervisorMsg::CheckPlugins);
            }
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
