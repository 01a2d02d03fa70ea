//! The emulated device of `tests/cuda_emulated.rs`: the kernels of `cuda/runner.cu` compiled
//! for the host (`emu.cpp` here), and a stand-in driver around them whose streams are threads
//! that run their work in order (kernels, copies, sets, event records and waits; a capturing
//! stream keeps its work as a graph to replay), whose device memory is host memory in memory
//! files of its own (so that another process opens it by an IPC handle), and whose device is
//! one sm_90 of 132 SMs whose virtual memory management maps real memory files.

use super::stand_in::{self, granularity, GRANULARITY, OK};
use nccl::gpu::driver::{self, Api, CUresult};
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const NOT_READY: CUresult = 600;

// ---- the host-compiled kernels -------------------------------------------------------------

type LaunchFn = unsafe extern "C" fn(*const c_char, c_uint, c_uint, c_uint, *const c_void) -> c_int;
type ParamBytesFn = unsafe extern "C" fn(*const c_char) -> usize;
type RefsFn = unsafe extern "C" fn() -> u64;

struct Emu {
    launch: LaunchFn,
    param_bytes: ParamBytesFn,
    refs: RefsFn,
    _lib: libloading::Library,
}
static EMU: OnceLock<Emu> = OnceLock::new();

/// Compiles `tests/cuda_emu/emu.cpp` (which includes `cuda/runner.cu`) into a shared library;
/// None (after saying why) when there is no g++. The caller removes the file.
pub fn build_emu() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if Command::new("g++").arg("--version").output().is_err() {
        eprintln!("SKIPPED: no g++ on PATH, the kernels were not run on the host");
        return None;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-emu");
    std::fs::create_dir_all(&dir).unwrap();
    let so: PathBuf = dir.join(format!("libemu-{}.so", std::process::id()));
    let out = Command::new("g++")
        .args([
            "-std=c++17",
            "-O2",
            "-g",
            "-fPIC",
            "-shared",
            "-ffp-contract=off",
        ])
        .args(["-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas"])
        .args(["-Wno-unused-parameter", "-Wno-sign-compare"])
        .arg("-I")
        .arg(root.join("cuda"))
        .arg(root.join("tests/cuda_emu/emu.cpp"))
        .arg("-o")
        .arg(&so)
        .arg("-lpthread")
        .output()
        .expect("run g++");
    assert!(
        out.status.success(),
        "g++ failed on tests/cuda_emu/emu.cpp:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(so)
}

/// Loads the kernels built by `build_emu`.
pub fn load_emu(so: &Path) {
    // SAFETY: the library has no initialisers beyond C++ statics; the symbols have the
    // signatures emu.cpp gives them.
    let emu = unsafe {
        let lib = libloading::Library::new(so).expect("load the emulated kernels");
        let launch = *lib.get::<LaunchFn>(b"oxemu_launch\0").unwrap();
        let param_bytes = *lib.get::<ParamBytesFn>(b"oxemu_param_bytes\0").unwrap();
        let refs = *lib.get::<RefsFn>(b"oxemu_refs_taken\0").unwrap();
        Emu {
            launch,
            param_bytes,
            refs,
            _lib: lib,
        }
    };
    assert!(EMU.set(emu).is_ok(), "loaded twice");
}

/// The slots the kernels' receivers have taken by reference so far (`OX_TOOK_REF`).
pub fn refs_taken() -> u64 {
    let emu = EMU.get().expect("the emulated kernels are loaded");
    // SAFETY: a plain read of a counter.
    unsafe { (emu.refs)() }
}

// ---- streams and events ----------------------------------------------------------------------

#[derive(Clone)]
pub enum Op {
    Launch {
        name: &'static CStr,
        grid: (u32, u32),
        block: u32,
        params: Vec<u64>,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    Set8 {
        dst: u64,
        v: u8,
        n: usize,
    },
    Set32 {
        dst: u64,
        v: u32,
        n: usize,
    },
    Record {
        event: Arc<Event>,
        generation: u64,
    },
    Wait {
        event: Arc<Event>,
        generation: u64,
    },
    /// An event record node of a graph (`CU_EVENT_RECORD_EXTERNAL` while capturing): each
    /// replay records the event anew (only in graphs; `replay` turns it into a `Record`).
    RecordNode(Arc<Event>),
    /// An event wait node (`CU_EVENT_WAIT_EXTERNAL`): each replay waits for the event's latest
    /// record when the replay is issued (only in graphs; `replay` turns it into a `Wait`).
    WaitNode(Arc<Event>),
    /// A user object the graph retains (`cuGraphRetainUserObject`; never run): its destructor
    /// runs when the graph, and every copy of it, is dropped.
    Keep(Arc<UserObject>),
    /// Where a stream that did not capture was drawn into the capture (it waited for an event
    /// recorded there): its work, which `end_capture` puts here (`Side`).
    Fork(usize),
    /// The work a stream drawn into the capture at this point captured, which a replay runs on
    /// that stream (beside the rest).
    Side(usize, Vec<Op>),
}

/// A user object (`cuUserObjectCreate`).
pub struct UserObject {
    ptr: usize,
    destroy: driver::CUhostFn,
}

impl Drop for UserObject {
    fn drop(&mut self) {
        // SAFETY: the destructor and pointer the executor gave, called once, the last
        // reference gone.
        unsafe { (self.destroy)(self.ptr as *mut c_void) }
    }
}

/// Host memory pinned now (`cuMemHostRegister`), by address: what kernels may reach of the
/// host's memory.
static PINNED: Mutex<BTreeMap<u64, usize>> = Mutex::new(BTreeMap::new());

/// Whether `p` is in host memory pinned now.
pub fn pinned(p: u64) -> bool {
    within(&PINNED.lock(), p)
}

/// Whether `p` is in one of `ranges` (start, bytes).
fn within(ranges: &BTreeMap<u64, usize>, p: u64) -> bool {
    ranges
        .range(..=p)
        .next_back()
        .is_some_and(|(&at, &n)| p < at + n as u64)
}

/// Whether a kernel reaches `p`: device memory (allocated, opened by an IPC handle, or mapped
/// in a reservation) or pinned host memory.
fn reachable(p: u64) -> bool {
    let in_map = |m: &Option<HashMap<u64, (i32, usize)>>| {
        m.as_ref()
            .is_some_and(|m| m.iter().any(|(&at, &(_, n))| at <= p && p < at + n as u64))
    };
    pinned(p) || in_map(&ALLOCS.lock()) || ipc_opened(p) || reserved(p, 1)
}

/// The memory a runner launch's connections live in that a kernel cannot reach: each one's
/// header and the first and last byte of its slots (`OxConnD`: header, slots, steps and slot
/// bytes (32 bits each), offset; their count is the low 16 bits of the descriptor's second word).
fn unreachable_conns(params: &[u64]) -> Vec<u64> {
    let n = (params[1] & 0xffff) as usize;
    (0..n)
        .flat_map(|i| {
            let c = &params[2 + 4 * i..6 + 4 * i];
            let slots = (c[2] & 0xffff_ffff) * (c[2] >> 32);
            let mut at = vec![c[0]];
            if c[1] != 0 && slots > 0 {
                at.extend([c[1], c[1] + slots - 1]);
            }
            at
        })
        .filter(|&p| !reachable(p))
        .collect()
}

/// What a kernel would have faulted on (a GPU's illegal address): the launch did not run.
pub static ILLEGAL: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The lanes of a runner launch: each one's (control block, device board) (`OxLaneD::ctl`,
/// `OxLaneD::board`; the counts of the descriptor's parts are the 16-bit fields of its second
/// word).
pub fn lane_comms(params: &[u64]) -> Vec<(u64, u64)> {
    let n = |i: u32| ((params[1] >> (16 * i)) & 0xffff) as usize;
    let lanes = (16 + 32 * n(0) + 80 * n(1) + 56 * n(2)) / 8;
    (0..n(3))
        .map(|l| (params[lanes + 3 * l + 1], params[lanes + 3 * l + 2]))
        .collect()
}

/// A stream: a thread that runs its queue in order.
#[derive(Default)]
struct Stream {
    queue: Mutex<VecDeque<Op>>,
    cv: Condvar,
    submitted: AtomicU64,
    done: Mutex<u64>,
    done_cv: Condvar,
}

/// An event: how many records were asked for, and which of them the streams have reached. A
/// wait is for the record that was the latest when the wait was asked for, that one exactly
/// (a later record, on another stream, finishing first does not end it).
#[derive(Default)]
pub struct Event {
    recorded: AtomicU64,
    reached: Mutex<BTreeSet<u64>>,
    cv: Condvar,
    /// The records asked for on a capturing stream (kept in its graph, not run), with that
    /// stream.
    captured: Mutex<BTreeMap<u64, usize>>,
    /// `cuEventDestroy` was called (a graph's node naming it may not run any more).
    destroyed: std::sync::atomic::AtomicBool,
}

impl Event {
    fn reached(&self, generation: u64) -> bool {
        generation == 0 || self.reached.lock().contains(&generation)
    }
}

/// Holds stream `h` until the gate opens (what a long kernel of the caller's does to the
/// collectives queued behind it).
pub fn gate(h: usize) -> Arc<Event> {
    let event = Arc::new(Event::default());
    submit(
        h,
        Op::Wait {
            event: event.clone(),
            generation: 1,
        },
    );
    event
}

/// Lets the stream held by `gate` go on.
pub fn open_gate(g: &Event) {
    g.reached.lock().insert(1);
    g.cv.notify_all();
}

static STREAMS: Mutex<Option<HashMap<usize, Arc<Stream>>>> = Mutex::new(None);
static EVENTS: Mutex<Option<HashMap<usize, Arc<Event>>>> = Mutex::new(None);

/// Whether streams and events belong to the context they were made in (`peers`: two devices,
/// each its own context), as the driver's do: work goes onto a stream only while its context
/// is current, and an event is recorded only on a stream of its own context; else the call
/// fails (CUDA_ERROR_INVALID_HANDLE) and says why.
pub static OWNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// The context of each stream and event (by handle) made while `OWNED` (by `cuStreamCreate`,
/// `cuEventCreate`, or the test's `own`).
static OWNERS: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// Stream (or event) `h` belongs to context `ctx` (a stream the test made there).
pub fn own(h: usize, ctx: usize) {
    OWNERS.lock().insert(h, ctx);
}

/// The calling thread's current context.
pub fn current_ctx() -> usize {
    let mut c: driver::CUcontext = std::ptr::null_mut();
    if let Ok(api) = driver::api() {
        // SAFETY: writes one pointer.
        unsafe { (api.ctx_get_current)(&mut c) };
    }
    c as usize
}

/// Records that `h`, made now, belongs to the current context (while `OWNED`).
fn made(h: usize) {
    if OWNED.load(Ordering::SeqCst) {
        own(h, current_ctx());
    }
}

/// Whether `call` on stream `s` breaks `OWNED`'s rule (said on stderr): `s` belongs to a
/// context that is not current. (The NULL and per-thread streams are the current context's.)
fn foreign_stream(s: usize, call: &str) -> bool {
    let Some(&owner) = OWNERS.lock().get(&s) else {
        return false;
    };
    let here = current_ctx();
    if owner != here {
        eprintln!(
            "{call} on stream {s:#x} of context {owner:#x} while context {here:#x} is current"
        );
        return true;
    }
    false
}

/// Whether recording event `e` on stream `s` breaks `OWNED`'s rule (said on stderr).
fn foreign_event(e: usize, s: usize) -> bool {
    let o = OWNERS.lock();
    let here = current_ctx();
    let stream_ctx = o.get(&s).copied().unwrap_or(here);
    match o.get(&e) {
        Some(&ctx) if ctx != stream_ctx => {
            eprintln!(
                "cuEventRecord: event {e:#x} of context {ctx:#x} on stream {s:#x} of context \
                 {stream_ctx:#x}"
            );
            true
        }
        _ => false,
    }
}
pub static NEXT: AtomicU64 = AtomicU64::new(0x100);
/// The kernels launched, by name.
/// The next launch on this stream fails (CUDA_ERROR_LAUNCH_FAILED), once.
pub static FAIL_LAUNCH_ON: AtomicU64 = AtomicU64::new(0);
/// Whether a runner launch gave a lane several blocks.
pub static SHARED_LANES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Runner launches whose header asked for device-scope step fences (`OXCCL_CUDA_FENCE=gpu`).
pub static GPU_FENCE_LAUNCHES: AtomicU64 = AtomicU64::new(0);
pub static LAUNCHED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
/// Board lanes launched (a direct all-reduce's part on the device board).
pub static BOARD_LANES: AtomicU64 = AtomicU64::new(0);
/// The blocks per lane of runner launches with a board lane (the low 16 bits of the header).
pub static BOARD_BLOCKS: Mutex<BTreeSet<u64>> = Mutex::new(BTreeSet::new());

/// The stream of handle `h` (any handle the executor is given names one, NULL included),
/// started at its first use.
fn stream(h: usize) -> Arc<Stream> {
    let mut m = STREAMS.lock();
    m.get_or_insert_with(HashMap::new)
        .entry(h)
        .or_insert_with(|| {
            let s = Arc::new(Stream::default());
            let w = s.clone();
            std::thread::Builder::new()
                .name(format!("emu-stream-{h:#x}"))
                .spawn(move || run_stream(&w))
                .unwrap();
            s
        })
        .clone()
}

fn event(h: usize) -> Arc<Event> {
    EVENTS
        .lock()
        .get_or_insert_with(HashMap::new)
        .entry(h)
        .or_default()
        .clone()
}

/// A capturing stream: its graph's capture id, and what the stream captured so far.
type Capturing = (u64, Vec<Op>);
/// Streams capturing a graph.
static CAPTURES: Mutex<Option<HashMap<usize, Capturing>>> = Mutex::new(None);
static CAPTURE_IDS: AtomicU64 = AtomicU64::new(1);

/// Starts capturing stream `h`'s work into a graph of its own (what the caller's
/// `cudaStreamBeginCapture` does): it is kept, not run, until `end_capture`.
pub fn begin_capture(h: usize) {
    begin_capture_together(&[h]);
}

/// Starts capturing the streams `hs` into one graph (as a stream forked from a capturing one
/// by an event joins its capture).
pub fn begin_capture_together(hs: &[usize]) {
    let id = CAPTURE_IDS.fetch_add(1, Ordering::SeqCst);
    let mut c = CAPTURES.lock();
    for &h in hs {
        c.get_or_insert_with(HashMap::new)
            .insert(h, (id, Vec::new()));
    }
}

/// A stream of the caller's that does not capture waited for an event recorded in a capture:
/// CUDA draws such a stream into the graph, which the executor never means to do (its own
/// streams, `cuStreamCreate`'s, it may draw in, if it joins them back before the capture ends:
/// `end_capture`).
pub static DRAWN_IN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Replays the graphs that streams captured together (stream, its graph): each on its stream,
/// the events recorded in them given new records, so that a wait in one waits for this
/// replay's record in another (as the graph's edges do), not for an earlier replay's. Event
/// record nodes record their event anew, the latest record from now on; wait nodes wait for
/// their event's latest record as the replay is issued (before its own record nodes).
pub fn replay(graphs: &[(usize, Vec<Op>)]) {
    let ops: Vec<(usize, &Op)> = graphs.iter().flat_map(|(h, g)| flat(*h, g)).collect();
    let waits: Vec<u64> = ops
        .iter()
        .map(|(_, op)| *op)
        .filter_map(|op| match op {
            Op::WaitNode(e) => Some(e.recorded.load(Ordering::SeqCst)),
            _ => None,
        })
        .collect();
    let mut waits = waits.into_iter();
    let mut fresh: Vec<(Arc<Event>, u64, u64)> = Vec::new();
    for (_, op) in &ops {
        if let Op::Record { event, generation } = op {
            let new = event.recorded.fetch_add(1, Ordering::SeqCst) + 1;
            fresh.push((event.clone(), *generation, new));
        }
    }
    let renamed = |event: &Arc<Event>, generation: u64| {
        fresh
            .iter()
            .find(|(e, g, _)| Arc::ptr_eq(e, event) && *g == generation)
            .map_or(generation, |f| f.2)
    };
    for &(h, op) in &ops {
        {
            let op = match op {
                Op::Keep(_) => continue,
                Op::Fork(_) | Op::Side(..) => unreachable!("flattened"),
                Op::Record { event, generation } => Op::Record {
                    event: event.clone(),
                    generation: renamed(event, *generation),
                },
                Op::Wait { event, generation } => Op::Wait {
                    event: event.clone(),
                    generation: renamed(event, *generation),
                },
                Op::RecordNode(event) | Op::WaitNode(event)
                    if event.destroyed.load(Ordering::SeqCst) =>
                {
                    ILLEGAL
                        .lock()
                        .push("a graph's event node names a destroyed event".into());
                    if matches!(op, Op::WaitNode(_)) {
                        waits.next();
                    }
                    continue;
                }
                Op::RecordNode(event) => Op::Record {
                    event: event.clone(),
                    generation: event.recorded.fetch_add(1, Ordering::SeqCst) + 1,
                },
                Op::WaitNode(event) => Op::Wait {
                    event: event.clone(),
                    generation: waits.next().expect("a wait node's record"),
                },
                op => op.clone(),
            };
            submit(h, op);
        }
    }
}

/// Stream `s`, which does not capture, waits for an event that stream `origin` recorded while
/// capturing: as CUDA does, `s` captures into `origin`'s graph from now on (until the capture
/// ends), its work in the graph where `origin` forked it.
fn draw_in(s: usize, origin: usize) {
    if !CREATED.lock().contains(&s) {
        DRAWN_IN.store(true, Ordering::SeqCst);
    }
    let mut c = CAPTURES.lock();
    let m = c.get_or_insert_with(HashMap::new);
    let Some((id, g)) = m.get_mut(&origin) else {
        // (The origin's capture ended: CUDA's error, a stale record.)
        ILLEGAL.lock().push(format!(
            "stream {s:#x} waited for a record of an ended capture"
        ));
        return;
    };
    g.push(Op::Fork(s));
    let id = *id;
    m.insert(s, (id, Vec::new()));
}

/// The graph stream `h` captured, with the work of the streams drawn into it in place (`Side`).
/// A drawn stream that `h` (or another stream of the capture) did not wait for after its last
/// work sets `DRAWN_IN` (CUDA fails such a capture: cudaErrorStreamCaptureUnjoined).
pub fn end_capture(h: usize) -> Vec<Op> {
    let mut c = CAPTURES.lock();
    let m = c.as_mut().expect("a capturing stream");
    let mut g = m.remove(&h).expect("a capturing stream").1;
    // (Streams drawn in by streams drawn in, too.)
    fn resolve(m: &mut HashMap<usize, Capturing>, g: &mut [Op], waits: &mut Vec<(usize, u64)>) {
        for op in g.iter_mut() {
            match op {
                Op::Wait { event, generation } => {
                    waits.push((Arc::as_ptr(event) as usize, *generation))
                }
                Op::Fork(s) => {
                    let s = *s;
                    let mut side = m.remove(&s).expect("a drawn stream captures").1;
                    resolve(m, &mut side, waits);
                    *op = Op::Side(s, side);
                }
                _ => {}
            }
        }
    }
    let mut waits = Vec::new();
    resolve(m, &mut g, &mut waits);
    fn joined(g: &[Op], waits: &[(usize, u64)]) -> bool {
        g.iter().all(|op| match op {
            Op::Side(_, side) => {
                joined(side, waits)
                    && match side.iter().rfind(|op| !matches!(op, Op::Keep(_))) {
                        Some(Op::Record { event, generation }) => {
                            waits.contains(&(Arc::as_ptr(event) as usize, *generation))
                        }
                        _ => false,
                    }
            }
            _ => true,
        })
    }
    if !joined(&g, &waits) {
        DRAWN_IN.store(true, Ordering::SeqCst);
    }
    g
}

/// A graph's work in order, with the stream each runs on: `h`'s, and where a stream was drawn
/// in, a stream of the replays' own for it (`Side`: in a graph, that work belongs to the graph,
/// not to the stream that captured it, so no eager work there comes between).
fn flat(h: usize, g: &[Op]) -> Vec<(usize, &Op)> {
    let mut v = Vec::new();
    for op in g {
        match op {
            Op::Side(s, side) => v.extend(flat(*s | 1 << 40, side)),
            op => v.push((h, op)),
        }
    }
    v
}

/// Launches run eagerly on streams the executor made (`cuStreamCreate`: its side streams).
pub static SIDE_LAUNCHES: AtomicU64 = AtomicU64::new(0);

pub fn submit(h: usize, op: Op) {
    if let Some((_, g)) = CAPTURES.lock().as_mut().and_then(|m| m.get_mut(&h)) {
        g.push(op);
        return;
    }
    if matches!(op, Op::Launch { .. }) && CREATED.lock().contains(&h) {
        SIDE_LAUNCHES.fetch_add(1, Ordering::SeqCst);
    }
    let s = stream(h);
    s.submitted.fetch_add(1, Ordering::SeqCst);
    s.queue.lock().push_back(op);
    s.cv.notify_all();
}

fn run_stream(s: &Stream) {
    loop {
        let op = {
            let mut q = s.queue.lock();
            loop {
                if let Some(op) = q.pop_front() {
                    break op;
                }
                s.cv.wait(&mut q);
            }
        };
        match op {
            Op::Launch {
                name,
                grid,
                block,
                params,
            } => {
                if name.to_bytes().starts_with(b"oxccl_run") {
                    let lost: Vec<u64> = lane_comms(&params)
                        .into_iter()
                        .map(|(ctl, _)| ctl)
                        .filter(|&c| !pinned(c))
                        .collect();
                    // (A captured launch whose communicators all ended returns at once,
                    // touching no connection: `OX_HEAD_CAPTURED`, the control block's abort
                    // word, its first.)
                    let stopped = params[0] & (1 << 16) != 0
                        && lost.is_empty()
                        && lane_comms(&params).iter().all(|&(ctl, _)| {
                            // SAFETY: a control block, pinned (`lost` is empty).
                            unsafe { std::ptr::read_volatile(ctl as *const u32) != 0 }
                        });
                    let far = if stopped {
                        Vec::new()
                    } else {
                        unreachable_conns(&params)
                    };
                    if !far.is_empty() {
                        ILLEGAL.lock().push(format!(
                            "{name:?} reaches connections in memory that is neither device \
                             memory nor pinned: {far:x?}"
                        ));
                    }
                    if !lost.is_empty() {
                        ILLEGAL.lock().push(format!(
                            "{name:?} reads control blocks that are not pinned: {lost:x?}"
                        ));
                        *s.done.lock() += 1;
                        s.done_cv.notify_all();
                        continue;
                    }
                }
                let emu = EMU.get().expect("emulated kernels");
                // SAFETY: `params` holds the kernel's whole parameter.
                let r = unsafe {
                    (emu.launch)(name.as_ptr(), grid.0, grid.1, block, params.as_ptr().cast())
                };
                assert_eq!(r, 0, "no kernel {name:?}");
            }
            // SAFETY (the three): the executor asked for these on memory it owns.
            Op::Copy { dst, src, bytes } => unsafe {
                std::ptr::copy(src as *const u8, dst as *mut u8, bytes)
            },
            Op::Set8 { dst, v, n } => unsafe { std::ptr::write_bytes(dst as *mut u8, v, n) },
            Op::Set32 { dst, v, n } => {
                for i in 0..n {
                    unsafe { *(dst as *mut u32).add(i) = v };
                }
            }
            Op::Record { event, generation } => {
                event.reached.lock().insert(generation);
                event.cv.notify_all();
            }
            Op::Wait { event, generation } => {
                let mut r = event.reached.lock();
                while generation != 0 && !r.contains(&generation) {
                    event.cv.wait(&mut r);
                }
            }
            Op::RecordNode(_) | Op::WaitNode(_) | Op::Keep(_) | Op::Fork(_) | Op::Side(..) => {
                unreachable!("a graph's node run as it is")
            }
        }
        *s.done.lock() += 1;
        s.done_cv.notify_all();
    }
}

/// How long a free waits for the work queued before it (`synchronize_device`).
const FREE_WAITS: Duration = Duration::from_secs(20);

/// Held (exclusively) while a free waits for the device (`synchronize_device`): other threads'
/// launches wait for it, as the driver's lock makes them.
static FREEING: parking_lot::RwLock<()> = parking_lot::RwLock::new(());

/// What a free of device or pinned memory does first, as the driver's does: it waits until
/// every stream has run the work queued before it (a kernel of a collective included, which
/// waits for its peers' launches), and other threads' launches wait meanwhile (`FREEING`).
/// Where that takes longer than `FREE_WAITS` (it waits for a launch that the freeing thread,
/// or one it blocks, was to make), the free would wait for good on a GPU: said in `ILLEGAL`,
/// and the free goes on so that the test ends.
fn synchronize_device(what: &str) {
    let _launches_wait = FREEING.write();
    let queued: Vec<(usize, Arc<Stream>, u64)> = STREAMS
        .lock()
        .iter()
        .flatten()
        .map(|(&h, s)| (h, s.clone(), s.submitted.load(Ordering::SeqCst)))
        .collect();
    let until = Instant::now() + FREE_WAITS;
    for (h, s, n) in queued {
        let mut d = s.done.lock();
        while *d < n {
            if s.done_cv.wait_until(&mut d, until).timed_out() {
                ILLEGAL.lock().push(format!(
                    "{what} waited {FREE_WAITS:?} for the work queued on stream {h:#x} before \
                     it (on a GPU: for good)"
                ));
                return;
            }
        }
    }
}

/// Waits until stream `h` has run everything it was given, at most `limit`.
pub fn sync(h: usize, limit: Duration) -> bool {
    let s = stream(h);
    let until = Instant::now() + limit;
    let mut d = s.done.lock();
    while *d < s.submitted.load(Ordering::SeqCst) {
        if s.done_cv.wait_until(&mut d, until).timed_out() {
            return false;
        }
    }
    true
}

// ---- the stand-in driver (C signatures of the driver table) ---------------------------------

unsafe extern "C" fn attr(v: *mut c_int, a: c_int, _: c_int) -> CUresult {
    // sm_90, 132 SMs, virtual memory management with POSIX file descriptors (ncclMemAlloc
    // takes cuMemCreate), no GPUDirect RDMA.
    unsafe {
        *v = match a {
            75 => 9,
            // OXEMU_RESIDENT: as many SMs as blocks run at once (one a SM, as the runner's do).
            16 => std::env::var("OXEMU_RESIDENT")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(132),
            102 | 103 => 1,
            _ => 0,
        }
    };
    OK
}
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn launch(
    f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    _shm: c_uint,
    s: *mut c_void,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    assert_eq!(
        (gz, by, bz),
        (1, 1, 1),
        "grids and blocks of one or two dimensions"
    );
    if foreign_stream(s as usize, "cuLaunchKernel") {
        return INVALID_HANDLE;
    }
    // (Not while another thread's free waits for the device.)
    let _no_free = FREEING.read();
    if s as u64 != 0 && FAIL_LAUNCH_ON.load(Ordering::SeqCst) == s as u64 {
        FAIL_LAUNCH_ON.store(0, Ordering::SeqCst);
        return 719; // CUDA_ERROR_LAUNCH_FAILED
    }
    let Some(name) = stand_in::kernel_name(f as usize) else {
        return 400; // CUDA_ERROR_INVALID_HANDLE
    };
    let emu = EMU.get().expect("emulated kernels");
    // SAFETY: a name runner.cu has.
    let bytes = unsafe { (emu.param_bytes)(name.as_ptr()) };
    assert!(bytes > 0, "{name:?}");
    // The parameter is copied at the launch, as the driver does.
    let mut words = vec![0u64; bytes / 8];
    // SAFETY: the kernel's one parameter, `bytes` long.
    unsafe {
        std::ptr::copy_nonoverlapping(*params as *const u8, words.as_mut_ptr().cast(), bytes)
    };
    LAUNCHED.lock().insert(name.to_str().unwrap().to_string());
    // The runner with several blocks per lane (its header's lane count is the top 16 bits of
    // its second word).
    if name.to_bytes().starts_with(b"oxccl_run") && u64::from(gx) > words[1] >> 48 {
        SHARED_LANES.store(true, Ordering::SeqCst);
    }
    if name.to_bytes().starts_with(b"oxccl_run") {
        let boards = lane_comms(&words).iter().filter(|l| l.1 != 0).count();
        BOARD_LANES.fetch_add(boards as u64, Ordering::SeqCst);
        if boards > 0 {
            BOARD_BLOCKS.lock().insert(words[0] & 0xffff);
        }
    }
    // The runner asked for device-scope step fences (the header's OX_HEAD_GPU_FENCES).
    if name.to_bytes().starts_with(b"oxccl_run") && words[0] & (1 << 17) != 0 {
        GPU_FENCE_LAUNCHES.fetch_add(1, Ordering::SeqCst);
    }
    submit(
        s as usize,
        Op::Launch {
            name,
            grid: (gx, gy),
            block: bx,
            params: words,
        },
    );
    OK
}
unsafe extern "C" fn free(p: u64) -> CUresult {
    if !unsafe_call_allowed() {
        return CAPTURE_UNSUPPORTED;
    }
    synchronize_device("cuMemFree");
    let Some((fd, len)) = ALLOCS.lock().as_mut().and_then(|m| m.remove(&p)) else {
        return INVALID_VALUE;
    };
    // SAFETY: mapped and opened by mem_alloc, given back once.
    unsafe {
        nix::libc::munmap(p as *mut c_void, len);
        nix::libc::close(fd);
    }
    OK
}
unsafe extern "C" fn dtod_async(dst: u64, src: u64, bytes: usize, s: *mut c_void) -> CUresult {
    if foreign_stream(s as usize, "cuMemcpyDtoDAsync") {
        return INVALID_HANDLE;
    }
    submit(s as usize, Op::Copy { dst, src, bytes });
    OK
}
unsafe extern "C" fn memset_async(dst: u64, v: u8, n: usize, s: *mut c_void) -> CUresult {
    if foreign_stream(s as usize, "cuMemsetD8Async") {
        return INVALID_HANDLE;
    }
    submit(s as usize, Op::Set8 { dst, v, n });
    OK
}
unsafe extern "C" fn memset32_async(dst: u64, v: c_uint, n: usize, s: *mut c_void) -> CUresult {
    if foreign_stream(s as usize, "cuMemsetD32Async") {
        return INVALID_HANDLE;
    }
    submit(s as usize, Op::Set32 { dst, v, n });
    OK
}
/// The streams `cuStreamCreate` made (the executor's own).
static CREATED: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

/// The streams the executor made (`cuStreamCreate`: its side streams).
pub fn created() -> Vec<usize> {
    CREATED.lock().iter().copied().collect()
}

unsafe extern "C" fn stream_create(s: *mut *mut c_void, _: c_uint) -> CUresult {
    let h = NEXT.fetch_add(1, Ordering::SeqCst) as usize;
    stream(h);
    CREATED.lock().insert(h);
    made(h);
    unsafe { *s = h as *mut c_void };
    OK
}
unsafe extern "C" fn stream_destroy(_: *mut c_void) -> CUresult {
    OK
}
/// What the driver answers to what a capturing stream may not do
/// (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; the capture is spoiled as well).
const CAPTURE_UNSUPPORTED: CUresult = 900;

/// The capture stream `s` takes part in, if any.
fn capture_id(s: usize) -> Option<u64> {
    CAPTURES.lock().as_ref()?.get(&s).map(|c| c.0)
}

fn capturing(s: usize) -> bool {
    CAPTURES.lock().as_ref().is_some_and(|m| m.contains_key(&s))
}

fn any_capture() -> bool {
    CAPTURES.lock().as_ref().is_some_and(|m| !m.is_empty())
}

thread_local! {
    /// The thread's capture mode (cuThreadExchangeStreamCaptureMode): 0 global (CUDA's
    /// default), 1 thread local, 2 relaxed.
    static MODE: std::cell::Cell<c_int> = const { std::cell::Cell::new(0) };
}
/// This thread's capture mode.
pub fn capture_mode() -> c_int {
    MODE.with(|x| x.get())
}
unsafe extern "C" fn exchange_mode(m: *mut c_int) -> CUresult {
    let old = MODE.with(|x| x.replace(unsafe { *m }));
    unsafe { *m = old };
    OK
}
/// Whether this thread may make a call that is unsafe while some stream captures (an
/// allocation, say): only in relaxed mode, or while none does.
fn unsafe_call_allowed() -> bool {
    MODE.with(|x| x.get()) == 2 || !any_capture()
}

unsafe extern "C" fn stream_sync(s: *mut c_void) -> CUresult {
    if capturing(s as usize) {
        return CAPTURE_UNSUPPORTED;
    }
    assert!(
        sync(s as usize, Duration::from_secs(120)),
        "stream {s:?} stuck"
    );
    OK
}
unsafe extern "C" fn stream_query(s: *mut c_void) -> CUresult {
    if capturing(s as usize) {
        return CAPTURE_UNSUPPORTED;
    }
    let st = stream(s as usize);
    if *st.done.lock() < st.submitted.load(Ordering::SeqCst) {
        NOT_READY
    } else {
        OK
    }
}
unsafe extern "C" fn is_capturing(s: *mut c_void, st: *mut c_int) -> CUresult {
    unsafe { *st = c_int::from(capturing(s as usize)) };
    OK
}
/// `cuStreamGetCaptureInfo_v2`: the status and the graph's capture id (the later outputs
/// NULL).
unsafe extern "C" fn capture_info(
    s: *mut c_void,
    st: *mut c_int,
    id: *mut u64,
    graph: *mut c_void,
    deps: *mut c_void,
    ndeps: *mut c_void,
) -> CUresult {
    let captures = CAPTURES
        .lock()
        .as_ref()
        .and_then(|m| m.get(&(s as usize)).map(|g| g.0));
    unsafe { stand_in::capture_info_of(st, id, [graph, deps, ndeps], captures) }
}
unsafe extern "C" fn user_object_create(
    obj: *mut *mut c_void,
    ptr: *mut c_void,
    destroy: driver::CUhostFn,
    refs: c_uint,
    flags: c_uint,
) -> CUresult {
    assert_eq!((refs, flags), (1, 1), "one reference, no destructor sync");
    let o = Arc::new(UserObject {
        ptr: ptr as usize,
        destroy,
    });
    unsafe { *obj = Arc::into_raw(o) as *mut c_void };
    OK
}
/// `cuGraphRetainUserObject`: the graph (its handle is its capture id) holds the object, in
/// the work of one of the streams capturing it.
unsafe extern "C" fn graph_retain(
    graph: *mut c_void,
    obj: *mut c_void,
    refs: c_uint,
    flags: c_uint,
) -> CUresult {
    assert_eq!((refs, flags), (1, 1), "the caller's one reference, moved");
    let mut c = CAPTURES.lock();
    // (In the work of a stream of the caller's, not of one drawn in.)
    let created = CREATED.lock();
    let Some((_, g)) = c.as_mut().and_then(|m| {
        m.iter_mut()
            .filter(|(_, (id, _))| *id == graph as u64)
            .min_by_key(|(h, _)| created.contains(h))
            .map(|(_, g)| g)
    }) else {
        return INVALID_VALUE;
    };
    // SAFETY: made by user_object_create; the caller's reference moves to the graph.
    g.push(Op::Keep(unsafe { Arc::from_raw(obj as *const UserObject) }));
    OK
}
unsafe extern "C" fn user_object_release(obj: *mut c_void, refs: c_uint) -> CUresult {
    assert_eq!(refs, 1);
    // SAFETY: made by user_object_create; the caller's reference.
    drop(unsafe { Arc::from_raw(obj as *const UserObject) });
    OK
}
unsafe extern "C" fn host_register(p: *mut c_void, n: usize, _: c_uint) -> CUresult {
    if !unsafe_call_allowed() {
        return CAPTURE_UNSUPPORTED;
    }
    if PINNED.lock().insert(p as u64, n).is_none() {
        OK
    } else {
        712 // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    }
}
unsafe extern "C" fn host_unregister(p: *mut c_void) -> CUresult {
    if !unsafe_call_allowed() {
        return CAPTURE_UNSUPPORTED;
    }
    synchronize_device("cuMemHostUnregister");
    if PINNED.lock().remove(&(p as u64)).is_some() {
        OK
    } else {
        INVALID_VALUE
    }
}
unsafe extern "C" fn wait_event(s: *mut c_void, e: *mut c_void, flags: c_uint) -> CUresult {
    let event = event(e as usize);
    if flags == 1 {
        // An event wait node: only while capturing.
        if !capturing(s as usize) {
            return 1; // CUDA_ERROR_INVALID_VALUE
        }
        submit(s as usize, Op::WaitNode(event));
        return OK;
    }
    let generation = event.recorded.load(Ordering::SeqCst);
    // As CUDA's stream capture: a capturing stream waits only for records of its own capture
    // (else CUDA_ERROR_STREAM_CAPTURE_ISOLATION, or for another capture's,
    // CUDA_ERROR_STREAM_CAPTURE_MERGE: two captures would become one); one that does not
    // capture is drawn into it.
    let origin = event.captured.lock().get(&generation).copied();
    match (capture_id(s as usize), origin) {
        (Some(_), None) if generation != 0 => return 905,
        (Some(id), Some(o)) if capture_id(o) != Some(id) => return 902,
        (None, Some(o)) => draw_in(s as usize, o),
        _ => {}
    }
    submit(s as usize, Op::Wait { event, generation });
    OK
}
unsafe extern "C" fn event_create(e: *mut *mut c_void, _: c_uint) -> CUresult {
    let h = NEXT.fetch_add(1, Ordering::SeqCst) as usize;
    event(h);
    made(h);
    unsafe { *e = h as *mut c_void };
    OK
}
unsafe extern "C" fn event_record_flags(e: *mut c_void, s: *mut c_void, flags: c_uint) -> CUresult {
    if flags != 1 {
        return unsafe { event_record(e, s) };
    }
    if foreign_event(e as usize, s as usize) {
        return INVALID_HANDLE;
    }
    // An event record node: only while capturing; it records at each replay, not now.
    if !capturing(s as usize) {
        return 1; // CUDA_ERROR_INVALID_VALUE
    }
    submit(s as usize, Op::RecordNode(event(e as usize)));
    OK
}
/// The next event record on a stream the executor made (a side stream) fails
/// (CUDA_ERROR_UNKNOWN), once.
pub static FAIL_SIDE_RECORD: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

unsafe extern "C" fn event_record(e: *mut c_void, s: *mut c_void) -> CUresult {
    if foreign_event(e as usize, s as usize) {
        return INVALID_HANDLE;
    }
    if CREATED.lock().contains(&(s as usize)) && FAIL_SIDE_RECORD.swap(false, Ordering::SeqCst) {
        return 999;
    }
    let event = event(e as usize);
    let generation = event.recorded.fetch_add(1, Ordering::SeqCst) + 1;
    if capturing(s as usize) {
        event.captured.lock().insert(generation, s as usize);
    }
    submit(s as usize, Op::Record { event, generation });
    OK
}
unsafe extern "C" fn event_query(e: *mut c_void) -> CUresult {
    // As CUDA: not while some stream captures in global mode, unless this thread is relaxed.
    if !unsafe_call_allowed() {
        return CAPTURE_UNSUPPORTED;
    }
    // A proxy thread runs beside the caller's captures at any moment, so it must be relaxed
    // whenever it queries (else a query during a capture would spoil it): checked at every
    // query, not only when a capture happens to overlap one.
    let proxy = std::thread::current()
        .name()
        .is_some_and(|n| n.starts_with("oxccl-proxy"));
    if proxy && MODE.with(|x| x.get()) != 2 {
        eprintln!("cuEventQuery from a proxy thread outside relaxed capture mode");
        std::process::abort();
    }
    let ev = event(e as usize);
    if !ev.reached(ev.recorded.load(Ordering::SeqCst)) {
        NOT_READY
    } else {
        OK
    }
}
unsafe extern "C" fn event_destroy(e: *mut c_void) -> CUresult {
    let gone = EVENTS.lock().as_mut().and_then(|m| m.remove(&(e as usize)));
    match gone {
        Some(ev) => {
            ev.destroyed.store(true, Ordering::SeqCst);
            OK
        }
        None => 400, // CUDA_ERROR_INVALID_HANDLE
    }
}
unsafe extern "C" fn pointer_attr(v: *mut c_void, a: c_int, p: u64) -> CUresult {
    // The allocation (cuMemAlloc) that holds `p`: its base and size, and whether it has a
    // legacy IPC handle.
    let alloc = || {
        ALLOCS.lock().as_ref().and_then(|m| {
            m.iter()
                .find(|(&at, &(_, n))| at <= p && p < at + n as u64)
                .map(|(&at, &(_, n))| (at, n as u64))
        })
    };
    match a {
        // SAFETY: the attributes' types: a device pointer, a size_t, an int.
        11 | 12 => match alloc() {
            Some((at, n)) => unsafe { *(v as *mut u64) = if a == 11 { at } else { n } },
            None => return 1,
        },
        10 => unsafe { *(v as *mut c_uint) = c_uint::from(alloc().is_some()) },
        // Device memory (2) of device 0, not managed.
        _ => unsafe { *(v as *mut c_uint) = if a == 9 || a == 8 { 0 } else { 2 } },
    }
    OK
}
stand_in::pointer_attrs_over!(stand_in, pointer_attr);
/// Device memory (`cuMemAlloc`): a memory file of its own, mapped shared, so that another
/// process can open it by an IPC handle (its process, file descriptor and size).
static ALLOCS: Mutex<Option<HashMap<u64, (i32, usize)>>> = Mutex::new(None);
/// How many allocations of device memory (`cuMemAlloc`) are live.
pub fn live_allocs() -> usize {
    ALLOCS.lock().as_ref().map_or(0, |m| m.len())
}
/// IPC handles opened in this process.
pub static IPC_OPENED: AtomicU64 = AtomicU64::new(0);
const IPC_MARK: &[u8; 8] = b"oxemuipc";

/// The next cuMemAlloc fails (CUDA_ERROR_OUT_OF_MEMORY), once.
pub static FAIL_ALLOC: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub unsafe extern "C" fn mem_alloc(p: *mut u64, n: usize) -> CUresult {
    use nix::libc;
    if !unsafe_call_allowed() {
        return CAPTURE_UNSUPPORTED;
    }
    if FAIL_ALLOC.swap(false, Ordering::SeqCst) {
        return 2; // CUDA_ERROR_OUT_OF_MEMORY
    }
    let len = n.max(1);
    // SAFETY: a fresh memory file, sized and mapped here; kept open for IPC.
    unsafe {
        let fd = libc::memfd_create(c"oxccl-emu".as_ptr(), 0);
        assert!(fd >= 0 && libc::ftruncate(fd, len as i64) == 0, "memfd");
        let at = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        assert_ne!(at, libc::MAP_FAILED, "mmap");
        *p = at as u64;
        ALLOCS
            .lock()
            .get_or_insert_with(HashMap::new)
            .insert(at as u64, (fd, len));
    }
    OK
}
unsafe extern "C" fn ipc_get(h: *mut driver::CUipcMemHandle, p: u64) -> CUresult {
    let Some((fd, len)) = ALLOCS.lock().as_ref().and_then(|m| m.get(&p).copied()) else {
        return 1; // CUDA_ERROR_INVALID_VALUE: not the base of an allocation
    };
    let mut r = [0u8; 64];
    r[..8].copy_from_slice(IPC_MARK);
    r[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    r[12..16].copy_from_slice(&fd.to_le_bytes());
    r[16..24].copy_from_slice(&(len as u64).to_le_bytes());
    unsafe { (*h).reserved = r };
    OK
}
unsafe extern "C" fn ipc_open(p: *mut u64, h: driver::CUipcMemHandle, flags: c_uint) -> CUresult {
    use nix::libc;
    let r = h.reserved;
    if &r[..8] != IPC_MARK || flags != 1 {
        return 1; // CUDA_ERROR_INVALID_VALUE
    }
    let pid = u32::from_le_bytes(r[8..12].try_into().unwrap());
    let fd = i32::from_le_bytes(r[12..16].try_into().unwrap());
    let len = u64::from_le_bytes(r[16..24].try_into().unwrap()) as usize;
    if pid == std::process::id() {
        return 1; // the driver refuses handles of the calling process
    }
    let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")).unwrap();
    // SAFETY: the other process's memory file, mapped shared; unmapped by ipc_close.
    unsafe {
        let f = libc::open(path.as_ptr(), libc::O_RDWR);
        if f < 0 {
            return 1;
        }
        let at = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f,
            0,
        );
        libc::close(f);
        if at == libc::MAP_FAILED {
            return 2; // CUDA_ERROR_OUT_OF_MEMORY
        }
        *p = at as u64;
        OPENED
            .lock()
            .get_or_insert_with(HashMap::new)
            .insert(at as u64, len);
    }
    IPC_OPENED.fetch_add(1, Ordering::SeqCst);
    OK
}
static OPENED: Mutex<Option<HashMap<u64, usize>>> = Mutex::new(None);

/// Whether `addr` is in device memory of another process, opened by its IPC handle.
pub fn ipc_opened(addr: u64) -> bool {
    OPENED
        .lock()
        .as_ref()
        .is_some_and(|m| m.iter().any(|(&p, &n)| p <= addr && addr < p + n as u64))
}
unsafe extern "C" fn ipc_close(p: u64) -> CUresult {
    let Some(len) = OPENED.lock().as_mut().and_then(|m| m.remove(&p)) else {
        return 1;
    };
    // SAFETY: mapped by ipc_open, unmapped once.
    unsafe { nix::libc::munmap(p as *mut c_void, len) };
    OK
}
// ---- virtual memory management (ncclMemAlloc), on real mappings ----------------------------
//
// Physical memory is a memory file; an address range is reserved without access; cuMemMap maps
// the file there still without access, and only cuMemSetAccess makes it readable and writable,
// so that a step left out faults as it would on a GPU. Sizes and addresses must be multiples of
// the granularity, and a mapping must fit its handle and its reservation.

const INVALID_VALUE: CUresult = 1;
const INVALID_HANDLE: CUresult = 400;
/// Handles (cuMemCreate): the memory file and its size.
static HANDLES: Mutex<Option<HashMap<u64, (i32, usize)>>> = Mutex::new(None);
/// Reservations: start and size.
static RESERVED: Mutex<Vec<(u64, usize)>> = Mutex::new(Vec::new());
/// cuMemMap calls that succeeded.
pub static MAPPED: AtomicU64 = AtomicU64::new(0);

fn reserved(p: u64, size: usize) -> bool {
    RESERVED
        .lock()
        .iter()
        .any(|&(at, n)| at <= p && p + size as u64 <= at + n as u64)
}

unsafe extern "C" fn mem_create(
    h: *mut u64,
    size: usize,
    prop: *const driver::CUmemAllocationProp,
    _: u64,
) -> CUresult {
    use nix::libc;
    let p = unsafe { *prop };
    if size == 0 || !size.is_multiple_of(GRANULARITY) || p.kind != 1 || p.location.kind != 1 {
        return INVALID_VALUE;
    }
    // SAFETY: a fresh memory file of `size` bytes.
    let fd = unsafe { libc::memfd_create(c"oxccl-emu-vmm".as_ptr(), 0) };
    assert!(
        fd >= 0 && unsafe { libc::ftruncate(fd, size as i64) } == 0,
        "memfd"
    );
    // SAFETY: the caller's handle pointer.
    unsafe { new_handle(h, fd, size) }
}
/// Makes a handle of memory file `fd` (`size` bytes), written to `h`.
///
/// # Safety
/// `h` is writable.
unsafe fn new_handle(h: *mut u64, fd: c_int, size: usize) -> CUresult {
    let handle = 0x7000_0000 + fd as u64;
    HANDLES
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(handle, (fd, size));
    unsafe { *h = handle };
    OK
}
unsafe extern "C" fn mem_release(h: u64) -> CUresult {
    match HANDLES.lock().as_mut().and_then(|m| m.remove(&h)) {
        // SAFETY: the handle's file, closed once (a mapping keeps the memory).
        Some((fd, _)) => unsafe { nix::libc::close(fd) },
        None => return INVALID_VALUE,
    };
    OK
}
unsafe extern "C" fn mem_export(out: *mut c_void, h: u64, kind: c_uint, _: u64) -> CUresult {
    let Some((fd, _)) = HANDLES.lock().as_ref().and_then(|m| m.get(&h).copied()) else {
        return INVALID_VALUE;
    };
    if kind != 1 {
        return INVALID_VALUE; // a POSIX file descriptor only
    }
    // SAFETY: a new descriptor of the handle's file, the caller's to close.
    unsafe { *(out as *mut c_int) = nix::libc::dup(fd) };
    OK
}
unsafe extern "C" fn mem_import(h: *mut u64, fd: *mut c_void, kind: c_uint) -> CUresult {
    use nix::libc;
    if kind != 1 {
        return INVALID_VALUE;
    }
    // SAFETY: the caller's descriptor, duplicated (the handle's own, closed by cuMemRelease),
    // its size read.
    let (fd, size) = unsafe {
        let fd = libc::dup(fd as isize as c_int);
        let mut st: libc::stat = std::mem::zeroed();
        if fd < 0 || libc::fstat(fd, &mut st) != 0 {
            return INVALID_VALUE;
        }
        (fd, st.st_size as usize)
    };
    // SAFETY: the caller's handle pointer.
    unsafe { new_handle(h, fd, size) }
}
unsafe extern "C" fn address_reserve(
    p: *mut u64,
    size: usize,
    align: usize,
    _: u64,
    _: u64,
) -> CUresult {
    use nix::libc;
    let align = align.max(GRANULARITY);
    if size == 0 || !size.is_multiple_of(GRANULARITY) || !align.is_power_of_two() {
        return INVALID_VALUE;
    }
    // SAFETY: an address range without access, aligned inside a larger one (the slack at its
    // ends stays reserved until the process ends).
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size + align,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(at, libc::MAP_FAILED, "reserve");
    let at = (at as u64).next_multiple_of(align as u64);
    RESERVED.lock().push((at, size));
    unsafe { *p = at };
    OK
}
unsafe extern "C" fn address_free(p: u64, size: usize) -> CUresult {
    let mut r = RESERVED.lock();
    let Some(i) = r.iter().position(|&(at, n)| at == p && n == size) else {
        return INVALID_VALUE;
    };
    r.remove(i);
    // SAFETY: the reservation's range, no longer handed out.
    unsafe { nix::libc::munmap(p as *mut c_void, size) };
    OK
}
unsafe extern "C" fn mem_map(p: u64, size: usize, off: usize, h: u64, _: u64) -> CUresult {
    use nix::libc;
    let Some((fd, n)) = HANDLES.lock().as_ref().and_then(|m| m.get(&h).copied()) else {
        return INVALID_VALUE;
    };
    if off != 0 || size != n || !p.is_multiple_of(GRANULARITY as u64) || !reserved(p, size) {
        return INVALID_VALUE;
    }
    // SAFETY: inside a reservation of ours; no access until cuMemSetAccess.
    unsafe { map_fixed(p, size, libc::MAP_SHARED, fd) };
    MAPPED.fetch_add(1, Ordering::SeqCst);
    OK
}

/// Maps `fd` (or, with -1, nothing) at `p` without access, replacing what was there.
///
/// # Safety
/// `p..p + size` is a reservation of ours that nothing else uses.
unsafe fn map_fixed(p: u64, size: usize, flags: c_int, fd: c_int) {
    use nix::libc;
    let at = unsafe {
        libc::mmap(
            p as *mut c_void,
            size,
            libc::PROT_NONE,
            flags | libc::MAP_FIXED,
            fd,
            0,
        )
    };
    assert_eq!(at as u64, p, "mmap at a reservation");
}
unsafe extern "C" fn mem_unmap(p: u64, size: usize) -> CUresult {
    use nix::libc;
    if !reserved(p, size) {
        return INVALID_VALUE;
    }
    // SAFETY: back to a reservation without access.
    unsafe {
        map_fixed(
            p,
            size,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
        )
    };
    OK
}
unsafe extern "C" fn set_access(
    p: u64,
    size: usize,
    d: *const driver::CUmemAccessDesc,
    n: usize,
) -> CUresult {
    let descs = unsafe { std::slice::from_raw_parts(d, n) };
    let ok = n >= 1
        && descs.iter().all(|d| d.location.kind == 1 && d.flags == 3)
        && descs[0].location.id == 0
        && reserved(p, size);
    if !ok {
        return INVALID_VALUE;
    }
    // SAFETY: mapped by mem_map (mprotect fails on what is not, and the test then fails).
    let r = unsafe {
        nix::libc::mprotect(
            p as *mut c_void,
            size,
            nix::libc::PROT_READ | nix::libc::PROT_WRITE,
        )
    };
    assert_eq!(r, 0, "set access");
    OK
}

pub fn stand_in() -> Api {
    stand_in_with(&[])
}

/// `stand_in` with `extra` in place of its functions for the symbols `extra` names.
pub fn stand_in_with(extra: &[(&str, *const c_void)]) -> Api {
    let mut own: Vec<(&str, *const c_void)> = extra.to_vec();
    own.extend([
        ("cuDeviceGetAttribute", attr as *const c_void),
        ("cuLaunchKernel", launch as *const c_void),
        ("cuMemFree_v2", free as *const c_void),
        ("cuMemcpyDtoDAsync_v2", dtod_async as *const c_void),
        ("cuMemsetD8Async", memset_async as *const c_void),
        ("cuMemsetD32Async", memset32_async as *const c_void),
        ("cuStreamCreate", stream_create as *const c_void),
        ("cuStreamDestroy_v2", stream_destroy as *const c_void),
        ("cuStreamSynchronize", stream_sync as *const c_void),
        ("cuStreamQuery", stream_query as *const c_void),
        ("cuStreamIsCapturing", is_capturing as *const c_void),
        ("cuStreamGetCaptureInfo_v2", capture_info as *const c_void),
        ("cuStreamWaitEvent", wait_event as *const c_void),
        ("cuEventCreate", event_create as *const c_void),
        ("cuEventRecord", event_record as *const c_void),
        (
            "cuEventRecordWithFlags",
            event_record_flags as *const c_void,
        ),
        ("cuEventQuery", event_query as *const c_void),
        ("cuEventDestroy_v2", event_destroy as *const c_void),
        ("cuPointerGetAttributes", pointer_attrs as *const c_void),
        ("cuMemAlloc_v2", mem_alloc as *const c_void),
        (
            "cuThreadExchangeStreamCaptureMode",
            exchange_mode as *const c_void,
        ),
        ("cuIpcGetMemHandle", ipc_get as *const c_void),
        ("cuIpcOpenMemHandle_v2", ipc_open as *const c_void),
        ("cuIpcCloseMemHandle", ipc_close as *const c_void),
        (
            "cuMemGetAllocationGranularity",
            granularity as *const c_void,
        ),
        ("cuMemCreate", mem_create as *const c_void),
        ("cuMemRelease", mem_release as *const c_void),
        ("cuMemExportToShareableHandle", mem_export as *const c_void),
        (
            "cuMemImportFromShareableHandle",
            mem_import as *const c_void,
        ),
        ("cuMemAddressReserve", address_reserve as *const c_void),
        ("cuMemAddressFree", address_free as *const c_void),
        ("cuMemMap", mem_map as *const c_void),
        ("cuMemUnmap", mem_unmap as *const c_void),
        ("cuMemSetAccess", set_access as *const c_void),
        ("cuUserObjectCreate", user_object_create as *const c_void),
        ("cuGraphRetainUserObject", graph_retain as *const c_void),
        ("cuUserObjectRelease", user_object_release as *const c_void),
        ("cuMemHostRegister_v2", host_register as *const c_void),
        ("cuMemHostUnregister", host_unregister as *const c_void),
    ]);
    // SAFETY: each function above has the signature the driver table lists for its symbol
    // (the caller's for `extra`).
    unsafe { stand_in::driver(&own) }
}
