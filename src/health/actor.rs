//! The health monitor actor: receives the probe thread's rounds, keeps the
//! tracker, tells the supervisor when health changes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::probe::{self, ProbeSpec, Round};
use super::tracker::HealthTracker;
use crate::supervisor::SupervisorMsg;

pub struct HealthMonitor;

pub struct HealthArgs {
    pub spec: ProbeSpec,
    pub uuids: Vec<String>,
    pub poll: Duration,
    pub recovery: Duration,
    pub supervisor: ActorRef<SupervisorMsg>,
}

pub enum HealthMsg {
    Round(Round),
}

pub struct HealthState {
    uuids: Vec<String>,
    tracker: HealthTracker,
    supervisor: ActorRef<SupervisorMsg>,
    /// Tells the probe thread to end (it also ends when we are gone).
    stop: Arc<AtomicBool>,
}

impl Actor for HealthMonitor {
    type Msg = HealthMsg;
    type State = HealthState;
    type Arguments = HealthArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<HealthMsg>,
        args: HealthArgs,
    ) -> Result<HealthState, ActorProcessingErr> {
        let stop = Arc::new(AtomicBool::new(false));
        let (spec, uuids, poll, flag) = (args.spec, args.uuids.clone(), args.poll, stop.clone());
        std::thread::Builder::new()
            .name("gpu-health".into())
            .spawn(move || {
                probe::run(spec, uuids, poll, |round| {
                    !flag.load(Ordering::SeqCst)
                        && myself.send_message(HealthMsg::Round(round)).is_ok()
                })
            })?;
        Ok(HealthState {
            tracker: HealthTracker::new(args.uuids.len(), args.recovery),
            uuids: args.uuids,
            supervisor: args.supervisor,
            stop,
        })
    }

    async fn handle(
        &self,
        _: ActorRef<HealthMsg>,
        msg: HealthMsg,
        state: &mut HealthState,
    ) -> Result<(), ActorProcessingErr> {
        let HealthMsg::Round(round) = msg;
        let failing: Vec<bool> = round.iter().map(Option::is_some).collect();
        let before = state.tracker.healthy();
        if let Some(now) = state.tracker.observe(&failing, Instant::now()) {
            for (g, uuid) in state.uuids.iter().enumerate() {
                match (before[g], now[g]) {
                    (true, false) => tracing::warn!(
                        %uuid,
                        reason = round[g].as_deref().unwrap_or(""),
                        "GPU unhealthy"
                    ),
                    (false, true) => tracing::info!(%uuid, "GPU healthy again"),
                    _ => {}
                }
            }
            let _ = state.supervisor.send_message(SupervisorMsg::Health(now));
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<HealthMsg>,
        state: &mut HealthState,
    ) -> Result<(), ActorProcessingErr> {
        state.stop.store(true, Ordering::SeqCst);
        Ok(())
    }
}
