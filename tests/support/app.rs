//! The daemon in-process: [`App`] starts it on this test's runtime through
//! `node::app::start`, as `main` does, and tells it what the signals would.
//! Each one has its own config file; the test gives it its own
//! device-plugin directory and `http_listen = "127.0.0.1:0"`, so several
//! run side by side in one test binary. Environment variables are
//! process-wide: the config carries what the binary would take from them
//! (`node_name`, `kubeconfig`).

use std::path::PathBuf;
use std::time::Instant;

use futures::StreamExt;
use gpu_device_plugin::config::Config;
use gpu_device_plugin::node::app::{self, Control, Reloaded, RunError, Running};

use super::{WAIT, http_get, poll_for, sample};

pub struct App {
    /// The HTTP endpoint's address as bound at start.
    pub http: String,
    /// The config file, re-read on [`App::reload`].
    pub config: PathBuf,
    running: Option<Running>,
    /// The config lives apart from the device-plugin directory, which a
    /// kubelet restart wipes.
    _files: tempfile::TempDir,
}

impl App {
    /// Starts the daemon on `toml`; panics when it does not start.
    pub async fn start(toml: &str) -> App {
        App::try_start(toml)
            .await
            .unwrap_or_else(|e| panic!("the daemon did not start: {e}"))
    }

    /// Starts the daemon on `toml`: Err when a start-up check refuses it.
    /// With `watch_config = true` an edit of the file reloads it, as in
    /// the binary.
    pub async fn try_start(toml: &str) -> Result<App, RunError> {
        logging();
        let files = tempfile::tempdir().unwrap();
        let config = files.path().join("config.toml");
        std::fs::write(&config, toml).unwrap();
        let parsed = Config::from_toml(toml, None)
            .unwrap_or_else(|e| panic!("a test config that does not parse: {e}\n{toml}"));
        let watch = parsed.watch_config;
        let running = app::start(parsed, Some(config.clone())).await?;
        if watch {
            let mut edits = gpu_device_plugin::node::config_watch::watch(&config).unwrap();
            let tell = running.controls();
            tokio::spawn(async move {
                while edits.next().await.is_some() {
                    if tell.send(Control::Edited).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(App {
            http: running.http.map(|a| a.to_string()).unwrap_or_default(),
            config,
            running: Some(running),
            _files: files,
        })
    }

    fn running(&self) -> &Running {
        self.running.as_ref().expect("the daemon runs")
    }

    /// Re-read the config file (SIGHUP in the binary).
    pub fn reload(&self) {
        assert!(self.running().send(Control::Reload), "the daemon stopped");
    }

    /// Writes `toml` over the config file and tells the daemon to reload.
    pub fn rewrite(&self, toml: &str) {
        std::fs::write(&self.config, toml).unwrap();
        self.reload();
    }

    /// How the last reload went (None before the first).
    pub fn last_reload(&self) -> Option<Reloaded> {
        self.running().reloads().borrow().clone()
    }

    /// Whether the daemon has stopped on its own.
    pub fn is_finished(&self) -> bool {
        self.running().is_finished()
    }

    /// Stops the daemon (SIGTERM in the binary) and waits until it has.
    pub async fn stop(mut self) {
        let running = self.running.take().expect("the daemon runs");
        let deadline = tokio::time::timeout(WAIT, running.stop());
        match deadline.await {
            Ok(ended) => ended.expect("the daemon stopped cleanly"),
            Err(_) => panic!("the daemon did not stop within {WAIT:?}"),
        }
    }

    /// `/metrics` and `/readyz` now: what a failing test shows of the
    /// daemon.
    pub fn state(&self) -> String {
        if self.http.is_empty() {
            return "(no HTTP endpoint)".into();
        }
        let (code, ready) = http_get(&self.http, "/readyz");
        let metrics = http_get(&self.http, "/metrics").1;
        format!("/readyz {code}: {ready}\n/metrics:\n{metrics}")
    }

    /// The value of `series` on `/metrics` now.
    pub fn metric(&self, series: &str) -> Option<f64> {
        sample(&http_get(&self.http, "/metrics").1, series)
    }

    /// Polls `/metrics` until `series` reads `value`.
    pub async fn wait_for_sample(&self, series: &str, value: f64) {
        super::wait_for_sample(&self.http, series, value).await;
    }

    /// Polls `/readyz` until its (status, body) satisfies `done`; returns
    /// them.
    pub async fn readyz_until(&self, done: impl Fn(u16, &str) -> bool) -> (u16, String) {
        self.get_until("/readyz", done).await
    }

    /// Polls `path` until its (status, body) satisfies `done`; returns
    /// them.
    pub async fn get_until(&self, path: &str, done: impl Fn(u16, &str) -> bool) -> (u16, String) {
        get_until(&self.http, path, done).await
    }

    /// Waits until the daemon says it is ready.
    pub async fn ready(&self) {
        self.readyz_until(|c, _| c == 200).await;
    }
}

impl Drop for App {
    /// Dropping the controls stops the daemon, on the runtime the test
    /// leaves running or not.
    fn drop(&mut self) {
        if let Some(r) = &self.running {
            r.send(Control::Stop);
        }
    }
}

/// What a test sees of a daemon, in-process or the binary.
pub trait Observed {
    /// What a failing test shows: the log (a binary) or the endpoints
    /// (in-process, where the log is the whole test process's).
    fn shown(&self) -> String;
    /// The HTTP endpoint's address.
    fn http_addr(&self) -> String;
}

impl Observed for App {
    fn shown(&self) -> String {
        self.state()
    }
    fn http_addr(&self) -> String {
        self.http.clone()
    }
}

/// How a test starts a daemon on a config: in-process or the binary.
pub trait Start: Observed + Sized {
    async fn start(toml: &str) -> Self;
}

impl Start for App {
    async fn start(toml: &str) -> App {
        App::start(toml).await
    }
}

impl Start for super::Daemon {
    async fn start(toml: &str) -> super::Daemon {
        super::Daemon::start(toml)
    }
}

/// Polls `path` at `addr` until its (status, body) satisfies `done`;
/// returns them.
pub async fn get_until(addr: &str, path: &str, done: impl Fn(u16, &str) -> bool) -> (u16, String) {
    poll_for(
        Instant::now() + WAIT,
        async || Some(http_get(addr, path)).filter(|(c, b)| done(*c, b)),
        || {
            format!(
                "{path} at {addr} never as wanted: {:?}",
                http_get(addr, path)
            )
        },
    )
    .await
}

impl Observed for super::Daemon {
    fn shown(&self) -> String {
        self.log_text()
    }
    fn http_addr(&self) -> String {
        self.listening()
    }
}

/// The daemons' logs on the test's output, once per test binary: seen
/// with `--nocapture` when a test fails.
fn logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}
