//! The inventory publisher actor. It keeps the Node's `<domain>/gpu-inventory`
//! annotation equal to the latest inventory it was sent: it reads the Node,
//! patches that one annotation only when it differs, and while the API
//! server cannot be reached (no credentials yet, a 503, a missing Node)
//! retries with backoff. Nothing waits on it: the supervisor sends and
//! moves on, and plugins never talk to it.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::DefaultBackoff;
use kube::{Api, Client};
use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::{Published, patch};
use crate::config::Config;

/// One call to the API server; the client's own retries of 503s may take
/// longer, and a later attempt is better than a stuck actor.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) struct InventoryPublisher;

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct InventoryArgs {
    pub(crate) node_name: String,
    pub(crate) kubeconfig: PathBuf,
    /// What the Node should carry from the start.
    pub(crate) published: Published,
}

impl InventoryArgs {
    pub(crate) fn new(config: &Config, published: Published) -> Self {
        InventoryArgs {
            node_name: config.node_name.clone(),
            kubeconfig: config.matcher.kubeconfig.clone(),
            published,
        }
    }

    /// What restarts a running publisher when a reload changes it: where
    /// it publishes. Left out: the inventory itself, sent to the running
    /// publisher.
    pub(crate) fn restart_key(&self) -> impl PartialEq + '_ {
        let InventoryArgs {
            node_name,
            kubeconfig,
            published: _,
        } = self;
        (node_name, kubeconfig)
    }
}

/// What the publisher is told; nothing waits for a reply.
pub(crate) enum InventoryMsg {
    /// What the Node should carry from now on (the GPU set, their health
    /// or the config changed): keep it and bring the Node in line, marking
    /// a key of a domain since changed for removal.
    Publish { published: Published },
    /// Bring the Node in line with what it should carry: sent to itself at
    /// start and as the backoff's retry.
    Sync,
}

pub(crate) struct InventoryState {
    node_name: String,
    kubeconfig: PathBuf,
    wanted: Published,
    /// Keys this publisher wrote before the domain changed: removed from
    /// the Node with the next patch.
    stale: Vec<String>,
    client: Option<Client>,
    backoff: DefaultBackoff,
    retry_pending: bool,
}

impl InventoryState {
    async fn sync(&mut self) -> Result<(), PublishError> {
        let client = match &self.client {
            Some(c) => c.clone(),
            None => {
                let c = crate::net::kube_client::from_kubeconfig(
                    &self.kubeconfig,
                    "matcher.kubeconfig",
                )
                .await?;
                self.client = Some(c.clone());
                c
            }
        };
        let nodes: Api<Node> = Api::all(client);
        let node =
            within(nodes.get(&self.node_name))
                .await
                .map_err(|source| PublishError::Read {
                    node: self.node_name.clone(),
                    source,
                })?;
        let annotations = node.metadata.annotations.unwrap_or_default();
        let Some(body) = patch(&annotations, &self.wanted, &self.stale) else {
            self.stale.clear();
            return Ok(());
        };
        let params = PatchParams::default();
        within(nodes.patch(&self.node_name, &params, &Patch::Merge(&body)))
            .await
            .map_err(|source| PublishError::Patch {
                node: self.node_name.clone(),
                source,
            })?;
        self.stale.clear();
        let gpus = &self.wanted.inventory.gpus;
        tracing::info!(
            node = %self.node_name,
            key = %self.wanted.key,
            gpus = gpus.len(),
            healthy = gpus.iter().filter(|g| g.healthy).count(),
            "GPU inventory published on the Node"
        );
        Ok(())
    }

    /// Syncs now; on failure schedules one retry after the next backoff
    /// step (a retry already scheduled covers this failure too).
    async fn sync_or_retry(&mut self, myself: &ActorRef<InventoryMsg>) {
        match self.sync().await {
            Ok(()) => self.backoff.reset(),
            Err(e) if !self.retry_pending => {
                let delay = self.backoff.next().unwrap_or(Duration::from_secs(30));
                tracing::warn!(
                    error = %e,
                    retry_in_ms = delay.as_millis() as u64,
                    "GPU inventory not published; retrying"
                );
                self.retry_pending = true;
                myself.send_after(delay, || InventoryMsg::Sync);
            }
            Err(e) => tracing::debug!(error = %e, "GPU inventory not published"),
        }
    }
}

/// Why the inventory did not reach the Node this time; the next sync tries
/// again.
#[derive(Debug, thiserror::Error)]
enum PublishError {
    #[error(transparent)]
    Client(#[from] crate::net::kube_client::KubeClientError),
    #[error("cannot read Node {node}: {source}")]
    Read { node: String, source: CallError },
    #[error("cannot patch Node {node}: {source}")]
    Patch { node: String, source: CallError },
}

/// An API call that failed, or did not answer within [`CALL_TIMEOUT`].
#[derive(Debug, thiserror::Error)]
enum CallError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("no answer within {} s", CALL_TIMEOUT.as_secs())]
    Timeout,
}

async fn within<T>(call: impl Future<Output = Result<T, kube::Error>>) -> Result<T, CallError> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(CallError::Timeout),
    }
}

impl Actor for InventoryPublisher {
    type Msg = InventoryMsg;
    type State = InventoryState;
    type Arguments = InventoryArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<InventoryMsg>,
        args: InventoryArgs,
    ) -> Result<InventoryState, ActorProcessingErr> {
        // The first sync runs as a message: starting never waits on the
        // API server.
        myself.send_message(InventoryMsg::Sync)?;
        Ok(InventoryState {
            node_name: args.node_name,
            kubeconfig: args.kubeconfig,
            wanted: args.published,
            stale: Vec::new(),
            client: None,
            backoff: DefaultBackoff::default(),
            retry_pending: false,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<InventoryMsg>,
        msg: InventoryMsg,
        state: &mut InventoryState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            InventoryMsg::Publish { published } => {
                if published.key != state.wanted.key {
                    state.stale.push(state.wanted.key.clone());
                }
                state.wanted = published;
            }
            InventoryMsg::Sync => state.retry_pending = false,
        }
        state.sync_or_retry(&myself).await;
        Ok(())
    }
}
