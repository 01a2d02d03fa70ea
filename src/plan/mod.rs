//! Planning: a collective or point-to-point call becomes, on each rank, a set of *lanes* of
//! *programs*. A program is a list of primitive steps (NCCL's vocabulary: send, recv, copySend,
//! recvCopySend, recvReduceSend, recvReduceCopy, recvReduceCopySend, localCopy) over connections,
//! repeated for each slice of the data (one FIFO slot per step and slice). Lanes run concurrently;
//! the programs of a lane run in order. Executors run programs without knowing the transport.
//!
//! Plans are data: nothing here runs, waits or owns executor state (`build` chooses the
//! algorithms; `task` is what an executor is handed).

pub mod board;
pub mod build;
pub mod direct;
pub mod ring;
pub mod task;

pub use task::{Task, What};

use crate::transport::Conn;
use crate::types::{CollKind, DataType, ReduceKind, Reduction, Scalar, ScalarArg};
use std::sync::Arc;

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

/// One step: a primitive over one segment of `len` elements (`src`/`dst` are the segment's start
/// addresses). Each iteration of its program handles the next slice of the segment.
#[derive(Clone)]
pub struct Step {
    pub prim: Prim,
    pub recv: Option<Arc<Conn>>,
    pub send: Option<Arc<Conn>>,
    pub src: usize,
    pub dst: usize,
    pub len: usize,
    /// `Send` applies the reduction's pre-multiplication (first hop of a reduction).
    pub prep: bool,
}

/// How the reduction of a program is known: resolved before it runs (a device-resident PreMulSum
/// scalar is read when the program starts, as NCCL reads it when the kernel runs).
#[derive(Clone, Copy, Debug)]
pub enum RedSpec {
    Ready(Reduction),
    PreMul { dtype: DataType, scalar: ScalarArg },
}

impl RedSpec {
    pub fn resolve(&self) -> Reduction {
        match *self {
            RedSpec::Ready(r) => r,
            RedSpec::PreMul { dtype, scalar } => {
                let bits = match scalar {
                    ScalarArg::Host(s) => s.bits,
                    ScalarArg::Device(addr) => {
                        let mut b = [0u8; 8];
                        // SAFETY: the caller registered this address as a scalar of `dtype`
                        // that stays valid until the collective completes (NCCL's contract).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                addr as *const u8,
                                b.as_mut_ptr(),
                                dtype.size(),
                            )
                        };
                        u64::from_le_bytes(b)
                    }
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
pub struct Program {
    pub steps: Vec<Step>,
    pub esize: usize,
    pub slice: usize,
    pub niter: usize,
    pub red: Option<RedSpec>,
    /// Write the caller's output with streaming stores (it is too large to stay in the cache).
    pub stream_out: bool,
    /// Slices of a later iteration may run before blocked slices of an earlier one (each
    /// connection still in order): every two steps' buffer regions start at the same address or
    /// do not overlap, so slices of different iterations never touch the same memory.
    pub run_ahead: bool,
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
        let out_bytes: usize = steps
            .iter()
            .filter(|s| s.prim.writes_dst())
            .map(|s| s.len * esize)
            .sum();
        // In place, the output's lines were just read as input and sit in the cache: ordinary
        // stores are cheaper there (measured: streaming stores cost a third of in-place speed).
        let in_place = steps
            .iter()
            .any(|s| s.prim.writes_dst() && s.len > 0 && s.src == s.dst);
        let regions: Vec<(usize, usize)> = steps
            .iter()
            .filter(|s| s.len > 0)
            .flat_map(|s| [(s.src, s.len * esize), (s.dst, s.len * esize)])
            .filter(|&(a, _)| a != 0)
            .collect();
        let run_ahead = crate::param::run_ahead()
            && regions.iter().enumerate().all(|(i, &(a, la))| {
                regions[i + 1..]
                    .iter()
                    .all(|&(b, lb)| a == b || a + la <= b || b + lb <= a)
            });
        Program {
            steps,
            esize,
            slice,
            niter: maxlen.div_ceil(slice),
            red,
            stream_out: !in_place && out_bytes >= crate::param::stream_bytes(),
            run_ahead,
        }
    }

    /// Bytes this program sends through FIFO slots.
    pub fn sent_bytes(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| s.send.is_some())
            .map(|s| s.len * self.esize)
            .sum()
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

/// Lanes run concurrently; the work of a lane in order.
#[derive(Default)]
pub struct Stage {
    pub lanes: Vec<Vec<Work>>,
    /// Output to spoil on purpose after the stage (OXCCL_FAULT=corrupt): (dtype, address, count).
    pub fault: Option<(DataType, usize, usize)>,
    /// Private copies of inputs the stage's programs read instead of the caller's buffers,
    /// taken when the stage starts.
    pub stash: Stash,
}

/// Private copies of input ranges that the work planned with them would otherwise overwrite
/// before reading (in-place all-to-all, a send from the buffer a receive of the same group
/// writes). Planned with the work, so that programs can point into them, but filled only when
/// the work starts, in stream order: earlier work on the stream may still be writing the input.
#[derive(Default)]
pub struct Stash {
    /// (caller's range start, bytes, copy).
    copies: Vec<(usize, usize, Vec<u8>)>,
}

impl Stash {
    /// Plans a copy of `bytes` at `src`; returns where the copy will be.
    pub fn keep(&mut self, src: usize, bytes: usize) -> usize {
        let v = vec![0u8; bytes.max(1)];
        let at = v.as_ptr() as usize;
        self.copies.push((src, bytes, v));
        at
    }

    /// Takes the planned copies.
    ///
    /// # Safety
    /// Each planned source range is readable now (validated at enqueue, and no other work is
    /// writing it).
    pub unsafe fn fill(&mut self) {
        for (src, bytes, v) in &mut self.copies {
            // SAFETY: per the contract; `v` holds `bytes` and is private.
            unsafe { std::ptr::copy_nonoverlapping(*src as *const u8, v.as_mut_ptr(), *bytes) };
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
