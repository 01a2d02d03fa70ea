//! Groups: this thread's calls collected until the outermost `ncclGroupEnd` (group state only).
//! Outside a group every call is a group of one, launched at once. At the group's end deferred
//! inits run first, all at once; then the calls are launched together (`launch`). A group of
//! only non-blocking inits ends at once, `ncclInProgress`, its inits running on (as NCCL's).

use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::exec::Stream;
use crate::launch::{self, Queued};
use crate::types::CollArgs;
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Default)]
struct GroupState {
    depth: usize,
    inits: Vec<Arc<Comm>>,
    ops: Vec<Queued>,
    error: Option<Error>,
}

thread_local! {
    static GROUP: RefCell<GroupState> = RefCell::new(GroupState::default());
}

/// Threads inside a group: while none is, a call need not look at its thread's group state
/// (a thread-local access in a shared library goes through `__tls_get_addr`, a good part of a
/// small operation's launch).
static THREADS_IN_GROUPS: AtomicUsize = AtomicUsize::new(0);

/// Inside a group, queue a comm's init for `ncclGroupEnd` and return true.
pub fn defer_init(comm: &Arc<Comm>) -> bool {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return false;
        }
        g.inits.push(comm.clone());
        true
    })
}

pub fn start() -> Result<()> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            THREADS_IN_GROUPS.fetch_add(1, Ordering::AcqRel);
        }
        g.depth += 1;
    });
    Ok(())
}

/// Ends a level of this thread's group (`call`: the call that does, for its error): the
/// group's state where that was the outermost.
fn close(call: &str) -> Result<Option<GroupState>> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Error::invalid_usage(format!(
                "{call} called without a matching ncclGroupStart"
            )));
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Ok(None);
        }
        THREADS_IN_GROUPS.fetch_sub(1, Ordering::AcqRel);
        Ok(Some(std::mem::take(&mut *g)))
    })
}

/// How deep this thread is in groups (0: in none).
pub fn depth() -> usize {
    GROUP.with(|g| g.borrow().depth)
}

pub fn end() -> Result<()> {
    match close("ncclGroupEnd")? {
        None => Ok(()),
        Some(s) => launch_group(s),
    }
}

/// `ncclGroupSimulateEnd`: ends the group as `end` does, but launches none of its calls (as
/// NCCL's, which only estimates their time); deferred inits still run (non-blocking ones in
/// the background, as `end` starts them). Whether the group held
/// calls (false also for an inner level): their time is not estimated yet.
pub fn simulate_end() -> Result<bool> {
    let Some(s) = close("ncclGroupSimulateEnd")? else {
        // (An inner level: only the outermost end does anything.)
        return Ok(false);
    };
    group_inits(&s)?;
    Ok(!s.ops.is_empty())
}

fn launch_group(s: GroupState) -> Result<()> {
    group_inits(&s)?;
    launch::run_group(s.ops)
}

/// A group's deferred inits at its end: started in the background where they are all it holds
/// and all non-blocking (`ncclInProgress`), else run here unless the group refused a call.
fn group_inits(s: &GroupState) -> Result<()> {
    if background_inits(s) {
        return Err(start_inits(s));
    }
    inits_unless_refused(s)
}

/// Starts a group's non-blocking inits, each on a thread of its own, as NCCL's group end does
/// with non-blocking communicators: it returns at once (`ncclInProgress`, what this gives),
/// and each communicator's ncclCommGetAsyncError says when its init is done. (A thread that
/// makes several communicators, each in a group of its own, in an order its peers do not
/// share, would otherwise wait in the first for a peer that waits in another.)
fn start_inits(s: &GroupState) -> Error {
    for (k, c) in s.inits.iter().enumerate() {
        if let Err(e) = c.start_init() {
            // (No thread to run it: this init and those not started report the error.)
            for rest in &s.inits[k..] {
                rest.abandon_init("its group's end could not start the init", &e);
            }
            return e;
        }
    }
    Error::new(
        crate::error::Code::InProgress,
        "non-blocking inits in progress",
    )
}

/// Whether the group's end starts its inits and returns: it holds inits, all non-blocking,
/// and nothing else (calls in the group wait for them: the group then runs as a blocking one,
/// and returns when its calls are launched).
fn background_inits(s: &GroupState) -> bool {
    s.error.is_none()
        && s.ops.is_empty()
        && !s.inits.is_empty()
        && s.inits.iter().all(|c| c.is_nonblocking())
}

/// Runs the group's deferred inits, unless it refused a call (or an init): then none runs and
/// none of its calls is launched (as NCCL's), its end returns that error at once, and its
/// communicators still to be made report it, rather than wait for a rank whose init was
/// refused.
fn inits_unless_refused(s: &GroupState) -> Result<()> {
    if let Some(e) = &s.error {
        for c in &s.inits {
            c.abandon_init("a call of the group its init was in failed", e);
        }
        return Err(e.clone());
    }
    crate::comm::run_inits(&s.inits)
}

/// Inside a group, makes `e` the group's error unless it has one: a call refused before it
/// reached `enqueue` (its datatype, its communicator handle, its config), or an init refused
/// in the group, as `enqueue` does for the calls it refuses. The group's end then returns it
/// and launches nothing (as NCCL's `ncclGroupErrCheck`).
pub fn note_error(e: &Error) {
    if THREADS_IN_GROUPS.load(Ordering::Acquire) == 0 {
        return;
    }
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 && g.error.is_none() {
            g.error = Some(e.clone());
        }
    });
}

/// Validates a call and queues it (or runs it at once outside a group).
pub fn enqueue(comm: &Arc<Comm>, args: CollArgs, stream: Stream) -> Result<()> {
    // This thread's own count is exact: if it is in a group, the counter is not zero.
    let in_group =
        THREADS_IN_GROUPS.load(Ordering::Acquire) > 0 && GROUP.with(|g| g.borrow().depth > 0);
    if !in_group {
        return launch::run_one(comm, args, stream);
    }
    let checked = launch::check(comm, args, stream);
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        // The communicator's first call in the group sets what its other streams must capture.
        let checked = checked.and_then(|q| q.fits_group(&g.ops).map(|()| q));
        match checked {
            Ok(q) => {
                g.ops.push(q);
                Ok(())
            }
            Err(e) => {
                if g.error.is_none() {
                    g.error = Some(e.clone());
                }
                Err(e)
            }
        }
    })
}
