//! The health monitor actor: receives the probe thread's rounds, keeps the
//! tracker, reports when health changes and every XID event. It knows
//! nothing of who listens: its news goes through [`HealthReport`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::probe::{self, Failure, GpuFault, ProbeSpec, Round};
use super::tracker::HealthTracker;

pub(crate) struct HealthMonitor;

/// What the monitor reports.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum HealthNews {
    /// The GPUs' health changed: one flag per GPU, in plan order, and why
    /// each unhealthy one failed last.
    Changed {
        healthy: Arc<[bool]>,
        why: Arc<[Option<Failure>]>,
    },
    /// An XID event on a GPU, whether or not it changed its health.
    Fault(GpuFault),
}

/// Where the monitor sends its news.
pub(crate) type HealthReport = Arc<dyn Fn(HealthNews) + Send + Sync>;

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
    /// Per GPU, the last failure seen.
    why: Vec<Option<Failure>>,
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
            why: vec![None; args.uuids.len()],
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
        for fault in round.faults {
            tracing::warn!(uuid = %fault.uuid, xid = %fault.xid, critical = fault.xid.critical(), "GPU fault");
            (state.report)(HealthNews::Fault(fault));
        }
        let failing: Vec<bool> = round.failed.iter().map(Option::is_some).collect();
        for (why, failed) in state.why.iter_mut().zip(round.failed) {
            if failed.is_some() {
                *why = failed;
            }
        }
        let before = state.tracker.healthy();
        if let Some(now) = state.tracker.observe(&failing, Instant::now()) {
            for (g, uuid) in state.uuids.iter().enumerate() {
                match (before[g], now[g]) {
                    (true, false) => {
                        let reason = state.why[g].as_ref().map(ToString::to_string);
                        tracing::warn!(%uuid, reason = reason.unwrap_or_default(), "GPU unhealthy");
                    }
                    (false, true) => tracing::info!(%uuid, "GPU healthy again"),
                    _ => {}
                }
            }
            let why = now
                .iter()
                .zip(&state.why)
                .map(|(healthy, why)| why.clone().filter(|_| !healthy))
                .collect();
            (state.report)(HealthNews::Changed { healthy: now, why });
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
            report: Arc::new(move |news| {
                let _ = tx.send(news);
            }),
        };
        let (monitor, handle) = Actor::spawn(None, HealthMonitor, args).await.unwrap();
        let mut next = async || {
            let r = tokio::time::timeout(WAIT, reports.recv()).await;
            r.expect("no report").expect("monitor gone")
        };
        // The first round is news, changed or not.
        let all_healthy = HealthNews::Changed {
            healthy: [true, true].into(),
            why: [None, None].into(),
        };
        assert_eq!(next().await, all_healthy);
        let flag = dir.path().join("GPU-b");
        std::fs::write(&flag, "").unwrap();
        assert_eq!(
            next().await,
            HealthNews::Changed {
                healthy: [true, false].into(),
                why: [None, Some(Failure::MockFlag(flag.clone()))].into()
            }
        );
        std::fs::remove_file(&flag).unwrap();
        assert_eq!(next().await, all_healthy);
        // An application's XID: news, and the GPU stays healthy.
        std::fs::write(dir.path().join("GPU-a.xid"), "43").unwrap();
        assert_eq!(
            next().await,
            HealthNews::Fault(GpuFault {
                uuid: "GPU-a".into(),
                xid: super::super::probe::Xid(Some(43))
            })
        );
        monitor.stop(None);
        handle.await.unwrap();
    }
}
