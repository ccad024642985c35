//! The usage probe thread. NVML calls and `/proc` reads block, so they run
//! here, never on an actor: every poll it asks each GPU for its compute
//! processes (MPS clients included) and their SM utilisation since the last
//! poll, and reads each process's cgroup to find its pod and container.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::{Device, Nvml};

use super::cgroup::{self, Owner};
use crate::config::{Backend, Config};

/// Where processes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum UsageSpec {
    /// `<dir>/<uuid>.procs` lists that GPU's processes, one a line:
    /// `pid memory_bytes sm_percent`, `-` for a figure the driver would
    /// not give; no dir or no file: none.
    Mock {
        dir: Option<PathBuf>,
    },
    Nvml,
}

impl UsageSpec {
    pub(crate) fn new(config: &Config) -> UsageSpec {
        let dir = &config.usage.mock_dir;
        match config.devices.backend {
            Backend::Nvml => UsageSpec::Nvml,
            Backend::Mock => UsageSpec::Mock {
                dir: (!dir.as_os_str().is_empty()).then(|| dir.clone()),
            },
        }
    }
}

/// One process on one GPU, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Process {
    pub(crate) pid: u32,
    /// Device memory it holds; None where the driver does not say.
    pub(crate) memory_bytes: Option<u64>,
    /// Its share of the GPU's SMs over the last poll, in percent; None
    /// where the driver has no sample for it.
    pub(crate) sm_percent: Option<u32>,
}

/// Why the driver gave no process list for a GPU. NVML's own errors are
/// kept as their text: the message is all that is logged, and a sample
/// must compare with the last to log only changes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ListError {
    #[error("NVML: {0}")]
    NoNvml(String),
    #[error("NVML lost the GPU: {0}")]
    Lost(String),
    #[error("NVML cannot list its processes: {0}")]
    Failed(String),
    #[error("the process list kept growing")]
    Grew,
}

/// One GPU's processes, each with its pod and container where it has one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct GpuProcesses {
    pub(crate) uuid: String,
    pub(crate) processes: Vec<(Process, Option<Owner>)>,
    /// Why the driver gave nothing for this GPU, if it did not.
    pub(crate) failed: Option<ListError>,
}

/// Runs a sample every `poll` until `report` returns false.
pub(crate) fn run(
    spec: UsageSpec,
    uuids: Vec<String>,
    proc_root: PathBuf,
    poll: Duration,
    report: impl Fn(Vec<GpuProcesses>) -> bool,
) {
    let owners = |found: Vec<(String, Result<Vec<Process>, ListError>)>| -> Vec<GpuProcesses> {
        found
            .into_iter()
            .map(|(uuid, listed)| match listed {
                Ok(processes) => GpuProcesses {
                    uuid,
                    processes: processes
                        .into_iter()
                        .map(|p| (p, owner_of(&proc_root, p.pid)))
                        .collect(),
                    failed: None,
                },
                Err(why) => GpuProcesses {
                    uuid,
                    processes: Vec::new(),
                    failed: Some(why),
                },
            })
            .collect()
    };
    match spec {
        UsageSpec::Mock { dir } => loop {
            let found = uuids
                .iter()
                .map(|u| (u.clone(), Ok(mock_processes(dir.as_deref(), u))))
                .collect();
            if !report(owners(found)) {
                return;
            }
            std::thread::sleep(poll);
        },
        UsageSpec::Nvml => {
            let nvml = Nvml::init();
            // Per GPU, the newest utilisation sample seen (µs).
            let mut seen: HashMap<String, u64> = HashMap::new();
            loop {
                let found = uuids
                    .iter()
                    .map(|u| {
                        let listed = match &nvml {
                            Ok(nvml) => nvml_processes(nvml, u, &mut seen),
                            Err(e) => Err(ListError::NoNvml(e.to_string())),
                        };
                        (u.clone(), listed)
                    })
                    .collect();
                if !report(owners(found)) {
                    return;
                }
                std::thread::sleep(poll);
            }
        }
    }
}

/// The pod and container of process `pid`, from its cgroup under
/// `proc_root` (the host's `/proc`); None when it is gone or in none.
fn owner_of(proc_root: &Path, pid: u32) -> Option<Owner> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok()?;
    cgroup::owner(&text)
}

/// A mock GPU's processes: its `.procs` file's well-formed lines.
fn mock_processes(dir: Option<&Path>, uuid: &str) -> Vec<Process> {
    let Some(text) =
        dir.and_then(|d| std::fs::read_to_string(d.join(format!("{uuid}.procs"))).ok())
    else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let pid = fields.next()?.parse().ok()?;
            let memory_bytes = fields.next()?.parse().ok();
            let sm_percent = fields.next()?.parse().ok();
            Some(Process {
                pid,
                memory_bytes,
                sm_percent,
            })
        })
        .collect()
}

/// A list that grew between NVML's count and its fill is asked again.
const LIST_TRIES: usize = 3;

/// One GPU's compute processes and MPS clients, with the SM utilisation
/// NVML sampled for each since the last call.
fn nvml_processes(
    nvml: &Nvml,
    uuid: &str,
    seen: &mut HashMap<String, u64>,
) -> Result<Vec<Process>, ListError> {
    let device = (nvml.device_by_uuid(uuid)).map_err(|e| ListError::Lost(e.to_string()))?;
    let mut infos = listed(|| device.running_compute_processes())?;
    // MPS clients: not every driver lists them; without MPS the list is
    // empty.
    if let Ok(clients) = listed(|| device.mps_running_compute_processes()) {
        for c in clients {
            if !infos.iter().any(|i| i.pid == c.pid) {
                infos.push(c);
            }
        }
    }
    let sm = sm_samples(&device, seen.entry(uuid.to_owned()).or_default());
    Ok(infos
        .into_iter()
        .map(|i| Process {
            pid: i.pid,
            memory_bytes: match i.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(b),
                UsedGpuMemory::Unavailable => None,
            },
            sm_percent: sm.get(&i.pid).copied(),
        })
        .collect())
}

fn listed(
    list: impl Fn() -> Result<Vec<ProcessInfo>, NvmlError>,
) -> Result<Vec<ProcessInfo>, ListError> {
    for _ in 0..LIST_TRIES {
        match list() {
            Err(NvmlError::InsufficientSize(_)) => {}
            other => return other.map_err(|e| ListError::Failed(e.to_string())),
        }
    }
    Err(ListError::Grew)
}

/// Per PID, its newest SM utilisation sample after `*seen` (µs), which
/// moves to the newest sample. None found (NVML's NotFound, or no support):
/// nothing, rather than a guess.
fn sm_samples(device: &Device, seen: &mut u64) -> HashMap<u32, u32> {
    let mut newest: HashMap<u32, (u64, u32)> = HashMap::new();
    if let Ok(samples) = device.process_utilization_stats(*seen) {
        for s in samples {
            *seen = (*seen).max(s.timestamp);
            let slot = newest.entry(s.pid).or_insert((s.timestamp, s.sm_util));
            if s.timestamp >= slot.0 {
                *slot = (s.timestamp, s.sm_util);
            }
        }
    }
    newest.into_iter().map(|(pid, (_, sm))| (pid, sm)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn mock_processes_are_read_and_owned_through_their_cgroups() {
        let dir = tempfile::tempdir().unwrap();
        let proc_root = dir.path().join("proc");
        let uid = "5f3c2a1b-0d4e-4c6f-8a9b-1c2d3e4f5a6b";
        let id = "9e1f0c3a7b5d2e4f6a8c0b1d3e5f7a9c2b4d6e8f0a1c3e5b7d9f1a3c5e7b9d0f";
        std::fs::create_dir_all(proc_root.join("41")).unwrap();
        std::fs::write(
            proc_root.join("41/cgroup"),
            format!("0::/kubepods/besteffort/pod{uid}/{id}\n"),
        )
        .unwrap();
        // 41 in a pod, 42 a host process (no /proc entry: gone), a garbled line.
        std::fs::write(
            dir.path().join("GPU-a.procs"),
            "41 1048576 30\n42 2048 -\nnonsense\n",
        )
        .unwrap();
        let samples = Mutex::new(Vec::new());
        let spec = UsageSpec::Mock {
            dir: Some(dir.path().to_owned()),
        };
        run(
            spec,
            vec!["GPU-a".into(), "GPU-b".into()],
            proc_root,
            Duration::ZERO,
            |s| {
                samples.lock().unwrap().push(s);
                false
            },
        );
        let samples = samples.into_inner().unwrap();
        let gpus = &samples[0];
        assert_eq!(gpus.len(), 2);
        assert_eq!(
            gpus[0].processes,
            [
                (
                    Process {
                        pid: 41,
                        memory_bytes: Some(1 << 20),
                        sm_percent: Some(30)
                    },
                    Some(Owner {
                        pod_uid: uid.into(),
                        container_id: id.into()
                    })
                ),
                (
                    Process {
                        pid: 42,
                        memory_bytes: Some(2048),
                        sm_percent: None
                    },
                    None
                ),
            ]
        );
        assert!(gpus[1].processes.is_empty() && gpus[1].failed.is_none());
    }
}
