//! The extender's config: the `[extender]` section of the TOML file. Every
//! key has a default, unknown keys are refused, and a bad value is named
//! by its key with what would be accepted.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::ConfigError;
use crate::rules::usage::Policy;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExtenderConfig {
    /// Where kube-scheduler reaches the extender (its `urlPrefix`). The
    /// default is loopback: `/bind` has no authentication, so only the
    /// kube-scheduler beside it (same pod) may reach it unless an operator
    /// chooses otherwise.
    pub listen: String,
    /// The domain of the resources and annotations, as on the nodes.
    pub resource_domain: String,
    pub policy: Policy,
    /// A kubeconfig file for the API server; empty: `$KUBECONFIG`, else the
    /// in-cluster service account.
    pub kubeconfig: PathBuf,
    /// How long one bind may take (the Binding, and on a failed one
    /// finding out whether it landed);
    /// kube-scheduler's own wait is the extender's `httpTimeout`.
    pub(crate) bind_timeout_ms: u64,
    /// How long a placement not yet seen bound is counted at most: a pod
    /// filtered or scored whose bind has not come (kube-scheduler filters
    /// the next pods before it binds this one), a bind whose caller hung up
    /// or whose Binding's fate is unknown, or a bind done that the watch
    /// has not shown yet (from the end of its `bind_timeout_ms`).
    pub(crate) reservation_ttl_ms: u64,
    /// How long a GPU pod's filter waits for a place among the
    /// `max_binds_queued` for its bind before answering a retryable error
    /// (0: at once). kube-scheduler filters one pod at a time, so the wait
    /// holds back the next bind until one ends: the scheduler goes at the
    /// binds' pace instead of sending binds that are refused, each costing
    /// the pod a backoff and the API server an Event and a status update.
    pub(crate) filter_wait_ms: u64,
    /// The filter passes only the node the policy ranks best among those
    /// the pod fits (the one prioritize would score 10), so kube-scheduler
    /// binds there without calling prioritize or running its own score
    /// plugins over every node: a shorter scheduling cycle at thousands of
    /// nodes. What is lost: the scheduler's soft preferences (preferred
    /// affinity, ScheduleAnyway spread, image locality) no longer choose
    /// among the nodes the pod fits, which at the shipped weight they
    /// cannot outvote anyway.
    pub(crate) choose_at_filter: bool,
    /// Binds running their API requests at once (each one request at a
    /// time); more wait, in the queue `max_binds_queued` bounds.
    pub(crate) max_binds_in_flight: usize,
    /// Binds admitted at once, running or waiting to, counting the places
    /// filters keep; past it a filter waits and a bind without a place is
    /// refused at once. Below `http.max_connections`, since each holds a
    /// connection, so that a filter always finds one; absent, the least of
    /// [`MAX_BINDS_QUEUED`] and the connections less a quarter: a bind's
    /// place frees as its answer goes out, before kube-scheduler has taken
    /// the connection back, so the next bind may open another meanwhile,
    /// and at the cap the server would close an idle one the scheduler may
    /// be about to send on (it does not resend a POST: `EOF`).
    max_binds_queued: Option<usize>,
    /// The HTTP server's bounds (`crate::config::EXTENDER_LIMITS` by default).
    pub(crate) http: crate::config::HttpConfig,
}

impl Default for ExtenderConfig {
    fn default() -> Self {
        ExtenderConfig {
            listen: "127.0.0.1:8888".into(),
            resource_domain: "doslab.io".into(),
            policy: Policy::Binpack,
            kubeconfig: PathBuf::new(),
            bind_timeout_ms: 10_000,
            reservation_ttl_ms: 10_000,
            max_binds_in_flight: 32,
            max_binds_queued: None,
            filter_wait_ms: 1_000,
            choose_at_filter: true,
            http: crate::config::HttpConfig::default(),
        }
    }
}

/// The default bound on binds admitted: a bind running or waiting holds
/// one of the scheduler's connections, and at the default 32 binds in
/// flight (about 500 binds a second at the ~60 ms two API writes take)
/// 256 wait at most half a second.
pub(crate) const MAX_BINDS_QUEUED: usize = 256;

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: format!("extender.{key}"),
        reason: reason.into(),
    }
}

impl ExtenderConfig {
    /// The `[extender]` section of the file at `path` (defaults when absent);
    /// the daemon's other keys are not read here.
    pub fn load(path: &Path) -> Result<ExtenderConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        ExtenderConfig::from_toml(&text)
    }

    pub fn from_toml(text: &str) -> Result<ExtenderConfig, ConfigError> {
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        let config: ExtenderConfig = match table.remove("extender") {
            Some(section) => section
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::Parse(format!("[extender]: {e}")))?,
            None => ExtenderConfig::default(),
        };
        config.validate()?;
        Ok(config)
    }

    fn connections(&self) -> usize {
        self.http
            .limits(&crate::config::EXTENDER_LIMITS)
            .max_connections
    }

    /// The binds that may be admitted at once (`max_binds_queued`, or its
    /// default).
    pub(crate) fn binds_queued(&self) -> usize {
        self.max_binds_queued.unwrap_or_else(|| {
            let c = self.connections();
            MAX_BINDS_QUEUED.min(c - (c / 4).max(1)).max(1)
        })
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        // The daemon's own check of the domain, reported under our key.
        if let Err(ConfigError::Invalid { key, reason }) =
            crate::config::validate_resource_domain(&self.resource_domain)
        {
            return Err(invalid(&key, reason));
        }
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(invalid(
                "listen",
                format!(
                    "{:?} is not an address:port like \"127.0.0.1:8888\"",
                    self.listen
                ),
            ));
        }
        if !(100..=120_000).contains(&self.bind_timeout_ms) {
            return Err(invalid(
                "bind_timeout_ms",
                "must be between 100 and 120000 (milliseconds)",
            ));
        }
        if self.filter_wait_ms > 60_000 {
            return Err(invalid(
                "filter_wait_ms",
                "must be at most 60000 (milliseconds), below the scheduler's httpTimeout",
            ));
        }
        if !(100..=600_000).contains(&self.reservation_ttl_ms) {
            return Err(invalid(
                "reservation_ttl_ms",
                "must be between 100 and 600000 (milliseconds)",
            ));
        }
        self.http
            .validate("extender.http", &crate::config::EXTENDER_LIMITS)?;
        let connections = self.connections();
        if let Some(n) = self.max_binds_queued
            && !(1..connections).contains(&n)
        {
            return Err(invalid(
                "max_binds_queued",
                format!(
                    "must be at least 1 and below extender.http.max_connections ({connections}), \
                     which must leave the scheduler a connection for filters"
                ),
            ));
        }
        if !(1..=100_000).contains(&self.max_binds_in_flight) {
            return Err(invalid(
                "max_binds_in_flight",
                "must be between 1 and 100000",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_section_and_errors() {
        let empty = ExtenderConfig::from_toml("resource_domain = \"other.io\"\n").unwrap();
        assert_eq!(empty, ExtenderConfig::default());
        // The unauthenticated /bind is reachable from the pod network only
        // when an operator says so.
        let listen: std::net::SocketAddr = empty.listen.parse().unwrap();
        assert!(listen.ip().is_loopback(), "{listen}");

        let text = "memory_unit_mib = 4\n[extender]\nlisten = \"127.0.0.1:0\"\npolicy = \"spread\"\n\
                    kubeconfig = \"/etc/kube/config\"\n";
        let c = ExtenderConfig::from_toml(text).unwrap();
        assert_eq!(c.policy, Policy::Spread);
        assert_eq!(c.listen, "127.0.0.1:0");
        assert_eq!(c.kubeconfig, PathBuf::from("/etc/kube/config"));
        assert_eq!(c.resource_domain, "doslab.io");

        let err = |t: &str| ExtenderConfig::from_toml(t).unwrap_err().to_string();
        let e = err("[extender]\npolicy = \"random\"\n");
        assert!(e.contains("random") && e.contains("binpack"), "{e}");
        let e = err("[extender]\nlisten_addr = \"x\"\n");
        assert!(e.contains("listen_addr"), "{e}");
        let e = err("[extender]\nlisten = \"nowhere\"\n");
        assert!(e.contains("`extender.listen`"), "{e}");
        let e = err("[extender]\nresource_domain = \"Bad_Domain\"\n");
        assert!(e.contains("`extender.resource_domain`"), "{e}");
        let e = err("[extender]\nbind_timeout_ms = 5\n");
        assert!(e.contains("`extender.bind_timeout_ms`"), "{e}");
        let e = err("[extender]\nfilter_wait_ms = 60001\n");
        assert!(e.contains("`extender.filter_wait_ms`"), "{e}");
        let e = err("[extender]\nreservation_ttl_ms = 0\n");
        assert!(e.contains("`extender.reservation_ttl_ms`"), "{e}");

        let c = ExtenderConfig::from_toml("[extender.http]\nmax_connections = 8\n").unwrap();
        let limits = c.http.limits(&crate::config::EXTENDER_LIMITS);
        assert_eq!(limits.max_connections, 8);
        // An absent key keeps the extender's own default, not the daemon's.
        assert_eq!(limits.max_body_bytes, 4 << 20);
        let e = err("[extender]\nmax_binds_in_flight = 0\n");
        assert!(e.contains("`extender.max_binds_in_flight`"), "{e}");
        let e = err("[extender]\nmax_binds_queued = 8\n[extender.http]\nmax_connections = 8\n");
        assert!(e.contains("below extender.http.max_connections (8)"), "{e}");
        let queued = |t: &str| ExtenderConfig::from_toml(t).unwrap().binds_queued();
        assert_eq!(
            queued("[extender]\nmax_binds_queued = 7\n[extender.http]\nmax_connections = 8\n"),
            7
        );
        // Absent: the connections less a quarter, at most the default.
        assert_eq!(queued(""), 48);
        assert_eq!(queued("[extender.http]\nmax_connections = 16\n"), 12);
        assert_eq!(queued("[extender.http]\nmax_connections = 2\n"), 1);
        assert_eq!(queued("[extender.http]\nmax_connections = 1\n"), 1);
        assert_eq!(
            queued("[extender.http]\nmax_connections = 4096\n"),
            MAX_BINDS_QUEUED
        );
        let e = err("[extender.http]\nmax_header_bytes = 100\n");
        assert!(e.contains("`extender.http.max_header_bytes`"), "{e}");
        let e = err("[extender.http]\nheader_timeout = 100\n");
        assert!(e.contains("header_timeout"), "{e}");
    }
}
