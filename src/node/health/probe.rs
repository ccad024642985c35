//! The probe thread. NVML calls block, so they run here, never on an actor;
//! the thread owns its NVML handle and event set and ends when its monitor
//! is gone. Every XID event is reported as a [`GpuFault`], an application's
//! too: on a GPU shared through MPS one client's fault ends every client of
//! that GPU's server, and their pods are told. Only the critical ones fail
//! the GPU.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::{NvmlError, NvmlErrorWithSource};
use nvml_wrapper::{EventSet, Nvml};

use crate::config::{Backend, Config};

/// XIDs caused by an application, not the GPU (as NVIDIA's plugin skips
/// them): a crashing container must not take a GPU from everyone else.
const APPLICATION_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];

/// What to check.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ProbeSpec {
    /// A file `<dir>/<uuid>` makes that GPU fail; a file `<dir>/<uuid>.xid`
    /// holding a number is one XID event on it, taken (the file removed)
    /// as NVML's queue hands an event out once; no dir: always healthy.
    Mock {
        dir: Option<PathBuf>,
    },
    Nvml,
}

impl ProbeSpec {
    pub(crate) fn new(config: &Config) -> ProbeSpec {
        let dir = &config.health.mock_dir;
        match config.devices.backend {
            Backend::Nvml => ProbeSpec::Nvml,
            Backend::Mock => ProbeSpec::Mock {
                dir: (!dir.as_os_str().is_empty()).then(|| dir.clone()),
            },
        }
    }
}

/// How GPU failures are noticed, for the start-up log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HealthMode {
    /// Critical XID events arrive as they happen, on this many GPUs.
    XidEvents(usize),
    /// Only the periodic query, and why.
    Polling(String),
}

impl fmt::Display for HealthMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HealthMode::XidEvents(n) => write!(f, "XID events registered on {n} GPUs"),
            HealthMode::Polling(why) => write!(f, "polling only ({why})"),
        }
    }
}

/// What the probe thread will do with `spec` (blocks: NVML).
pub(crate) fn mode(spec: &ProbeSpec, uuids: &[String]) -> HealthMode {
    match spec {
        ProbeSpec::Mock { .. } => HealthMode::Polling("mock backend".into()),
        ProbeSpec::Nvml => match Nvml::init() {
            Err(e) => HealthMode::Polling(format!("NVML: {e}")),
            Ok(nvml) => match xid_events(&nvml, uuids) {
                Ok((_, n)) => HealthMode::XidEvents(n),
                Err(why) => HealthMode::Polling(why.to_string()),
            },
        },
    }
}

/// Why XID events are not available, so health is polled only.
#[derive(Debug, thiserror::Error)]
enum NoEvents {
    #[error("no NVML event set: {0}")]
    NoSet(NvmlError),
    #[error("XID events not supported on {uuid}: {source}")]
    Unsupported {
        uuid: String,
        source: NvmlErrorWithSource,
    },
}

/// An event set with critical XID events registered on every GPU NVML
/// finds, and how many that is.
fn xid_events<'n>(nvml: &'n Nvml, uuids: &[String]) -> Result<(EventSet<'n>, usize), NoEvents> {
    let mut set = nvml.create_event_set().map_err(NoEvents::NoSet)?;
    let mut registered = 0;
    for u in uuids {
        if let Ok(d) = nvml.device_by_uuid(u.as_str()) {
            set = d
                .register_events(EventTypes::CRITICAL_XID_ERROR, set)
                .map_err(|source| NoEvents::Unsupported {
                    uuid: u.clone(),
                    source,
                })?;
            registered += 1;
        }
    }
    Ok((set, registered))
}

/// Why a GPU failed a round.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum Failure {
    #[error("mock health file {0} exists")]
    MockFlag(PathBuf),
    #[error("NVML: {0}")]
    NoNvml(String),
    #[error("{0}")]
    Query(String),
    #[error("critical {0}")]
    Xid(Xid),
}

/// An XID as NVML reports it: its number, when NVML gives one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Xid(pub(crate) Option<u64>);

impl fmt::Display for Xid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(x) => write!(f, "XID {x}"),
            None => f.write_str("XID (number unknown)"),
        }
    }
}

impl Xid {
    /// Not one an application causes: the GPU itself failed.
    pub(crate) fn critical(self) -> bool {
        self.0.is_none_or(|x| !APPLICATION_XIDS.contains(&x))
    }
}

/// An XID event on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuFault {
    pub(crate) uuid: String,
    pub(crate) xid: Xid,
}

/// One round: per GPU, why it failed if it did; and the XID events seen.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Round {
    pub(crate) failed: Vec<Option<Failure>>,
    pub(crate) faults: Vec<GpuFault>,
}

impl Round {
    /// A round where GPU `uuid` had `xid`: a critical one fails it.
    fn fault(&mut self, uuids: &[String], uuid: String, xid: Xid) {
        if let Some(g) = uuids.iter().position(|u| *u == uuid) {
            if xid.critical() {
                self.failed[g] = Some(Failure::Xid(xid));
            }
            self.faults.push(GpuFault { uuid, xid });
        }
    }
}

/// Runs rounds every `poll` until `report` returns false.
pub(crate) fn run(
    spec: ProbeSpec,
    uuids: Vec<String>,
    poll: Duration,
    report: impl Fn(Round) -> bool,
) {
    match spec {
        ProbeSpec::Mock { dir } => loop {
            let mut round = Round {
                failed: uuids
                    .iter()
                    .map(|u| {
                        let flag = dir.as_ref()?.join(u);
                        flag.exists().then_some(Failure::MockFlag(flag))
                    })
                    .collect(),
                faults: Vec::new(),
            };
            for u in dir.iter().flat_map(|d| uuids.iter().map(move |u| (d, u))) {
                if let Some(xid) = take_mock_xid(&u.0.join(format!("{}.xid", u.1))) {
                    round.fault(&uuids, u.1.clone(), xid);
                }
            }
            if !report(round) {
                return;
            }
            std::thread::sleep(poll);
        },
        ProbeSpec::Nvml => run_nvml(&uuids, poll, &report),
    }
}

/// The XID a mock event file holds, the file removed so it counts once; a
/// file that cannot be removed is no event (it would repeat every round).
fn take_mock_xid(path: &std::path::Path) -> Option<Xid> {
    let text = std::fs::read_to_string(path).ok()?;
    std::fs::remove_file(path).ok()?;
    Some(Xid(text.trim().parse().ok()))
}

fn run_nvml(uuids: &[String], poll: Duration, report: &impl Fn(Round) -> bool) {
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(e) => {
            // Discovery worked a moment ago; a library that stops loading
            // is a node problem: report every GPU until it comes back.
            let lost = Round {
                failed: vec![Some(Failure::NoNvml(e.to_string())); uuids.len()],
                faults: Vec::new(),
            };
            while report(lost.clone()) {
                std::thread::sleep(poll);
            }
            return;
        }
    };
    // Without events (not supported on some GPU) the polled query still runs.
    let events = xid_events(&nvml, uuids).ok().map(|(set, _)| set);
    loop {
        let failed = |u: &String| query(&nvml, u).err().map(|e| Failure::Query(e.to_string()));
        let mut round = Round {
            failed: uuids.iter().map(failed).collect(),
            faults: Vec::new(),
        };
        let wait_ms = u32::try_from(poll.as_millis()).unwrap_or(u32::MAX);
        match &events {
            Some(set) => {
                // Waiting for an event is also the poll interval.
                match set.wait(wait_ms) {
                    Ok(event) => {
                        if let Ok(uuid) = event.device.uuid() {
                            let xid = match event.event_data {
                                Some(XidError::Value(x)) => Some(x),
                                _ => None,
                            };
                            round.fault(uuids, uuid, Xid(xid));
                        }
                    }
                    Err(NvmlError::Timeout) => {}
                    // Not a wait at all (a GPU lost, say): the queries
                    // report the GPUs; the poll interval still holds.
                    Err(e) => {
                        tracing::warn!(error = %e, "waiting for XID events failed");
                        std::thread::sleep(poll);
                    }
                }
            }
            None => std::thread::sleep(poll),
        }
        if !report(round) {
            return;
        }
    }
}

/// Why a GPU failed its polled query: the reason its round reports.
#[derive(Debug, thiserror::Error)]
enum QueryError {
    #[error("NVML lost the GPU: {0}")]
    Lost(NvmlError),
    #[error("NVML query failed: {0}")]
    Failed(NvmlError),
}

/// A query that fails when a GPU fell off the bus or lost its handle.
fn query(nvml: &Nvml, uuid: &str) -> Result<(), QueryError> {
    let d = nvml.device_by_uuid(uuid).map_err(QueryError::Lost)?;
    d.memory_info().map(|_| ()).map_err(QueryError::Failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn mock_probe_reads_one_file_per_uuid() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("GPU-b"), "").unwrap();
        let rounds = Mutex::new(Vec::new());
        let spec = ProbeSpec::Mock {
            dir: Some(dir.path().to_owned()),
        };
        run(
            spec,
            vec!["GPU-a".into(), "GPU-b".into()],
            Duration::ZERO,
            |r| {
                rounds.lock().unwrap().push(r);
                false
            },
        );
        let rounds = rounds.into_inner().unwrap();
        assert_eq!(rounds.len(), 1);
        assert!(rounds[0].failed[0].is_none());
        let failure = rounds[0].failed[1].as_ref().unwrap().to_string();
        assert!(failure.contains("GPU-b"), "{failure}");
    }

    #[test]
    fn a_mock_xid_file_is_one_fault_and_only_a_critical_xid_fails_the_gpu() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("GPU-a.xid"), "31\n").unwrap();
        std::fs::write(dir.path().join("GPU-b.xid"), "79").unwrap();
        let rounds = Mutex::new(Vec::new());
        let spec = ProbeSpec::Mock {
            dir: Some(dir.path().to_owned()),
        };
        let uuids = vec!["GPU-a".to_owned(), "GPU-b".to_owned()];
        run(spec, uuids, Duration::ZERO, |r| {
            let mut rounds = rounds.lock().unwrap();
            rounds.push(r);
            rounds.len() < 2
        });
        let rounds = rounds.into_inner().unwrap();
        let fault = |uuid: &str, x| GpuFault {
            uuid: uuid.into(),
            xid: Xid(Some(x)),
        };
        assert_eq!(rounds[0].faults, [fault("GPU-a", 31), fault("GPU-b", 79)]);
        // 31 is an application's page fault: the GPU stays healthy.
        assert_eq!(rounds[0].failed[0], None);
        assert_eq!(rounds[0].failed[1], Some(Failure::Xid(Xid(Some(79)))));
        assert_eq!(
            rounds[1],
            Round {
                failed: vec![None, None],
                faults: vec![]
            },
            "taken once"
        );
    }
}
