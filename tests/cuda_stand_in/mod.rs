//! What the stand-in drivers of `tests/cuda_logic.rs` (which records) and
//! `tests/cuda_emulated.rs` (which runs the kernels on the host) have in common: one device
//! (sm_90, 132 SMs) of a CUDA 12.8 driver, its primary context, a module whose functions are
//! the kernels of `cuda/runner.cu`, "device" memory that is host memory, and a cache directory
//! holding a stand-in kernel image (so the executor compiles nothing).

#![allow(dead_code)] // each test uses its part

use nccl::gpu::driver::{Api, CUresult};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

pub const OK: CUresult = 0;

/// The kernels' names; a function handle is `FUNC_BASE` + its index here.
pub const KERNELS: [&CStr; 9] = [
    c"oxccl_run",
    c"oxccl_local",
    c"oxccl_run_large",
    c"oxccl_local_large",
    c"oxccl_direct4",
    c"oxccl_direct16",
    c"oxccl_copy",
    c"oxccl_run_board",
    c"oxccl_run_board_large",
];
pub const FUNC_BASE: usize = 0x3000;
pub const RUN: usize = FUNC_BASE;
pub const LOCAL: usize = FUNC_BASE + 1;
pub const RUN_LARGE: usize = FUNC_BASE + 2;
pub const LOCAL_LARGE: usize = FUNC_BASE + 3;
pub const DIRECT4: usize = FUNC_BASE + 4;
pub const DIRECT16: usize = FUNC_BASE + 5;
pub const COPY: usize = FUNC_BASE + 6;
pub const RUN_BOARD: usize = FUNC_BASE + 7;
pub const RUN_BOARD_LARGE: usize = FUNC_BASE + 8;

/// The name of function handle `f`.
pub fn kernel_name(f: usize) -> Option<&'static CStr> {
    KERNELS.get(f.wrapping_sub(FUNC_BASE)).copied()
}

thread_local! {
    static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

unsafe extern "C" fn ok_u(_: c_uint) -> CUresult {
    OK
}
unsafe extern "C" fn version(v: *mut c_int) -> CUresult {
    unsafe { *v = 12080 };
    OK
}
unsafe extern "C" fn count(n: *mut c_int) -> CUresult {
    unsafe { *n = 1 };
    OK
}
unsafe extern "C" fn device_get(d: *mut c_int, o: c_int) -> CUresult {
    unsafe { *d = o };
    OK
}
unsafe extern "C" fn name(_: *mut c_char, _: c_int, _: c_int) -> CUresult {
    OK
}
unsafe extern "C" fn retain(c: *mut *mut c_void, _: c_int) -> CUresult {
    unsafe { *c = 0x1000 as *mut c_void };
    OK
}
unsafe extern "C" fn get_current(c: *mut *mut c_void) -> CUresult {
    unsafe { *c = CURRENT.with(|x| x.get()) as *mut c_void };
    OK
}
unsafe extern "C" fn set_current(c: *mut c_void) -> CUresult {
    CURRENT.with(|x| x.set(c as usize));
    OK
}
unsafe extern "C" fn ctx_device(d: *mut c_int) -> CUresult {
    unsafe { *d = 0 };
    OK
}
unsafe extern "C" fn module_load(m: *mut *mut c_void, _: *const c_void) -> CUresult {
    unsafe { *m = 0x2000 as *mut c_void };
    OK
}
unsafe extern "C" fn get_function(
    f: *mut *mut c_void,
    _: *mut c_void,
    n: *const c_char,
) -> CUresult {
    let n = unsafe { CStr::from_ptr(n) };
    match KERNELS.iter().position(|k| *k == n) {
        Some(i) => {
            unsafe { *f = (FUNC_BASE + i) as *mut c_void };
            OK
        }
        None => 500, // CUDA_ERROR_NOT_FOUND
    }
}
unsafe extern "C" fn set_attr(_: *mut c_void, _: c_int, _: c_int) -> CUresult {
    OK
}
/// The granularity of the stand-ins' virtual memory (cuMem) allocations.
pub const GRANULARITY: usize = 2 << 20;

pub unsafe extern "C" fn granularity(
    g: *mut usize,
    _: *const nccl::gpu::driver::CUmemAllocationProp,
    _: c_uint,
) -> CUresult {
    unsafe { *g = GRANULARITY };
    OK
}

/// "Device" memory: host memory, 256-byte aligned, never freed (the tests are short).
pub unsafe extern "C" fn alloc(p: *mut u64, n: usize) -> CUresult {
    let v = vec![0u8; n + 256].leak();
    unsafe { *p = ((v.as_ptr() as u64) + 255) & !255 };
    OK
}
unsafe extern "C" fn alloc_async(p: *mut u64, n: usize, _: *mut c_void) -> CUresult {
    unsafe { alloc(p, n) }
}
unsafe extern "C" fn free_async(_: u64, _: *mut c_void) -> CUresult {
    OK
}
unsafe extern "C" fn register(_: *mut c_void, _: usize, _: c_uint) -> CUresult {
    OK
}
unsafe extern "C" fn unregister(_: *mut c_void) -> CUresult {
    OK
}
unsafe extern "C" fn host_dptr(d: *mut u64, p: *mut c_void, _: c_uint) -> CUresult {
    unsafe { *d = p as u64 };
    OK
}
unsafe extern "C" fn dtoh(d: *mut c_void, s: u64, n: usize) -> CUresult {
    unsafe { std::ptr::copy(s as *const u8, d as *mut u8, n) };
    OK
}
thread_local! {
    /// The thread's capture mode (0 global, CUDA's default; 2 relaxed).
    static MODE: std::cell::Cell<c_int> = const { std::cell::Cell::new(0) };
}
unsafe extern "C" fn exchange_mode(m: *mut c_int) -> CUresult {
    // SAFETY: the executor passes a valid pointer.
    unsafe { *m = MODE.with(|x| x.replace(*m)) };
    OK
}
unsafe extern "C" fn uuid(u: *mut [u8; 16], dev: c_int) -> CUresult {
    unsafe { *u = [0xa0 + dev as u8; 16] };
    OK
}
unsafe extern "C" fn can_access_peer(can: *mut c_int, _: c_int, _: c_int) -> CUresult {
    unsafe { *can = 0 };
    OK
}
unsafe extern "C" fn p2p_attr(v: *mut c_int, _: c_int, _: c_int, _: c_int) -> CUresult {
    unsafe { *v = 0 };
    OK
}
unsafe extern "C" fn enable_peer_access(_: *mut c_void, _: c_uint) -> CUresult {
    OK
}
/// What a stand-in's `cuStreamGetCaptureInfo_v2` reports of a stream that captures graph
/// `graph` (None: none): its status, capture id and, where asked, the graph (its handle is the
/// capture id). The executor asks for no dependencies.
///
/// # Safety
/// `st` and `id` are writable, and the first of `later` where it is not NULL; the others are
/// what the executor passed.
pub unsafe fn capture_info_of(
    st: *mut c_int,
    id: *mut u64,
    later: [*mut c_void; 3],
    graph: Option<u64>,
) -> CUresult {
    assert!(
        later[1..].iter().all(|p| p.is_null()),
        "outputs the executor never asks for"
    );
    unsafe {
        *st = c_int::from(graph.is_some());
        *id = graph.unwrap_or(0);
        if !later[0].is_null() {
            *later[0].cast::<u64>() = graph.unwrap_or(0);
        }
    }
    OK
}
/// A stand-in's `cuPointerGetAttributes`, from its `cuPointerGetAttribute` (`one`): each
/// attribute asked for in turn; where `one` fails for `p`, every output is 0 and the call
/// succeeds, as the driver's does for memory it does not know. (The executor asks for 4-byte
/// attributes only.)
///
/// # Safety
/// `attrs` and `out` hold `n` entries; each output is writable for its attribute.
pub unsafe fn pointer_attrs_of(
    one: unsafe extern "C" fn(*mut c_void, c_int, u64) -> CUresult,
    n: c_uint,
    attrs: *mut c_int,
    out: *mut *mut c_void,
    p: u64,
) -> CUresult {
    for i in 0..n as usize {
        // SAFETY: per the contract.
        let failed = unsafe { one(*out.add(i), *attrs.add(i), p) } != OK;
        if failed {
            for j in 0..n as usize {
                // SAFETY: per the contract.
                unsafe { *(*out.add(j)).cast::<c_uint>() = 0 };
            }
            return OK;
        }
    }
    OK
}
/// Defines `pointer_attrs`, a stand-in's `cuPointerGetAttributes`, over its one-attribute
/// `cuPointerGetAttribute` (`pointer_attrs_of`), where the stand-in's module has `c_uint`,
/// `c_int`, `c_void` and `CUresult` in scope.
macro_rules! pointer_attrs_over {
    ($stand_in:path, $one:path) => {
        unsafe extern "C" fn pointer_attrs(
            n: c_uint,
            attrs: *mut c_int,
            out: *mut *mut c_void,
            p: u64,
        ) -> CUresult {
            use $stand_in as s;
            // SAFETY: the driver's contract, which the executor keeps.
            unsafe { s::pointer_attrs_of($one, n, attrs, out, p) }
        }
    };
}
pub(crate) use pointer_attrs_over;
unsafe extern "C" fn error_str(_: CUresult, s: *mut *const c_char) -> CUresult {
    unsafe { *s = c"stand-in error".as_ptr() };
    OK
}

/// `CUDA_ERROR_NOT_SUPPORTED`, whatever the arguments (a call no stand-in test makes unless it
/// brings its own).
unsafe extern "C" fn not_supported() -> CUresult {
    801
}

/// A driver table: `own` (the test's functions, by symbol), then the common ones above for the
/// symbols `own` does not name. Panics where a symbol the executor needs is in neither.
///
/// # Safety
/// Each function of `own` has the signature the driver table lists for its symbol.
pub unsafe fn driver(own: &[(&str, *const c_void)]) -> Api {
    let common: [(&str, *const c_void); 21] = [
        ("cuInit", ok_u as *const c_void),
        ("cuDeviceGetUuid_v2", uuid as *const c_void),
        ("cuDriverGetVersion", version as *const c_void),
        ("cuDeviceGetCount", count as *const c_void),
        ("cuDeviceGet", device_get as *const c_void),
        ("cuDeviceGetName", name as *const c_void),
        ("cuDevicePrimaryCtxRetain", retain as *const c_void),
        ("cuCtxGetCurrent", get_current as *const c_void),
        ("cuCtxSetCurrent", set_current as *const c_void),
        ("cuCtxGetDevice", ctx_device as *const c_void),
        ("cuModuleLoadData", module_load as *const c_void),
        ("cuModuleGetFunction", get_function as *const c_void),
        ("cuFuncSetAttribute", set_attr as *const c_void),
        ("cuMemAlloc_v2", alloc as *const c_void),
        ("cuMemAllocAsync", alloc_async as *const c_void),
        ("cuMemFreeAsync", free_async as *const c_void),
        ("cuMemHostRegister_v2", register as *const c_void),
        ("cuMemHostUnregister", unregister as *const c_void),
        ("cuMemHostGetDevicePointer_v2", host_dptr as *const c_void),
        ("cuMemcpyDtoH_v2", dtoh as *const c_void),
        (
            "cuThreadExchangeStreamCaptureMode",
            exchange_mode as *const c_void,
        ),
    ];
    let more: [(&str, *const c_void); 7] = [
        (
            "cuMemExportToShareableHandle",
            not_supported as *const c_void,
        ),
        (
            "cuMemImportFromShareableHandle",
            not_supported as *const c_void,
        ),
        ("cuDeviceCanAccessPeer", can_access_peer as *const c_void),
        ("cuDeviceGetP2PAttribute", p2p_attr as *const c_void),
        ("cuCtxEnablePeerAccess", enable_peer_access as *const c_void),
        ("cuGetErrorName", error_str as *const c_void),
        ("cuGetErrorString", error_str as *const c_void),
    ];
    // SAFETY: the caller's for `own`; the common functions have their symbols' signatures.
    unsafe {
        Api::resolve(|sym| {
            let sym = sym.trim_end_matches('\0');
            own.iter()
                .chain(common.iter())
                .chain(more.iter())
                .find(|(n, _)| *n == sym)
                .map(|(_, f)| *f)
        })
    }
    .unwrap_or_else(|e| panic!("{}", e.msg))
}

/// Points the executor at a cache directory holding a stand-in image for sm_90 (module_load
/// above takes any bytes), so that it compiles nothing; selects the CUDA executor. Returns the
/// directory (the test removes it).
pub fn stand_in_kernels(tag: &str) -> std::path::PathBuf {
    std::env::set_var("OXCCL_DEVICE", "cuda");
    let cache = std::env::temp_dir().join(format!("oxccl-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::write(
        cache.join(nccl::exec::cuda::kernel_cache_name(90)),
        b"stand-in image",
    )
    .unwrap();
    std::env::set_var("OXCCL_CACHE_DIR", &cache);
    cache
}
