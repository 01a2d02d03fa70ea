//! A peer process that dies is an error on the rank that waits for it, within seconds (not at
//! the timeout), naming the dead rank and its pid.

use nccl::api::{self, StreamArg};
use nccl::error::Code;
use std::time::{Duration, Instant};

mod common;

/// In a child: rank 1 dies by SIGKILL right after init (its parent does not collect it while
/// rank 0 waits, so it is a zombie then: dead all the same); rank 0 then all-reduces with it.
#[test]
fn a_peer_killed_is_an_error_within_seconds() {
    let Some(role) = std::env::var("OXCCL_DEATH_RANK").ok() else {
        return parent();
    };
    let hex = std::env::var("OXCCL_DEATH_ID").unwrap();
    let mut id = [0u8; api::UNIQUE_ID_BYTES];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let r: i32 = role.parse().unwrap();
    let c = api::comm_init_rank(2, &id, r, Default::default()).unwrap();
    if r == 1 {
        nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL).unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    let count: usize = std::env::var("OXCCL_DEATH_COUNT").unwrap().parse().unwrap();
    let send = vec![1f32; count];
    let mut recv = vec![0f32; count];
    let t0 = Instant::now();
    let e = api::enqueue(
        &c,
        common::all_reduce_f32(&send, &mut recv),
        StreamArg::Null,
    )
    .unwrap_err();
    let took = t0.elapsed();
    assert_eq!(e.code, Code::RemoteError, "{e}");
    assert!(
        e.msg.contains("rank 1 (process ") && e.msg.contains("has died"),
        "{e}"
    );
    assert!(took < Duration::from_secs(5), "detected after {took:?}");
    eprintln!("death detected after {took:?}: {e}");
    // Abort returns at once with the peer dead.
    let t1 = Instant::now();
    let _ = api::comm_abort(api::comm_handle(&c));
    let abort = t1.elapsed();
    eprintln!("ncclCommAbort took {abort:?}");
    assert!(
        abort < Duration::from_secs(1),
        "ncclCommAbort took {abort:?}"
    );
}

fn parent() {
    // An eager operation, a direct one (ring fallback: malloc buffers in other processes).
    for count in ["8", "1000000"] {
        let id = api::get_unique_id().unwrap();
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        let exe = std::env::current_exe().unwrap();
        let kids: Vec<_> = (0..2)
            .map(|r| {
                std::process::Command::new(&exe)
                    .args([
                        "--exact",
                        "a_peer_killed_is_an_error_within_seconds",
                        "--nocapture",
                    ])
                    .env("OXCCL_DEVICE", "host")
                    .env("OXCCL_TIMEOUT_S", "60")
                    .env("OXCCL_DEATH_ID", &hex)
                    .env("OXCCL_DEATH_RANK", r.to_string())
                    .env("OXCCL_DEATH_COUNT", count)
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut kids = kids.into_iter();
        let (mut k0, mut k1) = (kids.next().unwrap(), kids.next().unwrap());
        // Rank 0 first: rank 1 stays a zombie while rank 0 waits for it.
        let s0 = k0.wait().unwrap();
        let s1 = k1.wait().unwrap();
        assert!(s0.success(), "count {count}: rank 0 failed: {s0:?}");
        assert!(
            !s1.success(),
            "count {count}: rank 1 should have been killed"
        );
    }
}
