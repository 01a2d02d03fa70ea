//! All-reduce across hosts. Two plans for communicators whose ranks span several hosts, each
//! moving fewer bytes and taking fewer network hops than the flat ring:
//! - *exchange* (2 ranks on 2 hosts): each rank sends its whole input to the other and reduces
//!   the two; one network hop instead of the ring's two, the same bytes on the wire.
//! - *hierarchical* (NCCL's tree, in three stages): a chain reduce inside each host to its first
//!   rank (the host's leader) over shared memory; an all-reduce among the leaders over the
//!   network (an exchange for two hosts; for 3 or more, a binary tree up and down when small,
//!   a ring otherwise); a chain broadcast from each leader inside its host. Each host boundary
//!   carries the data once each way, where the flat ring carries 2(n-1)/n of it and crosses
//!   hosts at every one of its 2(n-1) steps. With one rank per host it serves small messages
//!   only (the leaders' tree: 2 log2(hosts) hops instead of the ring's 2(hosts - 1)).
//!
//! Every rank computes the same result bit for bit: the leaders' ring gives every leader the
//! same sums, and the exchange, where each rank combines the two inputs in its own order, serves
//! only reductions whose result does not depend on that order (integers; float sums and
//! products; float max and min go round the ring, since max(+0, -0) and max(-0, +0) differ).
//! Only a NaN's payload may differ between the ranks of an exchange (both get a NaN). A
//! pre-multiply (PreMulSum) is applied once, by the rank whose input it is; a post-divide (Avg)
//! once, at the end.

use super::ring::{self, Links};
use super::{Prim, Program, RedSpec, Stage};
use crate::error::Result;
use crate::transport::{Class, ConnKey};
use crate::types::DataType;

/// The ranks of a communicator grouped by host, each host's ranks in ring order (the first is
/// its leader), hosts in the order of their first rank.
pub fn hosts(l: &dyn Links) -> Vec<Vec<usize>> {
    let n = l.nranks();
    let order: Vec<usize> = match l.ring() {
        Some(r) => r.to_vec(),
        None => (0..n).collect(),
    };
    let mut hosts: Vec<(u64, Vec<usize>)> = Vec::new();
    for r in order {
        let h = l.host(r);
        match hosts.iter_mut().find(|(k, _)| *k == h) {
            Some((_, v)) => v.push(r),
            None => hosts.push((h, vec![r])),
        }
    }
    hosts.into_iter().map(|(_, v)| v).collect()
}

/// Which plan an all-reduce across hosts gets (None: the flat ring).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    Exchange,
    Hierarchical,
}

impl Plan {
    /// The name `NCCL_ALGO` selects it by.
    pub fn algo(self) -> &'static str {
        match self {
            Plan::Exchange => "direct",
            Plan::Hierarchical => "tree",
        }
    }

    /// What the TUNING line shows.
    pub fn label(self) -> &'static str {
        match self {
            Plan::Exchange => "Direct (exchange)",
            Plan::Hierarchical => "Tree (hierarchical)",
        }
    }
}

/// Whether the exchange may combine inputs with `red`: each rank combines them in its own
/// order, so only where the order cannot change the result's bits (see the module's notes).
pub fn order_free(red: &RedSpec) -> bool {
    match red {
        RedSpec::PreMul { .. } => true,
        RedSpec::Ready(r) => {
            !r.dtype.is_float()
                || matches!(
                    r.kind,
                    crate::types::ReduceKind::Sum | crate::types::ReduceKind::Prod
                )
        }
    }
}

/// All-reduces of at most this many bytes among 3 or more hosts' leaders go up and down a
/// binary tree (2 log2(hosts) network hops) rather than round the ring (2 (hosts - 1) hops,
/// but each link carries less: the ring wins for large messages).
pub const TREE_BYTES: usize = 64 << 10;

/// Whether the leaders' binary tree serves `red` for `bytes`: small, and no post-divide (the
/// tree's one program would divide at every level; integer averages take the ring).
fn tree_serves(red: &RedSpec, bytes: usize, hosts: usize) -> bool {
    hosts >= 3
        && bytes <= TREE_BYTES
        && match red {
            RedSpec::Ready(r) => r.postdiv.is_none(),
            RedSpec::PreMul { .. } => true,
        }
}

/// The plan for an all-reduce of this communicator of `bytes` with `red`: the exchange for 2
/// ranks on 2 hosts (where `order_free`); the hierarchical plan where some host has several
/// ranks, or, with one rank per host, where the leaders' tree serves it; otherwise nothing (the
/// flat ring: each of its steps crosses a host boundary anyway).
pub fn choose(l: &dyn Links, red: &RedSpec, bytes: usize) -> Option<Plan> {
    let n = l.nranks();
    if n < 2 || (0..n).all(|r| l.host(r) == l.host(0)) {
        return None;
    }
    if n == 2 {
        return order_free(red).then_some(Plan::Exchange);
    }
    let hs = hosts(l);
    (hs.iter().any(|h| h.len() > 1) || tree_serves(&without_pre(*red), bytes, hs.len()))
        .then_some(Plan::Hierarchical)
}

/// A sub-group of a communicator's ranks (`members`, in the order its programs number them),
/// as the ring and chain builders see it; its connections are direct ones of the communicator.
struct Sub<'a> {
    parent: &'a dyn Links,
    members: &'a [usize],
    me: usize,
}

impl Links for Sub<'_> {
    fn rank(&self) -> usize {
        self.me
    }
    fn nranks(&self) -> usize {
        self.members.len()
    }
    fn slot_bytes(&self) -> usize {
        self.parent.slot_bytes()
    }
    fn conn(&self, peer: usize, is_sender: bool, _class: Class) -> Result<ConnKey> {
        self.parent
            .conn(self.members[peer], is_sender, Class::Direct)
    }
    fn host(&self, rank: usize) -> u64 {
        self.parent.host(self.members[rank])
    }
}

/// `red` without its post-divide (stages before the last).
fn without_post(red: RedSpec) -> RedSpec {
    match red {
        RedSpec::Ready(mut r) => {
            r.postdiv = None;
            RedSpec::Ready(r)
        }
        pre => pre,
    }
}

/// `red` without its pre-multiply (stages after the first: their inputs had it applied).
fn without_pre(red: RedSpec) -> RedSpec {
    match red {
        RedSpec::Ready(mut r) => {
            r.premul = None;
            RedSpec::Ready(r)
        }
        RedSpec::PreMul { dtype, .. } => RedSpec::Ready(crate::types::Reduction {
            dtype,
            kind: crate::types::ReduceKind::Sum,
            premul: None,
            postdiv: None,
        }),
    }
}

/// The exchange between this rank and `peer` (a rank of `l`): send `src` (pre-multiplied where
/// `prep`) and reduce what arrives with it into `dst`. In place is safe: each slice is sent
/// before the slice is overwritten, and slices are disjoint.
fn exchange(
    l: &dyn Links,
    peer: usize,
    (src, dst): (usize, usize),
    count: usize,
    dtype: DataType,
    red: RedSpec,
    prep: bool,
) -> Result<Program> {
    let mut send = ring::step(Prim::Send, src, 0, count);
    send.prep = prep;
    send.send = Some(l.conn(peer, true, Class::Direct)?);
    let mut recv = ring::step(Prim::RecvReduceCopy, src, dst, count);
    recv.prep = prep;
    recv.recv = Some(l.conn(peer, false, Class::Direct)?);
    Ok(Program::new(
        vec![send, recv],
        dtype,
        l.slot_bytes(),
        Some(red),
    ))
}

/// The exchange all-reduce of a 2-rank communicator.
pub fn all_reduce_exchange(
    l: &dyn Links,
    send: usize,
    recv: usize,
    count: usize,
    dtype: DataType,
    red: RedSpec,
) -> Result<Program> {
    let peer = 1 - l.rank();
    exchange(l, peer, (send, recv), count, dtype, red, true)
}

/// The hierarchical all-reduce: this rank's stages (2 or 3: the leaders' stage only on
/// leaders), each holding one program.
pub fn all_reduce_hierarchical(
    l: &dyn Links,
    send: usize,
    recv: usize,
    count: usize,
    dtype: DataType,
    red: RedSpec,
) -> Result<Vec<Program>> {
    let me = l.rank();
    let hs = hosts(l);
    let mine = hs
        .iter()
        .find(|h| h.contains(&me))
        .expect("every rank is on a host");
    let inside = Sub {
        parent: l,
        members: mine,
        me: mine.iter().position(|&r| r == me).expect("a member"),
    };
    let leaders: Vec<usize> = hs.iter().map(|h| h[0]).collect();
    let mut out = Vec::with_capacity(3);
    // Inside the host, to the leader (which applies its own pre-multiply; one rank: a local one).
    out.push(ring::reduce(
        &inside,
        send,
        recv,
        count,
        dtype,
        without_post(red),
        0,
    )?);
    if leaders.contains(&me) {
        let across = Sub {
            parent: l,
            members: &leaders,
            me: leaders.iter().position(|&r| r == me).expect("a leader"),
        };
        let red = without_pre(red);
        let bytes = count * dtype.size();
        out.push(if leaders.len() == 2 && order_free(&red) {
            exchange(
                &across,
                1 - across.me,
                (recv, recv),
                count,
                dtype,
                red,
                false,
            )?
        } else if tree_serves(&red, bytes, leaders.len()) {
            tree(&across, recv, count, dtype, red)?
        } else {
            ring::all_reduce(&across, recv, recv, count, dtype, red)?
        });
    }
    if mine.len() > 1 {
        out.push(ring::broadcast(&inside, recv, recv, count, dtype, 0)?);
    }
    Ok(out)
}

/// An all-reduce in place on `buf` up and down a binary tree of `l`'s ranks (position i's
/// children are 2i+1 and 2i+2): each rank reduces its children's data into its own and sends
/// the sum to its parent; the root's result comes back down. One program, pipelined by slice;
/// every rank ends with the root's bytes. `red` has neither pre-multiply nor post-divide.
fn tree(l: &dyn Links, buf: usize, count: usize, dtype: DataType, red: RedSpec) -> Result<Program> {
    let i = l.rank();
    let n = l.nranks();
    let children: Vec<usize> = [2 * i + 1, 2 * i + 2]
        .into_iter()
        .filter(|&c| c < n)
        .collect();
    let step = |prim, dst| ring::step(prim, buf, dst, count);
    let mut steps = Vec::new();
    for &c in &children {
        let mut s = step(Prim::RecvReduceCopy, buf);
        s.recv = Some(l.conn(c, false, Class::Direct)?);
        steps.push(s);
    }
    if i > 0 {
        let parent = (i - 1) / 2;
        let mut up = step(Prim::Send, 0);
        up.send = Some(l.conn(parent, true, Class::Direct)?);
        let mut down = step(Prim::Recv, buf);
        down.recv = Some(l.conn(parent, false, Class::Direct)?);
        steps.extend([up, down]);
    }
    for &c in &children {
        let mut s = step(Prim::Send, 0);
        s.send = Some(l.conn(c, true, Class::Direct)?);
        steps.push(s);
    }
    Ok(Program::new(steps, dtype, l.slot_bytes(), Some(red)))
}

/// One stage per program, each with one lane.
pub fn stages(programs: Vec<Program>) -> Vec<Stage> {
    programs
        .into_iter()
        .map(|p| {
            let mut s = Stage::default();
            s.lanes.push(vec![p.into()]);
            s
        })
        .collect()
}
