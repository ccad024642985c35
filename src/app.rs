//! The daemon: discover GPUs, plan the devices, run the actor tree until
//! told to stop, reloading the config when told to. `main` turns signals
//! into [`Control`]s; the demo passes its own.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use ractor::Actor;

use crate::config::{Backend, Config, ConfigError};
use crate::device::{DiscoverError, Plan, PlanError, discover};
use crate::metrics::Metrics;
use crate::supervisor::{Supervisor, SupervisorArgs, SupervisorMsg};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Discover(#[from] DiscoverError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("cannot start the supervisor: {0}")]
    Spawn(String),
    #[error("config key `http_listen`: cannot listen on {0}: {1}")]
    Http(String, std::io::Error),
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

/// What the daemon is told while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Re-read the config file; a bad one is logged and the old one kept.
    Reload,
    Stop,
}

/// Runs the daemon until `controls` says stop or ends. `source` is the file
/// `config` came from, re-read on `Reload`.
pub async fn run(
    config: Config,
    source: Option<PathBuf>,
    mut controls: impl Stream<Item = Control> + Unpin,
) -> Result<(), RunError> {
    let plan = plan(&config).await?;
    for gpu in plan.gpus() {
        tracing::info!(uuid = %gpu.uuid, index = gpu.index, memory_mib = gpu.memory_mib, numa_node = gpu.numa_node, "GPU");
    }
    let health = crate::health::mode(&config, plan.gpus()).await;
    let resources: Vec<String> = plan
        .models()
        .map(|m| config.resource_name(m.resource()))
        .collect();
    tracing::info!(
        version = crate::VERSION,
        config = %source.as_deref().map_or("(built-in default)".into(), |p| p.display().to_string()),
        backend = match config.devices.backend {
            Backend::Nvml => "nvml",
            Backend::Mock => "mock",
        },
        resources = resources.join(", "),
        %health,
        "starting"
    );
    let metrics = Arc::new(Metrics::default());
    if !config.http_listen.is_empty() {
        let addr = crate::http::serve(&config.http_listen, metrics.clone())
            .await
            .map_err(|e| RunError::Http(config.http_listen.clone(), e))?;
        tracing::info!(%addr, "HTTP endpoint listening (/metrics, /healthz, /readyz)");
    }
    let args = SupervisorArgs {
        config,
        plan,
        metrics,
    };
    let (supervisor, handle) = Actor::spawn(Some("supervisor".into()), Supervisor, args)
        .await
        .map_err(|e| RunError::Spawn(e.to_string()))?;
    while let Some(Control::Reload) = controls.next().await {
        match reload(source.as_deref()).await {
            Ok((config, plan)) => {
                let _ = supervisor.send_message(SupervisorMsg::Reload(Box::new((config, plan))));
            }
            Err(e) => {
                tracing::error!(error = %e, "reload refused; still serving the previous config")
            }
        }
    }
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

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("the daemon runs on the built-in config; there is no file to re-read")]
    NoFile,
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Run(#[from] RunError),
}

async fn reload(source: Option<&Path>) -> Result<(Config, Plan), ReloadError> {
    let config = Config::load(source.ok_or(ReloadError::NoFile)?)?;
    let plan = plan(&config).await?;
    Ok((config, plan))
}
