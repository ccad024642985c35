//! The HTTP adapter kube-scheduler calls: `POST <urlPrefix>/filter`,
//! `/prioritize`, `/bind`, `/preempt`. Thin: it decodes the body, asks the
//! [`Extender`], encodes the answer. Beside them `/healthz` (the process
//! answers) and `/readyz` (503 with the reason while the index does not
//! follow the API server, when a GPU pod's filter and bind are refused),
//! which [`ask_ready`] asks on loopback for the container's readiness probe,
//! and `/metrics` (each request counted by verb and outcome).
//!
//! kube-scheduler treats any non-200 status as a failure and then drops our
//! message, so filter and bind answer every problem, malformed JSON
//! included, with 200 and the reason in `Error`, which the scheduler puts
//! on the pod's events. Prioritize has no `Error` field: a body it cannot
//! use gets 400 with the reason as text (the scheduler ignores prioritize
//! failures and scores with the rest). Preempt has none either: a refusal
//! gets 503 with the reason as text, which fails that preemption attempt
//! (the extender is not ignorable) and the scheduler tries the pod again.
//!
//! It runs within `[extender.http]`'s bounds (see `crate::net::http`): a body
//! over `max_body_bytes` gets 413 before it is decoded.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::cluster::Binder;
use super::wire::{ExtenderBindingResult, ExtenderFilterResult};
use super::{Extender, ExtenderConfig, RequestError};

fn decode<T: serde::de::DeserializeOwned>(verb: Verb, body: &[u8]) -> Result<T, RequestError> {
    serde_json::from_slice(body).map_err(|source| RequestError::Malformed {
        verb: verb.name(),
        source,
    })
}

fn json(answer: &impl serde::Serialize) -> Response {
    let body = serde_json::to_string(answer).expect("extender answers always serialise");
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The verbs kube-scheduler asks, each answering a refusal its own way.
#[derive(Clone, Copy)]
pub(super) enum Verb {
    Filter,
    Prioritize,
    Bind,
    Preempt,
}

impl Verb {
    pub(super) const ALL: [Verb; 4] = [Verb::Filter, Verb::Prioritize, Verb::Bind, Verb::Preempt];

    /// Its name in a refusal, and its `verb` label on `/metrics`.
    pub(super) fn name(self) -> &'static str {
        match self {
            Verb::Filter => "filter",
            Verb::Prioritize => "prioritize",
            Verb::Bind => "bind",
            Verb::Preempt => "preempt",
        }
    }
}

impl RequestError {
    /// The one mapping of a refusal to HTTP: kube-scheduler drops the
    /// message of any non-200 answer, so filter and bind answer 200 with
    /// the reason in `Error`; prioritize has no `Error` field, so a 400,
    /// which the scheduler ignores, scoring with the rest; preempt has none
    /// either, so a 503, which fails the attempt until the pod's next.
    fn answer(&self, verb: Verb) -> Response {
        let reason = self.to_string();
        match verb {
            Verb::Filter => json(&ExtenderFilterResult::error(reason)),
            Verb::Prioritize => (StatusCode::BAD_REQUEST, reason).into_response(),
            Verb::Bind => json(&ExtenderBindingResult { error: reason }),
            Verb::Preempt => (StatusCode::SERVICE_UNAVAILABLE, reason).into_response(),
        }
    }
}

/// A handler's answer, counted: the verb's own on success,
/// [`RequestError::answer`] otherwise.
fn reply<B>(
    x: &Extender<B>,
    verb: Verb,
    answer: Result<impl serde::Serialize, RequestError>,
) -> Response {
    x.metrics.count(verb, &answer);
    match answer {
        Ok(answer) => json(&answer),
        Err(e) => e.answer(verb),
    }
}

async fn filter<B: Binder>(State(x): State<Arc<Extender<B>>>, body: Bytes) -> Response {
    let answer = match decode(Verb::Filter, &body) {
        Ok(args) => x.filter(&args).await,
        Err(e) => Err(e),
    };
    reply(&x, Verb::Filter, answer)
}

async fn prioritize<B: Binder>(State(x): State<Arc<Extender<B>>>, body: Bytes) -> Response {
    let answer = decode(Verb::Prioritize, &body).and_then(|args| x.prioritize(&args));
    reply(&x, Verb::Prioritize, answer)
}

async fn bind<B: Binder>(State(x): State<Arc<Extender<B>>>, body: Bytes) -> Response {
    let answer = match decode(Verb::Bind, &body) {
        Ok(args) => x.bind(&args).await,
        Err(e) => Err(e),
    };
    let answer = answer.map(|()| ExtenderBindingResult::default());
    reply(&x, Verb::Bind, answer)
}

async fn preempt<B: Binder>(State(x): State<Arc<Extender<B>>>, body: Bytes) -> Response {
    let answer = decode(Verb::Preempt, &body).and_then(|args| x.preempt(&args));
    reply(&x, Verb::Preempt, answer)
}

async fn metrics<B: Binder>(State(x): State<Arc<Extender<B>>>) -> Response {
    let content_type = crate::net::http::METRICS_CONTENT_TYPE;
    ([(header::CONTENT_TYPE, content_type)], x.metrics.render()).into_response()
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
        .route("/preempt", post(preempt::<B>))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz::<B>))
        .route("/metrics", get(metrics::<B>))
        .with_state(x);
    tokio::spawn(crate::net::http::serve_bounded(
        listener,
        app,
        config.http.limits(&crate::config::EXTENDER_LIMITS),
    ));
    Ok(bound)
}

/// The most of `/readyz`'s answer [`ask_ready`] reads: the reasons of two
/// kinds fit many times over, and whatever listens there is not trusted.
const READY_ANSWER_BYTES: u64 = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ReadyError {
    #[error("cannot ask {url} (config key `extender.listen`): {source}")]
    Unreachable { url: String, source: std::io::Error },
    #[error("{url} did not answer within {timeout:?}")]
    Timeout { url: String, timeout: Duration },
    #[error("{url} answered no HTTP status line: {head:?}")]
    Garbled { url: String, head: String },
    #[error("{url}: {status}: {body}")]
    NotReady {
        url: String,
        status: String,
        body: String,
    },
}

/// Asks the extender listening at `config.listen` for its `/readyz`
/// within `timeout`: Ok when it answers 200. The extender container's
/// readiness probe (`gpu-device-plugin extender-ready`), since it listens
/// on loopback where the kubelet's HTTP probes do not reach.
pub async fn ask_ready(config: &ExtenderConfig, timeout: Duration) -> Result<(), ReadyError> {
    let url = format!("http://{}/readyz", config.listen);
    let asked = async {
        let mut s = tokio::net::TcpStream::connect(&config.listen).await?;
        let request = format!("GET /readyz HTTP/1.0\r\nHost: {}\r\n\r\n", config.listen);
        s.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        s.take(READY_ANSWER_BYTES).read_to_end(&mut answer).await?;
        Ok(answer)
    };
    let answer = tokio::time::timeout(timeout, asked)
        .await
        .map_err(|_| ReadyError::Timeout {
            url: url.clone(),
            timeout,
        })?
        .map_err(|source| ReadyError::Unreachable {
            url: url.clone(),
            source,
        })?;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status_line = head.lines().next().unwrap_or_default();
    let status = match status_line.split_once(' ') {
        Some((version, status)) if version.starts_with("HTTP/") => status.trim(),
        _ => {
            return Err(ReadyError::Garbled {
                url,
                head: status_line.chars().take(80).collect(),
            });
        }
    };
    if status.starts_with("200 ") || status == "200" {
        return Ok(());
    }
    Err(ReadyError::NotReady {
        url,
        status: status.to_owned(),
        body: body.trim().to_owned(),
    })
}
