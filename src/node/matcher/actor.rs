//! The pod-matcher actor. It owns the API-server side (client, pod cache,
//! ledger writes) and answers one lookup at a time, so two Allocates on
//! different sockets can never claim the same container. A decision is
//! held as a reservation from the moment it is made until its ledger
//! write lands or fails: between them the caller readies the grant (in
//! its own task) and the write runs in a task of its own, whose result
//! comes back as a message, so the matcher serves other Allocates all the
//! while and none is decided onto the reservation. Writes to one pod go
//! one after another (each sees the last one's ledger); writes to
//! different pods overlap. Its Events are handed to `events`, which posts
//! them beside it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::watch;

use super::api::{
    KubeletId, LiveContainer, MatcherError, MatcherHandle, MatcherMsg, Recorded, Refusal, Reserved,
    Steer, UNSEEN_POD_WAIT,
};
use super::cache::PodCache;
use super::checkpoint::{self, Checkpointed, Crossing, Void};
use super::events::{Events, Why};
use super::report::Withdrawn;
use super::write::{self, Landed, Moved, Side, SwapError, Swapped, WriteError};
use crate::config::enforcement::Compute;
use crate::node::metrics::Metrics;
use crate::node::readiness::{Child, Hold, Readiness};
use crate::rules::matching::pods::{PodKey, PodView, runtime_ids};
use crate::rules::matching::{
    Ask, Decision, MatchError, decide, decide_with, deleting, record, usage,
};
use crate::rules::usage::{Inventory, Keys, Ledger, pending};

pub(crate) struct PodMatcher;

#[derive(Debug, Clone)]
pub(crate) struct MatcherArgs {
    pub(crate) node_name: String,
    /// This node's GPUs: what matching needs of the config and no more.
    pub(crate) node: Inventory,
    pub(crate) keys: Keys,
    pub(crate) wait: Duration,
    pub(crate) kubeconfig: PathBuf,
    /// The kubelet's device manager checkpoint, read when it restarts.
    pub(crate) kubelet_checkpoint: PathBuf,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) readiness: Arc<Readiness>,
    /// Where to publish the devices withdrawn from the kubelet's lists;
    /// None with `matcher.withdraw_exclusive = false`.
    pub(crate) withdrawals: Option<watch::Sender<Withdrawn>>,
    /// Shares are clients of their GPU's MPS server (`enforcement.compute`),
    /// which a fault in one client ends for all.
    pub(crate) mps: bool,
}

impl MatcherArgs {
    pub(crate) fn new(
        config: &crate::config::Config,
        gpus: &[crate::rules::device::Gpu],
        metrics: Arc<Metrics>,
        readiness: Arc<Readiness>,
        handle: &MatcherHandle,
    ) -> Self {
        MatcherArgs {
            node_name: config.node_name.clone(),
            node: Inventory::new(gpus, &config.offer()),
            keys: Keys::new(&config.resource_domain),
            wait: Duration::from_millis(config.matcher.wait_ms),
            kubeconfig: config.matcher.kubeconfig.clone(),
            kubelet_checkpoint: config.device_plugin_dir.join("kubelet_internal_checkpoint"),
            metrics,
            readiness,
            withdrawals: config
                .matcher
                .withdraw_exclusive
                .then(|| handle.withdrawals().clone()),
            mps: config.enforcement.compute() == Compute::Mps,
        }
    }

    /// What restarts a running matcher when a reload changes it. Left out:
    /// the metrics registry and the readiness marks, the supervisor's, the
    /// same across reloads;
    /// and the withdrawals channel, the supervisor's matcher handle's
    /// (only whether it is used is the config's). Taken apart field by
    /// field, so a field added here does not compile until it is sorted.
    pub(crate) fn restart_key(&self) -> impl PartialEq + '_ {
        let MatcherArgs {
            node_name,
            node,
            keys,
            wait,
            kubeconfig,
            kubelet_checkpoint,
            withdrawals,
            mps,
            metrics: _,
            readiness: _,
        } = self;
        (
            node_name,
            node,
            keys,
            wait,
            kubeconfig,
            kubelet_checkpoint,
            withdrawals.is_some(),
            mps,
        )
    }
}

pub(crate) struct MatcherState {
    /// Shared with the ledger writes in flight.
    args: Arc<MatcherArgs>,
    client: Client,
    cache: PodCache,
    /// Clears the matcher's unready mark once the pod cache has synced.
    synced: tokio::task::JoinHandle<()>,
    /// Keeps the per-GPU usage metrics current.
    report: tokio::task::JoinHandle<()>,
    /// Warning Events on pods it could not place, posted beside it.
    events: Events,
    /// Our writes by pod UID: the next Allocate may come before the watch
    /// event does.
    written: HashMap<String, Written>,
    /// Decisions handed out and not yet recorded or released, by ticket:
    /// every other decision counts them as served.
    reserved: HashMap<u64, Reservation>,
    /// The last ticket handed out.
    ticket: u64,
    /// Pods with a ledger write in flight, each with the records waiting
    /// for it to land (by ticket, with their callers' ports).
    writing: HashMap<String, VecDeque<(u64, RecordReply)>>,
    /// Lookups that found a repeat on a pod with a write in flight, by pod
    /// UID: decided again once its writes are done.
    deferred: HashMap<String, Vec<(Ask, Instant, DecideReply)>>,
    /// Pods deleted while the kubelet may be admitting them (the watch
    /// saw them go while Pending, or our write found them gone), by UID.
    /// The kubelet admits every pod it was sent before it stops it: their
    /// Allocates still come, and handed to the next pod of the same ask
    /// they would give it another's grant. So they stay candidates for
    /// `matcher.wait_ms` (until the kubelet restarts: a new one never saw
    /// them), holding nothing, their grants recorded here alone.
    deleted: HashMap<String, Deleted>,
    /// Grants of Pending pods that the last kubelet restart lost (it had
    /// not checkpointed them): left out of the pods' ledgers until the
    /// cache shows them served again.
    void: Void,
    /// The kubelet whose restart was last handled.
    kubelet: Option<KubeletId>,
    /// While a grant may have gone to another pod than the one it is
    /// recorded on: until when the kubelet's checkpoint is read, and the
    /// task reading it.
    crossings: Option<(watch::Sender<Instant>, tokio::task::JoinHandle<()>)>,
}

/// How long the kubelet's checkpoint is read after a grant that may have
/// gone to another pod is recorded: the kubelet writes it once the
/// container's every resource is allocated, moments after.
const CROSSINGS_WATCHED: Duration = Duration::from_secs(3);
/// How often it is read meanwhile.
const CHECKPOINT_READ: Duration = Duration::from_millis(100);

/// A pod deleted while the kubelet may be admitting it.
struct Deleted {
    view: PodView,
    since: Instant,
}

/// A decision its caller is readying (enforcement) before it is recorded.
struct Reservation {
    ask: Ask,
    decision: Decision,
    /// The caller's deadline: it has given up by then, whatever it got.
    expires: Instant,
    /// Its ledger write is in flight: it holds its place until the write's
    /// answer, whatever the deadline (the write may land).
    writing: bool,
    /// When its write started, another Pending pod asked the same of every
    /// container: the kubelet may have been admitting that one instead.
    crossable: bool,
}

/// Where a record's answer goes.
type RecordReply = RpcReplyPort<Result<Recorded, MatcherError>>;
/// Where a decision goes.
type DecideReply = RpcReplyPort<Result<Reserved, MatcherError>>;

#[derive(Default)]
struct Written {
    /// The pod's GPU records as our last swap wrote them: what a cached
    /// pod still at a version in `before` carries instead of its own.
    swapped: Option<write::Records>,
    ledger: Ledger,
    /// The resourceVersions our patches replaced, and the one the last one
    /// made: a cached pod still at an older one is really at `after`, so the
    /// next patch's precondition holds without a conflict and a re-read.
    before: HashSet<String>,
    after: String,
}

impl MatcherState {
    /// The pods as recorded: the cache, with our writes it has not shown
    /// yet; the pods deleted while Pending in place of what it holds of
    /// them.
    fn views(&mut self) -> Vec<PodView> {
        for (since, pod, arrival) in self.cache.take_deleted() {
            let mut view = self.view(&pod);
            view.arrival = arrival;
            self.bury(view, since);
        }
        let wait = self.args.wait;
        self.deleted.retain(|_, d| d.since.elapsed() < wait);
        let pods = self.cache.pods();
        let mut views = Vec::with_capacity(pods.len() + self.deleted.len());
        for pod in pods {
            let mut view = self.view(self.as_swapped(&pod).as_ref().unwrap_or(&pod));
            if self.deleted.contains_key(&view.uid) {
                continue;
            }
            view.arrival = self.cache.arrival(&view.uid);
            if let Some(void) = self.void.get_mut(&view.uid) {
                // Void until the cache shows what we wrote since.
                let written = self.written.get(&view.uid);
                void.retain(|(c, r)| {
                    let ids = |l: &Ledger| l.0.get(c).and_then(|g| g.ids.get(r)).cloned();
                    let again = written.and_then(|w| ids(&w.ledger));
                    let shown = again.is_some() && again == ids(&view.ledger);
                    if !shown {
                        view.ledger.void(c, *r);
                    }
                    !shown
                });
            }
            if let Some(w) = self.written.get(&view.uid) {
                view.ledger.merge(&w.ledger);
                if w.before.contains(&view.resource_version) {
                    view.resource_version.clone_from(&w.after);
                }
            }
            if pod.metadata.deletion_timestamp.is_some() {
                deleting(&mut view);
            }
            views.push(view);
        }
        for d in self.deleted.values() {
            let mut view = d.view.clone();
            view.live = false;
            if let Some(w) = self.written.get(&view.uid) {
                view.ledger.merge(&w.ledger);
            }
            views.push(view);
        }
        let live: HashSet<&str> = views.iter().map(|v| v.uid.as_str()).collect();
        self.written.retain(|uid, _| live.contains(uid.as_str()));
        self.void
            .retain(|uid, v| !v.is_empty() && live.contains(uid.as_str()));
        views
    }

    /// A new kubelet: the pods deleted before are no longer admitted, and
    /// the grants it had not checkpointed come again.
    async fn kubelet_restarted(&mut self, kubelet: KubeletId) {
        // Every plugin tells of the same restart.
        if self.kubelet.replace(kubelet) == Some(kubelet) {
            return;
        }
        self.cache.take_deleted();
        if !self.deleted.is_empty() {
            tracing::info!(
                pods = self.deleted.len(),
                "kubelet restarted; forgetting the pods deleted while Pending"
            );
            self.deleted.clear();
        }
        // Its first list hands it every pod at once, those it has yet to
        // admit among them, which it admits by creation time.
        let pods = self.cache.pods();
        let admitting = pods.iter().filter(|p| pending(p));
        self.cache
            .rebatch(admitting.filter_map(|p| p.metadata.uid.as_deref()));
        let kept = match checkpoint::read(&self.args.kubelet_checkpoint).await {
            Ok(kept) => kept,
            Err(e) => {
                tracing::warn!(error = %e, "kubelet restarted; taking every grant as kept");
                return;
            }
        };
        self.void.clear();
        let views = self.views();
        let void = checkpoint::void(&views, &self.args.keys, &checkpoint::kept(&kept));
        for (uid, grants) in &void {
            for (c, r) in grants {
                tracing::info!(%uid, container = %c, resource = %r,
                    "the restarted kubelet lost this grant; serving it again");
                if let Some(w) = self.written.get_mut(uid) {
                    w.ledger.void(c, *r);
                }
            }
        }
        self.void = void;
    }

    /// `pod` carrying the records our last swap wrote, if the cache shows
    /// it from before that.
    fn as_swapped(&self, pod: &Pod) -> Option<Pod> {
        let meta = &pod.metadata;
        let w = self.written.get(meta.uid.as_deref()?)?;
        let records = w.swapped.as_ref()?;
        if !w.before.contains(meta.resource_version.as_deref()?) {
            return None;
        }
        let mut pod = pod.clone();
        let annotations = pod.metadata.annotations.get_or_insert_default();
        for key in self.args.keys.pod_records() {
            annotations.remove(key);
        }
        annotations.extend(records.clone());
        Some(pod)
    }

    fn view(&self, pod: &Pod) -> PodView {
        let (view, warnings) = PodView::from_pod(&self.args.keys, pod);
        for w in warnings {
            tracing::debug!(pod = %view.key, warning = %w, "pod annotation");
        }
        view
    }

    /// Keeps `view`, of a pod deleted `since`, as a candidate the kubelet
    /// may yet admit, if it may be admitting it.
    fn bury(&mut self, view: PodView, since: Instant) {
        if view.admitting && !self.deleted.contains_key(&view.uid) {
            tracing::info!(pod = %view.key, "pod deleted while Pending; its Allocates may still come");
            self.deleted
                .insert(view.uid.clone(), Deleted { view, since });
        }
    }

    /// The pods as a new decision must see them: `recorded` with every
    /// live reservation on its pod's ledger, so no two callers are handed
    /// the same container or the same room on a GPU.
    fn reserving(&mut self, mut recorded: Vec<PodView>) -> Vec<PodView> {
        let now = Instant::now();
        self.reserved.retain(|_, r| r.writing || r.expires > now);
        for r in self.reserved.values() {
            if let Some(view) = recorded.iter_mut().find(|v| v.uid == r.decision.uid) {
                record(&mut view.ledger, &self.args.node, &r.ask, &r.decision);
            }
        }
        recorded
    }

    fn deciding(&mut self) -> Vec<PodView> {
        let recorded = self.views();
        self.reserving(recorded)
    }

    fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), namespace)
    }

    fn failure(&self, ask: &Ask, why: impl Into<Refusal>) -> MatcherError {
        let resource = ask.resource;
        MatcherError::Refused {
            node: self.args.node_name.clone(),
            amount: ask.devices * self.args.node.unit()[resource],
            resource,
            devices: ask.devices,
            why: why.into(),
        }
    }

    /// Finds the container and places it, by `caller` (the caller's
    /// deadline) at the latest, and holds the decision for the caller
    /// (none for a repeat: nothing to record).
    async fn decide(&mut self, ask: &Ask, caller: Instant) -> Result<Reserved, MatcherError> {
        let deadline = caller.min(Instant::now() + self.args.wait);
        if !self.cache.ready(deadline).await {
            return Err(self.failure(ask, Refusal::NotSynced(self.args.wait.as_millis())));
        }
        loop {
            let views = self.deciding();
            match decide(&self.args.node, &views, ask) {
                Ok(decision) if decision.repeat => {
                    self.log(ask, &decision);
                    return Ok(Reserved {
                        decision,
                        ticket: None,
                    });
                }
                Ok(decision) => {
                    self.ticket += 1;
                    let reservation = Reservation {
                        ask: ask.clone(),
                        decision: decision.clone(),
                        expires: caller,
                        writing: false,
                        crossable: false,
                    };
                    self.reserved.insert(self.ticket, reservation);
                    return Ok(Reserved {
                        decision,
                        ticket: Some(self.ticket),
                    });
                }
                Err(e) => {
                    // The pod may not have reached the cache yet.
                    if matches!(e, MatchError::NoCandidate { .. })
                        && self.cache.changed(deadline).await
                    {
                        continue;
                    }
                    let pod = e.pod().cloned();
                    let failure = self.failure(ask, e);
                    if let Some(pod) = &pod {
                        self.events
                            .warn(pod, Why::AllocateFailed, &failure.to_string());
                    }
                    return Err(failure);
                }
            }
        }
    }

    /// Records the reservation `ticket` on its pod's ledger, after the
    /// write in flight on the same pod if there is one.
    fn record(&mut self, myself: &ActorRef<MatcherMsg>, ticket: u64, reply: RecordReply) {
        let Some(r) = self.reserved.get(&ticket) else {
            let _ = reply.send(Ok(Recorded::Again));
            return;
        };
        match self.writing.get_mut(&r.decision.uid) {
            Some(queue) => queue.push_back((ticket, reply)),
            None => {
                let uid = r.decision.uid.clone();
                if self.start_write(myself, ticket, reply) {
                    self.writing.insert(uid, VecDeque::new());
                }
            }
        }
    }

    /// Starts the ledger write of the reservation `ticket` if the same
    /// lookup still decides the same: the pods may have changed while the
    /// caller readied it (gone, an assignment written, another pod now
    /// first), and then it must be decided again. The write runs in its
    /// own task and answers with [`MatcherMsg::Written`]. False when no
    /// write started (the caller was answered).
    fn start_write(
        &mut self,
        myself: &ActorRef<MatcherMsg>,
        ticket: u64,
        reply: RecordReply,
    ) -> bool {
        let Some(mut r) = self.reserved.remove(&ticket) else {
            let _ = reply.send(Ok(Recorded::Again));
            return false;
        };
        if r.expires <= Instant::now() || reply.is_closed() {
            let _ = reply.send(Ok(Recorded::Again));
            return false;
        }
        let mut recorded = self.views();
        let deciding = self.reserving(recorded.clone());
        if decide(&self.args.node, &deciding, &r.ask).as_ref() != Ok(&r.decision) {
            tracing::info!(pod = %r.decision.pod, "decision moved while being readied; deciding again");
            let _ = reply.send(Ok(Recorded::Again));
            return false;
        }
        let at = recorded
            .iter()
            .position(|v| v.uid == r.decision.uid)
            .expect("decided on it");
        let view = recorded.swap_remove(at);
        r.crossable = recorded
            .iter()
            .any(|o| o.admitting && !o.deleting && o.containers == view.containers);
        if self.deleted.contains_key(&view.uid) {
            // Nothing to write to: its grant is recorded here alone.
            let mut ledger = view.ledger;
            record(&mut ledger, &self.args.node, &r.ask, &r.decision);
            let written = Written {
                ledger,
                ..Written::default()
            };
            self.written.insert(view.uid, written);
            self.log(&r.ask, &r.decision);
            let _ = reply.send(Ok(Recorded::Done));
            return false;
        }
        let deadline = r.expires.min(Instant::now() + self.args.wait);
        let (api, args, myself) = (
            self.pods(&r.decision.pod.namespace),
            Arc::clone(&self.args),
            myself.clone(),
        );
        let (ask, decision) = (r.ask.clone(), r.decision.clone());
        r.writing = true;
        self.reserved.insert(ticket, r);
        tokio::spawn(async move {
            let landed = write::ledger(&api, &args, view, &ask, &decision, deadline).await;
            // A matcher stopped meanwhile drops the port: its caller reads
            // no answer, as from any matcher that stops mid-call.
            let _ = myself.cast(MatcherMsg::Written {
                ticket,
                landed,
                reply,
            });
        });
        true
    }

    /// The answer of the write of `ticket`: keeps what was written until
    /// the watch shows it (or that the pod is gone), answers its caller,
    /// and starts the next write waiting on the same pod.
    fn written(
        &mut self,
        myself: &ActorRef<MatcherMsg>,
        ticket: u64,
        landed: Result<Landed, WriteError>,
        reply: RecordReply,
    ) {
        let Some(r) = self.reserved.remove(&ticket) else {
            return;
        };
        let uid = r.decision.uid.clone();
        let answer = match landed {
            Ok(landed) => {
                let w = self.written.entry(uid.clone()).or_default();
                w.ledger = landed.ledger;
                w.before.insert(landed.replaced);
                w.after = landed.resource_version;
                self.log(&r.ask, &r.decision);
                if r.crossable {
                    self.watch_crossings(myself);
                }
                Ok(Recorded::Done)
            }
            Err(WriteError::Gone) => {
                // Decided again, onto the pod as deleted, or onto nothing
                // if it was no longer Pending.
                tracing::info!(pod = %r.decision.pod, "pod went away while being served");
                if let Some(pod) = self
                    .cache
                    .pods()
                    .into_iter()
                    .find(|p| p.metadata.uid.as_ref() == Some(&uid))
                {
                    self.bury(self.view(&pod), Instant::now());
                }
                Ok(Recorded::Again)
            }
            Err(WriteError::Unreachable(e)) => Err(self.failure(&r.ask, Refusal::ApiServer(e))),
        };
        if let Err(e) = &answer {
            tracing::warn!(error = %e, "not recorded");
        }
        let _ = reply.send(answer);
        self.next_write(myself, &uid);
    }

    /// Starts the next write waiting on pod `uid`, if any; else the pod has
    /// none in flight, and the lookups deferred until then are made again.
    fn next_write(&mut self, myself: &ActorRef<MatcherMsg>, uid: &str) {
        while let Some((next, reply)) = self.writing.get_mut(uid).and_then(VecDeque::pop_front) {
            if self.start_write(myself, next, reply) {
                return;
            }
        }
        self.writing.remove(uid);
        for (ask, deadline, reply) in self.deferred.remove(uid).unwrap_or_default() {
            let decide = MatcherMsg::Decide {
                ask,
                deadline,
                reply,
            };
            let _ = myself.send_message(decide);
        }
    }

    /// After a grant recorded on a pod the kubelet may have been admitting
    /// another of the same asks in the place of ([`Reservation::crossable`]:
    /// a batch, which the kubelet orders as it may, or pods the node's
    /// watch brought one at a time and the kubelet's list after a broken
    /// watch all at once): reads the kubelet's checkpoint for a while, each
    /// read sent back as [`MatcherMsg::Checkpoint`].
    fn watch_crossings(&mut self, myself: &ActorRef<MatcherMsg>) {
        let until = Instant::now() + CROSSINGS_WATCHED;
        if let Some((watched, task)) = &self.crossings
            && !task.is_finished()
        {
            watched.send_replace(until);
            return;
        }
        let (watched, until) = watch::channel(until);
        let path = self.args.kubelet_checkpoint.clone();
        let task = tokio::spawn(read_checkpoints(path, until, myself.clone()));
        self.crossings = Some((watched, task));
    }

    /// Swaps the GPU records of each pair of pods `held` shows crossed
    /// (neither with a write in flight: the next read judges those).
    fn checkpointed(&mut self, myself: &ActorRef<MatcherMsg>, held: &[Checkpointed]) {
        let views = self.views();
        for crossing in checkpoint::crossings(&views, &self.args.keys, held) {
            let uids = [&crossing.admitted, &crossing.recorded];
            if uids
                .iter()
                .any(|u| self.writing.contains_key(*u) || self.deleted.contains_key(*u))
            {
                continue;
            }
            let find = |uid: &str| views.iter().find(|v| v.uid == uid).cloned();
            let (Some(admitted), Some(recorded)) =
                (find(&crossing.admitted), find(&crossing.recorded))
            else {
                continue;
            };
            tracing::warn!(admitted = %admitted.key, recorded = %recorded.key,
                "the kubelet admitted one of two pods asking the same in the other's place; swapping their GPU records");
            for uid in uids {
                self.writing.insert(uid.clone(), VecDeque::new());
            }
            let deadline = Instant::now() + self.args.wait;
            let (args, myself) = (Arc::clone(&self.args), myself.clone());
            let (a, r) = (
                self.pods(&admitted.key.namespace),
                self.pods(&recorded.key.namespace),
            );
            tokio::spawn(async move {
                let admitted = Side {
                    api: a,
                    view: &admitted,
                };
                let recorded = Side {
                    api: r,
                    view: &recorded,
                };
                let pods = [admitted.view.key.clone(), recorded.view.key.clone()];
                let swapped = write::swap(&args, admitted, recorded, deadline).await;
                let swapped = MatcherMsg::Swapped {
                    crossing,
                    pods,
                    swapped,
                };
                let _ = myself.cast(swapped);
            });
        }
    }

    /// The end of the swap of `crossing`'s records: keeps what was written
    /// until the watch shows it, and starts the writes waiting on them.
    fn swap_ended(
        &mut self,
        myself: &ActorRef<MatcherMsg>,
        crossing: Crossing,
        [admitted_pod, recorded_pod]: [PodKey; 2],
        swapped: Result<Swapped, SwapError>,
    ) {
        match swapped {
            Ok(Swapped { admitted, recorded }) => {
                self.moved(&crossing.admitted, admitted);
                match recorded {
                    Ok(moved) => {
                        self.moved(&crossing.recorded, moved);
                        for (pod, other) in [
                            (&admitted_pod, &recorded_pod),
                            (&recorded_pod, &admitted_pod),
                        ] {
                            let note = format!(
                                "the kubelet admitted {admitted_pod} in the place of {recorded_pod}, \
                                 which asks the same: the GPU records of this pod and {other} \
                                 (assignment, ledger) were swapped to match what each got"
                            );
                            self.events.warn(pod, Why::RecordsSwapped, &note);
                        }
                    }
                    // Both carry its records: its grant counts twice
                    // (never past a GPU's room), and its own Allocates
                    // find nothing left to serve.
                    Err(e) => tracing::error!(pod = %crossing.recorded, error = ?e,
                        "half of a records swap did not land"),
                }
            }
            Err(e) => tracing::info!(admitted = %crossing.admitted, recorded = %crossing.recorded,
                error = ?e, "records not swapped"),
        }
        self.next_write(myself, &crossing.admitted);
        self.next_write(myself, &crossing.recorded);
    }

    /// Keeps the records a swap wrote on pod `uid`.
    fn moved(&mut self, uid: &str, moved: Moved) {
        let ledger = moved
            .records
            .get(&self.args.keys.ledger)
            .and_then(|text| serde_json::from_str(text).ok())
            .unwrap_or_default();
        let w = self.written.entry(uid.to_owned()).or_default();
        w.ledger = ledger;
        w.swapped = Some(moved.records);
        w.before.insert(moved.replaced);
        w.after = moved.resource_version;
    }

    /// Says what an Allocate was matched to.
    fn log(&self, ask: &Ask, d: &Decision) {
        tracing::info!(
            pod = %d.pod,
            container = %d.container,
            resource = %ask.resource,
            amount = d.amount,
            gpus = ?d.gpus.iter().map(|&g| &self.args.node.gpus[g].uuid).collect::<Vec<_>>(),
            repeat = d.repeat,
            "matched"
        );
    }

    async fn prefer(&mut self, ask: &Ask, caller: Instant) -> Steer {
        // Waiting a little for a pod the cache has not seen keeps an
        // assigned pod's IDs on its GPU.
        let deadline = caller.min(Instant::now() + UNSEEN_POD_WAIT);
        let (views, usage, decided) = loop {
            let views = self.deciding();
            let usage = usage(&self.args.node, &views);
            match decide_with(&self.args.node, &views, &usage, ask) {
                Err(MatchError::NoCandidate { .. }) if self.cache.changed(deadline).await => {}
                d => break (views, usage, d.ok()),
            }
        };
        let inv = &self.args.node;
        let assigned = decided.as_ref().is_some_and(|d| {
            views
                .iter()
                .any(|v| v.uid == d.uid && v.assignment.0.contains_key(&d.container))
        });
        // A container asking whole GPUs has its GPUs fixed once one of its
        // resources is served: the rest follow them, and its own whole GPUs
        // are no GPUs to keep its share off.
        let fixed = assigned
            || decided
                .as_ref()
                .is_some_and(|d| d.whole && !d.gpus.is_empty());
        match decided {
            // The extender's (or the container's own) GPUs and no others:
            // the kubelet takes a hint for each GPU it is not told to avoid.
            Some(d) if fixed => Steer {
                avoid: (0..inv.gpus.len()).map(|g| !d.gpus.contains(&g)).collect(),
                gpus: d.gpus,
            },
            d => Steer {
                gpus: d.map(|d| d.gpus).unwrap_or_default(),
                avoid: usage.avoid(inv, ask.resource),
            },
        }
    }

    /// Every container of the cached pods, once the cache has synced.
    async fn live(&self) -> Option<Vec<LiveContainer>> {
        if !self.cache.ready(Instant::now()).await {
            return None;
        }
        let mut live = Vec::new();
        for pod in self.cache.pods() {
            let (meta, Some(spec)) = (&pod.metadata, pod.spec.as_ref()) else {
                continue;
            };
            let key = PodKey {
                namespace: meta.namespace.clone().unwrap_or_default(),
                name: meta.name.clone().unwrap_or_default(),
            };
            let uid = meta.uid.clone().unwrap_or_default();
            let ids = runtime_ids(pod.status.as_ref());
            let inits = spec.init_containers.iter().flatten();
            for c in inits.chain(&spec.containers) {
                live.push(LiveContainer {
                    pod: key.clone(),
                    uid: uid.clone(),
                    container: c.name.clone(),
                    id: ids.get(c.name.as_str()).map(|id| (*id).to_owned()),
                });
            }
        }
        Some(live)
    }
}

impl Actor for PodMatcher {
    type Msg = MatcherMsg;
    type State = MatcherState;
    type Arguments = MatcherArgs;

    async fn pre_start(
        &self,
        _: ActorRef<MatcherMsg>,
        args: MatcherArgs,
    ) -> Result<MatcherState, ActorProcessingErr> {
        let client =
            crate::net::kube_client::from_kubeconfig(&args.kubeconfig, "matcher.kubeconfig")
                .await?;
        let cache = PodCache::start(client.clone(), &args.node_name);
        tracing::info!(node = %args.node_name, "pod matcher watching this node's pods");
        let (sync, readiness) = (cache.synced(), args.readiness.clone());
        let synced = tokio::spawn(async move {
            sync.await;
            tracing::info!("pod cache synced with the API server");
            readiness.hold(Child::Matcher, Hold::Waiting, None);
        });
        let report = super::report::spawn(&cache, &args);
        let events = Events::start(client.clone(), &args.node_name);
        Ok(MatcherState {
            args: Arc::new(args),
            client,
            cache,
            synced,
            report,
            events,
            written: HashMap::new(),
            reserved: HashMap::new(),
            ticket: 0,
            writing: HashMap::new(),
            deferred: HashMap::new(),
            deleted: HashMap::new(),
            void: Void::new(),
            kubelet: None,
            crossings: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<MatcherMsg>,
        msg: MatcherMsg,
        state: &mut MatcherState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            // A caller that has gone (timed out, or its RPC was cancelled)
            // reads no answer: serving it would record a grant no container
            // gets.
            MatcherMsg::Decide { ask, reply, .. } if reply.is_closed() => {
                tracing::info!(resource = %ask.resource, "skipping an Allocate whose caller has gone");
            }
            MatcherMsg::Record { ticket, reply } if reply.is_closed() => {
                state.reserved.remove(&ticket);
            }
            MatcherMsg::Prefer { reply, .. } if reply.is_closed() => {}
            MatcherMsg::Decide {
                ask,
                deadline,
                reply,
            } => match state.decide(&ask, deadline).await {
                // A repeat read off a ledger write still in flight: the
                // write may yet fail, so the answer waits for it.
                Ok(Reserved {
                    decision,
                    ticket: None,
                }) if state.writing.contains_key(&decision.uid) => {
                    let deferred = state.deferred.entry(decision.uid).or_default();
                    deferred.push((ask, deadline, reply));
                }
                result => {
                    if let Err(e) = &result {
                        tracing::warn!(error = %e, "no match");
                    }
                    // The plugin may have timed out; the reservation expires.
                    let _ = reply.send(result);
                }
            },
            MatcherMsg::Record { ticket, reply } => state.record(&myself, ticket, reply),
            MatcherMsg::Written {
                ticket,
                landed,
                reply,
            } => state.written(&myself, ticket, landed, reply),
            // A write in flight holds its place until its answer: it may
            // land after its caller gave up.
            MatcherMsg::Release { ticket } => {
                if state.reserved.get(&ticket).is_some_and(|r| !r.writing) {
                    state.reserved.remove(&ticket);
                }
            }
            MatcherMsg::Warn { pod, note } => state.events.warn(&pod, Why::AllocateFailed, &note),
            MatcherMsg::Fault { fault } => {
                let views = state.views();
                let notices =
                    super::faults::notices(&state.args.node, &views, &fault, state.args.mps);
                for (pod, why, note) in notices {
                    tracing::info!(%pod, uuid = %fault.uuid, xid = %fault.xid, "telling a pod of its GPU's fault");
                    state.events.warn(&pod, why, &note);
                }
            }
            MatcherMsg::KubeletRestarted { kubelet } => state.kubelet_restarted(kubelet).await,
            MatcherMsg::Prefer {
                ask,
                deadline,
                reply,
            } => {
                let _ = reply.send(state.prefer(&ask, deadline).await);
            }
            MatcherMsg::Live { reply } => {
                let _ = reply.send(state.live().await);
            }
            MatcherMsg::Checkpoint { held } => state.checkpointed(&myself, &held),
            MatcherMsg::Swapped {
                crossing,
                pods,
                swapped,
            } => state.swap_ended(&myself, crossing, pods, swapped),
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<MatcherMsg>,
        state: &mut MatcherState,
    ) -> Result<(), ActorProcessingErr> {
        // A successor's cache is not ours: this one must not mark it synced.
        state.synced.abort();
        if let Some((_, task)) = &state.crossings {
            task.abort();
        }
        // Without a matcher there is no usage to show, rather than a stale one.
        state.report.abort();
        state.args.metrics.set_gpus(Vec::new());
        state.args.metrics.set_grants(Vec::new());
        // Nor withdrawals nobody keeps current: every device the GPUs'
        // health allows goes back on the kubelet's lists.
        if let Some(tx) = &state.args.withdrawals {
            super::report::publish(tx, Withdrawn::default());
        }
        Ok(())
    }
}

/// Reads the kubelet's checkpoint at `path` every [`CHECKPOINT_READ`] until
/// `until`, each read sent to `matcher`.
async fn read_checkpoints(
    path: PathBuf,
    until: watch::Receiver<Instant>,
    matcher: ActorRef<MatcherMsg>,
) {
    while Instant::now() < *until.borrow() {
        match checkpoint::read(&path).await {
            Ok(held) => {
                if matcher.cast(MatcherMsg::Checkpoint { held }).is_err() {
                    return;
                }
            }
            Err(e) => tracing::debug!(error = %e, "cannot read the kubelet's checkpoint"),
        }
        tokio::time::sleep(CHECKPOINT_READ).await;
    }
}
