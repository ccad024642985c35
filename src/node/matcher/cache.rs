//! The node-local pod cache: a watch on pods with `spec.nodeName` = this
//! node, reflected into a store, so an Allocate costs no LIST. When the
//! watch fails (the API server went away, or the resourceVersion it would
//! resume on expired) it lists again within about a second of the API
//! server answering ([`crate::net::kube_client::relisting`]), and until that
//! list is in the cache is stale: nothing decides on it.
//!
//! It keeps only what placement needs, so its memory and every lookup over
//! it stay flat in the number of finished pods (a node that ran thousands
//! of Job pods): a Succeeded or Failed pod leaves it (the kubelet released
//! its devices, so it holds nothing and is no candidate), and a live one is
//! stored [`lean`], without managed fields, status beyond its phase, or
//! container fields besides name, limits and restart policy.
//!
//! It also remembers, for the matcher, the pods deleted while still
//! Pending ([`PodCache::take_deleted`]): the kubelet may be admitting them;
//! and how each pod reached the node ([`Arrival`]): the kubelet admits pods
//! in the order its watch brings them, and a list after its watch broke
//! (an API server restart breaks this watch too) by creation time.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    Container, ContainerStatus, Pod, PodSpec, PodStatus, ResourceRequirements,
};
use kube::api::ObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::net::kube_client::{relisting, status_code};
use crate::rules::matching::pods::Arrival;
use crate::rules::usage::{finished, pending};

/// What the cache says before its first list is in.
const UNLISTED: &str = "the first list of this node's pods has not arrived";
/// Deletions kept for the matcher between its reads: a bound on what a
/// burst of deletes can make it hold, far above what one Allocate's wait
/// sees on one node.
const DELETIONS_KEPT: usize = 512;

/// Pending pods the watch saw deleted, with when and how each had
/// arrived, oldest first.
type Deletions = Arc<Mutex<VecDeque<(Instant, Arc<Pod>, Arrival)>>>;

/// How each cached pod arrived, by UID.
#[derive(Default)]
struct Arrivals {
    by_uid: HashMap<String, Arrival>,
    /// The last delivery's number.
    seq: u64,
    /// The list being read: its delivery, and the UIDs it holds.
    listing: Option<(Arrival, HashSet<String>)>,
    /// The first list is in: a list after it is a batch. The first one's
    /// pods came to the kubelet, already running, one at a time.
    listed: bool,
}

impl Arrivals {
    fn next(&mut self, batch: bool) -> Arrival {
        self.seq += 1;
        Arrival {
            seq: self.seq,
            batch,
        }
    }

    /// Notes `event`; a deleted pod's arrival.
    fn note(&mut self, event: &watcher::Event<Pod>) -> Option<Arrival> {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        let uid = |p: &Pod| p.metadata.uid.clone().unwrap_or_default();
        match event {
            Init => {
                let batch = self.next(self.listed);
                self.listing = Some((batch, HashSet::new()));
            }
            InitApply(p) => {
                if let Some((batch, uids)) = &mut self.listing {
                    let uid = uid(p);
                    self.by_uid.entry(uid.clone()).or_insert(*batch);
                    uids.insert(uid);
                }
            }
            InitDone => {
                if let Some((_, uids)) = self.listing.take() {
                    self.by_uid.retain(|u, _| uids.contains(u));
                }
                self.listed = true;
            }
            Apply(p) => {
                if !self.by_uid.contains_key(&uid(p)) {
                    let one = self.next(false);
                    self.by_uid.insert(uid(p), one);
                }
            }
            Delete(p) => return self.by_uid.remove(&uid(p)),
        }
        None
    }
}

pub(crate) struct PodCache {
    store: Store<Pod>,
    /// Bumped on every change of the store.
    changes: watch::Receiver<u64>,
    /// Why the store may be behind the API server (not listed yet, or the
    /// watch failed and the list after it has not arrived); None while it
    /// follows the API server.
    stale: watch::Receiver<Option<String>>,
    deleted: Deletions,
    arrivals: Arc<Mutex<Arrivals>>,
    task: JoinHandle<()>,
}

impl PodCache {
    pub(crate) fn start(client: Client, node: &str) -> PodCache {
        let api: Api<Pod> = Api::all(client);
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let (store, mut writer) = reflector::store();
        let (tx, changes) = watch::channel(0u64);
        let (mark, stale) = watch::channel(Some(UNLISTED.to_owned()));
        let events = relisting(api, config).filter_map(|e| std::future::ready(kept(e)));
        let deleted = Deletions::default();
        let deletions = deleted.clone();
        let arrivals: Arc<Mutex<Arrivals>> = Arc::default();
        let arrived = arrivals.clone();
        let task = tokio::spawn(async move {
            futures::pin_mut!(events);
            while let Some(event) = events.next().await {
                use watcher::Event::{Apply, Delete, InitDone};
                match event {
                    Ok(event) => {
                        let arrival = arrived.lock().expect("arrivals").note(&event);
                        if let Delete(pod) = &event
                            && pending(pod)
                        {
                            let mut list = deletions.lock().expect("deletions");
                            if list.len() == DELETIONS_KEPT {
                                list.pop_front();
                            }
                            let arrival = arrival.unwrap_or_default();
                            list.push_back((Instant::now(), Arc::new(pod.clone()), arrival));
                        }
                        writer.apply_watcher_event(&event);
                        if let InitDone = event
                            && mark.send_replace(None).is_some_and(|was| was != UNLISTED)
                        {
                            tracing::info!("pod cache listed again after its watch failed");
                        }
                        if let Apply(_) | Delete(_) | InitDone = event {
                            tx.send_modify(|n| *n += 1);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(code = ?status_code(&e), error = %e,
                            "pod watch failed; listing again");
                        mark.send_replace(Some(e.to_string()));
                    }
                }
            }
        });
        PodCache {
            store,
            changes,
            stale,
            deleted,
            arrivals,
            task,
        }
    }

    /// The Pending pods the watch saw deleted since the last call, with
    /// when and how each had arrived, oldest first (at most the last
    /// [`DELETIONS_KEPT`]).
    pub(crate) fn take_deleted(&self) -> Vec<(Instant, Arc<Pod>, Arrival)> {
        self.deleted.lock().expect("deletions").drain(..).collect()
    }

    /// How the pod of `uid` reached the node.
    pub(crate) fn arrival(&self, uid: &str) -> Arrival {
        let arrivals = self.arrivals.lock().expect("arrivals");
        arrivals.by_uid.get(uid).copied().unwrap_or_default()
    }

    /// The pods of `uids` as one batch after those before: a restarted
    /// kubelet's first list hands it every pod at once.
    pub(crate) fn rebatch<'a>(&self, uids: impl IntoIterator<Item = &'a str>) {
        let mut arrivals = self.arrivals.lock().expect("arrivals");
        let batch = arrivals.next(true);
        for uid in uids {
            if let Some(a) = arrivals.by_uid.get_mut(uid) {
                *a = batch;
            }
        }
    }

    pub(crate) fn pods(&self) -> Vec<Arc<Pod>> {
        self.store.state()
    }

    /// Waits until the cache follows the API server (its first list, or
    /// the list after a failed watch, is in), until `deadline`.
    pub(crate) async fn ready(&self, deadline: Instant) -> bool {
        let mut stale = self.stale.clone();
        let wait = stale.wait_for(Option::is_none);
        tokio::time::timeout_at(deadline.into(), wait)
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Resolves once the first full list is in, however long that takes.
    pub(crate) fn synced(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut stale = self.stale.clone();
        async move {
            let _ = stale.wait_for(Option::is_none).await;
        }
    }

    /// The store and a receiver told of each change: for readers besides
    /// the matcher, which see the cache but never wait on it.
    pub(crate) fn reader(&self) -> (Store<Pod>, watch::Receiver<u64>) {
        (self.store.clone(), self.changes.clone())
    }

    /// Why the cache is stale now, None while it follows the API server:
    /// for readiness. Its first value (not listed yet) counts as seen.
    pub(crate) fn stale(&self) -> watch::Receiver<Option<String>> {
        self.stale.clone()
    }

    /// Waits for the store to change, until `deadline`; false when it passed.
    pub(crate) async fn changed(&mut self, deadline: Instant) -> bool {
        tokio::time::timeout_at(deadline.into(), self.changes.changed())
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

/// `event` as the store should apply it: a pod that finished is deleted
/// from it (and never added by a relist); every pod is stored [`lean`].
fn kept(
    event: Result<watcher::Event<Pod>, watcher::Error>,
) -> Option<Result<watcher::Event<Pod>, watcher::Error>> {
    use watcher::Event::{Apply, Delete, InitApply};
    let kept = match event {
        Err(e) => return Some(Err(e)),
        Ok(Apply(p)) if finished(&p) => Delete(lean(p)),
        Ok(Apply(p)) => Apply(lean(p)),
        Ok(InitApply(p)) if finished(&p) => return None,
        Ok(InitApply(p)) => InitApply(lean(p)),
        Ok(Delete(p)) => Delete(lean(p)),
        Ok(other) => other,
    };
    Some(Ok(kept))
}

/// `pod` with only what the matcher reads ([`crate::rules::matching::pods::PodView`], the
/// live containers): identity, annotations but `kubectl`'s copy of the
/// whole object, times, resourceVersion; the node and the containers' names,
/// limits and restart policies; the phase and each container's runtime ID.
pub(crate) fn lean(pod: Pod) -> Pod {
    let Pod {
        metadata,
        spec,
        status,
        ..
    } = pod;
    let mut annotations = metadata.annotations;
    if let Some(a) = &mut annotations {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
    let container = |c: Container| Container {
        name: c.name,
        restart_policy: c.restart_policy,
        resources: c.resources.map(|r| ResourceRequirements {
            limits: r.limits,
            ..Default::default()
        }),
        ..Default::default()
    };
    Pod {
        metadata: ObjectMeta {
            name: metadata.name,
            namespace: metadata.namespace,
            uid: metadata.uid,
            resource_version: metadata.resource_version,
            creation_timestamp: metadata.creation_timestamp,
            deletion_timestamp: metadata.deletion_timestamp,
            annotations,
            ..Default::default()
        },
        spec: spec.map(|s| PodSpec {
            node_name: s.node_name,
            init_containers: s
                .init_containers
                .map(|cs| cs.into_iter().map(container).collect()),
            containers: s.containers.into_iter().map(container).collect(),
            ..Default::default()
        }),
        status: status.map(|s| {
            // Which runtime ID each container has: what usage maps a
            // process's cgroup back to.
            let ids = |cs: Option<Vec<ContainerStatus>>| {
                cs.map(|cs| {
                    cs.into_iter()
                        .map(|c| ContainerStatus {
                            name: c.name,
                            container_id: c.container_id,
                            ..Default::default()
                        })
                        .collect()
                })
            };
            PodStatus {
                phase: s.phase,
                container_statuses: ids(s.container_statuses),
                init_container_statuses: ids(s.init_container_statuses),
                ..Default::default()
            }
        }),
    }
}

impl Drop for PodCache {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::{ContainerStatus, EnvVar};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

    use super::*;

    #[test]
    fn a_pod_is_stored_with_only_what_matching_reads() {
        let limits: BTreeMap<String, Quantity> =
            [("doslab.io/gpu-memory".to_owned(), Quantity("4".into()))].into();
        let bulky = Container {
            name: "app".into(),
            image: Some("registry/some/image:tag".into()),
            env: Some(vec![EnvVar {
                name: "X".into(),
                value: Some("y".repeat(4096)),
                ..Default::default()
            }]),
            resources: Some(ResourceRequirements {
                limits: Some(limits.clone()),
                requests: Some(limits.clone()),
                ..Default::default()
            }),
            restart_policy: Some("Always".into()),
            ..Default::default()
        };
        let pod = Pod {
            metadata: ObjectMeta {
                name: Some("p".into()),
                namespace: Some("ns".into()),
                uid: Some("u".into()),
                resource_version: Some("7".into()),
                labels: Some([("app".to_owned(), "x".to_owned())].into()),
                annotations: Some(
                    [
                        ("doslab.io/gpu-ledger".to_owned(), "{}".to_owned()),
                        (
                            "kubectl.kubernetes.io/last-applied-configuration".to_owned(),
                            "z".repeat(8192),
                        ),
                    ]
                    .into(),
                ),
                managed_fields: Some(vec![ManagedFieldsEntry::default(); 8]),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("n".into()),
                init_containers: Some(vec![bulky.clone()]),
                containers: vec![bulky],
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                container_statuses: Some(vec![ContainerStatus::default(); 2]),
                ..Default::default()
            }),
        };
        let kept = lean(pod.clone());
        let size = |p: &Pod| serde_json::to_string(p).unwrap().len();
        assert!(
            size(&kept) < 600,
            "{}",
            serde_json::to_string(&kept).unwrap()
        );
        assert!(size(&pod) > 12_000);
        let meta = &kept.metadata;
        assert!(meta.managed_fields.is_none() && meta.labels.is_none());
        assert_eq!(
            meta.annotations
                .as_ref()
                .unwrap()
                .keys()
                .collect::<Vec<_>>(),
            ["doslab.io/gpu-ledger"]
        );
        assert_eq!(meta.resource_version.as_deref(), Some("7"));
        let spec = kept.spec.as_ref().unwrap();
        for c in spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
        {
            assert_eq!(c.resources.as_ref().unwrap().limits, Some(limits.clone()));
            assert_eq!(c.restart_policy.as_deref(), Some("Always"));
            assert!(c.image.is_none() && c.env.is_none());
        }
        // What the matcher reads of it is what it read of the whole pod.
        let keys = crate::rules::usage::Keys::new("doslab.io");
        let view = |p: &Pod| crate::rules::matching::pods::PodView::from_pod(&keys, p);
        assert_eq!(view(&kept), view(&pod));
        assert_eq!(kept.status.unwrap().phase.as_deref(), Some("Running"));
    }

    /// The API-server stand-in, reached through a kubeconfig file (so no
    /// type of this crate crosses to the copy of it gpu-sim links), and a
    /// one-container pod spec asking one gpu-memory device.
    async fn stand_in() -> (
        gpu_sim::apiserver::ApiServerSim,
        tempfile::TempDir,
        std::path::PathBuf,
        [gpu_sim::apiserver::PodContainer; 1],
    ) {
        let api = gpu_sim::apiserver::ApiServerSim::start().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let app = [gpu_sim::apiserver::PodContainer {
            name: "app".into(),
            init: false,
            restartable: false,
            wants: [1, 0, 0],
        }];
        (api, dir, kubeconfig, app)
    }

    /// Thousands of finished Job pods on the node: the cache holds the
    /// live ones only, whether they finished before it listed or after.
    #[tokio::test]
    async fn finished_pods_leave_the_cache() {
        let (api, _dir, kubeconfig, app) = stand_in().await;
        const DONE: usize = 3000;
        for i in 0..DONE {
            api.add_pod("jobs", &format!("done-{i}"), "n", &app, &[]);
            let phase = if i % 3 == 0 { "Failed" } else { "Succeeded" };
            api.set_phase("jobs", &format!("done-{i}"), phase);
        }
        for i in 0..5 {
            api.add_pod("ns", &format!("live-{i}"), "n", &app, &[]);
        }
        api.add_pod("ns", "elsewhere", "m", &app, &[]);
        let client = crate::net::kube_client::from_kubeconfig(&kubeconfig, "kubeconfig")
            .await
            .unwrap();
        let mut cache = PodCache::start(client, "n");
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        assert!(cache.ready(deadline).await);
        let names = |cache: &PodCache| {
            let mut v: Vec<String> = cache
                .pods()
                .iter()
                .map(|p| p.metadata.name.clone().unwrap_or_default())
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            names(&cache),
            ["live-0", "live-1", "live-2", "live-3", "live-4"]
        );

        // Live pods that finish leave it as the watch tells of them.
        api.set_phase("ns", "live-0", "Succeeded");
        api.set_phase("ns", "live-1", "Failed");
        api.set_phase("ns", "live-2", "Running");
        while names(&cache).len() > 3 {
            assert!(cache.changed(deadline).await, "{:?}", names(&cache));
        }
        assert_eq!(names(&cache), ["live-2", "live-3", "live-4"]);
        api.stop();
    }

    /// From a failed watch until the list after it the cache is stale and
    /// nothing waiting on it goes ahead; that list brings what changed
    /// meanwhile.
    #[tokio::test]
    async fn the_cache_is_stale_from_a_failed_watch_until_it_lists_again() {
        let (api, _dir, kubeconfig, app) = stand_in().await;
        api.add_pod("ns", "a", "n", &app, &[]);
        let client = crate::net::kube_client::from_kubeconfig(&kubeconfig, "kubeconfig")
            .await
            .unwrap();
        let cache = PodCache::start(client, "n");
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        assert!(cache.ready(deadline).await);
        let mut stale = cache.stale();
        assert!(stale.borrow_and_update().is_none());

        api.outage(true);
        let why = tokio::time::timeout_at(deadline.into(), stale.wait_for(Option::is_some))
            .await
            .expect("the watch never failed")
            .unwrap()
            .clone();
        assert!(why.is_some_and(|w| !w.is_empty()));
        let soon = Instant::now() + std::time::Duration::from_millis(300);
        assert!(!cache.ready(soon).await, "ready on a stale cache");
        api.add_pod("ns", "b", "n", &app, &[]);

        api.outage(false);
        let back = Instant::now();
        assert!(cache.ready(deadline).await);
        // Within the target of the API server answering again.
        assert!(back.elapsed() < std::time::Duration::from_secs(5));
        let mut names: Vec<_> = cache
            .pods()
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        names.sort();
        assert_eq!(names, ["a", "b"]);
        api.stop();
    }
}
