//! `gpu-device-plugin inspect`: dial every plugin socket in a device-plugin
//! directory (ours or any vendor's) the way the kubelet does and report what
//! each serves. Read-only: it opens ListAndWatch, takes the first list and
//! hangs up.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use prost::Message;

use crate::api::Empty;
use crate::api::device_plugin_client::DevicePluginClient;
use crate::rules::device::KUBELET_MAX_MESSAGE_BYTES;

const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Report {
    pub(crate) socket: String,
    pub outcome: Result<Served, ProbeError>,
}

/// Why a socket serves nothing the kubelet could use, in the words the
/// report prints after the socket's name.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("cannot connect: {0}")]
    Connect(tonic::transport::Error),
    #[error("GetDevicePluginOptions: {}", .0.message())]
    Options(tonic::Status),
    #[error("ListAndWatch: {}", .0.message())]
    ListAndWatch(tonic::Status),
    #[error("ListAndWatch sent nothing within 5 s")]
    Silent,
    #[error("ListAndWatch ended without a list")]
    Ended,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    pub(crate) preferred_allocation: bool,
    pub(crate) pre_start_required: bool,
    pub(crate) devices: usize,
    pub(crate) healthy: usize,
    pub(crate) list_bytes: usize,
}

async fn probe(path: &Path) -> Result<Served, ProbeError> {
    let channel = crate::net::uds::connect(path, TIMEOUT)
        .await
        .map_err(ProbeError::Connect)?;
    // Larger than the kubelet's limit, so an oversize list is reported, not hidden.
    let mut client = DevicePluginClient::new(channel).max_decoding_message_size(64 << 20);
    let options = client
        .get_device_plugin_options(Empty {})
        .await
        .map_err(ProbeError::Options)?
        .into_inner();
    let mut stream = client
        .list_and_watch(Empty {})
        .await
        .map_err(ProbeError::ListAndWatch)?
        .into_inner();
    let list = tokio::time::timeout(TIMEOUT, stream.message())
        .await
        .map_err(|_| ProbeError::Silent)?
        .map_err(ProbeError::ListAndWatch)?
        .ok_or(ProbeError::Ended)?;
    Ok(Served {
        preferred_allocation: options.get_preferred_allocation_available,
        pre_start_required: options.pre_start_required,
        devices: list.devices.len(),
        healthy: list
            .devices
            .iter()
            .filter(|d| d.health == "Healthy")
            .count(),
        list_bytes: list.encoded_len(),
    })
}

/// Probes every plugin socket in `dir`.
pub async fn inspect(dir: &Path) -> Vec<Report> {
    let mut reports = Vec::new();
    for socket in crate::net::uds::plugin_sockets(dir) {
        let outcome = probe(&dir.join(&socket)).await;
        reports.push(Report { socket, outcome });
    }
    reports
}

pub fn render(dir: &Path, reports: &[Report]) -> String {
    let mut out = format!("device-plugin directory {}\n", dir.display());
    if reports.is_empty() {
        out.push_str("  no plugin sockets\n");
    }
    for r in reports {
        match &r.outcome {
            Ok(s) => {
                let over = if s.list_bytes > KUBELET_MAX_MESSAGE_BYTES {
                    "  OVER the kubelet's 4 MiB limit: the kubelet sees 0 devices"
                } else {
                    ""
                };
                let _ = writeln!(
                    out,
                    "  {}: {} devices, {} healthy, list {} bytes{over}; GetPreferredAllocation {}, PreStartContainer {}",
                    r.socket,
                    s.devices,
                    s.healthy,
                    s.list_bytes,
                    if s.preferred_allocation { "yes" } else { "no" },
                    if s.pre_start_required {
                        "required"
                    } else {
                        "not required"
                    },
                );
            }
            Err(e) => {
                let _ = writeln!(out, "  {}: {e}", r.socket);
            }
        }
    }
    out
}
