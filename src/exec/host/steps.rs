//! Step programs on the host: each primitive moves one FIFO slot of data between the caller's
//! buffers and a connection, whenever the connection's counters allow. Never blocks.

use super::copy::copy_out;
use super::tune::{BySize, FIFO_TUNE_BYTES, STREAMED};
use crate::error::{Error, Result};
use crate::plan::{Addr, Prim, Program};
use crate::transport::Conn;
use smallvec::SmallVec;
use std::sync::Arc;

use super::recv_ref::RecvRefs;
use crate::reduce::Reducer;
use std::time::Instant;

/// A program bound to this rank's connections.
pub(super) type HostProgram = Program<Arc<Conn>>;

// Binding a planned program reuses its steps' memory only where a bound step is the size of a
// planned one (`Program::bind`).
const _: () = {
    use crate::plan::Step;
    use crate::transport::ConnKey;
    use std::mem::{align_of, size_of};
    assert!(size_of::<Step<Arc<Conn>>>() == size_of::<Step<ConnKey>>());
    assert!(align_of::<Step<Arc<Conn>>>() == align_of::<Step<ConnKey>>());
};

/// Where a program is: the first slice not done (`head`, counting step by step through the
/// iterations), which of the following slices are done already (run ahead), and the program's
/// resolved reduction.
pub(super) struct Cursor {
    head: usize,
    /// Bit a: slice `head + a` is done (the window is at most `MAX_WINDOW` slices).
    ahead: u128,
    reducer: Option<Reducer>,
    /// Scratch for `poll_program`: connections (by address) held by pending slices, kept to
    /// reuse its memory.
    held: SmallVec<[usize; 4]>,
    /// FIFO slots are filled with streaming stores (see `plan::tune`).
    streamed: bool,
    /// Where the program's speed is recorded when it ends, the option measured, and its start.
    timed: Option<(usize, Instant)>,
    /// The option measured is not the one that looks better (an exploring operation).
    exploring: bool,
    /// Write the caller's output with streaming stores (it is too large to stay in the cache).
    stream_out: bool,
    /// Slices of a later iteration may run before blocked slices of an earlier one (each
    /// connection still in order): every two steps' buffer regions start at the same address or
    /// do not overlap, so slices of different iterations never touch the same memory.
    run_ahead: bool,
    /// Bit k: step k hands its connection the caller's memory rather than a copy of it
    /// (`by_reference`).
    by_ref: u64,
    /// Connections given slots by reference, and the last such step of each: when the program
    /// ends, those that have not left are copied into their slots (`Conn::settle_refs`)
    /// before the caller's memory is given back.
    refs: SmallVec<[(Arc<Conn>, u64); 2]>,
    /// Connections whose slots the proxy reads into the caller's memory (`recv_ref`).
    recv_refs: RecvRefs,
}

impl Drop for Cursor {
    #[inline]
    fn drop(&mut self) {
        if !self.refs.is_empty() || !self.recv_refs.is_empty() {
            self.settle();
        }
    }
}

/// The address of a host program's buffer (scratch was resolved when the work started; None
/// is never read or written).
#[inline]
pub(super) fn at(a: Addr) -> usize {
    match a {
        Addr::User(x) => x,
        Addr::None | Addr::Scratch { .. } => 0,
    }
}

/// The host's policies for a program: (streaming stores for its output, run ahead).
fn policies(prog: &HostProgram) -> (bool, bool) {
    let esize = prog.esize;
    let steps = &prog.steps;
    let out_bytes: usize = steps
        .iter()
        .filter(|s| s.prim.writes_dst())
        .map(|s| s.len * esize)
        .sum();
    // In place, the output's lines were just read as input and sit in the cache: ordinary
    // stores are cheaper there (measured: streaming stores cost a third of in-place speed).
    let in_place = steps
        .iter()
        .any(|s| s.prim.writes_dst() && s.len > 0 && s.src == s.dst);
    let stream_out = !in_place && out_bytes >= crate::param::stream_bytes();
    // Every two regions start at the same address or do not overlap (no allocation: a program
    // has a few steps, and this runs at each program's start).
    let regions = || {
        steps
            .iter()
            .filter(|s| s.len > 0)
            .flat_map(|s| [(at(s.src), s.len * esize), (at(s.dst), s.len * esize)])
            .filter(|&(a, _)| a != 0)
    };
    let run_ahead = crate::param::run_ahead()
        && regions().enumerate().all(|(i, (a, la))| {
            regions()
                .skip(i + 1)
                .all(|(b, lb)| a == b || a + la <= b || b + lb <= a)
        });
    (stream_out, run_ahead)
}

/// The steps that may send by reference (bit k for step k; none past 64 steps): a `Send` of
/// its source as it is (no pre-multiplication to apply first), or a `RecvReduceCopySend` of
/// the output it has just written, on a connection that takes slots by reference (the
/// network's sending ends, `Conn::sends_by_reference`). Such a step saves the copy into the
/// slot: the socket takes the bytes from the caller's buffer. A later step that writes where
/// such a slot still refers first has it copied into its slot (`guard`): in place, the bytes
/// sent are the ones the step read.
#[inline(never)]
fn by_reference(prog: &HostProgram, red: Option<&Reducer>) -> u64 {
    let steps = &prog.steps;
    if steps.len() > 64 {
        return 0;
    }
    let mut mask = 0;
    for (k, s) in steps.iter().enumerate() {
        let region = match s.prim {
            Prim::Send if !(s.prep && red.is_some_and(|r| !r.prep_is_copy())) => at(s.src),
            Prim::RecvReduceCopySend => at(s.dst),
            _ => continue,
        };
        if region != 0 && s.len > 0 && s.send.as_ref().is_some_and(|c| c.sends_by_reference()) {
            mask |= 1 << k;
        }
    }
    mask
}

/// Before a step writes `bytes` at `dst`: slots sent by reference that still refer to any of
/// it get copies of what it holds now. (Out of line: only network programs come here.)
#[inline(never)]
fn guard(cur: &Cursor, dst: *mut u8, bytes: usize) {
    for (c, last) in &cur.refs {
        if c.refers_to(dst as usize, bytes, *last) {
            c.settle_refs();
        }
    }
}

/// Bytes the program sends through slots that streaming stores may fill (see
/// `Conn::slots_read_by_peer`): what decides whether the FIFO choice is measured, and what it
/// is measured with.
fn streamable_bytes(prog: &HostProgram) -> usize {
    prog.steps
        .iter()
        .filter(|s| s.send.as_ref().is_some_and(|c| c.slots_read_by_peer()))
        .map(|s| s.len * prog.esize)
        .sum()
}

/// How many slices past the head a program may run ahead, in iterations, and at most in all (the
/// bits of `Cursor::ahead`; a program of more than 32 steps runs ahead less than 4 iterations).
const AHEAD_ITERS: usize = 4;
const MAX_WINDOW: usize = 128;

impl Cursor {
    /// `fifo`: the estimates to choose how to fill FIFO slots from, and the operation's round
    /// (shared by all ranks, see `Estimates::pick`).
    pub(super) fn new(prog: &HostProgram, fifo: Option<(&BySize, u64)>) -> Cursor {
        let forced = crate::param::fifo_stream();
        let sent = streamable_bytes(prog);
        let mut exploring = false;
        let timed = fifo
            .filter(|_| forced.is_none() && sent >= FIFO_TUNE_BYTES)
            .map(|(e, round)| {
                let e = e.get(sent);
                let option = e.pick(round);
                exploring = option != e.better();
                (option, Instant::now())
            });
        let (stream_out, run_ahead) = policies(prog);
        let reducer = prog.red.map(|r| Reducer::new(super::resolve(&r)));
        Cursor {
            head: 0,
            ahead: 0,
            by_ref: by_reference(prog, reducer.as_ref()),
            reducer,
            held: SmallVec::new(),
            streamed: forced.unwrap_or(timed.is_some_and(|(o, _)| o == STREAMED)),
            timed,
            exploring,
            stream_out,
            run_ahead,
            refs: SmallVec::new(),
            recv_refs: RecvRefs::new(prog),
        }
    }

    /// Copies the slots sent by reference that have not left into their slots, and revokes
    /// the places named for slots not received yet: the caller's buffers are then free to
    /// change (a program that ends, with an error or not, or is dropped). Most have left by
    /// then: only the last few slots are copied.
    #[cold]
    #[inline(never)]
    pub(super) fn settle(&mut self) {
        for (c, step) in self.refs.drain(..) {
            if c.head().load(std::sync::atomic::Ordering::Acquire) <= step {
                c.settle_refs();
            }
        }
        self.recv_refs.revoke();
    }

    /// Slot `step` of `c` was posted by reference: settled when the program ends, if it has
    /// not left by then.
    fn sent_by_reference(&mut self, c: &Arc<Conn>, step: u64) {
        match self.refs.iter_mut().find(|(x, _)| Arc::ptr_eq(x, c)) {
            Some(r) => r.1 = step,
            None => self.refs.push((c.clone(), step)),
        }
    }

    /// Whether the program tries the FIFO option that looks worse: its speed then says little
    /// about the ring's.
    pub(super) fn exploring(&self) -> bool {
        self.exploring
    }

    /// Records the finished program's speed with the option it used.
    pub(super) fn finish(&self, prog: &HostProgram, fifo: &BySize) {
        if let Some((option, t0)) = self.timed {
            let bytes = streamable_bytes(prog);
            fifo.get(bytes).record(option, bytes, t0.elapsed());
        }
    }

    /// What this program waits for, for timeout messages.
    pub(super) fn describe_wait(&self, prog: &HostProgram) -> Option<String> {
        Some(self.waits_on(prog)?.describe())
    }

    /// The connection this program waits on.
    pub(super) fn waits_on<'p>(&self, prog: &'p HostProgram) -> Option<&'p Arc<Conn>> {
        let s = prog.steps.get(self.head % prog.steps.len().max(1))?;
        s.recv
            .as_ref()
            .filter(|c| c.recv_slot().is_none())
            .or(s.send.as_ref())
    }
}

#[derive(PartialEq, Eq, Clone, Copy, Debug)]
pub(super) enum Poll {
    Done,
    Progress,
    Blocked,
}

/// Runs as many slices of the program as the connections allow: in order, and, where the
/// program allows it (`run_ahead`), slices of later iterations past blocked ones, as long as
/// each connection's slots are used in program order and no earlier slice of the same iteration
/// is still pending.
pub(super) fn poll_program(prog: &HostProgram, cur: &mut Cursor) -> Result<Poll> {
    let nsteps = prog.steps.len();
    let total = prog.niter * nsteps;
    let window = if cur.run_ahead {
        (AHEAD_ITERS * nsteps).min(MAX_WINDOW)
    } else {
        1
    };
    let mut progressed = false;
    loop {
        if cur.head >= total {
            // The caller has its memory back once this returns: slots that refer to it and
            // have not left get copies.
            if !cur.refs.is_empty() || !cur.recv_refs.is_empty() {
                cur.settle();
            }
            return Ok(Poll::Done);
        }
        let mut ran = false;
        // Connections held by pending earlier slices in this pass, and the iteration of the last
        // pending one (slices are visited in iteration order, so no earlier one can recur).
        let mut held = std::mem::take(&mut cur.held);
        held.clear();
        let mut held_iter = None;
        let end = (cur.head + window).min(total);
        for j in cur.head..end {
            let a = j - cur.head;
            if (cur.ahead >> a) & 1 == 1 {
                continue;
            }
            let (k, i) = (j % nsteps, j / nsteps);
            let s = &prog.steps[k];
            let conns = [s.recv.as_ref(), s.send.as_ref()];
            let blocked_by_order = held_iter == Some(i)
                || conns
                    .iter()
                    .flatten()
                    .any(|c| held.contains(&(Arc::as_ptr(c) as usize)));
            let (off, n) = prog.slice_of(k, i);
            let done = !blocked_by_order && (n == 0 || run_step(prog, cur, k, off, n)?);
            if done {
                cur.ahead |= 1 << a;
                ran = true;
            } else {
                held.extend(conns.iter().flatten().map(|c| Arc::as_ptr(c) as usize));
                held_iter = Some(i);
            }
        }
        cur.held = held;
        let first_pending = cur.ahead.trailing_ones();
        cur.ahead = cur.ahead.checked_shr(first_pending).unwrap_or(0);
        cur.head += first_pending as usize;
        if !ran {
            // Where a proxy moves the data (the network), move it now on this thread rather
            // than wait for the proxy thread to notice (it does the same where this one cannot).
            if let Some(s) = prog.steps.get(cur.head % nsteps) {
                s.send.iter().chain(s.recv.iter()).for_each(|c| c.drive());
            }
            return Ok(if progressed {
                Poll::Progress
            } else {
                Poll::Blocked
            });
        }
        progressed = true;
    }
}

/// Performs step `k` on `n` elements at element offset `off`, if its slots are ready (false
/// when they are not); an error, before the slot is used, when the peer filled it for another
/// call.
fn run_step(prog: &HostProgram, cur: &mut Cursor, k: usize, off: usize, n: usize) -> Result<bool> {
    let s = &prog.steps[k];
    let es = prog.esize;
    let bytes = n * es;
    let rslot = match &s.recv {
        Some(c) => match c.recv_slot() {
            Some(x) => {
                let theirs = c.call_of(x.0);
                if theirs != prog.call {
                    return Err(other_call(prog, c, theirs));
                }
                Some(x)
            }
            None => return Ok(false),
        },
        None => None,
    };
    let sslot = match &s.send {
        Some(c) => match c.send_slot() {
            Some(x) => Some(x),
            None => return Ok(false),
        },
        None => None,
    };
    let src = (at(s.src) + off * es) as *const u8;
    let dst = (at(s.dst) + off * es) as *mut u8;
    if !cur.recv_refs.is_empty() {
        if let (Some(c), Some((step, _))) = (&s.recv, rslot) {
            if cur.recv_refs.taking(prog, c, step, k) {
                // SAFETY: as below.
                unsafe { delivered(prog, cur, k, dst, bytes, (step, sslot)) };
                return Ok(true);
            }
        }
    }
    let inp = rslot.map(|x| x.1).unwrap_or(std::ptr::null());
    let out = sslot.map(|x| x.1).unwrap_or(std::ptr::null_mut());
    let red = cur.reducer.as_ref();
    let nt = cur.stream_out;
    let st = cur.streamed && s.send.as_ref().is_some_and(|c| c.slots_read_by_peer());
    let tmp = if st {
        stream_tmp(prog.slice * es)
    } else {
        std::ptr::null_mut()
    };
    if !cur.refs.is_empty() && s.prim.writes_dst() {
        guard(cur, dst, bytes);
    }
    // The slot refers to the caller's memory instead (see `by_reference`): a plain send, or
    // the output a reduction has just written.
    if k < 64 && (cur.by_ref >> k) & 1 == 1 {
        let sslot = sslot.expect("a slot to send in").0;
        // SAFETY: as below.
        unsafe { send_by_reference(prog, cur, k, (src, dst, inp), n, (rslot, sslot)) };
        return Ok(true);
    }
    // SAFETY: src/dst lie inside the caller's buffers (validated at enqueue: `len` elements from
    // the segment start), slots hold `slot_bytes >= bytes`, and a slot is owned by this side
    // between seeing it ready and posting it.
    unsafe {
        match s.prim {
            Prim::Send => match red {
                Some(r) if s.prep && !r.prep_is_copy() => {
                    if st {
                        // Transform in cache, then stream into the slot.
                        r.prep(tmp, src, n);
                        copy_out(out, tmp, bytes, true);
                    } else {
                        r.prep(out, src, n);
                    }
                }
                _ => copy_out(out, src, bytes, st),
            },
            Prim::Recv => copy_out(dst, inp, bytes, nt),
            Prim::CopySend => {
                copy_out(out, src, bytes, st);
                copy_out(dst, src, bytes, nt);
            }
            Prim::RecvCopySend => {
                copy_out(out, inp, bytes, st);
                copy_out(dst, inp, bytes, nt);
            }
            Prim::RecvReduceSend if st => {
                // Reduce in cache, then stream into the slot.
                reducer(red).combine(tmp, src, inp, n);
                copy_out(out, tmp, bytes, true);
            }
            Prim::RecvReduceSend => reducer(red).combine(out, src, inp, n),
            Prim::RecvReduceCopy => {
                let r = reducer(red);
                r.combine(dst, src, inp, n);
                r.finish(dst, dst, n);
            }
            Prim::RecvReduceCopySend if st => {
                // Reduce in cache (into the output, unless that is streamed too), then stream.
                let r = reducer(red);
                let acc = if nt { tmp } else { dst };
                r.combine(acc, src, inp, n);
                r.finish(acc, acc, n);
                copy_out(dst, acc, bytes, true);
                copy_out(out, acc, bytes, true);
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
                copy_out(out, dst, bytes, false);
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
        c.post_send(step, prog.call, bytes);
    }
    Ok(true)
}

/// Step `k` (a `Recv` or `RecvCopySend`) whose received slot `rstep` the proxy read straight
/// into `dst` (`recv_ref`): only the send is left, from `dst`, by reference where the
/// connection takes that (no other step writes `dst`: nothing to `guard`). Out of line: only
/// network receives come here.
///
/// # Safety
/// As `run_step`'s: `dst` is valid for `bytes` bytes and the slots are this side's.
#[inline(never)]
unsafe fn delivered(
    prog: &HostProgram,
    cur: &mut Cursor,
    k: usize,
    dst: *mut u8,
    bytes: usize,
    (rstep, sslot): (u64, Option<(u64, *mut u8)>),
) {
    let s = &prog.steps[k];
    if let (Some(c), Some((step, out))) = (&s.send, sslot) {
        if c.sends_by_reference() {
            c.post_send_ref(step, prog.call, dst, bytes);
            cur.sent_by_reference(c, step);
        } else {
            let st = cur.streamed && c.slots_read_by_peer();
            // SAFETY: per the contract (a slot holds `slot_bytes >= bytes`).
            unsafe { copy_out(out, dst, bytes, st) };
            c.post_send(step, prog.call, bytes);
        }
    }
    if let Some(c) = &s.recv {
        c.post_recv(rstep);
    }
}

/// Step `k` on `n` elements at `src`/`dst` with the received slot `inp` (`run_step`'s), its
/// slot to send posted by reference: to `src` (a `Send`), or to `dst` once the reduction is
/// there (a `RecvReduceCopySend`). Out of line: only network sends come here.
///
/// # Safety
/// As `run_step`'s: the ranges are valid for `n` elements and the slots are this side's.
#[inline(never)]
unsafe fn send_by_reference(
    prog: &HostProgram,
    cur: &mut Cursor,
    k: usize,
    (src, dst, inp): (*const u8, *mut u8, *const u8),
    n: usize,
    (rslot, sslot): (Option<(u64, *const u8)>, u64),
) {
    let s = &prog.steps[k];
    let c = s.send.as_ref().expect("a step that sends has a connection");
    let data = if s.prim == Prim::Send {
        src
    } else {
        let r = reducer(cur.reducer.as_ref());
        // SAFETY: per the contract.
        unsafe {
            r.combine(dst, src, inp, n);
            r.finish(dst, dst, n);
        }
        dst as *const u8
    };
    if let (Some(c), Some((step, _))) = (&s.recv, rslot) {
        c.post_recv(step);
    }
    c.post_send_ref(sslot, prog.call, data, n * prog.esize);
    cur.sent_by_reference(c, sslot);
}

/// The error of a program that received a slot filled by another call.
#[cold]
#[inline(never)]
fn other_call(prog: &HostProgram, c: &Conn, theirs: [u64; 2]) -> Error {
    use crate::plan::call::describe;
    Error::invalid_usage(format!(
        "rank {} called {}, but rank {} sent it data of {}: every rank must make the same calls \
         in the same order (a send the same bytes as its receive); nothing of it was read, and \
         the communicator can now only be destroyed or aborted",
        c.me,
        describe(prog.call),
        c.peer,
        describe(theirs)
    ))
}

thread_local! {
    /// Where a reduction goes before it is streamed into a slot: one per thread, kept (a buffer
    /// of a slot's size allocated per program costs page faults at every launch once the
    /// allocator gives its pages back).
    static STREAM_TMP: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// This thread's staging buffer, at least `bytes` long (valid until the next call on this
/// thread; `run_step` does not nest).
fn stream_tmp(bytes: usize) -> *mut u8 {
    STREAM_TMP.with_borrow_mut(|v| {
        if v.len() < bytes {
            v.resize(bytes, 0);
        }
        v.as_mut_ptr()
    })
}

fn reducer(r: Option<&Reducer>) -> &Reducer {
    r.expect("planner attaches a reduction to every reducing program")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{inproc, region_bytes, Proxy, Region};

    /// A sending end that takes slots by reference and never sends them (its peer reads
    /// nothing): what it holds is what a late socket would still send.
    struct Holding(Conn);

    impl Proxy for Holding {
        fn progress(&self) -> Result<bool> {
            Ok(false)
        }
        fn by_reference(&self) -> bool {
            true
        }
        fn settle(&self) {
            self.0.settle_refs_held();
        }
    }

    fn conn(name: &str, is_sender: bool) -> (Conn, Conn) {
        let region = inproc::open(name, region_bytes(4, 4096)).expect("a region");
        inproc::forget(name);
        let end = |s| Conn::new(Region::Heap(region.clone()), 4, 4096, (0, 1), s);
        let (mine, other) = (end(is_sender), end(!is_sender));
        mine.attach();
        mine.attach();
        (mine, other)
    }

    /// In place: a program sends its buffer by reference, then receives into the same buffer
    /// while the slot has not left. The slot must still send what the buffer held before
    /// the receive wrote it (`guard` copies it into the slot first).
    #[test]
    fn a_write_over_memory_a_slot_still_refers_to_copies_it_first() {
        let n = 1000;
        let (mut send, view) = conn("oxccl-steps-test-send", true);
        send.proxy = Some(Arc::new(Holding(view)));
        let send = Arc::new(send);
        let (recv, peer) = conn("oxccl-steps-test-recv", false);
        let recv = Arc::new(recv);
        let call = [7, 9];
        // The peer's slot, already there.
        let (step, slot) = peer.send_slot().expect("a free slot");
        // SAFETY: a free slot of 4096 bytes, ours until posted.
        unsafe { std::ptr::write_bytes(slot, 0xbb, n) };
        peer.post_send(step, call, n);
        let mut buf = vec![0xaau8; n];
        let at = Addr::User(buf.as_mut_ptr() as usize);
        let step = |prim, recv: Option<&Arc<Conn>>, send: Option<&Arc<Conn>>| crate::plan::Step {
            prim,
            recv: recv.cloned(),
            send: send.cloned(),
            src: at,
            dst: at,
            len: n,
            prep: false,
        };
        let prog: HostProgram = Program {
            steps: vec![
                step(Prim::Send, None, Some(&send)),
                step(Prim::Recv, Some(&recv), None),
            ],
            esize: 1,
            slice: 4096,
            niter: 1,
            red: None,
            call,
        };
        let mut cur = Cursor::new(&prog, None);
        assert_eq!(cur.by_ref, 1, "the send goes by reference");
        assert_eq!(poll_program(&prog, &mut cur).unwrap(), Poll::Done);
        drop(cur);
        assert!(buf.iter().all(|&b| b == 0xbb), "the receive landed");
        let (data, bytes) = send.slot_data(0);
        assert_eq!(data, send.slot(0) as *const u8, "the slot holds its bytes");
        // SAFETY: the slot's `bytes` bytes, posted and not freed (the head never moved).
        let sent = unsafe { std::slice::from_raw_parts(data, bytes) };
        assert!(
            bytes == n && sent.iter().all(|&b| b == 0xaa),
            "the slot sends what the buffer held before the receive"
        );
    }
}
