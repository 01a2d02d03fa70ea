//! The flight recorder (`OXCCL_FLIGHT_RECORDER=N`): a rank stuck in an operation dumps its
//! communicator's last operations with their state when asked by SIGUSR2
//! (`OXCCL_FLIGHT_RECORDER_SIGNAL=1`), when the watchdog fires, and when the operation fails.

use nccl::api::{self, StreamArg};
use std::time::{Duration, Instant};

mod common;

const TEST: &str = "a_stuck_rank_dumps_its_last_operations";

fn wait_for(path: &str, text: &str, within: Duration) -> String {
    let t0 = Instant::now();
    loop {
        let got = std::fs::read_to_string(path).unwrap_or_default();
        if got.contains(text) {
            return got;
        }
        assert!(
            t0.elapsed() < within,
            "{path} never said {text:?}; it holds:\n{got}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_stuck_rank_dumps_its_last_operations() {
    let prefix = std::env::temp_dir()
        .join(format!("oxccl-flight-{}", std::process::id()))
        .display()
        .to_string();
    if !common::is_child() {
        let out = common::in_child(
            TEST,
            &[
                ("OXCCL_FLIGHT_RECORDER", "3"),
                ("OXCCL_FLIGHT_RECORDER_SIGNAL", "1"),
                ("OXCCL_FLIGHT_RECORDER_FILE", &prefix),
                ("OXCCL_WATCHDOG_S", "1"),
                ("OXCCL_TIMEOUT_S", "3"),
            ],
        );
        if let Some(at) = out.find("on the watchdog:") {
            eprintln!("{}", &out[at..]);
        }
        return;
    }
    let prefix = std::env::var("OXCCL_FLIGHT_RECORDER_FILE").unwrap();
    let comms = api::comm_init_all(&[0, 1]).unwrap();
    let path = format!("{prefix}.{:016x}.0", comms[0].comm_hash().unwrap());
    // Four operations that complete (the recorder keeps the last three), eager and large.
    for count in [4usize, 1000, 100_000, 8] {
        std::thread::scope(|s| {
            for (r, c) in comms.iter().enumerate() {
                s.spawn(move || {
                    let send = vec![1f32 + r as f32; count];
                    let mut recv = vec![0f32; count];
                    api::enqueue(c, common::all_reduce_f32(&send, &mut recv), StreamArg::Null)
                        .unwrap();
                });
            }
        });
    }
    // Then rank 0 alone: stuck until its timeout.
    let watcher = std::thread::spawn({
        let path = path.clone();
        move || {
            std::thread::sleep(Duration::from_millis(300));
            nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGUSR2)
                .unwrap();
            let on_signal = wait_for(&path, "(SIGUSR2)", Duration::from_millis(700));
            let on_watchdog = wait_for(&path, "the watchdog fired", Duration::from_secs(2));
            (on_signal, on_watchdog)
        }
    });
    let send = vec![1f32; 50_000];
    let mut recv = vec![0f32; 50_000];
    let e = api::enqueue(
        &comms[0],
        common::all_reduce_f32(&send, &mut recv),
        StreamArg::Null,
    )
    .unwrap_err();
    let (on_signal, on_watchdog) = watcher.join().unwrap();
    let on_failure = wait_for(&path, "failed", Duration::from_secs(1));
    eprintln!(
        "on SIGUSR2:\n{on_signal}\non the watchdog:\n{on_watchdog}\non failure:\n{on_failure}"
    );
    for dump in [&on_signal, &on_watchdog] {
        assert!(dump.contains("the last 3 operations"), "{dump}");
        assert!(!dump.contains("#2 "), "the recorder keeps 3: {dump}");
        assert!(
            dump.contains("#3 AllReduce of 100000 x float: done in"),
            "{dump}"
        );
        assert!(
            dump.contains("#4 AllReduce of 8 x float: done in"),
            "{dump}"
        );
        assert!(
            dump.contains("#5 AllReduce of 50000 x float: running for"),
            "{dump}"
        );
    }
    assert!(
        on_failure.contains("#5 AllReduce of 50000 x float: failed")
            && on_failure.contains("Timeout"),
        "{on_failure}: {e}"
    );
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(format!("{prefix}.{:016x}.1", comms[1].comm_hash().unwrap()));
    for c in comms {
        let _ = api::comm_abort(api::comm_handle(&c));
    }
}
