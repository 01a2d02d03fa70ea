//! Randomized sequences of collectives and ring shifts (grouped send/recv), in and out of place,
//! alone and several to a group, on host streams and the NULL stream, one thread per rank.
//! Every rank draws the same sequence from a shared seed; every result is checked element by
//! element against a reference computed here from the inputs' formula.

use nccl::api::{self, CollArgs, StreamArg};
use nccl::types::{CollKind, DataType, OP_MAX, OP_MIN, OP_SUM};

mod common;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    ReduceScatter,
    AlltoAll,
    Gather,
    Scatter,
    /// Send to the next rank, receive from the previous one, in one group.
    Shift,
}

const KINDS: [Kind; 9] = [
    Kind::AllReduce,
    Kind::Reduce,
    Kind::Broadcast,
    Kind::AllGather,
    Kind::ReduceScatter,
    Kind::AlltoAll,
    Kind::Gather,
    Kind::Scatter,
    Kind::Shift,
];

#[derive(Clone, Copy, Debug)]
struct Op {
    kind: Kind,
    count: usize,
    op: i32,
    root: usize,
    in_place: bool,
}

/// Input element `i` of rank `r` for operation `k`.
fn val(r: usize, k: usize, i: usize) -> i32 {
    ((r * 131 + k * 17 + i * 7) % 61) as i32 - 30
}

fn reduce(op: i32, n: usize, f: impl Fn(usize) -> i32) -> i32 {
    let it = (0..n).map(f);
    match op {
        OP_SUM => it.sum(),
        OP_MAX => it.max().unwrap(),
        OP_MIN => it.min().unwrap(),
        _ => unreachable!(),
    }
}

/// Draws the whole sequence: batches of operations, each batch one group (or one call).
fn draw(seed: u64, n: usize, batches: usize) -> Vec<(bool, Vec<Op>)> {
    // 3 and 10 elements: inputs that travel in the cache line of a rank's arrival (see
    // `transport::board::TINY`); 64 and 1000: eager through the inline areas; then larger.
    draw_counts(
        seed,
        n,
        batches,
        &[0, 1, 3, 10, 64, 1000, 40_000, 300_000, 2_600_000],
    )
}

/// `draw` with element counts taken from `counts`.
fn draw_counts(seed: u64, n: usize, batches: usize, counts: &[usize]) -> Vec<(bool, Vec<Op>)> {
    let mut g = Rng(seed | 1);
    (0..batches)
        .map(|_| {
            let on_stream = g.below(3) != 0;
            let len = 1 + g.below(4) * usize::from(g.below(2) == 0);
            let ops = (0..len)
                .map(|_| Op {
                    kind: KINDS[g.below(KINDS.len())],
                    count: counts[g.below(counts.len())],
                    op: [OP_SUM, OP_MAX, OP_MIN][g.below(3)],
                    root: g.below(n),
                    in_place: g.below(2) == 0,
                })
                .collect();
            (on_stream, ops)
        })
        .collect()
}

/// One operation's buffers on one rank.
struct Bufs {
    /// The receive buffer (holding the input too when in place).
    buf: Vec<i32>,
    /// The rank's input, the send buffer when out of place.
    sep: Vec<i32>,
}

fn run_rank(n: usize, r: usize, id: &[u8; nccl::api::UNIQUE_ID_BYTES], seq: &[(bool, Vec<Op>)]) {
    let c = api::comm_init_rank(n as i32, id, r as i32, Default::default()).unwrap();
    let sh = api::host_stream_create().unwrap();
    let stream = api::stream_from_handle(sh).unwrap();
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mut k = 0;
    for (b, (on_stream, ops)) in seq.iter().enumerate() {
        let sa = if *on_stream {
            stream.clone()
        } else {
            StreamArg::Null
        };
        let first = k;
        let mut bufs: Vec<Bufs> = Vec::new();
        let grouped = ops.len() > 1;
        if grouped {
            api::group_start().unwrap();
        }
        for (j, o) in ops.iter().enumerate() {
            let kk = first + j;
            let c_ = o.count;
            // Sizes of the receive-side buffer and of the input.
            let (out_len, in_len) = match o.kind {
                Kind::AllGather | Kind::Gather => (n * c_, c_),
                Kind::ReduceScatter | Kind::Scatter => (n * c_, n * c_),
                Kind::AlltoAll => (n * c_, n * c_),
                _ => (c_, c_),
            };
            let mut bb = Bufs {
                buf: vec![-999; out_len.max(1)],
                sep: (0..in_len.max(1)).map(|i| val(r, kk, i)).collect(),
            };
            // In place, the input sits where NCCL's in-place convention puts it.
            let in_at = match o.kind {
                Kind::AllGather | Kind::Gather => r * c_,
                _ => 0,
            };
            let in_place = o.in_place;
            if in_place {
                match o.kind {
                    Kind::ReduceScatter | Kind::Scatter | Kind::AlltoAll => {
                        bb.buf = bb.sep.clone();
                    }
                    _ => {
                        for i in 0..in_len {
                            bb.buf[in_at + i] = val(r, kk, i);
                        }
                    }
                }
            }
            let base = bb.buf.as_mut_ptr() as usize;
            let send = if in_place {
                base + in_at * 4
            } else {
                bb.sep.as_ptr() as usize
            };
            let recv = match o.kind {
                Kind::ReduceScatter | Kind::Scatter if in_place => base + r * c_ * 4,
                _ => base,
            };
            let a = |kind, count, root: usize| CollArgs {
                kind,
                send,
                recv,
                count,
                dtype: DataType::Int32,
                op: o.op,
                root: root as i32,
            };
            match o.kind {
                Kind::AllReduce => api::enqueue(&c, a(CollKind::AllReduce, c_, 0), sa.clone()),
                Kind::Reduce => api::enqueue(&c, a(CollKind::Reduce, c_, o.root), sa.clone()),
                Kind::Broadcast => api::enqueue(&c, a(CollKind::Broadcast, c_, o.root), sa.clone()),
                Kind::AllGather => api::enqueue(&c, a(CollKind::AllGather, c_, 0), sa.clone()),
                Kind::ReduceScatter => {
                    api::enqueue(&c, a(CollKind::ReduceScatter, c_, 0), sa.clone())
                }
                Kind::AlltoAll => api::enqueue(&c, a(CollKind::AlltoAll, c_, 0), sa.clone()),
                Kind::Gather => api::enqueue(&c, a(CollKind::Gather, c_, o.root), sa.clone()),
                Kind::Scatter => api::enqueue(&c, a(CollKind::Scatter, c_, o.root), sa.clone()),
                Kind::Shift => {
                    if !grouped {
                        api::group_start().unwrap();
                    }
                    api::enqueue(&c, a(CollKind::Send, c_, next), sa.clone()).unwrap();
                    let r2 = api::enqueue(&c, a(CollKind::Recv, c_, prev), sa.clone());
                    if !grouped {
                        api::group_end().unwrap();
                    }
                    r2
                }
            }
            .unwrap_or_else(|e| panic!("rank {r} batch {b} op {kk} {o:?}: {e:?}"));
            bufs.push(bb);
        }
        if grouped {
            api::group_end().unwrap();
        }
        k += ops.len();
        if *on_stream {
            api::host_stream_synchronize(sh).unwrap();
        }
        // Check.
        for (j, (o, bb)) in ops.iter().zip(&bufs).enumerate() {
            let kk = first + j;
            let c_ = o.count;
            let out = &bb.buf;
            let red = |at: usize| reduce(o.op, n, |p| val(p, kk, at));
            let check = |i: usize, want: i32| {
                assert_eq!(
                    out[i], want,
                    "rank {r} batch {b} op {kk} {o:?}: element {i} (n={n})"
                );
            };
            match o.kind {
                Kind::AllReduce => (0..c_).for_each(|i| check(i, red(i))),
                Kind::Reduce if r == o.root => (0..c_).for_each(|i| check(i, red(i))),
                Kind::Reduce => {}
                Kind::Broadcast => (0..c_).for_each(|i| check(i, val(o.root, kk, i))),
                Kind::AllGather => {
                    (0..n * c_).for_each(|i| check(i, val(i / c_.max(1), kk, i % c_.max(1))))
                }
                Kind::ReduceScatter => {
                    let at = if o.in_place { r * c_ } else { 0 };
                    (0..c_).for_each(|i| check(at + i, red(r * c_ + i)))
                }
                Kind::AlltoAll => (0..n * c_)
                    .for_each(|i| check(i, val(i / c_.max(1), kk, r * c_ + i % c_.max(1)))),
                Kind::Gather if r == o.root => {
                    (0..n * c_).for_each(|i| check(i, val(i / c_.max(1), kk, i % c_.max(1))))
                }
                Kind::Gather => {}
                Kind::Scatter => {
                    let at = if o.in_place { r * c_ } else { 0 };
                    (0..c_).for_each(|i| check(at + i, val(o.root, kk, r * c_ + i)))
                }
                Kind::Shift => (0..c_).for_each(|i| check(i, val(prev, kk, i))),
            }
        }
    }
    api::host_stream_destroy(sh).unwrap();
    api::comm_destroy(api::comm_handle(&c)).unwrap();
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Seed (OXCCL_SOAK_SEED) and length in batches (OXCCL_SOAK_BATCHES) of the sequences.
fn params() -> (u64, usize) {
    (
        env_or("OXCCL_SOAK_SEED", 0x5eed),
        env_or("OXCCL_SOAK_BATCHES", 60),
    )
}

/// Runs `seq` on `n` ranks as threads of this process.
fn run_threads(n: usize, seq: &[(bool, Vec<Op>)]) {
    let id = api::get_unique_id().unwrap();
    std::thread::scope(|s| {
        for r in 0..n {
            let id = &id;
            s.spawn(move || run_rank(n, r, id, seq));
        }
    });
}

/// Ranks as threads of this process: peers' buffers are reachable, so direct (zero-copy)
/// algorithms run.
#[test]
fn random_sequences_threads() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let (seed, batches) = params();
    for n in [2usize, 3, 4] {
        let seq = draw(seed.wrapping_add(n as u64), n, batches);
        run_threads(n, &seq);
    }
}

/// Ranks as processes (this test binary run again as each rank): malloc buffers of other
/// processes are reached through the FIFO rings and cross-memory attach, which every size from
/// 1 KiB on may use here (OXCCL_CMA=1, OXCCL_CMA_MIN_BYTES), so that the tuner's choices vary.
#[test]
fn random_sequences_processes() {
    let (seed, batches) = params();
    if let Some((id, n, r)) = common::rank_env() {
        let seq = draw(seed.wrapping_add(n as u64), n, batches);
        return run_rank(n, r, &id, &seq);
    }
    for n in [2usize, 3] {
        common::run_ranks(
            "random_sequences_processes",
            n,
            &[("OXCCL_CMA", "1"), ("OXCCL_CMA_MIN_BYTES", "1K")],
        );
    }
}

/// Many small operations (the sizes whose whole cost is synchronisation, where races between
/// operations of one communicator would show): at least 10^5 collectives over 2 and 3 ranks as
/// threads (OXCCL_SOAK_SMALL_OPS), every element of every result checked.
#[test]
fn many_small_operations_threads() {
    std::env::set_var("OXCCL_DEVICE", "host");
    let (seed, _) = params();
    let total: usize = env_or("OXCCL_SOAK_SMALL_OPS", 100_000);
    let counts = [0usize, 1, 3, 10, 64, 1000, 5000];
    let t0 = std::time::Instant::now();
    let mut done = 0;
    for n in [2usize, 3] {
        // About 1.75 operations per batch: enough batches for half the total each.
        let batches = (total / 2) * 2 / 3;
        let seq = draw_counts(seed.wrapping_add(100 + n as u64), n, batches, &counts);
        done += seq.iter().map(|(_, ops)| ops.len()).sum::<usize>();
        run_threads(n, &seq);
    }
    assert!(done >= total, "{done} operations run, {total} wanted");
    eprintln!("{done} operations checked in {:?}", t0.elapsed());
}

/// The same between processes (2 ranks, OXCCL_SOAK_SMALL_OPS / 2 operations).
#[test]
fn many_small_operations_processes() {
    let (seed, _) = params();
    let total: usize = env_or("OXCCL_SOAK_SMALL_OPS", 100_000) / 2;
    let counts = [0usize, 1, 3, 10, 64, 1000, 5000];
    let batches = total * 2 / 3;
    if let Some((id, n, r)) = common::rank_env() {
        let seq = draw_counts(seed.wrapping_add(200), n, batches, &counts);
        let done: usize = seq.iter().map(|(_, ops)| ops.len()).sum();
        assert!(done >= total, "{done} operations drawn, {total} wanted");
        return run_rank(n, r, &id, &seq);
    }
    common::run_ranks("many_small_operations_processes", 2, &[]);
}

/// Ranks on several "hosts" (processes with different `OXCCL_HOSTID`s on this machine's
/// loopback; OXCCL_TEST_HOSTS=k puts rank r on host r % k, so the ranks of a host are
/// interleaved with the others'): traffic between hosts goes over the network transport.
/// 2 hosts x 2 ranks, 4 hosts x 1 rank, 2 hosts x 3 ranks.
#[test]
fn random_sequences_across_hosts() {
    let (seed, batches) = params();
    if let Some((id, n, r)) = common::rank_env() {
        let k: usize = env_or("OXCCL_TEST_HOSTS", 1);
        std::env::set_var("OXCCL_HOSTID", format!("soak-host-{}", r % k));
        let seq = draw(seed.wrapping_add(300 + n as u64), n, batches / 2);
        return run_rank(n, r, &id, &seq);
    }
    for (n, hosts) in [(4usize, "2"), (4, "4"), (6, "2")] {
        common::run_ranks(
            "random_sequences_across_hosts",
            n,
            &[("OXCCL_TEST_HOSTS", hosts)],
        );
    }
}

/// The same on real "hosts": network namespaces (own /dev/shm and hostname) joined by veth
/// pairs through a bridge (tests/common/netns.rs; needs root, skipped otherwise): 2 hosts x 2
/// ranks interleaved, 4 x 1, 2 x 3. Rank 0 makes the unique id on its host's eth0
/// (NCCL_SOCKET_IFNAME) and hands it to the others through a file. Every host's eth0 must
/// have carried the traffic.
#[test]
fn random_sequences_on_namespace_hosts() {
    let (seed, batches) = params();
    if let Ok(path) = std::env::var("OXCCL_TEST_ID_FILE") {
        let n: usize = env_or("OXCCL_TEST_N", 0);
        let r = common::netns::test_rank();
        let id = common::netns::id_via_file(&path, r);
        let seq = draw(seed.wrapping_add(400 + n as u64), n, batches / 2);
        return run_rank(n, r, &id, &seq);
    }
    let Some(mut hosts) = common::netns::Hosts::new(4) else {
        return;
    };
    for (n, k) in [(4usize, 2usize), (4, 4), (6, 2)] {
        let path =
            std::env::temp_dir().join(format!("oxccl-netns-id-{}-{n}-{k}", std::process::id()));
        let path = path.display().to_string();
        let _ = std::fs::remove_file(&path);
        let ranks = n.to_string();
        let before: Vec<u64> = (0..k).map(|i| hosts.bytes(i)).collect();
        hosts.start_ranks(
            "random_sequences_on_namespace_hosts",
            &path,
            n,
            |r| r % k,
            &[("OXCCL_TEST_N", &ranks)],
        );
        let ok = hosts.wait();
        let logs = common::netns::joined_logs(&path, n);
        assert!(ok, "{n} ranks on {k} hosts: a rank failed\n{logs}");
        hosts.assert_moved(&before, 1 << 20, &format!("{n} ranks on {k} hosts"));
        let _ = std::fs::remove_file(&path);
    }
}
