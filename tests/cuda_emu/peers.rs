//! Two devices for the emulated device of `tests/cuda_emulated.rs` (in a process of its own:
//! the driver is chosen once per process): each with its primary context, reaching the other's
//! memory (`cuDeviceCanAccessPeer`) with native atomics (NVLink) or without (plain PCIe, as
//! `NATIVE_ATOMICS` says), and a record of which context allocated device memory and which
//! enabled peer access to which. Kernels of both run on the one emulated device (its memory is
//! host memory: any kernel reaches any of it); what this shows is where the executor puts a
//! connection between ranks of one process on two devices, and that the kernels run over it.

use super::device;
use nccl::gpu::driver::{self, CUresult};
use parking_lot::Mutex;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

const OK: CUresult = 0;
/// Device d's primary context.
pub fn ctx_of(d: c_int) -> usize {
    0x1000 + 0x100 * d as usize
}

/// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED` between the two devices.
pub static NATIVE_ATOMICS: AtomicBool = AtomicBool::new(true);
/// `cuCtxEnablePeerAccess` refuses (`CUDA_ERROR_TOO_MANY_PEERS`, as past the hardware's
/// limit of peers).
pub static REFUSE_PEER_ACCESS: AtomicBool = AtomicBool::new(false);
/// (context, bytes) of each `cuMemAlloc`.
pub static ALLOCATED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
/// (address, bytes, context) of each `cuMemAlloc`.
static RANGES: Mutex<Vec<(u64, usize, usize)>> = Mutex::new(Vec::new());
/// Runner launches some of whose connections live in the other device's memory (allocated by
/// its context in this process, or opened by IPC from another process).
pub static REMOTE_LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// (context, peer context) of each `cuCtxEnablePeerAccess` that enabled it.
pub static ENABLED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// The device of context `c` (device 0's where none is current).
fn device_of(c: usize) -> usize {
    (c.max(0x1000) - 0x1000) / 0x100
}

/// Kernels loaded in device d's context: module 0x2000 + d, whose function handles are
/// `FUNC_BASE + i + FUNC_DEVICE * d` (a handle works only while its context is current).
const FUNC_DEVICE: usize = 0x10000;

unsafe extern "C" fn module_load(m: *mut *mut c_void, _: *const c_void) -> CUresult {
    unsafe { *m = (0x2000 + device_of(device::current_ctx())) as *mut c_void };
    OK
}
unsafe extern "C" fn get_function(
    f: *mut *mut c_void,
    module: *mut c_void,
    n: *const c_char,
) -> CUresult {
    let n = unsafe { std::ffi::CStr::from_ptr(n) };
    let d = module as usize - 0x2000;
    match super::stand_in::KERNELS.iter().position(|k| *k == n) {
        Some(i) => {
            unsafe { *f = (super::stand_in::FUNC_BASE + i + FUNC_DEVICE * d) as *mut c_void };
            OK
        }
        None => 500, // CUDA_ERROR_NOT_FOUND
    }
}

unsafe extern "C" fn count(n: *mut c_int) -> CUresult {
    unsafe { *n = 2 };
    OK
}
unsafe extern "C" fn retain(c: *mut *mut c_void, d: c_int) -> CUresult {
    unsafe { *c = ctx_of(d) as *mut c_void };
    OK
}
unsafe extern "C" fn ctx_device(d: *mut c_int) -> CUresult {
    unsafe { *d = device_of(device::current_ctx()) as c_int };
    OK
}
unsafe extern "C" fn can_access(can: *mut c_int, a: c_int, b: c_int) -> CUresult {
    unsafe { *can = (a != b) as c_int };
    OK
}
unsafe extern "C" fn p2p_attr(v: *mut c_int, attr: c_int, _: c_int, _: c_int) -> CUresult {
    let native = NATIVE_ATOMICS.load(Ordering::SeqCst);
    unsafe {
        *v = (attr != driver::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED || native) as c_int
    };
    OK
}
unsafe extern "C" fn enable_peer_access(peer: *mut c_void, _: c_uint) -> CUresult {
    if REFUSE_PEER_ACCESS.load(Ordering::SeqCst) {
        return 711;
    }
    let pair = (device::current_ctx(), peer as usize);
    let mut e = ENABLED.lock();
    if e.contains(&pair) {
        return driver::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    }
    e.push(pair);
    OK
}
/// `cuDeviceGetPCIBusId`: device d is at bus 3 + d, in the driver's spelling (an 8-digit
/// domain, capitals); the test's sysfs tree places them (`OXCCL_SYSFS_ROOT`).
unsafe extern "C" fn pci_bus_id(text: *mut c_char, len: c_int, d: c_int) -> CUresult {
    let id = format!("00000000:{:02X}:00.0\0", 3 + d);
    assert!(id.len() <= len as usize);
    unsafe { std::ptr::copy_nonoverlapping(id.as_ptr().cast(), text, id.len()) };
    OK
}
unsafe extern "C" fn mem_alloc(p: *mut u64, n: usize) -> CUresult {
    ALLOCATED.lock().push((device::current_ctx(), n));
    let r = unsafe { device::mem_alloc(p, n) };
    if r == OK {
        RANGES
            .lock()
            .push((unsafe { *p }, n, device::current_ctx()));
    }
    r
}
/// What a kernel would have faulted on: a connection in the other device's memory, allocated
/// there by this process, while the launching context has not enabled access to it.
pub static NO_PEER_ACCESS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// `cuLaunchKernel`: the function must be of the current context's module
/// (CUDA_ERROR_INVALID_HANDLE otherwise). A runner launch whose connections are not all in the
/// launching context's memory needs that context to have enabled access to the other's
/// (`NO_PEER_ACCESS` otherwise); it may give a lane several blocks (which count themselves in
/// with atomics on each connection's header) only where the devices' atomics on each other's
/// memory are native; otherwise it is refused (CUDA_ERROR_INVALID_VALUE, as the atomics would
/// not be atomic).
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn launch(
    f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shm: c_uint,
    s: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let here = device::current_ctx();
    let (d, f) = (
        f as usize / FUNC_DEVICE,
        (f as usize % FUNC_DEVICE) as *mut c_void,
    );
    if d != device_of(here) {
        eprintln!(
            "cuLaunchKernel: a function of device {d}'s module while context {here:#x} is \
             current"
        );
        return 400; // CUDA_ERROR_INVALID_HANDLE
    }
    let runner = super::stand_in::kernel_name(f as usize)
        .is_some_and(|n| n.to_bytes().starts_with(b"oxccl_run"));
    if runner {
        // SAFETY: the descriptor's header and connections (`OxHeadD`, `OxConnD`).
        let words = unsafe { *params as *const u64 };
        let (nb, nconns) = unsafe { (*words & 0xffff, (*words.add(1) & 0xffff) as usize) };
        let ranges = RANGES.lock();
        let owner = |hdr: u64| {
            ranges
                .iter()
                .find(|&&(p, n, _)| p <= hdr && hdr < p + n as u64)
                .map(|&(_, _, c)| c)
        };
        let headers: Vec<u64> = (0..nconns)
            .map(|i| unsafe { *words.add(2 + 4 * i) })
            .collect();
        let remote = headers
            .iter()
            .filter(|&&hdr| device::ipc_opened(hdr) || owner(hdr).is_some_and(|c| c != here))
            .count();
        let enabled = ENABLED.lock();
        for &hdr in &headers {
            if let Some(c) = owner(hdr).filter(|&c| c != here && !enabled.contains(&(here, c))) {
                NO_PEER_ACCESS.lock().push(format!(
                    "a launch in context {here:#x} on connection {hdr:#x} of context {c:#x}, \
                     whose memory it has not enabled access to"
                ));
            }
        }
        drop(enabled);
        drop(ranges);
        if remote > 0 {
            REMOTE_LAUNCHES.fetch_add(1, Ordering::SeqCst);
            if nb > 1 && !NATIVE_ATOMICS.load(Ordering::SeqCst) {
                eprintln!(
                    "a launch of {nb} blocks a lane over {remote} connection(s) in another \
                     device's memory without native atomics"
                );
                return 1;
            }
        }
    }
    unsafe { device::launch(f, gx, gy, gz, bx, by, bz, shm, s, params, extra) }
}
/// The test's buffers are pinned host memory (`CU_MEMORYTYPE_HOST`): either device reaches
/// them.
unsafe extern "C" fn pointer_attr(v: *mut c_void, a: c_int, _: u64) -> CUresult {
    unsafe { *(v as *mut c_uint) = if a == 9 || a == 8 { 0 } else { 1 } };
    OK
}
super::stand_in::pointer_attrs_over!(super::stand_in, pointer_attr);

/// The functions above, by symbol, for `device::stand_in_with`.
pub fn functions() -> Vec<(&'static str, *const c_void)> {
    vec![
        ("cuDeviceGetCount", count as *const c_void),
        ("cuModuleLoadData", module_load as *const c_void),
        ("cuModuleGetFunction", get_function as *const c_void),
        ("cuDevicePrimaryCtxRetain", retain as *const c_void),
        ("cuCtxGetDevice", ctx_device as *const c_void),
        ("cuDeviceCanAccessPeer", can_access as *const c_void),
        ("cuDeviceGetP2PAttribute", p2p_attr as *const c_void),
        ("cuCtxEnablePeerAccess", enable_peer_access as *const c_void),
        ("cuMemAlloc_v2", mem_alloc as *const c_void),
        ("cuLaunchKernel", launch as *const c_void),
        ("cuDeviceGetPCIBusId", pci_bus_id as *const c_void),
        ("cuPointerGetAttributes", pointer_attrs as *const c_void),
    ]
}
