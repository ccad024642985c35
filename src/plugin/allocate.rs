//! What a container gets (SPEC §4), from the devices the kubelet granted.
//! Pure: the tonic service validates IDs and calls [`container_response`].

use std::collections::HashMap;

use crate::api::{ContainerAllocateResponse, Mount};
use crate::config::Config;
use crate::device::{DeviceModel, DeviceRef, Resource};

/// The per-resource parts of the config an Allocate response needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseTemplate {
    amount_env: String,
    envs: HashMap<String, String>,
    mounts: Vec<Mount>,
}

impl ResponseTemplate {
    pub fn new(config: &Config, resource: Resource) -> Self {
        let mut envs: HashMap<String, String> = HashMap::from([(
            "NVIDIA_DRIVER_CAPABILITIES".to_owned(),
            "compute,utility".to_owned(),
        )]);
        envs.extend(config.allocate.envs.clone());
        let mounts = config
            .allocate
            .mounts
            .iter()
            .map(|m| Mount {
                container_path: m.container_path.display().to_string(),
                host_path: m.host_path.display().to_string(),
                read_only: m.read_only,
            })
            .collect();
        ResponseTemplate {
            amount_env: config.amount_env(resource),
            envs,
            mounts,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
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

/// The response for one container granted `devices` of `model`'s resource,
/// its GPUs read from the IDs (no pod matching).
pub fn container_response(
    model: &DeviceModel,
    devices: &[DeviceRef],
    template: &ResponseTemplate,
) -> Result<ContainerAllocateResponse, AllocateError> {
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
    let on: Vec<usize> = match resource {
        Resource::GpuCount => devices.iter().map(|d| d.gpu).collect(),
        _ => vec![first.gpu],
    };
    let amount = devices.len() as u64 * model.unit_amount();
    Ok(grant_response(model, &on, amount, template))
}

/// The response for a grant of `amount` (in the resource's unit) on `on`
/// (GPU indexes; one for a shared resource).
pub fn grant_response(
    model: &DeviceModel,
    on: &[usize],
    amount: u64,
    template: &ResponseTemplate,
) -> ContainerAllocateResponse {
    let gpus = model.gpus();
    let mut envs = template.envs.clone();
    let uuids: Vec<&str> = on.iter().map(|&g| gpus[g].uuid.as_str()).collect();
    envs.insert("NVIDIA_VISIBLE_DEVICES".into(), uuids.join(","));
    let shared = model.resource();
    if shared != Resource::GpuCount {
        envs.insert(template.amount_env.clone(), amount.to_string());
        let (key, value) = if shared == Resource::GpuMemory {
            ("CUDA_DEVICE_MEMORY_LIMIT_0", format!("{amount}m"))
        } else {
            ("CUDA_DEVICE_SM_LIMIT", amount.to_string())
        };
        envs.insert(key.into(), value);
    }
    ContainerAllocateResponse {
        envs,
        mounts: template.mounts.clone(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Plan;

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
        let r = container_response(
            m,
            &on(1, 10),
            &ResponseTemplate::new(&c, Resource::GpuMemory),
        )
        .unwrap();
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
        let r = container_response(m, &on(0, 3), &ResponseTemplate::new(&c, Resource::GpuCore))
            .unwrap();
        assert_eq!(r.envs["DOSLAB_IO_GPU_CORE"], "15");
        assert_eq!(r.envs["CUDA_DEVICE_SM_LIMIT"], "15");
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
    }

    #[test]
    fn count_grant_lists_every_uuid() {
        let (c, p) = setup("");
        let m = p.model(Resource::GpuCount).unwrap();
        let both = [DeviceRef { gpu: 1, unit: 0 }, DeviceRef { gpu: 0, unit: 0 }];
        let r =
            container_response(m, &both, &ResponseTemplate::new(&c, Resource::GpuCount)).unwrap();
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-b,GPU-a");
        assert!(!r.envs.contains_key("DOSLAB_IO_GPU_COUNT"));
    }

    #[test]
    fn shared_grant_across_gpus_is_refused() {
        let (c, p) = setup("");
        let m = p.model(Resource::GpuMemory).unwrap();
        let mut d = on(0, 2);
        d.extend(on(1, 1));
        let e =
            container_response(m, &d, &ResponseTemplate::new(&c, Resource::GpuMemory)).unwrap_err();
        assert!(
            e.to_string().contains("GPU-a") && e.to_string().contains("GPU-b"),
            "{e}"
        );
        let e = container_response(m, &[], &ResponseTemplate::new(&c, Resource::GpuMemory))
            .unwrap_err();
        assert_eq!(e, AllocateError::Empty);
    }

    #[test]
    fn operator_envs_and_mounts_are_added() {
        let extra = "[allocate]\nenvs = { NVIDIA_DRIVER_CAPABILITIES = \"all\", LD_PRELOAD = \"/l.so\" }\n\
                     [[allocate.mounts]]\nhost_path = \"/h\"\ncontainer_path = \"/c\"\nread_only = true";
        let (c, p) = setup(extra);
        let m = p.model(Resource::GpuCore).unwrap();
        let r = container_response(m, &on(0, 1), &ResponseTemplate::new(&c, Resource::GpuCore))
            .unwrap();
        assert_eq!(r.envs["NVIDIA_DRIVER_CAPABILITIES"], "all");
        assert_eq!(r.envs["LD_PRELOAD"], "/l.so");
        assert_eq!(r.mounts.len(), 1);
        assert!(r.mounts[0].read_only);
        assert_eq!(r.mounts[0].container_path, "/c");
    }
}
