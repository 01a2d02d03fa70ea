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
        })
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
