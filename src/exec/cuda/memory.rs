//! `ncclMemAlloc` on the CUDA executor: device memory of the calling thread's current device.
//! (Pinned host memory and connection slots in device memory are `gpu::memory`'s.)

use crate::error::{Error, Result};
use crate::gpu::driver::{self, check, CtxGuard};
use parking_lot::Mutex;
use std::collections::HashMap;

/// Live `ncclMemAlloc` allocations: address -> device.
static ALLOCS: Mutex<Option<HashMap<usize, i32>>> = Mutex::new(None);

pub fn alloc(bytes: usize) -> Result<usize> {
    if bytes == 0 {
        return Err(Error::invalid_argument("ncclMemAlloc: size is 0"));
    }
    let api = driver::api()?;
    let dev = driver::current_device()?;
    let _g = CtxGuard::enter(driver::primary_context(dev)?)?;
    let mut p: driver::CUdeviceptr = 0;
    // SAFETY: writes one device pointer.
    check(unsafe { (api.mem_alloc)(&mut p, bytes) }, || {
        format!("ncclMemAlloc: cuMemAlloc of {bytes} bytes on device {dev}")
    })?;
    ALLOCS
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(p as usize, dev);
    Ok(p as usize)
}

pub fn free(ptr: usize) -> Result<()> {
    if ptr == 0 {
        return Ok(());
    }
    let dev = ALLOCS
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
    // SAFETY: an allocation of ours, freed once (removed from the table above).
    check(unsafe { (api.mem_free)(ptr as u64) }, || {
        format!("ncclMemFree: cuMemFree of {ptr:#x}")
    })
}
