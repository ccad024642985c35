//! `kubectl gpu`: the kubectl plugin, the same binary installed as
//! `kubectl-gpu`. `top` prints per node and GPU what is granted to which
//! pod, from the API server (each Node's GPU inventory, each pod's ledger,
//! as far as its spec vouches: the daemon's own rule), beside what each
//! uses, from each node's daemon: its `/metrics` read through the API
//! server's pod proxy, so no port is opened to anyone and the caller's own
//! RBAC decides (`deploy/kubectl-gpu-rbac.yaml` is the least it needs).
//!
//! - `scrape`: the used series of a daemon's `/metrics` (pure).
//! - `table`: the table (pure).

mod scrape;
mod table;

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client};

use crate::rules::matching::granted;
use crate::rules::matching::pods::PodView;
use crate::rules::usage::{Inventory, Keys};
use table::NodeView;

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
         deploy/kubectl-gpu-rbac.yaml)"
    )]
    Forbidden { what: String, reason: String },
    #[error("cannot {what}: {source}")]
    Api { what: String, source: kube::Error },
    #[error("no node {0} with GPUs")]
    NoSuchNode(String),
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
    let inventory_key = format!("{}/gpu-inventory", args.domain);
    let nodes: Api<Node> = Api::all(client.clone());
    let nodes = nodes
        .list(&ListParams::default())
        .await
        .map_err(failed("list nodes"))?;
    let mut gpu_nodes: BTreeMap<String, Inventory> = BTreeMap::new();
    for n in nodes.items {
        let name = n.metadata.name.unwrap_or_default();
        let inventory = n
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(&inventory_key));
        if args.node.as_ref().is_none_or(|wanted| *wanted == name)
            && let Some(Ok(inventory)) = inventory.map(|text| Inventory::parse(text))
        {
            gpu_nodes.insert(name, inventory);
        }
    }
    if let Some(node) = &args.node
        && !gpu_nodes.contains_key(node)
    {
        return Err(TopError::NoSuchNode(node.clone()));
    }
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
            by_node
                .entry(node)
                .or_default()
                .push(PodView::from_pod(&keys, p).0);
        }
    }
    let daemons = daemons(&client, args).await;
    let mut views = Vec::new();
    for (name, inventory) in &gpu_nodes {
        let pods = by_node.remove(name).unwrap_or_default();
        let used = match &daemons {
            Err(why) => Err(why.clone()),
            Ok(d) => match d.get(name) {
                None => Err(format!(
                    "no daemon pod in namespace {}",
                    args.daemon_namespace
                )),
                Some((pod, port)) => usage(&client, &args.daemon_namespace, pod, *port).await,
            },
        };
        views.push(NodeView {
            name: name.clone(),
            gpus: inventory
                .gpus
                .iter()
                .map(|g| (g.uuid.clone(), g.memory_mib))
                .collect(),
            grants: granted(inventory, &pods),
            used,
        });
    }
    Ok(table::render(&views))
}

/// Per node, its daemon's pod and metrics port (the container port named
/// `http`), or why they cannot be listed.
async fn daemons(
    client: &Client,
    args: &TopArgs,
) -> Result<BTreeMap<String, (String, u16)>, String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &args.daemon_namespace);
    let params = ListParams::default().labels(&args.daemon_selector);
    let list = pods.list(&params).await.map_err(|e| match e {
        kube::Error::Api(s) if s.code == 403 => format!(
            "not allowed to list pods in namespace {} ({})",
            args.daemon_namespace, s.message
        ),
        e => format!("cannot list the daemons: {e}"),
    })?;
    Ok(list
        .items
        .into_iter()
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

/// What a daemon reports used, read through the API server's pod proxy.
async fn usage(
    client: &Client,
    namespace: &str,
    pod: &str,
    port: u16,
) -> Result<scrape::Used, String> {
    let path = format!("/api/v1/namespaces/{namespace}/pods/{pod}:{port}/proxy/metrics");
    let request = http::Request::get(&path)
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    let text = client.request_text(request).await.map_err(|e| match e {
        kube::Error::Api(s) if s.code == 403 => format!(
            "not allowed to get pods/proxy in namespace {namespace} ({})",
            s.message
        ),
        e => format!("cannot read {pod}'s metrics through the API server: {e}"),
    })?;
    Ok(scrape::parse(&text))
}
