//! CUDA graphs on the emulated device of `tests/cuda_emulated.rs`: capture and replay of the
//! ranks' collectives, as PyTorch's CUDA graphs use them; a group on two streams of one
//! capture; calls forked across streams and interleaved with another capture; replays mixed
//! with eager calls; a replay after the communicators were destroyed.

use super::device::{
    self, begin_capture, begin_capture_together, end_capture, replay, submit, Op, DRAWN_IN,
};
use super::*;

/// Graph capture and replay, as PyTorch's CUDA graphs use them: the launches made while the
/// ranks' streams capture are kept, not run; each replay runs them again on the inputs then in
/// the buffers, with eager operations of the same communicators in between (the connections'
/// counters carry over from launch to launch and from replay to replay).
pub fn graphs(comms: &[Arc<nccl::comm::Comm>], streams: &[usize], c: &Case) {
    let n = comms.len();
    let bufs = buffers(c, n);
    for (r, b) in bufs.iter().enumerate() {
        fill(c, n, r, *b, 0);
    }
    for &s in streams {
        begin_capture(s);
    }
    nccl::api::group_start().unwrap();
    for (r, comm) in comms.iter().enumerate() {
        enqueue(comm, c, n, bufs[r], streams[r]);
    }
    nccl::api::group_end().unwrap();
    let graphs: Vec<Vec<Op>> = streams.iter().map(|&s| end_capture(s)).collect();
    assert!(graphs.iter().all(|g| !g.is_empty()), "nothing captured");
    sync_all(streams, "capture");
    assert!(
        bufs.iter().all(|&(_, rb)| get(c.dtype, rb, 0) == 99.0),
        "a captured launch ran"
    );
    for round in 1..=3 {
        for (r, b) in bufs.iter().enumerate() {
            fill(c, n, r, *b, round);
        }
        let captured: Vec<(usize, Vec<Op>)> = streams.iter().copied().zip(graphs.clone()).collect();
        replay(&captured);
        let what = format!("{}, graph replay {round}", describe(c, n, streams.len()));
        sync_all(streams, &what);
        no_async_error(comms, &what);
        verify(c, &bufs, round, &what);
        check(comms, streams, c);
    }
    release_buffers();
}

/// A graph replayed after its communicators were destroyed: the graph holds their control
/// blocks (pinned still, saying stop), so its launches return at once and leave the buffers as
/// they are, touching none of the connections freed with the communicators (device memory
/// here: unmapped, a fault had a kernel touched it); the control blocks are freed once the
/// graph is dropped too. A graph dropped before its communicators leaves nothing behind them.
pub fn replay_after_destroy() {
    let c = f32_sum(4099);
    let control_blocks = |graphs: &[(usize, Vec<Op>)]| -> BTreeSet<u64> {
        graphs
            .iter()
            .flat_map(|(_, g)| g)
            .filter_map(|op| match op {
                Op::Launch { name, params, .. } if name.to_bytes().starts_with(b"oxccl_run") => {
                    Some(device::lane_comms(params).into_iter().map(|(ctl, _)| ctl))
                }
                _ => None,
            })
            .flatten()
            .collect()
    };
    for graph_first in [false, true] {
        let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks on one device");
        let streams = [new_stream(), new_stream()];
        let bufs = buffers(&c, 2);
        for (r, b) in bufs.iter().enumerate() {
            fill(&c, 2, r, *b, 1);
        }
        for &s in &streams {
            begin_capture(s);
        }
        // (Two launches of each communicator in the graph: it holds each communicator once.)
        for _ in 0..2 {
            nccl::api::group_start().unwrap();
            for (r, comm) in comms.iter().enumerate() {
                enqueue(comm, &c, 2, bufs[r], streams[r]);
            }
            nccl::api::group_end().unwrap();
        }
        let graphs: Vec<(usize, Vec<Op>)> = streams.iter().map(|&s| (s, end_capture(s))).collect();
        let ctls = control_blocks(&graphs);
        assert_eq!(ctls.len(), 2, "each rank's lanes name its control block");
        let held: Vec<usize> = graphs
            .iter()
            .flat_map(|(_, g)| g)
            .filter_map(|op| match op {
                Op::Keep(k) => Some(Arc::strong_count(k)),
                _ => None,
            })
            .collect();
        assert_eq!(
            held,
            [1, 1],
            "the graph holds one user object of each communicator"
        );
        replay(&graphs);
        sync_all(&streams, "a replay before the destroy");
        verify(&c, &bufs, 1, "a replay before the destroy");
        let destroy = |comms: Vec<Arc<nccl::comm::Comm>>| {
            for comm in &comms {
                nccl::api::comm_destroy(nccl::api::comm_handle(comm)).unwrap();
            }
        };
        if graph_first {
            drop(graphs);
            destroy(comms);
            assert!(
                ctls.iter().all(|&p| !device::pinned(p)),
                "control blocks left pinned after the graph and the communicators went"
            );
            release_buffers();
            continue;
        }
        // (A communicator that lives on: the watcher thread with it.)
        let keeper = nccl::api::comm_init_all(&[0]).expect("one rank");
        destroy(comms);
        assert!(
            ctls.iter().all(|&p| device::pinned(p)),
            "a graph that may be replayed lost its control blocks with its communicators"
        );
        for (r, b) in bufs.iter().enumerate() {
            fill(&c, 2, r, *b, 2);
        }
        replay(&graphs);
        sync_all(&streams, "a replay after the destroy");
        let illegal = std::mem::take(&mut *device::ILLEGAL.lock());
        assert!(illegal.is_empty(), "{illegal:?}");
        for &(_, rb) in &bufs {
            let written = (0..c.count)
                .filter(|&i| get(c.dtype, rb, i) != 99.0)
                .count();
            assert_eq!(written, 0, "a replay after the destroy wrote outputs");
        }
        // The graph goes: what it held goes soon after, by the watcher thread, with no call
        // of the program's, to the spares (pinned still, for later communicators: unpinning
        // could wait for good, `exec::cuda::spare`); they are freed with the last
        // communicator.
        drop(graphs);
        assert!(
            spares_hold(&ctls),
            "control blocks not given back 5 s after the graph went"
        );
        assert!(ctls.iter().all(|&p| device::pinned(p)));
        destroy(keeper);
        assert!(
            ctls.iter().all(|&p| !device::pinned(p)),
            "control blocks still pinned after the last communicator went"
        );
        release_buffers();
    }
}

/// Whether the spares (`exec::cuda::spare`) hold every page of `ctls` within 5 s.
fn spares_hold(ctls: &BTreeSet<u64>) -> bool {
    let t = Instant::now();
    let held = || {
        let (pages, _) = nccl::exec::cuda::spare::held();
        ctls.iter().all(|p| pages.contains(p))
    };
    while !held() && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    held()
}

/// What a graph held is let go of without a free: freeing device or pinned memory waits for the
/// device's kernels (the emulated driver's too: `device::synchronize_device`), and a rank's
/// kernel waits for its peers' launches, so ranks driven one at a time (threads of one
/// process, here one thread) would wait for good, had a free come between them. The graph of a
/// destroyed communicator goes while rank 0 of another waits for rank 1's launch (its kernel
/// still runs); rank 1 then launches, and the all-reduce completes. The graph's control blocks
/// went to the spares meanwhile, and are freed with the last communicator.
pub fn released_while_a_rank_waits() {
    let c = f32_sum(4099);
    let captured = nccl::api::comm_init_all(&[0, 0]).expect("two ranks on one device");
    let streams = [new_stream(), new_stream()];
    let bufs = buffers(&c, 2);
    for &s in &streams {
        begin_capture(s);
    }
    nccl::api::group_start().unwrap();
    for (r, comm) in captured.iter().enumerate() {
        enqueue(comm, &c, 2, bufs[r], streams[r]);
    }
    nccl::api::group_end().unwrap();
    let graphs: Vec<Vec<Op>> = streams.iter().map(|&s| end_capture(s)).collect();
    let ctls: BTreeSet<u64> = graphs
        .iter()
        .flatten()
        .filter_map(|op| match op {
            Op::Launch { name, params, .. } if name.to_bytes().starts_with(b"oxccl_run") => {
                Some(device::lane_comms(params).into_iter().map(|(ctl, _)| ctl))
            }
            _ => None,
        })
        .flatten()
        .collect();
    for comm in captured {
        nccl::api::comm_destroy(nccl::api::comm_handle(&comm)).unwrap();
    }
    assert!(
        ctls.iter().all(|&p| device::pinned(p)),
        "the graph lost them"
    );
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks on one device");
    for (r, b) in bufs.iter().enumerate() {
        fill(&c, 2, r, *b, 3);
    }
    assert!(!ctls.is_empty(), "the graph launched no runner");
    enqueue(&comms[0], &c, 2, bufs[0], streams[0]);
    assert!(
        !sync(streams[0], Duration::from_millis(50)),
        "rank 0's all-reduce ended without rank 1"
    );
    drop(graphs);
    assert!(
        spares_hold(&ctls),
        "control blocks not given back while rank 0's all-reduce waits for rank 1's launch"
    );
    // (The captured communicator's board, too: 64 parts x 128 bytes x 2 ranks.)
    assert!(
        nccl::exec::cuda::spare::held().1 >= 64 * 128 * 2,
        "its board not given back"
    );
    enqueue(&comms[1], &c, 2, bufs[1], streams[1]);
    let what = "an all-reduce whose ranks launch apart, a graph let go of between them";
    sync_all(&streams, what);
    let illegal = std::mem::take(&mut *device::ILLEGAL.lock());
    assert!(illegal.is_empty(), "{what}: {illegal:?}");
    no_async_error(&comms, what);
    verify(&c, &bufs, 3, what);
    for comm in comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(&comm)).unwrap();
    }
    assert!(
        ctls.iter().all(|&p| !device::pinned(p)),
        "control blocks still pinned after the last communicator went"
    );
    assert_eq!(
        nccl::exec::cuda::spare::held(),
        (Vec::new(), 0),
        "spares left after the last communicator went"
    );
    release_buffers();
}

/// A group of each rank's two all-reduces on two streams of one capture, as a side stream
/// forked from the main one captures with it: in the graph, a copy on the second stream makes
/// that all-reduce's input before the group, and another copies its output after it. Each
/// replay holds the second streams at first (a gate), so a launch on the first stream that did
/// not wait for the second's copy reads the poison left in that input; and the copy after the
/// group must find the all-reduce's output.
pub fn two_stream_graphs(comms: &[Arc<nccl::comm::Comm>]) {
    let n = comms.len();
    let c = f32_sum(3001);
    let bytes = 4 * c.count;
    let (first, second) = (buffers(&c, n), buffers(&c, n));
    let stage: Vec<usize> = (0..n).map(|_| buffer(bytes)).collect();
    let out: Vec<usize> = (0..n).map(|_| buffer(bytes)).collect();
    let (a, b): (Vec<usize>, Vec<usize>) = (0..n).map(|_| (new_stream(), new_stream())).unzip();
    let all: Vec<usize> = a.iter().chain(&b).copied().collect();
    for r in 0..n {
        begin_capture_together(&[a[r], b[r]]);
    }
    let copy = |dst: usize, src: usize| Op::Copy {
        dst: dst as u64,
        src: src as u64,
        bytes,
    };
    for r in 0..n {
        submit(b[r], copy(second[r].0, stage[r]));
    }
    nccl::api::group_start().unwrap();
    for r in 0..n {
        enqueue(&comms[r], &c, n, first[r], a[r]);
        enqueue(&comms[r], &c, n, second[r], b[r]);
    }
    nccl::api::group_end().unwrap();
    for r in 0..n {
        submit(b[r], copy(out[r], second[r].1));
    }
    let graphs: Vec<(usize, Vec<Op>)> = all.iter().map(|&s| (s, end_capture(s))).collect();
    assert!(
        !DRAWN_IN.load(Ordering::SeqCst),
        "a stream outside the capture waited for a captured event"
    );
    sync_all(&all, "capture");
    for k in 1..=3 {
        let salt = 100 + k;
        for r in 0..n {
            fill(&c, n, r, first[r], k);
            fill(&c, n, r, (stage[r], second[r].1), salt);
            for i in 0..c.count {
                put(DataType::Float32, second[r].0, i, 77.0);
                put(DataType::Float32, out[r], i, 55.0);
            }
        }
        let what = format!("two streams' group in one graph, replay {k}");
        let hold = Duration::from_millis(50);
        behind_gates((&b, &all), comms, hold, || replay(&graphs), (&what, &what));
        verify(&c, &first, k, &what);
        verify(&c, &second, salt, &what);
        for r in 0..n {
            for i in 0..c.count {
                let (got, want) = (
                    get(DataType::Float32, out[r], i),
                    get(DataType::Float32, second[r].1, i),
                );
                assert_eq!(
                    got, want,
                    "{what}: rank {r}'s copy after the group, element {i}"
                );
            }
        }
    }
    release_buffers();
}

/// Two all-reduces of each rank in separate calls, the first on a second stream that captures
/// with the first (forked from it), the second on the first: in a replay the second runs after
/// the first, as they were issued (they share the connections), even with rank 0's second
/// stream held at first (a gate), where its first stream would otherwise run its launch first
/// while rank 1 runs the other. `interleaved`: a call captured into another graph, whose
/// capture is open at the same time, comes between the two (the second still follows the
/// first).
pub fn forked_calls(comms: &[Arc<nccl::comm::Comm>], interleaved: bool) {
    let n = comms.len();
    let c = f32_sum(3001);
    let (x, y, z) = (buffers(&c, n), buffers(&c, n), buffers(&c, n));
    let (a, b): (Vec<usize>, Vec<usize>) = (0..n).map(|_| (new_stream(), new_stream())).unzip();
    let other: Vec<usize> = (0..n).map(|_| new_stream()).collect();
    let all: Vec<usize> = a.iter().chain(&b).copied().collect();
    for r in 0..n {
        begin_capture_together(&[a[r], b[r]]);
    }
    for r in 0..n {
        enqueue(&comms[r], &c, n, x[r], b[r]);
    }
    // Interleaved: a call captured into another graph (its own capture, open at the same
    // time) between the two.
    if interleaved {
        for r in 0..n {
            begin_capture(other[r]);
            enqueue(&comms[r], &c, n, z[r], other[r]);
        }
    }
    for r in 0..n {
        enqueue(&comms[r], &c, n, y[r], a[r]);
    }
    let graphs: Vec<(usize, Vec<Op>)> = all.iter().map(|&s| (s, end_capture(s))).collect();
    let others: Vec<(usize, Vec<Op>)> = match interleaved {
        true => other.iter().map(|&s| (s, end_capture(s))).collect(),
        false => Vec::new(),
    };
    assert!(
        !DRAWN_IN.load(Ordering::SeqCst),
        "a stream drawn into a capture"
    );
    for k in 1..=2 {
        for r in 0..n {
            fill(&c, n, r, x[r], k);
            fill(&c, n, r, y[r], 50 + k);
        }
        // Rank 0's second stream held: without the order, rank 0 would run the second
        // all-reduce while rank 1 runs the first, on the same connections.
        let what = format!(
            "separate calls on forked streams of one graph{}, replay {k}",
            if interleaved {
                ", another graph captured in between"
            } else {
                ""
            }
        );
        let hold = Duration::from_millis(50);
        behind_gates(
            (&b[..1], &all),
            comms,
            hold,
            || replay(&graphs),
            (&what, &what),
        );
        verify(&c, &x, k, &what);
        verify(&c, &y, 50 + k, &what);
        if interleaved {
            for (r, b) in z.iter().enumerate() {
                fill(&c, n, r, *b, 90 + k);
            }
            for g in &others {
                replay(std::slice::from_ref(g));
            }
            sync_all(&other, &what);
            verify(&c, &z, 90 + k, &what);
        }
    }
    release_buffers();
}

/// Graph replays and eager launches of the same communicators, issued one after the other on
/// other streams with nothing of the caller's between them (what NCCL's graph mixing support
/// allows): they run in issue order. Fresh communicators whose graphs are captured before
/// their first eager call; each round runs an eager call then a replay, a replay then an eager
/// call, and replays of two graphs; the first one's stream of rank 0 is held at first (a
/// gate), so that without that order rank 0 would run the second while rank 1 runs the first,
/// on the same connections.
pub fn mixed_replays(n: usize) {
    let comms = nccl::api::comm_init_all(&vec![0; n]).expect("ranks on one device");
    let c = f32_sum(3001);
    let (x, y, z) = (buffers(&c, n), buffers(&c, n), buffers(&c, n));
    let streams = |_| (0..n).map(|_| new_stream()).collect::<Vec<usize>>();
    let [g, g2, e]: [Vec<usize>; 3] = [0, 1, 2].map(streams);
    let all: Vec<usize> = g.iter().chain(&g2).chain(&e).copied().collect();
    let capture = |on: &[usize], bufs: &[(usize, usize)]| -> Vec<Vec<Op>> {
        (0..n)
            .map(|r| {
                begin_capture(on[r]);
                enqueue(&comms[r], &c, n, bufs[r], on[r]);
                end_capture(on[r])
            })
            .collect()
    };
    let (first, second) = (capture(&g, &x), capture(&g2, &z));
    let replays = |on: &[usize], graphs: &[Vec<Op>]| {
        for r in 0..n {
            replay(&[(on[r], graphs[r].clone())]);
        }
    };
    let eager = || {
        for r in 0..n {
            enqueue(&comms[r], &c, n, y[r], e[r]);
        }
    };
    for k in 1..=2 {
        for (case, what, held) in [
            (0, "an eager call, then a replay", e[0]),
            (1, "a replay, then an eager call", g[0]),
            (2, "a replay of one graph, then of another", g[0]),
        ] {
            for (r, b) in x.iter().enumerate() {
                fill(&c, n, r, *b, k);
                fill(&c, n, r, y[r], 50 + k);
                fill(&c, n, r, z[r], 90 + k);
            }
            let what = format!("{what}, round {k}");
            let issue = || match case {
                0 => {
                    eager();
                    replays(&g, &first);
                }
                1 => {
                    replays(&g, &first);
                    eager();
                }
                _ => {
                    replays(&g, &first);
                    replays(&g2, &second);
                }
            };
            let hold = Duration::from_millis(50);
            behind_gates((&[held], &all), &comms, hold, issue, (&what, &what));
            verify(&c, &x, k, &what);
            if case < 2 {
                verify(&c, &y, 50 + k, &what);
            } else {
                verify(&c, &z, 90 + k, &what);
            }
        }
    }
    for c in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
    }
    release_buffers();
}

/// A captured group of each rank's all-reduce, all-gather, and send and receive (larger than a
/// connection's FIFO): its point-to-point lanes run on the communicator's side stream, which
/// the capture draws in (forked from the rank's stream before the collectives, joined back
/// after them, `end_capture` checks), so every replay runs them beside the collectives, on a
/// stream of their own. Every output checked after each of two replays.
pub fn mixed_group_graph(comms: &[Arc<nccl::comm::Comm>], streams: &[usize]) {
    let n = comms.len();
    let calls = [
        f32_sum(4099),
        Case {
            kind: CollKind::AllGather,
            ..f32_sum(1001)
        },
        Case {
            kind: CollKind::Send,
            ..f32_sum(300_001)
        },
    ];
    // The calls of every rank in one group, rank r's on `on[r]` with its buffers of `bufs`
    // (filled first where `filled`: eager calls; captured ones are filled before each replay).
    let group = |on: &[usize], bufs: &[Vec<(usize, usize)>], filled: bool| {
        nccl::api::group_start().unwrap();
        for (r, comm) in comms.iter().enumerate() {
            for (c, b) in calls.iter().zip(bufs) {
                if filled {
                    fill(c, n, r, b[r], 0);
                }
                enqueue(comm, c, n, b[r], on[r]);
            }
        }
        nccl::api::group_end().unwrap();
    };
    let bufs: Vec<Vec<(usize, usize)>> = calls.iter().map(|c| buffers(c, n)).collect();
    for &s in streams {
        begin_capture(s);
    }
    group(streams, &bufs, false);
    // While the capture is open, the same group eagerly on other streams: the side streams are
    // still drawn into the capture (what they were given now would be captured, not run), so
    // the point-to-point lanes go into a collective's launch, and the group runs.
    let eager: Vec<usize> = (0..n).map(|_| new_stream()).collect();
    let ebufs: Vec<Vec<(usize, usize)>> = calls.iter().map(|c| buffers(c, n)).collect();
    let sides = device::SIDE_LAUNCHES.load(Ordering::SeqCst);
    group(&eager, &ebufs, true);
    let what = format!("the group eagerly, {n} ranks, while its capture is open");
    sync_all(&eager, &what);
    no_async_error(comms, &what);
    for (c, b) in calls.iter().zip(&ebufs) {
        verify(c, b, 0, &format!("{}: {what}", describe(c, n, n)));
    }
    assert_eq!(
        device::SIDE_LAUNCHES.load(Ordering::SeqCst),
        sides,
        "{what}: a launch on a side stream drawn into the capture"
    );
    // And captured into a second graph on other streams while the first capture is open: the
    // side streams belong to the first (a wait across captures is CUDA's error), so this one
    // takes none.
    let second: Vec<usize> = (0..n).map(|_| new_stream()).collect();
    let sbufs: Vec<Vec<(usize, usize)>> = calls.iter().map(|c| buffers(c, n)).collect();
    for &s in &second {
        begin_capture(s);
    }
    group(&second, &sbufs, false);
    let graphs2: Vec<(usize, Vec<Op>)> = second.iter().map(|&s| (s, end_capture(s))).collect();
    for (s, g) in &graphs2 {
        assert!(
            !g.iter().any(|op| matches!(op, Op::Side(..))),
            "stream {s:#x}: a side stream of another open capture in its graph"
        );
    }
    let graphs: Vec<(usize, Vec<Op>)> = streams.iter().map(|&s| (s, end_capture(s))).collect();
    assert!(
        !DRAWN_IN.load(Ordering::SeqCst),
        "a side stream not joined back, or a stream of the caller's drawn into the capture"
    );
    for (s, g) in &graphs {
        let sides = g.iter().filter(|op| matches!(op, Op::Side(..))).count();
        assert_eq!(
            sides, 1,
            "stream {s:#x}: the side stream's work in its graph"
        );
    }
    for round in 1..=2 {
        for (graphs, streams, bufs, which) in [
            (&graphs, streams, &bufs, "a captured group"),
            (
                &graphs2,
                &second[..],
                &sbufs,
                "the group captured beside it",
            ),
        ] {
            for (c, b) in calls.iter().zip(bufs) {
                for (r, &b) in b.iter().enumerate() {
                    fill(c, n, r, b, round);
                }
            }
            replay(graphs);
            let what = format!(
                "{which} of collectives and point-to-point calls, {n} ranks, replay {round}"
            );
            sync_all(streams, &what);
            no_async_error(comms, &what);
            for (c, b) in calls.iter().zip(bufs) {
                verify(c, b, round, &format!("{}: {what}", describe(c, n, n)));
            }
        }
    }
    release_buffers();
}

/// Communicators destroyed while a stream of another thread's captures a graph (CUDA's global
/// capture mode refuses a thread's unsafe calls then, queries and frees among them, unless the
/// thread is in relaxed mode, and spoils the capture): the destroy waits for the communicators'
/// launches and frees their device memory in relaxed mode, so it succeeds, frees all, and the
/// capture goes on.
pub fn destroy_while_capturing() {
    let before = device::live_allocs();
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks on one device");
    let streams = [new_stream(), new_stream()];
    // (An all-reduce on the board, a send and receive over a connection in device memory.)
    let calls = [
        f32_sum(4099),
        Case {
            kind: CollKind::Send,
            ..f32_sum(1001)
        },
    ];
    let bufs: Vec<Vec<(usize, usize)>> = calls.iter().map(|c| buffers(c, 2)).collect();
    nccl::api::group_start().unwrap();
    for (r, comm) in comms.iter().enumerate() {
        for (c, b) in calls.iter().zip(&bufs) {
            fill(c, 2, r, b[r], 0);
            enqueue(comm, c, 2, b[r], streams[r]);
        }
    }
    nccl::api::group_end().unwrap();
    let what = "before the destroy";
    sync_all(&streams, what);
    for (c, b) in calls.iter().zip(&bufs) {
        verify(c, b, 0, &format!("{}: {what}", describe(c, 2, 2)));
    }
    assert!(device::live_allocs() > before, "no device memory to free");
    let other = new_stream();
    begin_capture(other);
    let t = std::thread::spawn(move || {
        for c in &comms {
            nccl::api::comm_destroy(nccl::api::comm_handle(c))
                .expect("a destroy while another thread's stream captures");
        }
    });
    t.join().unwrap();
    assert_eq!(
        device::live_allocs(),
        before,
        "device memory left after the destroy"
    );
    let g = end_capture(other);
    assert!(
        g.is_empty(),
        "the capture took what the destroy did: {}",
        g.len()
    );
    release_buffers();
}

/// A panic inside the library's relaxed section (caught at the C boundary) leaves the calling
/// thread in the capture mode it had: relaxed for good, CUDA would let the thread's later
/// captures hold calls it refuses in them.
pub fn relaxed_restores_mode() {
    assert_eq!(device::capture_mode(), 0, "global mode to begin with");
    let r = std::panic::catch_unwind(|| {
        nccl::gpu::driver::relaxed::<()>(|| panic!("a panic while relaxed (this test's own)"))
    });
    assert!(r.is_err(), "the panic went through");
    assert_eq!(device::capture_mode(), 0, "the thread stayed relaxed");
}
