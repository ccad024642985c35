//! An API-server stand-in for the demo, the tests and the benchmark: pods
//! and events over plain HTTP on loopback, enough for the pod matcher (list
//! and watch with a `spec.nodeName` field selector, get, JSON merge patch
//! with a resourceVersion precondition, event create). It counts requests
//! by verb and can inject what a real API server does on a bad day: 503s,
//! slow answers, and writes by others that make a patch conflict.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Method, Request, Response, StatusCode};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

use crate::device::Resource;

/// One container of a pod to create: name, init or not, and the devices it
/// asks of gpu-memory, gpu-core and gpu-count.
#[derive(Debug, Clone)]
pub struct PodContainer {
    pub name: String,
    pub init: bool,
    pub wants: [u64; 3],
}

impl PodContainer {
    /// `(doslab.io/<resource>, devices)` for every resource it asks for.
    pub fn asks(&self) -> Vec<(String, usize)> {
        Resource::ALL
            .iter()
            .zip(self.wants)
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| (format!("doslab.io/{}", r.name()), n as usize))
            .collect()
    }
}

/// The kubelet's admission order: init containers, then app containers,
/// each in spec order.
pub fn admission_order(containers: &[PodContainer]) -> impl Iterator<Item = &PodContainer> {
    let (init, app): (Vec<_>, Vec<_>) = containers.iter().partition(|c| c.init);
    init.into_iter().chain(app)
}

#[derive(Default)]
struct Faults {
    unavailable: u32,
    conflicts: u32,
    delay: Duration,
}

#[derive(Default)]
struct Inner {
    pods: BTreeMap<(String, String), Value>,
    /// Every change, for watches that resume from a resourceVersion.
    history: Vec<(u64, &'static str, Value)>,
    rv: u64,
    created: u64,
    events: Vec<Value>,
    requests: BTreeMap<&'static str, u64>,
    faults: Faults,
}

impl Inner {
    fn bump(&mut self, kind: &'static str, mut pod: Value, tx: &broadcast::Sender<u64>) -> Value {
        self.rv += 1;
        pod["metadata"]["resourceVersion"] = self.rv.to_string().into();
        self.history.push((self.rv, kind, pod.clone()));
        let _ = tx.send(self.rv);
        pod
    }
}

#[derive(Clone)]
struct Shared {
    inner: Arc<Mutex<Inner>>,
    changes: broadcast::Sender<u64>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("api sim lock poisoned")
    }
}

pub struct ApiServerSim {
    shared: Shared,
    addr: SocketAddr,
    task: JoinHandle<()>,
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
    });
    json_response(code, &body)
}

fn json_response(code: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("valid response")
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

fn query(req: &Request<Body>) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| {
            let v = v
                .replace("%3D", "=")
                .replace("%2F", "/")
                .replace("%2C", ",");
            (k.to_owned(), v)
        })
        .collect()
}

/// A field selector of `spec.nodeName=…` and `status.phase=…` terms.
fn selected(pod: &Value, selector: Option<&String>) -> bool {
    selector
        .into_iter()
        .flat_map(|s| s.split(','))
        .all(|term| match term.split_once('=') {
            Some(("spec.nodeName", node)) => pod["spec"]["nodeName"] == node,
            Some(("status.phase", phase)) => pod["status"]["phase"] == phase,
            _ => true,
        })
}

async fn serve(shared: Shared, req: Request<Body>) -> Response<Body> {
    let path: Vec<String> = req
        .uri()
        .path()
        .trim_matches('/')
        .split('/')
        .map(str::to_owned)
        .collect();
    let q = query(&req);
    let watching = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    let verb: &'static str = match (req.method(), path.len(), watching) {
        (&Method::GET, 3, true) => "watch",
        (&Method::GET, 3, false) => "list",
        (&Method::GET, 6, _) => "get",
        (&Method::PATCH, 6, _) => "patch",
        (&Method::POST, 5, _) => "create",
        _ => "other",
    };
    let delay = {
        let mut inner = shared.lock();
        *inner.requests.entry(verb).or_default() += 1;
        if verb != "watch" && inner.faults.unavailable > 0 {
            inner.faults.unavailable -= 1;
            return status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "injected",
            );
        }
        inner.faults.delay
    };
    if !delay.is_zero() && verb != "watch" {
        tokio::time::sleep(delay).await;
    }
    match verb {
        "watch" => watch(shared, q).await,
        "list" => {
            let inner = shared.lock();
            let items: Vec<&Value> = inner
                .pods
                .values()
                .filter(|p| selected(p, q.get("fieldSelector")))
                .collect();
            json_response(
                StatusCode::OK,
                &json!({"kind": "PodList", "apiVersion": "v1",
                        "metadata": {"resourceVersion": inner.rv.to_string()}, "items": items}),
            )
        }
        "get" => {
            let inner = shared.lock();
            match inner.pods.get(&(path[3].clone(), path[5].clone())) {
                Some(p) => json_response(StatusCode::OK, p),
                None => status(StatusCode::NOT_FOUND, "NotFound", "pod not found"),
            }
        }
        "patch" => {
            let body = axum::body::to_bytes(req.into_body(), 1 << 24)
                .await
                .unwrap_or_default();
            let Ok(patch) = serde_json::from_slice::<Value>(&body) else {
                return status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
            };
            patch_pod(&shared, (path[3].clone(), path[5].clone()), &patch)
        }
        "create" if path[4] == "events" => {
            let body = axum::body::to_bytes(req.into_body(), 1 << 20)
                .await
                .unwrap_or_default();
            let mut event: Value = serde_json::from_slice(&body).unwrap_or_default();
            let mut inner = shared.lock();
            inner.rv += 1;
            event["metadata"]["name"] = format!("event-{}", inner.rv).into();
            event["metadata"]["resourceVersion"] = inner.rv.to_string().into();
            inner.events.push(event.clone());
            json_response(StatusCode::CREATED, &event)
        }
        _ => status(StatusCode::NOT_FOUND, "NotFound", "not served by the sim"),
    }
}

fn patch_pod(shared: &Shared, key: (String, String), patch: &Value) -> Response<Body> {
    let mut inner = shared.lock();
    if inner.faults.conflicts > 0 && inner.pods.contains_key(&key) {
        // Someone else (the kubelet's status manager) writes first.
        inner.faults.conflicts -= 1;
        let mut pod = inner.pods[&key].clone();
        pod["status"]["conditions"] = json!([{"type": "PodScheduled", "status": "True"}]);
        let pod = inner.bump("MODIFIED", pod, &shared.changes);
        inner.pods.insert(key.clone(), pod);
    }
    let Some(current) = inner.pods.get(&key) else {
        return status(StatusCode::NOT_FOUND, "NotFound", "pod not found");
    };
    let wanted = &patch["metadata"]["resourceVersion"];
    if !wanted.is_null() && *wanted != current["metadata"]["resourceVersion"] {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            "the object has been modified; please apply your changes to the latest version",
        );
    }
    let mut pod = current.clone();
    merge(&mut pod, patch);
    let pod = inner.bump("MODIFIED", pod, &shared.changes);
    inner.pods.insert(key, pod.clone());
    json_response(StatusCode::OK, &pod)
}

/// Newline-delimited watch events after the given resourceVersion, then
/// live ones, until the client goes away.
async fn watch(shared: Shared, q: BTreeMap<String, String>) -> Response<Body> {
    let since: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let selector = q.get("fieldSelector").cloned();
    let rx = shared.changes.subscribe();
    let stream = futures::stream::unfold(
        (shared, rx, since, selector),
        |(shared, mut rx, mut sent, selector)| async move {
            loop {
                let batch: Vec<Bytes> = {
                    let inner = shared.lock();
                    let start = inner.history.partition_point(|(rv, _, _)| *rv <= sent);
                    let out = inner.history[start..]
                        .iter()
                        .filter(|(_, _, pod)| selected(pod, selector.as_ref()))
                        .map(|(_, kind, pod)| {
                            Bytes::from(format!("{}\n", json!({"type": kind, "object": pod})))
                        })
                        .collect();
                    sent = inner.rv;
                    out
                };
                if !batch.is_empty() {
                    let chunk = Bytes::from(batch.concat());
                    return Some((Ok::<_, Infallible>(chunk), (shared, rx, sent, selector)));
                }
                match rx.recv().await {
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        },
    );
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from_stream(stream.boxed()))
        .expect("valid response")
}

impl ApiServerSim {
    pub async fn start() -> std::io::Result<ApiServerSim> {
        let (changes, _) = broadcast::channel(1024);
        let shared = Shared {
            inner: Arc::default(),
            changes,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let s = shared.clone();
        let app = axum::Router::new().fallback(move |req: Request<Body>| serve(s.clone(), req));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(ApiServerSim { shared, addr, task })
    }

    /// Writes a kubeconfig that reaches this server.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: sim\n  cluster:\n    server: http://{}\n\
             users:\n- name: sim\n  user: {{}}\ncontexts:\n- name: sim\n  context:\n    cluster: sim\n    user: sim\n\
             current-context: sim\n",
            self.addr
        );
        std::fs::write(path, text)
    }

    /// Creates a Pending pod bound to `node`; creation times follow the
    /// order of creation, a second apart.
    pub fn add_pod(
        &self,
        namespace: &str,
        name: &str,
        node: &str,
        containers: &[PodContainer],
        annotations: &[(&str, &str)],
    ) {
        let spec = |init: bool| -> Vec<Value> {
            containers
                .iter()
                .filter(|c| c.init == init)
                .map(|c| {
                    let limits: serde_json::Map<String, Value> = c
                        .asks()
                        .into_iter()
                        .map(|(r, n)| (r, n.to_string().into()))
                        .collect();
                    json!({"name": c.name, "image": "cuda", "resources": {"limits": limits}})
                })
                .collect()
        };
        let mut inner = self.shared.lock();
        inner.created += 1;
        let created = 1_700_000_000 + inner.created;
        let created = k8s_openapi::jiff::Timestamp::from_second(created as i64)
            .expect("valid time")
            .to_string();
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": namespace, "uid": format!("uid-{namespace}-{name}-{}", inner.created),
                "creationTimestamp": created,
                "annotations": annotations.iter().map(|(k, v)| (k.to_string(), Value::from(*v))).collect::<serde_json::Map<_, _>>(),
            },
            "spec": {"nodeName": node, "initContainers": spec(true), "containers": spec(false)},
            "status": {"phase": "Pending"},
        });
        let pod = inner.bump("ADDED", pod, &self.shared.changes);
        inner
            .pods
            .insert((namespace.to_owned(), name.to_owned()), pod);
    }

    /// Sets a pod's phase, as the kubelet does once its containers run.
    pub fn set_phase(&self, namespace: &str, name: &str, phase: &str) {
        let mut inner = self.shared.lock();
        let key = (namespace.to_owned(), name.to_owned());
        if let Some(mut pod) = inner.pods.get(&key).cloned() {
            pod["status"]["phase"] = phase.into();
            let pod = inner.bump("MODIFIED", pod, &self.shared.changes);
            inner.pods.insert(key, pod);
        }
    }

    pub fn delete_pod(&self, namespace: &str, name: &str) {
        let mut inner = self.shared.lock();
        if let Some(pod) = inner.pods.remove(&(namespace.to_owned(), name.to_owned())) {
            inner.bump("DELETED", pod, &self.shared.changes);
        }
    }

    /// Deletes a pod whose DELETED event reaches watches only after `lag`
    /// (a real watch trails the store it watches).
    pub fn delete_pod_late(&self, namespace: &str, name: &str, lag: Duration) {
        let pod = {
            let mut inner = self.shared.lock();
            inner.pods.remove(&(namespace.to_owned(), name.to_owned()))
        };
        if let Some(pod) = pod {
            let shared = self.shared.clone();
            tokio::spawn(async move {
                tokio::time::sleep(lag).await;
                shared.lock().bump("DELETED", pod, &shared.changes);
            });
        }
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        let inner = self.shared.lock();
        inner
            .pods
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    pub fn pods(&self) -> Vec<Value> {
        self.shared.lock().pods.values().cloned().collect()
    }

    pub fn events(&self) -> Vec<Value> {
        self.shared.lock().events.clone()
    }

    /// Requests served so far, by verb (list, watch, get, patch, create).
    pub fn requests(&self) -> BTreeMap<&'static str, u64> {
        self.shared.lock().requests.clone()
    }

    /// The next `n` requests other than watches answer 503.
    pub fn fail_next(&self, n: u32) {
        self.shared.lock().faults.unavailable = n;
    }

    /// The next `n` patches find the pod changed by someone else first.
    pub fn conflict_next(&self, n: u32) {
        self.shared.lock().faults.conflicts = n;
    }

    /// Injected 503s and conflicts not yet served.
    pub fn faults_left(&self) -> (u32, u32) {
        let f = &self.shared.lock().faults;
        (f.unavailable, f.conflicts)
    }

    /// Every request other than watches waits this long.
    pub fn delay(&self, d: Duration) {
        self.shared.lock().faults.delay = d;
    }

    pub fn stop(self) {
        self.task.abort();
    }
}
