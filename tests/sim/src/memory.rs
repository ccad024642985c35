//! An in-memory cluster for tests and the benchmark: it keeps pods with
//! resourceVersions as the API server does, answers the [`Binder`] calls
//! (refusing stale Bindings), and feeds the same [`Index`] the reflectors
//! would, at once or, while lagging, when told to catch up. Faults can be
//! injected: conflicting writes by others and failing Bindings.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};

use gpu_device_plugin::config::Config;
use gpu_device_plugin::extender::{BindError, Binder, ExtenderConfig, Index, PodName, pod_name};
use gpu_device_plugin::rules::device::Gpu;
use gpu_device_plugin::rules::usage::Inventory;

use crate::apiserver::PodContainer;

#[derive(Default)]
struct State {
    pods: BTreeMap<PodName, Pod>,
    rv: u64,
    /// Writes the index has not seen yet (a lagging watch).
    unseen: VecDeque<Pod>,
    lagging: bool,
    conflicts: u32,
    failing_bindings: u32,
    bindings: u64,
    /// Per call (`get`, `bind`): how long its answer takes after
    /// the call has done its work, as from a loaded API server.
    late: BTreeMap<&'static str, Duration>,
}

#[derive(Clone)]
pub struct MemoryCluster {
    index: Arc<RwLock<Index>>,
    state: Arc<Mutex<State>>,
}

impl Default for MemoryCluster {
    fn default() -> Self {
        MemoryCluster::new()
    }
}

impl MemoryCluster {
    /// An empty cluster whose index counts as synced and reads the default
    /// domain's annotations, the ones [`gpu_node`] writes.
    pub fn new() -> MemoryCluster {
        let mut index = Index::new(&ExtenderConfig::default().resource_domain);
        index.replace_nodes(Vec::new());
        index.replace_pods(Vec::new());
        MemoryCluster {
            index: Arc::new(RwLock::new(index)),
            state: Arc::default(),
        }
    }

    pub fn index(&self) -> Arc<RwLock<Index>> {
        self.index.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("memory cluster lock poisoned")
    }

    pub fn add_node(&self, node: Node) {
        self.index.write().expect("index").apply_node(node);
    }

    /// Stores `pod` (a new resourceVersion, a UID from its name if it has
    /// none), as a create or an update by someone else.
    pub fn put_pod(&self, mut pod: Pod) {
        let mut s = self.lock();
        s.rv += 1;
        pod.metadata.resource_version = Some(s.rv.to_string());
        let key = pod_name(&pod);
        pod.metadata
            .uid
            .get_or_insert_with(|| format!("uid-{}-{}", key.0, key.1));
        s.pods.insert(key, pod.clone());
        self.publish(&mut s, pod);
    }

    pub fn delete_pod(&self, key: &PodName) {
        let mut s = self.lock();
        s.pods.remove(key);
        self.index.write().expect("index").delete_pod(key);
    }

    pub fn pod(&self, key: &PodName) -> Option<Pod> {
        self.lock().pods.get(key).cloned()
    }

    /// While lagging, the index sees no write until [`Self::catch_up`].
    pub fn set_lagging(&self, lagging: bool) {
        self.lock().lagging = lagging;
    }

    pub fn catch_up(&self) {
        let mut s = self.lock();
        let mut ix = self.index.write().expect("index");
        for pod in s.unseen.drain(..) {
            ix.apply_pod(pod);
        }
    }

    /// The next `n` Bindings with a resourceVersion find the pod changed.
    pub fn conflict_next(&self, n: u32) {
        self.lock().conflicts = n;
    }

    /// The next `n` Bindings fail.
    pub fn fail_bindings(&self, n: u32) {
        self.lock().failing_bindings = n;
    }

    /// Calls `verb` (`get` or `bind`) answer `after` their work is
    /// done: a caller that stops waiting does not undo what they did.
    pub fn answer_late(&self, verb: &'static str, after: Duration) {
        self.lock().late.insert(verb, after);
    }

    async fn answer<T>(&self, verb: &'static str, result: T) -> T {
        let late = self.lock().late.get(verb).copied();
        if let Some(d) = late {
            tokio::time::sleep(d).await;
        }
        result
    }

    /// Bindings created so far.
    pub fn bindings(&self) -> u64 {
        self.lock().bindings
    }

    fn publish(&self, s: &mut State, pod: Pod) {
        if s.lagging {
            s.unseen.push_back(pod);
        } else {
            self.index.write().expect("index").apply_pod(pod);
        }
    }

    fn update(&self, key: &PodName, change: impl FnOnce(&mut Pod)) -> Result<Pod, BindError> {
        let mut s = self.lock();
        s.rv += 1;
        let rv = s.rv.to_string();
        let pod = s.pods.get_mut(key).ok_or(BindError::NotFound)?;
        change(pod);
        pod.metadata.resource_version = Some(rv);
        let pod = pod.clone();
        self.publish(&mut s, pod.clone());
        Ok(pod)
    }
}

impl Binder for MemoryCluster {
    async fn get_pod(&self, key: &PodName) -> Result<Option<Pod>, BindError> {
        self.answer("get", Ok(self.pod(key))).await
    }

    async fn bind(
        &self,
        key: &PodName,
        uid: &str,
        resource_version: Option<&str>,
        node: &str,
        annotations: &BTreeMap<String, String>,
    ) -> Result<(), BindError> {
        {
            let mut s = self.lock();
            if s.failing_bindings > 0 {
                s.failing_bindings -= 1;
                return Err(BindError::Api("injected Binding failure".into()));
            }
            let pod = s.pods.get(key).ok_or(BindError::NotFound)?;
            let spec = pod.spec.as_ref();
            if !uid.is_empty() && pod.metadata.uid.as_deref() != Some(uid)
                || spec.and_then(|s| s.node_name.as_deref()).is_some()
            {
                return Err(BindError::Conflict);
            }
            if let Some(rv) = resource_version {
                if pod.metadata.resource_version.as_deref() != Some(rv) {
                    return Err(BindError::Conflict);
                }
                if s.conflicts > 0 {
                    s.conflicts -= 1;
                    drop(s);
                    // Someone else's write lands first.
                    self.update(key, |_| {})?;
                    return Err(BindError::Conflict);
                }
            }
            s.bindings += 1;
        }
        // The node and the annotations in one update, as the API server
        // applies a Binding.
        let done = self.update(key, |pod| {
            pod.spec.get_or_insert_default().node_name = Some(node.to_owned());
            let on_pod = pod.metadata.annotations.get_or_insert_default();
            on_pod.extend(annotations.clone());
        });
        self.answer("bind", done.map(drop)).await
    }
}

/// A Node publishing `gpus` (UUID, MiB) in its `doslab.io/gpu-inventory`,
/// 1 MiB per memory device and 1 % per core device, every resource on.
pub fn gpu_node(name: &str, gpus: &[(&str, u64)]) -> Node {
    let gpus: Vec<Gpu> = (0..)
        .zip(gpus)
        .map(|(index, &(uuid, memory_mib))| Gpu {
            uuid: uuid.into(),
            memory_mib,
            index,
            numa_node: None,
        })
        .collect();
    // What the node daemon publishes on the default config.
    let inventory = Inventory::new(&gpus, &Config::default().offer());
    let text = serde_json::to_string(&inventory).expect("an inventory serialises");
    node_with(name, Some(&text))
}

/// A Node with `inventory` as its `doslab.io/gpu-inventory` text, or none.
pub fn node_with(name: &str, inventory: Option<&str>) -> Node {
    let annotations: serde_json::Map<String, serde_json::Value> = inventory
        .map(|text| ("doslab.io/gpu-inventory".to_owned(), text.into()))
        .into_iter()
        .collect();
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "annotations": annotations },
    }))
    .expect("a valid Node")
}

/// An unscheduled Pending pod asking, per container, the devices of
/// `containers` (`doslab.io/…` limits).
pub fn gpu_pod(namespace: &str, name: &str, containers: &[PodContainer]) -> Pod {
    let spec = |init: bool| -> Vec<serde_json::Value> {
        containers
            .iter()
            .filter(|c| c.init == init)
            .map(PodContainer::spec)
            .collect()
    };
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "namespace": namespace, "uid": format!("uid-{namespace}-{name}") },
        "spec": { "initContainers": spec(true), "containers": spec(false) },
        "status": { "phase": "Pending" },
    }))
    .expect("a valid Pod")
}
