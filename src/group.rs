//! Groups: calls collected until the outermost `ncclGroupEnd`, then planned and launched.
//! Outside a group every call is a group of one. Deferred inits run first, all at once; then each
//! communicator's calls become one task; tasks on a NULL stream run on this thread before
//! `ncclGroupEnd` returns, tasks on host streams are handed to those streams.

use crate::api::{CollArgs, StreamArg};
use crate::comm::{Comm, Core};
use crate::error::{Error, Result};
use crate::exec::host::Batch;
use crate::exec::Task;
use crate::plan::board::{BoardKind, BoardOp};
use crate::plan::{self, direct, ring, RedSpec, Stage};
use crate::stream::HostStream;
use crate::transport::Class;
use crate::types::{
    CollKind, DataType, ReduceKind, Reduction, Scalar, NUM_BUILTIN_OPS, OP_AVG, OP_MAX, OP_MIN,
    OP_PROD, OP_SUM,
};
use std::borrow::Borrow;
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A validated call. `C` holds the communicator's core (one per communicator): owned when the
/// call is queued in a group, borrowed from the communicator when it runs at once.
struct Queued<C: Borrow<Arc<Core>> = Arc<Core>> {
    core: C,
    args: CollArgs,
    red: Option<RedSpec>,
    stream: StreamArg,
}

impl<C: Borrow<Arc<Core>>> Queued<C> {
    fn core(&self) -> &Arc<Core> {
        self.core.borrow()
    }

    /// The call with its own reference to the core, to queue or to plan.
    fn owned(self) -> Queued {
        Queued {
            core: self.core.borrow().clone(),
            args: self.args,
            red: self.red,
            stream: self.stream,
        }
    }

    /// Whether the call goes to host stream `s`.
    fn on(&self, s: &Arc<HostStream>) -> bool {
        matches!(&self.stream, StreamArg::Host(x) if Arc::ptr_eq(x, s))
    }
}

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

pub fn end() -> Result<()> {
    let state = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Error::invalid_usage(
                "ncclGroupEnd called without a matching ncclGroupStart",
            ));
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Ok(None);
        }
        THREADS_IN_GROUPS.fetch_sub(1, Ordering::AcqRel);
        Ok(Some(std::mem::take(&mut *g)))
    })?;
    match state {
        None => Ok(()),
        Some(s) => launch_group(s),
    }
}

fn launch_group(s: GroupState) -> Result<()> {
    let init_result = crate::comm::run_inits(&s.inits);
    if let Some(e) = s.error {
        return Err(e);
    }
    init_result?;
    launch(s.ops)
}

/// Validates a call and queues it (or runs it at once outside a group).
pub fn enqueue(comm: &Arc<Comm>, args: CollArgs, stream: StreamArg) -> Result<()> {
    // This thread's own count is exact: if it is in a group, the counter is not zero.
    let in_group =
        THREADS_IN_GROUPS.load(Ordering::Acquire) > 0 && GROUP.with(|g| g.borrow().depth > 0);
    let checked = validate(comm, &args).map(|(core, red)| Queued {
        core,
        args,
        red,
        stream,
    });
    if !in_group {
        return launch_one(checked?);
    }
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        match checked {
            Ok(q) => {
                g.ops.push(q.owned());
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

fn bytes_of(count: usize, mult: usize, dtype: DataType, what: &str) -> Result<usize> {
    count
        .checked_mul(mult)
        .and_then(|c| c.checked_mul(dtype.size()))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::invalid_argument(format!("{what}: count {count} overflows the address space"))
        })
}

fn validate<'c>(comm: &'c Arc<Comm>, a: &CollArgs) -> Result<(&'c Arc<Core>, Option<RedSpec>)> {
    let core = comm.core()?;
    if let Some(e) = core.broken() {
        return Err(e);
    }
    let n = core.nranks;
    let name = a.kind.name();
    let rooted = matches!(
        a.kind,
        CollKind::Broadcast
            | CollKind::Reduce
            | CollKind::Gather
            | CollKind::Scatter
            | CollKind::Send
            | CollKind::Recv
    );
    if rooted && (a.root < 0 || a.root as usize >= n) {
        let what = if a.kind.is_p2p() { "peer" } else { "root" };
        return Err(Error::invalid_argument(format!(
            "{name}: invalid {what} {} (nranks is {n})",
            a.root
        )));
    }
    let (send_mult, recv_mult) = match a.kind {
        CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => (1, 1),
        CollKind::AllGather => (1, n),
        CollKind::ReduceScatter => (n, 1),
        CollKind::AlltoAll => (n, n),
        CollKind::Gather => (1, n),
        CollKind::Scatter => (n, 1),
        CollKind::Send => (1, 0),
        CollKind::Recv => (0, 1),
    };
    let me = core.rank as i32;
    let uses_send =
        !(matches!(a.kind, CollKind::Recv) || (a.kind == CollKind::Broadcast && a.root != me));
    let uses_recv = match a.kind {
        CollKind::Send => false,
        CollKind::Reduce | CollKind::Gather => a.root == me,
        _ => true,
    };
    let sb = bytes_of(a.count, send_mult, a.dtype, name)?;
    let rb = bytes_of(a.count, recv_mult, a.dtype, name)?;
    if uses_send && sb > 0 && a.send == 0 {
        return Err(Error::invalid_argument(format!("{name}: sendbuff is NULL")));
    }
    if uses_recv && rb > 0 && a.recv == 0 {
        return Err(Error::invalid_argument(format!("{name}: recvbuff is NULL")));
    }
    let reduces = matches!(
        a.kind,
        CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter
    );
    let red = if reduces {
        Some(resolve_op(comm, a.op, a.dtype, n, name)?)
    } else {
        None
    };
    Ok((core, red))
}

fn resolve_op(comm: &Comm, op: i32, dtype: DataType, n: usize, name: &str) -> Result<RedSpec> {
    let ready = |kind| {
        Ok(RedSpec::Ready(Reduction {
            dtype,
            kind,
            premul: None,
            postdiv: None,
        }))
    };
    match op {
        OP_SUM => ready(ReduceKind::Sum),
        OP_PROD => ready(ReduceKind::Prod),
        OP_MAX => ready(ReduceKind::Max),
        OP_MIN => ready(ReduceKind::Min),
        OP_AVG if dtype.is_float() => Ok(RedSpec::Ready(Reduction {
            dtype,
            kind: ReduceKind::Sum,
            premul: Some(scalar_from_f64(dtype, 1.0 / n as f64)),
            postdiv: None,
        })),
        OP_AVG => Ok(RedSpec::Ready(Reduction {
            dtype,
            kind: ReduceKind::Sum,
            premul: None,
            postdiv: Some(n as u64),
        })),
        _ if op >= NUM_BUILTIN_OPS => match comm.redops.get(op) {
            Some((d, scalar)) if d == dtype => Ok(RedSpec::PreMul { dtype, scalar }),
            Some((d, _)) => Err(Error::invalid_argument(format!(
                "{name}: operator {op} was created for datatype {} but used with {}",
                d.name(),
                dtype.name()
            ))),
            None => Err(Error::invalid_argument(format!(
                "{name}: invalid reduction operator {op} (not created on this communicator, or destroyed)"
            ))),
        },
        _ => Err(Error::invalid_argument(format!("{name}: invalid reduction operator {op}"))),
    }
}

/// A float scalar in the bits of `dtype`.
pub fn scalar_from_f64(dtype: DataType, v: f64) -> Scalar {
    use crate::reduce::convert;
    let bits = match dtype {
        DataType::Float64 => v.to_bits(),
        DataType::Float32 => (v as f32).to_bits() as u64,
        DataType::Float16 => convert::f32_to_f16(v as f32) as u64,
        DataType::Bfloat16 => convert::f32_to_bf16(v as f32) as u64,
        DataType::Float8e4m3 => convert::f32_to_e4m3(v as f32) as u64,
        DataType::Float8e5m2 => convert::f32_to_e5m2(v as f32) as u64,
        _ => v as i64 as u64,
    };
    Scalar { bits }
}

/// Launches a group of one call.
fn launch_one<C: Borrow<Arc<Core>>>(q: Queued<C>) -> Result<()> {
    match run_lone(std::slice::from_ref(&q)) {
        Some(r) => r,
        None => launch_tasks(vec![q.owned()]),
    }
}

/// Calls that all fit the board (eager operations), at most one per communicator, on
/// communicators with nothing outstanding and streams that are idle, run on this thread at once,
/// polled together (`exec::lone`); None when they do not qualify (nothing was taken: plan them
/// as usual).
fn run_lone<C: Borrow<Arc<Core>>>(qs: &[Queued<C>]) -> Option<Result<()>> {
    let budget = crate::param::inline_budget();
    for (i, q) in qs.iter().enumerate() {
        let (core, a) = (q.core(), &q.args);
        let bk = BoardKind::of(a.kind)?;
        if core.nranks < 2
            || !BoardOp::fits_inline(bk, core.nranks, a.count, a.dtype)
            || !core.has_board()
            || qs[..i].iter().any(|p| Arc::ptr_eq(p.core(), core))
            || (budget.is_zero() && matches!(q.stream, StreamArg::Host(_)))
        {
            return None;
        }
    }
    // Claim each host stream once (at its first call). A call alone in its group first runs
    // what its stream has queued (which may be this communicator's earlier work); a group only
    // takes idle streams (what one stream has queued may wait for another's).
    let first_on_stream = |i: usize| match &qs[i].stream {
        StreamArg::Host(s) => !qs[..i].iter().any(|p| p.on(s)),
        StreamArg::Null => false,
    };
    let mut claimed = 0;
    while claimed < qs.len() {
        if let StreamArg::Host(s) = &qs[claimed].stream {
            let ok = !first_on_stream(claimed)
                || if qs.len() == 1 {
                    s.claim_within(budget)
                } else {
                    s.claim()
                };
            if !ok {
                break;
            }
        }
        claimed += 1;
    }
    if claimed < qs.len() || !qs.iter().all(|q| q.core().idle()) {
        for (i, q) in qs[..claimed].iter().enumerate() {
            if let (StreamArg::Host(s), true) = (&q.stream, first_on_stream(i)) {
                s.release([]);
            }
        }
        return None;
    }
    use crate::exec::lone::{self, LoneOp};
    fn start<C: Borrow<Arc<Core>>>(q: &Queued<C>) -> LoneOp<'_> {
        let (core, a) = (q.core(), &q.args);
        let (board, seq) = core
            .board_op()
            .expect("checked: the communicator has a board");
        let ticket = core.take_ticket();
        let bk = BoardKind::of(a.kind).expect("checked: a board collective");
        let op = new_board_op(core, a, q.red, bk, board, seq, None);
        LoneOp::new(core, ticket, op)
    }
    // A single call (the common case) allocates nothing.
    Some(if qs.len() == 1 {
        let mut op = start(&qs[0]);
        let ops = std::slice::from_mut(&mut op);
        lone::run(ops, budget);
        end_lone(qs, ops)
    } else {
        let mut ops: Vec<LoneOp> = qs.iter().map(start).collect();
        lone::run(&mut ops, budget);
        end_lone(qs, &mut ops)
    })
}

/// Results of lone operations (`ops`, one per call of `qs`): the NULL stream's returned (its
/// unfinished work runs here to the end), each host stream's recorded on it (its unfinished work
/// handed to it), which ends that stream's claim.
fn end_lone<C: Borrow<Arc<Core>>>(
    qs: &[Queued<C>],
    ops: &mut [crate::exec::lone::LoneOp<'_>],
) -> Result<()> {
    if let ([q], [o]) = (qs, &mut *ops) {
        // One call, the common case: nothing to gather.
        return match &q.stream {
            StreamArg::Null => o.finish().unwrap_or_else(|b| finish_null(vec![b])),
            StreamArg::Host(s) => {
                end_on_stream(s, o.finish());
                Ok(())
            }
        };
    }
    let mut first_err = None;
    let mut null_pending = Vec::new();
    // Streams with several of the calls, and what they have so far.
    let mut shared: Vec<(&Arc<HostStream>, Vec<Batch>, Vec<Error>)> = Vec::new();
    for (q, o) in qs.iter().zip(ops.iter_mut()) {
        let r = o.finish();
        let s = match &q.stream {
            StreamArg::Null => {
                match r {
                    Ok(Err(e)) => {
                        first_err.get_or_insert(e);
                    }
                    Ok(Ok(())) => {}
                    Err(b) => null_pending.push(b),
                }
                continue;
            }
            StreamArg::Host(s) => s,
        };
        if qs.iter().filter(|p| p.on(s)).count() == 1 {
            end_on_stream(s, r);
            continue;
        }
        let at = match shared.iter().position(|(x, _, _)| Arc::ptr_eq(x, s)) {
            Some(at) => at,
            None => {
                shared.push((s, Vec::new(), Vec::new()));
                shared.len() - 1
            }
        };
        match r {
            Ok(r) => shared[at].2.extend(r.err()),
            Err(b) => shared[at].1.push(b),
        }
    }
    for (s, pending, errors) in shared {
        let pending = (!pending.is_empty()).then(|| Batch::join(pending));
        s.end_claim(pending, errors);
    }
    if !null_pending.is_empty() {
        if let Err(e) = finish_null(null_pending) {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Ends the claim of the stream of a lone call, with the call's result or unfinished work.
fn end_on_stream(s: &HostStream, r: std::result::Result<Result<()>, Batch>) {
    match r {
        Ok(r) => s.end_claim(None, r.err()),
        Err(b) => s.end_claim(Some(b), None),
    }
}

/// Runs lone calls' unfinished work on the NULL stream to the end: their first error.
fn finish_null(pending: Vec<Batch>) -> Result<()> {
    let mut b = Batch::join(pending);
    b.run_until(None);
    b.results()
        .into_iter()
        .find_map(|r| r.err())
        .map_or(Ok(()), Err)
}

/// A board operation for call `a`: eager when `fallback` (the ring program to run instead when
/// peers' buffers cannot be reached) is None.
fn new_board_op(
    core: &Core,
    a: &CollArgs,
    red: Option<RedSpec>,
    kind: BoardKind,
    board: Arc<crate::transport::board::Board>,
    seq: u64,
    fallback: Option<Box<plan::Program>>,
) -> BoardOp {
    let eager = fallback.is_none();
    BoardOp {
        board,
        maps: (!eager).then(|| core.maps.clone()),
        cma: core.cma,
        seq,
        rank: core.rank,
        nranks: core.nranks,
        kind,
        send: a.send,
        recv: a.recv,
        count: a.count,
        dtype: a.dtype,
        red,
        root: a.root.max(0) as usize,
        tuner: (!eager).then(|| core.tuner.clone()),
        fallback,
    }
}

/// Launches a group's calls.
fn launch(mut ops: Vec<Queued>) -> Result<()> {
    if ops.len() == 1 {
        return launch_one(ops.pop().expect("one call"));
    }
    match run_lone(&ops) {
        Some(r) => r,
        None => launch_tasks(ops),
    }
}

/// Turns queued calls into one task per communicator and runs them.
fn launch_tasks(ops: Vec<Queued>) -> Result<()> {
    if ops.is_empty() {
        return Ok(());
    }
    // Group by communicator, keeping call order.
    let mut per_comm: Vec<Vec<Queued>> = Vec::new();
    for q in ops {
        match per_comm
            .iter_mut()
            .find(|v| Arc::ptr_eq(&v[0].core, &q.core))
        {
            Some(v) => v.push(q),
            None => per_comm.push(vec![q]),
        }
    }
    let mut inline = Vec::new();
    let mut streamed: Vec<(Arc<crate::stream::HostStream>, Vec<Task>)> = Vec::new();
    let mut first_err = None;
    for qs in per_comm {
        let stream = qs[0].stream.clone();
        match build_task(qs) {
            Ok(t) => match stream {
                StreamArg::Null => inline.push(t),
                StreamArg::Host(s) => match streamed.iter_mut().find(|(x, _)| Arc::ptr_eq(x, &s)) {
                    Some((_, v)) => v.push(t),
                    None => streamed.push((s, vec![t])),
                },
            },
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    crate::stream::submit_all(streamed);
    for r in crate::exec::host::run(inline) {
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn describe<C: Borrow<Arc<Core>>>(qs: &[Queued<C>]) -> crate::exec::task::What {
    let a = &qs[0].args;
    crate::exec::task::What {
        kind: a.kind.name(),
        count: a.count,
        dtype: a.dtype.name(),
        more: qs.len() - 1,
    }
}

/// Plans one communicator's calls of a group into a task.
fn build_task(qs: Vec<Queued>) -> Result<Task> {
    let core = qs[0].core.clone();
    let mut task = Task::new(core.clone(), describe(&qs));
    let l: &dyn ring::Links = &*core;
    // Self send/recv pairs, matched in order.
    let mut self_sends = std::collections::VecDeque::new();
    let mut self_recvs = std::collections::VecDeque::new();
    // One lane per (peer, direction).
    let mut p2p_lanes: Vec<((usize, bool), Vec<plan::Program>)> = Vec::new();
    // A send from memory that a receive of the same task writes (sendrecv in place) reads a
    // copy taken when the task starts: the receive may run ahead of the send.
    let recvs: Vec<(usize, usize)> = qs
        .iter()
        .filter(|q| q.args.kind == CollKind::Recv)
        .map(|q| (q.args.recv, q.args.count * q.args.dtype.size()))
        .collect();
    let mut p2p_stash = plan::Stash::default();
    let mut send_src = |a: &CollArgs| {
        let bytes = a.count * a.dtype.size();
        if recvs
            .iter()
            .any(|&(r, rb)| plan::overlaps(a.send, bytes, r, rb))
        {
            p2p_stash.keep(a.send, bytes)
        } else {
            a.send
        }
    };
    let res = (|| -> Result<()> {
        for q in &qs {
            let a = q.args;
            let root = a.root.max(0) as usize;
            let red = q.red;
            let fault = Some((
                a.dtype,
                a.recv,
                plan::out_count(
                    a.kind,
                    a.count,
                    core.nranks,
                    core.rank,
                    a.root.max(0) as usize,
                ),
            ));
            let stage = |w: plan::Work| {
                let mut s = Stage::default();
                s.lanes.push(vec![w]);
                s.fault = fault;
                s
            };
            match a.kind {
                CollKind::AllReduce
                | CollKind::ReduceScatter
                | CollKind::AllGather
                | CollKind::Broadcast
                | CollKind::Reduce => {
                    let bk = BoardKind::of(a.kind).expect("a board collective");
                    let ring_program = || -> Result<plan::Program> {
                        match bk {
                            BoardKind::AllReduce => ring::all_reduce(
                                l,
                                a.send,
                                a.recv,
                                a.count,
                                a.dtype,
                                red.expect("red"),
                            ),
                            BoardKind::ReduceScatter => ring::reduce_scatter(
                                l,
                                a.send,
                                a.recv,
                                a.count,
                                a.dtype,
                                red.expect("red"),
                            ),
                            BoardKind::AllGather => {
                                ring::all_gather(l, a.send, a.recv, a.count, a.dtype)
                            }
                            BoardKind::Broadcast => {
                                ring::broadcast(l, a.send, a.recv, a.count, a.dtype, root)
                            }
                            BoardKind::Reduce => ring::reduce(
                                l,
                                a.send,
                                a.recv,
                                a.count,
                                a.dtype,
                                red.expect("red"),
                                root,
                            ),
                        }
                    };
                    let board = if core.nranks > 1 {
                        core.board_op()
                    } else {
                        None
                    };
                    let work = match board {
                        Some((board, seq)) => {
                            // An eager operation never falls back: no ring to plan.
                            let eager = BoardOp::fits_inline(bk, core.nranks, a.count, a.dtype);
                            let fallback = if eager {
                                None
                            } else {
                                Some(Box::new(ring_program()?))
                            };
                            plan::Work::Board(Box::new(new_board_op(
                                &core, &a, red, bk, board, seq, fallback,
                            )))
                        }
                        None => ring_program()?.into(),
                    };
                    task.stages.push_back(stage(work));
                }
                CollKind::AlltoAll => {
                    let mut s = direct::all_to_all(l, a.send, a.recv, a.count, a.dtype)?;
                    s.fault = fault;
                    task.stages.push_back(s);
                }
                CollKind::Gather => {
                    let mut s = direct::gather(l, a.send, a.recv, a.count, a.dtype, root)?;
                    s.fault = fault;
                    task.stages.push_back(s);
                }
                CollKind::Scatter => {
                    let mut s = direct::scatter(l, a.send, a.recv, a.count, a.dtype, root)?;
                    s.fault = fault;
                    task.stages.push_back(s);
                }
                CollKind::Send | CollKind::Recv => {
                    let is_send = a.kind == CollKind::Send;
                    if root == core.rank {
                        if is_send {
                            self_sends.push_back(a);
                        } else {
                            self_recvs.push_back(a);
                        }
                        continue;
                    }
                    let prog = if is_send {
                        direct::send(l, send_src(&a), a.count, a.dtype, root, Class::P2p)?
                    } else {
                        direct::recv(l, a.recv, a.count, a.dtype, root, Class::P2p)?
                    };
                    match p2p_lanes.iter_mut().find(|(k, _)| *k == (root, is_send)) {
                        Some((_, v)) => v.push(prog),
                        None => p2p_lanes.push(((root, is_send), vec![prog])),
                    }
                }
            }
        }
        if self_sends.len() != self_recvs.len() {
            return Err(Error::invalid_usage(format!(
                "rank {}: {} send(s) to itself but {} recv(s) from itself in one group",
                core.rank,
                self_sends.len(),
                self_recvs.len()
            )));
        }
        for (s, r) in self_sends.into_iter().zip(self_recvs) {
            if s.count * s.dtype.size() != r.count * r.dtype.size() {
                return Err(Error::invalid_usage(format!(
                    "rank {}: send to itself of {} bytes matched with a recv of {} bytes",
                    core.rank,
                    s.count * s.dtype.size(),
                    r.count * r.dtype.size()
                )));
            }
            if s.send == r.recv {
                continue; // in place: nothing moves
            }
            p2p_lanes.push((
                (core.rank, true),
                vec![direct::local_copy(
                    l,
                    send_src(&s),
                    r.recv,
                    s.count,
                    s.dtype,
                )],
            ));
        }
        Ok(())
    })();
    res?;
    // The ticket is taken only once planning succeeded, so a failed plan never blocks the comm.
    task.ticket = core.take_ticket();
    task.p2p_stash = p2p_stash;
    task.p2p = p2p_lanes
        .into_iter()
        .map(|(_, v)| v.into_iter().map(plan::Work::from).collect())
        .collect();
    Ok(task)
}
