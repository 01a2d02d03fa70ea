//! Engine tests through the validated Rust API (the C ABI's tests live in ffi-tests/).
//! Ranks are communicators of this process, driven from one thread inside groups, from one
//! thread per rank, or through host streams. Every result is checked element by element
//! against a reference computed here.

use nccl::api::{self, CollArgs, ScalarArg, StreamArg};
use nccl::comm::Comm;
use nccl::types::{CollKind, DataType, Scalar, OP_AVG, OP_MAX, OP_MIN, OP_PROD, OP_SUM};
use std::sync::Arc;

mod common;

fn comms(n: usize) -> Vec<Arc<Comm>> {
    std::env::set_var("OXCCL_DEVICE", "host");
    let devs: Vec<i32> = (0..n as i32).collect();
    api::comm_init_all(&devs).expect("init all")
}

fn destroy(cs: Vec<Arc<Comm>>) {
    for c in cs {
        let h = api::comm_handle(&c);
        api::comm_destroy(h).expect("destroy");
    }
}

fn args(
    kind: CollKind,
    send: &[i32],
    recv: &mut [i32],
    count: usize,
    op: i32,
    root: i32,
) -> CollArgs {
    CollArgs {
        kind,
        send: send.as_ptr() as usize,
        recv: recv.as_mut_ptr() as usize,
        count,
        dtype: DataType::Int32,
        op,
        root,
    }
}

fn input(rank: usize, i: usize) -> i32 {
    ((rank * 7 + i * 3) % 11) as i32 - 5
}

/// Runs one collective on all ranks of `cs` in one group, i32 data.
fn run_group(cs: &[Arc<Comm>], mk: impl Fn(usize) -> CollArgs) {
    api::group_start().unwrap();
    for (r, c) in cs.iter().enumerate() {
        api::enqueue(c, mk(r), StreamArg::Null).unwrap();
    }
    api::group_end().unwrap();
}

#[test]
fn allreduce_all_ops_many_sizes() {
    for n in [1usize, 2, 3, 4, 8] {
        let cs = comms(n);
        // 100_003 i32 = several FIFO slots per segment.
        for count in [0usize, 1, 5, 1000, 100_003] {
            for op in [OP_SUM, OP_PROD, OP_MAX, OP_MIN, OP_AVG] {
                let sends: Vec<Vec<i32>> = (0..n)
                    .map(|r| (0..count).map(|i| input(r, i)).collect())
                    .collect();
                let mut recvs: Vec<Vec<i32>> = vec![vec![i32::MIN; count]; n];
                let rp: Vec<usize> = recvs.iter_mut().map(|v| v.as_mut_ptr() as usize).collect();
                run_group(&cs, |r| CollArgs {
                    kind: CollKind::AllReduce,
                    send: sends[r].as_ptr() as usize,
                    recv: rp[r],
                    count,
                    dtype: DataType::Int32,
                    op,
                    root: 0,
                });
                for i in 0..count {
                    let col = (0..n).map(|r| sends[r][i]);
                    let want = match op {
                        OP_SUM => col.fold(0i32, |a, b| a.wrapping_add(b)),
                        OP_PROD => col.fold(1i32, |a, b| a.wrapping_mul(b)),
                        OP_MAX => col.max().unwrap(),
                        OP_MIN => col.min().unwrap(),
                        _ => col.fold(0i32, |a, b| a.wrapping_add(b)) / n as i32,
                    };
                    for (r, recv) in recvs.iter().enumerate() {
                        assert_eq!(recv[i], want, "n={n} count={count} op={op} rank={r} i={i}");
                    }
                }
            }
        }
        destroy(cs);
    }
}

#[test]
fn in_place_collectives_and_roots() {
    let n = 3;
    let cs = comms(n);
    let count = 70_001;
    // in-place allreduce
    let mut bufs: Vec<Vec<i32>> = (0..n)
        .map(|r| (0..count).map(|i| input(r, i)).collect())
        .collect();
    let want: Vec<i32> = (0..count)
        .map(|i| (0..n).map(|r| input(r, i)).sum())
        .collect();
    let ps: Vec<usize> = bufs.iter_mut().map(|v| v.as_mut_ptr() as usize).collect();
    run_group(&cs, |r| CollArgs {
        kind: CollKind::AllReduce,
        send: ps[r],
        recv: ps[r],
        count,
        dtype: DataType::Int32,
        op: OP_SUM,
        root: 0,
    });
    for b in &bufs {
        assert!(b == &want, "in-place allreduce");
    }
    // broadcast and reduce from every root
    for root in 0..n {
        let mut bufs: Vec<Vec<i32>> = (0..n)
            .map(|r| (0..count).map(|i| input(r, i)).collect())
            .collect();
        let ps: Vec<usize> = bufs.iter_mut().map(|v| v.as_mut_ptr() as usize).collect();
        run_group(&cs, |r| CollArgs {
            kind: CollKind::Broadcast,
            send: ps[r],
            recv: ps[r],
            count,
            dtype: DataType::Int32,
            op: 0,
            root: root as i32,
        });
        for b in &bufs {
            assert!(
                b.iter().enumerate().all(|(i, &v)| v == input(root, i)),
                "bcast root {root}"
            );
        }
        let sends: Vec<Vec<i32>> = (0..n)
            .map(|r| (0..count).map(|i| input(r, i)).collect())
            .collect();
        let mut out = vec![0i32; count];
        let op = out.as_mut_ptr() as usize;
        run_group(&cs, |r| CollArgs {
            kind: CollKind::Reduce,
            send: sends[r].as_ptr() as usize,
            recv: if r == root { op } else { 0 },
            count,
            dtype: DataType::Int32,
            op: OP_MAX,
            root: root as i32,
        });
        for (i, &v) in out.iter().enumerate() {
            assert_eq!(v, (0..n).map(|r| input(r, i)).max().unwrap());
        }
    }
    // in-place allgather (send = recv + rank*count) and reduce-scatter (recv = send + rank*count)
    let c = 33_333;
    let mut bufs: Vec<Vec<i32>> = (0..n).map(|_| vec![-99; c * n]).collect();
    for (r, b) in bufs.iter_mut().enumerate() {
        for i in 0..c {
            b[r * c + i] = input(r, i);
        }
    }
    let ps: Vec<usize> = bufs.iter_mut().map(|v| v.as_mut_ptr() as usize).collect();
    run_group(&cs, |r| CollArgs {
        kind: CollKind::AllGather,
        send: ps[r] + r * c * 4,
        recv: ps[r],
        count: c,
        dtype: DataType::Int32,
        op: 0,
        root: 0,
    });
    for b in &bufs {
        for r in 0..n {
            for i in 0..c {
                assert_eq!(b[r * c + i], input(r, i));
            }
        }
    }
    let mut bufs: Vec<Vec<i32>> = (0..n)
        .map(|r| (0..c * n).map(|i| input(r, i)).collect())
        .collect();
    let ps: Vec<usize> = bufs.iter_mut().map(|v| v.as_mut_ptr() as usize).collect();
    run_group(&cs, |r| CollArgs {
        kind: CollKind::ReduceScatter,
        send: ps[r],
        recv: ps[r] + r * c * 4,
        count: c,
        dtype: DataType::Int32,
        op: OP_SUM,
        root: 0,
    });
    for (r, b) in bufs.iter().enumerate() {
        for i in 0..c {
            let want: i32 = (0..n).map(|q| input(q, r * c + i)).sum();
            assert_eq!(b[r * c + i], want, "rank {r} i {i}");
        }
    }
    destroy(cs);
}

#[test]
fn alltoall_gather_scatter_and_p2p() {
    for n in [1usize, 2, 4, 5] {
        let cs = comms(n);
        let c = 20_000;
        let sends: Vec<Vec<i32>> = (0..n)
            .map(|r| (0..c * n).map(|i| input(r, i) + 100 * r as i32).collect())
            .collect();
        let mut recvs: Vec<Vec<i32>> = vec![vec![0; c * n]; n];
        let rp: Vec<usize> = recvs.iter_mut().map(|v| v.as_mut_ptr() as usize).collect();
        run_group(&cs, |r| CollArgs {
            kind: CollKind::AlltoAll,
            send: sends[r].as_ptr() as usize,
            recv: rp[r],
            count: c,
            dtype: DataType::Int32,
            op: 0,
            root: 0,
        });
        for (r, recv) in recvs.iter().enumerate() {
            for p in 0..n {
                assert_eq!(&recv[p * c..(p + 1) * c], &sends[p][r * c..(r + 1) * c]);
            }
        }
        let root = n - 1;
        let mut g = vec![0i32; c * n];
        let gp = g.as_mut_ptr() as usize;
        run_group(&cs, |r| CollArgs {
            kind: CollKind::Gather,
            send: sends[r].as_ptr() as usize,
            recv: if r == root { gp } else { 0 },
            count: c,
            dtype: DataType::Int32,
            op: 0,
            root: root as i32,
        });
        for p in 0..n {
            assert_eq!(&g[p * c..(p + 1) * c], &sends[p][..c]);
        }
        let mut recvs: Vec<Vec<i32>> = vec![vec![0; c]; n];
        let rp: Vec<usize> = recvs.iter_mut().map(|v| v.as_mut_ptr() as usize).collect();
        run_group(&cs, |r| CollArgs {
            kind: CollKind::Scatter,
            send: sends[root].as_ptr() as usize,
            recv: rp[r],
            count: c,
            dtype: DataType::Int32,
            op: 0,
            root: root as i32,
        });
        for (r, recv) in recvs.iter().enumerate() {
            assert_eq!(&recv[..], &sends[root][r * c..(r + 1) * c]);
        }
        // all-to-all-v from grouped send/recv: rank r sends (r + p + 1) * 1000 elements to p.
        let cnt = |from: usize, to: usize| (from + to + 1) * 1000;
        let payload =
            |from: usize, to: usize, i: usize| (from * 1_000_000 + to * 10_000 + i) as i32;
        let sbufs: Vec<Vec<Vec<i32>>> = (0..n)
            .map(|r| {
                (0..n)
                    .map(|p| (0..cnt(r, p)).map(|i| payload(r, p, i)).collect())
                    .collect()
            })
            .collect();
        let mut rbufs: Vec<Vec<Vec<i32>>> = (0..n)
            .map(|r| (0..n).map(|p| vec![0; cnt(p, r)]).collect())
            .collect();
        api::group_start().unwrap();
        for r in 0..n {
            for p in 0..n {
                let s = args(
                    CollKind::Send,
                    &sbufs[r][p],
                    &mut [],
                    cnt(r, p),
                    0,
                    p as i32,
                );
                api::enqueue(&cs[r], s, StreamArg::Null).unwrap();
                let rv = CollArgs {
                    kind: CollKind::Recv,
                    send: 0,
                    recv: rbufs[r][p].as_mut_ptr() as usize,
                    count: cnt(p, r),
                    dtype: DataType::Int32,
                    op: 0,
                    root: p as i32,
                };
                api::enqueue(&cs[r], rv, StreamArg::Null).unwrap();
            }
        }
        api::group_end().unwrap();
        for (r, rb) in rbufs.iter().enumerate() {
            for (p, buf) in rb.iter().enumerate() {
                assert!(
                    buf.iter().enumerate().all(|(i, &v)| v == payload(p, r, i)),
                    "a2av {p}->{r}"
                );
            }
        }
        destroy(cs);
    }
}

#[test]
fn one_thread_per_rank_and_host_streams() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let n = 4;
    let id = api::get_unique_id().unwrap();
    let count = 300_000;
    std::thread::scope(|s| {
        for r in 0..n {
            s.spawn(move || {
                let c = api::comm_init_rank(n, &id, r, Default::default()).unwrap();
                let stream = api::host_stream_create().unwrap();
                let sa = api::stream_from_handle(stream).unwrap();
                let send: Vec<f32> = (0..count)
                    .map(|i| ((i % 13) as f32) * (r as f32 + 1.0))
                    .collect();
                let mut recv = vec![0f32; count];
                let mut recv2 = vec![0f32; count];
                for out in [&mut recv, &mut recv2] {
                    let a = CollArgs {
                        kind: CollKind::AllReduce,
                        send: send.as_ptr() as usize,
                        recv: out.as_mut_ptr() as usize,
                        count,
                        dtype: DataType::Float32,
                        op: OP_SUM,
                        root: 0,
                    };
                    api::enqueue(&c, a, sa.clone()).unwrap();
                }
                api::host_stream_synchronize(stream).unwrap();
                assert!(api::host_stream_query(stream).unwrap());
                let k: f32 = (1..=n).map(|x| x as f32).sum();
                for i in 0..count {
                    assert_eq!(recv[i], ((i % 13) as f32) * k);
                    assert_eq!(recv2[i], recv[i]);
                }
                api::host_stream_destroy(stream).unwrap();
                api::comm_destroy(api::comm_handle(&c)).unwrap();
            });
        }
    });
}

/// Work that reads a private copy of its input (in-place all-to-all; a send from the buffer a
/// receive of the same group fills, as nccl-tests' in-place sendrecv does) must take that copy
/// in stream order: here an in-place all-reduce, held up by a late peer, is still to write the
/// buffer when the next operations are launched onto the same host stream.
#[test]
fn private_copies_of_inputs_are_taken_in_stream_order() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let n = 3;
    let id = api::get_unique_id().unwrap();
    // Larger than a connection's FIFO (8 slots of 128 KiB), so a receive can overtake its send.
    let count = 600_000;
    let val = |r: usize, i: usize| ((r * 31 + i * 7) % 1000) as i32;
    let sum = |i: usize| (0..n).map(|r| val(r, i)).sum::<i32>();
    std::thread::scope(|s| {
        for r in 0..n {
            s.spawn(move || {
                let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
                let st = api::host_stream_create().unwrap();
                let sa = api::stream_from_handle(st).unwrap();
                let mut buf: Vec<i32> = (0..count * n).map(|i| val(r, i)).collect();
                let b = buf.as_mut_ptr() as usize;
                if r == 0 {
                    // The last rank to arrive: the others have queued all their work by then.
                    std::thread::sleep(std::time::Duration::from_millis(300));
                }
                let coll = |kind, count, root: usize| CollArgs {
                    kind,
                    send: b,
                    recv: b,
                    count,
                    dtype: DataType::Int32,
                    op: OP_SUM,
                    root: root as i32,
                };
                api::enqueue(&c, coll(CollKind::AllReduce, count * n, 0), sa.clone()).unwrap();
                // Rank r's block p is now sum(r * count + i) for every p.
                api::enqueue(&c, coll(CollKind::AlltoAll, count, 0), sa.clone()).unwrap();
                api::group_start().unwrap();
                let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                api::enqueue(&c, coll(CollKind::Send, count * n, next), sa.clone()).unwrap();
                api::enqueue(&c, coll(CollKind::Recv, count * n, prev), sa.clone()).unwrap();
                api::group_end().unwrap();
                api::host_stream_synchronize(st).unwrap();
                for p in 0..n {
                    for i in 0..count {
                        assert_eq!(
                            buf[p * count + i],
                            sum(prev * count + i),
                            "rank {r}: {p} {i}"
                        );
                    }
                }
                api::host_stream_destroy(st).unwrap();
                api::comm_destroy(api::comm_handle(&c)).unwrap();
            });
        }
    });
}

/// Small operations run on the launching thread at once; when a peer is late they are handed
/// to the stream, taken back by the next launch or synchronize, or left to the stream's worker
/// when the launching thread is busy elsewhere. Every path must keep stream order and results.
#[test]
fn small_operations_with_late_peers() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let id = api::get_unique_id().unwrap();
    let ops = 80;
    let count_of = |k: usize| match k % 9 {
        8 => 100_000, // planned as usual, queued behind small ones
        m => 1 + m * 700 + k,
    };
    let expect = |k: usize, i: usize| -> i32 { (0..2).map(|r| input(r + k, i)).sum() };
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let mut rx = Some(rx);
        for r in 0..2usize {
            let rx = if r == 0 { rx.take() } else { None };
            let tx = tx.clone();
            s.spawn(move || {
                let c = api::comm_init_rank(2, &id, r as i32, Default::default()).unwrap();
                let h = api::host_stream_create().unwrap();
                let stream = api::stream_from_handle(h).unwrap();
                let sends: Vec<Vec<i32>> = (0..ops)
                    .map(|k| (0..count_of(k)).map(|i| input(r + k, i)).collect())
                    .collect();
                let mut recvs: Vec<Vec<i32>> = (0..ops).map(|k| vec![0; count_of(k)]).collect();
                for (k, (send, recv)) in sends.iter().zip(recvs.iter_mut()).enumerate() {
                    // Late peers, one side or the other, for longer than a launch waits.
                    if (r == 1 && k % 7 == 3) || (r == 0 && k % 5 == 1) {
                        std::thread::sleep(std::time::Duration::from_millis(1 + (k % 3) as u64));
                    }
                    let st = if k % 11 == 10 {
                        StreamArg::Null
                    } else {
                        stream.clone()
                    };
                    let a = args(CollKind::AllReduce, send, recv, count_of(k), OP_SUM, 0);
                    api::enqueue(&c, a, st).unwrap();
                    if k % 13 == 12 {
                        api::host_stream_query(h).unwrap();
                    }
                }
                api::host_stream_synchronize(h).unwrap();
                for (k, recv) in recvs.iter().enumerate() {
                    for (i, &v) in recv.iter().enumerate() {
                        assert_eq!(v, expect(k, i), "rank {r} op {k} element {i}");
                    }
                }
                // Rank 0 hands an operation over (rank 1 is late) and then waits for rank 1 to
                // finish it, calling nothing: only the stream's worker can run rank 0's part.
                let send: Vec<i32> = (0..64).map(|i| input(r, i)).collect();
                let mut recv = vec![0i32; 64];
                if r == 1 {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                let a = args(CollKind::AllReduce, &send, &mut recv, 64, OP_SUM, 0);
                api::enqueue(&c, a, stream.clone()).unwrap();
                if r == 0 {
                    rx.expect("rank 0 listens")
                        .recv_timeout(std::time::Duration::from_secs(60))
                        .expect("rank 1 finished without rank 0's thread");
                } else {
                    api::host_stream_synchronize(h).unwrap();
                    tx.send(()).unwrap();
                }
                api::host_stream_synchronize(h).unwrap();
                for (i, &v) in recv.iter().enumerate() {
                    assert_eq!(v, input(0, i) + input(1, i), "rank {r} element {i}");
                }
                api::host_stream_destroy(h).unwrap();
                api::comm_destroy(api::comm_handle(&c)).unwrap();
            });
        }
    });
}

/// Groups of small operations over several ranks of one thread run together on that thread;
/// with the other thread's ranks late, their unfinished parts go to each rank's stream (or, on
/// the NULL stream, run to the end in the group's `ncclGroupEnd`). Four ranks, two threads of
/// two ranks each.
#[test]
fn groups_of_small_operations_with_late_peers() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let id = api::get_unique_id().unwrap();
    let ops = 60;
    let count_of = |k: usize| 1 + (k * 37) % 3000;
    let expect = |k: usize, i: usize| -> i32 { (0..4).map(|r| input(r + k, i)).sum() };
    std::thread::scope(|s| {
        for t in 0..2usize {
            s.spawn(move || {
                let ranks = [2 * t, 2 * t + 1];
                api::group_start().unwrap();
                let cs: Vec<_> = ranks
                    .iter()
                    .map(|&r| api::comm_init_rank(4, &id, r as i32, Default::default()).unwrap())
                    .collect();
                api::group_end().unwrap();
                let hs: Vec<usize> = (0..2).map(|_| api::host_stream_create().unwrap()).collect();
                let sends: Vec<Vec<Vec<i32>>> = ranks
                    .iter()
                    .map(|&r| {
                        (0..ops)
                            .map(|k| (0..count_of(k)).map(|i| input(r + k, i)).collect())
                            .collect()
                    })
                    .collect();
                let mut recvs: Vec<Vec<Vec<i32>>> = (0..2)
                    .map(|_| (0..ops).map(|k| vec![0; count_of(k)]).collect())
                    .collect();
                for k in 0..ops {
                    if (t == 1 && k % 5 == 2) || (t == 0 && k % 7 == 4) {
                        std::thread::sleep(std::time::Duration::from_millis(1 + (k % 3) as u64));
                    }
                    api::group_start().unwrap();
                    for j in 0..2 {
                        let st = if k % 6 == 5 {
                            StreamArg::Null
                        } else {
                            api::stream_from_handle(hs[j]).unwrap()
                        };
                        let (send, recv) = (&sends[j][k], &mut recvs[j][k]);
                        let a = args(CollKind::AllReduce, send, recv, count_of(k), OP_SUM, 0);
                        api::enqueue(&cs[j], a, st).unwrap();
                    }
                    api::group_end().unwrap();
                }
                for &h in &hs {
                    api::host_stream_synchronize(h).unwrap();
                    api::host_stream_destroy(h).unwrap();
                }
                for (j, rv) in recvs.iter().enumerate() {
                    for (k, recv) in rv.iter().enumerate() {
                        for (i, &v) in recv.iter().enumerate() {
                            assert_eq!(v, expect(k, i), "rank {} op {k} element {i}", ranks[j]);
                        }
                    }
                }
                for c in cs {
                    api::comm_destroy(api::comm_handle(&c)).unwrap();
                }
            });
        }
    });
}

/// A small operation whose peer never comes is stopped by ncclCommAbort from another thread,
/// whether it waits on a host stream (handed over by its launch) or blocks its caller (NULL
/// stream): an error, not a hang.
#[test]
fn abort_stops_a_small_operation_waiting_for_its_peer() {
    std::env::set_var("OXCCL_DEVICE", "host");
    for null_stream in [false, true] {
        let id = api::get_unique_id().unwrap();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            s.spawn(move || {
                // Rank 1 joins the communicator but never calls the collective.
                let c = api::comm_init_rank(2, &id, 1, Default::default()).unwrap();
                done_rx
                    .recv_timeout(std::time::Duration::from_secs(120))
                    .expect("rank 0 finished");
                api::comm_destroy(api::comm_handle(&c)).unwrap();
            });
            let c = api::comm_init_rank(2, &id, 0, Default::default()).unwrap();
            let h = api::comm_handle(&c);
            let send = [1i32; 4];
            let mut recv = [0i32; 4];
            let a = args(CollKind::AllReduce, &send, &mut recv, 4, OP_SUM, 0);
            let t0 = std::time::Instant::now();
            let aborter = s.spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(200));
                api::comm_abort(h)
            });
            let r = if null_stream {
                api::enqueue(&c, a, StreamArg::Null)
            } else {
                let st = api::host_stream_create().unwrap();
                api::enqueue(&c, a, api::stream_from_handle(st).unwrap()).unwrap();
                let r = api::host_stream_synchronize(st);
                api::host_stream_destroy(st).unwrap();
                r
            };
            let e = r.expect_err("the operation cannot have completed");
            assert!(e.to_string().contains("abort"), "{e}");
            aborter.join().unwrap().unwrap();
            assert!(t0.elapsed() < std::time::Duration::from_secs(60));
            assert_eq!(recv, [0; 4], "no output without the peer");
            done_tx.send(()).unwrap();
        });
    }
}

#[test]
fn premulsum_host_and_device_scalars() {
    let n = 3;
    let cs = comms(n);
    let count = 5000;
    let scalar = 2.0f64;
    let dev_scalar = 3.0f64;
    let ops: Vec<(i32, i32)> = cs
        .iter()
        .map(|c| {
            let h = api::redop_create_premulsum(
                c,
                DataType::Float64,
                ScalarArg::Host(Scalar {
                    bits: scalar.to_bits(),
                }),
            )
            .unwrap();
            let d = api::redop_create_premulsum(
                c,
                DataType::Float64,
                ScalarArg::Device(&dev_scalar as *const f64 as usize),
            )
            .unwrap();
            (h, d)
        })
        .collect();
    for (which, k) in [(0, scalar), (1, dev_scalar)] {
        let sends: Vec<Vec<f64>> = (0..n)
            .map(|r| (0..count).map(|i| (i % 7) as f64 + r as f64).collect())
            .collect();
        let mut recvs = vec![vec![0f64; count]; n];
        let rp: Vec<usize> = recvs.iter_mut().map(|v| v.as_mut_ptr() as usize).collect();
        run_group(&cs, |r| CollArgs {
            kind: CollKind::AllReduce,
            send: sends[r].as_ptr() as usize,
            recv: rp[r],
            count,
            dtype: DataType::Float64,
            op: if which == 0 { ops[r].0 } else { ops[r].1 },
            root: 0,
        });
        for recv in &recvs {
            for (i, &got) in recv.iter().enumerate() {
                let want: f64 = (0..n).map(|r| ((i % 7) as f64 + r as f64) * k).sum();
                assert_eq!(got, want);
            }
        }
    }
    // an op used with another datatype, and a destroyed op, are errors
    let f = [0f32; 4];
    let mut g = [0f32; 4];
    let bad = CollArgs {
        kind: CollKind::AllReduce,
        send: f.as_ptr() as usize,
        recv: g.as_mut_ptr() as usize,
        count: 4,
        dtype: DataType::Float32,
        op: ops[0].0,
        root: 0,
    };
    assert_eq!(
        api::enqueue(&cs[0], bad, StreamArg::Null).unwrap_err().code,
        nccl::error::Code::InvalidArgument
    );
    for (c, (h, d)) in cs.iter().zip(&ops) {
        api::redop_destroy(c, *h).unwrap();
        api::redop_destroy(c, *d).unwrap();
        assert!(api::redop_destroy(c, *h).is_err());
        assert!(api::redop_destroy(c, OP_SUM).is_err());
    }
    destroy(cs);
}

#[test]
fn bad_arguments_are_errors() {
    use nccl::error::Code;
    let cs = comms(2);
    let b = [0i32; 8];
    let mut o = [0i32; 8];
    let bad_root = args(CollKind::Broadcast, &b, &mut o, 8, 0, 2);
    assert_eq!(
        api::enqueue(&cs[0], bad_root, StreamArg::Null)
            .unwrap_err()
            .code,
        Code::InvalidArgument
    );
    let bad_op = args(CollKind::AllReduce, &b, &mut o, 8, 77, 0);
    assert_eq!(
        api::enqueue(&cs[0], bad_op, StreamArg::Null)
            .unwrap_err()
            .code,
        Code::InvalidArgument
    );
    let mut null_recv = args(CollKind::AllReduce, &b, &mut o, 8, 0, 0);
    null_recv.recv = 0;
    assert_eq!(
        api::enqueue(&cs[0], null_recv, StreamArg::Null)
            .unwrap_err()
            .code,
        Code::InvalidArgument
    );
    let huge = args(CollKind::AllGather, &b, &mut o, usize::MAX / 2, 0, 0);
    assert_eq!(
        api::enqueue(&cs[0], huge, StreamArg::Null)
            .unwrap_err()
            .code,
        Code::InvalidArgument
    );
    assert_eq!(
        api::stream_from_handle(0x1234).err().unwrap().code,
        Code::InvalidArgument
    );
    assert_eq!(api::group_end().unwrap_err().code, Code::InvalidUsage);
    let h = api::comm_handle(&cs[0]);
    api::comm_destroy(h).unwrap();
    assert_eq!(
        api::comm_from_handle(h).err().unwrap().code,
        Code::InvalidArgument
    );
    api::comm_destroy(api::comm_handle(&cs[1])).unwrap();
}

#[test]
fn two_ranks_one_element_each_segment_but_one_empty() {
    let cs = comms(2);
    let s0 = [3i32];
    let s1 = [4i32];
    let mut r0 = [0i32];
    let mut r1 = [0i32];
    let (p0, p1) = (r0.as_mut_ptr() as usize, r1.as_mut_ptr() as usize);
    run_group(&cs, |r| CollArgs {
        kind: CollKind::AllReduce,
        send: if r == 0 {
            s0.as_ptr() as usize
        } else {
            s1.as_ptr() as usize
        },
        recv: if r == 0 { p0 } else { p1 },
        count: 1,
        dtype: DataType::Int32,
        op: OP_SUM,
        root: 0,
    });
    assert_eq!((r0[0], r1[0]), (7, 7));
}

/// Child side of `separate_processes_share_memory`: one rank of a comm whose ranks are
/// processes (the unique id travels in the environment, hex-encoded).
fn child_rank(id: [u8; nccl::api::UNIQUE_ID_BYTES], n: usize, r: usize) {
    let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
    let count = 1_000_003;
    let send: Vec<i64> = (0..count)
        .map(|i| (i as i64 % 1000) * (r as i64 + 1))
        .collect();
    let mut recv = vec![0i64; count];
    let a = CollArgs {
        kind: CollKind::AllReduce,
        send: send.as_ptr() as usize,
        recv: recv.as_mut_ptr() as usize,
        count,
        dtype: DataType::Int64,
        op: OP_SUM,
        root: 0,
    };
    api::enqueue(&c, a, StreamArg::Null).unwrap();
    let k: i64 = (1..=n as i64).sum();
    for (i, &v) in recv.iter().enumerate() {
        assert_eq!(v, (i as i64 % 1000) * k, "rank {r} element {i}");
    }
    // all-gather of rank-tagged blocks
    let blk = 10_000;
    let mine: Vec<i64> = (0..blk).map(|i| (r * 1_000_000 + i) as i64).collect();
    let mut all = vec![0i64; blk * n];
    let a = CollArgs {
        kind: CollKind::AllGather,
        send: mine.as_ptr() as usize,
        recv: all.as_mut_ptr() as usize,
        count: blk,
        dtype: DataType::Int64,
        op: 0,
        root: 0,
    };
    api::enqueue(&c, a, StreamArg::Null).unwrap();
    for q in 0..n {
        for i in 0..blk {
            assert_eq!(all[q * blk + i], (q * 1_000_000 + i) as i64);
        }
    }
    // ncclMemAlloc buffers: peers in other processes map them and work in place (zero copy).
    let count = 300_001;
    let bytes = count * 8;
    let (sp, rp) = (
        api::mem_alloc(bytes).unwrap(),
        api::mem_alloc(bytes * n).unwrap(),
    );
    // SAFETY: fresh allocations of the sizes used.
    let (sv, rv) = unsafe {
        (
            std::slice::from_raw_parts_mut(sp as *mut i64, count),
            std::slice::from_raw_parts_mut(rp as *mut i64, count * n),
        )
    };
    for (i, v) in sv.iter_mut().enumerate() {
        *v = (i as i64 % 977) - (r as i64) * 3;
    }
    for (kind, recv) in [(CollKind::AllReduce, rp), (CollKind::AllReduce, sp)] {
        let a = CollArgs {
            kind,
            send: sp,
            recv,
            count,
            dtype: DataType::Int64,
            op: OP_SUM,
            root: 0,
        };
        api::enqueue(&c, a, StreamArg::Null).unwrap();
    }
    // out of place, then in place over the same inputs: both give the sum
    let ksum: i64 = (0..n as i64).map(|q| -q * 3).sum();
    for i in 0..count {
        let once = (i as i64 % 977) * n as i64 + ksum;
        assert_eq!(rv[i], once, "memalloc allreduce rank {r} element {i}");
        assert_eq!(
            sv[i], once,
            "memalloc in-place allreduce rank {r} element {i}"
        );
    }
    let a = CollArgs {
        kind: CollKind::AllGather,
        send: sp,
        recv: rp,
        count,
        dtype: DataType::Int64,
        op: 0,
        root: 0,
    };
    api::enqueue(&c, a, StreamArg::Null).unwrap();
    for q in 0..n {
        assert_eq!(rv[q * count + 5], sv[5], "memalloc allgather block {q}");
    }
    api::mem_free(sp).unwrap();
    api::mem_free(rp).unwrap();
    // Small operations back to back (eager: inputs on the board, two areas by parity), each
    // rank with its own PreMulSum scalar, alternating with a sum and an all-gather.
    let scalar = (r + 1) as f64;
    let op = api::redop_create_premulsum(
        &c,
        DataType::Float64,
        ScalarArg::Host(Scalar {
            bits: scalar.to_bits(),
        }),
    )
    .unwrap();
    let small = 7;
    for it in 0..300usize {
        let x: Vec<f64> = (0..small).map(|i| (it * 10 + i + r) as f64).collect();
        let mut y = vec![0f64; small * n];
        let a = CollArgs {
            kind: [CollKind::AllReduce, CollKind::AllGather][it % 2],
            send: x.as_ptr() as usize,
            recv: y.as_mut_ptr() as usize,
            count: small,
            dtype: DataType::Float64,
            op: [op, 0][it % 2],
            root: 0,
        };
        api::enqueue(&c, a, StreamArg::Null).unwrap();
        for i in 0..small {
            if it % 2 == 0 {
                let want: f64 = (0..n)
                    .map(|q| (q + 1) as f64 * (it * 10 + i + q) as f64)
                    .sum();
                assert_eq!(
                    y[i], want,
                    "eager premulsum rank {r} iteration {it} element {i}"
                );
            } else {
                for q in 0..n {
                    let want = (it * 10 + i + q) as f64;
                    assert_eq!(
                        y[q * small + i],
                        want,
                        "eager allgather rank {r} iteration {it}"
                    );
                }
            }
        }
    }
    api::redop_destroy(&c, op).unwrap();
    api::comm_destroy(api::comm_handle(&c)).unwrap();
}

#[test]
fn separate_processes_share_memory() {
    if let Some((id, n, r)) = common::rank_env() {
        return child_rank(id, n, r);
    }
    std::env::set_var("OXCCL_DEVICE", "host");
    for n in [2usize, 3] {
        common::run_ranks("separate_processes_share_memory", n, &[]);
    }
    let left = common::shm_files();
    assert!(left.is_empty(), "shared memory left behind: {left:?}");
}

/// Not a test: times 2-rank AllReduce from two threads (`cargo test --release --test engine
/// timing -- --ignored --nocapture`; compare with OXCCL_ALGO=ring).
#[test]
#[ignore]
fn timing_two_threads_allreduce() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let id = api::get_unique_id().unwrap();
    for count in [2usize, 1 << 15, 1 << 19, 1 << 22] {
        let iters = if count < 1 << 18 { 2000 } else { 100 };
        let t = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    s.spawn(move || {
                        let c = api::comm_init_rank(2, &id, r, Default::default()).unwrap();
                        let send = vec![1f32; count];
                        let mut recv = vec![0f32; count];
                        let a = CollArgs {
                            kind: CollKind::AllReduce,
                            send: send.as_ptr() as usize,
                            recv: recv.as_mut_ptr() as usize,
                            count,
                            dtype: DataType::Float32,
                            op: OP_SUM,
                            root: 0,
                        };
                        for _ in 0..10 {
                            api::enqueue(&c, a, StreamArg::Null).unwrap();
                        }
                        let t0 = std::time::Instant::now();
                        for _ in 0..iters {
                            api::enqueue(&c, a, StreamArg::Null).unwrap();
                        }
                        let dt = t0.elapsed().as_secs_f64() / iters as f64;
                        assert!(recv.iter().all(|&v| v == 2.0));
                        api::comm_destroy(api::comm_handle(&c)).unwrap();
                        dt
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .fold(0f64, f64::max)
        });
        eprintln!(
            "count {count:>8}: {:>9.2} us  busbw {:.2} GB/s",
            t * 1e6,
            (count * 4) as f64 / t / 1e9
        );
    }
}
