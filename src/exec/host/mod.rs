//! The host executor: runs plans on host memory, on the calling thread (the NULL stream) or on
//! host streams (`oxcclHostStream*`, each with a worker thread). Launching a group's calls:
//! - calls that all fit the board (small collectives, one per communicator) onto idle streams
//!   run at once on this thread, polled together (`lone`), without building tasks;
//! - the others are planned (`plan::build`) into one task per communicator (`task`), run
//!   together by one polling loop (`batch`) on this thread for the NULL stream, or handed to
//!   their streams (`stream`).

mod batch;
mod board;
mod comm;
mod copy;
mod lone;
pub mod memory;
mod recv_ref;
mod steps;
pub mod stream;
mod task;
pub mod tune;

pub use comm::HostComm;

use super::{Call, CommExec, Stream};
use crate::error::{Error, Result};
use crate::plan::board::BoardKind;
use crate::transport::board::{Board, INLINE};
use batch::Batch;
use lone::LoneOp;
use std::sync::Arc;
use stream::HostStream;
use task::Task;

impl Call<'_> {
    /// The host executor's state of the call's communicator.
    #[inline]
    fn host(&self) -> &Arc<HostComm> {
        match self.comm {
            CommExec::Host(h) => h,
            // `exec::launch` hands the host executor only its own communicators.
            CommExec::Cuda(_) => unreachable!("a CUDA communicator in a host launch"),
        }
    }
}

/// A CUDA stream handed to the host executor (which `Stream::from_handle` never makes).
#[inline]
fn foreign_stream(q: &Call<'_>) -> Result<()> {
    match q.stream {
        Stream::Cuda(h) => Err(Error::invalid_argument(format!(
            "stream {h:#x} is a CUDA stream, which the host executor cannot run on"
        ))),
        _ => Ok(()),
    }
}

/// A program's reduction, a PreMulSum scalar in the caller's memory read now (when the work
/// runs, as NCCL's kernel reads it).
pub(super) fn resolve(red: &crate::plan::RedSpec) -> crate::types::Reduction {
    red.with_scalar(|addr, dtype| {
        let mut b = [0u8; 8];
        // SAFETY: the caller registered this address as a scalar of `dtype` that stays valid
        // until the collective completes (NCCL's contract); on the host executor it is host
        // memory.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, b.as_mut_ptr(), dtype.size()) };
        u64::from_le_bytes(b)
    })
}

/// Whether the call goes to host stream `s`.
fn on(q: &Call<'_>, s: &Arc<HostStream>) -> bool {
    matches!(&q.stream, Stream::Host(x) if Arc::ptr_eq(x, s))
}

/// Launches a group of one call.
#[inline(always)]
pub fn launch_one(q: &Call<'_>) -> Result<()> {
    foreign_stream(q)?;
    let qs = std::slice::from_ref(q);
    match run_lone(qs) {
        Some(r) => r,
        None => launch_comm(qs),
    }
}

/// Calls that all fit the board (eager operations), at most one per communicator, on
/// communicators with nothing outstanding and streams that are idle, run on this thread at once,
/// polled together (`exec::lone`); None when they do not qualify (nothing was taken: plan them
/// as usual).
fn run_lone(qs: &[Call<'_>]) -> Option<Result<()>> {
    let budget = crate::param::inline_budget();
    for (i, q) in qs.iter().enumerate() {
        let (comm, a) = (q.host(), &q.args);
        let bk = BoardKind::of(a.kind)?;
        if comm.nranks < 2
            || !crate::plan::board::fits_inline(bk, comm.nranks, a.count, a.dtype, INLINE)
            || !crate::plan::algo::direct_allowed(a.kind)
            || !comm.has_board()
            // The flight recorder sees tasks (a debugging mode: small operations take the
            // general path then).
            || comm.recorder.is_some()
            || qs[..i].iter().any(|p| Arc::ptr_eq(p.host(), comm))
            || (budget.is_zero() && matches!(q.stream, Stream::Host(_)))
        {
            return None;
        }
    }
    // Claim each host stream once (at its first call). A call alone in its group first runs
    // what its stream has queued (which may be this communicator's earlier work); a group only
    // takes idle streams (what one stream has queued may wait for another's).
    let first_on_stream = |i: usize| match &qs[i].stream {
        Stream::Host(s) => !qs[..i].iter().any(|p| on(p, s)),
        _ => false,
    };
    let mut claimed = 0;
    while claimed < qs.len() {
        if let Stream::Host(s) = &qs[claimed].stream {
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
    if claimed < qs.len() || !qs.iter().all(|q| q.host().idle()) {
        for (i, q) in qs[..claimed].iter().enumerate() {
            if let (Stream::Host(s), true) = (&q.stream, first_on_stream(i)) {
                s.release([]);
            }
        }
        return None;
    }
    fn start<'a>(q: &'a Call<'_>, board: (Arc<Board>, u64), kind: BoardKind) -> LoneOp<'a> {
        let a = &q.args;
        if crate::debug::subsys_enabled(crate::debug::Subsys::Tuning) {
            let bytes = a.count * a.dtype.size();
            crate::plan::algo::log_choice(a.kind.name(), bytes, q.host().nranks, "Direct");
        }
        LoneOp::start(q.host(), board, a, q.red, kind)
    }
    // Checked above: board collectives, and the communicators have boards.
    let board = |q: &Call<'_>| Some((q.host().board_op()?, BoardKind::of(q.args.kind)?));
    let no_board = || Some(Err(Error::internal("a lone operation without a board")));
    // A single call (the common case) allocates nothing.
    Some(if qs.len() == 1 {
        let Some((b, kind)) = board(&qs[0]) else {
            return no_board();
        };
        let mut op = start(&qs[0], b, kind);
        let ops = std::slice::from_mut(&mut op);
        lone::run(ops, budget);
        end_lone(qs, ops)
    } else {
        let mut ops = Vec::with_capacity(qs.len());
        for q in qs {
            let Some((b, kind)) = board(q) else {
                return no_board();
            };
            ops.push(start(q, b, kind));
        }
        lone::run(&mut ops, budget);
        end_lone(qs, &mut ops)
    })
}

/// Results of lone operations (`ops`, one per call of `qs`): the NULL stream's returned (its
/// unfinished work runs here to the end), each host stream's recorded on it (its unfinished work
/// handed to it), which ends that stream's claim.
fn end_lone(qs: &[Call<'_>], ops: &mut [LoneOp<'_>]) -> Result<()> {
    if let ([q], [o]) = (qs, &mut *ops) {
        // One call, the common case: nothing to gather.
        return match &q.stream {
            Stream::Host(s) => {
                end_on_stream(s, o.finish());
                Ok(())
            }
            _ => o.finish().unwrap_or_else(|b| finish_null(vec![b])),
        };
    }
    let mut first_err = None;
    let mut null_pending = Vec::new();
    // Streams with several of the calls, and what they have so far.
    let mut shared: Vec<(&Arc<HostStream>, Vec<Batch>, Vec<Error>)> = Vec::new();
    for (q, o) in qs.iter().zip(ops.iter_mut()) {
        let r = o.finish();
        let s = match &q.stream {
            Stream::Host(s) => s,
            _ => {
                match r {
                    Ok(Err(e)) => {
                        first_err.get_or_insert(e);
                    }
                    Ok(Ok(())) => {}
                    Err(b) => null_pending.push(b),
                }
                continue;
            }
        };
        if qs.iter().filter(|p| on(p, s)).count() == 1 {
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
    b.first_error().map_or(Ok(()), Err)
}

/// Launches a group's calls.
pub fn launch(mut ops: Vec<Call<'_>>) -> Result<()> {
    if ops.len() == 1 {
        return launch_one(&ops.pop().expect("one call"));
    }
    for q in &ops {
        foreign_stream(q)?;
    }
    match run_lone(&ops) {
        Some(r) => r,
        None => launch_tasks(ops),
    }
}

/// One communicator's calls (a group of one call, the common case): one task, planned, connected,
/// and run or handed to its stream without the gathering `launch_tasks` does for several
/// communicators (each allocation counts on this path: a small operation between two hosts
/// costs a few thousand instructions in all).
fn launch_comm(qs: &[Call<'_>]) -> Result<()> {
    let call = |q: &Call<'_>| (q.args, q.red);
    let (comm, conns) = (qs[0].host(), qs[0].conns);
    let plan = crate::plan::build::build_task(conns, comm.caps(), qs, call)?;
    let keys = conns.missing_of(|f| plan.for_each_key(&mut |k| f(k)));
    if !keys.is_empty() {
        if let Err(e) = crate::transport::conns::connect_all(&[(conns, keys)]) {
            // As in `launch_tasks`.
            comm.health.fail_unless_told(e.clone());
            return Err(e);
        }
    }
    let what = crate::plan::build::describe(qs, call);
    let task = Task::from_plan(comm, conns, plan, what)?;
    match &qs[0].stream {
        Stream::Host(s) => {
            stream::submit_one(s, task);
            Ok(())
        }
        Stream::Null | Stream::Cuda(_) => batch::run_one(task),
    }
}

/// Turns queued calls into one task per communicator and runs them.
fn launch_tasks(ops: Vec<Call<'_>>) -> Result<()> {
    if ops.is_empty() {
        return Ok(());
    }
    if ops.iter().all(|q| Arc::ptr_eq(q.host(), ops[0].host())) {
        return launch_comm(&ops);
    }
    // Group by communicator, keeping call order.
    let mut per_comm: Vec<Vec<Call>> = Vec::new();
    for q in ops {
        match per_comm
            .iter_mut()
            .find(|v| Arc::ptr_eq(v[0].host(), q.host()))
        {
            Some(v) => v.push(q),
            None => per_comm.push(vec![q]),
        }
    }
    let mut first_err = None;
    // Plan every communicator's task, then make the connections they all need in one exchange
    // (ranks this thread drives wait for each other's ends), then bind and queue them in order.
    let mut planned = Vec::with_capacity(per_comm.len());
    for qs in per_comm {
        let call = |q: &Call<'_>| (q.args, q.red);
        let comm = qs[0].host();
        match crate::plan::build::build_task(qs[0].conns, comm.caps(), &qs, call) {
            Ok(t) => {
                let what = crate::plan::build::describe(&qs, call);
                planned.push((qs, t, what))
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    let (needs, needy): (Vec<_>, Vec<_>) = planned
        .iter()
        .map(|(qs, t, _)| {
            let conns = qs[0].conns;
            let keys = conns.missing_of(|f| t.for_each_key(&mut |k| f(k)));
            ((conns, keys), qs[0].host())
        })
        .filter(|((_, keys), _)| !keys.is_empty())
        .unzip();
    if !needs.is_empty() {
        if let Err(e) = crate::transport::conns::connect_all(&needs) {
            // A communicator whose connections could not be made is broken, as NCCL's is; peers
            // whose ends connected would wait for it: they are told.
            for comm in needy {
                comm.health.fail_unless_told(e.clone());
            }
            return Err(e);
        }
    }
    let mut inline = Vec::new();
    let mut streamed: Vec<(Arc<HostStream>, Vec<Task>)> = Vec::new();
    for (qs, plan, what) in planned {
        match Task::from_plan(qs[0].host(), qs[0].conns, plan, what) {
            Ok(t) => match &qs[0].stream {
                Stream::Host(s) => match streamed.iter_mut().find(|(x, _)| Arc::ptr_eq(x, s)) {
                    Some((_, v)) => v.push(t),
                    None => streamed.push((s.clone(), vec![t])),
                },
                Stream::Null | Stream::Cuda(_) => inline.push(t),
            },
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    stream::submit_all(streamed);
    for r in batch::run(inline) {
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
