//! The supervisor actor. Its children are linked, so their ends arrive in
//! `handle_supervisor_evt`; ractor's default there would stop the
//! supervisor itself, which is exactly what must not happen.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};

use crate::config::Config;
use crate::device::{Plan, Resource};
use crate::plugin::{LastShared, PluginActor, PluginArgs, PluginMsg};

/// A child that ran this long before ending starts its backoff afresh.
const STABLE_AFTER: Duration = Duration::from_secs(60);
/// How long a stopping child may take (it ends its stream and server).
const CHILD_STOP_TIMEOUT: Duration = Duration::from_secs(4);

pub struct Supervisor;

pub struct SupervisorArgs {
    pub config: Config,
    pub plan: Plan,
}

pub enum SupervisorMsg {
    /// Start (again) the plugin of this resource.
    Start(Resource),
}

struct Child {
    actor: ActorRef<PluginMsg>,
    started: Instant,
}

pub struct SupervisorState {
    config: Config,
    plan: Plan,
    pairing: LastShared,
    children: BTreeMap<Resource, Child>,
    /// Consecutive quick failures per resource, for the backoff.
    failures: BTreeMap<Resource, u32>,
}

fn restart_delay(failures: u32) -> Duration {
    Duration::from_millis(100u64 << failures.saturating_sub(1).min(9)).min(Duration::from_secs(30))
}

impl Supervisor {
    async fn start_child(
        myself: &ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
        resource: Resource,
    ) {
        let Some(model) = state.plan.model(resource) else {
            return;
        };
        let args = PluginArgs::new(&state.config, model.clone(), state.pairing.clone());
        let name = format!("plugin-{resource}");
        match Actor::spawn_linked(Some(name), PluginActor, args, myself.get_cell()).await {
            Ok((actor, _)) => {
                state.children.insert(
                    resource,
                    Child {
                        actor,
                        started: Instant::now(),
                    },
                );
            }
            Err(e) => {
                Self::schedule_restart(myself, state, resource, &e.to_string());
            }
        }
    }

    fn schedule_restart(
        myself: &ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
        resource: Resource,
        reason: &str,
    ) {
        let failures = state.failures.entry(resource).or_default();
        *failures += 1;
        let delay = restart_delay(*failures);
        tracing::warn!(
            %resource,
            %reason,
            restart_in_ms = delay.as_millis() as u64,
            "plugin ended; restarting"
        );
        myself.send_after(delay, move || SupervisorMsg::Start(resource));
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
            config: args.config,
            plan: args.plan,
            pairing: LastShared::default(),
            children: BTreeMap::new(),
            failures: BTreeMap::new(),
        };
        let resources: Vec<Resource> = state.plan.models().map(|m| m.resource()).collect();
        for resource in resources {
            Self::start_child(&myself, &mut state, resource).await;
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
            SupervisorMsg::Start(resource) if !state.children.contains_key(&resource) => {
                Self::start_child(&myself, state, resource).await;
            }
            SupervisorMsg::Start(_) => {}
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
        let Some(resource) = state
            .children
            .iter()
            .find(|(_, c)| c.actor.get_id() == cell.get_id())
            .map(|(r, _)| *r)
        else {
            return Ok(());
        };
        let child = state.children.remove(&resource).expect("found above");
        if child.started.elapsed() >= STABLE_AFTER {
            state.failures.remove(&resource);
        }
        Self::schedule_restart(&myself, state, resource, &reason);
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let stops = state.children.values().map(|c| {
            c.actor
                .stop_and_wait(Some("shutdown".into()), Some(CHILD_STOP_TIMEOUT))
        });
        for result in futures::future::join_all(stops).await {
            if let Err(e) = result {
                tracing::warn!(error = %e, "plugin did not stop cleanly");
            }
        }
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
