//! Ring and chain algorithms: every rank talks to its ring neighbours only (Class::Ring).
//! AllReduce = reduce-scatter then all-gather around the ring, 2(n-1) steps per slice;
//! Broadcast/Reduce = a pipelined chain starting/ending at the root.

use super::{segment, Addr, Prim, Program, RedSpec, Step};
use crate::error::Result;
use crate::transport::conns::Conns;
use crate::transport::{Class, ConnKey};
use crate::types::DataType;

/// What an algorithm builder needs from its communicator.
pub trait Links {
    fn rank(&self) -> usize;
    fn nranks(&self) -> usize;
    fn slot_bytes(&self) -> usize;
    /// This rank's end of the connection with `peer` (`is_sender`: we send to it), by key: the
    /// executor binds it to the connection made at launch.
    fn conn(&self, peer: usize, is_sender: bool, class: Class) -> Result<ConnKey> {
        Ok(ConnKey::new(peer, is_sender, class))
    }
    /// The ranks in ring order, when it is not rank order (ranks of a host are contiguous in
    /// the ring, so that it crosses each host boundary once).
    fn ring(&self) -> Option<&[usize]> {
        None
    }
    /// An identity of the host `rank` runs on (ranks on one host share it).
    fn host(&self, _rank: usize) -> u64 {
        0
    }
}

impl Links for Conns {
    fn rank(&self) -> usize {
        self.rank
    }
    fn nranks(&self) -> usize {
        self.nranks
    }
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    fn ring(&self) -> Option<&[usize]> {
        self.ring_order()
    }
    fn host(&self, rank: usize) -> u64 {
        self.peers()[rank].host
    }
}

/// One of several rings over the same ranks in the same order, each on connections of its own
/// class (`Class::ring`): a collective split across channels runs a ring on each at once.
pub struct Channel<'a> {
    pub parent: &'a dyn Links,
    pub class: Class,
}

impl Links for Channel<'_> {
    fn rank(&self) -> usize {
        self.parent.rank()
    }
    fn nranks(&self) -> usize {
        self.parent.nranks()
    }
    fn slot_bytes(&self) -> usize {
        self.parent.slot_bytes()
    }
    fn conn(&self, peer: usize, is_sender: bool, class: Class) -> Result<ConnKey> {
        let class = if class == Class::Ring {
            self.class
        } else {
            class
        };
        self.parent.conn(peer, is_sender, class)
    }
    fn ring(&self) -> Option<&[usize]> {
        self.parent.ring()
    }
    fn host(&self, rank: usize) -> u64 {
        self.parent.host(rank)
    }
}

/// Rank `rank`'s position in the ring.
fn pos(l: &dyn Links, rank: usize) -> usize {
    match l.ring() {
        Some(ring) => ring.iter().position(|&x| x == rank).unwrap_or(rank),
        None => rank,
    }
}

/// The rank at ring position `p` (modulo the ring's length).
fn at_pos(l: &dyn Links, p: usize) -> usize {
    let p = p % l.nranks();
    l.ring().map_or(p, |ring| ring[p])
}

/// A step over `len` elements of user memory (address 0: none), no connection yet.
pub(super) fn step(prim: Prim, src: usize, dst: usize, len: usize) -> Step {
    Step {
        prim,
        recv: None,
        send: None,
        src: Addr::user(src),
        dst: Addr::user(dst),
        len,
        prep: false,
    }
}

fn ring_conns(l: &dyn Links) -> Result<(ConnKey, ConnKey)> {
    let (p, n) = (pos(l, l.rank()), l.nranks());
    let next = l.conn(at_pos(l, p + 1), true, Class::Ring)?;
    let prev = l.conn(at_pos(l, p + n - 1), false, Class::Ring)?;
    Ok((next, prev))
}

/// Attach the ring connections each step needs.
fn wire(mut steps: Vec<Step>, next: &ConnKey, prev: &ConnKey) -> Vec<Step> {
    for s in &mut steps {
        if s.prim.sends() {
            s.send = Some(*next);
        }
        if s.prim.recvs() {
            s.recv = Some(*prev);
        }
    }
    steps
}

pub fn all_reduce(
    l: &dyn Links,
    send: usize,
    recv: usize,
    count: usize,
    dtype: DataType,
    red: RedSpec,
) -> Result<Program> {
    // Segments are numbered by ring position (any numbering works: every rank gets them all).
    let (r, n, es) = (pos(l, l.rank()), l.nranks(), dtype.size());
    if n == 1 {
        let s = step(Prim::LocalReduce, send, recv, count);
        return Ok(Program::new(vec![s], dtype, l.slot_bytes(), Some(red)));
    }
    let seg = |j: usize| segment(count, n, j % n);
    let at = |base: usize, j: usize| base + seg(j).0 * es;
    let mut steps = Vec::with_capacity(2 * n - 1);
    let mut first = step(Prim::Send, at(send, r), 0, seg(r).1);
    first.prep = true;
    steps.push(first);
    for s in 1..n - 1 {
        let j = (r + n - s) % n;
        steps.push(step(Prim::RecvReduceSend, at(send, j), 0, seg(j).1));
    }
    let j = (r + 1) % n;
    steps.push(step(
        Prim::RecvReduceCopySend,
        at(send, j),
        at(recv, j),
        seg(j).1,
    ));
    for t in 1..n {
        let j = (r + 1 + n - t) % n;
        let prim = if t == n - 1 {
            Prim::Recv
        } else {
            Prim::RecvCopySend
        };
        steps.push(step(prim, 0, at(recv, j), seg(j).1));
    }
    let (next, prev) = ring_conns(l)?;
    Ok(Program::new(
        wire(steps, &next, &prev),
        dtype,
        l.slot_bytes(),
        Some(red),
    ))
}

/// `recvcount` elements per rank; rank r ends with the reduction of block r.
pub fn reduce_scatter(
    l: &dyn Links,
    send: usize,
    recv: usize,
    recvcount: usize,
    dtype: DataType,
    red: RedSpec,
) -> Result<Program> {
    // Ring positions; block `j` is the block of the rank at position j.
    let (r, n, es) = (pos(l, l.rank()), l.nranks(), dtype.size());
    let blk = |j: usize| send + at_pos(l, j) * recvcount * es;
    if n == 1 {
        let s = step(Prim::LocalReduce, send, recv, recvcount);
        return Ok(Program::new(vec![s], dtype, l.slot_bytes(), Some(red)));
    }
    let mut steps = Vec::with_capacity(n);
    let mut first = step(Prim::Send, blk(r + n - 1), 0, recvcount);
    first.prep = true;
    steps.push(first);
    for s in 1..n - 1 {
        steps.push(step(
            Prim::RecvReduceSend,
            blk(r + 2 * n - 1 - s),
            0,
            recvcount,
        ));
    }
    steps.push(step(Prim::RecvReduceCopy, blk(r), recv, recvcount));
    let (next, prev) = ring_conns(l)?;
    Ok(Program::new(
        wire(steps, &next, &prev),
        dtype,
        l.slot_bytes(),
        Some(red),
    ))
}

/// `count` elements from every rank, gathered in rank order.
pub fn all_gather(
    l: &dyn Links,
    send: usize,
    recv: usize,
    count: usize,
    dtype: DataType,
) -> Result<Program> {
    let (r, n, es) = (pos(l, l.rank()), l.nranks(), dtype.size());
    let blk = |j: usize| recv + at_pos(l, j) * count * es;
    if n == 1 {
        let s = step(Prim::LocalCopy, send, recv, count);
        return Ok(Program::new(vec![s], dtype, l.slot_bytes(), None));
    }
    let mut steps = vec![step(Prim::CopySend, send, blk(r), count)];
    for t in 1..n {
        let prim = if t == n - 1 {
            Prim::Recv
        } else {
            Prim::RecvCopySend
        };
        steps.push(step(prim, 0, blk(r + n - t), count));
    }
    let (next, prev) = ring_conns(l)?;
    Ok(Program::new(
        wire(steps, &next, &prev),
        dtype,
        l.slot_bytes(),
        None,
    ))
}

/// Chain from the root around the ring.
pub fn broadcast(
    l: &dyn Links,
    send: usize,
    recv: usize,
    count: usize,
    dtype: DataType,
    root: usize,
) -> Result<Program> {
    let (r, n) = (pos(l, l.rank()), l.nranks());
    let pos = (r + n - pos(l, root)) % n;
    let s = if n == 1 {
        step(Prim::LocalCopy, send, recv, count)
    } else if pos == 0 {
        step(Prim::CopySend, send, recv, count)
    } else if pos == n - 1 {
        step(Prim::Recv, 0, recv, count)
    } else {
        step(Prim::RecvCopySend, 0, recv, count)
    };
    let steps = if n == 1 {
        vec![s]
    } else {
        let (next, prev) = ring_conns(l)?;
        wire(vec![s], &next, &prev)
    };
    Ok(Program::new(steps, dtype, l.slot_bytes(), None))
}

/// Chain around the ring ending at the root.
pub fn reduce(
    l: &dyn Links,
    send: usize,
    recv: usize,
    count: usize,
    dtype: DataType,
    red: RedSpec,
    root: usize,
) -> Result<Program> {
    let (r, n) = (pos(l, l.rank()), l.nranks());
    let pos = (r + 2 * n - pos(l, root) - 1) % n;
    let s = if n == 1 {
        step(Prim::LocalReduce, send, recv, count)
    } else if pos == 0 {
        let mut s = step(Prim::Send, send, 0, count);
        s.prep = true;
        s
    } else if pos == n - 1 {
        step(Prim::RecvReduceCopy, send, recv, count)
    } else {
        step(Prim::RecvReduceSend, send, 0, count)
    };
    let steps = if n == 1 {
        vec![s]
    } else {
        let (next, prev) = ring_conns(l)?;
        wire(vec![s], &next, &prev)
    };
    Ok(Program::new(steps, dtype, l.slot_bytes(), Some(red)))
}
