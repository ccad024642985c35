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

impl MockApi {
    /// Takes the next request, asserts it is `method` on `uri` (path and
    /// query), and answers `code` with `answer`.
    pub(crate) async fn expect(
        &mut self,
        method: Method,
        uri: &str,
        code: u16,
        answer: Value,
    ) -> Received {
        let next = tokio::time::timeout(Duration::from_secs(5), self.0.next_request());
        let (request, reply) = next
            .await
            .unwrap_or_else(|_| panic!("no request came; expected {method} {uri}"))
            .unwrap_or_else(|| panic!("the client is gone; expected {method} {uri}"));
        assert_eq!(
            (request.method(), request.uri().to_string().as_str()),
            (&method, uri),
            "the request in this place of the sequence"
        );
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
        let response = Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(&answer).expect("JSON")))
            .expect("a response");
        reply.send_response(response);
        Received { content_type, body }
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
        let next = tokio::time::timeout(Duration::from_millis(300), self.0.next_request());
        if let Ok(Some((request, _))) = next.await {
            panic!(
                "an unexpected request: {} {}",
                request.method(),
                request.uri()
            );
        }
    }
}
