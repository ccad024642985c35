//! The supervisor's children: which ones the config and plan call for, the
//! one way each one's arguments are built, and how each is spawned. Adding
//! a child is a variant of [`Child`] and one arm in each `match` here; the
//! compiler points at every one.

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SpawnErr, SupervisionEvent};
use tracing::Instrument;

use crate::config::Config;
use crate::node::dra::{DraActor, DraArgs, DraMsg};
use crate::node::enforcement::mps::{Control, MpsArgs, MpsDaemons};
use crate::node::enforcement::sweeper::{Sweeper, SweeperArgs};
use crate::node::enforcement::{Compute, Enforcer};
use crate::node::health::{HealthArgs, HealthMonitor, HealthReport, ProbeSpec};
use crate::node::inventory::{InventoryArgs, InventoryMsg, InventoryPublisher, Published};
use crate::node::kubelet_watch::{CheckPlugins, KubeletWatcher, WatcherArgs};
use crate::node::matcher::{MatcherArgs, MatcherMsg, PodMatcher};
use crate::node::metrics::Metrics;
use crate::node::plugin::{Placement, PluginActor, PluginArgs, PluginMsg};
pub(crate) use crate::node::readiness::Child;
use crate::node::readiness::Readiness;
use crate::node::usage::{UsageArgs, UsageMonitor};
use crate::rules::device::Plan;

/// The watcher's periodic check, for filesystem events that never came.
const WATCH_TICK: Duration = Duration::from_secs(5);

/// The children `config` and `plan` call for, in start order: the matcher
/// before the plugins that ask it. The inventory on the Node serves the
/// scheduler extender, whose assignments only a matching node honours.
pub(crate) fn wanted(config: &Config, plan: &Plan) -> Vec<Child> {
    let mut children: Vec<Child> = config
        .pod_matching
        .then_some(Child::Matcher)
        .into_iter()
        .collect();
    children.extend(plan.models().map(|m| Child::Plugin(m.resource())));
    if config.pod_matching {
        children.push(Child::Inventory);
    }
    children.extend([Child::Watcher, Child::Health]);
    if Enforcer::new(&config.enforcement).is_some_and(|e| e.preloads()) {
        children.push(Child::Enforcement);
    }
    if config.enforcement.compute() == Compute::Mps {
        children.push(Child::Mps);
    }
    // Only pod matching and DRA's claims name a process's container.
    if (config.pod_matching || config.dra.enabled) && config.usage.poll_ms > 0 {
        children.push(Child::Usage);
    }
    if config.dra.enabled {
        children.push(Child::Dra);
    }
    children
}

/// What the supervisor keeps across its children's lives and hands to
/// them, beside the config and plan.
pub(crate) struct ChildContext<'a> {
    pub(crate) metrics: &'a Arc<Metrics>,
    pub(crate) readiness: &'a Arc<Readiness>,
    pub(crate) healthy: &'a Arc<[bool]>,
    pub(crate) placement: Placement,
    pub(crate) report_health: &'a HealthReport,
    pub(crate) check_plugins: &'a CheckPlugins,
}

/// One child's arguments.
#[derive(Clone)]
pub(crate) enum Args {
    Matcher(MatcherArgs),
    Plugin(PluginArgs),
    Inventory(InventoryArgs),
    Watcher(WatcherArgs),
    Health(HealthArgs),
    Enforcement(SweeperArgs),
    Mps(MpsArgs),
    Usage(UsageArgs),
    Dra(Box<DraArgs>),
}

/// A spawned child, by its typed address where the supervisor talks to it.
pub(crate) enum Spawned {
    Matcher(ActorRef<MatcherMsg>),
    Plugin(ActorRef<PluginMsg>),
    Inventory(ActorRef<InventoryMsg>),
    Dra(ActorRef<DraMsg>),
    Other(ActorCell),
}

impl Spawned {
    pub(crate) fn cell(&self) -> ActorCell {
        match self {
            Spawned::Matcher(a) => a.get_cell(),
            Spawned::Plugin(a) => a.get_cell(),
            Spawned::Inventory(a) => a.get_cell(),
            Spawned::Dra(a) => a.get_cell(),
            Spawned::Other(cell) => cell.clone(),
        }
    }
}

impl Args {
    /// `child`'s arguments under `config` and `plan`; None when they do not
    /// call for it.
    pub(crate) fn new(
        child: Child,
        config: &Config,
        plan: &Plan,
        context: &ChildContext,
    ) -> Option<Args> {
        if !wanted(config, plan).contains(&child) {
            return None;
        }
        Some(match child {
            Child::Matcher => Args::Matcher(MatcherArgs::new(
                config,
                plan.gpus(),
                context.metrics.clone(),
                context.readiness.clone(),
                match &context.placement {
                    Placement::Matcher { handle, .. } => handle,
                    // Wanted only with pod matching, whose placement it is.
                    Placement::Ids(_) => return None,
                },
            )),
            Child::Plugin(r) => Args::Plugin(PluginArgs::new(
                config,
                plan.model(r)?.clone(),
                context.placement.clone(),
                context.healthy.clone(),
                context.metrics,
            )),
            Child::Inventory => Args::Inventory(InventoryArgs::new(
                config,
                Published::of(config, plan.gpus(), context.healthy),
            )),
            Child::Watcher => Args::Watcher(WatcherArgs {
                dir: config.device_plugin_dir.clone(),
                check: context.check_plugins.clone(),
                tick: WATCH_TICK,
            }),
            Child::Health => Args::Health(HealthArgs {
                spec: ProbeSpec::new(config),
                uuids: plan.gpus().iter().map(|g| g.uuid.clone()).collect(),
                poll: Duration::from_millis(config.health.poll_ms),
                recovery: Duration::from_millis(config.health.recovery_ms),
                report: context.report_health.clone(),
            }),
            Child::Enforcement => Args::Enforcement(SweeperArgs {
                enforcer: Enforcer::new(&config.enforcement)?,
                matcher: match &context.placement {
                    Placement::Matcher { handle, .. } => Some(handle.clone()),
                    Placement::Ids(_) => None,
                },
                // The library is checked as often as the GPUs' health.
                tick: Duration::from_millis(config.health.poll_ms),
                metrics: context.metrics.clone(),
                readiness: context.readiness.clone(),
            }),
            Child::Mps => Args::Mps(MpsArgs {
                // Shares of DRA's GPUs are MPS clients too.
                controls: (plan.gpus().iter().chain(plan.dra_gpus()))
                    .map(|g| Control::new(&config.enforcement.mps, &g.uuid))
                    .collect(),
                // Asked as often as the GPUs' health is.
                tick: Duration::from_millis(config.health.poll_ms),
                readiness: context.readiness.clone(),
                metrics: context.metrics.clone(),
            }),
            Child::Usage => Args::Usage(UsageArgs::new(
                config,
                (plan.gpus(), plan.dra_gpus()),
                match &context.placement {
                    Placement::Matcher { handle, .. } => Some(handle.clone()),
                    // Without pod matching only DRA's claims name containers.
                    Placement::Ids(_) if config.dra.enabled => None,
                    Placement::Ids(_) => return None,
                },
                context.metrics.clone(),
            )),
            Child::Dra => Args::Dra(Box::new(DraArgs::new(config, plan.dra_gpus().to_vec()))),
        })
    }

    /// Spawns the child, unnamed (two actor trees may run in one process),
    /// linked to `supervisor`, its log lines under a span that names it.
    pub(crate) async fn spawn(
        self,
        child: Child,
        supervisor: ActorCell,
    ) -> Result<Spawned, SpawnErr> {
        let span = tracing::info_span!("actor", actor = %child);
        Ok(match self {
            Args::Matcher(a) => Spawned::Matcher(spawn(PodMatcher, a, span, supervisor).await?),
            Args::Plugin(a) => Spawned::Plugin(spawn(PluginActor, a, span, supervisor).await?),
            Args::Inventory(a) => {
                Spawned::Inventory(spawn(InventoryPublisher, a, span, supervisor).await?)
            }
            Args::Watcher(a) => {
                Spawned::Other(spawn(KubeletWatcher, a, span, supervisor).await?.get_cell())
            }
            Args::Health(a) => {
                Spawned::Other(spawn(HealthMonitor, a, span, supervisor).await?.get_cell())
            }
            Args::Enforcement(a) => {
                Spawned::Other(spawn(Sweeper, a, span, supervisor).await?.get_cell())
            }
            Args::Mps(a) => {
                Spawned::Other(spawn(MpsDaemons, a, span, supervisor).await?.get_cell())
            }
            Args::Usage(a) => {
                Spawned::Other(spawn(UsageMonitor, a, span, supervisor).await?.get_cell())
            }
            Args::Dra(a) => Spawned::Dra(spawn(DraActor, *a, span, supervisor).await?),
        })
    }
}

async fn spawn<A: Actor>(
    actor: A,
    args: A::Arguments,
    span: tracing::Span,
    supervisor: ActorCell,
) -> Result<ActorRef<A::Msg>, SpawnErr> {
    let named = Named { actor, span };
    Ok(Actor::spawn_linked(None, named, args, supervisor).await?.0)
}

/// An actor whose every callback runs in `span`: what a registered name
/// gave its log lines, without the process-wide name registry.
struct Named<A> {
    actor: A,
    span: tracing::Span,
}

impl<A: Actor> Actor for Named<A> {
    type Msg = A::Msg;
    type State = A::State;
    type Arguments = A::Arguments;

    async fn pre_start(
        &self,
        myself: ActorRef<A::Msg>,
        args: A::Arguments,
    ) -> Result<A::State, ActorProcessingErr> {
        let started = self.actor.pre_start(myself, args);
        started.instrument(self.span.clone()).await
    }

    async fn post_start(
        &self,
        myself: ActorRef<A::Msg>,
        state: &mut A::State,
    ) -> Result<(), ActorProcessingErr> {
        let done = self.actor.post_start(myself, state);
        done.instrument(self.span.clone()).await
    }

    async fn post_stop(
        &self,
        myself: ActorRef<A::Msg>,
        state: &mut A::State,
    ) -> Result<(), ActorProcessingErr> {
        let done = self.actor.post_stop(myself, state);
        done.instrument(self.span.clone()).await
    }

    async fn handle(
        &self,
        myself: ActorRef<A::Msg>,
        msg: A::Msg,
        state: &mut A::State,
    ) -> Result<(), ActorProcessingErr> {
        let done = self.actor.handle(myself, msg, state);
        done.instrument(self.span.clone()).await
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<A::Msg>,
        event: SupervisionEvent,
        state: &mut A::State,
    ) -> Result<(), ActorProcessingErr> {
        let done = self.actor.handle_supervisor_evt(myself, event, state);
        done.instrument(self.span.clone()).await
    }
}
