//! The daemon: discover GPUs, plan the devices, run the actor tree until
//! told to stop, reloading the config when told to. `main` turns signals
//! into [`Control`]s; the demo passes its own.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use ractor::{Actor, ActorRef};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::{Backend, Config, ConfigError};
use crate::node::config_watch::digest;
use crate::node::enforcement::{EnforcementError, Enforcer};
use crate::node::http::Reports;
use crate::node::metrics::Metrics;
use crate::node::readiness::Readiness;
use crate::node::supervisor::{Supervisor, SupervisorArgs, SupervisorMsg};
use crate::rules::device::{DiscoverError, Gpu, Plan, PlanError, discover};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Discover(#[from] DiscoverError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Dra(#[from] crate::node::dra::UnknownGpu),
    #[error("cannot start the supervisor: {0}")]
    Spawn(String),
    #[error("config key `http_listen`: cannot listen on {0}: {1}")]
    Http(String, std::io::Error),
    #[error(
        "config key `device_plugin_dir`: cannot create a socket in {}: {source}; it must be the \
         kubelet's device-plugin directory, existing and writable by the daemon (the DaemonSet \
         mounts it as a hostPath of type Directory)",
        dir.display()
    )]
    SocketDir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "config section `[enforcement]`: {0}; shared grants would be refused (install it with \
         `install-enforcement`, or set `mode = \"none\"`)"
    )]
    Enforcement(EnforcementError),
}

/// Checks that the plugins can bind their sockets, finds the node's GPUs
/// and plans every enabled resource's devices: what start-up and every
/// reload must pass before anything is served.
pub async fn plan(config: &Config) -> Result<Plan, RunError> {
    if !config.resources.is_empty() {
        socket_dir(config)?;
    }
    split(config, gpus(config).await?)
}

/// The node's plan: DRA's GPUs as `[dra]` selects them, the device-plugin
/// resources' over the others.
fn split(config: &Config, gpus: Vec<Gpu>) -> Result<Plan, RunError> {
    let (dra, rest) = match config.dra.enabled {
        true => config.dra.selection().split(gpus)?,
        false => (Vec::new(), gpus),
    };
    Ok(Plan::split(config, dra, rest)?)
}

/// GPU discovery, off the async threads: NVML blocks.
async fn gpus(config: &Config) -> Result<Vec<Gpu>, DiscoverError> {
    let c = config.clone();
    tokio::task::spawn_blocking(move || discover(&c))
        .await
        .expect("GPU discovery panicked")
}

fn socket_dir(config: &Config) -> Result<(), RunError> {
    let dir = &config.device_plugin_dir;
    crate::net::uds::check_bindable(dir).map_err(|source| RunError::SocketDir {
        dir: dir.clone(),
        source,
    })
}

/// What `check-config` found.
pub struct Checked {
    /// `None` off a GPU node: the plan needs the node's GPUs.
    pub plan: Option<Plan>,
    /// What could not be checked on this machine, and why.
    pub notes: Vec<String>,
}

/// The checks of [`plan`] (and the node name the config needs), made on any
/// machine: what this one lacks and a node has (NVML, `$NODE_NAME`, the
/// kubelet's directory) is a note; everything present is checked as
/// start-up checks it, so a config that passes here on a node starts there.
pub async fn check(config: &Config) -> Result<Checked, RunError> {
    let mut notes = Vec::new();
    if config.require_node_name().is_err() {
        notes.push(
            "node_name is empty and $NODE_NAME is not set here; pod_matching needs it, and \
             the DaemonSet sets NODE_NAME on the node"
                .to_owned(),
        );
    }
    match socket_dir(config) {
        Err(RunError::SocketDir { dir, source }) if source.kind() == ErrorKind::NotFound => notes
            .push(format!(
                "device_plugin_dir {} does not exist here; the daemon refuses to start \
                 without it",
                dir.display()
            )),
        other => other?,
    }
    let mps = &config.enforcement.mps;
    if config.enforcement.compute() == crate::node::enforcement::Compute::Mps
        && !mps.control_binary.exists()
    {
        notes.push(format!(
            "enforcement.mps.control_binary {} does not exist here; on a node, shared grants \
             are refused until its MPS control daemons answer",
            mps.control_binary.display()
        ));
    }
    if let Some(enforcer) = Enforcer::new(&config.enforcement).filter(Enforcer::preloads) {
        let dir = &config.enforcement.library_dir;
        if dir.exists() {
            enforcer.check().map_err(RunError::Enforcement)?;
        } else {
            notes.push(format!(
                "enforcement.library_dir {} does not exist here; on a node, shared grants are \
                 refused until libvgpu.so is installed there",
                dir.display()
            ));
        }
    }
    let plan = match gpus(config).await {
        Err(DiscoverError::Load(e)) => {
            notes.push(format!(
                "cannot load NVML ({e}): the device plan needs the node's GPUs; \
                 run check-config on the node"
            ));
            None
        }
        found => Some(split(config, found?)?),
    };
    Ok(Checked { plan, notes })
}

/// What the daemon is told while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Re-read the config file (SIGHUP); a bad one is logged and the old one
    /// kept.
    Reload,
    /// The config file's content changed: reload as on `Reload`, unless
    /// those very bytes were the last loaded or refused (a SIGHUP already
    /// took them).
    Edited,
    Stop,
}

/// The daemon once started: its HTTP address, a way to tell it what
/// [`run`]'s stream tells it, and its end.
pub struct Running {
    /// Where `http_listen` was bound at start (`:0` picks a free port);
    /// None when it is empty. A reload that changes `http_listen` moves
    /// the endpoint, and this address then no longer answers.
    pub http: Option<SocketAddr>,
    controls: mpsc::UnboundedSender<Control>,
    reloads: watch::Receiver<Option<Reloaded>>,
    done: JoinHandle<Result<(), RunError>>,
}

/// How the last reload went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reloaded {
    /// The file's new content passed every check and went to the actors
    /// (the applied-reloads count follows once every one took it).
    Applied,
    /// Refused, and why (what the log says); the previous config serves on.
    Refused(String),
}

impl Running {
    /// The outcome of the last reload that read new bytes (None before
    /// the first), changing as reloads are applied or refused.
    pub fn reloads(&self) -> watch::Receiver<Option<Reloaded>> {
        self.reloads.clone()
    }

    /// Tells the daemon `control`; false once it has stopped.
    pub fn send(&self, control: Control) -> bool {
        self.controls.send(control).is_ok()
    }

    /// A sender of [`Control`]s to the daemon, for whoever else tells it.
    pub fn controls(&self) -> mpsc::UnboundedSender<Control> {
        self.controls.clone()
    }

    /// Whether the daemon has stopped.
    pub fn is_finished(&self) -> bool {
        self.done.is_finished()
    }

    /// Waits until the daemon stops (on [`Control::Stop`], or once every
    /// sender of controls is gone) and its actors have ended.
    pub async fn ended(self) -> Result<(), RunError> {
        let Running { controls, done, .. } = self;
        drop(controls);
        done.await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    /// Tells the daemon to stop and waits until it has.
    pub async fn stop(self) -> Result<(), RunError> {
        self.send(Control::Stop);
        self.ended().await
    }
}

/// Starts the daemon on `config`: every start-up check passed, the HTTP
/// endpoint bound and the actor tree spawned, then returns while it runs
/// on this runtime. `source` is the file `config` came from, re-read on
/// `Reload` and `Edited`.
pub async fn start(config: Config, source: Option<PathBuf>) -> Result<Running, RunError> {
    let plan = plan(&config).await?;
    for gpu in plan.gpus() {
        tracing::info!(uuid = %gpu.uuid, index = gpu.index, memory_mib = gpu.memory_mib, numa_node = gpu.numa_node, "GPU");
    }
    let health = crate::node::health::mode(&config, plan.gpus()).await;
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
    let reports = Reports {
        metrics: Arc::new(Metrics::default()),
        readiness: Arc::new(Readiness::default()),
    };
    let metrics = reports.metrics.clone();
    // The bytes `config` came from; the file may since have changed, which
    // the watch then reports.
    let tried = match source.as_deref() {
        Some(p) => std::fs::read(p).map(|b| digest(&b)).unwrap_or_default(),
        None => digest(crate::config::DEFAULT_TOML.as_bytes()),
    };
    metrics.config_loaded(tried.clone());
    let (told_reloads, reloads) = watch::channel(None);
    let serving = Serving {
        http: Http::start(&config, &reports).await?,
        source,
        tried,
        reports: reports.clone(),
        reloads: told_reloads,
    };
    let http = serving.http.endpoint.as_ref().map(|e| e.addr);
    let args = SupervisorArgs {
        config,
        plan,
        metrics,
        readiness: reports.readiness,
    };
    let (supervisor, handle) = Actor::spawn(None, Supervisor, args)
        .await
        .map_err(|e| RunError::Spawn(e.to_string()))?;
    let (controls, told) = mpsc::unbounded_channel();
    let done = tokio::spawn(serve(serving, supervisor, handle, told));
    Ok(Running {
        http,
        controls,
        reloads,
        done,
    })
}

/// Runs the daemon until `controls` says stop or ends. `source` is the file
/// `config` came from, re-read on `Reload` and `Edited`.
pub async fn run(
    config: Config,
    source: Option<PathBuf>,
    mut controls: impl Stream<Item = Control> + Unpin,
) -> Result<(), RunError> {
    let running = start(config, source).await?;
    while let Some(control) = controls.next().await {
        if !running.send(control) || control == Control::Stop {
            break;
        }
    }
    running.stop().await
}

/// The reload loop: applies each control until `Stop` or the last sender
/// is gone, then stops the supervisor.
async fn serve(
    mut serving: Serving,
    supervisor: ActorRef<SupervisorMsg>,
    handle: ractor::concurrency::JoinHandle<()>,
    mut told: mpsc::UnboundedReceiver<Control>,
) -> Result<(), RunError> {
    while let Some(control) = told.recv().await {
        if control == Control::Stop {
            break;
        }
        if let Err(e) = serving.reload(control, &supervisor).await {
            serving.reports.metrics.config_refused();
            tracing::error!(error = %e, "reload refused; still serving the previous config");
            serving
                .reloads
                .send_replace(Some(Reloaded::Refused(e.to_string())));
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

/// What the reload loop keeps from one reload to the next.
struct Serving {
    source: Option<PathBuf>,
    /// The SHA-256 of the bytes last loaded or refused.
    tried: String,
    http: Http,
    reports: Reports,
    reloads: watch::Sender<Option<Reloaded>>,
}

impl Serving {
    /// Re-reads the file and, once the new config passes every start-up
    /// check and its `http_listen` is bound, hands it to the supervisor.
    async fn reload(
        &mut self,
        control: Control,
        supervisor: &ActorRef<SupervisorMsg>,
    ) -> Result<(), ReloadError> {
        let bytes = read_source(self.source.as_deref())?;
        let sha256 = digest(&bytes);
        if control == Control::Edited && sha256 == self.tried {
            return Ok(());
        }
        self.tried.clone_from(&sha256);
        let (config, plan) = load(&bytes).await?;
        let moved = self.http.moved(&config, &self.reports).await?;
        let config = Box::new(config);
        let _ = supervisor.send_message(SupervisorMsg::Reload { config, plan });
        // The new endpoint listens before the old one closes.
        if let Some(moved) = moved {
            self.http = moved;
        }
        self.reports.metrics.config_loaded(sha256);
        self.reloads.send_replace(Some(Reloaded::Applied));
        Ok(())
    }
}

/// The HTTP endpoint as `http_listen` and `[http]` ask: on its address
/// within those bounds, or off.
struct Http {
    listen: String,
    limits: crate::net::http::HttpLimits,
    /// Held: dropping it closes the listener.
    endpoint: Option<crate::node::http::Endpoint>,
}

impl Http {
    async fn start(config: &Config, reports: &Reports) -> Result<Http, RunError> {
        let listen = &config.http_listen;
        let limits = config.http.limits(&crate::config::DAEMON_LIMITS);
        let endpoint = if listen.is_empty() {
            None
        } else {
            let e = crate::node::http::serve(listen, limits, reports.clone())
                .await
                .map_err(|e| RunError::Http(listen.to_owned(), e))?;
            tracing::info!(addr = %e.addr, "HTTP endpoint listening (/metrics, /healthz, /readyz)");
            Some(e)
        };
        Ok(Http {
            listen: listen.to_owned(),
            limits,
            endpoint,
        })
    }

    /// The endpoint for a reload to `config`, newly bound; None when
    /// `http_listen` did not change. The caller drops this one, which
    /// closes it, once the reload is applied. New bounds on the same
    /// address apply at once, on the listener already bound.
    async fn moved(
        &mut self,
        config: &Config,
        reports: &Reports,
    ) -> Result<Option<Http>, RunError> {
        if config.http_listen == self.listen {
            let limits = config.http.limits(&crate::config::DAEMON_LIMITS);
            if limits != self.limits {
                if let Some(e) = &mut self.endpoint {
                    e.rebound(limits, reports.clone());
                }
                self.limits = limits;
            }
            return Ok(None);
        }
        let next = Http::start(config, reports).await?;
        tracing::info!(from = %self.listen, to = %config.http_listen, "http_listen changed; the old endpoint closes");
        Ok(Some(next))
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ReloadError {
    #[error("the daemon runs on the built-in config; there is no file to re-read")]
    NoFile,
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Run(#[from] RunError),
}

fn read_source(source: Option<&Path>) -> Result<Vec<u8>, ReloadError> {
    let path = source.ok_or(ReloadError::NoFile)?;
    std::fs::read(path).map_err(|e| {
        ReloadError::Config(ConfigError::Read {
            path: path.to_owned(),
            source: e,
        })
    })
}

/// The config in `bytes`, checked as at start, and its plan.
async fn load(bytes: &[u8]) -> Result<(Config, Plan), ReloadError> {
    let text = std::str::from_utf8(bytes)
        .map_err(|e| ConfigError::Parse(format!("the file is not UTF-8: {e}")))?;
    let config = Config::from_toml(text, std::env::var("NODE_NAME").ok())?;
    let plan = plan(&config).await?;
    Ok((config, plan))
}
