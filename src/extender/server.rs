//! The HTTP adapter kube-scheduler calls: `POST <urlPrefix>/filter`,
//! `/prioritize`, `/bind`. Thin: it decodes the body, asks the
//! [`Extender`], encodes the answer. Beside them `/healthz` (the process
//! answers) and `/readyz` (503 with the reason while the index does not
//! follow the API server, when a GPU pod's filter and bind are refused).
//!
//! kube-scheduler treats any non-200 status as a failure and then drops our
//! message, so filter and bind answer every problem, malformed JSON
//! included, with 200 and the reason in `Error`, which the scheduler puts
//! on the pod's events. Prioritize has no `Error` field: a body it cannot
//! use gets 400 with the reason as text (the scheduler ignores prioritize
//! failures and scores with the rest).
//!
//! It runs within `[extender.http]`'s bounds (see `crate::http`): a body
//! over `max_body_bytes` gets 413 before it is decoded.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use super::cluster::Binder;
use super::wire::{ExtenderBindingResult, ExtenderFilterResult};
use super::{Extender, ExtenderConfig};

fn decode<T: serde::de::DeserializeOwned>(verb: &str, body: &[u8]) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| {
        format!("gpu extender: {verb} request is not the JSON kube-scheduler sends: {e}")
    })
}

fn json(answer: &impl serde::Serialize) -> Response {
    let body = serde_json::to_string(answer).expect("extender answers always serialise");
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn filter<B: Binder>(State(x): State<Arc<Extender<B>>>, body: Bytes) -> Response {
    let answer = match decode("filter", &body) {
        Ok(args) => x.filter(&args),
        Err(e) => ExtenderFilterResult::error(e),
    };
    json(&answer)
}

async fn prioritize<B: Binder>(State(x): State<Arc<Extender<B>>>, body: Bytes) -> Response {
    match decode("prioritize", &body).and_then(|args| x.prioritize(&args)) {
        Ok(list) => json(&list),
        Err(e) => (StatusCode::BAD_REQUEST, e).into_response(),
    }
}

async fn bind<B: Binder>(State(x): State<Arc<Extender<B>>>, body: Bytes) -> Response {
    let error = match decode("bind", &body) {
        Ok(args) => x.bind(&args).await.err().unwrap_or_default(),
        Err(e) => e,
    };
    json(&ExtenderBindingResult { error })
}

async fn readyz<B: Binder>(State(x): State<Arc<Extender<B>>>) -> Response {
    let stale = x.stale();
    if stale.is_empty() {
        return "ok\n".into_response();
    }
    let why = format!("gpu extender not ready: {}\n", stale.join("; "));
    (StatusCode::SERVICE_UNAVAILABLE, why).into_response()
}

/// Binds `config.listen` and serves within `config.http`'s bounds until
/// the runtime stops; returns the bound address (`:0` picks a free port).
pub async fn start<B: Binder>(
    config: &ExtenderConfig,
    x: Arc<Extender<B>>,
) -> std::io::Result<SocketAddr> {
    let listener = Arc::new(tokio::net::TcpListener::bind(&config.listen).await?);
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/filter", post(filter::<B>))
        .route("/prioritize", post(prioritize::<B>))
        .route("/bind", post(bind::<B>))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz::<B>))
        .with_state(x);
    tokio::spawn(crate::http::serve_bounded(
        listener,
        app,
        config.http.limits(&crate::http::EXTENDER_LIMITS),
    ));
    Ok(bound)
}
