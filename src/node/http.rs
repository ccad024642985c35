//! The operator's HTTP endpoint (`http_listen`): `/metrics` in the
//! OpenMetrics text format (written by `prometheus-client`), `/healthz` (the process answers), `/readyz` (every enabled
//! resource is registered and its ListAndWatch stream open, the pod matcher,
//! when on, has synced its pod cache and reaches the API server, and no
//! actor keeps failing; a 503 names each part that is not ready and why).
//!
//! Both HTTP servers (this one and the scheduler extender's) run through
//! [`serve_bounded`]: the port is reachable from every pod, so a client that
//! opens connections and never finishes a request must not be able to grow
//! the daemon past its memory limit. Each connection gets a header-read
//! timeout, an idle timeout, a header-size cap and a body cap, and the
//! number of open connections is capped: one past the cap is closed at once
//! (queueing it would hold its socket and buffers just the same).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::config::ConfigError;
use crate::node::metrics::Metrics;

/// An HTTP server's bounds as the config gives them (`[http]` for the
/// daemon, `[extender.http]` for the extender); an absent key takes that
/// server's default ([`DAEMON_LIMITS`], [`EXTENDER_LIMITS`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// How long a client may take to send a request's headers, counted
    /// from the connection's start or the end of its previous response.
    header_timeout_ms: Option<u64>,
    /// A connection on which no byte moved either way for this long is
    /// closed (a slow body, a stalled reader).
    idle_timeout_ms: Option<u64>,
    /// Open connections at most; one more is closed as soon as accepted.
    max_connections: Option<usize>,
    /// Request line and headers at most, in bytes (hyper's read buffer).
    max_header_bytes: Option<usize>,
    /// Request body at most, in bytes; a larger one gets 413.
    max_body_bytes: Option<usize>,
}

/// An HTTP server's bounds, resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HttpLimits {
    pub(crate) header_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) max_connections: usize,
    pub(crate) max_header_bytes: usize,
    pub(crate) max_body_bytes: usize,
}

/// The daemon's endpoint: Prometheus and the kubelet's probes, a handful of
/// connections, GET only, so bodies are never needed.
pub(crate) const DAEMON_LIMITS: HttpLimits = HttpLimits {
    header_timeout: Duration::from_secs(5),
    idle_timeout: Duration::from_secs(60),
    max_connections: 64,
    max_header_bytes: 16 << 10,
    max_body_bytes: 1 << 10,
};

/// The extender: kube-scheduler's client keeps a few connections alive and
/// binds run concurrently. A filter body (`nodeCacheCapable: true`) is one
/// Pod, at most 1.5 MiB (the API server's request limit), and the node
/// names, at most 253 bytes each (about 1.3 MiB for 5,000 nodes): 4 MiB.
/// The idle timeout stays above kube-scheduler's `httpTimeout` (30 s in
/// deploy/) so a slow bind is never cut by it.
pub(crate) const EXTENDER_LIMITS: HttpLimits = HttpLimits {
    header_timeout: Duration::from_secs(10),
    idle_timeout: Duration::from_secs(90),
    max_connections: 64,
    max_header_bytes: 64 << 10,
    max_body_bytes: 4 << 20,
};

impl HttpConfig {
    /// The bounds, each key given or taken from `defaults`.
    pub(crate) fn limits(&self, defaults: &HttpLimits) -> HttpLimits {
        let ms = |v: Option<u64>, d: Duration| v.map_or(d, Duration::from_millis);
        HttpLimits {
            header_timeout: ms(self.header_timeout_ms, defaults.header_timeout),
            idle_timeout: ms(self.idle_timeout_ms, defaults.idle_timeout),
            max_connections: self.max_connections.unwrap_or(defaults.max_connections),
            max_header_bytes: self.max_header_bytes.unwrap_or(defaults.max_header_bytes),
            max_body_bytes: self.max_body_bytes.unwrap_or(defaults.max_body_bytes),
        }
    }

    /// Checks the bounds; `section` names the table in errors (`http`,
    /// `extender.http`).
    pub(crate) fn validate(&self, section: &str, defaults: &HttpLimits) -> Result<(), ConfigError> {
        let l = self.limits(defaults);
        let bad = |key: &str, reason: &str| {
            Err(ConfigError::Invalid {
                key: format!("{section}.{key}"),
                reason: reason.into(),
            })
        };
        if !(100..=600_000).contains(&l.header_timeout.as_millis()) {
            return bad(
                "header_timeout_ms",
                "must be between 100 and 600000 (milliseconds)",
            );
        }
        if l.idle_timeout < l.header_timeout || l.idle_timeout > Duration::from_secs(3600) {
            return bad(
                "idle_timeout_ms",
                "must be at least header_timeout_ms and at most 3600000 (milliseconds)",
            );
        }
        if !(1..=100_000).contains(&l.max_connections) {
            return bad("max_connections", "must be between 1 and 100000");
        }
        // hyper refuses a read buffer under 8 KiB.
        if !(8192..=(1 << 20)).contains(&l.max_header_bytes) {
            return bad("max_header_bytes", "must be between 8192 and 1048576");
        }
        if !(1..=(64 << 20)).contains(&l.max_body_bytes) {
            return bad("max_body_bytes", "must be between 1 and 67108864");
        }
        Ok(())
    }
}

/// Serves `app` on `listener` within `limits` until the returned future is
/// dropped (or the runtime stops). Each connection runs in its own task,
/// so dropping the accept loop closes the listener while requests in
/// flight finish.
pub(crate) async fn serve_bounded(listener: Arc<TcpListener>, app: Router, limits: HttpLimits) {
    let app = app.layer(DefaultBodyLimit::max(limits.max_body_bytes));
    let slots = Arc::new(Slots::new(limits.max_connections));
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_header_bytes);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Out of descriptors or a connection reset before accept: the
            // listener itself is fine; back off briefly so a full table
            // does not spin.
            Err(e) => {
                tracing::debug!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(slot) = slots.admit() else {
            tracing::debug!(
                cap = limits.max_connections,
                "HTTP connection cap reached, every connection busy; closing a new one"
            );
            drop(stream);
            continue;
        };
        let http1 = http1.clone();
        let app = app.clone();
        tokio::spawn(serve_connection(
            http1,
            stream,
            app,
            limits.idle_timeout,
            slot,
        ));
    }
}

/// The open connections, at most `cap`. At the cap a new connection takes
/// the place of the oldest one not serving a request (one that holds a
/// slot without asking anything, or sits idle between requests), so a
/// flood of connections that never finish their headers cannot lock the
/// kubelet's probes or Prometheus out; only when every connection is
/// inside a request is the new one closed.
struct Slots {
    cap: usize,
    /// By connection number, oldest first.
    open: std::sync::Mutex<(u64, std::collections::BTreeMap<u64, Arc<Conn>>)>,
}

/// What the accept loop knows of an open connection.
#[derive(Default)]
struct Conn {
    /// Requests being served on it now.
    busy: std::sync::atomic::AtomicUsize,
    /// Tells the connection's task to close it.
    evict: tokio::sync::Notify,
}

/// A connection's place among the open ones; freed when dropped.
struct Slot {
    slots: Arc<Slots>,
    id: u64,
    conn: Arc<Conn>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots
            .open
            .lock()
            .expect("slots lock")
            .1
            .remove(&self.id);
    }
}

impl Slots {
    fn new(cap: usize) -> Slots {
        Slots {
            cap,
            open: Default::default(),
        }
    }

    fn admit(self: &Arc<Self>) -> Option<Slot> {
        let mut guard = self.open.lock().expect("slots lock");
        let (next, open) = &mut *guard;
        if open.len() >= self.cap {
            let idle = open
                .iter()
                .find(|(_, c)| c.busy.load(Ordering::SeqCst) == 0)
                .map(|(id, _)| *id)?;
            // Removed here, so it no longer counts; its task closes it.
            let evicted = open.remove(&idle).expect("just found");
            evicted.evict.notify_one();
        }
        let id = *next;
        *next += 1;
        let conn = Arc::new(Conn::default());
        open.insert(id, conn.clone());
        Some(Slot {
            slots: self.clone(),
            id,
            conn,
        })
    }
}

/// Counts a request as being served on its connection while alive.
struct Busy(Arc<Conn>);

impl Busy {
    fn new(conn: &Arc<Conn>) -> Busy {
        conn.busy.fetch_add(1, Ordering::SeqCst);
        Busy(conn.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One connection, closed once no byte moved for `idle` or when a newer
/// connection takes its slot.
async fn serve_connection(
    http1: hyper::server::conn::http1::Builder,
    stream: TcpStream,
    app: Router,
    idle: Duration,
    slot: Slot,
) {
    let start = Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let io = TokioIo::new(Activity {
        inner: stream,
        start,
        last: last.clone(),
    });
    let conn = slot.conn.clone();
    let service = hyper::service::service_fn(move |req| {
        use tower::Service as _;
        let busy = Busy::new(&conn);
        let call = app.clone().call(req);
        async move {
            let response = call.await;
            drop(busy);
            response
        }
    });
    let served = http1.serve_connection(io, service);
    tokio::pin!(served);
    let moved = || start + Duration::from_millis(last.load(Ordering::Relaxed));
    loop {
        tokio::select! {
            result = served.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "HTTP connection ended with an error");
                }
                return;
            }
            () = slot.conn.evict.notified() => {
                tracing::debug!("HTTP connection cap reached; closing an idle connection for a new one");
                return;
            }
            () = tokio::time::sleep_until(moved() + idle) => {
                if moved().elapsed() >= idle {
                    tracing::debug!("HTTP connection idle too long; closing it");
                    return;
                }
            }
        }
    }
}

/// A stream that notes when a byte last moved, in milliseconds since
/// `start`, for the idle timeout.
struct Activity {
    inner: TcpStream,
    start: Instant,
    last: Arc<AtomicU64>,
}

impl Activity {
    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last.store(ms, Ordering::Relaxed);
    }
}

impl AsyncRead for Activity {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        polled
    }
}

impl AsyncWrite for Activity {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

async fn metrics(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, crate::node::metrics::CONTENT_TYPE)],
        m.render(),
    )
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(m): State<Arc<Metrics>>) -> (StatusCode, String) {
    let waiting = m.not_ready();
    if waiting.is_empty() {
        (StatusCode::OK, "ready\n".into())
    } else {
        let list = waiting.join("; ");
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {list}\n"),
        )
    }
}

/// A serving endpoint; dropping it closes the listener (requests in
/// flight finish), so a reload can open the new one before the old closes.
pub(crate) struct Endpoint {
    pub(crate) addr: SocketAddr,
    listener: Arc<TcpListener>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Endpoint {
    /// Serves on within new bounds: the listener stays bound (no gap, no
    /// second bind of the same port); connections already open keep the
    /// bounds they started with.
    pub(crate) fn rebound(&mut self, limits: HttpLimits, m: Arc<Metrics>) {
        self.task.abort();
        self.task = tokio::spawn(serve_bounded(self.listener.clone(), router(m), limits));
    }
}

fn router(m: Arc<Metrics>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(m)
}

/// Binds `addr` and serves within `limits` until the [`Endpoint`] is
/// dropped; `:0` picks a free port, which the endpoint's `addr` tells.
pub(crate) async fn serve(
    addr: &str,
    limits: HttpLimits,
    m: Arc<Metrics>,
) -> std::io::Result<Endpoint> {
    let listener = Arc::new(TcpListener::bind(addr).await?);
    let addr = listener.local_addr()?;
    let task = tokio::spawn(serve_bounded(listener.clone(), router(m), limits));
    Ok(Endpoint {
        addr,
        listener,
        task,
    })
}
