//! `kubectl gpu`: the kubectl plugin, the same binary installed as
//! `kubectl-gpu`. `top` prints per node and GPU what is granted to which
//! pod, from the API server (each Node's GPU inventory, each pod's ledger,
//! as far as its spec vouches: the daemon's own rule), beside what each
//! uses, from each node's daemon: its `/metrics` read through the API
//! server's pod proxy, so no port is opened to anyone and the caller's own
//! RBAC decides (`deploy/kubectl-gpu/rbac.yaml` is the least it needs).
//! Each daemon is read at the same time, within [`READ_TIMEOUT`] and
//! [`METRICS_LIMIT`]: one slow or broken node costs its own usage only.
//!
//! - `scrape`: the used series of a daemon's `/metrics` (pure).
//! - `table`: the table (pure).

mod scrape;
mod table;

use std::collections::BTreeMap;
use std::path::PathBuf;

use futures::AsyncReadExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client};

use crate::rules::matching::granted;
use crate::rules::matching::pods::PodView;
use crate::rules::usage::{Inventory, Keys};
use table::NodeView;

/// How long one daemon's `/metrics` may take through the API server.
const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The most of one daemon's `/metrics` read: a node of 8 GPUs × 16 shares
/// serves well under 1 MiB.
const METRICS_LIMIT: u64 = 16 << 20;

/// What `kubectl gpu top` is asked.
#[derive(Debug, Clone)]
pub struct TopArgs {
    /// Only this node.
    pub node: Option<String>,
    /// The shares of every namespace; else of `namespace`.
    pub all_namespaces: bool,
    /// Else the kubeconfig context's.
    pub namespace: Option<String>,
    /// Where the daemons run, and the label that selects them.
    pub daemon_namespace: String,
    pub daemon_selector: String,
    /// The resource domain of the annotations.
    pub domain: String,
    /// Else `$KUBECONFIG`, else `~/.kube/config`, else in-cluster.
    pub kubeconfig: Option<PathBuf>,
}

/// Why `top` printed nothing.
#[derive(Debug, thiserror::Error)]
pub enum TopError {
    #[error("cannot reach the API server: {0}")]
    Client(String),
    #[error(
        "the API server refused to {what} ({reason}); kubectl gpu top needs: list nodes \
         (cluster-wide), list pods (in the namespace shown, or everywhere with -A), and for \
         usage list pods and get pods/proxy in the daemons' namespace (see \
         deploy/kubectl-gpu/rbac.yaml)"
    )]
    Forbidden { what: String, reason: String },
    #[error("cannot {what}: {source}")]
    Api { what: String, source: kube::Error },
    #[error("no node {0} with GPUs")]
    NoSuchNode(String),
    #[error("node {node}: its GPU inventory annotation does not read: {reason}")]
    BadInventory { node: String, reason: String },
}

/// Why a node's usage is unknown: `top` still prints its grants, and this
/// after the table.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum UsageUnknown {
    #[error("not allowed to {what} in namespace {namespace} ({reason})")]
    Forbidden {
        what: &'static str,
        namespace: String,
        reason: String,
    },
    #[error("cannot list the daemons: {0}")]
    NoList(String),
    #[error("no running daemon pod in namespace {0}")]
    NoDaemon(String),
    #[error("cannot read {pod}'s metrics through the API server: {reason}")]
    Unreadable { pod: String, reason: String },
    #[error("{pod}'s metrics took over {after:?}")]
    TimedOut {
        pod: String,
        after: std::time::Duration,
    },
    #[error("{pod}'s metrics exceed {limit} bytes")]
    TooLarge { pod: String, limit: u64 },
}

/// Names a failed call: RBAC's refusal says what is missing.
fn failed(what: &str) -> impl Fn(kube::Error) -> TopError + '_ {
    move |e| match e {
        kube::Error::Api(s) if s.code == 403 => TopError::Forbidden {
            what: what.to_owned(),
            reason: s.message,
        },
        source => TopError::Api {
            what: what.to_owned(),
            source,
        },
    }
}

/// The table, or why not.
pub async fn top(args: &TopArgs) -> Result<String, TopError> {
    let client = match &args.kubeconfig {
        Some(path) => crate::net::kube_client::from_kubeconfig(path, "--kubeconfig").await,
        None => crate::net::kube_client::from_kubeconfig("".as_ref(), "--kubeconfig").await,
    }
    .map_err(|e| TopError::Client(e.to_string()))?;
    let keys = Keys::new(&args.domain);
    let gpu_nodes = gpu_nodes(&client, args).await?;
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let pods: Api<Pod> = if args.all_namespaces {
        Api::all(client.clone())
    } else {
        Api::namespaced(client.clone(), &namespace)
    };
    let what = if args.all_namespaces {
        "list pods in all namespaces".to_owned()
    } else {
        format!("list pods in namespace {namespace}")
    };
    let pods = pods
        .list(&ListParams::default())
        .await
        .map_err(failed(&what))?;
    let mut by_node: BTreeMap<String, Vec<PodView>> = BTreeMap::new();
    for p in &pods.items {
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        if let Some(node) = node.filter(|n| gpu_nodes.contains_key(n)) {
            let view = PodView::from_pod(&keys, p).0;
            by_node.entry(node).or_default().push(view);
        }
    }
    let daemons = daemons(&client, args).await;
    let reads = gpu_nodes.keys().map(|name| {
        let (client, daemons) = (&client, &daemons);
        async move {
            let d = daemons.as_ref().map_err(Clone::clone)?;
            let Some((pod, port)) = d.get(name) else {
                return Err(UsageUnknown::NoDaemon(args.daemon_namespace.clone()));
            };
            let read = usage(client, &args.daemon_namespace, pod, *port);
            let timed_out = || UsageUnknown::TimedOut {
                pod: pod.clone(),
                after: READ_TIMEOUT,
            };
            (tokio::time::timeout(READ_TIMEOUT, read).await).unwrap_or_else(|_| Err(timed_out()))
        }
    });
    let used = futures::future::join_all(reads).await;
    let views: Vec<NodeView> = (gpu_nodes.iter().zip(used))
        .map(|((name, inventory), used)| NodeView {
            name: name.clone(),
            gpus: (inventory.gpus.iter())
                .map(|g| (g.uuid.clone(), g.memory_mib))
                .collect(),
            grants: granted(inventory, &by_node.remove(name).unwrap_or_default()),
            used,
        })
        .collect();
    Ok(table::render(&views))
}

/// The nodes shown, each with its GPU inventory: every node that has one,
/// or `--node`'s alone. An inventory that does not read is an error,
/// not a node without GPUs.
async fn gpu_nodes(
    client: &Client,
    args: &TopArgs,
) -> Result<BTreeMap<String, Inventory>, TopError> {
    let key = format!("{}/gpu-inventory", args.domain);
    let nodes: Api<Node> = Api::all(client.clone());
    let nodes = nodes
        .list(&ListParams::default())
        .await
        .map_err(failed("list nodes"))?;
    let mut found = BTreeMap::new();
    for n in nodes.items {
        let name = n.metadata.name.unwrap_or_default();
        if args.node.as_ref().is_some_and(|wanted| *wanted != name) {
            continue;
        }
        let annotations = n.metadata.annotations.unwrap_or_default();
        if let Some(text) = annotations.get(&key) {
            let inventory = Inventory::parse(text).map_err(|e| TopError::BadInventory {
                node: name.clone(),
                reason: e.to_string(),
            })?;
            found.insert(name, inventory);
        }
    }
    if let Some(node) = &args.node
        && !found.contains_key(node)
    {
        return Err(TopError::NoSuchNode(node.clone()));
    }
    Ok(found)
}

/// Per node, its running daemon's pod and metrics port (the container port
/// named `http`), or why they cannot be listed.
async fn daemons(
    client: &Client,
    args: &TopArgs,
) -> Result<BTreeMap<String, (String, u16)>, UsageUnknown> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &args.daemon_namespace);
    let params = ListParams::default().labels(&args.daemon_selector);
    let list = pods.list(&params).await.map_err(|e| match e {
        kube::Error::Api(s) if s.code == 403 => UsageUnknown::Forbidden {
            what: "list pods",
            namespace: args.daemon_namespace.clone(),
            reason: s.message,
        },
        e => UsageUnknown::NoList(e.to_string()),
    })?;
    // A rollout's pods come and go: the running one, not being deleted.
    let running = |p: &Pod| {
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        phase == Some("Running") && p.metadata.deletion_timestamp.is_none()
    };
    Ok(list
        .items
        .into_iter()
        .filter(running)
        .filter_map(|p| {
            let spec = p.spec?;
            let port = spec
                .containers
                .iter()
                .flat_map(|c| c.ports.iter().flatten())
                .find(|p| p.name.as_deref() == Some("http"))
                .and_then(|p| u16::try_from(p.container_port).ok())?;
            Some((spec.node_name?, (p.metadata.name?, port)))
        })
        .collect())
}

/// What a daemon reports used, read through the API server's pod proxy,
/// at most [`METRICS_LIMIT`] of it.
async fn usage(
    client: &Client,
    namespace: &str,
    pod: &str,
    port: u16,
) -> Result<scrape::Used, UsageUnknown> {
    let unreadable = |reason: String| UsageUnknown::Unreadable {
        pod: pod.to_owned(),
        reason,
    };
    let path = format!("/api/v1/namespaces/{namespace}/pods/{pod}:{port}/proxy/metrics");
    let request = http::Request::get(&path)
        .body(Vec::new())
        .map_err(|e| unreadable(e.to_string()))?;
    let body = client.request_stream(request).await.map_err(|e| match e {
        kube::Error::Api(s) if s.code == 403 => UsageUnknown::Forbidden {
            what: "get pods/proxy",
            namespace: namespace.to_owned(),
            reason: s.message,
        },
        e => unreadable(e.to_string()),
    })?;
    let mut text = String::new();
    let read = body.take(METRICS_LIMIT + 1).read_to_string(&mut text).await;
    read.map_err(|e| unreadable(e.to_string()))?;
    if text.len() as u64 > METRICS_LIMIT {
        return Err(UsageUnknown::TooLarge {
            pod: pod.to_owned(),
            limit: METRICS_LIMIT,
        });
    }
    Ok(scrape::parse(&text))
}
