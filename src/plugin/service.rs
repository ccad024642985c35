//! The DevicePlugin gRPC service: a thin adapter from tonic to the device
//! model, packing and Allocate logic. The plugin actor owns its lifecycle.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use futures::Stream;
use prost::Message;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::allocate::{AllocateError, ResponseTemplate, container_response, grant_response};
use super::placement::Placement;
use super::request::{AllocateIdsRequest, Oversize, PreferredRequest};
use crate::api::lazy::device_plugin_server::DevicePlugin;
use crate::api::{
    AllocateResponse, ContainerPreferredAllocationResponse, DevicePluginOptions, Empty,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationResponse,
};
use crate::device::{DeviceListMessage, DeviceModel, DeviceRef, IdError, Resource, packing};
use crate::matcher::ledger::ids_digest;
use crate::matcher::matching::Ask;
use crate::metrics::{ResourceMetrics, Rpc};

/// What ListAndWatch streams: the current list, and whether it is the last
/// one of this stream (the plugin is stopping or re-registering).
#[derive(Debug, Clone, Default)]
pub struct StreamItem {
    pub list: DeviceListMessage,
    pub last: bool,
}

/// Counts the open ListAndWatch streams, so the plugin can tell when the
/// kubelet dropped it (it never reconnects by itself).
#[derive(Debug, Clone, Default)]
pub struct Streams(Arc<AtomicUsize>);

impl Streams {
    pub fn open(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    pub(super) fn guard(&self) -> StreamGuard {
        self.0.fetch_add(1, Ordering::SeqCst);
        StreamGuard(self.0.clone())
    }
}

/// Held by a stream for its life.
pub(super) struct StreamGuard(Arc<AtomicUsize>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

pub fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

pub struct DevicePluginService {
    model: Arc<DeviceModel>,
    template: Arc<ResponseTemplate>,
    lists: watch::Receiver<StreamItem>,
    placement: watch::Receiver<Placement>,
    metrics: Arc<ResourceMetrics>,
}

/// A refused request: the status for the kubelet, the reason for metrics.
struct Refusal(Status, &'static str);

impl DevicePluginService {
    pub fn new(
        model: Arc<DeviceModel>,
        template: Arc<ResponseTemplate>,
        lists: watch::Receiver<StreamItem>,
        placement: watch::Receiver<Placement>,
        metrics: Arc<ResourceMetrics>,
    ) -> Self {
        DevicePluginService {
            model,
            template,
            lists,
            placement,
            metrics,
        }
    }

    fn resource(&self) -> Resource {
        self.model.resource()
    }

    fn refuse(&self, reason: &'static str, e: impl std::fmt::Display) -> Refusal {
        Refusal(
            Status::invalid_argument(format!("{}: {e}", self.resource())),
            reason,
        )
    }

    fn oversize(&self, e: Oversize) -> Refusal {
        let reason = match e {
            Oversize::Containers(_) => "too_many_containers",
            Oversize::Ids(_) => "too_many_ids",
        };
        self.refuse(reason, e)
    }

    fn decode<'a>(
        &self,
        ids: impl ExactSizeIterator<Item = &'a [u8]>,
    ) -> Result<Vec<DeviceRef>, Refusal> {
        self.model.decode_all(ids).map_err(|e| {
            let reason = match e {
                IdError::Unknown(_) => "unknown_id",
                IdError::Duplicate(_) => "duplicate_id",
            };
            self.refuse(reason, e)
        })
    }

    /// Times and counts an RPC's outcome.
    fn record<T>(
        &self,
        rpc: Rpc,
        started: Instant,
        result: Result<T, Refusal>,
    ) -> Result<Response<T>, Status> {
        let failure = result.as_ref().err().map(|Refusal(_, reason)| *reason);
        self.metrics.rpc(rpc).record(started.elapsed(), failure);
        result
            .map(Response::new)
            .map_err(|Refusal(status, _)| status)
    }

    async fn preferred(
        &self,
        request: PreferredRequest,
    ) -> Result<PreferredAllocationResponse, Refusal> {
        let resource = self.resource();
        let containers = request.containers.checked().map_err(|e| self.oversize(e))?;
        let mut container_responses = Vec::new();
        for req in containers {
            let mut available = self.decode(req.available.iter())?;
            let must = self.decode(req.must_include.iter())?;
            let size = usize::try_from(req.size)
                .map_err(|_| self.refuse("bad_size", format!("allocation size {}", req.size)))?;
            let placement = self.placement.borrow().clone();
            let steer = match &placement {
                Placement::Ids(book) => book.steer(&self.model, &available, size),
                Placement::Matcher { handle, .. } => {
                    let ask = Ask {
                        resource,
                        devices: size as u64,
                        digest: None,
                        id_gpus: Vec::new(),
                    };
                    handle.prefer(ask).await
                }
            };
            available.retain(|d| !steer.avoid.get(d.gpu).copied().unwrap_or(false));
            let prefer = steer.gpus.first().copied();
            let chosen = match resource {
                Resource::GpuCount => {
                    packing::whole(&available, &must, size, |g| self.model.gpus()[g].numa_node)
                }
                _ => packing::shared(&available, &must, size, prefer),
            };
            tracing::debug!(%resource, available = available.len(), size, "GetPreferredAllocation");
            container_responses.push(ContainerPreferredAllocationResponse {
                device_i_ds: chosen.into_iter().map(|d| self.model.id(d)).collect(),
            });
        }
        Ok(PreferredAllocationResponse {
            container_responses,
        })
    }

    async fn allocate(&self, request: AllocateIdsRequest) -> Result<AllocateResponse, Refusal> {
        let resource = self.resource();
        let containers = request.containers.checked().map_err(|e| self.oversize(e))?;
        let mut container_responses = Vec::new();
        for req in containers {
            let devices = self.decode(req.ids.iter())?;
            let placement = self.placement.borrow().clone();
            let response = match &placement {
                Placement::Ids(book) => {
                    let response = container_response(&self.model, &devices, &self.template)
                        .map_err(|e| {
                            let reason = match e {
                                AllocateError::Empty => "empty",
                                AllocateError::SpansGpus { .. } => "spans_gpus",
                            };
                            self.refuse(reason, e)
                        })?;
                    book.grant(&self.model, &devices).map_err(|e| {
                        let status = Status::failed_precondition(format!("{resource}: {e}"));
                        Refusal(status, "split_container")
                    })?;
                    response
                }
                Placement::Matcher { handle, wait } => {
                    let mut id_gpus: Vec<usize> = Vec::new();
                    for d in &devices {
                        if !id_gpus.contains(&d.gpu) {
                            id_gpus.push(d.gpu);
                        }
                    }
                    let ask = Ask {
                        resource,
                        devices: devices.len() as u64,
                        // Decoded, so every ID is a known (ASCII) one.
                        digest: Some(ids_digest(
                            req.ids.iter().filter_map(|id| std::str::from_utf8(id).ok()),
                        )),
                        id_gpus,
                    };
                    let d = handle
                        .allocate(ask, Placement::allocate_timeout(*wait))
                        .await
                        .map_err(|e| Refusal(Status::failed_precondition(e), "no_match"))?;
                    grant_response(&self.model, &d.gpus, d.amount, &self.template)
                }
            };
            tracing::info!(
                %resource,
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
            (
                self.lists.clone(),
                true,
                false,
                self.metrics.streams.guard(),
            ),
            move |(mut rx, first, done, guard)| {
                let metrics = metrics.clone();
                async move {
                    if done || (!first && rx.changed().await.is_err()) {
                        tracing::info!(%resource, "ListAndWatch stream ended");
                        return None;
                    }
                    let item = rx.borrow_and_update().clone();
                    tracing::debug!(%resource, devices = item.list.device_count(), "ListAndWatch send");
                    metrics.lists_sent.fetch_add(1, Ordering::Relaxed);
                    metrics
                        .list_bytes
                        .store(item.list.encoded_len() as u64, Ordering::Relaxed);
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
        let result = self.preferred(request.into_inner()).await;
        self.record(Rpc::PreferredAllocation, started, result)
    }

    async fn allocate(
        &self,
        request: Request<AllocateIdsRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let started = Instant::now();
        let result = DevicePluginService::allocate(self, request.into_inner()).await;
        self.record(Rpc::Allocate, started, result)
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}
