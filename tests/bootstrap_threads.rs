//! No bootstrap thread outlives its Bootstrap (or its unique id's rendezvous). Alone in its own
//! test binary so that no other test's threads disturb the count of /proc/self/task.

use nccl::bootstrap::{Bootstrap, UniqueId};
use nccl::error::Code;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Waits (a little) for the thread count to come back to `base`.
fn settles_to(base: usize) -> usize {
    let t0 = Instant::now();
    loop {
        let n = threads();
        if n == base || t0.elapsed() > Duration::from_secs(5) {
            return n;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn no_thread_outlives_bootstrap() {
    let t = Duration::from_secs(60);
    let base = threads();

    // A full rendezvous with traffic; counted while alive, then after drop.
    let id = UniqueId::generate_with_timeout(t).unwrap();
    assert_eq!(threads(), base + 1, "the root thread runs");
    let n = 4;
    let alive: Vec<usize> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                sc.spawn(move || {
                    let b = Bootstrap::init_with_timeout(
                        &[id],
                        r,
                        n,
                        Arc::new(AtomicBool::new(false)),
                        t,
                    )
                    .unwrap();
                    let all = b.allgather(&[r as u8; 3]).unwrap();
                    assert_eq!(all, (0..n).map(|q| vec![q as u8; 3]).collect::<Vec<_>>());
                    b.send((r + 1) % n, 0, b"x").unwrap();
                    assert_eq!(b.recv((r + n - 1) % n, 0).unwrap(), b"x");
                    b.barrier().unwrap();
                    let c = threads();
                    b.barrier().unwrap();
                    c
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // n rank threads + n receiver threads while everyone was inside the two barriers.
    for c in alive {
        assert!(c >= base + 2 * n, "{c} threads, base {base}");
    }
    assert_eq!(
        settles_to(base),
        base,
        "threads left after the bootstraps were dropped"
    );

    // A failed init (a rank is missing) leaves nothing behind either, root included.
    let short = Duration::from_millis(400);
    let id = UniqueId::generate_with_timeout(short).unwrap();
    let e = Bootstrap::init_with_timeout(&[id], 0, 2, Arc::new(AtomicBool::new(false)), short)
        .err()
        .unwrap();
    assert_eq!(e.code, Code::Timeout);
    assert_eq!(settles_to(base), base, "threads left after a failed init");

    // Explicit close joins too.
    let id = UniqueId::generate_with_timeout(t).unwrap();
    let mut b =
        Bootstrap::init_with_timeout(&[id], 0, 1, Arc::new(AtomicBool::new(false)), t).unwrap();
    b.close();
    assert_eq!(settles_to(base), base, "threads left after close");
    drop(b);
}
