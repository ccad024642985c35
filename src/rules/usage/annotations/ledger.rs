//! The ledger on a pod: what each of its containers was granted, written in
//! the annotation `<domain>/gpu-ledger` so that a restarted plugin (or an
//! operator with kubectl) knows without asking the kubelet.
//!
//! `{"<container>": {"gpus": ["GPU-…"], "gpu-memory": 1024, "ids": {…}}}`:
//! amounts are in the resource's own unit (MiB, percent of a GPU, GPUs);
//! `ids` holds a hash of the device IDs per resource, so an Allocate the
//! kubelet repeats is recognised and answered the same way.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::rules::device::Resource;

/// What one container was granted, as recorded: its GPUs, the amount of
/// each resource the kubelet served, and the digest of the device IDs it
/// was served with.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LedgerEntry {
    pub(crate) gpus: Vec<String>,
    #[serde(
        rename = "gpu-memory",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub(crate) memory: Option<u64>,
    #[serde(rename = "gpu-core", default, skip_serializing_if = "Option::is_none")]
    pub(crate) core: Option<u64>,
    #[serde(rename = "gpu-count", default, skip_serializing_if = "Option::is_none")]
    pub(crate) count: Option<u64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) ids: BTreeMap<Resource, String>,
}

impl LedgerEntry {
    pub(crate) fn amount(&self, r: Resource) -> Option<u64> {
        match r {
            Resource::GpuMemory => self.memory,
            Resource::GpuCore => self.core,
            Resource::GpuCount => self.count,
        }
    }

    pub(crate) fn set(&mut self, r: Resource, amount: u64, ids: String) {
        *self.slot(r) = Some(amount);
        self.ids.insert(r, ids);
    }

    fn slot(&mut self, r: Resource) -> &mut Option<u64> {
        match r {
            Resource::GpuMemory => &mut self.memory,
            Resource::GpuCore => &mut self.core,
            Resource::GpuCount => &mut self.count,
        }
    }

    /// Holds its GPUs whole (gpu-count) rather than a share of one.
    pub(crate) fn whole(&self) -> bool {
        self.count.is_some()
    }
}

/// Container name → what it was granted; and, never written, which of the
/// pod's accounting annotations were there but unreadable ([`Unread`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Ledger(
    pub(crate) BTreeMap<String, LedgerEntry>,
    #[serde(skip)] pub(crate) Unread,
);

/// Which of a pod's accounting annotations (its ledger, its assignment)
/// were present but could not be read. What such a pod holds is then not
/// known from them, so [`crate::rules::usage::pod_holdings`] counts its asks
/// failing closed. It travels with the ledger so that every reader of a
/// pod's usage (the matcher, its metrics, the extender) sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Unread {
    pub(crate) ledger: bool,
    pub(crate) assignment: bool,
}

impl Ledger {
    /// A missing annotation is an empty ledger; a malformed one is an error,
    /// which the caller must not read as "nothing held"
    /// ([`super::Records`] does it for every reader).
    pub(crate) fn parse(text: Option<&str>) -> Result<Ledger, serde_json::Error> {
        text.map_or(Ok(Ledger::default()), serde_json::from_str)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a ledger always serialises")
    }

    pub(crate) fn served(&self, container: &str, r: Resource) -> bool {
        self.0.get(container).is_some_and(|g| g.amount(r).is_some())
    }

    /// Forgets `container`'s grant of `r` (a restarted kubelet no longer
    /// holds it), and the container's entry once it holds nothing.
    pub(crate) fn void(&mut self, container: &str, r: Resource) {
        if let Some(grant) = self.0.get_mut(container) {
            *grant.slot(r) = None;
            grant.ids.remove(&r);
            if Resource::ALL.iter().all(|&r| grant.amount(r).is_none()) {
                self.0.remove(container);
            }
        }
    }

    /// Adds what `other` has and this one lacks: entries are only ever
    /// added, so the union of two views of a ledger is the newest one.
    pub(crate) fn merge(&mut self, other: &Ledger) {
        for (name, grant) in &other.0 {
            let mine = self.0.entry(name.clone()).or_default();
            if mine.gpus.is_empty() {
                mine.gpus = grant.gpus.clone();
            }
            for r in Resource::ALL {
                if let (None, Some(a)) = (mine.amount(r), grant.amount(r)) {
                    let ids = grant.ids.get(&r).cloned().unwrap_or_default();
                    mine.set(r, a, ids);
                }
            }
        }
    }
}

/// A short, stable digest of a set of device IDs (order does not matter:
/// the kubelet may list them in any order).
pub(crate) fn ids_digest<'a>(ids: impl Iterator<Item = &'a str>) -> String {
    let mut sorted: Vec<&str> = ids.collect();
    sorted.sort_unstable();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for id in sorted {
        for b in id.bytes().chain([0]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_merges() {
        let mut a = Ledger::default();
        let g = a.0.entry("app".into()).or_default();
        g.gpus = vec!["GPU-a".into()];
        g.set(
            Resource::GpuMemory,
            1024,
            ids_digest(["x", "y"].into_iter()),
        );
        let text = a.to_json();
        assert_eq!(Ledger::parse(Some(&text)).unwrap(), a);
        assert!(text.contains("\"gpu-memory\":1024"), "{text}");

        let mut b = Ledger::default();
        let g = b.0.entry("app".into()).or_default();
        g.gpus = vec!["GPU-a".into()];
        g.set(Resource::GpuCore, 30, "d".into());
        b.merge(&a);
        assert!(b.served("app", Resource::GpuMemory) && b.served("app", Resource::GpuCore));
        assert!(!b.served("other", Resource::GpuCore));
        assert_eq!(Ledger::parse(None).unwrap(), Ledger::default());
        assert!(Ledger::parse(Some("{not json")).is_err());
    }

    #[test]
    fn digest_ignores_order() {
        let one = ids_digest(["a", "b", "c"].into_iter());
        assert_eq!(one, ids_digest(["c", "a", "b"].into_iter()));
        assert_ne!(one, ids_digest(["a", "bc"].into_iter()));
        assert_eq!(one.len(), 16);
    }
}
