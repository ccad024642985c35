//! Which binds the extender takes on and in what order they write.
//!
//! Places: at most `max` binds at once (`extender.max_binds_queued`),
//! counting the pods that passed the filter and whose bind has not come
//! yet, one per pod. The filter waits a while for a place
//! (`extender.filter_wait_ms`) and takes it for its pod: kube-scheduler
//! schedules one pod at a time and starts a pod's bind only after its
//! filter, so a filter that waits paces the scheduler to the binds, and
//! a bind that comes finds its place kept. A bind without a place (its
//! filter's place expired) past the bound is refused at once rather
//! than held: kube-scheduler sends its pod to the backoff queue (an
//! extender's bind error is a scheduling error, not Unschedulable).
//!
//! Order: a node's Bindings go out in the order of the assume times
//! their binds wrote, one after the previous one is answered, since the
//! node's matcher serves the kubelet's Allocates in assume-time order
//! while the kubelet admits pods in the order they were bound there.
//! Everything before the Binding (reading the pod, planning, the
//! assignment's patch) runs beside the binds ahead on the same node: an
//! unbound pod is no candidate of any node's matcher, and the plan counts
//! the GPUs of the binds ahead, which hold their reservations meanwhile.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::index::PodName;

pub(super) struct InFlight {
    max: usize,
    /// How long a place a filter took waits for its pod's bind.
    kept: Duration,
    places: Mutex<Places>,
    /// Signalled when a place frees.
    freed: Notify,
    /// `extender.max_binds_in_flight`: admitted binds making requests.
    pub(super) running: tokio::sync::Semaphore,
    /// The binds of each node with a bind between its plan and the end
    /// of its Binding; an entry goes when its last one ends, so there are
    /// at most `max`.
    nodes: Mutex<HashMap<String, NodeLine>>,
}

#[derive(Default)]
struct Places {
    binding: HashSet<PodName>,
    /// Pods that passed the filter, until when their place is kept.
    expected: HashMap<PodName, Instant>,
}

impl Places {
    /// Places taken at `now`, places kept past their time let go.
    fn taken(&mut self, now: Instant) -> usize {
        self.expected.retain(|_, until| *until > now);
        self.binding.len() + self.expected.len()
    }
}

#[derive(Default)]
struct NodeLine {
    next: u64,
    /// Tickets not yet done, in the order their Bindings go.
    waiting: BTreeSet<u64>,
    last_assumed: u128,
    turn: Arc<Notify>,
}

#[derive(Debug, thiserror::Error)]
pub enum Busy {
    #[error(
        "{0} binds are admitted or expected, the most extender.max_binds_queued allows; \
         the scheduler tries again after its backoff"
    )]
    Full(usize),
    #[error("another bind of this pod is in flight")]
    Pod,
}

/// A bind's place; freed when dropped.
pub(super) struct Admitted<'a> {
    in_flight: &'a InFlight,
    key: PodName,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        let mut places = self.in_flight.places.lock().expect("places lock poisoned");
        places.binding.remove(&self.key);
        drop(places);
        self.in_flight.freed.notify_waiters();
    }
}

/// A bind's place in its node's line, with the assume time it writes;
/// leaves the line when dropped.
pub(super) struct NodeTicket<'a> {
    in_flight: &'a InFlight,
    node: String,
    number: u64,
    pub(super) assumed: u128,
    turn: Arc<Notify>,
}

impl Drop for NodeTicket<'_> {
    fn drop(&mut self) {
        let mut nodes = self.in_flight.nodes.lock().expect("nodes lock poisoned");
        let Some(line) = nodes.get_mut(&self.node) else {
            return;
        };
        line.waiting.remove(&self.number);
        if line.waiting.is_empty() {
            nodes.remove(&self.node);
        }
        drop(nodes);
        self.turn.notify_waiters();
    }
}

impl NodeTicket<'_> {
    /// Waits until `until` for every bind ahead on the node to be done
    /// with its Binding; false when the time ran out.
    pub(super) async fn turn(&self, until: Instant) -> bool {
        loop {
            let next = self.turn.notified();
            tokio::pin!(next);
            next.as_mut().enable();
            let first = {
                let nodes = self.in_flight.nodes.lock().expect("nodes lock poisoned");
                nodes
                    .get(&self.node)
                    .and_then(|l| l.waiting.first().copied())
            };
            if first == Some(self.number) {
                return true;
            }
            if tokio::time::timeout_at(until.into(), next).await.is_err() {
                return false;
            }
        }
    }
}

impl InFlight {
    pub(super) fn new(max: usize, running: usize, kept: Duration) -> InFlight {
        InFlight {
            max,
            kept,
            places: Mutex::default(),
            freed: Notify::new(),
            running: tokio::sync::Semaphore::new(running),
            nodes: Mutex::default(),
        }
    }

    /// The bind of `key` takes its place: the one its filter kept, else a
    /// free one.
    pub(super) fn admit(&self, key: &PodName) -> Result<Admitted<'_>, Busy> {
        let now = Instant::now();
        let mut places = self.places.lock().expect("places lock poisoned");
        if places.binding.contains(key) {
            return Err(Busy::Pod);
        }
        let kept = places.expected.remove(key).is_some_and(|until| until > now);
        let taken = places.taken(now);
        if !kept && taken >= self.max {
            return Err(Busy::Full(taken));
        }
        places.binding.insert(key.clone());
        Ok(Admitted {
            in_flight: self,
            key: key.clone(),
        })
    }

    /// Keeps a place for the bind of `key`, which passed the filter,
    /// waiting up to `wait` for one to free.
    pub(super) async fn expect(&self, key: &PodName, wait: Duration) -> Result<(), Busy> {
        let until = Instant::now() + wait;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let (taken, next_expiry) = {
                let now = Instant::now();
                let mut places = self.places.lock().expect("places lock poisoned");
                let renewed = places.expected.contains_key(key);
                let taken = places.taken(now);
                if renewed || taken < self.max {
                    places.expected.insert(key.clone(), now + self.kept);
                    return Ok(());
                }
                (taken, places.expected.values().min().copied())
            };
            let wake = next_expiry.map_or(until, |e| e.min(until));
            if tokio::time::timeout_at(wake.into(), freed).await.is_err() && wake >= until {
                return Err(Busy::Full(taken));
            }
        }
    }

    /// Lets go of the place kept for `key`: its filter passed no node.
    pub(super) fn unexpect(&self, key: &PodName) {
        let mut places = self.places.lock().expect("places lock poisoned");
        if places.expected.remove(key).is_some() {
            drop(places);
            self.freed.notify_waiters();
        }
    }

    /// The next place in `node`'s line, assuming at `now` (UnixNano) or
    /// just after the bind ahead: take it under the index's lock with the
    /// plan, so that a node's assume times rise in the line's order.
    pub(super) fn ticket(&self, node: &str, now: u128) -> NodeTicket<'_> {
        let mut nodes = self.nodes.lock().expect("nodes lock poisoned");
        let line = nodes.entry(node.to_owned()).or_default();
        let number = line.next;
        line.next += 1;
        line.waiting.insert(number);
        let assumed = now.max(line.last_assumed + 1);
        line.last_assumed = assumed;
        NodeTicket {
            in_flight: self,
            node: node.to_owned(),
            number,
            assumed,
            turn: line.turn.clone(),
        }
    }

    #[cfg(test)]
    pub(super) fn idle(&self) -> bool {
        let nodes = self.nodes.lock().expect("nodes lock poisoned");
        let places = self.places.lock().expect("places lock poisoned");
        nodes.is_empty() && places.binding.is_empty()
    }
}
