//! The bounded HTTP server both programs serve through (the daemon's
//! endpoint and the scheduler extender): the port is reachable from every
//! pod, so a client that opens connections and never finishes a request
//! must not be able to grow the process past its memory limit. Each
//! connection gets a header-read timeout, an idle timeout, a header-size
//! cap and a body cap, and the number of open connections is capped: one
//! past the cap is closed at once (queueing it would hold its socket and
//! buffers just the same).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// What both programs' `/metrics` answer with: the OpenMetrics text
/// prometheus-client writes (counters typed without their `_total`, a
/// closing `# EOF`).
pub(crate) const METRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `registry`'s scrape in that format.
pub(crate) fn render_metrics(registry: &prometheus_client::registry::Registry) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail, and neither can encoding the label
    // sets and values both programs register.
    prometheus_client::encoding::text::encode(&mut out, registry)
        .expect("encoding metrics into a String");
    out
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
