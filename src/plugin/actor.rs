//! The plugin actor: serve first, then register (the kubelet dials back
//! inside Register), retry registration with backoff, and on stop send an
//! empty list, end the stream, stop the server and remove the socket.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use super::allocate::ResponseTemplate;
use super::pairing::LastShared;
use super::registration::{RegisterError, register};
use super::service::{DevicePluginService, StreamItem};
use crate::api::lazy::device_plugin_server::DevicePluginServer;
use crate::config::Config;
use crate::device::{DeviceListMessage, DeviceModel, Resource};

/// GetPreferredAllocation lists every free ID: hundreds of thousands of
/// them must fit in one request.
const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;
/// How long a stopping server may take to finish its calls.
const STOP_GRACE: Duration = Duration::from_secs(2);

pub struct PluginActor;

pub struct PluginArgs {
    pub model: Arc<DeviceModel>,
    pub resource_name: String,
    pub endpoint: String,
    pub socket: PathBuf,
    pub kubelet_socket: PathBuf,
    pub template: Arc<ResponseTemplate>,
    pub pairing: LastShared,
}

impl PluginArgs {
    pub fn new(config: &Config, model: Arc<DeviceModel>, pairing: LastShared) -> Self {
        let r = model.resource();
        let endpoint = config.endpoint(r);
        PluginArgs {
            resource_name: config.resource_name(r),
            socket: config.device_plugin_dir.join(&endpoint),
            endpoint,
            kubelet_socket: config.kubelet_socket(),
            template: Arc::new(ResponseTemplate::new(config, r)),
            model,
            pairing,
        }
    }
}

pub enum PluginMsg {
    /// Try to register the running server with the kubelet.
    Register,
    /// The outcome of a registration attempt.
    Registered(Result<(), RegisterError>),
}

pub struct PluginState {
    args: PluginArgs,
    lists: watch::Sender<StreamItem>,
    server: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
    failed_attempts: u32,
}

impl PluginState {
    fn resource(&self) -> Resource {
        self.args.model.resource()
    }
}

/// 100 ms, 200 ms, … capped at 2 s: a kubelet that appears is found fast,
/// one that is gone costs a few wake-ups a second at most.
fn backoff(failed_attempts: u32) -> Duration {
    Duration::from_millis(100u64 << failed_attempts.min(5)).min(Duration::from_secs(2))
}

impl Actor for PluginActor {
    type Msg = PluginMsg;
    type State = PluginState;
    type Arguments = PluginArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<PluginMsg>,
        args: PluginArgs,
    ) -> Result<PluginState, ActorProcessingErr> {
        let healthy: Arc<[bool]> = vec![true; args.model.gpus().len()].into();
        let item = StreamItem {
            list: DeviceListMessage::new(args.model.clone(), healthy),
            last: false,
        };
        let (lists, rx) = watch::channel(item);
        let incoming = crate::uds::bind(&args.socket)
            .map_err(|e| format!("cannot listen on {}: {e}", args.socket.display()))?;
        let service = DevicePluginService::new(
            args.model.clone(),
            args.template.clone(),
            rx,
            args.pairing.clone(),
        );
        let routes = tonic::service::Routes::new(
            DevicePluginServer::new(service).max_decoding_message_size(MAX_REQUEST_BYTES),
        );
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let resource = args.model.resource();
        let task = tokio::spawn(async move {
            let stopped = async {
                let _ = stop_rx.await;
            };
            if let Err(e) = crate::uds::serve(routes, incoming, stopped).await {
                tracing::error!(%resource, error = %e, "gRPC server failed");
            }
        });
        tracing::info!(
            %resource,
            socket = %args.socket.display(),
            devices = args.model.device_count(),
            "serving"
        );
        myself.send_message(PluginMsg::Register)?;
        Ok(PluginState {
            args,
            lists,
            server: Some((stop_tx, task)),
            failed_attempts: 0,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<PluginMsg>,
        msg: PluginMsg,
        state: &mut PluginState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PluginMsg::Register => {
                let kubelet = state.args.kubelet_socket.clone();
                let endpoint = state.args.endpoint.clone();
                let name = state.args.resource_name.clone();
                // Register blocks until the kubelet has dialled us back; the
                // actor keeps answering meanwhile.
                tokio::spawn(async move {
                    let result = register(&kubelet, &endpoint, &name).await;
                    let _ = myself.send_message(PluginMsg::Registered(result));
                });
            }
            PluginMsg::Registered(Ok(())) => {
                state.failed_attempts = 0;
                tracing::info!(
                    resource = %state.resource(),
                    name = %state.args.resource_name,
                    "registered with the kubelet"
                );
            }
            PluginMsg::Registered(Err(reason)) => {
                let delay = backoff(state.failed_attempts);
                state.failed_attempts += 1;
                // Waiting for a kubelet is normal at boot: say it once, calmly.
                match reason {
                    RegisterError::NoKubelet(_) if state.failed_attempts > 1 => {}
                    RegisterError::NoKubelet(_) => tracing::info!(
                        resource = %state.resource(),
                        %reason,
                        "waiting for the kubelet"
                    ),
                    _ => tracing::warn!(
                        resource = %state.resource(),
                        %reason,
                        retry_in_ms = delay.as_millis() as u64,
                        "registration failed"
                    ),
                }
                myself.send_after(delay, || PluginMsg::Register);
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<PluginMsg>,
        state: &mut PluginState,
    ) -> Result<(), ActorProcessingErr> {
        let resource = state.resource();
        // The kubelet drops devices it is told about before the stream ends.
        state.lists.send_replace(StreamItem {
            list: DeviceListMessage::empty(),
            last: true,
        });
        if let Some((stop, mut task)) = state.server.take() {
            let _ = stop.send(());
            if tokio::time::timeout(STOP_GRACE, &mut task).await.is_err() {
                tracing::warn!(%resource, "server did not stop in time; aborting it");
                task.abort();
            }
        }
        match std::fs::remove_file(&state.args.socket) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!(%resource, error = %e, "cannot remove socket");
            }
            _ => {}
        }
        tracing::info!(%resource, "stopped");
        Ok(())
    }
}
