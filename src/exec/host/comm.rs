//! The host executor's per-communicator state: the order its tasks run in (tickets), the board
//! of direct operations and its sequence numbers, peers' buffers mapped into this process, what
//! the tuner has measured, and whether cross-memory attach reaches every peer.

use super::memory::PeerMaps;
use super::tune::Tuner;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::health::{Health, Wait};
use crate::transport::board::Board;
use crate::transport::peer::PeerInfo;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub struct HostComm {
    pub rank: usize,
    pub nranks: usize,
    /// The communicator's hash and name, for log lines.
    pub hash: u64,
    pub name: Option<String>,
    pub health: Arc<Health>,
    next_ticket: AtomicU64,
    serving: AtomicU64,
    /// One past the ticket of the last task that began touching user memory: the communicator
    /// is quiescent when that task has finished (`begun <= serving`). Tasks begin in ticket
    /// order, and a task that finds the communicator aborted never begins.
    begun: AtomicU64,
    /// The board of direct algorithms (all ranks on this host), its operation counter.
    /// Set at init and kept as long as the state (tasks and peers' late reads hold their own).
    board: Option<Arc<Board>>,
    board_seq: AtomicU64,
    pub maps: Arc<PeerMaps>,
    /// Bandwidth seen on the ring and by cross-memory attach (see `tune`).
    pub tuner: Arc<Tuner>,
    /// Every rank can read and write every other rank's process memory (`transport::cma`).
    pub cma: bool,
    /// How to ask whether peers in other processes of this host live, by rank (None: this
    /// process, or another host), watched while an operation waits (`dead_peer`).
    peer_probes: Vec<Option<crate::liveness::Probe>>,
    /// The last operations, when `OXCCL_FLIGHT_RECORDER` asks for them.
    pub recorder: Option<crate::flight::Recorder>,
    /// "rank R (process P on host H)" of every rank, for messages.
    peer_names: Vec<String>,
    /// The buffers of in-place operations' private copies, kept between tasks.
    pub stash_pool: Arc<super::task::StashPool>,
}

impl HostComm {
    /// Sets up a rank's state once its peers are known (a collective call: every rank makes it).
    pub fn init(
        rank: usize,
        nranks: usize,
        hash: u64,
        peers: &[PeerInfo],
        boot: &Bootstrap,
        health: Arc<Health>,
        name: Option<String>,
    ) -> Result<HostComm> {
        let me = &peers[rank];
        let mut cma = false;
        // Direct algorithms need every rank on this host; with OXCCL_ALGO=ring there is no board
        // (the exchange below happens all the same, so ranks never disagree on init's steps).
        let board = if nranks > 1 && peers.iter().all(|q| q.host == me.host) {
            let shared = peers.iter().any(|q| !q.same_process(me));
            if shared {
                // Cross-memory attach only if every rank reaches every other process.
                let mine = crate::param::cma_enabled()
                    && peers.iter().all(|q| {
                        q.same_process(me)
                            || (me.pid_seen_by(q) != 0
                                && crate::transport::cma::can_reach(q.pid, q.probe))
                    });
                let all = boot.allgather(&[mine as u8])?;
                cma = all.iter().all(|v| v.first() == Some(&1));
            }
            if crate::plan::algo::direct_algorithms() {
                Some(Arc::new(Board::open(hash, nranks, shared)?))
            } else {
                None
            }
        } else {
            None
        };
        let peer_probes = PeerInfo::local_probes(peers, rank);
        Ok(HostComm {
            peer_names: peers
                .iter()
                .enumerate()
                .map(|(r, q)| q.describe(r))
                .collect(),
            peer_probes,
            recorder: crate::flight::for_comm(hash, name.clone(), rank),
            hash,
            name,
            rank,
            nranks,
            health,
            next_ticket: AtomicU64::new(0),
            serving: AtomicU64::new(0),
            begun: AtomicU64::new(0),
            board,
            board_seq: AtomicU64::new(0),
            maps: Arc::new(PeerMaps::default()),
            tuner: Default::default(),
            cma,
            stash_pool: Default::default(),
        })
    }

    pub fn take_ticket(&self) -> u64 {
        self.next_ticket.fetch_add(1, Ordering::AcqRel)
    }
    pub fn is_serving(&self, ticket: u64) -> bool {
        self.serving.load(Ordering::Acquire) == ticket
    }

    /// Task `ticket`, whose turn it is, begins to touch user memory unless the communicator is
    /// aborted or broken (then the error it must end with). Paired with `wait_quiescent`: either
    /// the abort is seen here, or the waiter sees this task begun and waits for its end.
    #[inline]
    pub fn begin(&self, ticket: u64) -> Result<()> {
        if self.try_begin(ticket) {
            return Ok(());
        }
        let h = &self.health;
        // Stopped by a failure (a timeout, a lost peer): that failure says why, as a running
        // task's would (`Running::aborted_error`); an abort or a revoke says so.
        if !h.aborted_here() && !h.revoked() {
            if let Some(e) = h.error() {
                return Err(e);
            }
        }
        if h.halted() {
            return Err(Error::remote(format!(
                "rank {}: communicator {}",
                self.rank,
                h.halted_how()
            )));
        }
        Ok(())
    }

    /// `begin` without the error: whether task `ticket` may begin.
    #[inline]
    pub fn try_begin(&self, ticket: u64) -> bool {
        self.begun.store(ticket + 1, Ordering::SeqCst);
        // (A revoke breaks the communicator too: `failed` covers it.)
        !self.health.aborted() && !self.health.failed()
    }

    /// Ends the turn of `ticket`, if it is being served. Only the holder of the ticket being
    /// served moves `serving` on, so a load and a store do what a compare-and-swap would, without
    /// a locked instruction (which would first wait for this rank's arrival on the board, still
    /// on its way to the peers, to leave the store buffer).
    pub fn advance_serving(&self, ticket: u64) {
        if self.serving.load(Ordering::Acquire) == ticket {
            self.serving.store(ticket + 1, Ordering::Release);
        }
    }
    /// True when every task handed out so far has finished.
    pub fn idle(&self) -> bool {
        self.serving.load(Ordering::Acquire) == self.next_ticket.load(Ordering::Acquire)
    }

    /// True when no task touches user memory: every task that began has ended.
    fn quiescent(&self) -> bool {
        self.begun.load(Ordering::SeqCst) <= self.serving.load(Ordering::Acquire)
    }

    /// Waits until all queued work is done; after an abort, until no task touches user memory
    /// any more (tasks that had not begun never will).
    pub fn wait_quiescent(&self, deadline: Instant) -> Result<()> {
        let w = Wait {
            deadline,
            ..Wait::new(
                format!("rank {}", self.rank),
                deadline.saturating_duration_since(Instant::now()),
                None,
            )
        };
        let what = || "its outstanding operations to complete".to_string();
        w.until(&what, || {
            self.idle() || (self.health.halted() && self.quiescent())
        })
    }

    /// What plans for this communicator may use.
    #[inline]
    pub fn caps(&self) -> crate::plan::build::Caps {
        crate::plan::build::Caps {
            direct: self.has_board(),
            direct_algo: "Direct (Ring fallback)",
            direct_fallback: true,
            eager_bytes: crate::transport::board::INLINE,
            // One thread runs a task's lanes: more rings would only interleave there.
            channels: 1,
        }
    }

    /// A peer process of this host that has died (exited, killed, or a zombie), among the
    /// ranks `of` says: what a waiting operation checks now and then, so that it fails at once
    /// rather than at its timeout.
    pub fn dead_peer(&self, of: impl Fn(usize) -> bool) -> Option<usize> {
        (0..self.peer_probes.len()).find(|&r| of(r) && !self.peer_alive(r))
    }

    /// "rank R (process P on host H)", for messages.
    pub fn peer_name(&self, r: usize) -> &str {
        self.peer_names.get(r).map_or("a rank", |s| s.as_str())
    }

    /// Whether rank `p`'s process still runs (as far as this host can tell: ranks of this
    /// process and of other hosts count as running).
    pub fn peer_alive(&self, p: usize) -> bool {
        self.peer_probes
            .get(p)
            .copied()
            .flatten()
            .is_none_or(crate::liveness::Probe::alive)
    }

    /// The communicator ends here (destroyed or aborted, its work stopped): peers on this host
    /// that wait for this rank on the board stop waiting (`Board::ended`).
    pub fn end(&self) {
        if let Some(b) = &self.board {
            b.end(self.rank);
        }
    }

    /// Whether `board_op` gives an operation.
    #[inline]
    pub fn has_board(&self) -> bool {
        self.board.is_some()
    }

    /// The board and the sequence number of the next direct operation, if direct algorithms
    /// are available and allowed (the board exists only then).
    #[inline]
    pub fn board_op(&self) -> Option<(Arc<Board>, u64)> {
        let b = self.board.clone()?;
        Some((b, self.board_seq.fetch_add(1, Ordering::AcqRel) + 1))
    }
}
