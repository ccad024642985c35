//! Where a pod fits on a node, and how well: the same answer for the
//! extender's filter and the node's GetPreferredAllocation, whose GPUs
//! both come from [`choose`].

use serde::Deserialize;

use super::select::{Candidate, Order, choose};
use super::{
    Assignment, ContainerAsk, Inventory, Ledger, NodeAsk, NodeRoom, NodeUsage, PodAsks,
    pod_holdings,
};
use crate::rules::device::{PerResource, Resource};

/// At most this many containers of one pod that ask GPUs.
pub(crate) const MAX_GPU_CONTAINERS: usize = 256;

/// Why a pod does not fit on a node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("container {container}: {reason}")]
pub(crate) struct FitError {
    pub(crate) container: String,
    pub(crate) reason: String,
    /// It would not fit even on this node empty with every GPU healthy:
    /// no amount of waiting helps.
    pub(crate) unresolvable: bool,
}

/// How to rank the nodes a pod fits on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Put each pod where it leaves the least GPU memory on the GPUs it
    /// takes, anywhere in the cluster, keeping the GPUs with the most room
    /// (and whole nodes) free for big pods.
    #[default]
    Binpack,
    /// Spread pods over the emptiest nodes.
    Spread,
    /// Put each pod on the node and GPU where it adds the least expected
    /// fragmentation for the pods the cluster runs (`frag`: Fragmentation
    /// Gradient Descent, USENIX ATC '23), among near equals the one with
    /// the least GPU and CPU left: GPU room stays in the pieces the next
    /// pods can use. Pods
    /// asking no GPU are placed too, when they reach the extender.
    Fragmentation,
}

/// The GPU the fit would put a lone shared container asking `need`
/// (memory and core, real units) on: the first of [`shared_order`].
pub(crate) fn best_shared(
    inv: &Inventory,
    usage: &NodeUsage,
    need: &PerResource<u64>,
) -> Option<usize> {
    shared_order(inv, usage, need, |_| false).first().copied()
}

/// The healthy GPUs away from whole-GPU work with `need` free, in the
/// order the fit tries them: the `preferred` (the pod's own) first, then
/// [`Order::BestFit`].
fn shared_order(
    inv: &Inventory,
    usage: &NodeUsage,
    need: &PerResource<u64>,
    preferred: impl Fn(usize) -> bool,
) -> Vec<usize> {
    let candidates = (0..inv.gpus.len())
        .filter(|&g| holds(inv, usage, g, need))
        .map(|g| Candidate {
            gpu: g,
            left: SHARED.map(|r| usage.free(inv, g, r) - need[r]),
            preferred: preferred(g),
            ..Candidate::default()
        })
        .collect();
    choose(candidates, usize::MAX, Order::BestFit)
}

/// `n` of the GPUs free of any work for whole asks: `first` of them in
/// its order, then by [`Order::NumaWhole`] over their memory, as the
/// node's GetPreferredAllocation chooses (`first` counting as its
/// must-include).
pub(crate) fn whole_gpus(
    inv: &Inventory,
    usage: &NodeUsage,
    first: &[usize],
    n: usize,
) -> Vec<usize> {
    // Most pods ask no whole GPU: the filter runs this for every node.
    if n == 0 {
        return Vec::new();
    }
    let mut free: Vec<usize> = Vec::new();
    for g in first.iter().copied().chain(0..inv.gpus.len()) {
        if free_of_work(inv, usage, g) && !free.contains(&g) {
            free.push(g);
        }
    }
    let candidates = free
        .into_iter()
        .map(|g| Candidate {
            gpu: g,
            left: [inv.gpus[g].memory_mib, 0],
            numa: inv.gpus[g].numa_node,
            preferred: first.contains(&g),
            ..Candidate::default()
        })
        .collect();
    choose(candidates, n, Order::NumaWhole)
}

const SHARED: [Resource; 2] = [Resource::GpuMemory, Resource::GpuCore];

/// Whether GPU `g` is healthy, away from whole-GPU work, and has `need`
/// (memory and core, real units) free.
fn holds(inv: &Inventory, usage: &NodeUsage, g: usize, need: &PerResource<u64>) -> bool {
    inv.gpus[g].healthy
        && !usage.gpus[g].held_whole()
        && SHARED.iter().all(|&r| usage.free(inv, g, r) >= need[r])
}

/// Whether GPU `g` is healthy and free of any work: what a whole ask takes.
fn free_of_work(inv: &Inventory, usage: &NodeUsage, g: usize) -> bool {
    inv.gpus[g].healthy && usage.gpus[g].idle()
}

/// GPUs for every container of the pod at once: each shared container on
/// one GPU with room for its memory and its core, each whole ask on GPUs
/// free of any work. Containers add up (init containers count while the
/// pod lives). The kubelet hands a container the devices of the pod's init
/// containers (for every resource of which they left some) before fresh
/// ones: a shared container handed some must go on their GPU, and a whole
/// ask takes the init containers' GPUs first (the pod holds them once),
/// fresh ones only for the rest. A sidecar (restartable init container)
/// takes from them the same way but keeps its devices for the pod's life:
/// it hands nothing on. At Allocate, IDs outside a container's assigned
/// GPUs and the GPUs still handed on by the pod's init containers are
/// refused.
///
/// It searches: whenever the rules place the pod, it is placed (within a
/// budget of steps that an ordinary pod never nears; past it the pod is
/// refused saying so), and a pod of more than [`MAX_GPU_CONTAINERS`]
/// containers asking GPUs is refused for good.
pub(crate) fn fit(
    inv: &Inventory,
    usage: &NodeUsage,
    asks: &PodAsks,
) -> Result<Assignment, FitError> {
    place_all(inv, usage, asks).map_err(|refused| {
        let mut ideal = inv.clone();
        ideal.gpus.iter_mut().for_each(|g| g.healthy = true);
        let mut e = refused.error;
        // Unresolvable only when proven on the empty node: a search that
        // gave up there proves nothing.
        e.unresolvable =
            place_all(&ideal, &NodeUsage::empty(&ideal), asks).is_err_and(|again| !again.gave_up);
        e
    })
}

/// Whether [`fit`] places the pod, without finding out why not: the test
/// a search over many states makes (preemption's sets of victims).
pub(crate) fn fits(inv: &Inventory, usage: &NodeUsage, asks: &PodAsks) -> bool {
    place_all(inv, usage, asks).is_ok()
}

/// A refusal, and whether it is one because the search ran out of steps.
struct Refused {
    error: FitError,
    gave_up: bool,
}

impl From<FitError> for Refused {
    fn from(error: FitError) -> Refused {
        Refused {
            error,
            gave_up: false,
        }
    }
}

/// Steps (a GPU tried for a group, a choice of whole GPUs) the search may
/// take per container and GPU before it gives up, and at least: enough to
/// search small pods exhaustively, a few milliseconds at most.
const STEPS_PER_CELL: u64 = 16;
const MIN_STEPS: u64 = 2048;
/// Groups checked for a GPU that still holds them before each step.
const LOOK_AHEAD: usize = 8;

fn place_all(inv: &Inventory, usage: &NodeUsage, asks: &PodAsks) -> Result<Assignment, Refused> {
    let layout = Layout::of(inv, usage, asks)?;
    let mut search = Search {
        inv,
        asks,
        groups: &layout.groups,
        usage: usage.clone(),
        on: vec![0; layout.groups.len()],
        in_pod: vec![0; inv.gpus.len()],
        steps: 0,
        budget: (STEPS_PER_CELL
            .saturating_mul(layout.containers as u64)
            .saturating_mul(inv.gpus.len() as u64))
        .max(MIN_STEPS),
        deepest: None,
        whole: Vec::new(),
        rest: layout
            .groups
            .iter()
            .rev()
            .scan(PerResource::default(), |sum, g| {
                SHARED.iter().for_each(|&r| sum[r] += g.need[r]);
                Some(*sum)
            })
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect(),
    };
    let first = whole_gpus(inv, usage, &[], layout.slots);
    let classes = search.classes(&first);
    let outcome = search.whole(&classes, &first);
    let deepest = search.deepest.take();
    let fail = |gave_up: bool| {
        let (_, mut error) = deepest.unwrap_or_else(|| {
            (
                0,
                FitError {
                    container: asks.containers[0].name.clone(),
                    reason: "no placement found".into(),
                    unresolvable: false,
                },
            )
        });
        if gave_up {
            error.reason = format!(
                "{}; the search for another placement of the pod's {} containers asking GPUs \
                 gave up after {} steps",
                error.reason, layout.containers, search.budget
            );
        }
        Refused { error, gave_up }
    };
    match outcome {
        Outcome::Found => {}
        Outcome::Exhausted => return Err(fail(false)),
        Outcome::GaveUp => return Err(fail(true)),
    }
    let uuid = |g: &usize| inv.gpus[*g].uuid.clone();
    let mut out = Assignment::default();
    for (c, place) in asks.containers.iter().zip(&layout.places) {
        let gpus: Vec<usize> = match place {
            Place::None => continue,
            Place::Whole(slots) => slots.iter().map(|&s| search.whole[s]).collect(),
            Place::Shared(group) => vec![search.on[*group]],
        };
        out.0
            .insert(c.name.clone(), gpus.iter().map(uuid).collect());
    }
    Ok(out)
}

/// Where one container goes, in the pod's layout.
enum Place {
    /// It asks no GPU.
    None,
    /// The whole GPUs it holds, as slots of the pod's whole GPUs (those
    /// handed on first).
    Whole(Vec<usize>),
    /// Its group of shared containers.
    Shared(usize),
}

/// Shared containers that must share one GPU (the kubelet hands one the
/// devices of another), with what they need there together.
struct Group {
    /// Container indexes, in spec order.
    members: Vec<usize>,
    need: PerResource<u64>,
}

/// The pod as the search sees it, from the kubelet's hand-on rules alone:
/// which GPUs, where, does not change which containers go together nor how
/// many whole GPUs the pod takes fresh.
struct Layout {
    places: Vec<Place>,
    /// Largest first (first-fit decreasing finds a placement without
    /// backtracking far more often than spec order).
    groups: Vec<Group>,
    /// How many fresh whole GPUs the pod takes.
    slots: usize,
    /// Containers asking GPUs.
    containers: usize,
}

impl Layout {
    fn of(inv: &Inventory, usage: &NodeUsage, asks: &PodAsks) -> Result<Layout, FitError> {
        let asking = |c: &&ContainerAsk| c.whole() || c.shared();
        if let Some(c) = asks
            .containers
            .iter()
            .filter(asking)
            .nth(MAX_GPU_CONTAINERS)
        {
            let n = asks.containers.iter().filter(asking).count();
            return Err(FitError {
                container: c.name.clone(),
                reason: format!(
                    "the pod has {n} containers asking GPUs; the scheduler extender places \
                     at most {MAX_GPU_CONTAINERS}"
                ),
                unresolvable: true,
            });
        }
        let free = (0..inv.gpus.len())
            .filter(|&g| free_of_work(inv, usage, g))
            .count();
        let most = most_per_gpu(inv);
        let mut places = Vec::with_capacity(asks.containers.len());
        let mut hand_on = HandOn::new(asks.containers.len());
        for (i, c) in asks.containers.iter().enumerate() {
            check_countable(inv, c)?;
            let place = if c.whole() {
                hand_on.whole(inv, c, free)?
            } else if c.shared() {
                check_under_largest(inv, usage, c, &most)?;
                hand_on.shared(i, c);
                Place::Shared(0)
            } else {
                Place::None
            };
            places.push(place);
        }
        let slots = hand_on.slots;
        let groups = hand_on.groups(inv, asks, &mut places);
        let groups = largest_first(inv, &most, groups, &mut places);
        let containers = asks.containers.iter().filter(asking).count();
        Ok(Layout {
            places,
            groups,
            slots,
            containers,
        })
    }
}

/// A refusal of container `c` that waiting may lift.
fn refusal(c: &ContainerAsk, reason: String) -> FitError {
    FitError {
        container: c.name.clone(),
        reason,
        unresolvable: false,
    }
}

/// The most devices of each resource any one GPU of the node has.
fn most_per_gpu(inv: &Inventory) -> PerResource<u64> {
    let units = inv.units();
    PerResource::from_fn(|r: Resource| {
        inv.gpus
            .iter()
            .map(|g| u64::from(units.per_gpu(r, g.memory_mib)))
            .max()
            .unwrap_or(0)
    })
}

/// Container `c` asks only resources the node offers, in amounts real
/// units can count.
fn check_countable(inv: &Inventory, c: &ContainerAsk) -> Result<(), FitError> {
    if let Some(r) = Resource::ALL
        .into_iter()
        .find(|&r| c.wants(r) > 0 && !inv.offers(r))
    {
        return Err(refusal(
            c,
            format!("asks {r}, which this node does not offer"),
        ));
    }
    match inv.overflow(&c.devices) {
        Some(why) => Err(refusal(c, why)),
        None => Ok(()),
    }
}

/// A shared ask of more than any GPU has is refused before any arithmetic
/// on an ask that may be absurd (hostile limits overflow).
fn check_under_largest(
    inv: &Inventory,
    usage: &NodeUsage,
    c: &ContainerAsk,
    most: &PerResource<u64>,
) -> Result<(), FitError> {
    if SHARED.into_iter().any(|r| c.wants(r) > most[r]) {
        let unit = inv.unit();
        let need = c.devices.map(|r, &d| d.saturating_mul(unit[r]));
        return Err(refusal(c, shortfall(inv, usage, &need)));
    }
    Ok(())
}

/// The kubelet's hand-on followed through the pod's containers in spec
/// order: which whole GPUs each takes, and which shared containers must
/// share a GPU because one is handed the other's devices.
struct HandOn {
    /// Whole GPUs handed on, as slots.
    handed: Vec<usize>,
    /// The fresh whole GPUs taken so far.
    slots: usize,
    /// Shared devices handed on, per resource: how many, and a container
    /// of the group they are from.
    devices: PerResource<(u64, usize)>,
    /// A union-find over the containers: each shared one's group.
    parent: Vec<usize>,
}

impl HandOn {
    fn new(containers: usize) -> Self {
        HandOn {
            handed: Vec::new(),
            slots: 0,
            devices: PerResource::default(),
            parent: (0..containers).collect(),
        }
    }

    /// A whole-GPU container's slots: those handed on to it first, then
    /// fresh ones, as long as the `free` GPUs free of other work last.
    fn whole(&mut self, inv: &Inventory, c: &ContainerAsk, free: usize) -> Result<Place, FitError> {
        let k = c.devices.count;
        let reused = self
            .handed
            .len()
            .min(usize::try_from(k).unwrap_or(usize::MAX));
        let fresh = k - reused as u64;
        let left = free - self.slots;
        if fresh > left as u64 {
            let handed = match reused {
                0 => String::new(),
                n => format!(", {n} of them handed on by its init containers"),
            };
            return Err(refusal(
                c,
                format!(
                    "wants {k} whole GPUs{handed}; {left} of {} are healthy and free of other \
                     work",
                    inv.gpus.len()
                ),
            ));
        }
        let fresh = fresh as usize;
        let mine: Vec<usize> = self.handed[..reused]
            .iter()
            .copied()
            .chain(self.slots..self.slots + fresh)
            .collect();
        self.slots += fresh;
        c.pass_on(&mut self.handed, &mine);
        Ok(Place::Whole(mine))
    }

    /// Shared container `i` joins the group whose devices it is handed.
    fn shared(&mut self, i: usize, c: &ContainerAsk) {
        for r in SHARED.into_iter().filter(|&r| c.wants(r) > 0) {
            let (left, from) = &mut self.devices[r];
            if *left > 0 {
                let (a, b) = (find(&mut self.parent, i), find(&mut self.parent, *from));
                self.parent[a] = b;
            } else {
                *from = i;
            }
            *left = c.pass_on_count(*left, c.wants(r));
        }
    }

    /// The groups of shared containers, in the order their first member
    /// comes, each with what it needs together; `places` gets each shared
    /// container's group.
    fn groups(mut self, inv: &Inventory, asks: &PodAsks, places: &mut [Place]) -> Vec<Group> {
        let mut groups: Vec<Group> = Vec::new();
        let mut group_of: Vec<Option<usize>> = vec![None; asks.containers.len()];
        for (i, c) in asks.containers.iter().enumerate() {
            let Place::Shared(group) = &mut places[i] else {
                continue;
            };
            let root = find(&mut self.parent, i);
            let g = *group_of[root].get_or_insert_with(|| {
                groups.push(Group {
                    members: Vec::new(),
                    need: PerResource::default(),
                });
                groups.len() - 1
            });
            *group = g;
            let need = inv.amount(&c.devices);
            let gr = &mut groups[g];
            gr.members.push(i);
            for r in SHARED {
                gr.need[r] += need[r];
            }
        }
        groups
    }
}

/// `groups` largest first by the sum of their shares of the largest GPU
/// (first-fit decreasing), `places` renumbered to match; a stable sort
/// keeps spec order among equals.
fn largest_first(
    inv: &Inventory,
    most: &PerResource<u64>,
    groups: Vec<Group>,
    places: &mut [Place],
) -> Vec<Group> {
    let cap = PerResource::from_fn(|r| most[r] * inv.unit()[r]);
    let size = |g: &Group| {
        u128::from(g.need.memory) * u128::from(cap.core)
            + u128::from(g.need.core) * u128::from(cap.memory)
    };
    let mut sorted: Vec<(usize, Group)> = groups.into_iter().enumerate().collect();
    sorted.sort_by_key(|(_, g)| std::cmp::Reverse(size(g)));
    let mut new_index = vec![0; sorted.len()];
    for (new, (old, _)) in sorted.iter().enumerate() {
        new_index[*old] = new;
    }
    for p in places.iter_mut() {
        if let Place::Shared(g) = p {
            *g = new_index[*g];
        }
    }
    sorted.into_iter().map(|(_, g)| g).collect()
}

/// The root of `i`'s set, halving the path on the way.
fn find(parent: &mut [usize], mut i: usize) -> usize {
    while parent[i] != i {
        parent[i] = parent[parent[i]];
        i = parent[i];
    }
    i
}

enum Outcome {
    Found,
    /// No placement below this point: proven.
    Exhausted,
    /// The budget ran out.
    GaveUp,
}

/// A depth-first search: the pod's fresh whole GPUs first, then each group
/// on a GPU, best first (the first placement it meets is best fit
/// decreasing's, reached in as many steps as groups). GPUs in the
/// same state are tried once per group: the rest of the search cannot tell
/// them apart.
struct Search<'a> {
    inv: &'a Inventory,
    asks: &'a PodAsks,
    groups: &'a [Group],
    /// The node's usage with what the search placed so far.
    usage: NodeUsage,
    /// Each group's GPU, once placed.
    on: Vec<usize>,
    /// How many of the pod's groups each GPU has.
    in_pod: Vec<u32>,
    steps: u64,
    budget: u64,
    /// The refusal at the most groups placed: the reason given when no
    /// placement is found.
    deepest: Option<(usize, FitError)>,
    /// The fresh whole GPUs, slot by slot.
    whole: Vec<usize>,
    /// What groups `i..` need in all, per `i`.
    rest: Vec<PerResource<u64>>,
}

impl Search<'_> {
    /// The GPUs free of any work, in classes the search cannot tell apart
    /// (same capacity and usage), smallest first: a whole ask takes the
    /// smallest, leaving room for shared work. Each class lists its GPUs
    /// of `first` first, so taking as many of it as `first` does takes
    /// those.
    fn classes(&self, first: &[usize]) -> Vec<Vec<usize>> {
        let (inv, usage) = (self.inv, &self.usage);
        let mut free: Vec<usize> = (0..inv.gpus.len())
            .filter(|&g| free_of_work(inv, usage, g))
            .collect();
        // Free of work is no sharers and not held whole; the amounts used
        // go in the key too, should a count ever disagree with them.
        let key = |g: usize| {
            let (cap, used) = (inv.capacity(g), usage.gpus[g].used);
            (cap.memory, cap.core, used.memory, used.core)
        };
        free.sort_by_key(|&g| (key(g), !first.contains(&g), g));
        let mut classes: Vec<Vec<usize>> = Vec::new();
        for g in free {
            match classes.last_mut() {
                Some(c) if key(c[0]) == key(g) => c.push(g),
                _ => classes.push(vec![g]),
            }
        }
        classes
    }

    /// Takes `first` for the pod's fresh whole GPUs (the choice the node
    /// makes), else any other choice while the groups do not fit, and
    /// places the groups.
    fn whole(&mut self, classes: &[Vec<usize>], first: &[usize]) -> Outcome {
        self.take_whole(first, true);
        self.steps += 1;
        let outcome = self.shared(0);
        if !matches!(outcome, Outcome::Exhausted) {
            return outcome;
        }
        self.take_whole(first, false);
        self.other_whole(classes, first.len(), first)
    }

    /// Chooses `wanted` fresh whole GPUs from `classes` (how many of each
    /// class, most of the smaller first) other than `tried`, then places
    /// the groups.
    fn other_whole(&mut self, classes: &[Vec<usize>], wanted: usize, tried: &[usize]) -> Outcome {
        let Some((class, rest)) = classes.split_first() else {
            let again =
                self.whole.len() == tried.len() && self.whole.iter().all(|g| tried.contains(g));
            if wanted > 0 || again {
                return Outcome::Exhausted;
            }
            self.steps += 1;
            return self.shared(0);
        };
        let later: usize = rest.iter().map(Vec::len).sum();
        let most = wanted.min(class.len());
        for take in (wanted.saturating_sub(later)..=most).rev() {
            self.take_whole(&class[..take], true);
            let outcome = self.other_whole(rest, wanted - take, tried);
            if !matches!(outcome, Outcome::Exhausted) {
                return outcome;
            }
            self.take_whole(&class[..take], false);
        }
        Outcome::Exhausted
    }

    /// Takes (or gives back) whole GPUs `gpus` for the pod.
    fn take_whole(&mut self, gpus: &[usize], take: bool) {
        for &g in gpus {
            if take {
                self.usage.gpus[g].used.count += 1;
                self.whole.push(g);
            } else {
                self.usage.gpus[g].used.count -= 1;
                self.whole.pop();
            }
        }
    }

    /// Places groups `i..` on the GPUs.
    fn shared(&mut self, i: usize) -> Outcome {
        let Some(group) = self.groups.get(i) else {
            return Outcome::Found;
        };
        if self.steps > self.budget {
            return Outcome::GaveUp;
        }
        let (inv, need) = (self.inv, group.need);
        // With one group left, the GPU-by-GPU check below says more.
        if self.groups.len() - i > 1
            && let Some(free) = self.short_in_all(i)
        {
            self.fail(i, |s| s.short_in_all_error(i, &free));
            return Outcome::Exhausted;
        }
        // A group no GPU holds now never fits below: checking the next few
        // (all of them at the start) refuses most pods that do not fit at
        // once, on a full node, instead of after every order of the rest.
        let ahead = if i == 0 {
            self.groups.len()
        } else {
            i + LOOK_AHEAD
        };
        if let Some(stuck) = self.groups[i..ahead.min(self.groups.len())]
            .iter()
            .find(|g| !(0..inv.gpus.len()).any(|gpu| holds(inv, &self.usage, gpu, &g.need)))
        {
            self.fail(i, |s| s.group_error(stuck));
            return Outcome::Exhausted;
        }
        let gpus = shared_order(inv, &self.usage, &need, |g| self.in_pod[g] > 0);
        let mut tried: Vec<(u64, u64)> = Vec::new();
        for g in gpus {
            let state = (
                self.usage.free(inv, g, Resource::GpuMemory),
                self.usage.free(inv, g, Resource::GpuCore),
            );
            if tried.contains(&state) {
                continue;
            }
            tried.push(state);
            self.steps += 1;
            self.put(g, &need, true);
            self.on[i] = g;
            let outcome = self.shared(i + 1);
            if !matches!(outcome, Outcome::Exhausted) {
                return outcome;
            }
            self.put(g, &need, false);
        }
        Outcome::Exhausted
    }

    /// Adds (or takes back) a group's `need` on GPU `g`.
    fn put(&mut self, g: usize, need: &PerResource<u64>, add: bool) {
        let u = &mut self.usage.gpus[g];
        if add {
            u.used.memory += need.memory;
            u.used.core += need.core;
            u.sharers += 1;
            self.in_pod[g] += 1;
        } else {
            u.used.memory -= need.memory;
            u.used.core -= need.core;
            u.sharers -= 1;
            self.in_pod[g] -= 1;
        }
    }

    /// Keeps the refusal at the deepest point the search reached (built
    /// only then: most dead ends need no words).
    fn fail(&mut self, depth: usize, e: impl FnOnce(&Self) -> FitError) {
        if self.deepest.as_ref().is_none_or(|(d, _)| depth > *d) {
            self.deepest = Some((depth, e(self)));
        }
    }

    /// What the GPUs that could take shared work have free in all, when
    /// groups `i..` need more memory or core than that.
    fn short_in_all(&self, i: usize) -> Option<PerResource<u64>> {
        let (inv, usage) = (self.inv, &self.usage);
        let mut free: PerResource<u64> = PerResource::default();
        for g in (0..inv.gpus.len()).filter(|&g| inv.gpus[g].healthy && !usage.gpus[g].held_whole())
        {
            for r in SHARED {
                free[r] += usage.free(inv, g, r);
            }
        }
        let need = &self.rest[i];
        SHARED.iter().any(|&r| need[r] > free[r]).then_some(free)
    }

    fn short_in_all_error(&self, i: usize, free: &PerResource<u64>) -> FitError {
        let need = &self.rest[i];
        let members = self.groups[i..].iter().flat_map(|g| &g.members);
        let first = members.clone().min().copied().unwrap_or_default();
        FitError {
            container: self.asks.containers[first].name.clone(),
            reason: format!(
                "the pod's {} containers still to place ask {} MiB and {} % of compute in \
                 all; the GPUs that could take them have {} MiB and {} % free",
                members.count(),
                need.memory,
                need.core,
                free.memory,
                free.core
            ),
            unresolvable: false,
        }
    }

    /// Why no GPU holds `group`: the first of its containers that no GPU
    /// holds together with those before it.
    fn group_error(&self, group: &Group) -> FitError {
        let (inv, usage) = (self.inv, &self.usage);
        let mut need = PerResource::<u64>::default();
        let mut at = group.members.len() - 1;
        for (k, &m) in group.members.iter().enumerate() {
            let own = inv.amount(&self.asks.containers[m].devices);
            for r in SHARED {
                need[r] += own[r];
            }
            if !(0..inv.gpus.len()).any(|g| holds(inv, usage, g, &need)) {
                at = k;
                break;
            }
        }
        let short = shortfall(inv, usage, &need);
        let reason = match at {
            0 => short,
            _ => {
                let before: Vec<&str> = group.members[..at]
                    .iter()
                    .map(|&b| self.asks.containers[b].name.as_str())
                    .collect();
                format!(
                    "the kubelet hands it devices of the pod's init containers, so it must \
                     share one GPU with {}: {short}",
                    before.join(", ")
                )
            }
        };
        FitError {
            container: self.asks.containers[group.members[at]].name.clone(),
            reason,
            unresolvable: false,
        }
    }
}

/// Says what is missing for a shared ask no GPU holds.
fn shortfall(inv: &Inventory, usage: &NodeUsage, need: &PerResource<u64>) -> String {
    let open: Vec<usize> = (0..inv.gpus.len())
        .filter(|&g| inv.gpus[g].healthy && !usage.gpus[g].held_whole())
        .collect();
    if open.is_empty() {
        return if inv.gpus.iter().any(|g| g.healthy) {
            "every healthy GPU is held whole".into()
        } else {
            "no GPU is healthy".into()
        };
    }
    let largest = |r: Resource| {
        open.iter()
            .map(|&g| (usage.free(inv, g, r), &inv.gpus[g].uuid))
            .max_by_key(|&(free, _)| free)
            .expect("some GPU is open")
    };
    let (mem, mem_gpu) = largest(Resource::GpuMemory);
    let (core, core_gpu) = largest(Resource::GpuCore);
    if mem < need.memory {
        format!(
            "no GPU has {} MiB free (largest {mem} MiB on {mem_gpu})",
            need.memory
        )
    } else if core < need.core {
        format!(
            "no GPU has {} % of its compute free (largest {core} % on {core_gpu})",
            need.core
        )
    } else {
        format!(
            "no GPU has {} MiB and {} % of its compute free at once",
            need.memory, need.core
        )
    }
}

/// Where else a pod whose one GPU ask is an app container's share of one
/// GPU could go on the node: each GPU that holds it, in the fit's order
/// (`assignment`'s own first), one of those alike in what they have free
/// and carry (they leave the node alike). Any other pod: `assignment`
/// alone.
pub(crate) fn alternatives(
    inv: &Inventory,
    usage: &NodeUsage,
    asks: &PodAsks,
    assignment: &Assignment,
) -> Vec<Assignment> {
    let mut gpu_asks = asks.containers.iter().filter(|c| c.whole() || c.shared());
    let (Some(c), None) = (gpu_asks.next(), gpu_asks.next()) else {
        return vec![assignment.clone()];
    };
    if c.init || !c.shared() {
        return vec![assignment.clone()];
    }
    let need = inv.amount(&c.devices);
    let own = |g: usize| {
        assignment
            .0
            .get(&c.name)
            .is_some_and(|u| u.contains(&inv.gpus[g].uuid))
    };
    let mut seen = Vec::new();
    shared_order(inv, usage, &need, own)
        .into_iter()
        .filter(|&g| {
            let state = (
                SHARED.map(|r| usage.free(inv, g, r)),
                SHARED.map(|r| inv.capacity(g)[r]),
                usage.gpus[g].carries_shared(),
            );
            let new = !seen.contains(&state);
            seen.push(state);
            new
        })
        .map(|g| Assignment([(c.name.clone(), vec![inv.gpus[g].uuid.clone()])].into()))
        .collect()
}

/// The node as it would be with the pod on `assignment`: its GPUs' usage
/// and the CPU and memory left.
pub(crate) fn room_after(
    room: &NodeRoom,
    asks: &PodAsks,
    assignment: &Assignment,
) -> (NodeUsage, NodeAsk) {
    (
        with_pod(room.inventory, room.usage, asks, assignment),
        room.free.minus(asks.node),
    )
}

/// `usage` with the pod on the GPUs of `assignment`.
fn with_pod(
    inv: &Inventory,
    usage: &NodeUsage,
    asks: &PodAsks,
    assignment: &Assignment,
) -> NodeUsage {
    let mut after = usage.clone();
    for h in pod_holdings(inv, &asks.containers, &Ledger::default(), assignment) {
        after.add(inv, &h);
    }
    after
}

/// MiB of GPU memory left on the GPUs the pod lands on, once all of it is
/// there: binpack's measure, least first (best fit across the cluster),
/// so that a pod takes the tightest room anywhere and the GPUs with the
/// most room stay open for the largest asks. A GPU the pod takes whole
/// counts its whole memory, so whole asks take the smallest GPUs. Each GPU
/// counts once, however many of the pod's containers share it.
pub(crate) fn leftover(
    inv: &Inventory,
    usage: &NodeUsage,
    asks: &PodAsks,
    assignment: &Assignment,
) -> u64 {
    let after = with_pod(inv, usage, asks, assignment);
    let mut gpus: Vec<usize> = assignment
        .0
        .values()
        .flatten()
        .filter_map(|u| inv.index(u))
        .collect();
    gpus.sort_unstable();
    gpus.dedup();
    gpus.into_iter()
        .map(|g| {
            if after.gpus[g].held_whole() {
                inv.capacity(g).memory
            } else {
                after.free(inv, g, Resource::GpuMemory)
            }
        })
        .fold(0, u64::saturating_add)
}

/// 0..=10: how much a node is worth to the pod under `policy`, from how
/// busy its healthy GPUs are once the pod is on them (a GPU held whole is
/// full; a shared one as full as its fuller resource).
pub(crate) fn score(
    inv: &Inventory,
    usage: &NodeUsage,
    asks: &PodAsks,
    assignment: &Assignment,
    policy: Policy,
) -> u8 {
    let after = with_pod(inv, usage, asks, assignment);
    let permille: Vec<u64> = (0..inv.gpus.len())
        .filter(|&g| inv.gpus[g].healthy)
        .map(|g| {
            let u = &after.gpus[g];
            if u.held_whole() {
                return 1000;
            }
            let cap = inv.capacity(g);
            [Resource::GpuMemory, Resource::GpuCore]
                .into_iter()
                .map(|r| {
                    // A saturated usage is full.
                    (u.used[r].saturating_mul(1000))
                        .checked_div(cap[r])
                        .unwrap_or(1000)
                })
                .max()
                .unwrap_or(0)
                .min(1000)
        })
        .collect();
    if permille.is_empty() {
        return 0;
    }
    let busy = (permille.iter().sum::<u64>() / permille.len() as u64 * 10 + 500) / 1000;
    let busy = busy as u8;
    match policy {
        Policy::Binpack | Policy::Fragmentation => busy,
        Policy::Spread => 10 - busy,
    }
}
