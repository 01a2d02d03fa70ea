//! Communicators: creation (blocking, or deferred to `ncclGroupEnd` inside a group), the per-rank
//! core the engine works with, lifecycle (finalize, destroy, abort) and per-comm tables
//! (PreMulSum operators, registered buffers).

pub mod handles;
mod peer;
pub mod tables;

use crate::api::{CommConfig, UNIQUE_ID_BYTES};
use crate::bootstrap::{Bootstrap, UniqueId};
use crate::error::{Code, Error, Result};
use crate::memory::PeerMaps;
use crate::plan::ring::Links;
use crate::transport::board::Board;
use crate::transport::{self, Class, Conn, Locality};
use once_cell::sync::OnceCell;
use parking_lot::Mutex;
use peer::PeerInfo;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

pub use tables::{RedOps, Registry};

/// The initialised state of one rank of a communicator.
pub struct Core {
    pub rank: usize,
    pub nranks: usize,
    pub cuda_dev: i32,
    pub hash: u64,
    pub name: Option<String>,
    pub slot_bytes: usize,
    pub nsteps: usize,
    peers: Vec<PeerInfo>,
    conns: Mutex<HashMap<(usize, bool, Class), Arc<Conn>>>,
    next_ticket: AtomicU64,
    serving: AtomicU64,
    abort: Arc<AtomicBool>,
    broken: Mutex<Option<Error>>,
    /// Whether `broken` holds an error (read first, so that a healthy call takes no lock).
    is_broken: AtomicBool,
    bootstrap: Mutex<Option<Bootstrap>>,
    /// The board of direct algorithms (all ranks on this host), its operation counter, and the
    /// peers' buffers mapped into this process.
    /// Set at init and kept as long as the core (tasks and peers' late reads hold their own).
    board: Option<Arc<Board>>,
    board_seq: AtomicU64,
    pub maps: Arc<PeerMaps>,
    /// Bandwidth seen on the ring and by cross-memory attach (see `plan::tune`).
    pub tuner: Arc<crate::plan::tune::Tuner>,
    /// Every rank can read and write every other rank's process memory (`transport::cma`).
    pub cma: bool,
}

impl Core {
    pub fn take_ticket(&self) -> u64 {
        self.next_ticket.fetch_add(1, Ordering::AcqRel)
    }
    pub fn is_serving(&self, ticket: u64) -> bool {
        self.serving.load(Ordering::Acquire) == ticket
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
    pub fn aborted(&self) -> bool {
        self.abort.load(Ordering::Acquire)
    }
    pub fn broken(&self) -> Option<Error> {
        if !self.is_broken.load(Ordering::Acquire) {
            return None;
        }
        self.broken.lock().clone()
    }
    pub fn set_broken(&self, e: Error) {
        let mut b = self.broken.lock();
        if b.is_none() {
            *b = Some(e);
            self.is_broken.store(true, Ordering::Release);
        }
    }

    fn locality(&self, peer: usize) -> Result<Locality> {
        let (me, p) = (&self.peers[self.rank], &self.peers[peer]);
        if me.host != p.host {
            return Err(Error::not_yet(&format!(
                "the network transport (rank {peer} is on another host)"
            )));
        }
        Ok(if me.pid == p.pid {
            Locality::SameProcess
        } else {
            Locality::SameHost
        })
    }

    /// Waits until all queued work is done (or the comm is aborted / times out).
    pub fn wait_idle(&self) -> Result<()> {
        let deadline = std::time::Instant::now() + crate::param::timeout();
        while !self.idle() {
            if self.aborted() {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(Error::timeout(format!(
                    "rank {}: outstanding operations did not complete",
                    self.rank
                )));
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        Ok(())
    }

    /// Whether `board_op` gives an operation.
    pub fn has_board(&self) -> bool {
        crate::param::direct_algorithms() && self.board.is_some()
    }

    /// The board and the sequence number of the next direct operation, if direct algorithms
    /// are available and allowed.
    pub fn board_op(&self) -> Option<(Arc<Board>, u64)> {
        if !crate::param::direct_algorithms() {
            return None;
        }
        let b = self.board.clone()?;
        Some((b, self.board_seq.fetch_add(1, Ordering::AcqRel) + 1))
    }

    fn teardown(&self) {
        self.conns.lock().clear();
        // Dropping the bootstrap closes its sockets and joins its threads.
        let _ = self.bootstrap.lock().take();
    }

    pub fn with_bootstrap<T>(&self, f: impl FnOnce(&Bootstrap) -> Result<T>) -> Result<T> {
        let b = self.bootstrap.lock();
        match b.as_ref() {
            Some(b) => f(b),
            None => Err(Error::invalid_usage("communicator has been destroyed")),
        }
    }
}

impl Links for Core {
    fn rank(&self) -> usize {
        self.rank
    }
    fn nranks(&self) -> usize {
        self.nranks
    }
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }
    fn conn(&self, peer: usize, is_sender: bool, class: Class) -> Result<Arc<Conn>> {
        let key = (peer, is_sender, class);
        if let Some(c) = self.conns.lock().get(&key) {
            return Ok(c.clone());
        }
        let loc = self.locality(peer)?;
        let c = Arc::new(transport::connect(&transport::ConnSpec {
            locality: loc,
            comm_hash: self.hash,
            me: self.rank,
            peer,
            is_sender,
            class,
            nsteps: self.nsteps,
            slot_bytes: self.slot_bytes,
        })?);
        self.conns.lock().insert(key, c.clone());
        Ok(c)
    }
}

/// What a deferred init needs.
struct PendingInit {
    nranks: usize,
    rank: usize,
    ids: Vec<UniqueId>,
    config: CommConfig,
    dev: Option<i32>,
}

/// A communicator handle's object: its core once initialised.
pub struct Comm {
    core: OnceCell<Arc<Core>>,
    pending: Mutex<Option<PendingInit>>,
    init_error: Mutex<Option<Error>>,
    destroyed: AtomicBool,
    pub redops: RedOps,
    pub registry: Registry,
}

impl Comm {
    fn pending(p: PendingInit) -> Comm {
        Comm {
            core: OnceCell::new(),
            pending: Mutex::new(Some(p)),
            init_error: Mutex::new(None),
            destroyed: AtomicBool::new(false),
            redops: RedOps::default(),
            registry: Registry::default(),
        }
    }

    /// The initialised core, or why there is none.
    pub fn core(&self) -> Result<&Arc<Core>> {
        if self.destroyed.load(Ordering::Acquire) {
            return Err(Error::invalid_argument("communicator has been destroyed"));
        }
        if let Some(c) = self.core.get() {
            return Ok(c);
        }
        if let Some(e) = self.init_error.lock().clone() {
            return Err(e);
        }
        Err(Error::invalid_usage(
            "communicator is not initialized yet (its ncclGroupEnd has not run)",
        ))
    }

    pub fn nranks(&self) -> Result<i32> {
        Ok(self.core()?.nranks as i32)
    }
    pub fn rank(&self) -> Result<i32> {
        Ok(self.core()?.rank as i32)
    }
    pub fn cuda_dev(&self) -> Result<i32> {
        Ok(self.core()?.cuda_dev)
    }
    pub fn comm_hash(&self) -> Result<u64> {
        Ok(self.core()?.hash)
    }

    /// Runs a pending init (blocking): rendezvous, exchange of peer facts, core set up.
    pub fn run_init(&self) -> Result<()> {
        let Some(p) = self.pending.lock().take() else {
            return Ok(());
        };
        match build_core(p) {
            Ok(core) => {
                let _ = self.core.set(Arc::new(core));
                Ok(())
            }
            Err(e) => {
                *self.init_error.lock() = Some(e.clone());
                Err(e)
            }
        }
    }

    pub fn finalize(&self) -> Result<()> {
        self.core()?.wait_idle()
    }

    pub fn destroy(&self) -> Result<()> {
        let r = match self.core.get() {
            Some(c) => {
                let r = c.wait_idle();
                c.teardown();
                r
            }
            None => Ok(()),
        };
        self.destroyed.store(true, Ordering::Release);
        r
    }

    pub fn abort(&self) {
        if let Some(c) = self.core.get() {
            c.abort.store(true, Ordering::Release);
        }
    }

    pub fn async_error(&self) -> Code {
        match self.core.get() {
            Some(c) => c.broken().map(|e| e.code).unwrap_or(Code::Success),
            None => self
                .init_error
                .lock()
                .as_ref()
                .map(|e| e.code)
                .unwrap_or(Code::InProgress),
        }
    }
}

fn build_core(p: PendingInit) -> Result<Core> {
    let abort = Arc::new(AtomicBool::new(false));
    let boot = Bootstrap::init(&p.ids, p.rank, p.nranks, abort.clone())
        .map_err(|e| e.context(format!("bootstrap of rank {} of {}", p.rank, p.nranks)))?;
    let me = PeerInfo::mine(p.dev.unwrap_or(-1));
    let all = boot.allgather(&me.to_bytes())?;
    let peers = all
        .iter()
        .enumerate()
        .map(|(r, b)| PeerInfo::from_bytes(b).map_err(|e| e.context(format!("rank {r}"))))
        .collect::<Result<Vec<_>>>()?;
    // Everyone uses rank 0's FIFO geometry.
    let (slot_bytes, nsteps) = (peers[0].slot_bytes as usize, peers[0].nsteps as usize);
    let cuda_dev = match p.dev {
        Some(d) => d,
        // A host slot per rank of this process: 0, 1, ... in rank order.
        None => peers[..p.rank]
            .iter()
            .filter(|q| q.host == me.host && q.pid == me.pid)
            .count() as i32,
    };
    let hash = boot.comm_hash();
    let mut cma = false;
    let board = if p.nranks > 1 && peers.iter().all(|q| q.host == me.host) {
        let shared = peers.iter().any(|q| q.pid != me.pid);
        if shared {
            // Cross-memory attach only if every rank reaches every other process.
            let mine = crate::param::cma_enabled()
                && peers
                    .iter()
                    .all(|q| q.pid == me.pid || crate::transport::cma::can_reach(q.pid, q.probe));
            let all = boot.allgather(&[mine as u8])?;
            cma = all.iter().all(|v| v.first() == Some(&1));
        }
        Some(Arc::new(Board::open(hash, p.nranks, shared)?))
    } else {
        None
    };
    crate::debug::info(&format!(
        "comm {hash:#x} rank {} nRanks {} nNodes 1 localRanks {} - Init COMPLETE (host executor)",
        p.rank,
        p.nranks,
        peers.iter().filter(|q| q.host == me.host).count()
    ));
    Ok(Core {
        rank: p.rank,
        nranks: p.nranks,
        cuda_dev,
        hash,
        name: p.config.comm_name.clone(),
        slot_bytes,
        nsteps,
        peers,
        conns: Mutex::new(HashMap::new()),
        next_ticket: AtomicU64::new(0),
        serving: AtomicU64::new(0),
        abort,
        broken: Mutex::new(None),
        is_broken: AtomicBool::new(false),
        bootstrap: Mutex::new(Some(boot)),
        board,
        board_seq: AtomicU64::new(0),
        maps: Arc::new(PeerMaps::default()),
        tuner: Default::default(),
        cma,
    })
}

fn check_executor() -> Result<()> {
    if crate::device::kind() == crate::device::DeviceKind::Cuda {
        return Err(Error::not_yet(
            "the CUDA executor (a CUDA driver was found; set OXCCL_DEVICE=host to run on host memory)",
        ));
    }
    Ok(())
}

fn parse_ids(ids: &[[u8; UNIQUE_ID_BYTES]]) -> Result<Vec<UniqueId>> {
    if ids.is_empty() {
        return Err(Error::invalid_argument("no unique id given"));
    }
    ids.iter().map(UniqueId::from_bytes).collect()
}

fn new_comm(
    nranks: i32,
    rank: i32,
    ids: Vec<UniqueId>,
    config: CommConfig,
    dev: Option<i32>,
) -> Result<Arc<Comm>> {
    check_executor()?;
    if nranks < 1 {
        return Err(Error::invalid_argument(format!(
            "invalid number of ranks {nranks} (must be at least 1)"
        )));
    }
    if rank < 0 || rank >= nranks {
        return Err(Error::invalid_argument(format!(
            "invalid rank {rank} (nranks is {nranks})"
        )));
    }
    Ok(Arc::new(Comm::pending(PendingInit {
        nranks: nranks as usize,
        rank: rank as usize,
        ids,
        config,
        dev,
    })))
}

/// `ncclCommInitRank*`: blocking outside a group, deferred to `ncclGroupEnd` inside one.
pub fn init_rank(
    nranks: i32,
    rank: i32,
    ids: &[[u8; UNIQUE_ID_BYTES]],
    config: CommConfig,
) -> Result<Arc<Comm>> {
    let comm = new_comm(nranks, rank, parse_ids(ids)?, config, None)?;
    if crate::group::defer_init(&comm) {
        return Ok(comm);
    }
    comm.run_init()?;
    Ok(comm)
}

/// `ncclCommInitAll`: one comm per listed device (host slot), all in this process.
pub fn init_all(devs: &[i32]) -> Result<Vec<Arc<Comm>>> {
    check_executor()?;
    if devs.is_empty() {
        return Err(Error::invalid_argument(
            "ncclCommInitAll: ndev must be at least 1",
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for &d in devs {
        if d < 0 {
            return Err(Error::invalid_argument(format!(
                "invalid device {d} in devlist"
            )));
        }
        if !seen.insert(d) {
            return Err(Error::invalid_usage(format!(
                "device {d} appears twice in devlist"
            )));
        }
    }
    let id = UniqueId::generate()?;
    let n = devs.len() as i32;
    let comms = devs
        .iter()
        .enumerate()
        .map(|(r, &d)| new_comm(n, r as i32, vec![id], CommConfig::default(), Some(d)))
        .collect::<Result<Vec<_>>>()?;
    run_inits(&comms)?;
    Ok(comms)
}

/// Runs several pending inits at once (they rendezvous with each other).
pub fn run_inits(comms: &[Arc<Comm>]) -> Result<()> {
    match comms {
        // Every group ends here: one without inits must not pay for a thread scope.
        [] => return Ok(()),
        [c] => return c.run_init(),
        _ => {}
    }
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| s.spawn(move || c.run_init()))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::internal("init thread panicked")))
            })
            .collect()
    });
    results.into_iter().collect()
}

/// Tag of the bootstrap message carrying a split's new unique id.
const SPLIT_TAG: u32 = 0x5eed;

/// `ncclCommSplit`: ranks with the same color form a new comm ordered by (key, old rank).
pub fn split(
    comm: &Arc<Comm>,
    color: i32,
    key: i32,
    config: Option<CommConfig>,
) -> Result<Option<Arc<Comm>>> {
    let core = comm.core()?.clone();
    if color < 0 && color != -1 {
        return Err(Error::invalid_argument(format!(
            "invalid color {color} (must be >= 0 or NCCL_SPLIT_NOCOLOR)"
        )));
    }
    core.wait_idle()?;
    let mut mine = color.to_le_bytes().to_vec();
    mine.extend_from_slice(&key.to_le_bytes());
    let all = core.with_bootstrap(|b| b.allgather(&mine))?;
    let parse = |b: &Vec<u8>, o: usize| i32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    if color == -1 {
        return Ok(None);
    }
    let mut members: Vec<(i32, usize)> = all
        .iter()
        .enumerate()
        .filter(|(_, b)| parse(b, 0) == color)
        .map(|(r, b)| (parse(b, 4), r))
        .collect();
    members.sort();
    let new_rank = members
        .iter()
        .position(|&(_, r)| r == core.rank)
        .expect("member");
    let leader = members[0].1;
    let id = if leader == core.rank {
        let id = UniqueId::generate()?;
        for &(_, r) in &members[1..] {
            core.with_bootstrap(|b| b.send(r, SPLIT_TAG, &id.to_bytes()))?;
        }
        id
    } else {
        let b = core.with_bootstrap(|b| b.recv(leader, SPLIT_TAG))?;
        let arr: [u8; UNIQUE_ID_BYTES] = b
            .try_into()
            .map_err(|_| Error::internal("split: bad unique id message"))?;
        UniqueId::from_bytes(&arr)?
    };
    let cfg = config.unwrap_or_default();
    let c = new_comm(
        members.len() as i32,
        new_rank as i32,
        vec![id],
        cfg,
        Some(core.cuda_dev),
    )?;
    c.run_init()?;
    Ok(Some(c))
}
