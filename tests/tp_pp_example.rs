//! The tensor- and pipeline-parallel MLP example (examples/tp_pp_mlp.cpp) against this build:
//! 8 ranks on one host (TP=4, PP=2) in both splits, under the environment launcher and under
//! mpirun, and 2 namespace hosts x 4 ranks with the tensor-parallel groups inside the hosts
//! and, on purpose, across them; its device engine (`--device cuda`) on the mock CUDA driver.
//! Rank 0 checks the result against the unsplit MLP (exactly, with --exact).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

mod common;

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// The example, built with make against cargo's libnccl.so.
fn example() -> &'static Path {
    static B: OnceLock<PathBuf> = OnceLock::new();
    B.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let prof = profile_dir();
        assert!(
            prof.join("libnccl.so").exists(),
            "cargo should have built the cdylib"
        );
        let out = prof.join("examples-build");
        let st = Command::new("make")
            .arg("-s")
            .arg("-C")
            .arg(root.join("examples"))
            .arg(format!("LIBDIR={}", prof.display()))
            .arg(format!("BUILD={}", out.display()))
            .status()
            .expect("make");
        assert!(st.success(), "building the example failed");
        out.join("tp_pp_mlp")
    })
}

/// Runs `n` ranks on this host with more environment; rank 0's output.
fn run_here_with(n: usize, args: &[&str], env: &[(&str, &str)]) -> String {
    let port = common::free_port().to_string();
    let kids: Vec<_> = (0..n)
        .map(|r| {
            Command::new(example())
                .args(args)
                .envs(env.iter().copied())
                .env("OXCCL_DEVICE", "host")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut out0 = String::new();
    for (r, k) in kids.into_iter().enumerate() {
        let o = k.wait_with_output().unwrap();
        let text =
            String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{args:?}: rank {r} failed:\n{text}");
        if r == 0 {
            out0 = text;
        }
    }
    out0
}

fn passed(out: &str) -> bool {
    out.lines()
        .last()
        .is_some_and(|l| l.starts_with("tp_pp_mlp: max |diff| = ") && l.ends_with(": PASS"))
}

/// The one-host runs: TP=4 x PP=2 in both splits, exact and not, and TP=2 x PP=4 with the
/// groups interleaved; 8 ranks each, with `extra` arguments and environment.
fn one_host_cases(extra: &[&str], env: &[(&str, &str)]) {
    for case in [
        "--tp 4 --pp 2 --exact",
        "--tp 4 --pp 2 --hidden 96 --layers 4",
        "--tp 4 --pp 2 --exact --split rows-first",
        "--tp 2 --pp 4 --layers 4 --exact --split rows-first --tp-across-hosts",
    ] {
        let args: Vec<&str> = case.split(' ').chain(extra.iter().copied()).collect();
        let out = run_here_with(8, &args, env);
        assert!(passed(&out), "{args:?}:\n{out}");
        assert!(
            !args.contains(&"--exact") || out.contains("max |diff| = 0 "),
            "{args:?}:\n{out}"
        );
    }
}

#[test]
fn tp4_pp2_on_one_host() {
    one_host_cases(&[], &[]);
}

/// 2 namespace hosts x 4 ranks: TP groups inside the hosts (pipeline across, over the network),
/// then across the hosts; both exact. The README's timing table comes from this run's output.
#[test]
fn tp4_pp2_on_two_namespace_hosts() {
    let Some(mut hosts) = common::netns::Hosts::new(2) else {
        return;
    };
    let exe = example().display().to_string();
    for extra in ["", "--tp-across-hosts"] {
        let port = common::free_port();
        let tag = format!("{}-{}", std::process::id(), extra.len());
        let log = |r: usize| std::env::temp_dir().join(format!("oxccl-tppp-{tag}-{r}.log"));
        let env: Vec<(String, String)> = [
            ("OXCCL_DEVICE", "host".to_string()),
            ("WORLD_SIZE", "8".to_string()),
            ("MASTER_ADDR", hosts.ip(0)),
            ("MASTER_PORT", port.to_string()),
            ("OXCCL_TIMEOUT_S", "60".to_string()),
            ("NCCL_DEBUG", "INFO".to_string()),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_string(), b))
        .collect();
        let before = hosts.counters();
        for i in 0..2 {
            let cmds: Vec<String> = (4 * i..4 * i + 4)
                .map(|r| {
                    format!(
                        "RANK={r} {exe} --tp 4 --pp 2 --exact --microbatches 8 {extra} > {} 2>&1",
                        log(r).display()
                    )
                })
                .collect();
            hosts.start(i, &env, &cmds);
        }
        let ok = hosts.wait_for(std::time::Duration::from_secs(120));
        let logs: Vec<String> = (0..8)
            .map(|r| {
                let t = std::fs::read_to_string(log(r)).unwrap_or_default();
                let _ = std::fs::remove_file(log(r));
                t
            })
            .collect();
        assert_eq!(ok, Some(vec![true, true]), "{extra}:\n{}", logs.join("\n"));
        assert!(passed(&logs[0]), "{extra}:\n{}", logs[0]);
        assert!(logs[0].contains("max |diff| = 0 "), "{}", logs[0]);
        // NCCL_DEBUG=INFO says which transport each connection uses (on its sending end):
        // inside hosts rank 0 sends to its pipeline peer (rank 4, the other host) over the
        // network and around its tensor-parallel ring over shared memory; across hosts, its
        // tensor-parallel ring crosses to the other host somewhere.
        assert!(logs[0].contains("nNodes 2"), "{}", logs[0]);
        if extra.is_empty() {
            assert!(logs[0].contains("-> 1[0] via NET/Socket/0"), "{}", logs[0]);
            assert!(logs[0].contains("via SHM/direct/direct"), "{}", logs[0]);
        } else {
            assert!(
                logs.iter().any(|l| l.contains("via NET/Socket/0")),
                "{}",
                logs.concat()
            );
        }
        hosts.assert_moved(&before, 10_000, extra);
        let lines: Vec<&str> = logs
            .iter()
            .flat_map(|l| l.lines())
            .filter(|l| l.starts_with("rank ") || l.starts_with("tp_pp_mlp"))
            .collect();
        eprintln!("2 hosts x 4 ranks {extra}:\n{}", lines.join("\n"));
    }
}

/// The device engine (`--device cuda`: examples/cuda_engine.h) on the mock CUDA driver: its
/// kernels compiled for sm_90 by the real NVRTC (from PyPI, scripts/setup.sh), their arithmetic
/// done by the mock on the host, the collectives on oxccl's host executor with the engine's
/// stream. What this checks is the example's device path (buffers, slices, stream order); the
/// kernels themselves run only in the GPU check (scripts/gpu-check.sh).
#[test]
fn device_engine_on_a_mock_driver() {
    let nvrtc = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/cuda-wheels/nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
    let nvrtc = match std::env::var("OXCCL_NVRTC") {
        Ok(p) => PathBuf::from(p),
        Err(_) if nvrtc.exists() => nvrtc,
        Err(_) => {
            eprintln!("SKIP: no NVRTC (scripts/setup.sh installs it into target/cuda-wheels)");
            return;
        }
    };
    let mock = common::mock_cuda_dir().display().to_string();
    let env = [
        ("LD_LIBRARY_PATH", mock.as_str()),
        ("OXCCL_NVRTC", nvrtc.to_str().unwrap()),
    ];
    one_host_cases(&["--device", "cuda"], &env);
    // A device newer than this NVRTC knows: the kernels go as PTX for an older architecture.
    let mut newer = env.to_vec();
    newer.push(("OXCCL_MOCK_CC", "129"));
    let out = run_here_with(
        8,
        &["--tp", "4", "--pp", "2", "--exact", "--device", "cuda"],
        &newer,
    );
    // (stdout, where PASS is the last line, then stderr, where the note is)
    assert!(
        out.contains("max |diff| = 0 (tolerance 0): PASS\n"),
        "{out}"
    );
    assert!(out.contains("kernels as PTX for compute_90"), "{out}");
}

/// Without a CUDA driver, `--device cuda` says so and exits with 3.
#[test]
fn device_engine_without_a_driver() {
    let o = Command::new(example())
        .args(["--device", "cuda"])
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .env("OXCCL_DEVICE", "host")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    if Path::new("/dev/nvidiactl").exists() {
        return; // a real driver may be on the loader's default path
    }
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("--device cuda: no CUDA driver"), "{err}");
}

/// Under OpenMPI's mpirun (scripts/setup.sh installs it), 8 ranks on this host: the ranks come
/// from mpirun's environment and, without MASTER_ADDR/MASTER_PORT, rank 0 publishes its port in
/// a file named by the job.
#[test]
fn tp4_pp2_under_mpirun() {
    if Command::new("mpirun").arg("--version").output().is_err() {
        eprintln!("SKIP: no mpirun (scripts/setup.sh installs OpenMPI)");
        return;
    }
    let o = Command::new("timeout")
        .args([
            "-k",
            "5",
            "120",
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
        ])
        .args(["-np", "8", "-x", "OXCCL_DEVICE=host"])
        .arg(example())
        .args(["--tp", "4", "--pp", "2", "--exact"])
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("tp_pp_mlp: max |diff| = 0 (tolerance 0): PASS"),
        "{out}"
    );
    assert_eq!(out.matches(" per micro-batch").count(), 8, "{out}");
}
