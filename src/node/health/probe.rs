//! The probe thread. NVML calls block, so they run here, never on an actor;
//! the thread owns its NVML handle and event set and ends when its monitor
//! is gone.

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
    /// A file `<dir>/<uuid>` makes that GPU fail; no dir: always healthy.
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

/// One round: per GPU, `Some(reason)` when it failed.
pub(crate) type Round = Vec<Option<String>>;

/// Runs rounds every `poll` until `report` returns false.
pub(crate) fn run(
    spec: ProbeSpec,
    uuids: Vec<String>,
    poll: Duration,
    report: impl Fn(Round) -> bool,
) {
    match spec {
        ProbeSpec::Mock { dir } => loop {
            let round = uuids
                .iter()
                .map(|u| {
                    let flag = dir.as_ref()?.join(u);
                    flag.exists()
                        .then(|| format!("mock health file {} exists", flag.display()))
                })
                .collect();
            if !report(round) {
                return;
            }
            std::thread::sleep(poll);
        },
        ProbeSpec::Nvml => run_nvml(&uuids, poll, &report),
    }
}

fn run_nvml(uuids: &[String], poll: Duration, report: &impl Fn(Round) -> bool) {
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(e) => {
            // Discovery worked a moment ago; a library that stops loading
            // is a node problem: report every GPU until it comes back.
            while report(vec![Some(format!("NVML: {e}")); uuids.len()]) {
                std::thread::sleep(poll);
            }
            return;
        }
    };
    // Without events (not supported on some GPU) the polled query still runs.
    let events = xid_events(&nvml, uuids).ok().map(|(set, _)| set);
    loop {
        let failed = |u: &String| query(&nvml, u).err().map(|e| e.to_string());
        let mut round: Round = uuids.iter().map(failed).collect();
        let wait_ms = u32::try_from(poll.as_millis()).unwrap_or(u32::MAX);
        match &events {
            Some(set) => {
                // Waiting for an event is also the poll interval.
                if let Ok(event) = set.wait(wait_ms) {
                    let uuid = event.device.uuid().ok();
                    let xid = match event.event_data {
                        Some(XidError::Value(x)) => Some(x),
                        _ => None,
                    };
                    let critical = xid.is_none_or(|x| !APPLICATION_XIDS.contains(&x));
                    if let (Some(uuid), true) = (uuid, critical)
                        && let Some(g) = uuids.iter().position(|u| *u == uuid)
                    {
                        round[g] = Some(format!("critical XID {xid:?}"));
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
        assert!(rounds[0][0].is_none());
        assert!(rounds[0][1].as_deref().unwrap().contains("GPU-b"));
    }
}
