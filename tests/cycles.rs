//! 1000 communicators made, used and destroyed one after another leave nothing behind: the
//! process's file descriptors, threads and `/dev/shm` files come back to what they were, and its
//! resident memory does not grow.

use nccl::api::{self, StreamArg};

mod common;

fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).map(|d| d.count()).unwrap_or(0)
}

fn shm_files() -> usize {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("oxccl-"))
                .count()
        })
        .unwrap_or(0)
}

/// Resident memory, KiB.
fn rss_kib() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4
}

/// (fds, threads, shm files, rss KiB)
fn usage() -> (usize, usize, usize, usize) {
    (
        count_dir("/proc/self/fd"),
        count_dir("/proc/self/task"),
        shm_files(),
        rss_kib(),
    )
}

/// Rank `r` of a fresh 2-rank communicator all-reduces once eagerly and once through the ring,
/// checks, and destroys it.
fn use_and_destroy(c: &std::sync::Arc<nccl::comm::Comm>, i: usize, r: usize) {
    for count in [4usize, 100_000] {
        let send = vec![1.0f32 + r as f32; count];
        let mut recv = vec![0f32; count];
        api::enqueue(c, common::all_reduce_f32(&send, &mut recv), StreamArg::Null).unwrap();
        assert!(
            recv.iter().all(|&x| x == 3.0),
            "cycle {i}: rank {r}: wrong result"
        );
    }
    api::comm_destroy(api::comm_handle(c)).unwrap();
}

/// One cycle: 2 ranks (threads) initialise from a fresh unique id, all-reduce once (eager) and
/// once through the ring, and destroy.
fn cycle(i: usize) {
    let id = api::get_unique_id().unwrap();
    std::thread::scope(|s| {
        for r in 0..2 {
            let id = &id;
            s.spawn(move || {
                let c = api::comm_init_rank(2, id, r, Default::default()).unwrap();
                use_and_destroy(&c, i, r as usize);
            });
        }
    });
}

#[test]
fn a_thousand_init_destroy_cycles_leave_nothing_behind() {
    if !common::is_child() {
        // Alone in a process: other tests' threads and files would blur the counts.
        let out = common::in_child("a_thousand_init_destroy_cycles_leave_nothing_behind", &[]);
        if let Some(l) = out.lines().find(|l| l.contains("cycles in")) {
            eprintln!("{l}");
        }
        return;
    }
    let cycles: usize = std::env::var("OXCCL_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    // Warm up: lazily made process-wide state (thread pools, caches) is not a leak.
    for i in 0..20 {
        cycle(i);
    }
    let before = usage();
    let t0 = std::time::Instant::now();
    for i in 0..cycles {
        cycle(i);
    }
    // Threads that end asynchronously (bootstrap services winding down) get a moment.
    let mut after = usage();
    for _ in 0..100 {
        if after.0 <= before.0 && after.1 <= before.1 && after.2 <= before.2 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        after = usage();
    }
    eprintln!(
        "{cycles} cycles in {:?}: fds {} -> {}, threads {} -> {}, /dev/shm files {} -> {}, rss {} -> {} KiB",
        t0.elapsed(),
        before.0,
        after.0,
        before.1,
        after.1,
        before.2,
        after.2,
        before.3,
        after.3
    );
    // (A thread of the last warm-up cycle may still have been ending when `before` was taken.)
    assert!(after.0 <= before.0, "file descriptors leaked");
    assert!(after.1 <= before.1, "threads leaked");
    assert!(after.2 <= before.2, "/dev/shm files leaked");
    assert!(
        after.3 < before.3 + 16 * 1024,
        "resident memory grew by {} KiB",
        after.3 - before.3
    );
}

/// The same between 2 processes (shared memory connections and board): each cycle's unique id
/// goes from rank 0 to rank 1 by a broadcast on a communicator that lives throughout.
#[test]
fn a_thousand_init_destroy_cycles_between_processes_leave_nothing_behind() {
    let Some((id, n, r)) = common::rank_env() else {
        return common::run_ranks(
            "a_thousand_init_destroy_cycles_between_processes_leave_nothing_behind",
            2,
            &[],
        );
    };
    let cycles: usize = std::env::var("OXCCL_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let world = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
    let cycle = |i: usize| {
        let mut id = if r == 0 {
            api::get_unique_id().unwrap()
        } else {
            [0u8; api::UNIQUE_ID_BYTES]
        };
        let a = nccl::api::CollArgs {
            kind: nccl::types::CollKind::Broadcast,
            send: id.as_ptr() as usize,
            recv: id.as_mut_ptr() as usize,
            count: api::UNIQUE_ID_BYTES,
            dtype: nccl::types::DataType::Uint8,
            op: 0,
            root: 0,
        };
        api::enqueue(&world, a, StreamArg::Null).unwrap();
        let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
        use_and_destroy(&c, i, r);
    };
    for i in 0..20 {
        cycle(i);
    }
    let before = usage();
    for i in 0..cycles {
        cycle(i);
    }
    let mut after = usage();
    for _ in 0..100 {
        if after.0 <= before.0 && after.1 <= before.1 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        after = usage();
    }
    eprintln!("rank {r}: {cycles} cycles: {before:?} -> {after:?} (fds, threads, shm, rss KiB)");
    assert!(after.0 <= before.0, "rank {r}: file descriptors leaked");
    assert!(after.1 <= before.1, "rank {r}: threads leaked");
    assert!(
        after.3 < before.3 + 16 * 1024,
        "rank {r}: resident memory grew by {} KiB",
        after.3 - before.3
    );
    api::comm_destroy(api::comm_handle(&world)).unwrap();
    // /dev/shm: every name is removed once both ends mapped it (the count is host-wide, so
    // it is checked by rank 0 once both are done with their cycles: only the world's board
    // and ring may remain, and they are unlinked already).
    assert!(shm_files() <= before.2, "rank {r}: /dev/shm files left");
}
