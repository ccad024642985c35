//! Registering a plugin with the kubelet (API version, endpoint socket name,
//! resource name, options; see
//! <https://kubernetes.io/docs/concepts/extend-kubernetes/compute-storage-net/device-plugins/#device-plugin-registration>).
//! The kubelet dials the plugin back inside this call, so the plugin must
//! already be serving.

use std::path::Path;
use std::time::Duration;

use crate::api::RegisterRequest;
use crate::api::registration_client::RegistrationClient;

#[derive(Debug, thiserror::Error)]
pub(crate) enum RegisterError {
    #[error("kubelet socket {0} is not there yet")]
    NoKubelet(String),
    #[error("cannot reach the kubelet at {path}: {source}")]
    Connect {
        path: String,
        source: tonic::transport::Error,
    },
    #[error("kubelet refused the registration: {0}")]
    Refused(String),
}

/// Registers `resource_name` served on `<device_plugin_dir>/<endpoint>`.
pub(crate) async fn register(
    kubelet_socket: &Path,
    endpoint: &str,
    resource_name: &str,
) -> Result<(), RegisterError> {
    let path = kubelet_socket.display().to_string();
    if !kubelet_socket.exists() {
        return Err(RegisterError::NoKubelet(path));
    }
    let channel = crate::net::uds::connect(kubelet_socket, Duration::from_secs(5))
        .await
        .map_err(|source| RegisterError::Connect { path, source })?;
    let mut client = RegistrationClient::new(channel);
    let request = RegisterRequest {
        version: crate::api::VERSION.to_owned(),
        endpoint: endpoint.to_owned(),
        resource_name: resource_name.to_owned(),
        options: Some(super::service::options()),
    };
    // The kubelet's own dial back is bounded by 10 s; leave it room.
    let mut request = tonic::Request::new(request);
    request.set_timeout(Duration::from_secs(30));
    client
        .register(request)
        .await
        .map_err(|s| RegisterError::Refused(s.message().to_owned()))?;
    Ok(())
}
