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
use std::sync::atomic::Ordering;

pub struct ShmRegion {
    ptr: NonNull<std::ffi::c_void>,
    len: usize,
    name: String,
    /// Pinned for the CUDA executor's kernels (`pin`), unpinned when it goes.
    pinned: std::sync::atomic::AtomicBool,
    /// On the CUDA executor with CUDA IPC, between ranks on one GPU: the connection in device
    /// memory (the receiving end's allocation, which the sending end opens by its IPC handle),
    /// and its (header, slots) addresses; the segment then only serves the host's bookkeeping.
    dev: parking_lot::Mutex<Option<DevSide>>,
    dev_at: once_cell::sync::OnceCell<(u64, u64)>,
    /// The process of the connection's other end (see `Parked`).
    peer_pid: u32,
    /// Its device memory is left as it is (`abandon`).
    abandoned: std::sync::atomic::AtomicBool,
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

/// A shared read-write mapping of the first `len` bytes of `fd` (a file of at least that size).
pub(crate) fn map_shared(
    fd: impl std::os::fd::AsFd,
    len: usize,
) -> nix::Result<NonNull<std::ffi::c_void>> {
    let len = NonZeroUsize::new(len).ok_or(nix::errno::Errno::EINVAL)?;
    // SAFETY: a fresh mapping of a file the caller holds open and that has `len` bytes (it
    // sized it, or checked its size); nothing else is at the address the kernel picks.
    unsafe {
        mmap(
            None,
            len,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
            fd,
            0,
        )
    }
}

/// Reserves the segment's memory now (posix_fallocate; the second end finds it reserved): a
/// /dev/shm too small for it is then an error that says so, where a sparse segment would
/// crash the process with SIGBUS when a slot is first written (as a container's default
/// 64 MiB /dev/shm does to NCCL users). A segment that does not fit is removed.
fn reserve(fd: &std::os::fd::OwnedFd, path: &str, len: usize) -> Result<()> {
    use nix::errno::Errno;
    use std::os::fd::AsRawFd;
    loop {
        match nix::fcntl::posix_fallocate(fd.as_raw_fd(), 0, len as i64) {
            Ok(()) => return Ok(()),
            Err(Errno::EINTR) => continue,
            // Where the filesystem cannot reserve, the memory comes as it is touched.
            Err(Errno::EOPNOTSUPP) | Err(Errno::ENODEV) => return Ok(()),
            Err(e) => {
                let _ = shm_unlink(path);
                let free = nix::sys::statvfs::statvfs("/dev/shm")
                    .map(|v| {
                        // (The counts' types differ between targets.)
                        #[allow(clippy::unnecessary_cast)]
                        let kib = |blocks| (blocks as u64 * v.fragment_size() as u64) >> 10;
                        format!(
                            " ({} KiB free of {} KiB)",
                            kib(v.blocks_available()),
                            kib(v.blocks())
                        )
                    })
                    .unwrap_or_default();
                return Err(Error::system(format!(
                    "/dev/shm{free} has no room for a shared-memory segment of {len} bytes \
                     ({path}: {e}): give it more (docker run --shm-size=1g, or a larger \
                     tmpfs), or fewer bytes per connection (OXCCL_CHUNK_BYTES, OXCCL_NSTEPS)"
                )));
            }
        }
    }
}

impl ShmRegion {
    /// Creates or opens the segment `name` of `len` bytes; `peer_pid`: the process of the
    /// other end, if another process maps it (0: none in particular).
    pub fn open(name: &str, len: usize, peer_pid: u32) -> Result<ShmRegion> {
        super::check_size(len)?;
        let path = format!("/{name}");
        let fd = shm_open(
            path.as_str(),
            OFlag::O_CREAT | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(|e| match e {
            nix::errno::Errno::ENOENT
            | nix::errno::Errno::EACCES
            | nix::errno::Errno::EPERM
            | nix::errno::Errno::EROFS => Error::system(format!(
                "shm_open {path}: {e}: processes of one host share memory through /dev/shm, \
                 which must be a writable tmpfs (a container may need its own /dev/shm mount, \
                 or --ipc=host)"
            )),
            e => Error::os(format!("shm_open {path}"), e),
        })?;
        // Both ends truncate to the same size: the second call changes nothing.
        nix::unistd::ftruncate(&fd, len as i64)
            .map_err(|e| Error::os(format!("ftruncate {path} to {len} bytes"), e))?;
        reserve(&fd, &path, len)?;
        let ptr =
            map_shared(&fd, len).map_err(|e| Error::os(format!("mmap {path} ({len} bytes)"), e))?;
        Ok(ShmRegion {
            ptr,
            len,
            name: path,
            pinned: Default::default(),
            dev: Default::default(),
            dev_at: Default::default(),
            peer_pid,
            abandoned: Default::default(),
        })
    }

    /// Pins the segment when the CUDA executor runs this process: kernels read and write it.
    pub fn pin(&self) -> Result<()> {
        if self.pinned.load(Ordering::Acquire) {
            return Ok(());
        }
        crate::gpu::memory::pin_if_cuda(self.ptr(), self.len)
            .map_err(|e| e.context(format!("shared memory {}", self.name)))?;
        self.pinned.store(true, Ordering::Release);
        Ok(())
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr() as *mut u8
    }

    pub fn unlink(&self) {
        let _ = shm_unlink(self.name.as_str());
    }

    /// The device addresses of (header, slots), where the connection lives in device memory.
    pub fn device_conn(&self) -> Option<(u64, u64)> {
        self.dev_at.get().copied()
    }

    /// The receiving end: puts the connection (`hdr_bytes` of header, `slot_bytes` of slots)
    /// in device memory of the current device; its IPC handle, for the sending end.
    pub fn use_device_memory(&self, hdr_bytes: usize, slot_bytes: usize) -> Result<[u8; 64]> {
        let c = crate::gpu::memory::DevConn::alloc(hdr_bytes, slot_bytes)?;
        let h = c.ipc_handle()?;
        self.set_dev(DevSide::Own(c))?;
        Ok(h)
    }

    /// The sending end: opens the receiving end's connection in device memory by `handle`.
    pub fn open_device_memory(&self, handle: &[u8; 64], hdr_bytes: usize) -> Result<()> {
        let c = crate::gpu::memory::IpcConn::open(handle, hdr_bytes)?;
        self.set_dev(DevSide::Opened(c))
    }

    fn set_dev(&self, d: DevSide) -> Result<()> {
        let at = match &d {
            DevSide::Own(c) => (c.hdr, c.slots),
            DevSide::Opened(c) => (c.hdr, c.slots),
        };
        let mut dev = self.dev.lock();
        if dev.is_some() || self.dev_at.set(at).is_err() {
            return Err(Error::internal("a connection put in device memory twice"));
        }
        *dev = Some(d);
        Ok(())
    }

    /// The sending end lets go of the receiving end's device memory (before it says it closed:
    /// the owner frees it only after, see `Parked`).
    pub fn close_opened(&self) {
        let mut dev = self.dev.lock();
        if matches!(*dev, Some(DevSide::Opened(_))) {
            dev.take();
        }
    }

    /// Leaves the device memory allocated and mapped for good, and the segment mapped and
    /// pinned (kernels that did not stop may still touch them; see
    /// `Conn::abandon_device_memory`).
    pub fn abandon(&self) {
        if let Some(d) = self.dev.lock().take() {
            std::mem::forget(d);
            self.abandoned.store(true, Ordering::Release);
        }
        if self.pinned.load(Ordering::Acquire) {
            self.abandoned.store(true, Ordering::Release);
        }
    }

    /// The header's closed word (`Conn::close`).
    pub fn closed_word(&self) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: a connection header, mapped as long as the region lives.
        unsafe { super::closed_word(self.ptr()) }
    }

    pub fn abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Acquire)
    }

    /// Whether the sending end is done with this segment's device memory: it said so in the
    /// header's closed word, or its process is gone (the driver closed its mappings).
    fn sender_done(ptr: *mut u8, peer_pid: u32) -> bool {
        // SAFETY: the caller's mapped connection header (a region's, or a parked one's).
        let closed = unsafe { super::closed_word(ptr) };
        closed.load(Ordering::Acquire) & super::end_bit(true) != 0
            || (peer_pid != 0
                && nix::sys::signal::kill(nix::unistd::Pid::from_raw(peer_pid as i32), None)
                    == Err(nix::errno::Errno::ESRCH))
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        if self.abandoned() {
            return; // the mapping too: the other end may read its header's words
        }
        let dev = self.dev.get_mut().take();
        if let Some(DevSide::Own(c)) = dev {
            if !Self::sender_done(self.ptr(), self.peer_pid) {
                // The sending end's process may still have it open: freeing it now is
                // undefined behaviour there (cuMemFree before cuIpcCloseMemHandle).
                Parked::park(Parked {
                    dev: Some(c),
                    ptr: self.ptr,
                    len: self.len,
                    peer_pid: self.peer_pid,
                });
                return;
            }
        }
        if self.pinned.load(Ordering::Acquire) {
            crate::gpu::memory::unpin_if_cuda(self.ptr());
        }
        // SAFETY: mapped in `open` with this length, not used after drop.
        let _ = unsafe { munmap(self.ptr, self.len) };
        Parked::sweep();
    }
}

/// A receiving end's device memory whose sending end had not let go of it when the connection
/// went, kept (with the segment whose header says when it does) until it has or its process is
/// gone; looked at whenever a region goes.
struct Parked {
    dev: Option<crate::gpu::memory::DevConn>,
    ptr: NonNull<std::ffi::c_void>,
    len: usize,
    peer_pid: u32,
}

// SAFETY: the mapping and the allocation are owned by the entry; only atomics are read.
unsafe impl Send for Parked {}

static PARKED: parking_lot::Mutex<Vec<Parked>> = parking_lot::Mutex::new(Vec::new());

impl Parked {
    fn park(p: Parked) {
        PARKED.lock().push(p);
    }

    /// Frees what the sending ends are done with (cuMemFree waits for the device: outside the
    /// lock, and only from where regions go, never from where connections are made).
    fn sweep() {
        let done: Vec<Parked> = {
            let mut list = PARKED.lock();
            let (done, keep) = std::mem::take(&mut *list)
                .into_iter()
                .partition(|p| ShmRegion::sender_done(p.ptr.as_ptr() as *mut u8, p.peer_pid));
            *list = keep;
            done
        };
        drop(done);
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        self.dev.take();
        // SAFETY: the segment's mapping, handed over by its region.
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
