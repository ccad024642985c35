//! Healthy / Unhealthy from rounds of checks. A failing check makes a GPU
//! unhealthy at once; it is healthy again only after passing every check for
//! the recovery window, so a flapping GPU does not flap the node.

use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub(crate) struct HealthTracker {
    recovery: Duration,
    last_failure: Vec<Option<Instant>>,
    healthy: Vec<bool>,
    /// Whether a round was observed: the first one is news even when all
    /// pass, since whoever listens may hold an earlier monitor's view (a
    /// reload restarts the monitor, maybe while a GPU was unhealthy).
    observed: bool,
}

impl HealthTracker {
    pub(crate) fn new(gpus: usize, recovery: Duration) -> Self {
        HealthTracker {
            recovery,
            last_failure: vec![None; gpus],
            healthy: vec![true; gpus],
            observed: false,
        }
    }

    pub(crate) fn healthy(&self) -> Arc<[bool]> {
        self.healthy.clone().into()
    }

    /// Applies one round (`failing[g]` is true when GPU g failed a check);
    /// returns the new health when it changed, and after the first round.
    pub(crate) fn observe(&mut self, failing: &[bool], now: Instant) -> Option<Arc<[bool]>> {
        let before = self.healthy.clone();
        for (g, &fails) in failing.iter().enumerate().take(self.healthy.len()) {
            if fails {
                self.last_failure[g] = Some(now);
                self.healthy[g] = false;
            } else if !self.healthy[g]
                && self.last_failure[g].is_none_or(|t| now.duration_since(t) >= self.recovery)
            {
                self.healthy[g] = true;
            }
        }
        let first = !std::mem::replace(&mut self.observed, true);
        (first || self.healthy != before).then(|| self.healthy())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fails_at_once_and_recovers_after_the_window() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut h = HealthTracker::new(2, Duration::from_secs(10));
        assert_eq!(
            h.observe(&[false, false], t0).as_deref(),
            Some(&[true, true][..]),
            "the first round is news"
        );
        assert_eq!(
            h.observe(&[true, false], t0 + s).as_deref(),
            Some(&[false, true][..])
        );
        assert_eq!(
            h.observe(&[false, false], t0 + 5 * s),
            None,
            "still in the window"
        );
        // Failing again restarts the window.
        assert_eq!(h.observe(&[true, false], t0 + 6 * s), None);
        assert_eq!(h.observe(&[false, false], t0 + 15 * s), None);
        assert_eq!(
            h.observe(&[false, false], t0 + 16 * s).as_deref(),
            Some(&[true, true][..])
        );
    }

    #[test]
    fn zero_window_recovers_on_the_next_passing_round() {
        let t0 = Instant::now();
        let mut h = HealthTracker::new(1, Duration::ZERO);
        assert!(h.observe(&[true], t0).is_some());
        assert_eq!(h.observe(&[false], t0).as_deref(), Some(&[true][..]));
    }
}
