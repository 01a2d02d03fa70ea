//! How far apart two GPUs sit on the PCIe tree, in the words of NCCL's `NCCL_P2P_LEVEL`: PIX
//! (one switch between them), PXB (several switches, no host bridge), PHB (through the CPU's
//! host bridges, one NUMA node), SYS (across NUMA nodes). Read from sysfs: each GPU's PCI bus
//! id (`cuDeviceGetPCIBusId`) names `/sys/bus/pci/devices/<id>`, a link to the device's path
//! from its host bridge (`/sys/devices/pci0000:00/0000:00:01.0/.../<id>`), beside its
//! `numa_node`. `OXCCL_SYSFS_ROOT` reads another tree (tests; containers that mount it
//! elsewhere).

use super::driver;
use std::path::{Path, PathBuf};

/// A PCIe distance (NCCL's numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Pix = 1,
    Pxb = 2,
    Phb = 3,
    Sys = 4,
}

/// The distance between two devices from their paths (host bridge first, the device last)
/// and NUMA nodes (-1: unknown, taken as node 0, as NCCL does).
pub fn level_of(a: &[String], b: &[String], numa: (i32, i32)) -> Level {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    match common {
        // Different host bridges: through the CPU, or across its sockets.
        0 if numa.0.max(0) == numa.1.max(0) => Level::Phb,
        0 => Level::Sys,
        // One host bridge, different root ports.
        1 => Level::Phb,
        // Below one root port: one switch (its downstream port, then the device, on each
        // side), or more.
        _ if a.len() - common <= 2 && b.len() - common <= 2 => Level::Pix,
        _ => Level::Pxb,
    }
}

fn sysfs() -> PathBuf {
    PathBuf::from(crate::param::get_str("OXCCL_SYSFS_ROOT").unwrap_or_else(|| "/sys".into()))
}

/// Device `ordinal`'s bus id as sysfs spells it (`0000:3b:00.0`).
fn bus_id(ordinal: i32) -> Option<String> {
    sysfs_bus_id(&driver::pci_bus_id(ordinal).ok()??)
}

/// A bus id as sysfs spells it, from the driver's spelling (its domain may have 8 digits, its
/// letters be capitals).
fn sysfs_bus_id(raw: &str) -> Option<String> {
    let mut parts = raw.trim().split([':', '.']);
    let mut hex = || u32::from_str_radix(parts.next()?, 16).ok();
    let (domain, bus, dev, func) = (hex()?, hex()?, hex()?, hex()?);
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// A device's path from its host bridge, from the canonical path of its sysfs entry: from the
/// last component naming a host bridge (`pciDDDD:BB`; bus addresses never start so), which
/// leaves out whatever the sysfs root's own path holds, and a bridge behind another (Intel's
/// VMD domains, `pci10000:e0` under a device of `pci0000:00`), as NCCL does.
fn from_host_bridge(real: &Path) -> Vec<String> {
    let parts: Vec<String> = real
        .components()
        .filter_map(|c| c.as_os_str().to_str().map(str::to_string))
        .collect();
    match parts.iter().rposition(|c| c.starts_with("pci")) {
        Some(i) => parts[i..].to_vec(),
        None => Vec::new(),
    }
}

/// Device `ordinal`'s path from its host bridge, and its NUMA node.
fn place(root: &Path, ordinal: i32) -> Option<(Vec<String>, i32)> {
    let dev = root.join("bus/pci/devices").join(bus_id(ordinal)?);
    let parts = from_host_bridge(&std::fs::canonicalize(&dev).ok()?);
    let numa = std::fs::read_to_string(dev.join("numa_node"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(-1);
    (!parts.is_empty()).then_some((parts, numa))
}

/// How far apart devices `a` and `b` (ordinals of this process) are on the PCIe tree (None:
/// sysfs or the driver does not say).
pub fn level(a: i32, b: i32) -> Option<Level> {
    let root = sysfs();
    let (pa, na) = place(&root, a)?;
    let (pb, nb) = place(&root, b)?;
    Some(level_of(&pa, &pb, (na, nb)))
}

#[cfg(test)]
mod tests {
    use super::{from_host_bridge, level_of, sysfs_bus_id, Level};
    use std::path::Path;

    fn path(s: &str) -> Vec<String> {
        s.split('/').map(str::to_string).collect()
    }

    #[test]
    fn pcie_distances_as_nccl_names_them() {
        let sw = "pci0000:00/0000:00:01.0/0000:01:00.0";
        let a = path(&format!("{sw}/0000:02:00.0/0000:03:00.0"));
        let b = path(&format!("{sw}/0000:02:01.0/0000:04:00.0"));
        assert_eq!(level_of(&a, &b, (0, 0)), Level::Pix);
        // Two levels of switches under one root port.
        let c = path(&format!(
            "{sw}/0000:02:02.0/0000:05:00.0/0000:06:00.0/0000:07:00.0"
        ));
        assert_eq!(level_of(&a, &c, (0, 0)), Level::Pxb);
        // Two root ports of one host bridge.
        let d = path("pci0000:00/0000:00:02.0/0000:08:00.0");
        assert_eq!(level_of(&a, &d, (0, 0)), Level::Phb);
        // Two host bridges: one NUMA node (or unknown), or two.
        let e = path("pci0000:80/0000:80:01.0/0000:81:00.0");
        assert_eq!(level_of(&a, &e, (0, 0)), Level::Phb);
        assert_eq!(level_of(&a, &e, (-1, -1)), Level::Phb);
        assert_eq!(level_of(&a, &e, (-1, 0)), Level::Phb);
        assert_eq!(level_of(&a, &e, (0, 1)), Level::Sys);
        assert_eq!(level_of(&a, &e, (-1, 1)), Level::Sys);
    }

    #[test]
    fn paths_start_at_the_last_host_bridge() {
        // A sysfs root whose own path names "pci...", and an Intel VMD domain: two root ports
        // behind the VMD bridge are PHB apart.
        let vmd = "/home/pci-lab/sys/devices/pci0000:00/0000:00:0e.0/pci10000:e0";
        let a = from_host_bridge(Path::new(&format!("{vmd}/10000:e0:1a.0/10000:e1:00.0")));
        let b = from_host_bridge(Path::new(&format!("{vmd}/10000:e0:1b.0/10000:e2:00.0")));
        assert_eq!(a[0], "pci10000:e0");
        assert_eq!(level_of(&a, &b, (0, 0)), Level::Phb);
        assert!(from_host_bridge(Path::new("/sys/devices/platform/x")).is_empty());
    }

    #[test]
    fn bus_ids_in_sysfs_spelling() {
        for raw in ["00000000:3B:00.0", "0000:3b:00.0", " 0000:3B:00.0\n"] {
            assert_eq!(sysfs_bus_id(raw).as_deref(), Some("0000:3b:00.0"), "{raw}");
        }
        assert_eq!(
            sysfs_bus_id("0001:0a:1f.1").as_deref(),
            Some("0001:0a:1f.1")
        );
        assert_eq!(sysfs_bus_id("3b:00"), None);
    }
}
