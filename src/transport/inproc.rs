//! Same-process connections: a zeroed, page-aligned heap region found by name in a process-wide
//! table until both ends hold it.

use super::peer::PeerInfo;
use super::{ConnSpec, Endpoint, Locality, Named, Transport};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::sync::Arc;

pub struct HeapRegion {
    ptr: *mut u8,
    layout: Layout,
    name: String,
    /// On the CUDA executor, the connection in device memory (ranks of one process on one GPU
    /// move data through it at device speed); `ptr` then only serves the host's bookkeeping.
    dev: once_cell::sync::OnceCell<crate::gpu::memory::DevConn>,
    /// Kernels that did not stop may still touch it: never freed (`abandon`).
    abandoned: std::sync::atomic::AtomicBool,
}

// SAFETY: the allocation is owned by the region and freed only on drop; concurrent access goes
// through the connection protocol's atomics.
unsafe impl Send for HeapRegion {}
// SAFETY: as above.
unsafe impl Sync for HeapRegion {}

impl HeapRegion {
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device addresses of (header, slots), where the connection lives in device memory.
    pub fn device_conn(&self) -> Option<(u64, u64)> {
        self.dev.get().map(|d| (d.hdr, d.slots))
    }

    /// Puts the connection (`hdr_bytes` of header, `slot_bytes` of slots) in device memory of
    /// the current device, once for both ends.
    pub fn use_device_memory(&self, hdr_bytes: usize, slot_bytes: usize) -> Result<()> {
        self.dev
            .get_or_try_init(|| crate::gpu::memory::DevConn::alloc(hdr_bytes, slot_bytes))
            .map(|_| ())
    }
}

impl HeapRegion {
    /// Leaves the region (pinned) and its device memory allocated for good (see
    /// `Conn::abandon_device_memory`).
    pub fn abandon(&self) {
        self.abandoned
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

impl Drop for HeapRegion {
    fn drop(&mut self) {
        if *self.abandoned.get_mut() {
            if let Some(d) = self.dev.take() {
                std::mem::forget(d);
            }
            return;
        }
        crate::gpu::memory::unpin_if_cuda(self.ptr);
        // SAFETY: allocated in `open` with this layout.
        unsafe { dealloc(self.ptr, self.layout) };
    }
}

static TABLE: Mutex<Option<HashMap<String, Arc<HeapRegion>>>> = Mutex::new(None);

pub fn open(name: &str, bytes: usize) -> Result<Arc<HeapRegion>> {
    super::check_size(bytes)?;
    let mut t = TABLE.lock();
    let map = t.get_or_insert_with(HashMap::new);
    if let Some(r) = map.get(name) {
        if r.layout.size() != bytes {
            return Err(Error::internal(format!(
                "connection {name}: ends disagree on its size"
            )));
        }
        return Ok(r.clone());
    }
    let layout =
        Layout::from_size_align(bytes, 4096).map_err(|e| Error::internal(e.to_string()))?;
    // SAFETY: layout has non-zero size.
    let ptr = unsafe { alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(Error::system(format!(
            "out of memory allocating {bytes} bytes for connection {name}"
        )));
    }
    // Kernels of the CUDA executor read and write connection memory.
    if let Err(e) = crate::gpu::memory::pin_if_cuda(ptr, bytes) {
        // SAFETY: allocated above with this layout.
        unsafe { dealloc(ptr, layout) };
        return Err(e.context(format!("connection {name}")));
    }
    let r = Arc::new(HeapRegion {
        ptr,
        layout,
        name: name.to_string(),
        dev: once_cell::sync::OnceCell::new(),
        abandoned: Default::default(),
    });
    map.insert(name.to_string(), r.clone());
    Ok(r)
}

pub fn forget(name: &str) {
    if let Some(map) = TABLE.lock().as_mut() {
        map.remove(name);
    }
}

/// The same-process transport.
pub struct InProc;

impl Transport for InProc {
    fn name(&self) -> &'static str {
        "in-process"
    }
    fn reaches(&self, me: &PeerInfo, peer: &PeerInfo) -> bool {
        Locality::of(me, peer) == Locality::SameProcess
    }
    fn setup(&self, spec: &ConnSpec) -> Result<(Box<dyn Endpoint>, Vec<u8>)> {
        Named::setup(spec, false)
    }
}
