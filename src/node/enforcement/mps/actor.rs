//! The MPS actor, a child of the supervisor: it starts each GPU's control
//! daemon that does not answer (one that does, left by an earlier run of
//! this daemon, is kept with its clients), then asks every one each tick.
//! A GPU whose control daemon does not answer makes the daemon unready,
//! naming it, and fails the actor, so the supervisor restarts it with its
//! backoff and the restart starts that control daemon again. Shared
//! Allocates do not wait for the tick: each asks its GPU's control daemon
//! itself (see `enforcement`), so they are refused at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::Control;
use crate::node::metrics::Metrics;
use crate::node::readiness::{Child, Hold, Readiness};

/// How long a control daemon just started may take to answer.
const START_GRACE: Duration = Duration::from_secs(3);

pub(crate) struct MpsDaemons;

#[derive(Debug, Clone)]
pub(crate) struct MpsArgs {
    /// One per GPU, in plan order.
    pub(crate) controls: Vec<Control>,
    pub(crate) tick: Duration,
    pub(crate) readiness: Arc<Readiness>,
    pub(crate) metrics: Arc<Metrics>,
}

impl MpsArgs {
    /// What restarts the running actor when a reload changes it. Left
    /// out: the readiness marks and the metrics, the supervisor's.
    pub(crate) fn restart_key(&self) -> impl PartialEq + '_ {
        let MpsArgs {
            controls,
            tick,
            readiness: _,
            metrics: _,
        } = self;
        (controls, tick)
    }
}

/// What the actor tells itself; nothing waits for a reply.
pub(crate) enum MpsMsg {
    /// Ask every control daemon (first starting those that do not answer
    /// when `start`); fail if one does not answer.
    Check { start: bool },
}

pub(crate) struct MpsState {
    args: MpsArgs,
}

/// Per control daemon, in order, why it does not answer (None: it does).
async fn unanswered(controls: &[Control], start: bool) -> Vec<Option<String>> {
    let controls = controls.to_vec();
    tokio::task::spawn_blocking(move || {
        (controls.iter())
            .map(|c| check(c, start).err().map(|e| e.to_string()))
            .collect()
    })
    .await
    .expect("MPS check panicked")
}

/// Asks `c`; when it does not answer and `start` says so, starts it and
/// waits for its first answer.
fn check(c: &Control, start: bool) -> Result<(), super::MpsError> {
    let asked = c.ping();
    if asked.is_ok() || !start {
        return asked;
    }
    tracing::info!(gpu = c.uuid(), "starting its MPS control daemon");
    c.start()?;
    let deadline = Instant::now() + START_GRACE;
    loop {
        match c.ping() {
            Err(_) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            done => return done,
        }
    }
}

impl MpsState {
    fn report(&self, why: Option<String>) {
        self.args.readiness.hold(Child::Mps, Hold::Waiting, why);
    }

    /// Each GPU's control daemon up or not on `/metrics`, and readiness
    /// held back by those that are not (named, joined); that, or None.
    fn publish(&self, found: &[Option<String>]) -> Option<String> {
        let controls = self.args.controls.iter().zip(found);
        let up = controls
            .clone()
            .map(|(c, why)| (c.uuid().to_owned(), why.is_none()));
        self.args.metrics.set_mps(Some(up.collect()));
        let down: Vec<String> = controls
            .filter_map(|(c, why)| Some(format!("{}: {}", c.uuid(), why.as_ref()?)))
            .collect();
        let why = (!down.is_empty()).then(|| down.join("; "));
        self.report(why.clone());
        why
    }
}

impl Actor for MpsDaemons {
    type Msg = MpsMsg;
    type State = MpsState;
    type Arguments = MpsArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<MpsMsg>,
        args: MpsArgs,
    ) -> Result<MpsState, ActorProcessingErr> {
        let state = MpsState { args };
        // Unready until the first check: starting them takes a while, off
        // the supervisor's start.
        state.report(Some("starting the control daemons".into()));
        myself.send_message(MpsMsg::Check { start: true })?;
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<MpsMsg>,
        msg: MpsMsg,
        state: &mut MpsState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            MpsMsg::Check { start } => {
                let found = unanswered(&state.args.controls, start).await;
                if let Some(why) = state.publish(&found) {
                    tracing::error!(error = %why, "MPS control daemon not answering: shared grants on its GPU are refused");
                    return Err(why.into());
                }
                if start {
                    let gpus = state.args.controls.len();
                    tracing::info!(gpus, "MPS control daemons answer");
                }
                myself.send_after(state.args.tick, || MpsMsg::Check { start: false });
            }
        }
        Ok(())
    }

    /// Stopped on purpose (MPS switched off, shutdown): its series go. A
    /// failed check skips this, so the series says which daemon is down
    /// until the restart asks again.
    async fn post_stop(
        &self,
        _: ActorRef<MpsMsg>,
        state: &mut MpsState,
    ) -> Result<(), ActorProcessingErr> {
        state.args.metrics.set_mps(None);
        Ok(())
    }
}
