//! The CUDA executor: runs the same plans as the host executor, on the caller's CUDA stream, with
//! the kernels of `cuda/` (`kernels`: compiled at run time by NVRTC). A group's calls are
//! planned per communicator (`plan::build`, without the host's direct board operations), their
//! connections made, their programs bound to the connections and flattened into kernel
//! parameters (`desc`); each stage of a task is one kernel launch (one block per lane), in
//! stream order, and its point-to-point lanes run beside them (`launch_set`). The calls return
//! once the work is enqueued.
//!
//! Ranks of one thread's group that share a device and a stream are launched together (one
//! kernel runs all their lanes), so that ranks on one GPU never wait for a kernel queued behind
//! their own. A communicator's launches run in issue order even on different streams (a launch
//! on another stream than the last one waits for the last one's event), except while a stream
//! captures a graph (a captured launch must not depend on work outside the graph). A
//! communicator's calls of one group on several streams are launched on the first, joined with
//! the others by events before and after (edges of the graph, when they capture one).
//!
//! Connection memory (FIFO slots and counters) is host memory pinned and mapped into the
//! devices (`memory::pin_host`), so that the same regions serve the shared-memory transport
//! between processes and the proxy threads of the network.

mod board;
pub mod comm;
mod desc;
mod direct;
mod kept;
mod kernels;
pub mod memory;
mod nvrtc;
pub mod spare;
pub mod stream;

pub use comm::CudaComm;

use super::{Call, CommExec};
use crate::error::{Error, Result};
use crate::gpu::driver::{self, check, CtxGuard};
use crate::plan::build::Caps;
use crate::plan::{Addr, Work};
use desc::{Desc, DevProgram};
use std::ffi::c_void;

/// The file name under which compiled kernels for `sm_{arch}` are cached for a driver of CUDA
/// 12.1 or later (tests put a stand-in image there).
#[doc(hidden)]
pub fn kernel_cache_name(arch: i32) -> String {
    kernels::cache_name(arch, true)
}

/// The calling thread's current device (the CUDA runtime's), for `ncclCommInitRank*`.
pub fn current_device() -> Result<i32> {
    driver::current_device()
}

impl<'a> Call<'a> {
    fn cuda(&self) -> &'a CudaComm {
        match self.comm {
            CommExec::Cuda(c) => c,
            CommExec::Host(_) => unreachable!("a host communicator in a CUDA launch"),
        }
    }
}

/// A group's calls by communicator (in place for one or two communicators).
type PerComm<'a> = smallvec::SmallVec<[Vec<Call<'a>>; 2]>;

/// Scratch for a plan's stash: device copies of inputs, taken in stream order.
struct Scratch {
    copies: Vec<(usize, usize)>,
    bases: Vec<u64>,
}

/// A stage's lanes bound to connections, with the scratch of its stash; `board`: its one lane
/// is a board lane (`board`), this rank's part of a direct collective.
struct DevStage {
    lanes: Vec<Vec<DevProgram>>,
    scratch: Scratch,
    board: bool,
}

/// One communicator's planned and bound work.
struct Job<'a> {
    comm: &'a CudaComm,
    stream: usize,
    /// Other streams the communicator's calls of the group were given: the launch stream waits
    /// for what they have queued, and they for the launch (as NCCL joins them).
    joins: Vec<usize>,
    stages: smallvec::SmallVec<[DevStage; 1]>,
    p2p: DevStage,
    /// The stage launch the point-to-point lanes join (`Task::p2p_stage`), or None: a launch
    /// of their own on the side stream, beside the stages (`launch_set`). In a stage's launch
    /// they go beside the last collective called before them, not ahead of the ones called
    /// after them (a peer that makes the same calls ungrouped would wait on those behind its
    /// own point-to-point calls).
    p2p_at: Option<usize>,
}

/// A group's jobs (in place for one communicator's).
type Jobs<'a> = smallvec::SmallVec<[Job<'a>; 1]>;

/// A launch of a set: stage k's (with the point-to-point lanes of the jobs whose `p2p_at` it
/// is), or the point-to-point lanes alone.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Slot {
    Stage(usize),
    P2p,
}

impl Job<'_> {
    /// The lanes of launch `slot`.
    fn lanes(&self, slot: Slot) -> impl Iterator<Item = &Vec<DevProgram>> {
        let (stage, p2p) = match slot {
            Slot::Stage(k) => (
                self.stages
                    .get(k)
                    .map(|s| s.lanes.as_slice())
                    .unwrap_or(&[]),
                self.p2p_at == Some(k),
            ),
            Slot::P2p => (&[][..], true),
        };
        let p2p = if p2p { self.p2p.lanes.as_slice() } else { &[] };
        stage.iter().chain(p2p)
    }

    /// Whether launch `slot`'s first lane is a board lane.
    fn on_board(&self, slot: Slot) -> bool {
        match slot {
            Slot::Stage(k) => self.stages.get(k).is_some_and(|s| s.board),
            Slot::P2p => false,
        }
    }
}

/// Binds a stage's lanes to the communicator's connections. A direct operation (the planner
/// gives them only where the communicator has a board: `prepare`) becomes a board lane's
/// program, one step over the rank's own buffers.
fn bind_stage(
    lanes: impl IntoIterator<Item = Vec<Work>>,
    copies: Vec<(usize, usize)>,
    conns: &crate::transport::conns::Conns,
) -> Result<DevStage> {
    let mut board = false;
    let lanes = lanes
        .into_iter()
        .map(|lane| {
            lane.into_iter()
                .map(|w| match w {
                    Work::Steps(p) => p.bind(&mut |k| conns.bound(k)),
                    Work::Board(b) => {
                        board = true;
                        board_program(&b)
                    }
                })
                .collect()
        })
        .collect::<Result<Vec<Vec<DevProgram>>>>()?;
    if board && (lanes.len() != 1 || lanes[0].len() != 1) {
        return Err(Error::internal("a board lane shares its stage"));
    }
    Ok(DevStage {
        lanes,
        scratch: Scratch {
            copies,
            bases: Vec::new(),
        },
        board,
    })
}

/// A board lane's program: this rank's buffers, count (per rank for all-gather and
/// reduce-scatter) and reduction, and the call's words, which say the collective to the kernel
/// (`ox_board`) and which the lanes compare on the board.
fn board_program(b: &crate::plan::board::BoardOp) -> Result<DevProgram> {
    let prim = match b.red {
        Some(_) => crate::plan::Prim::LocalReduce,
        None => crate::plan::Prim::LocalCopy,
    };
    let step = crate::plan::Step {
        prim,
        recv: None,
        send: None,
        src: Addr::User(b.send),
        dst: Addr::User(b.recv),
        len: b.count,
        prep: true,
    };
    let bytes = b.count * b.dtype.size();
    let mut p = crate::plan::Program::new(vec![step], b.dtype, bytes.max(1), b.red);
    p.call = crate::plan::call::of_coll(b.kind.coll(), b.count, b.dtype, b.red, b.root);
    p.bind(&mut |_| Err(Error::internal("a connection in a board lane")))
}

/// Checks that a buffer the kernels will touch is memory the device reaches (device, managed
/// or pinned-and-mapped host memory): a pageable host pointer would fault on the GPU and spoil
/// the context for every later call. On a capturing stream, an address the driver does not
/// know is let through (INFO): it may be a graph allocation made in the same capture
/// (`cudaMallocAsync` there, as PyTorch's `backend:cudaMallocAsync` does), memory that exists
/// only while the graph runs; NCCL checks no pointer by default.
fn check_buffer(q: &Call<'_>, addr: usize, what: &str, name: &str) -> Result<()> {
    let comm = q.cuda();
    if addr == 0 {
        return Ok(());
    }
    let api = driver::api()?;
    // The attributes in one call (a driver call takes its lock and looks the range up: this is
    // on every call's path). Memory the driver does not know gets type 0, not an error.
    let (mut ty, mut dev, mut managed): (std::ffi::c_uint, std::ffi::c_int, std::ffi::c_uint) =
        (0, -1, 0);
    let mut attrs = [
        driver::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        driver::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        driver::CU_POINTER_ATTRIBUTE_IS_MANAGED,
    ];
    let mut out = [
        &mut ty as *mut _ as *mut c_void,
        &mut dev as *mut _ as *mut c_void,
        &mut managed as *mut _ as *mut c_void,
    ];
    // SAFETY: three attributes, each written to its own variable of the attribute's type (the
    // managed flag an unsigned int); any address may be asked about.
    let r = unsafe {
        (api.pointer_attrs)(
            attrs.len() as std::ffi::c_uint,
            attrs.as_mut_ptr(),
            out.as_mut_ptr(),
            addr as u64,
        )
    };
    if r != driver::CUDA_SUCCESS || ty == 0 {
        if memory::device_of(addr) == Some(comm.dev) {
            return Ok(()); // ncclMemAlloc's, on this device
        }
        if driver::capture(stream::handle(&q.stream)).is_ok_and(|c| c != driver::Capture::No) {
            crate::debug::info(&format!(
                "{name}: {what} {addr:#x} is unknown to the driver's pointer query while its \
                 stream captures a graph: taken as a graph allocation of that capture (were it \
                 pageable host memory, the graph's replays would fault) ({})",
                comm.describe()
            ));
            return Ok(());
        }
        return Err(Error::invalid_argument(format!(
            "{name}: {what} {addr:#x} is not memory the GPU can reach (not from cudaMalloc, \
             ncclMemAlloc, cudaMallocManaged or cudaHostAlloc); {} runs on device {}",
            comm.describe(),
            comm.dev
        )));
    }
    // Managed memory (cudaMallocManaged) names the device it was allocated on, but every
    // device reaches it.
    if ty == driver::CU_MEMORYTYPE_DEVICE && managed == 0 && dev >= 0 && dev != comm.dev {
        return Err(Error::invalid_argument(format!(
            "{name}: {what} {addr:#x} is memory of device {dev}, but {} runs on device {} \
             (peer access between devices is not enabled)",
            comm.describe(),
            comm.dev
        )));
    }
    Ok(())
}

/// Checks that a reduction's buffers are aligned to its datatype: the kernels load and store
/// them element by element (where not 16 bytes at a time), and a GPU faults on a misaligned
/// element (`CUDA_ERROR_MISALIGNED_ADDRESS`, which spoils the context for every later call).
/// Copies move bytes and take any address; so does the host executor. (`send`, `recv`: the
/// buffers the call uses.)
#[inline]
fn check_aligned(q: &Call<'_>, send: bool, recv: bool) -> Result<()> {
    if q.red.is_none() {
        return Ok(());
    }
    let a = &q.args;
    for (what, addr, used) in [("sendbuff", a.send, send), ("recvbuff", a.recv, recv)] {
        if used && !addr.is_multiple_of(a.dtype.size()) {
            return Err(misaligned(q, what, addr));
        }
    }
    Ok(())
}

/// `check_aligned`'s error: `what` at `addr`.
#[cold]
#[inline(never)]
fn misaligned(q: &Call<'_>, what: &str, addr: usize) -> Error {
    let a = &q.args;
    Error::invalid_argument(format!(
        "{}: {what} {addr:#x} is not aligned to its datatype's {} bytes ({}): the GPU cannot \
         reduce elements at that address; {} runs on device {}",
        a.kind.name(),
        a.dtype.size(),
        a.dtype.name(),
        q.cuda().describe(),
        q.cuda().dev
    ))
}

/// The hardware queues a CUDA context spreads its streams over (`CUDA_DEVICE_MAX_CONNECTIONS`,
/// CUDA's variable; 8 where unset).
fn hardware_queues() -> usize {
    static N: once_cell::sync::Lazy<usize> = once_cell::sync::Lazy::new(|| {
        std::env::var("CUDA_DEVICE_MAX_CONNECTIONS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(8)
    });
    *N
}

/// A WARN, once per communicator, where its ranks on this GPU in this process launch apart
/// (this launch holds `ranks_here` of them) and outnumber the context's hardware queues: the
/// streams of some share a queue, which runs its work in order, so a rank's kernel can be
/// queued behind work that waits for another rank's kernel that waits for it.
#[inline]
fn warn_shared_queues(comm: &CudaComm, ranks_here: usize) {
    let (local, queues) = (comm.process_ranks_on_device.len(), hardware_queues());
    if ranks_here < local && local > queues {
        warn_shared_queues_once(comm, local, queues);
    }
}

#[cold]
#[inline(never)]
fn warn_shared_queues_once(comm: &CudaComm, local: usize, queues: usize) {
    if comm
        .queues_warned
        .swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        return;
    }
    crate::debug::warn(&format!(
        "{}: {local} ranks of this communicator on this GPU in this process launch apart, \
         more than its {queues} hardware queues (CUDA_DEVICE_MAX_CONNECTIONS): streams that \
         share a queue run in order there, so a rank's launch can wait behind work that waits \
         for it; if it stops, launch the GPU's ranks in one group, set \
         CUDA_DEVICE_MAX_CONNECTIONS to at least {local} (at most 32) before CUDA starts, or \
         put fewer ranks on the GPU",
        comm.describe()
    ));
}

/// Launches a group's calls (all on CUDA communicators).
pub fn launch(ops: Vec<Call<'_>>) -> Result<()> {
    for q in &ops {
        let name = q.args.kind.name();
        if q.args.count > 0 {
            let _g = q.cuda().enter()?;
            // Only the buffers the call uses (NCCL ignores the others: a non-root's receive
            // buffer of a reduce may be anything).
            let (send, recv) = q.args.buffers_used(q.cuda().rank);
            if send {
                check_buffer(q, q.args.send, "sendbuff", name)?;
            }
            if recv && (!send || q.args.recv != q.args.send) {
                check_buffer(q, q.args.recv, "recvbuff", name)?;
            }
            check_aligned(q, send, recv)?;
        }
    }
    stream::legacy_stream_together(&ops)?;
    // Group by communicator, keeping call order (calls of one communicator as they came).
    let mut per_comm: PerComm = PerComm::new();
    if !ops.is_empty() && ops.iter().all(|q| std::ptr::eq(q.cuda(), ops[0].cuda())) {
        per_comm.push(ops);
    } else {
        for q in ops {
            match per_comm
                .iter_mut()
                .find(|v| std::ptr::eq(v[0].cuda(), q.cuda()))
            {
                Some(v) => v.push(q),
                None => per_comm.push(vec![q]),
            }
        }
    }
    if trace() {
        for v in &per_comm {
            for q in v {
                crate::debug::info(&format!(
                    "{}: call {} send {:#x} recv {:#x} count {} stream {:#x} (comm at {:p})",
                    q.cuda().describe(),
                    q.args.kind.name(),
                    q.args.send,
                    q.args.recv,
                    q.args.count,
                    stream::handle(&q.stream),
                    q.cuda()
                ));
            }
        }
    }
    // All-reduces of every rank of a communicator on one device: one kernel each (`direct`),
    // launched once the rest of the group is planned and connected (a group that cannot be
    // fails before anything runs).
    let direct_sets = direct::take(&mut per_comm);
    let jobs = prepare(per_comm)?;
    let mut first_err = None;
    for set in &direct_sets {
        if let Err(e) = direct::launch(set) {
            first_err.get_or_insert(e);
        }
    }
    if let Err(e) = launch_jobs(jobs) {
        first_err.get_or_insert(e);
    }
    first_err.map_or(Ok(()), Err)
}

/// Plans a group's calls (by communicator), makes the connections they need and binds the
/// programs to them.
fn prepare<'a>(per_comm: PerComm<'a>) -> Result<Jobs<'a>> {
    if per_comm.is_empty() {
        return Ok(Jobs::new());
    }
    let mut planned: smallvec::SmallVec<[_; 1]> = smallvec::SmallVec::new();
    for qs in per_comm {
        let comm = qs[0].cuda();
        let caps = Caps {
            direct: comm.board.is_some()
                && comm.kern.run_board.is_some()
                && crate::param::cuda_direct(),
            direct_algo: "Direct (device board: every rank in this process on this GPU)",
            direct_fallback: false,
            eager_bytes: 0,
            channels: comm.channels,
        };
        let call = |q: &Call<'_>| (q.args, q.red);
        let t = crate::plan::build::build_task(qs[0].conns, caps, &qs, call)?;
        planned.push((qs, t));
    }
    let needs: Vec<_> = planned
        .iter()
        .map(|(qs, t)| {
            let conns = qs[0].conns;
            (conns, conns.missing_of(|f| t.for_each_key(&mut |k| f(k))))
        })
        .filter(|(_, keys)| !keys.is_empty())
        .collect();
    if !needs.is_empty() {
        // Device memory of new connections goes to each communicator's device (`Conns`
        // enters its context).
        if let Err(e) = crate::transport::conns::connect_all(&needs) {
            // Peers whose ends connected wait for this rank: tell them (a sending end that
            // could not open a receiving end's device memory, say).
            for (qs, _) in &planned {
                qs[0].cuda().health.fail_unless_told(e.clone());
            }
            return Err(e);
        }
    }
    let mut jobs = Jobs::new();
    for (qs, t) in planned {
        let conns = qs[0].conns;
        let p2p_at = Some(t.p2p_stage());
        let stages = t
            .stages
            .into_iter()
            .map(|s| bind_stage(s.lanes, s.stash.copies, conns))
            .collect::<Result<_>>()?;
        jobs.push(Job {
            comm: qs[0].cuda(),
            stream: stream::handle(&qs[0].stream),
            joins: {
                let first = stream::handle(&qs[0].stream);
                let mut v: Vec<usize> = Vec::new();
                for q in &qs[1..] {
                    let h = stream::handle(&q.stream);
                    if h != first && !v.contains(&h) {
                        v.push(h);
                    }
                }
                v
            },
            stages,
            p2p: bind_stage(t.p2p, t.p2p_stash.copies, conns)?,
            p2p_at,
        });
    }
    Ok(jobs)
}

/// Launches prepared jobs: together those that share a context and a stream.
fn launch_jobs(mut jobs: Jobs<'_>) -> Result<()> {
    // What graphs let go of since the last look goes before the group's first launch (not
    // while its stream captures).
    if let Some(j0) = jobs.first() {
        kept::reclaim_if(|| {
            CtxGuard::enter(j0.comm.ctx)
                .and_then(|_g| driver::capture(j0.stream))
                .is_ok_and(|c| c == driver::Capture::No)
        });
    }
    // (The usual group, one context and one stream, as it is.)
    if let Some(j0) = jobs.first() {
        let (ctx, s) = (j0.comm.ctx, j0.stream);
        if jobs.iter().all(|j| j.comm.ctx == ctx && j.stream == s) {
            return launch_set(&mut jobs);
        }
    }
    let mut first_err = None;
    let mut jobs = jobs.into_vec();
    while !jobs.is_empty() {
        let (ctx, s) = (jobs[0].comm.ctx, jobs[0].stream);
        let (mut set, rest): (Vec<Job>, Vec<Job>) = jobs
            .into_iter()
            .partition(|j| j.comm.ctx == ctx && j.stream == s);
        jobs = rest;
        if let Err(e) = launch_set(&mut set) {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Takes a stash's copies on `stream` (allocated in stream order) and points the programs at
/// them.
fn fill_scratch(
    sc: &mut Scratch,
    lanes: &mut [Vec<DevProgram>],
    stream: usize,
    api: &driver::Api,
) -> Result<()> {
    if sc.copies.is_empty() {
        return Ok(());
    }
    for &(src, bytes) in &sc.copies {
        let mut p: driver::CUdeviceptr = 0;
        // SAFETY: stream-ordered allocation on the caller's stream.
        check(
            unsafe { (api.mem_alloc_async)(&mut p, bytes.max(1), stream as _) },
            || format!("cuMemAllocAsync of {bytes} bytes of scratch"),
        )?;
        sc.bases.push(p);
        // SAFETY: `src` is `bytes` of the caller's (validated) buffer; `p` holds `bytes`.
        check(
            unsafe { (api.memcpy_dtod_async)(p, src as u64, bytes, stream as _) },
            || "copying an input to scratch (cuMemcpyDtoDAsync)".into(),
        )?;
    }
    let place = |a: Addr| match a {
        Addr::Scratch { idx, off } => Addr::User(sc.bases[idx as usize] as usize + off),
        a => a,
    };
    for p in lanes.iter_mut().flatten() {
        for s in &mut p.steps {
            s.src = place(s.src);
            s.dst = place(s.dst);
        }
    }
    Ok(())
}

fn free_scratch(sc: &Scratch, stream: usize, api: &driver::Api) {
    for &p in &sc.bases {
        // SAFETY: allocated by `fill_scratch` on this stream; freed after the launch using it.
        unsafe { (api.mem_free_async)(p, stream as _) };
    }
}

/// Launches the jobs of one (context, stream): stage k of every job in launch k. The jobs'
/// point-to-point lanes run beside the stages, as NCCL runs a whole group in one kernel: with
/// one stage, in its launch; with several, in a launch of their own on the side stream of the
/// first job's communicator (forked from `stream` before the stages and joined after them),
/// so that they wait for no stage and no stage waits for them (in a stage's launch, they would
/// hold up the later stages until a peer's matching calls come, which may come after the
/// peer's own of those stages).
fn launch_set(jobs: &mut [Job<'_>]) -> Result<()> {
    let api = driver::api()?;
    let comm0 = jobs[0].comm;
    let stream = jobs[0].stream;
    let _g = CtxGuard::enter(comm0.ctx)?;
    let cap = driver::capture(stream)?;
    let capturing = cap != driver::Capture::No;
    let nstages = jobs.iter().map(|j| j.stages.len()).max().unwrap_or(0);
    let any_p2p = jobs.iter().any(|j| !j.p2p.lanes.is_empty());
    let side = if nstages > 1 && any_p2p {
        side_launch(jobs, nstages, cap)?
    } else {
        None
    };
    if side.is_some() {
        for j in jobs.iter_mut() {
            j.p2p_at = None;
        }
    }
    let p2p_launches = jobs
        .iter()
        .filter(|j| !j.p2p.lanes.is_empty())
        .filter_map(|j| j.p2p_at.map(|k| k + 1))
        .max()
        .unwrap_or(0);
    let launches = nstages.max(p2p_launches);
    let stages = (0..launches).map(Slot::Stage);
    // Every launch's descriptor must fit before the first is launched: a group fails whole
    // (and alike on every rank, whose groups are the same).
    let large = jobs[0].comm.kern.large();
    for slot in stages.clone().chain(side.map(|_| Slot::P2p)) {
        Desc::check_fits(
            jobs.iter().flat_map(|j| j.lanes(slot)).map(Vec::as_slice),
            large,
        )?;
    }
    let mut launched = false;
    // Issue order per communicator across streams, and the group's other streams joined (while
    // capturing: edges of the graph, which all of them capture, `stream::streams_alike`).
    let mut result = jobs
        .iter()
        .try_for_each(|j| stream::join_before(api, j.comm, stream, &j.joins, cap));
    if !capturing {
        for j in jobs.iter() {
            j.comm.last_conns.lock().clear();
        }
    }
    // The side launch first (its lanes and the stages' share the device: `Beside`), then the
    // stages; `stream` waits for the side stream after them, also after an error (a capture
    // must get its forked stream back).
    let mut forked = None;
    if let (Some(s), true) = (side, result.is_ok()) {
        let side = s.side;
        result = stream::fork(api, stream, side.stream, side.event);
        if result.is_ok() {
            forked = Some(s);
            result = launch_stage(
                jobs,
                Slot::P2p,
                side.stream,
                s.stages,
                capturing,
                api,
                &mut launched,
            );
            let r = stream::record(api, side.stream, side.event);
            if result.is_ok() {
                result = r;
            }
        }
    }
    let beside = forked.map_or(Beside::default(), |s| s.p2p);
    for slot in stages {
        if result.is_err() {
            break;
        }
        result = launch_stage(jobs, slot, stream, beside, capturing, api, &mut launched);
    }
    if let Some(s) = forked {
        let r = stream::wait(api, stream, s.side.event);
        if result.is_ok() {
            result = r;
        }
    }
    if launched {
        // Also after an error: later launches and quiescence wait for what did run.
        for j in jobs.iter() {
            let r = match cap {
                driver::Capture::Graph(id) => {
                    stream::join_captured(api, j.comm, stream, &j.joins, id)
                }
                driver::Capture::No => stream::join_after(api, j.comm, stream, &j.joins, stream),
            };
            if result.is_ok() {
                result = r;
            }
        }
    }
    if let (Err(e), false) = (&result, capturing) {
        // The driver refused part of the group: the peers launched theirs and wait for this
        // rank's (whatever of it did run waits for the rest), so the communicators are broken
        // (their kernels are told to stop, their peers told) rather than left to hang. (A
        // graph being captured runs nowhere yet: nobody waits for it.)
        for j in jobs.iter() {
            j.comm.health.fail_and_announce(e.clone());
        }
    }
    result
}

/// The side stream of the first job's communicator for a launch of `jobs` (`nstages` stage
/// launches) on a stream that captures `cap`, where they can take it. Not where the
/// point-to-point launch and the largest stage launch need more blocks at once than the device
/// holds (in one launch, lanes in `lane_key`'s order always end; two launches on two streams
/// might each hold SMs that the other's lanes wait for), nor where the stream cannot be made
/// (INFO says why), nor where it is drawn into another graph's capture than `cap` (a capture
/// still open: it captures whatever is queued on it). Otherwise a stream that captures
/// nothing (drawn into the capture by the fork, if there is one), or the same graph already
/// (drawn into it by an earlier group). None: the point-to-point lanes join a stage's launch.
fn side_launch(
    jobs: &[Job<'_>],
    nstages: usize,
    cap: driver::Capture,
) -> Result<Option<SideLaunch>> {
    let comm = jobs[0].comm;
    // (The stages' own lanes: the point-to-point lanes are still in a stage's launch here.)
    let stages = Beside {
        lanes: (0..nstages)
            .map(|k| {
                jobs.iter()
                    .map(|j| j.stages.get(k).map_or(0, |s| s.lanes.len()))
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0),
        board: jobs.iter().any(|j| j.stages.iter().any(|s| s.board)),
    };
    let p2p = Beside {
        lanes: jobs.iter().map(|j| j.p2p.lanes.len()).sum(),
        board: false,
    };
    if (stages.lanes + p2p.lanes) * device_share(comm, stages.board) > comm.kern.sms as usize {
        return Ok(None);
    }
    let side = match comm.side() {
        Ok(side) => side,
        Err(e) => {
            crate::debug::info(&format!(
                "{}: no side stream for a group's sends and receives ({e}): they join a \
                 collective's launch",
                comm.describe()
            ));
            return Ok(None);
        }
    };
    let free = match (driver::capture(side.stream)?, cap) {
        (driver::Capture::No, _) => true,
        (driver::Capture::Graph(Some(a)), driver::Capture::Graph(Some(b))) => a == b,
        _ => false,
    };
    Ok(free.then_some(SideLaunch { side, stages, p2p }))
}

/// A set's point-to-point launch on a side stream: the stream, and the lanes of the stage
/// launches (the most of any) and of the point-to-point launch, each beside the other.
#[derive(Clone, Copy)]
struct SideLaunch {
    side: comm::Side,
    stages: Beside,
    p2p: Beside,
}

/// How many shares of the device's SMs a launch of `comm`'s takes at most (`board`: it, or a
/// launch beside it, has board lanes): every block of every lane of the ranks on the device
/// spins for the others, so all must fit on the device at once (one 512-thread block per SM
/// is assumed). Board lanes take at most half of it, so that another communicator's launches
/// fit beside theirs, and share it with every rank on a board of this context (other
/// communicators' too: their launches may all wait for peers at once).
fn device_share(comm: &CudaComm, board: bool) -> usize {
    if board {
        (2 * comm.ranks_on_device).max(board::ranks_in(comm.ctx))
    } else {
        comm.ranks_on_device
    }
}

/// The lanes of launches that run at the same time as a launch, on another stream: they must
/// all fit on the device at once (`run`).
#[derive(Clone, Copy, Default)]
struct Beside {
    lanes: usize,
    board: bool,
}

/// Launches `func` (512 threads a block, `grid` blocks) on `stream` with the descriptor
/// `params` as its one parameter; `what` names the launch in an error.
fn launch_kernel(
    api: &driver::Api,
    func: usize,
    grid: (u32, u32),
    stream: usize,
    params: &mut [u64],
    what: impl FnOnce() -> String,
) -> Result<()> {
    let mut args = [params.as_mut_ptr() as *mut c_void];
    // SAFETY: the kernels take one parameter, their descriptor (`PARAM_BYTES`, or
    // `PARAM_BYTES_LARGE` for the twins), which the caller sized `params` for.
    check(
        unsafe {
            (api.launch_kernel)(
                func as _,
                grid.0,
                grid.1,
                1,
                512,
                1,
                1,
                0,
                stream as _,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        },
        what,
    )
}

/// Launch `slot` of a set: stage k of every job and the point-to-point lanes of the jobs whose
/// `p2p_at` it is, or the point-to-point lanes alone; their scratch taken before and freed
/// after, in stream order.
fn launch_stage(
    jobs: &mut [Job<'_>],
    slot: Slot,
    stream: usize,
    beside: Beside,
    captured: bool,
    api: &driver::Api,
    launched: &mut bool,
) -> Result<()> {
    let comm0 = jobs[0].comm;
    let mut d = Desc::new();
    if !captured {
        d.allow_peer_refs();
    }
    let mut filled: smallvec::SmallVec<[(usize, bool); 4]> = smallvec::SmallVec::new();
    let mut r = Ok(());
    for (i, j) in jobs.iter_mut().enumerate() {
        let (stage, p2p) = match slot {
            Slot::Stage(k) => (j.stages.get_mut(k), j.p2p_at == Some(k)),
            Slot::P2p => (None, true),
        };
        if let Some(s) = stage {
            filled.push((i, false));
            r = fill_scratch(&mut s.scratch, &mut s.lanes, stream, api);
            if r.is_err() {
                break;
            }
        }
        if p2p {
            let s = &mut j.p2p;
            filled.push((i, true));
            r = fill_scratch(&mut s.scratch, &mut s.lanes, stream, api);
            if r.is_err() {
                break;
            }
        }
    }
    if r.is_ok() {
        r = ordered_lanes(jobs, slot)
            .into_iter()
            .try_for_each(|(lane, lc)| d.lane_on(lane, lc));
    }
    if r.is_ok() {
        if trace() {
            crate::debug::info(&format!(
                "{}: launch {slot:?} on stream {stream:#x}:{}",
                comm0.describe(),
                d.describe()
            ));
        }
        for j in jobs.iter() {
            // Each communicator keeps its own connections of the launches (for messages;
            // `launch_set` clears them first) and of every launch (for the watcher, which
            // learns from the kernels which one they wait on).
            let mut lc = j.comm.last_conns.lock();
            let mut used = j.comm.used.lock();
            for s in j.lanes(slot).flatten().flat_map(|p| &p.steps) {
                for c in s.conns() {
                    if !lc.iter().any(|x| std::sync::Arc::ptr_eq(x, c)) {
                        lc.push(c.clone());
                        used.add(c);
                    }
                }
            }
        }
        let here = jobs
            .iter()
            .filter(|j| j.comm.hash == comm0.hash && j.lanes(slot).next().is_some())
            .count();
        r = run(&d, comm0, here, beside, stream, captured, api).map(|l| *launched |= l);
    }
    // Scratch goes back in stream order after the launch that used it (or at once, in stream
    // order, when nothing was launched).
    for (i, p2p) in filled {
        let j = &jobs[i];
        let sc = match (p2p, slot) {
            (true, _) => &j.p2p.scratch,
            (false, Slot::Stage(k)) => &j.stages[k].scratch,
            (false, Slot::P2p) => unreachable!("no stage in the point-to-point launch"),
        };
        free_scratch(sc, stream, api);
    }
    r
}

/// The lanes of launch `slot` of `jobs`, each with its communicator's control block, in the order
/// `desc::lane_key` gives them (so that a launch with more blocks than the device holds at once
/// still ends).
fn ordered_lanes<'j>(
    jobs: &'j [Job<'_>],
    slot: Slot,
) -> smallvec::SmallVec<[(&'j [DevProgram], desc::LaneComm); 4]> {
    let mut v: smallvec::SmallVec<[_; 4]> = smallvec::SmallVec::new();
    for j in jobs {
        // (By its hash: the same order in every process, whatever order a group's calls on
        // several communicators came in.)
        let ci = j.comm.hash as usize;
        let ctl = j.comm.ctl.addr();
        let plain = desc::LaneComm {
            registry: j.comm.registry,
            ..desc::LaneComm::of(ctl)
        };
        let board = match (&j.comm.board, j.on_board(slot)) {
            (Some(b), true) => desc::LaneComm {
                board: b.addr(),
                rank: j.comm.rank as u16,
                nranks: j.comm.nranks as u16,
                ..plain
            },
            _ => plain,
        };
        for (index, lane) in j.lanes(slot).enumerate() {
            let ends = lane
                .iter()
                .flat_map(|p| &p.steps)
                .flat_map(|s| s.conns())
                .map(|c| (c.me, c.peer, c.is_sender, c.class));
            let key = desc::lane_key(ends, j.comm.nranks, ci, index, j.comm.rank);
            // (A board lane is the stage's only one, before the point-to-point lanes.)
            let lc = if index == 0 { board } else { plain };
            v.push((key, lane.as_slice(), lc));
        }
    }
    v.sort_by_key(|e| e.0);
    v.into_iter().map(|(_, lane, lc)| (lane, lc)).collect()
}

/// `OXCCL_CUDA_TRACE=1`: every launch is logged (INFO) with its lanes, steps and connections.
pub(super) fn trace() -> bool {
    static T: once_cell::sync::Lazy<bool> =
        once_cell::sync::Lazy::new(|| std::env::var("OXCCL_CUDA_TRACE").is_ok_and(|v| v == "1"));
    *T
}

/// Launches one descriptor on `stream` (`ranks_here`: the ranks of `comm`'s communicator whose
/// lanes it holds; `beside`: a launch on another stream that runs at the same time;
/// `captured`: `stream` captures a graph).
fn run(
    d: &Desc,
    comm: &CudaComm,
    ranks_here: usize,
    beside: Beside,
    stream: usize,
    captured: bool,
    api: &driver::Api,
) -> Result<bool> {
    if d.lanes() == 0 {
        return Ok(false);
    }
    let plain = d.plain_copies();
    let is_plain = plain.is_some();
    if let Some(copies) = plain {
        let copies: Vec<_> = copies
            .into_iter()
            .filter(|&(dst, src, bytes)| dst != src && bytes > 0)
            .collect();
        if copies.is_empty() {
            // In place on one rank: nothing to do.
            return Ok(false);
        }
        // On the copy engine, as NVIDIA's NCCL copies: on an H100 (12-06) it beat the wide and
        // the copy kernel at every size from 128 KiB to 512 MiB, in one run. A nonzero
        // `OXCCL_CUDA_CE_COPY_BYTES` gives copies of that size and more to the wide kernel
        // below (the GPU check measures both).
        let ce = crate::param::cuda_ce_copy_bytes();
        if ce == 0 || copies.iter().all(|c| c.2 < ce) {
            for (dst, src, bytes) in copies {
                // SAFETY: validated user ranges of `bytes` each.
                check(
                    unsafe { (api.memcpy_dtod_async)(dst, src, bytes as usize, stream as _) },
                    || format!("{}: cuMemcpyDtoDAsync", comm.describe()),
                )?;
            }
            return Ok(true);
        }
    }
    let k = &comm.kern;
    // A descriptor past `PARAM_BYTES` goes to the kernels' large-parameter twins.
    let pick = |small: usize, large: Option<usize>| match (d.large(), large) {
        (true, Some(f)) => f,
        _ => small,
    };
    let (func, grid_x, grid_y, nb) = if d.wide() {
        let blocks = (d.max_bytes() / (512 * 64)).clamp(1, 2 * k.sms as usize);
        // Plain copies may go to the lean copy kernel instead (until the GPU check has compared
        // the two, `OXCCL_CUDA_COPY_KERNEL=1` asks for it).
        let f = match k.copy {
            Some(c) if is_plain && !d.large() && crate::param::cuda_copy_kernel() => c,
            _ => pick(k.local, k.local_large),
        };
        (f, blocks as u32, d.lanes() as u32, 1)
    } else {
        // The launch's share of the device (`device_share`), with the lanes of a launch on
        // another stream that runs beside it.
        let ranks = device_share(comm, d.boards() > 0 || beside.board);
        let lanes = d.lanes() + beside.lanes;
        let room = k.sms as usize / (lanes * ranks).max(1);
        let nb = d.blocks_per_lane().min(room.max(1) as u16);
        // Past the device's SMs a launch still ends alone (its lanes are in `lane_key`'s
        // order), but not when it needs the device's other ranks' launches to run beside it.
        let others = comm.ranks_on_device.saturating_sub(ranks_here);
        let need = lanes + others * lanes.div_ceil(ranks_here.max(1));
        if others > 0
            && need > k.sms as usize
            && !comm
                .room_warned
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            crate::debug::warn(&format!(
                "{}: a launch of {} lanes while {others} more rank(s) of this communicator \
                 use this device in launches of their own: about {need} blocks may have to run \
                 at once where the device holds {}; if it stops, launch the device's ranks \
                 in one group on one stream, or put fewer ranks on the GPU",
                comm.describe(),
                d.lanes(),
                k.sms
            ));
        }
        warn_shared_queues(comm, ranks_here);
        let f = if d.boards() == 0 {
            pick(k.run, k.run_large)
        } else {
            // (Board lanes are planned only where the module has `run_board`.)
            match (d.large(), k.run_board, k.run_board_large) {
                (false, Some(f), _) | (true, _, Some(f)) => f,
                _ => {
                    return Err(Error::internal(
                        "a launch with board lanes, and no kernel for them",
                    ))
                }
            }
        };
        (f, d.lanes() as u32 * u32::from(nb), 1, nb)
    };
    // (An error where the descriptor is large and the driver has no twins.)
    let mut params = d.params(nb, k.large())?;
    if captured {
        // Replays look at the control blocks first: they may come after a communicator ended.
        params[0] |= desc::HEAD_CAPTURED;
    }
    if d.gpu_fences() {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let once = || !SAID.swap(true, std::sync::atomic::Ordering::Relaxed);
        match crate::param::cuda_fence() {
            crate::param::Fence::Gpu => {
                params[0] |= desc::HEAD_GPU_FENCES;
                if once() {
                    crate::debug::info(&format!(
                        "{}: the ring's steps use device-scope fences (OXCCL_CUDA_FENCE=gpu; \
                         every connection of the launch on this GPU)",
                        comm.describe()
                    ));
                }
            }
            crate::param::Fence::Unknown if once() => crate::debug::warn(
                "OXCCL_CUDA_FENCE is neither gpu nor sys: the ring's steps use system-scope \
                 fences",
            ),
            _ => {}
        }
    }
    launch_kernel(api, func, (grid_x, grid_y), stream, &mut params, || {
        format!(
            "{}: launching a kernel of {} lanes on stream {stream:#x}",
            comm.describe(),
            d.lanes()
        )
    })?;
    Ok(true)
}
