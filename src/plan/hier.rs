//! All-reduce across hosts. Two plans for communicators whose ranks span several hosts, each
//! moving fewer bytes and taking fewer network hops than the flat ring:
//! - *exchange* (2 ranks on 2 hosts, below `EXCHANGE_BYTES`): each rank sends its whole input
//!   to the other and reduces the two; one network hop instead of the ring's two, the same
//!   bytes on the wire. Larger, the ring's halves cost less: each rank reduces half the data,
//!   not all of it, and copies less.
//! - *hierarchical* (NCCL's tree, in three stages): a chain reduce inside each host to its first
//!   rank (the host's leader) over shared memory; an all-reduce among the leaders over the
//!   network (`Leaders`: an exchange for two hosts, below `EXCHANGE_BYTES`; for 3 or more, a binary tree up and down
//!   when small, then two binary trees each carrying half the data while the hops they save
//!   outweigh their slower pipelines, a ring above); a chain broadcast from each leader inside its host. Each host boundary
//!   carries the data once each way, where the flat ring carries 2(n-1)/n of it and crosses
//!   hosts at every one of its 2(n-1) steps. With one rank per host it serves what the trees
//!   serve (2 log2(hosts) hops instead of the ring's 2(hosts - 1)).
//!
//! The double binary tree (NCCL's, for bandwidth): one tree numbers the leaders as the ring
//! orders them, the other mirrors it, so that the leaves of one (about half the leaders) are
//! inner nodes of the other (with an odd number, the middle leader is a leaf in both). A single
//! tree's inner nodes send every byte twice down and its leaves' links idle half the time;
//! with two, each leader sends and receives about as much as in the ring, and each half still
//! takes 2 log2(hosts) hops.
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

    /// What the TUNING line shows for an all-reduce of `bytes` with `red` on `l`: the plan and,
    /// for the hierarchical one, how the leaders all-reduce.
    pub fn label(self, l: &dyn Links, red: &RedSpec, bytes: usize) -> String {
        match self {
            Plan::Exchange => "Direct (exchange)".into(),
            Plan::Hierarchical => {
                let leaders = Leaders::choose(&without_pre(*red), bytes, hosts(l).len());
                format!("Tree (hierarchical, leaders: {})", leaders.name())
            }
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

/// All-reduces between two hosts (2 ranks, or 2 hosts' leaders) of fewer bytes than this take
/// the exchange; larger ones the ring. Chosen, as NCCL's tuner chooses, by the time of one
/// operation (a blocking call, as a layer's all-reduce between two computations is): there the
/// exchange's single network hop wins up to 6 MiB, while in a stream of back-to-back calls the
/// ring's tail overlaps the next call's start and its half reduction per rank costs less CPU.
/// Measured between two namespace hosts over veth on a 2-core VM, 1 rank each, in turn:
/// - single blocking calls (60, mean ms; 2-3 runs each): 2 MiB 0.88-0.99 against the ring's
///   1.28-1.33, 4 MiB 1.82-1.96 against 2.58-3.02 (in place 2.05-2.67 against 3.38-3.93),
///   6 MiB 3.28-3.66 against 4.20-4.51, 8 MiB 5.0-5.5 against 4.0-4.96;
/// - back to back (`scripts/ab-net.sh`, 5 rounds of 100, median us): 2 MiB 1068 against 947,
///   4 MiB 2419 against 2067, 6 MiB 3165 against 2826 (best of each even: 917/901, 1984/2030,
///   2710/2664); MPI 962, 1951, 3065.
///
/// Earlier (2 MiB then, chosen back to back): 16 KiB 16 us against the ring's 30, 256 KiB even,
/// 1 MiB 422-446 us against 529-535 (blocking: 0.39-0.54 ms against 0.74-0.79), 64 MiB 66 ms
/// against 57: the exchange reduces the whole input at each rank, the ring half.
pub const EXCHANGE_BYTES: usize = 8 << 20;

/// All-reduces of at most this many bytes among 3 or more hosts' leaders go up and down a
/// binary tree (2 log2(hosts) network hops) rather than round the ring (2 (hosts - 1) hops).
pub const TREE_BYTES: usize = 64 << 10;
/// Above `TREE_BYTES`, the double binary tree saves the ring's extra hops: 2 (hosts - 1) for
/// the ring against 2 ceil(log2(hosts)) for each tree, each hop a network latency (~20 us
/// between namespace hosts here), while each tree's pipeline moves its half a little slower
/// than the ring moves the whole (measured on 4 loopback hosts: the tree ahead at 64 KiB, the
/// ring at 256 KiB and above). So it serves up to this many bytes per hop saved (none for 3
/// hosts; 4 and 5: 160 KiB; 8: 640 KiB; 16: 1.7 MiB), at most `DOUBLE_TREE_MAX`.
pub const DOUBLE_TREE_BYTES_PER_HOP: usize = 80 << 10;
pub const DOUBLE_TREE_MAX: usize = 16 << 20;

/// The most bytes the double binary tree serves among `hosts` leaders (see above).
fn double_tree_bytes(hosts: usize) -> usize {
    let depth = hosts.next_power_of_two().trailing_zeros() as usize;
    let saved = 2 * (hosts - 1).saturating_sub(depth);
    (saved * DOUBLE_TREE_BYTES_PER_HOP).min(DOUBLE_TREE_MAX)
}

/// How the hosts' leaders all-reduce among themselves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leaders {
    Exchange,
    Tree,
    DoubleTree,
    Ring,
}

impl Leaders {
    pub fn name(self) -> &'static str {
        match self {
            Leaders::Exchange => "exchange",
            Leaders::Tree => "tree",
            Leaders::DoubleTree => "double tree",
            Leaders::Ring => "ring",
        }
    }

    /// For `hosts` leaders, `bytes` and `red` (without its pre-multiply): the exchange for two
    /// (where `order_free`, below `EXCHANGE_BYTES`); for 3 or more, the trees by size where there is no post-divide (a
    /// tree's one program would divide at every level: integer averages take the ring).
    pub fn choose(red: &RedSpec, bytes: usize, hosts: usize) -> Leaders {
        let divides = matches!(red, RedSpec::Ready(r) if r.postdiv.is_some());
        if hosts == 2 && order_free(red) && bytes < EXCHANGE_BYTES {
            Leaders::Exchange
        } else if hosts < 3 || divides {
            Leaders::Ring
        } else if bytes <= TREE_BYTES {
            Leaders::Tree
        } else if bytes <= double_tree_bytes(hosts) {
            Leaders::DoubleTree
        } else {
            Leaders::Ring
        }
    }
}

/// The plan for an all-reduce of this communicator of `bytes` with `red`: the exchange for 2
/// ranks on 2 hosts (where `order_free`, below `EXCHANGE_BYTES`; else the flat ring, which
/// for 2 ranks is the leaders' ring); the hierarchical plan where some host has several
/// ranks, or, with one rank per host, where the leaders' tree serves it; otherwise nothing (the
/// flat ring: each of its steps crosses a host boundary anyway).
pub fn choose(l: &dyn Links, red: &RedSpec, bytes: usize) -> Option<Plan> {
    let n = l.nranks();
    if n < 2 || (0..n).all(|r| l.host(r) == l.host(0)) {
        return None;
    }
    if n == 2 {
        return (exchange_possible(l, red) && bytes < EXCHANGE_BYTES).then_some(Plan::Exchange);
    }
    let hs = hosts(l);
    let trees = matches!(
        Leaders::choose(&without_pre(*red), bytes, hs.len()),
        Leaders::Tree | Leaders::DoubleTree
    );
    (hs.iter().any(|h| h.len() > 1) || trees).then_some(Plan::Hierarchical)
}

/// Whether the exchange can serve this communicator's all-reduce with `red` at any size (2
/// ranks on 2 hosts, an order-free reduction): what `NCCL_ALGO=direct` asks for.
pub fn exchange_possible(l: &dyn Links, red: &RedSpec) -> bool {
    l.nranks() == 2 && l.host(0) != l.host(1) && order_free(red)
}

/// A sub-group of a communicator's ranks (`members`, in the order its programs number them),
/// as the ring and chain builders see it; its connections are the communicator's of `class`
/// (direct ones; the second of two trees that run at once has its own).
struct Sub<'a> {
    parent: &'a dyn Links,
    members: &'a [usize],
    me: usize,
    class: Class,
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
        self.parent.conn(self.members[peer], is_sender, self.class)
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

/// The hierarchical all-reduce: this rank's three stages, each holding the programs that run at
/// once (two for the double tree, else one): to the host's leader, among the leaders (empty on
/// other ranks), back from the leader (empty on a host of one rank). Every rank has all three,
/// so that stage k is the same step everywhere: the CUDA executor launches stage k of the
/// ranks that share a stream together, and a rank's stage that waited for another rank's later
/// one would stop that launch.
pub fn all_reduce_hierarchical(
    l: &dyn Links,
    send: usize,
    recv: usize,
    count: usize,
    dtype: DataType,
    red: RedSpec,
) -> Result<Vec<Vec<Program>>> {
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
        class: Class::Direct,
    };
    let leaders: Vec<usize> = hs.iter().map(|h| h[0]).collect();
    let mut out = Vec::with_capacity(3);
    // Inside the host, to the leader (which applies its own pre-multiply; one rank: a local one).
    out.push(vec![ring::reduce(
        &inside,
        send,
        recv,
        count,
        dtype,
        without_post(red),
        0,
    )?]);
    if leaders.contains(&me) {
        let across = |class| Sub {
            parent: l,
            members: &leaders,
            me: leaders.iter().position(|&r| r == me).expect("a leader"),
            class,
        };
        let a = across(Class::Direct);
        let red = without_pre(red);
        let bytes = count * dtype.size();
        out.push(match Leaders::choose(&red, bytes, leaders.len()) {
            Leaders::Exchange => vec![exchange(
                &a,
                1 - a.me,
                (recv, recv),
                count,
                dtype,
                red,
                false,
            )?],
            Leaders::Tree => vec![tree(&a, false, recv, count, dtype, red)?],
            Leaders::DoubleTree => {
                let half = count / 2;
                let upper = recv + half * dtype.size();
                vec![
                    tree(&a, false, recv, half, dtype, red)?,
                    tree(&across(Class::Tree), true, upper, count - half, dtype, red)?,
                ]
            }
            Leaders::Ring => vec![ring::all_reduce(&a, recv, recv, count, dtype, red)?],
        });
    } else {
        out.push(Vec::new());
    }
    out.push(if mine.len() > 1 {
        vec![ring::broadcast(&inside, recv, recv, count, dtype, 0)?]
    } else {
        Vec::new()
    });
    Ok(out)
}

/// An all-reduce in place on `buf` up and down a binary tree of `l`'s ranks (position i's
/// children are 2i+1 and 2i+2; rank r holds position r, or n-1-r in the `mirror`ed tree): each
/// rank reduces its children's data into its own and sends the sum to its parent; the root's
/// result comes back down. One program, pipelined by slice; every rank ends with the root's
/// bytes. `red` has neither pre-multiply nor post-divide.
fn tree(
    l: &dyn Links,
    mirror: bool,
    buf: usize,
    count: usize,
    dtype: DataType,
    red: RedSpec,
) -> Result<Program> {
    let n = l.nranks();
    // Position to rank and back (the mirror is its own inverse).
    let at = |p: usize| if mirror { n - 1 - p } else { p };
    let i = at(l.rank());
    let children: Vec<usize> = [2 * i + 1, 2 * i + 2]
        .into_iter()
        .filter(|&c| c < n)
        .map(at)
        .collect();
    let step = |prim, dst| ring::step(prim, buf, dst, count);
    let mut steps = Vec::new();
    for &c in &children {
        let mut s = step(Prim::RecvReduceCopy, buf);
        s.recv = Some(l.conn(c, false, Class::Direct)?);
        steps.push(s);
    }
    if i > 0 {
        let parent = at((i - 1) / 2);
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

/// One stage per list of programs, each program a lane of its own.
pub fn stages(programs: Vec<Vec<Program>>) -> Vec<Stage> {
    programs
        .into_iter()
        .map(|ps| {
            let mut s = Stage::default();
            s.lanes.extend(ps.into_iter().map(|p| vec![p.into()]));
            s
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{ReduceKind, Reduction};

    fn red(dtype: DataType, kind: ReduceKind, postdiv: bool) -> RedSpec {
        RedSpec::Ready(Reduction {
            dtype,
            kind,
            premul: None,
            postdiv: postdiv.then_some(2),
        })
    }

    /// The leaders' all-reduce by hosts and size: the exchange for two below `EXCHANGE_BYTES`
    /// (order-free reductions only), one tree up to 64 KiB, two trees while they save hops
    /// (never for 3 hosts), the ring otherwise and for post-divides.
    #[test]
    fn leaders_choose_by_hosts_and_size() {
        use Leaders::*;
        let sum = red(DataType::Float32, ReduceKind::Sum, false);
        let max = red(DataType::Float32, ReduceKind::Max, false);
        let avg = red(DataType::Int32, ReduceKind::Sum, true);
        assert_eq!(Leaders::choose(&sum, EXCHANGE_BYTES - 4, 2), Exchange);
        assert_eq!(Leaders::choose(&sum, EXCHANGE_BYTES, 2), Ring);
        assert_eq!(Leaders::choose(&max, 8, 2), Ring);
        assert_eq!(Leaders::choose(&avg, 8, 4), Ring);
        assert_eq!(Leaders::choose(&sum, 64 << 10, 3), Tree);
        assert_eq!(Leaders::choose(&sum, (64 << 10) + 4, 3), Ring);
        for (hosts, most) in [
            (4, 160 << 10),
            (5, 160 << 10),
            (8, 640 << 10),
            (16, 1760 << 10),
        ] {
            assert_eq!(Leaders::choose(&sum, 64 << 10, hosts), Tree, "{hosts}");
            assert_eq!(Leaders::choose(&sum, most, hosts), DoubleTree, "{hosts}");
            assert_eq!(Leaders::choose(&sum, most + 4, hosts), Ring, "{hosts}");
        }
        assert_eq!(Leaders::choose(&sum, 16 << 20, 1024), DoubleTree);
        assert_eq!(Leaders::choose(&sum, (16 << 20) + 4, 1024), Ring);
    }

    /// Hosts of 2 ranks and of 1 (ranks 0-1, 2-3, 4): every rank's hierarchical all-reduce has
    /// the same three stages, step by step: its programs in the leaders' stage on leaders only,
    /// in the last stage on hosts of several ranks only.
    #[test]
    fn every_rank_has_the_same_stages() {
        struct L(usize);
        impl super::super::ring::Links for L {
            fn rank(&self) -> usize {
                self.0
            }
            fn nranks(&self) -> usize {
                5
            }
            fn slot_bytes(&self) -> usize {
                4096
            }
            fn host(&self, r: usize) -> u64 {
                (r / 2) as u64
            }
        }
        let sum = red(DataType::Float32, ReduceKind::Sum, false);
        for count in [256, 1 << 22] {
            for r in 0..5 {
                let st = all_reduce_hierarchical(
                    &L(r),
                    0x1000,
                    0x10_0000,
                    count,
                    DataType::Float32,
                    sum,
                )
                .unwrap();
                let leader = r % 2 == 0;
                assert_eq!(st.len(), 3, "rank {r}");
                assert!(!st[0].is_empty(), "rank {r}");
                assert_eq!(!st[1].is_empty(), leader, "rank {r}");
                assert_eq!(!st[2].is_empty(), r < 4, "rank {r}");
            }
        }
    }
}
