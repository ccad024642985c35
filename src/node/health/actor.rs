//! The health monitor actor: receives the probe thread's rounds, keeps the
//! tracker, reports when health changes. It knows nothing of who listens:
//! its one outgoing message goes through [`HealthReport`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::probe::{self, ProbeSpec, Round};
use super::tracker::HealthTracker;

pub(crate) struct HealthMonitor;

/// Where the monitor sends every change of the GPUs' health (one flag per
/// GPU, in plan order).
pub(crate) type HealthReport = Arc<dyn Fn(Arc<[bool]>) + Send + Sync>;

#[derive(Clone)]
pub(crate) struct HealthArgs {
    pub(crate) spec: ProbeSpec,
    pub(crate) uuids: Vec<String>,
    pub(crate) poll: Duration,
    pub(crate) recovery: Duration,
    pub(crate) report: HealthReport,
}

impl HealthArgs {
    /// What restarts a running monitor when a reload changes it. Left out:
    /// where it reports, the supervisor's, the same across reloads.
    pub(crate) fn restart_key(&self) -> impl PartialEq + '_ {
        let HealthArgs {
            spec,
            uuids,
            poll,
            recovery,
            report: _,
        } = self;
        (spec, uuids, poll, recovery)
    }
}

/// What the monitor is told; nothing waits for a reply.
pub(crate) enum HealthMsg {
    /// One probe round from the probe thread (per GPU, why it failed, if
    /// it did): fed to the tracker, and a change of health is reported.
    Round { round: Round },
}

pub(crate) struct HealthState {
    uuids: Vec<String>,
    tracker: HealthTracker,
    report: HealthReport,
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
                        && myself.send_message(HealthMsg::Round { round }).is_ok()
                })
            })?;
        Ok(HealthState {
            tracker: HealthTracker::new(args.uuids.len(), args.recovery),
            uuids: args.uuids,
            report: args.report,
            stop,
        })
    }

    async fn handle(
        &self,
        _: ActorRef<HealthMsg>,
        msg: HealthMsg,
        state: &mut HealthState,
    ) -> Result<(), ActorProcessingErr> {
        let HealthMsg::Round { round } = msg;
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
            (state.report)(now);
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    const WAIT: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn reports_a_gpu_failing_and_recovering_to_whoever_listens() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, mut reports) = mpsc::unbounded_channel();
        let args = HealthArgs {
            spec: ProbeSpec::Mock {
                dir: Some(dir.path().to_owned()),
            },
            uuids: vec!["GPU-a".into(), "GPU-b".into()],
            poll: Duration::from_millis(10),
            recovery: Duration::ZERO,
            report: Arc::new(move |healthy| {
                let _ = tx.send(healthy);
            }),
        };
        let (monitor, handle) = Actor::spawn(None, HealthMonitor, args).await.unwrap();
        let mut next = async || {
            let r = tokio::time::timeout(WAIT, reports.recv()).await;
            r.expect("no report").expect("monitor gone")
        };
        std::fs::write(dir.path().join("GPU-b"), "").unwrap();
        assert_eq!(*next().await, [true, false]);
        std::fs::remove_file(dir.path().join("GPU-b")).unwrap();
        assert_eq!(*next().await, [true, true]);
        monitor.stop(None);
        handle.await.unwrap();
    }
}
