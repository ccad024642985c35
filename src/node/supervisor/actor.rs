//! The supervisor actor: restart policy and message handling. Which
//! children there are and how each is built live in `children`; what a
//! reload changes, in `reload`. Its children are linked, so their ends
//! arrive in `handle_supervisor_evt`; ractor's default there would stop the
//! supervisor itself, which is exactly what must not happen.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent, call_t};

use super::children::{Args, Child, ChildContext, Spawned, wanted};
use super::reload;
use crate::config::Config;
use crate::node::dra::DraMsg;
use crate::node::health::{GpuFault, HealthNews, HealthReport};
use crate::node::inventory::{InventoryMsg, Published};
use crate::node::kubelet_watch::CheckPlugins;
use crate::node::matcher::MatcherHandle;
use crate::node::metrics::{GpuStatus, Metrics};
use crate::node::plugin::{PairingBook, Placement, PluginMsg, SETTLE};
use crate::node::readiness::{Hold, Readiness};
use crate::rules::device::{Plan, Resource};

/// A child that ran this long works again: its backoff starts afresh and
/// it no longer holds readiness back.
const STABLE_AFTER: Duration = Duration::from_secs(60);
/// Quick failures in a row after which a child makes the daemon unready.
const FAILING_AFTER: u32 = 3;
/// How long a stopping child may take (a plugin ends its stream and server).
const CHILD_STOP_TIMEOUT: Duration = Duration::from_secs(4);

pub(crate) struct Supervisor;

pub(crate) struct SupervisorArgs {
    pub(crate) config: Config,
    pub(crate) plan: Plan,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) readiness: Arc<Readiness>,
}

/// What the supervisor is told. Only the test-only `Children` is a call;
/// everything else is sent and answered by what the supervisor does.
pub(crate) enum SupervisorMsg {
    /// Start `child` (again, after its backoff) unless it runs already or
    /// the config no longer calls for it; a failed start schedules the next
    /// try.
    Start { child: Child },
    /// The kubelet's directory changed (or the watcher's tick): every
    /// running plugin is told to verify its socket, kubelet and stream.
    CheckPlugins,
    /// The GPUs' health changed (one flag per GPU, in plan order): handed
    /// to every running plugin and published in the inventory. A list of
    /// the wrong length (a report from before a reload changed the GPUs)
    /// is dropped.
    Health { healthy: Arc<[bool]> },
    /// An XID event on a GPU: the pod matcher tells the pods on it.
    Fault { fault: GpuFault },
    /// A new, valid config (SIGHUP or an edit) and the plan made from it:
    /// stop, start or restart the children it changes. The sender has
    /// already checked both.
    Reload { config: Box<Config>, plan: Plan },
    /// `child`, failing before, may have run [`STABLE_AFTER`] by now: if
    /// so its backoff starts afresh and it no longer holds readiness back.
    Stable { child: Child },
    /// Reply with the running children, each with its actor: which ones a
    /// reload restarted or a crash brought back shows in their ids.
    #[cfg(test)]
    Children {
        reply: ractor::RpcReplyPort<BTreeMap<Child, ractor::ActorCell>>,
    },
}

struct Running {
    spawned: Spawned,
    started: Instant,
    /// What it was started with, to tell what a reload changes.
    args: Args,
}

pub(crate) struct SupervisorState {
    config: Config,
    plan: Plan,
    pairing: PairingBook,
    /// Filled while the pod matcher runs; every plugin holds a clone.
    matcher: MatcherHandle,
    healthy: Arc<[bool]>,
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
    /// The children's two messages to the supervisor.
    report_health: HealthReport,
    check_plugins: CheckPlugins,
    children: BTreeMap<Child, Running>,
    /// Consecutive quick failures per child, for the backoff.
    failures: BTreeMap<Child, u32>,
    /// Plugins stopped by a reload whose successor registers no earlier
    /// than this (see SETTLE); each successor waits on its own, so they
    /// settle side by side.
    settling: BTreeMap<Resource, Instant>,
}

fn restart_delay(failures: u32) -> Duration {
    Duration::from_millis(100u64 << failures.saturating_sub(1).min(9)).min(Duration::from_secs(30))
}

impl SupervisorState {
    /// `child` works again: a fresh backoff, and it no longer holds
    /// readiness back.
    fn steady(&mut self, child: Child) {
        if self.failures.remove(&child).is_some() {
            self.readiness.hold(child, Hold::Failing, None);
        }
    }

    /// `child` goes on purpose: whatever it held back goes with it (a
    /// successor marks its own).
    fn release(&mut self, child: Child) {
        self.readiness.release(child);
        self.metrics.release(child);
        self.failures.remove(&child);
    }

    /// `child`'s arguments under the current config and plan.
    fn args(&self, child: Child) -> Option<Args> {
        let context = ChildContext {
            metrics: &self.metrics,
            readiness: &self.readiness,
            healthy: &self.healthy,
            placement: self.placement(),
            report_health: &self.report_health,
            check_plugins: &self.check_plugins,
        };
        Args::new(child, &self.config, &self.plan, &context)
    }

    /// How plugins place containers under the current config.
    fn placement(&self) -> Placement {
        if self.config.pod_matching {
            Placement::Matcher {
                handle: self.matcher.clone(),
                wait: Duration::from_millis(self.config.matcher.wait_ms),
            }
        } else {
            Placement::Ids(self.pairing.clone())
        }
    }

    fn remove(&mut self, child: Child) -> Option<Running> {
        if child == Child::Matcher {
            self.matcher.set(None);
        }
        self.children.remove(&child)
    }

    /// Hands the running inventory publisher what the Node should carry now
    /// (it patches only when that differs), and the metrics each GPU's
    /// capacity and health.
    fn publish_inventory(&self) {
        let inventory = crate::rules::usage::Inventory::new(self.plan.gpus(), &self.config.offer());
        let gpus = self.plan.gpus().iter().zip(self.healthy.iter()).enumerate();
        self.metrics.set_gpu_status(
            gpus.map(|(g, (gpu, &healthy))| {
                let capacity = inventory.capacity(g);
                GpuStatus {
                    uuid: gpu.uuid.clone(),
                    memory_capacity_mib: capacity.memory,
                    core_capacity_percent: capacity.core,
                    healthy,
                    backend: self.config.enforcement.backend(),
                }
            })
            .collect(),
        );
        for running in self.children.values() {
            if let Spawned::Inventory(actor) = &running.spawned {
                let published = Published::of(&self.config, self.plan.gpus(), &self.healthy);
                let _ = actor.send_message(InventoryMsg::Publish { published });
            }
        }
    }

    fn plugins(&self) -> impl Iterator<Item = &ActorRef<PluginMsg>> {
        self.children.values().filter_map(|r| match &r.spawned {
            Spawned::Plugin(actor) => Some(actor),
            _ => None,
        })
    }
}

impl Supervisor {
    async fn start(myself: &ActorRef<SupervisorMsg>, state: &mut SupervisorState, child: Child) {
        if state.children.contains_key(&child) {
            return;
        }
        let Some(mut args) = state.args(child) else {
            return; // no longer wanted
        };
        match (&mut args, child) {
            (Args::Plugin(plugin), Child::Plugin(r)) => {
                plugin.settle_until = state.settling.remove(&r);
            }
            (Args::Matcher(_), _) => {
                let why = "has not synced its pod cache with the API server";
                let readiness = &state.readiness;
                readiness.hold(Child::Matcher, Hold::Waiting, Some(why.into()));
            }
            _ => {}
        }
        match args.clone().spawn(child, myself.get_cell()).await {
            Ok(spawned) => {
                if let Spawned::Matcher(actor) = &spawned {
                    state.matcher.set(Some(actor.clone()));
                }
                let started = Instant::now();
                let running = Running {
                    spawned,
                    started,
                    args,
                };
                state.children.insert(child, running);
                if state.failures.contains_key(&child) {
                    myself.send_after(STABLE_AFTER, move || SupervisorMsg::Stable { child });
                }
            }
            Err(e) => Self::schedule_restart(myself, state, child, &format!("cannot start: {e}")),
        }
    }

    fn schedule_restart(
        myself: &ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
        child: Child,
        reason: &str,
    ) {
        state.metrics.count_restart(&child.to_string());
        let failures = state.failures.entry(child).or_default();
        *failures += 1;
        let delay = restart_delay(*failures);
        if *failures >= FAILING_AFTER {
            let why = format!("failed {failures} times in a row, last: {reason}");
            state.readiness.hold(child, Hold::Failing, Some(why));
        }
        tracing::warn!(
            %child,
            %reason,
            restart_in_ms = delay.as_millis() as u64,
            "child ended; restarting"
        );
        myself.send_after(delay, move || SupervisorMsg::Start { child });
    }

    /// Stops children on purpose (a reload), side by side; returns when
    /// each one ended. They leave the map first, so their ends are not
    /// taken for crashes.
    async fn stop(
        state: &mut SupervisorState,
        children: Vec<(Child, &'static str)>,
    ) -> Vec<(Child, Instant)> {
        let mut stopping = Vec::new();
        for (child, why) in children {
            state.release(child);
            let running = state.remove(child);
            if running.is_some() {
                tracing::info!(%child, reason = why, "stopping");
            }
            stopping.push((child, running, why));
        }
        let stops = stopping.iter().map(|(child, running, why)| async move {
            if let Some(running) = running {
                stop_and_wait(*child, running, why).await;
            }
            (*child, Instant::now())
        });
        futures::future::join_all(stops).await
    }

    async fn reload(
        myself: &ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
        config: Config,
        plan: Plan,
    ) {
        Self::adopt(state, config, plan);
        // Plugins leave the matcher before it stops, and join it once it
        // runs, so no Allocate finds it missing.
        Self::push_placements(state, false).await;
        let restarts = Self::restarts(state).await;
        Self::stop_for_restart(state, restarts).await;
        Self::start_wanted(myself, state).await;
        Self::push_placements(state, true).await;
        state.publish_inventory();
        state.metrics.config_applied();
        tracing::info!(
            resources = ?state.plan.models().map(|m| m.resource().name()).collect::<Vec<_>>(),
            "config reloaded"
        );
    }

    /// Takes the new config and plan: the GPUs' health carries over while
    /// they are the same GPUs, and the metrics keep only the resources
    /// still served.
    fn adopt(state: &mut SupervisorState, config: Config, plan: Plan) {
        let uuids = |plan: &Plan| {
            plan.gpus()
                .iter()
                .map(|g| g.uuid.clone())
                .collect::<Vec<_>>()
        };
        let old_uuids = uuids(&state.plan);
        state.config = config;
        state.plan = plan;
        // Health is per GPU: it holds while the GPUs are the same ones.
        if uuids(&state.plan) != old_uuids {
            state.healthy = vec![true; state.plan.gpus().len()].into();
        }
        let names: Vec<String> = state
            .plan
            .models()
            .map(|m| state.config.resource_name(m.resource()))
            .collect();
        state.metrics.retain(&names);
    }

    /// The running children the new config changes, each with why; a DRA
    /// plugin switched off removes its slice first.
    async fn restarts(state: &SupervisorState) -> Vec<(Child, &'static str)> {
        let mut restarts = Vec::new();
        for (&child, running) in &state.children {
            let wanted = state.args(child);
            let Some(reason) = reload::restart(&running.args, wanted.as_ref()) else {
                continue;
            };
            // DRA switched off takes its slice with it; restarted, it keeps
            // it (its successor publishes one generation on).
            if wanted.is_none()
                && let Spawned::Dra(actor) = &running.spawned
            {
                let withdraw = |reply| DraMsg::Withdraw { reply };
                let ms = CHILD_STOP_TIMEOUT.as_millis() as u64;
                if let Err(e) = call_t!(actor, withdraw, ms) {
                    tracing::warn!(error = %e, "the DRA plugin did not remove its slice");
                }
            }
            restarts.push((child, reason));
        }
        restarts
    }

    /// Stopped and awaited before their successors start: each old stream
    /// ends before its new registration (kubernetes#121994), which waits
    /// SETTLE from that end. Side by side, so one slow stop holds back no
    /// other resource.
    async fn stop_for_restart(state: &mut SupervisorState, restarts: Vec<(Child, &'static str)>) {
        for (child, ended) in Self::stop(state, restarts).await {
            if let Child::Plugin(r) = child {
                state.settling.insert(r, ended + SETTLE);
            }
        }
    }

    /// Starts every child the config wants that is not running; a child
    /// waiting out a restart backoff that is no longer wanted holds
    /// nothing back any more.
    async fn start_wanted(myself: &ActorRef<SupervisorMsg>, state: &mut SupervisorState) {
        let wanted = wanted(&state.config, &state.plan);
        let dropped: Vec<Child> = (state.failures.keys())
            .filter(|c| !wanted.contains(c))
            .copied()
            .collect();
        for child in dropped {
            state.release(child);
        }
        for child in wanted {
            if !state.children.contains_key(&child) {
                tracing::info!(%child, "starting after reload");
                Self::start(myself, state, child).await;
            }
        }
    }

    /// Gives running plugins the config's placement, those switching to
    /// the matcher or those switching away from it, and waits until each
    /// has it.
    async fn push_placements(state: &mut SupervisorState, to_matcher: bool) {
        let new = state.placement();
        if new.uses_matcher() != to_matcher {
            return;
        }
        let mut pushes = Vec::new();
        for running in state.children.values_mut() {
            if let (Spawned::Plugin(actor), Args::Plugin(args)) =
                (&running.spawned, &mut running.args)
                && reload::repoint(&args.placement, &new)
            {
                args.placement = new.clone();
                pushes.push(actor.clone());
            }
        }
        for actor in pushes {
            let placement = new.clone();
            let set = |reply| PluginMsg::SetPlacement { placement, reply };
            if let Err(e) = call_t!(actor, set, 2000) {
                tracing::warn!(error = %e, "a plugin did not take the new placement");
            }
        }
    }
}

async fn stop_and_wait(child: Child, running: &Running, why: &str) {
    let cell = running.spawned.cell();
    if let Err(e) = cell
        .stop_and_wait(Some(why.to_owned()), Some(CHILD_STOP_TIMEOUT))
        .await
    {
        tracing::warn!(%child, error = %e, "did not stop cleanly");
    }
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let me = myself.clone();
        let report_health: HealthReport = Arc::new(move |news| {
            let _ = me.send_message(match news {
                HealthNews::Changed { healthy, .. } => SupervisorMsg::Health { healthy },
                HealthNews::Fault(fault) => SupervisorMsg::Fault { fault },
            });
        });
        let me = myself.clone();
        let check_plugins: CheckPlugins = Arc::new(move || {
            // A stopped supervisor is shutting down: nothing to heal.
            let _ = me.send_message(SupervisorMsg::CheckPlugins);
        });
        let mut state = SupervisorState {
            healthy: vec![true; args.plan.gpus().len()].into(),
            report_health,
            check_plugins,
            config: args.config,
            plan: args.plan,
            metrics: args.metrics,
            readiness: args.readiness,
            pairing: PairingBook::default(),
            matcher: MatcherHandle::default(),
            children: BTreeMap::new(),
            failures: BTreeMap::new(),
            settling: BTreeMap::new(),
        };
        // Every GPU's capacity and health on /metrics from the start, in
        // every mode (the health checks report only changes).
        state.publish_inventory();
        for child in wanted(&state.config, &state.plan) {
            Self::start(&myself, &mut state, child).await;
        }
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Start { child } => Self::start(&myself, state, child).await,
            SupervisorMsg::CheckPlugins => {
                for plugin in state.plugins() {
                    let _ = plugin.send_message(PluginMsg::Check);
                }
            }
            SupervisorMsg::Health { healthy } => {
                // A new monitor's first report is often what we hold.
                if healthy.len() == state.plan.gpus().len() && healthy != state.healthy {
                    state.healthy = healthy;
                    for plugin in state.plugins() {
                        let _ = plugin.send_message(PluginMsg::SetHealth {
                            healthy: state.healthy.clone(),
                        });
                    }
                    state.publish_inventory();
                }
            }
            SupervisorMsg::Fault { fault } => state.matcher.fault(fault),
            SupervisorMsg::Reload { config, plan } => {
                Self::reload(&myself, state, *config, plan).await;
            }
            SupervisorMsg::Stable { child } => {
                if state
                    .children
                    .get(&child)
                    .is_some_and(|r| r.started.elapsed() >= STABLE_AFTER)
                {
                    state.steady(child);
                }
            }
            #[cfg(test)]
            SupervisorMsg::Children { reply } => {
                let cells = state.children.iter();
                let _ = reply.send(cells.map(|(c, r)| (*c, r.spawned.cell())).collect());
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, reason) = match event {
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.unwrap_or_else(|| "stopped".into()))
            }
            SupervisionEvent::ActorFailed(cell, err) => (cell, format!("failed: {err}")),
            _ => return Ok(()),
        };
        let Some(child) = state
            .children
            .iter()
            .find(|(_, r)| r.spawned.cell().get_id() == cell.get_id())
            .map(|(c, _)| *c)
        else {
            return Ok(()); // stopped on purpose
        };
        // Its marks stay while it waits for its restart (what it held back
        // for is still so: it is not running); its successor replaces them,
        // and a stop on purpose releases them.
        let running = state.remove(child).expect("found above");
        if running.started.elapsed() >= STABLE_AFTER {
            state.steady(child);
        }
        Self::schedule_restart(&myself, state, child, &reason);
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let children = std::mem::take(&mut state.children);
        let stops =
            (children.iter()).map(|(child, running)| stop_and_wait(*child, running, "shutdown"));
        futures::future::join_all(stops).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restart_backoff_grows_and_is_capped() {
        assert_eq!(restart_delay(1), Duration::from_millis(100));
        assert_eq!(restart_delay(2), Duration::from_millis(200));
        assert_eq!(restart_delay(5), Duration::from_millis(1600));
        assert_eq!(restart_delay(9), Duration::from_millis(25_600));
        assert_eq!(restart_delay(50), Duration::from_secs(30));
    }
}
