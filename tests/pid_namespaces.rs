//! Ranks of one host in different PID namespaces: containers that share the host's hostname
//! and /dev/shm (`docker run --ipc=host --network=host`) but not its process ids, where each
//! rank's process may well be PID 1 of its own namespace. A process id then means nothing
//! across ranks: two ranks with the same one are not one process, and a peer's id names no
//! process here, or another one.
//!
//! - `one-inside`: rank 1 runs in a PID namespace of its own with its own /proc, where rank 0's
//!   process id names nothing; it waits for rank 0, which comes 1.5 s late to each all-reduce:
//!   rank 0 must not be taken for dead.
//! - `both-pid-1`: each rank is PID 1 of a namespace of its own: they are two processes all the
//!   same (shared memory between them, never one's pointers used by the other, never one's
//!   /proc/1 taken for the other's). All-reduces of 2, 4096 and 1M floats on malloc'd and on
//!   `ncclMemAlloc` buffers, and a send/recv each way, every element checked.
//! - `killed`: each rank in a namespace of its own (the same pid in each, under a shell that is
//!   PID 1), rank 1 forks a child that sleeps on, then kills itself after one all-reduce; rank
//!   0's next all-reduce must fail within seconds with `ncclRemoteError` naming rank 1 (its pid
//!   means nothing here: rank 0 sees its lock in /dev/shm released, although the child lives),
//!   and no file of either is left in /dev/shm.
//!
//! Needs root (`unshare --pid`); skips with a message where namespaces cannot be made (not
//! under CI, which is root).

use nccl::api::{self, CollArgs, StreamArg};
use nccl::types::CollKind;
use std::time::Duration;

mod common;

use common::all_reduce_f32_at as all_reduce;

const TEST: &str = "ranks_in_different_pid_namespaces_are_different_processes";
const UNSHARE: [&str; 4] = ["unshare", "--pid", "--fork", "--mount-proc"];
/// `UNSHARE` with the rank under a shell that is PID 1 (a namespace's PID 1 cannot be killed
/// from inside it), which outlives the rank by 6 s (the namespace's processes, the rank's
/// forked child among them, live as long as its PID 1).
const UNSHARE_SH: [&str; 8] = [
    "unshare",
    "--pid",
    "--fork",
    "--mount-proc",
    "sh",
    "-c",
    "\"$@\"; s=$?; sleep 6; exit $s",
    "sh",
];

/// Runs `args` on `c` (NULL stream), panicking with what failed.
fn run(c: &std::sync::Arc<nccl::comm::Comm>, args: CollArgs, what: &str) {
    api::enqueue(c, args, StreamArg::Null)
        .unwrap_or_else(|e| panic!("{what}: {e} ({})", nccl::error::last_error()));
}

/// A buffer of `count` floats: malloc'd, or from `ncclMemAlloc`.
fn floats(count: usize, mem_alloc: bool) -> &'static mut [f32] {
    let p = if mem_alloc {
        api::mem_alloc(count * 4).unwrap() as *mut f32
    } else {
        Box::leak(vec![0f32; count].into_boxed_slice()).as_mut_ptr()
    };
    // SAFETY: a fresh allocation of `count` floats, never freed.
    unsafe { std::slice::from_raw_parts_mut(p, count) }
}

fn rank(case: &str, r: i32, id: &[u8; api::UNIQUE_ID_BYTES]) {
    let c = api::comm_init_rank(2, id, r, Default::default()).unwrap();
    if case == "killed" {
        return killed(c, r);
    }
    let counts: &[usize] = if case == "one-inside" {
        &[4096; 3]
    } else {
        &[2, 4096, 1 << 20]
    };
    let mut round = 0;
    for mem_alloc in [false, true] {
        for &count in counts {
            round += 1;
            let (send, recv) = (floats(count, mem_alloc), floats(count, mem_alloc));
            let v = |q: i32, i: usize| ((i * 7 + round) % 11) as f32 + 3.0 * q as f32;
            send.iter_mut().enumerate().for_each(|(i, x)| *x = v(r, i));
            if case == "one-inside" && r == 0 {
                std::thread::sleep(Duration::from_millis(1500));
            }
            let what =
                format!("rank {r}, {case}, all-reduce of {count} (ncclMemAlloc {mem_alloc})");
            run(
                &c,
                all_reduce(send.as_ptr() as usize, recv.as_mut_ptr() as usize, count),
                &what,
            );
            for (i, &x) in recv.iter().enumerate() {
                assert_eq!(x, v(0, i) + v(1, i), "{what}, element {i}");
            }
            // A send/recv each way: rank 0 sends first, then receives.
            api::group_start().unwrap();
            for (kind, to) in [(CollKind::Send, 1 - r), (CollKind::Recv, 1 - r)] {
                let a = CollArgs {
                    kind,
                    root: to,
                    ..all_reduce(send.as_ptr() as usize, recv.as_mut_ptr() as usize, count)
                };
                api::enqueue(&c, a, StreamArg::Null).unwrap();
            }
            let what = format!("rank {r}, {case}, send/recv of {count} (ncclMemAlloc {mem_alloc})");
            api::group_end()
                .unwrap_or_else(|e| panic!("{what}: {e} ({})", nccl::error::last_error()));
            for (i, &x) in recv.iter().enumerate() {
                assert_eq!(x, v(1 - r, i), "{what}, element {i}");
            }
            if case == "one-inside" {
                break;
            }
        }
    }
    api::comm_destroy(api::comm_handle(&c)).unwrap();
}

/// `killed`: one all-reduce, then rank 1 dies and rank 0's next all-reduce must fail.
fn killed(c: std::sync::Arc<nccl::comm::Comm>, r: i32) {
    let count = 1 << 16;
    let (send, recv) = (floats(count, false), floats(count, false));
    send.fill(1.0);
    run(
        &c,
        all_reduce(send.as_ptr() as usize, recv.as_mut_ptr() as usize, count),
        "first",
    );
    assert!(
        recv.iter().all(|&x| x == 2.0),
        "rank {r}: the first all-reduce"
    );
    if r == 1 {
        // A child forked after init (a data loader's worker, say) outlives the rank: the
        // rank's lock must go with the rank, not stay with the child's copy of it.
        // SAFETY: the child only sleeps and exits (async-signal-safe calls).
        if let nix::unistd::ForkResult::Child = unsafe { nix::unistd::fork() }.unwrap() {
            // SAFETY: as above.
            unsafe {
                nix::libc::sleep(20);
                nix::libc::_exit(0);
            }
        }
        nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL).unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    let t = std::time::Instant::now();
    let args = all_reduce(send.as_ptr() as usize, recv.as_mut_ptr() as usize, count);
    let e = api::enqueue(&c, args, StreamArg::Null).expect_err("an all-reduce with a dead peer");
    let took = t.elapsed();
    assert_eq!(e.code, nccl::error::Code::RemoteError, "{e}");
    assert!(e.msg.contains("rank 1"), "the error names no rank: {e}");
    assert!(took < Duration::from_secs(3), "seen after {took:?}: {e}");
    eprintln!("killed: seen after {took:?}: {e}");
    api::comm_abort(api::comm_handle(&c)).unwrap();
}

#[test]
fn ranks_in_different_pid_namespaces_are_different_processes() {
    if let Some((id, _, r)) = common::rank_env() {
        let case = std::env::var("OXCCL_PIDNS_CASE").unwrap();
        return rank(&case, r as i32, &id);
    }
    let can = std::process::Command::new(UNSHARE[0])
        .args(&UNSHARE[1..])
        .arg("true")
        .status()
        .is_ok_and(|s| s.success());
    if !can {
        // CI runs as root: there the test must run.
        assert!(
            std::env::var_os("CI").is_none(),
            "cannot make a PID namespace (unshare --pid --fork --mount-proc)"
        );
        eprintln!("SKIPPED: cannot make a PID namespace here (unshare --pid needs root)");
        return;
    }
    for case in ["one-inside", "both-pid-1", "killed"] {
        let before = common::shm_files();
        let env = [("OXCCL_PIDNS_CASE", case)];
        let kids = common::spawn_ranks_in(TEST, 2, &env, |r| match (case, r) {
            ("one-inside", 0) => &[],
            ("killed", _) => &UNSHARE_SH,
            _ => &UNSHARE,
        });
        for (r, mut k) in kids.into_iter().enumerate() {
            let st = k.wait().unwrap();
            let dead = case == "killed" && r == 1;
            assert_eq!(st.success(), !dead, "{case}: rank {r}: {st:?}");
        }
        let left: Vec<_> = common::shm_files()
            .into_iter()
            .filter(|n| !before.contains(n))
            .collect();
        assert!(left.is_empty(), "{case}: left behind in /dev/shm: {left:?}");
    }
}
