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
            "AllReduce of 4 x float on rank 0 made no progress for {t} s (OXCCL_TIMEOUT_S): waiting for rank 1 "
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

/// A rank that is late (alive, busy elsewhere: a checkpoint) is waited for, at init (up to the
/// setup bound, 300 s without `OXCCL_TIMEOUT_S`) and in an operation (without
/// `OXCCL_TIMEOUT_S`, as long as it lives, as NCCL waits), and the watchdog names it meanwhile:
/// the root the ranks it misses, rank 0 the root it waits on, the operation the rank it waits
/// for. Rank 1 of 2 comes 2.5 s late to init and again to the first all-reduce (the watchdog
/// speaks after 1 s); both calls succeed with the right sums.
#[test]
fn a_late_rank_is_waited_for_and_named() {
    if !common::is_child() {
        let me = "a_late_rank_is_waited_for_and_named";
        let out = common::in_child(me, &[("OXCCL_WATCHDOG_S", "1"), ("NCCL_DEBUG", "WARN")]);
        let watchdog = |needle: &str| {
            out.lines()
                .find(|l| l.contains("NCCL WARN watchdog:") && l.contains(needle))
                .unwrap_or_else(|| panic!("no watchdog line with {needle:?}:\n{out}"))
                .to_string()
        };
        // The root of the id, and rank 0 waiting for it, name the missing rank.
        let root = watchdog("bootstrap root");
        assert!(
            root.contains("has waited 1 s for rank(s) 1 of 2 (id 0 of 1)"),
            "{root}"
        );
        let rank0 = watchdog("rank 0 has waited 1 s for the bootstrap root at");
        assert!(rank0.contains("to collect all 2 ranks"), "{rank0}");
        let op = watchdog("operation #1");
        assert!(
            op.contains("rank 0: operation #1 (AllReduce of 1024 x float) has made no progress")
                && op.contains("waiting for rank 1"),
            "{op}"
        );
        return;
    }
    assert!(
        std::env::var_os("OXCCL_TIMEOUT_S").is_none(),
        "this test is about waits without OXCCL_TIMEOUT_S"
    );
    let late = std::time::Duration::from_millis(2500);
    let id = api::get_unique_id().unwrap();
    std::thread::scope(|s| {
        for r in 0..2usize {
            s.spawn(move || {
                if r == 1 {
                    std::thread::sleep(late);
                }
                let t0 = std::time::Instant::now();
                let comm = api::comm_init_rank(2, &id, r as i32, Default::default()).unwrap();
                if r == 0 {
                    assert!(t0.elapsed() >= late / 2, "rank 0's init did not wait");
                }
                if r == 1 {
                    std::thread::sleep(late);
                }
                let send: Vec<f32> = (0..1024).map(|i| (i * (r + 1)) as f32).collect();
                let mut recv = vec![0f32; 1024];
                let t0 = std::time::Instant::now();
                api::enqueue(
                    &comm,
                    common::all_reduce_f32(&send, &mut recv),
                    StreamArg::Null,
                )
                .unwrap();
                if r == 0 {
                    assert!(t0.elapsed() >= late / 2, "rank 0's all-reduce did not wait");
                }
                for (i, &v) in recv.iter().enumerate() {
                    assert_eq!(v, (3 * i) as f32, "rank {r}: element {i}");
                }
                api::comm_destroy(api::comm_handle(&comm)).unwrap();
            });
        }
    });
}
