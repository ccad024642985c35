//! The one place a container's envs and mounts are composed, for a
//! device-plugin Allocate ([`ResponseComposer::compose`]) and a DRA claim's
//! CDI spec alike ([`ResponseComposer::edits`]), from the grant, HAMi-core's
//! preload and the config. A new env or mount is added here, as a step of
//! its own.
//!
//! The steps run in a fixed order, and each adds only the envs no earlier
//! step has set, so the order is the precedence when two name the same env
//! (the same step-by-step build as NVIDIA's k8s-device-plugin
//! `getAllocateResponse`):
//!
//! 1. The grant: `NVIDIA_VISIBLE_DEVICES` with the GPUs' UUIDs, and for a
//!    shared grant the amount in the domain's env, the limit HAMi-core
//!    enforces (SPEC §4), and for an MPS client the limit the driver
//!    enforces. First, so that nothing else can widen or move what the
//!    kubelet granted (the config refuses these names too).
//! 2. The operator's extras (config `[allocate]`): before the library's
//!    envs and the defaults, so that an operator can override them.
//! 3. Enforcement's envs and mounts (HAMi-core's preload, MPS's pipe
//!    directory), for a shared grant under enforcement (SPEC §8); its
//!    mounts after the operator's.
//! 4. The defaults: `NVIDIA_DRIVER_CAPABILITIES=compute,utility`.

use std::collections::{BTreeMap, HashMap};

use super::ContainerGrant;
use crate::api::{ContainerAllocateResponse, Mount};
use crate::config::Config;
use crate::node::enforcement::Preload;
use crate::rules::device::{DeviceModel, Resource};

/// The driver's cap on an MPS client's SMs, in percent of the GPU.
const MPS_CORE_ENV: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// The driver's cap on an MPS client's device memory.
const MPS_MEMORY_ENV: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";

/// What a shared grant caps, whichever API granted it: a device-plugin
/// Allocate carries one of the two (its resource's), a DRA share both.
/// Neither: whole GPUs, nothing to cap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) memory_mib: Option<u64>,
    pub(crate) core_percent: Option<u64>,
}

impl Limits {
    /// A device-plugin grant's limit: its resource's amount, unless it
    /// rides inside whole GPUs.
    pub(crate) fn of(resource: Resource, grant: &ContainerGrant) -> Limits {
        let amount = Some(grant.amount).filter(|_| !grant.whole);
        match resource {
            Resource::GpuMemory => Limits {
                memory_mib: amount,
                core_percent: None,
            },
            Resource::GpuCore => Limits {
                memory_mib: None,
                core_percent: amount,
            },
            Resource::GpuCount => Limits::default(),
        }
    }

    pub(crate) fn shared(&self) -> bool {
        self.memory_mib.is_some() || self.core_percent.is_some()
    }
}

/// A container's envs and mounts, before they become an Allocate response
/// or a CDI spec's container edits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ContainerEdits {
    pub(crate) envs: HashMap<String, String>,
    pub(crate) mounts: Vec<Mount>,
}

/// Composes containers' envs and mounts; built from the config once.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ResponseComposer {
    /// The envs carrying a shared grant's amount, e.g.
    /// `DOSLAB_IO_GPU_MEMORY` (MiB) and `DOSLAB_IO_GPU_CORE` (percent).
    memory_env: String,
    core_env: String,
    /// The operator's envs and mounts for every container.
    extra_envs: BTreeMap<String, String>,
    extra_mounts: Vec<Mount>,
}

impl ResponseComposer {
    pub(crate) fn new(config: &Config) -> Self {
        let extra_mounts = config
            .allocate
            .mounts
            .iter()
            .map(|m| Mount {
                container_path: m.container_path.display().to_string(),
                host_path: m.host_path.display().to_string(),
                read_only: m.read_only,
            })
            .collect();
        ResponseComposer {
            memory_env: config.amount_env(Resource::GpuMemory),
            core_env: config.amount_env(Resource::GpuCore),
            extra_envs: config.allocate.envs.clone(),
            extra_mounts,
        }
    }

    /// The Allocate response for `grant` of `model`'s resource, with
    /// `preload` when enforcement caps it: [`ResponseComposer::edits`].
    pub(crate) fn compose(
        &self,
        model: &DeviceModel,
        grant: &ContainerGrant,
        preload: Option<Preload>,
    ) -> ContainerAllocateResponse {
        let gpus = model.gpus();
        let uuids: Vec<&str> = grant.gpus.iter().map(|&g| gpus[g].uuid.as_str()).collect();
        let edits = self.edits(&uuids, Limits::of(model.resource(), grant), preload);
        ContainerAllocateResponse {
            envs: edits.envs,
            mounts: edits.mounts,
            ..Default::default()
        }
    }

    /// The envs and mounts of a container granted the GPUs `uuids` (one
    /// for a device-plugin share, one or more for a DRA share, each capped
    /// alike) with `limits`, and `preload` when enforcement caps it; the
    /// steps are the module's, in its order. An MPS client talks to one
    /// GPU's control daemon, so MPS shares are of one GPU (DRA refuses the
    /// others before it gets here).
    ///
    /// MPS's limits, in NVIDIA's client env formats: a core limit as
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (already percent), a memory
    /// limit as `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<GPU UUID>=<MiB>M` (the
    /// variable names devices as `CUDA_VISIBLE_DEVICES` does; by UUID, so
    /// the limit names the granted GPU however the client enumerates it).
    pub(crate) fn edits(
        &self,
        uuids: &[&str],
        limits: Limits,
        preload: Option<Preload>,
    ) -> ContainerEdits {
        let mut envs = HashMap::new();
        let mut add = |key: &str, value: String| {
            envs.entry(key.to_owned()).or_insert(value);
        };
        let mut mounts = Vec::new();

        // 1. The grant.
        add("NVIDIA_VISIBLE_DEVICES", uuids.join(","));
        let mps = preload.as_ref().is_some_and(|p| p.mps);
        if let Some(mib) = limits.memory_mib {
            add(&self.memory_env, mib.to_string());
            // HAMi-core caps each visible device by its index; a DRA
            // share over several GPUs takes the same of each.
            for i in 0..uuids.len() {
                add(&format!("CUDA_DEVICE_MEMORY_LIMIT_{i}"), format!("{mib}m"));
            }
            if mps {
                add(MPS_MEMORY_ENV, format!("{}={mib}M", uuids[0]));
            }
        }
        if let Some(percent) = limits.core_percent {
            add(&self.core_env, percent.to_string());
            add("CUDA_DEVICE_SM_LIMIT", percent.to_string());
            if mps {
                add(MPS_CORE_ENV, percent.to_string());
            }
        }

        // 2. The operator's extras.
        for (key, value) in &self.extra_envs {
            add(key, value.clone());
        }
        mounts.extend(self.extra_mounts.iter().cloned());

        // 3. Enforcement's.
        if let Some(preload) = preload {
            for (key, value) in preload.envs {
                add(&key, value);
            }
            mounts.extend(preload.mounts);
        }

        // 4. The defaults.
        add("NVIDIA_DRIVER_CAPABILITIES", "compute,utility".to_owned());

        ContainerEdits { envs, mounts }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::node::enforcement::{Compute, EnforcementConfig, Mode, plan};
    use crate::node::plugin::allocate::ids_grant;
    use crate::rules::device::{DeviceRef, Plan};

    /// Two mock GPUs of 1024 MiB, 4 MiB and 5 % units, `extra` added.
    pub(crate) fn setup(extra: &str) -> (Config, Plan) {
        let text = format!(
            "pod_matching = false\nmemory_unit_mib = 4\ncores_per_gpu = 20\n{extra}\n[devices]\nbackend = \"mock\"\n\
             [[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 1024\n[[devices.mock]]\nuuid = \"GPU-b\"\nmemory_mib = 1024"
        );
        let config = Config::from_toml(&text, None).unwrap();
        let gpus = crate::rules::device::discover(&config).unwrap();
        let plan = Plan::new(&config, gpus).unwrap();
        (config, plan)
    }

    fn on(gpu: usize, n: u32) -> Vec<DeviceRef> {
        (0..n).map(|unit| DeviceRef { gpu, unit }).collect()
    }

    /// The response for `devices` of `resource`, without enforcement.
    fn respond(
        extra: &str,
        resource: Resource,
        devices: &[DeviceRef],
    ) -> ContainerAllocateResponse {
        let (c, p) = setup(extra);
        let m = p.model(resource).unwrap();
        ResponseComposer::new(&c).compose(m, &ids_grant(m, devices).unwrap(), None)
    }

    /// A DRA share over two GPUs: both visible, each capped alike by its
    /// index.
    #[test]
    fn a_share_of_several_gpus_caps_each_by_its_index() {
        let (c, _) = setup("");
        let limits = Limits {
            memory_mib: Some(20480),
            core_percent: Some(30),
        };
        let e = ResponseComposer::new(&c).edits(&["GPU-a", "GPU-b"], limits, None);
        assert_eq!(e.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        assert_eq!(e.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "20480m");
        assert_eq!(e.envs["CUDA_DEVICE_MEMORY_LIMIT_1"], "20480m");
        assert!(!e.envs.contains_key("CUDA_DEVICE_MEMORY_LIMIT_2"));
        assert_eq!(e.envs["CUDA_DEVICE_SM_LIMIT"], "30");
    }

    #[test]
    fn memory_grant_sets_uuid_amount_and_limit() {
        let r = respond("", Resource::GpuMemory, &on(1, 10));
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-b");
        assert_eq!(r.envs["NVIDIA_DRIVER_CAPABILITIES"], "compute,utility");
        assert_eq!(r.envs["DOSLAB_IO_GPU_MEMORY"], "40");
        assert_eq!(r.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "40m");
        assert!(!r.envs.contains_key("CUDA_DEVICE_SM_LIMIT"));
        assert_eq!(r.envs.len(), 4);
        assert!(r.mounts.is_empty());
    }

    #[test]
    fn core_grant_is_in_percent() {
        // 20 devices per GPU: each is 5 %.
        let r = respond("", Resource::GpuCore, &on(0, 3));
        assert_eq!(r.envs["DOSLAB_IO_GPU_CORE"], "15");
        assert_eq!(r.envs["CUDA_DEVICE_SM_LIMIT"], "15");
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
    }

    #[test]
    fn count_grant_lists_every_uuid() {
        let both = [DeviceRef { gpu: 1, unit: 0 }, DeviceRef { gpu: 0, unit: 0 }];
        let r = respond("", Resource::GpuCount, &both);
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-b,GPU-a");
        assert!(!r.envs.contains_key("DOSLAB_IO_GPU_COUNT"));
    }

    #[test]
    fn a_shared_amount_riding_whole_gpus_caps_nothing() {
        let (c, p) = setup("");
        let m = p.model(Resource::GpuMemory).unwrap();
        let grant = ContainerGrant {
            gpus: vec![0, 1],
            amount: 40,
            whole: true,
        };
        let r = ResponseComposer::new(&c).compose(m, &grant, None);
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        assert!(!r.envs.contains_key("DOSLAB_IO_GPU_MEMORY"));
        assert!(!r.envs.contains_key("CUDA_DEVICE_MEMORY_LIMIT_0"));
    }

    #[test]
    fn operator_envs_and_mounts_are_added() {
        let extra = "[allocate]\nenvs = { NVIDIA_DRIVER_CAPABILITIES = \"all\", LD_PRELOAD = \"/l.so\" }\n\
                     [[allocate.mounts]]\nhost_path = \"/h\"\ncontainer_path = \"/c\"\nread_only = true";
        let r = respond(extra, Resource::GpuCore, &on(0, 1));
        assert_eq!(r.envs["NVIDIA_DRIVER_CAPABILITIES"], "all");
        assert_eq!(r.envs["LD_PRELOAD"], "/l.so");
        assert_eq!(r.mounts.len(), 1);
        assert!(r.mounts[0].read_only);
        assert_eq!(r.mounts[0].container_path, "/c");
    }

    /// On a clash the earlier step wins: the grant over the operator (the
    /// config refuses such extras, so the composer is built by hand), the
    /// operator over HAMi-core and the defaults; mounts keep step order.
    #[test]
    fn the_earlier_step_wins_a_clash() {
        let (c, p) = setup("");
        let m = p.model(Resource::GpuMemory).unwrap();
        let operator = |k: &str| (k.to_owned(), format!("operator's {k}"));
        let composer = ResponseComposer {
            extra_envs: BTreeMap::from([
                operator("NVIDIA_VISIBLE_DEVICES"),
                operator("CUDA_DEVICE_MEMORY_LIMIT_0"),
                operator("DOSLAB_IO_GPU_MEMORY"),
                operator("CUDA_DEVICE_MEMORY_SHARED_CACHE"),
                operator("NVIDIA_DRIVER_CAPABILITIES"),
            ]),
            extra_mounts: vec![Mount {
                container_path: "/operator".into(),
                host_path: "/h".into(),
                read_only: true,
            }],
            ..ResponseComposer::new(&c)
        };
        let enforcement = EnforcementConfig {
            mode: Mode::HamiCore,
            ..Default::default()
        };
        let preload = plan::plan(&enforcement, None, "GPU-b");
        let library_mounts = preload.mounts.clone();
        let grant = ids_grant(m, &on(1, 2)).unwrap();
        let r = composer.compose(m, &grant, Some(preload));
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-b");
        assert_eq!(r.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "8m");
        assert_eq!(r.envs["DOSLAB_IO_GPU_MEMORY"], "8");
        for k in [
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            "NVIDIA_DRIVER_CAPABILITIES",
        ] {
            assert_eq!(r.envs[k], format!("operator's {k}"));
        }
        assert_eq!(r.envs["GPU_CORE_UTILIZATION_POLICY"], "force");
        assert_eq!(r.envs.len(), 6);
        let targets: Vec<&str> = r.mounts.iter().map(|m| m.container_path.as_str()).collect();
        let mut want = vec!["/operator"];
        want.extend(library_mounts.iter().map(|m| m.container_path.as_str()));
        assert_eq!(targets, want);
    }

    /// Under MPS a shared grant carries the driver's limit beside the
    /// grant's own envs; the pipe directory and /dev/shm are mounted; a
    /// grant riding whole GPUs is no MPS client.
    #[test]
    fn an_mps_client_gets_the_drivers_limits() {
        let (c, p) = setup("");
        let mps = EnforcementConfig {
            compute: Some(Compute::Mps),
            ..Default::default()
        };
        let compose = |resource, devices: &[DeviceRef]| {
            let m = p.model(resource).unwrap();
            let grant = ids_grant(m, devices).unwrap();
            let uuid = &m.gpus()[grant.gpus[0]].uuid;
            let preload = plan::plan(&mps, None, uuid);
            ResponseComposer::new(&c).compose(m, &grant, Some(preload))
        };
        let core = compose(Resource::GpuCore, &on(1, 6));
        assert_eq!(core.envs[MPS_CORE_ENV], "30");
        assert_eq!(core.envs["CUDA_DEVICE_SM_LIMIT"], "30");
        assert!(!core.envs.contains_key(MPS_MEMORY_ENV));
        assert_eq!(core.envs["CUDA_MPS_PIPE_DIRECTORY"], "/var/run/nvidia-mps");
        let hosts: Vec<&str> = core.mounts.iter().map(|m| m.host_path.as_str()).collect();
        assert_eq!(
            hosts,
            [
                "/var/run/gpu-device-plugin/mps/pipe/GPU-b",
                "/var/run/gpu-device-plugin/mps/shm"
            ]
        );
        let memory = compose(Resource::GpuMemory, &on(0, 10));
        assert_eq!(memory.envs[MPS_MEMORY_ENV], "GPU-a=40M");
        assert!(!memory.envs.contains_key(MPS_CORE_ENV));
        // Without MPS, neither.
        let r = respond("", Resource::GpuCore, &on(0, 3));
        assert!(!r.envs.contains_key(MPS_CORE_ENV));
        // Riding whole GPUs: nothing to cap, whatever the preload says.
        let m = p.model(Resource::GpuMemory).unwrap();
        let whole = ContainerGrant {
            gpus: vec![0],
            amount: 40,
            whole: true,
        };
        let preload = plan::plan(&mps, None, "GPU-a");
        let r = ResponseComposer::new(&c).compose(m, &whole, Some(preload));
        assert!(!r.envs.contains_key(MPS_MEMORY_ENV));
    }
}
