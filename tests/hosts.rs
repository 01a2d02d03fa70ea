//! Ranks on two "hosts" (processes with different host identities, `OXCCL_HOSTID`, on this
//! machine's loopback): traffic inside a host goes over shared memory, traffic between hosts
//! over the network transport (TCP, moved by each communicator's proxy thread).

use nccl::api::{self, CollArgs, StreamArg};
use nccl::error::Code;
use nccl::types::{CollKind, DataType, OP_SUM};
use std::time::{Duration, Instant};

mod common;

fn f32s(v: &[f32]) -> usize {
    v.as_ptr() as usize
}

#[test]
fn two_hosts_inside_over_shared_memory_across_over_the_network() {
    let Some((id, n, r)) = common::rank_env() else {
        // The timeout is far above what the test allows: failing fast is what is tested.
        return common::run_ranks(
            "two_hosts_inside_over_shared_memory_across_over_the_network",
            4,
            &[],
        );
    };
    // Ranks 0, 1 on host A; 2, 3 on host B.
    std::env::set_var("OXCCL_HOSTID", format!("test-host-{}", r / 2));
    let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
    // One load/store team per host, ranks placed host by host.
    assert_eq!(api::comm_lsa(&c).unwrap(), (r, 4, r % 2, 2, 2), "rank {r}");
    let h = api::comm_handle(&c);
    // SAFETY: a live communicator handle.
    let lsa = unsafe { nccl::abi::ncclTeamLsa(h as nccl::abi::ncclComm_t) };
    assert_eq!((lsa.nRanks, lsa.rank, lsa.stride), (2, (r % 2) as i32, 1));
    // SAFETY: as above.
    let rail = unsafe { nccl::abi::ncclTeamRail(h as nccl::abi::ncclComm_t) };
    assert_eq!(
        (rail.nRanks, rail.rank, rail.stride),
        (2, (r / 2) as i32, 2)
    );
    // Send/Recv inside each host: 0 -> 1, 2 -> 3.
    let count = 300_000;
    let peer = r ^ 1;
    let send: Vec<f32> = (0..count).map(|i| (r * count + i) as f32).collect();
    let mut recv = vec![0f32; count];
    let p2p = |kind, buf: usize| CollArgs {
        kind,
        send: buf,
        recv: buf,
        count,
        dtype: DataType::Float32,
        op: OP_SUM,
        root: peer as i32,
    };
    let a = if r % 2 == 0 {
        p2p(CollKind::Send, f32s(&send))
    } else {
        p2p(CollKind::Recv, recv.as_mut_ptr() as usize)
    };
    api::enqueue(&c, a, StreamArg::Null).unwrap();
    if r % 2 == 1 {
        for (i, x) in recv.iter().enumerate() {
            assert_eq!(*x, (peer * count + i) as f32, "rank {r} element {i}");
        }
    }
    // An all-reduce: the ring crosses hosts.
    let t0 = Instant::now();
    api::enqueue(
        &c,
        common::all_reduce_f32(&send, &mut recv),
        StreamArg::Null,
    )
    .unwrap();
    for (i, x) in recv.iter().enumerate() {
        let want: f32 = (0..n).map(|p| (p * count + i) as f32).sum();
        assert_eq!(*x, want, "rank {r} element {i}");
    }
    eprintln!("rank {r}: all-reduce across hosts took {:?}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(20));
    api::comm_destroy(h).unwrap();
}

/// A rank that finds a failure tells every peer (through the bootstrap), so ranks that only
/// wait on it indirectly stop too: 4 "hosts" in a ring, rank 3 killed mid-loop; ranks 0-2 all
/// get an error within seconds (the timeout is 60 s), whichever of them saw the death first.
#[test]
fn a_death_reaches_every_rank_of_a_ring() {
    const T: &str = "a_death_reaches_every_rank_of_a_ring";
    if let Ok(r) = std::env::var("OXCCL_RING_DEATH_RANK") {
        let r: usize = r.parse().unwrap();
        let hex = std::env::var("OXCCL_RING_DEATH_ID").unwrap();
        let mut id = [0u8; api::UNIQUE_ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
        }
        std::env::set_var("OXCCL_HOSTID", format!("ring-death-host-{r}"));
        let c = api::comm_init_rank(4, &id, r as i32, Default::default()).unwrap();
        let count = 1 << 16;
        let send = vec![1f32; count];
        let mut recv = vec![0f32; count];
        let t0 = Instant::now();
        for i in 0.. {
            if i == 30 && r == 3 {
                nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL)
                    .unwrap();
            }
            let a = common::all_reduce_f32(&send, &mut recv);
            if let Err(e) = api::enqueue(&c, a, StreamArg::Null) {
                // (The ranks are not in step: rank 3 may die before the others reach 30.)
                let took = t0.elapsed();
                eprintln!("rank {r}: error after {i} all-reduces, {took:?}: {e}");
                assert_eq!(e.code, Code::RemoteError, "rank {r}: {e}");
                assert!(e.msg.contains("rank 3"), "rank {r}: {e}");
                assert!(
                    took < Duration::from_secs(10),
                    "rank {r}: after {took:?}: {e}"
                );
                let _ = api::comm_abort(api::comm_handle(&c));
                return;
            }
        }
    }
    let id = api::get_unique_id().unwrap();
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().unwrap();
    let kids: Vec<_> = (0..4)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["--exact", T, "--nocapture"])
                .env("OXCCL_DEVICE", "host")
                .env("OXCCL_TIMEOUT_S", "60")
                .env("OXCCL_RING_DEATH_ID", &hex)
                .env("OXCCL_RING_DEATH_RANK", r.to_string())
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let t0 = Instant::now();
    for (r, mut k) in kids.into_iter().enumerate() {
        let st = k.wait().unwrap();
        assert_eq!(st.success(), r != 3, "rank {r}: {st:?}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
}

/// Element `i` of a buffer of `dtype`, as f64 (the test's values are small integers).
fn get(dtype: DataType, b: &[u8], i: usize) -> f64 {
    let es = dtype.size();
    let x = &b[i * es..(i + 1) * es];
    match dtype {
        DataType::Uint8 => x[0] as f64,
        DataType::Int32 => i32::from_le_bytes(x.try_into().unwrap()) as f64,
        DataType::Int64 => i64::from_le_bytes(x.try_into().unwrap()) as f64,
        DataType::Float32 => f32::from_le_bytes(x.try_into().unwrap()) as f64,
        DataType::Float64 => f64::from_le_bytes(x.try_into().unwrap()),
        DataType::Bfloat16 => {
            f32::from_bits((u16::from_le_bytes(x.try_into().unwrap()) as u32) << 16) as f64
        }
        _ => unreachable!(),
    }
}

fn put(dtype: DataType, b: &mut [u8], i: usize, v: f64) {
    let es = dtype.size();
    let x = &mut b[i * es..(i + 1) * es];
    match dtype {
        DataType::Uint8 => x[0] = v as u8,
        DataType::Int32 => x.copy_from_slice(&(v as i32).to_le_bytes()),
        DataType::Int64 => x.copy_from_slice(&(v as i64).to_le_bytes()),
        DataType::Float32 => x.copy_from_slice(&(v as f32).to_le_bytes()),
        DataType::Float64 => x.copy_from_slice(&v.to_le_bytes()),
        DataType::Bfloat16 => {
            x.copy_from_slice(&(((v as f32).to_bits() >> 16) as u16).to_le_bytes())
        }
        _ => unreachable!(),
    }
}

/// An all-reduce's inputs and expected result at element `i` on rank `r` of `n`, for op
/// `op` (5: PreMulSum by 2): small integers, so that every summation order gives the same.
fn reduction_case(op: usize, n: usize, r: usize, i: usize) -> (f64, f64) {
    let base = |r: usize| ((i * 7 + r * 3) % 11) as f64;
    let bit = |r: usize| (1 + (i + r) % 2) as f64;
    match op {
        0 => (base(r), (0..n).map(base).sum()),
        1 => (bit(r), (0..n).map(bit).product()),
        2 => (base(r), (0..n).map(base).fold(f64::MIN, f64::max)),
        3 => (base(r), (0..n).map(base).fold(f64::MAX, f64::min)),
        // Avg: inputs that are multiples of n.
        4 => (n as f64 * base(r), (0..n).map(base).sum()),
        _ => (base(r), 2.0 * (0..n).map(base).sum::<f64>()),
    }
}

/// The all-reduce plans across hosts (the exchange of 2 ranks on 2 hosts; the hierarchical
/// plan: reduce inside each host, all-reduce among the hosts' first ranks, broadcast inside each
/// host), in several placements of ranks on hosts: every op (PreMulSum with a host and a device
/// scalar), six datatypes, in place and out of place, several FIFO slots per rank, each element
/// against the expected value; also with slots cut over 8 and 3 sockets per connection, and one
/// rank on each of 4 and 5 hosts (the hosts' trees). Rank 0's TUNING lines must name the plan
/// and how the leaders all-reduce (exchange, tree, double tree or ring), and every rank must
/// hold the same bytes.
#[test]
fn all_reduce_plans_across_hosts() {
    const T: &str = "all_reduce_plans_across_hosts";
    if let Some((id, n, r)) = common::rank_env() {
        let hosts: Vec<usize> = std::env::var("OXCCL_TEST_PLACE")
            .unwrap()
            .split(',')
            .map(|h| h.parse().unwrap())
            .collect();
        std::env::set_var("OXCCL_HOSTID", format!("plans-host-{}", hosts[r]));
        let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
        let count: usize = std::env::var("OXCCL_TEST_COUNT").map_or(40_000, |c| c.parse().unwrap());
        let dtypes = [
            DataType::Float32,
            DataType::Float64,
            DataType::Int32,
            DataType::Uint8,
            DataType::Int64,
            DataType::Bfloat16,
        ];
        for dtype in dtypes {
            let es = dtype.size();
            let two = match dtype {
                DataType::Float64 => 2f64.to_bits(),
                DataType::Float32 => 2f32.to_bits() as u64,
                DataType::Bfloat16 => (2f32.to_bits() >> 16) as u64,
                _ => 2,
            };
            let dev_scalar = two.to_le_bytes();
            for op in 0..7 {
                let (nccl_op, what) = match op {
                    0..=4 => (op as i32, format!("op {op}")),
                    5 => {
                        let s = nccl::types::ScalarArg::Host(nccl::types::Scalar { bits: two });
                        (
                            api::redop_create_premulsum(&c, dtype, s).unwrap(),
                            "premulsum".into(),
                        )
                    }
                    _ => {
                        let s = nccl::types::ScalarArg::Device(dev_scalar.as_ptr() as usize);
                        let op = api::redop_create_premulsum(&c, dtype, s).unwrap();
                        (op, "premulsum (device scalar)".into())
                    }
                };
                let case = op.min(5);
                for in_place in [false, true] {
                    let mut send = vec![0u8; count * es];
                    let mut out = vec![0u8; count * es];
                    for i in 0..count {
                        let x = reduction_case(case, n, r, i).0;
                        // Max and min meet +0 and -0: every rank must still get the same bits.
                        let x = if (2..=3).contains(&case) && x == 0.0 && r % 2 == 1 {
                            -0.0
                        } else {
                            x
                        };
                        put(dtype, &mut send, i, x);
                    }
                    let (s, d) = if in_place {
                        (send.as_mut_ptr() as usize, send.as_mut_ptr() as usize)
                    } else {
                        (send.as_ptr() as usize, out.as_mut_ptr() as usize)
                    };
                    let a = CollArgs {
                        kind: CollKind::AllReduce,
                        send: s,
                        recv: d,
                        count,
                        dtype,
                        op: nccl_op,
                        root: 0,
                    };
                    api::enqueue(&c, a, StreamArg::Null).unwrap();
                    let got = if in_place { &send } else { &out };
                    for i in 0..count {
                        let want = reduction_case(case, n, r, i).1;
                        let x = get(dtype, got, i);
                        // A float average is a pre-multiply by 1/n: rounding, within 1e-5.
                        let ok = if case == 4
                            && matches!(
                                dtype,
                                DataType::Float32 | DataType::Float64 | DataType::Bfloat16
                            ) {
                            (x - want).abs()
                                <= 1e-5 * want.abs().max(1.0)
                                    + if dtype == DataType::Bfloat16 {
                                        0.5
                                    } else {
                                        0.0
                                    }
                        } else {
                            x == want
                        };
                        assert!(
                            ok,
                            "rank {r} of {n} (hosts {hosts:?}): {dtype:?} {what} in place {in_place}: \
                             element {i} is {x}, expected {want}"
                        );
                    }
                    // Every rank has the same bytes: gather them all and compare.
                    let mut all = vec![0u8; n * got.len()];
                    let g = CollArgs {
                        kind: CollKind::AllGather,
                        send: got.as_ptr() as usize,
                        recv: all.as_mut_ptr() as usize,
                        count: got.len(),
                        dtype: DataType::Uint8,
                        op: 0,
                        root: 0,
                    };
                    api::enqueue(&c, g, StreamArg::Null).unwrap();
                    for (p, theirs) in all.chunks(got.len()).enumerate() {
                        if let Some(i) = (0..got.len()).find(|&i| theirs[i] != got[i]) {
                            panic!(
                                "rank {r} of {n} (hosts {hosts:?}): {dtype:?} {what} in place \
                                 {in_place}: rank {p}'s result differs from this rank's at byte {i}"
                            );
                        }
                    }
                }
                if op >= 5 {
                    api::redop_destroy(&c, nccl_op).unwrap();
                }
            }
        }
        api::comm_destroy(api::comm_handle(&c)).unwrap();
        return;
    }
    let dir = std::env::temp_dir().join(format!("oxccl-plans-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The last two runs cut each slot into parts over several sockets per connection.
    let many = [
        ("NCCL_NSOCKS_PERTHREAD", "4"),
        ("NCCL_SOCKET_NTHREADS", "2"),
        ("OXCCL_CHUNK_BYTES", "1048576"),
    ];
    let odd = [
        ("NCCL_NSOCKS_PERTHREAD", "3"),
        ("OXCCL_CHUNK_BYTES", "300032"),
    ];
    // Two ranks exchange, except for float max and min (the ring: see plan::hier).
    let exchange = &["Direct (exchange)", "Ring"][..];
    let h = |leaders: &str| format!("Tree (hierarchical, leaders: {leaders})");
    let (x, t, d, r) = (h("exchange"), h("tree"), h("double tree"), h("ring"));
    // Two hosts' leaders exchange, except for float max and min.
    let two = &[x.as_str(), r.as_str()][..];
    // Three: 40000 bytes (uint8) up and down one tree, more (the other types) round the
    // ring, as integer averages (a post-divide) are.
    let three = &[t.as_str(), r.as_str()][..];
    // Four: 80000 and 160000 bytes over two trees (up to 160 KiB), 320000 round the ring.
    let four = &[t.as_str(), d.as_str(), r.as_str()][..];
    // One rank per host: the same, where the flat ring serves what the trees do not.
    let trees = &["Ring", t.as_str(), d.as_str()][..];
    let small_trees = &["Ring", t.as_str()][..];
    let small = [("OXCCL_TEST_COUNT", "1000")];
    // From 8 MiB (1100000 elements of 8 bytes) two hosts take the ring, not the exchange.
    let large = [("OXCCL_TEST_COUNT", "1100000")];
    for (place, algos, env) in [
        ("0,1", exchange, &[][..]),
        ("0,0,1,1", two, &[]),
        ("0,1,0,1,0,1", two, &[]),
        ("0,1,1,2,2,2", three, &[]),
        ("0,1,2,3", trees, &[]),
        ("0,1,2,3,3", four, &[]),
        ("0,1,2,3,4", small_trees, &small[..]),
        ("0,1", exchange, &many[..]),
        ("0,0,1,1", two, &odd[..]),
        ("0,1", exchange, &large[..]),
        ("0,0,1,1", two, &large[..]),
    ] {
        let n = place.split(',').count();
        let id = api::get_unique_id().unwrap();
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        let exe = std::env::current_exe().unwrap();
        let log = |r: usize| dir.join(format!("rank{r}.log"));
        let kids: Vec<_> = (0..n)
            .map(|r| {
                std::process::Command::new(&exe)
                    .args(["--exact", T, "--nocapture"])
                    .env("OXCCL_DEVICE", "host")
                    .env("OXCCL_TEST_ID", &hex)
                    .env("OXCCL_TEST_N", n.to_string())
                    .env("OXCCL_TEST_RANK", r.to_string())
                    .env("OXCCL_TEST_PLACE", place)
                    .env("OXCCL_TIMEOUT_S", "60")
                    .env("NCCL_DEBUG", "INFO")
                    .env("NCCL_DEBUG_SUBSYS", "TUNING")
                    .envs(env.iter().copied())
                    // NCCL's INFO lines go to stdout.
                    .stdout(std::fs::File::create(log(r)).unwrap())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (r, mut k) in kids.into_iter().enumerate() {
            let ok = k.wait().unwrap().success();
            let text = std::fs::read_to_string(log(r)).unwrap_or_default();
            assert!(ok, "hosts {place} {env:?}: rank {r} failed:\n{text}");
            let want: std::collections::BTreeSet<&str> = algos.iter().copied().collect();
            let algos: std::collections::BTreeSet<&str> = text
                .lines()
                .filter_map(|l| l.split("AllReduce: ").nth(1))
                .filter_map(|l| l.split("-> Algo ").nth(1))
                .filter_map(|l| l.split(" proto").next())
                .collect();
            assert_eq!(algos, want, "hosts {place}: rank {r}'s plans");
            // 1100000 float64s (8800000 bytes): never the exchange; float32s (4400000) and
            // uint8s (1100000) by it (but for float max and min).
            let plan_of = |bytes: &str| {
                text.lines()
                    .filter(|l| l.contains(&format!("AllReduce: {bytes} Bytes ")))
                    .map(|l| l.contains("exchange"))
                    .collect::<Vec<bool>>()
            };
            if env == &large[..] {
                let big = plan_of("8800000");
                assert!(
                    !big.is_empty() && !big.iter().any(|&x| x),
                    "{place}:\n{text}"
                );
                for small in ["4400000", "1100000"] {
                    assert!(plan_of(small).iter().any(|&x| x), "{place}:\n{text}");
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
