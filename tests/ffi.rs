//! C and C++ programs that use the library only through `nccl.h` and `-lnccl` (ffi-tests/),
//! built with gcc/g++ `-Wall -Wextra -Werror` against the freshly built `libnccl.so` and run with
//! `OXCCL_DEVICE=host`, each under a timeout.
//!
//! The GPU programs (`coll_matrix cuda`, `cuda_ranks`, `cuda_graph`, `cuda_peer_death`: the CUDA driver loaded with
//! dlopen) are run here on a mock `libcuda.so.1` (ffi-tests/mock-cuda: "device" memory is host
//! memory, streams are host streams) to test their own logic, and must fail cleanly (exit 3, a
//! message) where there is no driver. The executables land in `target/<profile>/ffi-tests/bin/`,
//! from where `scripts/gpu-check.sh --prepare` packs them: the `ex_single` test it runs builds
//! every program.
//!
//! The header is the repository's `include/nccl.h` when it exists; until then NCCL's upstream
//! header (`/tmp/up/nvidia/nccl/include`, or `$OXCCL_UPSTREAM_INCLUDE`) with the stand-in CUDA
//! headers of `ffi-tests/cuda-stub`. `OXCCL_FFI_TIMEOUT` (seconds) overrides every timeout.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

mod common;

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `target/<profile>/`: this test binary lives in `target/<profile>/deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("test binary has a parent directory");
    deps.parent().unwrap_or(deps).to_path_buf()
}

/// A directory holding `libnccl.so` and `libnccl.so.2` (the SONAME the programs load), both
/// links to the cdylib cargo built for this test run.
fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let prof = profile_dir();
        let lib = [
            prof.join("libnccl.so"),
            prof.join("deps").join("libnccl.so"),
        ]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no libnccl.so in {} (or deps/)", prof.display()));
        let dir = prof.join("ffi-tests").join("lib");
        std::fs::create_dir_all(&dir).expect("create ffi-tests/lib");
        for name in ["libnccl.so", "libnccl.so.2"] {
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&lib, &link)
                .unwrap_or_else(|e| panic!("symlink {}: {e}", link.display()));
        }
        dir
    })
}

/// `-I` flags: the repository's header when there is one, else upstream's with the CUDA stubs.
fn include_flags() -> Vec<String> {
    let repo_inc = manifest_dir().join("include");
    if repo_inc.join("nccl.h").exists() {
        return vec![format!("-I{}", repo_inc.display())];
    }
    let upstream = std::env::var("OXCCL_UPSTREAM_INCLUDE")
        .unwrap_or_else(|_| "/tmp/up/nvidia/nccl/include".to_string());
    assert!(
        Path::new(&upstream).join("nccl.h").exists(),
        "no include/nccl.h in the repository and no upstream nccl.h in {upstream}"
    );
    vec![
        format!("-I{}", manifest_dir().join("ffi-tests/cuda-stub").display()),
        format!("-I{upstream}"),
    ]
}

/// Compile `ffi-tests/<src>` once per test run; returns the executable.
fn build(src: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let map = BUILT.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = map.get(src) {
        return p.clone();
    }
    let libdir = lib_dir();
    let out_dir = profile_dir().join("ffi-tests").join("bin");
    std::fs::create_dir_all(&out_dir).expect("create ffi-tests/bin");
    let stem = Path::new(src)
        .file_stem()
        .unwrap()
        .to_string_lossy()
        .to_string();
    let exe = out_dir.join(&stem);
    let cpp = src.ends_with(".cpp");
    let compiler = if cpp {
        std::env::var("CXX").unwrap_or_else(|_| "g++".into())
    } else {
        std::env::var("CC").unwrap_or_else(|_| "gcc".into())
    };
    let mut cmd = Command::new(&compiler);
    cmd.arg(if cpp { "-std=c++17" } else { "-std=c11" })
        .args(["-D_GNU_SOURCE", "-O2", "-g", "-Wall", "-Wextra", "-Werror"])
        .arg(format!("-I{}", manifest_dir().join("ffi-tests").display()))
        .args(include_flags())
        .arg(manifest_dir().join("ffi-tests").join(src))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", libdir.display()))
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .args(["-lnccl", "-lm", "-pthread", "-ldl"]);
    common::compile(&mut cmd, src);
    map.insert(src.to_string(), exe.clone());
    exe
}

/// Every program of ffi-tests/ (what gpu-check.sh packs for the GPU machine).
fn build_all() {
    let mut srcs: Vec<String> = std::fs::read_dir(manifest_dir().join("ffi-tests"))
        .expect("read ffi-tests/")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".c") || n.ends_with(".cpp"))
        .collect();
    srcs.sort();
    for src in srcs {
        build(&src);
    }
}

/// leak_check looks at machine-wide /dev/shm and must not see other tests' files: it runs alone.
fn exclusive() -> &'static RwLock<()> {
    static L: RwLock<()> = RwLock::new(());
    &L
}

fn timeout_for(default_s: u64) -> Duration {
    let s = std::env::var("OXCCL_FFI_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_s);
    Duration::from_secs(s)
}

fn tail(s: &str, n: usize) -> &str {
    if s.len() <= n {
        return s;
    }
    let mut i = s.len() - n;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

/// Run a built program with OXCCL_DEVICE=host in its own process group; kill the group and fail
/// on timeout; fail with its output when it exits non-zero.
fn run(src: &str, args: &[&str], timeout_s: u64) {
    run_env(src, args, &[], timeout_s)
}

/// `run` with extra environment variables.
fn run_env(src: &str, args: &[&str], envs: &[(&str, &str)], timeout_s: u64) {
    let mut all = vec![("OXCCL_DEVICE", "host")];
    all.extend_from_slice(envs);
    let o = run_raw(src, args, &all, timeout_s);
    match o.status {
        None => panic!(
            "{}: still running after {:?}, killed\n--- stdout\n{}\n--- stderr\n{}",
            o.what,
            o.timeout,
            tail(&o.stdout, 4000),
            tail(&o.stderr, 8000)
        ),
        Some(st) if !st.success() => panic!(
            "{}: {st}\n--- stdout\n{}\n--- stderr\n{}",
            o.what,
            tail(&o.stdout, 4000),
            tail(&o.stderr, 8000)
        ),
        Some(_) => {
            print!("{} ({:.1}s): {}", o.what, o.elapsed, o.stdout);
            if !o.stderr.is_empty() {
                eprint!("{}", tail(&o.stderr, 4000));
            }
        }
    }
}

/// What a run gave: the exit status (None: killed at the timeout) and the output.
struct Outcome {
    what: String,
    status: Option<std::process::ExitStatus>,
    stdout: String,
    stderr: String,
    elapsed: f64,
    timeout: Duration,
}

/// Run a built program with exactly these extra environment variables (OXCCL_DEVICE only when
/// given) in its own process group; kill the group on timeout.
fn run_raw(src: &str, args: &[&str], envs: &[(&str, &str)], timeout_s: u64) -> Outcome {
    let exe = build(src);
    let timeout = timeout_for(timeout_s);
    let mut child = Command::new(&exe)
        .args(args)
        .env_remove("OXCCL_DEVICE")
        .envs(envs.iter().copied())
        .env_remove("OXCCL_FAULT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", exe.display()));
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let pid = child.id() as i32;
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break Some(st);
        }
        if start.elapsed() > timeout {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Forked ranks may outlive a failed parent: never leave them behind.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let stdout = t_out.join().unwrap_or_default();
    let stderr = t_err.join().unwrap_or_default();
    Outcome {
        what: format!("{} {}", exe.display(), args.join(" ")),
        status,
        stdout,
        stderr,
        elapsed: start.elapsed().as_secs_f64(),
        timeout,
    }
}

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    exclusive().read().unwrap_or_else(|e| e.into_inner())
}

const RANKS: [&str; 5] = ["1", "2", "3", "4", "8"];

#[test]
fn bad_input_error_codes_and_messages() {
    let _g = shared();
    run("bad_input.c", &[], 120);
}

#[test]
fn cpp_smoke_extern_c_and_allreduce() {
    let _g = shared();
    run("cpp_smoke.cpp", &[], 120);
}

#[test]
fn ex_single_process_init_all_and_group() {
    let _g = shared();
    // scripts/gpu-check.sh --prepare runs only this test to build the C programs it packs.
    build_all();
    for n in RANKS {
        run("ex_single_process.c", &[n], 120);
    }
}

#[test]
fn ex_threads_one_thread_per_rank() {
    let _g = shared();
    for n in RANKS {
        run("ex_threads.c", &[n], 120);
    }
}

#[test]
fn ex_processes_one_process_per_rank() {
    let _g = shared();
    for n in RANKS {
        run("ex_processes.c", &[n, "parent", "100"], 120);
        run("ex_processes.c", &[n, "pipe", "100"], 120);
    }
}

#[test]
fn coll_matrix_1_rank() {
    let _g = shared();
    run("coll_matrix.c", &["1"], 300);
}

#[test]
fn coll_matrix_2_ranks() {
    let _g = shared();
    run("coll_matrix.c", &["2"], 300);
}

#[test]
fn coll_matrix_3_ranks() {
    let _g = shared();
    run("coll_matrix.c", &["3"], 300);
}

#[test]
fn coll_matrix_4_ranks() {
    let _g = shared();
    run("coll_matrix.c", &["4"], 300);
}

#[test]
fn coll_matrix_8_ranks() {
    let _g = shared();
    run("coll_matrix.c", &["8"], 600);
}

/// The ring and chain algorithms (the direct ones are the default where buffers are reachable).
#[test]
fn coll_matrix_ring_algorithms() {
    let _g = shared();
    for n in ["2", "3", "4"] {
        run_env("coll_matrix.c", &[n], &[("OXCCL_ALGO", "ring")], 300);
    }
    // FIFO slots always filled with streaming stores (normally a measured choice for large
    // programs).
    run_env(
        "coll_matrix.c",
        &["3"],
        &[("OXCCL_ALGO", "ring"), ("OXCCL_FIFO_STREAM", "1")],
        300,
    );
    // Strictly in order (no run-ahead across iterations).
    run_env(
        "coll_matrix.c",
        &["3"],
        &[("OXCCL_ALGO", "ring"), ("OXCCL_RUN_AHEAD", "0")],
        300,
    );
    // Streaming stores for every out-of-place output (normally only for large ones), on both
    // the ring and the direct algorithms.
    for algo in ["ring", "direct"] {
        run_env(
            "coll_matrix.c",
            &["3"],
            &[("OXCCL_ALGO", algo), ("OXCCL_STREAM_BYTES", "0")],
            300,
        );
    }
    run_env(
        "coll_matrix.c",
        &["8", "big=none"],
        &[("OXCCL_ALGO", "ring")],
        300,
    );
}

#[test]
fn coll_matrix_host_streams() {
    let _g = shared();
    run("coll_matrix.c", &["3", "stream"], 300);
    run("coll_matrix.c", &["8", "stream", "big=none"], 300);
    // Launches on idle streams run inline first (OXCCL_INLINE_US): never (all on the streams'
    // workers), and for 1 us (nearly every batch is handed over half done).
    for us in ["0", "1"] {
        run_env(
            "coll_matrix.c",
            &["4", "stream", "big=none"],
            &[("OXCCL_INLINE_US", us)],
            300,
        );
    }
}

#[test]
fn coll_matrix_mem_alloc() {
    let _g = shared();
    run("coll_matrix.c", &["2", "memalloc", "big=none"], 300);
    run(
        "coll_matrix.c",
        &["4", "stream", "memalloc", "big=none"],
        300,
    );
}

#[test]
fn leak_check_after_destroy() {
    let _g = exclusive().write().unwrap_or_else(|e| e.into_inner());
    run("leak_check.c", &["4"], 120);
    run("leak_check.c", &["2"], 120);
    // Over the network transport: its ends, sockets and helper threads go too.
    run("leak_check.c", &["3", "hosts"], 120);
    run_env(
        "leak_check.c",
        &["2", "hosts"],
        &[("NCCL_SOCKET_NTHREADS", "4")],
        120,
    );
}

/// The GPU programs where there is no CUDA driver: a message and exit code 3, no crash, no hang.
/// (Where there is a driver and a GPU they run for real and must pass.)
#[test]
fn cuda_programs_fail_cleanly_without_a_driver() {
    let _g = shared();
    let empty = profile_dir().join("ffi-tests").join("no-cuda");
    std::fs::create_dir_all(&empty).expect("create ffi-tests/no-cuda");
    let path = empty.display().to_string();
    for (src, args) in [
        ("coll_matrix.c", &["2", "cuda", "big=none"][..]),
        ("cuda_ranks.c", &["2", "threads"][..]),
        ("cuda_ranks.c", &["2", "processes"][..]),
        ("cuda_graph.c", &["2"][..]),
        ("cuda_peer_death.c", &["graph"][..]),
    ] {
        let o = run_raw(src, args, &[("LD_LIBRARY_PATH", &path)], 120);
        let code = o.status.and_then(|s| s.code());
        match code {
            Some(0) => print!("{} ran on a GPU: {}", o.what, o.stdout),
            Some(3) => {
                assert!(
                    o.stderr.contains("CUDA"),
                    "{}: exit 3 without a message about CUDA:\n{}",
                    o.what,
                    o.stderr
                );
                println!("{}: {}", o.what, o.stderr.lines().last().unwrap_or(""));
            }
            _ => panic!(
                "{}: {:?} (want exit 3 without a driver, 0 with a GPU)\n--- stdout\n{}\n--- stderr\n{}",
                o.what,
                o.status,
                tail(&o.stdout, 4000),
                tail(&o.stderr, 8000)
            ),
        }
    }
}

/// The GPU programs' own logic (shadows and copies, device addresses, in-place offsets, guards,
/// ranks as threads and processes) on the mock driver with the host executor.
#[test]
fn cuda_programs_on_a_mock_driver() {
    let _g = shared();
    let mock = common::mock_cuda_dir().display().to_string();
    let env = [("LD_LIBRARY_PATH", mock.as_str())];
    for n in ["1", "2", "3", "4"] {
        run_env("coll_matrix.c", &[n, "cuda", "big=none"], &env, 300);
        run_env("cuda_ranks.c", &[n, "threads"], &env, 120);
        run_env("cuda_ranks.c", &[n, "processes", "inplace"], &env, 120);
        run_env("cuda_graph.c", &[n, "nograph"], &env, 120);
    }
    run_env("coll_matrix.c", &["3", "cuda"], &env, 300);
    run_env(
        "coll_matrix.c",
        &["2", "cuda", "memalloc", "big=none"],
        &env,
        300,
    );
    run_env(
        "cuda_ranks.c",
        &["3", "threads", "inplace", "grouped", "mixed"],
        &env,
        120,
    );
    run_env(
        "cuda_ranks.c",
        &["2", "processes", "grouped", "mixed"],
        &env,
        120,
    );
    // A peer that dies while rank 0's all-reduce waits for it: an error naming it, no hang.
    run_env("cuda_peer_death.c", &["eager"], &env, 120);
}
