//! Receiving from another host straight into the caller's memory: a program names, ahead of
//! time, where the bytes of each slot it will take from a network connection are to go
//! (`Conn::post_recv_ref`), and the proxy reads them there instead of into the slot, which
//! spares the executor the copy out of it. Only for steps that copy what they receive to the
//! output as it is (`Recv`, `RecvCopySend`), and only where no other step of the program writes
//! that output or reads it, since the bytes may land at any time after the name is posted,
//! with one exception: in place, a reduction's earlier steps read the same part of the buffer
//! as their input (`reads_first`).
//!
//! The slots a program takes from a connection are its steps on it, iteration after
//! iteration, in order, from the connection's head when the program starts (the programs
//! before it that used the connection are done then). It names the places of its first
//! `nsteps` slots at once, and when it takes slot s the place for slot s + nsteps, which the
//! end cannot start reading before slot s is free again. A slot taken that is not the one the
//! order says (someone else took slots meanwhile, which no plan does) has everything named
//! revoked, and nothing more is named on that connection for the program. A program that ends
//! before it took every slot it named (an error) has the names revoked too: what was read
//! into its memory moves into the slots.

use super::steps::{at, HostProgram};
use crate::plan::{Prim, Program, Step};
use crate::transport::Conn;
use std::sync::Arc;

/// A program's connections that receive by reference (usually none: then nothing is done).
#[derive(Default)]
pub(super) struct RecvRefs(Vec<Plan>);

/// One connection's slots, as the program takes them.
struct Plan {
    conn: Arc<Conn>,
    /// The program's steps that receive on the connection, in order.
    steps: Vec<usize>,
    /// Bit k: step k's slots may go to the caller's memory.
    eligible: u64,
    /// The slot number of the program's first slot on the connection.
    base: u64,
    /// Slots taken so far, and named (or passed over) so far.
    taken: u64,
    named: u64,
    /// The next slice to name, the `named`th: iteration and index in `steps` (None: no more
    /// naming, after a slot out of order).
    next: Option<(usize, usize)>,
}

impl RecvRefs {
    pub(super) fn new(prog: &HostProgram) -> RecvRefs {
        let eligible = eligible(prog, |c| c.receives_by_reference());
        if eligible == 0 {
            return RecvRefs::default();
        }
        let mut plans: Vec<Plan> = Vec::new();
        for (k, s) in prog.steps.iter().enumerate() {
            let Some(c) = s.recv.as_ref().filter(|c| c.receives_by_reference()) else {
                continue;
            };
            let i = match plans.iter().position(|p| Arc::ptr_eq(&p.conn, c)) {
                Some(i) => i,
                None => {
                    plans.push(Plan {
                        conn: c.clone(),
                        steps: Vec::new(),
                        eligible: 0,
                        base: c.head().load(std::sync::atomic::Ordering::Acquire),
                        taken: 0,
                        named: 0,
                        next: Some((0, 0)),
                    });
                    plans.len() - 1
                }
            };
            plans[i].steps.push(k);
            plans[i].eligible |= eligible & (1 << k);
        }
        plans.retain(|p| p.eligible != 0);
        for p in &mut plans {
            p.name_ahead(prog);
        }
        RecvRefs(plans)
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The program is taking slot `step` of `conn` for step `k` (before it frees it): names
    /// the places of the slots that follow, and says whether this one was read into the
    /// caller's memory.
    pub(super) fn taking(
        &mut self,
        prog: &HostProgram,
        conn: &Arc<Conn>,
        step: u64,
        k: usize,
    ) -> bool {
        let Some(p) = self.0.iter_mut().find(|p| Arc::ptr_eq(&p.conn, conn)) else {
            return false;
        };
        if p.next.is_some() && p.base + p.taken != step {
            // Not the slot named for this step (bytes of another may have landed in its
            // place): what was named goes back into the slots, and nothing more is named.
            p.unname();
            p.next = None;
        }
        p.taken += 1;
        p.name_ahead(prog);
        (p.eligible >> k) & 1 == 1 && p.conn.delivered(step)
    }

    /// Revokes what was named and not taken (a program that ends early).
    pub(super) fn revoke(&mut self) {
        for p in &mut self.0 {
            p.unname();
        }
    }
}

impl Plan {
    /// Names the places of the slots up to `nsteps` past the last one taken.
    fn name_ahead(&mut self, prog: &HostProgram) {
        let c = &self.conn;
        let Some(next) = self.next.as_mut() else {
            return;
        };
        let steps = &self.steps;
        while self.named < self.taken + c.nsteps {
            let Some((j, off, n)) = advance(next, steps, prog) else {
                break;
            };
            if (self.eligible >> j) & 1 == 1 {
                let es = prog.esize;
                let dst = (at(prog.steps[j].dst) + off * es) as *mut u8;
                c.post_recv_ref(self.base + self.named, prog.call, dst, n * es);
            }
            self.named += 1;
        }
    }

    /// Revokes what was named and not taken.
    #[cold]
    fn unname(&mut self) {
        if self.named > self.taken {
            self.conn.revoke_recv_refs();
            self.named = self.taken;
        }
    }
}

/// The steps whose slots may land in the caller's memory (bit k: step k; none past 64
/// steps): a `Recv` or `RecvCopySend` on a connection that takes that (`receives`), whose
/// output no other step of the program touches, but for `reads_first`.
pub(super) fn eligible<C>(prog: &Program<C>, receives: impl Fn(&C) -> bool) -> u64 {
    let steps = &prog.steps;
    let candidate = |s: &Step<C>| {
        matches!(s.prim, Prim::Recv | Prim::RecvCopySend) && s.recv.as_ref().is_some_and(&receives)
    };
    if steps.len() > 64 || !steps.iter().any(candidate) {
        return 0;
    }
    let es = prog.esize;
    // Every buffer region the program reads or writes: (step, start, bytes, written).
    let regions: Vec<_> = steps
        .iter()
        .enumerate()
        .flat_map(|(k, s)| {
            let len = s.len * es;
            [
                (
                    k,
                    if s.prim.reads_src() { at(s.src) } else { 0 },
                    len,
                    false,
                ),
                (k, at(s.dst), len, s.prim.writes_dst()),
            ]
        })
        .filter(|&(_, a, n, _)| a != 0 && n > 0)
        .collect();
    let alone = |k: usize| {
        let (a, n) = (at(steps[k].dst), steps[k].len * es);
        a != 0
            && n > 0
            && regions
                .iter()
                .filter(|&&(j, b, _, w)| !(j == k && b == a && w))
                .all(|&(j, b, m, w)| {
                    a + n <= b || b + m <= a || reads_first(prog, (j, b, w), (k, a))
                })
    };
    (0..steps.len())
        .filter(|&k| candidate(&steps[k]) && alone(k))
        .fold(0, |m, k| m | 1 << k)
}

/// Whether step `j`'s region at `b` (written by it: `w`) may overlap step `k`'s output at `a`,
/// which the proxy writes as the bytes arrive: where step `j` sends this rank's share of a
/// reduction from its part of the region (a `Send` or `RecvReduceSend` of its input) before
/// step `k` in each iteration (`j < k`, both regions at the same address, so slice i of one is
/// slice i of the other), and what arrives for step `k` is the reduction of that part. The
/// result cannot arrive before every rank's share went, this rank's included: when the bytes
/// land, step `j` has read the slice (into a slot, or into the socket for a slot sent by
/// reference). That is in-place all-reduce: the ring's or tree's steps that send this rank's
/// input come before those that receive the result into the same buffer.
fn reads_first<C>(
    prog: &Program<C>,
    (j, b, w): (usize, usize, bool),
    (k, a): (usize, usize),
) -> bool {
    prog.red.is_some()
        && matches!(prog.steps[j].prim, Prim::Send | Prim::RecvReduceSend)
        && !w
        && j < k
        && b == a
}

/// The next slice of `steps` from `next` (iteration, index in `steps`) that takes a slot, in
/// program order: (step, element offset, elements).
fn advance(
    next: &mut (usize, usize),
    steps: &[usize],
    prog: &HostProgram,
) -> Option<(usize, usize, usize)> {
    loop {
        let (i, x) = *next;
        if i >= prog.niter {
            return None;
        }
        *next = if x + 1 < steps.len() {
            (i, x + 1)
        } else {
            (i + 1, 0)
        };
        let k = steps[x];
        let (off, n) = prog.slice_of(k, i);
        if n > 0 {
            return Some((k, off, n));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::steps::{poll_program, Cursor, Poll};
    use super::*;
    use crate::error::Result;
    use crate::plan::{Addr, Program, RedSpec, Step};
    use crate::transport::{inproc, region_bytes, Proxy, Region};
    use crate::types::{DataType, ReduceKind, Reduction};
    use parking_lot::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const NSTEPS: usize = 4;
    const SLICE: usize = 1024;

    /// A place named: slot, call words, address, bytes.
    type Named = (u64, [u64; 2], usize, usize);

    /// A receiving end whose wire is the test: it records the places named (the test delivers
    /// slots there) and the revokes, which move what was delivered and not taken into the
    /// slots (`view`: the same connection) and forget the names.
    struct Naming {
        view: Conn,
        named: Mutex<Vec<Named>>,
        /// Every place ever named.
        all: Mutex<Vec<Named>>,
        revokes: AtomicUsize,
    }

    impl Proxy for Naming {
        fn progress(&self) -> Result<bool> {
            Ok(false)
        }
        fn recv_by_reference(&self) -> bool {
            true
        }
        fn post_recv_ref(&self, step: u64, call: [u64; 2], dst: *mut u8, bytes: usize) {
            let named = (step, call, dst as usize, bytes);
            self.named.lock().retain(|x| x.0 != step);
            self.named.lock().push(named);
            self.all.lock().push(named);
        }
        fn revoke_recv_refs(&self) {
            self.revokes.fetch_add(1, Ordering::Relaxed);
            self.view.settle_refs_held();
            self.named.lock().clear();
        }
    }

    /// A receiving end (and its proxy) or a sending end, in a region of its own.
    fn conn(name: &str, is_sender: bool) -> (Arc<Conn>, Arc<Naming>) {
        let region = inproc::open(name, region_bytes(NSTEPS, 4096)).expect("a region");
        inproc::forget(name);
        let end = || {
            Conn::new(
                Region::Heap(region.clone()),
                NSTEPS,
                4096,
                (0, 1),
                is_sender,
            )
        };
        let mut c = end();
        c.attach();
        c.attach();
        let naming = Arc::new(Naming {
            view: end(),
            named: Mutex::default(),
            all: Mutex::default(),
            revokes: AtomicUsize::new(0),
        });
        if !is_sender {
            c.proxy = Some(naming.clone());
        }
        (Arc::new(c), naming)
    }

    fn step(prim: Prim, src: usize, dst: usize, len: usize) -> Step<Arc<Conn>> {
        Step {
            prim,
            recv: None,
            send: None,
            src: if src == 0 {
                Addr::None
            } else {
                Addr::User(src)
            },
            dst: if dst == 0 {
                Addr::None
            } else {
                Addr::User(dst)
            },
            len,
            prep: false,
        }
    }

    fn program(steps: Vec<Step<Arc<Conn>>>, red: bool) -> HostProgram {
        let len = steps.iter().map(|s| s.len).max().unwrap_or(0);
        Program {
            steps,
            esize: 1,
            slice: SLICE,
            niter: len.div_ceil(SLICE),
            red: red.then_some(RedSpec::Ready(Reduction {
                dtype: DataType::Uint8,
                kind: ReduceKind::Sum,
                premul: None,
                postdiv: None,
            })),
            call: [3, 4],
        }
    }

    fn pattern(s: u64, i: usize) -> u8 {
        (s as u8).wrapping_mul(29) ^ i as u8
    }

    /// A receive of 10.3 slices: each slot is named, once, `NSTEPS` slots ahead (the first
    /// ones when the program starts), for its place in the output; the slots the test then
    /// delivers there are taken without a copy, the others copied; the output is right either
    /// way. With `stop`, the program is dropped after that many slots and revokes what it
    /// named. With `stolen`, the test takes the first slot itself (as if another program had),
    /// so the program's first slot is the second: it revokes and names nothing more.
    /// Returns every place named (slot, offset in the output, bytes), the revokes, whether the
    /// output is right, and how many slots were delivered.
    fn receive(stop: Option<u64>, stolen: bool) -> (Vec<(u64, usize, usize)>, usize, bool, u64) {
        let n = 10 * SLICE + 300;
        let (recv, naming) = conn(&format!("oxccl-recv-ref-{stop:?}-{stolen}"), false);
        let mut buf = vec![0u8; n];
        let base = buf.as_mut_ptr() as usize;
        let mut s = step(Prim::Recv, 0, base, n);
        s.recv = Some(recv.clone());
        let prog = program(vec![s], false);
        let mut cur = Cursor::new(&prog, None);
        let shift = u64::from(stolen);
        let total = n.div_ceil(SLICE) as u64 + shift;
        let (mut sent, mut delivered) = (0u64, 0);
        loop {
            if stop.is_some_and(|k| recv.head().load(Ordering::Acquire) >= k) {
                drop(cur);
                break;
            }
            if stolen && sent == 1 && recv.head().load(Ordering::Acquire) == 0 {
                recv.post_recv(recv.recv_slot().expect("slot 0").0);
            } else if poll_program(&prog, &mut cur).unwrap() == Poll::Done {
                drop(cur);
                break;
            }
            // The peer: the next slot, where it was named or into the slot.
            if sent < total && sent < recv.head().load(Ordering::Acquire) + NSTEPS as u64 {
                let e = sent.saturating_sub(shift) as usize;
                let bytes = (n - e * SLICE).min(SLICE);
                let named = naming.named.lock().iter().find(|x| x.0 == sent).copied();
                let at = match named {
                    Some((_, call, dst, b)) => {
                        assert_eq!((call, b), ([3, 4], bytes), "slot {sent}");
                        delivered += 1;
                        dst as *mut u8
                    }
                    None => recv.slot(sent),
                };
                for i in 0..bytes {
                    // SAFETY: the named place or the free slot holds `bytes` bytes.
                    unsafe { at.add(i).write(pattern(sent, i)) };
                }
                recv.arrived(sent, [3, 4], bytes, named.map(|x| x.2 as *const u8));
                sent += 1;
            }
        }
        let right = stop.is_some()
            || (0..n).all(|i| buf[i] == pattern((i / SLICE) as u64 + shift, i % SLICE));
        let named = naming
            .all
            .lock()
            .iter()
            .map(|&(s, _, dst, b)| (s, dst - base, b))
            .collect();
        (
            named,
            naming.revokes.load(Ordering::Relaxed),
            right,
            delivered,
        )
    }

    /// The place of slot `s` of the receive above: (slot, offset, bytes).
    fn place(s: u64) -> (u64, usize, usize) {
        let e = s as usize;
        (s, e * SLICE, if e == 10 { 300 } else { SLICE })
    }

    #[test]
    fn slots_are_named_ahead_and_taken_without_a_copy() {
        let (named, revokes, right, delivered) = receive(None, false);
        assert!(right, "the output is wrong");
        assert_eq!(revokes, 0, "a program that took every slot revokes nothing");
        assert_eq!(named, (0..11).map(place).collect::<Vec<_>>());
        assert_eq!(delivered, 11);
    }

    #[test]
    fn a_program_that_ends_early_revokes_what_it_named() {
        let (named, revokes, ..) = receive(Some(3), false);
        assert_eq!(revokes, 1);
        assert_eq!(named.last().map(|x| x.0), Some(2 + NSTEPS as u64));
    }

    /// Slot 0, named for the program's first slice, goes elsewhere; slot 1, delivered to the
    /// place of the second, comes back into its slot at the revoke and is copied into the
    /// first; nothing is named after that.
    #[test]
    fn a_slot_taken_out_of_order_revokes_and_names_no_more() {
        let (named, revokes, right, delivered) = receive(None, true);
        assert!(right, "the output is wrong");
        assert_eq!(revokes, 1);
        let first: Vec<_> = (0..NSTEPS as u64).map(place).collect();
        assert_eq!(named, first);
        assert_eq!(delivered, 2, "slots 0 and 1, to the first places");
    }

    /// Which steps' slots may land in the output: not where another step writes it, nor where
    /// another reads it, except a reduction's earlier steps reading their input in place.
    #[test]
    fn only_outputs_nothing_else_touches_are_named() {
        let (recv, _) = conn("oxccl-recv-ref-eligible-r", false);
        let (send, _) = conn("oxccl-recv-ref-eligible-s", true);
        let (a, b) = (0x10_0000usize, 0x20_0000usize);
        let on = |mut s: Step<Arc<Conn>>, r: bool, t: bool| {
            s.recv = r.then(|| recv.clone());
            s.send = t.then(|| send.clone());
            s
        };
        let bits = |steps: Vec<Step<Arc<Conn>>>, red: bool| {
            RecvRefs::new(&program(steps, red))
                .0
                .first()
                .map_or(0, |p| p.eligible)
        };
        let n = 4 * SLICE;
        // Two ranks' ring all-reduce out of place, then in place.
        let ring = |src: usize| {
            vec![
                on(step(Prim::Send, src + n, 0, n), false, true),
                on(step(Prim::RecvReduceCopySend, src, b, n), true, true),
                on(step(Prim::Recv, 0, b + n, n), true, false),
            ]
        };
        assert_eq!(bits(ring(a), true), 0b100);
        assert_eq!(bits(ring(b), true), 0b100);
        // In place without a reduction: the send's input is not read before the bytes land.
        assert_eq!(bits(ring(b), false), 0);
        // Written by an earlier step, or read by a later one: not named.
        let copy_first = vec![
            step(Prim::LocalCopy, a, b, n),
            on(step(Prim::Recv, 0, b, n), true, false),
        ];
        assert_eq!(bits(copy_first, true), 0);
        let read_after = vec![
            on(step(Prim::Recv, 0, b, n), true, false),
            on(step(Prim::Send, b, 0, n), false, true),
        ];
        assert_eq!(bits(read_after, true), 0);
        // In place, read first by a step that does not send this rank's share: not named.
        let copied_first = vec![
            step(Prim::LocalCopy, b, a, n),
            on(step(Prim::Recv, 0, b, n), true, false),
        ];
        assert_eq!(bits(copied_first, true), 0);
        // Overlapping another step's region only in part: not named.
        let shifted = vec![
            on(step(Prim::Send, b + 64, 0, n), false, true),
            on(step(Prim::Recv, 0, b, n), true, false),
        ];
        assert_eq!(bits(shifted, true), 0);
        // A receive and forward into its own place, a point-to-point receive: named.
        assert_eq!(
            bits(vec![on(step(Prim::Recv, 0, b, n), true, false)], false),
            1
        );
        let forward = vec![on(step(Prim::RecvCopySend, 0, b, n), true, true)];
        assert_eq!(bits(forward, false), 1);
    }

    /// The planner's all-reduces, as it builds them for every rank, with every receiving
    /// connection taking slots by reference: the flat ring (2 to 5 ranks, in and out of place)
    /// names its all-gather's steps, the last n - 1, and no other; in the hierarchical plan (4
    /// hosts x 2 ranks) the leaders' tree names the leaves' receive from their parent and
    /// nothing at the root or the inner node (which reduce into the buffer first), and the
    /// leaders' ring names its all-gather's steps.
    #[test]
    fn the_planners_all_reduces_name_what_only_the_result_writes() {
        use crate::plan::{hier, ring};
        use crate::transport::ConnKey;
        struct L(usize, usize, usize);
        impl ring::Links for L {
            fn rank(&self) -> usize {
                self.0
            }
            fn nranks(&self) -> usize {
                self.1
            }
            fn slot_bytes(&self) -> usize {
                4096
            }
            fn host(&self, r: usize) -> u64 {
                (r / self.2) as u64
            }
        }
        let red = RedSpec::Ready(Reduction {
            dtype: DataType::Float32,
            kind: ReduceKind::Sum,
            premul: None,
            postdiv: None,
        });
        let receives = |k: &ConnKey| !k.is_sender;
        let f32s = DataType::Float32;
        let (a, b) = (0x100_0000usize, 0x800_0000usize);
        for n in 2..=5 {
            let gather = ((1u64 << (2 * n - 1)) - 1) & !((1u64 << n) - 1);
            for r in 0..n {
                for (send, recv) in [(a, b), (b, b)] {
                    let p = ring::all_reduce(&L(r, n, 1), send, recv, 10_000, f32s, red).unwrap();
                    assert_eq!(p.steps.len(), 2 * n - 1);
                    let got = eligible(&p, receives);
                    assert_eq!(
                        got,
                        gather,
                        "ring of {n}, rank {r}, in place {}",
                        send == recv
                    );
                }
            }
        }
        for (count, tree) in [(256, true), (8 << 20, false)] {
            for r in (0..8).step_by(2) {
                let stages =
                    hier::all_reduce_hierarchical(&L(r, 8, 2), a, b, count, f32s, red).unwrap();
                let got: Vec<u64> = stages[1].iter().map(|p| eligible(p, receives)).collect();
                let want = match (tree, r / 2) {
                    (true, 0 | 1) => 0,
                    (true, _) => 0b10,
                    (false, _) => 0b111_0000,
                };
                assert_eq!(got, [want], "leader {r}, tree {tree}");
            }
        }
    }

    /// A sending end that takes slots by reference and never sends them; it counts settles.
    struct Sending {
        view: Conn,
        settles: AtomicUsize,
    }

    impl Proxy for Sending {
        fn progress(&self) -> Result<bool> {
            Ok(false)
        }
        fn by_reference(&self) -> bool {
            true
        }
        fn settle(&self) {
            self.settles.fetch_add(1, Ordering::Relaxed);
            self.view.settle_refs_held();
        }
    }

    /// A delivered `RecvCopySend` forwards from the output, by reference where the sending end
    /// takes that; the program's end settles the slot, which then holds the bytes itself.
    #[test]
    fn a_delivered_forward_goes_by_reference_and_is_settled() {
        let (recv, naming) = conn("oxccl-recv-ref-fwd-r", false);
        let name = "oxccl-recv-ref-fwd-s";
        let region = inproc::open(name, region_bytes(NSTEPS, 4096)).expect("a region");
        inproc::forget(name);
        let end = || Conn::new(Region::Heap(region.clone()), NSTEPS, 4096, (0, 1), true);
        let sending = Arc::new(Sending {
            view: end(),
            settles: AtomicUsize::new(0),
        });
        let mut send = end();
        send.attach();
        send.attach();
        send.proxy = Some(sending.clone());
        let send = Arc::new(send);
        let n = 700;
        let mut buf = vec![0u8; n];
        let at = buf.as_mut_ptr() as usize;
        let mut s = step(Prim::RecvCopySend, 0, at, n);
        s.recv = Some(recv.clone());
        s.send = Some(send.clone());
        let prog = program(vec![s], false);
        let mut cur = Cursor::new(&prog, None);
        // The peer: slot 0, where it was named.
        let named = naming.named.lock()[0];
        assert_eq!(named, (0, [3, 4], at, n));
        for i in 0..n {
            // SAFETY: the named place holds `n` bytes.
            unsafe { (at as *mut u8).add(i).write(pattern(0, i)) };
        }
        recv.arrived(0, [3, 4], n, Some(at as *const u8));
        assert_eq!(poll_program(&prog, &mut cur).unwrap(), Poll::Done);
        assert_eq!(
            sending.settles.load(Ordering::Relaxed),
            1,
            "sent by reference, settled"
        );
        let (data, bytes) = send.slot_data(0);
        assert_eq!(
            (data, bytes),
            (send.slot(0) as *const u8, n),
            "the slot holds its bytes"
        );
        // SAFETY: the posted slot's `n` bytes.
        let sent = unsafe { std::slice::from_raw_parts(data, n) };
        assert!((0..n).all(|i| sent[i] == pattern(0, i) && buf[i] == pattern(0, i)));
        assert_eq!(
            recv.head().load(Ordering::Acquire),
            1,
            "the received slot is free"
        );
    }
}
