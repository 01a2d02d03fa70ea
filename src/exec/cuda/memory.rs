//! `ncclMemAlloc` on the CUDA executor: device memory of the calling thread's current device.
//! (Pinned host memory and connection slots in device memory are `gpu::memory`'s.)
//!
//! As NCCL does (unless `NCCL_CUMEM_ENABLE=0`), the memory comes from the driver's virtual
//! memory management: physical memory made with `cuMemCreate`, exportable as a POSIX file
//! descriptor where the device supports it (the kind of handle peers on this host import) and
//! registrable by an RDMA NIC where it allows that, mapped at an address range reserved for it
//! and made readable and writable by the device and by every device that can reach it as a
//! peer; the size is rounded up to the allocation granularity. A device without those calls, or a
//! step that fails, gives plain `cuMemAlloc` memory instead (`NCCL_DEBUG=INFO` says why).

use crate::error::{Error, Result};
use crate::gpu::driver::{self, check, Api, CUdeviceptr, CtxGuard};
use parking_lot::Mutex;
use std::collections::HashMap;

/// How an allocation was made, to free it the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `cuMemAlloc`.
    Plain,
    /// `cuMemCreate` (`handle`) mapped at a reservation of `size` bytes.
    Mapped { handle: u64, size: usize },
}

/// One live allocation: its device, how it was made, the bytes asked for.
type Alloc = (i32, Kind, usize);

/// Live `ncclMemAlloc` allocations by address.
static ALLOCS: Mutex<Option<HashMap<usize, Alloc>>> = Mutex::new(None);

/// The device of the `ncclMemAlloc` allocation `addr` lies in, if it does (a buffer check
/// that the driver's pointer query cannot answer falls back on this).
pub fn device_of(addr: usize) -> Option<i32> {
    let a = ALLOCS.lock();
    a.as_ref()?
        .iter()
        // Mapped memory only: a cuMemAlloc allocation the driver no longer knows was freed
        // behind our back (cudaFree, a reset context), and must fail the check.
        .find(|(&p, &(_, k, n))| matches!(k, Kind::Mapped { .. }) && p <= addr && addr < p + n)
        .map(|(_, &(d, _, _))| d)
}

/// `NCCL_CUMEM_ENABLE` (NCCL's meaning; default 1).
fn cumem_enabled() -> bool {
    crate::param::get_u64("NCCL_CUMEM_ENABLE") != 0
}

pub fn alloc(bytes: usize) -> Result<usize> {
    let api = driver::api()?;
    let dev = driver::current_device()?;
    let _g = CtxGuard::enter(driver::primary_context(dev)?)?;
    let mapped = if cumem_enabled() {
        match map_new(api, dev, bytes) {
            Ok(m) => Some(m),
            Err(e) => {
                crate::debug::info(&format!(
                    "ncclMemAlloc: cuMem allocation of {bytes} bytes on device {dev} not made \
                     ({}); using cuMemAlloc",
                    e.msg
                ));
                None
            }
        }
    } else {
        None
    };
    let (p, kind) = match mapped {
        Some((p, handle, size)) => {
            crate::debug::info(&format!(
                "ncclMemAlloc: {bytes} bytes on device {dev} at {p:#x}: cuMem, {size} mapped"
            ));
            crate::transport::registered::note_mapped(p, size, dev, handle);
            (p, Kind::Mapped { handle, size })
        }
        None => {
            let mut p: CUdeviceptr = 0;
            // SAFETY: writes one device pointer.
            check(unsafe { (api.mem_alloc)(&mut p, bytes) }, || {
                format!("ncclMemAlloc: cuMemAlloc of {bytes} bytes on device {dev}")
            })?;
            (p, Kind::Plain)
        }
    };
    ALLOCS
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(p as usize, (dev, kind, bytes));
    Ok(p as usize)
}

/// Physical memory of at least `bytes` on `dev`, mapped read-write for it: (address, the
/// allocation's handle, the mapped size). Undoes its own steps when one fails.
fn map_new(api: &Api, dev: i32, bytes: usize) -> Result<(CUdeviceptr, u64, usize)> {
    if driver::attr(
        dev,
        driver::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    )? == 0
    {
        return Err(Error::system("the device has no virtual memory management"));
    }
    let has = |a| driver::attr(dev, a).unwrap_or(0) != 0;
    let posix = has(driver::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
    let mut alloc_flags = [0u8; 8];
    // Memory an RDMA NIC may register (GPUDirect), where the device allows it.
    alloc_flags[driver::ALLOC_FLAG_GPU_DIRECT_RDMA] = u8::from(has(
        driver::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
    ));
    let location = driver::CUmemLocation {
        kind: driver::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev,
    };
    let prop = driver::CUmemAllocationProp {
        kind: driver::CU_MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: if posix {
            driver::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            driver::CU_MEM_HANDLE_TYPE_NONE
        },
        location,
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags,
    };
    let mut gran = 0usize;
    // SAFETY: writes one size; `prop` is a valid description.
    check(
        unsafe {
            (api.mem_granularity)(
                &mut gran,
                &prop,
                driver::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        },
        || "cuMemGetAllocationGranularity".into(),
    )?;
    let gran = gran.max(1);
    let size = bytes
        .checked_next_multiple_of(gran)
        .ok_or_else(|| Error::invalid_argument(format!("ncclMemAlloc: {bytes} bytes")))?;
    let mut handle = 0u64;
    // SAFETY: writes one handle; `prop` as above.
    check(
        unsafe { (api.mem_create)(&mut handle, size, &prop, 0) },
        || format!("cuMemCreate of {size} bytes"),
    )?;
    let access = access_for(api, dev);
    match crate::gpu::memory::map_handle(api, handle, size, gran, &access) {
        Ok(p) => Ok((p, handle, size)),
        Err(e) => {
            // SAFETY: created above, mapped nowhere now.
            unsafe { (api.mem_release)(handle) };
            Err(e)
        }
    }
}

/// Read-write access to memory of `dev`: for it, and for every device that can reach it as a
/// peer (as NCCL grants; peer access enabled by a program does not extend to mapped memory).
fn access_for(api: &Api, dev: i32) -> Vec<driver::CUmemAccessDesc> {
    let desc = |id| driver::CUmemAccessDesc {
        location: driver::CUmemLocation {
            kind: driver::CU_MEM_LOCATION_TYPE_DEVICE,
            id,
        },
        flags: driver::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let mut v = vec![desc(dev)];
    for peer in (0..driver::device_count().unwrap_or(1)).filter(|&d| d != dev) {
        let mut can = 0;
        // SAFETY: writes one int; both are device ordinals.
        let r = unsafe { (api.device_can_access_peer)(&mut can, peer, dev) };
        if r == driver::CUDA_SUCCESS && can != 0 {
            v.push(desc(peer));
        }
    }
    v
}

pub fn free(ptr: usize) -> Result<()> {
    if ptr == 0 {
        return Ok(());
    }
    let (dev, kind, _) = ALLOCS
        .lock()
        .get_or_insert_with(HashMap::new)
        .remove(&ptr)
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "ncclMemFree: {ptr:#x} was not allocated by ncclMemAlloc"
            ))
        })?;
    let api = driver::api()?;
    let _g = CtxGuard::enter(driver::primary_context(dev)?)?;
    let p = ptr as CUdeviceptr;
    match kind {
        // SAFETY: an allocation of ours, freed once (removed from the table above).
        Kind::Plain => check(unsafe { (api.mem_free)(p) }, || {
            format!("ncclMemFree: cuMemFree of {ptr:#x}")
        }),
        Kind::Mapped { handle, size } => {
            crate::transport::registered::forget_mapped(p);
            // SAFETY: as above: our mapping of `handle` over our reservation of `size`.
            let unmap = check(unsafe { (api.mem_unmap)(p, size) }, || {
                format!("ncclMemFree: cuMemUnmap of {ptr:#x}")
            });
            // SAFETY: as above.
            let release = check(unsafe { (api.mem_release)(handle) }, || {
                format!("ncclMemFree: cuMemRelease of {ptr:#x}")
            });
            // SAFETY: as above.
            let free = check(unsafe { (api.mem_address_free)(p, size) }, || {
                format!("ncclMemFree: cuMemAddressFree of {ptr:#x}")
            });
            unmap.and(release).and(free)
        }
    }
}
