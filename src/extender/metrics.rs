//! The extender's `/metrics`: every request kube-scheduler made, by verb
//! and by how it ended, so an operator sees binds refused, and why,
//! without reading the log. The outcomes are a closed set
//! ([`RequestError::kind`]), so the series stay bounded whatever the
//! requests hold.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::RequestError;
use super::server::Verb;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    /// [`Verb::name`].
    verb: &'static str,
    /// `ok`, or why it was refused.
    outcome: &'static str,
}

/// The extender's series.
pub(crate) struct ExtenderMetrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
}

impl Default for ExtenderMetrics {
    fn default() -> Self {
        let requests = Family::<RequestLabels, Counter>::default();
        // Each verb's success from the start, so "none yet" reads 0.
        for verb in Verb::ALL {
            let ok = RequestLabels {
                verb: verb.name(),
                outcome: "ok",
            };
            requests.get_or_create(&ok).inc_by(0);
        }
        let mut registry = Registry::with_prefix("gpu_device_plugin_extender");
        let help = "Requests from kube-scheduler, by verb and outcome (ok, or why refused)";
        registry.register("requests", help, Family::clone(&requests));
        ExtenderMetrics { registry, requests }
    }
}

impl ExtenderMetrics {
    /// Counts a `verb` request that ended in `result`.
    pub(super) fn count<T>(&self, verb: Verb, result: &Result<T, RequestError>) {
        let outcome = result.as_ref().map_or_else(RequestError::kind, |_| "ok");
        let verb = verb.name();
        self.requests
            .get_or_create(&RequestLabels { verb, outcome })
            .inc();
    }

    /// The scrape, in the OpenMetrics text format.
    pub(crate) fn render(&self) -> String {
        crate::net::http::render_metrics(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extender::wire::ExtenderFilterResult;

    #[test]
    fn a_refusal_is_counted_under_its_reason_under_its_verb() {
        let m = ExtenderMetrics::default();
        let refused: Result<ExtenderFilterResult, _> = Err(RequestError::Bind {
            pod: ("ns".into(), "p".into()),
            node: "n".into(),
            reason: Box::new(RequestError::NodeLineTooLong),
        });
        m.count(Verb::Bind, &refused);
        m.count(Verb::Bind, &refused);
        m.count(Verb::Filter, &Ok(()));
        let text = m.render();
        for line in [
            "gpu_device_plugin_extender_requests_total{verb=\"bind\",outcome=\"node_line_too_long\"} 2",
            "gpu_device_plugin_extender_requests_total{verb=\"bind\",outcome=\"ok\"} 0",
            "gpu_device_plugin_extender_requests_total{verb=\"filter\",outcome=\"ok\"} 1",
            "gpu_device_plugin_extender_requests_total{verb=\"prioritize\",outcome=\"ok\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
    }
}
