//! What a container is granted: its GPUs and the amount in its resource's
//! unit, read from the devices the kubelet granted when no pod matching
//! places it ([`ids_grant`]). The response it gets is composed from this
//! in [`crate::node::grant`].

use crate::node::grant::ContainerGrant;
use crate::rules::device::{DeviceModel, DeviceRef, Resource};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AllocateError {
    #[error("no device IDs in the request")]
    Empty,
    #[error(
        "{resource} devices span GPUs {first} and {second}; a container's {resource} must come \
         from one GPU (no single GPU had {units} free units)"
    )]
    SpansGpus {
        resource: Resource,
        first: String,
        second: String,
        units: usize,
    },
}

impl AllocateError {
    /// The kind of failure, for `rpc_failures_total{reason}`.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            AllocateError::Empty => "empty",
            AllocateError::SpansGpus { .. } => "spans_gpus",
        }
    }
}

/// The grant of `devices` of `model`'s resource, its GPUs read from the
/// IDs (no pod matching): a shared resource's devices must be on one GPU.
pub(crate) fn ids_grant(
    model: &DeviceModel,
    devices: &[DeviceRef],
) -> Result<ContainerGrant, AllocateError> {
    let first = devices.first().ok_or(AllocateError::Empty)?;
    let gpus = model.gpus();
    let resource = model.resource();
    if resource != Resource::GpuCount
        && let Some(other) = devices.iter().find(|d| d.gpu != first.gpu)
    {
        return Err(AllocateError::SpansGpus {
            resource,
            first: gpus[first.gpu].uuid.clone(),
            second: gpus[other.gpu].uuid.clone(),
            units: devices.len(),
        });
    }
    let gpus = match resource {
        Resource::GpuCount => devices.iter().map(|d| d.gpu).collect(),
        _ => vec![first.gpu],
    };
    Ok(ContainerGrant {
        gpus,
        amount: devices.len() as u64 * model.unit_amount(),
        whole: resource == Resource::GpuCount,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::grant::compose::tests::setup;

    fn on(gpu: usize, n: u32) -> Vec<DeviceRef> {
        (0..n).map(|unit| DeviceRef { gpu, unit }).collect()
    }

    #[test]
    fn a_grant_is_read_from_the_ids() {
        let (_, p) = setup("");
        let m = p.model(Resource::GpuMemory).unwrap();
        let g = ids_grant(m, &on(1, 10)).unwrap();
        assert_eq!((g.gpus, g.amount, g.whole), (vec![1], 40, false));
        let m = p.model(Resource::GpuCount).unwrap();
        let both = [DeviceRef { gpu: 1, unit: 0 }, DeviceRef { gpu: 0, unit: 0 }];
        let g = ids_grant(m, &both).unwrap();
        assert_eq!((g.gpus, g.whole), (vec![1, 0], true));
    }

    #[test]
    fn shared_grant_across_gpus_is_refused() {
        let (_, p) = setup("");
        let m = p.model(Resource::GpuMemory).unwrap();
        let mut d = on(0, 2);
        d.extend(on(1, 1));
        let e = ids_grant(m, &d).unwrap_err();
        assert!(
            e.to_string().contains("GPU-a") && e.to_string().contains("GPU-b"),
            "{e}"
        );
        assert_eq!(ids_grant(m, &[]).unwrap_err(), AllocateError::Empty);
    }
}
