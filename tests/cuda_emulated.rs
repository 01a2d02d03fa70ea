//! The CUDA executor end to end without a GPU: its launches run the kernels of `cuda/runner.cu`,
//! compiled for the host (`tests/cuda_emu/emu.cpp`), on a stand-in driver whose streams are
//! threads that run their work in order (kernels, copies, sets, event records and waits) and
//! whose "device memory" is host memory. Every collective over 1, 2 and 4 ranks of one device,
//! several datatypes and operators, in and out of place, ranks on their own streams and on one,
//! checked element by element against values computed here.
//!
//! What this shows: the executor's plans, descriptors, launches and stream order, and the
//! kernels' logic over connections (slots, counters, slices, several blocks per lane), together.
//! What it cannot show: the GPU's memory model, occupancy or speed; that is the GPU check's
//! (`scripts/gpu-check.sh`).
//!
//! One process, one test function: the driver and the executor are chosen once per process.

#[path = "cuda_stand_in/mod.rs"]
mod stand_in;

use nccl::gpu::driver::{self, Api, CUresult};
use nccl::types::{CollArgs, CollKind, DataType};
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use stand_in::OK;
const NOT_READY: CUresult = 600;

// ---- the host-compiled kernels -------------------------------------------------------------

type LaunchFn = unsafe extern "C" fn(*const c_char, c_uint, c_uint, c_uint, *const c_void) -> c_int;
type ParamBytesFn = unsafe extern "C" fn(*const c_char) -> usize;

struct Emu {
    launch: LaunchFn,
    param_bytes: ParamBytesFn,
    _lib: libloading::Library,
}
static EMU: OnceLock<Emu> = OnceLock::new();

/// Compiles `tests/cuda_emu/emu.cpp` (which includes `cuda/runner.cu`) into a shared library
/// and loads it; None (after saying why) when there is no g++.
fn load_emu() -> Option<Emu> {
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
    // SAFETY: the library has no initialisers beyond C++ statics; the symbols have the
    // signatures emu.cpp gives them.
    unsafe {
        let lib = libloading::Library::new(&so).expect("load the emulated kernels");
        let launch = *lib.get::<LaunchFn>(b"oxemu_launch\0").unwrap();
        let param_bytes = *lib.get::<ParamBytesFn>(b"oxemu_param_bytes\0").unwrap();
        let _ = std::fs::remove_file(&so);
        Some(Emu {
            launch,
            param_bytes,
            _lib: lib,
        })
    }
}

// ---- streams and events ----------------------------------------------------------------------

#[derive(Clone)]
enum Op {
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

/// An event: how many records were asked for, and how many of them the streams have reached.
#[derive(Default)]
struct Event {
    recorded: AtomicU64,
    reached: Mutex<u64>,
    cv: Condvar,
}

static STREAMS: Mutex<Option<HashMap<usize, Arc<Stream>>>> = Mutex::new(None);
static EVENTS: Mutex<Option<HashMap<usize, Arc<Event>>>> = Mutex::new(None);
static NEXT: AtomicU64 = AtomicU64::new(0x100);
/// The kernels launched, by name.
static LAUNCHED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

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

/// Streams capturing a graph, and what they captured so far.
static CAPTURES: Mutex<Option<HashMap<usize, Vec<Op>>>> = Mutex::new(None);

/// Starts capturing stream `h`'s work into a graph (what the caller's
/// `cudaStreamBeginCapture` does): it is kept, not run, until `end_capture`.
fn begin_capture(h: usize) {
    CAPTURES
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(h, Vec::new());
}

/// The graph stream `h` captured.
fn end_capture(h: usize) -> Vec<Op> {
    CAPTURES
        .lock()
        .as_mut()
        .and_then(|m| m.remove(&h))
        .expect("a capturing stream")
}

fn submit(h: usize, op: Op) {
    if let Some(g) = CAPTURES.lock().as_mut().and_then(|m| m.get_mut(&h)) {
        g.push(op);
        return;
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
                let mut r = event.reached.lock();
                *r = (*r).max(generation);
                event.cv.notify_all();
            }
            Op::Wait { event, generation } => {
                let mut r = event.reached.lock();
                while *r < generation {
                    event.cv.wait(&mut r);
                }
            }
        }
        *s.done.lock() += 1;
        s.done_cv.notify_all();
    }
}

/// Waits until stream `h` has run everything it was given, at most `limit`.
fn sync(h: usize, limit: Duration) -> bool {
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
    // sm_90, 132 SMs, no virtual memory management (ncclMemAlloc takes cuMemAlloc).
    unsafe {
        *v = match a {
            75 => 9,
            16 => 132,
            _ => 0,
        }
    };
    OK
}
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn launch(
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
unsafe extern "C" fn free(_: u64) -> CUresult {
    OK
}
unsafe extern "C" fn dtod_async(dst: u64, src: u64, bytes: usize, s: *mut c_void) -> CUresult {
    submit(s as usize, Op::Copy { dst, src, bytes });
    OK
}
unsafe extern "C" fn memset_async(dst: u64, v: u8, n: usize, s: *mut c_void) -> CUresult {
    submit(s as usize, Op::Set8 { dst, v, n });
    OK
}
unsafe extern "C" fn memset32_async(dst: u64, v: c_uint, n: usize, s: *mut c_void) -> CUresult {
    submit(s as usize, Op::Set32 { dst, v, n });
    OK
}
unsafe extern "C" fn stream_create(s: *mut *mut c_void, _: c_uint) -> CUresult {
    let h = NEXT.fetch_add(1, Ordering::SeqCst) as usize;
    stream(h);
    unsafe { *s = h as *mut c_void };
    OK
}
unsafe extern "C" fn stream_destroy(_: *mut c_void) -> CUresult {
    OK
}
unsafe extern "C" fn stream_sync(s: *mut c_void) -> CUresult {
    assert!(
        sync(s as usize, Duration::from_secs(120)),
        "stream {s:?} stuck"
    );
    OK
}
unsafe extern "C" fn stream_query(s: *mut c_void) -> CUresult {
    let st = stream(s as usize);
    if *st.done.lock() < st.submitted.load(Ordering::SeqCst) {
        NOT_READY
    } else {
        OK
    }
}
unsafe extern "C" fn is_capturing(s: *mut c_void, st: *mut c_int) -> CUresult {
    let active = CAPTURES
        .lock()
        .as_ref()
        .is_some_and(|m| m.contains_key(&(s as usize)));
    unsafe { *st = c_int::from(active) };
    OK
}
unsafe extern "C" fn wait_event(s: *mut c_void, e: *mut c_void, _: c_uint) -> CUresult {
    let event = event(e as usize);
    let generation = event.recorded.load(Ordering::SeqCst);
    submit(s as usize, Op::Wait { event, generation });
    OK
}
unsafe extern "C" fn event_create(e: *mut *mut c_void, _: c_uint) -> CUresult {
    unsafe { *e = NEXT.fetch_add(1, Ordering::SeqCst) as *mut c_void };
    OK
}
unsafe extern "C" fn event_record(e: *mut c_void, s: *mut c_void) -> CUresult {
    let event = event(e as usize);
    let generation = event.recorded.fetch_add(1, Ordering::SeqCst) + 1;
    submit(s as usize, Op::Record { event, generation });
    OK
}
unsafe extern "C" fn event_query(e: *mut c_void) -> CUresult {
    let ev = event(e as usize);
    if *ev.reached.lock() < ev.recorded.load(Ordering::SeqCst) {
        NOT_READY
    } else {
        OK
    }
}
unsafe extern "C" fn event_destroy(_: *mut c_void) -> CUresult {
    OK
}
unsafe extern "C" fn pointer_attr(v: *mut c_void, a: c_int, _: u64) -> CUresult {
    // Device memory (2) of device 0.
    unsafe { *(v as *mut c_uint) = if a == 9 { 0 } else { 2 } };
    OK
}
unsafe extern "C" fn unsupported() -> CUresult {
    801 // CUDA_ERROR_NOT_SUPPORTED
}

fn stand_in() -> Api {
    let no = unsupported as *const c_void;
    let own: Vec<(&str, *const c_void)> = vec![
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
        ("cuStreamWaitEvent", wait_event as *const c_void),
        ("cuEventCreate", event_create as *const c_void),
        ("cuEventRecord", event_record as *const c_void),
        ("cuEventQuery", event_query as *const c_void),
        ("cuEventDestroy_v2", event_destroy as *const c_void),
        ("cuPointerGetAttribute", pointer_attr as *const c_void),
        // No IPC and no virtual memory management: one process, cuMemAlloc.
        ("cuIpcGetMemHandle", no),
        ("cuIpcOpenMemHandle_v2", no),
        ("cuIpcCloseMemHandle", no),
        ("cuMemGetAllocationGranularity", no),
        ("cuMemCreate", no),
        ("cuMemRelease", no),
        ("cuMemAddressReserve", no),
        ("cuMemAddressFree", no),
        ("cuMemMap", no),
        ("cuMemUnmap", no),
        ("cuMemSetAccess", no),
    ];
    // SAFETY: each function above has the signature the driver table lists for its symbol
    // (`unsupported` ignores its arguments, which the C calling convention allows).
    unsafe { stand_in::driver(&own) }
}

// ---- the checks ---------------------------------------------------------------------------

/// A "device" buffer of `bytes`.
fn buffer(bytes: usize) -> usize {
    let mut p = 0u64;
    // SAFETY: writes one pointer.
    unsafe { stand_in::alloc(&mut p, bytes.max(1)) };
    p as usize
}

/// Rank r's input element i: a small integer (exact in every type used, in any order of
/// summation); positive and at most 3 for products.
fn input(r: usize, i: usize, op: i32) -> f64 {
    if op == nccl::types::OP_PROD {
        ((r + i) % 3 + 1) as f64
    } else {
        ((r * 7 + i * 3) % 11) as f64 - 5.0
    }
}

fn put(dt: DataType, buf: usize, i: usize, v: f64) {
    use nccl::reduce::convert;
    // SAFETY: `buf` holds element `i` of `dt`.
    unsafe {
        match dt {
            DataType::Float32 => *(buf as *mut f32).add(i) = v as f32,
            DataType::Float64 => *(buf as *mut f64).add(i) = v,
            DataType::Int32 => *(buf as *mut i32).add(i) = v as i32,
            DataType::Int8 => *(buf as *mut i8).add(i) = v as i8,
            DataType::Float16 => *(buf as *mut u16).add(i) = convert::f32_to_f16(v as f32),
            DataType::Bfloat16 => *(buf as *mut u16).add(i) = convert::f32_to_bf16(v as f32),
            _ => unreachable!("{dt:?}"),
        }
    }
}

fn get(dt: DataType, buf: usize, i: usize) -> f64 {
    use nccl::reduce::convert;
    // SAFETY: `buf` holds element `i` of `dt`.
    unsafe {
        match dt {
            DataType::Float32 => *(buf as *const f32).add(i) as f64,
            DataType::Float64 => *(buf as *const f64).add(i),
            DataType::Int32 => *(buf as *const i32).add(i) as f64,
            DataType::Int8 => *(buf as *const i8).add(i) as f64,
            DataType::Float16 => convert::f16_to_f32(*(buf as *const u16).add(i)) as f64,
            DataType::Bfloat16 => convert::bf16_to_f32(*(buf as *const u16).add(i)) as f64,
            _ => unreachable!("{dt:?}"),
        }
    }
}

/// op over the ranks' values (sum, prod, max, min; avg: sum / n, exact for the integer types
/// only where it divides, so the inputs are chosen to make sums multiples of n there).
fn combine(op: i32, vals: impl Iterator<Item = f64>, n: usize, dt: DataType) -> f64 {
    use nccl::types::*;
    let v: Vec<f64> = vals.collect();
    match op {
        OP_SUM => v.iter().sum(),
        OP_PROD => v.iter().product(),
        OP_MAX => v.iter().cloned().fold(f64::MIN, f64::max),
        OP_MIN => v.iter().cloned().fold(f64::MAX, f64::min),
        OP_AVG => {
            let s: f64 = v.iter().sum();
            if dt.is_float() {
                s / n as f64
            } else {
                (s / n as f64).trunc()
            }
        }
        _ => unreachable!(),
    }
}

#[derive(Clone, Copy)]
struct Case {
    kind: CollKind,
    dtype: DataType,
    op: i32,
    count: usize,
    in_place: bool,
    root: usize,
}

/// Elements of each rank's send and receive buffers for `c` over `n` ranks.
fn sizes(c: &Case, n: usize) -> (usize, usize) {
    match c.kind {
        CollKind::AllGather => (c.count, c.count * n),
        CollKind::ReduceScatter => (c.count * n, c.count),
        CollKind::AlltoAll => (c.count * n, c.count * n),
        _ => (c.count, c.count),
    }
}

/// Each rank's send and receive buffers for `c` (the same where in place).
fn buffers(c: &Case, n: usize) -> Vec<(usize, usize)> {
    let es = c.dtype.size();
    let (ns, nr) = sizes(c, n);
    (0..n)
        .map(|_| {
            let s = buffer(ns.max(nr) * es);
            let r = if c.in_place { s } else { buffer(nr * es) };
            (s, r)
        })
        .collect()
}

/// Rank r's inputs for `c` (salted), where the collective reads them (in place: inside the
/// output, as NCCL lays out in-place all-gathers), and a sentinel elsewhere in the output.
fn fill(c: &Case, n: usize, r: usize, (s, rb): (usize, usize), salt: usize) {
    let (ns, nr) = sizes(c, n);
    if !c.in_place {
        for i in 0..nr {
            put(c.dtype, rb, i, 99.0);
        }
    }
    let at = if c.in_place && c.kind == CollKind::AllGather {
        r * c.count
    } else {
        0
    };
    for i in 0..ns {
        put(c.dtype, s, at + i, input(r, i + salt, c.op));
    }
}

/// Rank r's calls for `c` on `stream` (Send: the ring's send to the next rank and receive from
/// the one before).
fn enqueue(
    comm: &Arc<nccl::comm::Comm>,
    c: &Case,
    n: usize,
    (s, rb): (usize, usize),
    stream: usize,
) {
    let r = comm.rank().unwrap() as usize;
    let send = if c.in_place && c.kind == CollKind::AllGather {
        s + r * c.count * c.dtype.size()
    } else {
        s
    };
    let call = |kind, send, recv, op, root: usize| CollArgs {
        kind,
        send,
        recv,
        count: c.count,
        dtype: c.dtype,
        op,
        root: root as i32,
    };
    let on = nccl::api::stream_from_handle(stream).unwrap();
    if c.kind == CollKind::Send {
        let next = call(CollKind::Send, send, 0, 0, (r + 1) % n);
        let prev = call(CollKind::Recv, 0, rb, 0, (r + n - 1) % n);
        nccl::api::enqueue(comm, next, on).unwrap();
        nccl::api::enqueue(comm, prev, stream_arg(stream)).unwrap();
    } else {
        nccl::api::enqueue(comm, call(c.kind, send, rb, c.op, c.root), on).unwrap();
    }
}

fn stream_arg(h: usize) -> nccl::api::StreamArg {
    nccl::api::stream_from_handle(h).unwrap()
}

fn describe(c: &Case, n: usize, streams: usize) -> String {
    format!(
        "{:?} {:?} op {} count {} {} over {n} ranks on {streams} stream(s)",
        c.kind,
        c.dtype,
        c.op,
        c.count,
        if c.in_place {
            "in place"
        } else {
            "out of place"
        },
    )
}

/// Every rank's output of `c` (inputs salted with `salt`), element by element.
fn verify(c: &Case, bufs: &[(usize, usize)], salt: usize, what: &str) {
    let n = bufs.len();
    let (_, nr) = sizes(c, n);
    let x = |r: usize, i: usize| input(r, i + salt, c.op);
    let reduced = |i: usize| combine(c.op, (0..n).map(|r| x(r, i)), n, c.dtype);
    for (q, &(_, rb)) in bufs.iter().enumerate() {
        let expect = |i: usize| -> f64 {
            match c.kind {
                CollKind::AllReduce => reduced(i),
                CollKind::Broadcast => x(c.root, i),
                CollKind::Reduce if q == c.root => reduced(i),
                CollKind::Reduce if c.in_place => x(q, i),
                CollKind::Reduce => 99.0,
                CollKind::AllGather => x(i / c.count, i % c.count),
                CollKind::ReduceScatter => reduced(q * c.count + i),
                CollKind::AlltoAll => x(i / c.count, q * c.count + i % c.count),
                CollKind::Send => x((q + n - 1) % n, i),
                k => unreachable!("{k:?}"),
            }
        };
        for i in 0..nr {
            assert_eq!(
                get(c.dtype, rb, i),
                expect(i),
                "{what}: rank {q} element {i}"
            );
        }
    }
}

fn sync_all(streams: &[usize], what: &str) {
    for &s in streams {
        assert!(sync(s, Duration::from_secs(120)), "{what}: stuck");
    }
}

fn no_async_error(comms: &[Arc<nccl::comm::Comm>], what: &str) {
    for comm in comms {
        let e = nccl::api::comm_async_error(comm);
        assert_eq!(e, nccl::error::Code::Success, "{what}");
    }
}

/// Runs `c` on `comms` (rank r on `streams[r]`, one group) and checks every rank's output.
fn check(comms: &[Arc<nccl::comm::Comm>], streams: &[usize], c: &Case) {
    let n = comms.len();
    let bufs = buffers(c, n);
    for (r, b) in bufs.iter().enumerate() {
        fill(c, n, r, *b, 0);
    }
    nccl::api::group_start().unwrap();
    for (r, comm) in comms.iter().enumerate() {
        enqueue(comm, c, n, bufs[r], streams[r]);
    }
    nccl::api::group_end().unwrap();
    let what = describe(c, n, streams.iter().collect::<BTreeSet<_>>().len());
    sync_all(streams, &what);
    no_async_error(comms, &what);
    verify(c, &bufs, 0, &what);
}

fn new_stream() -> usize {
    NEXT.fetch_add(1, Ordering::SeqCst) as usize
}

/// Graph capture and replay, as PyTorch's CUDA graphs use them: the launches made while the
/// ranks' streams capture are kept, not run; each replay runs them again on the inputs then in
/// the buffers, with eager operations of the same communicators in between (the connections'
/// counters carry over from launch to launch and from replay to replay).
fn graphs(comms: &[Arc<nccl::comm::Comm>], streams: &[usize], c: &Case) {
    let n = comms.len();
    let bufs = buffers(c, n);
    for (r, b) in bufs.iter().enumerate() {
        fill(c, n, r, *b, 0);
    }
    for &s in streams {
        begin_capture(s);
    }
    nccl::api::group_start().unwrap();
    for (r, comm) in comms.iter().enumerate() {
        enqueue(comm, c, n, bufs[r], streams[r]);
    }
    nccl::api::group_end().unwrap();
    let graphs: Vec<Vec<Op>> = streams.iter().map(|&s| end_capture(s)).collect();
    assert!(graphs.iter().all(|g| !g.is_empty()), "nothing captured");
    assert!(
        bufs.iter().all(|&(_, rb)| get(c.dtype, rb, 0) == 99.0),
        "a captured launch ran"
    );
    for replay in 1..=3 {
        for (r, b) in bufs.iter().enumerate() {
            fill(c, n, r, *b, replay);
        }
        for (&s, g) in streams.iter().zip(&graphs) {
            for op in g {
                submit(s, op.clone());
            }
        }
        let what = format!("{}, graph replay {replay}", describe(c, n, streams.len()));
        sync_all(streams, &what);
        no_async_error(comms, &what);
        verify(c, &bufs, replay, &what);
        check(comms, streams, c);
    }
}

/// Each rank in a thread of its own (`ncclCommInitRank`), launching and waiting on its own
/// stream, several operations in a row.
fn threads(n: usize, c: &Case) {
    let id = nccl::api::get_unique_id().unwrap();
    let bufs = buffers(c, n);
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            let b = bufs[r];
            let c = *c;
            std::thread::spawn(move || {
                let comm = nccl::api::comm_init_rank(n as i32, &id, r as i32, Default::default())
                    .expect("a rank in a thread");
                let stream = new_stream();
                for salt in 0..3 {
                    fill(&c, n, r, b, salt);
                    enqueue(&comm, &c, n, b, stream);
                    sync_all(&[stream], "threads");
                }
                no_async_error(std::slice::from_ref(&comm), "threads");
                comm
            })
        })
        .collect();
    let comms: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    verify(
        c,
        &bufs,
        2,
        &format!("{}, a thread per rank", describe(c, n, n)),
    );
    for c in &comms {
        nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
    }
}

#[test]
fn cuda_executor_on_emulated_kernels() {
    let Some(emu) = load_emu() else { return };
    assert!(EMU.set(emu).is_ok());
    let cache = stand_in::stand_in_kernels("cuda-emu");
    assert!(driver::install(stand_in()), "a driver was loaded already");
    assert_eq!(nccl::gpu::kind(), nccl::gpu::Kind::Cuda);
    use nccl::types::{OP_AVG, OP_MAX, OP_MIN, OP_PROD, OP_SUM};

    // Then the optional kernels: the direct all-reduce (`OXCCL_CUDA_DIRECT=1`: ranks of one
    // group on one device in one launch) and the copy kernel (`OXCCL_CUDA_COPY_KERNEL=1`: a
    // one-rank collective out of place).
    for (n, optional) in [
        (1usize, false),
        (2, false),
        (4, false),
        (1, true),
        (2, true),
        (4, true),
    ] {
        if optional {
            std::env::set_var("OXCCL_CUDA_DIRECT", "1");
            std::env::set_var("OXCCL_CUDA_COPY_KERNEL", "1");
        }
        let comms = nccl::api::comm_init_all(&vec![0; n]).expect("ranks on one device");
        let own: Vec<usize> = (0..n).map(|_| new_stream()).collect();
        let one = vec![new_stream(); n];
        let mut cases = Vec::new();
        let counts: &[usize] = if optional {
            &[300_001]
        } else {
            &[300_001, 1001]
        };
        // Every collective, large enough for several slices and blocks per lane, and an odd
        // count (tails, unaligned shares).
        for &count in counts {
            for kind in [
                CollKind::AllReduce,
                CollKind::Broadcast,
                CollKind::Reduce,
                CollKind::AllGather,
                CollKind::ReduceScatter,
                CollKind::AlltoAll,
                CollKind::Send,
            ] {
                for in_place in [false, true] {
                    if in_place && matches!(kind, CollKind::AlltoAll | CollKind::Send) {
                        continue;
                    }
                    cases.push(Case {
                        kind,
                        dtype: DataType::Float32,
                        op: OP_SUM,
                        count,
                        in_place,
                        root: n - 1,
                    });
                }
            }
        }
        // Datatypes and operators.
        for dtype in [
            DataType::Float64,
            DataType::Int32,
            DataType::Int8,
            DataType::Float16,
            DataType::Bfloat16,
        ] {
            for op in [OP_SUM, OP_PROD, OP_MAX, OP_MIN, OP_AVG] {
                if op == OP_AVG && !dtype.is_float() {
                    continue;
                }
                cases.push(Case {
                    kind: CollKind::AllReduce,
                    dtype,
                    op,
                    count: 5000,
                    in_place: false,
                    root: 0,
                });
            }
        }
        for c in &cases {
            check(&comms, &own, c);
            if n > 1 && c.kind == CollKind::AllReduce {
                check(&comms, &one, c);
            }
        }
        if n > 1 && !optional {
            graphs(&comms, &own, &cases[0]);
            threads(n, &cases[0]);
        }
        for c in &comms {
            nccl::api::comm_destroy(nccl::api::comm_handle(c)).unwrap();
        }
    }
    let launched = LAUNCHED.lock().clone();
    eprintln!("kernels run: {launched:?}");
    for k in ["oxccl_run", "oxccl_local", "oxccl_direct4", "oxccl_copy"] {
        assert!(launched.contains(k), "{k} never ran: {launched:?}");
    }
    let _ = std::fs::remove_dir_all(&cache);
}
