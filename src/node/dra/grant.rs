//! What an allocated ResourceClaim grants on this node, read from its
//! allocation without I/O: for every request with results of this driver
//! in this node's pool, the GPUs and what the share consumed
//! (`consumedCapacity` memory and cores), or whole GPUs.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};

use crate::node::grant::Limits;
use crate::rules::device::Gpu;
use crate::rules::usage::quantity::parse_count;

/// The capacity names a GPU publishes with consumable capacity.
pub(crate) const MEMORY: &str = "memory";
pub(crate) const CORES: &str = "cores";

const MIB: u64 = 1 << 20;

/// A GPU's device name in the pool: its NVML index, as NVIDIA's DRA driver
/// names them, a DNS label whatever the UUID looks like.
pub(crate) fn device_name(gpu: &Gpu) -> String {
    format!("gpu-{}", gpu.index)
}

/// What the grant is read against: the driver, this node's pool and DRA's
/// GPUs, and the gpu-core unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Node {
    pub(crate) driver: String,
    pub(crate) pool: String,
    pub(crate) gpus: Vec<Gpu>,
    pub(crate) cores_per_gpu: u32,
}

impl Node {
    /// This node's pool of DRA's `gpus`, as `config` names it.
    pub(crate) fn of(config: &crate::config::Config, gpus: Vec<Gpu>) -> Node {
        Node {
            driver: config.dra.driver_name(&config.resource_domain),
            pool: config.node_name.clone(),
            gpus,
            cores_per_gpu: config.cores_per_gpu,
        }
    }
}

/// One allocation result as the kubelet is answered about it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct ResultRef {
    pub(crate) request: String,
    pub(crate) device: String,
    pub(crate) share_id: Option<String>,
}

/// One request's part of a claim: its results, their GPUs (indexes into
/// [`Node::gpus`]; one when shared) and what they cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestGrant {
    pub(crate) request: String,
    pub(crate) results: Vec<ResultRef>,
    pub(crate) gpus: Vec<usize>,
    pub(crate) limits: Limits,
}

impl RequestGrant {
    /// The share's own key: its share ID when it has one, else the request
    /// (whole GPUs are the request's alone). Unique within the claim.
    pub(crate) fn share_key(&self) -> String {
        let request = self.request.replace('/', "_");
        match self.results.first().and_then(|r| r.share_id.as_deref()) {
            Some(id) => format!("{request}-{id}"),
            None => request,
        }
    }
}

/// Why a claim cannot be prepared; the text is what the kubelet shows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum GrantError {
    #[error("claim {0} is not allocated")]
    NotAllocated(String),
    #[error("claim {name} has UID {found}, not {asked}: it was deleted and made again")]
    UidMismatch {
        name: String,
        asked: String,
        found: String,
    },
    #[error("claim {0} has no device of driver {1} in pool {2}")]
    NoResults(String, String, String),
    #[error("claim {claim}: device {device} is not a GPU this driver serves on this node")]
    UnknownDevice { claim: String, device: String },
    #[error("claim {claim}: consumed {capacity} {value:?}: {why}")]
    BadCapacity {
        claim: String,
        capacity: String,
        value: String,
        why: String,
    },
    #[error(
        "claim {claim}: request {request} has two shares of device {device}; a share over \
         several GPUs needs them distinct (the request's constraint `distinctAttribute: \
         {driver}/uuid`)"
    )]
    SameGpuTwice {
        claim: String,
        request: String,
        device: String,
        driver: String,
    },
    #[error(
        "claim {claim}: request {request} consumed unlike shares of its {count} GPUs; a share \
         over several GPUs takes the same of each"
    )]
    UnlikeShares {
        claim: String,
        request: String,
        count: usize,
    },
}

/// The grant of `claim` (which the kubelet named by `uid`) on `node`.
pub(crate) fn grant(
    claim: &ResourceClaim,
    uid: &str,
    node: &Node,
) -> Result<Vec<RequestGrant>, GrantError> {
    let name = format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    );
    let found = claim.metadata.uid.as_deref().unwrap_or_default();
    if found != uid {
        return Err(GrantError::UidMismatch {
            name,
            asked: uid.to_owned(),
            found: found.to_owned(),
        });
    }
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .ok_or_else(|| GrantError::NotAllocated(name.clone()))?;
    // Per request, in the allocation's order.
    let mut requests: BTreeMap<&str, Vec<&DeviceRequestAllocationResult>> = BTreeMap::new();
    for r in results
        .iter()
        .filter(|r| r.driver == node.driver && r.pool == node.pool)
    {
        requests.entry(&r.request).or_default().push(r);
    }
    if requests.is_empty() {
        return Err(GrantError::NoResults(
            name,
            node.driver.clone(),
            node.pool.clone(),
        ));
    }
    requests
        .into_iter()
        .map(|(request, results)| request_grant(&name, request, &results, node))
        .collect()
}

fn request_grant(
    claim: &str,
    request: &str,
    results: &[&DeviceRequestAllocationResult],
    node: &Node,
) -> Result<RequestGrant, GrantError> {
    let mut gpus = Vec::new();
    let mut each = Vec::new();
    for r in results {
        let g = node
            .gpus
            .iter()
            .position(|g| device_name(g) == r.device)
            .ok_or_else(|| GrantError::UnknownDevice {
                claim: claim.to_owned(),
                device: r.device.clone(),
            })?;
        each.push(consumed(claim, r, &node.gpus[g], node.cores_per_gpu)?);
        gpus.push(g);
    }
    let limits = alike(&each, &gpus, node).ok_or_else(|| GrantError::UnlikeShares {
        claim: claim.to_owned(),
        request: request.to_owned(),
        count: gpus.len(),
    })?;
    // A share over several GPUs (a request's `count`) takes each GPU once.
    if limits.shared()
        && let Some(again) = (1..gpus.len()).find(|&i| gpus[..i].contains(&gpus[i]))
    {
        return Err(GrantError::SameGpuTwice {
            claim: claim.to_owned(),
            request: request.to_owned(),
            device: results[again].device.clone(),
            driver: node.driver.clone(),
        });
    }
    Ok(RequestGrant {
        request: request.to_owned(),
        results: results
            .iter()
            .map(|r| ResultRef {
                request: r.request.clone(),
                device: r.device.clone(),
                share_id: r.share_id.clone(),
            })
            .collect(),
        gpus,
        limits,
    })
}

/// The one limit that holds on each of a request's GPUs (`each` consumed
/// of `gpus`), which HAMi-core applies by index: the same cores on every
/// GPU, and the same memory, where a GPU whose share is all of its memory
/// (on a node of unlike GPUs) counts as capped at the others' amount if
/// that is at least its size. `None` when the shares are unlike.
fn alike(each: &[Limits], gpus: &[usize], node: &Node) -> Option<Limits> {
    let first = each.first().copied().unwrap_or_default();
    if each.iter().any(|l| l.core_percent != first.core_percent) {
        return None;
    }
    let mut caps = each.iter().filter_map(|l| l.memory_mib);
    let cap = caps.next();
    if caps.any(|m| Some(m) != cap) {
        return None;
    }
    let uncapped_fit = each
        .iter()
        .zip(gpus)
        .filter(|(l, _)| l.memory_mib.is_none())
        .all(|(_, &g)| cap.is_none_or(|m| node.gpus[g].memory_mib <= m));
    uncapped_fit.then_some(Limits {
        memory_mib: cap,
        core_percent: first.core_percent,
    })
}

/// What one result consumed of `gpu`: nothing recorded, or all its memory
/// and no or all cores, is the whole GPU (no limits); no cores is no
/// compute limit (the slice's default for a claim naming memory alone).
fn consumed(
    claim: &str,
    r: &DeviceRequestAllocationResult,
    gpu: &Gpu,
    cores_per_gpu: u32,
) -> Result<Limits, GrantError> {
    let Some(capacity) = r.consumed_capacity.as_ref() else {
        return Ok(Limits::default());
    };
    let read = |key: &str, max: u64, none: bool| -> Result<Option<u64>, GrantError> {
        let Some(q) = capacity.get(key) else {
            return Ok(None);
        };
        let bad = |why: String| GrantError::BadCapacity {
            claim: claim.to_owned(),
            capacity: key.to_owned(),
            value: q.0.clone(),
            why,
        };
        let n = parse_count(&q.0, max).map_err(|e| bad(e.to_string()))?;
        match n {
            0 if none => Ok(None),
            0 => Err(bad("nothing to run with".into())),
            n => Ok(Some(n)),
        }
    };
    let memory_bytes = gpu.memory_mib.saturating_mul(MIB);
    // Rounded down: a container never gets more than it was granted.
    let memory_mib = read(MEMORY, memory_bytes, false)?.map(|b| (b / MIB).max(1));
    let cores = read(CORES, u64::from(cores_per_gpu), true)?;
    let whole = memory_mib.is_none_or(|m| m >= gpu.memory_mib)
        && cores.is_none_or(|c| c >= cores_per_gpu.into());
    if whole {
        return Ok(Limits::default());
    }
    Ok(Limits {
        memory_mib,
        // cores_per_gpu divides 100: a whole percent.
        core_percent: cores.map(|c| c * 100 / u64::from(cores_per_gpu)),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    use super::*;

    pub(crate) fn node() -> Node {
        let gpu = |uuid: &str, index| Gpu {
            uuid: uuid.into(),
            memory_mib: 16384,
            index,
            numa_node: None,
        };
        Node {
            driver: "gpu.doslab.io".into(),
            pool: "node-a".into(),
            gpus: vec![gpu("GPU-a", 0), gpu("GPU-b", 1)],
            cores_per_gpu: 100,
        }
    }

    /// A result of `device` for `request`, consuming `capacity`.
    pub(crate) fn result(
        request: &str,
        device: &str,
        capacity: &[(&str, &str)],
        share: Option<&str>,
    ) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            driver: "gpu.doslab.io".into(),
            pool: "node-a".into(),
            device: device.into(),
            request: request.into(),
            share_id: share.map(Into::into),
            consumed_capacity: (!capacity.is_empty()).then(|| {
                capacity
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), Quantity((*v).into())))
                    .collect()
            }),
            ..Default::default()
        }
    }

    pub(crate) fn claim(uid: &str, results: Vec<DeviceRequestAllocationResult>) -> ResourceClaim {
        let mut c = ResourceClaim::default();
        c.metadata.name = Some("c".into());
        c.metadata.namespace = Some("ns".into());
        c.metadata.uid = Some(uid.into());
        c.status = Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(results),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        c
    }

    #[test]
    fn a_share_caps_memory_and_cores_on_its_gpu() {
        let share = result(
            "gpu",
            "gpu-1",
            &[("memory", "8Gi"), ("cores", "30")],
            Some("s1"),
        );
        let g = grant(&claim("u1", vec![share]), "u1", &node()).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].gpus, vec![1]);
        assert_eq!(
            g[0].limits,
            Limits {
                memory_mib: Some(8192),
                core_percent: Some(30)
            }
        );
        assert_eq!(g[0].share_key(), "gpu-s1");
        // cores in 5 % units: 6 of 20 is 30 %.
        let n = Node {
            cores_per_gpu: 20,
            ..node()
        };
        let share = result("gpu", "gpu-0", &[("cores", "6")], Some("s2"));
        let g = grant(&claim("u1", vec![share]), "u1", &n).unwrap();
        assert_eq!(g[0].limits.core_percent, Some(30));
        assert_eq!(g[0].limits.memory_mib, None);
        // Memory alone (cores at the slice's default, none): no compute
        // limit, as a pod asking gpu-memory alone gets from the device
        // plugin.
        let share = result(
            "gpu",
            "gpu-0",
            &[("memory", "4Gi"), ("cores", "0")],
            Some("s3"),
        );
        let g = grant(&claim("u1", vec![share]), "u1", &node()).unwrap();
        assert_eq!(
            g[0].limits,
            Limits {
                memory_mib: Some(4096),
                core_percent: None
            }
        );
    }

    #[test]
    fn no_capacity_or_all_of_it_is_the_whole_gpu() {
        let whole = [
            result("a", "gpu-0", &[], None),
            result(
                "b",
                "gpu-1",
                &[("memory", "16Gi"), ("cores", "100")],
                Some("x"),
            ),
        ];
        let g = grant(&claim("u", whole.to_vec()), "u", &node()).unwrap();
        assert!(g.iter().all(|r| r.limits == Limits::default()), "{g:?}");
        assert_eq!(g[0].share_key(), "a");
        // The slice's defaults for a claim naming no capacity: all the
        // memory, no cores.
        let defaults = result(
            "a",
            "gpu-0",
            &[("memory", "16Gi"), ("cores", "0")],
            Some("y"),
        );
        let g = grant(&claim("u", vec![defaults]), "u", &node()).unwrap();
        assert_eq!(g[0].limits, Limits::default());
        // Two whole GPUs in one request.
        let two = vec![
            result("r", "gpu-0", &[], None),
            result("r", "gpu-1", &[], None),
        ];
        let g = grant(&claim("u", two), "u", &node()).unwrap();
        assert_eq!((g.len(), g[0].gpus.clone()), (1, vec![0, 1]));
    }

    #[test]
    fn what_cannot_be_prepared_says_why() {
        let n = node();
        let ok = result("r", "gpu-0", &[], None);
        let e = grant(&claim("u", vec![ok.clone()]), "v", &n).unwrap_err();
        assert!(matches!(e, GrantError::UidMismatch { .. }), "{e}");
        let mut c = claim("u", vec![]);
        c.status = None;
        assert_eq!(
            grant(&c, "u", &n).unwrap_err(),
            GrantError::NotAllocated("ns/c".into())
        );
        let other = DeviceRequestAllocationResult {
            pool: "node-b".into(),
            ..ok.clone()
        };
        let e = grant(&claim("u", vec![other]), "u", &n).unwrap_err();
        assert!(matches!(e, GrantError::NoResults(..)), "{e}");
        let e = grant(&claim("u", vec![result("r", "gpu-7", &[], None)]), "u", &n).unwrap_err();
        assert!(e.to_string().contains("gpu-7"), "{e}");
        for bad in ["-1", "0", "1.5", "17Gi", "x"] {
            let r = result("r", "gpu-0", &[("memory", bad)], Some("s"));
            let e = grant(&claim("u", vec![r]), "u", &n).unwrap_err();
            assert!(matches!(e, GrantError::BadCapacity { .. }), "{bad}: {e}");
        }
        let r = result("r", "gpu-0", &[("cores", "101")], Some("s"));
        assert!(grant(&claim("u", vec![r]), "u", &n).is_err());
        let unlike = vec![
            result("r", "gpu-0", &[("cores", "10")], Some("s")),
            result("r", "gpu-1", &[("cores", "20")], Some("t")),
        ];
        let e = grant(&claim("u", unlike), "u", &n).unwrap_err();
        assert!(
            matches!(e, GrantError::UnlikeShares { count: 2, .. }),
            "{e}"
        );
        let half_whole = vec![
            result("r", "gpu-0", &[("cores", "10")], Some("s")),
            result("r", "gpu-1", &[], None),
        ];
        let e = grant(&claim("u", half_whole), "u", &n).unwrap_err();
        assert!(matches!(e, GrantError::UnlikeShares { .. }), "{e}");
        let unlike_memory = vec![
            result("r", "gpu-0", &[("memory", "4Gi")], Some("s")),
            result("r", "gpu-1", &[("memory", "8Gi")], Some("t")),
        ];
        let e = grant(&claim("u", unlike_memory), "u", &n).unwrap_err();
        assert!(matches!(e, GrantError::UnlikeShares { .. }), "{e}");
        let twice = vec![
            result("r", "gpu-1", &[("cores", "10")], Some("s")),
            result("r", "gpu-1", &[("cores", "10")], Some("t")),
        ];
        let e = grant(&claim("u", twice), "u", &n).unwrap_err();
        assert!(matches!(e, GrantError::SameGpuTwice { .. }), "{e}");
        assert!(e.to_string().contains("distinctAttribute"), "{e}");
    }

    /// A request of `count: 2` with capacity: the same share on two
    /// distinct GPUs, both in the grant with one limit each.
    #[test]
    fn a_share_may_span_distinct_gpus_alike() {
        let span = vec![
            result(
                "r",
                "gpu-0",
                &[("memory", "4Gi"), ("cores", "3")],
                Some("s"),
            ),
            result(
                "r",
                "gpu-1",
                &[("memory", "4Gi"), ("cores", "3")],
                Some("t"),
            ),
        ];
        let g = grant(&claim("u", span), "u", &node()).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].gpus, [0, 1]);
        assert_eq!(g[0].results.len(), 2);
        assert_eq!(g[0].limits.memory_mib, Some(4096));
        assert_eq!(g[0].share_key(), "r-s");

        // GPUs of unlike sizes: 16 GiB each is all of the small GPU and
        // half the big one; capped at 16 GiB on both, which holds.
        let mut n = node();
        n.gpus[1].memory_mib = 32768;
        let span = vec![
            result("r", "gpu-0", &[("memory", "16Gi")], Some("s")),
            result("r", "gpu-1", &[("memory", "16Gi")], Some("t")),
        ];
        let g = grant(&claim("u", span), "u", &n).unwrap();
        assert_eq!(g[0].limits.memory_mib, Some(16384));
        // Cores alone: each GPU's memory whole, the cores alike.
        let cores = vec![
            result("r", "gpu-0", &[("cores", "30")], Some("s")),
            result("r", "gpu-1", &[("cores", "30")], Some("t")),
        ];
        let g = grant(&claim("u", cores), "u", &n).unwrap();
        assert_eq!(
            (g[0].limits.memory_mib, g[0].limits.core_percent),
            (None, Some(30))
        );
    }
}
