//! What holds `/readyz` back besides the resources' own registration: a
//! child of the supervisor that is not up yet, keeps failing, or is behind
//! the API server. Marks are keyed by the [`Child`] itself, so the child
//! that sets a mark and the supervisor that clears it on the child's way
//! out name it the same way: a child that dies without cleaning up (a
//! panic skips its `post_stop`) leaves nothing behind once its supervisor
//! releases it.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::rules::device::Resource;

/// The supervisor's children, one value per running actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Child {
    Matcher,
    Plugin(Resource),
    Inventory,
    Watcher,
    Health,
    Enforcement,
    Mps,
    Usage,
    Dra,
}

impl std::fmt::Display for Child {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Child::Matcher => f.write_str("pod matcher"),
            Child::Plugin(r) => write!(f, "plugin {r}"),
            Child::Inventory => f.write_str("inventory publisher"),
            Child::Watcher => f.write_str("kubelet watcher"),
            Child::Health => f.write_str("health monitor"),
            Child::Enforcement => f.write_str("enforcement sweeper"),
            Child::Mps => f.write_str("mps control daemons"),
            Child::Usage => f.write_str("usage monitor"),
            Child::Dra => f.write_str("DRA plugin"),
        }
    }
}

/// Why a child holds readiness back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Hold {
    /// Not up yet (the pod matcher before its pod cache synced).
    Waiting,
    /// Restarted again and again.
    Failing,
    /// Behind the API server (the pod matcher's watch failed and the list
    /// after it has not arrived), so an Allocate waits and may fail.
    Stale,
}

/// The children holding readiness back, each with why.
#[derive(Debug, Default)]
pub(crate) struct Readiness {
    held: Mutex<BTreeMap<(Child, Hold), String>>,
}

impl Readiness {
    /// Marks `child` unready for `hold` with the reason `why`, or clears
    /// that mark with None.
    pub(crate) fn hold(&self, child: Child, hold: Hold, why: Option<String>) {
        let mut held = self.held.lock().expect("readiness lock");
        match why {
            Some(why) => held.insert((child, hold), why),
            None => held.remove(&(child, hold)),
        };
    }

    /// Clears every mark of `child` (it stopped, on purpose or not; a
    /// successor marks its own).
    pub(crate) fn release(&self, child: Child) {
        let mut held = self.held.lock().expect("readiness lock");
        held.retain(|(c, _), _| *c != child);
    }

    /// `child: why` for each mark, in the children's order.
    pub(crate) fn held(&self) -> Vec<String> {
        let held = self.held.lock().expect("readiness lock");
        held.iter()
            .map(|((child, _), why)| format!("{child}: {why}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_is_cleared_by_its_kind_or_with_its_child() {
        let r = Readiness::default();
        r.hold(Child::Matcher, Hold::Waiting, Some("not synced".into()));
        r.hold(Child::Matcher, Hold::Failing, Some("failed".into()));
        r.hold(Child::Matcher, Hold::Waiting, None);
        assert_eq!(r.held(), ["pod matcher: failed"]);
        r.hold(Child::Enforcement, Hold::Waiting, Some("no library".into()));
        r.release(Child::Matcher);
        assert_eq!(r.held(), ["enforcement sweeper: no library"]);
        r.release(Child::Enforcement);
        assert!(r.held().is_empty());
    }
}
