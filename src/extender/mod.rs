//! The kube-scheduler extender (`gpu-device-plugin scheduler-extender`):
//! filter, prioritize and bind for pods that ask for GPU resources, so that
//! every container's shared ask lands on one GPU with room and every
//! whole-GPU ask on free whole GPUs, and the pod carries its per-container
//! assignment before it is bound.
//!
//! `index` (the cluster as the reflectors see it) and `plan` (the
//! decisions) are pure; `cluster` does the API-server I/O behind the
//! [`Binder`] trait; `server` is the HTTP adapter. [`Extender`] ties them:
//! filter and prioritize read a snapshot, binds run one at a time.

mod cluster;
pub(crate) mod config;
mod index;
#[cfg(feature = "sim")]
pub mod memory;
mod plan;
mod server;
pub mod wire;

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

pub use cluster::{BindError, Binder, KubeBinder, Reflectors};
pub use config::ExtenderConfig;
pub use index::{Index, PodName};
pub use plan::Planner;
pub use server::start;

use wire::{ExtenderArgs, ExtenderBindingArgs, ExtenderFilterResult, HostPriority, NodeList};

pub struct Extender<B> {
    planner: Planner,
    index: Arc<RwLock<Index>>,
    binder: B,
    /// One bind at a time: each plans against the state the previous left.
    bind_lock: tokio::sync::Mutex<()>,
    bind_timeout: Duration,
}

/// How often a bind re-reads and re-plans a pod that changed under it.
const BIND_ATTEMPTS: usize = 3;

impl<B: Binder> Extender<B> {
    pub fn new(config: &ExtenderConfig, index: Arc<RwLock<Index>>, binder: B) -> Self {
        Extender {
            planner: Planner::new(&config.resource_domain, config.policy),
            index,
            binder,
            bind_lock: tokio::sync::Mutex::new(()),
            bind_timeout: Duration::from_millis(config.bind_timeout_ms),
        }
    }

    fn snapshot(&self) -> std::sync::RwLockReadGuard<'_, Index> {
        self.index.read().expect("index lock poisoned")
    }

    pub fn filter(&self, args: &ExtenderArgs) -> ExtenderFilterResult {
        let Some(pod) = &args.pod else {
            return ExtenderFilterResult::error("gpu extender: the filter request has no Pod");
        };
        let names = args.names();
        let mut result = ExtenderFilterResult::default();
        let mut passed: Vec<String> = Vec::new();
        match self.planner.asks(pod) {
            // Not ours to judge: every node passes, nothing is read.
            None => passed = names,
            Some(asks) => {
                let ix = self.snapshot();
                if !ix.synced() {
                    return ExtenderFilterResult::error(
                        "gpu extender: not yet synced with the API server; try again shortly",
                    );
                }
                for name in names {
                    match self.planner.fits(&ix, &name, &asks) {
                        Ok(_) => passed.push(name),
                        Err(refusal) if refusal.never => {
                            result
                                .failed_and_unresolvable_nodes
                                .insert(name, refusal.reason);
                        }
                        Err(refusal) => {
                            result.failed_nodes.insert(name, refusal.reason);
                        }
                    }
                }
            }
        }
        // Answer in the shape asked: names for a node-cache-capable
        // scheduler, the Node objects themselves otherwise.
        match &args.nodes {
            Some(list) if args.node_names.is_none() => {
                let passed: HashSet<&str> = passed.iter().map(String::as_str).collect();
                let items = list
                    .items
                    .iter()
                    .filter(|n| passed.contains(wire::node_name(n).as_str()))
                    .cloned()
                    .collect();
                result.nodes = Some(NodeList { items });
            }
            _ => result.node_names = Some(passed),
        }
        result
    }

    pub fn prioritize(&self, args: &ExtenderArgs) -> Result<Vec<HostPriority>, String> {
        let pod = args
            .pod
            .as_ref()
            .ok_or("gpu extender: the prioritize request has no Pod")?;
        let names = args.names();
        let asks = self.planner.asks(pod);
        let ix = self.snapshot();
        Ok(names
            .into_iter()
            .map(|host| {
                let score = asks
                    .as_ref()
                    .map_or(0, |a| self.planner.score(&ix, &host, a));
                HostPriority {
                    host,
                    score: i64::from(score),
                }
            })
            .collect())
    }

    /// Places the pod's containers on GPUs of `args.node`, records the
    /// assignment on the pod, then binds it. On failure nothing stays
    /// reserved and the pod's annotations are as before.
    pub async fn bind(&self, args: &ExtenderBindingArgs) -> Result<(), String> {
        let _one = self.bind_lock.lock().await;
        let key: PodName = (args.pod_namespace.clone(), args.pod_name.clone());
        let who = format!("pod {}/{}", key.0, key.1);
        let result = self.bind_locked(&key, args).await;
        match &result {
            Ok(()) => tracing::info!(pod = %who, node = %args.node, "bound"),
            Err(e) => tracing::warn!(pod = %who, node = %args.node, error = %e, "bind refused"),
        }
        result.map_err(|e| format!("gpu extender: cannot bind {who} to node {}: {e}", args.node))
    }

    async fn within<T>(
        &self,
        deadline: Instant,
        call: impl Future<Output = Result<T, BindError>>,
    ) -> Result<T, BindError> {
        tokio::time::timeout_at(deadline.into(), call)
            .await
            .unwrap_or_else(|_| Err(BindError::Api("no answer in time".into())))
    }

    async fn bind_locked(&self, key: &PodName, args: &ExtenderBindingArgs) -> Result<(), String> {
        let deadline = Instant::now() + self.bind_timeout;
        let node = args.node.as_str();
        let mut attempts = 0;
        let patched = loop {
            let pod = self
                .within(deadline, self.binder.get_pod(key))
                .await
                .map_err(|e| e.to_string())?
                .ok_or("the pod does not exist")?;
            let uid = pod.metadata.uid.as_deref().unwrap_or_default();
            if !args.pod_uid.is_empty() && uid != args.pod_uid {
                return Err(format!(
                    "the pod is now another one (UID {uid}, the scheduler bound UID {})",
                    args.pod_uid
                ));
            }
            if let Some(bound) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
                // A retried bind after one that worked is answered the same.
                return if bound == node {
                    Ok(())
                } else {
                    Err(format!("it is already bound to node {bound}"))
                };
            }
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            let Some(plan) = self.planner.plan_bind(&self.snapshot(), &pod, node, now)? else {
                break None;
            };
            self.index
                .write()
                .expect("index lock poisoned")
                .reserve(plan.reserved);
            let rv = pod.metadata.resource_version.as_deref();
            let patch = self.binder.annotate(key, rv, &plan.annotations);
            match self.within(deadline, patch).await {
                Ok(_) => break Some(plan.annotations),
                Err(e) => {
                    self.release(key);
                    attempts += 1;
                    if e != BindError::Conflict || attempts == BIND_ATTEMPTS {
                        return Err(format!("recording the GPU assignment failed: {e}"));
                    }
                }
            }
        };
        let uid = args.pod_uid.as_str();
        let bound = self
            .within(deadline, self.binder.bind(key, uid, node))
            .await;
        let Err(e) = bound else { return Ok(()) };
        // The Binding may have landed although its answer did not.
        if let Ok(Some(pod)) = self.within(deadline, self.binder.get_pod(key)).await
            && pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
        {
            return Ok(());
        }
        if let Some(annotations) = patched {
            self.undo(key, &annotations).await;
        }
        self.release(key);
        Err(format!("creating the Binding failed: {e}"))
    }

    fn release(&self, key: &PodName) {
        self.index
            .write()
            .expect("index lock poisoned")
            .release(key);
    }

    /// Removes the annotations a failed bind wrote. It gets a deadline of
    /// its own: the bind's may be what ran out.
    async fn undo(
        &self,
        key: &PodName,
        written: &std::collections::BTreeMap<String, Option<String>>,
    ) {
        let removal = written.keys().map(|k| (k.clone(), None)).collect();
        let deadline = Instant::now() + self.bind_timeout;
        let call = self.binder.annotate(key, None, &removal);
        if let Err(e) = self.within(deadline, call).await {
            tracing::error!(pod = ?key, error = %e,
                "cannot remove the GPU assignment of a pod whose bind failed; \
                 it holds nothing while unbound, and its next bind replaces it");
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExtenderError {
    #[error(transparent)]
    Client(#[from] crate::kube_client::KubeClientError),
    #[error("cannot listen on {addr} (config key `extender.listen`): {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
}

/// A started extender: where it listens and the index its reflectors keep.
/// The reflectors stop when it is dropped.
pub(crate) struct Started {
    pub(crate) addr: std::net::SocketAddr,
    /// The demo waits on it to sync before it schedules.
    #[cfg(feature = "sim")]
    pub(crate) index: Arc<RwLock<Index>>,
    _reflectors: Reflectors,
}

/// Starts the reflectors and the HTTP server.
pub(crate) async fn launch(config: &ExtenderConfig) -> Result<Started, ExtenderError> {
    let client =
        crate::kube_client::from_kubeconfig(&config.kubeconfig, "extender.kubeconfig").await?;
    let index = Arc::new(RwLock::new(Index::new(&config.resource_domain)));
    let reflectors = Reflectors::start(&client, index.clone());
    let extender = Arc::new(Extender::new(
        config,
        index.clone(),
        KubeBinder::new(client),
    ));
    let addr = start(config, extender)
        .await
        .map_err(|source| ExtenderError::Listen {
            addr: config.listen.clone(),
            source,
        })?;
    Ok(Started {
        addr,
        #[cfg(feature = "sim")]
        index,
        _reflectors: reflectors,
    })
}

/// Runs the extender until `stop` resolves.
pub async fn run(
    config: ExtenderConfig,
    stop: impl Future<Output = ()>,
) -> Result<(), ExtenderError> {
    let started = launch(&config).await?;
    tracing::info!(addr = %started.addr, policy = ?config.policy, "scheduler extender listening");
    stop.await;
    Ok(())
}
