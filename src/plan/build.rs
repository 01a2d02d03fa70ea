//! Algorithm choice: one communicator's calls of a group become one task. Collectives that the
//! executor can run directly over its board are planned as direct operations (eager when small,
//! with the ring to fall back on when large); the rest as rings, chains and direct connections;
//! sends and receives as one lane per peer and direction.

use super::board::{BoardKind, BoardOp};
use super::call::{of_coll, of_p2p};
use super::hier;
use super::ring::Links;
use super::task::{Task, What};
use super::{direct, out_count, overlaps, ring, Addr, Program, RedSpec, Stage, Stash, Work};
use crate::error::{Error, Result};
use crate::transport::Class;
use crate::types::{CollArgs, CollKind};

/// What an executor offers a communicator's plans.
#[derive(Clone, Copy, Debug)]
pub struct Caps {
    /// Direct operations over a board every rank reaches.
    pub direct: bool,
    /// How the choice of a direct operation that is not eager reads (`NCCL_DEBUG_SUBSYS=TUNING`).
    pub direct_algo: &'static str,
    /// Whether a direct operation that is not eager carries the ring to fall back on (where
    /// some peer buffer may turn out out of reach); without it, it plans no ring.
    pub direct_fallback: bool,
    /// The largest input per rank (bytes) a direct operation carries on the board itself.
    pub eager_bytes: usize,
    /// The rings a large all-reduce, broadcast or reduce is split across (1 to
    /// `Class::RINGS`; see `channel_parts`).
    pub channels: usize,
}

/// The least bytes a ring channel takes: a collective is split across at most as many
/// channels as it has this many bytes.
pub const CHANNEL_MIN_BYTES: usize = 256 << 10;

/// How `count` elements of `esize` bytes split across at most `channels` rings: (first
/// element, count) of each part, in order, each a multiple of 16 bytes but the last; one part
/// where the data is too small to share out.
pub fn channel_parts(count: usize, esize: usize, channels: usize) -> Vec<(usize, usize)> {
    let by_size = (count * esize / CHANNEL_MIN_BYTES).max(1);
    let c = channels.clamp(1, Class::RINGS).min(by_size);
    let align = (16 / esize).max(1);
    let per = count.div_ceil(c).div_ceil(align) * align;
    (0..c)
        .map(|k| (k * per, count.saturating_sub(k * per).min(per)))
        .filter(|&(_, n)| n > 0)
        .collect()
}

/// What a task does, for messages: its first call, and how many more the group has.
pub fn describe<T>(qs: &[T], call: impl Fn(&T) -> (CollArgs, Option<RedSpec>)) -> What {
    let a = &call(&qs[0]).0;
    What {
        kind: a.kind.name(),
        count: a.count,
        dtype: a.dtype.name(),
        more: qs.len() - 1,
    }
}

/// Plans one communicator's calls of a group into a task.
///
/// `caps`: what the executor offers this communicator; collectives that can run as direct
/// operations are planned as such (eager up to its eager limit, else with the ring to fall back
/// on).
///
/// `call` reads a call's arguments and reduction out of the caller's records (no copy of them
/// is made: this runs at every launch).
pub fn build_task<T>(
    l: &dyn Links,
    caps: Caps,
    qs: &[T],
    call: impl Fn(&T) -> (CollArgs, Option<RedSpec>),
) -> Result<Task> {
    let direct = caps.direct;
    let (rank, nranks) = (l.rank(), l.nranks());
    let mut task = Task::default();
    // Self send/recv pairs, matched in order.
    let mut self_sends = std::collections::VecDeque::new();
    let mut self_recvs = std::collections::VecDeque::new();
    // One lane per (peer, direction).
    let mut p2p_lanes: Vec<((usize, bool), Vec<Program>)> = Vec::new();
    // A send from memory that a receive of the same task writes (sendrecv in place) reads a
    // copy taken when the task starts: the receive may run ahead of the send.
    let recvs: Vec<(usize, usize)> = qs
        .iter()
        .map(&call)
        .filter(|(a, _)| a.kind == CollKind::Recv)
        .map(|(a, _)| (a.recv, a.count * a.dtype.size()))
        .collect();
    let mut p2p_stash = Stash::default();
    let mut send_src = |a: &CollArgs| {
        let bytes = a.count * a.dtype.size();
        if recvs.iter().any(|&(r, rb)| overlaps(a.send, bytes, r, rb)) {
            p2p_stash.keep(a.send, bytes)
        } else {
            Addr::user(a.send)
        }
    };
    let res = (|| -> Result<()> {
        for q in qs {
            let (a, red) = call(q);
            let root = a.root.max(0) as usize;
            // What every program of the call carries in the slots it sends.
            let words = if a.kind.is_p2p() {
                of_p2p(a.count * a.dtype.size())
            } else {
                of_coll(a.kind, a.count, a.dtype, red, root)
            };
            let tagged = |mut s: Stage| {
                for w in s.lanes.iter_mut().flatten() {
                    if let Work::Steps(p) = w {
                        p.call = words;
                    }
                }
                s
            };
            let fault = Some((
                a.dtype,
                a.recv,
                out_count(a.kind, a.count, nranks, rank, root),
            ));
            let stage = |w: Work| {
                let mut s = Stage::default();
                s.lanes.push(vec![w]);
                s.fault = fault;
                s
            };
            match a.kind {
                CollKind::AllReduce
                | CollKind::ReduceScatter
                | CollKind::AllGather
                | CollKind::Broadcast
                | CollKind::Reduce => {
                    let bk = BoardKind::of(a.kind).expect("a board collective");
                    let ring_program = || -> Result<Program> {
                        let mut p = match bk {
                            BoardKind::AllReduce => ring::all_reduce(
                                l,
                                a.send,
                                a.recv,
                                a.count,
                                a.dtype,
                                red.expect("red"),
                            ),
                            BoardKind::ReduceScatter => ring::reduce_scatter(
                                l,
                                a.send,
                                a.recv,
                                a.count,
                                a.dtype,
                                red.expect("red"),
                            ),
                            BoardKind::AllGather => {
                                ring::all_gather(l, a.send, a.recv, a.count, a.dtype)
                            }
                            BoardKind::Broadcast => {
                                ring::broadcast(l, a.send, a.recv, a.count, a.dtype, root)
                            }
                            BoardKind::Reduce => ring::reduce(
                                l,
                                a.send,
                                a.recv,
                                a.count,
                                a.dtype,
                                red.expect("red"),
                                root,
                            ),
                        }?;
                        p.call = words;
                        Ok(p)
                    };
                    let bytes = a.count * a.dtype.size();
                    // Across hosts, an all-reduce's own plans (see `hier`).
                    let across = match (bk, red) {
                        (BoardKind::AllReduce, Some(red)) => hier::choose(l, &red, bytes)
                            .or_else(|| {
                                // Past its size the exchange gives way to the ring, unless the
                                // user allows the exchange ("direct") and not the ring.
                                let name = a.kind.name();
                                (hier::exchange_possible(l, &red)
                                    && super::algo::algo_allows(name, "direct")
                                    && !super::algo::algo_allows(name, "ring"))
                                .then_some(hier::Plan::Exchange)
                            })
                            .filter(|p| {
                                let among = ["ring", p.algo()];
                                super::algo::algo_allows_among(a.kind.name(), p.algo(), &among)
                            })
                            .map(|p| (p, red)),
                        _ => None,
                    };
                    if let Some((plan, red)) = across {
                        // The label takes work (`hier::hosts`): only when it prints.
                        super::algo::log_choice_with(a.kind.name(), bytes, nranks, || {
                            plan.label(l, &red, bytes)
                        });
                        match plan {
                            // One program (the small operations' plan between two hosts).
                            hier::Plan::Exchange => {
                                let p = hier::all_reduce_exchange(
                                    l, a.send, a.recv, a.count, a.dtype, red,
                                )?;
                                task.stages.push(tagged(stage(p.into())));
                            }
                            hier::Plan::Hierarchical => {
                                let programs = hier::all_reduce_hierarchical(
                                    l, a.send, a.recv, a.count, a.dtype, red,
                                )?;
                                let mut stages = hier::stages(programs);
                                // (The last this rank runs: a host of one rank has no third.)
                                if let Some(last) =
                                    stages.iter_mut().rev().find(|s| !s.lanes.is_empty())
                                {
                                    last.fault = fault;
                                }
                                for s in stages {
                                    task.stages.push(tagged(s));
                                }
                            }
                        }
                        continue;
                    }
                    let direct = direct && super::algo::algo_allows(a.kind.name(), "direct");
                    let work = if direct && nranks > 1 {
                        // An eager operation never falls back: no ring to plan.
                        let eager = super::board::fits_inline(
                            bk,
                            nranks,
                            a.count,
                            a.dtype,
                            caps.eager_bytes,
                        );
                        let fallback = if eager || !caps.direct_fallback {
                            None
                        } else {
                            Some(Box::new(ring_program()?))
                        };
                        let algo = if eager { "Direct" } else { caps.direct_algo };
                        super::algo::log_choice(a.kind.name(), bytes, nranks, algo);
                        Work::Board(Box::new(BoardOp::new(rank, nranks, &a, red, bk, fallback)))
                    } else {
                        super::algo::log_choice(a.kind.name(), bytes, nranks, "Ring");
                        let parts = match bk {
                            BoardKind::AllReduce | BoardKind::Broadcast | BoardKind::Reduce
                                if caps.channels > 1 && nranks > 1 =>
                            {
                                channel_parts(a.count, a.dtype.size(), caps.channels)
                            }
                            _ => Vec::new(),
                        };
                        if parts.len() > 1 {
                            task.stages
                                .push(channels(l, &a, red, bk, root, &parts, words, fault)?);
                            continue;
                        }
                        ring_program()?.into()
                    };
                    task.stages.push(stage(work));
                }
                CollKind::AlltoAll => {
                    let bytes = a.count * a.dtype.size() * nranks;
                    super::algo::log_choice(a.kind.name(), bytes, nranks, "Direct");
                    let mut s = tagged(direct::all_to_all(l, a.send, a.recv, a.count, a.dtype)?);
                    s.fault = fault;
                    task.stages.push(s);
                }
                CollKind::Gather => {
                    let mut s = tagged(direct::gather(l, a.send, a.recv, a.count, a.dtype, root)?);
                    s.fault = fault;
                    task.stages.push(s);
                }
                CollKind::Scatter => {
                    let mut s = tagged(direct::scatter(l, a.send, a.recv, a.count, a.dtype, root)?);
                    s.fault = fault;
                    task.stages.push(s);
                }
                CollKind::Send | CollKind::Recv => {
                    if task.p2p_after.is_none() {
                        task.p2p_after = Some(task.stages.len());
                    }
                    let is_send = a.kind == CollKind::Send;
                    if root == rank {
                        if is_send {
                            self_sends.push_back(a);
                        } else {
                            self_recvs.push_back(a);
                        }
                        continue;
                    }
                    let mut prog = if is_send {
                        direct::send(l, send_src(&a), a.count, a.dtype, root, Class::P2p)?
                    } else {
                        direct::recv(l, a.recv, a.count, a.dtype, root, Class::P2p)?
                    };
                    prog.call = words;
                    match p2p_lanes.iter_mut().find(|(k, _)| *k == (root, is_send)) {
                        Some((_, v)) => v.push(prog),
                        None => p2p_lanes.push(((root, is_send), vec![prog])),
                    }
                }
            }
        }
        if self_sends.len() != self_recvs.len() {
            return Err(Error::invalid_usage(format!(
                "rank {}: {} send(s) to itself but {} recv(s) from itself in one group",
                rank,
                self_sends.len(),
                self_recvs.len()
            )));
        }
        for (s, r) in self_sends.into_iter().zip(self_recvs) {
            if s.count * s.dtype.size() != r.count * r.dtype.size() {
                return Err(Error::invalid_usage(format!(
                    "rank {}: send to itself of {} bytes matched with a recv of {} bytes",
                    rank,
                    s.count * s.dtype.size(),
                    r.count * r.dtype.size()
                )));
            }
            if s.send == r.recv {
                continue; // in place: nothing moves
            }
            p2p_lanes.push((
                (rank, true),
                vec![direct::local_copy(
                    l,
                    send_src(&s),
                    r.recv,
                    s.count,
                    s.dtype,
                )],
            ));
        }
        Ok(())
    })();
    res?;
    task.p2p_stash = p2p_stash;
    task.p2p = p2p_lanes
        .into_iter()
        .map(|(_, v)| v.into_iter().map(Work::from).collect())
        .collect();
    Ok(task)
}

/// A ring collective split across channels: one stage whose lanes each run the collective's
/// ring over one part of the data (`parts`, from `channel_parts`) on channel k's connections,
/// all at once.
#[allow(clippy::too_many_arguments)]
fn channels(
    l: &dyn Links,
    a: &CollArgs,
    red: Option<RedSpec>,
    bk: BoardKind,
    root: usize,
    parts: &[(usize, usize)],
    words: super::call::Call,
    fault: Option<(crate::types::DataType, usize, usize)>,
) -> Result<Stage> {
    let es = a.dtype.size();
    let mut s = Stage::default();
    for (k, &(first, n)) in parts.iter().enumerate() {
        let ch = ring::Channel {
            parent: l,
            class: Class::ring(k),
        };
        let (send, recv) = (a.send + first * es, a.recv + first * es);
        let red = || red.ok_or_else(|| Error::internal("a reduction without its operator"));
        let mut p = match bk {
            BoardKind::AllReduce => ring::all_reduce(&ch, send, recv, n, a.dtype, red()?)?,
            BoardKind::Broadcast => ring::broadcast(&ch, send, recv, n, a.dtype, root)?,
            BoardKind::Reduce => ring::reduce(&ch, send, recv, n, a.dtype, red()?, root)?,
            _ => {
                return Err(Error::internal(
                    "a collective that is not split across rings",
                ))
            }
        };
        p.call = words;
        s.lanes.push(vec![p.into()]);
    }
    s.fault = fault;
    Ok(s)
}
