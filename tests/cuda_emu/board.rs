//! The device board (`src/exec/cuda/board.rs`): the ranks of a communicator, all in this
//! process on the one device, launching one at a time (each in a thread of its own, or one
//! after the other on streams of their own): their collectives meet on the board, a board lane
//! in each rank's launch, whatever else their groups hold. And its failures: ranks that make
//! different calls, a rank that ends its communicator while a peer waits for it there, and one
//! that never comes.

use super::device::{self, BOARD_LANES};
use super::*;

/// Board lanes launched since `before`.
fn board_lanes_since(before: u64) -> u64 {
    BOARD_LANES.load(Ordering::SeqCst) - before
}

/// The collectives the board serves.
fn on_board(kind: CollKind) -> bool {
    use CollKind::*;
    matches!(
        kind,
        AllReduce | Reduce | Broadcast | AllGather | ReduceScatter
    )
}

/// Ranks 0..n of a new communicator, each in a thread of its own on a stream of its own,
/// running `work(comm, rank, stream)`, then waiting for their streams (`what`: the work) with
/// no error; their communicators, once every thread is done.
fn in_threads(
    n: usize,
    what: &'static str,
    work: impl Fn(&Arc<nccl::comm::Comm>, usize, usize) + Clone + Send + 'static,
) -> Vec<Arc<nccl::comm::Comm>> {
    let id = nccl::api::get_unique_id().unwrap();
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            let work = work.clone();
            std::thread::spawn(move || {
                let comm = nccl::api::comm_init_rank(n as i32, &id, r as i32, Default::default())
                    .expect("a rank in a thread");
                let stream = new_stream();
                work(&comm, r, stream);
                sync_all(&[stream], what);
                no_async_error(std::slice::from_ref(&comm), what);
                comm
            })
        })
        .collect();
    ranks.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Each rank in a thread of its own on its own stream: every collective of `cs` that the board
/// serves in turn (all-reduce, reduce, broadcast, all-gather, reduce-scatter; datatypes,
/// operators, in place, several sizes), then an all-reduce and the ring's send and receive:
/// even ranks in one group (one launch: the board lane beside the connections' lanes, with
/// few blocks), odd ranks one after the other (the board lane alone, a block per part), so
/// that the ranks share the parts out among different numbers of blocks. Every output checked
/// element by element, and every collective a board lane.
pub fn board_threads(n: usize, cs: &[Case]) {
    let cs: Vec<Case> = cs.iter().filter(|c| on_board(c.kind)).copied().collect();
    let bufs: Vec<Vec<(usize, usize)>> = cs.iter().map(|c| buffers(c, n)).collect();
    let with = f32_sum(300_001);
    let ring = Case {
        kind: CollKind::Send,
        ..f32_sum(1001)
    };
    let (wbufs, rbufs) = (buffers(&with, n), buffers(&ring, n));
    let before = BOARD_LANES.load(Ordering::SeqCst);
    device::BOARD_BLOCKS.lock().clear();
    let (c2, b2, w2, r2) = (cs.clone(), bufs.clone(), wbufs.clone(), rbufs.clone());
    let comms = in_threads(
        n,
        "board lanes of ranks in threads",
        move |comm, r, stream| {
            for (c, b) in c2.iter().zip(&b2) {
                fill(c, n, r, b[r], 0);
                enqueue(comm, c, n, b[r], stream);
            }
            fill(&with, n, r, w2[r], 1);
            fill(&ring, n, r, r2[r], 1);
            let together = r % 2 == 0;
            if together {
                nccl::api::group_start().unwrap();
            }
            enqueue(comm, &with, n, w2[r], stream);
            enqueue(comm, &ring, n, r2[r], stream);
            if together {
                nccl::api::group_end().unwrap();
            }
        },
    );
    for (c, b) in cs.iter().zip(&bufs) {
        verify(
            c,
            b,
            0,
            &format!("{}, a thread per rank", describe(c, n, n)),
        );
    }
    let what = format!(
        "{} with a ring's send and receive in one group",
        describe(&with, n, n)
    );
    verify(&with, &wbufs, 1, &what);
    verify(&ring, &rbufs, 1, &what);
    assert_eq!(
        board_lanes_since(before),
        (n * (cs.len() + 1)) as u64,
        "every collective of ranks in threads on the device board"
    );
    let blocks = device::BOARD_BLOCKS.lock().clone();
    assert!(
        blocks.len() > 2,
        "board lanes of ranks in threads with few kinds of block counts: {blocks:?}"
    );
    for c in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
    }
    release_buffers();
}

/// Failures on the board, ranks of one communicator launching one after the other on streams
/// of their own. Different calls (counts whose operations cut into as many parts, and into
/// different numbers of parts; another collective): both communicators fail with
/// ncclInvalidUsage naming the other rank's call, their streams drained. A rank that ends its
/// communicator while its peer's kernel waits for it on the board: the peer fails with
/// ncclRemoteError within seconds. Peers that come after a rank's abort (of two ranks and of
/// three): ncclRemoteError, the aborted rank's buffers untouched. Ranks that end one after the
/// other: no error.
pub fn board_failures() {
    use nccl::error::Code;
    let streams = [new_stream(), new_stream()];
    let bcast = Case {
        kind: CollKind::Broadcast,
        ..f32_sum(4099)
    };
    for (calls, says) in [
        ([f32_sum(1001), f32_sum(2002)], "AllReduce of 2002 x"),
        (
            [f32_sum(300_001), f32_sum(600_002)],
            "AllReduce of 600002 x",
        ),
        ([f32_sum(4099), bcast], "Broadcast of 4099 x"),
    ] {
        let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
        let bufs = [buffers(&calls[0], 2)[0], buffers(&calls[1], 2)[1]];
        let before = BOARD_LANES.load(Ordering::SeqCst);
        for r in 0..2 {
            enqueue(&comms[r], &calls[r], 2, bufs[r], streams[r]);
        }
        assert_eq!(board_lanes_since(before), 2, "on the board");
        let what = format!("ranks that call {} and {says}", describe(&calls[0], 2, 2));
        failed(&comms, &streams, Some(Code::InvalidUsage), &what);
        let msg = nccl::error::last_error();
        assert!(
            msg.contains("device board") && msg.contains(says),
            "{what}: {msg}"
        );
        release_buffers();
    }

    let c = f32_sum(4099);
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
    let bufs = buffers(&c, 2);
    // (Both once, so that the wait below is not the first use of anything.)
    for r in 0..2 {
        enqueue(&comms[r], &c, 2, bufs[r], streams[r]);
    }
    sync_all(&streams, "two board all-reduces");
    enqueue(&comms[0], &c, 2, bufs[0], streams[0]);
    assert!(
        !sync(streams[0], Duration::from_millis(300)),
        "done without its peer"
    );
    nccl::api::comm_destroy(nccl::api::comm_handle(&comms[1])).expect("destroy");
    assert!(
        sync(streams[0], Duration::from_secs(20)),
        "the kernel still waits on the board for a peer that destroyed its communicator"
    );
    assert_eq!(
        async_error(&comms[0]),
        Code::RemoteError,
        "a peer that left"
    );
    let msg = nccl::error::last_error();
    assert!(msg.contains("ended its communicator"), "{msg}");
    let _ = nccl::api::comm_abort(nccl::api::comm_handle(&comms[0]));

    // A peer that comes too late, of two ranks, then of three (rank 1 waiting there too).
    late_peer_after_abort(&c, &[streams[0], streams[1]]);
    late_peer_after_abort(&c, &[streams[0], streams[1], new_stream()]);

    // Ranks that end one after the other once their work is done: no error for the one that
    // ends last (its kernels waited on the board for the other before it left, not after).
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks");
    let bufs = buffers(&c, 2);
    for r in 0..2 {
        enqueue(&comms[r], &c, 2, bufs[r], streams[r]);
    }
    sync_all(&streams, "two board all-reduces");
    nccl::api::comm_destroy(nccl::api::comm_handle(&comms[1])).expect("destroy");
    // (A false "peer ended" would come once the watcher's second of grace has passed.)
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        nccl::api::comm_async_error(&comms[0]),
        Code::Success,
        "{}",
        nccl::error::last_error()
    );
    nccl::api::comm_destroy(nccl::api::comm_handle(&comms[0])).expect("destroy");
    release_buffers();
}

/// A board lane in a launch whose descriptor needs the large kernel parameter: each of two
/// ranks, in a thread of its own, has an all-reduce and 60 sends to and receives from its peer
/// in one group (`oxccl_run_board_large`). Every output checked.
pub fn board_large() {
    let c = f32_sum(300_001);
    let bufs = buffers(&c, 2);
    let (pairs, count) = (60, 16);
    let p2p: Vec<(usize, usize)> = (0..2)
        .map(|_| {
            let (send, recv) = (buffer(pairs * count * 4), buffer(pairs * count * 4));
            pattern(send, recv, pairs * count);
            (send, recv)
        })
        .collect();
    let what = "an all-reduce beside 60 sends and receives, a rank per thread";
    let before = BOARD_LANES.load(Ordering::SeqCst);
    // (Forgotten if an earlier case ran it: this case must.)
    device::LAUNCHED.lock().remove("oxccl_run_board_large");
    let (b, p) = (bufs.clone(), p2p.clone());
    let comms = in_threads(2, what, move |comm, r, stream| {
        let (send, recv) = p[r];
        fill(&c, 2, r, b[r], 0);
        nccl::api::group_start().unwrap();
        enqueue(comm, &c, 2, b[r], stream);
        for k in 0..pairs {
            let at = 4 * count * k;
            let to = p2p_f32(CollKind::Send, send + at, 0, count, 1 - r);
            let from = p2p_f32(CollKind::Recv, 0, recv + at, count, 1 - r);
            nccl::api::enqueue(comm, to, stream_arg(stream)).unwrap();
            nccl::api::enqueue(comm, from, stream_arg(stream)).unwrap();
        }
        nccl::api::group_end().unwrap();
    });
    verify(&c, &bufs, 0, what);
    for &(_, recv) in &p2p {
        pattern_arrived(recv, pairs * count);
    }
    assert_eq!(board_lanes_since(before), 2, "{what}: on the board");
    assert!(
        device::LAUNCHED.lock().contains("oxccl_run_board_large"),
        "{what}: not the large kernel"
    );
    for comm in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(comm)).unwrap();
    }
    release_buffers();
}

/// Ranks 0 and 1 (each in a thread of its own) make `calls`, each in its `orders`: rank 0 in
/// one group, rank 1 one by one, or in a group of its own where `grouped`. Every output
/// checked.
fn grouped_otherwise(
    calls: &[Case],
    orders: [&'static [usize]; 2],
    grouped: bool,
    what: &'static str,
) {
    let bufs: Vec<Vec<(usize, usize)>> = calls.iter().map(|c| buffers(c, 2)).collect();
    let (c, b) = (calls.to_vec(), bufs.clone());
    let side = device::SIDE_LAUNCHES.load(Ordering::SeqCst);
    let comms = in_threads(2, what, move |comm, r, stream| {
        for (c, b) in c.iter().zip(&b) {
            fill(c, 2, r, b[r], 0);
        }
        if r == 0 || grouped {
            nccl::api::group_start().unwrap();
        }
        for &i in orders[r] {
            enqueue(comm, &c[i], 2, b[i][r], stream);
        }
        if r == 0 || grouped {
            nccl::api::group_end().unwrap();
        }
    });
    for (c, b) in calls.iter().zip(&bufs) {
        verify(c, b, 0, &format!("{}: {what}", describe(c, 2, 2)));
    }
    assert!(
        device::SIDE_LAUNCHES.load(Ordering::SeqCst) > side,
        "{what}: no launch on a side stream"
    );
    for comm in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(comm)).unwrap();
    }
    release_buffers();
}

/// The same calls in the same order, grouped differently: rank 0 holds an all-reduce, an
/// all-gather and a send and receive with rank 1 in one group, rank 1 makes them one by one.
/// Rank 0's collectives run one launch after the other, and its point-to-point lanes beside
/// them: ahead of the all-gather, rank 1's send would sit behind its all-gather, which would
/// wait for rank 0's, queued behind the point-to-point lanes.
pub fn board_mixed_groups() {
    let ar = f32_sum(4099);
    let ag = Case {
        kind: CollKind::AllGather,
        ..f32_sum(1001)
    };
    let p2p = Case {
        kind: CollKind::Send,
        ..f32_sum(300_001)
    };
    grouped_otherwise(
        &[ar, ag, p2p],
        [&[0, 1, 2], &[0, 1, 2]],
        false,
        "an all-reduce, an all-gather, a send and a receive, grouped on rank 0 only",
    );
}

/// A group's sends and receives run beside its collectives, not in one of their launches:
/// rank 0 groups an all-reduce, a send and receive (larger than the connection's FIFO), an
/// all-gather and a reduce-scatter, while rank 1 makes the same calls with its send and
/// receive last, one by one or in a group of its own. Were rank 0's point-to-point lanes in
/// its all-reduce's launch, they would wait for rank 1's, which come after its all-gather and
/// reduce-scatter, which wait for rank 0's, queued behind the all-reduce's launch: a hang.
pub fn board_p2p_beside() {
    let ar = f32_sum(4099);
    let ag = Case {
        kind: CollKind::AllGather,
        ..f32_sum(1001)
    };
    let rs = Case {
        kind: CollKind::ReduceScatter,
        ..f32_sum(2003)
    };
    let p2p = Case {
        kind: CollKind::Send,
        ..f32_sum(300_001)
    };
    let calls = [ar, p2p, ag, rs];
    // (Each rank's order of the calls.)
    let orders: [&[usize]; 2] = [&[0, 1, 2, 3], &[0, 2, 3, 1]];
    grouped_otherwise(
        &calls,
        orders,
        false,
        "rank 0 groups an all-reduce, a send and receive, an all-gather and a reduce-scatter; \
         rank 1 makes them one by one, its send and receive last",
    );
    grouped_otherwise(
        &calls,
        orders,
        true,
        "rank 0 groups an all-reduce, a send and receive, an all-gather and a reduce-scatter; \
         rank 1 groups them with its send and receive last",
    );
    alone_then_abort(&calls, false);
    alone_then_abort(&calls, true);
}

/// A rank whose peer never comes: its collectives wait on its stream, its sends and receives
/// on the side stream; the abort stops both kernels, and its stream drains (it waits for the
/// side stream's launch). `record_fails`: recording the side stream's join fails (a driver
/// error after its launch), so the caller's stream does not wait for it; the side stream is
/// held back until after the abort began, and the abort still returns only once the side
/// kernel is done (its control block is freed then).
fn alone_then_abort(calls: &[Case], record_fails: bool) {
    let comms = nccl::api::comm_init_all(&[0, 0]).expect("two ranks on one device");
    let streams = [new_stream(), new_stream()];
    let bufs: Vec<Vec<(usize, usize)>> = calls.iter().map(|c| buffers(c, 2)).collect();
    let group = |ranks: &[usize]| {
        nccl::api::group_start().unwrap();
        for &r in ranks {
            for (c, b) in calls.iter().zip(&bufs) {
                fill(c, 2, r, b[r], 0);
                enqueue(&comms[r], c, 2, b[r], streams[r]);
            }
        }
        nccl::api::group_end().unwrap();
    };
    // (Both first: the connections are made.)
    group(&[0, 1]);
    let what = "a group of both ranks, each on its stream";
    sync_all(&streams, what);
    for (c, b) in calls.iter().zip(&bufs) {
        verify(c, b, 0, &format!("{}: {what}", describe(c, 2, 2)));
    }
    let side = device::SIDE_LAUNCHES.load(Ordering::SeqCst);
    let gates: Vec<_> = if record_fails {
        device::FAIL_SIDE_RECORD.store(true, Ordering::SeqCst);
        device::created().into_iter().map(device::gate).collect()
    } else {
        Vec::new()
    };
    nccl::api::group_start().unwrap();
    for (c, b) in calls.iter().zip(&bufs) {
        fill(c, 2, 0, b[0], 0);
        enqueue(&comms[0], c, 2, b[0], streams[0]);
    }
    let r = nccl::api::group_end();
    assert_eq!(
        r.is_err(),
        record_fails,
        "rank 0's group alone, the side record failing: {record_fails}: {r:?}"
    );
    assert!(
        device::SIDE_LAUNCHES.load(Ordering::SeqCst) > side,
        "rank 0's group alone: no launch on a side stream"
    );
    // (With the record failing, the stages are not launched: the group failed.)
    assert!(
        record_fails || !sync(streams[0], Duration::from_millis(300)),
        "rank 0's group done without its peer"
    );
    let opened = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opener = {
        let opened = opened.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            opened.store(true, Ordering::SeqCst);
            for g in &gates {
                device::open_gate(g);
            }
        })
    };
    nccl::api::comm_abort(nccl::api::comm_handle(&comms[0])).expect("abort");
    assert!(
        opened.load(Ordering::SeqCst) || !record_fails,
        "the abort returned while the side stream still held its launch"
    );
    assert!(
        sync(streams[0], Duration::from_secs(10)),
        "rank 0's kernels went on after the abort (its stream waits for its side stream)"
    );
    opener.join().unwrap();
    nccl::api::comm_abort(nccl::api::comm_handle(&comms[1])).expect("abort");
    for h in device::created() {
        assert!(
            sync(h, Duration::from_secs(10)),
            "side stream {h:#x} still busy"
        );
    }
    assert!(
        device::ILLEGAL.lock().is_empty(),
        "{:?}",
        device::ILLEGAL.lock()
    );
    release_buffers();
}

/// A peer that comes too late (`streams.len()` ranks): the last rank's launch is held behind a
/// gate on its stream while rank 0's kernel (and the ranks' between) wait for it on the board;
/// the abort stops rank 0's kernel. Rank 0 arrived before it left, so the ranks between go on
/// waiting for the last (rank 0 may still count). Then the gate opens: every peer finds that
/// rank 0 left before it did its share, and stops with ncclRemoteError saying so (not a call
/// mismatch read from a line left from before), without touching rank 0's buffers, which the
/// caller may use again once the abort has returned.
fn late_peer_after_abort(c: &Case, streams: &[usize]) {
    use nccl::error::Code;
    let n = streams.len();
    let comms = nccl::api::comm_init_all(&vec![0; n]).expect("ranks on the one device");
    let bufs = buffers(c, n);
    for (r, &b) in bufs.iter().enumerate() {
        fill(c, n, r, b, 0);
    }
    let last = n - 1;
    let gate = device::gate(streams[last]);
    let before = BOARD_LANES.load(Ordering::SeqCst);
    enqueue(&comms[last], c, n, bufs[last], streams[last]);
    assert_eq!(
        board_lanes_since(before),
        1,
        "the late peer's launch, on the board"
    );
    for r in 1..last {
        enqueue(&comms[r], c, n, bufs[r], streams[r]);
    }
    aborted_alone(&comms, c, bufs[0], streams[0]);
    for i in 0..c.count {
        put(c.dtype, bufs[0].0, i, -5.0);
    }
    for (r, &s) in streams.iter().enumerate().take(last).skip(1) {
        assert!(
            !sync(s, Duration::from_millis(300)),
            "rank {r} done without rank {last}"
        );
    }
    device::open_gate(&gate);
    for r in 1..n {
        assert!(
            sync(streams[r], Duration::from_secs(10)),
            "rank {r}'s kernel waited on the board for a rank that left ({n} ranks)"
        );
        assert_eq!(
            async_error(&comms[r]),
            Code::RemoteError,
            "rank {r}, rank 0 left ({n} ranks)"
        );
        let msg = nccl::error::last_error();
        assert!(msg.contains("left a direct collective"), "rank {r}: {msg}");
    }
    assert!(
        (0..c.count)
            .all(|i| get(c.dtype, bufs[0].0, i) == -5.0 && get(c.dtype, bufs[0].1, i) == 99.0),
        "peers touched the buffers of a rank that left the board ({n} ranks)"
    );
    for comm in &comms[1..] {
        nccl::api::comm_abort(nccl::api::comm_handle(comm)).expect("abort");
    }
    release_buffers();
}

/// Four communicators of two ranks, all in this process on a device of 16 SMs that runs 16
/// blocks at once (`OXEMU_RESIDENT=16`): every rank 0 launches its all-reduce first, each on
/// a stream of its own, and the ranks 1 come later. Each rank's board launch takes its share
/// of the device among every rank on a board there (2 blocks), so all eight run at once;
/// with half the device for each communicator's two ranks (4 blocks each), the four ranks 0
/// would fill it waiting for peers that could never start. Every output checked.
pub fn boards_share_the_device() {
    let c = f32_sum(300_001);
    let comms: Vec<_> = (0..4)
        .map(|_| nccl::api::comm_init_all(&[0, 0]).expect("two ranks"))
        .collect();
    let bufs: Vec<_> = comms.iter().map(|_| buffers(&c, 2)).collect();
    let streams: Vec<[usize; 2]> = comms.iter().map(|_| [new_stream(), new_stream()]).collect();
    let before = BOARD_LANES.load(Ordering::SeqCst);
    for r in 0..2 {
        for ((comm, b), s) in comms.iter().zip(&bufs).zip(&streams) {
            fill(&c, 2, r, b[r], 0);
            enqueue(&comm[r], &c, 2, b[r], s[r]);
        }
        if r == 0 {
            // (The ranks 0's blocks take the device first.)
            std::thread::sleep(Duration::from_millis(300));
        }
    }
    let what = "four communicators' board all-reduces on a device of 16 SMs";
    for s in &streams {
        sync_all(s, what);
    }
    assert_eq!(board_lanes_since(before), 8, "{what}: on the board");
    for (comm, b) in comms.iter().zip(&bufs) {
        no_async_error(comm, what);
        verify(&c, b, 0, what);
    }
    for comm in comms.iter().flatten() {
        nccl::api::comm_destroy(nccl::api::comm_handle(comm)).unwrap();
    }
    release_buffers();
}
