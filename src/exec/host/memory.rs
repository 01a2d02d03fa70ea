//! `ncclMemAlloc` / `ncclMemFree` on the host executor: page-aligned memory backed by a memfd,
//! so that peers in other processes can map the same pages.

use crate::error::{Error, Result};
use crate::transport::board::BufInfo;
use nix::sys::mman::munmap;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsRawFd;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

struct Alloc {
    len: usize,
    id: u64,
    fd: OwnedFd,
}

/// Live allocations by base address.
static ALLOCS: Mutex<BTreeMap<usize, Alloc>> = Mutex::new(BTreeMap::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub fn alloc(size: usize) -> Result<usize> {
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
    let p = crate::transport::shm::map_shared(&fd, len)
        .map_err(|e| Error::os(format!("ncclMemAlloc: mmap of {size} bytes"), e))?;
    let addr = p.as_ptr() as usize;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    ALLOCS.lock().insert(addr, Alloc { len, id, fd });
    Ok(addr)
}

pub fn free(ptr: usize) -> Result<()> {
    if ptr == 0 {
        return Ok(());
    }
    let a = ALLOCS.lock().remove(&ptr).ok_or_else(|| {
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

/// How a peer process can reach `bytes` bytes at `addr`: through the `ncclMemAlloc` allocation
/// holding them, if there is one.
pub fn describe(addr: usize, bytes: usize) -> BufInfo {
    let allocs = ALLOCS.lock();
    let mut info = BufInfo {
        addr: addr as u64,
        ..BufInfo::default()
    };
    if let Some((&base, a)) = allocs.range(..=addr).next_back() {
        if addr + bytes <= base + a.len {
            info.alloc_id = a.id;
            info.fd = a.fd.as_raw_fd() as u64;
            info.base = base as u64;
            info.len = a.len as u64;
        }
    }
    info
}

struct Mapping {
    ptr: NonNull<std::ffi::c_void>,
    len: usize,
}

// SAFETY: a shared mapping owned by this struct; peers synchronise through the board.
unsafe impl Send for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped by `PeerMaps::resolve` with this length.
        let _ = unsafe { munmap(self.ptr, self.len) };
    }
}

/// Peers' `ncclMemAlloc` allocations mapped into this process, by (process key, allocation id).
#[derive(Default)]
pub struct PeerMaps {
    maps: Mutex<HashMap<(u64, u64), Mapping>>,
}

impl PeerMaps {
    /// The local address of a buffer of the process of `key` (`liveness::my_process_key`): its own
    /// address when that is this process, a mapping of its allocation when it has one and is
    /// in this process's PID namespace; None when it cannot be reached.
    pub fn resolve(&self, key: u64, info: &BufInfo) -> Result<Option<usize>> {
        use crate::liveness::{my_process_key, pid_of_key};
        if key == my_process_key() {
            return Ok(Some(info.addr as usize));
        }
        let Some(pid) = pid_of_key(key).filter(|_| info.alloc_id != 0) else {
            return Ok(None);
        };
        let mut maps = self.maps.lock();
        let key = (key, info.alloc_id);
        if let std::collections::hash_map::Entry::Vacant(slot) = maps.entry(key) {
            let path = format!("/proc/{pid}/fd/{}", info.fd);
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| {
                    Error::os(format!("mapping a peer's ncclMemAlloc buffer ({path})"), e)
                })?;
            let len = info.len as usize;
            if f.metadata().map(|m| m.len()).unwrap_or(0) != len as u64 {
                return Err(Error::system(format!(
                    "{path} is not the peer's allocation of {len} bytes"
                )));
            }
            // The peer's memfd, of its full length.
            let ptr = crate::transport::shm::map_shared(&f, len)
                .map_err(|e| Error::os(format!("mmap of {path}"), e))?;
            slot.insert(Mapping { ptr, len });
        }
        let m = &maps[&key];
        Ok(Some(
            m.ptr.as_ptr() as usize + (info.addr - info.base) as usize,
        ))
    }
}
