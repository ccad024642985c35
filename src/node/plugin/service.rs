//! The DevicePlugin gRPC service: a thin adapter from tonic to the plugin.
//! Each RPC decodes the kubelet's IDs, delegates to [`Placement`] and (for
//! Allocate) the [`ResponseComposer`], encodes the answer and records it in
//! the metrics.
//! The plugin actor owns its lifecycle.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::Stream;
use prost::Message;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::actor::OpenStreams;
use super::codec::{AllocateIdsRequest, DeviceListMessage, Oversize, PreferredRequest};
use super::placement::{PlaceError, Placement};
use crate::api::lazy::device_plugin_server::DevicePlugin;
use crate::api::{
    AllocateResponse, ContainerPreferredAllocationResponse, DevicePluginOptions, Empty,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationResponse,
};
use crate::node::enforcement::Enforcer;
use crate::node::grant::ResponseComposer;
use crate::node::metrics::{ResourceMetrics, Rpc};
use crate::rules::device::{DeviceModel, DeviceRef, IdError, Resource};

/// What ListAndWatch streams: the current list, and whether it is the last
/// one of this stream (the plugin is stopping or re-registering).
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamItem {
    pub(crate) list: DeviceListMessage,
    pub(crate) last: bool,
}

pub(crate) fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

pub(crate) struct DevicePluginService {
    model: Arc<DeviceModel>,
    composer: Arc<ResponseComposer>,
    lists: watch::Receiver<StreamItem>,
    placement: watch::Receiver<Placement>,
    enforcer: Option<Enforcer>,
    metrics: Arc<ResourceMetrics>,
    /// The plugin's count of open streams: each ListAndWatch holds a guard.
    streams: OpenStreams,
}

/// A refused request: the status for the kubelet, the reason for metrics.
struct RpcRefusal(Status, &'static str);

impl DevicePluginService {
    pub(crate) fn new(
        model: Arc<DeviceModel>,
        composer: Arc<ResponseComposer>,
        lists: watch::Receiver<StreamItem>,
        placement: watch::Receiver<Placement>,
        enforcer: Option<Enforcer>,
        metrics: Arc<ResourceMetrics>,
        streams: OpenStreams,
    ) -> Self {
        DevicePluginService {
            model,
            composer,
            lists,
            placement,
            enforcer,
            metrics,
            streams,
        }
    }

    fn resource(&self) -> Resource {
        self.model.resource()
    }

    fn refuse(&self, reason: &'static str, e: impl std::fmt::Display) -> RpcRefusal {
        RpcRefusal(
            Status::invalid_argument(format!("{}: {e}", self.resource())),
            reason,
        )
    }

    fn oversize(&self, e: Oversize) -> RpcRefusal {
        let reason = match e {
            Oversize::Containers(_) => "too_many_containers",
            Oversize::Ids(_) => "too_many_ids",
        };
        self.refuse(reason, e)
    }

    fn decode<'a>(
        &self,
        ids: impl ExactSizeIterator<Item = &'a [u8]>,
    ) -> Result<Vec<DeviceRef>, RpcRefusal> {
        self.model.decode_all(ids).map_err(|e| {
            let reason = match e {
                IdError::Unknown(_) => "unknown_id",
                IdError::Duplicate(_) => "duplicate_id",
            };
            self.refuse(reason, e)
        })
    }

    /// A wrong request is an invalid argument; a container the plugin
    /// cannot place is a failed precondition.
    fn unplaced(&self, e: PlaceError) -> RpcRefusal {
        let reason = e.reason();
        let status = match &e {
            PlaceError::Ids(_) => return self.refuse(reason, e),
            PlaceError::Split(_) => {
                Status::failed_precondition(format!("{}: {e}", self.resource()))
            }
            PlaceError::Matcher(_) => Status::failed_precondition(e.to_string()),
            PlaceError::Enforcement(_) => {
                Status::failed_precondition(format!("{}: {e}", self.resource()))
            }
        };
        RpcRefusal(status, reason)
    }

    /// Times and counts an RPC's outcome.
    fn record<T>(
        &self,
        rpc: Rpc,
        started: Instant,
        result: Result<T, RpcRefusal>,
    ) -> Result<Response<T>, Status> {
        let failure = result.as_ref().err().map(|RpcRefusal(_, reason)| *reason);
        self.metrics.rpc(rpc).record(started.elapsed(), failure);
        result
            .map(Response::new)
            .map_err(|RpcRefusal(status, _)| status)
    }

    async fn answer_preferred(
        &self,
        request: PreferredRequest,
    ) -> Result<PreferredAllocationResponse, RpcRefusal> {
        let containers = request.containers.checked().map_err(|e| self.oversize(e))?;
        let mut container_responses = Vec::new();
        for req in containers {
            let available = self.decode(req.available.iter())?;
            let must = self.decode(req.must_include.iter())?;
            let size = usize::try_from(req.size)
                .map_err(|_| self.refuse("bad_size", format!("allocation size {}", req.size)))?;
            tracing::debug!(resource = %self.resource(), available = available.len(), size, "GetPreferredAllocation");
            let placement = self.placement.borrow().clone();
            let chosen = placement.steer(&self.model, available, &must, size).await;
            container_responses.push(ContainerPreferredAllocationResponse {
                device_i_ds: chosen.into_iter().map(|d| self.model.id(d)).collect(),
            });
        }
        Ok(PreferredAllocationResponse {
            container_responses,
        })
    }

    async fn answer_allocate(
        &self,
        request: AllocateIdsRequest,
    ) -> Result<AllocateResponse, RpcRefusal> {
        let containers = request.containers.checked().map_err(|e| self.oversize(e))?;
        // One per RPC: its containers share one library check.
        let enforcement = self.enforcer.as_ref().map(Enforcer::for_allocate);
        let mut container_responses = Vec::new();
        for req in containers {
            let devices = self.decode(req.ids.iter())?;
            // Decoded, so every ID is a known (ASCII) one.
            let ids: Vec<&str> = req
                .ids
                .iter()
                .filter_map(|id| std::str::from_utf8(id).ok())
                .collect();
            let placement = self.placement.borrow().clone();
            let (grant, preload) = placement
                .grant(&self.model, &devices, &ids, enforcement.as_ref())
                .await
                .map_err(|e| self.unplaced(e))?;
            let response = self.composer.compose(&self.model, &grant, preload);
            tracing::info!(
                resource = %self.resource(),
                devices = devices.len(),
                gpus = %response.envs.get("NVIDIA_VISIBLE_DEVICES").map_or("", String::as_str),
                "Allocate"
            );
            container_responses.push(response);
        }
        Ok(AllocateResponse {
            container_responses,
        })
    }
}

#[tonic::async_trait]
impl DevicePlugin for DevicePluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream =
        Pin<Box<dyn Stream<Item = Result<DeviceListMessage, Status>> + Send + 'static>>;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let resource = self.resource();
        let metrics = self.metrics.clone();
        tracing::info!(%resource, "ListAndWatch stream opened");
        // (receiver, first, done, guard): the first item is the current list;
        // the guard counts the stream open until the kubelet drops it.
        let stream = futures::stream::unfold(
            (self.lists.clone(), true, false, self.streams.guard()),
            move |(mut rx, first, done, guard)| {
                let metrics = metrics.clone();
                async move {
                    if done || (!first && rx.changed().await.is_err()) {
                        tracing::info!(%resource, "ListAndWatch stream ended");
                        return None;
                    }
                    let item = rx.borrow_and_update().clone();
                    tracing::debug!(%resource, devices = item.list.device_count(), "ListAndWatch send");
                    metrics.count_list(item.list.encoded_len() as u64);
                    Some((Ok(item.list), (rx, false, item.last, guard)))
                }
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let started = Instant::now();
        let result = self.answer_preferred(request.into_inner()).await;
        self.record(Rpc::PreferredAllocation, started, result)
    }

    async fn allocate(
        &self,
        request: Request<AllocateIdsRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let started = Instant::now();
        let result = self.answer_allocate(request.into_inner()).await;
        self.record(Rpc::Allocate, started, result)
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::Config;
    use crate::node::grant::ResponseComposer;
    use crate::node::matcher::MatcherHandle;
    use crate::node::metrics::Metrics;
    use crate::rules::device::Plan;

    #[tokio::test]
    async fn an_allocate_the_matcher_cannot_serve_is_counted_by_kind() {
        let text =
            "[devices]\nbackend = \"mock\"\n[[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 1024";
        let config = Config::from_toml(text, Some("n".into())).unwrap();
        let plan = Plan::new(&config, crate::rules::device::discover(&config).unwrap()).unwrap();
        let model = plan.model(Resource::GpuMemory).unwrap().clone();
        let metrics = Metrics::default();
        let (_lists, lists) = watch::channel(StreamItem::default());
        let (_placement, placement) = watch::channel(Placement::Matcher {
            handle: MatcherHandle::default(),
            wait: Duration::from_millis(100),
        });
        let service = DevicePluginService::new(
            model.clone(),
            Arc::new(ResponseComposer::new(&config)),
            lists,
            placement,
            None,
            metrics.resource("doslab.io/gpu-memory"),
            OpenStreams::default(),
        );
        let request = crate::api::AllocateRequest {
            container_requests: vec![crate::api::ContainerAllocateRequest {
                devices_ids: vec![model.id(DeviceRef { gpu: 0, unit: 0 })],
            }],
        };
        let request = AllocateIdsRequest::decode(request.encode_to_vec().as_slice()).unwrap();
        let status = DevicePlugin::allocate(&service, Request::new(request))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert_eq!(
            status.message(),
            "the pod matcher is not running (see the log for why)"
        );
        let text = metrics.render();
        assert!(
            text.contains("rpc=\"allocate\",reason=\"matcher_down\"} 1"),
            "{text}"
        );
    }
}
