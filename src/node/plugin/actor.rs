//! The plugin actor: serve first, then register (the kubelet dials back
//! inside Register), retry registration with backoff, heal on `Check`, and
//! on stop send an empty list, end the stream, stop the server and remove
//! the socket.
//!
//! `Check` is idempotent, so the kubelet watcher can send it on every
//! filesystem event and on a timer: it restarts the server when the socket
//! was removed or replaced, or when the kubelet restarted or dropped the
//! stream since we registered, and registers at once when a kubelet
//! appears.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use super::codec::DeviceListMessage;
use super::placement::Placement;
use super::registration::{RegisterError, register};
use super::service::{DevicePluginService, StreamItem};
use crate::api::lazy::device_plugin_server::DevicePluginServer;
use crate::config::Config;
use crate::node::enforcement::Enforcer;
use crate::node::grant::ResponseComposer;
use crate::node::metrics::{Metrics, ResourceMetrics};
use crate::rules::device::{DeviceModel, Resource};

/// GetPreferredAllocation lists every free ID: hundreds of thousands of
/// them must fit in one request.
const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;
/// How long a stopping server may take to finish its calls.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// The kubelet opens ListAndWatch as part of Register; a registration this
/// old without an open stream means the kubelet dropped us.
const STREAM_GRACE: Duration = Duration::from_secs(3);
/// Pause between ending a stream a live kubelet still holds and registering
/// again: the kubelet must handle the old stream's end first, or it drops
/// the new registration (kubernetes#121994). We cannot see when it has, so
/// we give it time; a lost race is still healed by `Check`.
pub(crate) const SETTLE: Duration = Duration::from_millis(200);

pub(crate) struct PluginActor;

/// Everything a plugin needs.
#[derive(Debug, Clone)]
pub(crate) struct PluginArgs {
    pub(crate) model: Arc<DeviceModel>,
    pub(crate) resource_name: String,
    pub(crate) endpoint: String,
    pub(crate) socket: PathBuf,
    pub(crate) kubelet_socket: PathBuf,
    pub(crate) composer: Arc<ResponseComposer>,
    pub(crate) placement: Placement,
    /// Caps shared grants; None with enforcement off.
    pub(crate) enforcer: Option<Enforcer>,
    pub(crate) healthy: Arc<[bool]>,
    pub(crate) metrics: Arc<ResourceMetrics>,
    /// Set when a predecessor's stream ended just now (a reload): no
    /// registration before this instant with the same kubelet (see SETTLE).
    pub(crate) settle_until: Option<Instant>,
}

impl PluginArgs {
    pub(crate) fn new(
        config: &Config,
        model: Arc<DeviceModel>,
        placement: Placement,
        healthy: Arc<[bool]>,
        metrics: &Metrics,
    ) -> Self {
        let r = model.resource();
        let endpoint = config.endpoint(r);
        let resource_name = config.resource_name(r);
        PluginArgs {
            metrics: metrics.resource(&resource_name),
            resource_name,
            socket: config.device_plugin_dir.join(&endpoint),
            endpoint,
            kubelet_socket: config.kubelet_socket(),
            composer: Arc::new(ResponseComposer::new(config)),
            model,
            placement,
            enforcer: Enforcer::new(&config.enforcement),
            healthy,
            settle_until: None,
        }
    }

    /// What restarts a running plugin when a reload changes it. Left out:
    /// placement and health, pushed to the running plugin; its metrics,
    /// looked up by resource name; the settle instant, set at its start.
    /// Taken apart field by field, so a field added here does not compile
    /// until it is sorted.
    pub(crate) fn restart_key(&self) -> impl PartialEq + '_ {
        let PluginArgs {
            model,
            resource_name,
            endpoint,
            socket,
            kubelet_socket,
            composer,
            enforcer,
            placement: _,
            healthy: _,
            metrics: _,
            settle_until: _,
        } = self;
        (
            model,
            resource_name,
            endpoint,
            socket,
            kubelet_socket,
            composer,
            enforcer,
        )
    }
}

/// What the plugin is told. Only `SetPlacement` is answered; the others
/// are sent and forgotten.
pub(crate) enum PluginMsg {
    /// Register the server of `generation` with the kubelet, unless that
    /// server was replaced since, a registration is under way or done, the
    /// settle pause of a restart is not over, or this is an early trigger
    /// inside the backoff window. Sent by the plugin itself (at start, on
    /// `Check`, and as the scheduled retry). The outcome comes back as
    /// `Registered`.
    Register {
        /// The server this attempt is for (bumped on every server start).
        generation: u64,
        /// The retry this is, scheduled for that instant; None: at once,
        /// on start or on a trigger.
        scheduled: Option<Instant>,
    },
    /// The outcome of a registration attempt, from the task that made it:
    /// on success the plugin counts itself registered, on failure it
    /// schedules the next `Register` on its backoff. Ignored when the
    /// server was replaced since.
    Registered {
        /// The server the attempt was for.
        generation: u64,
        /// The kubelet socket it registered with (default when none was
        /// there).
        kubelet: FileId,
        result: Result<(), RegisterError>,
    },
    /// Verify socket, kubelet and stream, and heal what is wrong (restart
    /// the server, register again). Idempotent: the kubelet watcher sends
    /// it on every filesystem event and on a timer.
    Check,
    /// Pod matching was switched on or off, or its wait changed. The
    /// plugin's server uses `placement` from its next call on, and the
    /// plugin follows the matcher's withdrawals while it uses the matcher.
    SetPlacement {
        placement: Placement,
        /// Answered once the server uses `placement`.
        reply: RpcReplyPort<()>,
    },
    /// The GPUs' health changed: the plugin streams the new list.
    SetHealth {
        /// Per GPU of the model, whether it passes its health checks.
        healthy: Arc<[bool]>,
    },
    /// The matcher's withdrawals changed: the plugin streams the new list.
    /// Ignored once placement no longer uses the matcher.
    SetWithdrawn {
        /// Per GPU: whether the matcher withdraws this resource's devices
        /// (empty: none).
        withdrawn: Arc<[bool]>,
    },
}

/// The ListAndWatch streams open now. The kubelet never reconnects a
/// stream it dropped, so the plugin heals from this count (`Check`); the
/// metrics and `/readyz` read it. Each stream holds a [`StreamGuard`] for
/// its life.
#[derive(Debug, Clone, Default)]
pub(crate) struct OpenStreams(Arc<AtomicUsize>);

impl OpenStreams {
    pub(crate) fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// Counts one more stream open until the guard drops.
    pub(crate) fn guard(&self) -> StreamGuard {
        self.0.fetch_add(1, Ordering::SeqCst);
        StreamGuard(self.0.clone())
    }
}

/// Held by a stream for its life.
pub(crate) struct StreamGuard(Arc<AtomicUsize>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

struct Server {
    lists: watch::Sender<StreamItem>,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
    socket_id: FileId,
}

pub(crate) struct PluginState {
    args: PluginArgs,
    /// Every server's service reads the placement from here, per call.
    placement: watch::Sender<Placement>,
    server: Option<Server>,
    /// Bumped on every server start: outcomes of older attempts are ignored.
    generation: u64,
    registering: bool,
    /// The kubelet socket we registered with, and when.
    registered: Option<(FileId, Instant)>,
    /// No registration before this instant while the kubelet socket is
    /// still the one that held our old stream (see SETTLE); a new kubelet is
    /// registered at once.
    settle: Option<(Instant, Option<FileId>)>,
    retry: Retry,
    /// Per GPU: devices the matcher withdraws while the GPU's exclusivity
    /// holds (empty: none); listed unhealthy, whatever the GPU's health.
    withdrawn: Arc<[bool]>,
    /// Forwards the matcher's withdrawals while placement uses it.
    follower: Option<JoinHandle<()>>,
    /// The streams every server of this plugin opened, still open.
    streams: OpenStreams,
}

impl PluginState {
    fn resource(&self) -> Resource {
        self.args.model.resource()
    }

    /// The current list, with the device gauges brought up to date: a
    /// GPU's devices are listed healthy when it is and they are not
    /// withdrawn.
    fn list(&self) -> DeviceListMessage {
        let healthy = (self.args.healthy.iter().enumerate())
            .map(|(g, &h)| h && !self.withdrawn.get(g).copied().unwrap_or(false))
            .collect();
        let list = DeviceListMessage::new(self.args.model.clone(), healthy);
        self.args
            .metrics
            .set_devices(list.device_count(), list.healthy_count());
        list
    }

    fn set_registered(&mut self, registered: Option<(FileId, Instant)>) {
        self.registered = registered;
        self.args.metrics.set_registered(registered.is_some());
    }

    /// Pod matching was switched on or off, or its wait changed.
    fn set_placement(&mut self, myself: &ActorRef<PluginMsg>, placement: Placement) {
        tracing::info!(resource = %self.resource(), ?placement, "placement changed");
        self.args.placement = placement.clone();
        self.placement.send_replace(placement);
        self.follow(myself);
    }

    /// Follows the withdrawals of the matcher the placement uses, or, with
    /// none, withdraws nothing.
    fn follow(&mut self, myself: &ActorRef<PluginMsg>) {
        if let Some(old) = self.follower.take() {
            old.abort();
        }
        let Placement::Matcher { handle, .. } = &self.args.placement else {
            self.set_withdrawn(Arc::new([]));
            return;
        };
        let (mut rx, myself, r) = (handle.follow_withdrawals(), myself.clone(), self.resource());
        self.follower = Some(tokio::spawn(async move {
            loop {
                let mask = rx.borrow_and_update()[r].clone();
                let msg = PluginMsg::SetWithdrawn { withdrawn: mask };
                if myself.send_message(msg).is_err() {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        }));
    }

    /// Streams the new list when the GPUs' health changed.
    fn set_health(&mut self, healthy: Arc<[bool]>) {
        if healthy.len() != self.args.model.gpus().len() || healthy == self.args.healthy {
            return;
        }
        self.args.healthy = healthy;
        self.stream("device health changed");
    }

    /// Streams the new list when the matcher's withdrawals changed.
    fn set_withdrawn(&mut self, withdrawn: Arc<[bool]>) {
        if withdrawn == self.withdrawn {
            return;
        }
        self.withdrawn = withdrawn;
        self.stream("devices withdrawn or given back");
    }

    /// Sends the current list down the open stream, saying `why`.
    fn stream(&self, why: &str) {
        let list = self.list();
        tracing::info!(
            resource = %self.resource(),
            healthy = list.healthy_count(),
            devices = list.device_count(),
            "{why}"
        );
        if let Some(server) = &self.server {
            server.lists.send_replace(StreamItem { list, last: false });
        }
    }
}

/// Which file a path names now. The inode alone is not enough: a socket
/// deleted and created again (a restarted kubelet) often gets the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct FileId {
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

impl FileId {
    fn key(self) -> (u64, i64, i64) {
        (self.ino, self.ctime, self.ctime_nsec)
    }
}

fn file_id(path: &Path) -> Option<FileId> {
    std::fs::metadata(path).ok().map(|m| FileId {
        ino: m.ino(),
        ctime: m.ctime(),
        ctime_nsec: m.ctime_nsec(),
    })
}

/// 100 ms, 200 ms, … capped at 2 s: a kubelet that appears is found fast,
/// one that is gone costs a few wake-ups a second at most.
fn backoff(failed_attempts: u32) -> Duration {
    Duration::from_millis(100u64 << failed_attempts.min(5)).min(Duration::from_secs(2))
}

/// When to register again after failures: on time, not per trigger. A
/// filesystem event or check may try once early within the current backoff
/// window; only a failure once the window is over (the scheduled retry)
/// makes the next window longer. A burst of events (a `kubelet.sock` that
/// appears before the kubelet listens) so costs one extra attempt at most.
#[derive(Debug, Default)]
struct Retry {
    /// Windows that ended in a failure, in a row.
    failures: u32,
    /// When the scheduled retry is due; None: no failure since the last
    /// success or server start.
    due: Option<Instant>,
    /// A trigger already tried early in this window.
    tried_early: bool,
}

impl Retry {
    /// Whether a trigger at `now` may try now.
    fn early(&mut self, now: Instant) -> bool {
        match self.due {
            Some(due) if now < due => !std::mem::replace(&mut self.tried_early, true),
            _ => true,
        }
    }

    /// An attempt failed at `now`: the delay to the next scheduled retry,
    /// or None when it was an early one and the scheduled retry stands.
    fn failed(&mut self, now: Instant) -> Option<Duration> {
        if self.due.is_some_and(|due| now < due) {
            return None;
        }
        let delay = backoff(self.failures);
        self.failures += 1;
        self.due = Some(now + delay);
        self.tried_early = false;
        Some(delay)
    }
}

impl PluginActor {
    fn start_server(state: &PluginState) -> Result<Server, ActorProcessingErr> {
        let args = &state.args;
        let (lists, rx) = watch::channel(StreamItem {
            list: state.list(),
            last: false,
        });
        let incoming = crate::net::uds::bind(&args.socket)
            .map_err(|e| format!("cannot listen on {}: {e}", args.socket.display()))?;
        let socket_id = file_id(&args.socket).unwrap_or_default();
        let service = DevicePluginService::new(
            args.model.clone(),
            args.composer.clone(),
            rx,
            state.placement.subscribe(),
            args.enforcer.clone(),
            args.metrics.clone(),
            state.streams.clone(),
        );
        let routes = tonic::service::Routes::new(
            DevicePluginServer::new(service).max_decoding_message_size(MAX_REQUEST_BYTES),
        );
        let (stop, stop_rx) = oneshot::channel::<()>();
        let resource = args.model.resource();
        let task = tokio::spawn(async move {
            let stopped = async {
                let _ = stop_rx.await;
            };
            if let Err(e) = crate::net::uds::serve(routes, incoming, stopped).await {
                tracing::error!(%resource, error = %e, "gRPC server failed");
            }
        });
        tracing::info!(
            %resource,
            socket = %args.socket.display(),
            devices = args.model.device_count(),
            "serving"
        );
        Ok(Server {
            lists,
            stop,
            task,
            socket_id,
        })
    }

    /// Ends the stream with `last`, stops the server, removes the socket if
    /// it is still ours.
    async fn stop_server(state: &mut PluginState, last: DeviceListMessage) {
        let Some(server) = state.server.take() else {
            return;
        };
        let resource = state.resource();
        server.lists.send_replace(StreamItem {
            list: last,
            last: true,
        });
        let _ = server.stop.send(());
        let mut task = server.task;
        if tokio::time::timeout(STOP_GRACE, &mut task).await.is_err() {
            tracing::warn!(%resource, "server did not stop in time; aborting it");
            task.abort();
        }
        if file_id(&state.args.socket) == Some(server.socket_id)
            && let Err(e) = std::fs::remove_file(&state.args.socket)
        {
            tracing::warn!(%resource, error = %e, "cannot remove socket");
        }
    }

    /// A new server and a new registration, the old stream ended first
    /// (kubernetes#121994); with `settle`, registering again with the same
    /// kubelet waits SETTLE (a new kubelet never saw the old stream).
    async fn restart(
        myself: &ActorRef<PluginMsg>,
        state: &mut PluginState,
        reason: &str,
        settle: bool,
    ) -> Result<(), ActorProcessingErr> {
        tracing::info!(resource = %state.resource(), %reason, "restarting server and re-registering");
        let held_by = state.registered.map(|(id, _)| id);
        let list = state.list();
        Self::stop_server(state, list).await;
        state.server = Some(Self::start_server(state)?);
        state.generation += 1;
        state.registering = false;
        state.set_registered(None);
        state.retry = Retry::default();
        let until = (settle && held_by.is_some()).then(|| Instant::now() + SETTLE);
        Self::first_registration(myself, state, until, held_by)
    }

    /// Registers the current server at once, or with `settle_until` once
    /// that has passed, unless the kubelet is no longer `held_by` then.
    fn first_registration(
        myself: &ActorRef<PluginMsg>,
        state: &mut PluginState,
        settle_until: Option<Instant>,
        held_by: Option<FileId>,
    ) -> Result<(), ActorProcessingErr> {
        let generation = state.generation;
        match settle_until {
            Some(until) => {
                let wait = until.saturating_duration_since(Instant::now());
                tracing::info!(
                    resource = %state.resource(),
                    settle_ms = wait.as_millis() as u64,
                    "settling before registering: the kubelet must drop the old stream first"
                );
                state.settle = Some((until, held_by));
                myself.send_after(wait, move || PluginMsg::Register {
                    generation,
                    scheduled: None,
                });
            }
            None => myself.send_message(PluginMsg::Register {
                generation,
                scheduled: None,
            })?,
        }
        Ok(())
    }

    /// Registers generation `generation` unless it is stale, already under
    /// way or done, settling, or an early trigger inside the backoff window.
    fn on_register(
        myself: &ActorRef<PluginMsg>,
        state: &mut PluginState,
        generation: u64,
        scheduled: Option<Instant>,
    ) -> Result<(), ActorProcessingErr> {
        if generation != state.generation || state.registering || state.registered.is_some() {
            return Ok(());
        }
        let kubelet = state.args.kubelet_socket.clone();
        if let Some((until, held_by)) = state.settle {
            if Instant::now() < until && file_id(&kubelet) == held_by {
                return Ok(()); // the deferred attempt comes at `until`
            }
            state.settle = None;
        }
        let on_time = match scheduled {
            // A retry of a window that has since been replaced.
            Some(due) => state.retry.due == Some(due),
            None => state.retry.early(Instant::now()),
        };
        if !on_time {
            return Ok(());
        }
        let Some(kubelet_id) = file_id(&kubelet) else {
            let err = RegisterError::NoKubelet(kubelet.display().to_string());
            myself.send_message(PluginMsg::Registered {
                generation,
                kubelet: FileId::default(),
                result: Err(err),
            })?;
            return Ok(());
        };
        state.registering = true;
        let endpoint = state.args.endpoint.clone();
        let name = state.args.resource_name.clone();
        let myself = myself.clone();
        // Register blocks until the kubelet has dialled us back; the actor
        // keeps answering meanwhile.
        tokio::spawn(async move {
            let result = register(&kubelet, &endpoint, &name).await;
            let _ = myself.send_message(PluginMsg::Registered {
                generation,
                kubelet: kubelet_id,
                result,
            });
        });
        Ok(())
    }

    /// The outcome of a registration attempt: registered, or the next
    /// retry scheduled on the backoff.
    fn on_registered(
        myself: &ActorRef<PluginMsg>,
        state: &mut PluginState,
        generation: u64,
        kubelet_id: FileId,
        result: Result<(), RegisterError>,
    ) {
        if generation != state.generation {
            return;
        }
        state.registering = false;
        let reason = match result {
            Ok(()) => {
                state.retry = Retry::default();
                state.set_registered(Some((kubelet_id, Instant::now())));
                state.args.metrics.count_registration();
                tracing::info!(
                    resource = %state.resource(),
                    name = %state.args.resource_name,
                    "registered with the kubelet"
                );
                return;
            }
            Err(reason) => reason,
        };
        let Some(delay) = state.retry.failed(Instant::now()) else {
            tracing::debug!(
                resource = %state.resource(),
                %reason,
                "early registration attempt failed; the scheduled retry stands"
            );
            return;
        };
        // Waiting for a kubelet is normal at boot: say it once, calmly.
        match reason {
            RegisterError::NoKubelet(_) if state.retry.failures > 1 => {}
            RegisterError::NoKubelet(_) => tracing::info!(
                resource = %state.resource(),
                %reason,
                "waiting for the kubelet"
            ),
            _ => tracing::warn!(
                resource = %state.resource(),
                %reason,
                retry_in_ms = delay.as_millis() as u64,
                "registration failed"
            ),
        }
        let due = state.retry.due;
        myself.send_after(delay, move || PluginMsg::Register {
            generation,
            scheduled: due,
        });
    }

    /// Verifies socket, kubelet and stream; heals what is wrong.
    async fn on_check(
        myself: &ActorRef<PluginMsg>,
        state: &mut PluginState,
    ) -> Result<(), ActorProcessingErr> {
        let ours = state.server.as_ref().map(|s| s.socket_id);
        let kubelet = file_id(&state.args.kubelet_socket);
        if file_id(&state.args.socket) != ours {
            // Deleted under a kubelet that still streams from us.
            let live = state.registered.is_some_and(|(id, _)| Some(id) == kubelet);
            return Self::restart(myself, state, "socket removed", live).await;
        }
        match (kubelet, state.registered) {
            (Some(now), Some((then, _))) if now != then => {
                if let Placement::Matcher { handle, .. } = &state.args.placement {
                    handle.kubelet_restarted(now.key());
                }
                Self::restart(myself, state, "kubelet restarted", false).await
            }
            (Some(_), Some((_, at)))
                if at.elapsed() > STREAM_GRACE && state.streams.count() == 0 =>
            {
                let reason = "kubelet closed the ListAndWatch stream";
                Self::restart(myself, state, reason, false).await
            }
            (Some(_), None) if !state.registering => {
                // A kubelet appeared: no need to sit out the backoff.
                myself.send_message(PluginMsg::Register {
                    generation: state.generation,
                    scheduled: None,
                })?;
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

impl Actor for PluginActor {
    type Msg = PluginMsg;
    type State = PluginState;
    type Arguments = PluginArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<PluginMsg>,
        args: PluginArgs,
    ) -> Result<PluginState, ActorProcessingErr> {
        // The kubelet now is the one that held the predecessor's stream.
        let held_by = file_id(&args.kubelet_socket);
        let settle_until = args.settle_until;
        let mut state = PluginState {
            placement: watch::Sender::new(args.placement.clone()),
            args,
            server: None,
            generation: 0,
            registering: false,
            registered: None,
            settle: None,
            retry: Retry::default(),
            withdrawn: Arc::new([]),
            follower: None,
            streams: OpenStreams::default(),
        };
        let streams = state.streams.clone();
        state.args.metrics.read_streams(move || streams.count());
        state.follow(&myself);
        state.server = Some(Self::start_server(&state)?);
        Self::first_registration(&myself, &mut state, settle_until, held_by)?;
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<PluginMsg>,
        msg: PluginMsg,
        state: &mut PluginState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PluginMsg::Register {
                generation,
                scheduled,
            } => Self::on_register(&myself, state, generation, scheduled),
            PluginMsg::Registered {
                generation,
                kubelet,
                result,
            } => {
                Self::on_registered(&myself, state, generation, kubelet, result);
                Ok(())
            }
            PluginMsg::Check => Self::on_check(&myself, state).await,
            PluginMsg::SetPlacement { placement, reply } => {
                state.set_placement(&myself, placement);
                let _ = reply.send(());
                Ok(())
            }
            PluginMsg::SetHealth { healthy } => {
                state.set_health(healthy);
                Ok(())
            }
            // One the last follower sent before placement left the matcher
            // is stale: without it nothing is withdrawn.
            PluginMsg::SetWithdrawn { withdrawn } => {
                if state.args.placement.uses_matcher() {
                    state.set_withdrawn(withdrawn);
                }
                Ok(())
            }
        }
    }

    async fn post_stop(
        &self,
        _: ActorRef<PluginMsg>,
        state: &mut PluginState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(follower) = state.follower.take() {
            follower.abort();
        }
        // The kubelet drops devices it is told about before the stream ends.
        Self::stop_server(state, DeviceListMessage::empty()).await;
        state.set_registered(None);
        tracing::info!(resource = %state.resource(), "stopped");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Registration attempts against a kubelet socket nobody answers, with
    /// a burst of triggers every millisecond: (ms since start, delay to the
    /// next scheduled retry) of each attempt that failed on schedule.
    fn scheduled_failures(until_ms: u64) -> (Vec<(u64, u64)>, u32) {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut retry = Retry::default();
        let mut scheduled = Vec::new();
        let mut early = 0;
        for ms in 0..until_ms {
            // The first attempt at start, then each time the timer fires.
            let mut attempts = u32::from(retry.due.is_none_or(|due| at(ms) >= due));
            if attempts == 0 {
                attempts = (0..10).map(|_| u32::from(retry.early(at(ms)))).sum();
                early += attempts;
            }
            for _ in 0..attempts {
                if let Some(delay) = retry.failed(at(ms)) {
                    scheduled.push((ms, delay.as_millis() as u64));
                }
            }
        }
        (scheduled, early)
    }

    #[test]
    fn backoff_grows_on_time_and_a_burst_of_triggers_tries_once_per_window() {
        let (scheduled, early) = scheduled_failures(3200);
        assert_eq!(
            scheduled,
            [
                (0, 100),
                (100, 200),
                (300, 400),
                (700, 800),
                (1500, 1600),
                (3100, 2000)
            ]
        );
        assert_eq!(early, scheduled.len() as u32);
    }

    #[test]
    fn a_success_starts_the_backoff_afresh_and_a_stale_window_is_over() {
        let now = Instant::now();
        let mut retry = Retry::default();
        assert_eq!(retry.failed(now), Some(Duration::from_millis(100)));
        assert!(retry.early(now));
        assert!(!retry.early(now), "one early attempt per window");
        let later = now + Duration::from_millis(100);
        assert!(retry.early(later), "the window is over: a trigger may try");
        assert_eq!(retry.failed(later), Some(Duration::from_millis(200)));
        retry = Retry::default();
        assert_eq!(retry.failed(later), Some(Duration::from_millis(100)));
    }
}
