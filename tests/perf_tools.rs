//! The nccl-tests-compatible perf tools (nccl-tests-compat/) against the libnccl.so that cargo
//! built: build them with make, run short sweeps on the host executor and check every row of
//! their output table for wrong elements.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

const TOOLS: [&str; 10] = [
    "all_reduce_perf",
    "all_gather_perf",
    "broadcast_perf",
    "reduce_perf",
    "reduce_scatter_perf",
    "alltoall_perf",
    "gather_perf",
    "scatter_perf",
    "sendrecv_perf",
    "hypercube_perf",
];

struct Built {
    bin: PathBuf,
    lib: PathBuf,
}

/// target/debug (or whichever profile dir holds this test binary and libnccl.so).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("profile dir").to_path_buf()
}

fn built() -> &'static Built {
    static B: OnceLock<Built> = OnceLock::new();
    B.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        // OXCCL_PERF_NCCL_LIB: test another libnccl.so directory instead of cargo's own.
        let prof = std::env::var_os("OXCCL_PERF_NCCL_LIB").map_or_else(profile_dir, PathBuf::from);
        let so = prof.join("libnccl.so");
        assert!(
            so.exists(),
            "{} missing: cargo should have built the cdylib",
            so.display()
        );
        // The tools need libnccl.so.2 (the SONAME) at run time: give them a directory with it.
        let out = profile_dir().join("nccl-tests");
        let lib = out.join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        let link = lib.join("libnccl.so.2");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&so, &link).unwrap();
        let st = Command::new("make")
            .arg("-C")
            .arg(root.join("nccl-tests-compat"))
            .arg(format!("NCCL_LIB={}", prof.display()))
            .arg(format!("BUILDDIR={}", out.display()))
            .status()
            .expect("make");
        assert!(st.success(), "building the perf tools failed");
        Built { bin: out, lib }
    })
}

fn tool(name: &str) -> Command {
    let b = built();
    let mut c = Command::new(b.bin.join(name));
    c.env("LD_LIBRARY_PATH", &b.lib)
        .env("OXCCL_DEVICE", "host")
        .env_remove("OXCCL_FAULT")
        .env_remove("NCCL_TESTS_MIN_BW")
        .env_remove("WORLD_SIZE")
        .env_remove("OMPI_COMM_WORLD_SIZE");
    c
}

fn run(name: &str, args: &[&str]) -> Output {
    tool(name).args(args).output().expect("spawn perf tool")
}

fn text(o: &Output) -> String {
    format!(
        "{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// One data row of the table: (size, count, type, redop, root, wrong out-of-place, wrong in-place).
#[derive(Debug)]
struct Row {
    size: u64,
    ty: String,
    op: String,
    wrong: [i64; 2],
}

fn rows(stdout: &str) -> Vec<Row> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 13, "malformed row: {l}");
            Row {
                size: f[0].parse().expect("size"),
                ty: f[2].to_string(),
                op: f[3].to_string(),
                wrong: [
                    f[8].parse().expect("#wrong"),
                    f[12].parse().expect("#wrong"),
                ],
            }
        })
        .collect()
}

/// Exit 0, the header lines, `expect_rows` rows, all with #wrong == 0, and the OK footer.
fn assert_clean(o: &Output, expect_rows: usize) -> Vec<Row> {
    let t = text(o);
    assert_eq!(o.status.code(), Some(0), "non-zero exit:\n{t}");
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(out.contains("# nThread "), "no header:\n{t}");
    assert!(out.contains("# Using devices"), "no device list:\n{t}");
    assert!(
        out.contains("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"),
        "no table header:\n{t}"
    );
    assert!(
        out.contains("# Out of bounds values : 0 OK"),
        "bad footer:\n{t}"
    );
    assert!(
        out.contains("# Avg bus bandwidth    : "),
        "no avg busbw:\n{t}"
    );
    let r = rows(&out);
    assert_eq!(r.len(), expect_rows, "row count:\n{t}");
    for row in &r {
        assert_eq!(row.wrong, [0, 0], "wrong elements in {row:?}:\n{t}");
    }
    r
}

#[test]
fn help_and_bad_arguments() {
    let o = run("all_reduce_perf", &["-h"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains("USAGE"));
    let o = run("all_reduce_perf", &["-b", "1M", "-e", "1K"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("minbytes"));
    let o = run("all_reduce_perf", &["-d", "notatype"]);
    assert_eq!(o.status.code(), Some(1));
    let o = run("all_reduce_perf", &["-o", "xor"]);
    assert_eq!(o.status.code(), Some(1));
}

/// Rank 0 of the tools' own out-of-band exchange does not wait forever for processes that never
/// come: within `-T` seconds it ends the run, naming the ranks that did not connect.
#[test]
fn rank_zero_alone_gives_up_naming_the_missing_ranks() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let started = std::time::Instant::now();
    let o = tool("all_reduce_perf")
        .args(["-b", "8", "-e", "8", "-T", "2"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "3")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .output()
        .expect("spawn perf tool");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("0 of 2 processes connected (not yet: 1 2)"),
        "{}",
        text(&o)
    );
    assert!(
        started.elapsed().as_secs() < 30,
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn sweep_every_tool_one_to_four_ranks() {
    // 8, 32, ..., 128K: 8 sizes
    for name in TOOLS {
        for g in 1..=4 {
            let gs = g.to_string();
            let o = run(
                name,
                &[
                    "-b", "8", "-e", "256K", "-f", "4", "-g", &gs, "-n", "3", "-w", "1",
                ],
            );
            if name == "hypercube_perf" && g == 3 {
                assert_eq!(o.status.code(), Some(1), "{}", text(&o));
                assert!(String::from_utf8_lossy(&o.stdout).contains("power-of-two"));
                continue;
            }
            let r = assert_clean(&o, 8);
            assert_eq!(r[0].ty, "float");
            let head = String::from_utf8_lossy(&o.stdout);
            assert!(head.contains(&format!(
                "# nThread 1 nGpus {g} minBytes 8 maxBytes 262144 step: 4(factor)"
            )));
            assert_eq!(head.matches("#  Rank ").count(), g, "device lines");
        }
    }
}

#[test]
fn all_types_and_ops() {
    // 12 types x 6 ops x 3 sizes
    let o = run(
        "all_reduce_perf",
        &[
            "-b", "64", "-e", "256", "-f", "2", "-g", "3", "-d", "all", "-o", "all", "-n", "2",
            "-w", "1",
        ],
    );
    let r = assert_clean(&o, 12 * 6 * 3);
    assert!(r.iter().any(|x| x.ty == "f8e5m2" && x.op == "mulsum"));
    assert!(r.iter().any(|x| x.ty == "bfloat16" && x.op == "avg"));
    let o = run(
        "reduce_scatter_perf",
        &[
            "-b", "96", "-e", "192", "-f", "2", "-g", "2", "-d", "all", "-o", "all", "-n", "2",
            "-w", "1",
        ],
    );
    assert_clean(&o, 12 * 6 * 2);
    // every root
    let o = run(
        "reduce_perf",
        &[
            "-b", "64", "-e", "64", "-g", "3", "-r", "-1", "-o", "all", "-d", "half", "-n", "2",
            "-w", "1",
        ],
    );
    assert_clean(&o, 6 * 3);
    let o = run(
        "broadcast_perf",
        &[
            "-b", "64", "-e", "64", "-g", "4", "-r", "-1", "-d", "all", "-n", "2", "-w", "1",
        ],
    );
    assert_clean(&o, 12 * 4);
    for name in [
        "gather_perf",
        "scatter_perf",
        "alltoall_perf",
        "all_gather_perf",
    ] {
        let o = run(
            name,
            &[
                "-b", "8", "-e", "4K", "-f", "8", "-g", "3", "-r", "2", "-d", "f8e4m3", "-n", "2",
                "-w", "1",
            ],
        );
        // 8, 64, 512, 4096
        assert_clean(&o, 4);
    }
}

#[test]
fn threads_blocking_and_aggregation() {
    let o = run(
        "all_reduce_perf",
        &[
            "-t", "2", "-g", "2", "-b", "8", "-e", "8K", "-f", "4", "-n", "2", "-w", "1",
        ],
    );
    let r = assert_clean(&o, 6);
    assert_eq!(r.last().unwrap().size, 8192);
    let o = run(
        "all_gather_perf",
        &[
            "-t", "3", "-g", "1", "-b", "1K", "-e", "1K", "-z", "1", "-m", "2", "-n", "2",
        ],
    );
    assert_clean(&o, 1);
    let o = run(
        "sendrecv_perf",
        &["-g", "2", "-b", "1K", "-e", "1K", "-y", "1", "-n", "2"],
    );
    assert_clean(&o, 1);
}

/// Runs `name` as 2 processes (env launcher) with `args` and `envs`; returns (rank 0, rank 1).
fn two_processes(name: &str, args: &[&str], envs: &[(&str, &str)]) -> (Output, Output) {
    let mut outs = processes(2, name, args, envs).into_iter();
    (outs.next().unwrap(), outs.next().unwrap())
}

/// Runs `name` as `n` processes (env launcher) with `args` and `envs`; checks that ranks 1.. exit
/// with 0 and returns every rank's output.
fn processes(n: usize, name: &str, args: &[&str], envs: &[(&str, &str)]) -> Vec<Output> {
    processes_placed(n, name, args, envs, &|_| None)
}

/// `processes`, rank r with `OXCCL_HOSTID` set to `host(r)` where that is Some (ranks on
/// different "hosts" of this machine talk over the network).
fn processes_placed(
    n: usize,
    name: &str,
    args: &[&str],
    envs: &[(&str, &str)],
    host: &dyn Fn(usize) -> Option<String>,
) -> Vec<Output> {
    // A port free a moment ago may be taken by the time rank 0 binds it (other tests open
    // sockets all the time): rank 0 then exits at once, and the run is made again on another.
    for _ in 0..3 {
        if let Some(outs) = processes_on_port(n, name, args, envs, host, common::free_port()) {
            return outs;
        }
    }
    panic!("{name}: rank 0 could not listen on 3 free ports in a row");
}

/// `processes_placed` with rank 0 at `port`: None when rank 0 could not listen on it (the
/// other ranks are stopped).
fn processes_on_port(
    n: usize,
    name: &str,
    args: &[&str],
    envs: &[(&str, &str)],
    host: &dyn Fn(usize) -> Option<String>,
    port: u16,
) -> Option<Vec<Output>> {
    let port = port.to_string();
    let mut kids: Vec<_> = (0..n)
        .map(|r| {
            tool(name)
                .args(args)
                .envs(envs.iter().copied())
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .envs(host(r).map(|h| ("OXCCL_HOSTID", h)))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let first = kids.remove(0).wait_with_output().unwrap();
    if String::from_utf8_lossy(&first.stderr).contains("rank 0 cannot listen on port") {
        for mut k in kids {
            let _ = k.kill();
            let _ = k.wait();
        }
        return None;
    }
    let outs: Vec<Output> = std::iter::once(first)
        .chain(kids.into_iter().map(|c| c.wait_with_output().unwrap()))
        .collect();
    for (r, o) in outs.iter().enumerate().skip(1) {
        assert_eq!(o.status.code(), Some(0), "{name} rank {r}:\n{}", text(o));
    }
    Some(outs)
}

/// In place, nccl-tests' sendrecv sends from the buffer it receives into, and alltoall sends
/// and receives in one buffer: with 3 processes in a ring and more data than a connection's
/// FIFO holds (8 slots of 128 KiB), a receive can overtake its send and must not overwrite
/// what is still to be sent.
#[test]
fn three_processes_in_place_p2p() {
    for name in ["sendrecv_perf", "alltoall_perf"] {
        let outs = processes(
            3,
            name,
            &[
                "-b", "3M", "-e", "6M", "-f", "2", "-d", "int32", "-n", "3", "-w", "1",
            ],
            &[],
        );
        assert_clean(&outs[0], 2);
    }
}

#[test]
fn two_processes_via_rank_world_size() {
    for name in ["all_reduce_perf", "sendrecv_perf", "all_gather_perf"] {
        let (o, _) = two_processes(
            name,
            &["-b", "8", "-e", "64K", "-f", "4", "-n", "2", "-w", "1"],
            &[],
        );
        assert_clean(&o, 7);
        assert_eq!(
            String::from_utf8_lossy(&o.stdout)
                .matches("#  Rank ")
                .count(),
            2
        );
    }
}

/// Ordinary (malloc) buffers in two processes, every type and op, in and out of place: eager
/// operations for small sizes, then the ring (default: cross-memory attach is off), and
/// cross-memory attach competing with the ring at every larger size (OXCCL_CMA=1
/// OXCCL_CMA_MIN_BYTES=0).
#[test]
fn two_processes_every_algorithm() {
    let reducing = ["all_reduce_perf", "reduce_perf", "reduce_scatter_perf"];
    for envs in [
        &[][..],
        &[("OXCCL_CMA", "1"), ("OXCCL_CMA_MIN_BYTES", "0")][..],
        // The ring with FIFO slots filled by streaming stores at every size.
        &[("OXCCL_FIFO_STREAM", "1")][..],
    ] {
        for name in reducing
            .iter()
            .chain(&["all_gather_perf", "broadcast_perf"])
        {
            let ops = if reducing.contains(name) { 6 } else { 1 };
            let (o, _) = two_processes(
                name,
                &[
                    "-b", "8", "-e", "512K", "-f", "16", "-d", "all", "-o", "all", "-n", "1", "-w",
                    "1", "-r", "1",
                ],
                envs,
            );
            // sizes 8 B, 128 B, 2 KiB, 32 KiB, 512 KiB x 12 types x ops
            assert_clean(&o, 5 * 12 * ops);
        }
    }
}

#[test]
fn corrupt_fault_is_detected() {
    let o = tool("all_reduce_perf")
        .args([
            "-b", "8", "-e", "1K", "-f", "4", "-g", "2", "-n", "2", "-w", "1",
        ])
        .env("OXCCL_FAULT", "corrupt")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(7), "{}", text(&o));
    let r = rows(&String::from_utf8_lossy(&o.stdout));
    assert_eq!(r.len(), 4, "{}", text(&o));
    assert!(
        r.iter().any(|x| x.wrong[0] > 0 || x.wrong[1] > 0),
        "{}",
        text(&o)
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("FAILED"));
}

/// What the perf tools launched on namespace hosts need (the environment launcher's variables,
/// rank 0 on host 0 at a free port), with `extra` added; and the log file prefix for `what`
/// (`common::netns::take_logs` reads and removes them).
fn ns_launch(
    b: &Built,
    hosts: &common::netns::Hosts,
    world: usize,
    extra: &[(&str, &str)],
    what: &str,
) -> (Vec<(String, String)>, String) {
    let port = common::free_port();
    let mut env: Vec<(String, String)> = [
        ("OXCCL_DEVICE", "host".to_string()),
        ("LD_LIBRARY_PATH", b.lib.display().to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", hosts.ip(0)),
        ("MASTER_PORT", port.to_string()),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_string(), b))
    .collect();
    env.extend(extra.iter().map(|(a, b)| (a.to_string(), b.to_string())));
    let prefix = std::env::temp_dir()
        .join(format!("oxccl-{what}-{}", std::process::id()))
        .display()
        .to_string();
    (env, prefix)
}

/// The perf tools across 2 namespace hosts x 2 ranks under the environment launcher (RANK,
/// WORLD_SIZE, MASTER_ADDR, MASTER_PORT): every row checked (`Out of bounds values : 0 OK`),
/// and the data went over the link between the hosts.
#[test]
fn tools_across_two_namespace_hosts() {
    let Some(mut hosts) = common::netns::Hosts::new(2) else {
        return;
    };
    let b = built();
    for name in ["all_reduce_perf", "all_gather_perf", "sendrecv_perf"] {
        let exe = b.bin.join(name).display().to_string();
        let (env, logs) = ns_launch(b, &hosts, 4, &[("OXCCL_TIMEOUT_S", "60")], name);
        let before = hosts.counters();
        for i in 0..2 {
            let cmds: Vec<String> = (2 * i..2 * i + 2)
                .map(|r| {
                    format!("RANK={r} {exe} -b 8 -e 4M -f 16 -n 3 -w 1 > {logs}.rank{r}.log 2>&1")
                })
                .collect();
            hosts.start(i, &env, &cmds);
        }
        let ok = hosts.wait_for(std::time::Duration::from_secs(120));
        let logs = common::netns::take_logs(&logs, 4);
        assert_eq!(ok, Some(vec![true, true]), "{name}:\n{}", logs.join("\n"));
        assert!(
            logs[0].contains("# Out of bounds values : 0 OK") && logs[0].contains("  524288 "),
            "{name}:\n{}",
            logs[0]
        );
        hosts.assert_moved(&before, 4 << 20, name);
    }
}

/// Two ranks of one machine (same hostname and boot id) that do not share /dev/shm (each
/// mounted its own tmpfs, as containers with private IPC do) cannot share memory: they are
/// told apart as hosts and the all-reduce goes over the network, instead of each rank waiting
/// on a FIFO the other never sees (every row checked; it used to hang).
#[test]
fn ranks_with_private_dev_shm_talk_over_the_network() {
    let Some(mut hosts) = common::netns::Hosts::new(1) else {
        return;
    };
    let b = built();
    let exe = b.bin.join("all_reduce_perf").display().to_string();
    let extra = [("OXCCL_TIMEOUT_S", "20"), ("NCCL_DEBUG", "INFO")];
    let (env, logs) = ns_launch(b, &hosts, 2, &extra, "private-shm");
    let cmds: Vec<String> = (0..2)
        .map(|r| {
            format!(
                "unshare --mount --propagation private sh -c 'mount -t tmpfs tmpfs /dev/shm && \
                 RANK={r} exec {exe} -b 8 -e 1M -f 16 -n 3 -w 1' > {logs}.rank{r}.log 2>&1"
            )
        })
        .collect();
    hosts.start(0, &env, &cmds);
    let ok = hosts.wait_for(std::time::Duration::from_secs(90));
    let logs = common::netns::take_logs(&logs, 2);
    assert_eq!(ok, Some(vec![true]), "{}", logs.join("\n"));
    assert!(
        logs[0].contains("# Out of bounds values : 0 OK") && logs[0].contains("  524288 "),
        "{}",
        logs[0]
    );
    assert!(logs[0].contains("via NET/Socket"), "{}", logs[0]);
}

/// The perf tools across 2 namespace hosts x 2 ranks under OpenMPI's `mpirun` (installed by
/// scripts/setup.sh): mpirun runs on host 0 and starts host 1's ranks through `ip netns exec`
/// (its PMIx server listening on host 0's eth0); the tools take their ranks from mpirun's
/// environment and rank 0's address from MASTER_ADDR/MASTER_PORT (`-x`). Every row checked,
/// and the data went over the hosts' link.
#[test]
fn tools_across_two_namespace_hosts_under_mpirun() {
    if Command::new("mpirun").arg("--version").output().is_err() {
        assert!(
            std::env::var_os("CI").is_none(),
            "mpirun missing: scripts/setup.sh installs openmpi-bin"
        );
        eprintln!("SKIPPED: no mpirun (scripts/setup.sh installs openmpi-bin)");
        return;
    }
    let Some(mut hosts) = common::netns::Hosts::new(2) else {
        return;
    };
    let b = built();
    for name in ["all_reduce_perf", "sendrecv_perf"] {
        let exe = b.bin.join(name).display().to_string();
        let log = std::env::temp_dir().join(format!(
            "oxccl-perf-mpirun-{}-{name}.log",
            std::process::id()
        ));
        let env: Vec<(String, String)> = [
            ("OXCCL_DEVICE", "host".to_string()),
            ("LD_LIBRARY_PATH", b.lib.display().to_string()),
            ("MASTER_ADDR", hosts.ip(0)),
            ("MASTER_PORT", "29571".to_string()),
            ("OXCCL_TIMEOUT_S", "60".to_string()),
            ("PMIX_MCA_ptl_tcp_remote_connections", "1".to_string()),
            ("PMIX_MCA_ptl_tcp_if_include", "eth0".to_string()),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_string(), b))
        .collect();
        let args = "-b 8 -e 4M -f 16 -n 3 -w 1";
        let host1 = format!(
            "ip netns exec {} unshare --uts sh -c 'hostname {}-1 && exec {exe} {args}'",
            hosts.ns(1),
            hosts.ns(1)
        );
        let cmd = format!(
            "mpirun --allow-run-as-root --oversubscribe --mca oob_tcp_if_include eth0 \
             --mca btl self -x OXCCL_DEVICE -x LD_LIBRARY_PATH -x MASTER_ADDR -x MASTER_PORT \
             -x OXCCL_TIMEOUT_S -np 2 {exe} {args} : -np 2 {host1} > {} 2>&1",
            log.display()
        );
        let before = hosts.counters();
        hosts.start(0, &env, &[cmd]);
        let ok = hosts.wait_for(std::time::Duration::from_secs(120));
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        assert_eq!(ok, Some(vec![true]), "{name}:\n{text}");
        assert!(
            text.contains("# Out of bounds values : 0 OK")
                && text.contains("  524288 ")
                && text.contains("Rank  3 Group  0 Pid")
                && text.contains(&format!("on {}-1 ", hosts.ns(1))),
            "{name}:\n{text}"
        );
        hosts.assert_moved(&before, 4 << 20, name);
    }
}

/// A C program whose peer on another host dies mid-transfer gets an error, and is not killed
/// by a signal (a C program does not ignore SIGPIPE): two all_reduce_perf ranks on 2 "hosts"
/// (loopback, `OXCCL_HOSTID`) move 32 MiB all-reduces; rank 1 is killed; rank 0 must exit with
/// the tool's NCCL failure message naming the lost peer. (Whether a write meets the dead
/// socket first is a race: `transport::net::wire::tests` checks the SIGPIPE case itself.)
#[test]
fn a_peer_dying_mid_transfer_is_an_error_in_a_c_program() {
    use std::os::unix::process::ExitStatusExt;
    let port = common::free_port().to_string();
    let start = |r: usize| {
        tool("all_reduce_perf")
            .args([
                "-b", "32M", "-e", "32M", "-n", "100000", "-w", "1", "-c", "0",
            ])
            .env("WORLD_SIZE", "2")
            .env("RANK", r.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("OXCCL_HOSTID", format!("sigpipe-host-{r}"))
            .env("OXCCL_TIMEOUT_S", "30")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let r0 = start(0);
    let mut r1 = start(1);
    // Both are well into their all-reduces by then.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    r1.kill().unwrap();
    let _ = r1.wait();
    let t0 = std::time::Instant::now();
    let o = r0.wait_with_output().unwrap();
    assert_eq!(
        o.status.signal(),
        None,
        "rank 0 was killed by a signal:\n{}",
        text(&o)
    );
    assert!(!o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(
        t.contains("Test NCCL failure") && t.contains("rank 1"),
        "{t}"
    );
    assert!(t0.elapsed() < std::time::Duration::from_secs(20), "{t}");
}

/// A v11+ plugin gets a context per communicator, as from NCCL: a rank whose communicator has
/// connections through the plugin has one, with the communicator's hash as its id (the same on
/// every rank, not 0), and finalizes it when the communicator ends, after every comm made in
/// it closed (the test plugin logs both, warns of comms still open, and fails a listen or
/// connect in any context but a live one).
fn check_contexts(name: &str, outs: &[Output]) {
    let mut ids = Vec::new();
    for (r, o) in outs.iter().enumerate() {
        let t = text(o);
        let made: Vec<&str> = t
            .lines()
            .filter_map(|l| l.split("testnet context for comm ").nth(1))
            .filter(|id| !id.ends_with("finalized") && *id != "0")
            .collect();
        assert!(
            !t.contains("comm(s) open"),
            "{name} rank {r}: a context finalized before what was made in it closed:\n{t}"
        );
        let crosses = t.contains("via NET/testnet/0");
        assert!(
            made.len() == usize::from(crosses) || (!crosses && made.len() == 1),
            "{name} rank {r}: one context for its communicator:\n{t}"
        );
        for id in made {
            assert!(
                t.contains(&format!("testnet context for comm {id} finalized")),
                "{name} rank {r}: context {id} not finalized:\n{t}"
            );
            ids.push(id.to_string());
        }
    }
    assert!(
        ids.len() >= 2,
        "{name}: contexts on the ranks that cross hosts: {ids:?}"
    );
    assert!(
        ids.iter().all(|i| *i == ids[0]),
        "{name}: one id on every rank: {ids:?}"
    );
}

/// The test net plugin (tests/net_plugin/testnet.c) built for ABI version `v`.
fn testnet_plugin(v: u32) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/net_plugin/testnet.c");
    let so = profile_dir().join(format!("testnet-plugins/libnccl-net-testnet{v}.so"));
    std::fs::create_dir_all(so.parent().unwrap()).unwrap();
    let st = Command::new("cc")
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC"])
        .arg(format!("-DNET_V={v}"))
        .arg("-o")
        .arg(&so)
        .arg(&src)
        .status()
        .expect("cc");
    assert!(st.success(), "building the test net plugin v{v} failed");
    so
}

/// Every collective and Send/Recv through the net plugin path: the perf tools on 2 "hosts" x 2
/// ranks (loopback, OXCCL_HOSTID), NCCL_NET_PLUGIN pointing at oxccl's socket transport built
/// as a plugin (net-plugin/, ABI v8, connections named NET/oxsocket), then at a TCP plugin in
/// C built for ABI v8 and v12 (NET/testnet); every row checked, and at v11+ the contexts per
/// communicator. Three of the tools with a plugin that refuses every third post; then
/// all_reduce at every ABI version v6 .. v12.
#[test]
fn every_collective_through_a_net_plugin() {
    let hosts = |r: usize| Some(format!("plugin-host-{}", r / 2));
    let check_plugin = |plugin: &str, name: &str, v: u32, outs: &[Output]| {
        let t = text(&outs[0]);
        assert_eq!(outs[0].status.code(), Some(0), "{name} v{v}:\n{t}");
        assert!(
            t.contains("# Out of bounds values : 0 OK"),
            "{name} v{v}:\n{t}"
        );
        // The ranks whose connections cross the hosts say so (a sending end's line).
        let all: String = outs.iter().map(text).collect();
        assert!(
            all.contains(&format!("via NET/{plugin}/0")),
            "{name} v{v}:\n{all}"
        );
        assert!(!all.contains("via NET/Socket"), "{name} v{v}:\n{all}");
        assert!(
            t.contains(&format!("loaded net plugin '{plugin}' (ncclNet_v{v})")),
            "{name} v{v}:\n{t}"
        );
        // The plugin's own log line, its format's arguments filled in.
        let hello = match plugin {
            "testnet" => format!("NET/Plugin: testnet plugin initialised (ABI v{v}, TCP)"),
            _ => "NET/Plugin: oxccl socket net plugin initialised".to_string(),
        };
        assert!(t.contains(&hello), "{name} v{v}: no '{hello}' in\n{t}");
    };
    let check = |name: &str, v: u32, outs: &[Output]| check_plugin("testnet", name, v, outs);
    // oxccl's own socket transport as a plugin (net-plugin/, built with the library).
    let ours = common::oxccl_net_plugin();
    let envs = [
        ("NCCL_NET_PLUGIN", ours.to_str().unwrap()),
        ("NCCL_DEBUG", "INFO"),
        ("OXCCL_TIMEOUT_S", "60"),
    ];
    for name in TOOLS {
        let outs = processes_placed(4, name, &["-b", "8", "-e", "1M", "-f", "32"], &envs, &hosts);
        check_plugin("oxsocket", name, 8, &outs);
    }
    let v8 = testnet_plugin(8);
    for (v, so) in [(8, v8.clone()), (12, testnet_plugin(12))] {
        let so = so.to_str().unwrap();
        let envs = [
            ("NCCL_NET_PLUGIN", so),
            ("NCCL_DEBUG", "INFO"),
            ("OXCCL_TIMEOUT_S", "60"),
        ];
        for name in TOOLS {
            let outs =
                processes_placed(4, name, &["-b", "8", "-e", "1M", "-f", "32"], &envs, &hosts);
            check(name, v, &outs);
            if v >= 11 {
                check_contexts(name, &outs);
            }
        }
    }
    // A plugin that sometimes refuses a post (NULL request: call again later).
    let so = v8.to_str().unwrap();
    let envs = [
        ("NCCL_NET_PLUGIN", so),
        ("NCCL_DEBUG", "INFO"),
        ("OXCCL_TIMEOUT_S", "60"),
        ("OXCCL_TEST_NET_BUSY", "1"),
    ];
    for name in ["all_reduce_perf", "alltoall_perf", "sendrecv_perf"] {
        let outs = processes_placed(4, name, &["-b", "8", "-e", "4M", "-f", "8"], &envs, &hosts);
        check(name, 8, &outs);
    }
    for v in [6, 7, 9, 10, 11] {
        let so = testnet_plugin(v);
        let so = so.to_str().unwrap();
        let envs = [
            ("NCCL_NET_PLUGIN", so),
            ("NCCL_DEBUG", "INFO"),
            ("OXCCL_TIMEOUT_S", "60"),
        ];
        let outs = processes_placed(
            4,
            "all_reduce_perf",
            &["-b", "8", "-e", "1M", "-f", "32"],
            &envs,
            &hosts,
        );
        check("all_reduce_perf", v, &outs);
        if v >= 11 {
            check_contexts("all_reduce_perf", &outs);
        }
    }
}
