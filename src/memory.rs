//! `ncclMemAlloc` / `ncclMemFree` on the host executor: page-aligned memory backed by a memfd,
//! so that peers in other processes can map the same pages.

use crate::error::{Error, Result};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;

struct Alloc {
    len: usize,
    _fd: OwnedFd,
}

static ALLOCS: Mutex<Option<HashMap<usize, Alloc>>> = Mutex::new(None);

pub fn alloc(size: usize) -> Result<usize> {
    if size == 0 {
        return Err(Error::invalid_argument("ncclMemAlloc: size is 0"));
    }
    let page = 4096usize;
    let len = size
        .checked_add(page - 1)
        .map(|s| s & !(page - 1))
        .ok_or_else(|| Error::invalid_argument(format!("ncclMemAlloc: size {size} too large")))?;
    let fd =
        nix::sys::memfd::memfd_create(c"oxccl-mem", nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC)
            .map_err(|e| Error::os("ncclMemAlloc: memfd_create", e))?;
    nix::unistd::ftruncate(&fd, len as i64)
        .map_err(|e| Error::os(format!("ncclMemAlloc: cannot allocate {size} bytes"), e))?;
    // SAFETY: a fresh shared mapping of our own memfd, non-zero length.
    let p = unsafe {
        mmap(
            None,
            NonZeroUsize::new(len).expect("non-zero"),
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
            &fd,
            0,
        )
    }
    .map_err(|e| Error::os(format!("ncclMemAlloc: mmap of {size} bytes"), e))?;
    let addr = p.as_ptr() as usize;
    ALLOCS
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(addr, Alloc { len, _fd: fd });
    Ok(addr)
}

pub fn free(ptr: usize) -> Result<()> {
    if ptr == 0 {
        return Ok(());
    }
    let a = ALLOCS
        .lock()
        .as_mut()
        .and_then(|m| m.remove(&ptr))
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "ncclMemFree: {ptr:#x} was not returned by ncclMemAlloc (or is already freed)"
            ))
        })?;
    // SAFETY: `ptr` and `len` are a mapping made by `alloc` and removed from the table above.
    unsafe {
        munmap(
            NonNull::new(ptr as *mut std::ffi::c_void).expect("non-null"),
            a.len,
        )
    }
    .map_err(|e| Error::os("ncclMemFree: munmap", e))
}
