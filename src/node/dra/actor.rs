//! The DRA plugin's actor: it owns the DRA service socket and the
//! registration socket and their servers, the node's ResourceSlice, and a
//! health monitor of DRA's GPUs (a GPU turning unhealthy taints its device).
//! Everything it needs is built in `pre_start`; a server that stops, or a
//! monitor that dies, fails the actor and the supervisor restarts it. A
//! refusal from the kubelet re-creates the registration socket, which makes
//! the kubelet's plugin watcher register the plugin again.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::sync::watch;
use tokio::task::AbortHandle;

use super::cdi::CdiDir;
use super::grant::{Node, device_name};
use super::health::{GpusHealth, HealthService};
use super::prepare::{Preparer, PreparerParts};
use super::proto::health::v1::dra_resource_health_server::DraResourceHealthServer;
use super::proto::health::v1alpha1::dra_resource_health_server::DraResourceHealthServer as AlphaHealthServer;
use super::proto::registration::registration_server::RegistrationServer;
use super::proto::{v1, v1beta1};
use super::service::{DraService, RegistrationService};
use super::slices::{self, Facts, Shape};
use crate::config::Config;
use crate::node::enforcement::Enforcer;
use crate::node::grant::ResponseComposer;
use crate::node::health::{Failure, HealthArgs, HealthMonitor, HealthNews, ProbeSpec};
use crate::rules::device::{Gpu, GpuSource};

/// How soon a slice that could not be published is tried again.
const REPUBLISH: Duration = Duration::from_secs(5);
/// How long after a refusal the registration socket is made again.
const REREGISTER: Duration = Duration::from_secs(1);

pub(crate) struct DraActor;

/// The DRA plugin's arguments; any change restarts it.
#[derive(Clone, PartialEq)]
pub(crate) struct DraArgs {
    pub(crate) node: Node,
    pub(crate) registration_socket: PathBuf,
    pub(crate) service_socket: PathBuf,
    pub(crate) cdi: CdiDir,
    pub(crate) checkpoint: PathBuf,
    pub(crate) kubeconfig: PathBuf,
    pub(crate) composer: ResponseComposer,
    pub(crate) enforcer: Option<Enforcer>,
    pub(crate) shape: Shape,
    pub(crate) probe: ProbeSpec,
    pub(crate) poll: Duration,
    pub(crate) recovery: Duration,
    /// Where the GPUs' facts (product, versions, places on PCI) come from.
    pub(crate) source: GpuSource,
}

impl DraArgs {
    /// DRA over `gpus` (the ones it serves) as `config` says.
    pub(crate) fn new(config: &Config, gpus: Vec<Gpu>) -> DraArgs {
        let dra = &config.dra;
        let driver = dra.driver_name(&config.resource_domain);
        DraArgs {
            registration_socket: dra.registration_socket(&driver),
            service_socket: dra.service_socket(&driver),
            cdi: CdiDir {
                dir: dra.cdi_dir.clone(),
                driver,
            },
            checkpoint: dra.checkpoint_file(),
            kubeconfig: config.matcher.kubeconfig.clone(),
            composer: ResponseComposer::new(config),
            enforcer: Enforcer::new(&config.enforcement),
            shape: Shape {
                consumable: dra.consumable_capacity,
                memory_unit_mib: config.memory_unit_mib,
            },
            probe: ProbeSpec::new(config),
            poll: Duration::from_millis(config.health.poll_ms),
            recovery: Duration::from_millis(config.health.recovery_ms),
            source: GpuSource::from(config),
            node: Node::of(config, gpus),
        }
    }

    /// What restarts a running DRA plugin: all of it.
    pub(crate) fn restart_key(&self) -> &Self {
        self
    }
}

pub(crate) enum DraMsg {
    /// The GPUs' health changed (DRA's GPUs, in order).
    Health {
        healthy: Arc<[bool]>,
        why: Arc<[Option<Failure>]>,
    },
    /// Publish the slice (again).
    Publish,
    /// The kubelet refused the plugin: register again.
    Reregister,
    /// A server stopped; the actor fails with it.
    ServerDown(String),
    /// DRA is being switched off on this node (a reload): remove the
    /// node's slice and publish no more; answered once it is gone or the
    /// API server refused. The supervisor stops the actor next. Not sent
    /// on a restart or a shutdown: a daemon coming back keeps its slice
    /// (and the kubelet removes a plugin's slices once it stays
    /// unregistered).
    Withdraw { reply: RpcReplyPort<()> },
}

pub(crate) struct DraState {
    args: DraArgs,
    client: kube::Client,
    /// What the slice and the kubelet's health streams say.
    health: watch::Sender<GpusHealth>,
    service: AbortHandle,
    registration: AbortHandle,
    facts: Facts,
    /// The slice was withdrawn: nothing publishes it again.
    withdrawn: bool,
    /// Watches the node's slice and has it published again when it goes.
    slice_watch: Option<AbortHandle>,
}

/// The two servers of the plugin.
#[derive(Clone, Copy)]
enum Server {
    /// The DRA service; the kubelet's DRA manager dials it as a `unix:`
    /// target, which sends `localhost` as `:authority`.
    Dra,
    /// The registration service; the kubelet's plugin watcher sends the
    /// socket's path as `:authority`, so it is served through the relay.
    Registration,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Server::Dra => "DRA",
            Server::Registration => "registration",
        }
    }
}

/// Serves `routes` on a fresh socket at `path`; its end, error or not, is
/// reported to `myself` as [`DraMsg::ServerDown`].
fn serve(
    myself: &ActorRef<DraMsg>,
    path: &std::path::Path,
    routes: tonic::service::Routes,
    server: Server,
) -> Result<AbortHandle, ActorProcessingErr> {
    let what = server.name();
    let incoming = crate::net::uds::bind(path)
        .map_err(|e| format!("cannot listen on {} ({what}): {e}", path.display()))?;
    let me = myself.clone();
    let task = tokio::spawn(async move {
        let end = match server {
            Server::Registration => {
                crate::net::uds::serve_relayed(routes, incoming, std::future::pending()).await
            }
            Server::Dra => crate::net::uds::serve(routes, incoming, std::future::pending()).await,
        };
        let why = match end {
            Ok(()) => format!("the {what} server stopped"),
            Err(e) => format!("the {what} server failed: {e}"),
        };
        let _ = me.send_message(DraMsg::ServerDown(why));
    });
    Ok(task.abort_handle())
}

fn registration_routes(args: &DraArgs, myself: &ActorRef<DraMsg>) -> tonic::service::Routes {
    let me = myself.clone();
    let service = RegistrationService {
        driver: args.node.driver.clone(),
        endpoint: args.service_socket.display().to_string(),
        on_refusal: Arc::new(move |_| {
            let _ = me.send_message(DraMsg::Reregister);
        }),
    };
    tonic::service::Routes::new(RegistrationServer::new(service))
}

impl Actor for DraActor {
    type Msg = DraMsg;
    type State = DraState;
    type Arguments = DraArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<DraMsg>,
        args: DraArgs,
    ) -> Result<DraState, ActorProcessingErr> {
        let client =
            crate::net::kube_client::from_kubeconfig(&args.kubeconfig, "matcher.kubeconfig")
                .await?;
        let parts = PreparerParts {
            client: client.clone(),
            node: args.node.clone(),
            composer: args.composer.clone(),
            enforcer: args.enforcer.clone(),
            cdi: args.cdi.clone(),
            checkpoint: args.checkpoint.clone(),
        };
        let preparer = tokio::task::spawn_blocking(move || Preparer::new(parts))
            .await
            .expect("checkpoint load panicked")?;
        let source = args.source.clone();
        let facts = tokio::task::spawn_blocking(move || crate::rules::device::facts(source))
            .await
            .expect("NVML facts panicked");
        let dra = DraService(Arc::new(preparer));
        let (health_news, watching) = watch::channel(GpusHealth::all_healthy(args.node.gpus.len()));
        let health_service = HealthService {
            pool: args.node.pool.clone(),
            devices: args.node.gpus.iter().map(device_name).collect(),
            health: watching,
        };
        let routes =
            tonic::service::Routes::new(v1::dra_plugin_server::DraPluginServer::new(dra.clone()))
                .add_service(v1beta1::server::dra_plugin_server::DraPluginServer::new(
                    dra,
                ))
                .add_service(DraResourceHealthServer::new(health_service.clone()))
                .add_service(AlphaHealthServer::new(health_service));
        let service = serve(&myself, &args.service_socket, routes, Server::Dra)?;
        // Registered only once the service answers: the kubelet calls it
        // as soon as it has the registration.
        let registration = serve(
            &myself,
            &args.registration_socket,
            registration_routes(&args, &myself),
            Server::Registration,
        )?;
        let me = myself.clone();
        let health = HealthArgs {
            spec: args.probe.clone(),
            uuids: args.node.gpus.iter().map(|g| g.uuid.clone()).collect(),
            poll: args.poll,
            recovery: args.recovery,
            report: Arc::new(move |news| {
                if let HealthNews::Changed { healthy, why } = news {
                    let _ = me.send_message(DraMsg::Health { healthy, why });
                }
            }),
        };
        Actor::spawn_linked(None, HealthMonitor, health, myself.get_cell()).await?;
        if !args.shape.consumable {
            tracing::info!(
                "DRA publishes whole GPUs only (dra.consumable_capacity = false): a claim \
                 takes a GPU whole"
            );
        }
        tracing::info!(
            driver = %args.node.driver,
            gpus = args.node.gpus.len(),
            service = %args.service_socket.display(),
            registration = %args.registration_socket.display(),
            "DRA plugin serving"
        );
        Ok(DraState {
            health: health_news,
            args,
            client,
            service,
            registration,
            facts,
            withdrawn: false,
            slice_watch: None,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<DraMsg>,
        state: &mut DraState,
    ) -> Result<(), ActorProcessingErr> {
        myself.send_message(DraMsg::Publish)?;
        let me = myself.clone();
        let watch =
            slices::watch_missing(state.client.clone(), state.args.node.clone(), move || {
                let _ = me.send_message(DraMsg::Publish);
            });
        state.slice_watch = Some(tokio::spawn(watch).abort_handle());
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<DraMsg>,
        msg: DraMsg,
        state: &mut DraState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DraMsg::Health { healthy, why } => {
                let now = GpusHealth { healthy, why };
                let before = state.health.borrow().clone();
                if now.healthy.len() == before.healthy.len() && now != before {
                    if now.healthy != before.healthy {
                        myself.send_message(DraMsg::Publish)?;
                    }
                    state.health.send_replace(now);
                }
            }
            DraMsg::Publish if state.withdrawn => {}
            DraMsg::Publish => {
                let a = &state.args;
                let healthy = state.health.borrow().healthy.clone();
                let published =
                    slices::publish(&state.client, &a.node, &healthy, &state.facts, &a.shape).await;
                match published {
                    Ok(p) => {
                        if a.shape.consumable && !p.consumable {
                            tracing::warn!(
                                "the API server dropped allowMultipleAllocations: this cluster \
                                 has no consumable capacity (Kubernetes 1.36+, or the \
                                 DRAConsumableCapacity gate), so claims get whole GPUs; set \
                                 dra.consumable_capacity = false to say so"
                            );
                        }
                        tracing::info!(generation = p.generation, "ResourceSlice published");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot publish the ResourceSlice; trying again");
                        myself.send_after(REPUBLISH, || DraMsg::Publish);
                    }
                }
            }
            DraMsg::Reregister => {
                state.registration.abort();
                tokio::time::sleep(REREGISTER).await;
                state.registration = serve(
                    &myself,
                    &state.args.registration_socket,
                    registration_routes(&state.args, &myself),
                    Server::Registration,
                )?;
                tracing::info!("registration socket made again");
            }
            DraMsg::Withdraw { reply } => {
                state.withdrawn = true;
                match slices::withdraw(&state.client, &state.args.node).await {
                    Ok(()) => tracing::info!("DRA switched off: ResourceSlice removed"),
                    Err(e) => tracing::warn!(error = %e, "cannot remove the ResourceSlice"),
                }
                let _ = reply.send(());
            }
            // An aborted server never reports: this one ended by itself.
            DraMsg::ServerDown(why) => return Err(why.into()),
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<DraMsg>,
        event: SupervisionEvent,
        _: &mut DraState,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            SupervisionEvent::ActorFailed(_, e) => {
                Err(format!("health monitor failed: {e}").into())
            }
            _ => Ok(()),
        }
    }

    async fn post_stop(
        &self,
        _: ActorRef<DraMsg>,
        state: &mut DraState,
    ) -> Result<(), ActorProcessingErr> {
        state.service.abort();
        state.registration.abort();
        if let Some(watch) = &state.slice_watch {
            watch.abort();
        }
        // The kubelet's watcher unregisters a plugin whose socket is gone.
        for path in [&state.args.registration_socket, &state.args.service_socket] {
            let _ = std::fs::remove_file(path);
        }
        Ok(())
    }
}
