//! Which pod and container a process belongs to, from its
//! `/proc/<pid>/cgroup` (pure). The kubelet puts every container in a
//! cgroup under `kubepods`, named after the pod's UID and the container's
//! runtime ID, in either driver's form and either cgroup version:
//!
//! - systemd: `…/kubepods.slice/kubepods-burstable.slice/
//!   kubepods-burstable-pod<uid, '_' for '-'>.slice/cri-containerd-<id>.scope`
//!   (`crio-<id>.scope`, `docker-<id>.scope`, `cri-dockerd-<id>.scope`);
//! - cgroupfs: `…/kubepods/besteffort/pod<uid>/<id>`;
//!
//! anywhere in the path, on the v2 line `0::…` or any v1 controller's line:
//! a node that is itself a container nests them, and a reader in a cgroup
//! namespace of its own (the runtimes' default on cgroup v2) sees them
//! relative to its own cgroup (`0::/../../besteffort/pod<uid>/<id>`), with
//! no `kubepods` left to anchor on. So the pod segment is found by its
//! shape, and the container's is the one after it.

/// A process's pod (its UID) and container (its runtime ID, as the
/// container status's `containerID` ends after `://`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Owner {
    pub(crate) pod_uid: String,
    pub(crate) container_id: String,
}

/// The runtimes' prefixes of a container's systemd scope.
const SCOPE_PREFIXES: [&str; 4] = ["cri-containerd-", "crio-", "cri-dockerd-", "docker-"];

/// The owner `cgroup` (a `/proc/<pid>/cgroup` file's text) names; None for
/// a process outside any pod's container (the daemon, a host process, a
/// runtime's monitor such as `crio-conmon-…`).
pub(crate) fn owner(cgroup: &str) -> Option<Owner> {
    cgroup.lines().find_map(|line| {
        // hierarchy-ID:controllers:path, the path possibly holding ':'.
        let path = line.splitn(3, ':').nth(2)?;
        let parts: Vec<&str> = path.split('/').collect();
        parts.windows(2).find_map(|pair| {
            Some(Owner {
                pod_uid: pod_uid(pair[0])?,
                container_id: container_id(pair[1])?,
            })
        })
    })
}

/// The pod UID a path segment names: `pod<uid>` (cgroupfs) or
/// `kubepods[-<qos>]-pod<uid with '_'>.slice` (systemd).
fn pod_uid(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".slice").unwrap_or(segment);
    let uid = name
        .rsplit_once("-pod")
        .map_or_else(|| name.strip_prefix("pod"), |(_, u)| Some(u))?;
    let uid = uid.replace('_', "-");
    let hex_or_dash = |c: char| c.is_ascii_hexdigit() || c == '-';
    (uid.len() == 36 && uid.chars().all(hex_or_dash)).then_some(uid)
}

/// The container ID a segment names: a runtime's scope or the bare ID.
fn container_id(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".scope").unwrap_or(segment);
    let id = SCOPE_PREFIXES
        .iter()
        .find_map(|p| name.strip_prefix(p))
        .unwrap_or(name);
    // Runtimes' IDs are 64 hex digits; a monitor's scope is not one.
    (id.len() >= 12 && id.chars().all(|c| c.is_ascii_hexdigit())).then(|| id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "5f3c2a1b-0d4e-4c6f-8a9b-1c2d3e4f5a6b";
    const ID: &str = "9e1f0c3a7b5d2e4f6a8c0b1d3e5f7a9c2b4d6e8f0a1c3e5b7d9f1a3c5e7b9d0f";

    fn owned() -> Option<Owner> {
        Some(Owner {
            pod_uid: UID.into(),
            container_id: ID.into(),
        })
    }

    #[test]
    fn every_driver_and_version_names_the_pod_and_container() {
        let systemd_uid = UID.replace('-', "_");
        let cases = [
            // cgroup v2, systemd driver, containerd.
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/\
                 kubepods-burstable-pod{systemd_uid}.slice/cri-containerd-{ID}.scope\n"
            ),
            // Guaranteed QoS has no QoS slice; CRI-O.
            format!("0::/kubepods.slice/kubepods-pod{systemd_uid}.slice/crio-{ID}.scope"),
            // cgroupfs driver.
            format!("0::/kubepods/besteffort/pod{UID}/{ID}"),
            // cgroup v1: the controllers' lines, any of which names it.
            format!(
                "12:pids:/kubepods/burstable/pod{UID}/{ID}\n\
                 11:memory:/kubepods/burstable/pod{UID}/{ID}\n1:name=systemd:/\n"
            ),
            // A node that is a container (kind): nested under its own.
            format!("0::/system.slice/docker-abc.scope/kubepods/pod{UID}/{ID}"),
            // Read from a cgroup namespace of its own: relative paths.
            format!("0::/../../besteffort/pod{UID}/{ID}"),
            format!(
                "0::/../../../kubepods-besteffort.slice/kubepods-besteffort-pod{systemd_uid}.slice/\
                 cri-containerd-{ID}.scope"
            ),
        ];
        for cgroup in cases {
            assert_eq!(owner(&cgroup), owned(), "{cgroup}");
        }
    }

    #[test]
    fn processes_outside_a_pods_container_have_no_owner() {
        let systemd_uid = UID.replace('-', "_");
        for cgroup in [
            "0::/system.slice/containerd.service".to_owned(),
            "0::/user.slice/user-0.slice/session-1.scope".to_owned(),
            // The pod's own cgroup (a sandbox's process) and a runtime's monitor.
            format!("0::/kubepods.slice/kubepods-pod{systemd_uid}.slice"),
            format!("0::/kubepods.slice/kubepods-pod{systemd_uid}.slice/crio-conmon-{ID}.scope"),
            // Not a UID, and garbage.
            format!("0::/kubepods/podnot-a-uid/{ID}"),
            "garbage".to_owned(),
            String::new(),
        ] {
            assert_eq!(owner(&cgroup), None, "{cgroup}");
        }
    }
}
