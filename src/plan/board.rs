//! Direct (zero-copy) algorithms over the communicator's board: every rank publishes where its
//! buffers are, then reads its peers' inputs and writes their outputs in place. Each rank owns one
//! segment of the work, so each element is read once per input and written once per output; two
//! board rounds (arrive, done) replace the 2(n-1) FIFO hops of a ring.
//!
//! Small operations are *eager*: inputs travel on the board itself, and every rank computes its
//! own output from them in one round.
//!
//! Whether peers' buffers can be reached is only known once everyone has published (another
//! process's buffer must come from `ncclMemAlloc`); every rank decides the same way from the same
//! published facts, and falls back to the ring program it carries when some buffer cannot be
//! reached.

use super::{Program, RedSpec};
use crate::error::Result;
use crate::transport::ConnKey;
use crate::types::{CollArgs, CollKind, DataType};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoardKind {
    AllReduce,
    Reduce,
    ReduceScatter,
    AllGather,
    Broadcast,
}

impl BoardKind {
    pub const ALL: &'static [BoardKind] = &[
        BoardKind::AllReduce,
        BoardKind::Reduce,
        BoardKind::ReduceScatter,
        BoardKind::AllGather,
        BoardKind::Broadcast,
    ];

    /// The board collective a collective call can run as.
    pub fn of(kind: CollKind) -> Option<BoardKind> {
        Some(match kind {
            CollKind::AllReduce => BoardKind::AllReduce,
            CollKind::ReduceScatter => BoardKind::ReduceScatter,
            CollKind::AllGather => BoardKind::AllGather,
            CollKind::Broadcast => BoardKind::Broadcast,
            CollKind::Reduce => BoardKind::Reduce,
            _ => return None,
        })
    }

    pub fn coll(self) -> CollKind {
        match self {
            BoardKind::AllReduce => CollKind::AllReduce,
            BoardKind::ReduceScatter => CollKind::ReduceScatter,
            BoardKind::AllGather => CollKind::AllGather,
            BoardKind::Broadcast => CollKind::Broadcast,
            BoardKind::Reduce => CollKind::Reduce,
        }
    }
}

/// A direct operation: what every rank reads and writes, planned identically on every rank. The
/// executor that runs it gives it its place on the board (`seq`, the communicator's count of
/// direct operations) and brings the board, the peers' mappings and its tuning.
pub struct BoardOp<C = ConnKey> {
    /// This operation's number among the communicator's direct operations (from 1; 0 until the
    /// executor numbers it).
    pub seq: u64,
    pub rank: usize,
    pub nranks: usize,
    pub kind: BoardKind,
    pub send: usize,
    pub recv: usize,
    /// Elements: per rank for ReduceScatter/AllGather, of the vector otherwise.
    pub count: usize,
    pub dtype: DataType,
    pub red: Option<RedSpec>,
    pub root: usize,
    /// What runs instead when some peer buffer cannot be reached; None for eager operations
    /// (see `eager`), which read no peer's buffer.
    pub fallback: Option<Box<Program<C>>>,
}

impl<C> BoardOp<C> {
    /// The direct operation of call `a` on `rank` of `nranks`: eager when `fallback` (the ring
    /// program to run instead when peers' buffers cannot be reached) is None.
    #[inline]
    pub fn new(
        rank: usize,
        nranks: usize,
        a: &CollArgs,
        red: Option<RedSpec>,
        kind: BoardKind,
        fallback: Option<Box<Program<C>>>,
    ) -> BoardOp<C> {
        BoardOp {
            seq: 0,
            rank,
            nranks,
            kind,
            send: a.send,
            recv: a.recv,
            count: a.count,
            dtype: a.dtype,
            red,
            root: a.root.max(0) as usize,
            fallback,
        }
    }

    /// The same operation over connection handles `bind` gives for its fallback's keys.
    pub fn bind<D>(self, bind: &mut impl FnMut(C) -> Result<D>) -> Result<BoardOp<D>> {
        Ok(BoardOp {
            seq: self.seq,
            rank: self.rank,
            nranks: self.nranks,
            kind: self.kind,
            send: self.send,
            recv: self.recv,
            count: self.count,
            dtype: self.dtype,
            red: self.red,
            root: self.root,
            fallback: match self.fallback {
                Some(p) => Some(Box::new(p.bind(bind)?)),
                None => None,
            },
        })
    }

    /// Small enough for every rank to carry its input on the board (`Board::eager_area`): each
    /// rank copies its input there, arrives, and computes its own output from everyone's copies;
    /// one round, no done barrier, any buffers (nothing is read from peers' memory). Planned as
    /// such when the operation `fits_inline`, with no ring to fall back on. (The host
    /// executor's reading; the CUDA executor's board operations carry no ring either, where
    /// `Caps::direct_fallback` is off, and run alike whatever their size.)
    pub fn eager(&self) -> bool {
        self.fallback.is_none()
    }

    /// Whether rank `p`'s send buffer is an input (a non-root's Broadcast send buffer is not).
    pub fn sends(&self, p: usize) -> bool {
        self.kind != BoardKind::Broadcast || p == self.root
    }

    /// This rank's output as (type, address, elements): what OXCCL_FAULT=corrupt spoils.
    pub fn output(&self) -> (DataType, usize, usize) {
        let elems = super::out_count(
            self.kind.coll(),
            self.count,
            self.nranks,
            self.rank,
            self.root,
        );
        (self.dtype, self.recv, elems)
    }

    /// The operation as the call that made it, for messages.
    pub fn what(&self) -> super::task::What {
        super::task::What {
            kind: self.kind.coll().name(),
            count: self.count,
            dtype: self.dtype.name(),
            more: 0,
        }
    }

    /// Bytes of the operation's `count` elements: what its speed is measured over.
    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    /// Bytes of this rank's send and receive buffers that the operation touches.
    pub fn extents(&self) -> (usize, usize) {
        let (n, c, es) = (self.nranks, self.count, self.dtype.size());
        match self.kind {
            BoardKind::AllReduce | BoardKind::Reduce | BoardKind::Broadcast => (c * es, c * es),
            BoardKind::ReduceScatter => (n * c * es, c * es),
            BoardKind::AllGather => (c * es, n * c * es),
        }
    }

    /// Which peers' (send, recv) buffers this rank needs.
    pub fn needs(&self, peer: usize) -> (bool, bool) {
        if peer == self.rank {
            return (false, false);
        }
        match self.kind {
            BoardKind::AllReduce => (true, true),
            BoardKind::Reduce => (true, peer == self.root),
            BoardKind::ReduceScatter | BoardKind::AllGather => (true, false),
            BoardKind::Broadcast => (peer == self.root, false),
        }
    }
}

/// Whether an operation of this shape is eager: every rank's input fits `eager_bytes` (the
/// executor's limit: what its board carries inline).
pub fn fits_inline(
    kind: BoardKind,
    nranks: usize,
    count: usize,
    dtype: DataType,
    eager_bytes: usize,
) -> bool {
    let input = match kind {
        BoardKind::ReduceScatter => nranks * count,
        _ => count,
    };
    input
        .checked_mul(dtype.size())
        .is_some_and(|b| b <= eager_bytes)
}
