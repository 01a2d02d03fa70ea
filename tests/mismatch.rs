//! Ranks that call one collective with different counts, datatypes, reductions or roots get
//! `ncclInvalidUsage` on every rank, naming both calls, and nothing is written: no byte past any
//! buffer (each ends at a guard page, so an overrun crashes the test), and not the outputs either.

use nccl::api::{self, CollArgs, StreamArg};
use nccl::error::Code;
use nccl::types::{CollKind, DataType, OP_MAX, OP_SUM};
use nix::sys::mman::{mmap_anonymous, mprotect, MapFlags, ProtFlags};
use std::num::NonZeroUsize;

mod common;

const PAGE: usize = 4096;
const CANARY: u8 = 0xa5;

/// `bytes` of memory that end where an inaccessible page begins (kept mapped for the test).
struct Guarded {
    at: usize,
    bytes: usize,
}

impl Guarded {
    fn new(bytes: usize) -> Guarded {
        let body = bytes.div_ceil(PAGE) * PAGE;
        let len = body + PAGE;
        // SAFETY: a fresh private anonymous mapping.
        let base = unsafe {
            mmap_anonymous(
                None,
                NonZeroUsize::new(len).unwrap(),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .unwrap();
        // SAFETY: the last page of our own mapping.
        unsafe {
            let guard =
                std::ptr::NonNull::new(base.as_ptr().cast::<u8>().add(body).cast()).unwrap();
            mprotect(guard, PAGE, ProtFlags::PROT_NONE).unwrap();
        }
        let at = base.as_ptr() as usize + body - bytes;
        // SAFETY: `bytes` writable bytes at `at`.
        unsafe { std::ptr::write_bytes(at as *mut u8, CANARY, bytes) };
        Guarded { at, bytes }
    }

    fn untouched(&self) -> bool {
        // SAFETY: as in `new`.
        unsafe { std::slice::from_raw_parts(self.at as *const u8, self.bytes) }
            .iter()
            .all(|&b| b == CANARY)
    }
}

/// One rank's side of a case: (kind, count, datatype, op, root).
type Side = (CollKind, usize, DataType, i32, i32);

fn args(s: Side, send: &Guarded, recv: &Guarded) -> CollArgs {
    CollArgs {
        kind: s.0,
        send: send.at,
        recv: recv.at,
        count: s.1,
        dtype: s.2,
        op: s.3,
        root: s.4,
    }
}

fn buffers(s: Side) -> (Guarded, Guarded) {
    let bytes = (s.1 * s.2.size()).max(1);
    (Guarded::new(bytes), Guarded::new(bytes))
}

/// Checks one rank's outcome of a mismatched call.
fn check(r: usize, e: nccl::error::Error, mine: &str, theirs: &str, recv: &Guarded) {
    assert_eq!(e.code, Code::InvalidUsage, "rank {r}: {e}");
    let peer = 1 - r;
    assert!(
        e.msg.contains(&format!("rank {r} called {mine}"))
            && e.msg.contains(&format!("rank {peer} called {theirs}")),
        "rank {r}: {e}"
    );
    assert!(recv.untouched(), "rank {r}: its output was written");
}

const F: DataType = DataType::Float32;

/// (rank 0's call, rank 1's call, how each reads in the message).
fn cases() -> Vec<(Side, Side, &'static str, &'static str)> {
    use CollKind::*;
    vec![
        // Direct operations (zero copy between the ranks' buffers): counts, datatypes.
        (
            (AllReduce, 1 << 20, F, OP_SUM, 0),
            (AllReduce, 2 << 20, F, OP_SUM, 0),
            "AllReduce of 1048576 x float (sum)",
            "AllReduce of 2097152 x float (sum)",
        ),
        (
            (AllReduce, 1 << 18, F, OP_SUM, 0),
            (AllReduce, 1 << 18, DataType::Float64, OP_SUM, 0),
            "AllReduce of 262144 x float (sum)",
            "AllReduce of 262144 x double (sum)",
        ),
        // Eager operations (inputs on the board): counts, reductions.
        (
            (AllReduce, 4, F, OP_SUM, 0),
            (AllReduce, 8, F, OP_SUM, 0),
            "AllReduce of 4 x float (sum)",
            "AllReduce of 8 x float (sum)",
        ),
        (
            (AllReduce, 16, F, OP_SUM, 0),
            (AllReduce, 16, F, OP_MAX, 0),
            "AllReduce of 16 x float (sum)",
            "AllReduce of 16 x float (max)",
        ),
        // One rank eager, the other direct.
        (
            (AllReduce, 100, F, OP_SUM, 0),
            (AllReduce, 100_000, F, OP_SUM, 0),
            "AllReduce of 100 x float (sum)",
            "AllReduce of 100000 x float (sum)",
        ),
        // Roots, and kinds.
        (
            (Broadcast, 64, F, OP_SUM, 0),
            (Broadcast, 64, F, OP_SUM, 1),
            "Broadcast of 64 x float, root 0",
            "Broadcast of 64 x float, root 1",
        ),
        (
            (AllReduce, 64, F, OP_SUM, 0),
            (Reduce, 64, F, OP_SUM, 0),
            "AllReduce of 64 x float (sum)",
            "Reduce of 64 x float (sum), root 0",
        ),
    ]
}

#[test]
fn mismatched_calls_between_threads_are_errors_on_both() {
    std::env::set_var("OXCCL_DEVICE", "host");
    for (a, b, da, db) in cases() {
        let comms = api::comm_init_all(&[0, 1]).unwrap();
        std::thread::scope(|s| {
            for (r, (side, mine, theirs)) in [(a, da, db), (b, db, da)].into_iter().enumerate() {
                let c = &comms[r];
                s.spawn(move || {
                    let (send, recv) = buffers(side);
                    let e = api::enqueue(c, args(side, &send, &recv), StreamArg::Null)
                        .expect_err("a mismatched call must fail");
                    check(r, e, mine, theirs, &recv);
                    // The communicator is broken now: the next call says why.
                    let e2 = api::enqueue(c, args(side, &send, &recv), StreamArg::Null)
                        .expect_err("a broken communicator");
                    assert_eq!(e2.code, Code::InvalidUsage, "rank {r}: {e2}");
                });
            }
        });
        for c in comms {
            api::comm_destroy(api::comm_handle(&c)).unwrap();
        }
    }
}

/// The same between processes (each rank's malloc buffers are out of its peer's reach: the
/// check comes before the ring the ranks would fall back on).
#[test]
fn mismatched_calls_between_processes_are_errors_on_both() {
    let Some((id, n, r)) = common::rank_env() else {
        return common::run_ranks(
            "mismatched_calls_between_processes_are_errors_on_both",
            2,
            &[],
        );
    };
    let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
    // Two cases: a direct count mismatch, and an eager one (each breaks its communicator, so
    // the second runs on a split of the first's bootstrap would not do: use a fresh comm by
    // splitting before the first).
    let c2 = api::comm_split(&c, 0, r as i32, None).unwrap().unwrap();
    for (comm, case) in [(&c, 0usize), (&c2, 2)] {
        let (a, b, da, db) = cases()[case];
        let (side, mine, theirs) = if r == 0 { (a, da, db) } else { (b, db, da) };
        let (send, recv) = buffers(side);
        let e = api::enqueue(comm, args(side, &send, &recv), StreamArg::Null)
            .expect_err("a mismatched call must fail");
        check(r, e, mine, theirs, &recv);
    }
    api::comm_destroy(api::comm_handle(&c2)).unwrap();
    api::comm_destroy(api::comm_handle(&c)).unwrap();
}

/// Calls that run as step programs over FIFOs (rings, all-to-all, send/recv) are checked in
/// every slot a rank receives: a slot filled by another call is an error before it is read.
/// (rank 0's call, rank 1's call, how each reads in the message, whether rank 0 must fail too.)
fn fifo_cases() -> Vec<(Side, Side, &'static str, &'static str, bool)> {
    use CollKind::*;
    vec![
        (
            (AllReduce, 1 << 18, F, OP_SUM, 0),
            (AllReduce, 1 << 19, F, OP_SUM, 0),
            "AllReduce of 262144 x float (sum)",
            "AllReduce of 524288 x float (sum)",
            true,
        ),
        (
            (AllGather, 1000, F, OP_SUM, 0),
            (AllGather, 1000, DataType::Int32, OP_SUM, 0),
            "AllGather of 1000 x float",
            "AllGather of 1000 x int32",
            true,
        ),
        (
            (AlltoAll, 5000, F, OP_SUM, 0),
            (AlltoAll, 6000, F, OP_SUM, 0),
            "AlltoAll of 5000 x float",
            "AlltoAll of 6000 x float",
            true,
        ),
        // Rank 0 sends 16 KiB to rank 1, which expects 32 KiB: the receiver fails (the sender's
        // data fits the FIFO: its send may complete).
        (
            (Send, 4096, F, OP_SUM, 1),
            (Recv, 8192, F, OP_SUM, 0),
            "Send/Recv of 16384 bytes",
            "Send/Recv of 32768 bytes",
            false,
        ),
    ]
}

fn fifo_mismatch(r: usize, c: &std::sync::Arc<nccl::comm::Comm>, case: usize) {
    let (a, b, da, db, both) = fifo_cases()[case];
    let (side, mine, theirs) = if r == 0 { (a, da, db) } else { (b, db, da) };
    let (send, recv) = buffers(side);
    let bytes = |s: Side| (s.1 * s.2.size()).max(1);
    // AllGather and AlltoAll outputs (and AlltoAll inputs) hold a count per rank.
    let recv = if matches!(side.0, CollKind::AllGather | CollKind::AlltoAll) {
        Guarded::new(2 * bytes(side))
    } else {
        recv
    };
    let send = if side.0 == CollKind::AlltoAll {
        Guarded::new(2 * bytes(side))
    } else {
        send
    };
    let r_ = api::enqueue(c, args(side, &send, &recv), StreamArg::Null);
    if r == 0 && !both {
        return;
    }
    let e = r_.expect_err("a mismatched call must fail");
    assert_eq!(e.code, Code::InvalidUsage, "rank {r}: {e}");
    let peer = 1 - r;
    // Found here, or by the peer (which tells every rank).
    let here = format!("rank {r} called {mine}, but rank {peer} sent it data of {theirs}");
    let there = format!("rank {peer} called {theirs}, but rank {r} sent it data of {mine}");
    assert!(
        e.msg.contains(&here) || e.msg.contains(&there),
        "rank {r}: {e}"
    );
}

#[test]
fn mismatched_calls_over_fifos_are_errors() {
    if !common::is_child() {
        common::in_child(
            "mismatched_calls_over_fifos_are_errors",
            &[("OXCCL_ALGO", "ring"), ("OXCCL_TIMEOUT_S", "5")],
        );
        return;
    }
    for case in 0..fifo_cases().len() {
        let comms = api::comm_init_all(&[0, 1]).unwrap();
        std::thread::scope(|s| {
            for (r, c) in comms.iter().enumerate() {
                s.spawn(move || fifo_mismatch(r, c, case));
            }
        });
        for c in comms {
            let _ = api::comm_abort(api::comm_handle(&c));
        }
    }
}

#[test]
fn mismatched_calls_over_fifos_between_processes_are_errors() {
    let Some((id, n, r)) = common::rank_env() else {
        return common::run_ranks(
            "mismatched_calls_over_fifos_between_processes_are_errors",
            2,
            &[("OXCCL_ALGO", "ring"), ("OXCCL_TIMEOUT_S", "5")],
        );
    };
    let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
    let comms: Vec<_> = fifo_cases()
        .iter()
        .map(|_| api::comm_split(&c, 0, r as i32, None).unwrap().unwrap())
        .collect();
    for (case, comm) in comms.iter().enumerate() {
        fifo_mismatch(r, comm, case);
    }
    for comm in comms {
        let _ = api::comm_abort(api::comm_handle(&comm));
    }
    let _ = api::comm_abort(api::comm_handle(&c));
}
