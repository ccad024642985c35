//! A mocked API server for in-crate tests, in kube's `tower-test` pattern
//! (as kube-rs's controller-rs example's `fixtures.rs` does): a
//! [`kube::Client`] whose every request the test receives in turn, checks
//! and answers, so a round trip's exact request sequence is pinned.

use std::time::Duration;

use hyper::{Method, Request, Response};
use kube::Client;
use kube::client::Body;
use serde_json::Value;
use tower_test::mock::{self, Handle};

/// The API server side of [`client`]'s connection.
pub(crate) struct MockApi(Handle<Request<Body>, Response<Body>>);

/// A client whose requests [`MockApi`] answers.
pub(crate) fn client() -> (Client, MockApi) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, "default"), MockApi(handle))
}

/// One request as the API server got it.
#[derive(Debug)]
pub(crate) struct Received {
    pub(crate) content_type: Option<String>,
    /// The body as JSON; Null when empty.
    pub(crate) body: Value,
}

/// The body of a merge patch that sets `annotations` on an object whose
/// resourceVersion must still be `resource_version`.
pub(crate) fn annotations_patch(resource_version: &str, annotations: Value) -> Value {
    serde_json::json!({
        "metadata": { "annotations": annotations, "resourceVersion": resource_version },
    })
}

/// A `Status` object as the API server answers a failure with `code`.
pub(crate) fn status(code: u16, reason: &str) -> Value {
    serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": format!("{reason} (mocked)"),
        "reason": reason, "code": code,
    })
}

/// A request taken and not answered yet: the client waits until
/// [`Taken::answer`].
pub(crate) struct Taken {
    pub(crate) method: Method,
    /// Path and query.
    pub(crate) uri: String,
    pub(crate) received: Received,
    reply: mock::SendResponse<Response<Body>>,
}

impl Taken {
    /// Answers `code` with `answer`; gives the request as received.
    pub(crate) fn answer(self, code: u16, answer: &Value) -> Received {
        let response = Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(answer).expect("JSON")))
            .expect("a response");
        self.reply.send_response(response);
        self.received
    }
}

impl MockApi {
    /// Takes the next request if one comes `within`, without answering it.
    pub(crate) async fn take_within(&mut self, within: Duration) -> Option<Taken> {
        let (request, reply) = tokio::time::timeout(within, self.0.next_request())
            .await
            .ok()??;
        let method = request.method().clone();
        let uri = request.uri().to_string();
        let content_type = request
            .headers()
            .get("content-type")
            .map(|v| v.to_str().expect("an ASCII content type").to_owned());
        let bytes = request.into_body().collect_bytes().await.expect("a body");
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("a JSON body")
        };
        Some(Taken {
            method,
            uri,
            received: Received { content_type, body },
            reply,
        })
    }

    /// Takes the next request (within 5 s; `expected` says what in the
    /// panic) without answering it.
    pub(crate) async fn take(&mut self, expected: &str) -> Taken {
        self.take_within(Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("no request came; expected {expected}"))
    }

    /// Takes the next request, asserts it is `method` on `uri` (path and
    /// query), and answers `code` with `answer`.
    pub(crate) async fn expect(
        &mut self,
        method: Method,
        uri: &str,
        code: u16,
        answer: Value,
    ) -> Received {
        let taken = self.take(&format!("{method} {uri}")).await;
        assert_eq!(
            (&taken.method, taken.uri.as_str()),
            (&method, uri),
            "the request in this place of the sequence"
        );
        taken.answer(code, &answer)
    }

    /// Takes the next request, asserts it is a JSON merge patch of `uri`,
    /// and answers `code` with `answer`.
    pub(crate) async fn expect_merge_patch(
        &mut self,
        uri: &str,
        code: u16,
        answer: Value,
    ) -> Received {
        let patch = self.expect(Method::PATCH, uri, code, answer).await;
        assert_eq!(
            patch.content_type.as_deref(),
            Some("application/merge-patch+json")
        );
        patch
    }

    /// Asserts that no further request comes.
    pub(crate) async fn done(mut self) {
        if let Some(t) = self.take_within(Duration::from_millis(300)).await {
            panic!("an unexpected request: {} {}", t.method, t.uri);
        }
    }
}
