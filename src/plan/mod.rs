//! Planning: a collective or point-to-point call becomes, on each rank, a set of *lanes* of
//! *programs*. A program is a list of primitive steps (NCCL's vocabulary: send, recv, copySend,
//! recvCopySend, recvReduceSend, recvReduceCopy, recvReduceCopySend, localCopy) over connections,
//! repeated for each slice of the data (one FIFO slot per step and slice). Lanes run concurrently;
//! the programs of a lane run in order. Executors run programs without knowing the transport.
//!
//! Plans are data: nothing here runs, waits or owns executor state (`build` chooses the
//! algorithms; `task` is what an executor is handed).

pub mod algo;
pub mod board;
pub mod build;
pub mod call;
pub mod direct;
pub mod encode;
pub mod hier;
pub mod ring;
pub mod task;
#[cfg(test)]
mod tests;

pub use task::{Stages, Task, What};

use crate::error::Result;
use crate::transport::ConnKey;
use crate::types::{CollKind, DataType, ReduceKind, Reduction, Scalar, ScalarArg};
use smallvec::SmallVec;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prim {
    /// slot <- pre?(src)
    Send,
    /// dst <- slot
    Recv,
    /// dst <- src; slot <- src
    CopySend,
    /// dst <- in; slot <- in
    RecvCopySend,
    /// slot <- pre(src) op in
    RecvReduceSend,
    /// dst <- post(pre(src) op in)
    RecvReduceCopy,
    /// dst <- post(pre(src) op in); slot <- dst
    RecvReduceCopySend,
    /// dst <- src
    LocalCopy,
    /// dst <- post(pre(src))  (a reduction over one rank)
    LocalReduce,
}

impl Prim {
    /// Whether the step writes the caller's output (`dst`).
    pub fn writes_dst(self) -> bool {
        !matches!(self, Prim::Send | Prim::RecvReduceSend)
    }

    /// Whether the step reads the caller's input (`src`).
    pub fn reads_src(self) -> bool {
        !matches!(self, Prim::Recv | Prim::RecvCopySend)
    }

    pub fn recvs(self) -> bool {
        matches!(
            self,
            Prim::Recv
                | Prim::RecvCopySend
                | Prim::RecvReduceSend
                | Prim::RecvReduceCopy
                | Prim::RecvReduceCopySend
        )
    }
    pub fn sends(self) -> bool {
        matches!(
            self,
            Prim::Send
                | Prim::CopySend
                | Prim::RecvCopySend
                | Prim::RecvReduceSend
                | Prim::RecvReduceCopySend
        )
    }
}

/// Where a step reads or writes, typed: the caller's buffer, or scratch the executor provides
/// in stream order (a copy of an input it takes when the work starts). Connection slots are the
/// step's `send`/`recv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Addr {
    /// No buffer: the step only moves a connection slot on that side.
    None,
    /// The caller's memory at this address (host or device memory, as the executor's is).
    User(usize),
    /// `off` bytes into scratch `idx` of the work's stash (the stage's for stage lanes, the
    /// task's `p2p_stash` for point-to-point lanes).
    Scratch { idx: u32, off: usize },
}

impl Addr {
    /// A caller's address, 0 meaning none.
    pub fn user(a: usize) -> Addr {
        if a == 0 {
            Addr::None
        } else {
            Addr::User(a)
        }
    }
}

impl std::ops::Add<usize> for Addr {
    type Output = Addr;
    /// `bytes` further on.
    fn add(self, bytes: usize) -> Addr {
        match self {
            Addr::None => Addr::None,
            Addr::User(a) => Addr::User(a + bytes),
            Addr::Scratch { idx, off } => Addr::Scratch {
                idx,
                off: off + bytes,
            },
        }
    }
}

/// One step: a primitive over one segment of `len` elements (`src`/`dst` are the segment's start
/// addresses). Each iteration of its program handles the next slice of the segment.
/// Connections are named by key in a plan (`C = ConnKey`); an executor binds them to its own
/// handles (`Program::bind`).
#[derive(Clone)]
pub struct Step<C = ConnKey> {
    pub prim: Prim,
    pub recv: Option<C>,
    pub send: Option<C>,
    pub src: Addr,
    pub dst: Addr,
    pub len: usize,
    /// `Send` applies the reduction's pre-multiplication (first hop of a reduction).
    pub prep: bool,
}

impl<C> Step<C> {
    /// The connections the step uses: its receive's, then its send's.
    pub fn conns(&self) -> impl Iterator<Item = &C> {
        self.recv.iter().chain(self.send.iter())
    }
}

/// How the reduction of a program is known: ready, or a PreMulSum whose scalar may live in the
/// caller's (device) memory, read by the executor when the work runs, as NCCL reads it when the
/// kernel runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RedSpec {
    Ready(Reduction),
    PreMul { dtype: DataType, scalar: ScalarArg },
}

impl RedSpec {
    /// The reduction, given the scalar's bits (read by the executor where it lives).
    pub fn with_scalar(&self, read: impl FnOnce(usize, DataType) -> u64) -> Reduction {
        match *self {
            RedSpec::Ready(r) => r,
            RedSpec::PreMul { dtype, scalar } => {
                let bits = match scalar {
                    ScalarArg::Host(s) => s.bits,
                    ScalarArg::Device(addr) => read(addr, dtype),
                };
                Reduction {
                    dtype,
                    kind: ReduceKind::Sum,
                    premul: Some(Scalar { bits }),
                    postdiv: None,
                }
            }
        }
    }
}

/// A list of steps repeated over `niter` slices of at most `slice` elements.
#[derive(Clone)]
pub struct Program<C = ConnKey> {
    pub steps: Vec<Step<C>>,
    pub esize: usize,
    pub slice: usize,
    pub niter: usize,
    pub red: Option<RedSpec>,
    /// The call the program is part of: it travels with every slot the program sends, and a
    /// receiving program checks it against its own (see `call`).
    pub call: call::Call,
}

impl Program {
    pub fn new(
        steps: Vec<Step>,
        dtype: DataType,
        slot_bytes: usize,
        red: Option<RedSpec>,
    ) -> Program {
        let esize = dtype.size();
        let slice = (slot_bytes / esize).max(1);
        let maxlen = steps.iter().map(|s| s.len).max().unwrap_or(0);
        Program {
            steps,
            esize,
            slice,
            niter: maxlen.div_ceil(slice),
            red,
            call: [0; 2],
        }
    }

    /// Calls `f` with each connection the program uses (a plain loop: launches do this).
    pub fn for_each_key(&self, f: &mut impl FnMut(ConnKey)) {
        for s in &self.steps {
            if let Some(k) = s.send {
                f(k);
            }
            if let Some(k) = s.recv {
                f(k);
            }
        }
    }
}

impl<C> Program<C> {
    /// The same program over connection handles `bind` gives for its keys.
    pub fn bind<D>(self, bind: &mut impl FnMut(C) -> Result<D>) -> Result<Program<D>> {
        // Collected in place: the executors' bound steps are the size of planned ones (see
        // `ConnKey`), so the planned steps' memory takes them, with no allocation at each
        // launch. (A bound step of another size leaves a shrinking realloc, which costs more
        // than an allocation and a free.)
        let steps = self
            .steps
            .into_iter()
            .map(|s| {
                Ok(Step {
                    prim: s.prim,
                    recv: s.recv.map(&mut *bind).transpose()?,
                    send: s.send.map(&mut *bind).transpose()?,
                    src: s.src,
                    dst: s.dst,
                    len: s.len,
                    prep: s.prep,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Program {
            steps,
            esize: self.esize,
            slice: self.slice,
            niter: self.niter,
            red: self.red,
            call: self.call,
        })
    }

    /// Elements step `k` handles in iteration `i`, and its element offset in the segment.
    #[inline]
    pub fn slice_of(&self, k: usize, i: usize) -> (usize, usize) {
        let len = self.steps[k].len;
        let off = i * self.slice;
        if off >= len {
            (off, 0)
        } else {
            (off, (len - off).min(self.slice))
        }
    }
}

/// A unit of work in a lane: a step program over connections, or a direct operation over the
/// communicator's board.
pub enum Work {
    Steps(Program),
    Board(Box<board::BoardOp>),
}

impl From<Program> for Work {
    fn from(p: Program) -> Work {
        Work::Steps(p)
    }
}

impl Work {
    /// Calls `f` with each connection the work may use.
    pub fn for_each_key(&self, f: &mut impl FnMut(ConnKey)) {
        match self {
            Work::Steps(p) => p.for_each_key(f),
            Work::Board(b) => {
                if let Some(p) = &b.fallback {
                    p.for_each_key(f)
                }
            }
        }
    }
}

/// A stage's lanes, which run concurrently (the work of each in order). Most stages have one,
/// held in place: a small operation's launch makes no allocation for it.
pub type Lanes<W = Work> = SmallVec<[Vec<W>; 1]>;

/// Lanes run concurrently; the work of a lane in order.
#[derive(Default)]
pub struct Stage {
    pub lanes: Lanes,
    /// Output to spoil on purpose after the stage (OXCCL_FAULT=corrupt): (dtype, address, count).
    pub fault: Option<(DataType, usize, usize)>,
    /// Private copies of inputs the stage's programs read instead of the caller's buffers,
    /// taken when the stage starts.
    pub stash: Stash,
}

/// Private copies of input ranges that the work planned with them would otherwise overwrite
/// before reading (in-place all-to-all, a send from the buffer a receive of the same group
/// writes). Planned with the work, so that programs can point into them (`Addr::Scratch`), but
/// provided by the executor and filled only when the work starts, in stream order: earlier work
/// on the stream may still be writing the input.
#[derive(Default, Clone, Debug, PartialEq, Eq)]
pub struct Stash {
    /// (caller's range start, bytes) of each copy.
    pub copies: Vec<(usize, usize)>,
}

impl Stash {
    /// Plans a copy of `bytes` at `src`; returns where the copy will be.
    pub fn keep(&mut self, src: usize, bytes: usize) -> Addr {
        self.copies.push((src, bytes));
        Addr::Scratch {
            idx: (self.copies.len() - 1) as u32,
            off: 0,
        }
    }
}

/// Whether the byte ranges [a, a + alen) and [b, b + blen) share a byte.
pub fn overlaps(a: usize, alen: usize, b: usize, blen: usize) -> bool {
    alen > 0 && blen > 0 && a < b + blen && b < a + alen
}

/// Elements a collective of `count` writes on `rank` (what OXCCL_FAULT=corrupt spoils).
pub fn out_count(kind: CollKind, count: usize, n: usize, rank: usize, root: usize) -> usize {
    match kind {
        CollKind::AllGather | CollKind::AlltoAll => count * n,
        CollKind::Gather if rank == root => count * n,
        CollKind::Gather => 0,
        CollKind::Reduce if rank != root => 0,
        _ => count,
    }
}

/// Split `count` elements into `n` nearly equal segments: (offset, len) of segment `j`.
pub fn segment(count: usize, n: usize, j: usize) -> (usize, usize) {
    let base = count / n;
    let rem = count % n;
    let off = j * base + j.min(rem);
    let len = base + usize::from(j < rem);
    (off, len)
}
