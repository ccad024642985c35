//! The devices of one resource over a node's GPUs, and the plan of all
//! enabled resources, refused when a list would not fit the kubelet's 4 MiB.

use std::collections::BTreeMap;
use std::sync::Arc;

use prost::encoding::encoded_len_varint;

use super::ids::{MAX_ID_LEN, Tags, index_len};
use super::{Gpu, Offer, Resource, Units};

/// The kubelet's gRPC receive limit for one message: a ListAndWatch update
/// over it is dropped by the kubelet, so the plan must never build one.
pub const KUBELET_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

pub(crate) const HEALTHY: &str = "Healthy";
pub(crate) const UNHEALTHY: &str = "Unhealthy";

/// One device: unit `unit` of the GPU at position `gpu` in the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceRef {
    pub(crate) gpu: usize,
    pub(crate) unit: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("unknown device ID {0:?}")]
    Unknown(String),
    #[error("device ID {0:?} is listed twice")]
    Duplicate(String),
}

/// The devices one resource advertises.
#[derive(Debug, PartialEq)]
pub struct DeviceModel {
    resource: Resource,
    gpus: Arc<[Gpu]>,
    tags: Arc<Tags>,
    units: Vec<u32>,
    /// MiB per gpu-memory device, percent per gpu-core device, 1 for gpu-count.
    unit_amount: u64,
}

impl DeviceModel {
    fn new(resource: Resource, gpus: Arc<[Gpu]>, tags: Arc<Tags>, size: Units) -> Self {
        let units = gpus
            .iter()
            .map(|g| size.per_gpu(resource, g.memory_mib))
            .collect();
        DeviceModel {
            resource,
            gpus,
            tags,
            units,
            unit_amount: size.amount(resource),
        }
    }

    pub fn resource(&self) -> Resource {
        self.resource
    }

    pub(crate) fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    pub(crate) fn units(&self, gpu: usize) -> u32 {
        self.units[gpu]
    }

    pub(crate) fn unit_amount(&self) -> u64 {
        self.unit_amount
    }

    pub fn device_count(&self) -> u64 {
        self.units.iter().map(|u| u64::from(*u)).sum()
    }

    /// Calls `f(gpu, id)` for every device in list order, allocating nothing.
    pub fn for_each_id(&self, mut f: impl FnMut(usize, &str)) {
        let mut buf = [0u8; MAX_ID_LEN];
        for gpu in 0..self.gpus.len() {
            if self.resource == Resource::GpuCount {
                f(gpu, &self.gpus[gpu].uuid);
                continue;
            }
            for unit in 0..self.units[gpu] {
                f(gpu, self.tags.encode(gpu, unit, &mut buf));
            }
        }
    }

    pub fn id(&self, d: DeviceRef) -> String {
        if self.resource == Resource::GpuCount {
            return self.gpus[d.gpu].uuid.clone();
        }
        let mut buf = [0u8; MAX_ID_LEN];
        self.tags.encode(d.gpu, d.unit, &mut buf).to_owned()
    }

    pub(crate) fn decode(&self, id: &[u8]) -> Result<DeviceRef, IdError> {
        let found = if self.resource == Resource::GpuCount {
            self.gpus
                .iter()
                .position(|g| g.uuid.as_bytes() == id)
                .map(|gpu| DeviceRef { gpu, unit: 0 })
        } else {
            self.tags
                .decode(id)
                .filter(|(gpu, unit)| *unit < self.units[*gpu])
                .map(|(gpu, unit)| DeviceRef { gpu, unit })
        };
        found.ok_or_else(|| IdError::Unknown(String::from_utf8_lossy(id).into_owned()))
    }

    /// Decodes a request's IDs; unknown or repeated IDs are refused by name.
    /// GetPreferredAllocation sends every free ID, so repeats are found with
    /// one bit per device rather than a hash set.
    pub fn decode_all<'a>(
        &self,
        ids: impl ExactSizeIterator<Item = &'a [u8]>,
    ) -> Result<Vec<DeviceRef>, IdError> {
        let mut seen: Vec<Vec<u64>> = self
            .units
            .iter()
            .map(|u| vec![0; (*u as usize).div_ceil(64)])
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let d = self.decode(id)?;
            let (word, bit) = (d.unit as usize / 64, 1u64 << (d.unit % 64));
            if seen[d.gpu][word] & bit != 0 {
                return Err(IdError::Duplicate(String::from_utf8_lossy(id).into_owned()));
            }
            seen[d.gpu][word] |= bit;
            out.push(d);
        }
        Ok(out)
    }

    /// NUMA node advertised in the Topology field. Only whole GPUs carry it:
    /// on gpu-memory it would cost ~6 bytes per device against the 4 MiB cap.
    pub(crate) fn topology(&self, gpu: usize) -> Option<u32> {
        if self.resource == Resource::GpuCount {
            self.gpus[gpu].numa_node
        } else {
            None
        }
    }

    /// Exact encoded size of the ListAndWatch message, computed without
    /// building it. `healthy(gpu)` gives each GPU's state.
    pub fn wire_len(&self, healthy: impl Fn(usize) -> bool) -> usize {
        let mut total = 0;
        for gpu in 0..self.gpus.len() {
            let health = if healthy(gpu) { HEALTHY } else { UNHEALTHY };
            let topo = self.topology(gpu);
            if self.resource == Resource::GpuCount {
                total += device_entry_len(self.gpus[gpu].uuid.len(), health, topo);
                continue;
            }
            total += self.band_len(self.units[gpu], |id_len| {
                device_entry_len(self.tags.len() + id_len, health, topo)
            });
        }
        total
    }

    /// Sum of `cost(index digits)` over unit indices `0..n`, by digit bands.
    fn band_len(&self, n: u32, cost: impl Fn(usize) -> usize) -> usize {
        let mut total = 0;
        let mut low: u64 = 0;
        let mut digits = 1;
        while low < u64::from(n) {
            let high = 36u64.pow(digits as u32).min(u64::from(n));
            debug_assert_eq!(index_len(low as u32), digits);
            total += (high - low) as usize * cost(digits);
            low = high;
            digits += 1;
        }
        total
    }

    /// The size when every GPU is unhealthy: the longest the list can get.
    pub fn worst_case_wire_len(&self) -> usize {
        self.wire_len(|_| false)
    }
}

/// Bytes of a `NUMANode`; proto3 leaves out a zero ID, so node 0 is empty.
pub(crate) fn numa_len(node: u32) -> usize {
    if node == 0 {
        0
    } else {
        1 + encoded_len_varint(u64::from(node))
    }
}

/// Bytes of a `TopologyInfo` holding one NUMA node.
pub(crate) fn topology_len(node: u32) -> usize {
    let n = numa_len(node);
    1 + encoded_len_varint(n as u64) + n
}

/// Bytes of one `Device` message.
pub(crate) fn device_len(id_len: usize, health: &str, numa: Option<u32>) -> usize {
    let mut len = 1 + encoded_len_varint(id_len as u64) + id_len;
    len += 1 + encoded_len_varint(health.len() as u64) + health.len();
    if let Some(node) = numa {
        let t = topology_len(node);
        len += 1 + encoded_len_varint(t as u64) + t;
    }
    len
}

/// Bytes one `devices` entry takes in a ListAndWatchResponse.
pub(crate) fn device_entry_len(id_len: usize, health: &str, numa: Option<u32>) -> usize {
    let device = device_len(id_len, health, numa);
    1 + encoded_len_varint(device as u64) + device
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("no GPU found on this node")]
    NoGpus,
    #[error(
        "every GPU of this node is DRA's (config key `dra.gpus`), and `resources` asks for \
         device-plugin resources on the others; set resources = [] or leave GPUs to them"
    )]
    NoneLeft,
    #[error("GPU UUID {0:?} is reported twice")]
    DuplicateUuid(String),
    #[error(
        "config key `memory_unit_mib`: {resource} would need {bytes} bytes in one ListAndWatch \
         message at {unit} MiB per device, over the kubelet's {limit}-byte limit; the smallest \
         memory_unit_mib that fits is {fits}"
    )]
    TooLarge {
        resource: Resource,
        bytes: usize,
        unit: u64,
        limit: usize,
        fits: u64,
    },
    #[error(
        "config key `memory_unit_mib`: {unit} MiB is more than GPU {uuid}'s {memory_mib} MiB, \
         which would have no gpu-memory devices; the largest memory_unit_mib every GPU can take \
         is {fits}"
    )]
    UnitOverGpu {
        unit: u64,
        uuid: String,
        memory_mib: u64,
        fits: u64,
    },
}

/// The device models of every enabled resource on this node.
#[derive(Debug, Clone)]
pub struct Plan {
    models: BTreeMap<Resource, Arc<DeviceModel>>,
    /// The GPUs DRA serves, none of the models'.
    dra: Vec<Gpu>,
}

impl Plan {
    /// `offer` is an [`Offer`], or a `&Config`, which makes one.
    pub fn new(offer: impl Into<Offer>, gpus: Vec<Gpu>) -> Result<Plan, PlanError> {
        let Offer { resources, units } = offer.into();
        if gpus.is_empty() {
            return Err(PlanError::NoGpus);
        }
        let tags = Tags::new(gpus.iter().map(|g| g.uuid.as_str())).ok_or_else(|| {
            let dup = gpus
                .iter()
                .enumerate()
                .find(|(i, g)| gpus[..*i].iter().any(|o| o.uuid == g.uuid))
                .map(|(_, g)| g.uuid.clone())
                .unwrap_or_default();
            PlanError::DuplicateUuid(dup)
        })?;
        // gpu-core has cores_per_gpu (at least 1) devices on every GPU and
        // gpu-count one, so only gpu-memory can leave a GPU without devices.
        if resources.contains(&Resource::GpuMemory)
            && let Some(g) = gpus
                .iter()
                .find(|g| units.per_gpu(Resource::GpuMemory, g.memory_mib) == 0)
        {
            return Err(PlanError::UnitOverGpu {
                unit: units.memory_unit_mib,
                uuid: g.uuid.clone(),
                memory_mib: g.memory_mib,
                fits: gpus.iter().map(|g| g.memory_mib).min().unwrap_or(1),
            });
        }
        let gpus: Arc<[Gpu]> = gpus.into();
        let tags = Arc::new(tags);
        let mut models = BTreeMap::new();
        for resource in resources {
            let model = DeviceModel::new(resource, gpus.clone(), tags.clone(), units);
            let bytes = model.worst_case_wire_len();
            if bytes > KUBELET_MAX_MESSAGE_BYTES {
                let fits = smallest_fitting_unit(units, &gpus, &tags);
                return Err(PlanError::TooLarge {
                    resource,
                    bytes,
                    unit: units.memory_unit_mib,
                    limit: KUBELET_MAX_MESSAGE_BYTES,
                    fits,
                });
            }
            models.insert(resource, Arc::new(model));
        }
        Ok(Plan {
            models,
            dra: Vec::new(),
        })
    }

    /// The node's plan: `dra`, the GPUs DRA serves, set apart, and the
    /// device-plugin resources' models over `rest`, the others.
    pub fn split(
        offer: impl Into<Offer>,
        dra: Vec<Gpu>,
        rest: Vec<Gpu>,
    ) -> Result<Plan, PlanError> {
        let offer = offer.into();
        let mut plan = match offer.resources.is_empty() {
            true => Plan {
                models: BTreeMap::new(),
                dra: Vec::new(),
            },
            false if rest.is_empty() && !dra.is_empty() => return Err(PlanError::NoneLeft),
            false => Plan::new(offer, rest)?,
        };
        plan.dra = dra;
        Ok(plan)
    }

    /// The GPUs DRA serves.
    pub(crate) fn dra_gpus(&self) -> &[Gpu] {
        &self.dra
    }

    pub fn model(&self, r: Resource) -> Option<&Arc<DeviceModel>> {
        self.models.get(&r)
    }

    pub fn models(&self) -> impl Iterator<Item = &Arc<DeviceModel>> {
        self.models.values()
    }

    pub fn gpus(&self) -> &[Gpu] {
        self.models
            .values()
            .next()
            .map(|m| m.gpus())
            .unwrap_or_default()
    }
}

/// Only gpu-memory's size depends on a config value, so only it can be fixed.
fn smallest_fitting_unit(units: Units, gpus: &Arc<[Gpu]>, tags: &Arc<Tags>) -> u64 {
    let largest = gpus.iter().map(|g| g.memory_mib).max().unwrap_or(1);
    // Doubling then bisecting: the size only shrinks as the unit grows.
    let fits = |unit: u64| {
        let units = Units {
            memory_unit_mib: unit,
            ..units
        };
        DeviceModel::new(Resource::GpuMemory, gpus.clone(), tags.clone(), units)
            .worst_case_wire_len()
            <= KUBELET_MAX_MESSAGE_BYTES
    };
    let mut hi = units.memory_unit_mib.max(1);
    while !fits(hi) && hi < largest {
        hi = (hi * 2).min(largest);
    }
    let mut lo = units.memory_unit_mib;
    while lo + 1 < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::api;
    use prost::Message;

    pub(crate) fn gpu(i: u32, memory_mib: u64, numa: Option<u32>) -> Gpu {
        Gpu {
            uuid: format!("GPU-{i:08x}-aaaa-bbbb-cccc-ddddeeeeffff"),
            memory_mib,
            index: i,
            numa_node: numa,
        }
    }

    /// The offer of a config enabling `resources` at `unit` MiB per memory
    /// device and the default 100 gpu-core devices per GPU.
    pub(crate) fn config(resources: &[Resource], unit: u64) -> Offer {
        Offer {
            resources: resources.to_vec(),
            units: Units {
                memory_unit_mib: unit,
                cores_per_gpu: 100,
            },
        }
    }

    /// The list the way a naive plugin builds it, to check our arithmetic.
    pub(crate) fn eager_list(m: &DeviceModel, healthy: &[bool]) -> api::ListAndWatchResponse {
        let mut devices = Vec::new();
        m.for_each_id(|gpu, id| {
            devices.push(api::Device {
                id: id.to_owned(),
                health: if healthy[gpu] { HEALTHY } else { UNHEALTHY }.to_owned(),
                topology: m.topology(gpu).map(|n| api::TopologyInfo {
                    nodes: vec![api::NumaNode { id: i64::from(n) }],
                }),
            })
        });
        api::ListAndWatchResponse { devices }
    }

    #[test]
    fn device_counts_follow_the_units() {
        let gpus = vec![gpu(0, 16_384, Some(0)), gpu(1, 8_000, Some(1))];
        let plan = Plan::new(config(&Resource::ALL, 2), gpus).unwrap();
        assert_eq!(
            plan.model(Resource::GpuMemory).unwrap().device_count(),
            8_192 + 4_000
        );
        assert_eq!(plan.model(Resource::GpuCore).unwrap().device_count(), 200);
        assert_eq!(plan.model(Resource::GpuCount).unwrap().device_count(), 2);
    }

    #[test]
    fn wire_len_matches_prost_exactly() {
        let gpus = vec![
            gpu(0, 3_000, Some(0)),
            gpu(1, 2_000, Some(3)),
            gpu(2, 50, None),
        ];
        let plan = Plan::new(config(&Resource::ALL, 1), gpus).unwrap();
        for m in plan.models() {
            for healthy in [
                [true, true, true],
                [true, false, true],
                [false, false, false],
            ] {
                let eager = eager_list(m, &healthy);
                assert_eq!(
                    m.wire_len(|g| healthy[g]),
                    eager.encoded_len(),
                    "{}",
                    m.resource()
                );
            }
        }
    }

    #[test]
    fn every_id_decodes_to_its_device() {
        let gpus = vec![gpu(0, 2_000, None), gpu(1, 1_500, None)];
        let plan = Plan::new(config(&Resource::ALL, 1), gpus).unwrap();
        for m in plan.models() {
            let mut n = 0;
            m.for_each_id(|gpu, id| {
                let d = m.decode(id.as_bytes()).unwrap();
                assert_eq!(d.gpu, gpu);
                assert_eq!(m.id(d), id);
                assert!(id.len() <= 63);
                n += 1;
            });
            assert_eq!(n as u64, m.device_count());
        }
    }

    #[test]
    fn unknown_and_duplicate_ids_are_named() {
        let plan = Plan::new(config(&[Resource::GpuCore], 1), vec![gpu(0, 10, None)]).unwrap();
        let m = plan.model(Resource::GpuCore).unwrap();
        let first = m.id(DeviceRef { gpu: 0, unit: 0 });
        let past_end = m.id(DeviceRef { gpu: 0, unit: 100 });
        assert_eq!(
            m.decode(past_end.as_bytes()),
            Err(IdError::Unknown(past_end.clone()))
        );
        let dup = [first.clone(), first.clone()];
        assert_eq!(
            m.decode_all(dup.iter().map(|s| s.as_bytes())),
            Err(IdError::Duplicate(first))
        );
        assert!(
            m.decode_all(std::iter::once(&b"nope"[..]))
                .unwrap_err()
                .to_string()
                .contains("\"nope\"")
        );
    }

    #[test]
    fn two_80gb_gpus_fit_at_one_mib() {
        let gpus = vec![gpu(0, 81_920, Some(0)), gpu(1, 81_920, Some(1))];
        let plan = Plan::new(config(&Resource::ALL, 1), gpus).unwrap();
        let m = plan.model(Resource::GpuMemory).unwrap();
        let per_device = m.wire_len(|_| true) as f64 / m.device_count() as f64;
        assert!(per_device < 20.0, "{per_device} bytes per device");
    }

    #[test]
    fn too_large_names_the_smallest_unit_that_fits() {
        let gpus: Vec<Gpu> = (0..8).map(|i| gpu(i, 81_920, None)).collect();
        let err = Plan::new(config(&Resource::ALL, 1), gpus.clone()).unwrap_err();
        let PlanError::TooLarge { fits, .. } = err.clone() else {
            panic!("{err}")
        };
        assert!(err.to_string().contains("memory_unit_mib"));
        assert!(Plan::new(config(&Resource::ALL, fits), gpus.clone()).is_ok());
        assert!(Plan::new(config(&Resource::ALL, fits - 1), gpus).is_err());
    }

    #[test]
    fn a_memory_unit_over_a_gpus_memory_is_refused_naming_the_gpu() {
        let gpus = vec![gpu(0, 81_920, None), gpu(1, 24_576, None)];
        let err = Plan::new(config(&Resource::ALL, 32_768), gpus.clone()).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("memory_unit_mib") && text.contains(&gpus[1].uuid),
            "{text}"
        );
        assert!(text.contains("can take is 24576"), "{text}");
        assert!(Plan::new(config(&Resource::ALL, 24_576), gpus.clone()).is_ok());
        // Without gpu-memory the unit gives no resource its devices.
        let others = [Resource::GpuCore, Resource::GpuCount];
        assert!(Plan::new(config(&others, 32_768), gpus).is_ok());
    }

    #[test]
    fn no_gpus_and_duplicate_uuids_are_refused() {
        assert_eq!(
            Plan::new(config(&Resource::ALL, 1), vec![]).unwrap_err(),
            PlanError::NoGpus
        );
        let g = gpu(0, 10, None);
        let err = Plan::new(config(&Resource::ALL, 1), vec![g.clone(), g.clone()]).unwrap_err();
        assert_eq!(err, PlanError::DuplicateUuid(g.uuid));
    }
}
