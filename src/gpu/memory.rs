//! Memory the GPU reaches, for the layers below the executors: host memory pinned and mapped
//! into every device (connection regions, which the kernels and proxy threads both reach; the
//! control blocks of communicators), and connection slots in device memory.

use super::driver::{self, check, CtxGuard};
use crate::error::{Error, Result};

/// The host memory `pin_host` pinned, by address: the context it was pinned in (None where
/// someone else had pinned it already: theirs to undo) and how many pins hold it (ranks of one
/// process may pin the same mapping).
#[derive(Default)]
struct Pins(std::collections::HashMap<usize, (Option<usize>, usize)>);

impl Pins {
    /// Counts another pin of `addr`: false where it is the first (to be pinned now, then
    /// `record`ed).
    fn add(&mut self, addr: usize) -> bool {
        match self.0.get_mut(&addr) {
            Some(e) => {
                e.1 += 1;
                true
            }
            None => false,
        }
    }

    fn record(&mut self, addr: usize, ctx: Option<usize>) {
        self.0.insert(addr, (ctx, 1));
    }

    /// Counts an unpin of `addr`: the context to unpin it in, where this was the last pin and
    /// the pinning was ours.
    fn remove(&mut self, addr: usize) -> Option<usize> {
        let e = self.0.get_mut(&addr)?;
        e.1 -= 1;
        if e.1 > 0 {
            return None;
        }
        self.0.remove(&addr)?.0
    }
}

static PINS: once_cell::sync::Lazy<parking_lot::Mutex<Pins>> =
    once_cell::sync::Lazy::new(Default::default);

/// Pins `len` bytes of host memory at `ptr` and maps them into every device (the device sees
/// them at the same address: unified addressing).
pub fn pin_host(ptr: *mut u8, len: usize) -> Result<()> {
    let api = driver::api()?;
    let mut pins = PINS.lock();
    if pins.add(ptr as usize) {
        return Ok(());
    }
    // In the current context (a communicator's, entered by whoever makes connections); device
    // 0's only where there is none. PORTABLE maps the memory into every context anyway.
    let ctx = current_or_device0()?;
    let _g = CtxGuard::enter(ctx)?;
    driver::relaxed(|| {
        // SAFETY: the caller's mapping of `len` bytes, unpinned before it goes (`unpin_host`).
        let r = unsafe {
            (api.host_register)(
                ptr as *mut std::ffi::c_void,
                len,
                driver::CU_MEMHOSTREGISTER_PORTABLE | driver::CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        };
        if r == driver::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED {
            pins.record(ptr as usize, None);
            return Ok(());
        }
        check(r, || {
            format!("pinning {len} bytes of host memory at {ptr:p} (cuMemHostRegister)")
        })?;
        let mut d: driver::CUdeviceptr = 0;
        // SAFETY: registered just above.
        let r = check(
            unsafe { (api.host_device_pointer)(&mut d, ptr as *mut std::ffi::c_void, 0) },
            || "cuMemHostGetDevicePointer".into(),
        )
        .and_then(|_| match d as usize == ptr as usize {
            true => Ok(()),
            false => Err(Error::internal(format!(
                "pinned host memory at {ptr:p} is at {d:#x} on the device (oxccl needs unified \
                 addressing)"
            ))),
        });
        match r {
            Ok(()) => pins.record(ptr as usize, Some(ctx)),
            // Not left registered: a later mapping at this address would be taken as pinned.
            // SAFETY: registered just above, not used.
            Err(_) => unsafe {
                (api.host_unregister)(ptr as *mut std::ffi::c_void);
            },
        }
        r
    })
}

/// The calling thread's current context, else device 0's primary context.
fn current_or_device0() -> Result<usize> {
    let api = driver::api()?;
    let mut ctx: driver::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one pointer.
    check(unsafe { (api.ctx_get_current)(&mut ctx) }, || {
        "cuCtxGetCurrent".into()
    })?;
    if ctx.is_null() {
        driver::primary_context(0)
    } else {
        Ok(ctx as usize)
    }
}

/// Whether kernels on devices `a` and `b` (ordinals of this process, different) can reach each
/// other's memory (`cuDeviceCanAccessPeer`, both ways) and are near enough for
/// `NCCL_P2P_LEVEL` (NVLink, told by native peer atomics, always is; over PCIe, at most
/// `param::p2p_max_pcie` apart, by `topo::level`, unknown counting as SYS): ranks on them keep
/// their connections in the receiving end's device memory. Decided once per pair (an INFO line
/// says how).
pub fn peers_capable(a: i32, b: i32) -> bool {
    static PAIRS: Pairs = parking_lot::Mutex::new(None);
    if a < 0 || b < 0 || a == b || crate::param::p2p_disabled() {
        return false;
    }
    once_per_pair(&PAIRS, a, b, || decide_peers(a, b))
}

/// `peers_capable`'s decision, told in an INFO line.
fn decide_peers(a: i32, b: i32) -> bool {
    let Ok(api) = driver::api() else {
        return false;
    };
    let can = |x: i32, y: i32| {
        let mut c = 0;
        // SAFETY: writes one int; both are device ordinals of this process.
        let r = unsafe { (api.device_can_access_peer)(&mut c, x, y) };
        r == driver::CUDA_SUCCESS && c != 0
    };
    let max = crate::param::p2p_max_pcie();
    let (ok, how) = if !(can(a, b) && can(b, a)) {
        (false, "do not reach each other's memory".to_string())
    } else if native_atomics(a, b) {
        (true, "reach each other's memory over NVLink".to_string())
    } else {
        let level = super::topo::level(a, b);
        let ok = level.map_or(max >= 4, |l| l as u8 <= max);
        let apart = match level {
            Some(l) => format!("{} apart", crate::param::p2p_level_name(l as u8)),
            None => "at a distance sysfs does not tell (taken as SYS)".to_string(),
        };
        let allowed = crate::param::p2p_level_name(max);
        (
            ok,
            format!(
                "reach each other's memory over PCIe, {apart} (NCCL_P2P_LEVEL allows up to \
                 {allowed})"
            ),
        )
    };
    crate::debug::info(&format!(
        "devices {a} and {b} {how}: connections between their ranks {}",
        if ok {
            "live in device memory"
        } else {
            "stage in host memory"
        }
    ));
    ok
}

/// Answers by unordered pair of devices.
type Pairs = parking_lot::Mutex<Option<std::collections::HashMap<(i32, i32), bool>>>;

/// The answer `table` keeps for devices `a` and `b` in either order, `decide` made the first
/// time (under the table's lock: every caller gets the first answer).
fn once_per_pair(table: &Pairs, a: i32, b: i32, decide: impl FnOnce() -> bool) -> bool {
    let mut t = table.lock();
    *t.get_or_insert_with(std::collections::HashMap::new)
        .entry((a.min(b), a.max(b)))
        .or_insert_with(decide)
}

/// Whether atomics of kernels on device `a` on device `b`'s memory are native, both ways
/// (NVLink; not PCIe): only then do several blocks of a lane send over one connection in the
/// other's memory (they count themselves in with atomics on its header: `Conn::shared_blocks`).
pub fn native_atomics(a: i32, b: i32) -> bool {
    let Ok(api) = driver::api() else {
        return false;
    };
    let native = |x: i32, y: i32| {
        let mut v = 0;
        // SAFETY: writes one int; both are device ordinals of this process.
        let r = unsafe {
            (api.device_p2p_attr)(
                &mut v,
                driver::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                x,
                y,
            )
        };
        r == driver::CUDA_SUCCESS && v != 0
    };
    a >= 0 && b >= 0 && native(a, b) && native(b, a)
}

/// The ordinal, in this process, of the GPU of `uuid` (None: it does not see it).
pub fn device_of_uuid(uuid: &[u8; 16]) -> Option<i32> {
    let n = driver::device_count().ok()?;
    (0..n).find(|&d| driver::device_uuid(d).ok().as_ref() == Some(uuid))
}

/// Whether the primary contexts of devices `a` and `b` (ordinals of this process) reach each
/// other's memory, peer access enabled both ways (once per pair in the process: every later
/// call gives the first one's answer, so both ends of a connection decide alike). A refusal
/// (`CUDA_ERROR_TOO_MANY_PEERS` past the hardware's limit, say) is a WARN, and their ranks'
/// connections stage in host memory rather than fail.
pub fn peer_access(a: i32, b: i32) -> bool {
    static PAIRS: Pairs = parking_lot::Mutex::new(None);
    once_per_pair(&PAIRS, a, b, || enable_both(a, b))
}

/// `peer_access`'s decision.
fn enable_both(a: i32, b: i32) -> bool {
    // (A communicator's context is its device's primary context.)
    let enable = |from: i32, to: i32| -> Result<()> {
        let (f, t) = (driver::primary_context(from)?, driver::primary_context(to)?);
        enable_peer_access(f, t, &format!("from device {from} to device {to}"))
    };
    match enable(a, b).and_then(|_| enable(b, a)) {
        Ok(()) => true,
        Err(e) => {
            crate::debug::warn(&format!(
                "{}: ranks on devices {a} and {b} stage their data in host memory",
                e.msg
            ));
            false
        }
    }
}

/// Peer access from context `from` to context `to` (`cuCtxEnablePeerAccess`; one enabled
/// before is fine). `what` says which, for the error.
fn enable_peer_access(from: usize, to: usize, what: &str) -> Result<()> {
    let api = driver::api()?;
    let _g = CtxGuard::enter(from)?;
    driver::relaxed(|| {
        // SAFETY: two live contexts (the current one and the peer's).
        let r = unsafe { (api.ctx_enable_peer_access)(to as _, 0) };
        if r == driver::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check(r, || format!("cuCtxEnablePeerAccess {what}"))
    })
}

/// Undoes `pin_host` (before the memory is freed or unmapped): the last pin of an address is
/// undone in the context it was made in (never one made now, whatever thread tears down).
pub fn unpin_host(ptr: *mut u8) {
    let Some(ctx) = PINS.lock().remove(ptr as usize) else {
        return;
    };
    if let Ok(api) = driver::api() {
        if let Ok(_g) = CtxGuard::enter(ctx) {
            // (Relaxed: a stream of another thread may capture a graph now.)
            let _ = driver::relaxed(|| {
                // SAFETY: memory pinned by `pin_host`, still mapped.
                unsafe { (api.host_unregister)(ptr as *mut std::ffi::c_void) };
                Ok(())
            });
        }
    }
}

/// Pins `ptr` when the CUDA executor runs this process (connection regions): kernels read and
/// write it.
pub fn pin_if_cuda(ptr: *mut u8, len: usize) -> Result<()> {
    match super::kind() {
        super::Kind::Cuda => pin_host(ptr, len),
        super::Kind::Host => Ok(()),
    }
}

pub fn unpin_if_cuda(ptr: *mut u8) {
    if super::kind() == super::Kind::Cuda {
        unpin_host(ptr)
    }
}

/// Maps allocation `handle` (`size` bytes, whole) at a range reserved for it (aligned to
/// `align`; 0: the driver's choice) with `access`: its address. Undoes its own steps when one
/// fails (the handle stays the caller's).
pub fn map_handle(
    api: &driver::Api,
    handle: u64,
    size: usize,
    align: usize,
    access: &[driver::CUmemAccessDesc],
) -> Result<driver::CUdeviceptr> {
    let mut p: driver::CUdeviceptr = 0;
    // SAFETY: writes one address; a fresh range of `size`.
    check(
        unsafe { (api.mem_address_reserve)(&mut p, size, align, 0, 0) },
        || format!("cuMemAddressReserve of {size} bytes"),
    )?;
    // SAFETY: the whole allocation at the start of the range just reserved.
    check(unsafe { (api.mem_map)(p, size, 0, handle, 0) }, || {
        "cuMemMap".into()
    })
    .and_then(|_| {
        // SAFETY: the range mapped above; `access` holds that many descriptors.
        check(
            unsafe { (api.mem_set_access)(p, size, access.as_ptr(), access.len()) },
            || "cuMemSetAccess".into(),
        )
        .inspect_err(|_| {
            // SAFETY: mapped above, unused.
            unsafe { (api.mem_unmap)(p, size) };
        })
    })
    .inspect_err(|_| {
        // SAFETY: reserved above, nothing mapped there now.
        unsafe { (api.mem_address_free)(p, size) };
    })?;
    Ok(p)
}

/// Device memory of the calling thread's current context (the communicator's, entered by
/// whoever makes it), else device 0's, zeroed before use; freed when dropped.
pub struct DevMem {
    pub ptr: u64,
    ctx: usize,
}

impl DevMem {
    /// `bytes`, zeroed (`what` names them in an error).
    pub fn zeroed(bytes: usize, what: &str) -> Result<DevMem> {
        DevMem::alloc_with(bytes, what, |_, _| Ok(()))
    }

    /// `bytes`, zeroed, then `init(ptr, stream)` (more writes on the same stream).
    ///
    /// The writes go to a private non-blocking stream, which is synchronized: legal even while
    /// a caller's stream captures a graph (the legacy stream's synchronous copies would join,
    /// and spoil, the capture).
    fn alloc_with(
        bytes: usize,
        what: &str,
        init: impl FnOnce(u64, driver::CUstream) -> Result<()>,
    ) -> Result<DevMem> {
        let api = driver::api()?;
        let ctx = current_or_device0()?;
        let _g = CtxGuard::enter(ctx)?;
        let m = driver::relaxed(|| {
            let mut p: driver::CUdeviceptr = 0;
            // SAFETY: writes one device pointer.
            check(unsafe { (api.mem_alloc)(&mut p, bytes) }, || {
                format!("cuMemAlloc of {bytes} bytes for {what}")
            })?;
            Ok(DevMem { ptr: p, ctx })
        })?;
        m.fill(bytes, what, init)?;
        Ok(m)
    }

    /// Zeroes its first `bytes` again (a spare's reuse, `exec::cuda::spare`).
    pub fn zero(&self, bytes: usize) -> Result<()> {
        let _g = CtxGuard::enter(self.ctx)?;
        self.fill(bytes, "spare device memory", |_, _| Ok(()))
    }

    /// Zeroes its first `bytes`, then `init(ptr, stream)`, on a private stream it waits for
    /// (in its context, current).
    fn fill(
        &self,
        bytes: usize,
        what: &str,
        init: impl FnOnce(u64, driver::CUstream) -> Result<()>,
    ) -> Result<()> {
        let api = driver::api()?;
        let p = self.ptr;
        driver::relaxed(|| {
            let mut st: driver::CUstream = std::ptr::null_mut();
            // SAFETY: writes one stream handle.
            check(
                unsafe { (api.stream_create)(&mut st, driver::CU_STREAM_NON_BLOCKING) },
                || "cuStreamCreate".into(),
            )?;
            // SAFETY: the memory just allocated; the stream made above, destroyed once.
            let r = check(unsafe { (api.memset_d8_async)(p, 0, bytes, st) }, || {
                format!("cuMemsetD8Async of {what}")
            })
            .and_then(|_| init(p, st))
            .and_then(|_| {
                // SAFETY: the stream made above.
                check(unsafe { (api.stream_synchronize)(st) }, || {
                    "cuStreamSynchronize".into()
                })
            });
            // SAFETY: as above.
            unsafe { (api.stream_destroy)(st) };
            r
        })
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        if let (Ok(api), Ok(_g)) = (driver::api(), CtxGuard::enter(self.ctx)) {
            // (Relaxed: another thread's graph capture in global mode would refuse it, and
            // be spoiled.)
            let _ = driver::relaxed(|| {
                // SAFETY: allocated in `alloc_with`, freed once, when nothing uses it any more.
                unsafe { (api.mem_free)(self.ptr) };
                Ok(())
            });
        }
    }
}

/// A connection kept wholly in device memory: its header (counters, slot metadata) and its
/// slots, so that kernels on the device poll and move it at device speed (freed with the
/// connection's region). Between ranks of one process both ends use it; between processes on
/// one GPU the receiving end allocates it and the sending end opens it by its IPC handle
/// (`ipc_handle`, `IpcConn`). The attach count is 2 from the start: both ends exist once the
/// connection does.
pub struct DevConn {
    pub hdr: u64,
    pub slots: u64,
    mem: DevMem,
}

/// Where a connection header keeps its attach count (`transport`'s layout).
const ATTACH_OFF: u64 = 128;

impl DevConn {
    /// `hdr_bytes` of header and `slot_bytes` of slots in the calling thread's current context
    /// (the communicator's, entered by whoever makes connections), else device 0's.
    pub fn alloc(hdr_bytes: usize, slot_bytes: usize) -> Result<DevConn> {
        let api = driver::api()?;
        // (The slots are zeroed too: one memset, not two calls.)
        let mem = DevMem::alloc_with(hdr_bytes + slot_bytes, "a connection", |p, st| {
            // SAFETY: 4 bytes inside the header.
            check(
                unsafe { (api.memset_d32_async)(p + ATTACH_OFF, 2, 1, st) },
                || "cuMemsetD32Async of a connection header".into(),
            )
        })?;
        Ok(DevConn {
            hdr: mem.ptr,
            slots: mem.ptr + hdr_bytes as u64,
            mem,
        })
    }

    /// The handle another process opens this allocation by (`IpcConn::open`).
    pub fn ipc_handle(&self) -> Result<[u8; 64]> {
        let api = driver::api()?;
        let _g = CtxGuard::enter(self.mem.ctx)?;
        driver::relaxed(|| {
            let mut h = driver::CUipcMemHandle { reserved: [0; 64] };
            // SAFETY: writes one handle; `hdr` is the allocation's base.
            check(
                unsafe { (api.ipc_get_mem_handle)(&mut h, self.hdr) },
                || "cuIpcGetMemHandle of a connection in device memory".into(),
            )?;
            Ok(h.reserved)
        })
    }
}

/// Another process's `DevConn`, opened by its IPC handle in the current context (the
/// communicator's), else device 0's; closed when dropped.
pub struct IpcConn {
    pub hdr: u64,
    pub slots: u64,
    ctx: usize,
}

impl IpcConn {
    /// Opens `handle`, whose allocation holds `hdr_bytes` of header, then the slots.
    pub fn open(handle: &[u8; 64], hdr_bytes: usize) -> Result<IpcConn> {
        let api = driver::api()?;
        let ctx = current_or_device0()?;
        let _g = CtxGuard::enter(ctx)?;
        driver::relaxed(|| {
            let mut p: driver::CUdeviceptr = 0;
            let h = driver::CUipcMemHandle { reserved: *handle };
            // SAFETY: writes one device pointer; the handle came from the peer's
            // cuIpcGetMemHandle.
            check(
                unsafe {
                    (api.ipc_open_mem_handle)(&mut p, h, driver::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                },
                || "cuIpcOpenMemHandle of the peer's connection in device memory".into(),
            )?;
            Ok(IpcConn {
                hdr: p,
                slots: p + hdr_bytes as u64,
                ctx,
            })
        })
    }
}

impl Drop for IpcConn {
    fn drop(&mut self) {
        if let (Ok(api), Ok(_g)) = (driver::api(), CtxGuard::enter(self.ctx)) {
            // (Relaxed, as `DevMem`'s free.)
            let _ = driver::relaxed(|| {
                // SAFETY: opened in `open`, closed once.
                unsafe { (api.ipc_close_mem_handle)(self.hdr) };
                Ok(())
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Pins;

    /// An address pinned twice is unpinned once, at its last unpin, in the context it was
    /// pinned in; one someone else had pinned is never unpinned; an unknown one is left alone.
    #[test]
    fn pins_are_counted_and_undone_where_made() {
        let mut p = Pins::default();
        assert!(!p.add(0x1000));
        p.record(0x1000, Some(7));
        assert!(p.add(0x1000));
        assert_eq!(p.remove(0x1000), None);
        assert_eq!(p.remove(0x1000), Some(7));
        assert_eq!(p.remove(0x1000), None);
        assert!(!p.add(0x1000), "pinned anew after the last unpin");
        assert!(!p.add(0x2000));
        p.record(0x2000, None);
        assert_eq!(p.remove(0x2000), None);
        assert!(!p.add(0x2000), "forgotten after its last unpin");
        assert_eq!(p.remove(0x3000), None);
    }
}
