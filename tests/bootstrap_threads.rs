//! No bootstrap thread outlives its Bootstrap (or its unique id's rendezvous), and unused unique
//! ids cost no thread. Alone in its own test binary so that no other test's threads disturb the
//! counts of /proc/self/task and /proc/self/fd.

use nccl::bootstrap::{Bootstrap, UniqueId};
use nccl::error::Code;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
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

/// One test, in two parts run in turn: a second test would run on a thread of its own and
/// disturb the counts.
#[test]
fn no_thread_outlives_bootstrap() {
    rendezvous_threads();
    unused_ids_cost_no_thread();
}

fn rendezvous_threads() {
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

/// Waits (a little longer than the ids' timeout) for the descriptor count to come back to `base`.
fn fds_settle_to(base: usize, within: Duration) -> usize {
    let t0 = Instant::now();
    loop {
        let n = fds();
        if n == base || t0.elapsed() > within {
            return n;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Raises the soft limit on descriptors to fit `need` (a default of 1024 would not fit 1000
/// listeners).
fn fit_fds(need: u64) {
    use nix::libc::{getrlimit, rlimit, setrlimit, RLIMIT_NOFILE};
    let mut r = rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain system calls on a local struct.
    unsafe {
        assert_eq!(getrlimit(RLIMIT_NOFILE, &mut r), 0);
        if r.rlim_cur < need {
            r.rlim_cur = need.min(r.rlim_max);
            assert_eq!(setrlimit(RLIMIT_NOFILE, &r), 0);
        }
    }
}

/// 1000 unique ids nobody uses cost 1000 listening sockets while they are pending, one service
/// thread for all of them, and nothing once they expired. One of them still serves a rank.
fn unused_ids_cost_no_thread() {
    fit_fds(4096);
    let base_threads = threads();
    let base_fds = fds();
    let n = 1000;
    let life = Duration::from_secs(3);
    let t0 = Instant::now();
    let ids: Vec<UniqueId> = (0..n)
        .map(|_| UniqueId::generate_with_timeout(life).unwrap())
        .collect();
    let made = t0.elapsed();
    let pending_threads = threads();
    let pending_fds = fds();
    assert!(
        pending_threads <= base_threads + 1,
        "{n} unused ids run {} threads",
        pending_threads - base_threads
    );
    // A listener per id, plus the service's waker (2).
    assert!(
        pending_fds >= base_fds + n && pending_fds <= base_fds + n + 2,
        "{n} unused ids hold {} descriptors",
        pending_fds - base_fds
    );
    // Among them, an id in use works as ever.
    let b = Bootstrap::init_with_timeout(
        &[ids[n / 2]],
        0,
        1,
        Arc::new(AtomicBool::new(false)),
        Duration::from_secs(10),
    )
    .unwrap();
    drop(b);
    assert!(made < life, "making {n} ids took {made:?}");
    // Expired: no thread, no descriptor left.
    assert_eq!(
        fds_settle_to(base_fds, life + Duration::from_secs(5)),
        base_fds,
        "descriptors left after {n} ids expired"
    );
    assert_eq!(
        settles_to(base_threads),
        base_threads,
        "threads left after {n} ids expired"
    );
    // Their ports are closed.
    for id in &ids[..10] {
        assert!(std::net::TcpStream::connect(id.root_addr()).is_err());
    }
}
