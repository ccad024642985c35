//! An API-server stand-in for the demo, the tests and the benchmark: pods,
//! nodes and events over plain HTTP on loopback, enough for the pod matcher,
//! the node's inventory and the scheduler extender: list and watch (field
//! selectors with `=` and `!=`; an object leaving the selection is DELETED
//! for the watch), get, JSON merge patch with a resourceVersion
//! precondition, JSON patch with `test`, the `pods/<name>/binding`
//! subresource (once per pod, 409 after), `events.k8s.io/v1` Event create
//! and merge patch (validated strictly, as the real one validates that
//! API: what is required, what may not change). It counts requests
//! by verb and can inject what a real API server does on a bad day: 503s,
//! slow answers, and writes by others that make a patch conflict. Like the
//! real one it stores every resource quantity of a pod's containers and a
//! node's status in canonical form (`8000` is stored as `8k`), and refuses
//! a write with a quantity it cannot read (422).

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

use gpu_device_plugin::rules::device::Resource;
use gpu_device_plugin::rules::usage::quantity;

/// One container of a pod to create: name, init or not, and the devices it
/// asks of gpu-memory, gpu-core and gpu-count.
#[derive(Debug, Clone)]
pub struct PodContainer {
    pub name: String,
    pub init: bool,
    /// An init container with `restartPolicy: Always` (a sidecar): it keeps
    /// its devices for the pod's life. Only init containers can be.
    pub restartable: bool,
    pub wants: [u64; 3],
}

impl PodContainer {
    /// Hands its devices on to the containers after it, as the kubelet
    /// does for an init container that is not a sidecar.
    pub(crate) fn hands_on(&self) -> bool {
        self.init && !self.restartable
    }

    /// Its entry in a pod's `containers` or `initContainers`, as the API
    /// server stores it: quantities in canonical form (`8000` is `8k`),
    /// extended resources' requests default to the limits; a sidecar
    /// carries `restartPolicy: Always`.
    pub(crate) fn spec(&self) -> Value {
        let limits: serde_json::Map<String, Value> = self
            .asks()
            .into_iter()
            .map(|(r, n)| {
                let q = quantity::canonical(&n.to_string());
                (r, q.expect("a device count is a quantity").into())
            })
            .collect();
        let mut spec = json!({"name": self.name, "image": "cuda",
               "resources": {"limits": limits.clone(), "requests": limits}});
        if self.restartable {
            spec["restartPolicy"] = "Always".into();
        }
        spec
    }

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
    /// Every request answers 500, watches included, and open watches end.
    outage: bool,
}

/// The kinds of object the stand-in stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Pod,
    Node,
}

/// (kind, namespace, name); nodes have an empty namespace.
type Key = (Kind, String, String);

/// One change: its resourceVersion, the event type, and the object before
/// (for modifications) and after, so a watch with a field selector can
/// tell an object that left the selection from one that changed inside it.
struct Change {
    rv: u64,
    kind: Kind,
    event: &'static str,
    before: Option<Value>,
    after: Value,
}

#[derive(Default)]
struct Inner {
    objects: BTreeMap<Key, Value>,
    /// Every change, for watches that resume from a resourceVersion.
    history: Vec<Change>,
    rv: u64,
    created: u64,
    events: Vec<Value>,
    requests: BTreeMap<&'static str, u64>,
    faults: Faults,
}

impl Inner {
    /// Stores `object` under `key` with a new resourceVersion and records
    /// the change; `None` deletes.
    fn write(
        &mut self,
        key: Key,
        object: Option<Value>,
        tx: &broadcast::Sender<u64>,
    ) -> Option<Value> {
        self.rv += 1;
        let before = self.objects.remove(&key);
        let (event, after) = match (object, &before) {
            (Some(mut o), _) => {
                o["metadata"]["resourceVersion"] = self.rv.to_string().into();
                self.objects.insert(key.clone(), o.clone());
                let event = if before.is_some() {
                    "MODIFIED"
                } else {
                    "ADDED"
                };
                (event, o)
            }
            (None, Some(old)) => ("DELETED", old.clone()),
            (None, None) => return None,
        };
        self.history.push(Change {
            rv: self.rv,
            kind: key.0,
            event,
            before: before.filter(|_| event == "MODIFIED"),
            after: after.clone(),
        });
        let _ = tx.send(self.rv);
        Some(after)
    }

    fn get(&self, key: &Key) -> Option<&Value> {
        self.objects.get(key)
    }
}

#[derive(Clone)]
struct ApiState {
    inner: Arc<Mutex<Inner>>,
    changes: broadcast::Sender<u64>,
}

impl ApiState {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("api sim lock poisoned")
    }
}

pub struct ApiServerSim {
    shared: ApiState,
    addr: SocketAddr,
    task: JoinHandle<()>,
}

/// A request's JSON body (at most `limit` bytes), or the 400 the API
/// server answers when it is not JSON.
async fn json_body(req: Request<Body>, limit: usize) -> Result<Value, Response<Body>> {
    let body = axum::body::to_bytes(req.into_body(), limit)
        .await
        .unwrap_or_default();
    serde_json::from_slice(&body)
        .map_err(|_| status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON"))
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

/// RFC 6902 JSON patch (`add`, `replace`, `remove`, `test`); the API
/// server answers 422 when an operation does not apply, a failed `test`
/// included, and changes nothing.
fn json_patch(target: &mut Value, ops: &Value) -> Result<(), String> {
    let ops = ops.as_array().ok_or("a JSON patch is an array")?;
    let mut out = target.clone();
    for op in ops {
        let path = op["path"].as_str().ok_or("an operation without a path")?;
        let tokens: Vec<String> = path
            .split('/')
            .skip(1)
            .map(|t| t.replace("~1", "/").replace("~0", "~"))
            .collect();
        let Some((last, parents)) = tokens.split_last() else {
            return Err(format!("cannot patch the whole object ({path})"));
        };
        let mut parent = &mut out;
        for t in parents {
            parent = parent
                .get_mut(t.as_str())
                .ok_or_else(|| format!("{path}: {t} does not exist"))?;
        }
        let obj = parent
            .as_object_mut()
            .ok_or_else(|| format!("{path}: the parent is not an object"))?;
        match op["op"].as_str() {
            Some("add") => {
                obj.insert(last.clone(), op["value"].clone());
            }
            Some("replace") if obj.contains_key(last) => {
                obj.insert(last.clone(), op["value"].clone());
            }
            Some("remove") if obj.contains_key(last) => {
                obj.remove(last);
            }
            Some("test") if obj.get(last) == Some(&op["value"]) => {}
            Some("test") => return Err(format!("test of {path} failed")),
            Some("replace" | "remove") => return Err(format!("{path} does not exist")),
            other => return Err(format!("unsupported operation {other:?}")),
        }
    }
    *target = out;
    Ok(())
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
                .replace("%21", "!")
                .replace("%2F", "/")
                .replace("%2C", ",");
            (k.to_owned(), v)
        })
        .collect()
}

/// A field selector of `field=value` and `field!=value` terms over
/// `metadata.name`, `metadata.namespace`, `spec.nodeName`, `spec.schedulerName`
/// and `status.phase`; a field the object lacks reads as "" (so
/// `spec.nodeName=` selects unscheduled pods), as on a real API server.
fn selected(object: &Value, selector: Option<&String>) -> bool {
    selector
        .into_iter()
        .flat_map(|s| s.split(','))
        .filter(|t| !t.is_empty())
        .all(|term| {
            let (field, want, equal) = match term.split_once("!=") {
                Some((f, v)) => (f, v, false),
                None => match term.split_once('=') {
                    Some((f, v)) => (f.trim_end_matches('='), v, true),
                    None => return true,
                },
            };
            let value = field
                .split('.')
                .fold(object, |v, part| &v[part])
                .as_str()
                .unwrap_or("");
            (value == want) == equal
        })
}

/// What a request addresses, from its path under `/api/v1`.
enum Target {
    /// A collection: its kind and, for namespaced ones, the namespace.
    Collection(Kind, Option<String>),
    Object(Key),
    Binding(Key),
    /// `events.k8s.io/v1` Events of a namespace.
    Events(String),
    /// One of them: namespace, name.
    Event(String, String),
}

fn target(path: &[String]) -> Option<Target> {
    let p: Vec<&str> = path.iter().map(String::as_str).collect();
    Some(match p.as_slice() {
        ["api", "v1", "pods"] => Target::Collection(Kind::Pod, None),
        ["api", "v1", "nodes"] => Target::Collection(Kind::Node, None),
        ["api", "v1", "nodes", name] => {
            Target::Object((Kind::Node, String::new(), name.to_string()))
        }
        ["api", "v1", "namespaces", ns, "pods"] => {
            Target::Collection(Kind::Pod, Some(ns.to_string()))
        }
        ["api", "v1", "namespaces", ns, "pods", name] => {
            Target::Object((Kind::Pod, ns.to_string(), name.to_string()))
        }
        ["api", "v1", "namespaces", ns, "pods", name, "binding"] => {
            Target::Binding((Kind::Pod, ns.to_string(), name.to_string()))
        }
        ["apis", "events.k8s.io", "v1", "namespaces", ns, "events"] => {
            Target::Events(ns.to_string())
        }
        [
            "apis",
            "events.k8s.io",
            "v1",
            "namespaces",
            ns,
            "events",
            name,
        ] => Target::Event(ns.to_string(), name.to_string()),
        _ => return None,
    })
}

fn list_kind(kind: Kind) -> &'static str {
    match kind {
        Kind::Pod => "PodList",
        Kind::Node => "NodeList",
    }
}

/// Whether `object` of `kind` belongs to the collection a list or watch asked for.
fn in_collection(
    kind: Kind,
    ns: Option<&String>,
    q: &BTreeMap<String, String>,
    ok: Kind,
    object: &Value,
) -> bool {
    ok == kind
        && ns.is_none_or(|ns| object["metadata"]["namespace"] == ns.as_str())
        && selected(object, q.get("fieldSelector"))
}

async fn serve(shared: ApiState, req: Request<Body>) -> Response<Body> {
    let path: Vec<String> = req
        .uri()
        .path()
        .trim_matches('/')
        .split('/')
        .map(str::to_owned)
        .collect();
    let q = query(&req);
    let watching = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    let Some(target) = target(&path) else {
        return status(StatusCode::NOT_FOUND, "NotFound", "not served by the sim");
    };
    let verb: &'static str = match (req.method(), &target, watching) {
        (&Method::GET, Target::Collection(..), true) => "watch",
        (&Method::GET, Target::Collection(..), false) => "list",
        (&Method::GET, Target::Object(_), _) => "get",
        (&Method::PATCH, Target::Object(_), _) => "patch",
        (&Method::POST, Target::Events(_), _) => "create",
        (&Method::PATCH, Target::Event(..), _) => "patch",
        (&Method::POST, Target::Binding(_), _) => "bind",
        _ => {
            return status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "not served by the sim",
            );
        }
    };
    let delay = {
        let mut inner = shared.lock();
        *inner.requests.entry(verb).or_default() += 1;
        if inner.faults.outage {
            return status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "injected outage: etcdserver: request timed out",
            );
        }
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
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    match target {
        Target::Collection(kind, ns) if watching => watch(shared, kind, ns, q).await,
        Target::Collection(kind, ns) => {
            let inner = shared.lock();
            let items: Vec<&Value> = inner
                .objects
                .iter()
                .filter(|((k, _, _), o)| in_collection(kind, ns.as_ref(), &q, *k, o))
                .map(|(_, o)| o)
                .collect();
            json_response(
                StatusCode::OK,
                &json!({"kind": list_kind(kind), "apiVersion": "v1",
                        "metadata": {"resourceVersion": inner.rv.to_string()}, "items": items}),
            )
        }
        Target::Object(key) if verb == "get" => match shared.lock().get(&key) {
            Some(o) => json_response(StatusCode::OK, o),
            None => status(StatusCode::NOT_FOUND, "NotFound", "not found"),
        },
        Target::Object(key) => match json_body(req, 1 << 24).await {
            Ok(patch) => patch_object(&shared, key, &content_type, &patch),
            Err(refused) => refused,
        },
        Target::Binding(key) => match json_body(req, 1 << 20).await {
            Ok(binding) => bind(&shared, key, &binding),
            Err(refused) => refused,
        },
        Target::Events(ns) => match json_body(req, 1 << 20).await {
            Ok(event) => create_event(&shared, &ns, event),
            Err(refused) => refused,
        },
        Target::Event(ns, name) => match json_body(req, 1 << 20).await {
            Ok(patch) => patch_event(&shared, (&ns, &name), &content_type, &patch),
            Err(refused) => refused,
        },
    }
}

/// What the real API server refuses of an `events.k8s.io/v1` Event in
/// namespace `ns` (its strict validation of that API), as its messages
/// name them; empty when it takes the Event.
fn event_errors(ns: &str, event: &Value) -> Vec<String> {
    let mut errors = Vec::new();
    let text = |field: &str| event[field].as_str().unwrap_or_default();
    let meta = &event["metadata"];
    if [&meta["name"], &meta["generateName"]]
        .iter()
        .all(|n| n.as_str().is_none_or(str::is_empty))
    {
        errors.push("metadata.name: Required value: name or generateName is required".into());
    }
    if event["eventTime"]
        .as_str()
        .is_none_or(|t| t.parse::<k8s_openapi::jiff::Timestamp>().is_err())
    {
        errors.push("eventTime: Required value".into());
    }
    for field in [
        "reportingController",
        "reportingInstance",
        "action",
        "reason",
    ] {
        match text(field).len() {
            0 => errors.push(format!("{field}: Required value")),
            129.. => errors.push(format!("{field}: Invalid value: at most 128 characters")),
            _ => {}
        }
    }
    if !matches!(text("type"), "Normal" | "Warning") {
        errors.push(format!("type: Invalid value: {:?}", text("type")));
    }
    if text("note").len() > 1024 {
        errors.push("note: Invalid value: at most 1024 characters".into());
    }
    let regarding = &event["regarding"];
    if ["kind", "name"]
        .iter()
        .any(|f| regarding[f].as_str().is_none_or(str::is_empty))
    {
        errors.push("regarding: Required value: kind and name".into());
    }
    // A namespaced object's Events live in its namespace.
    if regarding["namespace"].as_str().is_some_and(|n| n != ns) {
        errors.push("regarding.namespace: Invalid value: does not match the event's".into());
    }
    for field in [
        "deprecatedCount",
        "deprecatedFirstTimestamp",
        "deprecatedLastTimestamp",
        "deprecatedSource",
    ] {
        if !event[field].is_null() {
            errors.push(format!("{field}: Invalid value: needs to be unset"));
        }
    }
    let series = &event["series"];
    if !series.is_null()
        && (series["count"].as_u64().is_none_or(|c| c < 2)
            || series["lastObservedTime"].as_str().is_none())
    {
        errors.push("series: Invalid value: count of at least 2 and lastObservedTime".into());
    }
    errors
}

/// `status(422)` for `errors` of the Event `name`, as the API server words it.
fn invalid_event(name: &str, errors: &[String]) -> Response<Body> {
    let message = format!(
        "Event.events.k8s.io {name:?} is invalid: [{}]",
        errors.join(", ")
    );
    status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &message)
}

/// `events.k8s.io/v1` create: validated, named from its generateName if it
/// has no name, stored.
fn create_event(shared: &ApiState, ns: &str, mut event: Value) -> Response<Body> {
    let meta_ns = &event["metadata"]["namespace"];
    if !meta_ns.is_null() && meta_ns != ns {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "the namespace of the provided object does not match the namespace sent on the request",
        );
    }
    let name = event["metadata"]["name"].as_str().unwrap_or_default();
    let errors = event_errors(ns, &event);
    if !errors.is_empty() {
        return invalid_event(name, &errors);
    }
    let mut inner = shared.lock();
    inner.rv += 1;
    if name.is_empty() {
        let prefix = event["metadata"]["generateName"]
            .as_str()
            .unwrap_or_default();
        event["metadata"]["name"] = format!("{prefix}{}", inner.rv).into();
    }
    let name = event["metadata"]["name"].clone();
    let same = |e: &Value| e["metadata"]["namespace"] == ns && e["metadata"]["name"] == name;
    if inner.events.iter().any(same) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!("events.events.k8s.io {name} already exists"),
        );
    }
    event["metadata"]["namespace"] = ns.into();
    event["metadata"]["resourceVersion"] = inner.rv.to_string().into();
    inner.events.push(event.clone());
    json_response(StatusCode::CREATED, &event)
}

/// `events.k8s.io/v1` merge patch (a repeat's series): what the Event says
/// and whom it is about may not change.
fn patch_event(
    shared: &ApiState,
    (ns, name): (&str, &str),
    content_type: &str,
    patch: &Value,
) -> Response<Body> {
    if content_type.split(';').next().unwrap_or_default().trim() != "application/merge-patch+json" {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            &format!("the sim patches Events by merge patch only, not {content_type:?}"),
        );
    }
    let mut inner = shared.lock();
    let found = (inner.events.iter())
        .position(|e| e["metadata"]["namespace"] == ns && e["metadata"]["name"] == name);
    let Some(at) = found else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("events.events.k8s.io {name:?} not found"),
        );
    };
    let current = &inner.events[at];
    let wanted = &patch["metadata"]["resourceVersion"];
    if !wanted.is_null() && *wanted != current["metadata"]["resourceVersion"] {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            "the object has been modified; please apply your changes to the latest version",
        );
    }
    let mut event = current.clone();
    merge(&mut event, patch);
    let mut errors = event_errors(ns, &event);
    for field in [
        "regarding",
        "related",
        "reason",
        "note",
        "type",
        "eventTime",
        "action",
        "reportingController",
        "reportingInstance",
    ] {
        if event[field] != current[field] {
            errors.push(format!("{field}: Invalid value: field is immutable"));
        }
    }
    if event["metadata"]["name"] != current["metadata"]["name"] {
        errors.push("metadata.name: Invalid value: field is immutable".into());
    }
    if !errors.is_empty() {
        return invalid_event(name, &errors);
    }
    inner.rv += 1;
    event["metadata"]["resourceVersion"] = inner.rv.to_string().into();
    inner.events[at] = event.clone();
    json_response(StatusCode::OK, &event)
}

fn patch_object(shared: &ApiState, key: Key, content_type: &str, patch: &Value) -> Response<Body> {
    let mut inner = shared.lock();
    if key.0 == Kind::Pod && inner.faults.conflicts > 0 && inner.objects.contains_key(&key) {
        // Someone else (the kubelet's status manager) writes first.
        inner.faults.conflicts -= 1;
        let mut pod = inner.objects[&key].clone();
        pod["status"]["conditions"] = json!([{"type": "PodScheduled", "status": "True"}]);
        inner.write(key.clone(), Some(pod), &shared.changes);
    }
    let Some(current) = inner.get(&key) else {
        return status(StatusCode::NOT_FOUND, "NotFound", "not found");
    };
    let mut object = current.clone();
    match content_type.split(';').next().unwrap_or_default().trim() {
        "application/json-patch+json" => {
            if let Err(e) = json_patch(&mut object, patch) {
                return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &e);
            }
        }
        // A strategic merge patch of annotations and labels is a merge patch.
        "application/merge-patch+json" | "application/strategic-merge-patch+json" => {
            let wanted = &patch["metadata"]["resourceVersion"];
            if !wanted.is_null() && *wanted != current["metadata"]["resourceVersion"] {
                return status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    "the object has been modified; please apply your changes to the latest version",
                );
            }
            merge(&mut object, patch);
        }
        other => {
            return status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                &format!("the sim does not serve patches of type {other:?}"),
            );
        }
    }
    if let Err(e) = canonical_quantities(key.0, &mut object) {
        return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &e);
    }
    let object = inner.write(key, Some(object), &shared.changes);
    json_response(StatusCode::OK, &object.expect("written"))
}

/// `pods/<name>/binding`: sets the pod's node once and merges the
/// Binding's annotations onto it in the same update, as the API server
/// does; a Binding for another uid or an older resourceVersion, or for a
/// pod already bound, being deleted or still gated, is a conflict.
fn bind(shared: &ApiState, key: Key, binding: &Value) -> Response<Body> {
    let mut inner = shared.lock();
    let Some(pod) = inner.get(&key).cloned() else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("pods \"{}\" not found", key.2),
        );
    };
    let Some(node) = binding["target"]["name"].as_str().filter(|n| !n.is_empty()) else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "binding without a target node",
        );
    };
    let meta = &binding["metadata"];
    let uid = &meta["uid"];
    if uid.as_str().is_some_and(|u| !u.is_empty()) && *uid != pod["metadata"]["uid"] {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                pod["metadata"]["uid"]
            ),
        );
    }
    let rv = &meta["resourceVersion"];
    if rv.as_str().is_some_and(|v| !v.is_empty()) && *rv != pod["metadata"]["resourceVersion"] {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on pods \"{}\": the object has been modified; \
                 please apply your changes to the latest version and try again",
                key.2
            ),
        );
    }
    let refused = if let Some(bound) = pod["spec"]["nodeName"].as_str().filter(|n| !n.is_empty()) {
        Some(format!("is already assigned to node \"{bound}\""))
    } else if !pod["metadata"]["deletionTimestamp"].is_null() {
        Some("is being deleted, cannot be assigned to a host".into())
    } else if pod["spec"]["schedulingGates"]
        .as_array()
        .is_some_and(|g| !g.is_empty())
    {
        Some("has non-empty .spec.schedulingGates".into())
    } else {
        None
    };
    if let Some(why) = refused {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on pods/binding \"{}\": pod {} {why}",
                key.2, key.2
            ),
        );
    }
    let mut pod = pod;
    pod["spec"]["nodeName"] = node.into();
    if let Some(set) = meta["annotations"].as_object() {
        let on_pod = &mut pod["metadata"]["annotations"];
        if !on_pod.is_object() {
            *on_pod = json!({});
        }
        for (k, v) in set {
            on_pod[k] = v.clone();
        }
    }
    pod["status"]["conditions"] = json!([{"type": "PodScheduled", "status": "True"}]);
    inner.write(key, Some(pod), &shared.changes);
    json_response(
        StatusCode::CREATED,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
    )
}

/// Newline-delimited watch events after the given resourceVersion, then
/// live ones, until the client goes away. With a field selector, an object
/// that comes into the selection is ADDED and one that leaves it DELETED,
/// as a real API server reports it.
async fn watch(
    shared: ApiState,
    kind: Kind,
    ns: Option<String>,
    q: BTreeMap<String, String>,
) -> Response<Body> {
    let since: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let rx = shared.changes.subscribe();
    let stream = futures::stream::unfold((shared, rx, since), move |(shared, mut rx, mut sent)| {
        let (ns, q) = (ns.clone(), q.clone());
        async move {
            loop {
                let batch: Vec<Bytes> = {
                    let inner = shared.lock();
                    if inner.faults.outage {
                        return None;
                    }
                    let start = inner.history.partition_point(|c| c.rv <= sent);
                    let inside = |o: &Value| in_collection(kind, ns.as_ref(), &q, kind, o);
                    let out = inner.history[start..]
                        .iter()
                        .filter(|c| c.kind == kind)
                        .filter_map(|c| {
                            let was = c.before.as_ref().is_some_and(inside);
                            let event = match (c.event, was, inside(&c.after)) {
                                ("MODIFIED", true, true) => "MODIFIED",
                                ("MODIFIED", false, true) => "ADDED",
                                ("MODIFIED", true, false) => "DELETED",
                                ("MODIFIED", false, false) => return None,
                                (e, _, true) => e,
                                _ => return None,
                            };
                            Some(Bytes::from(format!(
                                "{}\n",
                                json!({"type": event, "object": c.after})
                            )))
                        })
                        .collect();
                    sent = inner.rv;
                    out
                };
                if !batch.is_empty() {
                    let chunk = Bytes::from(batch.concat());
                    return Some((Ok::<_, Infallible>(chunk), (shared, rx, sent)));
                }
                match rx.recv().await {
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from_stream(stream.boxed()))
        .expect("valid response")
}

/// The quantities of `object` (a pod's containers' limits and requests,
/// init containers too; a node's capacity and allocatable) in canonical
/// form, as the API server stores them; the first it cannot read is the
/// error, naming where it is.
fn canonical_quantities(kind: Kind, object: &mut Value) -> Result<(), String> {
    let maps: Vec<&mut Value> = match kind {
        Kind::Pod => {
            let mut maps = Vec::new();
            if let Value::Object(s) = &mut object["spec"] {
                for (list, containers) in s.iter_mut() {
                    if list != "containers" && list != "initContainers" {
                        continue;
                    }
                    for c in containers.as_array_mut().into_iter().flatten() {
                        if let Some(Value::Object(r)) = c.get_mut("resources") {
                            for (which, m) in r.iter_mut() {
                                if which == "limits" || which == "requests" {
                                    maps.push(m);
                                }
                            }
                        }
                    }
                }
            }
            maps
        }
        Kind::Node => match &mut object["status"] {
            Value::Object(s) => s
                .iter_mut()
                .filter(|(k, _)| *k == "capacity" || *k == "allocatable")
                .map(|(_, m)| m)
                .collect(),
            _ => Vec::new(),
        },
    };
    for m in maps {
        for (name, q) in m.as_object_mut().into_iter().flatten() {
            let text = match &*q {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                other => return Err(format!("{name}: {other} is not a quantity")),
            };
            *q = quantity::canonical(&text)
                .map_err(|e| format!("{name}: {e}"))?
                .into();
        }
    }
    Ok(())
}

fn pod_key(namespace: &str, name: &str) -> Key {
    (Kind::Pod, namespace.to_owned(), name.to_owned())
}

/// A Pending pod as the API server stores it after defaulting.
fn pod_object(
    namespace: &str,
    name: &str,
    containers: &[PodContainer],
    annotations: &[(&str, &str)],
) -> Value {
    let spec = |init: bool| -> Vec<Value> {
        containers
            .iter()
            .filter(|c| c.init == init)
            .map(PodContainer::spec)
            .collect()
    };
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": namespace,
            "annotations": annotations.iter().map(|(k, v)| (k.to_string(), Value::from(*v))).collect::<serde_json::Map<_, _>>(),
        },
        "spec": {"schedulerName": "default-scheduler", "initContainers": spec(true), "containers": spec(false)},
        "status": {"phase": "Pending"},
    })
}

impl ApiServerSim {
    pub async fn start() -> std::io::Result<ApiServerSim> {
        let (changes, _) = broadcast::channel(1024);
        let shared = ApiState {
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
        let mut pod = pod_object(namespace, name, containers, annotations);
        pod["spec"]["nodeName"] = node.into();
        self.create_pod(pod);
    }

    /// Creates a Pending pod that `scheduler` has yet to place (no node).
    pub fn add_unscheduled_pod(
        &self,
        namespace: &str,
        name: &str,
        scheduler: &str,
        containers: &[PodContainer],
    ) {
        let mut pod = pod_object(namespace, name, containers, &[]);
        pod["spec"]["schedulerName"] = scheduler.into();
        self.create_pod(pod);
    }

    fn create_pod(&self, mut pod: Value) {
        let mut inner = self.shared.lock();
        inner.created += 1;
        let created = 1_700_000_000 + inner.created;
        let meta = &mut pod["metadata"];
        // A UUID, as the real API server's: the kubelet names the pod's
        // cgroups after it, and a node agent parses it back.
        meta["uid"] = format!("00000000-0000-4000-8000-{:012x}", inner.created).into();
        meta["creationTimestamp"] = k8s_openapi::jiff::Timestamp::from_second(created as i64)
            .expect("valid time")
            .to_string()
            .into();
        let key = pod_key(
            pod["metadata"]["namespace"].as_str().unwrap_or_default(),
            pod["metadata"]["name"].as_str().unwrap_or_default(),
        );
        canonical_quantities(Kind::Pod, &mut pod).expect("whole device counts are quantities");
        inner.write(key, Some(pod), &self.shared.changes);
    }

    /// Creates (or replaces) a Node with `doslab.io/…` and other extended
    /// resources in its capacity and allocatable, as the kubelet reports the
    /// device plugins' devices.
    pub fn add_node(&self, name: &str, resources: &[(&str, u64)], annotations: &[(&str, &str)]) {
        let quantities: serde_json::Map<String, Value> = resources
            .iter()
            .map(|(r, n)| (r.to_string(), n.to_string().into()))
            .collect();
        let mut node = json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": name, "uid": format!("uid-node-{name}"),
                "labels": {"kubernetes.io/hostname": name},
                "annotations": annotations.iter().map(|(k, v)| (k.to_string(), Value::from(*v))).collect::<serde_json::Map<_, _>>(),
            },
            "status": {"capacity": quantities.clone(), "allocatable": quantities},
        });
        canonical_quantities(Kind::Node, &mut node).expect("whole device counts are quantities");
        let key = (Kind::Node, String::new(), name.to_owned());
        self.shared
            .lock()
            .write(key, Some(node), &self.shared.changes);
    }

    pub fn node(&self, name: &str) -> Option<Value> {
        self.shared
            .lock()
            .get(&(Kind::Node, String::new(), name.to_owned()))
            .cloned()
    }

    /// Sets a pod's phase, as the kubelet does once its containers run.
    pub fn set_phase(&self, namespace: &str, name: &str, phase: &str) {
        let mut inner = self.shared.lock();
        let key = pod_key(namespace, name);
        if let Some(mut pod) = inner.get(&key).cloned() {
            pod["status"]["phase"] = phase.into();
            inner.write(key, Some(pod), &self.shared.changes);
        }
    }

    /// Sets a pod Running with its containers' runtime IDs (`name, id`),
    /// as the kubelet reports them in the containers' statuses.
    pub fn set_running(&self, namespace: &str, name: &str, ids: &[(&str, &str)]) {
        let mut inner = self.shared.lock();
        let key = pod_key(namespace, name);
        if let Some(mut pod) = inner.get(&key).cloned() {
            pod["status"]["phase"] = "Running".into();
            pod["status"]["containerStatuses"] = ids
                .iter()
                .map(|(c, id)| {
                    json!({"name": c, "containerID": format!("containerd://{id}"), "ready": true,
                           "restartCount": 0, "image": "app", "imageID": "app"})
                })
                .collect();
            inner.write(key, Some(pod), &self.shared.changes);
        }
    }

    pub fn delete_pod(&self, namespace: &str, name: &str) {
        self.shared
            .lock()
            .write(pod_key(namespace, name), None, &self.shared.changes);
    }

    /// Deletes a pod whose DELETED event reaches watches only after `lag`
    /// (a real watch trails the store it watches).
    pub fn delete_pod_late(&self, namespace: &str, name: &str, lag: Duration) {
        let pod = self.shared.lock().objects.remove(&pod_key(namespace, name));
        if let Some(pod) = pod {
            let shared = self.shared.clone();
            tokio::spawn(async move {
                tokio::time::sleep(lag).await;
                let mut inner = shared.lock();
                inner.rv += 1;
                let rv = inner.rv;
                inner.history.push(Change {
                    rv,
                    kind: Kind::Pod,
                    event: "DELETED",
                    before: None,
                    after: pod,
                });
                let _ = shared.changes.send(rv);
            });
        }
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        self.shared.lock().get(&pod_key(namespace, name)).cloned()
    }

    pub fn pods(&self) -> Vec<Value> {
        self.shared
            .lock()
            .objects
            .iter()
            .filter(|((k, _, _), _)| *k == Kind::Pod)
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// The `events.k8s.io/v1` Events posted so far, in order; a repeat
    /// patched into its first one's series is no new Event.
    pub fn events(&self) -> Vec<Value> {
        self.shared.lock().events.clone()
    }

    /// The Events once there are `count` of them, or as they are when
    /// `timeout` has passed: the matcher posts them beside its answer, so
    /// they land a moment after the refusal they explain.
    pub async fn wait_for_events(&self, count: usize, timeout: Duration) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let events = self.events();
            if events.len() >= count || tokio::time::Instant::now() >= deadline {
                return events;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Requests served so far, by verb (list, watch, get, patch, create,
    /// bind).
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

    /// An outage (`true`) until it ends (`false`): every request answers
    /// 500, as a real API server does while etcd is away (a 503 the client
    /// would retry by itself), watches included, and the open watches end.
    pub fn outage(&self, on: bool) {
        self.shared.lock().faults.outage = on;
        // Wakes the open watches, which then see the outage and end.
        let _ = self.shared.changes.send(0);
    }

    /// Every request other than watches waits this long.
    pub fn delay(&self, d: Duration) {
        self.shared.lock().faults.delay = d;
    }

    pub fn stop(self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::TryStreamExt;
    use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod};
    use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams, WatchEvent, WatchParams};

    async fn client(api: &ApiServerSim) -> kube::Client {
        let url = format!("http://{}", api.addr).parse().unwrap();
        kube::Client::try_from(kube::Config::new(url)).unwrap()
    }

    fn gpu_pod() -> Vec<PodContainer> {
        vec![PodContainer {
            name: "main".into(),
            init: false,
            restartable: false,
            wants: [1024, 10, 0],
        }]
    }

    fn binding(pod: &str, node: &str) -> Binding {
        Binding {
            metadata: ObjectMeta {
                name: Some(pod.into()),
                ..Default::default()
            },
            target: ObjectReference {
                name: Some(node.into()),
                ..Default::default()
            },
        }
    }

    fn recorded(note: &str) -> kube::runtime::events::Event {
        kube::runtime::events::Event {
            type_: kube::runtime::events::EventType::Warning,
            reason: "GpuAllocateFailed".into(),
            note: Some(note.into()),
            action: "Allocate".into(),
            secondary: None,
        }
    }

    fn pod_ref(namespace: &str) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some("p".into()),
            namespace: Some(namespace.into()),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_recorders_repeat_patches_the_series_of_its_first_event() {
        use kube::runtime::events::{Recorder, Reporter};
        let api = ApiServerSim::start().await.unwrap();
        let reporter = Reporter {
            controller: "gpu-device-plugin".into(),
            instance: Some("node-1".into()),
        };
        let recorder = Recorder::new(client(&api).await, reporter);
        recorder
            .publish(&recorded("first"), &pod_ref("team-a"))
            .await
            .unwrap();
        recorder
            .publish(&recorded("second"), &pod_ref("team-a"))
            .await
            .unwrap();
        let events = api.events();
        assert_eq!(events.len(), 1, "{events:?}");
        let event = &events[0];
        assert_eq!(event["metadata"]["namespace"], "team-a");
        assert_eq!(event["regarding"]["name"], "p");
        assert_eq!(event["note"], "first");
        assert_eq!(event["reportingInstance"], "node-1");
        assert_eq!(event["series"]["count"], 2);
        assert_eq!(
            (api.requests().get("create"), api.requests().get("patch")),
            (Some(&1), Some(&1))
        );
    }

    #[tokio::test]
    async fn an_event_is_refused_as_the_api_server_refuses_it() {
        use k8s_openapi::api::events::v1::Event;
        let api = ApiServerSim::start().await.unwrap();
        let events: Api<Event> = Api::namespaced(client(&api).await, "team-a");
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
            k8s_openapi::jiff::Timestamp::now(),
        );
        let good = Event {
            metadata: ObjectMeta {
                name: Some("p.1".into()),
                ..Default::default()
            },
            event_time: Some(now),
            reporting_controller: Some("gpu-device-plugin".into()),
            reporting_instance: Some("node-1".into()),
            action: Some("Allocate".into()),
            reason: Some("GpuAllocateFailed".into()),
            regarding: Some(pod_ref("team-a")),
            note: Some("why".into()),
            type_: Some("Warning".into()),
            ..Default::default()
        };
        let refused = async |event: &Event| match events.create(&PostParams::default(), event).await
        {
            Err(kube::Error::Api(s)) => (s.code, s.message),
            other => panic!("{other:?}"),
        };
        let mut bad = good.clone();
        bad.reporting_controller = None;
        bad.type_ = Some("Error".into());
        let (code, message) = refused(&bad).await;
        assert_eq!(code, 422);
        assert!(
            message.contains("reportingController: Required value")
                && message.contains("type: Invalid value"),
            "{message}"
        );
        let mut elsewhere = good.clone();
        elsewhere.regarding = Some(pod_ref("team-b"));
        assert_eq!(refused(&elsewhere).await.0, 422);
        let mut legacy = good.clone();
        legacy.deprecated_count = Some(1);
        assert_eq!(refused(&legacy).await.0, 422);
        assert!(api.events().is_empty());

        events.create(&PostParams::default(), &good).await.unwrap();
        assert_eq!(refused(&good).await.0, 409);
        let params = PatchParams::default();
        let renote = serde_json::json!({"note": "another story"});
        let err = events.patch("p.1", &params, &Patch::Merge(&renote)).await;
        assert!(matches!(err, Err(kube::Error::Api(s)) if s.code == 422));
        let gone = events.patch("p.2", &params, &Patch::Merge(&renote)).await;
        assert!(matches!(gone, Err(kube::Error::Api(s)) if s.code == 404));
        assert_eq!(api.events()[0]["note"], "why");
    }

    #[tokio::test]
    async fn a_pod_is_bound_once_and_a_second_binding_conflicts() {
        let api = ApiServerSim::start().await.unwrap();
        api.add_unscheduled_pod("default", "p", "doslab-gpu-scheduler", &gpu_pod());
        let pods: Api<Pod> = Api::namespaced(client(&api).await, "default");
        let unscheduled = pods
            .list(&kube::api::ListParams::default().fields("spec.nodeName="))
            .await
            .unwrap();
        assert_eq!(unscheduled.items.len(), 1);
        let body = binding("p", "n1");
        pods.create_subresource::<_, Value>("binding", "p", &PostParams::default(), &body)
            .await
            .unwrap();
        let pod = api.pod("default", "p").unwrap();
        assert_eq!(pod["spec"]["nodeName"], "n1");
        let again = pods
            .create_subresource::<_, Value>("binding", "p", &PostParams::default(), &body)
            .await
            .unwrap_err();
        match again {
            kube::Error::Api(s) => {
                assert_eq!(s.code, 409);
                assert!(
                    s.message.contains("already assigned to node \"n1\""),
                    "{}",
                    s.message
                );
            }
            e => panic!("{e}"),
        }
        assert_eq!(api.requests().get("bind"), Some(&2));
    }

    #[tokio::test]
    async fn a_binding_sets_node_and_annotations_at_once_or_nothing() {
        let api = ApiServerSim::start().await.unwrap();
        api.add_unscheduled_pod("default", "p", "doslab-gpu-scheduler", &gpu_pod());
        let pods: Api<Pod> = Api::namespaced(client(&api).await, "default");
        let rv = api.pod("default", "p").unwrap()["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_owned();
        let with = |rv: &str| {
            let mut b = binding("p", "n1");
            b.metadata.resource_version = Some(rv.into());
            b.metadata.annotations =
                Some([("doslab.io/gpu-assigned".into(), "false".into())].into());
            b
        };
        let stale = pods
            .create_subresource::<_, Value>(
                "binding",
                "p",
                &PostParams::default(),
                &with(&format!("{rv}0")),
            )
            .await;
        assert!(matches!(stale, Err(kube::Error::Api(s)) if s.code == 409));
        let pod = api.pod("default", "p").unwrap();
        assert!(pod["spec"]["nodeName"].is_null());
        assert!(pod["metadata"]["annotations"]["doslab.io/gpu-assigned"].is_null());
        pods.create_subresource::<_, Value>("binding", "p", &PostParams::default(), &with(&rv))
            .await
            .unwrap();
        let pod = api.pod("default", "p").unwrap();
        assert_eq!(pod["spec"]["nodeName"], "n1");
        assert_eq!(
            pod["metadata"]["annotations"]["doslab.io/gpu-assigned"],
            "false"
        );
    }

    #[tokio::test]
    async fn a_failed_json_patch_test_changes_nothing() {
        let api = ApiServerSim::start().await.unwrap();
        api.add_pod("default", "p", "n1", &gpu_pod(), &[]);
        let pods: Api<Pod> = Api::namespaced(client(&api).await, "default");
        let rv = api.pod("default", "p").unwrap()["metadata"]["resourceVersion"].clone();
        let ops = |rv: &Value| {
            serde_json::from_value::<json_patch::Patch>(json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                {"op": "add", "path": "/metadata/annotations/doslab.io~1gpu-uuid", "value": "GPU-1"},
            ]))
            .unwrap()
        };
        let stale = pods
            .patch(
                "p",
                &PatchParams::default(),
                &Patch::Json::<()>(ops(&json!("0"))),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(stale, kube::Error::Api(ref s) if s.code == 422),
            "{stale}"
        );
        assert!(
            api.pod("default", "p").unwrap()["metadata"]["annotations"]["doslab.io/gpu-uuid"]
                .is_null()
        );
        pods.patch("p", &PatchParams::default(), &Patch::Json::<()>(ops(&rv)))
            .await
            .unwrap();
        assert_eq!(
            api.pod("default", "p").unwrap()["metadata"]["annotations"]["doslab.io/gpu-uuid"],
            "GPU-1"
        );
    }

    #[tokio::test]
    async fn a_pod_leaving_a_field_selection_is_deleted_for_the_watch() {
        let api = ApiServerSim::start().await.unwrap();
        api.add_pod("default", "p", "n1", &gpu_pod(), &[]);
        let pods: Api<Pod> = Api::all(client(&api).await);
        let params = WatchParams::default().fields("status.phase!=Succeeded,status.phase!=Failed");
        let mut events = pods.watch(&params, "0").await.unwrap().boxed();
        let first = events.try_next().await.unwrap().unwrap();
        assert!(matches!(first, WatchEvent::Added(_)), "{first:?}");
        api.set_phase("default", "p", "Running");
        let second = events.try_next().await.unwrap().unwrap();
        assert!(matches!(second, WatchEvent::Modified(_)), "{second:?}");
        api.set_phase("default", "p", "Succeeded");
        let third = events.try_next().await.unwrap().unwrap();
        assert!(matches!(third, WatchEvent::Deleted(_)), "{third:?}");
    }

    #[tokio::test]
    async fn nodes_are_listed_watched_and_patched() {
        let api = ApiServerSim::start().await.unwrap();
        api.add_node("n1", &[("doslab.io/gpu-count", 2)], &[]);
        let nodes: Api<Node> = Api::all(client(&api).await);
        let listed = nodes.list(&Default::default()).await.unwrap();
        assert_eq!(listed.items.len(), 1);
        let allocatable = listed.items[0]
            .status
            .as_ref()
            .unwrap()
            .allocatable
            .as_ref()
            .unwrap();
        assert_eq!(allocatable["doslab.io/gpu-count"].0, "2");
        let patch = json!({"metadata": {"annotations": {"doslab.io/gpu-inventory": "{}"}}});
        nodes
            .patch("n1", &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        assert_eq!(
            api.node("n1").unwrap()["metadata"]["annotations"]["doslab.io/gpu-inventory"],
            "{}"
        );
        // Pods and nodes are separate collections.
        let pods: Api<Pod> = Api::all(client(&api).await);
        assert!(
            pods.list(&Default::default())
                .await
                .unwrap()
                .items
                .is_empty()
        );
    }

    #[tokio::test]
    async fn quantities_are_stored_in_canonical_form_and_unreadable_ones_refused() {
        let api = ApiServerSim::start().await.unwrap();
        let containers = [
            PodContainer {
                name: "init".into(),
                init: true,
                restartable: false,
                wants: [4000, 0, 0],
            },
            PodContainer {
                name: "main".into(),
                init: false,
                restartable: false,
                wants: [8000, 1500, 4096],
            },
        ];
        api.add_pod("default", "p", "n1", &containers, &[]);
        let pod = api.pod("default", "p").unwrap();
        let init = &pod["spec"]["initContainers"][0]["resources"];
        assert_eq!(init["limits"]["doslab.io/gpu-memory"], "4k");
        assert_eq!(init["requests"]["doslab.io/gpu-memory"], "4k");
        let main = &pod["spec"]["containers"][0]["resources"]["limits"];
        assert_eq!(main["doslab.io/gpu-memory"], "8k");
        assert_eq!(main["doslab.io/gpu-core"], "1500");
        assert_eq!(main["doslab.io/gpu-count"], "4096");

        api.add_node("n1", &[("doslab.io/gpu-memory", 10000)], &[]);
        assert_eq!(
            api.node("n1").unwrap()["status"]["capacity"]["doslab.io/gpu-memory"],
            "10k"
        );
        let nodes: Api<Node> = Api::all(client(&api).await);
        let patch = json!({"status": {"allocatable": {"memory": "1024Ki", "cpu": 2.5}}});
        nodes
            .patch("n1", &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        let allocatable = &api.node("n1").unwrap()["status"]["allocatable"];
        assert_eq!(allocatable["memory"], "1Mi");
        assert_eq!(allocatable["cpu"], "2500m");
        assert_eq!(allocatable["doslab.io/gpu-memory"], "10k");

        let before = api.node("n1").unwrap();
        let bad = json!({"status": {"capacity": {"doslab.io/gpu-memory": "8 k"}}});
        let e = nodes
            .patch("n1", &PatchParams::default(), &Patch::Merge(&bad))
            .await
            .unwrap_err();
        match e {
            kube::Error::Api(s) => {
                assert_eq!(s.code, 422);
                assert!(s.message.contains("doslab.io/gpu-memory"), "{}", s.message);
                assert!(s.message.contains("\"8 k\""), "{}", s.message);
            }
            e => panic!("{e}"),
        }
        assert_eq!(api.node("n1").unwrap(), before);
    }
}
