//! The one way every API-server user here gets its client: the kubeconfig
//! a config key names, else `$KUBECONFIG`, else the in-cluster service
//! account. Errors name the config key, so an operator knows what to fix.
//! Also the watch both the daemon's pod cache and the extender's index
//! keep their view with ([`relisting`]): a failed watch lists again soon.

use std::fmt::Debug;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::stream::{BoxStream, Stream, StreamExt};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;

#[derive(Debug, thiserror::Error)]
pub enum KubeClientError {
    #[error("no API server credentials (KUBECONFIG or in-cluster): {0}")]
    NoCredentials(kube::Error),
    #[error("config key `{key}` ({path}): {reason}")]
    Kubeconfig {
        key: &'static str,
        path: String,
        reason: String,
    },
}

/// A client from the kubeconfig at `path` (the value of config key `key`);
/// an empty path means `$KUBECONFIG`, else in-cluster.
pub async fn from_kubeconfig(path: &Path, key: &'static str) -> Result<Client, KubeClientError> {
    if path.as_os_str().is_empty() {
        return Client::try_default()
            .await
            .map_err(KubeClientError::NoCredentials);
    }
    let named = |e: &dyn std::fmt::Display| KubeClientError::Kubeconfig {
        key,
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let file = Kubeconfig::read_from(path).map_err(|e| named(&e))?;
    let config = kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
        .await
        .map_err(|e| named(&e))?;
    Client::try_from(config).map_err(|e| named(&e))
}

/// The HTTP status the API server answered a watch or its list with, if
/// it answered at all (410: the resourceVersion expired).
pub fn status_code(err: &watcher::Error) -> Option<u16> {
    use watcher::Error::{InitialListFailed, WatchError, WatchFailed, WatchStartFailed};
    match err {
        WatchError(s) => Some(s.code),
        InitialListFailed(kube::Error::Api(s))
        | WatchStartFailed(kube::Error::Api(s))
        | WatchFailed(kube::Error::Api(s)) => Some(s.code),
        _ => None,
    }
}

/// How long to wait before a fresh list and watch after the `attempt`th
/// failure in a row (0 the first): 0.2 s doubling to a cap of 1 s, or of
/// 2 s while the server answers 429 or 5xx (it is there but overloaded or
/// not ready, and every node's daemon is asking too), each drawn between
/// half and all of it so that the nodes spread out.
///
/// Short, because a stale cache is not ready: kube-runtime's default
/// backoff (0.8 s doubling to 30 s with full jitter, reset only by an event
/// that arrives) has grown to tens of seconds by the time the API server
/// is back from a restart, and a watch that fails to restart on an expired
/// resourceVersion would retry that same version. The caller starts a new
/// `watcher()` instead, which lists first. The cap still bounds the load
/// of a server that keeps failing: one list per second per watcher.
pub fn relist_delay(err: &watcher::Error, attempt: u32) -> Duration {
    let overloaded = status_code(err).is_some_and(|c| c == 429 || c >= 500);
    let cap = Duration::from_secs(if overloaded { 2 } else { 1 });
    let nominal = Duration::from_millis(200)
        .saturating_mul(1 << attempt.min(16))
        .min(cap);
    nominal.mul_f64(0.5 + fastrand::f64() / 2.0)
}

/// A watch that has run this long without failing counts as recovered:
/// its next failure waits the shortest delay again.
const SETTLED: Duration = Duration::from_secs(10);

/// Where a [`relisting`] watch is.
enum Phase<K> {
    /// Listing or watching.
    Watching(BoxStream<'static, watcher::Result<Event<K>>>),
    /// Failed: a fresh list and watch after this long.
    After(Duration),
}

/// The watcher's events, but every error ends that watcher: after
/// [`relist_delay`] a fresh one lists again (`Init` .. `InitDone`) rather
/// than resume on a resourceVersion that may have expired. So a view built
/// from these events is behind the API server from an `Err` until the next
/// `InitDone`, and then only for about a second once the API server
/// answers again. Failures in a row wait longer, up to the cap; a watch
/// that worked for [`SETTLED`] starts the count again.
pub fn relisting<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = watcher::Result<Event<K>>> + Send
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let start = Relisting {
        phase: Phase::After(Duration::ZERO),
        attempt: 0,
        listed: None,
        api,
        config,
    };
    futures::stream::unfold(start, |mut r| async move {
        let event = loop {
            let mut events = match std::mem::replace(&mut r.phase, Phase::After(Duration::ZERO)) {
                Phase::Watching(events) => events,
                Phase::After(delay) => {
                    tokio::time::sleep(delay).await;
                    watcher(r.api.clone(), r.config.clone()).boxed()
                }
            };
            match events.next().await {
                Some(event) => {
                    r.phase = Phase::Watching(events);
                    break event;
                }
                // The watcher never ends; were it to, a new one starts.
                None => r.phase = Phase::After(Duration::from_secs(1)),
            }
        };
        match &event {
            Ok(Event::InitDone) => r.listed = Some(Instant::now()),
            Ok(_) => {}
            Err(e) => {
                if r.listed.take().is_some_and(|t| t.elapsed() >= SETTLED) {
                    r.attempt = 0;
                }
                r.phase = Phase::After(relist_delay(e, r.attempt));
                r.attempt = r.attempt.saturating_add(1);
            }
        }
        Some((event, r))
    })
}

/// A [`relisting`] watch's state between events.
struct Relisting<K: Resource> {
    phase: Phase<K>,
    /// Failures in a row.
    attempt: u32,
    /// When the current watcher's list arrived.
    listed: Option<Instant>,
    api: Api<K>,
    config: watcher::Config,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            ..Default::default()
        }))
    }

    #[test]
    fn a_failed_watch_relists_within_a_second_or_two() {
        let expired = watcher::Error::WatchStartFailed(api(410));
        assert_eq!(status_code(&expired), Some(410));
        let refused = watcher::Error::NoResourceVersion;
        assert_eq!(status_code(&refused), None);
        let overloaded = watcher::Error::InitialListFailed(api(429));
        let within = |d: Duration, lo: u64, hi: u64| {
            d >= Duration::from_millis(lo) && d <= Duration::from_millis(hi)
        };
        for _ in 0..100 {
            assert!(within(relist_delay(&expired, 0), 100, 200));
            assert!(within(relist_delay(&expired, 1), 200, 400));
            assert!(within(relist_delay(&refused, 2), 400, 800));
            assert!(within(relist_delay(&refused, 3), 500, 1000));
            assert!(within(relist_delay(&refused, u32::MAX), 500, 1000));
            assert!(within(relist_delay(&overloaded, 3), 800, 1600));
            assert!(within(relist_delay(&overloaded, 40), 1000, 2000));
        }
    }

    async fn error_of(path: &Path, key: &'static str) -> String {
        match from_kubeconfig(path, key).await {
            Ok(_) => panic!("{} gave a client", path.display()),
            Err(e) => e.to_string(),
        }
    }

    #[tokio::test]
    async fn a_bad_kubeconfig_is_reported_under_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let e = error_of(&missing, "matcher.kubeconfig").await;
        assert!(
            e.starts_with("config key `matcher.kubeconfig` (") && e.contains("missing"),
            "{e}"
        );
        let garbled = dir.path().join("garbled");
        std::fs::write(&garbled, "not: [a kubeconfig").unwrap();
        let e = error_of(&garbled, "extender.kubeconfig").await;
        assert!(e.starts_with("config key `extender.kubeconfig` ("), "{e}");
    }
}
