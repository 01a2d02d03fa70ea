//! The board: one small region per communicator, shared by all its ranks on this host, where each
//! rank publishes, per operation, where its buffers are and how far it has got. Direct algorithms
//! use it to read and write peers' buffers in place (zero copy): ranks of one process address each
//! other's memory directly; ranks in other processes map `ncclMemAlloc` memory of their peers.

use super::{inproc, shm, Region};
use crate::error::Result;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

const SLOT: usize = 320;
/// An arrival word holds the operation's sequence number in its low `SEQ_BITS` and the call's
/// signature (`signature`) above them: a peer that sees the arrival can check the call too. Its
/// top bit (`LEFT`) says the rank has left the operation without finishing it (a timeout, an
/// abort, an error): peers must not use what it published.
const SEQ_BITS: u32 = 40;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
pub const LEFT: u64 = 1 << 63;
/// A claim word (see `Board::claim`): the operation's sequence number in the low `SEQ_BITS`,
/// the number of peers working on the rank's buffers above it, and `LEFT`.
const CLAIM_ONE: u64 = 1 << SEQ_BITS;
const CLAIM_COUNT: u64 = !SEQ_MASK & !LEFT;
const HDR: usize = 256;
/// Bytes of each rank's inline data area (two of them, by operation parity): small operations
/// carry their inputs on the board itself (see `plan::board`, eager operations).
pub const INLINE: usize = 32 << 10;
/// Bytes of an eager operation's input that travel in the cache line of the rank's arrival.
pub const TINY: usize = 56;

/// How a peer can reach one of this rank's buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BufInfo {
    /// The address in its owner's address space.
    pub addr: u64,
    /// Owner-side `ncclMemAlloc` allocation holding it: (id, fd, base, len); id 0 = none.
    pub alloc_id: u64,
    pub fd: u64,
    pub base: u64,
    pub len: u64,
}

/// A rank's arrival at an eager operation and its input when tiny, in one cache line: a peer that
/// sees the arrival has the data too (one transfer between cores instead of two).
#[repr(C, align(64))]
struct EagerLine {
    arrive: AtomicU64,
    tiny: [AtomicU64; TINY / 8],
}

/// One rank's slot: `arrive`/`done` are operation sequence numbers; the buffer descriptions are
/// written before `arrive` is published and read by peers only between `arrive` and `done`.
#[repr(C, align(64))]
struct Slot {
    /// Eager operations arrive here instead, by operation parity: each parity in a line of its
    /// own, so that a rank already writing its next operation does not take away the line that
    /// a slower peer is still reading the current one from.
    eager: [EagerLine; 2],
    arrive: AtomicU64,
    done: AtomicU64,
    /// The rank's process key (`liveness::my_process_key`).
    key: AtomicU64,
    /// The rank's PreMulSum scalar (its bits; it may differ from rank to rank), by operation
    /// parity like the inline areas (eager operations have no done barrier).
    scalar: [AtomicU64; 2],
    words: [AtomicU64; 10],
    /// The rank's vote for cross-memory attach (see `plan::tune`).
    vote: AtomicU64,
    /// Who works on the rank's buffers during a direct operation (see `claim`).
    claims: AtomicU64,
    /// The direct operation whose peers' buffers the rank holds claims on (0: none).
    busy: AtomicU64,
    /// What the rank called, by operation parity (`Call`): read by peers only when signatures
    /// differ, to say how.
    call: [[AtomicU64; 2]; 2],
    /// Non-zero once the rank has ended its communicator (destroyed or aborted it): it will
    /// arrive at no further operation.
    ended: AtomicU64,
}

/// A call as the board describes it, to check that every rank made the same one: (count, kind |
/// datatype << 8 | operator << 16 | root << 32).
pub type Call = [u64; 2];

/// The call's 23-bit signature, which travels in the arrival word (a fold of its words: cheap,
/// and any difference in count, kind, datatype, reduction or root below 2^24 changes it).
#[inline]
pub fn signature(c: Call) -> u64 {
    let (a, b) = (c[0], c[1]);
    (a ^ a >> 24 ^ a >> 48 ^ b.rotate_left(5) ^ b >> 29 ^ b >> 53) & 0x7f_ffff
}

fn arrival(seq: u64, call: Call) -> u64 {
    (seq & SEQ_MASK) | signature(call) << SEQ_BITS
}

const _: () = assert!(std::mem::size_of::<Slot>() <= SLOT);
const _: () = assert!(std::mem::size_of::<EagerLine>() == 64);

pub struct Board {
    region: Region,
    base: *mut u8,
    pub nranks: usize,
    /// This process's key (`liveness::my_process_key`; a board is not used across fork).
    key: u64,
}

// SAFETY: all accesses to the region go through atomics; the mapping lives as long as the Board.
unsafe impl Send for Board {}
// SAFETY: as above.
unsafe impl Sync for Board {}

impl Board {
    /// Opens the comm's board (`shared`: some ranks are in other processes) and attaches.
    pub fn open(comm_hash: u64, nranks: usize, shared: bool) -> Result<Board> {
        let name = format!("oxccl-{comm_hash:016x}-board");
        let bytes = HDR + nranks * SLOT + nranks * 2 * INLINE;
        let region = if shared {
            let r = shm::ShmRegion::open(&name, bytes, 0)?;
            r.pin()?;
            Region::Shm(r)
        } else {
            Region::Heap(inproc::open(&name, bytes)?)
        };
        let base = match &region {
            Region::Heap(h) => h.ptr(),
            Region::Shm(s) => s.ptr(),
        };
        let b = Board {
            region,
            base,
            nranks,
            key: crate::liveness::my_process_key(),
        };
        // SAFETY: the header's first word is inside the region and used only atomically.
        let attached = unsafe { &*(b.base as *const AtomicU32) };
        if attached.fetch_add(1, Ordering::AcqRel) + 1 == nranks as u32 {
            b.forget_name();
        }
        Ok(b)
    }

    fn forget_name(&self) {
        match &self.region {
            Region::Heap(h) => inproc::forget(h.name()),
            Region::Shm(s) => s.unlink(),
        }
    }

    #[inline]
    fn slot(&self, rank: usize) -> &Slot {
        assert!(rank < self.nranks);
        // SAFETY: slot `rank` lies inside the region; Slot is all atomics (valid for any bits).
        unsafe { &*(self.base.add(HDR + rank * SLOT) as *const Slot) }
    }

    /// Rank `rank`'s inline data area for operation `seq` (`INLINE` bytes). Written by its rank
    /// before it arrives at `seq`; read by all between their arrival and the end of `seq + 1`
    /// (which no rank can finish before every rank has finished `seq`), so two areas suffice.
    #[inline]
    pub fn inline_area(&self, rank: usize, seq: u64) -> *mut u8 {
        assert!(rank < self.nranks);
        let i = rank * 2 + (seq & 1) as usize;
        // SAFETY: the area lies inside the region (see `open`).
        unsafe { self.base.add(HDR + self.nranks * SLOT + i * INLINE) }
    }

    /// Where rank `rank` puts the input (`bytes` long) of an eager operation `seq`: next to its
    /// arrival when it is tiny, else its inline area. Same reuse rules as `inline_area`.
    #[inline]
    pub fn eager_area(&self, rank: usize, seq: u64, bytes: usize) -> *mut u8 {
        if bytes <= TINY {
            self.slot(rank).eager[(seq & 1) as usize].tiny[0].as_ptr() as *mut u8
        } else {
            self.inline_area(rank, seq)
        }
    }

    /// Publishes this rank's buffers for operation `seq`, then its arrival.
    pub fn publish(
        &self,
        rank: usize,
        seq: u64,
        (send, recv): (BufInfo, BufInfo),
        scalar: u64,
        vote: f64,
        call: Call,
    ) {
        let s = self.slot(rank);
        s.vote.store(vote.to_bits(), Ordering::Relaxed);
        for (w, v) in s.call[(seq & 1) as usize].iter().zip(call) {
            w.store(v, Ordering::Relaxed);
        }
        s.key.store(self.key, Ordering::Relaxed);
        s.scalar[(seq & 1) as usize].store(scalar, Ordering::Relaxed);
        for (i, v) in [send.addr, send.alloc_id, send.fd, send.base, send.len]
            .into_iter()
            .chain([recv.addr, recv.alloc_id, recv.fd, recv.base, recv.len])
            .enumerate()
        {
            s.words[i].store(v, Ordering::Relaxed);
        }
        s.claims.store(seq & SEQ_MASK, Ordering::Relaxed);
        s.arrive.store(arrival(seq, call), Ordering::Release);
    }

    /// Rank `me` is about to claim peers' buffers for direct operation `seq` (`Some`), or holds
    /// no claim any more (`None`, after releasing them): a rank that left waits for the claims
    /// of live holders only.
    pub fn set_busy(&self, me: usize, seq: Option<u64>) {
        self.slot(me)
            .busy
            .store(seq.map_or(0, |s| s & SEQ_MASK), Ordering::Release);
    }

    /// Whether `rank` may hold claims for operation `seq`.
    pub fn busy(&self, rank: usize, seq: u64) -> bool {
        self.slot(rank).busy.load(Ordering::Acquire) == seq & SEQ_MASK
    }

    /// Claims the right to read and write `rank`'s published buffers for direct operation
    /// `seq`: false when that rank has left the operation (see `leave`), and then they must not
    /// be touched. Release each claim (`release`) once done with them, before posting done.
    pub fn claim(&self, rank: usize, seq: u64) -> bool {
        let w = &self.slot(rank).claims;
        let mut c = w.load(Ordering::Acquire);
        loop {
            if c & LEFT != 0 || c & SEQ_MASK != seq & SEQ_MASK {
                return false;
            }
            match w.compare_exchange_weak(c, c + CLAIM_ONE, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => c = now,
            }
        }
    }

    /// Gives back a claim on `rank`'s buffers.
    pub fn release(&self, rank: usize) {
        self.slot(rank)
            .claims
            .fetch_sub(CLAIM_ONE, Ordering::AcqRel);
    }

    /// This rank leaves operation `seq` without finishing it: its arrival is marked `LEFT` (peers
    /// that see it fail instead of using what it published) and no new claim on its buffers is
    /// granted. Returns how many peers still hold claims (wait until `claimed` says none before
    /// giving the buffers back to the caller). Eager operations have no claims.
    pub fn leave(&self, rank: usize, seq: u64, eager: bool) -> u64 {
        let s = self.slot(rank);
        let mark = |w: &AtomicU64| {
            let _ = w.fetch_update(Ordering::AcqRel, Ordering::Acquire, |a| {
                (a & SEQ_MASK == seq & SEQ_MASK).then_some(a | LEFT)
            });
        };
        if eager {
            mark(&s.eager[(seq & 1) as usize].arrive);
            return 0;
        }
        mark(&s.arrive);
        let c = s
            .claims
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                (c & SEQ_MASK == seq & SEQ_MASK).then_some(c | LEFT)
            })
            .map_or(0, |c| c & CLAIM_COUNT);
        c >> SEQ_BITS
    }

    /// How many peers still hold claims on `rank`'s buffers.
    pub fn claimed(&self, rank: usize) -> u64 {
        (self.slot(rank).claims.load(Ordering::Acquire) & CLAIM_COUNT) >> SEQ_BITS
    }

    /// Whether `rank` left operation `seq` (`eager`: an eager one) without finishing it.
    pub fn left(&self, rank: usize, seq: u64, eager: bool) -> bool {
        let s = self.slot(rank);
        let w = if eager {
            s.eager[(seq & 1) as usize].arrive.load(Ordering::Acquire)
        } else {
            s.arrive.load(Ordering::Acquire)
        };
        w & LEFT != 0 && w & SEQ_MASK == seq & SEQ_MASK
    }

    /// Publishes this rank's arrival at an eager operation `seq` (its input is in its eager
    /// area; peers read nothing else of its slot but its PreMulSum scalar, when it has one).
    /// Returns the arrival word peers will see (`eager_word`).
    pub fn publish_eager(&self, rank: usize, seq: u64, scalar: Option<u64>, call: Call) -> u64 {
        let s = self.slot(rank);
        if let Some(v) = scalar {
            s.scalar[(seq & 1) as usize].store(v, Ordering::Relaxed);
        }
        // The call's words stay in this rank's own line: peers read them only on a mismatch.
        for (w, v) in s.call[(seq & 1) as usize].iter().zip(call) {
            w.store(v, Ordering::Relaxed);
        }
        let w = arrival(seq, call);
        s.eager[(seq & 1) as usize]
            .arrive
            .store(w, Ordering::Release);
        w
    }

    /// `rank`'s arrival word at eager operations of `seq`'s parity: `seq` and the call's
    /// signature once it has arrived at `seq` (what `publish_eager` returned there), an older
    /// operation's before (no rank gets two ahead).
    #[inline]
    pub fn eager_word(&self, rank: usize, seq: u64) -> u64 {
        self.slot(rank).eager[(seq & 1) as usize]
            .arrive
            .load(Ordering::Acquire)
    }

    /// Whether an eager arrival word is at `seq` or later.
    #[inline]
    pub fn reached(word: u64, seq: u64) -> bool {
        word & SEQ_MASK >= seq
    }

    /// This rank has ended its communicator: peers waiting for it to arrive somewhere, or to
    /// finish, stop waiting (`ended`).
    pub fn end(&self, rank: usize) {
        self.slot(rank).ended.store(1, Ordering::Release);
    }

    /// Whether `rank` has ended its communicator. Everything it published before is visible
    /// once this says yes: look at it again before concluding that it never arrived.
    pub fn ended(&self, rank: usize) -> bool {
        self.slot(rank).ended.load(Ordering::Acquire) != 0
    }

    pub fn arrived(&self, rank: usize, seq: u64) -> bool {
        self.slot(rank).arrive.load(Ordering::Acquire) & SEQ_MASK >= seq
    }

    /// The signature `rank` arrived at operation `seq` with (`eager`: at an eager operation);
    /// None until it has arrived there.
    pub fn signature_of(&self, rank: usize, seq: u64, eager: bool) -> Option<u64> {
        let s = self.slot(rank);
        let w = if eager {
            s.eager[(seq & 1) as usize].arrive.load(Ordering::Acquire)
        } else {
            s.arrive.load(Ordering::Acquire)
        };
        (w & SEQ_MASK == seq & SEQ_MASK).then_some((w & !LEFT) >> SEQ_BITS)
    }

    /// What `rank` called at operation `seq` (valid once it has arrived there, until `seq + 2`).
    pub fn call_of(&self, rank: usize, seq: u64) -> Call {
        let c = &self.slot(rank).call[(seq & 1) as usize];
        [c[0].load(Ordering::Relaxed), c[1].load(Ordering::Relaxed)]
    }

    /// Whether `rank` has arrived at eager operation `seq`. Its line of that parity holds `seq`
    /// once it has, and an older operation's number before (no rank gets two ahead: it cannot
    /// finish `seq + 1` before everyone has arrived there).
    pub fn arrived_eager(&self, rank: usize, seq: u64) -> bool {
        self.slot(rank).eager[(seq & 1) as usize]
            .arrive
            .load(Ordering::Acquire)
            & SEQ_MASK
            >= seq
    }

    pub fn post_done(&self, rank: usize, seq: u64) {
        self.slot(rank).done.store(seq, Ordering::Release);
    }

    pub fn is_done(&self, rank: usize, seq: u64) -> bool {
        self.slot(rank).done.load(Ordering::Acquire) >= seq
    }

    /// A peer's published (process key, send, recv); valid between its arrival and its done.
    pub fn peer(&self, rank: usize) -> (u64, BufInfo, BufInfo) {
        let s = self.slot(rank);
        let w: Vec<u64> = s.words.iter().map(|w| w.load(Ordering::Relaxed)).collect();
        let info = |o: usize| BufInfo {
            addr: w[o],
            alloc_id: w[o + 1],
            fd: w[o + 2],
            base: w[o + 3],
            len: w[o + 4],
        };
        (s.key.load(Ordering::Relaxed), info(0), info(5))
    }

    /// A peer's vote for cross-memory attach; valid as its buffers are.
    pub fn vote(&self, rank: usize) -> f64 {
        f64::from_bits(self.slot(rank).vote.load(Ordering::Relaxed))
    }

    /// A peer's PreMulSum scalar bits for operation `seq`; valid as its inline area is.
    pub fn scalar(&self, rank: usize, seq: u64) -> u64 {
        self.slot(rank).scalar[(seq & 1) as usize].load(Ordering::Relaxed)
    }
}

impl Drop for Board {
    fn drop(&mut self) {
        // If some rank never attached, nobody else removes the name.
        self.forget_name();
    }
}
