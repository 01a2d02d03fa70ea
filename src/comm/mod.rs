//! Communicators: creation (blocking, or deferred to `ncclGroupEnd` inside a group), the per-rank
//! core the engine works with, lifecycle (finalize, destroy, abort) and per-comm tables
//! (PreMulSum operators, registered buffers).

mod derive;
pub mod handles;
pub mod tables;

pub use derive::{shrink, shrink_at_group_end, split, split_at_group_end};

use crate::bootstrap::{Bootstrap, UniqueId, ID_BYTES as UNIQUE_ID_BYTES};
use crate::error::{Code, Error, Result};
use crate::exec::{CommExec, CommSetup};
use crate::health::Health;
use crate::transport::conns::Conns;
use crate::transport::peer::PeerInfo;
use crate::types::CommConfig;
use once_cell::sync::OnceCell;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub use tables::{RedOps, Registry};

/// The initialised state of one rank of a communicator.
pub struct Core {
    pub rank: usize,
    pub nranks: usize,
    pub cuda_dev: i32,
    pub hash: u64,
    /// The configuration it was made with (a split or shrink given none inherits it, as in
    /// NCCL).
    pub config: CommConfig,
    /// The peers, the connections made so far, and the bootstrap.
    pub conns: Conns,
    /// Abort flag, first error, remote abort: what every wait on this communicator watches.
    pub health: Arc<Health>,
    /// The executor's state of this rank.
    pub exec: CommExec,
    /// This process's liveness lock, while peers of this host in other PID namespaces look
    /// at it (`liveness`).
    _alive: Option<crate::liveness::Hold>,
    /// Communicators split or shrunk from this one whose non-blocking init may still run: as
    /// in NCCL, where that init is a job of the parent, the parent's `ncclCommGetAsyncError`
    /// says `ncclInProgress` until they are done (PyTorch waits on the parent after a shrink).
    children: Mutex<Vec<std::sync::Weak<Comm>>>,
}

impl Core {
    /// Waits until all queued work is done (for peers that are alive but late, as long as
    /// `OXCCL_TIMEOUT_S` allows: unset, as long as they live); after an abort, until nothing
    /// touches user memory any more (`ncclTimeout` past `param::bound`).
    pub fn wait_idle(&self) -> Result<()> {
        let limit = if self.health.halted() {
            crate::param::bound()
        } else {
            crate::param::wait_limit()
        };
        self.exec.wait_quiescent(std::time::Instant::now() + limit)
    }

    /// Notes a communicator made from this one whose non-blocking init runs (`children`).
    pub fn add_child(&self, c: &Arc<Comm>) {
        if c.init_running() {
            self.children.lock().push(Arc::downgrade(c));
        }
    }

    /// Notes a non-blocking communicator made from this one whose init waits for the end of
    /// the caller's group (a split or shrink there): until it is done, as `add_child`.
    pub fn add_deferred_child(&self, c: &Arc<Comm>) {
        if c.is_nonblocking() {
            self.children.lock().push(Arc::downgrade(c));
        }
    }

    /// Whether the non-blocking init of a communicator made from this one still runs.
    fn child_init_running(&self) -> bool {
        let mut kids = self.children.lock();
        kids.retain(|k| k.upgrade().is_some_and(|k| k.init_in_progress()));
        !kids.is_empty()
    }

    /// `idle`: its work is done (`wait_idle` succeeded).
    fn teardown(&self, idle: bool) {
        // Peers on this host waiting for this rank stop waiting; dropping the bootstrap closes
        // its sockets and joins its threads.
        self.exec.end();
        self.conns.teardown(idle);
    }

    pub fn with_bootstrap<T>(&self, f: impl FnOnce(&Bootstrap) -> Result<T>) -> Result<T> {
        self.conns.with_bootstrap(f)
    }

    /// Rank `r`'s host identity (hostname and boot id), as every rank saw it at init.
    pub fn host_of(&self, r: usize) -> Option<u64> {
        self.conns.peers().get(r).map(|p| p.host)
    }
}

/// Where a split or shrink deferred to its group's end learns its place, when the init runs:
/// (ranks, rank, unique id) of the new communicator, or None where this rank joins none.
type Placement = Box<dyn FnOnce() -> Result<Option<(usize, usize, UniqueId)>> + Send>;

/// What a deferred init needs.
struct PendingInit {
    nranks: usize,
    rank: usize,
    ids: Vec<UniqueId>,
    config: CommConfig,
    dev: Option<i32>,
    /// Set by `ncclCommAbort` while the init runs (it becomes the communicator's abort flag).
    abort: Arc<AtomicBool>,
    /// A split or shrink deferred to its group's end: `nranks`, `rank` and `ids` come from
    /// here first.
    placement: Option<Placement>,
    /// The communicator's `Registry::id` (set by `Comm::pending`).
    registry: u64,
}

/// A communicator handle's object: its core once initialised.
pub struct Comm {
    core: OnceCell<Arc<Core>>,
    pending: Mutex<Option<PendingInit>>,
    init_error: Mutex<Option<Error>>,
    /// `config.blocking = 0` (or `NCCL_COMM_BLOCKING=0`): init runs on a thread of its own, and
    /// the calls that make the communicator return `ncclInProgress` (see `start_init`).
    nonblocking: bool,
    init_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    init_abort: Arc<AtomicBool>,
    destroyed: AtomicBool,
    /// `ncclCommFinalize` was called (a second call, or a revoke after it, is refused).
    finalized: AtomicBool,
    /// `ncclCommRevoke` was called (a second call is refused).
    revoked: AtomicBool,
    pub redops: RedOps,
    pub registry: Registry,
}

impl Comm {
    fn pending(mut p: PendingInit) -> Comm {
        let registry = Registry::default();
        p.registry = registry.id();
        // NCCL_COMM_BLOCKING, where 0 or 1, overrides the config (as NCCL's).
        let blocking = match crate::param::get_str("NCCL_COMM_BLOCKING").as_deref() {
            Some("0") => false,
            Some("1") => true,
            _ => p.config.blocking.unwrap_or(true),
        };
        Comm {
            nonblocking: !blocking,
            init_thread: Mutex::new(None),
            init_abort: p.abort.clone(),
            core: OnceCell::new(),
            pending: Mutex::new(Some(p)),
            init_error: Mutex::new(None),
            destroyed: AtomicBool::new(false),
            finalized: AtomicBool::new(false),
            revoked: AtomicBool::new(false),
            redops: RedOps::default(),
            registry,
        }
    }

    /// The initialised core, or why there is none.
    #[inline]
    pub fn core(&self) -> Result<&Arc<Core>> {
        match self.core.get() {
            Some(c) if !self.destroyed.load(Ordering::Acquire) => Ok(c),
            _ => Err(self.no_core()),
        }
    }

    /// Why `core` has none to give (kept out of every call's straight line).
    #[cold]
    #[inline(never)]
    fn no_core(&self) -> Error {
        if self.destroyed.load(Ordering::Acquire) {
            return Error::invalid_argument("communicator has been destroyed");
        }
        if let Some(e) = self.init_error.lock().clone() {
            return e;
        }
        // (ncclInvalidArgument, as NCCL's for a communicator used before it is ready.)
        if self.nonblocking && self.init_thread.lock().is_some() {
            return Error::invalid_argument(
                "the communicator's non-blocking init is still in progress: poll \
                 ncclCommGetAsyncError until it returns ncclSuccess before using it",
            );
        }
        Error::invalid_argument(
            "communicator is not initialized yet (its ncclGroupEnd has not run)",
        )
    }

    /// Runs the pending init: here (blocking), or on a thread of its own for a non-blocking
    /// communicator (then `init_in_progress` says whether it is still running).
    pub fn start_init(self: &Arc<Self>) -> Result<()> {
        if !self.nonblocking {
            return self.run_init();
        }
        let me = self.clone();
        let t = std::thread::Builder::new()
            .name("oxccl-init".into())
            .spawn(move || {
                // Its error goes to ncclCommGetAsyncError and ncclGetLastError (`run_init`).
                let _ = me.run_init();
            })
            .map_err(|e| Error::os("starting the init thread", e))?;
        *self.init_thread.lock() = Some(t);
        Ok(())
    }

    /// Whether the communicator is non-blocking (`config.blocking = 0`, `NCCL_COMM_BLOCKING`).
    pub fn is_nonblocking(&self) -> bool {
        self.nonblocking
    }

    /// Whether a non-blocking init is still running (`ncclInProgress`).
    pub fn init_in_progress(&self) -> bool {
        self.async_error() == Code::InProgress
    }

    /// Whether a non-blocking init was started and still runs: what makes the call that made
    /// the communicator return `ncclInProgress`. Not an init deferred to the end of the
    /// caller's group, blocking or not: that call returns `ncclSuccess`, as NCCL's (the group's
    /// end starts it, and says `ncclInProgress` where it runs on: `group::end`).
    pub fn init_running(&self) -> bool {
        self.nonblocking && self.init_thread.lock().is_some() && self.init_in_progress()
    }

    /// Waits for a non-blocking init to end (the comm is being destroyed or aborted).
    fn join_init(&self) {
        if let Some(t) = self.init_thread.lock().take() {
            let _ = t.join();
        }
    }

    /// `ncclCommRevoke`: in-flight and queued work stops (it ends in `ncclRemoteError`) and the
    /// communicator is quiescent when this returns; afterwards it can only be shrunk, split,
    /// destroyed or aborted (its collectives return `ncclInvalidUsage`).
    pub fn revoke(&self) -> Result<()> {
        self.core()?;
        // (As NCCL's: once only, and not after ncclCommFinalize.)
        if self.finalized.load(Ordering::Acquire) {
            return Err(Error::invalid_argument(
                "ncclCommRevoke: the communicator was finalized (ncclCommFinalize)",
            ));
        }
        if self.revoked.swap(true, Ordering::AcqRel) {
            return Err(Error::invalid_argument(
                "ncclCommRevoke: the communicator was revoked already",
            ));
        }
        self.stop_work(
            "was revoked (ncclCommRevoke): only ncclCommShrink, ncclCommSplit, ncclCommDestroy \
             and ncclCommAbort can use it now",
        )
    }

    /// Stops the work in flight and queued, as `revoke`, and returns once nothing runs; its
    /// calls then fail with `ncclInvalidUsage` saying that it `how` (unless an error came
    /// first, which they keep returning).
    pub fn stop_work(&self, how: &str) -> Result<()> {
        let core = self.core()?;
        core.health.record(&Error::invalid_usage(format!(
            "rank {}: the communicator {how}",
            core.rank
        )));
        core.health.revoke();
        core.wait_idle()
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
        let Some(mut p) = self.pending.lock().take() else {
            return Ok(());
        };
        if let Some(place) = p.placement.take() {
            match place() {
                // (Not a member: the split handed out no handle to this communicator.)
                Ok(None) => return Ok(()),
                Ok(Some((nranks, rank, id))) => {
                    (p.nranks, p.rank, p.ids) = (nranks, rank, vec![id])
                }
                Err(e) => {
                    *self.init_error.lock() = Some(e.clone());
                    return Err(e);
                }
            }
        }
        let aborted = p.abort.clone();
        match build_core(p) {
            Ok(core) => {
                let core = Arc::new(core);
                // A failure this rank finds is announced to the peers through the bootstrap.
                let weak = Arc::downgrade(&core);
                core.health.set_announcer(Box::new(move |why| {
                    if let Some(c) = weak.upgrade() {
                        let _ = c.conns.with_bootstrap(|b| {
                            b.announce_failure(why);
                            Ok(())
                        });
                    }
                }));
                let _ = self.core.set(core);
                Ok(())
            }
            Err(e) => {
                // A non-blocking init's error reaches nobody as a return value: its message goes
                // to ncclGetLastError (and NCCL's WARN line) before ncclCommGetAsyncError can
                // report the code, so that a caller who polls the one finds the other. Not after
                // ncclCommAbort, which the caller asked for.
                if self.nonblocking && !aborted.load(std::sync::atomic::Ordering::SeqCst) {
                    crate::error::set_last_error(&format!(
                        "non-blocking communicator init: {}",
                        e.msg
                    ));
                }
                *self.init_error.lock() = Some(e.clone());
                Err(e)
            }
        }
    }

    /// An init deferred to a group's end that has not come yet (the communicator is `how`,
    /// destroyed or aborted, first): it will not run then, and connect to nobody.
    fn abandon_unstarted(&self, how: &str) {
        let why = format!("it was {how} before its group's end ran its init");
        self.abandon_init(&why, &Error::invalid_usage("ncclGroupEnd"));
    }

    /// A deferred init that will not run (`why`, whose error is `e`): the communicator
    /// reports it from now on.
    pub fn abandon_init(&self, why: &str, e: &Error) {
        if self.pending.lock().take().is_some() {
            *self.init_error.lock() = Some(Error::new(
                e.code,
                format!("the communicator was not made: {why}: {}", e.msg),
            ));
        }
    }

    pub fn finalize(&self) -> Result<()> {
        let core = self.core()?;
        // (As NCCL's: once only.)
        if self.finalized.swap(true, Ordering::AcqRel) {
            return Err(Error::invalid_argument(
                "ncclCommFinalize: the communicator was finalized already",
            ));
        }
        core.wait_idle()
    }

    pub fn destroy(&self) -> Result<()> {
        self.abandon_unstarted("destroyed");
        self.join_init();
        let r = match self.core.get() {
            Some(c) => {
                let r = c.wait_idle();
                if let Err(e) = &r {
                    // Its work did not end (its kernels are told to stop): its connections are
                    // left as they are, not closed, so peers that wait on them would not learn
                    // that this rank is gone. They are told, as for any failure of its own.
                    c.health.fail_unless_told(e.clone());
                }
                c.teardown(r.is_ok());
                r
            }
            None => Ok(()),
        };
        self.destroyed.store(true, Ordering::Release);
        r
    }

    pub fn abort(&self) {
        self.abandon_unstarted("aborted");
        // A non-blocking init still running gives up (its waits watch this flag).
        self.init_abort.store(true, Ordering::SeqCst);
        if let Some(c) = self.core.get() {
            c.health.abort();
        }
    }

    pub fn async_error(&self) -> Code {
        match self.core.get() {
            Some(c) => match c.health.async_error() {
                Some(e) => e.code,
                None if c.child_init_running() => Code::InProgress,
                None => Code::Success,
            },
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
    crate::plan::algo::check_env();
    crate::transport::plugin::check_once();
    // The network between hosts (before the bootstrap: a name that is nothing fails at once).
    let plugin = crate::transport::plugin::uses_plugin(p.config.net_name.as_deref())?;
    let health = Arc::new(Health::with_flag(p.abort.clone()));
    let boot = Bootstrap::init(&p.ids, p.rank, p.nranks, health.clone())
        .map_err(|e| e.context(format!("bootstrap of rank {} of {}", p.rank, p.nranks)))?;
    let me = PeerInfo::mine(p.dev.unwrap_or(-1)).with_net_plugin(plugin);
    let all = boot.allgather(&me.to_bytes())?;
    let peers = all
        .iter()
        .enumerate()
        .map(|(r, b)| PeerInfo::from_bytes(b).map_err(|e| e.context(format!("rank {r}"))))
        .collect::<Result<Vec<_>>>()?;
    PeerInfo::one_network(&peers)?;
    let cuda_dev = match p.dev {
        Some(d) => d,
        // A host slot per rank of this process: 0, 1, ... in rank order.
        None => peers[..p.rank]
            .iter()
            .filter(|q| q.same_process(&me))
            .count() as i32,
    };
    // Peers of this host in other PID namespaces cannot ask whether this process lives by its
    // pid: it holds a lock they look at, taken before any looks, and tells them its token (an
    // exchange every rank makes where some host has ranks of several namespaces: every rank
    // knows whether). A lock that cannot be made is a WARN: peers then cannot tell whether
    // this rank died (they wait for it as NCCL's ranks do).
    let mut peers = peers;
    let alive = match PeerInfo::namespaces_mixed(&peers) {
        true => {
            let hold = match PeerInfo::has_foreign_neighbours(&peers, p.rank) {
                true => crate::liveness::hold()
                    .map_err(|e| crate::debug::warn(&format!("rank {}: {}", p.rank, e.msg)))
                    .ok(),
                false => None,
            };
            let token = hold.as_ref().map_or(0, |h| h.token());
            let all = boot.allgather(&token.to_le_bytes())?;
            for (q, t) in peers.iter_mut().zip(&all) {
                q.alive = t
                    .get(..8)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u64::from_le_bytes);
            }
            hold
        }
        false => None,
    };
    let hash = boot.comm_hash();
    let exec = CommExec::init(CommSetup {
        rank: p.rank,
        nranks: p.nranks,
        hash,
        peers: &peers,
        boot: &boot,
        health: health.clone(),
        name: p.config.comm_name.clone(),
        dev: cuda_dev,
        graph_usage: p.config.graph_usage(),
        registry: p.registry,
    })?;
    let local = peers.iter().filter(|q| q.host == me.host).count();
    let conns = Conns::new(boot, peers, hash, health.clone());
    if let Some(ctx) = exec.device_ctx() {
        conns.set_device_ctx(ctx);
    }
    if let Some(busy) = exec.proxy_busy() {
        conns.set_busy(busy);
    }
    let nodes = conns.nodes();
    let dev_guard = exec.enter_device()?;
    conns.connect_ring(exec.channels())?;
    drop(dev_guard);
    crate::debug::info(&format!(
        "comm {hash:#x} rank {} nRanks {} nNodes {nodes} localRanks {} - Init COMPLETE ({})",
        p.rank,
        p.nranks,
        local,
        exec.name()
    ));
    Ok(Core {
        rank: p.rank,
        nranks: p.nranks,
        cuda_dev,
        hash,
        config: p.config.clone(),
        conns,
        health,
        exec,
        _alive: alive,
        children: Mutex::new(Vec::new()),
    })
}

/// Communicators can be made only where the executor is there (the CUDA one is not yet).
/// The device a new rank is bound to: the one named (`ncclCommInitAll`'s list, a split's
/// parent), else, on the CUDA executor, the calling thread's current device (as NCCL binds
/// `ncclCommInitRank*`); the host executor numbers host slots itself (None).
fn bind_device(dev: Option<i32>) -> Result<Option<i32>> {
    match (crate::gpu::kind(), dev) {
        (_, Some(d)) => Ok(Some(d)),
        (crate::gpu::Kind::Host, None) => Ok(None),
        (crate::gpu::Kind::Cuda, None) => crate::exec::cuda::current_device().map(Some),
    }
}

fn parse_ids(ids: &[[u8; UNIQUE_ID_BYTES]]) -> Result<Vec<UniqueId>> {
    if ids.is_empty() {
        return Err(Error::invalid_argument("no unique id given"));
    }
    ids.iter().map(UniqueId::from_bytes).collect()
}

pub(crate) fn new_comm(
    nranks: i32,
    rank: i32,
    ids: Vec<UniqueId>,
    config: CommConfig,
    dev: Option<i32>,
) -> Result<Arc<Comm>> {
    let dev = bind_device(dev)?;
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
        abort: Arc::new(AtomicBool::new(false)),
        placement: None,
        registry: 0,
    })))
}

/// A communicator made at its group's end by a split or shrink whose place (`placement`) is
/// learned there, on `dev`.
pub(crate) fn new_placed(
    config: CommConfig,
    dev: Option<i32>,
    placement: Placement,
) -> Result<Arc<Comm>> {
    Ok(Arc::new(Comm::pending(PendingInit {
        nranks: 1,
        rank: 0,
        ids: Vec::new(),
        config,
        dev: bind_device(dev)?,
        abort: Arc::new(AtomicBool::new(false)),
        placement: Some(placement),
        registry: 0,
    })))
}

/// `ncclCommInitRank*`: a communicator whose init is still to run (`Comm::run_init`, now or
/// at the end of the caller's group).
pub fn pending_rank(
    nranks: i32,
    rank: i32,
    ids: &[[u8; UNIQUE_ID_BYTES]],
    config: CommConfig,
) -> Result<Arc<Comm>> {
    new_comm(nranks, rank, parse_ids(ids)?, config, None)
}

/// `ncclCommInitAll`: one comm per listed device (host slot), all in this process.
pub fn init_all(devs: &[i32]) -> Result<Vec<Arc<Comm>>> {
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
        // Several ranks on one GPU are fine on the CUDA executor (NCCL refuses them): it is how
        // one GPU runs every multi-rank path.
        if !seen.insert(d) && crate::gpu::kind() == crate::gpu::Kind::Host {
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
