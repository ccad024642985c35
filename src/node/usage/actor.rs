//! The usage monitor actor: receives the probe thread's samples, names
//! their processes through the pod matcher's live containers and DRA's
//! prepared claims, and publishes the result on `/metrics`, replacing the
//! last, so a container gone is gone within one poll.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::probe::{self, GpuProcesses, ListError, UsageSpec};
use crate::node::dra::DraNode;
use crate::node::dra::shares::{self, ClaimBook, ClaimRef};
use crate::node::matcher::{LiveContainer, MatcherHandle};
use crate::node::metrics::Metrics;

pub(crate) struct UsageMonitor;

#[derive(Debug, Clone)]
pub(crate) struct UsageArgs {
    pub(crate) spec: UsageSpec,
    pub(crate) uuids: Vec<String>,
    pub(crate) proc_root: PathBuf,
    pub(crate) poll: Duration,
    /// The pod matcher, with the device plugin's pod matching.
    pub(crate) matcher: Option<MatcherHandle>,
    /// DRA's claims, with DRA on.
    pub(crate) claims: Option<ClaimSource>,
    pub(crate) metrics: Arc<Metrics>,
}

/// Where DRA's prepared claims are found and read.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ClaimSource {
    pub(crate) checkpoint: PathBuf,
    pub(crate) kubeconfig: PathBuf,
    pub(crate) node: DraNode,
}

impl UsageArgs {
    /// Usage of `gpus`, named through `matcher` and, with DRA on, the
    /// claims prepared on `dra_gpus`.
    pub(crate) fn new(
        config: &crate::config::Config,
        (gpus, dra_gpus): (&[crate::rules::device::Gpu], &[crate::rules::device::Gpu]),
        matcher: Option<MatcherHandle>,
        metrics: Arc<Metrics>,
    ) -> UsageArgs {
        let claims = config.dra.enabled.then(|| ClaimSource {
            checkpoint: config.dra.checkpoint_file(),
            kubeconfig: config.matcher.kubeconfig.clone(),
            node: DraNode::of(config, dra_gpus.to_vec()),
        });
        UsageArgs {
            spec: UsageSpec::new(config),
            uuids: gpus
                .iter()
                .chain(dra_gpus)
                .map(|g| g.uuid.clone())
                .collect(),
            proc_root: config.usage.proc_root.clone(),
            poll: Duration::from_millis(config.usage.poll_ms),
            matcher,
            claims,
            metrics,
        }
    }

    /// What restarts a running monitor when a reload changes it. Left out:
    /// the matcher handle and the metrics, the supervisor's, the same
    /// across reloads (but whether there is a matcher at all counts).
    pub(crate) fn restart_key(&self) -> impl PartialEq + '_ {
        let UsageArgs {
            spec,
            uuids,
            proc_root,
            poll,
            matcher,
            claims,
            metrics: _,
        } = self;
        // Pod matching switched on or off: its handle comes or goes.
        (spec, uuids, proc_root, poll, claims, matcher.is_some())
    }
}

/// What the monitor is told; nothing waits for a reply.
pub(crate) enum UsageMsg {
    /// One sample from the probe thread: named and published. With DRA,
    /// the claims its checkpoint named then (None: it could not be read).
    Sampled {
        gpus: Vec<GpuProcesses>,
        prepared: Option<Vec<ClaimRef>>,
    },
}

pub(crate) struct UsageState {
    args: UsageArgs,
    /// Per GPU, why the driver gave nothing last time (logged once).
    failing: Vec<Option<ListError>>,
    /// The matcher's live containers as last answered: a slow or
    /// restarting matcher does not blank every share's series.
    live: Vec<LiveContainer>,
    /// DRA's claims as last read, with DRA on.
    claims: Option<ClaimBook>,
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
        let claims = match &args.claims {
            None => None,
            Some(source) => Some(ClaimBook::new(
                crate::net::kube_client::from_kubeconfig(&source.kubeconfig, "matcher.kubeconfig")
                    .await?,
                source.node.clone(),
            )),
        };
        let checkpoint = args.claims.as_ref().map(|c| c.checkpoint.clone());
        std::thread::Builder::new()
            .name("gpu-usage".into())
            .spawn(move || {
                // Whether the checkpoint could not be read last time (logged once).
                let unread = std::cell::Cell::new(false);
                probe::run(spec, uuids, root, poll, |gpus| {
                    if flag.load(Ordering::SeqCst) {
                        return false;
                    }
                    // The last sample is still being named: this one goes.
                    if sending.swap(true, Ordering::SeqCst) {
                        return true;
                    }
                    // Read here, off the actor: a file read blocks.
                    let prepared = checkpoint.as_deref().and_then(|path| {
                        let read = shares::prepared(path);
                        if let Err(e) = &read
                            && !unread.replace(true)
                        {
                            tracing::warn!(error = %e, "cannot name DRA's shares");
                        }
                        unread.set(read.is_err());
                        read.ok()
                    });
                    myself
                        .send_message(UsageMsg::Sampled { gpus, prepared })
                        .is_ok()
                })
            })?;
        Ok(UsageState {
            failing: vec![None; args.uuids.len()],
            args,
            live: Vec::new(),
            claims,
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
        let UsageMsg::Sampled { gpus, prepared } = msg;
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
        if let Some(matcher) = &state.args.matcher
            && let Some(live) = matcher.live().await
        {
            state.live = live;
        }
        let (claimed, grants) = match (&mut state.claims, prepared) {
            (Some(book), Some(prepared)) => {
                let stale = super::strangers(&gpus, &state.live, &book.containers());
                book.follow(&prepared, &stale).await;
                (book.containers(), book.grants())
            }
            // Unreadable just now: what was read last still holds.
            (Some(book), None) => (book.containers(), book.grants()),
            (None, _) => Default::default(),
        };
        let mut series = super::series(&gpus, &state.live, &claimed);
        series.claims = grants;
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
