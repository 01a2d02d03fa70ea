//! Direct operations over the board, on the host: publish, wait for every rank to arrive, then
//! compute this rank's share straight between the peers' buffers, post done, and wait until every
//! rank is done (peers write into our output). Falls back to the op's ring program when some
//! peer buffer cannot be reached.

use super::copy::{copy_out, copy_tiny};
use super::memory::PeerMaps;
use super::steps::{poll_program, Cursor, Poll};
use super::tune::{self, Tuner, CMA};
use crate::error::{Error, Result};
use crate::plan::board::{BoardKind, BoardOp};
use crate::plan::segment;
use crate::reduce::Reducer;
use crate::transport::board::{signature, Board, Call, LEFT, TINY};
use crate::transport::cma;
use crate::transport::Conn;
use crate::types::{Reduction, Scalar};
use std::sync::Arc;
use std::time::Instant;

/// Bytes reduced at a time: small enough to stay in cache between the reduction and the copies.
const SLICE_BYTES: usize = 64 << 10;

/// A planned direct operation with what the host executor runs it with: the communicator's board
/// (the operation's place on it is `seq`), the peers' buffers mapped into this process, the
/// tuner (cross-memory attach against the ring), and whether cross-memory attach reaches every
/// peer.
pub struct Direct {
    pub op: BoardOp<Arc<Conn>>,
    pub board: Arc<Board>,
    /// Peers' mapped allocations (None for eager operations, which read no peer's buffer).
    pub maps: Option<Arc<PeerMaps>>,
    /// Buffers of other processes that cannot be mapped are reached by cross-memory attach.
    pub cma: bool,
    /// Where to vote from and record into when cross-memory attach competes with the ring.
    pub tuner: Option<Arc<Tuner>>,
}

impl std::ops::Deref for Direct {
    type Target = BoardOp<Arc<Conn>>;
    fn deref(&self) -> &BoardOp<Arc<Conn>> {
        &self.op
    }
}

impl Direct {
    /// `op` numbered and equipped for `comm` (which must have a board).
    #[inline]
    pub fn new(comm: &super::HostComm, mut op: BoardOp<Arc<Conn>>) -> Option<Direct> {
        let (board, seq) = comm.board_op()?;
        op.seq = seq;
        let eager = op.eager();
        Some(Direct {
            op,
            board,
            maps: (!eager).then(|| comm.maps.clone()),
            cma: comm.cma,
            tuner: (!eager).then(|| comm.tuner.clone()),
        })
    }
}

enum Phase {
    Publish,
    Arrive,
    Fallback(Box<Cursor>),
    Done,
    /// An eager operation, complete: no done barrier.
    Finished,
}

pub(super) struct BoardState {
    phase: Phase,
    /// This rank's arrival word at an eager operation: every peer's must be the same.
    word: u64,
    /// When every rank had arrived, and the path the tuner chose (when it chose one).
    timed: Option<(Instant, usize)>,
}

impl BoardState {
    pub(super) fn new() -> BoardState {
        BoardState {
            phase: Phase::Publish,
            word: 0,
            timed: None,
        }
    }

    /// The connection the operation's ring fallback waits on, if it waits on one.
    pub(super) fn waits_on<'o>(&self, op: &'o Direct) -> Option<&'o Arc<Conn>> {
        match (&self.phase, op.fallback.as_deref()) {
            (Phase::Fallback(c), Some(prog)) => c.waits_on(prog),
            _ => None,
        }
    }

    /// What the operation waits for, as the end of a sentence ("waiting for ...").
    pub(super) fn describe_wait(&self, op: &Direct) -> String {
        if let (Phase::Fallback(c), Some(prog)) = (&self.phase, op.fallback.as_deref()) {
            let conn = c
                .describe_wait(prog)
                .unwrap_or_else(|| "its ring neighbours".into());
            return format!(
                "{conn} on the ring that direct operation #{} fell back on",
                op.seq
            );
        }
        let (what, test): (&str, &dyn Fn(usize) -> bool) = match self.phase {
            Phase::Done => ("finish", &|p| op.board.is_done(p, op.seq)),
            _ if op.eager() => ("arrive at", &|p| op.board.arrived_eager(p, op.seq)),
            _ => ("arrive at", &|p| op.board.arrived(p, op.seq)),
        };
        let late: Vec<String> = (0..op.nranks)
            .filter(|&p| !test(p))
            .map(|p| p.to_string())
            .collect();
        let who = match late.len() {
            0 => "its peers".to_string(),
            1 => format!("rank {}", late[0]),
            _ => format!("ranks {}", late.join(", ")),
        };
        format!("{who} to {what} direct operation #{}", op.seq)
    }

    /// This rank leaves the operation unfinished (it failed, timed out or was aborted): peers
    /// that have not started on its buffers are told so (they fail, see `left`), and the call
    /// returns only once those that have are done with them (`alive(p)`: whether rank p's
    /// process still runs; a dead holder touches nothing any more). The caller's buffers are
    /// then its own again.
    pub(super) fn leave(&mut self, op: &Direct, alive: &dyn Fn(usize) -> bool) {
        match self.phase {
            Phase::Publish | Phase::Finished => {}
            _ if op.eager() => {
                op.board.leave(op.rank, op.seq, true);
            }
            Phase::Arrive | Phase::Fallback(_) | Phase::Done => {
                if op.board.leave(op.rank, op.seq, false) > 0 {
                    // Holders are computing (nothing they do waits): a short wait.
                    let mut backoff = crate::health::Backoff::default();
                    while op.board.claimed(op.rank) > 0 {
                        let holders = || (0..op.nranks).filter(|&p| op.board.busy(p, op.seq));
                        if backoff.pause() && !holders().any(alive) {
                            break;
                        }
                    }
                }
            }
        }
        self.phase = Phase::Finished;
    }

    pub(super) fn poll(&mut self, op: &Direct) -> Result<Poll> {
        if op.eager() {
            self.poll_eager(op)
        } else {
            self.poll_direct(op)
        }
    }

    /// An eager operation (a small one's whole latency is made here): publish this rank's input
    /// on the board, then, once every rank has arrived, compute this rank's output.
    fn poll_eager(&mut self, op: &Direct) -> Result<Poll> {
        let sb = op.extents().0;
        let mut progressed = false;
        match self.phase {
            Phase::Publish => {
                if op.sends(op.rank) {
                    let (dst, src) = (
                        op.board.eager_area(op.rank, op.seq, sb),
                        op.send as *const u8,
                    );
                    // SAFETY: the send buffer holds `sb` bytes (validated at enqueue); the eager
                    // area holds at least `sb` (fits_inline) and is ours for `seq`.
                    unsafe {
                        if sb <= TINY {
                            copy_tiny(dst, src, sb)
                        } else {
                            copy_out(dst, src, sb, false)
                        }
                    };
                }
                self.word =
                    op.board
                        .publish_eager(op.rank, op.seq, premul_bits(op), call_words(op));
                self.phase = Phase::Arrive;
                progressed = true;
            }
            Phase::Finished => return Ok(Poll::Done),
            _ => {}
        }
        // One load per peer says whether it arrived, and with the same call (the signature
        // travels in the arrival word).
        for p in 0..op.nranks {
            let w = op.board.eager_word(p, op.seq);
            if w == self.word {
                continue;
            }
            if Board::reached(w, op.seq) {
                // The same call, left unfinished; or another call.
                return Err(if w & !LEFT == self.word {
                    left(op, p)
                } else {
                    mismatch(op, p)
                });
            }
            // A peer at this operation with a direct one called something else.
            other_kind_arrived(op, false)?;
            // A peer that ended its communicator never arrives (looked at again after `ended`).
            peer_ended(
                op,
                |q| q == p && !Board::reached(op.board.eager_word(p, op.seq), op.seq),
                "arrive",
            )?;
            return Ok(if progressed {
                Poll::Progress
            } else {
                Poll::Blocked
            });
        }
        let src = |p: usize| op.board.eager_area(p, op.seq, sb) as usize;
        // SAFETY: every rank's eager area holds its input for `seq` until everyone has arrived
        // at `seq + 1`, which needs this rank to finish.
        unsafe { compute_eager(op, &src)? };
        self.phase = Phase::Finished;
        Ok(Poll::Done)
    }

    /// A direct operation on peers' buffers, or its ring fallback.
    #[inline(never)]
    fn poll_direct(&mut self, op: &Direct) -> Result<Poll> {
        let mut progressed = false;
        loop {
            match &mut self.phase {
                Phase::Publish => {
                    let (sb, rb) = op.extents();
                    let send = super::memory::describe(op.send, sb);
                    let recv = super::memory::describe(op.recv, rb);
                    let vote = op
                        .tuner
                        .as_ref()
                        .map_or(0.0, |t| t.cma.get(op.bytes()).vote());
                    op.board.publish(
                        op.rank,
                        op.seq,
                        (send, recv),
                        premul_bits(op).unwrap_or(0),
                        vote,
                        call_words(op),
                    );
                    self.phase = Phase::Arrive;
                    progressed = true;
                }
                Phase::Arrive => {
                    if !(0..op.nranks).all(|p| op.board.arrived(p, op.seq)) {
                        other_kind_arrived(op, true)?;
                        let sig = signature(call_words(op));
                        peer_left(op, |p| op.board.arrived(p, op.seq) && same_call(op, p, sig))?;
                        peer_ended(op, |p| !op.board.arrived(p, op.seq), "arrive")?;
                        return Ok(if progressed {
                            Poll::Progress
                        } else {
                            Poll::Blocked
                        });
                    }
                    // Before anything is read or written: every rank called the same, and is
                    // still there.
                    same_calls(op)?;
                    peer_left(op, |_| true)?;
                    let (peers, path) = resolve(op)?;
                    // Timed from when all have arrived: a late peer is not the path's fault.
                    self.timed = path.map(|p| (Instant::now(), p));
                    match peers {
                        Some(peers) => {
                            claimed(op, || compute(op, &peers))?;
                            op.board.post_done(op.rank, op.seq);
                            self.phase = Phase::Done;
                        }
                        None => {
                            let prog = op.fallback.as_ref().ok_or_else(|| {
                                Error::internal("an eager operation has no ring to fall back on")
                            })?;
                            // Never exploring on the operations the verdict explores on.
                            let round = op.seq + tune::FIFO_ROUND_OFFSET;
                            let fifo = op.tuner.as_deref().map(|t| (&t.fifo, round));
                            self.phase = Phase::Fallback(Box::new(Cursor::new(prog, fifo)))
                        }
                    }
                    progressed = true;
                }
                Phase::Fallback(c) => {
                    let prog = op
                        .fallback
                        .as_ref()
                        .expect("a fallback phase has its program");
                    match poll_program(prog, c)? {
                        Poll::Done => {
                            if let Some(t) = &op.tuner {
                                c.finish(prog, &t.fifo);
                            }
                            // A ring that tried its worse FIFO option says little about the
                            // ring against cross-memory attach.
                            if c.exploring() {
                                self.timed = None;
                            }
                            op.board.post_done(op.rank, op.seq);
                            self.phase = Phase::Done;
                            progressed = true;
                        }
                        p => return Ok(p),
                    }
                }
                Phase::Finished => return Ok(Poll::Done),
                Phase::Done => {
                    let done = (0..op.nranks).all(|p| op.board.is_done(p, op.seq));
                    if !done {
                        // A peer that left, or ended its communicator, will never be done.
                        peer_left(op, |p| !op.board.is_done(p, op.seq))?;
                        peer_ended(op, |p| !op.board.is_done(p, op.seq), "finish")?;
                    }
                    return Ok(if done {
                        if let (Some((t0, path)), Some(t)) = (self.timed, &op.tuner) {
                            t.cma.get(op.bytes()).record(path, op.bytes(), t0.elapsed());
                        }
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

/// The call as the board describes it (see `plan::call`).
#[inline]
fn call_words(op: &Direct) -> Call {
    crate::plan::call::of_coll(op.kind.coll(), op.count, op.dtype, op.red, op.root)
}

/// The error of ranks that called different collectives at one operation.
#[cold]
#[inline(never)]
fn mismatch(op: &Direct, peer: usize) -> Error {
    Error::invalid_usage(format!(
        "direct operation #{}: rank {} called {}, rank {peer} called {}: every rank must call a \
         collective with the same count, datatype, reduction and root; nothing was written, and \
         the communicator can now only be destroyed or aborted",
        op.seq,
        op.rank,
        crate::plan::call::describe(call_words(op)),
        crate::plan::call::describe(op.board.call_of(peer, op.seq))
    ))
}

/// Every rank has arrived at a direct operation: an error if one called something else (by
/// the signatures in the arrival words, already read: the calls themselves are read only to
/// say how they differ).
fn same_calls(op: &Direct) -> Result<()> {
    let sig = signature(call_words(op));
    match (0..op.nranks).find(|&p| p != op.rank && !same_call(op, p, sig)) {
        Some(p) => Err(mismatch(op, p)),
        None => Ok(()),
    }
}

/// Runs `work` on the peers' buffers under a claim on each (see `Board::claim`): an error,
/// with nothing touched, if a peer has left the operation.
fn claimed(op: &Direct, work: impl FnOnce() -> Result<()>) -> Result<()> {
    let (b, seq, me) = (&op.board, op.seq, op.rank);
    b.set_busy(me, Some(seq));
    let peers = || (0..op.nranks).filter(|&p| p != me);
    let r = match peers().find(|&p| !b.claim(p, seq)) {
        Some(gone) => {
            peers()
                .take_while(|&p| p != gone)
                .for_each(|p| b.release(p));
            Err(left(op, gone))
        }
        None => {
            let r = work();
            peers().for_each(|p| b.release(p));
            r
        }
    };
    b.set_busy(me, None);
    r
}

/// A peer left the operation (see `BoardState::leave`).
#[cold]
fn left(op: &Direct, peer: usize) -> Error {
    Error::remote(format!(
        "direct operation #{} on rank {}: rank {peer} left it unfinished (it failed, timed out or \
         was aborted); nothing was read from or written to rank {peer}'s buffers",
        op.seq, op.rank
    ))
}

/// An error if a peer that this rank still waits for (`which`, looked at after `Board::ended`)
/// has ended its communicator: it will never come. (Out of line: only blocked polls call it.)
#[inline(never)]
fn peer_ended(op: &Direct, which: impl Fn(usize) -> bool, waiting: &str) -> Result<()> {
    match (0..op.nranks).find(|&p| p != op.rank && op.board.ended(p) && which(p)) {
        Some(p) => Err(ended(op, p, waiting)),
        None => Ok(()),
    }
}

#[cold]
fn ended(op: &Direct, peer: usize, waiting: &str) -> Error {
    Error::remote(format!(
        "direct operation #{} on rank {}: rank {peer} ended its communicator (ncclCommDestroy \
         or ncclCommAbort) while this rank waited for it to {waiting}",
        op.seq, op.rank
    ))
}

/// An error if a peer (of those `which` selects) has left the operation.
#[inline]
fn peer_left(op: &Direct, which: impl Fn(usize) -> bool) -> Result<()> {
    let eager = op.eager();
    match (0..op.nranks).find(|&p| p != op.rank && which(p) && op.board.left(p, op.seq, eager)) {
        Some(p) => Err(left(op, p)),
        None => Ok(()),
    }
}

/// Whether `peer` arrived at this direct operation with the call of signature `sig` (this
/// rank's).
fn same_call(op: &Direct, peer: usize, sig: u64) -> bool {
    op.board.signature_of(peer, op.seq, false) == Some(sig)
}

/// While waiting for peers: an error if one arrived at this operation with the other kind
/// (eager where this rank is direct, or the other way round: their counts differ).
#[cold]
fn other_kind_arrived(op: &Direct, eager: bool) -> Result<()> {
    for p in (0..op.nranks).filter(|&p| p != op.rank) {
        if op.board.signature_of(p, op.seq, eager).is_some() {
            return Err(mismatch(op, p));
        }
    }
    Ok(())
}

/// Every rank's inputs are scaled by that rank's own PreMulSum scalar: this rank's, to publish
/// (None when the operation has none).
fn premul_bits(op: &Direct) -> Option<u64> {
    op.red
        .and_then(|r| super::resolve(&r).premul)
        .map(|s| s.bits)
}

/// The reducers of an operation: one per rank when each brings its own PreMulSum scalar (read
/// from the board), else one for all (no allocation: small operations make many of these);
/// none for operations that do not reduce. Seen as a slice.
enum Reducers {
    None,
    Plain(&'static Reducer),
    One(Reducer),
    PerRank(Vec<Reducer>),
}

impl std::ops::Deref for Reducers {
    type Target = [Reducer];
    fn deref(&self) -> &[Reducer] {
        match self {
            Reducers::None => &[],
            Reducers::Plain(r) => std::slice::from_ref(*r),
            Reducers::One(r) => std::slice::from_ref(r),
            Reducers::PerRank(v) => v,
        }
    }
}

fn reducers(op: &Direct) -> Reducers {
    match op.red.map(|s| super::resolve(&s)) {
        None => Reducers::None,
        Some(r) if r.premul.is_some() => Reducers::PerRank(
            (0..op.nranks)
                .map(|p| {
                    Reducer::new(Reduction {
                        premul: Some(Scalar {
                            bits: op.board.scalar(p, op.seq),
                        }),
                        ..r
                    })
                })
                .collect(),
        ),
        Some(r) => match Reducer::plain(&r) {
            Some(p) => Reducers::Plain(p),
            None => Reducers::One(Reducer::cached(r)),
        },
    }
}

/// This rank's output of an eager operation, from every rank's input at `src(p)`.
///
/// # Safety
/// Each `src(p)` holds rank p's input (its send extent); the receive buffer is valid.
unsafe fn compute_eager(op: &Direct, src: &dyn Fn(usize) -> usize) -> Result<()> {
    let (n, r, es, c) = (op.nranks, op.rank, op.dtype.size(), op.count);
    let reducers = reducers(op);
    let out = op.recv as *mut u8;
    let from =
        |p: usize, first: usize| -> Result<*const u8> { Ok((src(p) + first * es) as *const u8) };
    // SAFETY: per the contract; the output never overlaps the board.
    unsafe {
        match op.kind {
            BoardKind::AllReduce => reduce_into(&reducers, n, &mut |p| from(p, 0), out, c)?,
            BoardKind::Reduce if r == op.root => {
                reduce_into(&reducers, n, &mut |p| from(p, 0), out, c)?
            }
            BoardKind::Reduce => {}
            BoardKind::ReduceScatter => reduce_into(&reducers, n, &mut |p| from(p, r * c), out, c)?,
            BoardKind::AllGather => {
                for p in 0..n {
                    copy_out(out.add(p * c * es), src(p) as *const u8, c * es, false);
                }
            }
            BoardKind::Broadcast => copy_out(out, src(op.root) as *const u8, c * es, false),
        }
    }
    Ok(())
}

/// Where a rank's buffer is, seen from this process.
#[derive(Clone, Copy, Debug)]
enum Loc {
    /// Addressable here: this process's memory, or a peer's `ncclMemAlloc` buffer mapped in.
    Here(usize),
    /// In another process, reached by cross-memory attach.
    Remote { pid: u32, addr: usize },
}

/// Every rank's (send, recv) buffers.
type Peers = Vec<(Loc, Loc)>;

/// Where every rank's (send, recv) buffers are, or None when one that some rank needs cannot be
/// reached (or the tuner chose the ring), with the path the tuner chose when it chose one. Every
/// rank reaches the same verdict: it depends only on what all ranks published and on the
/// communicator's cross-memory-attach verdict, agreed at init.
fn resolve(op: &Direct) -> Result<(Option<Peers>, Option<usize>)> {
    // Reachability first, from the published facts alone (identical on every rank).
    let mut infos = Vec::with_capacity(op.nranks);
    for p in 0..op.nranks {
        let (pid, s, r) = op.board.peer(p);
        infos.push((pid, s, r));
    }
    // A rank needs what its role needs; the verdict must not depend on the role, so check the
    // union of every rank's needs: all sends, and every recv that some rank writes.
    let writes_peer_recv = matches!(op.kind, BoardKind::AllReduce | BoardKind::Reduce);
    let one_ns = infos.iter().all(|(q, _, _)| q >> 32 == infos[0].0 >> 32);
    let reachable = |cma: bool| {
        (0..op.nranks).all(|p| {
            let want_recv = writes_peer_recv && (op.kind == BoardKind::AllReduce || p == op.root);
            let want_send = op.sends(p);
            let (key, s, r) = &infos[p];
            // Reachable from every process: same-process peers count only when all ranks share
            // it, `ncclMemAlloc` buffers only when all ranks share a PID namespace (they are
            // opened through /proc/<pid>).
            let from_all = |i: &crate::transport::board::BufInfo| {
                cma || (i.alloc_id != 0 && one_ns) || infos.iter().all(|(q, _, _)| q == key)
            };
            (!want_send || from_all(s)) && (!want_recv || from_all(r))
        })
    };
    // Cross-memory attach costs a system call per slice and a page walk per page: the ring's
    // shared FIFOs are quicker until the data outgrows the caches (OXCCL_CMA_MIN_BYTES); above
    // that, the tuner picks whichever has been faster.
    let mut path = None;
    let cma = !reachable(false)
        && op.cma
        && op.bytes() >= crate::param::cma_min_bytes()
        && reachable(true)
        && {
            let p = tune::verdict(op.seq, (0..op.nranks).map(|q| op.board.vote(q)));
            path = Some(p);
            p == CMA
        };
    if !cma && !reachable(false) {
        return Ok((None, path));
    }
    let locate = |key: u64, i: &crate::transport::board::BufInfo, p: usize| -> Result<Loc> {
        let maps = op
            .maps
            .as_ref()
            .ok_or_else(|| Error::internal("a direct operation without peer maps"))?;
        let remote = crate::liveness::pid_of_key(key).filter(|_| cma);
        match (maps.resolve(key, i)?, remote) {
            (Some(a), _) => Ok(Loc::Here(a)),
            (None, Some(pid)) => Ok(Loc::Remote {
                pid,
                addr: i.addr as usize,
            }),
            (None, None) => Err(Error::internal(format!(
                "direct operation #{}: rank {p}'s buffer is unreachable after all",
                op.seq
            ))),
        }
    };
    let mut out = Vec::with_capacity(op.nranks);
    for (p, &(key, s, r)) in infos.iter().enumerate().take(op.nranks) {
        if p == op.rank {
            out.push((Loc::Here(op.send), Loc::Here(op.recv)));
            continue;
        }
        let (ws, wr) = op.needs(p);
        let sa = if ws {
            locate(key, &s, p)?
        } else {
            Loc::Here(0)
        };
        let ra = if wr {
            locate(key, &r, p)?
        } else {
            Loc::Here(0)
        };
        out.push((sa, ra));
    }
    Ok((Some(out), path))
}

/// Reduces `elems` elements of every rank's input into `acc`, then finishes them; `fetch(p)`
/// gives the address of rank p's elements (it may copy them somewhere first).
///
/// # Safety
/// Every address `fetch` returns is valid for `elems` elements; `acc` holds them and is none of
/// those addresses.
unsafe fn reduce_into(
    reducers: &[Reducer],
    n: usize,
    fetch: &mut dyn FnMut(usize) -> Result<*const u8>,
    acc: *mut u8,
    elems: usize,
) -> Result<()> {
    // With per-rank PreMulSum scalars, rank p's reducer applies p's scalar.
    let red = |p: usize| &reducers[p.min(reducers.len() - 1)];
    // SAFETY: per the contract (`fetch` keeps the last two addresses it gave valid).
    unsafe {
        let first = fetch(0)?;
        let mut p = 1;
        if n > 1 && !red(0).has_prep() {
            // The first two inputs straight into `acc`: no copy of the first.
            red(1).combine(acc, fetch(1)?, first, elems);
            p = 2;
        } else {
            red(0).prep(acc, first, elems);
        }
        while p < n {
            let src = fetch(p)?;
            red(p).combine(acc, src, acc, elems);
            p += 1;
        }
        red(0).finish(acc, acc, elems);
    }
    Ok(())
}

/// Bytes reduced at a time when some input comes by cross-memory attach (a system call each).
const CMA_SLICE_BYTES: usize = 256 << 10;

fn compute(op: &Direct, peers: &[(Loc, Loc)]) -> Result<()> {
    let (n, r, es, c) = (op.nranks, op.rank, op.dtype.size(), op.count);
    let send = |p: usize| peers[p].0;
    let recv = |p: usize| peers[p].1;
    let remote = peers
        .iter()
        .any(|(s, d)| matches!(s, Loc::Remote { .. }) || matches!(d, Loc::Remote { .. }));
    let slice = (if remote { CMA_SLICE_BYTES } else { SLICE_BYTES } / es).max(1);
    let reducers = reducers(op);
    // Streaming stores for large outputs, unless in place (see steps::policies).
    let nt = op.send != op.recv && op.extents().1 >= crate::param::stream_bytes();
    let mut scratch = vec![0u8; slice * es];
    let acc = scratch.as_mut_ptr();
    // Two staging slices, used in turn: the last two inputs fetched stay valid.
    let mut staging = vec![0u8; if remote { 2 * slice * es } else { 0 }];
    let tmp = staging.as_mut_ptr();
    let turn = std::cell::Cell::new(0usize);
    // Rank p's input elements [at, at + m): in place, or copied into staging from its process.
    let fetch = |p: usize, at: usize, m: usize| -> Result<*const u8> {
        match send(p) {
            Loc::Here(a) => Ok((a + at * es) as *const u8),
            Loc::Remote { pid, addr } => {
                let t = turn.get();
                turn.set(t ^ 1);
                // SAFETY: staging holds two slices; the remote range is in p's published extent.
                unsafe {
                    let buf = tmp.add(t * slice * es);
                    cma::read(pid, addr + at * es, buf, m * es)?;
                    Ok(buf as *const u8)
                }
            }
        }
    };
    // Writes m elements from `src` at element offset `at` of rank p's output.
    let put = |p: usize, at: usize, src: *const u8, m: usize| -> Result<()> {
        // SAFETY: `src` holds m elements; the destination lies in p's published extent.
        unsafe {
            match recv(p) {
                Loc::Here(a) => copy_out((a + at * es) as *mut u8, src, m * es, nt),
                Loc::Remote { pid, addr } => cma::write(pid, addr + at * es, src, m * es)?,
            }
        }
        Ok(())
    };
    // Copies m elements of rank p's input from `from` into this rank's output at `to`.
    let gather = |p: usize, from: usize, to: usize, m: usize| -> Result<()> {
        let dst = match recv(r) {
            Loc::Here(a) => (a + to * es) as *mut u8,
            Loc::Remote { .. } => unreachable!("this rank's own buffer is here"),
        };
        // SAFETY: both ranges lie in published extents (this rank's, and p's).
        unsafe {
            match send(p) {
                Loc::Here(a) => copy_out(dst, (a + from * es) as *const u8, m * es, nt),
                Loc::Remote { pid, addr } => cma::read(pid, addr + from * es, dst, m * es)?,
            }
        }
        Ok(())
    };
    // SAFETY (reduce_into): `fetch` returns in-extent addresses or `tmp`; `acc` is private.
    // Only this rank writes the ranges it owns (its segment or block) until everyone is done.
    match op.kind {
        BoardKind::AllReduce | BoardKind::Reduce => {
            let (off, len) = segment(c, n, r);
            let mut o = 0;
            while o < len {
                let m = slice.min(len - o);
                unsafe { reduce_into(&reducers, n, &mut |p| fetch(p, off + o, m), acc, m)? };
                if op.kind == BoardKind::AllReduce {
                    for p in 0..n {
                        put(p, off + o, acc, m)?;
                    }
                } else {
                    put(op.root, off + o, acc, m)?;
                }
                o += m;
            }
        }
        BoardKind::ReduceScatter => {
            let mut o = 0;
            while o < c {
                let m = slice.min(c - o);
                unsafe { reduce_into(&reducers, n, &mut |p| fetch(p, r * c + o, m), acc, m)? };
                put(r, o, acc, m)?;
                o += m;
            }
        }
        BoardKind::AllGather => {
            for p in 0..n {
                gather(p, 0, p * c, c)?;
            }
        }
        BoardKind::Broadcast => gather(op.root, 0, 0, c)?,
    }
    Ok(())
}
