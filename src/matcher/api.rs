//! The typed handle the plugins call, and the matcher's messages. The
//! supervisor fills the handle when it (re)starts the matcher, so plugins
//! never hold a stale actor.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use ractor::{ActorRef, RpcReplyPort, call_t};

use super::matching::{Ask, Decision};

/// Where GetPreferredAllocation should take devices from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Steer {
    /// The GPUs the container will get (empty: no opinion).
    pub gpus: Vec<usize>,
    /// Per GPU: keep off it (whole and shared work do not mix).
    pub avoid: Vec<bool>,
}

pub enum MatcherMsg {
    /// Find, place and record the container an Allocate is for.
    Allocate(Ask, RpcReplyPort<Result<Decision, String>>),
    /// The same lookup, recording nothing, for GetPreferredAllocation.
    Prefer(Ask, RpcReplyPort<Steer>),
}

#[derive(Debug, Clone, Default)]
pub struct MatcherHandle(Arc<RwLock<Option<ActorRef<MatcherMsg>>>>);

/// GetPreferredAllocation must stay fast; without an answer by then the
/// plugin packs on its own.
pub(super) const PREFER_TIMEOUT: Duration = Duration::from_millis(500);

impl MatcherHandle {
    pub fn set(&self, actor: Option<ActorRef<MatcherMsg>>) {
        *self.0.write().expect("matcher handle poisoned") = actor;
    }

    fn actor(&self) -> Option<ActorRef<MatcherMsg>> {
        self.0.read().expect("matcher handle poisoned").clone()
    }

    /// `timeout` covers the matcher's own bounded waits plus its queue.
    pub async fn allocate(&self, ask: Ask, timeout: Duration) -> Result<Decision, String> {
        let actor = self
            .actor()
            .ok_or("the pod matcher is not running (see the log for why)")?;
        let ms = timeout.as_millis() as u64;
        call_t!(actor, MatcherMsg::Allocate, ms, ask)
            .map_err(|e| format!("the pod matcher did not answer: {e}"))?
    }

    pub async fn prefer(&self, ask: Ask) -> Steer {
        let Some(actor) = self.actor() else {
            return Steer::default();
        };
        let ms = PREFER_TIMEOUT.as_millis() as u64;
        call_t!(actor, MatcherMsg::Prefer, ms, ask).unwrap_or_default()
    }
}
