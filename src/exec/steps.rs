//! Step programs on the host: each primitive moves one FIFO slot of data between the caller's
//! buffers and a connection, whenever the connection's counters allow. Never blocks.

use super::copy::copy_out;
use crate::plan::{Prim, Program};
use crate::reduce::Reducer;

/// Where a program is: iteration, step, and its resolved reduction.
pub(super) struct Cursor {
    iter: usize,
    step: usize,
    reducer: Option<Reducer>,
}

impl Cursor {
    pub(super) fn new(prog: &Program) -> Cursor {
        Cursor {
            iter: 0,
            step: 0,
            reducer: prog.red.map(|r| Reducer::new(r.resolve())),
        }
    }

    /// What this program waits for, for timeout messages.
    pub(super) fn describe_wait(&self, prog: &Program) -> Option<String> {
        let s = prog.steps.get(self.step)?;
        let conn = s
            .recv
            .as_ref()
            .filter(|c| c.recv_slot().is_none())
            .or(s.send.as_ref())?;
        Some(conn.describe())
    }
}

#[derive(PartialEq, Eq, Clone, Copy, Debug)]
pub(super) enum Poll {
    Done,
    Progress,
    Blocked,
}

/// Copy `bytes` bytes; `src == dst` is a no-op.
///
/// # Safety
/// Both ranges valid; equal or disjoint.
#[inline]
pub(super) unsafe fn copy(dst: *mut u8, src: *const u8, bytes: usize) {
    if bytes > 0 && !std::ptr::eq(dst, src) {
        // SAFETY: per the contract above.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) };
    }
}

/// Runs as many slices of the program as the connections allow.
pub(super) fn poll_program(prog: &Program, cur: &mut Cursor) -> Poll {
    let mut progressed = false;
    loop {
        if cur.iter >= prog.niter || prog.steps.is_empty() {
            return Poll::Done;
        }
        let (off, n) = prog.slice_of(cur.step, cur.iter);
        if n > 0 && !run_step(prog, cur, off, n) {
            return if progressed {
                Poll::Progress
            } else {
                Poll::Blocked
            };
        }
        progressed = true;
        cur.step += 1;
        if cur.step == prog.steps.len() {
            cur.step = 0;
            cur.iter += 1;
        }
    }
}

/// Performs step `cur.step` on `n` elements at element offset `off`, if its slots are ready.
fn run_step(prog: &Program, cur: &Cursor, off: usize, n: usize) -> bool {
    let s = &prog.steps[cur.step];
    let es = prog.esize;
    let bytes = n * es;
    let rslot = match &s.recv {
        Some(c) => match c.recv_slot() {
            Some(x) => Some(x),
            None => return false,
        },
        None => None,
    };
    let sslot = match &s.send {
        Some(c) => match c.send_slot() {
            Some(x) => Some(x),
            None => return false,
        },
        None => None,
    };
    let src = (s.src + off * es) as *const u8;
    let dst = (s.dst + off * es) as *mut u8;
    let inp = rslot.map(|x| x.1).unwrap_or(std::ptr::null());
    let out = sslot.map(|x| x.1).unwrap_or(std::ptr::null_mut());
    let red = cur.reducer.as_ref();
    let nt = prog.stream_out;
    // SAFETY: src/dst lie inside the caller's buffers (validated at enqueue: `len` elements from
    // the segment start), slots hold `slot_bytes >= bytes`, and a slot is owned by this side
    // between seeing it ready and posting it.
    unsafe {
        match s.prim {
            Prim::Send => match red {
                Some(r) if s.prep => r.prep(out, src, n),
                _ => copy(out, src, bytes),
            },
            Prim::Recv => copy_out(dst, inp, bytes, nt),
            Prim::CopySend => {
                copy(out, src, bytes);
                copy_out(dst, src, bytes, nt);
            }
            Prim::RecvCopySend => {
                copy(out, inp, bytes);
                copy_out(dst, inp, bytes, nt);
            }
            Prim::RecvReduceSend => reducer(red).combine(out, src, inp, n),
            Prim::RecvReduceCopy => {
                let r = reducer(red);
                r.combine(dst, src, inp, n);
                r.finish(dst, dst, n);
            }
            Prim::RecvReduceCopySend if nt => {
                // Reduce into the outgoing slot (cached), then stream it to the output.
                let r = reducer(red);
                r.combine(out, src, inp, n);
                r.finish(out, out, n);
                copy_out(dst, out, bytes, true);
            }
            Prim::RecvReduceCopySend => {
                let r = reducer(red);
                r.combine(dst, src, inp, n);
                r.finish(dst, dst, n);
                copy(out, dst, bytes);
            }
            Prim::LocalCopy => copy_out(dst, src, bytes, nt),
            Prim::LocalReduce => {
                let r = reducer(red);
                r.prep(dst, src, n);
                r.finish(dst, dst, n);
            }
        }
    }
    if let (Some(c), Some((step, _))) = (&s.recv, rslot) {
        c.post_recv(step);
    }
    if let (Some(c), Some((step, _))) = (&s.send, sslot) {
        c.post_send(step);
    }
    true
}

fn reducer(r: Option<&Reducer>) -> &Reducer {
    r.expect("planner attaches a reduction to every reducing program")
}
