//! Plans are executor-agnostic data: every plan kind of the C matrix (ffi-tests/coll_matrix.c:
//! every collective, SendRecv and AlltoAllv groups, every datatype and reduction, in and out of
//! place, several counts, every root and rank, with and without direct operations) encodes into
//! the flat `#[repr(C)]` form a kernel would read, and decodes back to the same plan.

use super::build::build_task;
use super::encode::{self, Flat, FlatAddr, FlatDirect, FlatProgram, FlatRed, FlatStep};
use super::ring::Links;
use super::{Addr, Program, RedSpec, Task, Work};
use crate::transport::ConnKey;
use crate::types::{
    CollArgs, CollKind, DataType, ReduceKind, Reduction, Scalar, ScalarArg, OP_SUM,
};
use std::fmt::Write;

/// One rank's shape (planning names connections by key: nothing is connected).
struct TestLinks {
    rank: usize,
    nranks: usize,
}

impl TestLinks {
    fn new(rank: usize, nranks: usize) -> TestLinks {
        TestLinks { rank, nranks }
    }
}

impl Links for TestLinks {
    fn rank(&self) -> usize {
        self.rank
    }
    fn nranks(&self) -> usize {
        self.nranks
    }
    fn slot_bytes(&self) -> usize {
        4096
    }
}

/// Everything a plan says.
fn show(t: &Task) -> String {
    fn conn(c: &Option<ConnKey>) -> String {
        c.map_or("-".into(), |k| format!("{k:?}"))
    }
    fn prog(o: &mut String, p: &Program) {
        let _ = write!(
            o,
            "[prog esize {} slice {} niter {} red {:?} call {:?}:",
            p.esize, p.slice, p.niter, p.red, p.call
        );
        for s in &p.steps {
            let _ = write!(
                o,
                " {:?} {:?}->{:?} len {} prep {} send {} recv {};",
                s.prim,
                s.src,
                s.dst,
                s.len,
                s.prep,
                conn(&s.send),
                conn(&s.recv)
            );
        }
        o.push(']');
    }
    fn lanes(o: &mut String, ls: &[Vec<Work>]) {
        for l in ls {
            o.push_str("\n  lane:");
            for w in l {
                match w {
                    Work::Steps(p) => prog(o, p),
                    Work::Board(b) => {
                        let _ = write!(
                            o,
                            "[direct seq {} {}/{} {:?} {:#x}->{:#x} count {} {:?} red {:?} root {}",
                            b.seq,
                            b.rank,
                            b.nranks,
                            b.kind,
                            b.send,
                            b.recv,
                            b.count,
                            b.dtype,
                            b.red,
                            b.root
                        );
                        if let Some(f) = &b.fallback {
                            o.push_str(" fallback ");
                            prog(o, f);
                        }
                        o.push(']');
                    }
                }
            }
        }
    }
    let mut o = String::new();
    for s in &t.stages {
        let _ = write!(o, "\nstage fault {:?} stash {:?}", s.fault, s.stash);
        lanes(&mut o, &s.lanes);
    }
    let _ = write!(o, "\np2p stash {:?} after {:?}", t.p2p_stash, t.p2p_after);
    lanes(&mut o, &t.p2p);
    o
}

/// The reductions of the C matrix for `dtype` over `n` ranks: the builtins (avg as the engine
/// resolves it), PreMulSum with a host-immediate and with a device-resident scalar.
fn reductions(dtype: DataType, n: usize) -> Vec<RedSpec> {
    let ready = |kind, premul, postdiv| {
        RedSpec::Ready(Reduction {
            dtype,
            kind,
            premul,
            postdiv,
        })
    };
    let mut v: Vec<RedSpec> = [
        ReduceKind::Sum,
        ReduceKind::Prod,
        ReduceKind::Max,
        ReduceKind::Min,
    ]
    .into_iter()
    .map(|k| ready(k, None, None))
    .collect();
    v.push(if dtype.is_float() {
        ready(
            ReduceKind::Sum,
            Some(crate::reduce::scalar_from_f64(dtype, 1.0 / n as f64)),
            None,
        )
    } else {
        ready(ReduceKind::Sum, None, Some(n as u64))
    });
    v.push(RedSpec::PreMul {
        dtype,
        scalar: ScalarArg::Host(Scalar { bits: 3 }),
    });
    v.push(RedSpec::PreMul {
        dtype,
        scalar: ScalarArg::Device(0x5ca1a8),
    });
    v
}

/// Encodes and decodes `t`; both directions must keep every field.
fn round_trip(t: &Task, what: &dyn Fn() -> String) -> Flat {
    let f = encode::encode(t).unwrap_or_else(|e| panic!("{}: encode: {e}", what()));
    let back = encode::decode(&f).unwrap_or_else(|e| panic!("{}: decode: {e}", what()));
    assert_eq!(show(&back), show(t), "{}", what());
    let again = encode::encode(&back).unwrap();
    assert_eq!(again, f, "{}: re-encoding differs", what());
    f
}

const BUF: usize = 0x1000_0000;

/// The host executor's offer (direct operations or not, its eager limit).
fn caps(direct: bool) -> super::build::Caps {
    super::build::Caps {
        direct,
        direct_algo: "Direct (Ring fallback)",
        direct_fallback: true,
        eager_bytes: crate::transport::board::INLINE,
        channels: 1,
    }
}

#[test]
fn every_plan_kind_of_the_c_matrix_encodes_and_decodes() {
    use CollKind::*;
    let mut tasks = 0usize;
    let mut kinds = std::collections::BTreeSet::new();
    for n in [1usize, 2, 3, 4, 8] {
        for rank in 0..n {
            let links = TestLinks::new(rank, n);
            for direct in [false, true] {
                for kind in [
                    AllReduce,
                    Broadcast,
                    Reduce,
                    AllGather,
                    ReduceScatter,
                    AlltoAll,
                    Gather,
                    Scatter,
                ] {
                    let reduces = matches!(kind, AllReduce | Reduce | ReduceScatter);
                    let rooted = matches!(kind, Broadcast | Reduce | Gather | Scatter);
                    // Every datatype with the matrix's small counts; the big count with a few.
                    for dtype in DataType::ALL {
                        let reds: Vec<Option<RedSpec>> = if reduces {
                            reductions(dtype, n).into_iter().map(Some).collect()
                        } else {
                            vec![None]
                        };
                        let counts: &[usize] =
                            if matches!(dtype, DataType::Float32 | DataType::Int8) {
                                &[0, 1, 7, 70000]
                            } else {
                                &[1, 7]
                            };
                        for &count in counts {
                            for in_place in [false, true] {
                                for root in 0..if rooted { n } else { 1 } {
                                    for red in &reds {
                                        let recv = BUF + (1 << 24);
                                        // In place: the output's slot of this rank is the input.
                                        let send = if in_place {
                                            match kind {
                                                AllGather | Gather => {
                                                    recv + rank * count * dtype.size()
                                                }
                                                _ => recv,
                                            }
                                        } else {
                                            BUF
                                        };
                                        let a = CollArgs {
                                            kind,
                                            send,
                                            recv,
                                            count,
                                            dtype,
                                            op: OP_SUM,
                                            root: root as i32,
                                        };
                                        let t =
                                            build_task(&links, caps(direct), &[(a, *red)], |c| *c)
                                                .unwrap();
                                        let f = round_trip(&t, &|| {
                                            format!("{kind:?} n {n} rank {rank} root {root} {dtype:?} count {count} in place {in_place} direct {direct} red {red:?}")
                                        });
                                        kinds.insert(shape(&f));
                                        tasks += 1;
                                    }
                                }
                            }
                        }
                    }
                }
            }
            // SendRecv (a ring shift) and AlltoAllv (to and from every peer, itself included,
            // with counts that differ per pair), out of place and with sends from the buffer
            // the group's receives write (a private copy: scratch).
            for count in [0usize, 1, 7, 70000] {
                for in_place in [false, true] {
                    let es = 4;
                    let recv_at = |p: usize| BUF + (1 << 24) + p * (count + p) * es;
                    let send_at = |p: usize| {
                        if in_place {
                            recv_at(p)
                        } else {
                            BUF + p * (count + p) * es
                        }
                    };
                    let call = |kind, at: usize, c: usize, peer: usize| {
                        (
                            CollArgs {
                                kind,
                                send: at,
                                recv: at,
                                count: c,
                                dtype: DataType::Float32,
                                op: OP_SUM,
                                root: peer as i32,
                            },
                            None,
                        )
                    };
                    let shift = [
                        call(Send, send_at(0), count, (rank + 1) % n),
                        call(Recv, recv_at(0), count, (rank + n - 1) % n),
                    ];
                    let mut v = Vec::new();
                    for p in 0..n {
                        v.push(call(Send, send_at(p), count + p + rank, p));
                        v.push(call(Recv, recv_at(p), count + p + rank, p));
                    }
                    // A collective called before the shift, in the same group.
                    let mut after = vec![call(Broadcast, BUF + (1 << 26), count, 0)];
                    after.extend_from_slice(&shift);
                    for (name, calls) in [
                        ("SendRecv", &shift[..]),
                        ("AlltoAllv", &v[..]),
                        ("Broadcast, then SendRecv", &after[..]),
                    ] {
                        let t = build_task(&links, caps(true), calls, |c| *c).unwrap();
                        // The point-to-point lanes go beside the last stage (here every
                        // collective is called before the point-to-point calls).
                        let before = t.stages.len();
                        assert_eq!(t.p2p_after, Some(before), "{name}");
                        assert_eq!(t.p2p_stage(), before.saturating_sub(1), "{name}");
                        let f = round_trip(&t, &|| {
                            format!("{name} n {n} rank {rank} count {count} in place {in_place}")
                        });
                        kinds.insert(shape(&f));
                        tasks += 1;
                    }
                }
            }
        }
    }
    // The matrix covers every kind of record the flat form has.
    let all: std::collections::BTreeSet<&str> = kinds.iter().flatten().copied().collect();
    for k in [
        "ring program",
        "direct eager",
        "direct with fallback",
        "scratch address",
        "stage stash",
        "p2p stash",
        "p2p lanes",
        "p2p after a collective",
        "device scalar",
        "host scalar",
        "postdiv",
        "premul",
        "fault",
    ] {
        assert!(all.contains(k), "no plan of the matrix has a {k}: {all:?}");
    }
    assert!(tasks > 10_000, "{tasks} tasks");
}

/// The kinds of records a flat task holds, for the coverage check.
fn shape(f: &Flat) -> Vec<&'static str> {
    let mut v = Vec::new();
    if f.programs.iter().any(|p| p.nsteps > 1) {
        v.push("ring program");
    }
    if f.directs.iter().any(|d| d.fallback == encode::NONE) {
        v.push("direct eager");
    }
    if f.directs.iter().any(|d| d.fallback != encode::NONE) {
        v.push("direct with fallback");
    }
    if f.steps.iter().any(|s| s.src.kind == 2 || s.dst.kind == 2) {
        v.push("scratch address");
    }
    if f.stages.iter().any(|s| s.ncopies > 0) {
        v.push("stage stash");
    }
    if f.header.np2p_copies > 0 {
        v.push("p2p stash");
    }
    if f.header.np2p_lanes > 0 {
        v.push("p2p lanes");
    }
    if f.header.p2p_after > 1 {
        v.push("p2p after a collective");
    }
    let reds = f
        .programs
        .iter()
        .map(|p| p.red)
        .chain(f.directs.iter().map(|d| d.red));
    for r in reds {
        match r.kind {
            3 => v.push("device scalar"),
            2 => v.push("host scalar"),
            1 if r.flags & 2 != 0 => v.push("postdiv"),
            1 if r.flags & 1 != 0 => v.push("premul"),
            _ => {}
        }
    }
    if f.stages.iter().any(|s| s.has_fault != 0) {
        v.push("fault");
    }
    v
}

/// The records have the fixed C layout a kernel reads (sizes and alignment of every field).
#[test]
fn flat_records_have_a_fixed_c_layout() {
    use std::mem::{align_of, size_of};
    assert_eq!(size_of::<FlatAddr>(), 16);
    assert_eq!(size_of::<FlatStep>(), 56);
    assert_eq!(size_of::<FlatRed>(), 32);
    assert_eq!(size_of::<FlatProgram>(), 80);
    assert_eq!(size_of::<FlatDirect>(), 96);
    for a in [
        align_of::<FlatAddr>(),
        align_of::<FlatStep>(),
        align_of::<FlatProgram>(),
        align_of::<FlatDirect>(),
    ] {
        assert_eq!(a, 8);
    }
}

/// Malformed flat records are errors, not panics.
#[test]
fn decoding_rejects_malformed_records() {
    let links = TestLinks::new(0, 3);
    let a = CollArgs {
        kind: CollKind::AllReduce,
        send: BUF,
        recv: BUF + 4096,
        count: 70000,
        dtype: DataType::Float32,
        op: OP_SUM,
        root: 0,
    };
    let red = reductions(DataType::Float32, 3)[0];
    let t = build_task(&links, caps(false), &[(a, Some(red))], |c| *c).unwrap();
    let f = encode::encode(&t).unwrap();
    let mut bad = f.clone();
    bad.steps[0].prim = 99;
    assert!(encode::decode(&bad).is_err());
    let mut bad = f.clone();
    bad.programs[0].nsteps = 1000;
    assert!(encode::decode(&bad).is_err());
    let mut bad = f.clone();
    bad.steps[0].send = 77;
    assert!(encode::decode(&bad).is_err());
    let mut bad = f.clone();
    bad.programs[0].red.dtype = 42;
    assert!(encode::decode(&bad).is_err());
    let mut bad = f;
    bad.stages[0].nlanes = 9;
    assert!(encode::decode(&bad).is_err());
    // A scratch address keeps its index and offset.
    assert_eq!(
        Addr::Scratch { idx: 2, off: 8 } + 4,
        Addr::Scratch { idx: 2, off: 12 }
    );
}

#[test]
fn a_large_ring_collective_splits_across_channels() {
    use super::build::{channel_parts, Caps, CHANNEL_MIN_BYTES};
    use crate::transport::Class;
    // The parts cover the elements in order, each but the last a multiple of 16 bytes, at most
    // as many as asked and as the data holds CHANNEL_MIN_BYTES.
    for (count, esize, ch) in [
        (300_001usize, 4usize, 4usize),
        (1000, 4, 4),
        (1 << 20, 2, 3),
        (65_537, 8, 2),
        (CHANNEL_MIN_BYTES * 4 - 1, 1, 4),
        (7, 1, 4),
    ] {
        let parts = channel_parts(count, esize, ch);
        let mut at = 0;
        for &(first, n) in &parts {
            assert_eq!(first, at, "{count} x {esize} over {ch}: {parts:?}");
            assert!(n > 0, "{parts:?}");
            at += n;
        }
        assert_eq!(at, count, "{parts:?}");
        for &(_, n) in &parts[..parts.len() - 1] {
            assert_eq!(n * esize % 16, 0, "{parts:?}");
        }
        let most = ch.min((count * esize / CHANNEL_MIN_BYTES).max(1));
        assert!(
            parts.len() <= most,
            "{count} x {esize} over {ch}: {parts:?}"
        );
    }
    assert_eq!(channel_parts(1000, 4, 4).len(), 1);
    assert_eq!(channel_parts(300_001, 4, 4).len(), 4);
    assert_eq!(channel_parts(300_001, 4, 2).len(), 2);

    // An all-reduce, broadcast or reduce of 1.2 MB on 3 ranks, 4 channels: one stage of 4
    // lanes, lane k on channel k's ring connections over part k; the other collectives and
    // small ones keep one lane; each plan encodes and decodes.
    let caps = Caps {
        direct: false,
        direct_algo: "",
        direct_fallback: false,
        eager_bytes: 0,
        channels: 4,
    };
    let red = Some(RedSpec::Ready(Reduction {
        dtype: DataType::Float32,
        kind: ReduceKind::Sum,
        premul: None,
        postdiv: None,
    }));
    for kind in [
        CollKind::AllReduce,
        CollKind::Broadcast,
        CollKind::Reduce,
        CollKind::AllGather,
    ] {
        for (count, split) in [(300_001usize, true), (1000, false)] {
            for rank in 0..3 {
                let links = TestLinks::new(rank, 3);
                let a = CollArgs {
                    kind,
                    send: BUF,
                    recv: BUF + (1 << 24),
                    count,
                    dtype: DataType::Float32,
                    op: OP_SUM,
                    root: 1,
                };
                let red = if kind == CollKind::Broadcast || kind == CollKind::AllGather {
                    None
                } else {
                    red
                };
                let t = build_task(&links, caps, &[(a, red)], |c| *c).unwrap();
                let what = || format!("{kind:?} of {count} on rank {rank}");
                round_trip(&t, &what);
                assert_eq!(t.stages.len(), 1, "{}", what());
                let lanes = &t.stages[0].lanes;
                let split = split && kind != CollKind::AllGather;
                assert_eq!(lanes.len(), if split { 4 } else { 1 }, "{}", what());
                if !split {
                    continue;
                }
                let parts = channel_parts(count, 4, 4);
                for (k, lane) in lanes.iter().enumerate() {
                    let [Work::Steps(p)] = lane.as_slice() else {
                        panic!("{}: lane {k} is not one program", what())
                    };
                    let mut conns = 0;
                    for s in &p.steps {
                        for c in [s.send, s.recv].into_iter().flatten() {
                            assert_eq!(c.class, Class::ring(k), "{}", what());
                            conns += 1;
                        }
                    }
                    assert!(conns > 0, "{}", what());
                    // The lane's user addresses lie in its part of the input or output.
                    let (first, n) = parts[k];
                    for s in &p.steps {
                        for (addr, base) in [(&s.src, a.send), (&s.dst, a.recv)] {
                            if let Addr::User(at) = addr {
                                let lo = base + 4 * first;
                                assert!(
                                    *at >= lo && *at + 4 * s.len <= lo + 4 * n,
                                    "{}: lane {k}: {at:#x}+{} outside part {first}+{n}",
                                    what(),
                                    s.len
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
