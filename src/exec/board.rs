//! Direct operations over the board, on the host: publish, wait for every rank to arrive, then
//! compute this rank's share straight between the peers' buffers, post done, and wait until every
//! rank is done (peers write into our output). Falls back to the op's ring program when some
//! peer buffer cannot be reached.

use super::copy::copy_out;
use super::steps::{poll_program, Cursor, Poll};
use crate::error::{Error, Result};
use crate::plan::board::{BoardKind, BoardOp};
use crate::plan::segment;
use crate::reduce::Reducer;
use crate::types::{Reduction, Scalar};

/// Bytes reduced at a time: small enough to stay in cache between the reduction and the copies.
const SLICE_BYTES: usize = 64 << 10;

enum Phase {
    Publish,
    Arrive,
    Fallback(Cursor),
    Done,
    /// An eager operation, complete: no done barrier.
    Finished,
}

pub(super) struct BoardState {
    phase: Phase,
}

impl BoardState {
    pub(super) fn new(_op: &BoardOp) -> BoardState {
        BoardState {
            phase: Phase::Publish,
        }
    }

    pub(super) fn describe_wait(&self, op: &BoardOp) -> String {
        let (what, test): (&str, &dyn Fn(usize) -> bool) = match self.phase {
            Phase::Done => ("finish", &|p| op.board.is_done(p, op.seq)),
            _ => ("arrive", &|p| op.board.arrived(p, op.seq)),
        };
        let late: Vec<String> = (0..op.nranks)
            .filter(|&p| !test(p))
            .map(|p| p.to_string())
            .collect();
        format!(
            "rank(s) {} to {what} direct operation #{}",
            late.join(","),
            op.seq
        )
    }

    pub(super) fn poll(&mut self, op: &BoardOp) -> Result<Poll> {
        let mut progressed = false;
        loop {
            match &mut self.phase {
                Phase::Publish if op.eager => {
                    if op.sends() {
                        let (sb, _) = op.extents();
                        // SAFETY: the send buffer holds `sb` bytes (validated at enqueue); the
                        // inline area holds INLINE >= sb (fits_inline) and is ours for `seq`.
                        unsafe {
                            copy_out(
                                op.board.inline_area(op.rank, op.seq),
                                op.send as *const u8,
                                sb,
                                false,
                            )
                        };
                    }
                    op.board.publish(
                        op.rank,
                        op.seq,
                        Default::default(),
                        Default::default(),
                        own_scalar(op),
                    );
                    self.phase = Phase::Arrive;
                    progressed = true;
                }
                Phase::Publish => {
                    let (sb, rb) = op.extents();
                    let send = crate::memory::describe(op.send, sb);
                    let recv = crate::memory::describe(op.recv, rb);
                    op.board
                        .publish(op.rank, op.seq, send, recv, own_scalar(op));
                    self.phase = Phase::Arrive;
                    progressed = true;
                }
                Phase::Arrive => {
                    if !(0..op.nranks).all(|p| op.board.arrived(p, op.seq)) {
                        return Ok(if progressed {
                            Poll::Progress
                        } else {
                            Poll::Blocked
                        });
                    }
                    if op.eager {
                        let src = |p: usize| op.board.inline_area(p, op.seq) as usize;
                        // SAFETY: every rank's inline area holds its input for `seq` until
                        // everyone has arrived at `seq + 1`, which needs this rank to finish.
                        unsafe { compute_eager(op, &src) };
                        self.phase = Phase::Finished;
                        return Ok(Poll::Done);
                    }
                    match resolve(op)? {
                        Some(peers) => {
                            compute(op, &peers);
                            op.board.post_done(op.rank, op.seq);
                            self.phase = Phase::Done;
                        }
                        None => self.phase = Phase::Fallback(Cursor::new(&op.fallback)),
                    }
                    progressed = true;
                }
                Phase::Fallback(c) => match poll_program(&op.fallback, c) {
                    Poll::Done => {
                        op.board.post_done(op.rank, op.seq);
                        self.phase = Phase::Done;
                        progressed = true;
                    }
                    p => return Ok(p),
                },
                Phase::Finished => return Ok(Poll::Done),
                Phase::Done => {
                    return Ok(if (0..op.nranks).all(|p| op.board.is_done(p, op.seq)) {
                        Poll::Done
                    } else if progressed {
                        Poll::Progress
                    } else {
                        Poll::Blocked
                    });
                }
            }
        }
    }
}

/// Every rank's inputs are scaled by that rank's own PreMulSum scalar: this rank's, to publish.
fn own_scalar(op: &BoardOp) -> u64 {
    op.red
        .and_then(|r| r.resolve().premul)
        .map_or(0, |s| s.bits)
}

/// The reducers of an operation: one per rank when each brings its own PreMulSum scalar (read
/// from the board), else one for all; empty for operations that do not reduce.
fn reducers(op: &BoardOp) -> Vec<Reducer> {
    match op.red.map(|s| s.resolve()) {
        None => Vec::new(),
        Some(r) if r.premul.is_some() => (0..op.nranks)
            .map(|p| {
                Reducer::new(Reduction {
                    premul: Some(Scalar {
                        bits: op.board.scalar(p, op.seq),
                    }),
                    ..r
                })
            })
            .collect(),
        Some(r) => vec![Reducer::new(r)],
    }
}

/// This rank's output of an eager operation, from every rank's input at `src(p)`.
///
/// # Safety
/// Each `src(p)` holds rank p's input (its send extent); the receive buffer is valid.
unsafe fn compute_eager(op: &BoardOp, src: &dyn Fn(usize) -> usize) {
    let (n, r, es, c) = (op.nranks, op.rank, op.dtype.size(), op.count);
    let reducers = reducers(op);
    let out = op.recv as *mut u8;
    // SAFETY: per the contract; the output never overlaps the board.
    unsafe {
        match op.kind {
            BoardKind::AllReduce => reduce_into(&reducers, n, src, 0, es, out, c),
            BoardKind::Reduce if r == op.root => reduce_into(&reducers, n, src, 0, es, out, c),
            BoardKind::Reduce => {}
            BoardKind::ReduceScatter => reduce_into(&reducers, n, src, r * c, es, out, c),
            BoardKind::AllGather => {
                for p in 0..n {
                    copy_out(out.add(p * c * es), src(p) as *const u8, c * es, false);
                }
            }
            BoardKind::Broadcast => copy_out(out, src(op.root) as *const u8, c * es, false),
        }
    }
}

/// Local addresses of every rank's (send, recv) buffers, or None when one this rank needs cannot
/// be reached. Every rank reaches the same verdict: it depends only on what all ranks published.
fn resolve(op: &BoardOp) -> Result<Option<Vec<(usize, usize)>>> {
    // Reachability first, from the published facts alone (identical on every rank).
    let mut infos = Vec::with_capacity(op.nranks);
    for p in 0..op.nranks {
        let (pid, s, r) = op.board.peer(p);
        infos.push((pid, s, r));
    }
    // A rank needs what its role needs; the verdict must not depend on the role, so check the
    // union of every rank's needs: all sends, and every recv that some rank writes.
    let writes_peer_recv = matches!(op.kind, BoardKind::AllReduce | BoardKind::Reduce);
    let all_ok = (0..op.nranks).all(|p| {
        let want_recv = writes_peer_recv && (op.kind == BoardKind::AllReduce || p == op.root);
        let want_send = op.kind != BoardKind::Broadcast || p == op.root;
        let (pid, s, r) = &infos[p];
        // Reachable from every process: same-process peers count only when all ranks share it.
        let from_all = |i: &crate::transport::board::BufInfo| {
            i.alloc_id != 0 || infos.iter().all(|(q, _, _)| q == pid)
        };
        (!want_send || from_all(s)) && (!want_recv || from_all(r))
    });
    if !all_ok {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(op.nranks);
    for (p, &(pid, s, r)) in infos.iter().enumerate().take(op.nranks) {
        if p == op.rank {
            out.push((op.send, op.recv));
            continue;
        }
        let (ws, wr) = op.needs(p);
        let sa = if ws {
            op.maps.resolve(pid, &s)?
        } else {
            Some(0)
        };
        let ra = if wr {
            op.maps.resolve(pid, &r)?
        } else {
            Some(0)
        };
        match (sa, ra) {
            (Some(sa), Some(ra)) => out.push((sa, ra)),
            _ => {
                return Err(Error::internal(format!(
                    "direct operation #{}: rank {p}'s buffer is unreachable after all",
                    op.seq
                )))
            }
        }
    }
    Ok(Some(out))
}

/// Reduces `elems` elements at element offset `at` of every rank's send buffer (`src(p)`) into
/// `acc`, then finishes them.
///
/// # Safety
/// Every `src(p) + at` range is valid for `elems` elements; `acc` holds them.
unsafe fn reduce_into(
    reducers: &[Reducer],
    n: usize,
    src: &dyn Fn(usize) -> usize,
    at: usize,
    es: usize,
    acc: *mut u8,
    elems: usize,
) {
    // With per-rank PreMulSum scalars, rank p's reducer applies p's scalar.
    let red = |p: usize| &reducers[p.min(reducers.len() - 1)];
    // SAFETY: per the contract; `acc` is a private scratch buffer.
    unsafe {
        red(0).prep(acc, (src(0) + at * es) as *const u8, elems);
        for p in 1..n {
            red(p).combine(acc, (src(p) + at * es) as *const u8, acc, elems);
        }
        red(0).finish(acc, acc, elems);
    }
}

fn compute(op: &BoardOp, peers: &[(usize, usize)]) {
    let (n, r, es, c) = (op.nranks, op.rank, op.dtype.size(), op.count);
    let send = |p: usize| peers[p].0;
    let recv = |p: usize| peers[p].1;
    let slice = (SLICE_BYTES / es).max(1);
    let reducers = reducers(op);
    // Streaming stores for large outputs, unless in place (see Program::stream_out).
    let nt = op.send != op.recv && op.extents().1 >= crate::param::stream_bytes();
    let mut scratch = vec![0u8; slice * es];
    let acc = scratch.as_mut_ptr();
    // SAFETY: every address comes from a rank's validated buffer (its own, mapped, or in this
    // process) and stays within the extents that rank published; only this rank writes the
    // ranges it owns (its segment or block) until everyone is done.
    unsafe {
        match op.kind {
            BoardKind::AllReduce | BoardKind::Reduce => {
                let (off, len) = segment(c, n, r);
                let mut o = 0;
                while o < len {
                    let m = slice.min(len - o);
                    reduce_into(&reducers, n, &send, off + o, es, acc, m);
                    if op.kind == BoardKind::AllReduce {
                        for p in 0..n {
                            copy_out((recv(p) + (off + o) * es) as *mut u8, acc, m * es, nt);
                        }
                    } else {
                        copy_out((recv(op.root) + (off + o) * es) as *mut u8, acc, m * es, nt);
                    }
                    o += m;
                }
            }
            BoardKind::ReduceScatter => {
                let mut o = 0;
                while o < c {
                    let m = slice.min(c - o);
                    reduce_into(&reducers, n, &send, r * c + o, es, acc, m);
                    copy_out((recv(r) + o * es) as *mut u8, acc, m * es, nt);
                    o += m;
                }
            }
            BoardKind::AllGather => {
                for p in 0..n {
                    copy_out(
                        (recv(r) + p * c * es) as *mut u8,
                        send(p) as *const u8,
                        c * es,
                        nt,
                    );
                }
            }
            BoardKind::Broadcast => {
                copy_out(recv(r) as *mut u8, send(op.root) as *const u8, c * es, nt);
            }
        }
    }
}
