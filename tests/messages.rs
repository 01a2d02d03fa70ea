//! What a timeout says: the operation, the rank, and what it waited for as a sentence that
//! names the peer and, on a ring, the step.

use nccl::api::{self, StreamArg};
use nccl::error::Code;

mod common;

/// Rank 0 of 2 calls an all-reduce that rank 1 never joins: after the timeout (1 s here) the
/// error names rank 1, and what rank 0 waited for.
#[test]
fn a_timeout_names_the_peer_and_what_was_awaited() {
    if !common::is_child() {
        let me = "a_timeout_names_the_peer_and_what_was_awaited";
        let _ = common::in_child(me, &[("OXCCL_TIMEOUT_S", "1")]);
        let _ = common::in_child(me, &[("OXCCL_TIMEOUT_S", "1"), ("OXCCL_ALGO", "ring")]);
        // The watchdog speaks before the timeout, in NCCL's WARN line format.
        let out = common::in_child(
            me,
            &[
                ("OXCCL_TIMEOUT_S", "3"),
                ("OXCCL_WATCHDOG_S", "1"),
                ("NCCL_DEBUG", "WARN"),
            ],
        );
        let warn = out
            .lines()
            .find(|l| l.contains("NCCL WARN watchdog:"))
            .unwrap_or_else(|| panic!("no watchdog line:\n{out}"));
        assert!(
            warn.contains(" rank 0: operation #1 (AllReduce of 4 x float) has made no progress for 1 s: waiting for rank 1 to arrive at direct operation #1")
                && warn.contains("comm 0x"),
            "{warn}"
        );
        return;
    }
    let ring = std::env::var("OXCCL_ALGO").is_ok();
    let comms = api::comm_init_all(&[0, 1]).unwrap();
    let send = vec![1f32; 1 << 16];
    let mut recv = vec![0f32; 1 << 16];
    let mut recv1 = vec![0f32; 1 << 16];
    if ring {
        // One operation together first, so that the ring's connections exist.
        api::group_start().unwrap();
        api::enqueue(
            &comms[0],
            common::all_reduce_f32(&send, &mut recv),
            StreamArg::Null,
        )
        .unwrap();
        api::enqueue(
            &comms[1],
            common::all_reduce_f32(&send, &mut recv1),
            StreamArg::Null,
        )
        .unwrap();
        api::group_end().unwrap();
        assert!(recv.iter().all(|&x| x == 2.0));
    }
    let e = api::enqueue(
        &comms[0],
        common::all_reduce_f32(&send[..4], &mut recv[..4]),
        StreamArg::Null,
    )
    .unwrap_err();
    assert_eq!(e.code, Code::Timeout, "{e}");
    let msg = e.to_string();
    let t = std::env::var("OXCCL_TIMEOUT_S").unwrap();
    assert!(
        msg.contains(&format!(
            "AllReduce of 4 x float on rank 0 made no progress for {t} s: waiting for rank 1 "
        )),
        "{msg}"
    );
    if ring {
        assert!(msg.contains(" step "), "{msg}");
    } else {
        assert!(
            msg.contains("waiting for rank 1 to arrive at direct operation #1"),
            "{msg}"
        );
    }
    assert!(!msg.contains("rank(s)  "), "{msg}");
    eprintln!("timeout message: {msg}");
    for c in comms {
        let _ = api::comm_destroy(api::comm_handle(&c));
    }
}
