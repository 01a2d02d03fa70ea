//! Receiving from another host straight into the caller's memory: a program names, ahead of
//! time, where the bytes of each slot it will take from a network connection are to go
//! (`Conn::post_recv_ref`), and the proxy reads them there instead of into the slot, which
//! spares the executor the copy out of it. Only for steps that copy what they receive to the
//! output as it is (`Recv`, `RecvCopySend`), and only where no other step of the program reads
//! or writes that output: the bytes may land at any time after the name is posted.
//!
//! The slots a program takes from a connection are its steps on it, iteration after
//! iteration, in order; the first it takes says which slot number that order starts at. When
//! it takes slot s it names the place for slot s + nsteps, which the end cannot start reading
//! before slot s is free again. A program that ends before it took every slot it named (an
//! error) has the names revoked: what was read into its memory moves into the slots.

use super::steps::{at, HostProgram};
use crate::plan::Prim;
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
    /// The slot number of the program's first slot on the connection, once taken.
    base: Option<u64>,
    /// Slots taken so far, and named (or passed over) so far.
    taken: u64,
    named: u64,
    /// The next slice to name: iteration and index in `steps`.
    next: (usize, usize),
}

impl RecvRefs {
    pub(super) fn new(prog: &HostProgram) -> RecvRefs {
        let steps = &prog.steps;
        if steps.len() > 64
            || !steps
                .iter()
                .any(|s| s.recv.as_ref().is_some_and(|c| c.receives_by_reference()))
        {
            return RecvRefs::default();
        }
        let es = prog.esize;
        // Every buffer region of the program, by step.
        let regions: Vec<_> = steps
            .iter()
            .enumerate()
            .flat_map(|(k, s)| [(k, at(s.src), s.len * es), (k, at(s.dst), s.len * es)])
            .filter(|&(_, a, n)| a != 0 && n > 0)
            .collect();
        let alone = |k: usize| {
            let (a, n) = (at(steps[k].dst), steps[k].len * es);
            a != 0
                && n > 0
                && regions
                    .iter()
                    .filter(|&&(j, b, _)| !(j == k && b == a))
                    .all(|&(_, b, m)| a + n <= b || b + m <= a)
        };
        let mut plans: Vec<Plan> = Vec::new();
        for (k, s) in steps.iter().enumerate() {
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
                        base: None,
                        taken: 0,
                        named: 0,
                        next: (0, 0),
                    });
                    plans.len() - 1
                }
            };
            plans[i].steps.push(k);
            if matches!(s.prim, Prim::Recv | Prim::RecvCopySend) && alone(k) {
                plans[i].eligible |= 1 << k;
            }
        }
        plans.retain(|p| p.eligible != 0);
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
        let base = *p.base.get_or_insert(step - p.taken);
        p.taken += 1;
        let c = &p.conn;
        while p.named < p.taken + c.nsteps {
            let Some((j, off, n)) = advance(&mut p.next, &p.steps, prog) else {
                break;
            };
            // The slot just taken was read already: named from the next one on.
            if p.named >= p.taken && (p.eligible >> j) & 1 == 1 {
                let es = prog.esize;
                let dst = (at(prog.steps[j].dst) + off * es) as *mut u8;
                c.post_recv_ref(base + p.named, prog.call, dst, n * es);
            }
            p.named += 1;
        }
        (p.eligible >> k) & 1 == 1 && c.delivered(step)
    }

    /// Revokes what was named and not taken (a program that ends early).
    pub(super) fn revoke(&mut self) {
        for p in &mut self.0 {
            if p.named > p.taken {
                p.conn.revoke_recv_refs();
                p.named = p.taken;
            }
        }
    }
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
