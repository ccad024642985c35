//! Where a GPU sits on PCI, in the forms Kubernetes' standard device
//! attributes take (k8s.io/dynamic-resource-allocation's `deviceattribute`):
//! the bus ID in extended BDF (`0000:3b:00.0`), and the PCIe root complex
//! (`pci0000:3a`) read from sysfs, whose mount point the config names.
//! Best effort: what cannot be read or does not have the expected shape is
//! `None`, and its attribute is left out.

use std::path::{Component, Path, PathBuf};

/// The extended BDF form (`dddd:bb:dd.f`, lowercase hex) of a bus ID as
/// NVML gives it (`00000000:3B:00.0`, an 8-digit domain) or as written in
/// a config; `None` for anything else, or a domain beyond 4 hex digits,
/// which the standard form cannot hold.
pub(crate) fn bus_id(raw: &str) -> Option<String> {
    let (domain, rest) = raw.trim().split_once(':')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit());
    let hex = |s: &str, len: usize| s.len() == len && digits(s);
    // from_str_radix alone would take a sign.
    let domain = u16::from_str_radix(domain, 16)
        .ok()
        .filter(|_| digits(domain))?;
    let rest = rest.to_ascii_lowercase();
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    (hex(bus, 2) && hex(device, 2) && hex(function, 1))
        .then(|| format!("{domain:04x}:{bus}:{device}.{function}"))
}

/// The sysfs link of the device at `bus_id` (extended BDF).
fn device_link(sysfs_root: &Path, bus_id: &str) -> PathBuf {
    sysfs_root.join("bus/pci/devices").join(bus_id)
}

/// The device's NUMA node; `None` where the platform has none (sysfs says
/// -1) or sysfs cannot be read.
pub(crate) fn numa_node(sysfs_root: &Path, bus_id: &str) -> Option<u32> {
    let text = std::fs::read_to_string(device_link(sysfs_root, bus_id).join("numa_node")).ok()?;
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// The PCIe root complex the device at `bus_id` (extended BDF) sits under:
/// `<sysfs>/bus/pci/devices/<bus_id>` links to
/// `<sysfs>/devices/pci<domain>:<bus>/…/<bus_id>` (through any bridges),
/// and the root is the first component under `devices`.
pub(crate) fn pcie_root(sysfs_root: &Path, bus_id: &str) -> Option<String> {
    let target = std::fs::read_link(device_link(sysfs_root, bus_id)).ok()?;
    // The kernel writes the link relative to its directory; an absolute
    // one counts only inside this sysfs.
    let relative = if target.is_absolute() {
        target.strip_prefix(sysfs_root).ok()?.to_owned()
    } else {
        Path::new("bus/pci/devices").join(target)
    };
    root_of(&relative, bus_id)
}

/// The root complex in `path` (relative to sysfs, `..` not yet resolved):
/// `devices/pci…/…/<bus_id>` once resolved, else `None`.
fn root_of(path: &Path, bus_id: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => parts.push(p.to_str()?),
            Component::CurDir => {}
            // Out of sysfs: no device of it.
            Component::ParentDir => drop(parts.pop()?),
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    match parts[..] {
        ["devices", root, .., last] if root.starts_with("pci") && last == bus_id => {
            Some(root.to_owned())
        }
        _ => None,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn nvml_bus_ids_take_the_extended_bdf_form() {
        assert_eq!(bus_id("00000000:3B:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(bus_id("0001:c1:1f.7").as_deref(), Some("0001:c1:1f.7"));
        assert_eq!(bus_id("0000FFFF:04:00.1").as_deref(), Some("ffff:04:00.1"));
        // A domain the 4-digit form cannot hold (a VMD domain), and shapes
        // that are no bus ID.
        for odd in [
            "00010000:3b:00.0",
            "3b:00.0",
            "0000:3b:00",
            "0000:3b:0.0",
            "0000:3b:00.10",
            "0000:3g:00.0",
            "0000:3b:00.0:1",
            "+000:3b:00.0",
            "",
        ] {
            assert_eq!(bus_id(odd), None, "{odd}");
        }
    }

    /// A sysfs holding one device, `0000:3b:00.0`, behind a bridge of the
    /// root complex `pci0000:3a`, linked from bus/pci/devices as the
    /// kernel links it, with `numa`.
    pub(in crate::rules::device) fn sysfs(numa: &str) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let device = root
            .path()
            .join("devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0");
        std::fs::create_dir_all(&device).unwrap();
        std::fs::write(device.join("numa_node"), numa).unwrap();
        let links = root.path().join("bus/pci/devices");
        std::fs::create_dir_all(&links).unwrap();
        symlink(
            "../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0",
            links.join("0000:3b:00.0"),
        )
        .unwrap();
        root
    }

    #[test]
    fn the_pcie_root_is_read_from_the_devices_sysfs_link() {
        let root = sysfs("1\n");
        assert_eq!(
            pcie_root(root.path(), "0000:3b:00.0").as_deref(),
            Some("pci0000:3a")
        );
        assert_eq!(numa_node(root.path(), "0000:3b:00.0"), Some(1));
        // An absolute link inside this sysfs says the same.
        let links = root.path().join("bus/pci/devices");
        symlink(
            root.path()
                .join("devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1"),
            links.join("0000:3b:00.1"),
        )
        .unwrap();
        assert_eq!(
            pcie_root(root.path(), "0000:3b:00.1").as_deref(),
            Some("pci0000:3a")
        );
        // Another device, absent: no root, no NUMA node.
        assert_eq!(pcie_root(root.path(), "0000:3c:00.0"), None);
        assert_eq!(numa_node(root.path(), "0000:3c:00.0"), None);
    }

    #[test]
    fn a_link_of_another_shape_gives_no_root() {
        let root = sysfs("-1\n");
        // -1: the platform has no NUMA information.
        assert_eq!(numa_node(root.path(), "0000:3b:00.0"), None);
        let links = root.path().join("bus/pci/devices");
        for (bus, target) in [
            // Not under devices/pci…
            ("0000:3b:00.1", "../../../devices/platform/0000:3b:00.1"),
            // Ending in another device.
            ("0000:3b:00.2", "../../../devices/pci0000:3a/0000:3b:00.0"),
            // Out of sysfs.
            (
                "0000:3b:00.3",
                "../../../../../../devices/pci0000:3a/0000:3b:00.3",
            ),
            // Absolute, outside this sysfs.
            ("0000:3b:00.4", "/elsewhere/devices/pci0000:3a/0000:3b:00.4"),
            // Dangling is fine: only the link is read.
            ("0000:3b:00.5", "../../../devices/pci0000:3a/0000:3b:00.5"),
        ] {
            symlink(target, links.join(bus)).unwrap();
            let want = (bus == "0000:3b:00.5").then(|| "pci0000:3a".to_owned());
            assert_eq!(pcie_root(root.path(), bus), want, "{target}");
        }
        // A directory where the link should be.
        std::fs::create_dir(links.join("0000:3b:00.6")).unwrap();
        assert_eq!(pcie_root(root.path(), "0000:3b:00.6"), None);
        // No sysfs at all.
        assert_eq!(pcie_root(&root.path().join("none"), "0000:3b:00.0"), None);
    }
}
