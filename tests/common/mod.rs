//! Helpers shared by test binaries: running a test again as the ranks of one communicator, one
//! process each.

use nccl::api::{self, UNIQUE_ID_BYTES};

/// In a process that `run_ranks` started: (unique id, number of ranks, this rank).
pub fn rank_env() -> Option<([u8; UNIQUE_ID_BYTES], usize, usize)> {
    let r = std::env::var("OXCCL_TEST_RANK").ok()?.parse().ok()?;
    let n = std::env::var("OXCCL_TEST_N").ok()?.parse().ok()?;
    let hex = std::env::var("OXCCL_TEST_ID").ok()?;
    let mut id = [0u8; UNIQUE_ID_BYTES];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some((id, n, r))
}

/// Runs this binary's test `test` again as each of `n` ranks (see `rank_env`), on the host
/// executor, with `envs` added, and asserts that every rank succeeds.
pub fn run_ranks(test: &str, n: usize, envs: &[(&str, &str)]) {
    let id = api::get_unique_id().unwrap();
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().unwrap();
    let kids: Vec<_> = (0..n)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["--exact", test, "--nocapture"])
                .env("OXCCL_DEVICE", "host")
                .env("OXCCL_TEST_ID", &hex)
                .env("OXCCL_TEST_N", n.to_string())
                .env("OXCCL_TEST_RANK", r.to_string())
                .env("OXCCL_TIMEOUT_S", "60")
                .envs(envs.iter().copied())
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for (r, mut k) in kids.into_iter().enumerate() {
        assert!(
            k.wait().unwrap().success(),
            "{test}: rank {r} of {n} failed"
        );
    }
}
