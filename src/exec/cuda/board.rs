//! The device board: where the ranks of a communicator that are all in one process on one GPU
//! meet for direct collectives (all-reduce, reduce, broadcast, all-gather, reduce-scatter),
//! whatever threads and streams launch their parts.
//!
//! `direct` serves a group that holds every rank's all-reduce (one thread, one launch). Ranks
//! that call from threads of their own launch one at a time, each on its own stream, so no
//! launch knows the others' buffers; but their buffers are all in this process's address
//! space, on this GPU. Each rank's launch then has a *board lane* (`Desc::lane_on`): the
//! blocks publish the rank's buffers on the board, wait there for every rank's, and each rank
//! does its share of the elements from every input it needs into every output it writes
//! (`ox_board` in `cuda/runner.cu`, which documents the board's layout), instead of passing
//! every byte through FIFO slots around a ring. Every count lives on the board, in device
//! memory, so graph replays need nothing from the host.
//!
//! One board per communicator and context, shared by its ranks here: the first rank to come
//! allocates it, the others find it (`for_rank`). Graphs that captured a board lane keep it
//! (`kept::Kept`).

use crate::error::Result;
use crate::gpu::memory::DevMem;
use parking_lot::Mutex;
use std::sync::{Arc, Weak};

/// The parts an operation is cut into at most, and the bytes of one rank's line for one part
/// (`OX_BOARD_PARTS`, `OX_BOARD_LINE`).
const PARTS: usize = 64;
const LINE: usize = 128;
/// A board's bytes: a line per rank and part.
fn bytes(nranks: usize) -> usize {
    PARTS * LINE * nranks
}
/// The most ranks a board serves (`OX_DIRECT_MAX`).
pub const MAX_RANKS: usize = super::direct::MAX_RANKS;

pub struct Board {
    /// Its memory (None once dropped: gone to the spares).
    mem: Option<DevMem>,
    at: u64,
    hash: u64,
    ctx: usize,
    nranks: usize,
    /// Each rank's place: free, taken, or left (its communicator ended).
    places: Mutex<Vec<Place>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    Free,
    Taken,
    Left,
}

impl Board {
    /// The board's device address.
    pub fn addr(&self) -> u64 {
        self.at
    }

    /// Whether `addr` is on the board (a waiting kernel names the line it waits on).
    pub fn holds(&self, addr: u64) -> bool {
        (self.at..self.at + bytes(self.nranks) as u64).contains(&addr)
    }

    /// The part and the rank of the line at `addr` (on the board).
    pub fn line(&self, addr: u64) -> (usize, usize) {
        let i = (addr - self.at) as usize / LINE;
        (i / self.nranks, i % self.nranks)
    }

    /// Rank `rank`'s communicator ended, its kernels done: it comes no more.
    pub fn leave(&self, rank: usize) {
        if let Some(p) = self.places.lock().get_mut(rank) {
            *p = Place::Left;
        }
    }

    /// Whether rank `rank`'s communicator ended.
    pub fn left(&self, rank: usize) -> bool {
        self.places.lock().get(rank) == Some(&Place::Left)
    }
}

impl Drop for Board {
    fn drop(&mut self) {
        // Kept for a later communicator: freeing it now could wait for good (`spare`).
        if let Some(m) = self.mem.take() {
            super::spare::give_board(self.ctx, bytes(self.nranks), m);
        }
    }
}

/// The boards of this process's communicators (dropped ones are swept at the next look).
static BOARDS: Mutex<Vec<Weak<Board>>> = Mutex::new(Vec::new());

/// The ranks of this process on the boards of context `ctx` (those whose communicators have
/// not ended): every one of them may have a board launch waiting for its peers at once, so
/// together they must fit the device (`exec::cuda::run`'s room).
pub fn ranks_in(ctx: usize) -> usize {
    BOARDS
        .lock()
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|b| b.ctx == ctx)
        .map(|b| {
            b.places
                .lock()
                .iter()
                .filter(|&&p| p == Place::Taken)
                .count()
        })
        .sum()
}

/// The board of rank `rank` of the communicator `hash` of `nranks` ranks, in context `ctx`
/// (current): the one its ranks here already share, where this rank's place is free, else a
/// new one. None where the communicator has fewer than 2 or more than `MAX_RANKS` ranks.
pub fn for_rank(hash: u64, ctx: usize, rank: usize, nranks: usize) -> Result<Option<Arc<Board>>> {
    if !(2..=MAX_RANKS).contains(&nranks) || rank >= nranks {
        return Ok(None);
    }
    let mut all = BOARDS.lock();
    all.retain(|w| w.strong_count() > 0);
    for b in all.iter().filter_map(Weak::upgrade) {
        if (b.hash, b.ctx, b.nranks) == (hash, ctx, nranks) {
            let mut places = b.places.lock();
            if places[rank] == Place::Free {
                places[rank] = Place::Taken;
                drop(places);
                return Ok(Some(b));
            }
        }
    }
    let mem = match super::spare::board(ctx, bytes(nranks)) {
        Some(m) => m,
        None => DevMem::zeroed(bytes(nranks), "a communicator's device board")?,
    };
    let mut places = vec![Place::Free; nranks];
    places[rank] = Place::Taken;
    let b = Arc::new(Board {
        at: mem.ptr,
        mem: Some(mem),
        hash,
        ctx,
        nranks,
        places: Mutex::new(places),
    });
    all.push(Arc::downgrade(&b));
    Ok(Some(b))
}
