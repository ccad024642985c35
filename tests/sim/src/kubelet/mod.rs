//! A kubelet stand-in for the demo and the tests, behaving as the real
//! one's device manager (pkg/kubelet/cm/devicemanager) does: Register dials
//! the plugin back (10 s) and opens ListAndWatch before it returns; each
//! list replaces the device set; a message over 4 MiB fails the stream; an
//! ended stream marks every device unhealthy and is never reopened; an
//! older stream that ends after a re-registration drops the new client too
//! (kubernetes#121994); admission asks GetPreferredAllocation, keeps valid
//! IDs, fills the shortfall itself, then calls Allocate; a container after
//! init containers takes their devices first and asks
//! GetPreferredAllocation (with them as must-include) only for the rest;
//! the pods bound to the node are admitted one at a time (`admission`).

mod admission;
mod registration;

pub use admission::pod_containers;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use gpu_device_plugin::api::device_plugin_client::DevicePluginClient;
use gpu_device_plugin::api::registration_server::RegistrationServer;
use gpu_device_plugin::api::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, DevicePluginOptions, PreferredAllocationRequest,
};

/// The kubelet's gRPC receive limit.
pub(crate) const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// What the kubelet knows of one resource.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceView {
    pub registrations: u32,
    pub stream_open: bool,
    pub devices: usize,
    pub healthy: usize,
    /// ListAndWatch messages received, over every stream.
    pub messages: u64,
    pub last_message_bytes: usize,
    pub stream_error: Option<String>,
}

/// One resource's grant in an admitted container.
#[derive(Debug, Clone)]
pub struct AllocatedResource {
    pub resource: String,
    pub device_ids: Vec<String>,
    pub response: ContainerAllocateResponse,
    /// How long the Allocate call took, as the kubelet saw it.
    pub allocate_took: Duration,
}

/// A registered plugin's connection; gone when the kubelet restarts.
struct Endpoint {
    generation: u64,
    client: DevicePluginClient<Channel>,
    options: DevicePluginOptions,
    /// ID → healthy.
    devices: BTreeMap<String, bool>,
    reader: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct SimState {
    endpoints: BTreeMap<String, Endpoint>,
    /// What the kubelet reports per resource; outlives restarts.
    views: BTreeMap<String, ResourceView>,
    /// Device IDs in use per resource; like the kubelet's checkpoint, it
    /// outlives plugin re-registrations and kubelet restarts.
    allocated: BTreeMap<String, BTreeSet<String>>,
    /// The pods admitted (or refused) by UID, with the device IDs each
    /// holds per resource.
    pods: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
    generations: u64,
}

struct KubeletState {
    state: Mutex<SimState>,
    /// Bumped on every change, so waiters wake.
    version: watch::Sender<u64>,
}

impl KubeletState {
    fn update<T>(&self, f: impl FnOnce(&mut SimState) -> T) -> T {
        let out = f(&mut self.state.lock().expect("kubelet sim lock poisoned"));
        self.version.send_modify(|v| *v += 1);
        out
    }
}

pub use gpu_device_plugin::net::uds::plugin_sockets;

/// The device manager's checkpoint: the one file a restart keeps.
pub(crate) const CHECKPOINT: &str = "kubelet_internal_checkpoint";

pub struct KubeletSim {
    dir: PathBuf,
    shared: Arc<KubeletState>,
    server: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
    order: Mutex<ResourceOrder>,
}

/// The order in which admission serves one container's resources. The real
/// kubelet walks a Go map, so any order comes; the stand-in draws it from a
/// seed, so a failure can be replayed, or tests force one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResourceOrder {
    /// A random order per container from this xorshift state (not zero).
    Seeded(u64),
    /// These resource names first, in this order; any other after them.
    Given(Vec<String>),
}

impl ResourceOrder {
    /// `asks` in this order; a seeded order moves on to its next draw.
    fn arrange(&mut self, asks: &mut [(String, usize)]) {
        match self {
            ResourceOrder::Seeded(state) => {
                for i in (1..asks.len()).rev() {
                    // xorshift64: enough to shuffle three resources.
                    *state ^= *state << 13;
                    *state ^= *state >> 7;
                    *state ^= *state << 17;
                    asks.swap(i, (*state % (i as u64 + 1)) as usize);
                }
            }
            ResourceOrder::Given(names) => {
                asks.sort_by_key(|(r, _)| names.iter().position(|n| n == r).unwrap_or(usize::MAX));
            }
        }
    }
}

impl KubeletSim {
    /// Starts serving `<dir>/kubelet.sock`.
    pub fn start(dir: &Path) -> std::io::Result<KubeletSim> {
        let shared = Arc::new(KubeletState {
            state: Mutex::new(SimState::default()),
            version: watch::channel(0).0,
        });
        let mut sim = KubeletSim {
            dir: dir.to_owned(),
            shared,
            server: None,
            order: Mutex::new(ResourceOrder::Seeded(0x9e37_79b9_7f4a_7c15)),
        };
        std::fs::write(dir.join(CHECKPOINT), "{}")?;
        sim.serve()?;
        Ok(sim)
    }

    fn serve(&mut self) -> std::io::Result<()> {
        let incoming = gpu_device_plugin::net::uds::bind(&self.dir.join("kubelet.sock"))?;
        let service = registration::RegistrationService {
            dir: self.dir.clone(),
            shared: self.shared.clone(),
        };
        let routes = tonic::service::Routes::new(RegistrationServer::new(service));
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let stopped = async {
                let _ = stop_rx.await;
            };
            if let Err(e) = gpu_device_plugin::net::uds::serve(routes, incoming, stopped).await {
                tracing::error!(error = %e, "kubelet simulator server failed");
            }
        });
        self.server = Some((stop_tx, task));
        Ok(())
    }

    async fn stop_serving(&mut self) {
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(());
            let _ = task.await;
        }
    }

    /// Restarts the kubelet as the real one does: its connections die, every
    /// file in the directory but the checkpoint is deleted (plugin sockets
    /// included), and a new `kubelet.sock` appears.
    pub async fn restart(&mut self) -> std::io::Result<()> {
        self.stop_serving().await;
        let endpoints = self.shared.update(|s| {
            for v in s.views.values_mut() {
                v.stream_open = false;
                v.healthy = 0;
            }
            std::mem::take(&mut s.endpoints)
        });
        for (_, e) in endpoints {
            if let Some(reader) = e.reader {
                reader.abort();
                let _ = reader.await;
            }
        }
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            if entry.file_name() != CHECKPOINT && entry.file_type()?.is_file()
                || gpu_device_plugin::net::uds::is_socket(&entry)
            {
                std::fs::remove_file(entry.path())?;
            }
        }
        self.serve()
    }

    /// How admission orders each container's resources from now on (a
    /// seed of zero, which xorshift cannot leave, is taken as one).
    pub fn set_order(&self, order: ResourceOrder) {
        let order = match order {
            ResourceOrder::Seeded(0) => ResourceOrder::Seeded(1),
            o => o,
        };
        *self.order.lock().expect("kubelet sim lock poisoned") = order;
    }

    /// `asks` in the order admission serves them (see [`ResourceOrder`]).
    pub(crate) fn arrange(&self, mut asks: Vec<(String, usize)>) -> Vec<(String, usize)> {
        let mut order = self.order.lock().expect("kubelet sim lock poisoned");
        order.arrange(&mut asks);
        asks
    }

    /// What the kubelet knows, per resource name.
    pub fn snapshot(&self) -> BTreeMap<String, ResourceView> {
        let state = self.shared.state.lock().expect("kubelet sim lock poisoned");
        state.views.clone()
    }

    /// Waits until `done(snapshot)` holds; false on timeout.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        done: impl Fn(&BTreeMap<String, ResourceView>) -> bool,
    ) -> bool {
        let mut rx = self.shared.version.subscribe();
        tokio::time::timeout(timeout, async {
            loop {
                if done(&self.snapshot()) {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await
        .is_ok()
    }

    /// The client the kubelet holds for a resource, for raw calls.
    pub fn client(&self, resource: &str) -> Option<DevicePluginClient<Channel>> {
        let state = self.shared.state.lock().expect("kubelet sim lock poisoned");
        state.endpoints.get(resource).map(|e| e.client.clone())
    }

    /// Healthy, unallocated device IDs of a resource.
    pub fn free_devices(&self, resource: &str) -> Vec<String> {
        let state = self.shared.state.lock().expect("kubelet sim lock poisoned");
        let none = BTreeSet::new();
        let allocated = state.allocated.get(resource).unwrap_or(&none);
        state.endpoints.get(resource).map_or_else(Vec::new, |e| {
            e.devices
                .iter()
                .filter(|(id, healthy)| **healthy && !allocated.contains(*id))
                .map(|(id, _)| id.clone())
                .collect()
        })
    }

    /// Admits one container asking `amount` devices of each resource, in the
    /// order given, as the kubelet's device manager does. On any failure the
    /// container's devices are released and the error text returned.
    pub async fn admit(
        &self,
        requests: &[(impl AsRef<str>, usize)],
    ) -> Result<Vec<AllocatedResource>, String> {
        self.admit_reusing(requests, &[]).await
    }

    /// [`admit`](Self::admit) for a container after its pod's init
    /// containers, as the kubelet's `devicesToAllocate` does: the devices of
    /// `reusable` (the init containers' grants) come first; when they cover
    /// the ask there is no GetPreferredAllocation, otherwise the rest is
    /// taken fresh with the reused IDs as `must_include`.
    pub async fn admit_reusing(
        &self,
        requests: &[(impl AsRef<str>, usize)],
        reusable: &[AllocatedResource],
    ) -> Result<Vec<AllocatedResource>, String> {
        let mut grants: Vec<AllocatedResource> = Vec::new();
        // Only what this container took fresh goes back on a failure: reused
        // IDs stay with the init container.
        let mut fresh: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (resource, amount) in requests {
            let resource = resource.as_ref();
            // Grants of several init containers name the IDs one handed to
            // the next more than once: the kubelet reuses their union.
            let mut seen = HashSet::new();
            let reuse: Vec<String> = reusable
                .iter()
                .filter(|g| g.resource == resource)
                .flat_map(|g| &g.device_ids)
                .filter(|id| seen.insert(*id))
                .take(*amount)
                .cloned()
                .collect();
            match self.admit_one(resource, *amount, reuse).await {
                Ok((g, taken)) => {
                    fresh.entry(g.resource.clone()).or_default().extend(taken);
                    grants.push(g);
                }
                Err(e) => {
                    self.shared.update(|s| admission::release(s, &fresh));
                    return Err(e);
                }
            }
        }
        Ok(grants)
    }

    /// Admits `amount` devices of one resource, `reused` first; returns the
    /// grant and the IDs it took fresh.
    async fn admit_one(
        &self,
        resource: &str,
        amount: usize,
        reused: Vec<String>,
    ) -> Result<(AllocatedResource, Vec<String>), String> {
        let (mut client, options) = {
            let state = self.shared.state.lock().expect("kubelet sim lock poisoned");
            let e = state
                .endpoints
                .get(resource)
                .ok_or_else(|| format!("unknown resource {resource}"))?;
            (e.client.clone(), e.options)
        };
        let reused_n = reused.len();
        let mut chosen = reused;
        let mut taken: HashSet<String> = chosen.iter().cloned().collect();
        if chosen.len() < amount {
            let free = self.free_devices(resource);
            let needed = amount - chosen.len();
            if free.len() < needed {
                return Err(format!(
                    "insufficient {resource}: requested {needed}, available {}",
                    free.len()
                ));
            }
            if options.get_preferred_allocation_available {
                let request = PreferredAllocationRequest {
                    container_requests: vec![ContainerPreferredAllocationRequest {
                        available_device_i_ds: chosen.iter().chain(&free).cloned().collect(),
                        must_include_device_i_ds: chosen.clone(),
                        allocation_size: amount as i32,
                    }],
                };
                let hint = client
                    .get_preferred_allocation(request)
                    .await
                    .map_err(|s| format!("GetPreferredAllocation: {}", s.message()))?
                    .into_inner();
                let free_set: HashSet<&String> = free.iter().collect();
                for id in hint
                    .container_responses
                    .into_iter()
                    .flat_map(|r| r.device_i_ds)
                {
                    if chosen.len() < amount && free_set.contains(&id) && taken.insert(id.clone()) {
                        chosen.push(id);
                    }
                }
            }
            // The hint is only a hint: fill any shortfall from the free list.
            for id in free {
                if chosen.len() >= amount {
                    break;
                }
                if taken.insert(id.clone()) {
                    chosen.push(id);
                }
            }
        }
        let fresh: Vec<String> = chosen[reused_n..].to_vec();
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: chosen.clone(),
            }],
        };
        let started = std::time::Instant::now();
        let mut response = client
            .allocate(request)
            .await
            .map_err(|s| format!("UnexpectedAdmissionError: {}", s.message()))?
            .into_inner();
        let allocate_took = started.elapsed();
        let response = response
            .container_responses
            .pop()
            .ok_or("Allocate returned no container response")?;
        self.shared.update(|s| {
            s.allocated
                .entry(resource.to_owned())
                .or_default()
                .extend(chosen.iter().cloned());
        });
        Ok((
            AllocatedResource {
                resource: resource.to_owned(),
                device_ids: chosen,
                response,
                allocate_took,
            },
            fresh,
        ))
    }

    /// Stops serving and removes `kubelet.sock`.
    pub async fn stop(mut self) {
        self.stop_serving().await;
        let _ = std::fs::remove_file(self.dir.join("kubelet.sock"));
    }
}

/// The container's envs as the kubelet merges them: first value wins.
pub fn merged_envs(grants: &[AllocatedResource]) -> BTreeMap<String, String> {
    let mut envs = BTreeMap::new();
    for g in grants {
        for (k, v) in &g.response.envs {
            envs.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    envs
}

/// Does to `dir` what the kubelet does to a ConfigMap volume, with
/// `config.toml` in version `version` (a number new to `dir`): the data in
/// a new directory, `..data` renamed onto it, `config.toml` a link through
/// `..data`. The tests edit a daemon's config through it.
pub fn swap_configmap(dir: &Path, version: u32, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::symlink;
    let data = dir.join(format!("..2026_11_23_{version}"));
    std::fs::create_dir(&data)?;
    std::fs::write(data.join("config.toml"), text)?;
    let tmp = dir.join("..data_tmp");
    symlink(data.file_name().expect("a named directory"), &tmp)?;
    std::fs::rename(&tmp, dir.join("..data"))?;
    if !dir.join("config.toml").exists() {
        symlink("..data/config.toml", dir.join("config.toml"))?;
    }
    Ok(())
}
