//! Connections between two ranks: a FIFO of `nsteps` slots of `slot_bytes` plus two monotonic
//! counters (`tail`: slots the sender filled, `head`: slots the receiver freed), in memory both
//! ends reach. Transports only decide where that memory lives:
//! - same process: a heap region both ranks hold (`inproc`);
//! - same host, other process: a POSIX shared memory segment (`shm`).
//!
//! The executor never knows which one it has.

pub mod board;
pub mod cma;
pub mod inproc;
pub mod peer;
pub mod shm;

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Byte offsets inside a connection region.
const TAIL_OFF: usize = 0;
const HEAD_OFF: usize = 64;
const ATTACH_OFF: usize = 128;
const HDR_BYTES: usize = 4096;

/// What class of traffic a connection carries: each class has its own FIFOs, so operations of
/// different classes that run at the same time never interleave on one FIFO.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// Ring and chain algorithms (to the next rank, from the previous one).
    Ring = 0,
    /// User `ncclSend`/`ncclRecv`.
    P2p = 1,
    /// Direct algorithms of collectives (alltoall, gather, scatter, direct allreduce).
    Direct = 2,
}

/// Where the two ends of a connection live relative to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Locality {
    SameProcess,
    SameHost,
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
    pub peer: usize,
    pub is_sender: bool,
    /// Sender: the receiver has attached (until then nothing is written, so data never goes to a
    /// region the receiver will not see).
    peer_ready: std::sync::atomic::AtomicBool,
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
        peer: usize,
        is_sender: bool,
    ) -> Conn {
        let base = region.base();
        Conn {
            region,
            base,
            nsteps: nsteps as u64,
            slot_bytes,
            peer,
            is_sender,
            peer_ready: std::sync::atomic::AtomicBool::new(false),
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

    /// Increments the attach count; returns how many ends had attached before.
    pub fn attach(&self) -> u32 {
        self.attached().fetch_add(1, Ordering::AcqRel)
    }

    pub fn slot(&self, step: u64) -> *mut u8 {
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

    #[inline]
    pub fn post_send(&self, step: u64) {
        self.tail().store(step + 1, Ordering::Release);
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

    #[inline]
    pub fn post_recv(&self, step: u64) {
        self.head().store(step + 1, Ordering::Release);
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

/// Opens (creating if needed) the region of connection `from -> to` and attaches this end.
/// Everything that identifies one end of a connection.
pub struct ConnSpec {
    pub locality: Locality,
    pub comm_hash: u64,
    pub me: usize,
    pub peer: usize,
    pub is_sender: bool,
    pub class: Class,
    pub nsteps: usize,
    pub slot_bytes: usize,
}

pub fn connect(spec: &ConnSpec) -> Result<Conn> {
    let &ConnSpec {
        locality,
        comm_hash,
        me,
        peer,
        is_sender,
        class,
        nsteps,
        slot_bytes,
    } = spec;
    let (from, to) = if is_sender { (me, peer) } else { (peer, me) };
    let name = conn_name(comm_hash, from, to, class);
    let bytes = region_bytes(nsteps, slot_bytes);
    let region = match locality {
        Locality::SameProcess => Region::Heap(inproc::open(&name, bytes)?),
        Locality::SameHost => Region::Shm(shm::ShmRegion::open(&name, bytes)?),
    };
    let conn = Conn::new(region, nsteps, slot_bytes, peer, is_sender);
    if conn.attach() >= 1 {
        // Both ends are attached: the name is no longer needed.
        match &conn.region {
            Region::Heap(_) => inproc::forget(&name),
            Region::Shm(s) => s.unlink(),
        }
    }
    Ok(conn)
}

impl Drop for Conn {
    fn drop(&mut self) {
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
