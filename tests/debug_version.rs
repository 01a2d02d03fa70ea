//! `NCCL_DEBUG=VERSION` (and `WARN`, `INFO`) print NCCL's version line once per process, at the
//! first communicator init: a child process (this binary again, running `inits_in_a_child`) makes
//! several communicators through the C entry points, and the parent counts the lines.

use nccl::abi::*;
use std::ffi::c_int;
use std::process::Command;
use std::ptr::null_mut;

const CHILD: &str = "OXCCL_TEST_VERSION_CHILD";
const LINE: &str = "NCCL version 2.32.3+oxccl";

/// In the child: three ncclCommInitAll and one ncclCommInitRank (two threads, a rank each).
#[test]
fn inits_in_a_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let devs: [c_int; 4] = [0, 1, 2, 3];
    for n in [4, 2, 1] {
        let mut comms: [ncclComm_t; 4] = [null_mut(); 4];
        // SAFETY: room for n <= 4 handles, n devices.
        unsafe {
            assert_eq!(ncclCommInitAll(comms.as_mut_ptr(), n, devs.as_ptr()).0, 0);
            for &c in &comms[..n as usize] {
                assert_eq!(ncclCommDestroy(c).0, 0);
            }
        }
    }
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }.0, 0);
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            std::thread::spawn(move || {
                let mut c: ncclComm_t = null_mut();
                // SAFETY: a valid out-pointer; both ranks use the same id.
                unsafe {
                    assert_eq!(ncclCommInitRank(&mut c, 2, id, r).0, 0);
                    assert_eq!(ncclCommDestroy(c).0, 0);
                }
            })
        })
        .collect();
    for t in ranks {
        t.join().unwrap();
    }
}

/// The child's stdout with `NCCL_DEBUG` set to `level` (unset when None).
fn child_stdout(level: Option<&str>) -> String {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "inits_in_a_child", "--nocapture"])
        .env(CHILD, "1")
        .env("OXCCL_DEVICE", "host")
        .env("OXCCL_TIMEOUT_S", "60")
        .env_remove("NCCL_DEBUG");
    if let Some(l) = level {
        cmd.env("NCCL_DEBUG", l);
    }
    let out = cmd.output().expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child with NCCL_DEBUG={level:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn version_lines(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter(|l| l.contains("NCCL version"))
        .collect()
}

#[test]
fn version_and_warn_print_the_bare_line_once() {
    for level in ["VERSION", "WARN", "version"] {
        let out = child_stdout(Some(level));
        assert_eq!(
            version_lines(&out),
            [LINE],
            "NCCL_DEBUG={level}: want exactly one bare version line:\n{out}"
        );
    }
}

#[test]
fn info_prints_one_info_log_line() {
    let out = child_stdout(Some("INFO"));
    let lines = version_lines(&out);
    assert_eq!(lines.len(), 1, "NCCL_DEBUG=INFO: {lines:#?}\n{out}");
    // host:pid:tid [dev] NCCL INFO NCCL version ...
    let (prefix, rest) = lines[0].split_once(' ').unwrap();
    assert_eq!(prefix.split(':').count(), 3, "{}", lines[0]);
    let pid = prefix.split(':').nth(1).unwrap();
    assert!(pid.parse::<u32>().is_ok(), "{}", lines[0]);
    let (dev, rest) = rest.split_once(' ').unwrap();
    assert!(dev.starts_with('[') && dev.ends_with(']'), "{}", lines[0]);
    assert_eq!(rest, format!("NCCL INFO {LINE}"));
}

#[test]
fn no_line_without_nccl_debug() {
    let out = child_stdout(None);
    assert!(version_lines(&out).is_empty(), "{out}");
}
