//! GPU health. A probe thread checks the GPUs (NVML: critical XID events and
//! a query that fails when a GPU fell off the bus; mock: a file per UUID in
//! `health.mock_dir`), the monitor actor turns its rounds into Healthy /
//! Unhealthy with a recovery window and reports every change (the supervisor
//! pushes it to all plugins, whose ListAndWatch streams send the new list)
//! and every XID event (the pod matcher tells the pods on that GPU).

mod actor;
mod probe;
mod tracker;

pub(crate) use actor::{HealthArgs, HealthMonitor, HealthNews, HealthReport};
#[cfg(test)]
pub(crate) use probe::Xid;
pub(crate) use probe::{Failure, GpuFault, HealthMode, ProbeSpec};

/// How the configured backend will check `gpus`: asks NVML off the async
/// threads, as the probe thread will.
pub(crate) async fn mode(
    config: &crate::config::Config,
    gpus: &[crate::rules::device::Gpu],
) -> HealthMode {
    let spec = ProbeSpec::new(config);
    let uuids: Vec<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
    tokio::task::spawn_blocking(move || probe::mode(&spec, &uuids))
        .await
        .expect("health mode probe panicked")
}
