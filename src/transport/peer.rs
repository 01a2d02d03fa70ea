//! What ranks tell each other at init: where they run and the FIFO geometry they use.

use crate::error::{Error, Result};
use crate::liveness::{pid_namespace, Probe};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    pub host: u64,
    pub pid: u32,
    pub dev: i32,
    /// The device's UUID on the CUDA executor (zeros on the host executor): which physical GPU,
    /// whatever number each process gives it.
    pub gpu: [u8; 16],
    /// `FLAG_IPC`.
    pub flags: u32,
    /// The process's PID namespace (the inode of `/proc/self/ns/pid`, 0 if unknown): where it
    /// equals this process's, `pid` means the same process here.
    pub pidns: u64,
    pub slot_bytes: u64,
    pub nsteps: u32,
    /// Where this process keeps its cross-memory-attach probe word (`transport::cma`).
    pub probe: u64,
    /// The UUIDs of the GPUs this rank's GPU reaches as a peer, and that reach it
    /// (`gpu::memory::peers_capable`), among those its process sees (at most `MAX_REACHES`):
    /// two ranks of one host on different GPUs may share device memory where each names the
    /// other's.
    pub reaches: Vec<[u8; 16]>,
    /// The host's name, for messages (at most 64 bytes of it).
    pub hostname: String,
    /// The token of the lock by which its process tells peers of other PID namespaces that it
    /// lives (`liveness::hold`; 0: none). Not in the bytes: exchanged at init after them.
    pub alive: u64,
}

const BYTES: usize = 8 + 4 + 4 + 16 + 4 + 8 + 8 + 4 + 8;
/// The most peer GPUs a rank names (`reaches`; after the fixed bytes, a count byte and as many
/// UUIDs, then the host name).
const MAX_REACHES: usize = 64;
/// The bytes' first four: which layout follows (a rank of another oxccl version sends another).
const FORMAT: &[u8; 4] = b"OXP\x02";

/// The process takes connections in device memory by CUDA IPC (CUDA executor,
/// `OXCCL_CUDA_IPC` not 0, not `NCCL_P2P_DISABLE=1`).
const FLAG_IPC: u32 = 1;
/// The process left the slot size to oxccl (`OXCCL_CHUNK_BYTES` unset): see `comm_slot_bytes`.
const FLAG_DEFAULT_SLOTS: u32 = 2;
/// Between hosts this rank moves data through the net plugin, not the socket transport
/// (`plugin::uses_plugin`: `config.netName`, `NCCL_NET`).
const FLAG_NET_PLUGIN: u32 = 4;
/// Bits 8-10 of the flags: the rings a large ring collective is split across on this rank
/// (`OXCCL_CUDA_CHANNELS` on the CUDA executor, else 1): see `comm_channels`.
const CHANNELS_SHIFT: u32 = 8;

/// The slot size a communicator across hosts takes where rank 0 left it to oxccl (as NCCL's
/// Simple protocol moves 512 KiB per step over the network): each slot costs a header, a
/// counter handshake and a pass of the executor, and over TCP 128 KiB slots spent about a
/// tenth of a 16 MiB all-reduce between two hosts on that (scripts/ab-net.sh, see the README).
const ACROSS_HOSTS_SLOT_BYTES: usize = 512 << 10;

/// This host's identity: hostname, boot id, and which /dev/shm the process sees
/// (`OXCCL_HOSTID` overrides, for tests). Processes of one machine that do not share /dev/shm
/// (containers with private IPC, each mounting its own tmpfs) cannot share memory: they are
/// on different "hosts" and talk over the network, instead of each creating a FIFO the other
/// never sees.
fn host_hash() -> u64 {
    let id = std::env::var("OXCCL_HOSTID").unwrap_or_else(|_| {
        let host = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_default();
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let shm = nix::sys::stat::stat("/dev/shm")
            .map(|st| format!("{}:{}", st.st_dev, st.st_ino))
            .unwrap_or_default();
        format!("{host}|{}|{shm}", boot.trim())
    });
    // FNV-1a: stable across processes and builds.
    id.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// FIFO slot size: `OXCCL_CHUNK_BYTES`, whose default is larger on the CUDA executor (a slot
/// costs a counter handshake; kernels move a megabyte in about the time it takes).
fn slot_bytes() -> usize {
    match crate::gpu::kind() {
        crate::gpu::Kind::Cuda if !crate::param::is_set("OXCCL_CHUNK_BYTES") => 1 << 20,
        _ => crate::param::chunk_bytes(),
    }
}

/// `PeerInfo::reaches` of a rank on device `dev`.
fn reaches(dev: i32) -> Vec<[u8; 16]> {
    let n = crate::gpu::driver::device_count().unwrap_or(0);
    (0..n)
        .filter(|&d| crate::gpu::memory::peers_capable(dev, d))
        .filter_map(|d| crate::gpu::driver::device_uuid(d).ok())
        .take(MAX_REACHES)
        .collect()
}

impl PeerInfo {
    pub fn mine(dev: i32) -> PeerInfo {
        PeerInfo {
            host: host_hash(),
            pid: std::process::id(),
            dev,
            gpu: match crate::gpu::kind() {
                crate::gpu::Kind::Cuda if dev >= 0 => {
                    crate::gpu::driver::device_uuid(dev).unwrap_or_default()
                }
                _ => [0; 16],
            },
            flags: if crate::gpu::kind() == crate::gpu::Kind::Cuda
                && crate::param::cuda_ipc()
                && !crate::param::p2p_disabled()
            {
                FLAG_IPC
            } else {
                0
            } | if crate::param::is_set("OXCCL_CHUNK_BYTES") {
                0
            } else {
                FLAG_DEFAULT_SLOTS
            } | (match crate::gpu::kind() {
                crate::gpu::Kind::Cuda => {
                    crate::param::cuda_channels().min(super::Class::RINGS) as u32
                }
                crate::gpu::Kind::Host => 1,
            }) << CHANNELS_SHIFT,
            pidns: pid_namespace(),
            slot_bytes: slot_bytes() as u64,
            nsteps: crate::param::nsteps() as u32,
            probe: crate::transport::cma::probe_addr(),
            reaches: match crate::gpu::kind() {
                crate::gpu::Kind::Cuda if dev >= 0 => reaches(dev),
                _ => Vec::new(),
            },
            hostname: nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .map(|h| h.chars().take(64).collect())
                .unwrap_or_default(),
            alive: 0,
        }
    }

    /// Whether this rank and `other` run on one GPU: the same physical device where both know
    /// its UUID (ranks of other processes), else the same device number (ranks of one process).
    pub fn same_gpu(&self, other: &PeerInfo) -> bool {
        if self.gpu != [0; 16] && other.gpu != [0; 16] {
            self.gpu == other.gpu
        } else {
            self.same_process(other) && self.dev == other.dev
        }
    }

    /// Whether this rank and `other` run in one process: one host, one pid in one PID
    /// namespace (ranks of two containers may both be PID 1).
    pub fn same_process(&self, other: &PeerInfo) -> bool {
        self.host == other.host && self.pid == other.pid && self.pidns == other.pidns
    }

    /// The PID by which this process can ask whether `other`'s process lives: its pid where
    /// both are in one PID namespace (or neither could read which: taken as one, as
    /// `same_process` does), else 0 (unknown).
    pub fn pid_seen_by(&self, other: &PeerInfo) -> u32 {
        if self.pidns == other.pidns {
            other.pid
        } else {
            0
        }
    }

    /// How this process asks whether each of `peers`' processes lives, for those on this host
    /// but not this process (`peers[me]`'s): by its pid where it is in this PID namespace, else
    /// by the lock it holds (`liveness`; its pid names nothing here, or another process), if
    /// it holds one.
    pub fn local_probes(peers: &[PeerInfo], me: usize) -> Vec<Option<Probe>> {
        let m = &peers[me];
        peers
            .iter()
            .map(|q| {
                if q.host != m.host || q.same_process(m) {
                    return None;
                }
                match m.pid_seen_by(q) {
                    0 => (q.alive != 0).then_some(Probe::Lock(q.alive)),
                    pid => Some(Probe::Pid(pid)),
                }
            })
            .collect()
    }

    /// Whether some rank on this host is in another PID namespace than this one (it then tells
    /// that it lives by a lock: `liveness::hold`).
    pub fn has_foreign_neighbours(peers: &[PeerInfo], me: usize) -> bool {
        let m = &peers[me];
        peers.iter().any(|q| q.host == m.host && q.pidns != m.pidns)
    }

    /// Whether some host has ranks of several PID namespaces (every rank finds the same from
    /// the same list).
    pub fn namespaces_mixed(peers: &[PeerInfo]) -> bool {
        let mut first = std::collections::HashMap::new();
        peers
            .iter()
            .any(|q| *first.entry(q.host).or_insert(q.pidns) != q.pidns)
    }

    /// A communicator's FIFO slot size: rank 0's, or at least `ACROSS_HOSTS_SLOT_BYTES` where
    /// its ranks are on several hosts and rank 0 left the size to oxccl (every rank decides
    /// alike, from the same list).
    pub fn comm_slot_bytes(peers: &[PeerInfo]) -> usize {
        let Some(first) = peers.first() else {
            return crate::param::chunk_bytes();
        };
        let own = first.slot_bytes as usize;
        let across = peers.iter().any(|p| p.host != first.host);
        if across && first.flags & FLAG_DEFAULT_SLOTS != 0 {
            own.max(ACROSS_HOSTS_SLOT_BYTES)
        } else {
            own
        }
    }

    /// The rings a communicator's large ring collectives are split across: rank 0's choice,
    /// so that every rank plans alike whatever its own environment says; 1 where a rank runs
    /// the host executor (no GPU: `gpu` zeros), which splits nothing.
    pub fn comm_channels(peers: &[PeerInfo]) -> usize {
        if peers.iter().any(|p| p.gpu == [0; 16]) {
            return 1;
        }
        peers.first().map_or(1, |p| {
            ((p.flags >> CHANNELS_SHIFT) & 7).clamp(1, super::Class::RINGS as u32) as usize
        })
    }

    /// This rank's information, moving data between hosts through the net plugin
    /// (`plugin`) or the socket transport.
    pub fn with_net_plugin(mut self, plugin: bool) -> PeerInfo {
        self.flags = self.flags & !FLAG_NET_PLUGIN | if plugin { FLAG_NET_PLUGIN } else { 0 };
        self
    }

    /// Whether this rank moves data between hosts through the net plugin.
    pub fn net_plugin(&self) -> bool {
        self.flags & FLAG_NET_PLUGIN != 0
    }

    /// A communicator across hosts moves data between them one way on every rank: the net
    /// plugin, or the socket transport (the two ends of a connection must speak one). Rank 0
    /// and the first rank that differs otherwise (every rank finds the same, from the same
    /// list): ncclInvalidUsage at init, where a mismatch would otherwise fail connections.
    pub fn one_network(peers: &[PeerInfo]) -> Result<()> {
        let Some(first) = peers.first() else {
            return Ok(());
        };
        if peers.iter().all(|p| p.host == first.host) {
            return Ok(());
        }
        let way = |p: &PeerInfo| match p.net_plugin() {
            true => "the net plugin",
            false => "the socket transport",
        };
        match peers
            .iter()
            .position(|p| p.net_plugin() != first.net_plugin())
        {
            None => Ok(()),
            Some(r) => Err(Error::invalid_usage(format!(
                "{} moves data between hosts through {} and {} through {}: config.netName \
                 (or NCCL_NET, which overrides it) must name one network on every rank, and a \
                 net plugin load on every host or none (a host that could not load it says \
                 why in a WARN)",
                first.describe(0),
                way(first),
                peers[r].describe(r),
                way(&peers[r])
            ))),
        }
    }

    /// Whether this rank's process takes connections in device memory by CUDA IPC.
    fn takes_ipc(&self) -> bool {
        self.flags & FLAG_IPC != 0
    }

    /// Whether connections between this rank's process and `other`'s may live in device memory
    /// opened by CUDA IPC: both take it, and both are in one PID namespace (CUDA's IPC handles
    /// do not open across PID namespaces, containers that do not share one).
    pub fn ipc_with(&self, other: &PeerInfo) -> bool {
        self.takes_ipc() && other.takes_ipc() && self.pidns == other.pidns
    }

    /// Whether this rank's GPU and `other`'s (another, of this host) reach each other's
    /// memory: each names the other's UUID in `reaches` (so both ends decide alike).
    pub fn peer_gpus(&self, other: &PeerInfo) -> bool {
        self.host == other.host
            && self.gpu != [0; 16]
            && other.gpu != [0; 16]
            && self.gpu != other.gpu
            && self.reaches.contains(&other.gpu)
            && other.reaches.contains(&self.gpu)
    }

    /// "rank R (process P on host H)", for messages.
    pub fn describe(&self, rank: usize) -> String {
        format!(
            "rank {rank} (process {} on host {})",
            self.pid, self.hostname
        )
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(FORMAT.len() + BYTES);
        v.extend_from_slice(FORMAT);
        v.extend_from_slice(&self.host.to_le_bytes());
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.dev.to_le_bytes());
        v.extend_from_slice(&self.gpu);
        v.extend_from_slice(&self.flags.to_le_bytes());
        v.extend_from_slice(&self.pidns.to_le_bytes());
        v.extend_from_slice(&self.slot_bytes.to_le_bytes());
        v.extend_from_slice(&self.nsteps.to_le_bytes());
        v.extend_from_slice(&self.probe.to_le_bytes());
        let reaches = &self.reaches[..self.reaches.len().min(MAX_REACHES)];
        v.push(reaches.len() as u8);
        for u in reaches {
            v.extend_from_slice(u);
        }
        v.extend_from_slice(self.hostname.as_bytes());
        v
    }

    pub fn from_bytes(b: &[u8]) -> Result<PeerInfo> {
        let b = b.strip_prefix(FORMAT).ok_or_else(|| {
            Error::invalid_usage(
                "its peer information is in another layout: it runs another version of oxccl \
                 (every rank must load the same libnccl.so.2)",
            )
        })?;
        let n = b.get(BYTES).map_or(0, |&n| n as usize);
        let fixed = BYTES + 1 + 16 * n;
        if b.len() < fixed || b.len() > fixed + 64 || n > MAX_REACHES {
            return Err(Error::internal(format!(
                "peer info of {} bytes, expected {BYTES}, a count of peer GPUs, their UUIDs \
                 and a host name",
                b.len()
            )));
        }
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        Ok(PeerInfo {
            host: u64_at(0),
            pid: u32_at(8),
            dev: u32_at(12) as i32,
            gpu: b[16..32].try_into().expect("16 bytes"),
            flags: u32_at(32),
            pidns: u64_at(36),
            slot_bytes: u64_at(44),
            nsteps: u32_at(52),
            probe: u64_at(56),
            reaches: b[BYTES + 1..fixed]
                .chunks_exact(16)
                .map(|u| u.try_into().expect("16 bytes"))
                .collect(),
            hostname: String::from_utf8_lossy(&b[fixed..]).into_owned(),
            alive: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::{my_process_key, pid_of_key, process_key};
    #[test]
    fn round_trip() {
        let mut p = PeerInfo::mine(3);
        p.gpu = *b"0123456789abcdef";
        p.flags = FLAG_IPC;
        p.pidns = 0xfeed_f00d;
        assert_eq!(PeerInfo::from_bytes(&p.to_bytes()).unwrap(), p);
        p.reaches = vec![*b"fedcba9876543210", [7; 16]];
        assert_eq!(PeerInfo::from_bytes(&p.to_bytes()).unwrap(), p);
        // Another layout (a rank of another version): said so, not misread.
        let e = PeerInfo::from_bytes(&p.to_bytes()[4..]).unwrap_err();
        assert!(e.msg.contains("another version of oxccl"), "{}", e.msg);
        assert!(PeerInfo::from_bytes(&[0u8; 3]).is_err());
    }

    /// CUDA IPC between two processes only where both take it and share a PID namespace
    /// (CUDA's handles do not open across them), whichever end asks.
    #[test]
    fn ipc_needs_both_ends_and_one_pid_namespace() {
        let mut a = PeerInfo::mine(0);
        a.flags = FLAG_IPC;
        let mut b = a.clone();
        assert!(a.ipc_with(&b) && b.ipc_with(&a));
        b.pidns ^= 1;
        assert!(!a.ipc_with(&b) && !b.ipc_with(&a));
        b.pidns = a.pidns;
        b.flags = 0;
        assert!(!a.ipc_with(&b) && !b.ipc_with(&a));
    }

    /// Across hosts a communicator takes larger slots, unless its rank 0 chose the size; one
    /// host keeps rank 0's, and every rank reads the same answer from the same list.
    #[test]
    fn slots_across_hosts_are_larger_unless_rank_0_chose() {
        let mut a = PeerInfo::mine(0);
        a.slot_bytes = 128 << 10;
        a.flags = FLAG_DEFAULT_SLOTS;
        let mut b = a.clone();
        b.pid += 1;
        assert_eq!(
            PeerInfo::comm_slot_bytes(&[a.clone(), b.clone()]),
            128 << 10
        );
        b.host ^= 1;
        assert_eq!(
            PeerInfo::comm_slot_bytes(&[a.clone(), b.clone()]),
            ACROSS_HOSTS_SLOT_BYTES
        );
        assert_eq!(
            PeerInfo::comm_slot_bytes(&[b.clone(), a.clone()]),
            ACROSS_HOSTS_SLOT_BYTES
        );
        // Larger already (the CUDA executor's default): kept.
        a.slot_bytes = 1 << 20;
        assert_eq!(PeerInfo::comm_slot_bytes(&[a.clone(), b.clone()]), 1 << 20);
        // Rank 0 set OXCCL_CHUNK_BYTES: its size, whatever the others left.
        a.slot_bytes = 64 << 10;
        a.flags = 0;
        assert_eq!(PeerInfo::comm_slot_bytes(&[a.clone(), b.clone()]), 64 << 10);
        let e = PeerInfo::from_bytes(&b.to_bytes()).unwrap();
        assert_eq!(
            e.flags & FLAG_DEFAULT_SLOTS,
            FLAG_DEFAULT_SLOTS,
            "sent with the bytes"
        );
    }

    /// Rank 0's channel count holds for every rank, through the bytes; none (an older flag
    /// word) is 1, more than `Class::RINGS` is `RINGS`.
    #[test]
    fn rank_0_chooses_the_channels() {
        let mut a = PeerInfo::mine(0);
        a.gpu = *b"0123456789abcdef";
        let mut b = a.clone();
        a.flags = FLAG_DEFAULT_SLOTS | 3 << CHANNELS_SHIFT;
        b.flags = 1 << CHANNELS_SHIFT;
        let a = PeerInfo::from_bytes(&a.to_bytes()).unwrap();
        assert_eq!(PeerInfo::comm_channels(&[a.clone(), b.clone()]), 3);
        assert_eq!(PeerInfo::comm_channels(&[b.clone(), a.clone()]), 1);
        b.flags = 0;
        assert_eq!(PeerInfo::comm_channels(&[b.clone(), a.clone()]), 1);
        b.flags = 7 << CHANNELS_SHIFT;
        assert_eq!(
            PeerInfo::comm_channels(&[b.clone(), a.clone()]),
            super::super::Class::RINGS
        );
        assert_eq!(PeerInfo::comm_channels(&[]), 1);
        // A rank on the host executor (no GPU) among them: nobody splits.
        let mut host = a.clone();
        host.gpu = [0; 16];
        assert_eq!(PeerInfo::comm_channels(&[b, a, host]), 1);
    }

    /// Ranks of one host may differ in their network (they never use it); across hosts every
    /// rank must take the same, through the bytes, and a mismatch names rank 0 and the first
    /// that differs.
    #[test]
    fn ranks_across_hosts_take_one_network() {
        let a = PeerInfo::mine(0).with_net_plugin(true);
        let a = PeerInfo::from_bytes(&a.to_bytes()).unwrap();
        assert!(a.net_plugin() && !a.clone().with_net_plugin(false).net_plugin());
        let b = a.clone().with_net_plugin(false);
        assert!(PeerInfo::one_network(&[a.clone(), b.clone()]).is_ok());
        let mut c = b.clone();
        c.host ^= 1;
        assert!(PeerInfo::one_network(&[b.clone(), c.clone()]).is_ok());
        let e = PeerInfo::one_network(&[a.clone(), a.clone(), c]).unwrap_err();
        assert_eq!(e.code, crate::error::Code::InvalidUsage);
        assert!(
            e.msg.starts_with("rank 0 (process ")
                && e.msg
                    .contains("through the net plugin and rank 2 (process ")
                && e.msg
                    .contains("through the socket transport: config.netName"),
            "{}",
            e.msg
        );
        assert!(PeerInfo::one_network(&[]).is_ok());
    }

    #[test]
    fn one_gpu_is_one_uuid_or_one_number_in_one_process() {
        let a = PeerInfo::mine(0);
        let mut b = a.clone();
        assert!(a.same_gpu(&b));
        b.dev = 1;
        assert!(!a.same_gpu(&b));
        // Other processes: device 0 in each need not be one GPU.
        let mut c = a.clone();
        c.pid += 1;
        assert!(!a.same_gpu(&c));
        // With UUIDs, whatever the numbers.
        let (mut x, mut y) = (a.clone(), c.clone());
        x.gpu = [7; 16];
        y.gpu = [7; 16];
        y.dev = 5;
        assert!(x.same_gpu(&y));
        y.gpu[15] = 8;
        assert!(!x.same_gpu(&y));
        // A pid means something here only from this PID namespace.
        assert_ne!(a.pidns, 0, "/proc/self/ns/pid");
        assert_eq!(a.pid_seen_by(&c), c.pid);
        c.pidns += 1;
        assert_eq!(a.pid_seen_by(&c), 0);
    }

    /// Two containers' PID 1 are two processes: one pid in two PID namespaces is neither the
    /// same process, nor a process whose pid means anything here.
    #[test]
    fn a_pid_names_a_process_only_in_its_namespace() {
        let a = PeerInfo::mine(0);
        let mut b = a.clone();
        assert!(a.same_process(&b));
        b.pidns ^= 1;
        assert!(!a.same_process(&b) && !a.same_gpu(&b));
        assert_eq!(
            PeerInfo::local_probes(&[a.clone(), b.clone()], 0),
            [None, None],
            "no lock told: no probe"
        );
        b.alive = 77;
        assert_eq!(
            PeerInfo::local_probes(&[a.clone(), b.clone()], 0),
            [None, Some(Probe::Lock(77))]
        );
        assert!(PeerInfo::has_foreign_neighbours(&[a.clone(), b.clone()], 0));
        assert!(PeerInfo::namespaces_mixed(&[a.clone(), b.clone()]));
        b.pidns = a.pidns;
        b.pid += 1;
        assert_eq!(
            PeerInfo::local_probes(&[a.clone(), b.clone()], 0),
            [None, Some(Probe::Pid(b.pid))]
        );
        assert!(!PeerInfo::has_foreign_neighbours(
            &[a.clone(), b.clone()],
            0
        ));
        assert!(!PeerInfo::namespaces_mixed(&[a.clone(), b.clone()]));
        b.host ^= 1;
        b.pidns ^= 1;
        assert!(!a.same_process(&b));
        // Other namespaces on other hosts only: nothing mixed on any one host.
        assert!(!PeerInfo::namespaces_mixed(&[a.clone(), b.clone()]));
        assert_eq!(PeerInfo::local_probes(&[a.clone(), b], 0), [None, None]);

        let me = my_process_key();
        assert_eq!(me, process_key(a.pid, a.pidns));
        assert_eq!(pid_of_key(me), Some(a.pid));
        assert_eq!(pid_of_key(process_key(12345, a.pidns)), Some(12345));
        let foreign = process_key(a.pid, a.pidns ^ 1);
        assert_ne!(foreign, me);
        assert_eq!(pid_of_key(foreign), None);
    }
}
