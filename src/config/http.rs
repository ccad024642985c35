//! The `[http]` and `[extender.http]` sections: an HTTP server's bounds,
//! and each server's defaults.

use std::time::Duration;

use serde::Deserialize;

use super::ConfigError;
use crate::net::http::HttpLimits;

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
