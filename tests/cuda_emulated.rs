//! The CUDA executor end to end without a GPU: its launches run the kernels of `cuda/runner.cu`,
//! compiled for the host, on an emulated device (`tests/cuda_emu/`: a stand-in driver whose
//! streams are threads that run their work in order, whose device memory is host memory).
//! Checked element by element against values computed here: every collective over 1, 2 and 4
//! ranks of one device (`ncclCommInitAll`), in and out of place, ranks on their own streams and
//! on one, several datatypes and every operator; the direct all-reduce (the default for a group of every rank on one device) and the optional copy
//! kernels; graphs captured and replayed between eager launches (and a group on two streams
//! of one graph), and after their communicators are destroyed (`cuda_emu/graphs.rs`); a
//! thread per rank, whose all-reduces meet on the device board (`cuda_emu/board.rs`, with its
//! failures); and a process per rank (2 and 3, `cuda_emu/processes.rs`), with
//! connections in device memory opened by IPC handles (the default) and, with
//! `OXCCL_CUDA_IPC=0`, in shared host memory; ranks on 2 "hosts" over the network transport; ranks on two devices
//! (`cuda_emu/peers.rs`), with and without native peer atomics; sends by reference between
//! ranks of one process on one device (`by_reference`). And failures: a call mismatch, an abort, a refused launch or allocation,
//! a peer process that dies during an eager launch or a graph's replay (on this host, on
//! another, and in another PID namespace of this host), one that never comes, and one that did
//! its part and left (no failure).
//!
//! What this shows: the executor's plans, descriptors, launches, stream order and connection
//! setup, and the kernels' logic over connections (slots, counters, slices, several blocks per
//! lane), together. What it cannot show: the GPU's memory model, occupancy, speed, or how the
//! real driver takes each call; that is the GPU check's (`scripts/gpu-check.sh`).
//!
//! One test function: the driver and the executor are chosen once per process (rank processes
//! run this same function, told so by `OXEMU_RANK`).

#[path = "cuda_emu/board.rs"]
mod board;
#[path = "cuda_emu/device.rs"]
mod device;
#[path = "cuda_emu/graphs.rs"]
mod graphs;
#[path = "cuda_emu/peers.rs"]
mod peers;
#[path = "cuda_emu/processes.rs"]
mod processes;
#[path = "cuda_stand_in/mod.rs"]
mod stand_in;

use board::{
    board_failures, board_large, board_mixed_groups, board_p2p_beside, board_threads,
    boards_share_the_device,
};
use device::{begin_capture, end_capture, replay, sync, IPC_OPENED, LAUNCHED, NEXT};
use graphs::{
    destroy_while_capturing, forked_calls, graphs, mixed_group_graph, mixed_replays,
    relaxed_restores_mode, released_while_a_rank_waits, replay_after_destroy, two_stream_graphs,
};
use nccl::gpu::driver;
use nccl::types::{CollArgs, CollKind, DataType};
use processes::{processes, rank_process, ranks_process, run_processes};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

// ---- the checks ---------------------------------------------------------------------------

/// A "device" buffer of `bytes`.
fn buffer(bytes: usize) -> usize {
    let mut v = vec![0u8; bytes.max(1) + 256];
    let p = (v.as_mut_ptr() as usize).next_multiple_of(256);
    BUFFERS.lock().push(v);
    p
}

/// The buffers `buffer` handed out, until `release_buffers`.
static BUFFERS: parking_lot::Mutex<Vec<Vec<u8>>> = parking_lot::Mutex::new(Vec::new());

/// Frees every buffer (only when no launch that uses one can still run).
fn release_buffers() {
    BUFFERS.lock().clear();
}

/// Rank r's input element i: a small integer (exact in every type used, in any order of
/// summation); positive and at most 3 for products.
fn input(r: usize, i: usize, op: i32) -> f64 {
    if op == nccl::types::OP_PROD {
        ((r + i) % 3 + 1) as f64
    } else {
        ((r * 7 + i * 3) % 11) as f64 - 5.0
    }
}

fn put(dt: DataType, buf: usize, i: usize, v: f64) {
    use nccl::reduce::convert;
    // SAFETY: `buf` holds element `i` of `dt`.
    unsafe {
        match dt {
            DataType::Float32 => *(buf as *mut f32).add(i) = v as f32,
            DataType::Float64 => *(buf as *mut f64).add(i) = v,
            DataType::Int32 => *(buf as *mut i32).add(i) = v as i32,
            DataType::Int8 => *(buf as *mut i8).add(i) = v as i8,
            DataType::Float16 => *(buf as *mut u16).add(i) = convert::f32_to_f16(v as f32),
            DataType::Bfloat16 => *(buf as *mut u16).add(i) = convert::f32_to_bf16(v as f32),
            _ => unreachable!("{dt:?}"),
        }
    }
}

fn get(dt: DataType, buf: usize, i: usize) -> f64 {
    use nccl::reduce::convert;
    // SAFETY: `buf` holds element `i` of `dt`.
    unsafe {
        match dt {
            DataType::Float32 => *(buf as *const f32).add(i) as f64,
            DataType::Float64 => *(buf as *const f64).add(i),
            DataType::Int32 => *(buf as *const i32).add(i) as f64,
            DataType::Int8 => *(buf as *const i8).add(i) as f64,
            DataType::Float16 => convert::f16_to_f32(*(buf as *const u16).add(i)) as f64,
            DataType::Bfloat16 => convert::bf16_to_f32(*(buf as *const u16).add(i)) as f64,
            _ => unreachable!("{dt:?}"),
        }
    }
}

/// op over the ranks' values (sum, prod, max, min; avg: sum / n, exact for the integer types
/// only where it divides, so the inputs are chosen to make sums multiples of n there).
fn combine(op: i32, vals: impl Iterator<Item = f64>, n: usize, dt: DataType) -> f64 {
    use nccl::types::*;
    let v: Vec<f64> = vals.collect();
    match op {
        OP_SUM => v.iter().sum(),
        OP_PROD => v.iter().product(),
        OP_MAX => v.iter().cloned().fold(f64::MIN, f64::max),
        OP_MIN => v.iter().cloned().fold(f64::MAX, f64::min),
        OP_AVG => {
            let s: f64 = v.iter().sum();
            if dt.is_float() {
                s / n as f64
            } else {
                (s / n as f64).trunc()
            }
        }
        _ => unreachable!(),
    }
}

#[derive(Clone, Copy)]
struct Case {
    kind: CollKind,
    dtype: DataType,
    op: i32,
    count: usize,
    in_place: bool,
    root: usize,
}

/// Elements of each rank's send and receive buffers for `c` over `n` ranks.
fn sizes(c: &Case, n: usize) -> (usize, usize) {
    match c.kind {
        CollKind::AllGather => (c.count, c.count * n),
        CollKind::ReduceScatter => (c.count * n, c.count),
        CollKind::AlltoAll => (c.count * n, c.count * n),
        _ => (c.count, c.count),
    }
}

/// Each rank's send and receive buffers for `c` (the same where in place).
fn buffers(c: &Case, n: usize) -> Vec<(usize, usize)> {
    let es = c.dtype.size();
    let (ns, nr) = sizes(c, n);
    (0..n)
        .map(|r| {
            let s = buffer(ns.max(nr) * es);
            let rb = if c.in_place {
                in_place_output(c, r, s)
            } else {
                buffer(nr * es)
            };
            (s, rb)
        })
        .collect()
}

/// Where rank r's in-place output of `c` lies in its input `s`, as NCCL lays it out: a
/// reduce-scatter's at segment r, every other collective's at the input.
fn in_place_output(c: &Case, r: usize, s: usize) -> usize {
    if c.kind == CollKind::ReduceScatter {
        s + r * c.count * c.dtype.size()
    } else {
        s
    }
}

/// Rank r's inputs for `c` (salted), where the collective reads them (in place: inside the
/// output, as NCCL lays out in-place all-gathers), and a sentinel elsewhere in the output.
fn fill(c: &Case, n: usize, r: usize, (s, rb): (usize, usize), salt: usize) {
    let (ns, nr) = sizes(c, n);
    if !c.in_place {
        for i in 0..nr {
            put(c.dtype, rb, i, 99.0);
        }
    }
    let at = if c.in_place && c.kind == CollKind::AllGather {
        r * c.count
    } else {
        0
    };
    for i in 0..ns {
        put(c.dtype, s, at + i, input(r, i + salt, c.op));
    }
}

/// Rank r's calls for `c` on `stream` (Send: the ring's send to the next rank and receive from
/// the one before).
fn enqueue(
    comm: &Arc<nccl::comm::Comm>,
    c: &Case,
    n: usize,
    (s, rb): (usize, usize),
    stream: usize,
) {
    let r = comm.rank().unwrap() as usize;
    let send = if c.in_place && c.kind == CollKind::AllGather {
        s + r * c.count * c.dtype.size()
    } else {
        s
    };
    let call = |kind, send, recv, op, root: usize| CollArgs {
        kind,
        send,
        recv,
        count: c.count,
        dtype: c.dtype,
        op,
        root: root as i32,
    };
    let on = nccl::api::stream_from_handle(stream).unwrap();
    if c.kind == CollKind::Send {
        let next = call(CollKind::Send, send, 0, 0, (r + 1) % n);
        let prev = call(CollKind::Recv, 0, rb, 0, (r + n - 1) % n);
        // In a group, as NCCL asks of a rank that sends to and receives from its peers.
        nccl::api::group_start().unwrap();
        nccl::api::enqueue(comm, next, on).unwrap();
        nccl::api::enqueue(comm, prev, stream_arg(stream)).unwrap();
        nccl::api::group_end().unwrap();
    } else {
        nccl::api::enqueue(comm, call(c.kind, send, rb, c.op, c.root), on).unwrap();
    }
}

fn stream_arg(h: usize) -> nccl::api::StreamArg {
    nccl::api::stream_from_handle(h).unwrap()
}

/// A float32 send (`send` read) or receive (`recv` written) of `count` elements with `peer`.
fn p2p_f32(kind: CollKind, send: usize, recv: usize, count: usize, peer: usize) -> CollArgs {
    CollArgs {
        kind,
        send,
        recv,
        count,
        dtype: DataType::Float32,
        op: 0,
        root: peer as i32,
    }
}

/// `n` floats of a known pattern at `send`, and `recv`'s `n` set to -1 (where the pattern must
/// arrive: `pattern_arrived`).
fn pattern(send: usize, recv: usize, n: usize) {
    for i in 0..n {
        put(DataType::Float32, send, i, (i % 1000) as f64);
        put(DataType::Float32, recv, i, -1.0);
    }
}

fn pattern_arrived(recv: usize, n: usize) {
    for i in 0..n {
        assert_eq!(
            get(DataType::Float32, recv, i),
            (i % 1000) as f64,
            "element {i}"
        );
    }
}

fn describe(c: &Case, n: usize, streams: usize) -> String {
    format!(
        "{:?} {:?} op {} count {} {} over {n} ranks on {streams} stream(s)",
        c.kind,
        c.dtype,
        c.op,
        c.count,
        if c.in_place {
            "in place"
        } else {
            "out of place"
        },
    )
}

/// Every rank's output of `c` (inputs salted with `salt`), element by element.
fn verify(c: &Case, bufs: &[(usize, usize)], salt: usize, what: &str) {
    for (q, &(_, rb)) in bufs.iter().enumerate() {
        verify_rank(c, bufs.len(), q, rb, salt, what);
    }
}

/// Rank q's output `rb` of `c` over n ranks.
fn verify_rank(c: &Case, n: usize, q: usize, rb: usize, salt: usize, what: &str) {
    let (_, nr) = sizes(c, n);
    let x = |r: usize, i: usize| input(r, i + salt, c.op);
    let reduced = |i: usize| combine(c.op, (0..n).map(|r| x(r, i)), n, c.dtype);
    let expect = |i: usize| -> f64 {
        match c.kind {
            CollKind::AllReduce => reduced(i),
            CollKind::Broadcast => x(c.root, i),
            CollKind::Reduce if q == c.root => reduced(i),
            CollKind::Reduce if c.in_place => x(q, i),
            CollKind::Reduce => 99.0,
            CollKind::AllGather => x(i / c.count, i % c.count),
            CollKind::ReduceScatter => reduced(q * c.count + i),
            CollKind::AlltoAll => x(i / c.count, q * c.count + i % c.count),
            CollKind::Send => x((q + n - 1) % n, i),
            k => unreachable!("{k:?}"),
        }
    };
    // Exact, but for a float average over a count of ranks that is not a power of two: NCCL
    // multiplies each input by 1/n (rounded) before the sum, so the result may be a few units
    // in the last place from sum / n.
    let slack = if c.op == nccl::types::OP_AVG && !n.is_power_of_two() {
        let eps = match c.dtype {
            DataType::Float16 => 2f64.powi(-10),
            DataType::Bfloat16 => 2f64.powi(-7),
            DataType::Float32 => 2f64.powi(-23),
            _ => 2f64.powi(-52),
        };
        2.0 * n as f64 * eps
    } else {
        0.0
    };
    for i in 0..nr {
        let (got, want) = (get(c.dtype, rb, i), expect(i));
        assert!(
            got == want || (got - want).abs() <= slack * want.abs().max(1.0),
            "{what}: rank {q} element {i}: {got}, expected {want}"
        );
    }
}

fn sync_all(streams: &[usize], what: &str) {
    for &s in streams {
        assert!(sync(s, Duration::from_secs(120)), "{what}: stuck");
    }
}

fn no_async_error(comms: &[Arc<nccl::comm::Comm>], what: &str) {
    for comm in comms {
        let e = nccl::api::comm_async_error(comm);
        assert_eq!(e, nccl::error::Code::Success, "{what}");
    }
}

/// Holds the queues of the streams `held` behind a gate while `enqueue` puts work on them (and
/// others), for `hold`, then lets them run: the work on `streams` must finish (`waited`) and
/// leave `comms` without an error (`healthy`).
fn behind_gates(
    (held, streams): (&[usize], &[usize]),
    comms: &[Arc<nccl::comm::Comm>],
    hold: Duration,
    enqueue: impl FnOnce(),
    (waited, healthy): (&str, &str),
) {
    let gates: Vec<_> = held.iter().map(|&s| device::gate(s)).collect();
    enqueue();
    std::thread::sleep(hold);
    for g in &gates {
        device::open_gate(g);
    }
    sync_all(streams, waited);
    no_async_error(comms, healthy);
}

/// Runs `c` on `comms` (rank r on `streams[r]`, one group) and checks every rank's output.
fn check(comms: &[Arc<nccl::comm::Comm>], streams: &[usize], c: &Case) {
    check_in(comms, streams, c, &buffers(c, comms.len()));
}

/// The cases `cs` in one group (one launch per stage where the ranks share a stream), each
/// checked.
fn check_together(comms: &[Arc<nccl::comm::Comm>], streams: &[usize], cs: &[Case]) {
    let bufs: Vec<_> = cs.iter().map(|c| buffers(c, comms.len())).collect();
    let group: Vec<_> = cs
        .iter()
        .zip(&bufs)
        .map(|(c, b)| (c, b.as_slice()))
        .collect();
    check_group(comms, streams, &group);
}

/// `check` in the buffers `bufs`.
fn check_in(comms: &[Arc<nccl::comm::Comm>], streams: &[usize], c: &Case, bufs: &[(usize, usize)]) {
    check_group(comms, streams, &[(c, bufs)]);
}

/// Each case of `group` in its buffers (rank r's at index r), every rank's calls in one group;
/// each output checked.
fn check_group(
    comms: &[Arc<nccl::comm::Comm>],
    streams: &[usize],
    group: &[(&Case, &[(usize, usize)])],
) {
    let n = comms.len();
    for &(c, bufs) in group {
        for (r, b) in bufs.iter().enumerate() {
            fill(c, n, r, *b, 0);
        }
    }
    nccl::api::group_start().unwrap();
    for &(c, bufs) in group {
        for (r, comm) in comms.iter().enumerate() {
            enqueue(comm, c, n, bufs[r], streams[r]);
        }
    }
    nccl::api::group_end().unwrap();
    let on = streams.iter().collect::<BTreeSet<_>>().len();
    let what: Vec<String> = group.iter().map(|(c, _)| describe(c, n, on)).collect();
    let what = match what.as_slice() {
        [one] => one.clone(),
        all => format!("in one group: {}", all.join("; ")),
    };
    sync_all(streams, &what);
    no_async_error(comms, &what);
    for &(c, bufs) in group {
        verify(c, bufs, 0, &what);
    }
}

/// A stream of the caller's (with two devices, `device::OWNED`, of the thread's current
/// context, where it has one).
fn new_stream() -> usize {
    let h = NEXT.fetch_add(1, Ordering::SeqCst) as usize;
    let ctx = device::current_ctx();
    if device::OWNED.load(Ordering::SeqCst) && ctx != 0 {
        device::own(h, ctx);
    }
    h
}

/// A float32 sum all-reduce of `count` elements, out of place.
fn f32_sum(count: usize) -> Case {
    Case {
        kind: CollKind::AllReduce,
        dtype: DataType::Float32,
        op: nccl::types::OP_SUM,
        count,
        in_place: false,
        root: 0,
    }
}

/// Each rank in a thread of its own (`ncclCommInitRank`), launching and waiting on its own
/// stream, several operations in a row. With `null_first`, each first tries the NULL stream:
/// on a GPU the legacy stream would run their kernels one after the other, each waiting for
/// ever for the next; so that launch is `ncclInvalidUsage` saying why, before anything is
/// enqueued, and the communicators stay usable.
fn threads(n: usize, c: &Case, null_first: bool) {
    let id = nccl::api::get_unique_id().unwrap();
    let bufs = buffers(c, n);
    let rounds = if null_first { 1 } else { 3 };
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            let b = bufs[r];
            let c = *c;
            std::thread::spawn(move || {
                let comm = nccl::api::comm_init_rank(n as i32, &id, r as i32, Default::default())
                    .expect("a rank in a thread");
                if null_first {
                    let args = CollArgs {
                        kind: c.kind,
                        send: b.0,
                        recv: b.1,
                        count: c.count,
                        dtype: c.dtype,
                        op: c.op,
                        root: c.root as i32,
                    };
                    let e = nccl::api::enqueue(&comm, args, stream_arg(0)).expect_err("refused");
                    assert_eq!(e.code, nccl::error::Code::InvalidUsage, "{}", e.msg);
                    assert!(e.msg.contains("NULL stream"), "{}", e.msg);
                }
                let stream = new_stream();
                for salt in 0..rounds {
                    fill(&c, n, r, b, salt);
                    enqueue(&comm, &c, n, b, stream);
                    sync_all(&[stream], "threads");
                }
                no_async_error(std::slice::from_ref(&comm), "threads");
                comm
            })
        })
        .collect();
    let comms: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    let how = if null_first {
        ", after the NULL stream"
    } else {
        ""
    };
    verify(
        c,
        &bufs,
        rounds - 1,
        &format!("{}, a thread per rank{how}", describe(c, n, n)),
    );
    for c in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
    }
    release_buffers();
}

/// Ranks 1 and 2 of 4 on the one device, a send and its receive in one group on the NULL
/// stream: the launch holds every rank they need, so it runs (ranks 0 and 3 sit out).
fn two_of_four_on_null(comms: &[Arc<nccl::comm::Comm>]) {
    let count = 100_003;
    let send = buffer(count * 4);
    let recv = buffer(count * 4);
    pattern(send, recv, count);
    let p2p = |kind, peer| p2p_f32(kind, send, recv, count, peer);
    nccl::api::group_start().unwrap();
    nccl::api::enqueue(&comms[1], p2p(CollKind::Send, 2), stream_arg(0)).unwrap();
    nccl::api::enqueue(&comms[2], p2p(CollKind::Recv, 1), stream_arg(0)).unwrap();
    nccl::api::group_end().expect("ranks 1 and 2 alone on the NULL stream");
    sync_all(&[0], "ranks 1 and 2 of 4 on the NULL stream");
    no_async_error(comms, "ranks 1 and 2 of 4 on the NULL stream");
    pattern_arrived(recv, count);
    release_buffers();
}

/// Collectives in `ncclMemAlloc` memory (cuMemCreate, reserved, mapped, made accessible), and
/// `ncclMemFree` giving it back.
fn mem_alloc_buffers(comms: &[Arc<nccl::comm::Comm>], streams: &[usize]) {
    let n = comms.len();
    let mapped = device::MAPPED.load(Ordering::SeqCst);
    for c in cases(n, &[300_001]).iter().take(4) {
        let (ns, nr) = sizes(c, n);
        let es = c.dtype.size();
        let bufs: Vec<(usize, usize)> = (0..n)
            .map(|r| {
                let s = nccl::api::mem_alloc(ns.max(nr) * es).expect("ncclMemAlloc");
                let rb = if c.in_place {
                    in_place_output(c, r, s)
                } else {
                    nccl::api::mem_alloc(nr * es).expect("ncclMemAlloc")
                };
                (s, rb)
            })
            .collect();
        check_in(comms, streams, c, &bufs);
        for &(s, rb) in &bufs {
            nccl::api::mem_free(s).expect("ncclMemFree");
            if !c.in_place {
                nccl::api::mem_free(rb).expect("ncclMemFree");
            }
        }
    }
    assert!(
        device::MAPPED.load(Ordering::SeqCst) > mapped,
        "ncclMemAlloc did not take cuMemCreate memory"
    );
}

/// The kernels only larger launches take: the direct all-reduce of more than 4 ranks
/// (`oxccl_direct16`), and a group of 60 sends and receives
/// between two ranks, whose descriptor is past 4000 bytes (`oxccl_run_large`).
fn large_launches(streams: &[usize]) {
    use nccl::types::OP_MAX;
    let comms = nccl::api::comm_init_all(&[0; 6]).expect("six ranks");
    for (dtype, op) in [
        (DataType::Float32, nccl::types::OP_SUM),
        (DataType::Bfloat16, OP_MAX),
    ] {
        let c = Case {
            kind: CollKind::AllReduce,
            dtype,
            op,
            count: 1001,
            in_place: false,
            root: 0,
        };
        check(&comms, &[streams[0]; 6], &c);
    }
    for c in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
    }

    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
    let (pairs, count) = (60, 16);
    let send = buffer(pairs * count * 4);
    let recv = buffer(pairs * count * 4);
    pattern(send, recv, pairs * count);
    nccl::api::group_start().unwrap();
    for k in 0..pairs {
        let at = 4 * count * k;
        let to = p2p_f32(CollKind::Send, send + at, 0, count, 1);
        let from = p2p_f32(CollKind::Recv, 0, recv + at, count, 0);
        nccl::api::enqueue(&comms[0], to, stream_arg(streams[0])).unwrap();
        nccl::api::enqueue(&comms[1], from, stream_arg(streams[1])).unwrap();
    }
    nccl::api::group_end().unwrap();
    sync_all(&streams[..2], "60 sends and receives");
    no_async_error(&comms, "60 sends and receives");
    pattern_arrived(recv, pairs * count);
    for c in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
    }
    release_buffers();
}

/// Waits until `comm` reports an asynchronous error (at most 30 s); its code.
fn async_error(comm: &Arc<nccl::comm::Comm>) -> nccl::error::Code {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let e = nccl::api::comm_async_error(comm);
        if e != nccl::error::Code::Success || Instant::now() > until {
            return e;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Two ranks' calls in one group, rank r's `calls[r]` in `bufs[r]` on `streams[r]`: what
/// `ncclGroupEnd` returned.
fn pair(
    comms: &[Arc<nccl::comm::Comm>],
    calls: [&Case; 2],
    bufs: &[(usize, usize)],
    streams: &[usize],
) -> nccl::error::Result<()> {
    nccl::api::group_start().unwrap();
    for r in 0..2 {
        enqueue(&comms[r], calls[r], 2, bufs[r], streams[r]);
    }
    nccl::api::group_end()
}

/// Rank 0 of `comms` launches `c` in `buf` on `stream`, and its peer never comes: the launch
/// does not end, and `ncclCommAbort` stops it within seconds.
fn aborted_alone(comms: &[Arc<nccl::comm::Comm>], c: &Case, buf: (usize, usize), stream: usize) {
    enqueue(&comms[0], c, comms.len(), buf, stream);
    assert!(
        !sync(stream, Duration::from_millis(300)),
        "done without its peer"
    );
    let t = Instant::now();
    nccl::api::comm_abort(nccl::api::comm_handle(&comms[0])).expect("abort");
    assert!(
        sync(stream, Duration::from_secs(10)),
        "the kernel went on after the abort"
    );
    assert!(t.elapsed() < Duration::from_secs(10));
}

/// After a failure: the streams drain, every communicator reports an error (`code`, where
/// given), then they are aborted.
fn failed(
    comms: &[Arc<nccl::comm::Comm>],
    streams: &[usize],
    code: Option<nccl::error::Code>,
    what: &str,
) {
    sync_all(streams, what);
    for c in comms {
        match code {
            Some(code) => assert_eq!(async_error(c), code, "{what}"),
            None => assert_ne!(async_error(c), nccl::error::Code::Success, "{what}"),
        }
    }
    for c in comms {
        let _ = nccl::api::comm_abort(nccl::api::comm_handle(c));
    }
}

/// Failures end in errors on the device too. Ranks that make different calls: the kernel that
/// receives the other call's data stops, and both communicators fail with ncclInvalidUsage
/// naming both calls, their streams drained. A rank whose peer never launches: its kernel waits
/// until `ncclCommAbort` stops it.
fn failures() {
    use nccl::error::Code;
    use nccl::types::OP_SUM;
    // The ring's failures (a group of both ranks' all-reduces is otherwise one launch).
    std::env::set_var("OXCCL_CUDA_DIRECT", "0");
    nccl::param::reread();
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
    let streams = [new_stream(), new_stream()];
    let calls = [CollKind::AllReduce, CollKind::Broadcast].map(|kind| Case {
        kind,
        dtype: DataType::Float32,
        op: OP_SUM,
        count: 1001,
        in_place: false,
        root: 0,
    });
    let bufs = [buffers(&calls[0], 2)[0], buffers(&calls[1], 2)[1]];
    pair(&comms, [&calls[0], &calls[1]], &bufs, &streams).unwrap();
    failed(
        &comms,
        &streams,
        Some(Code::InvalidUsage),
        "mismatched calls",
    );
    // ncclGetLastError's message (the watcher that found the kernel's error set it).
    let msg = nccl::error::last_error();
    assert!(
        msg.contains("a peer sent data of")
            && msg.contains("AllReduce")
            && msg.contains("Broadcast"),
        "{msg}"
    );

    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
    let alone = calls[0];
    aborted_alone(&comms, &alone, buffers(&alone, 2)[0], streams[0]);
    nccl::api::comm_abort(nccl::api::comm_handle(&comms[1])).expect("abort");

    // A peer rank of this process that destroys its communicator while this rank's kernel
    // waits for it, their connections in device memory: the kernel stops, and the
    // communicator fails, within seconds (the host copy of the header says the end closed).
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
    let bufs = buffers(&alone, 2);
    pair(&comms, [&alone; 2], &bufs, &streams).unwrap();
    sync_all(&streams, "the connections made");
    enqueue(&comms[0], &alone, 2, bufs[0], streams[0]);
    nccl::api::comm_destroy(nccl::api::comm_handle(&comms[1])).expect("destroy");
    assert!(
        sync(streams[0], Duration::from_secs(20)),
        "the kernel still waits for a peer that destroyed its communicator"
    );
    assert_ne!(
        async_error(&comms[0]),
        Code::Success,
        "a peer that destroyed its communicator"
    );
    let _ = nccl::api::comm_abort(nccl::api::comm_handle(&comms[0]));

    // A launch the driver refuses: the group's call fails with ncclUnhandledCudaError naming
    // the driver's error, and the peer, whose kernel runs and waits for it, is told and stops
    // (the ring: each rank's launch on its stream).
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
    let bufs = buffers(&calls[0], 2);
    device::FAIL_LAUNCH_ON.store(streams[1] as u64, Ordering::SeqCst);
    let e = pair(&comms, [&calls[0]; 2], &bufs, &streams).expect_err("a launch the driver refused");
    assert_eq!(e.code, Code::UnhandledCudaError, "{}", e.msg);
    assert!(e.msg.contains("stand-in error"), "{}", e.msg);
    failed(&comms, &streams, None, "a refused launch");
    // The direct all-reduce's one launch (on rank 0's stream) refused: the call fails alike,
    // but nothing ran and no peer waits, so the communicators stay well and the call, made
    // again, is right.
    std::env::remove_var("OXCCL_CUDA_DIRECT");
    nccl::param::reread();
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
    device::FAIL_LAUNCH_ON.store(streams[0] as u64, Ordering::SeqCst);
    let e = pair(&comms, [&calls[0]; 2], &bufs, &streams).expect_err("a refused direct launch");
    assert_eq!(e.code, Code::UnhandledCudaError, "{}", e.msg);
    assert!(
        e.msg.contains("stand-in error") && e.msg.contains("direct all-reduce"),
        "{}",
        e.msg
    );
    sync_all(&streams, "a refused direct launch");
    no_async_error(&comms, "a refused direct launch");
    check_in(&comms, &streams, &calls[0], &bufs);
    for c in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
    }
    std::env::set_var("OXCCL_CUDA_DIRECT", "0");
    nccl::param::reread();

    // Device memory for a connection the driver cannot give (an all-to-all's connections are
    // made at its first launch; between ranks of one process, in device memory): an error
    // naming it, on the group's call and on both communicators, and nothing waits.
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
    let all_to_all = Case {
        kind: CollKind::AlltoAll,
        ..calls[0]
    };
    let bufs = buffers(&all_to_all, 2);
    device::FAIL_ALLOC.store(true, Ordering::SeqCst);
    let e =
        pair(&comms, [&all_to_all; 2], &bufs, &streams).expect_err("no memory for a connection");
    assert!(
        !device::FAIL_ALLOC.load(Ordering::SeqCst),
        "no allocation was made"
    );
    assert!(e.msg.contains("cuMemAlloc"), "{}", e.msg);
    failed(&comms, &streams, None, "no memory for a connection");
    std::env::remove_var("OXCCL_CUDA_DIRECT");
    nccl::param::reread();
    misaligned(&streams);
    release_buffers();
}

/// A reduction's buffer that is not aligned to its datatype (a GPU faults on such an element,
/// and the fault spoils the context): `ncclInvalidArgument` naming it, before anything is
/// enqueued, and the communicators stay well. A copy takes any address: a broadcast of
/// float32s between odd byte addresses arrives byte for byte.
fn misaligned(streams: &[usize]) {
    use nccl::error::Code;
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
    let c = f32_sum(1001);
    let bufs = buffers(&c, 2);
    for (send, recv, what) in [
        (bufs[0].0 + 2, bufs[0].1, "sendbuff"),
        (bufs[0].0, bufs[0].1 + 1, "recvbuff"),
    ] {
        let args = CollArgs {
            kind: CollKind::AllReduce,
            send,
            recv,
            count: c.count,
            dtype: DataType::Float32,
            op: nccl::types::OP_SUM,
            root: 0,
        };
        let e = nccl::api::enqueue(&comms[0], args, stream_arg(streams[0]))
            .expect_err("a misaligned all-reduce");
        assert_eq!(e.code, Code::InvalidArgument, "{}", e.msg);
        assert!(
            e.msg.contains(what) && e.msg.contains("not aligned") && e.msg.contains("4 bytes"),
            "{}",
            e.msg
        );
    }
    sync_all(streams, "refused calls");
    no_async_error(&comms, "refused calls");
    check_in(&comms, streams, &c, &bufs);

    let bytes = 4 * 1001;
    let (src, dst) = (
        buffer(bytes + 8) + 1,
        [buffer(bytes + 8) + 3, buffer(bytes + 8) + 5],
    );
    for i in 0..bytes {
        // SAFETY: `buffer` gave bytes + 8 bytes from src - 1.
        unsafe { *((src + i) as *mut u8) = (i * 7 % 251) as u8 };
    }
    nccl::api::group_start().unwrap();
    for (r, comm) in comms.iter().enumerate() {
        let args = CollArgs {
            kind: CollKind::Broadcast,
            send: src,
            recv: dst[r],
            count: 1001,
            dtype: DataType::Float32,
            op: 0,
            root: 0,
        };
        nccl::api::enqueue(comm, args, stream_arg(streams[r])).unwrap();
    }
    nccl::api::group_end().unwrap();
    sync_all(streams, "a broadcast between odd addresses");
    no_async_error(&comms, "a broadcast between odd addresses");
    for (r, &d) in dst.iter().enumerate() {
        for i in 0..bytes {
            // SAFETY: as above.
            let got = unsafe { *((d + i) as *const u8) };
            assert_eq!(got, (i * 7 % 251) as u8, "rank {r}'s byte {i}");
        }
    }
    for c in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
    }
}

/// `OXCCL_CUDA_CHANNELS=4` on the ring (`OXCCL_CUDA_DIRECT=0`): the fourth ring's connections
/// are made at init; large all-reduces, broadcasts and reduces (parts of several blocks per
/// lane) split across rings that run at once, on each rank's stream and on one stream for all
/// ranks, each element checked; with `OXCCL_CUDA_FENCE=gpu` (device-scope step fences, the
/// same as the others on this emulation: the flag's path). On 8 ranks, 3 channels fit.
fn channels() {
    use nccl::transport::{Class, ConnKey};
    std::env::set_var("OXCCL_CUDA_DIRECT", "0");
    std::env::set_var("OXCCL_CUDA_CHANNELS", "4");
    std::env::set_var("OXCCL_CUDA_FENCE", "gpu");
    nccl::param::reread();
    for n in [2usize, 3] {
        let comms = nccl::api::comm_init_all(&vec![0; n]).expect("ranks on one device");
        let core = comms[0].core().expect("rank 0");
        assert!(
            core.conns
                .bound(ConnKey::new(1, true, Class::Ring3))
                .is_ok(),
            "{n} ranks: the fourth ring is not connected at init"
        );
        let own: Vec<usize> = (0..n).map(|_| new_stream()).collect();
        let one = vec![new_stream(); n];
        let mut cases: Vec<Case> = cases(n, &[2_500_001])
            .into_iter()
            .filter(|c| {
                c.count == 2_500_001
                    && matches!(
                        c.kind,
                        CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce
                    )
            })
            .collect();
        cases.push(Case {
            kind: CollKind::AllReduce,
            dtype: DataType::Bfloat16,
            op: nccl::types::OP_MAX,
            count: 600_007,
            in_place: false,
            root: 0,
        });
        let fenced = device::GPU_FENCE_LAUNCHES.load(Ordering::SeqCst);
        for c in &cases {
            check(&comms, &own, c);
            check(&comms, &one, c);
            release_buffers();
        }
        assert!(
            device::GPU_FENCE_LAUNCHES.load(Ordering::SeqCst) > fenced,
            "{n} ranks: no launch asked for device-scope fences"
        );
        for c in &comms {
            nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
        }
    }
    // 8 ranks: a launch of 4 channels would pass the ordinary kernel parameter, so 3 are
    // used, and only their rings are connected.
    let comms = nccl::api::comm_init_all(&[0; 8]).expect("ranks on one device");
    let core = comms[0].core().expect("rank 0");
    assert_eq!(core.exec.channels(), 3);
    let bound = |c| core.conns.bound(ConnKey::new(1, true, c)).is_ok();
    assert!(
        bound(Class::Ring2),
        "8 ranks: the third ring is not connected at init"
    );
    assert!(
        !bound(Class::Ring3),
        "8 ranks: a fourth ring that is never used"
    );
    for c in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
    }
    std::env::remove_var("OXCCL_CUDA_DIRECT");
    std::env::remove_var("OXCCL_CUDA_CHANNELS");
    std::env::remove_var("OXCCL_CUDA_FENCE");
    nccl::param::reread();
}

/// The collectives checked: every one, large enough for several slices and blocks per lane,
/// and at an odd count (tails, unaligned shares), f32 sums in and out of place; then all-reduces
/// of other datatypes with every operator.
fn cases(n: usize, counts: &[usize]) -> Vec<Case> {
    use nccl::types::{OP_AVG, OP_MAX, OP_MIN, OP_PROD, OP_SUM};
    let mut cases = Vec::new();
    for &count in counts {
        for kind in [
            CollKind::AllReduce,
            CollKind::Broadcast,
            CollKind::Reduce,
            CollKind::AllGather,
            CollKind::ReduceScatter,
            CollKind::AlltoAll,
            CollKind::Send,
        ] {
            for in_place in [false, true] {
                cases.push(Case {
                    kind,
                    dtype: DataType::Float32,
                    op: OP_SUM,
                    count,
                    in_place,
                    root: n - 1,
                });
            }
        }
    }
    for dtype in [
        DataType::Float64,
        DataType::Int32,
        DataType::Int8,
        DataType::Float16,
        DataType::Bfloat16,
    ] {
        for op in [OP_SUM, OP_PROD, OP_MAX, OP_MIN, OP_AVG] {
            if op == OP_AVG && !dtype.is_float() {
                continue;
            }
            cases.push(Case {
                kind: CollKind::AllReduce,
                dtype,
                op,
                count: 5000,
                in_place: false,
                root: 0,
            });
        }
    }
    cases
}

/// Installs the stand-in driver with the kernels at `so`; the kernel cache directory made.
fn start(so: &Path) -> PathBuf {
    device::load_emu(so);
    let cache = stand_in::stand_in_kernels("cuda-emu");
    // `OXEMU_PEERS`: two devices (`peer_devices`).
    let api = match std::env::var("OXEMU_PEERS") {
        Ok(how) => {
            peers::NATIVE_ATOMICS.store(!how.starts_with("pcie"), Ordering::SeqCst);
            peers::REFUSE_PEER_ACCESS.store(how == "refused", Ordering::SeqCst);
            device::OWNED.store(true, Ordering::SeqCst);
            device::stand_in_with(&peers::functions())
        }
        Err(_) => device::stand_in(),
    };
    assert!(driver::install(api), "a driver was loaded already");
    assert_eq!(nccl::gpu::kind(), nccl::gpu::Kind::Cuda);
    cache
}

/// A device that runs only as many blocks at once as the ranks on it (`OXEMU_RESIDENT`, in a
/// process of its own so that its kernels are loaded for it): 4, then 2; launches with more
/// lanes than that still end. Then 16, for four communicators' boards
/// (`board::boards_share_the_device`).
fn few_blocks(so: &Path) {
    for (ranks, cases) in [("4", 6), ("2", 2), ("16", 1)] {
        // Killed at the deadline: a launch whose first blocks wait for ones that never start.
        // (16 KiB slots: a FIFO of 128 KiB, below every lane's bytes.)
        let (ok, report) = child(
            so,
            &[("OXEMU_RESIDENT", ranks), ("OXCCL_CHUNK_BYTES", "16384")],
            Duration::from_secs(240),
        );
        assert!(
            ok && report.contains(&format!("few blocks: {cases} cases")),
            "a device running {ranks} blocks at once:\n{report}"
        );
    }
}

/// `OXCCL_TIMEOUT_S` on connections in device memory (in a process of its own, whose
/// environment sets it from the start): a rank of one process whose peer never launches has
/// its kernel stopped and its communicator failed once its kernels have waited that long for
/// the same step of a connection the host cannot read (the ring, `OXCCL_CUDA_DIRECT=0`), or
/// for the peer's arrival on the device board (the default). With one hardware queue
/// (`CUDA_DEVICE_MAX_CONNECTIONS=1`), a WARN says that ranks launching apart share it.
fn stall(so: &Path) {
    let (ok, report) = child(
        so,
        &[
            ("OXEMU_STALL", "1"),
            ("OXCCL_TIMEOUT_S", "2"),
            ("OXCCL_WATCHDOG_S", "1"),
            ("NCCL_DEBUG", "WARN"),
            ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
        ],
        Duration::from_secs(120),
    );
    assert!(
        ok && report.contains("stall: stopped") && report.contains("a stuck destroy returned"),
        "a peer that never launches, OXCCL_TIMEOUT_S=2:\n{report}"
    );
    // The watchdog named the wait before the timeout ended it, once per stalled communicator
    // (the ring's, then the board's).
    let said = report
        .lines()
        .filter(|l| {
            l.contains("NCCL WARN watchdog: ")
                && l.contains("its kernels have waited 1 s for a peer that does not move")
        })
        .count();
    assert_eq!(said, 2, "the watchdog on a stall:\n{report}");
    // Two ranks on the GPU launching apart, one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1):
    // a WARN per communicator that launched so.
    let queues = report
        .lines()
        .filter(|l| {
            l.contains("NCCL WARN")
                && l.contains(
                    "2 ranks of this communicator on this GPU in this process launch apart",
                )
                && l.contains("its 1 hardware queues (CUDA_DEVICE_MAX_CONNECTIONS)")
        })
        .count();
    assert!(queues >= 2, "shared hardware queues:\n{report}");
}

/// `stall`'s process.
fn stall_process() {
    let cache = start(Path::new(&std::env::var("OXEMU_LIB").unwrap()));
    for (direct, says) in [("0", "wait for step"), ("1", "on the device board")] {
        std::env::set_var("OXCCL_CUDA_DIRECT", direct);
        nccl::param::reread();
        let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
        let c = f32_sum(1001);
        let bufs = buffers(&c, 2);
        let stream = new_stream();
        let t = Instant::now();
        enqueue(&comms[0], &c, 2, bufs[0], stream);
        assert!(
            sync(stream, Duration::from_secs(60)),
            "the kernel still waits for a peer that never launched"
        );
        let e = async_error(&comms[0]);
        let msg = nccl::error::last_error();
        assert_eq!(e, nccl::error::Code::Timeout, "{msg}");
        assert!(
            msg.contains("OXCCL_TIMEOUT_S") && msg.contains(says),
            "{msg}"
        );
        assert!(
            t.elapsed() >= Duration::from_secs(2),
            "before the timeout: {msg}"
        );
        for comm in &comms {
            let _ = nccl::api::comm_abort(nccl::api::comm_handle(comm));
        }
        println!("stall: stopped after {:?}: {msg}", t.elapsed());
    }
    stuck_destroy();
    let _ = std::fs::remove_dir_all(&cache);
}

/// The ranks' kernels cannot run (queued behind a kernel of the caller's that does not end: a
/// gate) when their communicators are destroyed: each destroy waits (twice OXCCL_TIMEOUT_S,
/// then 5 s after telling them to stop), leaves what they use allocated, and returns
/// (`ncclTimeout`, saying so); from
/// then on nothing is freed (the spares stay), since a free would wait for those kernels: the
/// last communicator's destroy returns at once instead of hanging in the frees.
fn stuck_destroy() {
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
    // (One more, destroyed first, whose control block goes to the spares.)
    let one = nccl::api::comm_init_all(&[0]).expect("one rank");
    nccl::api::comm_destroy(nccl::api::comm_handle(&one[0])).unwrap();
    drop(one);
    assert!(!nccl::exec::cuda::spare::held().0.is_empty(), "no spare");
    let c = f32_sum(1001);
    let bufs = buffers(&c, 2);
    let stream = new_stream();
    let gate = device::gate(stream);
    nccl::api::group_start().unwrap();
    for (r, comm) in comms.iter().enumerate() {
        enqueue(comm, &c, 2, bufs[r], stream);
    }
    nccl::api::group_end().unwrap();
    let t = Instant::now();
    for comm in comms {
        // (It says its kernels did not finish in time.)
        if let Err(e) = nccl::api::comm_destroy(nccl::api::comm_handle(&comm)) {
            assert_eq!(e.code, nccl::error::Code::Timeout, "a stuck destroy: {e}");
        }
    }
    let took = t.elapsed();
    let illegal = std::mem::take(&mut *device::ILLEGAL.lock());
    assert!(illegal.is_empty(), "{illegal:?}");
    assert!(
        !nccl::exec::cuda::spare::held().0.is_empty(),
        "spares freed after a destroy left kernels running"
    );
    device::open_gate(&gate);
    assert!(
        sync(stream, Duration::from_secs(60)),
        "the kernels never ended"
    );
    println!("stall: a stuck destroy returned after {took:?}");
}

/// Runs this test in a process of its own with `vars` set (the first says what it runs),
/// killed after `limit`: whether it succeeded, and its exit status and output.
fn child(so: &Path, vars: &[(&str, &str)], limit: Duration) -> (bool, String) {
    // To a file: a pipe nobody reads until the end could fill and stop the process.
    let log = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "cuda-emu-{}-{}.log",
        vars[0].0,
        std::process::id()
    ));
    let out = std::fs::File::create(&log).unwrap();
    let mut kid = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "cuda_executor_on_emulated_kernels",
            "--nocapture",
        ])
        .env_remove("NCCL_DEBUG")
        .envs(vars.iter().copied())
        .env("OXEMU_LIB", so)
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline && kid.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = kid.kill();
    let status = kid.wait().unwrap();
    let report = format!(
        "{status}\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let _ = std::fs::remove_file(&log);
    (status.success(), report)
}

/// Ranks on two devices, where the stand-in driver has two (`peers`): of one process
/// (`ncclCommInitAll` of devices 0, 1, 0, 1: every ring hop crosses them), each collective
/// checked, in a process of its own; and a process per rank, rank r on device r % 2, with
/// `OXCCL_CUDA_IPC=1`. Their connections live in the receiving rank's device memory: in one
/// process the two devices' contexts enable peer access to each other, between processes the
/// sending rank opens it by its IPC handle; without native peer atomics (plain PCIe) a sending
/// lane runs one block (the stand-in refuses more, `peers::launch`). PCIe pairs must be near
/// enough for `NCCL_P2P_LEVEL` on a sysfs tree made here (`OXCCL_SYSFS_ROOT`): under one
/// switch by default, through the host bridge with `PHB`, never with `NVL`; farther pairs
/// stage in host memory, and so, rather than fail, do ranks of one process where the driver
/// refuses to enable peer access (too many peers).
fn peer_devices(so: &Path) {
    // The two devices' places on a PCIe tree of sysfs's form: under one switch (PIX), or on
    // two root ports (PHB).
    let trees =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("sysfs-{}", std::process::id()));
    for (tree, second) in [
        ("pix", "0000:00:01.0/0000:01:00.0/0000:02:01.0"),
        ("phb", "0000:00:02.0"),
    ] {
        let root = trees.join(tree);
        for (id, under) in [
            ("0000:03:00.0", "0000:00:01.0/0000:01:00.0/0000:02:00.0"),
            ("0000:04:00.0", second),
        ] {
            let dev = root.join("devices/pci0000:00").join(under).join(id);
            std::fs::create_dir_all(&dev).unwrap();
            std::fs::write(dev.join("numa_node"), "0\n").unwrap();
            let link = root.join("bus/pci/devices");
            std::fs::create_dir_all(&link).unwrap();
            std::os::unix::fs::symlink(&dev, link.join(id)).unwrap();
        }
    }
    // (how, tree, NCCL_P2P_LEVEL): PCIe under one switch takes device memory by default,
    // through the CPU only where the level allows it; NVL allows NVLink only.
    for (how, tree, level) in [
        ("nvlink", "phb", ""),
        ("pcie", "pix", ""),
        ("pcie-phb", "phb", ""),
        ("pcie-phb-level", "phb", "PHB"),
        ("pcie-nvl", "pix", "NVL"),
        ("refused", "pix", ""),
    ] {
        let root = trees.join(tree);
        let root = root.to_str().unwrap();
        let vars = [
            ("OXEMU_PEERS", how),
            ("NCCL_P2P_LEVEL", level),
            ("OXCCL_SYSFS_ROOT", root),
        ];
        let (ok, report) = child(so, &vars, Duration::from_secs(300));
        assert!(
            ok && report.contains(&format!("peer devices ({how}): checked")),
            "ranks on two devices ({how}):\n{report}"
        );
        // A process per rank, by CUDA IPC where the pair qualifies (on two root ports by
        // default it does not: both stage in host memory, opening nothing).
        let shares = match how {
            "nvlink" | "pcie" => true,
            "pcie-phb" => false,
            _ => continue,
        };
        // (The rank processes inherit it.)
        std::env::set_var("OXCCL_SYSFS_ROOT", root);
        // (By default: OXCCL_CUDA_IPC unset.)
        let opened = run_processes(so, 2, None, 1, None, Some(how));
        std::env::remove_var("OXCCL_SYSFS_ROOT");
        assert_eq!(
            opened > 0,
            shares,
            "processes on two devices ({how}): {opened} IPC handles opened"
        );
    }
    let _ = std::fs::remove_dir_all(&trees);
}

/// `peer_devices`' process.
fn peer_devices_process(how: &str) {
    let cache = start(Path::new(&std::env::var("OXEMU_LIB").unwrap()));
    let comms = nccl::api::comm_init_all(&[0, 1, 0, 1]).expect("ranks on two devices");
    // Rank r's stream on its device, r % 2 (made in that device's context).
    let own: Vec<usize> = (0..4).map(|_| new_stream()).collect();
    for (r, &s) in own.iter().enumerate() {
        device::own(s, peers::ctx_of(r as i32 % 2));
    }
    let cases = cases(4, &[300_001, 1001]);
    for c in &cases {
        check(&comms, &own, c);
        release_buffers();
    }
    let enabled = peers::ENABLED.lock().clone();
    let allocated = peers::ALLOCATED.lock().clone();
    let (d0, d1) = (peers::ctx_of(0), peers::ctx_of(1));
    let remote = peers::REMOTE_LAUNCHES.load(Ordering::SeqCst);
    if matches!(how, "nvlink" | "pcie" | "pcie-phb-level") {
        assert!(remote > 0, "no launch over the other device's memory");
        for pair in [(d0, d1), (d1, d0)] {
            assert!(
                enabled.contains(&pair),
                "no peer access {pair:x?}: {enabled:x?}"
            );
        }
        // The ring's connections, on both devices (each in its receiving end's).
        for d in [d0, d1] {
            assert!(
                allocated.iter().any(|&(c, _)| c == d),
                "no device memory on {d:#x}: {allocated:x?}"
            );
        }
    } else {
        assert!(
            enabled.is_empty() && remote == 0,
            "peer access where it is refused or not allowed: {enabled:x?}, {remote} launches"
        );
    }
    for c in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
    }
    let faults: Vec<String> = device::ILLEGAL
        .lock()
        .iter()
        .chain(peers::NO_PEER_ACCESS.lock().iter())
        .cloned()
        .collect();
    assert!(
        faults.is_empty(),
        "what the GPUs would have faulted on: {faults:?}"
    );
    let _ = std::fs::remove_dir_all(&cache);
    println!("peer devices ({how}): checked {} cases", cases.len());
}

/// `few_blocks`' process: as many ranks on the one device as it runs blocks at once, one
/// stream, so each group is one launch of all their lanes, each lane past a FIFO's depth. On 4
/// ranks: an all-to-all (4 x 7 lanes), a ring shift (4 x 2) and an all-reduce; then, on the
/// ring split across 4 channels (16 lanes), an all-reduce, a broadcast and a reduce, whose end
/// ranks have lanes on one connection and the middle ones on two (each channel's lanes must
/// come together). On 2 ranks, groups whose ranks have lanes of two classes to one peer: an
/// all-to-all with a ring shift, a broadcast (a chain) with a ring shift (the two ends of each
/// connection must come together). Each checked.
fn few_blocks_process() {
    let cache = start(Path::new(&std::env::var("OXEMU_LIB").unwrap()));
    if std::env::var("OXEMU_RESIDENT").as_deref() == Ok("16") {
        boards_share_the_device();
        let _ = std::fs::remove_dir_all(&cache);
        println!("few blocks: 1 cases");
        return;
    }
    if std::env::var("OXEMU_RESIDENT").as_deref() == Ok("2") {
        let comms = nccl::api::comm_init_all(&[0; 2]).expect("ranks on one device");
        let one = vec![new_stream(); 2];
        let case = |kind| Case {
            kind,
            ..f32_sum(300_001)
        };
        let groups = [
            [case(CollKind::AlltoAll), case(CollKind::Send)],
            [case(CollKind::Broadcast), case(CollKind::Send)],
        ];
        for g in &groups {
            check_together(&comms, &one, g);
            release_buffers();
        }
        for c in &comms {
            nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
        }
        let _ = std::fs::remove_dir_all(&cache);
        println!("few blocks: {} cases", groups.len());
        return;
    }
    let one = vec![new_stream(); 4];
    let mut checked = 0;
    for (channels, kinds) in [
        (
            "1",
            [CollKind::AlltoAll, CollKind::Send, CollKind::AllReduce],
        ),
        (
            "4",
            [CollKind::AllReduce, CollKind::Broadcast, CollKind::Reduce],
        ),
    ] {
        if channels != "1" {
            std::env::set_var("OXCCL_CUDA_DIRECT", "0");
        }
        std::env::set_var("OXCCL_CUDA_CHANNELS", channels);
        nccl::param::reread();
        let comms = nccl::api::comm_init_all(&[0; 4]).expect("ranks on one device");
        for c in cases(4, &[300_001])
            .iter()
            .filter(|c| !c.in_place && c.dtype == DataType::Float32 && kinds.contains(&c.kind))
        {
            check(&comms, &one, c);
            release_buffers();
            checked += 1;
        }
        for c in &comms {
            nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
        }
    }
    let _ = std::fs::remove_dir_all(&cache);
    println!("few blocks: {checked} cases");
}

/// Sends by reference (`NCCL_P2P_DIRECT_DISABLE` unset), in a process of its own with 16 KiB
/// slots (a FIFO of 128 KiB, below the operations' bytes per connection): between ranks of
/// one process on one device, a program that sends more than its FIFO holds sends its
/// buffers' addresses, and the receiving kernel reads them there (`desc::mark_refs`).
fn by_reference(so: &Path) {
    let (ok, report) = child(
        so,
        &[("OXEMU_REFS", "1"), ("OXCCL_CHUNK_BYTES", "16384")],
        Duration::from_secs(300),
    );
    assert!(
        ok && report.contains("by reference: "),
        "sends by reference:\n{report}"
    );
}

/// `by_reference`'s process: on the ring (`OXCCL_CUDA_DIRECT=0`), every collective over 2 and
/// 4 ranks of the one device, in and out of place, checked element by element, ranks in one
/// launch and (all-reduce) a thread per rank launching apart; the receivers took slots by
/// reference for every kind of collective. With `NCCL_P2P_DIRECT_DISABLE=1`, none.
fn by_reference_process() {
    let cache = start(Path::new(&std::env::var("OXEMU_LIB").unwrap()));
    std::env::set_var("OXCCL_CUDA_DIRECT", "0");
    nccl::param::reread();
    let mut checked = 0;
    for n in [2usize, 4] {
        let comms = nccl::api::comm_init_all(&vec![0; n]).expect("ranks on one device");
        let own: Vec<usize> = (0..n).map(|_| new_stream()).collect();
        let all = cases(n, &[300_001]);
        let mut by_kind: Vec<(CollKind, u64)> = Vec::new();
        for c in all.iter().filter(|c| c.dtype == DataType::Float32) {
            let before = device::refs_taken();
            check(&comms, &own, c);
            release_buffers();
            checked += 1;
            let took = device::refs_taken() - before;
            match by_kind.iter_mut().find(|(k, _)| *k == c.kind) {
                Some((_, t)) => *t += took,
                None => by_kind.push((c.kind, took)),
            }
        }
        // (Every kind has a step that sends a buffer as it is: a send, the first hop of a
        // reduction, a forwarded or finished slice.)
        for (kind, took) in &by_kind {
            assert!(*took > 0, "{n} ranks: no {kind:?} took a slot by reference");
        }
        let before = device::refs_taken();
        threads(n, &all[0], false);
        assert!(
            device::refs_taken() > before,
            "{n} ranks in threads: no slot by reference"
        );
        checked += 1;
        for c in &comms {
            nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
        }
    }
    revoked_refs();
    std::env::set_var("NCCL_P2P_DIRECT_DISABLE", "1");
    nccl::param::reread();
    let comms = nccl::api::comm_init_all(&[0; 2]).expect("ranks on one device");
    let own: Vec<usize> = (0..2).map(|_| new_stream()).collect();
    let before = device::refs_taken();
    for c in cases(2, &[300_001])
        .iter()
        .filter(|c| c.dtype == DataType::Float32 && !c.in_place)
    {
        check(&comms, &own, c);
        release_buffers();
        checked += 1;
    }
    assert_eq!(
        device::refs_taken(),
        before,
        "NCCL_P2P_DIRECT_DISABLE=1, yet slots went by reference"
    );
    for c in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
    }
    let _ = std::fs::remove_dir_all(&cache);
    println!(
        "by reference: {checked} cases, {} slots",
        device::refs_taken()
    );
}

/// A sender aborted while its receiver has not come: its kernel had posted a FIFO's worth of
/// slots by reference and waited for room; the abort stops it at once (it revokes the slots:
/// nothing may read its buffer once it is done). The receiver, which comes later, reads none
/// of it and fails with `ncclRemoteError` (the launch fails, or, as here, its kernel stops on
/// the revoked slot and says so).
fn revoked_refs() {
    let comms = nccl::api::comm_init_all(&[0; 2]).expect("ranks on one device");
    let streams = [new_stream(), new_stream()];
    let count = 300_001;
    let (send, recv) = (buffer(count * 4), buffer(count * 4));
    // (First a send that connects the two ranks: connections are made at a first call, by
    // both ranks.)
    nccl::api::group_start().unwrap();
    let args = p2p_f32(CollKind::Send, send, 0, 1, 1);
    nccl::api::enqueue(&comms[0], args, stream_arg(streams[0])).expect("send");
    let args = p2p_f32(CollKind::Recv, 0, recv, 1, 0);
    nccl::api::enqueue(&comms[1], args, stream_arg(streams[1])).expect("receive");
    nccl::api::group_end().expect("connected");
    sync_all(&streams, "the first send");
    pattern(send, recv, count);
    let before = device::refs_taken();
    let args = p2p_f32(CollKind::Send, send, 0, count, 1);
    nccl::api::enqueue(&comms[0], args, stream_arg(streams[0])).expect("send");
    assert!(
        !sync(streams[0], Duration::from_millis(300)),
        "a send of more than a FIFO holds ended without its receiver"
    );
    nccl::api::comm_abort(nccl::api::comm_handle(&comms[0])).expect("abort");
    assert!(
        sync(streams[0], Duration::from_secs(10)),
        "the sending kernel went on after the abort"
    );
    let args = p2p_f32(CollKind::Recv, 0, recv, count, 0);
    let launched = nccl::api::enqueue(&comms[1], args, stream_arg(streams[1]));
    if launched.is_ok() {
        sync_all(&streams[1..], "the receive after its sender's abort");
        assert_eq!(
            async_error(&comms[1]),
            nccl::error::Code::RemoteError,
            "the receive from an aborted sender"
        );
    }
    eprintln!("after the sender's abort: {launched:?}");
    assert_eq!(device::refs_taken(), before, "a revoked slot was read");
    for i in 0..count {
        assert_eq!(get(DataType::Float32, recv, i), -1.0, "element {i} arrived");
    }
    let _ = nccl::api::comm_abort(nccl::api::comm_handle(&comms[1]));
    release_buffers();
}

/// Whether this process may make PID namespaces (root; CI is, and must).
fn can_unshare_pid() -> bool {
    let ok = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || std::env::var_os("CI").is_none(),
        "cannot make a PID namespace (unshare --pid)"
    );
    if !ok {
        eprintln!("SKIPPED: a peer in another PID namespace (unshare --pid needs root)");
    }
    ok
}

#[test]
fn cuda_executor_on_emulated_kernels() {
    if let Some(rs) = std::env::var("OXEMU_RANK").ok().filter(|r| r.contains(',')) {
        let ranks: Vec<usize> = rs.split(',').map(|r| r.parse().unwrap()).collect();
        return ranks_process(&ranks);
    }
    if let Ok(r) = std::env::var("OXEMU_RANK") {
        return rank_process(r.parse().unwrap());
    }
    if std::env::var("OXEMU_RESIDENT").is_ok() {
        return few_blocks_process();
    }
    if let Ok(how) = std::env::var("OXEMU_PEERS") {
        return peer_devices_process(&how);
    }
    if std::env::var("OXEMU_STALL").is_ok() {
        return stall_process();
    }
    if std::env::var("OXEMU_REFS").is_ok() {
        return by_reference_process();
    }
    let Some(so) = device::build_emu() else {
        return;
    };
    let cache = start(&so);

    // First the ring everywhere (`OXCCL_CUDA_DIRECT=0`; a one-rank collective out of place
    // copies on the copy engine, the default); then the direct all-reduce (the default: ranks
    // of one group on one device in one launch) and the optional copy kernel
    // (`OXCCL_CUDA_COPY_KERNEL=1`, for one-rank copies from `OXCCL_CUDA_CE_COPY_BYTES`).
    std::env::set_var("OXCCL_CUDA_DIRECT", "0");
    nccl::param::reread();
    for (n, optional) in [
        (1usize, false),
        (2, false),
        (4, false),
        (1, true),
        (2, true),
        (4, true),
    ] {
        if optional {
            std::env::remove_var("OXCCL_CUDA_DIRECT");
            std::env::set_var("OXCCL_CUDA_COPY_KERNEL", "1");
            std::env::set_var("OXCCL_CUDA_CE_COPY_BYTES", "512K");
            nccl::param::reread();
        }
        let comms = nccl::api::comm_init_all(&vec![0; n]).expect("ranks on one device");
        let own: Vec<usize> = (0..n).map(|_| new_stream()).collect();
        let one = vec![new_stream(); n];
        let counts: &[usize] = if optional {
            &[300_001]
        } else {
            &[300_001, 1001]
        };
        let cases = cases(n, counts);
        for c in &cases {
            check(&comms, &own, c);
            if n > 1 && c.kind == CollKind::AllReduce {
                check(&comms, &one, c);
            }
            release_buffers();
        }
        if n > 1 && !optional {
            // The NULL stream (the legacy default stream) as the caller's.
            check(&comms, &vec![0; n], &cases[0]);
            if n == 4 {
                two_of_four_on_null(&comms);
            }
            graphs(&comms, &own, &cases[0]);
            mixed_group_graph(&comms, &own);
            two_stream_graphs(&comms);
            forked_calls(&comms, false);
            forked_calls(&comms, true);
            mixed_replays(n);
            threads(n, &cases[0], false);
            threads(n, &cases[0], true);
            mem_alloc_buffers(&comms, &own);
        }
        if n > 1 && optional {
            // Eager all-reduces on the direct kernel between the replays of graphs (whose
            // captures take the device board: one launch per rank's stream), in order.
            graphs(&comms, &own, &cases[0]);
            mixed_group_graph(&comms, &own);
            mixed_replays(n);
        }
        for c in &comms {
            nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
        }
    }
    std::env::remove_var("OXCCL_CUDA_DIRECT");
    std::env::remove_var("OXCCL_CUDA_COPY_KERNEL");
    std::env::remove_var("OXCCL_CUDA_CE_COPY_BYTES");
    nccl::param::reread();
    channels();
    destroy_while_capturing();
    relaxed_restores_mode();
    large_launches(&[new_stream(), new_stream()]);
    // Replays after the communicators went: their captures on the device board (the
    // default), then on the ring (whose connections the graph must not use after they are
    // freed).
    replay_after_destroy();
    std::env::set_var("OXCCL_CUDA_DIRECT", "0");
    nccl::param::reread();
    replay_after_destroy();
    std::env::remove_var("OXCCL_CUDA_DIRECT");
    nccl::param::reread();
    released_while_a_rank_waits();
    // The device board: ranks of one process on the one device, each launching alone.
    board_threads(2, &cases(2, &[300_001, 1001]));
    board_threads(4, &cases(4, &[300_001]));
    board_failures();
    board_large();
    board_mixed_groups();
    board_p2p_beside();
    let illegal = device::ILLEGAL.lock().clone();
    assert!(
        illegal.is_empty(),
        "what a GPU would have faulted on: {illegal:?}"
    );
    let launched = LAUNCHED.lock().clone();
    eprintln!("kernels run: {launched:?}");
    for k in stand_in::KERNELS {
        let k = k.to_str().unwrap();
        // (A one-rank launch's descriptor is never large.)
        if k != "oxccl_local_large" {
            assert!(launched.contains(k), "{k} never ran: {launched:?}");
        }
    }
    assert!(
        device::SHARED_LANES.load(Ordering::SeqCst),
        "no lane had several blocks"
    );
    failures();
    stall(&so);
    few_blocks(&so);
    by_reference(&so);
    peer_devices(&so);
    // (ipc None: OXCCL_CUDA_IPC unset, the default, which is IPC.)
    for (n, ipc, hosts) in [
        (2, Some(false), 1),
        (2, None, 1),
        (3, Some(true), 1),
        (2, Some(false), 2),
        (4, None, 2),
    ] {
        processes(&so, n, ipc, hosts);
    }
    // Ring collectives split across 4 channels (rank 0's OXCCL_CUDA_CHANNELS, whatever the
    // others say): in shared host memory, by CUDA IPC, and across two "hosts".
    std::env::set_var("OXCCL_CUDA_CHANNELS", "4");
    std::env::set_var("OXEMU_CHANNELS_OTHERS", "1");
    for (n, ipc, hosts) in [(3, Some(false), 1), (2, None, 1), (2, Some(false), 2)] {
        processes(&so, n, ipc, hosts);
    }
    std::env::remove_var("OXCCL_CUDA_CHANNELS");
    std::env::remove_var("OXEMU_CHANNELS_OTHERS");
    // Ranks 0 and 1 in one process, on one stream, and rank 2 on another "host": the
    // hierarchical all-reduce, whose stages every rank has alike (each stage of ranks 0 and 1
    // is one launch); by CUDA IPC (2 of 4 ranks' processes on one host) too.
    std::env::set_var("OXEMU_TOGETHER", "2");
    for (n, hosts) in [(3, 2), (4, 2)] {
        processes(&so, n, None, hosts);
    }
    std::env::remove_var("OXEMU_TOGETHER");
    // A peer that dies, on this host and on another, during an eager launch or a graph's
    // replay, and in a PID namespace of its own on this host (told by its lock); one that
    // never comes; one that did its part and left (no failure). On this host with the
    // connections in device memory (CUDA IPC, the default) and in pinned host memory.
    // Ranks in PID namespaces of their own, where CUDA's IPC handles do not open, stage in
    // host memory (no handle opened) whatever OXCCL_CUDA_IPC says.
    for (n, hosts, how, ipc) in [
        (2, 1, "death", None),
        (2, 1, "death", Some(false)),
        (2, 2, "death", None),
        (2, 1, "graph-death", None),
        (2, 2, "graph-death", None),
        (2, 1, "late", None),
        (2, 1, "finish", Some(false)),
        (2, 2, "finish", None),
        (3, 1, "graph-finish", None),
        (2, 1, "pidns-death", None),
        (2, 1, "pidns", Some(true)),
    ] {
        if how.starts_with("pidns") && !can_unshare_pid() {
            continue;
        }
        run_processes(&so, n, ipc, hosts, Some(how), None);
    }
    // Registered buffers that the kernels of other processes on the one device read where they
    // are (16 KiB slots: 1.2 MB is more than a FIFO's worth), over 2 and 3 processes.
    std::env::set_var("OXCCL_CHUNK_BYTES", "16384");
    for n in [2, 3] {
        run_processes(&so, n, None, 1, Some("registered"), None);
    }
    std::env::remove_var("OXCCL_CHUNK_BYTES");
    let _ = std::fs::remove_file(&so);
    let _ = std::fs::remove_dir_all(&cache);
}
