//! What CUDA graphs keep of a communicator. A captured launch names the communicator's control
//! block (its kernels read it) and events (the graph's record and wait nodes), and a graph may
//! be replayed after `ncclCommDestroy`. So each graph that captured a launch of a communicator
//! holds a [`Kept`] of it (a CUDA user object the graph retains), beside the communicator's own
//! references: the last to let go frees them. A communicator that ends marks its control block
//! stopped (`CudaComm::end`), and captured launches look at it before anything else
//! (`OX_HEAD_CAPTURED` in `cuda/runner.cu`): a replay after the end returns at once, leaving
//! the buffers as they are, instead of reading and writing connections freed by then.
//!
//! The driver calls a user object's destructor where no CUDA call is allowed, so it only queues
//! the `Kept`; what that held is let go of by the watcher thread within a few milliseconds
//! while communicators live, and at the next launch outside graph capture, or the next
//! communicator made or destroyed (`reclaim`): its events destroyed, its control block and
//! board kept as spares for later communicators (`spare`), which no free can make wait.

use super::comm::Ctl;
use crate::gpu::driver::{self, CtxGuard};
use parking_lot::Mutex;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A communicator's events (its last launch's, its join event, those its captured launches
/// record), destroyed in its context when nothing holds them any more.
pub(super) struct Events {
    ctx: usize,
    list: Mutex<Vec<usize>>,
}

impl Events {
    pub fn new(ctx: usize) -> Events {
        Events {
            ctx,
            list: Mutex::new(Vec::new()),
        }
    }

    /// Destroyed with the others.
    pub fn add(&self, event: usize) {
        self.list.lock().push(event);
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        if let (Ok(api), Ok(_g)) = (driver::api(), CtxGuard::enter(self.ctx)) {
            // (Relaxed: another thread's graph capture in global mode may be going on.)
            let _ = driver::relaxed(|| {
                for &e in self.list.get_mut().iter() {
                    // SAFETY: events created by the communicator, destroyed once, here.
                    unsafe { (api.event_destroy)(e as driver::CUevent) };
                }
                Ok(())
            });
        }
    }
}

/// What a graph holding a communicator's launches keeps alive.
#[derive(Clone)]
#[expect(
    dead_code,
    reason = "held, never read: what they own lives while a graph holds them"
)]
pub(super) struct Kept {
    pub ctl: Arc<Ctl>,
    pub events: Arc<Events>,
    /// Its device board (`super::board`), which board lanes read and write.
    pub board: Option<Arc<super::board::Board>>,
}

/// What graphs let go of, to be freed outside the driver's destructor thread.
static RELEASED: Mutex<Vec<Kept>> = Mutex::new(Vec::new());
static PENDING: AtomicBool = AtomicBool::new(false);

/// A user object's destructor (a driver thread: no CUDA call here, so nothing is freed).
unsafe extern "C" fn let_go(p: *mut c_void) {
    // SAFETY: `keep` made `p` from a boxed Kept and gave it to the driver, which calls this
    // once, when the last reference goes.
    let k = unsafe { Box::from_raw(p.cast::<Kept>()) };
    RELEASED.lock().push(*k);
    PENDING.store(true, Ordering::Release);
}

/// Makes the graph that `stream` captures into hold `k` until it and its instances are gone;
/// false where it cannot (a driver without user objects, or one that does not say which graph
/// a stream captures).
pub(super) fn keep(k: &Kept, stream: usize) -> bool {
    let Ok(api) = driver::api() else {
        return false;
    };
    let Some(uo) = api.user_objects else {
        return false;
    };
    let Ok(Some(graph)) = driver::capture_graph(stream) else {
        return false;
    };
    // (Relaxed: the caller's stream captures.)
    driver::relaxed(|| {
        let raw = Box::into_raw(Box::new(k.clone()));
        let mut obj: driver::CUuserObject = std::ptr::null_mut();
        // SAFETY: one reference, ours; `let_go` takes `raw` back when it goes.
        let r = unsafe {
            (uo.create)(
                &mut obj,
                raw.cast(),
                let_go,
                1,
                driver::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC,
            )
        };
        if r != driver::CUDA_SUCCESS {
            // SAFETY: the driver did not take it.
            drop(unsafe { Box::from_raw(raw) });
            return Ok(false);
        }
        // SAFETY: the capturing graph; our reference moves to it.
        let r = unsafe { (uo.retain)(graph, obj, 1, driver::CU_GRAPH_USER_OBJECT_MOVE) };
        if r != driver::CUDA_SUCCESS {
            // SAFETY: our reference, let go (its destructor queues the Kept).
            unsafe { (uo.release)(obj, 1) };
            return Ok(false);
        }
        Ok(true)
    })
    .unwrap_or(false)
}

/// `reclaim` where there is something to free and `now()` says so.
pub(super) fn reclaim_if(now: impl FnOnce() -> bool) {
    if PENDING.load(Ordering::Acquire) && now() {
        reclaim();
    }
}

/// Lets go of what graphs let go of since the last call: events are destroyed (in their
/// context, relaxed: a stream may capture a graph meanwhile), control blocks and boards go to
/// the spares (`spare`: nothing here frees memory, so nothing waits for the device's kernels).
/// What graphs let go of once no communicator is left, and no call of the program follows,
/// stays until it exits.
pub(super) fn reclaim() {
    if !PENDING.swap(false, Ordering::Acquire) {
        return;
    }
    let gone = std::mem::take(&mut *RELEASED.lock());
    drop(gone);
}
