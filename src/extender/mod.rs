//! The kube-scheduler extender (`gpu-device-plugin scheduler-extender`):
//! filter, prioritize, bind and preempt for pods that ask for GPU
//! resources, so that
//! every container's shared ask lands on one GPU with room and every
//! whole-GPU ask on free whole GPUs, and the pod carries its per-container
//! assignment before it is bound.
//!
//! `index` (the cluster as the reflectors see it), `plan` (the
//! decisions) and `preempt` (the victims that free a GPU) are pure; `cluster` does the API-server I/O behind the
//! [`Binder`] trait; `server` is the HTTP adapter; `admission` bounds the
//! binds taken on and orders each node's Bindings. [`Extender`] ties them:
//! filter and prioritize read a snapshot, a GPU pod's filter keeping a
//! place for its bind; binds run concurrently, each planning and reserving
//! its GPUs in one step under the index's lock, and a node's Bindings go
//! one after the other in the order of their assume times. A bind makes
//! one write: the Binding, carrying the assignment as its annotations,
//! which the API server copies onto the pod in the update that sets its
//! node, so no pod ever has one without the other and a failed Binding
//! leaves nothing to undo.

mod admission;
mod cluster;
#[cfg(test)]
mod cluster_tests;
pub(crate) mod config;
mod error;
mod index;
mod metrics;
mod plan;
mod preempt;
mod server;
#[cfg(test)]
mod test_pods;
pub mod wire;

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use admission::{InFlight, NodeTicket};
pub use cluster::{BindError, Binder, KubeBinder, Reflectors};
pub use config::ExtenderConfig;
pub use error::RequestError;
use index::Stage;
pub use index::{Index, PodName, pod_name};
pub use plan::Planner;
pub use server::{ReadyError, ask_ready, start};

use k8s_openapi::api::core::v1::Pod;
use wire::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderFilterResult, ExtenderPreemptionArgs,
    ExtenderPreemptionResult, HostPriority, NodeList,
};

pub struct Extender<B> {
    planner: Planner,
    index: Arc<RwLock<Index>>,
    binder: B,
    in_flight: InFlight,
    /// How long a GPU pod's filter waits for a bind's place.
    filter_wait: Duration,
    /// `extender.choose_at_filter`.
    choose_at_filter: bool,
    bind_timeout: Duration,
    /// How long a placement not yet seen bound counts: a nomination, or a
    /// bind that ended without knowing whether its Binding landed.
    reservation_ttl: Duration,
    /// What `/metrics` reports.
    metrics: metrics::ExtenderMetrics,
}

/// The highest score of a node other than the best: two points below it,
/// which at the shipped weight (100; the scheduler adds score × weight ×
/// 10) is 2,000, more than the score plugins the shipped profile leaves on
/// can add together (TaintToleration 3, NodeAffinity 2, PodTopologySpread
/// 2, InterPodAffinity 2, ImageLocality 1, VolumeBinding 1,
/// DynamicResources 2: at most 1,300).
const RUNNER_UP: i64 = wire::MAX_SCORE - 2;

/// How often a bind re-reads and re-plans a pod that changed under it.
const BIND_ATTEMPTS: usize = 3;

/// The share of `bind_timeout` a bind keeps for finding out whether a
/// Binding without an answer landed.
const CHECK_SHARE: u32 = 4;

/// A bind's reservation while the bind runs. Unless the bind settled it,
/// it ends at once if no Binding was sent, or becomes a nomination that
/// expires if one may have landed: when the bind returns early (refused,
/// nothing to do, or the Binding's fate unknown), and when its future is
/// dropped (kube-scheduler hung up at its `httpTimeout`, and axum dropped
/// the handler).
struct BindReservation<'a> {
    index: &'a RwLock<Index>,
    key: &'a PodName,
    ttl: Duration,
    binding_sent: bool,
    settled: bool,
    /// Set once the bind returned: a guard dropped without it went with
    /// the bind's future, so its caller is gone.
    returned: bool,
}

impl Drop for BindReservation<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let key = self.key;
        match (self.returned, self.binding_sent) {
            (false, false) => tracing::warn!(pod = ?key,
                "bind abandoned by its caller before its Binding; its GPU reservation ends"),
            (false, true) => tracing::warn!(pod = ?key,
                "bind abandoned by its caller after its Binding was sent; its GPU reservation \
                 stays until the pod is seen bound or the reservation expires"),
            (true, true) => tracing::info!(pod = ?key,
                "whether the Binding landed is unknown; the GPU reservation stays until the \
                 pod is seen bound or the reservation expires"),
            (true, false) => tracing::debug!(pod = ?key,
                "bind ended without a Binding; its GPU reservation, if any, ends"),
        }
        let mut ix = self.index.write().expect("index lock poisoned");
        if self.binding_sent {
            ix.demote(key, Instant::now() + self.ttl);
        } else {
            ix.release(key);
        }
    }
}

impl<B: Binder> Extender<B> {
    pub fn new(config: &ExtenderConfig, index: Arc<RwLock<Index>>, binder: B) -> Self {
        Extender {
            planner: Planner::new(&config.resource_domain, config.policy),
            index,
            binder,
            // A filtered pod's place is kept as long as its nomination.
            in_flight: InFlight::new(
                config.binds_queued(),
                config.max_binds_in_flight,
                Duration::from_millis(config.reservation_ttl_ms),
            ),
            filter_wait: Duration::from_millis(config.filter_wait_ms),
            choose_at_filter: config.choose_at_filter,
            bind_timeout: Duration::from_millis(config.bind_timeout_ms),
            reservation_ttl: Duration::from_millis(config.reservation_ttl_ms),
            metrics: metrics::ExtenderMetrics::default(),
        }
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Index> {
        self.index.write().expect("index lock poisoned")
    }

    /// The index with the reservations that are over ended, and `pod`'s
    /// own nomination ended too: a pod filtered or scored again is judged
    /// without its earlier guess.
    fn fresh(&self, pod: &Pod) -> std::sync::RwLockWriteGuard<'_, Index> {
        let mut ix = self.write();
        ix.expire(Instant::now());
        ix.release_nomination(&index::pod_name(pod));
        ix
    }

    /// Counts `pod` on `node`, where the scheduler will bind it (the one
    /// node left, or the one scored highest), until its bind replaces the
    /// nomination, it is filtered again, or the nomination expires: the
    /// scheduler filters the next pods before this one's bind arrives.
    fn nominate(&self, ix: &mut Index, pod: &Pod, node: &str) {
        if let Ok(Some(plan)) = self.planner.plan_bind(ix, pod, node, 0) {
            let until = Instant::now() + self.reservation_ttl;
            ix.reserve(plan.reserved, Stage::Nominated, until);
        }
    }

    /// The nodes where the pod fits. A GPU pod's filter first waits up to
    /// `filter_wait_ms` for a place for its bind and keeps it (see
    /// `admission`), answering a retryable error if none frees.
    pub async fn filter(&self, args: &ExtenderArgs) -> Result<ExtenderFilterResult, RequestError> {
        let Some(pod) = &args.pod else {
            return Err(RequestError::NoPod {
                verb: server::Verb::Filter.name(),
            });
        };
        let names = args.names();
        let mut result = ExtenderFilterResult::default();
        let mut passed: Vec<String> = Vec::new();
        match self.planner.asks(pod) {
            // Not ours to judge: every node passes, nothing is read.
            None => passed = names,
            Some(asks) => {
                if !self.index.read().expect("index lock poisoned").synced() {
                    return Err(RequestError::Filter(Box::new(RequestError::NotSynced)));
                }
                let key = index::pod_name(pod);
                let start = Instant::now();
                if let Err(busy) = self.in_flight.expect(&key, self.filter_wait).await {
                    tracing::info!(pod = ?key, error = %busy, "filter refused: no place for a bind");
                    return Err(RequestError::Filter(Box::new(busy.into())));
                }
                let waited_us = start.elapsed().as_micros();
                let mut ix = self.fresh(pod);
                let mut ranks = Vec::new();
                for name in names {
                    match self.planner.fits(&ix, &name, &asks) {
                        Ok(rank) => {
                            passed.push(name);
                            ranks.push(Some(rank));
                        }
                        Err(refusal) if refusal.never => {
                            result
                                .failed_and_unresolvable_nodes
                                .insert(name, refusal.reason);
                        }
                        Err(refusal) => {
                            result.failed_nodes.insert(name, refusal.reason);
                        }
                    }
                }
                if self.choose_at_filter
                    && passed.len() > 1
                    && let Some(b) = best_of(&ranks, &passed)
                {
                    passed = vec![passed.swap_remove(b)];
                }
                // One node left: the scheduler binds there without asking
                // for scores.
                match passed.as_slice() {
                    [] => self.in_flight.unexpect(&key),
                    [only] => self.nominate(&mut ix, pod, only),
                    _ => {}
                }
                let took_us = start.elapsed().as_micros();
                tracing::debug!(pod = ?key, passed = passed.len(), waited_us, took_us, "filtered");
            }
        }
        // Answer in the shape asked: names for a node-cache-capable
        // scheduler, the Node objects themselves otherwise.
        match &args.nodes {
            Some(list) if args.node_names.is_none() => {
                let passed: HashSet<&str> = passed.iter().map(String::as_str).collect();
                let items = list
                    .items
                    .iter()
                    .filter(|n| passed.contains(wire::node_name(n).as_str()))
                    .cloned()
                    .collect();
                result.nodes = Some(NodeList { items });
            }
            _ => result.node_names = Some(passed),
        }
        Ok(result)
    }

    /// Why the extender cannot place GPU pods now (a kind not listed yet,
    /// or listed again since its watch failed), each with why; empty when
    /// it can: for `/readyz`.
    pub fn stale(&self) -> Vec<String> {
        self.index.read().expect("index lock poisoned").stale()
    }

    /// Ranks the nodes under the policy ([`Planner::rank`]) and answers
    /// the best one [`wire::MAX_SCORE`] and every other node its policy
    /// score capped at [`RUNNER_UP`], so that the scheduler takes the node
    /// the policy chose and nominated, not one tied with it at random.
    pub fn prioritize(&self, args: &ExtenderArgs) -> Result<Vec<HostPriority>, RequestError> {
        let pod = args.pod.as_ref().ok_or(RequestError::NoPod {
            verb: server::Verb::Prioritize.name(),
        })?;
        let names = args.names();
        let Some(asks) = self.planner.asks(pod) else {
            let zero = |host| HostPriority { host, score: 0 };
            return Ok(names.into_iter().map(zero).collect());
        };
        let start = Instant::now();
        let mut ix = self.fresh(pod);
        let ranks: Vec<_> = names
            .iter()
            .map(|host| self.planner.rank(&ix, host, &asks))
            .collect();
        let best = best_of(&ranks, &names);
        if let Some(b) = best {
            self.nominate(&mut ix, pod, &names[b]);
        }
        drop(ix);
        let took_us = start.elapsed().as_micros();
        tracing::debug!(pod = ?index::pod_name(pod), nodes = names.len(), took_us, "prioritized");
        Ok(names
            .into_iter()
            .zip(ranks)
            .enumerate()
            .map(|(i, (host, rank))| {
                let score = if Some(i) == best {
                    wire::MAX_SCORE
                } else {
                    rank.map_or(0, |r| i64::from(r.score).min(RUNNER_UP))
                };
                HostPriority { host, score }
            })
            .collect())
    }

    /// Of the nodes where kube-scheduler would preempt for the pod, those
    /// where evicting pods of lower priority makes room on the GPUs as
    /// the filter places it, each with the victims that do
    /// ([`preempt`]). A pod asking no GPU keeps the scheduler's choice.
    pub fn preempt(
        &self,
        args: &ExtenderPreemptionArgs,
    ) -> Result<ExtenderPreemptionResult, RequestError> {
        let pod = args.pod.as_ref().ok_or(RequestError::NoPod {
            verb: server::Verb::Preempt.name(),
        })?;
        let offered = args.candidates();
        let Some(asking) = self.planner.asks(pod).filter(|a| plan::asks_gpus(&a.asks)) else {
            return Ok(ExtenderPreemptionResult {
                node_name_to_meta_victims: offered,
            });
        };
        // Reservations over, and the pod's own nomination (it is weighed
        // anew), end first; the search then only reads.
        drop(self.fresh(pod));
        let ix = self.index.read().expect("index lock poisoned");
        if !ix.synced() {
            return Err(RequestError::NotSynced);
        }
        let start = Instant::now();
        let mut budget = preempt::CHECKS_PER_REQUEST;
        let mut kept = std::collections::BTreeMap::new();
        let mut chosen = Vec::new();
        for (node, theirs) in &offered {
            let uids: Vec<&str> = theirs.pods.iter().map(|p| p.uid.as_str()).collect();
            let Some(v) = preempt::victims(&ix, node, &asking, &uids, &mut budget) else {
                continue;
            };
            // No victim needed for the GPUs: what the node lacks is not
            // weighed here, and the scheduler's own choice stands (it
            // takes a kept node without victims for an error).
            if v.pods.is_empty() {
                kept.insert(node.clone(), theirs.clone());
                continue;
            }
            let pods = v
                .pods
                .iter()
                .map(|(_, uid)| wire::MetaPod { uid: uid.clone() });
            let victims = wire::MetaVictims {
                pods: pods.collect(),
                num_pdb_violations: v.budget_violations,
            };
            kept.insert(node.clone(), victims);
            let names: Vec<String> = v
                .pods
                .iter()
                .map(|(k, _)| format!("{}/{}", k.0, k.1))
                .collect();
            chosen.push(format!("{node}: {}", names.join(", ")));
        }
        drop(ix);
        tracing::info!(pod = ?asking.key, offered = offered.len(), kept = kept.len(),
            took_us = start.elapsed().as_micros(), victims = ?chosen, "preemption weighed");
        Ok(ExtenderPreemptionResult {
            node_name_to_meta_victims: kept,
        })
    }

    /// Places the pod's containers on GPUs of `args.node` and binds it
    /// with the assignment, answering within `bind_timeout_ms`. On failure
    /// nothing stays reserved, except where the Binding's fate is unknown:
    /// then the reservation lives on as an expiring nomination.
    pub async fn bind(&self, args: &ExtenderBindingArgs) -> Result<(), RequestError> {
        let start = Instant::now();
        let deadline = start + self.bind_timeout;
        let key: PodName = (args.pod_namespace.clone(), args.pod_name.clone());
        let who = format!("pod {}/{}", key.0, key.1);
        let result = match self.in_flight.admit(&key) {
            Ok(_admitted) => self.bind_admitted(&key, args, deadline).await,
            Err(busy) => Err(busy.into()),
        };
        let took_ms = start.elapsed().as_millis();
        match &result {
            Ok(()) => tracing::info!(pod = %who, node = %args.node, took_ms, "bound"),
            Err(e) => {
                tracing::warn!(pod = %who, node = %args.node, error = %e, took_ms, "bind refused")
            }
        }
        result.map_err(|reason| RequestError::Bind {
            pod: key,
            node: args.node.clone(),
            reason: Box::new(reason),
        })
    }

    /// When a bind's write must be sent by: early enough to leave time to
    /// check whether it landed.
    fn writes_end(&self, deadline: Instant) -> Instant {
        deadline - self.bind_timeout / CHECK_SHARE
    }

    async fn within<T>(
        &self,
        deadline: Instant,
        call: impl Future<Output = Result<T, BindError>>,
    ) -> Result<T, BindError> {
        tokio::time::timeout_at(deadline.into(), call)
            .await
            .unwrap_or_else(|_| Err(BindError::Api("no answer in time".into())))
    }

    async fn bind_admitted(
        &self,
        key: &PodName,
        args: &ExtenderBindingArgs,
        deadline: Instant,
    ) -> Result<(), RequestError> {
        // A stale index may count GPUs free that a pod bound meanwhile holds.
        if !self.index.read().expect("index lock poisoned").synced() {
            return Err(RequestError::NotSynced);
        }
        // A bind that waited for its turn past its write's time has none
        // left to write and check.
        let writes_end = self.writes_end(deadline);
        let queued = Instant::now();
        let turn = self.in_flight.running.acquire();
        let Ok(Ok(_turn)) = tokio::time::timeout_at(writes_end.into(), turn).await else {
            return Err(RequestError::QueuedTooLong);
        };
        let queued = queued.elapsed();
        let mut held = BindReservation {
            index: &self.index,
            key,
            ttl: self.reservation_ttl,
            binding_sent: false,
            settled: false,
            returned: false,
        };
        let result = self.bind_held(&mut held, args, deadline, queued).await;
        held.returned = true;
        result
    }

    /// Binds the pod with its plan: up to [`BIND_ATTEMPTS`] tries, each
    /// reading the pod again after a Binding that found it changed (which
    /// changed nothing), all under the node's one ticket, taken with the
    /// first plan so that its assume time stays for every try. `queued`:
    /// how long the bind waited for `max_binds_in_flight`, for the log that
    /// breaks a bind's time down.
    async fn bind_held(
        &self,
        held: &mut BindReservation<'_>,
        args: &ExtenderBindingArgs,
        deadline: Instant,
        queued: Duration,
    ) -> Result<(), RequestError> {
        let key = held.key;
        let start = Instant::now();
        let writes_end = self.writes_end(deadline);
        let node = args.node.as_str();
        let mut ticket = None;
        let mut in_turn = false;
        let mut attempts = 0;
        loop {
            let pod = self
                .pod_to_bind(key, args, attempts == 0, writes_end)
                .await?;
            if let Some(bound) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
                // A retried bind after one that worked is answered the same.
                return if bound == node {
                    Ok(())
                } else {
                    Err(RequestError::BoundElsewhere(bound.to_owned()))
                };
            }
            let plan = self.plan_and_reserve(&pod, node, &mut ticket, deadline)?;
            let planned_at = Instant::now();
            if !in_turn {
                let ticket = ticket.as_ref().expect("planning takes the node's ticket");
                // No Binding was sent: the guard ends the reservation.
                if !ticket.turn(writes_end).await {
                    return Err(RequestError::NodeLineTooLong);
                }
                in_turn = true;
            }
            let annotations = plan.map(|p| p.annotations).unwrap_or_default();
            let rv = pod.metadata.resource_version.as_deref();
            held.binding_sent = true;
            let sent_at = Instant::now();
            let binding = self.binder.bind(key, &args.pod_uid, rv, node, &annotations);
            let e = match self.within(writes_end, binding).await {
                Ok(()) => {
                    held.settled = true;
                    tracing::debug!(pod = ?key, queued_us = queued.as_micros(),
                        plan_us = (planned_at - start).as_micros(),
                        turn_us = (sent_at - planned_at).as_micros(),
                        binding_us = sent_at.elapsed().as_micros(), "bind steps");
                    return Ok(());
                }
                Err(e) => e,
            };
            attempts += 1;
            if e != BindError::Conflict || attempts == BIND_ATTEMPTS {
                return self.settle_failed_binding(held, node, e, deadline).await;
            }
            // The pod moved on (or was bound) since it was read: the
            // Binding changed nothing, so plan again on the pod as it is.
            held.binding_sent = false;
            self.write().release(key);
        }
    }

    /// The pod to bind, refused when it is not the one the scheduler
    /// bound. The first try takes the pod as the reflector showed it; if
    /// that is behind, the Binding's precondition fails and the next try
    /// reads it from the API server.
    async fn pod_to_bind(
        &self,
        key: &PodName,
        args: &ExtenderBindingArgs,
        first_try: bool,
        writes_end: Instant,
    ) -> Result<Arc<Pod>, RequestError> {
        let cached = first_try
            .then(|| {
                self.index
                    .read()
                    .expect("index lock poisoned")
                    .unbound_pod(key)
            })
            .flatten()
            .filter(|p| args.pod_uid.is_empty() || p.metadata.uid.as_ref() == Some(&args.pod_uid));
        let pod = match cached {
            Some(pod) => pod,
            None => self
                .within(writes_end, self.binder.get_pod(key))
                .await
                .map_err(RequestError::ReadPod)?
                .map(Arc::new)
                .ok_or(RequestError::PodGone)?,
        };
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        if !args.pod_uid.is_empty() && uid != args.pod_uid {
            return Err(RequestError::Replaced {
                now: uid.to_owned(),
                scheduled: args.pod_uid.clone(),
            });
        }
        Ok(pod)
    }

    /// Plans the pod on `node` and reserves its GPUs until the bind's
    /// deadline, in one step under the index's lock so that no other bind
    /// plans on the same free GPUs; the node's ticket is taken there too
    /// on the first try.
    fn plan_and_reserve<'a>(
        &'a self,
        pod: &Pod,
        node: &str,
        ticket: &mut Option<NodeTicket<'a>>,
        deadline: Instant,
    ) -> Result<Option<plan::BindPlan>, RequestError> {
        // The pod's own nomination (wherever it was) gives way to the
        // node the scheduler chose.
        let mut ix = self.fresh(pod);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let assumed = ticket
            .get_or_insert_with(|| self.in_flight.ticket(node, now))
            .assumed;
        let plan = self.planner.plan_bind(&ix, pod, node, assumed)?;
        if let Some(p) = &plan {
            let until = deadline + self.reservation_ttl;
            ix.reserve(p.reserved.clone(), Stage::Binding, until);
        }
        Ok(plan)
    }

    /// After a Binding that answered an error. It may have landed although
    /// its answer did not: a pod found bound to the node is bound, with
    /// its assignment, whatever the Binding answered; a pod not bound has
    /// neither, and loses its reservation.
    async fn settle_failed_binding(
        &self,
        held: &mut BindReservation<'_>,
        node: &str,
        e: BindError,
        deadline: Instant,
    ) -> Result<(), RequestError> {
        let key = held.key;
        let pod = match self.within(deadline, self.binder.get_pod(key)).await {
            Ok(Some(pod)) => pod,
            Ok(None) => {
                held.settled = true;
                self.write().release(key);
                return Err(RequestError::BindingPodGone(e));
            }
            Err(check) => {
                // Unknown: not released (its GPUs may be in use); the
                // guard leaves a nomination that expires.
                return Err(RequestError::BindingUnknown { failed: e, check });
            }
        };
        if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node) {
            held.settled = true;
            tracing::info!(pod = ?key, %node, error = %e, "the Binding landed although its answer did not");
            return Ok(());
        }
        held.settled = true;
        self.write().release(key);
        Err(RequestError::Binding(e))
    }
}

/// Of `names` ranked `ranks`, the index of the best, the first of the best
/// in name order: the same choice for the same state.
fn best_of(ranks: &[Option<plan::Rank>], names: &[String]) -> Option<usize> {
    (0..names.len())
        .filter(|&i| ranks[i].is_some())
        .max_by_key(|&i| (ranks[i], std::cmp::Reverse(&names[i])))
}

#[derive(Debug, thiserror::Error)]
pub enum ExtenderError {
    #[error(transparent)]
    Client(#[from] crate::net::kube_client::KubeClientError),
    #[error("cannot listen on {addr} (config key `extender.listen`): {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
}

/// A started extender: where it listens and the index its reflectors keep.
/// The reflectors stop when it is dropped.
pub struct Started {
    pub addr: std::net::SocketAddr,
    index: Arc<RwLock<Index>>,
    _reflectors: Reflectors,
}

impl Started {
    /// Whether the reflectors have listed nodes and pods once: until then
    /// the filter refuses GPU pods as "not synced", so a caller that
    /// schedules at once (the demo) waits for this first.
    pub fn synced(&self) -> bool {
        self.index.read().is_ok_and(|ix| ix.synced())
    }
}

/// Starts the reflectors and the HTTP server.
pub async fn launch(config: &ExtenderConfig) -> Result<Started, ExtenderError> {
    let client =
        crate::net::kube_client::from_kubeconfig(&config.kubeconfig, "extender.kubeconfig").await?;
    let index = Arc::new(RwLock::new(Index::new(&config.resource_domain)));
    let reflectors = Reflectors::start(&client, index.clone());
    let extender = Arc::new(Extender::new(
        config,
        index.clone(),
        KubeBinder::new(client),
    ));
    let addr = start(config, extender)
        .await
        .map_err(|source| ExtenderError::Listen {
            addr: config.listen.clone(),
            source,
        })?;
    Ok(Started {
        addr,
        index,
        _reflectors: reflectors,
    })
}

/// Runs the extender until `stop` resolves.
pub async fn run(
    config: ExtenderConfig,
    stop: impl Future<Output = ()>,
) -> Result<(), ExtenderError> {
    let started = launch(&config).await?;
    tracing::info!(addr = %started.addr, policy = ?config.policy, "scheduler extender listening");
    stop.await;
    Ok(())
}
