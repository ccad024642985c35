//! The extender's I/O with the API server: the reflectors that keep the
//! [`Index`] (Nodes, non-terminal Pods and PodDisruptionBudgets, watched,
//! never listed per request) and the one write a bind makes, behind the [`Binder`] trait so
//! that tests run the same bind logic on an in-memory cluster.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::PostParams;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource};
use tokio::task::JoinHandle;

use super::index::{Index, PodName, pod_name};
use crate::net::kube_client::{relisting, status_code};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindError {
    /// The pod changed since it was read (the precondition failed).
    #[error("the pod changed while being bound")]
    Conflict,
    #[error("the pod no longer exists")]
    NotFound,
    #[error("the API server: {0}")]
    Api(String),
}

/// The API-server calls of a bind: reading the pod, and its one write.
pub trait Binder: Send + Sync + 'static {
    fn get_pod(&self, pod: &PodName)
    -> impl Future<Output = Result<Option<Pod>, BindError>> + Send;

    /// Creates the pod's Binding to `node` carrying `annotations`, which
    /// the API server copies onto the pod in the same update that sets its
    /// node. `uid` makes it refuse the Binding for another pod of the same
    /// name, and `resource_version` ([`BindError::Conflict`]) for a pod
    /// that moved on since it was read.
    fn bind(
        &self,
        pod: &PodName,
        uid: &str,
        resource_version: Option<&str>,
        node: &str,
        annotations: &BTreeMap<String, String>,
    ) -> impl Future<Output = Result<(), BindError>> + Send;
}

fn api_error(e: kube::Error) -> BindError {
    match e {
        kube::Error::Api(s) if s.code == 409 => BindError::Conflict,
        kube::Error::Api(s) if s.code == 404 => BindError::NotFound,
        e => BindError::Api(e.to_string()),
    }
}

pub struct KubeBinder {
    client: Client,
}

impl KubeBinder {
    pub fn new(client: Client) -> Self {
        KubeBinder { client }
    }

    fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), namespace)
    }
}

impl Binder for KubeBinder {
    async fn get_pod(&self, (ns, name): &PodName) -> Result<Option<Pod>, BindError> {
        self.pods(ns).get_opt(name).await.map_err(api_error)
    }

    async fn bind(
        &self,
        (ns, name): &PodName,
        uid: &str,
        resource_version: Option<&str>,
        node: &str,
        annotations: &BTreeMap<String, String>,
    ) -> Result<(), BindError> {
        let mut metadata = serde_json::json!({ "name": name, "namespace": ns, "uid": uid });
        if let Some(rv) = resource_version {
            metadata["resourceVersion"] = rv.into();
        }
        if !annotations.is_empty() {
            metadata["annotations"] = serde_json::json!(annotations);
        }
        let binding = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": metadata,
            "target": { "apiVersion": "v1", "kind": "Node", "name": node },
        });
        self.pods(ns)
            .create_subresource::<_, serde_json::Value>(
                "binding",
                name,
                &PostParams::default(),
                &binding,
            )
            .await
            .map(drop)
            .map_err(api_error)
    }
}

/// What a reflector does with the objects of one kind.
trait Reflect: Resource<DynamicType = ()> + Clone + Send + 'static {
    fn apply(index: &mut Index, obj: Self);
    fn delete(index: &mut Index, obj: &Self);
    fn replace(index: &mut Index, all: Vec<Self>);
    /// The watch failed: stale until the next `replace`.
    fn unsync(index: &mut Index, why: String);
}

impl Reflect for Node {
    fn apply(index: &mut Index, obj: Self) {
        index.apply_node(obj);
    }
    fn delete(index: &mut Index, obj: &Self) {
        index.delete_node(obj.metadata.name.as_deref().unwrap_or_default());
    }
    fn replace(index: &mut Index, all: Vec<Self>) {
        index.replace_nodes(all);
    }
    fn unsync(index: &mut Index, why: String) {
        index.unsync_nodes(why);
    }
}

impl Reflect for Pod {
    fn apply(index: &mut Index, obj: Self) {
        index.apply_pod(obj);
    }
    fn delete(index: &mut Index, obj: &Self) {
        index.delete_pod(&pod_name(obj));
    }
    fn replace(index: &mut Index, all: Vec<Self>) {
        index.replace_pods(all);
    }
    fn unsync(index: &mut Index, why: String) {
        index.unsync_pods(why);
    }
}

impl Reflect for PodDisruptionBudget {
    fn apply(index: &mut Index, obj: Self) {
        index.apply_budget(&obj);
    }
    fn delete(index: &mut Index, obj: &Self) {
        index.delete_budget(obj);
    }
    fn replace(index: &mut Index, all: Vec<Self>) {
        index.replace_budgets(&all);
    }
    /// Budgets only weigh preemption's choices: the last ones known stay,
    /// and placing pods goes on (the failure is logged by the reflector).
    fn unsync(_: &mut Index, _: String) {}
}

/// Keeps `index` in step with the API server's objects of one kind; after
/// a failed watch the kind is stale until it has been listed again, which
/// [`relisting`] does within about a second of the API server answering.
fn reflect<K>(api: Api<K>, config: watcher::Config, index: Arc<RwLock<Index>>) -> JoinHandle<()>
where
    K: Reflect + std::fmt::Debug + serde::de::DeserializeOwned + Sync,
{
    let kind = K::kind(&()).into_owned();
    tokio::spawn(async move {
        let stream = relisting(api, config);
        futures::pin_mut!(stream);
        // A relist replaces the whole set at its end, so a half-done one
        // never hides pods that still hold GPUs.
        let mut relist: Vec<K> = Vec::new();
        while let Some(event) = stream.next().await {
            let event = match event {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(%kind, code = ?status_code(&e), error = %e,
                        "watch failed; listing again");
                    K::unsync(
                        &mut index.write().expect("index lock poisoned"),
                        e.to_string(),
                    );
                    continue;
                }
            };
            let mut ix = index.write().expect("index lock poisoned");
            match event {
                Event::Apply(obj) => K::apply(&mut ix, obj),
                Event::Delete(obj) => K::delete(&mut ix, &obj),
                Event::Init => relist.clear(),
                Event::InitApply(obj) => relist.push(obj),
                Event::InitDone => {
                    K::replace(&mut ix, std::mem::take(&mut relist));
                    tracing::info!(%kind, nodes = ix.node_count(), pods = ix.pod_count(), "synced");
                }
            }
        }
    })
}

/// The reflectors; dropping this stops them.
pub struct Reflectors {
    tasks: Vec<JoinHandle<()>>,
}

impl Reflectors {
    pub(crate) fn start(client: &Client, index: Arc<RwLock<Index>>) -> Reflectors {
        let pods =
            watcher::Config::default().fields("status.phase!=Succeeded,status.phase!=Failed");
        Reflectors {
            tasks: vec![
                reflect::<Node>(
                    Api::all(client.clone()),
                    watcher::Config::default(),
                    index.clone(),
                ),
                reflect::<Pod>(Api::all(client.clone()), pods, index.clone()),
                reflect::<PodDisruptionBudget>(
                    Api::all(client.clone()),
                    watcher::Config::default(),
                    index,
                ),
            ],
        }
    }
}

impl Drop for Reflectors {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
