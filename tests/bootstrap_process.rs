//! Ranks as separate processes: the test binary runs itself (the ignored `child_rank` test) for
//! ranks 1..n, and is rank 0 itself.

use nccl::bootstrap::{Bootstrap, UniqueId, ID_BYTES};
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

fn payload(r: usize) -> Vec<u8> {
    (0..100 + 57 * r).map(|i| (i * 3 + r * 101) as u8).collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// What every rank does; panics on any mismatch.
fn rank_work(id: UniqueId, r: usize, n: usize) {
    let b = Bootstrap::init(&[id], r, n, Arc::new(AtomicBool::new(false))).unwrap();
    let all = b.allgather(&payload(r)).unwrap();
    for (q, got) in all.iter().enumerate() {
        assert_eq!(got, &payload(q), "rank {r}: block of rank {q}");
    }
    let pids = b.allgather(&std::process::id().to_le_bytes()).unwrap();
    let mut uniq = pids.clone();
    uniq.sort();
    uniq.dedup();
    assert_eq!(uniq.len(), n, "every rank is its own process");
    b.send((r + 1) % n, 11, &payload(r + 10)).unwrap();
    assert_eq!(
        b.recv((r + n - 1) % n, 11).unwrap(),
        payload((r + n - 1) % n + 10)
    );
    b.barrier().unwrap();
}

#[test]
#[ignore = "run by process_ranks as a child process"]
fn child_rank() {
    let Ok(id) = std::env::var("OXCCL_TEST_ID") else {
        return;
    };
    let r: usize = std::env::var("OXCCL_TEST_RANK").unwrap().parse().unwrap();
    let n: usize = std::env::var("OXCCL_TEST_NRANKS").unwrap().parse().unwrap();
    let bytes: [u8; ID_BYTES] = unhex(&id).try_into().unwrap();
    rank_work(UniqueId::from_bytes(&bytes).unwrap(), r, n);
    println!("CHILD-OK rank {r}");
}

#[test]
fn process_ranks() {
    let n = 4;
    let id = UniqueId::generate_with_timeout(Duration::from_secs(60)).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut kids: Vec<_> = (1..n)
        .map(|r| {
            Command::new(&exe)
                .args(["--ignored", "--exact", "child_rank", "--nocapture"])
                .env("OXCCL_TEST_ID", hex(&id.to_bytes()))
                .env("OXCCL_TEST_RANK", r.to_string())
                .env("OXCCL_TEST_NRANKS", n.to_string())
                .env("OXCCL_TIMEOUT_S", "60")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    rank_work(id, 0, n);
    let t0 = Instant::now();
    for (i, k) in kids.iter_mut().enumerate() {
        while k.try_wait().unwrap().is_none() {
            if t0.elapsed() > Duration::from_secs(60) {
                let _ = k.kill();
                panic!("child rank {} hangs", i + 1);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    for (i, k) in kids.into_iter().enumerate() {
        let out = k.wait_with_output().unwrap();
        let so = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && so.contains(&format!("CHILD-OK rank {}", i + 1)),
            "child rank {}: {:?}\n{so}\n{}",
            i + 1,
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A rank whose root is gone (its id expired, so its port refuses connections) gives up after
/// `OXCCL_BOOTSTRAP_CONNECT_S`, not after the whole `OXCCL_TIMEOUT_S`, and says what it tried.
#[test]
fn unreachable_root_fails_within_the_connect_bound() {
    if common::is_child() {
        return unreachable_root();
    }
    let out = common::in_child(
        "unreachable_root_fails_within_the_connect_bound",
        &[
            ("OXCCL_BOOTSTRAP_CONNECT_S", "1"),
            ("OXCCL_TIMEOUT_S", "60"),
        ],
    );
    assert!(out.contains("UNREACHABLE-OK"), "{out}");
}

fn unreachable_root() {
    let id = UniqueId::generate_with_timeout(Duration::from_millis(100)).unwrap();
    let addr = id.root_addr();
    // Wait for the root to expire and close its port.
    let t0 = Instant::now();
    while std::net::TcpStream::connect(addr).is_ok() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the expired root still listens"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let t0 = Instant::now();
    let e = nccl::api::comm_init_rank(2, &id.to_bytes(), 0, Default::default())
        .err()
        .expect("init with an unreachable root must fail");
    let took = t0.elapsed();
    assert_eq!(e.code, nccl::error::Code::Timeout, "{e}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "gave up after {took:?}: {e}"
    );
    for part in [
        &format!("bootstrap root at {addr}"),
        "to accept a connection",
        "attempt(s) failed",
        "Connection refused",
        "OXCCL_BOOTSTRAP_CONNECT_S=1",
    ] {
        assert!(e.msg.contains(part), "{part:?} missing from: {e}");
    }
    println!("UNREACHABLE-OK after {took:?}: {e}");
}
