//! A peer process that dies is an error on the rank that waits for it, within seconds (not at
//! the timeout), naming the dead rank; `ncclCommAbort` then returns within a second, and no
//! `/dev/shm` file is left behind, whatever the peer was doing when it died: right after init,
//! before a connection's two ends attached, in the middle of a ring, in the middle of a direct
//! operation. So is a peer that ends its communicator and lives on.

use nccl::api::{self, CollArgs, StreamArg};
use nccl::error::Code;
use nccl::types::CollKind;
use std::time::{Duration, Instant};

mod common;

const TEST: &str = "a_peer_killed_is_an_error_within_seconds";

/// Where rank 1 dies, and what rank 0 runs meanwhile (the environment of each case).
const CASES: [(&str, &[(&str, &str)]); 5] = [
    // Right after init, rank 0 then runs an eager operation, and a large one (ring fallback:
    // malloc buffers in other processes).
    ("after-init-eager", &[]),
    ("after-init-large", &[]),
    // Rank 0's first send to rank 1 sets up a connection whose other end never comes.
    ("before-attach", &[]),
    // While both run ring all-reduces.
    ("mid-ring", &[("OXCCL_ALGO", "ring")]),
    // While both run direct all-reduces on ncclMemAlloc buffers (each maps the other's).
    ("mid-direct", &[]),
];

use common::all_reduce_f32_at as all_reduce;

fn kill_me() {
    nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL).unwrap();
}

fn rank(case: &str, r: i32, id: &[u8; api::UNIQUE_ID_BYTES]) {
    let c = api::comm_init_rank(2, id, r, Default::default()).unwrap();
    let mid = case.starts_with("mid-");
    if r == 1 {
        if !mid {
            kill_me();
        }
        // Dies 100 ms into the loop below.
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            kill_me();
        });
    } else if !mid {
        std::thread::sleep(Duration::from_millis(200));
    }
    let count = match case {
        "after-init-eager" => 2,
        "before-attach" => 1000,
        _ => 1 << 20,
    };
    let (send, recv) = if case == "mid-direct" {
        let (s, d) = (
            api::mem_alloc(count * 4).unwrap(),
            api::mem_alloc(count * 4).unwrap(),
        );
        // SAFETY: fresh allocations of `count` floats.
        unsafe { std::slice::from_raw_parts_mut(s as *mut f32, count) }.fill(1.0);
        (s, d)
    } else {
        let s = Box::leak(vec![1f32; count].into_boxed_slice()).as_ptr() as usize;
        let d = Box::leak(vec![0f32; count].into_boxed_slice()).as_ptr() as usize;
        (s, d)
    };
    let t0 = Instant::now();
    let e = loop {
        let r = if case == "before-attach" {
            let a = CollArgs {
                kind: CollKind::Send,
                root: 1,
                ..all_reduce(send, recv, count)
            };
            api::enqueue(&c, a, StreamArg::Null)
        } else {
            api::enqueue(&c, all_reduce(send, recv, count), StreamArg::Null)
        };
        match r {
            Ok(()) if mid => continue,
            Ok(()) => panic!("{case}: rank {r:?} succeeded with its peer dead"),
            Err(e) => break e,
        }
    };
    let took = t0.elapsed();
    assert_eq!(r, 0, "{case}: rank 1 lived on: {e}");
    assert_eq!(e.code, Code::RemoteError, "{case}: {e}");
    assert!(
        e.msg.contains("rank 1"),
        "{case}: the error names no rank: {e}"
    );
    let limit = Duration::from_secs(if mid { 6 } else { 5 });
    assert!(took < limit, "{case}: detected after {took:?}: {e}");
    eprintln!("{case}: death detected after {took:?}: {e}");
    // The communicator reports it too.
    let async_err = api::comm_async_error(&c);
    assert_eq!(
        async_err,
        Code::RemoteError,
        "{case}: ncclCommGetAsyncError"
    );
    let t1 = Instant::now();
    let _ = api::comm_abort(api::comm_handle(&c));
    let abort = t1.elapsed();
    eprintln!("{case}: ncclCommAbort took {abort:?}");
    assert!(
        abort < Duration::from_secs(1),
        "{case}: ncclCommAbort took {abort:?}"
    );
}

/// In a rank process of `spawn_ranks`: (case, rank, unique id).
fn child() -> Option<(String, i32, [u8; api::UNIQUE_ID_BYTES])> {
    let (id, _, r) = common::rank_env()?;
    Some((std::env::var("OXCCL_DEATH_CASE").unwrap(), r as i32, id))
}

/// Runs this binary's test `test` again as ranks 0 and 1 of a new communicator, for `case`.
fn spawn_ranks(test: &str, case: &str, env: &[(&str, &str)]) -> Vec<std::process::Child> {
    let mut all = vec![("OXCCL_DEATH_CASE", case)];
    all.extend_from_slice(env);
    common::spawn_ranks(test, 2, &all)
}

#[test]
fn a_peer_killed_is_an_error_within_seconds() {
    if let Some((case, r, id)) = child() {
        return rank(&case, r, &id);
    }
    for (case, env) in CASES {
        let before = common::shm_files();
        let mut kids = spawn_ranks(TEST, case, env).into_iter();
        let (mut k0, mut k1) = (kids.next().unwrap(), kids.next().unwrap());
        // Rank 0 first: rank 1 stays a zombie while rank 0 waits for it (dead all the same).
        let s0 = k0.wait().unwrap();
        let s1 = k1.wait().unwrap();
        assert!(s0.success(), "{case}: rank 0 failed: {s0:?}");
        assert!(!s1.success(), "{case}: rank 1 should have been killed");
        let after = common::shm_files();
        let left: Vec<_> = after.iter().filter(|n| !before.contains(n)).collect();
        assert!(left.is_empty(), "{case}: left behind in /dev/shm: {left:?}");
    }
}

/// A peer that ends its communicator (`ncclCommAbort`, or `ncclCommDestroy` without making the
/// call rank 0 waits in) and lives on is an error on the rank waiting for it, within seconds,
/// naming it: over the board (a direct operation, an eager one), over a ring's shared-memory
/// connections, at a send whose connection rank 1 never set up, and at a receive on a
/// connection that exists. Rank 1's process stays
/// alive meanwhile, so that only the end of its communicator can tell.
const END_TEST: &str = "a_peer_that_ends_its_communicator_is_an_error_within_seconds";
const END_CASES: [(&str, &[(&str, &str)]); 6] = [
    ("abort-direct", &[]),
    ("abort-eager", &[]),
    ("abort-ring", &[("OXCCL_ALGO", "ring")]),
    ("destroy-direct", &[]),
    ("abort-send", &[]),
    ("abort-recv", &[]),
];

fn ending_rank(case: &str, r: i32, id: &[u8; api::UNIQUE_ID_BYTES]) {
    let c = api::comm_init_rank(2, id, r, Default::default()).unwrap();
    if case == "abort-recv" {
        // One message first: the connection rank 1 -> rank 0 exists when rank 1 aborts.
        let one = Box::leak(vec![1f32; 1].into_boxed_slice()).as_ptr() as usize;
        let kind = if r == 1 {
            CollKind::Send
        } else {
            CollKind::Recv
        };
        let a = CollArgs {
            kind,
            root: 1 - r,
            ..all_reduce(one, one, 1)
        };
        api::enqueue(&c, a, StreamArg::Null).unwrap();
    }
    if r == 1 {
        std::thread::sleep(Duration::from_millis(300));
        let h = api::comm_handle(&c);
        if case.starts_with("destroy") {
            api::comm_destroy(h).unwrap();
        } else {
            api::comm_abort(h).unwrap();
        }
        // Alive until rank 0 is done (at most 8 s), so that no death check can tell it.
        let done = std::env::var("OXCCL_END_DONE").unwrap();
        let t = Instant::now();
        while !std::path::Path::new(&done).exists() && t.elapsed() < Duration::from_secs(8) {
            std::thread::sleep(Duration::from_millis(20));
        }
        return;
    }
    let count = if case == "abort-eager" { 2 } else { 1 << 20 };
    let send = Box::leak(vec![1f32; count].into_boxed_slice()).as_ptr() as usize;
    let recv = Box::leak(vec![0f32; count].into_boxed_slice()).as_ptr() as usize;
    let t0 = Instant::now();
    let a = match case {
        "abort-send" | "abort-recv" => CollArgs {
            kind: if case == "abort-send" {
                CollKind::Send
            } else {
                CollKind::Recv
            },
            root: 1,
            ..all_reduce(send, recv, count)
        },
        _ => all_reduce(send, recv, count),
    };
    // Rank 1 makes no such call: this one waits for it.
    let e = api::enqueue(&c, a, StreamArg::Null).expect_err("a call succeeded without rank 1");
    let took = t0.elapsed();
    eprintln!("{case}: detected after {took:?}: {e}");
    assert_eq!(e.code, Code::RemoteError, "{case}: {e}");
    assert!(e.msg.contains("rank 1"), "{case}: names no rank: {e}");
    assert!(took < Duration::from_secs(5), "{case}: after {took:?}: {e}");
    assert!(!e.msg.contains("has died"), "{case}: not from the end: {e}");
    std::fs::write(std::env::var("OXCCL_END_DONE").unwrap(), b"").unwrap();
    let _ = api::comm_abort(api::comm_handle(&c));
}

#[test]
fn a_peer_that_ends_its_communicator_is_an_error_within_seconds() {
    if let Some((case, r, id)) = child() {
        return ending_rank(&case, r, &id);
    }
    for (case, env) in END_CASES {
        let done = std::env::temp_dir().join(format!("oxccl-end-{}-{case}", std::process::id()));
        let done_s = done.display().to_string();
        let mut env = env.to_vec();
        env.push(("OXCCL_END_DONE", &done_s));
        let kids = spawn_ranks(END_TEST, case, &env);
        for (r, mut k) in kids.into_iter().enumerate() {
            let st = k.wait().unwrap();
            assert!(st.success(), "{case}: rank {r} failed: {st:?}");
        }
        let _ = std::fs::remove_file(&done);
    }
}

/// A peer that did its part and then ended is no failure: rank 1 sends 512 KiB (it fits the
/// connection's FIFO, so its send completes unread), destroys its communicator and lives on;
/// rank 0 receives only afterwards, and gets every value.
const PART_TEST: &str = "a_peer_that_ends_after_its_part_is_no_failure";

fn part_rank(r: i32, id: &[u8; api::UNIQUE_ID_BYTES]) {
    let c = api::comm_init_rank(2, id, r, Default::default()).unwrap();
    let count = 128 << 10;
    let init = |i: usize| if r == 1 { i as f32 } else { 0.0 };
    let buf: &'static mut [f32] = Box::leak((0..count).map(init).collect());
    let addr = buf.as_mut_ptr() as usize;
    let p2p = |kind, root, n| CollArgs {
        kind,
        root,
        ..all_reduce(addr, addr, n)
    };
    if r == 1 {
        // The first send sets the connection up (rank 0 receives it at once).
        api::enqueue(&c, p2p(CollKind::Send, 0, 1), StreamArg::Null).unwrap();
        api::enqueue(&c, p2p(CollKind::Send, 0, count), StreamArg::Null).unwrap();
        api::comm_destroy(api::comm_handle(&c)).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        return;
    }
    api::enqueue(&c, p2p(CollKind::Recv, 1, 1), StreamArg::Null).unwrap();
    // By now rank 1 has sent everything and ended its communicator.
    std::thread::sleep(Duration::from_millis(500));
    api::enqueue(&c, p2p(CollKind::Recv, 1, count), StreamArg::Null)
        .unwrap_or_else(|e| panic!("a receive of what rank 1 sent before it ended: {e}"));
    assert!(
        buf.iter().enumerate().all(|(i, &v)| v == i as f32),
        "the data rank 1 sent before it ended"
    );
    api::comm_destroy(api::comm_handle(&c)).unwrap();
}

#[test]
fn a_peer_that_ends_after_its_part_is_no_failure() {
    if let Some((_, r, id)) = child() {
        return part_rank(r, &id);
    }
    for (r, mut k) in spawn_ranks(PART_TEST, "part", &[]).into_iter().enumerate() {
        let st = k.wait().unwrap();
        assert!(st.success(), "rank {r} failed: {st:?}");
    }
}

/// The tests where rank 5 of 8 dies (no neighbour of rank 0, so it never connected to rank 0)
/// and rank 0 then sends to it: the parent spawns them (`env` added) and every rank but 5 must
/// pass.
fn rank_5_dies(test: &str, env: &[(&str, &str)]) {
    // Where rank 0 says it is done.
    let done = std::env::temp_dir().join(format!("oxccl-{test}-{}", std::process::id()));
    let _ = std::fs::remove_file(&done);
    let mut env = env.to_vec();
    env.push(("OXCCL_TEST_DONE", done.to_str().unwrap()));
    let kids = common::spawn_ranks(test, 8, &env);
    let ends: Vec<_> = kids.into_iter().map(|mut k| k.wait().unwrap()).collect();
    let _ = std::fs::remove_file(&done);
    for (r, s) in ends.iter().enumerate() {
        assert_eq!(s.success(), r != 5, "rank {r}: {s:?}");
    }
}

/// A rank of those tests other than 0 and 5 stays until rank 0 is done (so that only rank 5 is
/// gone), then aborts: true where it was one (the caller returns).
fn others_wait_for_rank_0(c: &std::sync::Arc<nccl::comm::Comm>, r: usize) -> bool {
    if r == 0 {
        return false;
    }
    let done = std::path::PathBuf::from(std::env::var("OXCCL_TEST_DONE").unwrap());
    let t0 = Instant::now();
    while !done.exists() && t0.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = api::comm_abort(api::comm_handle(c));
    true
}

/// Rank 0's send to rank 5 in those tests: its error and how long it took; then rank 0 says it
/// is done.
fn send_to_rank_5(c: &std::sync::Arc<nccl::comm::Comm>) -> (nccl::error::Error, Duration) {
    let send = vec![1f32; 1000];
    let mut recv = vec![0f32; 1000];
    let t0 = Instant::now();
    let a = CollArgs {
        kind: CollKind::Send,
        root: 5,
        ..common::all_reduce_f32(&send, &mut recv)
    };
    let e = api::enqueue(c, a, StreamArg::Null).expect_err("a send to a dead rank");
    let took = t0.elapsed();
    std::fs::write(std::env::var("OXCCL_TEST_DONE").unwrap(), b"").unwrap();
    eprintln!("a send to rank 5, which died, failed after {took:?}: {e}");
    (e, took)
}

const UNSEEN_TEST: &str = "a_send_to_a_rank_that_died_unseen_fails_at_the_connect_bound";

/// Rank 0's first send to a rank that died after init without ever connecting to rank 0 (8
/// ranks; rank 5 is no neighbour of rank 0): setting up the connection cannot reach it, and
/// that is the error, after the connect bound (`OXCCL_BOOTSTRAP_CONNECT_S`, 2 s here), rather
/// than a wait for its half of the setup until the setup bound (`OXCCL_TIMEOUT_S`, 60 s here):
/// `ncclRemoteError` saying that rank 5's process died.
#[test]
fn a_send_to_a_rank_that_died_unseen_fails_at_the_connect_bound() {
    let Some((id, n, r)) = common::rank_env() else {
        return rank_5_dies(UNSEEN_TEST, &[("OXCCL_BOOTSTRAP_CONNECT_S", "2")]);
    };
    let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
    let send = vec![1f32; 1000];
    let mut recv = vec![0f32; 1000];
    let a = common::all_reduce_f32(&send, &mut recv);
    api::enqueue(&c, a, StreamArg::Null).unwrap();
    assert!(recv.iter().all(|&x| x == n as f32));
    if r == 5 {
        kill_me();
    }
    if others_wait_for_rank_0(&c, r) {
        return;
    }
    std::thread::sleep(Duration::from_millis(200));
    let (e, took) = send_to_rank_5(&c);
    assert_eq!(e.code, Code::RemoteError, "{e}");
    assert!(
        e.msg.contains("rank 5 (process ") && e.msg.contains("has died"),
        "{e}"
    );
    assert!(took < Duration::from_secs(10), "failed after {took:?}: {e}");
    let _ = api::comm_abort(api::comm_handle(&c));
}

const UNSEEN_LATER_TEST: &str = "a_rank_that_dies_while_a_first_send_awaits_it_is_seen_at_once";

/// Rank 0's first send to rank 5 (8 ranks: no neighbour of rank 0, so it never connected to
/// rank 0): rank 5 lives when the setup starts, and dies 2 s later without having called
/// anything. Rank 0 watches it through its own bootstrap connection to it, and fails with
/// `ncclRemoteError` naming rank 5 within seconds, not at the setup wait's bound
/// (`OXCCL_TIMEOUT_S`, 60 s here).
#[test]
fn a_rank_that_dies_while_a_first_send_awaits_it_is_seen_at_once() {
    let Some((id, n, r)) = common::rank_env() else {
        return rank_5_dies(UNSEEN_LATER_TEST, &[]);
    };
    let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
    if r == 5 {
        std::thread::sleep(Duration::from_secs(2));
        kill_me();
    }
    if others_wait_for_rank_0(&c, r) {
        return;
    }
    let (e, took) = send_to_rank_5(&c);
    assert_eq!(e.code, Code::RemoteError, "{e}");
    // (Where rank 0 came to its send after rank 5 died, the connect fails instead: the test
    // above's error.)
    assert!(
        e.msg.contains("rank 5 is gone") || e.msg.contains("rank 5 (process "),
        "{e}"
    );
    assert!(took < Duration::from_secs(15), "failed after {took:?}: {e}");
    let _ = api::comm_abort(api::comm_handle(&c));
}
