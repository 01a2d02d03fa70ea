//! One kernel for an all-reduce of every rank of a communicator (by default;
//! `OXCCL_CUDA_DIRECT=0`: the ring).
//!
//! When one thread's group holds an all-reduce of each rank of a communicator, all on one
//! device (`ncclCommInitAll` with a repeated device, `all_reduce_perf -g 2`), every rank's
//! input and output are at hand in one address space: one launch reads the n inputs once and
//! writes the n outputs once (`oxccl_direct4` / `oxccl_direct16` in `cuda/runner.cu`), where
//! the ring moves every byte through FIFO slots, n - 1 times, with a counter handshake per
//! slot. The descriptor is the usual one: lane k is rank k's program of one `LocalReduce`
//! step over its own buffers, with its own reduction (a PreMulSum's scalar is per rank); the
//! kernel reduces across the lanes in rank order.
//!
//! The launch goes on rank 0's stream; the other ranks' streams wait for it, and it for what
//! they had queued, with each communicator's events (as a group's streams are joined). Not
//! taken (the ring runs) while a stream captures a graph, when a rank has other calls in the
//! group, when the calls differ, when one rank's buffers overlap another's, or when the loaded
//! module lacks the kernels.

use super::desc::Desc;
use super::{stream, Call};
use crate::error::{Error, Result};
use crate::gpu::driver::{self, CtxGuard};
use crate::plan::{Addr, Prim, Program, Step};
use crate::types::CollKind;

/// The most ranks one launch reduces (`OX_DIRECT_MAX`).
pub const MAX_RANKS: usize = 16;

/// `OXCCL_CUDA_DIRECT`, and `NCCL_ALGO` leaves all-reduces a direct algorithm.
fn enabled() -> bool {
    crate::param::cuda_direct() && crate::plan::algo::direct_allowed(CollKind::AllReduce)
}

/// Takes out of `per_comm` (a group's calls, by communicator) the sets that one direct launch
/// serves, each ordered by rank.
pub(super) fn take<'a>(per_comm: &mut super::PerComm<'a>) -> Vec<Vec<Call<'a>>> {
    if per_comm.len() < 2 || !enabled() {
        return Vec::new();
    }
    let mut sets = Vec::new();
    let mut i = 0;
    while i < per_comm.len() {
        let members: Vec<usize> = (0..per_comm.len())
            .filter(|&j| same_comm(&per_comm[i], &per_comm[j]))
            .collect();
        let mut set: Vec<&Call> = members.iter().map(|&j| &per_comm[j][0]).collect();
        set.sort_by_key(|q| q.cuda().rank);
        if serves(&members, per_comm, &set) {
            // Remove from the back, so the indices stay valid.
            let mut taken: Vec<Call> = Vec::with_capacity(members.len());
            for &j in members.iter().rev() {
                taken.extend(per_comm.remove(j));
            }
            taken.sort_by_key(|q| q.cuda().rank);
            sets.push(taken);
        } else {
            i += 1;
        }
    }
    sets
}

/// Two communicators' calls are ranks of one communicator (its hash; rank counts agree).
fn same_comm(a: &[Call<'_>], b: &[Call<'_>]) -> bool {
    a[0].conns.hash == b[0].conns.hash && a[0].conns.nranks == b[0].conns.nranks
}

/// Whether the ranks `members` of `per_comm` (`set`: their first calls, by rank) are every
/// rank of their communicator, each with one all-reduce, all the same call, on one context,
/// not capturing, with buffers no other rank touches.
fn serves(members: &[usize], per_comm: &[Vec<Call<'_>>], set: &[&Call]) -> bool {
    let n = set[0].conns.nranks;
    let q0 = set[0];
    let k0 = &q0.cuda().kern;
    let kernel = if n <= 4 { k0.direct4 } else { k0.direct16 };
    if !(2..=MAX_RANKS).contains(&n) || members.len() != n || kernel.is_none() {
        return false;
    }
    if members.iter().any(|&j| per_comm[j].len() != 1) {
        return false;
    }
    // The same call by the words a mismatch is told by (not the operator's raw value: each
    // rank's PreMulSum operator has its communicator's; each lane takes its own rank's).
    let call =
        |q: &Call| crate::plan::call::of_coll(q.args.kind, q.args.count, q.args.dtype, q.red, 0);
    let alike = set.iter().enumerate().all(|(r, q)| {
        let a = q.args;
        q.cuda().rank == r
            && a.kind == CollKind::AllReduce
            && a.count > 0
            && q.red.is_some()
            && call(q) == call(q0)
            && q.cuda().ctx == q0.cuda().ctx
    });
    if !alike {
        return false;
    }
    let streams: Vec<usize> = set.iter().map(|q| stream::handle(&q.stream)).collect();
    let _g = match q0.cuda().enter() {
        Ok(g) => g,
        Err(_) => return false,
    };
    if streams
        .iter()
        .any(|&s| driver::capturing(s).unwrap_or(true))
    {
        return false;
    }
    apart(set)
}

/// Each rank's output overlaps no other rank's buffers, and its own input only in place.
fn apart(set: &[&Call]) -> bool {
    let bytes = set[0].args.count * set[0].args.dtype.size();
    let overlap = |a: usize, b: usize| a < b + bytes && b < a + bytes;
    set.iter().enumerate().all(|(k, q)| {
        let (s, r) = (q.args.send, q.args.recv);
        (s == r || !overlap(s, r))
            && set
                .iter()
                .enumerate()
                .all(|(j, p)| j == k || !(overlap(r, p.args.send) || overlap(r, p.args.recv)))
    })
}

/// Launches one set `take` returned (every rank of a communicator, by rank).
pub(super) fn launch(set: &[Call<'_>]) -> Result<()> {
    let api = driver::api()?;
    let c0 = set[0].cuda();
    let n = set.len();
    let a0 = set[0].args;
    let bytes = a0.count * a0.dtype.size();
    let func = if n <= 4 {
        c0.kern.direct4
    } else {
        c0.kern.direct16
    }
    .ok_or_else(|| Error::internal("the direct all-reduce kernel went missing"))?;
    let mut d = Desc::new();
    for q in set {
        let step = Step {
            prim: Prim::LocalReduce,
            recv: None,
            send: None,
            src: Addr::User(q.args.send),
            dst: Addr::User(q.args.recv),
            len: q.args.count,
            prep: true,
        };
        let p = Program::new(vec![step], q.args.dtype, bytes.max(1), q.red)
            .bind(&mut |_| Err(Error::internal("a connection in a direct all-reduce")))?;
        d.lane(std::iter::once(&p), q.cuda().ctl.addr())?;
    }
    let mut params = d.params(1, false)?;
    let streams: Vec<usize> = set.iter().map(|q| stream::handle(&q.stream)).collect();
    let s0 = streams[0];
    // Rank k's stream, as the launch's other stream to join (none for rank 0's).
    fn others(s: &usize, s0: usize) -> &[usize] {
        if *s == s0 {
            &[]
        } else {
            std::slice::from_ref(s)
        }
    }
    let _g = CtxGuard::enter(c0.ctx)?;
    // What each rank queued before, on its stream or (its last launch) on another, comes first.
    for (q, s) in set.iter().zip(&streams) {
        stream::join_before(api, q.cuda(), s0, others(s, s0), driver::Capture::No)?;
    }
    let blocks = (bytes / (512 * 64)).clamp(1, 2 * c0.kern.sms as usize) as u32;
    // (A descriptor of at most 16 lanes of one step each fits `PARAM_BYTES`.)
    super::launch_kernel(api, func, (blocks, 1), s0, &mut params, || {
        format!(
            "{}: launching the direct all-reduce of {n} ranks on stream {s0:#x}",
            c0.describe()
        )
    })?;
    if super::trace() {
        crate::debug::info(&format!(
            "{}: direct all-reduce of {n} ranks, {bytes} bytes each, {blocks} blocks, on \
             stream {s0:#x}",
            c0.describe()
        ));
    }
    // Each rank's later work, on its stream or another, comes after: its last event is
    // recorded after the kernel, and its own stream waits for it (its stream is then the one
    // whose later launches need no wait).
    let mut result = Ok(());
    for (q, s) in set.iter().zip(&streams) {
        crate::plan::algo::log_choice(
            "AllReduce",
            bytes,
            n,
            "Direct (one kernel over every rank's buffers on this GPU)",
        );
        q.cuda().last_conns.lock().clear();
        let r = stream::join_after(api, q.cuda(), s0, others(s, s0), *s);
        if result.is_ok() {
            result = r;
        }
    }
    if let Err(e) = &result {
        // The kernel runs, but later work may not be ordered after it: the communicators
        // are broken, as after a failed launch of a ring (`launch_set`).
        for q in set {
            q.cuda().health.fail_and_announce(e.clone());
        }
    }
    result
}
