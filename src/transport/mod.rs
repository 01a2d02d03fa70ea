//! Connections between two ranks: a FIFO of `nsteps` slots of `slot_bytes` plus two monotonic
//! counters (`tail`: slots the sender filled, `head`: slots the receiver freed), in memory both
//! ends reach. A [`Transport`] only decides where that memory lives and who moves it:
//! - same process: a heap region both ranks hold (`inproc`);
//! - same host, other process: a POSIX shared memory segment (`shm`);
//! - another host: the network (`net`, not there yet), where a proxy thread moves filled slots
//!   over the wire and bumps the counters (the [`Proxy`] hook).
//!
//! The executor never knows which one it has. A transport sets up its end of a connection and
//! hands back a blob that the bootstrap carries to the other end, which finishes its end with it
//! (`conns::connect_all` does this for all the connections a launch needs, in one exchange).

pub mod board;
pub mod cma;
pub mod conns;
pub mod inproc;
pub mod net;
pub mod net_plugin;
pub mod peer;
pub mod plugin;
pub mod proxy;
pub mod registered;
pub mod shm;
#[cfg(test)]
mod tests;

use crate::error::{Error, Result};
use peer::PeerInfo;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// Byte offsets inside a connection region.
const TAIL_OFF: usize = 0;
const HEAD_OFF: usize = 64;
const ATTACH_OFF: usize = 128;
/// Which ends have let go of the connection (bit 0: the sender's, bit 1: the receiver's): set
/// when an end's `Conn` goes (its communicator destroyed or aborted), so that the other end
/// stops waiting for it (`peer_closed`).
const CLOSED_OFF: usize = 192;
/// For slots sent by reference between kernels (`REF_FLAG`): the receiving blocks' claims on
/// the sender's memory, and whether the sender revoked its slots (u32 each; `cuda/runner.cu`:
/// `OX_REF_CLAIMS`, `OX_REF_REVOKED`). The host never touches them.
const REF_CLAIMS_OFF: usize = 256;
const REF_REVOKED_OFF: usize = 320;
const _: () = assert!(ATTACH_OFF + 4 <= CLOSED_OFF && CLOSED_OFF + 4 <= REF_CLAIMS_OFF);
const _: () = assert!(REF_CLAIMS_OFF + 4 <= REF_REVOKED_OFF && REF_REVOKED_OFF + 4 <= CALL_OFF);
/// Per slot, the words of the call that filled it (`plan::call`) and the bytes it holds: the
/// receiver checks the call against its own before using the slot; a proxy that moves slots
/// over the network moves these too, and only the bytes the slot holds.
const CALL_OFF: usize = 1024;
const META_BYTES: usize = 24;
/// In a slot's byte count: the slot holds no bytes but the address of the caller's memory that
/// holds them (in its first 8 bytes). At the end that sends the slot over the network: posted
/// so (`Conn::post_send_ref`); at a network receiving end: read there, into the memory the
/// executor named for the slot (`Conn::post_recv_ref`). Between kernels of one process on one
/// GPU, the CUDA executor's sending kernel posts such slots and its receiving kernel reads the
/// bytes at the address (`exec::cuda::desc`'s `mark_refs`). No other end sees such a slot.
const REF_FLAG: u64 = 1 << 63;
const HDR_BYTES: usize = 4096;
const _: () = assert!(CALL_OFF + 64 * META_BYTES <= HDR_BYTES); // nsteps <= 64 (param::nsteps)
/// Per slot, the arrival counts (u32) of the blocks of a CUDA kernel's lane at the sending and
/// the receiving end (`cuda/runner.cu`: `OX_SEND_ARRIVALS`, `OX_RECV_ARRIVALS`).
const SEND_ARRIVALS_OFF: usize = 2560;
const RECV_ARRIVALS_OFF: usize = 2816;
const _: () = assert!(CALL_OFF + 64 * META_BYTES <= SEND_ARRIVALS_OFF);
const _: () = assert!(SEND_ARRIVALS_OFF + 64 * 4 <= RECV_ARRIVALS_OFF);
const _: () = assert!(RECV_ARRIVALS_OFF + 64 * 4 <= HDR_BYTES);

/// What class of traffic a connection carries: each class has its own FIFOs, so operations of
/// different classes that run at the same time never interleave on one FIFO.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    /// Ring and chain algorithms (to the next rank, from the previous one).
    Ring = 0,
    /// User `ncclSend`/`ncclRecv`.
    P2p = 1,
    /// Direct algorithms of collectives (alltoall, gather, scatter, direct allreduce).
    Direct = 2,
    /// The second of two trees that run at once (the first uses Direct connections).
    Tree = 3,
    /// The rings of channels 1 to 3 (`Ring` is channel 0's) where a collective's data is split
    /// across several rings that run at once (`OXCCL_CUDA_CHANNELS`).
    Ring1 = 4,
    Ring2 = 5,
    Ring3 = 6,
}

impl Class {
    /// The most rings a collective is split across (`Class::ring`).
    pub const RINGS: usize = 4;

    /// The class of ring channel `c` (below `RINGS`).
    pub fn ring(c: usize) -> Class {
        match c {
            0 => Class::Ring,
            1 => Class::Ring1,
            2 => Class::Ring2,
            _ => Class::Ring3,
        }
    }

    /// The ring channel whose connections these are (1 to 3 for `Ring1`-`Ring3`): 0 for every
    /// other class, as everything but a split collective's extra rings runs on channel 0.
    pub fn channel(self) -> usize {
        match self {
            Class::Ring1 => 1,
            Class::Ring2 => 2,
            Class::Ring3 => 3,
            _ => 0,
        }
    }

    /// The kind of traffic, whatever the channel (NCCL_DEBUG's `Channel CC/K` prints it as
    /// K): 0 rings and chains, 1 point to point, 2 direct algorithms (also the hierarchical
    /// ones' rings and chains inside and between hosts, and their trees but the second of
    /// two), 3 the second of two trees.
    pub fn kind(self) -> usize {
        match self {
            Class::Ring | Class::Ring1 | Class::Ring2 | Class::Ring3 => 0,
            Class::P2p => 1,
            Class::Direct => 2,
            Class::Tree => 3,
        }
    }
}

/// Where the two ends of a connection live relative to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Locality {
    SameProcess,
    SameHost,
    OtherHost,
}

impl Locality {
    pub fn of(me: &PeerInfo, peer: &PeerInfo) -> Locality {
        if me.host != peer.host {
            Locality::OtherHost
        } else if me.same_process(peer) {
            Locality::SameProcess
        } else {
            Locality::SameHost
        }
    }
}

/// One end of a connection, as plans name it: the peer, which end this is, the traffic class.
/// Hashes as one word (see `KeyHasher`): launches look keys up on every task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ConnKey {
    /// The peer's rank, in 32 bits: a planned step (two keys) is then the size of a step bound
    /// to connections, so binding a program reuses its memory (see `Program::bind`).
    peer: u32,
    /// This rank sends on the connection (else it receives).
    pub is_sender: bool,
    pub class: Class,
}

impl ConnKey {
    pub fn new(peer: usize, is_sender: bool, class: Class) -> ConnKey {
        // Ranks are C ints.
        debug_assert!(u32::try_from(peer).is_ok(), "rank {peer}");
        ConnKey {
            peer: peer as u32,
            is_sender,
            class,
        }
    }

    /// The peer's rank.
    #[inline]
    pub fn peer(&self) -> usize {
        self.peer as usize
    }
}

impl std::hash::Hash for ConnKey {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        h.write_u64((self.peer as u64) << 4 | (self.class as u64) << 1 | self.is_sender as u64);
    }
}

/// A hasher for keys that are one small word already (`ConnKey`): a multiply spreads it.
#[derive(Default)]
pub struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }
}

/// A way to connect two ranks.
pub trait Transport: Sync {
    fn name(&self) -> &'static str;
    /// Whether it connects `me` with `peer`.
    fn reaches(&self, me: &PeerInfo, peer: &PeerInfo) -> bool;
    /// Sets up this end of a connection: the end to finish, and a blob for the peer's end.
    fn setup(&self, spec: &ConnSpec) -> Result<(Box<dyn Endpoint>, Vec<u8>)>;
}

/// One end of a connection, set up and waiting for the peer's blob.
pub trait Endpoint: Send {
    /// Finishes the connection with what the peer's `setup` handed back.
    fn connect(self: Box<Self>, peer_blob: &[u8]) -> Result<Conn>;
}

/// What a proxy thread drives for connections whose data it moves (the network): one call moves
/// what it can (filled slots onto the wire, arrived data into free slots) and bumps the
/// counters; true when it moved something.
pub trait Proxy: Send + Sync {
    fn progress(&self) -> Result<bool>;
    /// The peer closed the connection after its last complete slot: waiting for more from it
    /// is an error.
    fn closed(&self) -> bool {
        false
    }
    /// Whether everything the executor handed to this end has left (a sending end whose FIFO
    /// the proxy has emptied): the communicator can then go without losing data.
    fn flushed(&self) -> bool {
        true
    }
    /// What the proxy thread sleeps on (poll) while nothing moves, added to `out`: sockets and
    /// whether the end waits to read from them or to write to them; nothing when only the
    /// executor can unblock it (a sending end with nothing to send, a receiving end whose FIFO
    /// is full: its kick wakes the thread).
    fn wait_for(&self, _out: &mut Vec<Wait>) {}
    /// Called once by the proxy thread that drives this end: how the executor wakes it
    /// (`Conn::kick`).
    fn set_waker(&self, _waker: proxy::Waker) {}
    /// The executor has filled a slot (sending end) or freed one (receiving end): the end moves
    /// what it can on the executor's thread and wakes the proxy thread where it must.
    fn kick(&self) {}
    /// How long a receiving end has heard nothing from its peer (slots or heartbeats); None
    /// where that is not known.
    fn silent_for(&self) -> Option<std::time::Duration> {
        None
    }
    /// `progress` on the executor's thread while it waits on this end, unless the proxy thread
    /// is at it (then nothing): the data moves without a hand-off between threads. Errors are
    /// left to the proxy thread (which meets them too).
    fn progress_inline(&self) {}
    /// The (local, peer) addresses of the sockets the end moves data on, once connected.
    fn sockets(&self) -> Vec<(std::net::SocketAddr, std::net::SocketAddr)> {
        Vec::new()
    }
    /// A sending end that sends a slot's bytes from the caller's memory where the slot says
    /// so (`Conn::post_send_ref`), sparing the executor the copy into the slot.
    fn by_reference(&self) -> bool {
        false
    }
    /// Copies into their slots the bytes of slots posted by reference that have not left yet:
    /// the caller's memory may be reused once this returns. Holds the end while it copies.
    fn settle(&self) {}
    /// A receiving end that reads a slot's bytes straight into the caller's memory where the
    /// executor named it for the slot beforehand (`Conn::post_recv_ref`), sparing it the copy
    /// out of the slot.
    fn recv_by_reference(&self) -> bool {
        false
    }
    /// Receiving end: slot `step`, if it comes from call `call` and holds `bytes` bytes, is to
    /// be read into the `bytes` bytes at `dst` (valid until the slot is taken or
    /// `revoke_recv_refs` returns).
    fn post_recv_ref(&self, _step: u64, _call: [u64; 2], _dst: *mut u8, _bytes: usize) {}
    /// Receiving end: forgets every destination posted; what was already read into one (slots
    /// published and not yet taken, and the slot being read) is copied into its slot. The
    /// caller's memory may be reused once this returns. Holds the end while it copies.
    fn revoke_recv_refs(&self) {}
}

/// What a proxy's end waits for on its socket (`Proxy::wait_for`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    Readable(std::os::fd::RawFd),
    Writable(std::os::fd::RawFd),
    /// Nothing to sleep on (a net plugin's requests): look again soon.
    Soon,
}

static INPROC: inproc::InProc = inproc::InProc;
static SHM: shm::Shm = shm::Shm;
static NET: net::Net = net::Net;
static NET_PLUGIN: net_plugin::NetPlugin = net_plugin::NetPlugin;

/// The transport that connects `me` with `peer`, in order of preference: in process, shared
/// memory, and between hosts the net plugin where `me` moves data through it (its
/// communicator's choice, `plugin::uses_plugin`, which every rank shares:
/// `PeerInfo::one_network`), else the socket transport.
pub fn pick(me: &PeerInfo, peer: &PeerInfo) -> Result<&'static dyn Transport> {
    let net: &'static dyn Transport = if me.net_plugin() && plugin::net().is_some() {
        &NET_PLUGIN
    } else {
        &NET
    };
    [&INPROC as &dyn Transport, &SHM, net]
        .into_iter()
        .find(|t| t.reaches(me, peer))
        .ok_or_else(|| Error::internal("no transport reaches the peer"))
}

/// Memory shared by both ends of one connection.
pub enum Region {
    Heap(std::sync::Arc<inproc::HeapRegion>),
    Shm(shm::ShmRegion),
}

impl Region {
    fn base(&self) -> *mut u8 {
        match self {
            Region::Heap(h) => h.ptr(),
            Region::Shm(s) => s.ptr(),
        }
    }
}

/// One direction of a connection, as seen by one of its ends.
pub struct Conn {
    region: Region,
    base: *mut u8,
    pub nsteps: u64,
    pub slot_bytes: usize,
    /// This end's rank and the other end's.
    pub me: usize,
    pub peer: usize,
    pub is_sender: bool,
    /// Sender: the receiver has attached (until then nothing is written, so data never goes to a
    /// region the receiver will not see).
    peer_ready: std::sync::atomic::AtomicBool,
    /// Who moves the data, where a proxy thread does (network connections); None where both
    /// ends share the memory.
    pub proxy: Option<Arc<dyn Proxy>>,
    /// Several blocks of a lane may share this end, where it lives in device memory
    /// (`ConnSpec::shared_blocks`).
    pub shared_blocks: bool,
    /// Both ends' kernels run on one GPU in this process and the connection lives in its
    /// memory: nothing off the GPU touches its counters or slots (device-scope fences suffice,
    /// `OXCCL_CUDA_FENCE`).
    pub same_device: bool,
    /// A sending end whose receiver is a kernel of another process on this GPU, the
    /// connection in the receiving end's memory (CUDA IPC): that process's key
    /// (`liveness::process_key`), which `registered` asks to read registered
    /// buffers where they are.
    pub peer_process: Option<u64>,
    /// The class of traffic the connection was made for (set where it is connected; `Ring`
    /// for one made by hand).
    pub class: Class,
}

// SAFETY: the region stays mapped while the Conn lives; the counters are atomics and the slot
// bytes are only touched by the side that owns them according to the counters.
unsafe impl Send for Conn {}
// SAFETY: see above; a Conn is used by one executor at a time (operations on a comm are serialized).
unsafe impl Sync for Conn {}

pub fn region_bytes(nsteps: usize, slot_bytes: usize) -> usize {
    HDR_BYTES + nsteps * slot_bytes
}

impl Conn {
    pub fn new(
        region: Region,
        nsteps: usize,
        slot_bytes: usize,
        (me, peer): (usize, usize),
        is_sender: bool,
    ) -> Conn {
        let base = region.base();
        Conn {
            region,
            base,
            nsteps: nsteps as u64,
            slot_bytes,
            me,
            peer,
            is_sender,
            peer_ready: std::sync::atomic::AtomicBool::new(false),
            proxy: None,
            shared_blocks: true,
            same_device: false,
            peer_process: None,
            class: Class::Ring,
        }
    }

    /// Where a kernel finds this connection: the header (counters and slot metadata) and the
    /// first slot (both in memory the device reaches when the CUDA executor runs).
    pub fn device_view(&self) -> (usize, usize) {
        let dev = match &self.region {
            Region::Heap(h) => h.device_conn(),
            Region::Shm(s) => s.device_conn(),
        };
        match dev {
            Some((hdr, slots)) => (hdr as usize, slots as usize),
            None => (self.base as usize, self.base as usize + HDR_BYTES),
        }
    }

    /// Whether the other end reads the slots this end fills straight from shared memory (its
    /// core pulls the lines over), rather than a proxy of this process sending them over the
    /// network (the socket copies them out of this core's cache, right after they are filled):
    /// streaming stores into the slots can only pay off for the former.
    pub fn slots_read_by_peer(&self) -> bool {
        self.proxy.is_none()
    }

    /// Whether the counters live in device memory (the host's copy of them is unused).
    pub fn on_device(&self) -> bool {
        match &self.region {
            Region::Heap(h) => h.device_conn().is_some(),
            Region::Shm(s) => s.device_conn().is_some(),
        }
    }

    fn counter(&self, off: usize) -> &AtomicU64 {
        // SAFETY: the header is inside the mapped region, 64-byte aligned, and only ever accessed
        // atomically by either end.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    pub fn tail(&self) -> &AtomicU64 {
        self.counter(TAIL_OFF)
    }

    pub fn head(&self) -> &AtomicU64 {
        self.counter(HEAD_OFF)
    }

    fn attached(&self) -> &AtomicU32 {
        // SAFETY: as for `counter`.
        unsafe { &*(self.base.add(ATTACH_OFF) as *const AtomicU32) }
    }

    /// The counters, for messages: "tail T head H attached A".
    pub fn counters(&self) -> String {
        if self.on_device() {
            let (me, peer) = (self.me, self.peer);
            return format!("{me}/{peer}: counters in device memory");
        }
        format!(
            "{} -> {}: tail {} head {} attached {}",
            if self.is_sender { self.me } else { self.peer },
            if self.is_sender { self.peer } else { self.me },
            self.tail().load(Ordering::Acquire),
            self.head().load(Ordering::Acquire),
            self.attached().load(Ordering::Acquire)
        )
    }

    /// Increments the attach count; returns how many ends had attached before.
    pub fn attach(&self) -> u32 {
        self.attached().fetch_add(1, Ordering::AcqRel)
    }

    pub fn slot(&self, step: u64) -> *mut u8 {
        // (A connection in device memory has no slots in host memory: `Named::setup`.)
        debug_assert!(
            !self.on_device(),
            "a host slot of a connection in device memory"
        );
        let idx = (step % self.nsteps) as usize;
        // SAFETY: idx < nsteps, so the slot lies inside the region.
        unsafe { self.base.add(HDR_BYTES + idx * self.slot_bytes) }
    }

    /// Sender: the slot to fill next, if one is free.
    #[inline]
    pub fn send_slot(&self) -> Option<(u64, *mut u8)> {
        if !self.peer_ready.load(Ordering::Relaxed) {
            if self.attached().load(Ordering::Acquire) < 2 {
                return None;
            }
            self.peer_ready.store(true, Ordering::Relaxed);
        }
        let tail = self.tail().load(Ordering::Relaxed);
        let head = self.head().load(Ordering::Acquire);
        if tail - head < self.nsteps {
            Some((tail, self.slot(tail)))
        } else {
            None
        }
    }

    /// Sender: slot `step` is filled with `bytes`, by call `call`.
    #[inline]
    pub fn post_send(&self, step: u64, call: [u64; 2], bytes: usize) {
        self.set_meta(step, [call[0], call[1], bytes as u64]);
        self.tail().store(step + 1, Ordering::Release);
        if let Some(p) = &self.proxy {
            p.kick();
        }
    }

    /// Whether this sending end can take slots by reference (`post_send_ref`).
    #[inline]
    pub fn sends_by_reference(&self) -> bool {
        self.is_sender && self.proxy.as_ref().is_some_and(|p| p.by_reference())
    }

    /// Sender, where `sends_by_reference`: slot `step` is the `bytes` bytes at `data`, by call
    /// `call`. They must stay there, unchanged, until the head passes `step` or `settle`
    /// returns.
    #[inline]
    pub fn post_send_ref(&self, step: u64, call: [u64; 2], data: *const u8, bytes: usize) {
        // SAFETY: a slot holds at least 8 bytes and is this end's until it posts it (the
        // region of a network end is private to this process).
        unsafe { (self.slot(step) as *mut usize).write_unaligned(data as usize) };
        self.set_meta(step, [call[0], call[1], bytes as u64 | REF_FLAG]);
        self.tail().store(step + 1, Ordering::Release);
        if let Some(p) = &self.proxy {
            p.kick();
        }
    }

    /// Sender: where slot `step`'s bytes are and how many (the slot itself, or the memory it
    /// refers to), once it is posted.
    pub fn slot_data(&self, step: u64) -> (*const u8, usize) {
        self.referred(step)
            .unwrap_or_else(|| (self.slot(step), self.meta(step)[2] as usize))
    }

    /// The memory slot `step` refers to, and how many bytes, if it was posted by reference
    /// (sender) or read into the caller's memory (receiver), and not settled since.
    fn referred(&self, step: u64) -> Option<(*const u8, usize)> {
        let bytes = self.meta(step)[2];
        if bytes & REF_FLAG == 0 {
            return None;
        }
        // SAFETY: `post_send_ref` or `arrived` wrote the address there.
        let data = unsafe { (self.slot(step) as *const usize).read_unaligned() };
        Some((data as *const u8, (bytes & !REF_FLAG) as usize))
    }

    /// Sender: copies the bytes of every slot posted by reference and not yet sent into the
    /// slot (under the lock of the end that sends them), so that the slot no longer refers to
    /// anything. Call with the memory still valid.
    pub fn settle_refs(&self) {
        if let Some(p) = &self.proxy {
            p.settle();
        }
    }

    /// Sender: whether a slot up to step `last` that has not left refers to memory that
    /// overlaps the `len` bytes at `lo` (read on the thread that posts the slots).
    pub fn refers_to(&self, lo: usize, len: usize, last: u64) -> bool {
        let head = self.head().load(Ordering::Acquire);
        (head..=last).any(|step| {
            self.referred(step)
                .is_some_and(|(at, bytes)| (at as usize) < lo + len && lo < at as usize + bytes)
        })
    }

    /// `settle_refs` for the end that sends the slots: the caller holds what keeps the sending
    /// from reading them meanwhile. At a receiving end, the same for its published slots that
    /// refer to the caller's memory (`Proxy::revoke_recv_refs`).
    pub fn settle_refs_held(&self) {
        let head = self.head().load(Ordering::Acquire);
        let tail = self.tail().load(Ordering::Acquire);
        for step in head..tail {
            if let Some((data, bytes)) = self.referred(step) {
                // SAFETY: the referred bytes are still valid (see `settle_refs`), `bytes` fits
                // the slot, and the two do not overlap (the slot is this end's own memory).
                unsafe { std::ptr::copy_nonoverlapping(data, self.slot(step), bytes) };
                let m = self.meta(step);
                self.set_meta(step, [m[0], m[1], bytes as u64]);
            }
        }
    }

    /// Whether this receiving end can read slots into the caller's memory (`post_recv_ref`).
    #[inline]
    pub fn receives_by_reference(&self) -> bool {
        !self.is_sender && self.proxy.as_ref().is_some_and(|p| p.recv_by_reference())
    }

    /// Receiver, where `receives_by_reference`: slot `step`, if it comes from call `call` with
    /// `bytes` bytes, is to be read into the `bytes` bytes at `dst` instead of the slot
    /// (`delivered` then says so). That memory must stay valid until the slot is taken or
    /// `revoke_recv_refs` returns, and nothing else may read or write it meanwhile. It must
    /// not be posted before the slot `nsteps` earlier was taken (or the names revoked): they
    /// share a cell. Posted for a slot the end has started reading, it is not used.
    #[inline]
    pub fn post_recv_ref(&self, step: u64, call: [u64; 2], dst: *mut u8, bytes: usize) {
        if let Some(p) = &self.proxy {
            p.post_recv_ref(step, call, dst, bytes);
        }
    }

    /// Receiver: whether filled slot `step` was read into the memory posted for it
    /// (`post_recv_ref`) rather than into the slot.
    #[inline]
    pub fn delivered(&self, step: u64) -> bool {
        !self.is_sender && self.meta(step)[2] & REF_FLAG != 0
    }

    /// A proxy's receiving end: slot `step` from call `call` with `bytes` bytes is there, in
    /// the slot, or at `at`, the memory named for it (`delivered` then says so, and the slot
    /// holds the address, as a slot posted by reference does); the executor may take it.
    pub fn arrived(&self, step: u64, call: [u64; 2], bytes: usize, at: Option<*const u8>) {
        let flag = match at {
            Some(at) => {
                // SAFETY: a slot holds at least 8 bytes and is this end's until published;
                // its bytes went elsewhere.
                unsafe { (self.slot(step) as *mut usize).write_unaligned(at as usize) };
                REF_FLAG
            }
            None => 0,
        };
        self.set_meta(step, [call[0], call[1], bytes as u64 | flag]);
        self.tail().store(step + 1, Ordering::Release);
    }

    /// Receiver: see `Proxy::revoke_recv_refs`. Call with the posted memory still valid.
    pub fn revoke_recv_refs(&self) {
        if let Some(p) = &self.proxy {
            p.revoke_recv_refs();
        }
    }

    /// Receiver: slot `step` is free again.
    #[inline]
    pub fn post_recv(&self, step: u64) {
        self.head().store(step + 1, Ordering::Release);
        if let Some(p) = &self.proxy {
            // A proxy that stopped reading because the FIFO was full can go on.
            p.kick();
        }
    }

    /// The words of the call that filled slot `step` (read by the receiver once the slot is
    /// filled, see `recv_slot`).
    #[inline]
    pub fn call_of(&self, step: u64) -> [u64; 2] {
        let m = self.meta(step);
        [m[0], m[1]]
    }

    /// Slot `step`'s (call words, bytes): what a proxy sends ahead of the slot's bytes.
    pub fn meta(&self, step: u64) -> [u64; 3] {
        let w = self.slot_meta(step);
        [0, 1, 2].map(|i| w[i].load(Ordering::Relaxed))
    }

    /// Sets slot `step`'s (call words, bytes) (the sender, or a proxy that received the slot).
    pub fn set_meta(&self, step: u64, m: [u64; 3]) {
        for (w, v) in self.slot_meta(step).iter().zip(m) {
            w.store(v, Ordering::Relaxed);
        }
    }

    fn slot_meta(&self, step: u64) -> &[AtomicU64; 3] {
        let idx = (step % self.nsteps) as usize;
        assert!(idx < 64);
        // SAFETY: inside the header (see CALL_OFF), 8-byte aligned, only accessed atomically.
        unsafe { &*(self.base.add(CALL_OFF + idx * META_BYTES) as *const [AtomicU64; 3]) }
    }

    /// Receiver: the next filled slot, if there is one.
    #[inline]
    pub fn recv_slot(&self) -> Option<(u64, *const u8)> {
        let head = self.head().load(Ordering::Relaxed);
        let tail = self.tail().load(Ordering::Acquire);
        if tail > head {
            Some((head, self.slot(head)))
        } else {
            None
        }
    }

    /// Moves this connection's data on the caller's thread if a proxy moves it (see
    /// `Proxy::progress_inline`).
    #[inline]
    pub fn drive(&self) {
        if let Some(p) = &self.proxy {
            p.progress_inline();
        }
    }

    /// The sockets this connection's data moves on (see `Proxy::sockets`).
    pub fn sockets(&self) -> Vec<(std::net::SocketAddr, std::net::SocketAddr)> {
        self.proxy.as_ref().map_or_else(Vec::new, |p| p.sockets())
    }

    /// How long the peer has been silent on this connection (see `Proxy::silent_for`).
    pub fn silent_for(&self) -> Option<std::time::Duration> {
        self.proxy.as_ref()?.silent_for()
    }

    /// Whether the peer has closed this connection (its proxy saw it go, or, where both ends
    /// share the region, its end is gone): nothing more comes. Whatever it wrote before is
    /// visible once this says yes.
    pub fn peer_closed(&self) -> bool {
        self.proxy.as_ref().is_some_and(|p| p.closed())
            || self.closed().load(Ordering::Acquire) & end_bit(!self.is_sender) != 0
    }

    /// This end lets go of the connection: the other end's waits for it end (`peer_closed`).
    /// A sending end that opened the receiving end's device memory closes it first: the owner
    /// frees it only once this end says it is done (`shm::Parked`).
    pub fn close(&self) {
        if let Region::Shm(s) = &self.region {
            if s.abandoned() {
                // Its kernels may still touch the device memory: the owner must keep it.
                return;
            }
            s.close_opened();
        }
        // (In the host copy of the header, which both ends share whether or not the counters
        // live in device memory.)
        self.closed()
            .fetch_or(end_bit(self.is_sender), Ordering::Release);
    }

    /// The communicator's kernels did not stop: the connection's memory (device memory, or
    /// pinned host memory) stays allocated, mapped and pinned (a leak, rather than memory a
    /// running kernel touches after it was freed), and this end never says it closed, so the
    /// other end keeps its own too.
    pub fn abandon_device_memory(&self) {
        if crate::gpu::kind() != crate::gpu::Kind::Cuda {
            return; // (host threads that did not stop leave nothing the driver owns)
        }
        match &self.region {
            Region::Shm(s) => s.abandon(),
            Region::Heap(h) => h.abandon(),
        }
    }

    fn closed(&self) -> &AtomicU32 {
        // SAFETY: the header is mapped as long as the Conn lives.
        unsafe { closed_word(self.base) }
    }

    /// What this end is waiting for, for timeout messages.
    pub fn describe(&self) -> String {
        let (t, h) = (
            self.tail().load(Ordering::Relaxed),
            self.head().load(Ordering::Relaxed),
        );
        if self.is_sender {
            format!(
                "rank {} to free a slot for step {t} ({h} of the {t} steps sent are freed)",
                self.peer
            )
        } else {
            format!(
                "rank {} to send step {h} ({t} steps received so far)",
                self.peer
            )
        }
    }

    pub fn locality(&self) -> Locality {
        match self.region {
            Region::Heap(_) => Locality::SameProcess,
            Region::Shm(_) => Locality::SameHost,
        }
    }
}

/// The name both ends of a connection derive independently.
pub fn conn_name(comm_hash: u64, from: usize, to: usize, class: Class) -> String {
    format!("oxccl-{comm_hash:016x}-{from}-{to}-{}", class as u32)
}

/// Everything that identifies one end of a connection.
pub struct ConnSpec {
    /// The address this rank's bootstrap listens on: network ends listen there too.
    pub local_ip: std::net::IpAddr,
    pub comm_hash: u64,
    pub me: usize,
    pub peer: usize,
    pub is_sender: bool,
    pub class: Class,
    pub nsteps: usize,
    pub slot_bytes: usize,
    /// Both ends run on one device (CUDA executor): their connection may live in its memory.
    pub same_device: bool,
    /// Both ends run on two GPUs of this host that reach each other's memory (CUDA executor,
    /// `PeerInfo::peer_gpus`): their connection may live in the receiving end's device memory.
    pub peer_device: bool,
    /// Several blocks of a lane may share this end (their arrival counts are atomics on the
    /// connection's header): false for a sending end whose connection lives in a peer GPU's
    /// memory without native atomics to it (PCIe).
    pub shared_blocks: bool,
    /// Both ends' processes take connections in device memory by CUDA IPC (`OXCCL_CUDA_IPC`
    /// not 0 and not `NCCL_P2P_DISABLE=1` in each, one PID namespace: `PeerInfo::ipc_with`).
    pub ipc: bool,
    /// The process of the other end, as this process sees it (0: in another PID namespace).
    pub peer_pid: u32,
    /// The other end's host name (for messages).
    pub peer_host: String,
    /// The communicator's health: an abort ends a wait of the setup (a network end's connect).
    pub health: Option<Arc<crate::health::Health>>,
}

impl ConnSpec {
    /// The name both ends derive independently.
    fn name(&self) -> String {
        let (from, to) = if self.is_sender {
            (self.me, self.peer)
        } else {
            (self.peer, self.me)
        };
        conn_name(self.comm_hash, from, to, self.class)
    }
}

/// An end of a connection whose memory both ends open by the name they derive (`inproc`,
/// `shm`): the blob is the name, which the other end checks against its own.
pub(crate) struct Named {
    /// Taken by `connect`; an end dropped before (its peer never answered) removes the name.
    region: Option<Region>,
    name: String,
    nsteps: usize,
    slot_bytes: usize,
    me: usize,
    peer: usize,
    is_sender: bool,
    /// A sending end between processes whose connection lives in device memory: the receiving
    /// end's blob carries the IPC handle.
    opens_handle: bool,
    shared_blocks: bool,
    /// See `Conn::same_device`.
    same_device: bool,
    /// See `Conn::peer_process`.
    peer_process: Option<u64>,
}

/// Whether a connection between `spec`'s ranks lives in device memory: ranks on one GPU, on
/// the CUDA executor, unless `NCCL_P2P_DISABLE=1` asks for host-staged memory; between
/// processes (CUDA IPC) only where both take it (`OXCCL_CUDA_IPC` not 0) in one PID namespace
/// (`spec.ipc`, `PeerInfo::ipc_with`), so that both ends decide alike; ranks on two
/// peer-capable GPUs likewise, in the receiving end's memory
/// (the sending end's kernels write to it, through peer access: in one process enabled
/// between the two devices' contexts when the pair was decided, `gpu::memory::peer_access`;
/// between processes by the IPC handle's opening).
fn in_device_memory(spec: &ConnSpec, shm: bool) -> bool {
    crate::gpu::kind() == crate::gpu::Kind::Cuda
        && (spec.same_device || spec.peer_device)
        && !crate::param::p2p_disabled()
        && (!shm || spec.ipc)
}

/// Why a network end whose peer has not connected since `since` (when the end was made) fails,
/// once it has waited twice the setup bound; None while the peer may still come. The peer's
/// end connects as soon as it has this end's blob or handle, which it had before this end was
/// made: so long a wait is for a peer that died before it could (an operation waits on live
/// peers for good). (`net`'s listening end, the net plugin's connect and accept.)
pub(crate) fn never_connected(since: std::time::Instant) -> Option<String> {
    let waited = since.elapsed();
    (waited > 2 * crate::param::bound()).then(|| {
        format!(
            "it never connected (this end waited {}): its process ended, or its host or the \
             link to it is down",
            crate::health::fmt_secs(waited)
        )
    })
}

/// Between the connection's name and the IPC handle in a receiving end's blob.
const HANDLE_MARK: u8 = 0;

impl Named {
    pub(crate) fn setup(spec: &ConnSpec, shm: bool) -> Result<(Box<dyn Endpoint>, Vec<u8>)> {
        let name = spec.name();
        let bytes = region_bytes(spec.nsteps, spec.slot_bytes);
        let slots = spec.nsteps * spec.slot_bytes;
        let mut handle = None;
        let region = if shm {
            // A connection in device memory keeps only the header here (the host's
            // bookkeeping: closed bits, the attach count): its slots would take /dev/shm
            // room (a container's is 64 MiB by default) that nothing uses. Both ends decide
            // alike, so both size the segment alike.
            let on_device = in_device_memory(spec, true);
            let r = shm::ShmRegion::open(
                &name,
                if on_device { HDR_BYTES } else { bytes },
                spec.peer_pid,
            )?;
            // The receiving end allocates; the sending end opens what its blob names.
            if !spec.is_sender && on_device {
                handle = Some(r.use_device_memory(HDR_BYTES, slots)?);
            }
            Region::Shm(r)
        } else {
            let h = inproc::open(&name, bytes)?;
            // On one device, whichever end comes first allocates; on two, the receiving end
            // (its blob, which the sending end waits for, says it is done).
            if in_device_memory(spec, false) && (spec.same_device || !spec.is_sender) {
                h.use_device_memory(HDR_BYTES, slots)?;
            }
            Region::Heap(h)
        };
        // Between kernels of two processes on one GPU, the sending one may refer to its
        // registered buffers: the receiving process serves their opening.
        let peer_process = (shm
            && spec.same_device
            && spec.ipc
            && spec.peer_pid != 0
            && in_device_memory(spec, true))
        .then(|| crate::liveness::process_key(spec.peer_pid, crate::liveness::pid_namespace()));
        if peer_process.is_some() && !spec.is_sender {
            registered::serve();
        }
        let mut blob = name.as_bytes().to_vec();
        if let Some(h) = handle {
            blob.push(HANDLE_MARK);
            blob.extend_from_slice(&h);
        }
        Ok((
            Box::new(Named {
                region: Some(region),
                name,
                nsteps: spec.nsteps,
                slot_bytes: spec.slot_bytes,
                me: spec.me,
                peer: spec.peer,
                is_sender: spec.is_sender,
                opens_handle: shm && spec.is_sender && in_device_memory(spec, true),
                shared_blocks: spec.shared_blocks,
                // (In one process only, until a GPU has checked device-scope fences between
                // processes that share a GPU by CUDA IPC.)
                same_device: !shm && spec.same_device && in_device_memory(spec, shm),
                peer_process: peer_process.filter(|_| spec.is_sender),
            }),
            blob,
        ))
    }
}

/// A peer's blob: the connection's name, and the IPC handle of its device memory if it has one.
fn split_blob(blob: &[u8]) -> (&[u8], Option<&[u8]>) {
    match blob.iter().position(|&b| b == HANDLE_MARK) {
        Some(i) => (&blob[..i], Some(&blob[i + 1..])),
        None => (blob, None),
    }
}

impl Endpoint for Named {
    fn connect(mut self: Box<Self>, peer_blob: &[u8]) -> Result<Conn> {
        let n = &mut *self;
        let region = n
            .region
            .take()
            .ok_or_else(|| Error::internal("a connection end connected twice"))?;
        // Dropped on error: the region is unlinked (see `Drop for Conn`).
        let mut conn = Conn::new(region, n.nsteps, n.slot_bytes, (n.me, n.peer), n.is_sender);
        conn.shared_blocks = n.shared_blocks;
        conn.same_device = n.same_device;
        conn.peer_process = n.peer_process;
        let (name, handle) = split_blob(peer_blob);
        if name != n.name.as_bytes() {
            return Err(Error::internal(format!(
                "connection {}: rank {}'s end names another connection ({})",
                n.name,
                n.peer,
                String::from_utf8_lossy(name)
            )));
        }
        match (handle, &conn.region) {
            (None, _) if n.opens_handle => {
                return Err(Error::internal(format!(
                    "connection {}: rank {} sent no IPC handle of its device memory",
                    n.name, n.peer
                )))
            }
            (None, Region::Shm(s)) if !conn.on_device() => s.pin()?,
            (None, _) => {}
            (Some(h), Region::Shm(s)) if n.opens_handle => {
                let h: &[u8; 64] = h.try_into().map_err(|_| {
                    Error::internal(format!(
                        "connection {}: rank {} sent an IPC handle of {} bytes",
                        n.name,
                        n.peer,
                        h.len()
                    ))
                })?;
                s.open_device_memory(h, HDR_BYTES).map_err(|e| {
                    e.context(format!(
                        "rank {}: opening rank {}'s end of connection {} in device memory \
                         (CUDA IPC; with OXCCL_CUDA_IPC=0, or NCCL_P2P_DISABLE=1, in either \
                         process the connection stages in pinned host memory instead)",
                        n.me, n.peer, n.name
                    ))
                })?;
            }
            (Some(_), _) => {
                return Err(Error::internal(format!(
                    "connection {}: rank {} sent an IPC handle this end cannot use",
                    n.name, n.peer
                )))
            }
        }
        if conn.attach() >= 1 {
            // Both ends are attached: the name is no longer needed.
            match &conn.region {
                Region::Heap(_) => inproc::forget(&n.name),
                Region::Shm(s) => s.unlink(),
            }
        }
        Ok(conn)
    }
}

impl Drop for Named {
    fn drop(&mut self) {
        // Never connected (the peer failed or died first): nobody else will remove the name.
        match self.region.take() {
            Some(Region::Heap(h)) => inproc::forget(h.name()),
            Some(Region::Shm(s)) => {
                // A sending end that never opened the receiving end's device memory is done
                // with it: its owner may free it (`shm::Parked`).
                if self.is_sender {
                    s.closed_word().fetch_or(end_bit(true), Ordering::Release);
                }
                s.unlink()
            }
            None => {}
        }
    }
}

/// The closed word of the connection header at `base`.
///
/// # Safety
/// `base` is a connection header mapped for `'a`; the word is only accessed atomically (a u32 at a 64-byte aligned offset).
unsafe fn closed_word<'a>(base: *const u8) -> &'a AtomicU32 {
    // SAFETY: per the contract.
    unsafe { &*(base.add(CLOSED_OFF) as *const AtomicU32) }
}

/// An end's bit in the closed word.
fn end_bit(is_sender: bool) -> u32 {
    if is_sender {
        1
    } else {
        2
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.close();
        // If the peer never attached, nobody else will remove the name (and nothing was sent:
        // senders wait for the receiver to attach).
        match &self.region {
            Region::Heap(h) => inproc::forget(h.name()),
            Region::Shm(s) => s.unlink(),
        }
    }
}

pub(crate) fn check_size(bytes: usize) -> Result<()> {
    if bytes < HDR_BYTES {
        return Err(Error::internal("connection region too small"));
    }
    Ok(())
}
