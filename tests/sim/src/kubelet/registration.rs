//! The simulator's Registration service and the ListAndWatch reader it
//! starts for each registered plugin.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use tonic::{Request, Response, Status, Streaming};

use super::{Endpoint, KubeletState, MAX_MESSAGE_BYTES};
use gpu_device_plugin::api::device_plugin_client::DevicePluginClient;
use gpu_device_plugin::api::registration_server::Registration;
use gpu_device_plugin::api::{Empty, ListAndWatchResponse, RegisterRequest};

pub(crate) struct RegistrationService {
    pub(crate) dir: PathBuf,
    pub(crate) shared: Arc<KubeletState>,
}

/// The kubelet's rule for an extended resource name.
pub(crate) fn validate_resource_name(name: &str) -> Result<(), String> {
    let Some((_, short)) = name.split_once('/') else {
        return Err(format!("resource name {name:?} has no '/'"));
    };
    if name.contains("kubernetes.io/") {
        return Err(format!(
            "resource name {name:?} is in the kubernetes.io namespace"
        ));
    }
    let ok = !short.is_empty()
        && short.len() <= 63
        && short
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && short.starts_with(|c: char| c.is_ascii_alphanumeric())
        && short.ends_with(|c: char| c.is_ascii_alphanumeric());
    if !ok {
        return Err(format!("resource name {name:?} is not a qualified name"));
    }
    Ok(())
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let r = request.into_inner();
        if r.version != gpu_device_plugin::api::VERSION {
            return Err(Status::unknown(format!(
                "invalid version {:?}, expected {}",
                r.version,
                gpu_device_plugin::api::VERSION
            )));
        }
        validate_resource_name(&r.resource_name).map_err(Status::unknown)?;
        let path = self.dir.join(&r.endpoint);
        let dial = |e: &dyn std::fmt::Display| {
            Status::unknown(format!(
                "failed to dial device plugin {}: {e}",
                path.display()
            ))
        };
        let channel = gpu_device_plugin::net::uds::connect(&path, Duration::from_secs(10))
            .await
            .map_err(|e| dial(&e))?;
        let mut client =
            DevicePluginClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
        let options = client
            .get_device_plugin_options(Empty {})
            .await
            .map_err(|e| dial(&e))?
            .into_inner();
        let stream = client
            .list_and_watch(Empty {})
            .await
            .map_err(|e| dial(&e))?
            .into_inner();
        let name = r.resource_name.clone();
        let generation = self.shared.update(|s| {
            s.generations += 1;
            let generation = s.generations;
            s.endpoints.insert(
                name.clone(),
                Endpoint {
                    generation,
                    client,
                    options,
                    devices: Default::default(),
                    reader: None,
                },
            );
            let view = s.views.entry(name.clone()).or_default();
            view.registrations += 1;
            view.stream_open = true;
            view.stream_error = None;
            generation
        });
        let reader = tokio::spawn(read_stream(
            self.shared.clone(),
            name.clone(),
            generation,
            stream,
        ));
        self.shared.update(|s| {
            if let Some(e) = s
                .endpoints
                .get_mut(&name)
                .filter(|e| e.generation == generation)
            {
                e.reader = Some(reader);
            }
        });
        Ok(Response::new(Empty {}))
    }
}

async fn read_stream(
    shared: Arc<KubeletState>,
    name: String,
    generation: u64,
    mut stream: Streaming<ListAndWatchResponse>,
) {
    let error = loop {
        match stream.message().await {
            Ok(Some(list)) => shared.update(|s| {
                let Some(e) = s
                    .endpoints
                    .get_mut(&name)
                    .filter(|e| e.generation == generation)
                else {
                    return;
                };
                let bytes = list.encoded_len();
                e.devices = list
                    .devices
                    .into_iter()
                    .map(|d| {
                        let healthy = d.health == "Healthy";
                        (d.id, healthy)
                    })
                    .collect();
                let view = s.views.entry(name.clone()).or_default();
                view.last_message_bytes = bytes;
                view.messages += 1;
                view.devices = e.devices.len();
                view.healthy = e.devices.values().filter(|h| **h).count();
            }),
            Ok(None) => break None,
            Err(status) => break Some(format!("{:?}: {}", status.code(), status.message())),
        }
    };
    shared.update(|s| {
        let Some(e) = s.endpoints.get_mut(&name) else {
            return;
        };
        // Ending an older stream after a newer registration drops the newer
        // client too: the kubelet looks endpoints up by resource name.
        let dropped_newer = e.generation > generation;
        for healthy in e.devices.values_mut() {
            *healthy = false;
        }
        if dropped_newer && let Some(reader) = e.reader.take() {
            reader.abort();
        }
        let view = s.views.entry(name.clone()).or_default();
        view.healthy = 0;
        view.stream_open = false;
        view.stream_error = if dropped_newer {
            Some("dropped by an older stream's end (kubernetes#121994)".into())
        } else {
            error
        };
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_names_follow_the_kubelet_rules() {
        assert!(validate_resource_name("doslab.io/gpu-memory").is_ok());
        assert!(validate_resource_name("gpu-memory").is_err());
        assert!(validate_resource_name("kubernetes.io/gpu").is_err());
        assert!(validate_resource_name("doslab.io/").is_err());
        assert!(validate_resource_name(&format!("doslab.io/{}", "a".repeat(64))).is_err());
        assert!(validate_resource_name("doslab.io/gpu memory").is_err());
    }
}
