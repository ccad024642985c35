//! How a plugin learns which GPU a container gets: from the pod matcher
//! (SPEC §3), or, with `pod_matching = false`, from the device IDs alone.

use std::time::Duration;

use super::pairing::LastShared;
use crate::matcher::MatcherHandle;

#[derive(Debug, Clone)]
pub enum Placement {
    /// From the IDs, with the pairing hint for GetPreferredAllocation.
    Ids(LastShared),
    /// From the pod matcher, which may wait up to `wait` for a pod.
    Matcher {
        handle: MatcherHandle,
        wait: Duration,
    },
}

/// Beyond the matcher's own wait: its queue (one lookup at a time).
const QUEUE_SLACK: Duration = Duration::from_secs(5);

impl Placement {
    pub fn uses_matcher(&self) -> bool {
        matches!(self, Placement::Matcher { .. })
    }

    pub fn allocate_timeout(wait: Duration) -> Duration {
        wait + QUEUE_SLACK
    }
}
