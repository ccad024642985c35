//! The enforcement sweeper, one actor beside the plugins: every tick it
//! checks the library (readiness is false while it is unusable, logged once
//! per change), removes the cache directories of containers that are gone
//! and exports how many are left, and reads the live containers' usage
//! regions into the per-container memory metric.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::{CacheOwner, EnforcementError, Enforcer, Keep, Region, RegionError, cache_key};
use crate::node::matcher::{LiveContainer, MatcherHandle};
use crate::node::metrics::{ContainerLabels, ContainerMemory, EnforcementSeries, Metrics};
use crate::node::readiness::{Child, Hold, Readiness};

pub(crate) struct Sweeper;

#[derive(Debug, Clone)]
pub(crate) struct SweeperArgs {
    pub(crate) enforcer: Enforcer,
    /// With pod matching: says which containers live. Without, cache
    /// directories go by age.
    pub(crate) matcher: Option<MatcherHandle>,
    pub(crate) tick: Duration,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) readiness: Arc<Readiness>,
}

impl SweeperArgs {
    /// What restarts a running sweeper when a reload changes it. Left out:
    /// the metrics registry and the readiness marks, the supervisor's; and which matcher handle it
    /// asks, the supervisor's, the same across reloads (only whether it
    /// asks one is the config's).
    pub(crate) fn restart_key(&self) -> impl PartialEq + '_ {
        let SweeperArgs {
            enforcer,
            matcher,
            tick,
            metrics: _,
            readiness: _,
        } = self;
        (enforcer, matcher.is_some(), tick)
    }
}

/// What the sweeper tells itself; nothing waits for a reply.
pub(crate) enum SweeperMsg {
    /// Run one pass (check the library, sweep the cache directories, read
    /// the usage regions) and schedule the next after the tick.
    Tick,
}

pub(crate) struct SweeperState {
    args: SweeperArgs,
    /// Why the library was unusable at the last check (None: usable);
    /// unknown before the first.
    library: Option<Option<String>>,
    /// Cache keys whose region could not be read, logged once each.
    unreadable: HashSet<String>,
    series: EnforcementSeries,
}

/// What one pass found on disk.
struct Found {
    library: Option<String>,
    cache_dirs: Result<u64, EnforcementError>,
    regions: Vec<(LiveContainer, String, Result<Option<Region>, RegionError>)>,
}

impl SweeperState {
    async fn pass(&mut self) {
        // None with pod matching: not synced (or down), so nothing says
        // which pods are gone.
        let live = match &self.args.matcher {
            Some(handle) => handle.live().await,
            None => None,
        };
        let matching = self.args.matcher.is_some();
        let enforcer = self.args.enforcer.clone();
        let found = tokio::task::spawn_blocking(move || scan(&enforcer, matching, live))
            .await
            .expect("enforcement sweep panicked");
        self.report_library(found.library);
        match found.cache_dirs {
            Ok(n) => self.series.cache_dirs = n,
            Err(e) => tracing::warn!(error = %e, "cannot sweep enforcement cache directories"),
        }
        if matching {
            self.series.memory_used = self.memory_used(found.regions);
        }
        self.args.metrics.set_enforcement(Some(self.series.clone()));
    }

    /// Readiness follows the library; the log says when that changes.
    /// False when nothing changed, so nothing was told.
    fn report_library(&mut self, why: Option<String>) -> bool {
        if self.library.as_ref() == Some(&why) {
            return false;
        }
        match &why {
            Some(e) => {
                tracing::error!(error = %e, "enforcement library unavailable: shared grants are refused")
            }
            None => tracing::info!(
                library = %self.args.enforcer.library_path().display(),
                "enforcement library usable"
            ),
        }
        let readiness = &self.args.readiness;
        readiness.hold(Child::Enforcement, Hold::Waiting, why.clone());
        self.library = Some(why);
        true
    }

    /// The memory rows of the regions read; an unreadable one is left out
    /// and logged once.
    fn memory_used(
        &mut self,
        regions: Vec<(LiveContainer, String, Result<Option<Region>, RegionError>)>,
    ) -> Vec<ContainerMemory> {
        let mut rows = Vec::new();
        let mut still = HashSet::new();
        for (c, key, region) in regions {
            match region {
                Ok(Some(region)) => {
                    rows.extend(region.devices.into_iter().map(|d| ContainerMemory {
                        at: ContainerLabels::new(&c.pod, &c.container, &d.uuid),
                        bytes: d.used_bytes,
                    }))
                }
                Ok(None) => {}
                Err(e) => {
                    if !self.unreadable.contains(&key) {
                        tracing::warn!(pod = %c.pod, container = %c.container, error = %e,
                            "cannot read the container's usage region; its memory metric is left out");
                    }
                    still.insert(key);
                }
            }
        }
        self.unreadable = still;
        rows
    }
}

/// The file work of one pass: the library check, the sweep, and (with the
/// live containers) their regions.
fn scan(enforcer: &Enforcer, matching: bool, live: Option<Vec<LiveContainer>>) -> Found {
    let library = enforcer.check().err().map(|e| e.to_string());
    let now = SystemTime::now();
    let keep = match (&live, matching) {
        (Some(live), _) => Some(Keep::Live {
            keys: live.iter().map(key_of).collect(),
            as_of: now,
        }),
        (None, false) => enforcer
            .max_age()
            .and_then(|age| now.checked_sub(age))
            .map(Keep::NewerThan),
        (None, true) => None,
    };
    // Without a sweep (nothing says what is stale), keep everything and
    // still count.
    let keep = keep.unwrap_or(Keep::NewerThan(SystemTime::UNIX_EPOCH));
    let cache_dirs = enforcer.sweep(&keep).map(|s| s.remaining as u64);
    let regions = live
        .into_iter()
        .flatten()
        .map(|c| {
            let key = key_of(&c);
            let region = enforcer.usage(&key);
            (c, key, region)
        })
        .collect();
    Found {
        library,
        cache_dirs,
        regions,
    }
}

fn key_of(c: &LiveContainer) -> String {
    cache_key(CacheOwner {
        pod_uid: &c.uid,
        container: &c.container,
    })
}

impl Actor for Sweeper {
    type Msg = SweeperMsg;
    type State = SweeperState;
    type Arguments = SweeperArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SweeperMsg>,
        args: SweeperArgs,
    ) -> Result<SweeperState, ActorProcessingErr> {
        myself.send_message(SweeperMsg::Tick)?;
        if args.matcher.is_none() {
            tracing::info!(
                "without pod matching, per-container memory is not exported and cache \
                 directories are removed by age"
            );
        }
        Ok(SweeperState {
            args,
            library: None,
            unreadable: HashSet::new(),
            series: EnforcementSeries::default(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SweeperMsg>,
        msg: SweeperMsg,
        state: &mut SweeperState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SweeperMsg::Tick => {
                state.pass().await;
                myself.send_after(state.args.tick, || SweeperMsg::Tick);
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<SweeperMsg>,
        state: &mut SweeperState,
    ) -> Result<(), ActorProcessingErr> {
        // Enforcement switched off (or a successor takes over): its
        // readiness and series go with it.
        state.args.readiness.release(Child::Enforcement);
        state.args.metrics.set_enforcement(None);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::node::enforcement::{EnforcementConfig, Mode, install_library, library, region};

    fn enforcer(root: &Path, cache_max_age_s: u64) -> Enforcer {
        install_library(&library::tests::real_shared_object(), &root.join("lib")).unwrap();
        Enforcer::new(&EnforcementConfig {
            mode: Mode::HamiCore,
            library_dir: root.join("lib"),
            state_dir: root.join("state"),
            cache_max_age_s,
            ..Default::default()
        })
        .unwrap()
    }

    fn container(pod: &str, container: &str) -> LiveContainer {
        LiveContainer::of(pod, container, None)
    }

    /// Prepares `c`'s cache directory as an Allocate does; returns it.
    fn allocate(e: &Enforcer, c: &LiveContainer) -> std::path::PathBuf {
        let owner = CacheOwner {
            pod_uid: &c.uid,
            container: &c.container,
        };
        let p = e
            .for_allocate()
            .prepare(
                Some(crate::node::enforcement::Owner::Container(owner)),
                "GPU-a",
            )
            .unwrap();
        p.cache_dir.unwrap()
    }

    fn state(e: &Enforcer) -> SweeperState {
        SweeperState {
            args: SweeperArgs {
                enforcer: e.clone(),
                matcher: None,
                tick: Duration::from_secs(1),
                metrics: Arc::default(),
                readiness: Arc::default(),
            },
            library: None,
            unreadable: HashSet::new(),
            series: EnforcementSeries::default(),
        }
    }

    #[test]
    fn live_containers_keep_their_directories_and_report_their_memory() {
        let tmp = tempfile::tempdir().unwrap();
        let e = enforcer(tmp.path(), 0);
        let (a, b, gone) = (
            container("p", "a"),
            container("p", "b"),
            container("q", "c"),
        );
        let dir_a = allocate(&e, &a);
        let dir_b = allocate(&e, &b);
        let dir_gone = allocate(&e, &gone);
        std::fs::write(
            dir_a.join(crate::node::enforcement::plan::CACHE_FILE),
            region::tests::region((1, 2), &[("GPU-a", 1 << 30)], &[(1, &[5 << 20])]),
        )
        .unwrap();
        std::fs::write(
            dir_b.join(crate::node::enforcement::plan::CACHE_FILE),
            b"short",
        )
        .unwrap();

        // The matcher has not synced: nothing is removed, all are counted.
        let found = scan(&e, true, None);
        assert_eq!(found.library, None);
        assert_eq!(found.cache_dirs.ok(), Some(3));
        assert!(dir_gone.is_dir());

        let live = vec![a.clone(), b.clone(), container("r", "not-started")];
        let found = scan(&e, true, Some(live));
        assert_eq!(found.cache_dirs.ok(), Some(2));
        assert!(!dir_gone.exists() && dir_a.is_dir() && dir_b.is_dir());
        let mut s = state(&e);
        let rows = s.memory_used(found.regions);
        assert_eq!(
            rows,
            [ContainerMemory {
                at: ContainerLabels {
                    namespace: "ns".into(),
                    pod: "p".into(),
                    container: "a".into(),
                    gpu: "GPU-a".into(),
                    claim: String::new(),
                },
                bytes: 5 << 20,
            }]
        );
        assert_eq!(s.unreadable, HashSet::from([key_of(&b)]));
    }

    #[test]
    fn without_pod_matching_directories_go_by_age_and_the_library_is_checked() {
        let tmp = tempfile::tempdir().unwrap();
        let e = enforcer(tmp.path(), 3600);
        let dir = allocate(&e, &container("p", "a"));
        assert_eq!(scan(&e, false, None).cache_dirs.ok(), Some(1));
        assert!(dir.is_dir(), "a fresh directory was swept");
        // Made long ago.
        let old = SystemTime::now() - Duration::from_secs(7200);
        std::fs::File::open(&dir)
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert_eq!(scan(&e, false, None).cache_dirs.ok(), Some(0));
        assert!(!dir.exists());

        std::fs::remove_file(e.library_path()).unwrap();
        let why = scan(&e, false, None).library.unwrap();
        assert!(why.contains(&*e.library_path().to_string_lossy()), "{why}");
        let mut s = state(&e);
        assert!(s.report_library(Some(why.clone())));
        assert_eq!(
            s.args.readiness.held(),
            [format!("enforcement sweeper: {why}")]
        );
        // Every check finds it missing again; only the change is told.
        assert!(!s.report_library(Some(why.clone())));
        assert!(s.report_library(None));
        assert!(!s.report_library(None));
        assert!(s.args.readiness.held().is_empty());
    }
}
