//! The operator's HTTP endpoint (`http_listen`): `/metrics` in Prometheus
//! text format, `/healthz` (the process answers), `/readyz` (every enabled
//! resource is registered and its ListAndWatch stream open, the pod matcher,
//! when on, has synced its pod cache, and no actor keeps failing; a 503
//! names each part that is not ready and why).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::Metrics;

async fn metrics(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
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
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Binds `addr` and serves until the [`Endpoint`] is dropped; `:0` picks a
/// free port, which the endpoint's `addr` tells.
pub(crate) async fn serve(addr: &str, m: Arc<Metrics>) -> std::io::Result<Endpoint> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(m);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "HTTP endpoint failed");
        }
    });
    Ok(Endpoint { addr: bound, task })
}
