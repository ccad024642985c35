//! What a container gets, from the devices the kubelet granted: the GPUs'
//! UUIDs in `NVIDIA_VISIBLE_DEVICES`, and for a shared resource the amount
//! in the domain's env and the limit the in-container enforcement reads.
//! Pure: [`ResponseTemplate::response`] is the one place a response is
//! built, so a new env or mount is added there.

use std::collections::{BTreeMap, HashMap};

use crate::api::{ContainerAllocateResponse, Mount};
use crate::device::{DeviceModel, DeviceRef, Resource};

/// What the operator adds to every container (config `[allocate]`).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Extras {
    pub(crate) envs: BTreeMap<String, String>,
    pub(crate) mounts: Vec<Mount>,
}

/// One resource's fixed part of every Allocate response.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ResponseTemplate {
    /// The env carrying a shared grant's amount, e.g. `DOSLAB_IO_GPU_MEMORY`.
    amount_env: String,
    envs: HashMap<String, String>,
    mounts: Vec<Mount>,
}

/// What a container gets: GPUs (indexes; one for a shared resource of a
/// container asking no whole GPU) and an amount in the resource's unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Grant {
    pub(crate) gpus: Vec<usize>,
    pub(crate) amount: u64,
    /// The container holds `gpus` whole
    /// ([`ContainerAsk::rides_whole`](crate::usage::ContainerAsk::rides_whole)):
    /// a shared amount rides inside them, so its response is the whole
    /// GPUs' and caps nothing, whichever resource the kubelet served first.
    pub(crate) whole: bool,
}

impl ResponseTemplate {
    pub(crate) fn new(amount_env: String, extras: &Extras) -> Self {
        let mut envs: HashMap<String, String> = HashMap::from([(
            "NVIDIA_DRIVER_CAPABILITIES".to_owned(),
            "compute,utility".to_owned(),
        )]);
        envs.extend(extras.envs.clone());
        ResponseTemplate {
            amount_env,
            envs,
            mounts: extras.mounts.clone(),
        }
    }

    /// The response for `grant` of `model`'s resource.
    pub(crate) fn response(&self, model: &DeviceModel, grant: &Grant) -> ContainerAllocateResponse {
        let gpus = model.gpus();
        let mut envs = self.envs.clone();
        let uuids: Vec<&str> = grant.gpus.iter().map(|&g| gpus[g].uuid.as_str()).collect();
        envs.insert("NVIDIA_VISIBLE_DEVICES".into(), uuids.join(","));
        let shared = model.resource();
        let amount = grant.amount;
        if shared != Resource::GpuCount && !grant.whole {
            envs.insert(self.amount_env.clone(), amount.to_string());
            let (key, value) = if shared == Resource::GpuMemory {
                ("CUDA_DEVICE_MEMORY_LIMIT_0", format!("{amount}m"))
            } else {
                ("CUDA_DEVICE_SM_LIMIT", amount.to_string())
            };
            envs.insert(key.into(), value);
        }
        ContainerAllocateResponse {
            envs,
            mounts: self.mounts.clone(),
            ..Default::default()
        }
    }
}

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
) -> Result<Grant, AllocateError> {
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
    Ok(Grant {
        gpus,
        amount: devices.len() as u64 * model.unit_amount(),
        whole: resource == Resource::GpuCount,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::device::Plan;
    use crate::plugin::actor::template;

    /// What the service answers for a container granted `devices`.
    fn container_response(
        model: &DeviceModel,
        devices: &[DeviceRef],
        template: &ResponseTemplate,
    ) -> Result<ContainerAllocateResponse, AllocateError> {
        Ok(template.response(model, &ids_grant(model, devices)?))
    }

    fn setup(extra: &str) -> (Config, Plan) {
        let text = format!(
            "pod_matching = false\nmemory_unit_mib = 4\ncores_per_gpu = 20\n{extra}\n[devices]\nbackend = \"mock\"\n\
             [[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 1024\n[[devices.mock]]\nuuid = \"GPU-b\"\nmemory_mib = 1024"
        );
        let config = Config::from_toml(&text, None).unwrap();
        let gpus = crate::device::discover(&config).unwrap();
        let plan = Plan::new(&config, gpus).unwrap();
        (config, plan)
    }

    fn on(gpu: usize, n: u32) -> Vec<DeviceRef> {
        (0..n).map(|unit| DeviceRef { gpu, unit }).collect()
    }

    #[test]
    fn memory_grant_sets_uuid_amount_and_limit() {
        let (c, p) = setup("");
        let m = p.model(Resource::GpuMemory).unwrap();
        let r = container_response(m, &on(1, 10), &template(&c, Resource::GpuMemory)).unwrap();
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-b");
        assert_eq!(r.envs["NVIDIA_DRIVER_CAPABILITIES"], "compute,utility");
        assert_eq!(r.envs["DOSLAB_IO_GPU_MEMORY"], "40");
        assert_eq!(r.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "40m");
        assert!(!r.envs.contains_key("CUDA_DEVICE_SM_LIMIT"));
    }

    #[test]
    fn core_grant_is_in_percent() {
        let (c, p) = setup("");
        let m = p.model(Resource::GpuCore).unwrap();
        // 20 devices per GPU: each is 5 %.
        let r = container_response(m, &on(0, 3), &template(&c, Resource::GpuCore)).unwrap();
        assert_eq!(r.envs["DOSLAB_IO_GPU_CORE"], "15");
        assert_eq!(r.envs["CUDA_DEVICE_SM_LIMIT"], "15");
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
    }

    #[test]
    fn count_grant_lists_every_uuid() {
        let (c, p) = setup("");
        let m = p.model(Resource::GpuCount).unwrap();
        let both = [DeviceRef { gpu: 1, unit: 0 }, DeviceRef { gpu: 0, unit: 0 }];
        let r = container_response(m, &both, &template(&c, Resource::GpuCount)).unwrap();
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-b,GPU-a");
        assert!(!r.envs.contains_key("DOSLAB_IO_GPU_COUNT"));
    }

    #[test]
    fn shared_grant_across_gpus_is_refused() {
        let (c, p) = setup("");
        let m = p.model(Resource::GpuMemory).unwrap();
        let mut d = on(0, 2);
        d.extend(on(1, 1));
        let e = container_response(m, &d, &template(&c, Resource::GpuMemory)).unwrap_err();
        assert!(
            e.to_string().contains("GPU-a") && e.to_string().contains("GPU-b"),
            "{e}"
        );
        let e = container_response(m, &[], &template(&c, Resource::GpuMemory)).unwrap_err();
        assert_eq!(e, AllocateError::Empty);
    }

    #[test]
    fn operator_envs_and_mounts_are_added() {
        let extra = "[allocate]\nenvs = { NVIDIA_DRIVER_CAPABILITIES = \"all\", LD_PRELOAD = \"/l.so\" }\n\
                     [[allocate.mounts]]\nhost_path = \"/h\"\ncontainer_path = \"/c\"\nread_only = true";
        let (c, p) = setup(extra);
        let m = p.model(Resource::GpuCore).unwrap();
        let r = container_response(m, &on(0, 1), &template(&c, Resource::GpuCore)).unwrap();
        assert_eq!(r.envs["NVIDIA_DRIVER_CAPABILITIES"], "all");
        assert_eq!(r.envs["LD_PRELOAD"], "/l.so");
        assert_eq!(r.mounts.len(), 1);
        assert!(r.mounts[0].read_only);
        assert_eq!(r.mounts[0].container_path, "/c");
    }
}
