//! The gRPC adapters: the DRA plugin service, v1 and v1beta1 over one
//! [`Preparer`] (v1beta1's messages are v1's without `Device.share_id`, see
//! build.rs), and the plugin registration service the kubelet's plugin
//! watcher calls on the registration socket.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::prepare::{MAX_CLAIMS, Preparer};
use super::proto::registration::registration_server::Registration;
use super::proto::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use super::proto::{health, v1, v1beta1};

/// The plugin type the kubelet's plugin watcher hands to its DRA manager.
pub(crate) const PLUGIN_TYPE: &str = "DRAPlugin";

/// The DRA service, every version.
#[derive(Clone)]
pub(crate) struct DraService(pub(crate) Arc<Preparer>);

fn bounded(n: usize) -> Result<(), Status> {
    if n > MAX_CLAIMS {
        return Err(Status::invalid_argument(format!(
            "{n} claims in one call; at most {MAX_CLAIMS}"
        )));
    }
    Ok(())
}

impl DraService {
    async fn prepare(
        &self,
        r: v1::NodePrepareResourcesRequest,
    ) -> Result<v1::NodePrepareResourcesResponse, Status> {
        bounded(r.claims.len())?;
        Ok(self.0.prepare(r.claims).await)
    }

    async fn unprepare(
        &self,
        r: v1::NodeUnprepareResourcesRequest,
    ) -> Result<v1::NodeUnprepareResourcesResponse, Status> {
        bounded(r.claims.len())?;
        Ok(self.0.unprepare(r.claims).await)
    }
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        r: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        self.prepare(r.into_inner()).await.map(Response::new)
    }

    async fn node_unprepare_resources(
        &self,
        r: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        self.unprepare(r.into_inner()).await.map(Response::new)
    }
}

#[tonic::async_trait]
impl v1beta1::server::dra_plugin_server::DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        r: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        self.prepare(r.into_inner()).await.map(Response::new)
    }

    async fn node_unprepare_resources(
        &self,
        r: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        self.unprepare(r.into_inner()).await.map(Response::new)
    }
}

/// What the registration service says and whom it tells of the kubelet's
/// verdict.
#[derive(Clone)]
pub(crate) struct RegistrationService {
    pub(crate) driver: String,
    /// The DRA service socket's path.
    pub(crate) endpoint: String,
    /// Called with the kubelet's error when it refused the plugin.
    pub(crate) on_refusal: Arc<dyn Fn(String) + Send + Sync>,
}

/// The versions offered, most recent first: the kubelet takes the first
/// it supports of the plugin API, and of the health API.
pub(crate) fn supported_versions() -> Vec<String> {
    [
        v1::SERVICE,
        v1beta1::SERVICE,
        health::v1::SERVICE,
        health::v1alpha1::SERVICE,
    ]
    .map(str::to_owned)
    .to_vec()
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.to_owned(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: supported_versions(),
        }))
    }

    async fn notify_registration_status(
        &self,
        r: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = r.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.driver, "registered with the kubelet");
        } else {
            tracing::error!(driver = %self.driver, error = %status.error, "the kubelet refused the DRA plugin");
            (self.on_refusal)(status.error);
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
