//! What communicators leave behind for the next ones: their control blocks (pinned host pages)
//! and device boards, kept as they are when a communicator, or the last graph holding them,
//! lets go of them, and handed out again, zeroed, to communicators made later in the same
//! context.
//!
//! Freeing device or pinned memory (`cuMemFree`, `cuMemHostUnregister`) waits for the
//! device's kernels, and a rank's kernel waits for its peers' launches. Where threads of one
//! process drive the ranks one at a time, a free between two of their launches would wait for
//! good (NCCL's users know this hang from their own `cudaFree` calls). What graphs let go of
//! goes at any moment (`kept::reclaim`, on the watcher thread or before a launch), and a
//! communicator may be destroyed while another's ranks launch apart: neither frees anything,
//! so neither can wait. The spares are freed when the process's last communicator goes
//! (`Live`), and what is let go of after that is freed at once: no launch of this library can
//! wait for a peer then. (A communicator's connections are still freed when it is destroyed.)

use crate::gpu::memory::DevMem;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Control block pages (context pinned in, address), pinned and mapped into every context.
static PAGES: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
/// Boards' device memory (context, bytes, memory).
static BOARDS: Mutex<Vec<(usize, usize, DevMem)>> = Mutex::new(Vec::new());
/// Communicators of this process on the CUDA executor. Held while the spares are freed, so
/// that no communicator is made meanwhile (its ranks could launch apart under the frees).
static LIVE: Mutex<usize> = Mutex::new(0);
/// A communicator was destroyed while its kernels still ran (`stuck`): nothing is freed any
/// more, since a free would wait for them.
static STUCK: AtomicBool = AtomicBool::new(false);

/// Whether what is let go of is freed now rather than kept (`live`: the count, its lock
/// held): no communicator is left, and none got stuck.
fn frees_now(live: usize) -> bool {
    live == 0 && !STUCK.load(Ordering::SeqCst)
}

/// A spare control block page of context `ctx` (pinned there), zeroed; None where there is
/// none.
pub(super) fn page(ctx: usize, bytes: usize) -> Option<*mut u8> {
    let mut pages = PAGES.lock();
    let i = pages.iter().position(|&(c, _)| c == ctx)?;
    let p = pages.swap_remove(i).1 as *mut u8;
    // SAFETY: a page of `bytes` given back by a control block, which no kernel reads any more
    // (it went once its communicator's and its graphs' launches were done).
    unsafe { std::ptr::write_bytes(p, 0, bytes) };
    Some(p)
}

/// Keeps a control block's page (pinned in `ctx`) for a later communicator; frees it where no
/// communicator is left (a graph let go of it after the last went).
pub(super) fn give_page(ctx: usize, p: *mut u8) {
    let live = LIVE.lock();
    if frees_now(*live) {
        super::comm::free_page(p);
        return;
    }
    PAGES.lock().push((ctx, p as usize));
    drop(live);
}

/// A spare board of `bytes` in context `ctx`, zeroed; None where there is none, or zeroing it
/// failed (it is left allocated then).
pub(super) fn board(ctx: usize, bytes: usize) -> Option<DevMem> {
    let mut boards = BOARDS.lock();
    let i = boards.iter().position(|b| (b.0, b.1) == (ctx, bytes))?;
    let m = boards.swap_remove(i).2;
    drop(boards);
    match m.zero(bytes) {
        Ok(()) => Some(m),
        Err(e) => {
            // (Left allocated: freeing it here, between other ranks' launches, could wait for
            // good.)
            crate::debug::warn(&format!("zeroing a spare device board: {e}"));
            std::mem::forget(m);
            None
        }
    }
}

/// Keeps a board's memory (`bytes` in context `ctx`) for a later communicator; frees it where
/// no communicator is left.
pub(super) fn give_board(ctx: usize, bytes: usize, m: DevMem) {
    let live = LIVE.lock();
    if frees_now(*live) {
        drop(m);
        return;
    }
    BOARDS.lock().push((ctx, bytes, m));
    drop(live);
}

/// A communicator is destroyed while its kernels still run: from now on nothing is freed (a
/// free would wait for them), the spares stay until the process exits.
pub(super) fn stuck() {
    STUCK.store(true, Ordering::SeqCst);
}

/// What the spares hold now: control block pages, board bytes.
pub fn held() -> (Vec<u64>, usize) {
    let pages = PAGES.lock().iter().map(|&(_, p)| p as u64).collect();
    let boards = BOARDS.lock().iter().map(|b| b.1).sum();
    (pages, boards)
}

/// A communicator on the CUDA executor, counted while it lives: when the last goes, the
/// spares are freed.
pub(super) struct Live(());

impl Live {
    pub fn new() -> Live {
        *LIVE.lock() += 1;
        Live(())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let mut live = LIVE.lock();
        *live -= 1;
        if !frees_now(*live) {
            return;
        }
        // (Under the count's lock: a communicator made meanwhile waits for the frees, before
        // any launch of its.)
        let pages = std::mem::take(&mut *PAGES.lock());
        let boards = std::mem::take(&mut *BOARDS.lock());
        for (_, p) in pages {
            super::comm::free_page(p as *mut u8);
        }
        drop(boards);
        drop(live);
    }
}
