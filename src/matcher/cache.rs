//! The node-local pod cache: a watcher on pods with `spec.nodeName` = this
//! node, reflected into a store, so an Allocate costs no LIST. The watcher
//! re-lists and re-watches by itself (with backoff) when the API server
//! goes away.

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub(crate) struct PodCache {
    store: Store<Pod>,
    /// Bumped on every event the store applied.
    changes: watch::Receiver<u64>,
    /// Why the watch last failed, until an event comes through again.
    failing: watch::Receiver<Option<String>>,
    task: JoinHandle<()>,
}

impl PodCache {
    pub(crate) fn start(client: Client, node: &str) -> PodCache {
        let api: Api<Pod> = Api::all(client);
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let (store, writer) = reflector::store();
        let (tx, changes) = watch::channel(0u64);
        let (failed, failing) = watch::channel(None);
        let stream = reflector::reflector(writer, watcher(api, config)).default_backoff();
        let task = tokio::spawn(async move {
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(_) => {
                        tx.send_modify(|n| *n += 1);
                        failed.send_if_modified(|f| f.take().is_some());
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "pod watch failed; retrying");
                        failed.send_replace(Some(e.to_string()));
                    }
                }
            }
        });
        PodCache {
            store,
            changes,
            failing,
            task,
        }
    }

    pub(crate) fn pods(&self) -> Vec<Arc<Pod>> {
        self.store.state()
    }

    /// Waits for the first full list, until `deadline`.
    pub(crate) async fn ready(&self, deadline: Instant) -> bool {
        let wait = self.store.wait_until_ready();
        tokio::time::timeout_at(deadline.into(), wait)
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Resolves once the first full list is in, however long that takes.
    pub(crate) fn synced(&self) -> impl Future<Output = ()> + Send + 'static {
        let store = self.store.clone();
        async move {
            let _ = store.wait_until_ready().await;
        }
    }

    /// The store and a receiver told of each change: for readers besides
    /// the matcher, which see the cache but never wait on it.
    pub(crate) fn reader(&self) -> (Store<Pod>, watch::Receiver<u64>) {
        (self.store.clone(), self.changes.clone())
    }

    /// Why the watch is failing now (the API server cannot be reached or
    /// refuses it), None while it works: for readiness.
    pub(crate) fn failing(&self) -> watch::Receiver<Option<String>> {
        self.failing.clone()
    }

    /// Waits for the store to change, until `deadline`; false when it passed.
    pub(crate) async fn changed(&mut self, deadline: Instant) -> bool {
        tokio::time::timeout_at(deadline.into(), self.changes.changed())
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

impl Drop for PodCache {
    fn drop(&mut self) {
        self.task.abort();
    }
}
