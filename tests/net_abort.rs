//! ncclCommAbort across hosts while data arrives: two "hosts" (network namespaces,
//! tests/common/netns.rs; needs root, skipped otherwise), one rank each, queue large all-reduces
//! on host streams; rank 0 aborts mid-way while rank 1 still sends. Rank 0's receives land in
//! its buffers straight from the socket (`OXCCL_NET_ZERO_COPY`, on by default): once the abort
//! returns, canaries written into every buffer must stay untouched, in place and out of place.
//! Rank 1 gets an error naming rank 0 (no hang), aborts, and checks its buffers the same way.

use nccl::api::{self, CollArgs};
use nccl::types::{CollKind, DataType, OP_SUM};
use std::time::{Duration, Instant};

mod common;

const TEST: &str = "abort_across_hosts_leaves_the_buffers_alone";
const CANARY: f32 = -12345.0;
/// 16 MiB per buffer: several milliseconds per all-reduce over veth.
const COUNT: usize = 4 << 20;
const OPS: usize = 8;

/// One rank's part (in a host's namespace). `case` is "inplace-MS" or "outofplace-MS": rank 0
/// aborts MS milliseconds after its all-reduces are queued.
fn rank(case: &str, r: usize, path: &str) {
    let (place, ms) = case.split_once('-').unwrap();
    let in_place = place == "inplace";
    let delay: u64 = ms.parse().unwrap();
    let id = common::netns::id_via_file(path, r);
    let c = api::comm_init_rank(2, &id, r as i32, Default::default()).unwrap();
    let stream = api::host_stream_create().unwrap();
    let mut send = vec![r as f32 + 1.0; COUNT];
    let mut recv = vec![0f32; COUNT];
    api::group_start().unwrap();
    for _ in 0..OPS {
        let buf = send.as_mut_ptr() as usize;
        let a = CollArgs {
            kind: CollKind::AllReduce,
            send: buf,
            recv: if in_place {
                buf
            } else {
                recv.as_mut_ptr() as usize
            },
            count: COUNT,
            dtype: DataType::Float32,
            op: OP_SUM,
            root: 0,
        };
        api::enqueue(&c, a, api::stream_from_handle(stream).unwrap()).unwrap();
    }
    api::group_end().unwrap();
    let t0 = Instant::now();
    if r == 0 {
        std::thread::sleep(Duration::from_millis(delay));
    } else {
        // Rank 0's abort closes its sockets: an error here, within seconds.
        let e = api::host_stream_synchronize(stream).expect_err("rank 0 aborted mid-way");
        eprintln!("rank 1: {e} after {:?}", t0.elapsed());
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
        assert!(e.msg.contains("rank 0"), "{e}");
        assert!(!e.msg.contains("on rank 1: rank 1"), "said twice: {e}");
    }
    let t1 = Instant::now();
    let _ = api::comm_abort(api::comm_handle(&c));
    assert!(
        t1.elapsed() < Duration::from_secs(10),
        "abort took {:?}",
        t1.elapsed()
    );
    // The buffers are the caller's again: fill them, give stray writers time, check.
    for b in [&mut send, &mut recv] {
        b.fill(CANARY);
    }
    std::thread::sleep(Duration::from_millis(400));
    for (name, b) in [("send", &send), ("recv", &recv)] {
        if let Some(j) = b.iter().position(|&x| x != CANARY) {
            panic!(
                "rank {r} ({case}): {name} buffer element {j} was written after ncclCommAbort \
                 returned: {}",
                b[j]
            );
        }
    }
    // The aborted work reports an error (or nothing, had it finished); no hang.
    let _ = api::host_stream_synchronize(stream);
    api::host_stream_destroy(stream).unwrap();
    eprintln!("rank {r} ({case}): buffers untouched after the abort");
}

#[test]
fn abort_across_hosts_leaves_the_buffers_alone() {
    if let Ok(path) = std::env::var("OXCCL_TEST_ID_FILE") {
        let r = common::netns::test_rank();
        return rank(&std::env::var("OXCCL_TEST_CASE").unwrap(), r, &path);
    }
    let Some(mut hosts) = common::netns::Hosts::new(2) else {
        return;
    };
    for case in ["inplace-4", "outofplace-12", "inplace-30", "outofplace-45"] {
        let path = std::env::temp_dir()
            .join(format!("oxccl-netabort-{}-{case}", std::process::id()))
            .display()
            .to_string();
        let env = [
            ("OXCCL_TEST_CASE", case),
            ("OXCCL_HEARTBEAT_S", "2"),
            // The work goes to the stream's worker: the abort comes from another thread.
            ("OXCCL_INLINE_US", "0"),
        ];
        hosts.start_ranks(TEST, &path, 2, |r| r, &env);
        let ok = hosts.wait_for(Duration::from_secs(60));
        let logs = common::netns::joined_logs(&path, 2);
        let _ = std::fs::remove_file(&path);
        eprintln!("{case}:\n{logs}");
        assert_eq!(ok, Some(vec![true, true]), "{case}:\n{logs}");
        for r in 0..2 {
            assert!(
                logs.contains(&format!("rank {r} ({case}): buffers untouched")),
                "{case}:\n{logs}"
            );
        }
    }
}
