//! A rank that left a collective unfinished (it timed out, or was aborted from another thread)
//! has its buffers back: a peer that arrives later fails with `ncclRemoteError` naming it, never
//! reads or writes them (they are unmapped before the peer arrives, so a touch crashes the
//! test), and never returns success built from the departed rank's data.

use nccl::api::{self, CollArgs, StreamArg};
use nccl::error::Code;
use nccl::types::{CollKind, DataType, OP_SUM};
use nix::sys::mman::{mmap_anonymous, munmap, MapFlags, ProtFlags};
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

mod common;

const CANARY: f32 = -7.0;

/// A private mapping of `count` floats, filled with `v`.
fn mapped(count: usize, v: f32) -> *mut f32 {
    let bytes = NonZeroUsize::new(count * 4).unwrap();
    // SAFETY: a fresh private anonymous mapping.
    let p = unsafe {
        mmap_anonymous(
            None,
            bytes,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_PRIVATE,
        )
    }
    .unwrap()
    .as_ptr()
    .cast::<f32>();
    // SAFETY: `count` floats of our own mapping.
    unsafe { std::slice::from_raw_parts_mut(p, count) }.fill(v);
    p
}

fn unmap(p: *mut f32, count: usize) {
    // SAFETY: a mapping of `count` floats made by `mapped`, not used afterwards.
    unsafe { munmap(std::ptr::NonNull::new(p.cast()).unwrap(), count * 4) }.unwrap();
}

fn all_reduce(send: *mut f32, recv: *mut f32, count: usize) -> CollArgs {
    CollArgs {
        kind: CollKind::AllReduce,
        send: send as usize,
        recv: recv as usize,
        count,
        dtype: DataType::Float32,
        op: OP_SUM,
        root: 0,
    }
}

/// Sizes that take each board path between two threads: a tiny eager operation (inputs in the
/// arrival's cache line), an eager one (inputs on the board), and a direct one (zero copy
/// between the ranks' buffers).
const COUNTS: [usize; 3] = [2, 4096, 1 << 20];

/// Rank 0 calls alone and leaves (`how` makes it leave: a timeout, or an abort from another
/// thread); its buffers are unmapped; then rank 1 calls: it must fail, name rank 0, and leave
/// its own output alone.
fn late_peer(how: &str) {
    std::env::set_var("OXCCL_DEVICE", "host");
    for count in COUNTS {
        let comms = api::comm_init_all(&[0, 1]).unwrap();
        let (s0, r0) = (mapped(count, 1.0), mapped(count, CANARY));
        let t0 = Instant::now();
        let e0 = std::thread::scope(|s| {
            if how == "abort" {
                let h = api::comm_handle(&comms[0]);
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(200));
                    let _ = api::comm_abort(h);
                });
            }
            api::enqueue(&comms[0], all_reduce(s0, r0, count), StreamArg::Null)
                .expect_err("rank 0 is alone: its call cannot succeed")
        });
        let left = t0.elapsed();
        let want = if how == "abort" {
            Code::RemoteError
        } else {
            Code::Timeout
        };
        assert_eq!(e0.code, want, "count {count}: rank 0: {e0}");
        // Rank 0's buffers are gone: any touch from now on crashes.
        unmap(s0, count);
        unmap(r0, count);
        let (s1, r1) = (mapped(count, 2.0), mapped(count, CANARY));
        let e1 = api::enqueue(&comms[1], all_reduce(s1, r1, count), StreamArg::Null)
            .expect_err("rank 1 arrives after rank 0 left: it must not succeed");
        assert_eq!(e1.code, Code::RemoteError, "count {count}: rank 1: {e1}");
        assert!(
            (e1.msg.contains("rank 0 left") || e1.msg.contains("rank 0 failed")),
            "count {count}: rank 1's error must name rank 0: {e1}"
        );
        // SAFETY: rank 1's output, still mapped.
        let out = unsafe { std::slice::from_raw_parts(r1, count) };
        assert!(
            out.iter().all(|&x| x == CANARY),
            "count {count}: rank 1's output was written"
        );
        eprintln!("count {count}: rank 0 left after {left:?} ({how}); rank 1: {e1}");
        unmap(s1, count);
        unmap(r1, count);
        for c in comms.iter().skip(usize::from(how == "abort")) {
            let _ = api::comm_abort(api::comm_handle(c));
        }
    }
}

#[test]
fn late_peer_after_a_timeout_fails_and_touches_nothing() {
    if common::is_child() {
        return late_peer("timeout");
    }
    common::in_child(
        "late_peer_after_a_timeout_fails_and_touches_nothing",
        &[("OXCCL_TIMEOUT_S", "1")],
    );
}

#[test]
fn late_peer_after_an_abort_fails_and_touches_nothing() {
    if common::is_child() {
        return late_peer("abort");
    }
    common::in_child("late_peer_after_an_abort_fails_and_touches_nothing", &[]);
}

/// The same between processes: rank 0 times out and refills its buffers; rank 1 calls once it
/// has (told through a file) and must fail at once; rank 0's buffers must keep what it wrote.
#[test]
fn late_peer_between_processes_fails_and_touches_nothing() {
    let Some((id, n, r)) = common::rank_env() else {
        return common::run_ranks(
            "late_peer_between_processes_fails_and_touches_nothing",
            2,
            &[("OXCCL_TIMEOUT_S", "1")],
        );
    };
    let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
    // One communicator per round, made before any rank leaves (a left one is broken).
    let comms: Vec<_> = COUNTS
        .iter()
        .map(|_| api::comm_split(&c, 0, r as i32, None).unwrap().unwrap())
        .collect();
    let tag: String = id[..8].iter().map(|b| format!("{b:02x}")).collect();
    let marker = |what: &str, i: usize| {
        std::env::temp_dir().join(format!("oxccl-late-peer-{tag}-{what}-{i}"))
    };
    let wait_for = |p: &std::path::Path| {
        let t0 = Instant::now();
        while !p.exists() {
            assert!(t0.elapsed() < Duration::from_secs(60), "no {}", p.display());
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = std::fs::remove_file(p);
    };
    for (i, (count, comm)) in COUNTS.into_iter().zip(comms).enumerate() {
        let (s, d) = (mapped(count, 1.0 + r as f32), mapped(count, CANARY));
        // SAFETY: our own mappings of `count` floats.
        let (sv, dv) = unsafe {
            (
                std::slice::from_raw_parts_mut(s, count),
                std::slice::from_raw_parts_mut(d, count),
            )
        };
        if r == 0 {
            let e = api::enqueue(&comm, all_reduce(s, d, count), StreamArg::Null)
                .expect_err("rank 0 is alone: its call cannot succeed");
            assert_eq!(e.code, Code::Timeout, "count {count}: {e}");
            sv.fill(CANARY);
            dv.fill(CANARY);
            std::fs::write(marker("left", i), b"").unwrap();
            wait_for(&marker("called", i));
            // Give a stray writer time to show itself.
            std::thread::sleep(Duration::from_millis(100));
            assert!(
                sv.iter().chain(dv.iter()).all(|&x| x == CANARY),
                "count {count}: rank 0's buffers were touched after its call returned"
            );
        } else {
            wait_for(&marker("left", i));
            let t0 = Instant::now();
            let e = api::enqueue(&comm, all_reduce(s, d, count), StreamArg::Null)
                .expect_err("rank 1 arrives after rank 0 left: it must not succeed");
            std::fs::write(marker("called", i), b"").unwrap();
            assert_eq!(e.code, Code::RemoteError, "count {count}: {e}");
            assert!(
                e.msg.contains("rank 0 left") || e.msg.contains("rank 0 failed"),
                "count {count}: {e}"
            );
            assert!(
                t0.elapsed() < Duration::from_millis(800),
                "round {i}: took {:?}",
                t0.elapsed()
            );
            assert!(
                dv.iter().all(|&x| x == CANARY),
                "count {count}: output written"
            );
        }
        let _ = api::comm_abort(api::comm_handle(&comm));
        unmap(s, count);
        unmap(d, count);
    }
    let _ = api::comm_abort(api::comm_handle(&c));
}
