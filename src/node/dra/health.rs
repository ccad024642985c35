//! The kubelet's device health stream (KEP-4680, `DRAResourceHealth` v1 and
//! v1alpha1): every GPU DRA serves, healthy or not and why, so an unhealthy
//! GPU shows in the `allocatedResourcesStatus` of each pod whose claim has
//! it. Each stream sends the whole list at once, again at every change and
//! at least every [`RESEND`]: the kubelet takes a device it has not heard
//! of within [`TIMEOUT`] as Unknown.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::proto::health::{v1, v1alpha1};
use crate::node::health::Failure;

/// How often a stream repeats an unchanged list.
const RESEND: Duration = Duration::from_secs(10);
/// How long the kubelet trusts a report: the kubelet's own default, three
/// resends, so one late report does not turn a GPU Unknown.
const TIMEOUT: Duration = Duration::from_secs(30);

/// The health of DRA's GPUs, in their order: healthy or not, and why the
/// unhealthy ones failed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GpusHealth {
    pub(crate) healthy: Arc<[bool]>,
    pub(crate) why: Arc<[Option<Failure>]>,
}

impl GpusHealth {
    pub(crate) fn all_healthy(gpus: usize) -> GpusHealth {
        GpusHealth {
            healthy: vec![true; gpus].into(),
            why: vec![None; gpus].into(),
        }
    }
}

/// Serves the stream of one node's pool; `devices` are the GPUs' device
/// names in the slice, in the order of the health it follows.
#[derive(Clone)]
pub(crate) struct HealthService {
    pub(crate) pool: String,
    pub(crate) devices: Arc<[String]>,
    pub(crate) health: watch::Receiver<GpusHealth>,
}

type Reports = Pin<Box<dyn Stream<Item = Result<v1::NodeWatchResourcesResponse, Status>> + Send>>;

impl HealthService {
    /// The whole list as the kubelet reads it, stamped `now` (Unix seconds).
    fn report(&self, health: &GpusHealth, now: i64) -> v1::NodeWatchResourcesResponse {
        let devices = self
            .devices
            .iter()
            .zip(health.healthy.iter().zip(health.why.iter()));
        let devices = devices
            .map(|(name, (&healthy, why))| v1::DeviceHealth {
                device: Some(v1::DeviceIdentifier {
                    pool_name: self.pool.clone(),
                    device_name: name.clone(),
                }),
                health: if healthy {
                    v1::HealthStatus::Healthy
                } else {
                    v1::HealthStatus::Unhealthy
                } as i32,
                last_updated_time: now,
                health_check_timeout_seconds: TIMEOUT.as_secs() as i64,
                message: why
                    .as_ref()
                    .filter(|_| !healthy)
                    .map(ToString::to_string)
                    .unwrap_or_default(),
            })
            .collect();
        v1::NodeWatchResourcesResponse { devices }
    }

    fn reports(&self) -> Reports {
        tracing::info!(pool = %self.pool, "the kubelet watches the GPUs' health");
        let service = self.clone();
        let stream = futures::stream::unfold((service, true), |(mut service, first)| async move {
            if !first {
                tokio::select! {
                    changed = service.health.changed() => changed.ok()?,
                    () = tokio::time::sleep(RESEND) => {}
                }
            }
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64);
            let health = service.health.borrow_and_update().clone();
            let report = service.report(&health, now);
            Some((Ok(report), (service, false)))
        });
        Box::pin(stream)
    }
}

/// Both versions' services stream the same reports.
macro_rules! serve_health {
    ($($version:ident),+) => {$(
        #[tonic::async_trait]
        impl $version::dra_resource_health_server::DraResourceHealth for HealthService {
            type NodeWatchResourcesStream = Reports;

            async fn node_watch_resources(
                &self,
                _: Request<v1::NodeWatchResourcesRequest>,
            ) -> Result<Response<Reports>, Status> {
                Ok(Response::new(self.reports()))
            }
        }
    )+};
}

serve_health!(v1, v1alpha1);

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::path::PathBuf;

    #[tokio::test]
    async fn the_stream_sends_every_gpu_at_once_and_again_at_each_change() {
        let (tx, rx) = watch::channel(GpusHealth::all_healthy(2));
        let service = HealthService {
            pool: "node-a".into(),
            devices: ["gpu-0".to_owned(), "gpu-1".to_owned()].into(),
            health: rx,
        };
        let mut reports = service.reports();
        let first = reports.next().await.unwrap().unwrap();
        let health: Vec<_> = first
            .devices
            .iter()
            .map(|d| (d.device.clone().unwrap().device_name, d.health()))
            .collect();
        assert_eq!(
            health,
            [
                ("gpu-0".to_owned(), v1::HealthStatus::Healthy),
                ("gpu-1".to_owned(), v1::HealthStatus::Healthy)
            ]
        );
        assert!(
            first
                .devices
                .iter()
                .all(|d| d.health_check_timeout_seconds == 30
                    && d.last_updated_time > 0
                    && d.device.as_ref().unwrap().pool_name == "node-a")
        );
        let flag = PathBuf::from("/flags/GPU-b");
        tx.send(GpusHealth {
            healthy: [true, false].into(),
            why: [None, Some(Failure::MockFlag(flag))].into(),
        })
        .unwrap();
        let next = reports.next().await.unwrap().unwrap();
        assert_eq!(next.devices[1].health(), v1::HealthStatus::Unhealthy);
        assert_eq!(
            next.devices[1].message,
            "mock health file /flags/GPU-b exists"
        );
        assert_eq!(next.devices[0].message, "");
        drop(tx);
        assert!(
            reports.next().await.is_none(),
            "the stream ends with the plugin"
        );
    }
}
