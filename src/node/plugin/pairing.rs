//! What the three plugins of one process know of the node when they run
//! without pod matching, and so see device IDs but never a container.
//!
//! - **Pairing.** The kubelet serves a container's resources back to back,
//!   so a container's second shared grant follows its first. Each shared
//!   resource keeps its latest grant with a sequence number; the partner of
//!   a grant of R is the other resource's latest grant if that is newer
//!   than R's own. A single-resource container (core only, or an app
//!   container reusing its init container's memory) then costs the next
//!   container at most a stale hint for its first grant, never its second.
//! - **Room.** Free units per GPU: for a resource, the kubelet's available
//!   IDs in its last GetPreferredAllocation, less the plugin's grants since.
//!   A container's first grant goes where the most of both resources stays
//!   free (the usage model's `Order::Roomiest`), since its second ask is
//!   not known yet.
//! - **Whole GPUs.** GPUs granted whole and not listed free by the kubelet
//!   since; shared hints keep off them, whole hints keep off GPUs carrying
//!   shared work while others are free.
//!
//! Pod matching knows all this instead of inferring it.

use std::sync::{Arc, Mutex};

use crate::node::matcher::Steer;
use crate::rules::device::{DeviceModel, DeviceRef, Resource, free};
use crate::rules::usage::{Candidate, Order, choose};

/// What the plugins of one process know of the node's grants, shared by
/// them (each holds a clone).
#[derive(Debug, Clone, Default)]
pub(crate) struct PairingBook(Arc<Mutex<Book>>);

#[derive(Debug, Default)]
struct Book {
    seq: u64,
    /// gpu-memory, gpu-core.
    shared: [SharedResource; 2],
    /// Per GPU: granted whole and not listed free since.
    whole: Vec<bool>,
}

/// What the book knows of one shared resource: its latest grant and room.
#[derive(Debug, Default)]
struct SharedResource {
    latest: Option<LatestGrant>,
    /// Per GPU: free units as far as the plugin knows, and all units.
    free: Vec<u32>,
    units: Vec<u32>,
}

/// A resource's latest grant, to pair the other resource's next one with.
#[derive(Debug, Clone, Copy)]
struct LatestGrant {
    seq: u64,
    /// `None` for a refused grant: it ends the pair, and pairs with nothing.
    gpu: Option<usize>,
    /// It had no partner, so it was certainly its container's first grant.
    opened: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "this container's {other} was just granted on {first}, which has too little {resource} \
     left, and the kubelet chose {second}: a container's shared resources must come from one \
     GPU (without pod matching the plugin cannot know a container's second ask when it places \
     the first)"
)]
pub(crate) struct SplitError {
    resource: Resource,
    other: Resource,
    first: String,
    second: String,
}

fn slot(resource: Resource) -> Option<usize> {
    match resource {
        Resource::GpuMemory => Some(0),
        Resource::GpuCore => Some(1),
        Resource::GpuCount => None,
    }
}

fn other(resource: Resource) -> Resource {
    match resource {
        Resource::GpuMemory => Resource::GpuCore,
        _ => Resource::GpuMemory,
    }
}

impl SharedResource {
    /// Sized for `model`'s GPUs, everything free until the kubelet says.
    fn resize_to(&mut self, model: &DeviceModel) {
        let gpus = model.gpus().len();
        if self.units.len() != gpus {
            self.units = (0..gpus).map(|g| model.units(g)).collect();
            self.free = self.units.clone();
        }
    }

    fn used(&self, gpu: usize) -> bool {
        self.free.get(gpu) < self.units.get(gpu)
    }
}

impl Book {
    /// The grant a grant of shared `resource` now would pair with.
    fn partner(&self, s: usize) -> Option<LatestGrant> {
        let own = self.shared[s].latest.map_or(0, |l| l.seq);
        self.shared[1 - s]
            .latest
            .filter(|l| l.seq > own && l.gpu.is_some())
    }

    /// The GPU for `size` units of slot `s` outside `avoid`: `partner`
    /// if it has room, else the one that keeps the most of both shared
    /// resources free, as a share of each GPU ([`Order::Roomiest`]);
    /// `None` when no GPU has room.
    fn roomiest(
        &self,
        s: usize,
        size: u32,
        avoid: &[bool],
        partner: Option<usize>,
    ) -> Option<usize> {
        let (this, that) = (&self.shared[s], &self.shared[1 - s]);
        let candidates = (0..this.units.len())
            .filter(|&g| !avoid[g] && this.free[g] >= size)
            .map(|g| {
                let mut c = Candidate {
                    gpu: g,
                    preferred: partner == Some(g),
                    ..Candidate::default()
                };
                c.left[s] = u64::from(this.free[g] - size);
                c.all[s] = u64::from(this.units[g]);
                if let (Some(&f), Some(&u)) = (that.free.get(g), that.units.get(g)) {
                    (c.left[1 - s], c.all[1 - s]) = (u64::from(f), u64::from(u));
                }
                c
            })
            .collect();
        choose(candidates, 1, Order::Roomiest).first().copied()
    }
}

impl PairingBook {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.0.lock().expect("pairing lock poisoned")
    }

    /// Learns what the kubelet lists free for `model`'s resource and says
    /// where GetPreferredAllocation should take `size` devices from.
    pub(crate) fn steer(&self, model: &DeviceModel, available: &[DeviceRef], size: usize) -> Steer {
        let mut book = self.book();
        let gpus = model.gpus().len();
        let free = free::per_gpu(available, gpus);
        book.whole.resize(gpus, false);
        let Some(s) = slot(model.resource()) else {
            // The kubelet lists every whole GPU not allocated.
            book.whole = free.iter().map(|&f| f == 0).collect();
            let shared: Vec<bool> = (0..gpus)
                .map(|g| book.shared.iter().any(|s| s.used(g)))
                .collect();
            let clear = (0..gpus).filter(|&g| free[g] > 0 && !shared[g]).count();
            // Mixing is better than no hint when too few GPUs are clear.
            let avoid = if clear >= size {
                shared
            } else {
                vec![false; gpus]
            };
            return Steer {
                gpus: Vec::new(),
                avoid,
            };
        };
        book.shared[s].resize_to(model);
        book.shared[s].free = free;
        let size = u32::try_from(size).unwrap_or(u32::MAX);
        let avoid = book.whole.clone();
        let partner = book.partner(s).and_then(|p| p.gpu);
        Steer {
            gpus: book
                .roomiest(s, size, &avoid, partner)
                .into_iter()
                .collect(),
            avoid,
        }
    }

    /// Records a grant of `devices` (already checked to be on one GPU for
    /// a shared resource). Refuses a container's second shared grant on
    /// another GPU than its first, which would hand it two GPUs' envs; the
    /// refusal ends the pair, so the next container starts afresh.
    pub(crate) fn grant(
        &self,
        model: &DeviceModel,
        devices: &[DeviceRef],
    ) -> Result<(), SplitError> {
        let mut book = self.book();
        let resource = model.resource();
        let Some(s) = slot(resource) else {
            book.whole.resize(model.gpus().len(), false);
            for d in devices {
                book.whole[d.gpu] = true;
            }
            return Ok(());
        };
        let Some(gpu) = devices.first().map(|d| d.gpu) else {
            return Ok(());
        };
        book.shared[s].resize_to(model);
        book.seq += 1;
        let seq = book.seq;
        let partner = book.partner(s);
        if let Some(LatestGrant {
            gpu: Some(first),
            opened: true,
            ..
        }) = partner
            && first != gpu
        {
            book.shared[s].latest = Some(LatestGrant {
                seq,
                gpu: None,
                opened: false,
            });
            let uuid = |g: usize| model.gpus()[g].uuid.clone();
            return Err(SplitError {
                resource,
                other: other(resource),
                first: uuid(first),
                second: uuid(gpu),
            });
        }
        let shared = &mut book.shared[s];
        shared.latest = Some(LatestGrant {
            seq,
            gpu: Some(gpu),
            opened: partner.is_none(),
        });
        let taken = u32::try_from(devices.len()).unwrap_or(u32::MAX);
        shared.free[gpu] = shared.free[gpu].saturating_sub(taken);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::rules::device::Plan;

    /// Two GPUs of 100 MiB: 100 memory and 100 core units each.
    fn plan() -> Plan {
        let text = "pod_matching = false\n[devices]\nbackend = \"mock\"\n\
                    [[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 100\n\
                    [[devices.mock]]\nuuid = \"GPU-b\"\nmemory_mib = 100";
        let config = Config::from_toml(text, None).unwrap();
        let gpus = crate::rules::device::discover(&config).unwrap();
        Plan::new(&config, gpus).unwrap()
    }

    fn on(gpu: usize, units: std::ops::Range<u32>) -> Vec<DeviceRef> {
        units.map(|unit| DeviceRef { gpu, unit }).collect()
    }

    fn all(free: [u32; 2]) -> Vec<DeviceRef> {
        let mut v = on(0, 0..free[0]);
        v.extend(on(1, 0..free[1]));
        v
    }

    #[test]
    fn the_second_grant_follows_the_first_after_a_single_resource_grant() {
        let p = plan();
        let (mem, core) = (
            p.model(Resource::GpuMemory).unwrap(),
            p.model(Resource::GpuCore).unwrap(),
        );
        let book = PairingBook::default();
        // An init container's memory, its app container's core, then the
        // app container's memory: the init container's IDs again.
        book.grant(mem, &on(0, 0..40)).unwrap();
        assert_eq!(book.steer(core, &all([100, 100]), 10).gpus, [0]);
        book.grant(core, &on(0, 0..10)).unwrap();
        book.grant(mem, &on(0, 0..40)).unwrap();
        // The next container's core finds no room on GPU a: its first grant,
        // elsewhere, is not refused, and its memory follows it.
        assert_eq!(book.steer(core, &all([0, 100]), 10).gpus, [1]);
        book.grant(core, &on(1, 0..10)).unwrap();
        assert_eq!(book.steer(mem, &all([60, 100]), 50).gpus, [1]);
        book.grant(mem, &on(1, 0..50)).unwrap();
    }

    #[test]
    fn a_split_is_refused_only_after_a_certain_first_grant() {
        let p = plan();
        let (mem, core) = (
            p.model(Resource::GpuMemory).unwrap(),
            p.model(Resource::GpuCore).unwrap(),
        );
        let book = PairingBook::default();
        book.grant(mem, &on(0, 0..10)).unwrap();
        let e = book.grant(core, &on(1, 0..10)).unwrap_err();
        assert!(e.to_string().contains("GPU-a") && e.to_string().contains("GPU-b"));
        // The refusal ended the pair: the next grant is a first one.
        book.grant(mem, &on(1, 10..20)).unwrap();
        // A paired grant's successor may be a new container: not refused.
        book.grant(core, &on(1, 10..20)).unwrap();
        book.grant(mem, &on(0, 20..30)).unwrap();
    }

    #[test]
    fn first_grants_keep_room_in_both_and_stay_off_whole_gpus() {
        let p = plan();
        let (mem, core, count) = (
            p.model(Resource::GpuMemory).unwrap(),
            p.model(Resource::GpuCore).unwrap(),
            p.model(Resource::GpuCount).unwrap(),
        );
        let book = PairingBook::default();
        book.steer(core, &all([5, 100]), 1);
        // GPU a is the best fit for memory but has 5 % of compute left.
        assert_eq!(book.steer(mem, &all([30, 100]), 20).gpus, [1]);
        // Whole GPU b: shared work keeps off it ...
        book.grant(count, &on(1, 0..1)).unwrap();
        let s = book.steer(core, &all([100, 100]), 10);
        assert_eq!(s.avoid, [false, true]);
        // ... and whole grants keep off GPU a's shared memory, unless it is
        // the only GPU free.
        let s = book.steer(count, &all([1, 0]), 1);
        assert_eq!(s.avoid, [false, false]);
        let s = book.steer(count, &all([1, 1]), 1);
        assert_eq!(s.avoid, [true, false]);
    }
}
