//! The daemon: discover GPUs, plan the devices, run the actor tree until
//! `shutdown` resolves, then stop it cleanly. `main` passes a signal future,
//! the demo and tests pass their own.

use std::future::Future;
use std::time::Duration;

use ractor::Actor;

use crate::config::Config;
use crate::device::{DiscoverError, Plan, PlanError, discover};
use crate::supervisor::{Supervisor, SupervisorArgs};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Discover(#[from] DiscoverError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("cannot start the supervisor: {0}")]
    Spawn(String),
}

/// Finds the node's GPUs (off the async threads: NVML blocks) and plans
/// every enabled resource's devices.
pub async fn plan(config: &Config) -> Result<Plan, RunError> {
    let c = config.clone();
    let gpus = tokio::task::spawn_blocking(move || discover(&c))
        .await
        .expect("GPU discovery panicked")?;
    Ok(Plan::new(config, gpus)?)
}

/// Runs the daemon until `shutdown` resolves.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
    let plan = plan(&config).await?;
    for gpu in plan.gpus() {
        tracing::info!(uuid = %gpu.uuid, index = gpu.index, memory_mib = gpu.memory_mib, numa_node = ?gpu.numa_node, "GPU");
    }
    if config.pod_matching {
        tracing::warn!(
            "pod_matching = true, but this build has no pod matcher yet: Allocate derives \
             each container's GPU from its device IDs, as with pod_matching = false"
        );
    }
    let args = SupervisorArgs { config, plan };
    let (supervisor, handle) = Actor::spawn(Some("supervisor".into()), Supervisor, args)
        .await
        .map_err(|e| RunError::Spawn(e.to_string()))?;
    shutdown.await;
    tracing::info!("shutting down");
    if let Err(e) = supervisor
        .stop_and_wait(Some("shutdown".into()), Some(Duration::from_secs(8)))
        .await
    {
        tracing::warn!(error = %e, "supervisor did not stop in time");
    }
    let _ = handle.await;
    Ok(())
}
