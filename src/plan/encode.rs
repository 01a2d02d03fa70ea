//! A task in flat, `#[repr(C)]` form: what a CUDA executor copies to the device for its kernel
//! (arrays of fixed-size records linked by indices, no pointers but the caller's buffers and
//! device-resident scalars), and back. Connections become indices into a table of keys, for
//! which the executor puts each connection's FIFO and counters where its kernel reads them.
//!
//! `decode(encode(t))` is `t`: every field of a plan has a place here (tests check it for every
//! plan kind), so nothing an executor needs can hide in host-only Rust values.

use super::board::{BoardKind, BoardOp};
use super::{Addr, Prim, Program, RedSpec, Stage, Stash, Step, Task, Work};
use crate::error::{Error, Result};
use crate::transport::{Class, ConnKey};
use crate::types::{DataType, ReduceKind, Reduction, Scalar, ScalarArg};

/// No index (no connection, no fallback program).
pub const NONE: u32 = u32::MAX;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatAddr {
    /// 0 none, 1 the caller's memory (`at` is the address), 2 scratch `idx` (`at` is the offset).
    pub kind: u32,
    pub idx: u32,
    pub at: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatStep {
    pub prim: u32,
    pub prep: u32,
    /// Indices into `Flat::conns`, or `NONE`.
    pub send: u32,
    pub recv: u32,
    pub src: FlatAddr,
    pub dst: FlatAddr,
    pub len: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatRed {
    /// 0 none, 1 ready, 2 PreMulSum with its scalar in `scalar` (bits), 3 PreMulSum with its
    /// scalar at address `scalar` (read when the work runs).
    pub kind: u32,
    pub dtype: i32,
    /// `ReduceKind` (Sum 0, Prod 1, Max 2, Min 3).
    pub op: u32,
    /// Bit 0: `premul` holds a scalar; bit 1: `postdiv` holds a divisor.
    pub flags: u32,
    pub scalar: u64,
    pub postdiv: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatProgram {
    pub first_step: u32,
    pub nsteps: u32,
    pub esize: u64,
    pub slice: u64,
    pub niter: u64,
    pub red: FlatRed,
    /// The call's words (see `plan::call`), checked against each received slot's.
    pub call: [u64; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatDirect {
    pub seq: u64,
    pub rank: u32,
    pub nranks: u32,
    /// `BoardKind` (AllReduce 0, Reduce 1, ReduceScatter 2, AllGather 3, Broadcast 4).
    pub kind: u32,
    pub dtype: i32,
    pub send: u64,
    pub recv: u64,
    pub count: u64,
    pub root: u64,
    pub red: FlatRed,
    /// Index into `Flat::programs` of the ring to fall back on, or `NONE` (eager).
    pub fallback: u32,
    pub _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatWork {
    /// 0: `index` is a program; 1: `index` is a direct operation.
    pub kind: u32,
    pub index: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatLane {
    pub first_work: u32,
    pub nworks: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatCopy {
    pub src: u64,
    pub bytes: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatStage {
    pub first_lane: u32,
    pub nlanes: u32,
    pub first_copy: u32,
    pub ncopies: u32,
    /// Output spoiled on purpose (`OXCCL_FAULT=corrupt`): `has_fault` 1, then type, address,
    /// elements.
    pub has_fault: u32,
    pub fault_dtype: i32,
    pub fault_addr: u64,
    pub fault_count: u64,
}

/// A connection a step names: the peer, which end this rank is, the traffic class.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatConn {
    pub peer: u32,
    pub is_sender: u32,
    /// `Class` (Ring 0, P2p 1, Direct 2, Tree 3).
    pub class: u32,
    pub _pad: u32,
}

/// Where a task's point-to-point lanes and copies are.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlatHeader {
    pub nstages: u32,
    pub first_p2p_lane: u32,
    pub np2p_lanes: u32,
    pub first_p2p_copy: u32,
    pub np2p_copies: u32,
    /// `Task::p2p_after`, plus one (0: None).
    pub p2p_after: u32,
}

/// A task as arrays of flat records.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Flat {
    pub header: FlatHeader,
    pub stages: Vec<FlatStage>,
    pub lanes: Vec<FlatLane>,
    pub works: Vec<FlatWork>,
    pub programs: Vec<FlatProgram>,
    pub steps: Vec<FlatStep>,
    pub directs: Vec<FlatDirect>,
    pub copies: Vec<FlatCopy>,
    /// The connections steps name by index.
    pub conns: Vec<FlatConn>,
}

const CLASSES: [Class; 7] = [
    Class::Ring,
    Class::P2p,
    Class::Direct,
    Class::Tree,
    Class::Ring1,
    Class::Ring2,
    Class::Ring3,
];

fn idx(n: usize) -> Result<u32> {
    u32::try_from(n)
        .ok()
        .filter(|&i| i != NONE)
        .ok_or_else(|| Error::internal("a plan too large to encode"))
}

fn prim_code(p: Prim) -> u32 {
    PRIMS
        .iter()
        .position(|&q| q == p)
        .expect("every primitive is listed") as u32
}

const PRIMS: [Prim; 9] = [
    Prim::Send,
    Prim::Recv,
    Prim::CopySend,
    Prim::RecvCopySend,
    Prim::RecvReduceSend,
    Prim::RecvReduceCopy,
    Prim::RecvReduceCopySend,
    Prim::LocalCopy,
    Prim::LocalReduce,
];

const REDUCE_KINDS: [ReduceKind; 4] = [
    ReduceKind::Sum,
    ReduceKind::Prod,
    ReduceKind::Max,
    ReduceKind::Min,
];

const BOARD_KINDS: &[BoardKind] = BoardKind::ALL;

fn pick<T: Copy>(table: &[T], code: u32, what: &str) -> Result<T> {
    table
        .get(code as usize)
        .copied()
        .ok_or_else(|| Error::internal(format!("flat plan: bad {what} code {code}")))
}

fn enc_addr(a: Addr) -> FlatAddr {
    match a {
        Addr::None => FlatAddr::default(),
        Addr::User(x) => FlatAddr {
            kind: 1,
            idx: 0,
            at: x as u64,
        },
        Addr::Scratch { idx, off } => FlatAddr {
            kind: 2,
            idx,
            at: off as u64,
        },
    }
}

fn dec_addr(a: FlatAddr) -> Result<Addr> {
    Ok(match a.kind {
        0 => Addr::None,
        1 => Addr::User(a.at as usize),
        2 => Addr::Scratch {
            idx: a.idx,
            off: a.at as usize,
        },
        k => return Err(Error::internal(format!("flat plan: bad address kind {k}"))),
    })
}

fn enc_red(r: Option<RedSpec>) -> FlatRed {
    let reduction = |r: Reduction, kind: u32| FlatRed {
        kind,
        dtype: r.dtype as i32,
        op: REDUCE_KINDS.iter().position(|&k| k == r.kind).unwrap_or(0) as u32,
        flags: u32::from(r.premul.is_some()) | (u32::from(r.postdiv.is_some()) << 1),
        scalar: r.premul.map_or(0, |s| s.bits),
        postdiv: r.postdiv.unwrap_or(0),
    };
    match r {
        None => FlatRed::default(),
        Some(RedSpec::Ready(r)) => reduction(r, 1),
        Some(RedSpec::PreMul { dtype, scalar }) => {
            let (kind, scalar) = match scalar {
                ScalarArg::Host(s) => (2, s.bits),
                ScalarArg::Device(a) => (3, a as u64),
            };
            FlatRed {
                kind,
                dtype: dtype as i32,
                scalar,
                ..FlatRed::default()
            }
        }
    }
}

fn dec_red(f: FlatRed) -> Result<Option<RedSpec>> {
    if f.kind == 0 {
        return Ok(None);
    }
    let dtype = DataType::from_raw(f.dtype)?;
    Ok(Some(match f.kind {
        1 => RedSpec::Ready(Reduction {
            dtype,
            kind: pick(&REDUCE_KINDS, f.op, "reduction")?,
            premul: (f.flags & 1 != 0).then_some(Scalar { bits: f.scalar }),
            postdiv: (f.flags & 2 != 0).then_some(f.postdiv),
        }),
        2 => RedSpec::PreMul {
            dtype,
            scalar: ScalarArg::Host(Scalar { bits: f.scalar }),
        },
        3 => RedSpec::PreMul {
            dtype,
            scalar: ScalarArg::Device(f.scalar as usize),
        },
        k => {
            return Err(Error::internal(format!(
                "flat plan: bad reduction kind {k}"
            )))
        }
    }))
}

struct Encoder {
    f: Flat,
}

/// The index of connection `c` in `conns` (added if new), `NONE` for no connection.
fn key_index(conns: &mut Vec<FlatConn>, c: &Option<ConnKey>) -> Result<u32> {
    let Some(k) = c else { return Ok(NONE) };
    let r = FlatConn {
        peer: idx(k.peer())?,
        is_sender: k.is_sender as u32,
        class: k.class as u32,
        _pad: 0,
    };
    match conns.iter().position(|x| *x == r) {
        Some(i) => idx(i),
        None => {
            conns.push(r);
            idx(conns.len() - 1)
        }
    }
}

/// What `encode_program` appends to: a `Vec`, or a `SmallVec` (the CUDA executor's descriptor
/// holds a small launch's in place).
pub trait Append<T> {
    fn count(&self) -> usize;
    fn append(&mut self, item: T);
}

impl<T> Append<T> for Vec<T> {
    fn count(&self) -> usize {
        self.len()
    }
    fn append(&mut self, item: T) {
        self.push(item)
    }
}

impl<A: smallvec::Array> Append<A::Item> for smallvec::SmallVec<A> {
    fn count(&self) -> usize {
        self.len()
    }
    fn append(&mut self, item: A::Item) {
        self.push(item)
    }
}

/// Appends program `p` (its steps to `steps`, itself to `programs`), naming each connection
/// by the index `conn` gives it (`NONE` for none): the one flat form of a program, which the
/// CUDA executor's kernels read (`cuda/runner.cu`). Returns the program's index.
pub fn encode_program<C>(
    p: &Program<C>,
    steps: &mut impl Append<FlatStep>,
    programs: &mut impl Append<FlatProgram>,
    mut conn: impl FnMut(&Option<C>) -> Result<u32>,
) -> Result<u32> {
    let first_step = idx(steps.count())?;
    for s in &p.steps {
        let step = FlatStep {
            prim: prim_code(s.prim),
            prep: s.prep as u32,
            send: conn(&s.send)?,
            recv: conn(&s.recv)?,
            src: enc_addr(s.src),
            dst: enc_addr(s.dst),
            len: s.len as u64,
        };
        steps.append(step);
    }
    programs.append(FlatProgram {
        first_step,
        nsteps: idx(p.steps.len())?,
        esize: p.esize as u64,
        slice: p.slice as u64,
        niter: p.niter as u64,
        red: enc_red(p.red),
        call: p.call,
    });
    idx(programs.count() - 1)
}

impl Encoder {
    fn program(&mut self, p: &Program) -> Result<u32> {
        let conns = &mut self.f.conns;
        encode_program(p, &mut self.f.steps, &mut self.f.programs, |c| {
            key_index(conns, c)
        })
    }

    fn direct(&mut self, op: &BoardOp) -> Result<u32> {
        let fallback = match &op.fallback {
            Some(p) => self.program(p)?,
            None => NONE,
        };
        self.f.directs.push(FlatDirect {
            seq: op.seq,
            rank: idx(op.rank)?,
            nranks: idx(op.nranks)?,
            kind: BOARD_KINDS.iter().position(|&k| k == op.kind).unwrap_or(0) as u32,
            dtype: op.dtype as i32,
            send: op.send as u64,
            recv: op.recv as u64,
            count: op.count as u64,
            root: op.root as u64,
            red: enc_red(op.red),
            fallback,
            _pad: 0,
        });
        idx(self.f.directs.len() - 1)
    }

    /// Encodes lanes; (first lane, count).
    fn lanes(&mut self, lanes: &[Vec<Work>]) -> Result<(u32, u32)> {
        // Lanes are contiguous: their works are encoded first, then the lane records.
        let mut recs = Vec::with_capacity(lanes.len());
        for l in lanes {
            let works: Vec<FlatWork> = l
                .iter()
                .map(|w| {
                    Ok(match w {
                        Work::Steps(p) => FlatWork {
                            kind: 0,
                            index: self.program(p)?,
                        },
                        Work::Board(op) => FlatWork {
                            kind: 1,
                            index: self.direct(op)?,
                        },
                    })
                })
                .collect::<Result<_>>()?;
            recs.push(FlatLane {
                first_work: idx(self.f.works.len())?,
                nworks: idx(works.len())?,
            });
            self.f.works.extend(works);
        }
        let first = idx(self.f.lanes.len())?;
        self.f.lanes.extend(recs);
        Ok((first, idx(lanes.len())?))
    }

    fn copies(&mut self, s: &Stash) -> Result<(u32, u32)> {
        let first = idx(self.f.copies.len())?;
        self.f
            .copies
            .extend(s.copies.iter().map(|&(src, bytes)| FlatCopy {
                src: src as u64,
                bytes: bytes as u64,
            }));
        Ok((first, idx(s.copies.len())?))
    }
}

/// The flat form of a task.
pub fn encode(t: &Task) -> Result<Flat> {
    let mut e = Encoder { f: Flat::default() };
    for s in &t.stages {
        let (first_lane, nlanes) = e.lanes(&s.lanes)?;
        let (first_copy, ncopies) = e.copies(&s.stash)?;
        let (dt, addr, count) = s.fault.unwrap_or((DataType::Int8, 0, 0));
        e.f.stages.push(FlatStage {
            first_lane,
            nlanes,
            first_copy,
            ncopies,
            has_fault: s.fault.is_some() as u32,
            fault_dtype: dt as i32,
            fault_addr: addr as u64,
            fault_count: count as u64,
        });
    }
    let (first_p2p_lane, np2p_lanes) = e.lanes(&t.p2p)?;
    let (first_p2p_copy, np2p_copies) = e.copies(&t.p2p_stash)?;
    e.f.header = FlatHeader {
        nstages: idx(t.stages.len())?,
        first_p2p_lane,
        np2p_lanes,
        first_p2p_copy,
        np2p_copies,
        p2p_after: match t.p2p_after {
            None => 0,
            Some(n) => idx(n + 1)?,
        },
    };
    Ok(e.f)
}

fn range<T>(v: &[T], first: u32, n: u32, what: &str) -> Result<std::ops::Range<usize>> {
    let (a, b) = (first as usize, first as usize + n as usize);
    if b > v.len() {
        return Err(Error::internal(format!(
            "flat plan: {what} {a}..{b} outside its {} records",
            v.len()
        )));
    }
    Ok(a..b)
}

fn at<T: Copy>(v: &[T], i: u32, what: &str) -> Result<T> {
    v.get(i as usize)
        .copied()
        .ok_or_else(|| Error::internal(format!("flat plan: no {what} {i}")))
}

fn dec_program(f: &Flat, i: u32) -> Result<Program> {
    let p = at(&f.programs, i, "program")?;
    let conn = |c: u32| -> Result<Option<ConnKey>> {
        if c == NONE {
            return Ok(None);
        }
        let k = at(&f.conns, c, "connection")?;
        Ok(Some(ConnKey::new(
            k.peer as usize,
            k.is_sender != 0,
            pick(&CLASSES, k.class, "connection class")?,
        )))
    };
    let steps = f.steps[range(&f.steps, p.first_step, p.nsteps, "steps")?]
        .iter()
        .map(|s| {
            Ok(Step {
                prim: pick(&PRIMS, s.prim, "primitive")?,
                recv: conn(s.recv)?,
                send: conn(s.send)?,
                src: dec_addr(s.src)?,
                dst: dec_addr(s.dst)?,
                len: s.len as usize,
                prep: s.prep != 0,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Program {
        steps,
        esize: p.esize as usize,
        slice: p.slice as usize,
        niter: p.niter as usize,
        red: dec_red(p.red)?,
        call: p.call,
    })
}

fn dec_lanes(f: &Flat, first: u32, n: u32) -> Result<Vec<Vec<Work>>> {
    f.lanes[range(&f.lanes, first, n, "lanes")?]
        .iter()
        .map(|l| {
            f.works[range(&f.works, l.first_work, l.nworks, "works")?]
                .iter()
                .map(|w| {
                    Ok(match w.kind {
                        0 => Work::Steps(dec_program(f, w.index)?),
                        1 => {
                            let d = at(&f.directs, w.index, "direct operation")?;
                            Work::Board(Box::new(BoardOp {
                                seq: d.seq,
                                rank: d.rank as usize,
                                nranks: d.nranks as usize,
                                kind: pick(BOARD_KINDS, d.kind, "direct operation")?,
                                send: d.send as usize,
                                recv: d.recv as usize,
                                count: d.count as usize,
                                dtype: DataType::from_raw(d.dtype)?,
                                red: dec_red(d.red)?,
                                root: d.root as usize,
                                fallback: match d.fallback {
                                    NONE => None,
                                    p => Some(Box::new(dec_program(f, p)?)),
                                },
                            }))
                        }
                        k => return Err(Error::internal(format!("flat plan: bad work kind {k}"))),
                    })
                })
                .collect()
        })
        .collect()
}

fn dec_copies(f: &Flat, first: u32, n: u32) -> Result<Stash> {
    Ok(Stash {
        copies: f.copies[range(&f.copies, first, n, "copies")?]
            .iter()
            .map(|c| (c.src as usize, c.bytes as usize))
            .collect(),
    })
}

/// The task a flat form describes; malformed records are an error, never a panic.
pub fn decode(f: &Flat) -> Result<Task> {
    let h = f.header;
    if h.nstages as usize != f.stages.len() {
        return Err(Error::internal("flat plan: stage count mismatch"));
    }
    let stages = f
        .stages
        .iter()
        .map(|s| {
            Ok(Stage {
                lanes: dec_lanes(f, s.first_lane, s.nlanes)?.into(),
                fault: if s.has_fault != 0 {
                    Some((
                        DataType::from_raw(s.fault_dtype)?,
                        s.fault_addr as usize,
                        s.fault_count as usize,
                    ))
                } else {
                    None
                },
                stash: dec_copies(f, s.first_copy, s.ncopies)?,
            })
        })
        .collect::<Result<_>>()?;
    Ok(Task {
        stages,
        p2p: dec_lanes(f, h.first_p2p_lane, h.np2p_lanes)?,
        p2p_stash: dec_copies(f, h.first_p2p_copy, h.np2p_copies)?,
        p2p_after: h.p2p_after.checked_sub(1).map(|n| n as usize),
    })
}
