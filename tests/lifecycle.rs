//! The calls people use when something failed: `ncclCommShrink` (with and without
//! `NCCL_SHRINK_ABORT`, after a peer died), `ncclCommRevoke`, and non-blocking communicators
//! (`config.blocking = 0`: init in the background, `ncclCommGetAsyncError` says when it is done).

use nccl::api::{self, CollArgs, StreamArg};
use nccl::error::Code;
use nccl::types::CommConfig;
use std::time::{Duration, Instant};

mod common;

fn err<T>(r: nccl::error::Result<T>) -> nccl::error::Error {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

fn sum_check(c: &std::sync::Arc<nccl::comm::Comm>, me: f32, want: f32, what: &str) {
    let send = vec![me; 1000];
    let mut recv = vec![0f32; 1000];
    api::enqueue(c, common::all_reduce_f32(&send, &mut recv), StreamArg::Null)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(recv.iter().all(|&x| x == want), "{what}: {:?}", &recv[..4]);
}

/// Three ranks as threads; ranks 0 and 2 shrink rank 1 away (rank 1 does not call), renumbered
/// 0 and 1, and all-reduce on the new communicator. Bad exclusion lists are errors.
#[test]
fn shrink_excludes_ranks_and_renumbers_the_rest() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let comms = api::comm_init_all(&[0, 1, 2]).unwrap();
    let e = err(api::comm_shrink(&comms[0], &[0], None, false));
    assert_eq!(e.code, Code::InvalidUsage, "{e}");
    let e = err(api::comm_shrink(&comms[0], &[1, 1], None, false));
    assert_eq!(e.code, Code::InvalidArgument, "{e}");
    let e = err(api::comm_shrink(&comms[0], &[3], None, false));
    assert_eq!(e.code, Code::InvalidArgument, "{e}");
    std::thread::scope(|s| {
        for old in [0usize, 2] {
            let c = &comms[old];
            s.spawn(move || {
                let n = api::comm_shrink(c, &[1], None, false).unwrap();
                assert_eq!(n.nranks().unwrap(), 2);
                assert_eq!(n.rank().unwrap(), (old / 2) as i32);
                sum_check(&n, old as f32 + 1.0, 4.0, "shrunk comm");
                api::comm_destroy(api::comm_handle(&n)).unwrap();
            });
        }
    });
    for c in comms {
        api::comm_destroy(api::comm_handle(&c)).unwrap();
    }
}

/// Three processes; rank 2 dies; ranks 0 and 1 see the error, shrink with `NCCL_SHRINK_ABORT`
/// and go on with the two of them. The old communicator's asynchronous error is cleared by the
/// shrink (PyTorch polls it after a shrink, and would fail the shrink on it, as on NCCL), while
/// its calls still fail.
#[test]
fn shrink_after_a_peer_died() {
    let Some((id, n, r)) = common::rank_env() else {
        return common::run_ranks("shrink_after_a_peer_died", 3, &[]);
    };
    let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
    sum_check(&c, 1.0, 3.0, "before the death");
    if r == 2 {
        // Exits with success for run_ranks' sake: the others see a dead process all the same.
        std::process::exit(0);
    }
    std::thread::sleep(Duration::from_millis(100));
    let send = vec![1f32; 1000];
    let mut recv = vec![0f32; 1000];
    let e = api::enqueue(
        &c,
        common::all_reduce_f32(&send, &mut recv),
        StreamArg::Null,
    )
    .unwrap_err();
    assert_eq!(e.code, Code::RemoteError, "{e}");
    assert_eq!(api::comm_async_error(&c), Code::RemoteError);
    let t0 = Instant::now();
    let s = api::comm_shrink(&c, &[2], None, true).unwrap();
    eprintln!("rank {r}: shrink took {:?}", t0.elapsed());
    assert_eq!((s.nranks().unwrap(), s.rank().unwrap()), (2, r as i32));
    assert_eq!(api::comm_async_error(&s), Code::Success);
    assert_eq!(
        api::comm_async_error(&c),
        Code::Success,
        "the old communicator"
    );
    let e = api::enqueue(
        &c,
        common::all_reduce_f32(&send, &mut recv),
        StreamArg::Null,
    )
    .unwrap_err();
    assert_eq!(e.code, Code::RemoteError, "the old communicator: {e}");
    sum_check(&s, r as f32 + 1.0, 3.0, "after the shrink");
    api::comm_destroy(api::comm_handle(&s)).unwrap();
    let _ = api::comm_abort(api::comm_handle(&c));
}

/// A revoked communicator's work in flight ends in an error, the revoke returns once nothing
/// runs, and the communicator then refuses collectives (but can still be shrunk).
#[test]
fn revoke_stops_work_in_flight() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let comms = api::comm_init_all(&[0, 1]).unwrap();
    let sh = api::host_stream_create().unwrap();
    let count = 1 << 20;
    let send = vec![1f32; count];
    let mut recv = vec![0f32; count];
    // Rank 0 alone: its work waits for rank 1 on its stream.
    let a: CollArgs = common::all_reduce_f32(&send, &mut recv);
    api::enqueue(&comms[0], a, api::stream_from_handle(sh).unwrap()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    api::comm_revoke(&comms[0]).unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "revoke took {:?}",
        t0.elapsed()
    );
    let e = api::host_stream_synchronize(sh).unwrap_err();
    assert_eq!(e.code, Code::RemoteError, "{e}");
    assert!(e.msg.contains("revoked"), "{e}");
    let e = api::enqueue(&comms[0], a, StreamArg::Null).unwrap_err();
    assert_eq!(e.code, Code::InvalidUsage, "{e}");
    assert!(e.msg.contains("revoked"), "{e}");
    // Once only (as NCCL's); and a finalized communicator is not revoked, nor finalized twice.
    let e = api::comm_revoke(&comms[0]).unwrap_err();
    assert_eq!(e.code, Code::InvalidArgument, "{e}");
    assert!(e.msg.contains("revoked already"), "{e}");
    api::comm_finalize(&comms[1]).unwrap();
    for e in [
        api::comm_finalize(&comms[1]).unwrap_err(),
        api::comm_revoke(&comms[1]).unwrap_err(),
    ] {
        assert_eq!(e.code, Code::InvalidArgument, "{e}");
        assert!(e.msg.contains("finalized"), "{e}");
    }
    api::host_stream_destroy(sh).unwrap();
    for c in comms {
        let _ = api::comm_abort(api::comm_handle(&c));
    }
}

/// Polls a non-blocking communicator until its init ends (within 30 s of `t0`), which must be
/// a success.
fn await_ready(c: &std::sync::Arc<nccl::comm::Comm>, t0: Instant) {
    while api::comm_async_error(c) == Code::InProgress {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "init never completed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(api::comm_async_error(c), Code::Success);
}

fn nonblocking() -> CommConfig {
    CommConfig {
        blocking: Some(false),
        ..Default::default()
    }
}

/// Non-blocking init: the call returns at once, `ncclCommGetAsyncError` says `ncclInProgress`
/// until the peers are there, then `ncclSuccess`; using the communicator before is an error.
#[test]
fn nonblocking_init_completes_in_the_background() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let id = api::get_unique_id().unwrap();
    let c0 = api::comm_init_rank(2, &id, 0, nonblocking()).unwrap();
    // Rank 1 is not there yet: rank 0's init cannot be done.
    assert_eq!(api::comm_async_error(&c0), Code::InProgress);
    assert!(c0.init_in_progress());
    let send = vec![1f32; 8];
    let mut recv = vec![0f32; 8];
    let e = api::enqueue(
        &c0,
        common::all_reduce_f32(&send, &mut recv),
        StreamArg::Null,
    )
    .unwrap_err();
    assert!(e.msg.contains("in progress"), "{e}");
    assert_eq!(e.code, Code::InvalidArgument, "as NCCL's: {e}");
    // Destroying it meanwhile is refused at once (as NCCL's), the handle still good.
    let e = api::comm_destroy(api::comm_handle(&c0)).unwrap_err();
    assert_eq!(e.code, Code::InvalidArgument, "{e}");
    assert!(e.msg.contains("ncclCommAbort"), "{e}");
    assert_eq!(api::comm_async_error(&c0), Code::InProgress);
    let c1 = api::comm_init_rank(2, &id, 1, nonblocking()).unwrap();
    let t0 = Instant::now();
    for c in [&c0, &c1] {
        await_ready(c, t0);
    }
    std::thread::scope(|s| {
        for (r, c) in [&c0, &c1].into_iter().enumerate() {
            s.spawn(move || sum_check(c, r as f32 + 1.0, 3.0, "non-blocking comm"));
        }
    });
    // A split with a non-blocking config is non-blocking too, and so is one given no config
    // (it inherits its parent's, as in NCCL).
    let mut kids = Vec::new();
    for config in [Some(nonblocking()), None] {
        let two: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = [&c0, &c1]
                .into_iter()
                .map(|c| {
                    let config = config.clone();
                    s.spawn(move || api::comm_split(c, 0, 0, config).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        for k in &two {
            await_ready(k, Instant::now());
            let core = k.core().expect("initialised");
            assert_eq!(core.config.blocking, Some(false), "{config:?}");
        }
        kids.extend(two);
    }
    for c in kids.into_iter().chain([c0, c1]) {
        api::comm_destroy(api::comm_handle(&c)).unwrap();
    }
}

/// A group holding only non-blocking inits ends at once with `ncclInProgress`, the inits
/// running on, as NCCL's: two threads (two processes' main threads, say) that each make two
/// non-blocking communicators, each in a group of its own, in opposite orders, both get
/// through (a group end that waited for its inits would wait for good: each thread's first
/// init waits for the other thread's second). A group with a call in it still runs its inits
/// first and returns when the call is launched.
#[test]
fn nonblocking_inits_in_a_group_run_on_after_its_end() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let ids = [api::get_unique_id().unwrap(), api::get_unique_id().unwrap()];
    let what = "two threads' non-blocking group inits";
    let made: Vec<Vec<_>> = common::within(60, what, move || {
        std::thread::scope(|s| {
            let hs: Vec<_> = [[0usize, 1], [1, 0]]
                .into_iter()
                .enumerate()
                .map(|(rank, order)| {
                    let ids = &ids;
                    s.spawn(move || {
                        let t0 = Instant::now();
                        let mut comms = vec![None, None];
                        for which in order {
                            api::group_start().unwrap();
                            let c = api::comm_init_rank(2, &ids[which], rank as i32, nonblocking());
                            let c = c.expect("returns ncclSuccess inside the group, as NCCL's");
                            let e = api::group_end().expect_err("the inits run on");
                            assert_eq!(e.code, Code::InProgress, "{e}");
                            comms[which] = Some(c);
                        }
                        assert!(t0.elapsed() < Duration::from_secs(10), "a group end waited");
                        let comms: Vec<_> = comms.into_iter().map(Option::unwrap).collect();
                        for c in &comms {
                            await_ready(c, t0);
                        }
                        comms
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    });
    for which in 0..2 {
        std::thread::scope(|s| {
            for (r, per_rank) in made.iter().enumerate() {
                let c = &per_rank[which];
                s.spawn(move || sum_check(c, r as f32 + 1.0, 3.0, "group-made non-blocking comm"));
            }
        });
    }
    // One thread, both ranks: two non-blocking inits and an all-reduce of the communicators
    // made above, in one group, which returns once the inits are done and the call launched.
    let id = api::get_unique_id().unwrap();
    let send = [vec![1f32; 64], vec![2f32; 64]];
    let mut recv = [vec![0f32; 64], vec![0f32; 64]];
    api::group_start().unwrap();
    let two: Vec<_> = (0..2)
        .map(|r| api::comm_init_rank(2, &id, r, nonblocking()).unwrap())
        .collect();
    for (r, per_rank) in made.iter().enumerate() {
        let a = common::all_reduce_f32(&send[r], &mut recv[r]);
        api::enqueue(&per_rank[0], a, StreamArg::Null).unwrap();
    }
    api::group_end().expect("a group with a call returns when it is launched");
    assert!(recv.iter().flatten().all(|&x| x == 3.0));
    for c in &two {
        assert_eq!(api::comm_async_error(c), Code::Success);
    }
    for c in made.into_iter().flatten().chain(two) {
        api::comm_destroy(api::comm_handle(&c)).unwrap();
    }
}

/// One group of a float sum all-reduce on each of 3 communicators of this thread's ranks, of
/// 256 ones, twos and fours: what each received.
fn all_reduce_each(comms: &[std::sync::Arc<nccl::comm::Comm>]) -> [Vec<f32>; 3] {
    let send = [vec![1f32; 256], vec![2f32; 256], vec![4f32; 256]];
    let mut recv = [vec![0f32; 256], vec![0f32; 256], vec![0f32; 256]];
    api::group_start().unwrap();
    for (k, (s, r)) in comms.iter().zip(send.iter().zip(recv.iter_mut())) {
        api::enqueue(k, common::all_reduce_f32(s, r), StreamArg::Null).unwrap();
    }
    api::group_end().unwrap();
    recv
}

/// `ncclCommSplit` inside a group runs at the group's end, as NCCL's: one thread splits the
/// communicators of all its ranks in one group (each split's exchange needs the others'),
/// blocking or not; a rank with `NCCL_SPLIT_NOCOLOR` gets no communicator but takes part.
#[test]
fn one_thread_splits_all_its_ranks_in_one_group() {
    std::env::set_var("OXCCL_DEVICE", "host");
    for config in [None, Some(nonblocking())] {
        common::within(60, "splits in one group", move || {
            let comms = api::comm_init_all(&[0, 1, 2, 3]).unwrap();
            api::group_start().unwrap();
            // Colors 0, 1, 0, none; keys put old rank 2 before old rank 0.
            let kids: Vec<_> = (0..4)
                .map(|r| {
                    let color = if r == 3 { -1 } else { (r % 2) as i32 };
                    api::comm_split(&comms[r], color, -(r as i32), config.clone()).unwrap()
                })
                .collect();
            assert!(kids[3].is_none() && kids[..3].iter().all(Option::is_some));
            match api::group_end() {
                Ok(()) => assert!(config.is_none()),
                Err(e) => assert_eq!((e.code, config.is_some()), (Code::InProgress, true), "{e}"),
            }
            let kids: Vec<_> = kids.into_iter().flatten().collect();
            for k in &kids {
                await_ready(k, Instant::now());
            }
            let place = |k: &std::sync::Arc<nccl::comm::Comm>| {
                let c = k.core().unwrap();
                (c.rank, c.nranks)
            };
            let places: Vec<_> = kids.iter().map(place).collect();
            assert_eq!(places, [(1, 2), (0, 1), (0, 2)], "old ranks 0, 1, 2");
            // Color 0 (old ranks 0 and 2) reduces; color 1 (old rank 1 alone) copies.
            let recv = all_reduce_each(&kids);
            assert!(recv[0].iter().chain(&recv[2]).all(|&x| x == 5.0));
            assert!(recv[1].iter().all(|&x| x == 2.0));
            for c in kids.into_iter().chain(comms) {
                api::comm_destroy(api::comm_handle(&c)).unwrap();
            }
        });
    }
}

/// `ncclCommShrink` inside a group runs at the group's end, as NCCL's: one thread shrinks the
/// communicators of 3 of its 4 ranks in one group (each shrink's exchange needs the others'),
/// blocking, and non-blocking with `NCCL_SHRINK_ABORT`; a bad exclusion list is refused at
/// the call. The new communicators all-reduce.
#[test]
fn one_thread_shrinks_its_ranks_in_one_group() {
    std::env::set_var("OXCCL_DEVICE", "host");
    for (config, abort) in [(None, false), (Some(nonblocking()), true)] {
        common::within(60, "shrinks in one group", move || {
            let comms = api::comm_init_all(&[0, 1, 2, 3]).unwrap();
            api::group_start().unwrap();
            let e = err(api::group_noted(api::comm_shrink(
                &comms[0],
                &[3, 3],
                None,
                abort,
            )));
            assert_eq!(e.code, Code::InvalidArgument, "{e}");
            api::group_end().expect_err("the group of a refused shrink");
            api::group_start().unwrap();
            let kids: Vec<_> = (0..3)
                .map(|r| api::comm_shrink(&comms[r], &[3], config.clone(), abort).unwrap())
                .collect();
            match api::group_end() {
                Ok(()) => assert!(config.is_none()),
                Err(e) => assert_eq!((e.code, config.is_some()), (Code::InProgress, true), "{e}"),
            }
            for k in &kids {
                await_ready(k, Instant::now());
            }
            for (r, k) in kids.iter().enumerate() {
                assert_eq!((k.rank().unwrap(), k.nranks().unwrap()), (r as i32, 3));
            }
            let recv = all_reduce_each(&kids);
            assert!(recv.iter().flatten().all(|&x| x == 7.0));
            for c in kids.into_iter().chain(comms) {
                api::comm_destroy(api::comm_handle(&c)).unwrap();
            }
        });
    }
}

/// A non-blocking split or shrink made inside a group keeps its parent's
/// `ncclCommGetAsyncError` at `ncclInProgress` until the new communicator's init is done, as
/// one made outside a group does (PyTorch waits on the parent): rank 0's, in a group, waits
/// for the other ranks, which come later, from threads of their own.
#[test]
fn nonblocking_children_made_in_a_group_keep_the_parent_in_progress() {
    std::env::set_var("OXCCL_DEVICE", "host");
    for shrink in [false, true] {
        common::within(60, "a parent of a child made in a group", move || {
            let comms = api::comm_init_all(&[0, 1, 2]).unwrap();
            let derive = |r: usize| {
                if shrink {
                    api::comm_shrink(&comms[r], &[2], Some(nonblocking()), false).unwrap()
                } else {
                    let c = api::comm_split(&comms[r], 0, r as i32, Some(nonblocking()));
                    c.unwrap().expect("a member")
                }
            };
            api::group_start().unwrap();
            let k0 = derive(0);
            assert_eq!(api::group_end().unwrap_err().code, Code::InProgress);
            std::thread::sleep(Duration::from_millis(200));
            assert_eq!(
                api::comm_async_error(&comms[0]),
                Code::InProgress,
                "the parent while its child waits for the other ranks (shrink: {shrink})"
            );
            let others: Vec<_> = std::thread::scope(|s| {
                let late = if shrink { 1..2 } else { 1..3 };
                let ts: Vec<_> = late.map(|r| s.spawn(move || derive(r))).collect();
                ts.into_iter().map(|t| t.join().unwrap()).collect()
            });
            let t0 = Instant::now();
            while api::comm_async_error(&comms[0]) == Code::InProgress {
                assert!(t0.elapsed() < Duration::from_secs(30), "never done");
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(api::comm_async_error(&comms[0]), Code::Success);
            assert_eq!(api::comm_async_error(&k0), Code::Success);
            for k in &others {
                await_ready(k, Instant::now());
            }
            for c in others.into_iter().chain([k0]).chain(comms) {
                api::comm_destroy(api::comm_handle(&c)).unwrap();
            }
        });
    }
}

/// A communicator destroyed (or aborted) inside the group that would make it is not made at
/// the group's end: the end does not wait for its peers, which will never come.
#[test]
fn a_communicator_destroyed_before_its_group_ends_is_not_made() {
    std::env::set_var("OXCCL_DEVICE", "host");
    for (config, abort) in [(CommConfig::default(), false), (nonblocking(), true)] {
        let what = "a group ending after its communicator's destroy";
        common::within(30, what, move || {
            let id = api::get_unique_id().unwrap();
            api::group_start().unwrap();
            let c = api::comm_init_rank(2, &id, 0, config).unwrap();
            let h = api::comm_handle(&c);
            if abort {
                api::comm_abort(h).unwrap();
            } else {
                api::comm_destroy(h).unwrap();
            }
            let t0 = Instant::now();
            let _ = api::group_end();
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the group's end waited"
            );
            let e = c.core().err().expect("not made");
            assert!(e.msg.contains("destroyed"), "{e}");
        });
    }
}

/// A non-blocking shrink's new communicator inits in the background, and, as in NCCL (where
/// that init is a job of the parent), the parent's `ncclCommGetAsyncError` says `ncclInProgress`
/// until it is done: PyTorch waits on the parent after a shrink, then asks the new
/// communicator its rank. Ranks 0 and 1 of 3 shrink rank 2 away, rank 1 a while after rank 0
/// (whose shrink, the leader's, returns at once).
#[test]
fn nonblocking_shrink_is_in_progress_on_the_parent() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let comms = api::comm_init_all(&[0, 1, 2]).unwrap();
    let k0 = api::comm_shrink(&comms[0], &[2], Some(nonblocking()), false).unwrap();
    assert_eq!(api::comm_async_error(&k0), Code::InProgress);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        api::comm_async_error(&comms[0]),
        Code::InProgress,
        "rank 0's parent while its new communicator waits for rank 1"
    );
    let k1 = api::comm_shrink(&comms[1], &[2], Some(nonblocking()), false).unwrap();
    let t0 = Instant::now();
    for (parent, kid) in [(&comms[0], &k0), (&comms[1], &k1)] {
        // What PyTorch does: wait on the parent, then use the new communicator.
        while api::comm_async_error(parent) == Code::InProgress {
            assert!(t0.elapsed() < Duration::from_secs(30), "never done");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(api::comm_async_error(parent), Code::Success);
        assert_eq!(api::comm_async_error(kid), Code::Success);
        assert_eq!(kid.nranks().unwrap(), 2);
    }
    std::thread::scope(|s| {
        for (r, k) in [&k0, &k1].into_iter().enumerate() {
            s.spawn(move || sum_check(k, r as f32 + 1.0, 3.0, "shrunk non-blocking comm"));
        }
    });
    for c in [k0, k1].into_iter().chain(comms) {
        api::comm_destroy(api::comm_handle(&c)).unwrap();
    }
}

/// Aborting a non-blocking communicator whose init waits for a peer that never comes returns
/// at once and leaves no thread behind.
#[test]
fn abort_during_nonblocking_init() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let id = api::get_unique_id().unwrap();
    let c = api::comm_init_rank(2, &id, 0, nonblocking()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(api::comm_async_error(&c), Code::InProgress);
    let t0 = Instant::now();
    let _ = api::comm_abort(api::comm_handle(&c));
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "abort took {:?}",
        t0.elapsed()
    );
}

/// A non-blocking init that fails says why: `ncclCommGetAsyncError` gives the code and
/// `ncclGetLastError` the message, naming the rank (nobody else gets the init's error). Rank 0
/// gives up its init; rank 1 joins afterwards and can no longer connect: rank 0's leaving
/// failed the rendezvous, whose root (in rank 0's process) then closed.
#[test]
fn a_failed_nonblocking_init_says_why() {
    if !common::is_child() {
        common::in_child(
            "a_failed_nonblocking_init_says_why",
            &[("OXCCL_BOOTSTRAP_CONNECT_S", "1")],
        );
        return;
    }
    let id = api::get_unique_id().unwrap();
    let c0 = api::comm_init_rank(2, &id, 0, nonblocking()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let _ = api::comm_abort(api::comm_handle(&c0));
    let c1 = api::comm_init_rank(2, &id, 1, nonblocking()).unwrap();
    let t0 = Instant::now();
    while api::comm_async_error(&c1) == Code::InProgress {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the init never ended"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let code = api::comm_async_error(&c1);
    assert_ne!(code, Code::Success, "the init succeeded without rank 0");
    let msg = nccl::error::last_error();
    assert!(
        msg.contains("non-blocking communicator init: bootstrap of rank 1 of 2")
            && msg.contains("for the bootstrap root at"),
        "{code:?}: {msg:?}"
    );
    api::comm_destroy(api::comm_handle(&c1)).unwrap();
}

/// `ncclCommSplit` does not wait for the parent's work (as NCCL's, whose split only talks
/// over the bootstrap): rank 0 queues an all-reduce on X, then one on the parent Y, on one
/// stream, and splits Y; rank 1 splits Y first, then makes the same two calls. Had rank 0's
/// split waited for Y's all-reduce, queued behind X's, which waits for rank 1's X call, which
/// comes after rank 1's split, which waits for rank 0's: neither would ever go on.
#[test]
fn a_split_does_not_wait_for_the_parents_work() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let xs = api::comm_init_all(&[0, 1]).unwrap();
    let ys = api::comm_init_all(&[0, 1]).unwrap();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for r in 0..2 {
            let (x, y) = (&xs[r], &ys[r]);
            s.spawn(move || {
                let me = r as f32 + 1.0;
                let send = vec![me; 1000];
                let (mut rx, mut ry) = (vec![0f32; 1000], vec![0f32; 1000]);
                let sh = api::host_stream_create().unwrap();
                let st = || api::stream_from_handle(sh).unwrap();
                let calls = |rx: &mut Vec<f32>, ry: &mut Vec<f32>| {
                    api::enqueue(x, common::all_reduce_f32(&send, rx), st()).unwrap();
                    api::enqueue(y, common::all_reduce_f32(&send, ry), st()).unwrap();
                };
                let kid = if r == 0 {
                    calls(&mut rx, &mut ry);
                    api::comm_split(y, 0, 0, None).unwrap().unwrap()
                } else {
                    let k = api::comm_split(y, 0, 0, None).unwrap().unwrap();
                    calls(&mut rx, &mut ry);
                    k
                };
                api::host_stream_synchronize(sh).unwrap();
                api::host_stream_destroy(sh).unwrap();
                assert!(rx.iter().chain(&ry).all(|&v| v == 3.0), "rank {r}");
                sum_check(&kid, me, 3.0, "the split");
                api::comm_destroy(api::comm_handle(&kid)).unwrap();
            });
        }
    });
    assert!(t0.elapsed() < Duration::from_secs(60));
    for c in xs.into_iter().chain(ys) {
        api::comm_destroy(api::comm_handle(&c)).unwrap();
    }
}

/// A split color that is neither >= 0 nor `NCCL_SPLIT_NOCOLOR` fails every rank's split,
/// naming the rank that gave it, at once (refused before the exchange, the others would wait
/// in it for that rank); the parent still works.
#[test]
fn a_bad_split_color_fails_every_rank() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let comms = api::comm_init_all(&[0, 1]).unwrap();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (r, c) in comms.iter().enumerate() {
            s.spawn(move || {
                let color = if r == 0 { -5 } else { 0 };
                let e = err(api::comm_split(c, color, 0, None));
                assert_eq!(e.code, Code::InvalidArgument, "rank {r}: {e}");
                assert!(e.msg.contains("rank 0 gave color -5"), "rank {r}: {e}");
                sum_check(c, r as f32 + 1.0, 3.0, "the parent after a refused split");
            });
        }
    });
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    for c in comms {
        api::comm_destroy(api::comm_handle(&c)).unwrap();
    }
}
