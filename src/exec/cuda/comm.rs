//! The CUDA executor's state of one rank: its device and context, the event that marks the end
//! of its last launch (operations of a communicator run in issue order whatever streams they
//! are given, as NCCL's do), and its control block: pinned host memory through which the host
//! stops the kernels (abort) and kernels report why they stopped (a call mismatch) and which
//! connection they wait on.

use super::kept::{self, Events, Kept};
use super::kernels::{self, Kernels};
use crate::error::{Error, Result};
use crate::exec::CommSetup;
use crate::gpu::driver::{self, check, CtxGuard};
use crate::health::Health;
use crate::transport::Conn;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// The control block (`OxCtl` in `cuda/runner.cu`), in a pinned page of its own.
pub(super) struct Ctl {
    page: *mut u8,
    /// The context it was pinned in (`spare`).
    ctx: usize,
}

// SAFETY: the page is owned by the Ctl and only touched through atomics / volatile reads.
unsafe impl Send for Ctl {}
// SAFETY: as above.
unsafe impl Sync for Ctl {}

const CTL_PAGE: usize = 4096;

impl Ctl {
    /// A control block in context `ctx` (current): a spare one's page, else a new page pinned.
    fn new(ctx: usize) -> Result<Ctl> {
        if let Some(page) = super::spare::page(ctx, CTL_PAGE) {
            return Ok(Ctl { page, ctx });
        }
        let layout = std::alloc::Layout::from_size_align(CTL_PAGE, CTL_PAGE).expect("layout");
        // SAFETY: non-zero size.
        let page = unsafe { std::alloc::alloc_zeroed(layout) };
        if page.is_null() {
            return Err(Error::system("out of memory for a control block"));
        }
        if let Err(e) = crate::gpu::memory::pin_host(page, CTL_PAGE) {
            // SAFETY: allocated above with this layout.
            unsafe { std::alloc::dealloc(page, layout) };
            return Err(e);
        }
        Ok(Ctl { page, ctx })
    }

    pub fn addr(&self) -> u64 {
        self.page as u64
    }

    fn word(&self, i: usize) -> &AtomicU32 {
        // SAFETY: inside the page, 4-byte aligned.
        unsafe { &*(self.page.add(4 * i) as *const AtomicU32) }
    }

    pub fn abort(&self) {
        self.word(0).store(1, Ordering::SeqCst);
    }

    /// The mark that changes while kernels wait (0: none has waited yet), the connection (its
    /// header's device address) a kernel last said it waits on, and the step of it it waits
    /// for (`u64::MAX`: its peer's attach).
    pub fn waiting(&self) -> (u64, u64, u64) {
        // SAFETY: inside the page, 8-byte aligned (`wait_mark` at 64, `wait_conn` at 56,
        // `wait_step` at 72).
        let mark = unsafe { std::ptr::read_volatile(self.page.add(64) as *const u64) };
        // The kernel wrote the connection and step before the mark (with a fence between).
        std::sync::atomic::fence(Ordering::Acquire);
        // SAFETY: as above.
        let conn = unsafe { std::ptr::read_volatile(self.page.add(56) as *const u64) };
        // SAFETY: as above.
        let step = unsafe { std::ptr::read_volatile(self.page.add(72) as *const u64) };
        (mark, conn, step)
    }

    /// The kernel's error code and details, if one stopped on an error.
    pub fn error(&self) -> Option<(u32, [u64; 6])> {
        let code = self.word(1).load(Ordering::Acquire);
        // (u32::MAX: a kernel has claimed the word and is writing the details; its code
        // follows them.)
        if code == 0 || code == u32::MAX {
            return None;
        }
        let mut info = [0u64; 6];
        for (i, v) in info.iter_mut().enumerate() {
            // SAFETY: inside the page, 8-byte aligned (offset 8 + 8 i).
            *v = unsafe { std::ptr::read_volatile(self.page.add(8 + 8 * i) as *const u64) };
        }
        Some((code, info))
    }
}

impl Drop for Ctl {
    fn drop(&mut self) {
        // Kept pinned for a later communicator: unpinning now could wait for good (`spare`).
        super::spare::give_page(self.ctx, self.page);
    }
}

/// Unpins and frees a control block's page (`spare`, once no communicator is left).
pub(super) fn free_page(page: *mut u8) {
    crate::gpu::memory::unpin_host(page);
    let layout = std::alloc::Layout::from_size_align(CTL_PAGE, CTL_PAGE).expect("layout");
    // SAFETY: allocated in `Ctl::new` with this layout, given back once.
    unsafe { std::alloc::dealloc(page, layout) };
}

/// How many graphs being captured at once a communicator keeps its last launch in; past that,
/// the graph it launched into least lately is forgotten (a launch back in it gets the wait
/// nodes of a first launch there, and no edge from the launch before it).
const OPEN_GRAPHS: usize = 64;

/// The communicator's last launch in one graph being captured.
pub(super) struct Tip {
    /// The graph's capture id (None: a new tip whose event is not recorded yet).
    pub graph: Option<u64>,
    /// Recorded after that launch, in its graph (never queried).
    pub event: usize,
    pub stream: usize,
    /// When it was last used (`Captured::tick`).
    used: u64,
}

/// Where the communicator's launches captured into graphs went.
pub(super) struct Captured {
    /// Its last launch in each graph it launched into lately, by capture id (graphs captured
    /// at once, interleaved, each keep theirs; a graph that ended leaves its event for reuse).
    tips: Vec<Tip>,
    tick: u64,
    /// Recorded by every captured launch as an event record node, so at each replay (never
    /// queried): eager launches, and launches of other graphs, wait for the replays issued
    /// before them.
    pub replayed: usize,
    /// A captured launch recorded `replayed` (some graph holds a record of it).
    pub any: bool,
    /// Graph usage mode 2 (`ncclConfig_t.graphUsageMode`, `NCCL_GRAPH_MIXING_SUPPORT`): the
    /// record and wait nodes are used, so that eager launches, replays and the communicator's
    /// destroy wait for the replays issued before them. Modes 0 and 1 leave no node at all,
    /// as NCCL's do (graphs launched from the device, or whose collectives sit in conditional
    /// or loop bodies, may not hold them): the program orders its replays, and lets them end
    /// before it destroys the communicator.
    pub mixing: bool,
    /// Mode 0 (the program said it captures none; told once when it does).
    pub no_graphs: bool,
    /// Every event of the communicator (tips' events join it as they are made).
    pub events: Arc<Events>,
    /// A captured launch went into a graph that could not be made to hold the communicator's
    /// control block and events (`kept::keep`): they are never freed.
    pub unkept: bool,
}

impl Captured {
    /// Its last launch captured into graph `id`, if it is kept.
    pub fn tip(&self, id: u64) -> Option<&Tip> {
        self.tips.iter().find(|t| t.graph == Some(id))
    }

    /// Where its launch now captured on `stream` into graph `id` goes: (the index of its tip,
    /// the event to record there): the graph's tip, or a free one, or a new one (an event
    /// created), or, with `OPEN_GRAPHS` graphs kept, that of the graph it launched into least
    /// lately. Nothing changes until `commit`, once the event is recorded.
    pub fn slot(
        &mut self,
        api: &driver::Api,
        id: u64,
        stream: usize,
        name: &str,
    ) -> Result<(usize, usize)> {
        if let Some(i) = self.tips.iter().position(|t| t.graph == Some(id)) {
            return Ok((i, self.tips[i].event));
        }
        // Free: a tip whose first record failed, and one of a graph captured on this stream
        // before, whose capture has ended: a stream takes part in one capture at a time, until
        // it ends (a stream forked into a capture and joined back stays in it until then). So
        // graphs captured one after the other on one stream, as PyTorch captures them (one
        // per batch size, say), take one tip, however many there are.
        if let Some(i) = self
            .tips
            .iter()
            .position(|t| t.graph.is_none() || t.stream == stream)
        {
            return Ok((i, self.tips[i].event));
        }
        if self.tips.len() < OPEN_GRAPHS {
            let mut ev: driver::CUevent = std::ptr::null_mut();
            // Relaxed: the caller's stream captures.
            driver::relaxed(|| {
                // SAFETY: writes one event handle (destroyed with the others: `Events`).
                check(
                    unsafe { (api.event_create)(&mut ev, driver::CU_EVENT_DISABLE_TIMING) },
                    || "cuEventCreate".into(),
                )
            })?;
            self.events.add(ev as usize);
            self.tips.push(Tip {
                graph: None,
                event: ev as usize,
                stream: 0,
                used: 0,
            });
            return Ok((self.tips.len() - 1, ev as usize));
        }
        let (i, t) = self
            .tips
            .iter()
            .enumerate()
            .min_by_key(|(_, t)| t.used)
            .expect("OPEN_GRAPHS > 0");
        if let Some(g) = t.graph {
            crate::debug::warn(&format!(
                "{name}: its launches are captured into more than {OPEN_GRAPHS} CUDA graphs \
                 at once; it forgets where its last launch into graph {g} went (a later launch \
                 of its in that graph is not ordered after it)"
            ));
        }
        Ok((i, t.event))
    }

    /// Tip `i` (from `slot`) now holds the launch captured on `stream` into graph `id`.
    pub fn commit(&mut self, i: usize, id: u64, stream: usize) {
        self.tick += 1;
        let tip = &mut self.tips[i];
        (tip.graph, tip.stream, tip.used) = (Some(id), stream, self.tick);
    }
}

/// Where the communicator's last launch went.
pub(super) struct Last {
    /// Recorded after the last launch (0: none yet).
    pub event: usize,
    /// The stream of the last launch (later launches on it need no join).
    pub stream: Option<usize>,
    /// The event was recorded (a launch happened outside graph capture).
    pub recorded: bool,
}

/// Whether the communicator's kernels may be running, for its proxy thread
/// (`transport::proxy::Busy`), which must then not sleep: kernels fill and free the network's
/// FIFO slots without waking it. Its last eager launch is not done yet, or kernels said they
/// wait (in the control block) within the last `MARK_FRESH`: a graph's replay, which the
/// library does not see launched, shows itself only so. (A launch queued behind the caller's
/// own work on its stream counts as running from its issue: the thread then wakes every
/// 20 us through that work too, a small cost on a GPU host's many cores.)
struct Running {
    ctx: usize,
    last: Arc<Mutex<Last>>,
    /// Weak: `CudaComm`'s drop counts the control block's holders (graphs that keep it).
    ctl: Weak<Ctl>,
    /// Keeps the last launch's event alive while the proxy thread may query it.
    _events: Arc<Events>,
    /// The wait mark at the last look, and when it last changed.
    mark: Mutex<(u64, Instant)>,
    /// The proxy thread is readied for the driver (`on_thread_start`); until then, or if that
    /// failed, `busy` says no and queries nothing.
    ready: std::sync::atomic::AtomicBool,
}

/// How long after kernels last said they wait the proxy thread keeps from sleeping.
const MARK_FRESH: Duration = Duration::from_millis(20);

impl crate::transport::proxy::Busy for Running {
    fn on_thread_start(&self) {
        // Relaxed capture mode: the event queries below must not spoil a graph that another
        // thread captures in global mode.
        match driver::background_thread(self.ctx) {
            Ok(()) => self.ready.store(true, Ordering::Relaxed),
            Err(e) => crate::debug::warn(&format!(
                "a proxy thread could not ready itself for the CUDA driver ({e}): it sleeps \
                 up to 1 ms between looks while kernels run"
            )),
        }
    }

    fn busy(&self) -> bool {
        let Some(ctl) = self.ctl.upgrade() else {
            return false;
        };
        let mark = ctl.waiting().0;
        drop(ctl);
        {
            let mut m = self.mark.lock();
            if mark != m.0 {
                *m = (mark, Instant::now());
                return true;
            }
            if mark != 0 && m.1.elapsed() < MARK_FRESH {
                return true;
            }
        }
        // (Locked: a launch is being issued now.)
        let Some(l) = self.last.try_lock() else {
            return true;
        };
        // (Not ready: the thread could not leave global capture mode or enter the context, and
        // must not query the driver.)
        if !l.recorded || !self.ready.load(Ordering::Relaxed) {
            return false;
        }
        let ev = l.event;
        drop(l);
        let (Ok(api), Ok(_g)) = (driver::api(), CtxGuard::enter(self.ctx)) else {
            return false;
        };
        // SAFETY: the communicator's event, alive while `_events` is (re-recorded by later
        // launches meanwhile: the query then answers for the later one).
        unsafe { (api.event_query)(ev as driver::CUevent) == driver::CUDA_ERROR_NOT_READY }
    }
}

pub struct CudaComm {
    pub dev: i32,
    pub(super) ctx: usize,
    pub rank: usize,
    pub nranks: usize,
    /// The communicator's hash (the same on all its ranks).
    pub(super) hash: u64,
    pub(super) health: Arc<Health>,
    pub(super) ctl: Arc<Ctl>,
    pub(super) kern: Kernels,
    pub(super) last: Arc<Mutex<Last>>,
    /// The connections of the last launch (their counters go into timeout messages).
    pub(super) last_conns: Arc<Mutex<Vec<Arc<Conn>>>>,
    /// Every connection its launches used, captured ones included, by the device address of
    /// its header (what a waiting kernel names in the control block).
    pub(super) used: Arc<Mutex<Used>>,
    /// Recorded on a group's other streams to join them to the launch stream.
    pub(super) join_event: usize,
    /// Its last launch captured into each graph (later ones captured into it wait for it).
    pub(super) captured: Mutex<Captured>,
    /// Ranks of this communicator on this host and device (their kernels share its SMs).
    pub(super) ranks_on_device: usize,
    /// Ranks of this communicator on this device in this process (this one included).
    pub(super) process_ranks_on_device: Vec<usize>,
    /// Where every rank is in this process on this device (2 to `board::MAX_RANKS` of
    /// them): the board their collectives meet on (`board`).
    pub(super) board: Option<Arc<super::board::Board>>,
    /// The rings a large ring collective is split across: rank 0's `OXCCL_CUDA_CHANNELS` (1
    /// where a rank runs the host executor), as many as a rank's launch fits in the ordinary
    /// kernel parameter (`desc::channels_that_fit`).
    pub(crate) channels: usize,
    /// A launch that may need more blocks at once than the device holds was warned of.
    pub(super) room_warned: std::sync::atomic::AtomicBool,
    /// Its ranks on this device in this process, launching apart, outnumber the device's
    /// hardware queues, and a WARN said so (once).
    pub(super) queues_warned: std::sync::atomic::AtomicBool,
    /// The stream a group's point-to-point lanes run on beside its collectives, and the event
    /// that forks it from the launch stream and joins it back (`Side`): made by the first
    /// group that holds both.
    side: once_cell::sync::OnceCell<Side>,
    name: String,
    /// Its registry of `ncclCommRegister` buffers (`transport::registered`): launches send
    /// those other processes may read in place; they are deregistered when it ends.
    pub(super) registry: u64,
    /// Counted among the process's communicators (last: dropped after its control block and
    /// board went to the spares, `spare::Live`).
    _live: super::spare::Live,
}

/// A communicator's side stream (non-blocking) and its fork/join event.
#[derive(Clone, Copy)]
pub(super) struct Side {
    pub stream: usize,
    pub event: usize,
}

impl CudaComm {
    pub fn init(s: CommSetup<'_>) -> Result<CudaComm> {
        let dev = s.dev;
        let ctx = driver::primary_context(dev)?;
        let _g = CtxGuard::enter(ctx)?;
        // What graphs let go of since the last look is freed.
        kept::reclaim();
        // Relaxed, as the rest of the setup: loading a module while another thread captures
        // a graph in the global mode (PyTorch's) must not break that capture.
        let kern = driver::relaxed(|| kernels::get(ctx, dev))?;
        let api = driver::api()?;
        let events = Arc::new(Events::new(ctx));
        let event = || {
            let mut ev: driver::CUevent = std::ptr::null_mut();
            // SAFETY: writes one event handle (destroyed with the others: `Events`).
            check(
                unsafe { (api.event_create)(&mut ev, driver::CU_EVENT_DISABLE_TIMING) },
                || "cuEventCreate".into(),
            )?;
            events.add(ev as usize);
            Ok::<_, Error>(ev)
        };
        let (ev, join, replayed) = (event()?, event()?, event()?);
        // Both events the wait nodes of captured launches name are recorded once now (on a
        // stream of ours, done at once), so that every capture gets the same nodes, whatever
        // ran before it: a graph captured before the first eager launch still waits, at each
        // replay, for the eager launches issued before that replay.
        let mixing = s.graph_usage == 2;
        if mixing {
            driver::relaxed(|| {
                let mut st: driver::CUstream = std::ptr::null_mut();
                // SAFETY: writes one stream handle; destroyed below.
                check(
                    unsafe { (api.stream_create)(&mut st, driver::CU_STREAM_NON_BLOCKING) },
                    || "cuStreamCreate".into(),
                )?;
                let mut r = Ok(());
                for e in [ev, replayed] {
                    // SAFETY: our events, our stream.
                    let x = check(unsafe { (api.event_record)(e, st) }, || {
                        "cuEventRecord (a communicator's first record)".into()
                    });
                    r = r.and(x);
                }
                // SAFETY: our stream, its work enqueued (it ends on its own).
                unsafe { (api.stream_destroy)(st) };
                r
            })?;
        }
        let live = super::spare::Live::new();
        let ctl = Arc::new(Ctl::new(ctx)?);
        let process_ranks_on_device: Vec<usize> = (0..s.peers.len())
            .filter(|&q| {
                q == s.rank
                    || (s.peers[q].same_process(&s.peers[s.rank])
                        && s.peers[q].same_gpu(&s.peers[s.rank]))
            })
            .collect();
        let board = if process_ranks_on_device.len() == s.nranks {
            super::board::for_rank(s.hash, ctx, s.rank, s.nranks)?
        } else {
            None
        };
        let name = match &s.name {
            Some(n) => format!("comm {n} ({:#x}) rank {} of {}", s.hash, s.rank, s.nranks),
            None => format!("comm {:#x} rank {} of {}", s.hash, s.rank, s.nranks),
        };
        let last = Arc::new(Mutex::new(Last {
            event: ev as usize,
            stream: None,
            recorded: false,
        }));
        let last_conns = Arc::new(Mutex::new(Vec::new()));
        let used = Arc::new(Mutex::new(Used::default()));
        watch(Watched {
            ctl: Arc::downgrade(&ctl),
            health: Arc::downgrade(&s.health),
            name: name.clone(),
            reported: false,
            used: Arc::downgrade(&used),
            board: board.as_ref().map(Arc::downgrade),
            probes: crate::transport::peer::PeerInfo::local_probes(s.peers, s.rank),
            names: s
                .peers
                .iter()
                .enumerate()
                .map(|(r, q)| q.describe(r))
                .collect(),
            mark: 0,
            idle: 0,
            suspects: Default::default(),
            progress: Default::default(),
        });
        crate::debug::info(&format!(
            "{name}: CUDA executor on device {dev} (driver {})",
            driver::version().unwrap_or(0)
        ));
        Ok(CudaComm {
            dev,
            ctx,
            rank: s.rank,
            nranks: s.nranks,
            hash: s.hash,
            health: s.health,
            ctl,
            kern,
            last,
            last_conns,
            used,
            join_event: join as usize,
            captured: Mutex::new(Captured {
                tips: Vec::new(),
                tick: 0,
                replayed: replayed as usize,
                any: false,
                mixing,
                no_graphs: s.graph_usage == 0,
                events,
                unkept: false,
            }),
            channels: super::desc::channels_that_fit(
                s.nranks,
                crate::transport::peer::PeerInfo::comm_channels(s.peers),
            ),
            ranks_on_device: s
                .peers
                .iter()
                .filter(|q| q.host == s.peers[s.rank].host && q.same_gpu(&s.peers[s.rank]))
                .count()
                .max(1),
            process_ranks_on_device,
            board,
            room_warned: Default::default(),
            queues_warned: Default::default(),
            side: Default::default(),
            name,
            registry: s.registry,
            _live: live,
        })
    }

    /// Its side stream and event, made now if this is the first group that needs them (the
    /// caller is in its context; relaxed capture mode, as the caller's stream may capture).
    pub(super) fn side(&self) -> Result<Side> {
        self.side
            .get_or_try_init(|| {
                let api = driver::api()?;
                driver::relaxed(|| {
                    let mut st: driver::CUstream = std::ptr::null_mut();
                    // SAFETY: writes one stream handle (destroyed with the communicator).
                    check(
                        unsafe { (api.stream_create)(&mut st, driver::CU_STREAM_NON_BLOCKING) },
                        || "cuStreamCreate (a communicator's side stream)".into(),
                    )?;
                    let mut ev: driver::CUevent = std::ptr::null_mut();
                    // SAFETY: writes one event handle (destroyed with the others: `Events`).
                    let r = check(
                        unsafe { (api.event_create)(&mut ev, driver::CU_EVENT_DISABLE_TIMING) },
                        || "cuEventCreate".into(),
                    );
                    if let Err(e) = r {
                        // SAFETY: made above, nothing enqueued.
                        unsafe { (api.stream_destroy)(st) };
                        return Err(e);
                    }
                    self.captured.lock().events.add(ev as usize);
                    Ok(Side {
                        stream: st as usize,
                        event: ev as usize,
                    })
                })
            })
            .copied()
    }

    /// The counters of the last launch's connections, for messages.
    fn counters(&self) -> String {
        let c = self.last_conns.lock();
        c.iter()
            .map(|c| c.counters())
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// What tells its proxy thread that its kernels are running (`Running`).
    pub fn proxy_busy(&self) -> Arc<dyn crate::transport::proxy::Busy> {
        Arc::new(Running {
            ctx: self.ctx,
            last: self.last.clone(),
            ctl: Arc::downgrade(&self.ctl),
            _events: self.captured.lock().events.clone(),
            mark: Mutex::new((0, Instant::now())),
            ready: Default::default(),
        })
    }

    /// Makes the communicator's context current until the guard drops.
    pub fn enter(&self) -> Result<CtxGuard> {
        CtxGuard::enter(self.ctx)
    }

    /// The context of the communicator's device (its primary context).
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    pub fn describe(&self) -> &str {
        &self.name
    }

    /// The communicator ends (destroyed, its work done or given up): its control block says
    /// stop from now on, so that a graph replayed later returns at once (`kept`).
    pub fn end(&self) {
        self.ctl.abort();
        // Its peers' board lanes wait for it no more (`Watched::board_peer_gone`).
        if let Some(b) = &self.board {
            b.leave(self.rank);
        }
    }

    /// Waits until the last launch is done; after an abort, tells the kernels to stop first.
    pub fn wait_quiescent(&self, deadline: Instant) -> Result<()> {
        if self.health.halted() {
            crate::debug::warn(&format!(
                "{}: stopping its kernels (connections of the last launch: {})",
                self.name,
                self.counters()
            ));
            self.ctl.abort();
        }
        let _g = CtxGuard::enter(self.ctx)?;
        // (Relaxed: another thread's graph capture in global mode would refuse the queries,
        // and be spoiled.)
        driver::relaxed(|| self.wait_launches(deadline))
    }

    /// `wait_quiescent`'s waits, in the communicator's context.
    fn wait_launches(&self, deadline: Instant) -> Result<()> {
        // Its last eager launch, and the replays issued after it (their record nodes).
        let events: Vec<usize> = {
            let l = self.last.lock();
            let c = self.captured.lock();
            [(l.recorded, l.event), (c.any, c.replayed)]
                .into_iter()
                .filter_map(|(on, e)| on.then_some(e))
                .collect()
        };
        let api = driver::api()?;
        for ev in events {
            // SAFETY: our event (never recorded by a capturing stream but as a record node,
            // which takes effect when its graph is launched: a legal query).
            self.wait_until(deadline, || unsafe {
                (api.event_query)(ev as driver::CUevent)
            })?;
        }
        // The side stream too: its launch is joined into the last launch's event, but not
        // where recording the join failed (the communicator failed then, and its side kernel
        // was told to stop). Not while a capture holds it: nothing of it runs then, and a
        // query would spoil the capture.
        if let Some(side) = self.side.get() {
            if driver::capture(side.stream)? == driver::Capture::No {
                // SAFETY: our stream, not capturing (checked just before).
                self.wait_until(deadline, || unsafe {
                    (api.stream_query)(side.stream as driver::CUstream)
                })?;
            }
        }
        Ok(())
    }

    /// `wait_quiescent` for one of its events or streams: polls `query` (a cuEventQuery or a
    /// cuStreamQuery) until it is not NOT_READY, telling the kernels to stop if the
    /// communicator halts meanwhile.
    fn wait_until(
        &self,
        mut deadline: Instant,
        query: impl Fn() -> driver::CUresult,
    ) -> Result<()> {
        let mut told = false;
        loop {
            let r = query();
            if r != driver::CUDA_ERROR_NOT_READY {
                return check(r, || {
                    format!("{}: waiting for its last operation", self.name)
                });
            }
            if !told && self.health.halted() {
                // Told to stop, they stop at once; what they may wait behind gets the bound
                // of a stop (the wait for a live peer before it may have had none).
                told = true;
                self.ctl.abort();
                deadline = deadline.min(Instant::now() + crate::param::bound());
            }
            if Instant::now() >= deadline {
                return Err(Error::timeout(format!(
                    "{}: its operations on device {} did not finish in time (connections of \
                     the last launch: {})",
                    self.name,
                    self.dev,
                    self.counters()
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// How long a destroy waits for the communicator's kernels before it tells them to stop: 30 s,
/// or twice `OXCCL_TIMEOUT_S` where that is shorter.
fn destroy_wait() -> Duration {
    Duration::from_secs(30).min(2 * crate::param::bound())
}

impl Drop for CudaComm {
    fn drop(&mut self) {
        if self
            .wait_quiescent(Instant::now() + destroy_wait())
            .is_err()
        {
            // Kernels still run: tell them to stop, and if they do not, leave the control
            // block they read allocated (a leak, not a fault that spoils the context).
            self.ctl.abort();
            if self
                .wait_quiescent(Instant::now() + Duration::from_secs(5))
                .is_err()
            {
                crate::debug::warn(&format!(
                    "{}: destroyed while its kernels still run; their memory is not freed",
                    self.name
                ));
                std::mem::forget(self.ctl.clone());
                std::mem::forget(self.board.clone());
                super::spare::stuck();
                // (Other processes' kernels may still read its registered buffers: they stay
                // open there.)
                crate::transport::registered::abandon(self.registry);
                return;
            }
        }
        // Other processes close what they opened of its registered buffers (its kernels, and
        // so theirs that read them, are done).
        crate::transport::registered::deregister(self.registry, None);
        // (Its events go when the graphs that name them do too: `Events`.)
        self.last.lock().recorded = false;
        if let Some(side) = self.side.get() {
            // Its work is done (a capture it was drawn into, still open, keeps it: a leak).
            if let (Ok(api), Ok(_g), Ok(driver::Capture::No)) = (
                driver::api(),
                CtxGuard::enter(self.ctx),
                driver::capture(side.stream),
            ) {
                let _ = driver::relaxed(|| {
                    // SAFETY: our stream, made by `side`, destroyed once.
                    unsafe { (api.stream_destroy)(side.stream as driver::CUstream) };
                    Ok(())
                });
            }
        }
        self.end();
        kept::reclaim();
        let c = self.captured.lock();
        let kept = Kept {
            ctl: self.ctl.clone(),
            events: c.events.clone(),
            board: self.board.clone(),
        };
        // Some graph holds it (the watcher's reference is weak, upgraded for a moment now and
        // then: this may be wrong then, for a log line).
        let graphs = Arc::strong_count(&self.ctl) > 2;
        if c.unkept {
            crate::debug::info(&format!(
                "{}: destroyed after a launch of its was captured into a CUDA graph that this \
                 driver could not make hold its control block and events: they stay allocated \
                 (a replay returns at once)",
                self.name
            ));
            std::mem::forget(kept);
        } else if graphs {
            crate::debug::info(&format!(
                "{}: destroyed while CUDA graphs that captured its launches remain: replaying \
                 them now moves no data between ranks (their kernels return at once); its \
                 control block and events are freed once the last of them is destroyed",
                self.name
            ));
        }
    }
}

/// Every connection a communicator's launches used, by the device address of its header.
#[derive(Default)]
pub(super) struct Used(std::collections::HashMap<u64, Arc<Conn>>);

impl Used {
    pub fn add(&mut self, c: &Arc<Conn>) {
        self.0
            .entry(c.device_view().0 as u64)
            .or_insert_with(|| c.clone());
    }
}

/// What the watcher thread looks after: a communicator's control block and health, and, while
/// its kernels wait, the peer they wait for.
struct Watched {
    ctl: Weak<Ctl>,
    health: Weak<Health>,
    name: String,
    reported: bool,
    used: Weak<Mutex<Used>>,
    /// Its device board, where board lanes wait for their peers.
    board: Option<Weak<super::board::Board>>,
    /// How to ask whether each rank's process lives, where it runs on this host in another
    /// process (`PeerInfo::local_probes`), and each rank in words.
    probes: Vec<Option<crate::liveness::Probe>>,
    names: Vec<String>,
    /// The control block's wait mark at the last look, and how many looks in a row it has not
    /// changed (the kernels did not wait).
    mark: u64,
    idle: u32,
    /// Since when each peer (by rank) has been seen gone while kernels waited on it.
    suspects: std::collections::HashMap<usize, Instant>,
    /// The counters of each connection (by header) kernels waited on, where the host can read
    /// them, since when they are so, and whether the watchdog said so.
    progress: std::collections::HashMap<u64, (String, Instant, bool)>,
}

/// How often (in the watcher's 5 ms turns) it looks at the peers of communicators whose
/// kernels wait, and how long a peer may be gone before that is an error (what it wrote before
/// it went may still let the kernels finish).
const PEER_TURNS: u32 = 20;
const PEER_GRACE: Duration = Duration::from_secs(1);
/// Looks without a wait after which the kernels count as no longer waiting (a kernel says it
/// waits every 1024 reads of a counter: many times a look while it does). What was seen of
/// the peers then starts again (a stalled connection's clock, at the first such look).
/// While kernels wait, their blocks take turns naming the connection each waits on: one may
/// go unnamed for many looks, so nothing starts again for that.
const IDLE_LOOKS: u32 = 3;

impl Watched {
    /// A peer the kernels wait for in vain: a process of this host that died, a connection
    /// its peer closed, a peer on another host silent past the heartbeat (as the host
    /// executor's waits check). Judged only while kernels wait (launched eagerly or replayed
    /// from a graph), and only on the connection they wait on: a peer that did its part and
    /// left is no failure. An error once it has been so for `PEER_GRACE`.
    fn peer_failure(&mut self, ctl: &Ctl) -> Option<Error> {
        let (mark, hdr, step) = ctl.waiting();
        if mark == self.mark {
            self.idle += 1;
            // A stall is a wait without a break: its clock starts again at once (else a wait
            // on counters left as the last operation's wait saw them would time out early).
            self.progress.clear();
            if self.idle >= IDLE_LOOKS {
                self.suspects.clear();
            }
            return None;
        }
        self.mark = mark;
        self.idle = 0;
        let used = self.used.upgrade()?;
        let used = used.lock();
        if let Some(e) = self.stalled(&used, hdr, step) {
            return Some(e);
        }
        let Some(conn) = used.0.get(&hdr).cloned() else {
            drop(used);
            let (r, why) = self.board_peer_gone(hdr)?;
            return self.suspect(r, why);
        };
        drop(used);
        let r = conn.peer;
        let name = self
            .names
            .get(r)
            .cloned()
            .unwrap_or_else(|| format!("rank {r}"));
        let dead = || {
            let probe = (*self.probes.get(r)?)?;
            (!probe.alive()).then(|| format!("{name} has died"))
        };
        let closed = || {
            conn.peer_closed().then(|| {
                format!(
                    "{name} closed its connection (it ended its communicator, exited or failed)"
                )
            })
        };
        let silent = || {
            let quiet = conn.silent_for()?;
            (quiet > crate::param::heartbeat()?).then(|| {
                format!(
                    "{name} has not been heard from for {:.1} s (OXCCL_HEARTBEAT_S): its host, \
                     process or the link to it is down",
                    quiet.as_secs_f64()
                )
            })
        };
        let why = dead().or_else(closed).or_else(silent);
        self.suspect(r, why)
    }

    /// Rank `r`, which the kernels wait for, is gone (`why`) or well (None): an error once it
    /// has been gone for `PEER_GRACE` while they waited (a wait reported before it went, and
    /// not renewed since, lets the suspicion lapse: `IDLE_LOOKS`).
    fn suspect(&mut self, r: usize, why: Option<String>) -> Option<Error> {
        let Some(why) = why else {
            // That peer is well (it may have been silent a while).
            self.suspects.remove(&r);
            return None;
        };
        let since = *self.suspects.entry(r).or_insert_with(Instant::now);
        (since.elapsed() >= PEER_GRACE).then(|| {
            Error::remote(format!(
                "{}: {why} while this rank's kernels waited for it",
                self.name
            ))
        })
    }

    /// A board lane waits on the device board (`hdr`: the line it waits on) for a rank: that
    /// rank, and why it is gone where its communicator ended (None: it lives). None where `hdr`
    /// is not on the board.
    fn board_peer_gone(&self, hdr: u64) -> Option<(usize, Option<String>)> {
        let (b, _, r, name) = self.board_line(hdr)?;
        Some((
            r,
            b.left(r).then(|| {
                format!(
                    "{name} ended its communicator (on the device board of a direct collective)"
                )
            }),
        ))
    }

    /// The board line a kernel waits on (`hdr`): the board, the part, the rank and its name.
    fn board_line(&self, hdr: u64) -> Option<(Arc<super::board::Board>, usize, usize, &str)> {
        let b = self.board.as_ref()?.upgrade()?;
        if !b.holds(hdr) {
            return None;
        }
        let (part, r) = b.line(hdr);
        let name = self.names.get(r).map_or("a rank", |n| n.as_str());
        Some((b, part, r, name))
    }

    /// The kernels wait on a connection that has not moved for the communicator's timeout: a
    /// peer that never comes, as the host executor's waits time out (`OXCCL_TIMEOUT_S`). Where
    /// the host can read the counters (pinned memory), they did not change; where they live in
    /// device memory, the kernels kept waiting for the same step of it (`step`, which they
    /// report with the connection).
    fn stalled(&mut self, used: &Used, hdr: u64, step: u64) -> Option<Error> {
        // Timed out only where the user set it: a GPU job's ranks may legitimately keep their
        // peers waiting for minutes (a checkpoint, an evaluation on one rank), as NCCL lets
        // them. The watchdog names the wait meanwhile.
        let timeout = crate::param::timeout();
        let watchdog = crate::param::watchdog();
        if timeout.is_none() && watchdog.is_none() {
            return None;
        }
        // (Counters only grow: a wait on it that ended, or any progress, changes them; a
        // kernel that waits for another step of it has seen it move.)
        let counters = match used.0.get(&hdr) {
            Some(conn) => match (conn.on_device(), step) {
                (false, _) => conn.counters(),
                (true, u64::MAX) => format!(
                    "{}, its kernels wait for the peer to attach",
                    conn.counters()
                ),
                (true, s) => format!("{}, its kernels wait for step {s}", conn.counters()),
            },
            None => {
                // A board lane waits for a rank to arrive at a part of a direct collective.
                let (_, part, _, name) = self.board_line(hdr)?;
                format!(
                    "{name} on the device board, which has not arrived at part {part} of a \
                     direct collective (arrival {step})"
                )
            }
        };
        let p = self
            .progress
            .entry(hdr)
            .or_insert_with(|| (counters.clone(), Instant::now(), false));
        if p.0 != counters {
            *p = (counters, Instant::now(), false);
            return None;
        }
        let waited = p.1.elapsed();
        if !p.2 && watchdog.is_some_and(|w| waited > w) {
            p.2 = true;
            crate::debug::warn(&format!(
                "watchdog: {}: its kernels have waited {} s for a peer that does not move: {}",
                self.name,
                waited.as_secs(),
                p.0
            ));
        }
        let timeout = timeout.filter(|&t| waited > t)?;
        Some(Error::timeout(format!(
            "{}: its kernels waited {} s for a peer that did not move (OXCCL_TIMEOUT_S): {}",
            self.name,
            timeout.as_secs(),
            p.0
        )))
    }
}

static WATCHED: Mutex<Vec<Watched>> = Mutex::new(Vec::new());

/// Registers a communicator with the watcher thread (started at the first one): a kernel's
/// error, or a peer its running kernels wait for in vain, becomes the communicator's error
/// (announced to the peers), and an aborted or failed communicator's kernels are told to stop.
fn watch(x: Watched) {
    let mut w = WATCHED.lock();
    let start = w.is_empty();
    w.push(x);
    if start {
        let spawned = std::thread::Builder::new()
            .name("oxccl-cuda-watch".into())
            .spawn(|| {
                for turn in 1u32.. {
                    std::thread::sleep(Duration::from_millis(5));
                    if !watch_turn(turn.is_multiple_of(PEER_TURNS)) {
                        // The next communicator starts a new watcher.
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            crate::debug::warn(&format!(
                "cannot start the CUDA watcher thread ({e}): kernel errors and aborts are seen \
                 only when a communicator waits"
            ));
            w.clear();
        }
    }
}

/// One turn of the watcher (`peers`: also look at running kernels' peers); false when nothing
/// is left to watch.
fn watch_turn(peers: bool) -> bool {
    // What graphs let go of is freed here too, while communicators live (their launches and
    // destroys free it as well).
    kept::reclaim();
    // Look under the lock, act after it (announcing a failure talks to the peers).
    let mut errors = Vec::new();
    let mut stops = Vec::new();
    {
        let mut w = WATCHED.lock();
        w.retain_mut(|x| {
            let (Some(ctl), Some(h)) = (x.ctl.upgrade(), x.health.upgrade()) else {
                return false;
            };
            if !x.reported {
                if let Some((code, info)) = ctl.error() {
                    x.reported = true;
                    errors.push((h.clone(), kernel_error(&x.name, code, info)));
                } else if peers && !h.halted() && !h.failed() {
                    if let Some(e) = x.peer_failure(&ctl) {
                        x.reported = true;
                        errors.push((h.clone(), e));
                    }
                }
            }
            if x.reported || h.halted() || h.failed() {
                stops.push(ctl);
            }
            true
        });
        if w.is_empty() && errors.is_empty() {
            return false;
        }
    }
    for (h, e) in errors {
        // (Also a WARN and ncclGetLastError's message: `Health::fail`.)
        h.fail_and_announce(e);
    }
    for ctl in stops {
        ctl.abort();
    }
    true
}

fn kernel_error(name: &str, code: u32, info: [u64; 6]) -> Error {
    match code {
        1 => Error::invalid_usage(format!(
            "{name}: a peer sent data of {} into an operation of {} (the launch's connection \
             {}, seen by block {}): \
             every rank must make the same calls in the same order; the communicator can now \
             only be destroyed or aborted",
            crate::plan::call::describe([info[1], info[2]]),
            crate::plan::call::describe([info[3], info[4]]),
            info[0],
            info[5]
        )),
        3 => Error::invalid_usage(format!(
            "{name}: rank {} made a call of {} where this rank made one of {} (a direct \
             collective on the device board, seen by block {}): every rank must make the same \
             calls in the same order; the communicator can now only be destroyed or aborted",
            info[0],
            crate::plan::call::describe([info[1], info[2]]),
            crate::plan::call::describe([info[3], info[4]]),
            info[5]
        )),
        4 => Error::remote(format!(
            "{name}: rank {} left a direct collective on the device board before it was done \
             (its kernel stopped: an abort, an error, a failed peer), at part {}",
            info[0], info[1]
        )),
        5 => Error::remote(format!(
            "{name}: the peer that sent on the launch's connection {} stopped its kernel (an \
             abort, an error) before this rank read what it sent by reference (seen by block \
             {}); none of it was read",
            info[0], info[5]
        )),
        c => Error::internal(format!("{name}: a kernel stopped with code {c}")),
    }
}
