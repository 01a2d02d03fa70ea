//! A /dev/shm too small for the shared-memory connections (a container's default is 64 MiB):
//! every rank gets an error, the failing one naming /dev/shm and what to do, instead of a
//! process killed by SIGBUS when a slot is first written; and nothing stays in /dev/shm. A
//! read-only /dev/shm likewise: an error that says /dev/shm must be a writable tmpfs.
//! Needs root (a mount namespace with a small tmpfs on /dev/shm); skipped otherwise.

use nccl::api;
use std::process::Command;

mod common;

const TEST: &str = "a_dev_shm_too_small_is_an_error_not_a_crash";

/// One rank (in the small /dev/shm's mount namespace): an all-reduce large enough to use the
/// connections' slots must fail, cleanly, then the communicator goes.
fn rank(id: [u8; api::UNIQUE_ID_BYTES], n: usize, r: usize) {
    let count = 1 << 20;
    let send = vec![r as f32; count];
    let mut recv = vec![0f32; count];
    let e = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).and_then(|c| {
        let res = api::enqueue(
            &c,
            common::all_reduce_f32(&send, &mut recv),
            api::StreamArg::Null,
        );
        let _ = api::comm_abort(api::comm_handle(&c));
        res
    });
    let e = e.expect_err("an all-reduce over a /dev/shm of 256 KiB, or a read-only one");
    eprintln!("rank {r}: {e}");
    if e.msg.contains("/dev/shm") {
        assert_eq!(e.code, nccl::error::Code::SystemError, "{e}");
        // What to do: give it room, or make it writable.
        assert!(
            e.msg.contains("--shm-size") || e.msg.contains("writable tmpfs"),
            "{e}"
        );
    }
    std::fs::write(
        format!("{}.rank{r}", std::env::var("OXCCL_TEST_OUT").unwrap()),
        e.to_string(),
    )
    .unwrap();
}

#[test]
fn a_dev_shm_too_small_is_an_error_not_a_crash() {
    if let Some((id, n, r)) = common::rank_env() {
        return rank(id, n, r);
    }
    if common::is_child() {
        // In the mount namespace: the ranks, each a process of its own sharing the small
        // /dev/shm. Each exits 0 only with an error in hand (`rank`).
        let out = std::env::var("OXCCL_TEST_OUT").unwrap();
        common::run_ranks(TEST, 2, &[("OXCCL_TEST_OUT", &out)]);
        let errors: Vec<String> = (0..2)
            .map(|r| std::fs::read_to_string(format!("{out}.rank{r}")).unwrap())
            .collect();
        assert!(
            errors.iter().any(|e| e.contains("/dev/shm")),
            "no rank named /dev/shm: {errors:?}"
        );
        if std::env::var("OXCCL_TEST_CASE").unwrap() == "ro" {
            assert!(
                errors.iter().any(|e| e.contains("writable tmpfs")),
                "{errors:?}"
            );
        }
        let left = std::fs::read_dir("/dev/shm").unwrap().count();
        assert_eq!(left, 0, "segments left in /dev/shm");
        return;
    }
    // (Root, or another way to make a mount namespace: unshare says.)
    let can = Command::new("unshare")
        .args(["--mount", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !can {
        eprintln!("skipped: a tmpfs on /dev/shm in a mount namespace needs root");
        return;
    }
    let out = std::env::temp_dir()
        .join(format!("oxccl-shm-space-{}", std::process::id()))
        .display()
        .to_string();
    let exe = std::env::current_exe().unwrap();
    // Too small, then read-only (a container whose /dev/shm cannot be written).
    for (case, opts) in [("small", "size=256k"), ("ro", "ro,size=256k")] {
        let run = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(format!(
                "mount -t tmpfs -o {opts} tmpfs /dev/shm && exec \"$@\""
            ))
            .arg("sh")
            .arg(&exe)
            .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
            .env("OXCCL_TEST_CHILD", "1")
            .env("OXCCL_DEVICE", "host")
            .env("OXCCL_TEST_OUT", &out)
            .env("OXCCL_TEST_CASE", case)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&run.stdout).to_string()
            + &String::from_utf8_lossy(&run.stderr);
        for r in 0..2 {
            let _ = std::fs::remove_file(format!("{out}.rank{r}"));
        }
        assert!(run.status.success(), "{case}:\n{text}");
        assert!(text.contains("1 passed"), "{case}: ran nothing:\n{text}");
    }
}
