//! Ranks in processes of their own on the emulated device of `tests/cuda_emulated.rs` (each
//! runs the test function again, told so by `OXEMU_RANK`): on one device or two, on one
//! "host" or several, over shared host memory, CUDA IPC or the network; and peers that fail
//! the others (a death, a late peer) or leave once done.

use super::*;

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} unset"))
}

/// The timeout the troubled runs set (`OXCCL_TIMEOUT_S`).
fn timeout() -> Duration {
    nccl::param::timeout().expect("OXCCL_TIMEOUT_S is set for a troubled run")
}

/// The communicator's id the parent gave (`OXEMU_ID`, in hex).
fn unique_id() -> [u8; nccl::api::UNIQUE_ID_BYTES] {
    let hex = var("OXEMU_ID");
    let mut id = [0u8; nccl::api::UNIQUE_ID_BYTES];
    for (k, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * k..2 * k + 2], 16).unwrap();
    }
    id
}

/// Several ranks in one process (`OXEMU_RANK` "0,1"), on the one device: made in one group,
/// and each case's calls of all of them in one group on one stream, so that each stage of
/// theirs is one launch; every output checked.
pub fn ranks_process(ranks: &[usize]) {
    let n: usize = var("OXEMU_NRANKS").parse().unwrap();
    let id = unique_id();
    let cache = start(Path::new(&var("OXEMU_LIB")));
    nccl::api::group_start().unwrap();
    let comms: Vec<_> = ranks
        .iter()
        .map(|&r| nccl::api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap())
        .collect();
    nccl::api::group_end().expect("ranks of one process made in one group");
    let comm = &comms[0];
    println!("comm hash {:016x}", comm.comm_hash().unwrap());
    println!("hosts {}", nccl::api::comm_lsa(comm).unwrap().4);
    println!("channels {}", comm.core().unwrap().exec.channels());
    run_cases(&comms, ranks, n, &format!("ranks {ranks:?} in one process"));
    println!("{}", conn_segments(comm.comm_hash().unwrap()));
    for comm in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(comm)).unwrap();
    }
    println!(
        "ranks {ranks:?}: IPC handles opened: {}",
        IPC_OPENED.load(Ordering::SeqCst)
    );
    no_faults();
    let _ = std::fs::remove_dir_all(&cache);
}

/// Asserts that no kernel of this process would have faulted on a GPU (`device::ILLEGAL`).
fn no_faults() {
    let illegal = device::ILLEGAL.lock().clone();
    assert!(
        illegal.is_empty(),
        "what a GPU would have faulted on: {illegal:?}"
    );
}

/// "connection segments: N, largest B bytes": the shared-memory segments of communicator
/// `hash`'s connections that this process maps (`/proc/self/maps`; they are unlinked once both
/// ends have them).
fn conn_segments(hash: u64) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let prefix = format!(
        "/dev/shm/{}",
        nccl::transport::conn_name(hash, 0, 0, nccl::transport::Class::Ring)
    );
    // (The name without its ranks and class: "oxccl-<hash>-".)
    let prefix = &prefix[..prefix.len() - "0-0-0".len()];
    let sizes: Vec<u64> = maps
        .lines()
        .filter(|l| l.contains(prefix))
        .map(|l| {
            let (a, b) = l
                .split_whitespace()
                .next()
                .unwrap()
                .split_once('-')
                .unwrap();
            u64::from_str_radix(b, 16).unwrap() - u64::from_str_radix(a, 16).unwrap()
        })
        .collect();
    format!(
        "connection segments: {}, largest {} bytes",
        sizes.len(),
        sizes.iter().max().unwrap_or(&0)
    )
}

/// Every case of `n` ranks for this process's ranks `ranks` (their communicators `comms`), on
/// one stream (several ranks: their calls in one group); every output checked.
fn run_cases(comms: &[Arc<nccl::comm::Comm>], ranks: &[usize], n: usize, how: &str) {
    let stream = new_stream();
    for c in cases(n, &[300_001, 1001]) {
        let (ns, nr) = sizes(&c, n);
        let bufs: Vec<(usize, usize)> = ranks
            .iter()
            .map(|&r| {
                let s = buffer(ns.max(nr) * c.dtype.size());
                let b = (
                    s,
                    if c.in_place {
                        in_place_output(&c, r, s)
                    } else {
                        buffer(nr * c.dtype.size())
                    },
                );
                fill(&c, n, r, b, 0);
                b
            })
            .collect();
        let grouped = comms.len() > 1;
        if grouped {
            nccl::api::group_start().unwrap();
        }
        for (comm, &b) in comms.iter().zip(&bufs) {
            enqueue(comm, &c, n, b, stream);
        }
        if grouped {
            nccl::api::group_end().unwrap();
        }
        // (The other processes hold a rank each, on a stream of its own.)
        let what = format!("{}, {how}", describe(&c, n, n + 1 - comms.len()));
        sync_all(&[stream], &what);
        no_async_error(comms, &what);
        for (&r, b) in ranks.iter().zip(&bufs) {
            verify_rank(&c, n, r, b.1, 0, &what);
        }
        release_buffers();
    }
}

/// A rank in a process of its own (`OXEMU_RANK`; the parent's `processes` starts it): every
/// case on its own stream, its own output checked.
pub fn rank_process(r: usize) {
    let n: usize = var("OXEMU_NRANKS").parse().unwrap();
    let id = unique_id();
    let cache = start(Path::new(&var("OXEMU_LIB")));
    if std::env::var("OXEMU_PEERS").is_ok() {
        // Rank r on device r % 2 (the current context's, as ncclCommInitRank takes it).
        let api = driver::api().unwrap();
        // SAFETY: the stand-in's context of that device.
        unsafe { (api.ctx_set_current)(peers::ctx_of(r as i32 % 2) as _) };
    }
    let comm = nccl::api::comm_init_rank(n as i32, &id, r as i32, Default::default())
        .expect("a rank in a process");
    println!("comm hash {:016x}", comm.comm_hash().unwrap());
    // The hosts the communicator sees (ranks on different ones talk only over the network).
    println!("hosts {}", nccl::api::comm_lsa(&comm).unwrap().4);
    // The rings a large ring collective is split across (rank 0's OXCCL_CUDA_CHANNELS, fewer
    // from 8 ranks).
    println!("channels {}", comm.core().unwrap().exec.channels());
    if let Ok(how) = std::env::var("OXEMU_TROUBLE") {
        return trouble(&how, comm, r, n, new_stream(), &cache);
    }
    run_cases(std::slice::from_ref(&comm), &[r], n, "a process per rank");
    println!("{}", conn_segments(comm.comm_hash().unwrap()));
    nccl::api::comm_destroy(nccl::api::comm_handle(&comm)).unwrap();
    println!(
        "rank {r}: IPC handles opened: {}",
        IPC_OPENED.load(Ordering::SeqCst)
    );
    no_faults();
    let _ = std::fs::remove_dir_all(&cache);
}

/// A peer process that fails the others: every rank runs an all-reduce (the connections
/// made), then the last rank, with `how` "death", kills itself, or, with "late", stays away
/// (for the communicators' timeout and 5 s more, then leaves); the others launch another
/// all-reduce, whose kernel waits for it, and must see an error on the communicator and their
/// stream drain, within the bounds, then say so. With "graph-" before `how`, the all-reduce is
/// captured once and both runs are replays of the graph (which the library does not see
/// launched: only the kernels can tell it they wait).
pub fn trouble(
    how: &str,
    comm: Arc<nccl::comm::Comm>,
    r: usize,
    n: usize,
    stream: usize,
    cache: &Path,
) {
    let _ = std::fs::remove_dir_all(cache);
    let how = how.trim_start_matches("pidns-");
    if how == "finish" {
        return finish(comm, r, n, stream);
    }
    if how == "graph-finish" {
        return graph_finish(comm, r, stream);
    }
    if how == "registered" {
        return registered(comm, r, n, stream);
    }
    let c = cases(n, &[300_001])[0];
    let b = buffers(&c, n)[r];
    fill(&c, n, r, b, 0);
    let graph = how.strip_prefix("graph-").map(|_| {
        begin_capture(stream);
        enqueue(&comm, &c, n, b, stream);
        end_capture(stream)
    });
    let how = how.trim_start_matches("graph-");
    let run = || match &graph {
        Some(g) => replay(&[(stream, g.clone())]),
        None => enqueue(&comm, &c, n, b, stream),
    };
    run();
    sync_all(&[stream], "before the trouble");
    verify_rank(&c, n, r, b.1, 0, "before the trouble");
    if r == n - 1 {
        if how == "death" {
            // SAFETY: ends this process.
            unsafe { nix::libc::kill(nix::libc::getpid(), nix::libc::SIGKILL) };
        }
        std::thread::sleep(timeout() + Duration::from_secs(5));
        let _ = nccl::api::comm_abort(nccl::api::comm_handle(&comm));
        println!("stayed away");
        return;
    }
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    run();
    let code = async_error(&comm);
    assert_ne!(
        code,
        nccl::error::Code::Success,
        "rank {r}: the failed peer went unseen"
    );
    // A death is seen as one (not only as the stall that `OXCCL_TIMEOUT_S` would also end);
    // a late peer by the stall timeout, not by its leaving (at the timeout and 5 s more).
    let want = match how {
        "death" => nccl::error::Code::RemoteError,
        _ => nccl::error::Code::Timeout,
    };
    assert_eq!(code, want, "rank {r}: {}", nccl::error::last_error());
    if how == "late" {
        // Not before the timeout: the stall's clock starts with this wait.
        assert!(
            t.elapsed() >= timeout(),
            "rank {r}: timed out after {:?}: {}",
            t.elapsed(),
            nccl::error::last_error()
        );
    }
    assert!(
        sync(stream, Duration::from_secs(10)),
        "rank {r}: the kernel went on"
    );
    println!(
        "survived: {code:?} after {:.1} s: {}",
        t.elapsed().as_secs_f64(),
        nccl::error::last_error()
    );
    let _ = nccl::api::comm_abort(nccl::api::comm_handle(&comm));
}

/// A peer that did its part and left is no failure: the last rank sends rank 0 what fits its
/// connection, destroys its communicator and exits; rank 0's receive waits in its stream's
/// queue behind 2.5 s of other work (a gate), then runs and must get the data, no error.
pub fn finish(comm: Arc<nccl::comm::Comm>, r: usize, n: usize, stream: usize) {
    let count = 1001;
    let b = buffer(4 * count);
    let call = |kind, peer: usize| p2p_f32(kind, b, b, count, peer);
    if r == n - 1 {
        for i in 0..count {
            put(DataType::Float32, b, i, i as f64);
        }
        nccl::api::enqueue(&comm, call(CollKind::Send, 0), stream_arg(stream)).unwrap();
        sync_all(&[stream], "the send");
        nccl::api::comm_destroy(nccl::api::comm_handle(&comm)).unwrap();
        println!("sent and left");
        return;
    }
    if r != 0 {
        nccl::api::comm_destroy(nccl::api::comm_handle(&comm)).unwrap();
        println!("survived: not involved");
        return;
    }
    behind_gates(
        (&[stream], &[stream]),
        std::slice::from_ref(&comm),
        Duration::from_millis(2500),
        || {
            nccl::api::enqueue(&comm, call(CollKind::Recv, n - 1), stream_arg(stream)).unwrap();
        },
        (
            "the receive behind the gate",
            "a peer that did its part and left",
        ),
    );
    for i in 0..count {
        assert_eq!(get(DataType::Float32, b, i), i as f64, "element {i}");
    }
    println!("survived: received after the peer left");
    nccl::api::comm_destroy(nccl::api::comm_handle(&comm)).unwrap();
}

/// In graphs, with 3 ranks: a peer that did its part and left is no failure while the kernels
/// wait for another, live one. Each rank captures its part once: rank 2 a send to rank 0,
/// rank 1 a send to rank 0, rank 0 both receives in one group. Rank 2 replays, then destroys
/// its communicator and exits; rank 0's replay waits in its stream behind a gate until rank 2
/// is gone, then its kernel waits 2 s for rank 1 (which replays late): it must get both, no
/// error (the dead rank 2 is not whom its kernel waits for).
pub fn graph_finish(comm: Arc<nccl::comm::Comm>, r: usize, stream: usize) {
    let count = 1001;
    let value = |from: usize, i: usize| (i * (from + 1)) as f64;
    let call = |kind, buf, peer: usize| p2p_f32(kind, buf, buf, count, peer);
    let bufs: Vec<usize> = (0..3).map(|_| buffer(4 * count)).collect();
    begin_capture(stream);
    if r == 0 {
        nccl::api::group_start().unwrap();
        for from in [2, 1] {
            let c = call(CollKind::Recv, bufs[from], from);
            nccl::api::enqueue(&comm, c, stream_arg(stream)).unwrap();
        }
        nccl::api::group_end().unwrap();
    } else {
        (0..count).for_each(|i| put(DataType::Float32, bufs[r], i, value(r, i)));
        let c = call(CollKind::Send, bufs[r], 0);
        nccl::api::enqueue(&comm, c, stream_arg(stream)).unwrap();
    }
    let graph = [(stream, end_capture(stream))];
    let run_graph = || replay(&graph);
    match r {
        2 => {
            run_graph();
            sync_all(&[stream], "rank 2's send");
            nccl::api::comm_destroy(nccl::api::comm_handle(&comm)).unwrap();
            println!("sent and left");
        }
        1 => {
            std::thread::sleep(Duration::from_millis(3000));
            run_graph();
            sync_all(&[stream], "rank 1's late send");
            nccl::api::comm_destroy(nccl::api::comm_handle(&comm)).unwrap();
            println!("survived: sent late");
        }
        _ => {
            behind_gates(
                (&[stream], &[stream]),
                std::slice::from_ref(&comm),
                Duration::from_millis(1000),
                run_graph,
                (
                    "rank 0's receives",
                    "a peer that did its part and left, in a graph",
                ),
            );
            for from in [1, 2] {
                for i in 0..count {
                    let got = get(DataType::Float32, bufs[from], i);
                    assert_eq!(got, value(from, i), "from rank {from}, element {i}");
                }
            }
            println!("survived: received from both");
            nccl::api::comm_destroy(nccl::api::comm_handle(&comm)).unwrap();
        }
    }
}

/// Registered buffers read where they are by the kernels of another process on the one GPU
/// (with 16 KiB slots, `OXCCL_CHUNK_BYTES`, so that 1.2 MB is more than a FIFO's worth): each
/// rank registers a send and a receive buffer of its own, device memory from `cuMemAlloc`
/// (opened by its legacy IPC handle), then from `ncclMemAlloc` (cuMem, opened by a file
/// descriptor of its physical memory); sends the next rank its send buffer while it receives
/// the previous one's, then all-reduces the two out of place; every element checked. Its
/// kernels took slots by reference (the other processes opened its buffers through their
/// registration services); once every rank deregistered them, each process has closed what it
/// opened, and the same calls take nothing by reference and give the same results.
pub fn registered(comm: Arc<nccl::comm::Comm>, r: usize, n: usize, stream: usize) {
    let count = 300_001;
    let bytes = 4 * count;
    let api = driver::api().unwrap();
    let value = |from: usize, i: usize| ((i % 1000) * (from + 1)) as f64;
    let on = stream_arg(stream);
    // (The refs taken, and how many of the other processes' buffers this one had open after
    // the point-to-point calls: no rank deregisters before all took part in the all-reduce.)
    let run = |send: usize, recv: usize, what: &str| -> (u64, usize) {
        for i in 0..count {
            put(DataType::Float32, send, i, value(r, i));
            put(DataType::Float32, recv, i, -1.0);
        }
        let before = device::refs_taken();
        nccl::api::group_start().unwrap();
        let to = p2p_f32(CollKind::Send, send, 0, count, (r + 1) % n);
        let from = p2p_f32(CollKind::Recv, 0, recv, count, (r + n - 1) % n);
        nccl::api::enqueue(&comm, to, on.clone()).unwrap();
        nccl::api::enqueue(&comm, from, on.clone()).unwrap();
        nccl::api::group_end().unwrap();
        sync_all(&[stream], what);
        no_async_error(std::slice::from_ref(&comm), what);
        for i in 0..count {
            let want = value((r + n - 1) % n, i);
            assert_eq!(
                get(DataType::Float32, recv, i),
                want,
                "{what}: received element {i}"
            );
        }
        let opened = nccl::transport::registered::opened();
        let all = CollArgs {
            send,
            recv,
            ..p2p_f32(CollKind::AllReduce, 0, 0, count, 0)
        };
        nccl::api::enqueue(&comm, all, on.clone()).unwrap();
        sync_all(&[stream], what);
        no_async_error(std::slice::from_ref(&comm), what);
        for i in 0..count {
            let want: f64 = (0..n).map(|q| value(q, i)).sum();
            assert_eq!(
                get(DataType::Float32, recv, i),
                want,
                "{what}: reduced element {i}"
            );
        }
        (device::refs_taken() - before, opened)
    };
    let mut said = Vec::new();
    for how in ["cuMemAlloc", "ncclMemAlloc"] {
        let alloc = || {
            if how == "ncclMemAlloc" {
                return nccl::api::mem_alloc(bytes).unwrap();
            }
            let mut p = 0;
            // SAFETY: writes one device pointer (freed below).
            assert_eq!(unsafe { (api.mem_alloc)(&mut p, bytes) }, 0, "cuMemAlloc");
            p as usize
        };
        let (send, recv) = (alloc(), alloc());
        let handles = [send, recv].map(|b| nccl::api::comm_register(&comm, b, bytes).unwrap());
        let (took, opened) = run(send, recv, &format!("registered {how} buffers"));
        assert!(
            took > 0,
            "rank {r}: nothing taken by reference from registered {how} buffers"
        );
        assert!(
            opened > 0,
            "rank {r}: opened none of the other processes' {how} buffers"
        );
        for h in handles {
            nccl::api::comm_deregister(&comm, h).unwrap();
        }
        // (Every rank deregistered before its part of these calls: each asked the other
        // processes to close its buffers, and waited.)
        let (again, _) = run(send, recv, &format!("deregistered {how} buffers"));
        assert_eq!(
            again, 0,
            "rank {r}: slots by reference from deregistered {how} buffers"
        );
        assert_eq!(
            nccl::transport::registered::opened(),
            0,
            "rank {r}: the other processes' deregistered {how} buffers are still open here"
        );
        // No rank goes on (to register more) before every rank has looked.
        let b = buffer(4);
        let barrier = CollArgs {
            send: b,
            recv: b,
            ..p2p_f32(CollKind::AllReduce, 0, 0, 1, 0)
        };
        nccl::api::enqueue(&comm, barrier, on.clone()).unwrap();
        sync_all(&[stream], "the barrier");
        for b in [send, recv] {
            if how == "ncclMemAlloc" {
                nccl::api::mem_free(b).unwrap();
            } else {
                // SAFETY: allocated above; nothing uses it any more.
                unsafe { (api.mem_free)(b as u64) };
            }
        }
        said.push(format!(
            "{how}: took {took} slots by reference, opened {opened}"
        ));
    }
    nccl::api::comm_destroy(nccl::api::comm_handle(&comm)).unwrap();
    no_faults();
    println!(
        "survived: registered buffers read in place ({}), none once deregistered",
        said.join("; ")
    );
}

/// The library's segments in /dev/shm.
pub fn shm_names() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with("oxccl-"))
                .collect()
        })
        .unwrap_or_default()
}

/// n ranks in processes of their own on the one device: connections in device memory, which
/// the sending end opens by the receiving end's IPC handle (`ipc`: `OXCCL_CUDA_IPC=1`, or None,
/// the variable unset: the default), or with `Some(false)` (`OXCCL_CUDA_IPC=0`) in shared host
/// memory (pinned, mapped into the device). With `hosts` > 1 the ranks are spread over that many
/// "hosts" of this machine (`OXCCL_HOSTID`, consecutive ranks on one): between hosts the network
/// transport's proxy threads move the kernels' FIFO slots over loopback sockets.
pub fn processes(so: &Path, n: usize, ipc: Option<bool>, hosts: usize) {
    run_processes(so, n, ipc, hosts, None, None);
}

/// `processes`, or with `trouble` ("death", "late") the last rank fails the others (`trouble`);
/// "pidns-" before it, or `trouble` "pidns" alone (nothing fails), puts each rank in a PID
/// namespace of its own. The IPC handles the ranks opened (0 with `trouble` other than "pidns").
/// `peers`: the ranks' driver has two devices (`OXEMU_PEERS`), rank r on device r % 2.
pub fn run_processes(
    so: &Path,
    n: usize,
    ipc: Option<bool>,
    hosts: usize,
    trouble: Option<&str>,
    peers: Option<&str>,
) -> u64 {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cuda-emu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = |r: usize, what: &str| dir.join(format!("rank{r}.{what}"));
    let id = nccl::api::get_unique_id().unwrap();
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    // "pidns-...": each rank in a PID namespace of its own, under a shell that is its PID 1
    // (containers sharing this host's /dev/shm; both ranks have the same pid).
    let pidns = trouble.is_some_and(|t| t.starts_with("pidns"));
    let trouble = trouble.filter(|&t| t != "pidns");
    // `OXEMU_TOGETHER`=k: ranks 0 to k-1 share the first process (`ranks_process`), the others
    // have one each; a process is named by its first rank.
    let together = std::env::var("OXEMU_TOGETHER")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, n);
    let procs: Vec<Vec<usize>> = std::iter::once((0..together).collect())
        .chain((together..n).map(|r| vec![r]))
        .collect();
    let host_of = |r: usize| r * hosts / n;
    let kids: Vec<_> = procs
        .iter()
        .map(|ranks| {
            let r = ranks[0];
            let exe = std::env::current_exe().unwrap();
            let mut cmd = Command::new(if pidns { Path::new("unshare") } else { &exe });
            if pidns {
                cmd.args([
                    "--pid",
                    "--fork",
                    "--mount-proc",
                    "sh",
                    "-c",
                    "\"$@\"; exit $?",
                    "sh",
                ])
                .arg(&exe);
            }
            match ipc {
                Some(i) => cmd.env("OXCCL_CUDA_IPC", if i { "1" } else { "0" }),
                None => cmd.env_remove("OXCCL_CUDA_IPC"),
            };
            cmd.args([
                "--exact",
                "cuda_executor_on_emulated_kernels",
                "--nocapture",
            ])
            .env(
                "OXEMU_RANK",
                ranks
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            )
            .env("OXEMU_NRANKS", n.to_string())
            .env("OXEMU_ID", &hex)
            .env("OXEMU_LIB", so)
            .envs(trouble.map(|t| ("OXEMU_TROUBLE", t)))
            .envs(peers.map(|p| ("OXEMU_PEERS", p)))
            // A short timeout for the late peer (also the bootstrap's).
            .envs(trouble.map(|_| ("OXCCL_TIMEOUT_S", "3")))
            .envs((hosts > 1).then(|| ("OXCCL_HOSTID", format!("emu-host-{}", host_of(r)))))
            // Ranks other than 0 told another channel count (rank 0's holds).
            .envs(
                std::env::var("OXEMU_CHANNELS_OTHERS")
                    .ok()
                    .filter(|_| r > 0)
                    .map(|v| ("OXCCL_CUDA_CHANNELS", v)),
            )
            .env_remove("NCCL_DEBUG")
            .env_remove("NCCL_DEBUG_SUBSYS")
            // To files: a pipe nobody reads until the end could fill and stop a rank.
            .stdout(std::fs::File::create(log(r, "out")).unwrap())
            .stderr(std::fs::File::create(log(r, "err")).unwrap())
            .spawn()
            .unwrap()
        })
        .collect();
    // Killed at the deadline: a hang fails the test with what each rank printed.
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut kids = kids;
    while Instant::now() < deadline && kids.iter_mut().any(|k| k.try_wait().unwrap().is_none()) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let outs: Vec<(std::process::ExitStatus, String, String)> = kids
        .into_iter()
        .zip(procs.iter().map(|p| p[0]))
        .map(|(mut k, r)| {
            let _ = k.kill();
            let status = k.wait().unwrap();
            let read = |w| std::fs::read_to_string(log(r, w)).unwrap_or_default();
            (status, read("out"), read("err"))
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    let report: String = outs
        .iter()
        .zip(&procs)
        .map(|((status, out, err), ranks)| format!("--- ranks {ranks:?}: {status}\n{out}{err}"))
        .collect();
    if outs.iter().any(|o| !o.0.success()) {
        // Killed ranks leave their communicator's segments behind (named by its hash, which
        // each rank prints first).
        let hashes: BTreeSet<&str> = outs
            .iter()
            .filter_map(|o| o.1.lines().find_map(|l| l.strip_prefix("comm hash ")))
            .collect();
        for name in shm_names() {
            if hashes
                .iter()
                .any(|h| name.starts_with(&format!("oxccl-{h}-")))
            {
                let _ = std::fs::remove_file(Path::new("/dev/shm").join(name));
            }
        }
    }
    if let Some(how) = trouble {
        use std::os::unix::process::ExitStatusExt;
        let last = outs.last().expect("a process");
        match how
            .trim_start_matches("graph-")
            .trim_start_matches("pidns-")
        {
            // (Under a shell: its exit status says the rank was killed.)
            "death" if pidns => assert_eq!(last.0.code(), Some(128 + 9), "{report}"),
            "death" => assert_eq!(last.0.signal(), Some(9), "{report}"),
            "finish" => assert!(
                last.0.success() && last.1.contains("sent and left"),
                "{report}"
            ),
            "registered" => assert!(
                last.0.success() && last.1.contains("survived: "),
                "{report}"
            ),
            _ => assert!(
                last.0.success() && last.1.contains("stayed away"),
                "{report}"
            ),
        }
        for (status, out, _) in &outs[..outs.len() - 1] {
            assert!(status.success() && out.contains("survived: "), "{report}");
        }
        eprintln!("a peer's {how}, {n} processes:\n{report}");
        return 0;
    }
    let mut opened = 0;
    // (What rank 0 was told, within the rings there are.)
    let channels = std::env::var("OXCCL_CUDA_CHANNELS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, nccl::transport::Class::RINGS);
    for (status, out, _) in &outs {
        assert!(status.success(), "{n} processes:\n{report}");
        assert!(out.contains(&format!("hosts {hosts}\n")), "{report}");
        assert!(
            out.contains(&format!("channels {channels}\n")),
            "rank 0's {channels} channels: {report}"
        );
        let line = out
            .lines()
            .find(|l| l.contains("IPC handles opened"))
            .unwrap_or("");
        let here = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        opened += here;
        // Connections in device memory keep only their 4 KiB header in /dev/shm (a
        // container's is 64 MiB); host-staged ones their slots too.
        if let (Some(seg), None, None) = (
            out.lines().find(|l| l.starts_with("connection segments: ")),
            peers,
            trouble,
        ) {
            let largest: u64 = seg.split(' ').nth(4).unwrap().parse().unwrap();
            if here > 0 {
                assert_eq!(largest, 4096, "{n} processes, CUDA IPC: {seg}\n{report}");
            } else if ipc == Some(false) && !seg.starts_with("connection segments: 0,") {
                assert!(
                    largest > 4096,
                    "{n} processes, host-staged: {seg}\n{report}"
                );
            }
        }
    }
    // (IPC serves ranks of one host and one PID namespace, of one GPU unless they are on two:
    // `peer_devices`.)
    // (Ranks of one process share memory without it.)
    let two_on_a_host = procs.iter().enumerate().any(|(i, a)| {
        procs[i + 1..]
            .iter()
            .any(|b| host_of(a[0]) == host_of(b[0]))
    });
    if peers.is_none() {
        assert_eq!(
            opened > 0,
            ipc.unwrap_or(true) && two_on_a_host && !pidns,
            "{n} processes: IPC handles opened: {opened}"
        );
    }
    opened
}
