//! Keeps one container's gpu-memory and gpu-core on one GPU when the plugin
//! runs without pod matching and so cannot see the container.
//!
//! The kubelet admits one container at a time and serves its resources back
//! to back, so the GPU of an unpaired shared grant is the best guess for the
//! container's other shared resource. It is only a hint for
//! GetPreferredAllocation; pod matching (SPEC §3) knows instead of guessing.

use std::sync::{Arc, Mutex};

use crate::device::Resource;

#[derive(Debug, Clone, Default)]
pub struct LastShared(Arc<Mutex<Option<(Resource, usize)>>>);

impl LastShared {
    /// Records a shared grant. A grant of the other shared resource closes
    /// the pair, so the next container starts without a guess.
    pub fn note(&self, resource: Resource, gpu: usize) {
        let mut last = self.0.lock().expect("pairing lock poisoned");
        *last = match *last {
            Some((other, _)) if other != resource => None,
            _ => Some((resource, gpu)),
        };
    }

    /// The GPU the other shared resource was just granted on, if any.
    pub fn partner_gpu(&self, resource: Resource) -> Option<usize> {
        let last = self.0.lock().expect("pairing lock poisoned");
        last.filter(|(other, _)| *other != resource)
            .map(|(_, gpu)| gpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_close_after_both_resources() {
        let p = LastShared::default();
        assert_eq!(p.partner_gpu(Resource::GpuCore), None);
        p.note(Resource::GpuMemory, 2);
        assert_eq!(p.partner_gpu(Resource::GpuCore), Some(2));
        assert_eq!(p.partner_gpu(Resource::GpuMemory), None);
        p.note(Resource::GpuCore, 2);
        assert_eq!(p.partner_gpu(Resource::GpuMemory), None);
        assert_eq!(p.partner_gpu(Resource::GpuCore), None);
        // Two memory-only containers: the newer grant is the guess.
        p.note(Resource::GpuMemory, 0);
        p.note(Resource::GpuMemory, 1);
        assert_eq!(p.partner_gpu(Resource::GpuCore), Some(1));
    }
}
