//! Helpers shared by test binaries: running a test again as the ranks of one communicator, one
//! process each, or once in a child process with its own environment.

pub mod netns;

use nccl::api::{self, UNIQUE_ID_BYTES};

/// In a process that `run_ranks` started: (unique id, number of ranks, this rank).
#[allow(dead_code)]
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
#[allow(dead_code)]
pub fn run_ranks(test: &str, n: usize, envs: &[(&str, &str)]) {
    for (r, mut k) in spawn_ranks(test, n, envs).into_iter().enumerate() {
        assert!(
            k.wait().unwrap().success(),
            "{test}: rank {r} of {n} failed"
        );
    }
}

/// `run_ranks` without the wait: the rank processes, in rank order (their stdout discarded).
#[allow(dead_code)]
pub fn spawn_ranks(test: &str, n: usize, envs: &[(&str, &str)]) -> Vec<std::process::Child> {
    spawn_ranks_in(test, n, envs, |_| &[])
}

/// `spawn_ranks`, each rank r started through the command `wrap(r)` (empty: none), e.g.
/// `unshare --pid --fork` to put it in a namespace of its own.
#[allow(dead_code)]
pub fn spawn_ranks_in<'a>(
    test: &str,
    n: usize,
    envs: &[(&str, &str)],
    wrap: impl Fn(usize) -> &'a [&'a str],
) -> Vec<std::process::Child> {
    let id = api::get_unique_id().unwrap();
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().unwrap();
    (0..n)
        .map(|r| {
            let mut c = match wrap(r) {
                [] => std::process::Command::new(&exe),
                [cmd, args @ ..] => {
                    let mut c = std::process::Command::new(cmd);
                    c.args(args).arg(&exe);
                    c
                }
            };
            c.args(["--exact", test, "--nocapture"])
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
        .collect()
}

/// Whether this process is a child that `in_child` started.
#[allow(dead_code)]
pub fn is_child() -> bool {
    std::env::var_os("OXCCL_TEST_CHILD").is_some()
}

/// Runs this binary's test `test` again in a child process on the host executor with `env`
/// added (the library reads its parameters once per process), and asserts that it passed; its
/// output (stdout, then stderr).
#[allow(dead_code)]
pub fn in_child(test: &str, env: &[(&str, &str)]) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env("OXCCL_TEST_CHILD", "1")
        .env("OXCCL_DEVICE", "host")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{test} with {env:?} failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "{test} with {env:?} ran nothing:\n{text}"
    );
    text
}

/// A float32 sum all-reduce of `send` into `recv`.
#[allow(dead_code)]
pub fn all_reduce_f32(send: &[f32], recv: &mut [f32]) -> nccl::api::CollArgs {
    all_reduce_f32_at(
        send.as_ptr() as usize,
        recv.as_mut_ptr() as usize,
        send.len(),
    )
}

/// A float32 sum all-reduce of `count` elements at address `send` into `recv` (buffers the
/// test does not hold as slices: device memory, a stand-in's, a peer's).
#[allow(dead_code)]
pub fn all_reduce_f32_at(send: usize, recv: usize, count: usize) -> nccl::api::CollArgs {
    nccl::api::CollArgs {
        kind: nccl::types::CollKind::AllReduce,
        send,
        recv,
        count,
        dtype: nccl::types::DataType::Float32,
        op: nccl::types::OP_SUM,
        root: 0,
    }
}

/// Runs `f` on a thread of its own and fails the test when it has not returned within `secs`
/// (a hang is a failure with a message, not a test run that never ends); `f`'s panic is the
/// test's.
#[allow(dead_code)]
pub fn within<T: Send + 'static>(
    secs: u64,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    use std::sync::mpsc::RecvTimeoutError;
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(v) => {
            let _ = h.join();
            v
        }
        Err(RecvTimeoutError::Timeout) => panic!("{what}: still running after {secs} s"),
        Err(RecvTimeoutError::Disconnected) => match h.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => unreachable!("the thread sent its result"),
        },
    }
}

/// oxccl's socket transport built as a net plugin (`net-plugin/`, name `oxsocket`), beside
/// the test binaries' profile folder; a test that needs it fails when it was not built.
#[allow(dead_code)]
pub fn oxccl_net_plugin() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let plugin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .join("libnccl_net_oxccl.so");
    assert!(
        plugin.exists(),
        "{} is missing: cargo build --release --workspace --lib builds it",
        plugin.display()
    );
    plugin
}

/// A TCP port free on this machine now (for MASTER_PORT; another socket may take it before the
/// rank binds it, which callers that can should retry).
#[allow(dead_code)]
pub fn free_port() -> u16 {
    // Below the kernel's ephemeral range: a port from that range, free when looked at, may be
    // taken as the source port of another test's connection before the program under test binds
    // it (tp_pp_example failed once so: "rank 0 cannot listen on port 36371").
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    if low > 11000 {
        use std::hash::{BuildHasher, Hasher};
        let span = low - 10000;
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let start = h.finish() as u32;
        for i in 0..200 {
            let port = (10000 + (start.wrapping_add(i * 7919)) % span) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs a compiler command; a failure panics with the command and what the compiler said.
#[allow(dead_code)]
pub fn compile(cmd: &mut std::process::Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", cmd.get_program()));
    assert!(
        out.status.success(),
        "compiling {what} failed ({:?}):\n{}{}",
        cmd,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The mock CUDA driver: a directory holding `libcuda.so.1` built from
/// ffi-tests/mock-cuda/mock_cuda.c (put it on LD_LIBRARY_PATH), next to this test binary's
/// `target/<profile>/`.
#[allow(dead_code)]
pub fn mock_cuda_dir() -> &'static std::path::Path {
    use std::path::PathBuf;
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("current_exe");
        let deps = exe.parent().expect("test binary has a parent directory");
        let dir = deps
            .parent()
            .unwrap_or(deps)
            .join("ffi-tests")
            .join("mock-cuda");
        std::fs::create_dir_all(&dir).expect("create ffi-tests/mock-cuda");
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ffi-tests/mock-cuda/mock_cuda.c");
        // Built under a temporary name and renamed: test binaries run at once may both build it.
        let tmp = dir.join(format!("libcuda.so.1.{}", std::process::id()));
        let cc = std::env::var("CC").unwrap_or_else(|_| "gcc".into());
        let mut cmd = std::process::Command::new(&cc);
        cmd.args([
            "-std=c11",
            "-D_GNU_SOURCE",
            "-O2",
            "-g",
            "-Wall",
            "-Wextra",
            "-Werror",
        ])
        .args(["-shared", "-fPIC"])
        .arg(&src)
        .arg("-o")
        .arg(&tmp)
        .args(["-ldl", "-lm"]);
        compile(&mut cmd, "the mock libcuda");
        std::fs::rename(&tmp, dir.join("libcuda.so.1")).expect("rename the mock libcuda");
        dir
    })
}

/// The library's files in /dev/shm now, sorted (a test compares them before and after).
#[allow(dead_code)]
pub fn shm_files() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("oxccl-"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
