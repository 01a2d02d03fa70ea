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
use std::ffi::{c_int, c_uint, c_void};
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
/// (context, peer context) of each `cuCtxEnablePeerAccess` that enabled it.
pub static ENABLED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

fn current() -> usize {
    let api = driver::api().expect("the stand-in driver");
    let mut c: driver::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one pointer.
    unsafe { (api.ctx_get_current)(&mut c) };
    c as usize
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
    let c = current().max(0x1000);
    unsafe { *d = ((c - 0x1000) / 0x100) as c_int };
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
    let pair = (current(), peer as usize);
    let mut e = ENABLED.lock();
    if e.contains(&pair) {
        return driver::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    }
    e.push(pair);
    OK
}
unsafe extern "C" fn mem_alloc(p: *mut u64, n: usize) -> CUresult {
    ALLOCATED.lock().push((current(), n));
    unsafe { device::mem_alloc(p, n) }
}
/// The test's buffers are pinned host memory (`CU_MEMORYTYPE_HOST`): either device reaches
/// them.
unsafe extern "C" fn pointer_attr(v: *mut c_void, a: c_int, _: u64) -> CUresult {
    unsafe { *(v as *mut c_uint) = if a == 9 { 0 } else { 1 } };
    OK
}

/// The functions above, by symbol, for `device::stand_in_with`.
pub fn functions() -> Vec<(&'static str, *const c_void)> {
    vec![
        ("cuDeviceGetCount", count as *const c_void),
        ("cuDevicePrimaryCtxRetain", retain as *const c_void),
        ("cuCtxGetDevice", ctx_device as *const c_void),
        ("cuDeviceCanAccessPeer", can_access as *const c_void),
        ("cuDeviceGetP2PAttribute", p2p_attr as *const c_void),
        ("cuCtxEnablePeerAccess", enable_peer_access as *const c_void),
        ("cuMemAlloc_v2", mem_alloc as *const c_void),
        ("cuPointerGetAttribute", pointer_attr as *const c_void),
    ]
}
