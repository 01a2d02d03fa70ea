//! ncclCommAbort while work runs: once it returns, the library never touches the ranks' buffers
//! again (the buffers can be freed or reused), and every waiter gets an error, not a hang.

use nccl::api::{self, CollArgs};
use nccl::types::{CollKind, DataType, OP_SUM};
use std::time::{Duration, Instant};

mod common;

const CANARY: f32 = -12345.0;

/// Two ranks of this process run large all-reduces on host streams, handed straight to the
/// streams' workers (`OXCCL_INLINE_US=0`), with direct operations and with rings; another
/// thread aborts both communicators mid-way. After the aborts return, canaries written into
/// every buffer must stay untouched.
#[test]
fn abort_while_workers_run_then_buffers_are_ours() {
    if common::is_child() {
        return abort_while_workers_run();
    }
    let me = "abort_while_workers_run_then_buffers_are_ours";
    let _ = common::in_child(me, &[("OXCCL_INLINE_US", "0")]);
    let _ = common::in_child(me, &[("OXCCL_INLINE_US", "0"), ("OXCCL_ALGO", "ring")]);
}

fn abort_while_workers_run() {
    std::env::set_var("OXCCL_DEVICE", "host");
    // Large enough that the operations are still running when the abort comes.
    let count = 16 << 20;
    for round in 0..3 {
        let comms = api::comm_init_all(&[0, 1]).unwrap();
        let streams: Vec<usize> = (0..2).map(|_| api::host_stream_create().unwrap()).collect();
        let mut send: Vec<Vec<f32>> = (0..2).map(|r| vec![r as f32 + 1.0; count]).collect();
        let mut recv: Vec<Vec<f32>> = (0..2).map(|_| vec![0.0f32; count]).collect();
        api::group_start().unwrap();
        for _ in 0..4 {
            for r in 0..2 {
                let a = CollArgs {
                    kind: CollKind::AllReduce,
                    send: send[r].as_ptr() as usize,
                    recv: recv[r].as_mut_ptr() as usize,
                    count,
                    dtype: DataType::Float32,
                    op: OP_SUM,
                    root: 0,
                };
                let st = api::stream_from_handle(streams[r]).unwrap();
                api::enqueue(&comms[r], a, st).unwrap();
            }
        }
        api::group_end().unwrap();
        // Let the workers get going (round 0 aborts almost at once).
        std::thread::sleep(Duration::from_millis(2 + 15 * round));
        let handles: Vec<usize> = comms.iter().map(api::comm_handle).collect();
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for h in handles {
                s.spawn(move || {
                    // Abort reports how the destroy ended; either way nothing may run on.
                    let _ = api::comm_abort(h);
                });
            }
        });
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "abort took {:?}",
            t0.elapsed()
        );
        // The buffers are the caller's again: fill them, give stray writers time, check.
        for b in send.iter_mut().chain(recv.iter_mut()) {
            b.fill(CANARY);
        }
        std::thread::sleep(Duration::from_millis(300));
        for (i, b) in send.iter().chain(recv.iter()).enumerate() {
            if let Some(j) = b.iter().position(|&x| x != CANARY) {
                panic!(
                    "round {round}: buffer {i} element {j} was written after ncclCommAbort returned: {}",
                    b[j]
                );
            }
        }
        for st in streams {
            // The aborted work reports an error (or nothing, if it had finished); no hang.
            let _ = api::host_stream_synchronize(st);
            api::host_stream_destroy(st).unwrap();
        }
    }
}
