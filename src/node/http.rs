//! The operator's HTTP endpoint (`http_listen`): `/metrics` in the
//! OpenMetrics text format (written by `prometheus-client`), `/healthz` (the process answers), `/readyz` (every enabled
//! resource is registered and its ListAndWatch stream open, the pod matcher,
//! when on, has synced its pod cache and reaches the API server, and no
//! actor keeps failing; a 503 names each part that is not ready and why).
//! It serves within `[http]`'s bounds through [`crate::net::http`].

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::net::http::HttpLimits;
use crate::net::http::serve_bounded;
use crate::node::metrics::Metrics;
use crate::node::readiness::Readiness;

/// What the endpoint reports: the series, and what holds readiness back
/// besides the resources.
#[derive(Debug, Clone)]
pub(crate) struct Reports {
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) readiness: Arc<Readiness>,
}

async fn metrics(State(r): State<Reports>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, crate::net::http::METRICS_CONTENT_TYPE)],
        r.metrics.render(),
    )
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(r): State<Reports>) -> (StatusCode, String) {
    let mut waiting = r.metrics.resources_not_ready();
    waiting.extend(r.readiness.held());
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
    pub(crate) fn rebound(&mut self, limits: HttpLimits, r: Reports) {
        self.task.abort();
        self.task = tokio::spawn(serve_bounded(self.listener.clone(), router(r), limits));
    }
}

fn router(r: Reports) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(r)
}

/// Binds `addr` and serves within `limits` until the [`Endpoint`] is
/// dropped; `:0` picks a free port, which the endpoint's `addr` tells.
pub(crate) async fn serve(addr: &str, limits: HttpLimits, r: Reports) -> std::io::Result<Endpoint> {
    let listener = Arc::new(TcpListener::bind(addr).await?);
    let addr = listener.local_addr()?;
    let task = tokio::spawn(serve_bounded(listener.clone(), router(r), limits));
    Ok(Endpoint {
        addr,
        listener,
        task,
    })
}
