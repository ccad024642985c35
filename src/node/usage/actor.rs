//! The usage monitor actor: receives the probe thread's samples, names
//! their processes through the pod matcher's live containers and publishes
//! the result on `/metrics`, replacing the last, so a container gone is
//! gone within one poll.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::probe::{self, GpuProcesses, ListError, UsageSpec};
use crate::node::matcher::{LiveContainer, MatcherHandle};
use crate::node::metrics::Metrics;

pub(crate) struct UsageMonitor;

#[derive(Debug, Clone)]
pub(crate) struct UsageArgs {
    pub(crate) spec: UsageSpec,
    pub(crate) uuids: Vec<String>,
    pub(crate) proc_root: PathBuf,
    pub(crate) poll: Duration,
    pub(crate) matcher: MatcherHandle,
    pub(crate) metrics: Arc<Metrics>,
}

impl UsageArgs {
    pub(crate) fn new(
        config: &crate::config::Config,
        gpus: &[crate::rules::device::Gpu],
        matcher: MatcherHandle,
        metrics: Arc<Metrics>,
    ) -> UsageArgs {
        UsageArgs {
            spec: UsageSpec::new(config),
            uuids: gpus.iter().map(|g| g.uuid.clone()).collect(),
            proc_root: config.usage.proc_root.clone(),
            poll: Duration::from_millis(config.usage.poll_ms),
            matcher,
            metrics,
        }
    }

    /// What restarts a running monitor when a reload changes it. Left out:
    /// the matcher handle and the metrics, the supervisor's, the same
    /// across reloads.
    pub(crate) fn restart_key(&self) -> impl PartialEq + '_ {
        let UsageArgs {
            spec,
            uuids,
            proc_root,
            poll,
            matcher: _,
            metrics: _,
        } = self;
        (spec, uuids, proc_root, poll)
    }
}

/// What the monitor is told; nothing waits for a reply.
pub(crate) enum UsageMsg {
    /// One sample from the probe thread: named and published.
    Sampled { gpus: Vec<GpuProcesses> },
}

pub(crate) struct UsageState {
    args: UsageArgs,
    /// Per GPU, why the driver gave nothing last time (logged once).
    failing: Vec<Option<ListError>>,
    /// The matcher's live containers as last answered: a slow or
    /// restarting matcher does not blank every share's series.
    live: Vec<LiveContainer>,
    /// Tells the probe thread to end (it also ends when we are gone).
    stop: Arc<AtomicBool>,
    /// Set by the probe thread when it sends a sample, cleared once it is
    /// handled: while set, newer samples are dropped, so a slow matcher
    /// never piles samples up in the mailbox.
    busy: Arc<AtomicBool>,
}

impl Actor for UsageMonitor {
    type Msg = UsageMsg;
    type State = UsageState;
    type Arguments = UsageArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<UsageMsg>,
        args: UsageArgs,
    ) -> Result<UsageState, ActorProcessingErr> {
        let stop = Arc::new(AtomicBool::new(false));
        let busy = Arc::new(AtomicBool::new(false));
        let (flag, sending) = (stop.clone(), busy.clone());
        let (spec, uuids, root, poll) = (
            args.spec.clone(),
            args.uuids.clone(),
            args.proc_root.clone(),
            args.poll,
        );
        std::thread::Builder::new()
            .name("gpu-usage".into())
            .spawn(move || {
                probe::run(spec, uuids, root, poll, |gpus| {
                    if flag.load(Ordering::SeqCst) {
                        return false;
                    }
                    // The last sample is still being named: this one goes.
                    sending.swap(true, Ordering::SeqCst)
                        || myself.send_message(UsageMsg::Sampled { gpus }).is_ok()
                })
            })?;
        Ok(UsageState {
            failing: vec![None; args.uuids.len()],
            args,
            live: Vec::new(),
            stop,
            busy,
        })
    }

    async fn handle(
        &self,
        _: ActorRef<UsageMsg>,
        msg: UsageMsg,
        state: &mut UsageState,
    ) -> Result<(), ActorProcessingErr> {
        let UsageMsg::Sampled { gpus } = msg;
        for (gpu, was) in gpus.iter().zip(&mut state.failing) {
            if gpu.failed != *was {
                match &gpu.failed {
                    Some(why) => {
                        tracing::warn!(uuid = %gpu.uuid, error = %why, "cannot read the GPU's processes; its usage series are left out")
                    }
                    None => tracing::info!(uuid = %gpu.uuid, "reading the GPU's processes"),
                }
                was.clone_from(&gpu.failed);
            }
        }
        // None: the matcher is down, slow or not synced; the containers
        // it last named still name the processes.
        if let Some(live) = state.args.matcher.live().await {
            state.live = live;
        }
        let series = super::series(&gpus, &state.live);
        state.args.metrics.set_usage(Some(series));
        state.busy.store(false, Ordering::SeqCst);
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<UsageMsg>,
        state: &mut UsageState,
    ) -> Result<(), ActorProcessingErr> {
        state.stop.store(true, Ordering::SeqCst);
        state.args.metrics.set_usage(None);
        Ok(())
    }
}
