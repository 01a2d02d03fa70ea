//! Same-host connections: a POSIX shared memory segment, created by whichever end comes first,
//! unlinked as soon as both ends have mapped it (or when the comm goes), so a crash leaves
//! nothing behind in /dev/shm once both sides attached.

use super::peer::PeerInfo;
use super::{ConnSpec, Endpoint, Locality, Named, Transport};
use crate::error::{Error, Result};
use nix::fcntl::OFlag;
use nix::sys::mman::{mmap, munmap, shm_open, shm_unlink, MapFlags, ProtFlags};
use nix::sys::stat::Mode;
use std::num::NonZeroUsize;
use std::ptr::NonNull;

pub struct ShmRegion {
    ptr: NonNull<std::ffi::c_void>,
    len: usize,
    name: String,
    /// On the CUDA executor with `OXCCL_CUDA_IPC=1`, between ranks on one GPU: the connection
    /// in device memory (the receiving end's allocation, which the sending end opens by its IPC
    /// handle); the segment then only serves the host's bookkeeping.
    dev: once_cell::sync::OnceCell<DevSide>,
}

/// A connection in device memory, as one end holds it.
enum DevSide {
    Own(crate::gpu::memory::DevConn),
    Opened(crate::gpu::memory::IpcConn),
}

// SAFETY: the mapping lives as long as the region; access goes through the protocol's atomics.
unsafe impl Send for ShmRegion {}
// SAFETY: as above.
unsafe impl Sync for ShmRegion {}

impl ShmRegion {
    pub fn open(name: &str, len: usize) -> Result<ShmRegion> {
        super::check_size(len)?;
        let path = format!("/{name}");
        let fd = shm_open(
            path.as_str(),
            OFlag::O_CREAT | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(|e| Error::os(format!("shm_open {path}"), e))?;
        // Both ends truncate to the same size: the second call changes nothing.
        nix::unistd::ftruncate(&fd, len as i64)
            .map_err(|e| Error::os(format!("ftruncate {path} to {len} bytes"), e))?;
        // SAFETY: a fresh shared mapping of a file we own, length checked non-zero.
        let ptr = unsafe {
            mmap(
                None,
                NonZeroUsize::new(len).expect("non-zero"),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| Error::os(format!("mmap {path} ({len} bytes)"), e))?;
        // Kernels of the CUDA executor read and write connection memory.
        if let Err(e) = crate::gpu::memory::pin_if_cuda(ptr.as_ptr() as *mut u8, len) {
            // SAFETY: mapped just above.
            let _ = unsafe { munmap(ptr, len) };
            return Err(e.context(format!("shared memory {path}")));
        }
        Ok(ShmRegion {
            ptr,
            len,
            name: path,
            dev: once_cell::sync::OnceCell::new(),
        })
    }

    /// The device addresses of (header, slots), where the connection lives in device memory.
    pub fn device_conn(&self) -> Option<(u64, u64)> {
        self.dev.get().map(|d| match d {
            DevSide::Own(c) => (c.hdr, c.slots),
            DevSide::Opened(c) => (c.hdr, c.slots),
        })
    }

    /// The receiving end: puts the connection (`hdr_bytes` of header, `slot_bytes` of slots)
    /// in device memory of the current device; its IPC handle, for the sending end.
    pub fn use_device_memory(&self, hdr_bytes: usize, slot_bytes: usize) -> Result<[u8; 64]> {
        let c = crate::gpu::memory::DevConn::alloc(hdr_bytes, slot_bytes)?;
        let h = c.ipc_handle()?;
        self.dev
            .set(DevSide::Own(c))
            .map_err(|_| Error::internal("a connection put in device memory twice"))?;
        Ok(h)
    }

    /// The sending end: opens the receiving end's connection in device memory by `handle`.
    pub fn open_device_memory(&self, handle: &[u8; 64], hdr_bytes: usize) -> Result<()> {
        let c = crate::gpu::memory::IpcConn::open(handle, hdr_bytes)?;
        self.dev
            .set(DevSide::Opened(c))
            .map_err(|_| Error::internal("a connection put in device memory twice"))
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr() as *mut u8
    }

    pub fn unlink(&self) {
        let _ = shm_unlink(self.name.as_str());
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        crate::gpu::memory::unpin_if_cuda(self.ptr.as_ptr() as *mut u8);
        // SAFETY: mapped in `open` with this length, not used after drop.
        let _ = unsafe { munmap(self.ptr, self.len) };
    }
}

/// The same-host transport (other processes).
pub struct Shm;

impl Transport for Shm {
    fn name(&self) -> &'static str {
        "shared memory"
    }
    fn reaches(&self, me: &PeerInfo, peer: &PeerInfo) -> bool {
        Locality::of(me, peer) == Locality::SameHost
    }
    fn setup(&self, spec: &ConnSpec) -> Result<(Box<dyn Endpoint>, Vec<u8>)> {
        Named::setup(spec, true)
    }
}
