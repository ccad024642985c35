//! The supervisor actor. Its children are linked, so their ends arrive in
//! `handle_supervisor_evt`; ractor's default there would stop the
//! supervisor itself, which is exactly what must not happen.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent, call_t};

use crate::config::Config;
use crate::device::{Plan, Resource};
use crate::health::{HealthArgs, HealthMonitor, ProbeSpec};
use crate::inventory::{InventoryArgs, InventoryHandle, InventoryPublisher, Published};
use crate::kubelet_watch::{KubeletWatcher, WatcherArgs};
use crate::matcher::{self, MatcherArgs, MatcherHandle, PodMatcher};
use crate::metrics::{Hold, Metrics};
use crate::plugin::{LastShared, Placement, PluginActor, PluginArgs, PluginMsg, SETTLE};

/// A child that ran this long works again: its backoff starts afresh and
/// it no longer holds readiness back.
const STABLE_AFTER: Duration = Duration::from_secs(60);
/// Quick failures in a row after which a child makes the daemon unready.
const FAILING_AFTER: u32 = 3;
/// How long a stopping child may take (a plugin ends its stream and server).
const CHILD_STOP_TIMEOUT: Duration = Duration::from_secs(4);
/// The watcher's periodic check, for filesystem events that never came.
const WATCH_TICK: Duration = Duration::from_secs(5);

pub struct Supervisor;

pub struct SupervisorArgs {
    pub config: Config,
    pub plan: Plan,
    pub metrics: Arc<Metrics>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Child {
    Matcher,
    Plugin(Resource),
    Watcher,
    Health,
    Inventory,
}

impl std::fmt::Display for Child {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Child::Matcher => f.write_str("pod matcher"),
            Child::Plugin(r) => write!(f, "plugin {r}"),
            Child::Watcher => f.write_str("kubelet watcher"),
            Child::Health => f.write_str("health monitor"),
            Child::Inventory => f.write_str("inventory publisher"),
        }
    }
}

pub enum SupervisorMsg {
    /// Start (again) a child that is not running.
    Start(Child),
    /// Have every plugin verify its socket, kubelet and stream.
    CheckPlugins,
    /// GPU health changed.
    Health(Arc<[bool]>),
    /// A new, valid config and its plan (SIGHUP).
    Reload(Box<(Config, Plan)>),
    /// A child that was failing may have run STABLE_AFTER by now.
    Stable(Child),
}

struct Running {
    cell: ActorCell,
    started: Instant,
    /// For plugins: what it serves, to tell a changed one on reload.
    plugin: Option<(ActorRef<PluginMsg>, PluginArgs)>,
}

impl Running {
    /// A child the supervisor only starts and stops.
    fn untyped(cell: ActorCell) -> Running {
        Running {
            cell,
            started: Instant::now(),
            plugin: None,
        }
    }
}

pub struct SupervisorState {
    config: Config,
    plan: Plan,
    pairing: LastShared,
    /// Filled while the pod matcher runs; every plugin holds a clone.
    matcher: MatcherHandle,
    inventory: InventoryHandle,
    healthy: Arc<[bool]>,
    metrics: Arc<Metrics>,
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
            self.metrics.hold(&child.to_string(), Hold::Failing, None);
        }
    }

    /// `child` goes on purpose: whatever it held back goes with it (a
    /// successor marks its own).
    fn release(&mut self, child: Child) {
        self.metrics.hold(&child.to_string(), Hold::Waiting, None);
        self.steady(child);
    }

    fn plugin_args(&self, resource: Resource) -> Option<PluginArgs> {
        let model = self.plan.model(resource)?.clone();
        Some(PluginArgs::new(
            &self.config,
            model,
            self.placement(),
            self.healthy.clone(),
            &self.metrics,
        ))
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

    fn published(&self) -> Published {
        Published::of(&self.config, self.plan.gpus(), &self.healthy)
    }

    fn matcher_args(&self) -> MatcherArgs {
        MatcherArgs::new(&self.config, self.plan.gpus(), self.metrics.clone())
    }

    /// In start order: the matcher before the plugins that ask it.
    fn wanted(&self) -> Vec<Child> {
        let mut children: Vec<Child> = self
            .config
            .pod_matching
            .then_some(Child::Matcher)
            .into_iter()
            .collect();
        children.extend(self.plan.models().map(|m| Child::Plugin(m.resource())));
        children.extend([Child::Watcher, Child::Health]);
        // The inventory invites placements only a pod-matching node honours.
        if self.config.pod_matching {
            children.push(Child::Inventory);
        }
        children
    }

    fn remove(&mut self, child: Child) -> Option<Running> {
        match child {
            Child::Matcher => self.matcher.set(None),
            Child::Inventory => self.inventory.set(None),
            _ => {}
        }
        self.children.remove(&child)
    }

    fn plugins(&self) -> impl Iterator<Item = &ActorRef<PluginMsg>> {
        self.children
            .values()
            .filter_map(|r| r.plugin.as_ref().map(|(a, _)| a))
    }
}

impl Supervisor {
    async fn start(myself: &ActorRef<SupervisorMsg>, state: &mut SupervisorState, child: Child) {
        if state.children.contains_key(&child) || !state.wanted().contains(&child) {
            return;
        }
        let name = Some(child.to_string());
        let supervisor = myself.get_cell();
        let spawned: Result<Running, String> = match child {
            Child::Plugin(r) => {
                let Some(mut args) = state.plugin_args(r) else {
                    return;
                };
                args.settle_until = state.settling.remove(&r);
                Actor::spawn_linked(name, PluginActor, args.clone(), supervisor)
                    .await
                    .map(|(actor, _)| Running {
                        cell: actor.get_cell(),
                        started: Instant::now(),
                        plugin: Some((actor, args)),
                    })
                    .map_err(|e| e.to_string())
            }
            Child::Matcher => {
                let why = "has not synced its pod cache with the API server";
                let metrics = &state.metrics;
                metrics.hold(matcher::READY_NAME, Hold::Waiting, Some(why.into()));
                let args = state.matcher_args();
                Actor::spawn_linked(name, PodMatcher, args, supervisor)
                    .await
                    .map(|(a, _)| {
                        state.matcher.set(Some(a.clone()));
                        Running::untyped(a.get_cell())
                    })
                    .map_err(|e| e.to_string())
            }
            Child::Watcher => {
                let args = WatcherArgs {
                    dir: state.config.device_plugin_dir.clone(),
                    supervisor: myself.clone(),
                    tick: WATCH_TICK,
                };
                Actor::spawn_linked(name, KubeletWatcher, args, supervisor)
                    .await
                    .map(|(a, _)| Running::untyped(a.get_cell()))
                    .map_err(|e| e.to_string())
            }
            Child::Health => {
                let args = health_args(myself, state);
                Actor::spawn_linked(name, HealthMonitor, args, supervisor)
                    .await
                    .map(|(a, _)| Running::untyped(a.get_cell()))
                    .map_err(|e| e.to_string())
            }
            Child::Inventory => {
                let args = InventoryArgs::new(&state.config, state.published());
                Actor::spawn_linked(name, InventoryPublisher, args, supervisor)
                    .await
                    .map(|(a, _)| {
                        state.inventory.set(Some(a.clone()));
                        Running::untyped(a.get_cell())
                    })
                    .map_err(|e| e.to_string())
            }
        };
        match spawned {
            Ok(running) => {
                state.children.insert(child, running);
                if state.failures.contains_key(&child) {
                    myself.send_after(STABLE_AFTER, move || SupervisorMsg::Stable(child));
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
        let failures = state.failures.entry(child).or_default();
        *failures += 1;
        let delay = restart_delay(*failures);
        if *failures >= FAILING_AFTER {
            let why = format!("failed {failures} times in a row, last: {reason}");
            let metrics = &state.metrics;
            metrics.hold(&child.to_string(), Hold::Failing, Some(why));
        }
        tracing::warn!(
            %child,
            %reason,
            restart_in_ms = delay.as_millis() as u64,
            "child ended; restarting"
        );
        myself.send_after(delay, move || SupervisorMsg::Start(child));
    }

    /// Stops a child on purpose (reload, shutdown): it leaves the map
    /// first, so its end is not taken for a crash.
    async fn stop(state: &mut SupervisorState, child: Child, why: &str) {
        state.release(child);
        if let Some(running) = state.remove(child) {
            tracing::info!(%child, reason = why, "stopping");
            if let Err(e) = running
                .cell
                .stop_and_wait(Some(why.to_owned()), Some(CHILD_STOP_TIMEOUT))
                .await
            {
                tracing::warn!(%child, error = %e, "did not stop cleanly");
            }
        }
    }

    async fn reload(
        myself: &ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
        config: Config,
        plan: Plan,
    ) {
        let old_dir = state.config.device_plugin_dir.clone();
        let old_gpus = state.plan.gpus().to_vec();
        let old_health = (state.config.health.clone(), state.config.devices.backend);
        let old_matcher = state.matcher_args();
        let old_inventory = InventoryArgs::new(&state.config, state.published());
        state.config = config;
        state.plan = plan;
        if state.plan.gpus() != old_gpus.as_slice() {
            state.healthy = vec![true; state.plan.gpus().len()].into();
        }
        let names: Vec<String> = state
            .plan
            .models()
            .map(|m| state.config.resource_name(m.resource()))
            .collect();
        state.metrics.retain(&names);
        // Plugins leave the matcher before it stops, and join it once it
        // runs, so no Allocate finds it missing.
        Self::push_placements(state, false).await;
        let running: Vec<Child> = state.children.keys().copied().collect();
        for child in running {
            let reason = match child {
                Child::Plugin(r) => {
                    let wanted = state.plugin_args(r);
                    let running = state
                        .children
                        .get_mut(&child)
                        .and_then(|c| c.plugin.as_mut());
                    match (running, wanted) {
                        (_, None) => Some("disabled by reload"),
                        (Some((_, old)), Some(new)) if !old.serves_like(&new) => {
                            Some("changed by reload")
                        }
                        _ => None,
                    }
                }
                Child::Matcher if !state.config.pod_matching => Some("disabled by reload"),
                Child::Matcher => {
                    (!state.matcher_args().same_as(&old_matcher)).then_some("changed by reload")
                }
                Child::Watcher => {
                    (state.config.device_plugin_dir != old_dir).then_some("directory changed")
                }
                Child::Health => {
                    let now = (state.config.health.clone(), state.config.devices.backend);
                    (now != old_health || state.plan.gpus() != old_gpus.as_slice())
                        .then_some("health settings changed")
                }
                Child::Inventory if !state.config.pod_matching => Some("disabled by reload"),
                Child::Inventory => {
                    let now = InventoryArgs::new(&state.config, state.published());
                    (!now.same_target(&old_inventory)).then_some("changed by reload")
                }
            };
            if let Some(reason) = reason {
                // Stopped and awaited before its successor starts: the old
                // stream ends before the new registration (kubernetes#121994).
                Self::stop(state, child, reason).await;
                if let Child::Plugin(r) = child {
                    state.settling.insert(r, Instant::now() + SETTLE);
                }
            }
        }
        // A child waiting out a restart backoff that is no longer wanted
        // holds nothing back any more.
        let wanted = state.wanted();
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
        Self::push_placements(state, true).await;
        state.inventory.publish(state.published());
        tracing::info!(
            resources = ?state.plan.models().map(|m| m.resource().name()).collect::<Vec<_>>(),
            "config reloaded"
        );
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
            if let Some((actor, args)) = &mut running.plugin
                && !args.placement.same_as(&new)
            {
                args.placement = new.clone();
                pushes.push(actor.clone());
            }
        }
        for actor in pushes {
            if let Err(e) = call_t!(actor, PluginMsg::SetPlacement, 2000, new.clone()) {
                tracing::warn!(error = %e, "a plugin did not take the new placement");
            }
        }
    }
}

fn health_args(myself: &ActorRef<SupervisorMsg>, state: &SupervisorState) -> HealthArgs {
    let h = &state.config.health;
    HealthArgs {
        spec: ProbeSpec::new(&state.config),
        uuids: state.plan.gpus().iter().map(|g| g.uuid.clone()).collect(),
        poll: Duration::from_millis(h.poll_ms),
        recovery: Duration::from_millis(h.recovery_ms),
        supervisor: myself.clone(),
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
        let mut state = SupervisorState {
            healthy: vec![true; args.plan.gpus().len()].into(),
            config: args.config,
            plan: args.plan,
            metrics: args.metrics,
            pairing: LastShared::default(),
            matcher: MatcherHandle::default(),
            inventory: InventoryHandle::default(),
            children: BTreeMap::new(),
            failures: BTreeMap::new(),
            settling: BTreeMap::new(),
        };
        for child in state.wanted() {
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
            SupervisorMsg::Start(child) => Self::start(&myself, state, child).await,
            SupervisorMsg::CheckPlugins => {
                for plugin in state.plugins() {
                    let _ = plugin.send_message(PluginMsg::Check);
                }
            }
            SupervisorMsg::Health(healthy) => {
                if healthy.len() == state.plan.gpus().len() {
                    state.healthy = healthy;
                    for plugin in state.plugins() {
                        let _ = plugin.send_message(PluginMsg::SetHealth(state.healthy.clone()));
                    }
                    state.inventory.publish(state.published());
                }
            }
            SupervisorMsg::Reload(new) => {
                let (config, plan) = *new;
                Self::reload(&myself, state, config, plan).await;
            }
            SupervisorMsg::Stable(child) => {
                if state
                    .children
                    .get(&child)
                    .is_some_and(|r| r.started.elapsed() >= STABLE_AFTER)
                {
                    state.steady(child);
                }
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
            .find(|(_, r)| r.cell.get_id() == cell.get_id())
            .map(|(c, _)| *c)
        else {
            return Ok(()); // stopped on purpose
        };
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
        let stops = children.into_iter().map(|(child, running)| async move {
            if let Err(e) = running
                .cell
                .stop_and_wait(Some("shutdown".into()), Some(CHILD_STOP_TIMEOUT))
                .await
            {
                tracing::warn!(%child, error = %e, "did not stop cleanly");
            }
        });
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
