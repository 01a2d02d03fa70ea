//! Buffers registered with `ncclCommRegister` that kernels of other processes on this GPU read
//! where they are: sends by reference between processes (`exec::cuda::desc::mark_refs`).
//!
//! - A kernel of another process reads this process's buffer only where that process has
//!   opened the buffer's allocation, at an address of its own: by its legacy CUDA IPC handle
//!   (`cuMemAlloc` memory), or, for `ncclMemAlloc`'s cuMem memory, by a POSIX file descriptor
//!   of its physical memory (sent over the socket), which it maps. The first launch that would
//!   send a registered buffer by reference to a kernel of such a process asks that process's
//!   registration service for it: a thread (started once the process has a receiving end a
//!   kernel of another process on its GPU sends on, `serve`) that opens the allocation in the
//!   GPU's primary context and answers the address it sees it at. The launch's slots then carry
//!   the address as the receiver sees it: the sender adds the offset between the two
//!   (`OxConnD::ref_delta`).
//! - A buffer is found by its address among the launching communicator's registrations, as
//!   NCCL keeps them (another communicator's deregistration must not close what this one's
//!   kernels read), within one allocation.
//! - `ncclCommDeregister`, and the communicator's end, ask every process asked to open a
//!   buffer to close it, and wait for the answer (up to `ASK_WAIT` each): the caller may free
//!   the buffer once it returns. A process that ended or does not answer keeps its opening
//!   until it exits; so do all where the communicator ended while its kernels still ran
//!   (`abandon`: the other processes' kernels may still read).
//! - A process that cannot open a buffer (no service, another user, the handle refused, no
//!   answer within `ASK_WAIT`) is not asked again for it: its receives of that buffer go
//!   through the slots, as everything did before. So does memory that has neither kind of
//!   handle, and every launch captured into a CUDA graph (a replay may come after the buffer is
//!   deregistered).
//! - The service answers only processes of this user, and closes a buffer only at the request
//!   of the process that sent it (told by the socket's credentials); a sender checks the same
//!   of the service (its name is a convention anyone could bind) before it sends a handle.

use crate::debug;
use crate::gpu::driver::{self, check, CtxGuard};
use crate::liveness::{my_process_key, pid_namespace, process_key};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::io::{IoSlice, IoSliceMut, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// How long a request to another process's service may take.
const ASK_WAIT: Duration = Duration::from_secs(10);
/// How long the service waits for a request's bytes (a process sends them as it connects; one
/// that does not holds the service up no longer).
const SERVE_WAIT: Duration = Duration::from_secs(2);
/// A request: what (`OPEN`, `OPEN_FD`, `CLOSE`), the asking process's key, the buffer's number
/// there, the GPU's UUID, and the allocation's IPC handle (`OPEN`) or its size (`OPEN_FD`, the
/// file descriptor beside the bytes).
const REQUEST: usize = 1 + 8 + 8 + 16 + 64;
const OPEN: u8 = 1;
const CLOSE: u8 = 2;
const OPEN_FD: u8 = 3;

/// How another process opens an allocation.
enum Handle {
    /// `cuMemAlloc` memory: its legacy IPC handle.
    Legacy([u8; 64]),
    /// cuMem memory (`ncclMemAlloc`): a file descriptor of its physical memory, and the size
    /// mapped.
    Fd(OwnedFd, u64),
}

/// An allocation as another process opens it.
struct Export {
    base: u64,
    size: u64,
    uuid: [u8; 16],
    handle: Handle,
}

/// A registered buffer of this process.
struct Reg {
    /// The registry (communicator) it was registered with, and the handle it got there.
    owner: u64,
    handle: usize,
    at: u64,
    end: u64,
    /// Its number among this process's registrations (what its peers know it by).
    id: u64,
    /// Its allocation, once asked for (None inside: no other process can open it).
    export: Option<Option<Export>>,
    /// The processes asked to open it: their key, and where they see the allocation's base
    /// (None: they could not open it).
    peers: Vec<(u64, Option<u64>)>,
}

static REGS: Mutex<Vec<Reg>> = Mutex::new(Vec::new());
/// How many registrations there are (a launch looks only where there are some).
static COUNT: AtomicUsize = AtomicUsize::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// `ncclMemAlloc`'s cuMem mappings: base, size, device, allocation handle.
static MAPPED: Mutex<Vec<(u64, u64, i32, u64)>> = Mutex::new(Vec::new());

/// Notes a cuMem mapping of `ncclMemAlloc` (exported by a file descriptor when registered).
pub fn note_mapped(base: u64, size: usize, dev: i32, handle: u64) {
    MAPPED.lock().push((base, size as u64, dev, handle));
}

/// Forgets a mapping `note_mapped` noted (`ncclMemFree`).
pub fn forget_mapped(base: u64) {
    MAPPED.lock().retain(|m| m.0 != base);
}

/// Whether this process has registered buffers.
pub fn any() -> bool {
    COUNT.load(Ordering::Relaxed) > 0
}

/// Records `ncclCommRegister(buf, size)` of registry `owner`, which gave it `handle`.
pub fn register(owner: u64, handle: usize, buf: usize, size: usize) {
    let mut regs = REGS.lock();
    regs.push(Reg {
        owner,
        handle,
        at: buf as u64,
        end: (buf + size) as u64,
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        export: None,
        peers: Vec::new(),
    });
    COUNT.store(regs.len(), Ordering::Relaxed);
}

/// Forgets registry `owner`'s `handle` (every handle of it where None), once every process
/// that opened the buffer has closed it.
pub fn deregister(owner: u64, handle: Option<usize>) {
    let gone: Vec<Reg> = {
        let mut regs = REGS.lock();
        let (gone, kept) = std::mem::take(&mut *regs)
            .into_iter()
            .partition(|r| r.owner == owner && handle.is_none_or(|h| h == r.handle));
        *regs = kept;
        COUNT.store(regs.len(), Ordering::Relaxed);
        gone
    };
    // (Every process asked, not only those that answered: one whose answer was lost may have
    // opened it.)
    for r in gone {
        for (peer, _) in &r.peers {
            if ask(*peer, CLOSE, r.id, &[0; 16], &[0; 64], None).is_none() {
                debug::info(&format!(
                    "ncclCommDeregister: the process of key {peer:#x} did not confirm it closed \
                     buffer {:#x} (it may have ended)",
                    r.at
                ));
            }
        }
    }
}

/// Forgets registry `owner`'s buffers without asking anyone to close them: its communicator
/// ended while its kernels still ran (other processes' kernels may still read them; their
/// openings stay until those processes end).
pub fn abandon(owner: u64) {
    let mut regs = REGS.lock();
    regs.retain(|r| r.owner != owner);
    COUNT.store(regs.len(), Ordering::Relaxed);
}

/// What to add to an address of this process in `[at, end)` for the kernels of process `peer`
/// (on this GPU) to read it: Some only where a buffer registered with registry `owner` (the
/// launching communicator's) holds the range within one allocation, and that process has
/// opened the allocation (asked here the first time).
pub fn peer_offset(owner: u64, peer: u64, at: u64, end: u64) -> Option<i64> {
    let mut regs = REGS.lock();
    let r = regs
        .iter_mut()
        .find(|r| r.owner == owner && r.at <= at && end <= r.end)?;
    let x = r.export.get_or_insert_with(|| export(r.at)).as_ref()?;
    if at < x.base || end > x.base + x.size {
        return None; // (a registration across two allocations)
    }
    if let Some(p) = r.peers.iter().find(|p| p.0 == peer) {
        return p.1.map(|seen| seen.wrapping_sub(x.base) as i64);
    }
    let seen = match &x.handle {
        Handle::Legacy(h) => ask(peer, OPEN, r.id, &x.uuid, h, None),
        Handle::Fd(fd, size) => {
            let mut payload = [0u8; 64];
            payload[..8].copy_from_slice(&size.to_le_bytes());
            ask(peer, OPEN_FD, r.id, &x.uuid, &payload, Some(fd.as_raw_fd()))
        }
    };
    if seen.is_none() {
        debug::info(&format!(
            "registered buffer {:#x}: the process of key {peer:#x} did not open it; what it \
             receives of it goes through the connection's slots",
            r.at
        ));
    }
    let base = x.base;
    r.peers.push((peer, seen));
    Some(seen?.wrapping_sub(base) as i64)
}

/// The allocation that holds `at`, as another process opens it: `ncclMemAlloc`'s cuMem mapping
/// by a file descriptor, other memory by its legacy IPC handle (None where it has neither).
fn export(at: u64) -> Option<Export> {
    let api = driver::api().ok()?;
    let mapped = MAPPED
        .lock()
        .iter()
        .find(|m| m.0 <= at && at < m.0 + m.1)
        .copied();
    if let Some((base, size, dev, h)) = mapped {
        let mut fd: c_int = -1;
        let _g = CtxGuard::enter(driver::primary_context(dev).ok()?).ok()?;
        driver::relaxed(|| {
            // SAFETY: writes one int, a new descriptor of ours; `h` is ncclMemAlloc's handle.
            check(
                unsafe {
                    (api.mem_export)(
                        &mut fd as *mut c_int as *mut c_void,
                        h,
                        driver::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        0,
                    )
                },
                || format!("cuMemExportToShareableHandle of registered buffer {at:#x}"),
            )
        })
        .ok()?;
        // SAFETY: the driver gave us this descriptor; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        return Some(Export {
            base,
            size,
            uuid: driver::device_uuid(dev).ok()?,
            handle: Handle::Fd(fd, size),
        });
    }
    let (mut base, mut size, mut dev, mut legacy): (u64, u64, c_int, c_int) = (0, 0, -1, 0);
    let mut attrs = [
        driver::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        driver::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        driver::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        driver::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    ];
    let mut out = [
        &mut base as *mut _ as *mut c_void,
        &mut size as *mut _ as *mut c_void,
        &mut dev as *mut _ as *mut c_void,
        &mut legacy as *mut _ as *mut c_void,
    ];
    // SAFETY: four attributes, each written to a variable of its type (the range's start a
    // device pointer, its size a size_t, the ordinal an int, the capability a bool as int).
    let r = unsafe {
        (api.pointer_attrs)(
            attrs.len() as std::ffi::c_uint,
            attrs.as_mut_ptr(),
            out.as_mut_ptr(),
            at,
        )
    };
    if r != driver::CUDA_SUCCESS || base == 0 || size == 0 || dev < 0 || legacy == 0 {
        return None;
    }
    let _g = CtxGuard::enter(driver::primary_context(dev).ok()?).ok()?;
    let h = driver::relaxed(|| {
        let mut h = driver::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: writes one handle; `base` is the allocation's.
        check(unsafe { (api.ipc_get_mem_handle)(&mut h, base) }, || {
            format!("cuIpcGetMemHandle of registered buffer {at:#x}")
        })?;
        Ok(h.reserved)
    })
    .ok()?;
    Some(Export {
        base,
        size,
        uuid: driver::device_uuid(dev).ok()?,
        handle: Handle::Legacy(h),
    })
}

/// The name of process `key`'s service (abstract: nothing to remove).
fn service_name(key: u64) -> String {
    format!("oxccl-registered-{key:016x}")
}

/// Asks process `peer`'s service to open (`OPEN`, `OPEN_FD` with `fd`: the address it sees
/// the allocation at) or close (`CLOSE`: Some(0)) this process's buffer `id`.
fn ask(
    peer: u64,
    op: u8,
    id: u64,
    uuid: &[u8; 16],
    payload: &[u8; 64],
    fd: Option<RawFd>,
) -> Option<u64> {
    let addr = SocketAddr::from_abstract_name(service_name(peer)).ok()?;
    let mut s = UnixStream::connect_addr(&addr).ok()?;
    s.set_read_timeout(Some(ASK_WAIT)).ok()?;
    s.set_write_timeout(Some(ASK_WAIT)).ok()?;
    // The name is the peer's by convention only: the listener must be that process, of this
    // user (anyone else would get the buffer's handle, and could answer any address).
    let (is_peer, cred) = other_end_is(&s, peer).ok()?;
    if !is_peer {
        debug::warn(&format!(
            "the registration service of the process of key {peer:#x} is another process's \
             (pid {}, uid {}): not asked",
            cred.pid(),
            cred.uid()
        ));
        return None;
    }
    let mut req = Vec::with_capacity(REQUEST);
    req.push(op);
    req.extend_from_slice(&my_process_key().to_le_bytes());
    req.extend_from_slice(&id.to_le_bytes());
    req.extend_from_slice(uuid);
    req.extend_from_slice(payload);
    let fds: Vec<RawFd> = fd.into_iter().collect();
    let cmsg: Vec<ControlMessage> = if fds.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(&fds)]
    };
    let sent = sendmsg::<()>(
        s.as_raw_fd(),
        &[IoSlice::new(&req)],
        &cmsg,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .ok()?;
    send_all(&s, &req[sent..]).ok()?;
    let mut ans = [0u8; 9];
    s.read_exact(&mut ans).ok()?;
    (ans[0] == 1).then(|| u64::from_le_bytes(ans[1..].try_into().expect("8 bytes")))
}

/// Whether the other end of `s` is process `key` (of this PID namespace) and of this user: its
/// credentials (the kernel's, taken when it connected or listened) with the answer.
fn other_end_is(
    s: &UnixStream,
    key: u64,
) -> std::io::Result<(bool, nix::sys::socket::UnixCredentials)> {
    let cred = nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::PeerCredentials)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { nix::libc::geteuid() };
    let is = cred.uid() == uid && key == process_key(cred.pid() as u32, pid_namespace());
    Ok((is, cred))
}

/// Writes all of `b` to `s`, without a SIGPIPE where the other end has gone (the process may
/// be a C program's, where that signal ends it).
fn send_all(s: &UnixStream, mut b: &[u8]) -> std::io::Result<()> {
    while !b.is_empty() {
        match nix::sys::socket::send(s.as_raw_fd(), b, MsgFlags::MSG_NOSIGNAL) {
            Ok(n) => b = &b[n..],
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The process whose service runs (a forked child starts its own).
static SERVING: Mutex<u32> = Mutex::new(0);

/// Starts this process's registration service, if it does not run.
pub fn serve() {
    let mut pid = SERVING.lock();
    if *pid == std::process::id() {
        return;
    }
    let l = SocketAddr::from_abstract_name(service_name(my_process_key()))
        .and_then(|a| UnixListener::bind_addr(&a));
    let started = l.and_then(|l| {
        std::thread::Builder::new()
            .name("oxccl-registered".into())
            .spawn(move || {
                for s in l.incoming() {
                    match s {
                        Ok(s) => {
                            let _ = answer(s);
                        }
                        // (Out of descriptors, say: not a spin.)
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            })
    });
    match started {
        Ok(_) => *pid = std::process::id(),
        Err(e) => debug::warn(&format!(
            "the service that opens other processes' registered buffers did not start ({e}): \
             their sends to this process go through the connections' slots"
        )),
    }
}

/// How this process opened another's buffer.
#[derive(Clone, Copy)]
enum Opening {
    /// By its legacy IPC handle (a handle opened twice is opened once).
    Legacy([u8; 64]),
    /// Its physical memory mapped at a range of this size reserved here.
    Mapped(u64),
}

/// Buffers of other processes this process opened, by (their process, their number): the
/// address, the context, and how.
type Opened = HashMap<(u64, u64), (u64, usize, Opening)>;
static OPENED: Mutex<Option<Opened>> = Mutex::new(None);

/// How many buffers of other processes this process has open.
pub fn opened() -> usize {
    OPENED.lock().as_ref().map_or(0, |m| m.len())
}

/// Serves one request.
fn answer(mut s: UnixStream) -> std::io::Result<()> {
    s.set_read_timeout(Some(SERVE_WAIT))?;
    s.set_write_timeout(Some(SERVE_WAIT))?;
    let mut req = [0u8; REQUEST];
    let mut fds: Vec<OwnedFd> = Vec::new();
    let got = {
        let mut space = nix::cmsg_space!([RawFd; 2]);
        let mut iov = [IoSliceMut::new(&mut req)];
        let msg = recvmsg::<()>(
            s.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        for c in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(v) = c {
                // SAFETY: descriptors the kernel just installed in this process for us.
                fds.extend(v.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
            }
        }
        msg.bytes
    };
    if got == 0 {
        return Ok(());
    }
    s.read_exact(&mut req[got..])?;
    let word = |i: usize| u64::from_le_bytes(req[i..i + 8].try_into().expect("8 bytes"));
    let (op, from, id) = (req[0], word(1), word(9));
    let uuid: [u8; 16] = req[17..33].try_into().expect("16 bytes");
    let payload: [u8; 64] = req[33..].try_into().expect("64 bytes");
    // Only a process of this user, and only for its own buffers.
    let (mine, _) = other_end_is(&s, from)?;
    let r = match op {
        _ if !mine => None,
        OPEN => open(from, id, &uuid, Opening::Legacy(payload), None),
        OPEN_FD => match fds.first() {
            Some(fd) => open(from, id, &uuid, Opening::Mapped(word(33)), Some(fd)),
            None => None,
        },
        CLOSE => close(from, id).then_some(0),
        _ => None,
    };
    let mut ans = [0u8; 9];
    if let Some(a) = r {
        ans[0] = 1;
        ans[1..].copy_from_slice(&a.to_le_bytes());
    }
    let sent = send_all(&s, &ans);
    if sent.is_err() && r.is_some() && op != CLOSE {
        // The process that asked will not use what it did not hear of.
        close(from, id);
    }
    sent
}

/// Opens process `from`'s buffer `id` (once), in the primary context of the GPU of `uuid`: by
/// its legacy IPC handle, or by mapping the physical memory of `fd` (`Opening::Mapped`'s size).
fn open(from: u64, id: u64, uuid: &[u8; 16], how: Opening, fd: Option<&OwnedFd>) -> Option<u64> {
    let mut opened = OPENED.lock();
    let m = opened.get_or_insert_with(HashMap::new);
    let same = |v: &(u64, usize, Opening)| match (v.2, how) {
        (Opening::Legacy(a), Opening::Legacy(b)) => a == b,
        _ => false,
    };
    if let Some(&v) = m.get(&(from, id)).or_else(|| m.values().find(|v| same(v))) {
        m.insert((from, id), v);
        return Some(v.0);
    }
    let api = driver::api().ok()?;
    let dev = crate::gpu::memory::device_of_uuid(uuid)?;
    let ctx = driver::primary_context(dev).ok()?;
    let _g = CtxGuard::enter(ctx).ok()?;
    let a = driver::relaxed(|| match (how, fd) {
        (Opening::Legacy(h), _) => {
            let mut p: driver::CUdeviceptr = 0;
            let h = driver::CUipcMemHandle { reserved: h };
            // SAFETY: writes one device pointer; the handle came from the other process's
            // cuIpcGetMemHandle (a wrong one is refused).
            check(
                unsafe {
                    (api.ipc_open_mem_handle)(&mut p, h, driver::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                },
                || "cuIpcOpenMemHandle of another process's registered buffer".into(),
            )?;
            Ok(p)
        }
        (Opening::Mapped(size), Some(fd)) => map_fd(api, dev, fd, size as usize),
        (Opening::Mapped(_), None) => Err(crate::error::Error::internal("no descriptor")),
    })
    .ok()?;
    m.insert((from, id), (a, ctx, how));
    Some(a)
}

/// Maps the physical memory of `fd` (another process's cuMem allocation, `size` bytes) at a
/// range reserved for it, read-write for `dev`; undoes its own steps when one fails.
fn map_fd(api: &driver::Api, dev: i32, fd: &OwnedFd, size: usize) -> crate::error::Result<u64> {
    let mut h: u64 = 0;
    // SAFETY: writes one handle; the descriptor is one of ours, which the driver reads.
    check(
        unsafe {
            (api.mem_import)(
                &mut h,
                fd.as_raw_fd() as isize as *mut c_void,
                driver::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        },
        || "cuMemImportFromShareableHandle of another process's registered buffer".into(),
    )?;
    let access = [driver::CUmemAccessDesc {
        location: driver::CUmemLocation {
            kind: driver::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        },
        flags: driver::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }];
    // (`size` is the exporter's mapped size: a multiple of its granularity.)
    let r = crate::gpu::memory::map_handle(api, h, size, 0, &access);
    // SAFETY: the imported handle, released once (a mapping keeps the memory).
    unsafe { (api.mem_release)(h) };
    r
}

/// Closes process `from`'s buffer `id` (a legacy opening once no other number names it).
fn close(from: u64, id: u64) -> bool {
    let mut opened = OPENED.lock();
    let Some(m) = opened.as_mut() else {
        return false;
    };
    let Some((a, ctx, how)) = m.remove(&(from, id)) else {
        return false;
    };
    if m.values().any(|v| v.0 == a) {
        return true;
    }
    let (Ok(api), Ok(_g)) = (driver::api(), CtxGuard::enter(ctx)) else {
        return false;
    };
    // SAFETY: opened by `open`, closed once (the kernels that read it ended: the sender's
    // drained before its buffer could be deregistered).
    driver::relaxed(|| match how {
        Opening::Legacy(_) => check(unsafe { (api.ipc_close_mem_handle)(a) }, || {
            "cuIpcCloseMemHandle".into()
        }),
        Opening::Mapped(size) => {
            let size = size as usize;
            let unmap = check(unsafe { (api.mem_unmap)(a, size) }, || "cuMemUnmap".into());
            let free = check(unsafe { (api.mem_address_free)(a, size) }, || {
                "cuMemAddressFree".into()
            });
            unmap.and(free)
        }
    })
    .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Sends `req` to this process's service; its answer (None: the connection closed).
    fn send(req: &[u8]) -> Option<[u8; 9]> {
        let addr = SocketAddr::from_abstract_name(service_name(my_process_key())).unwrap();
        let mut s = UnixStream::connect_addr(&addr).unwrap();
        s.write_all(req).unwrap();
        let mut ans = [0u8; 9];
        s.read_exact(&mut ans).ok().map(|_| ans)
    }

    /// The service refuses what it must: a close in another process's name, a handle it
    /// cannot open (no driver here), an unknown request; a peer that sends half a request is
    /// dropped without an answer, and the service goes on answering.
    #[test]
    fn the_service_refuses_strangers_and_goes_on() {
        serve();
        serve();
        let request = |op: u8, from: u64| {
            let mut r = vec![op];
            r.extend_from_slice(&from.to_le_bytes());
            r.extend_from_slice(&7u64.to_le_bytes());
            r.extend_from_slice(&[0; 16 + 64]);
            r
        };
        let me = my_process_key();
        assert_eq!(
            send(&request(CLOSE, me ^ 1)),
            Some([0; 9]),
            "another's close"
        );
        assert_eq!(send(&request(OPEN, me ^ 1)), Some([0; 9]), "another's open");
        assert_eq!(
            send(&request(OPEN, me)),
            Some([0; 9]),
            "no driver to open it"
        );
        assert_eq!(
            send(&request(CLOSE, me)),
            Some([0; 9]),
            "nothing open to close"
        );
        assert_eq!(send(&request(9, me)), Some([0; 9]), "an unknown request");
        assert_eq!(send(&request(CLOSE, me)[..20]), None, "half a request");
        assert_eq!(
            send(&request(CLOSE, me)),
            Some([0; 9]),
            "the service answers after the half request"
        );
        // Open by a descriptor without one: refused.
        assert_eq!(send(&request(OPEN_FD, me)), Some([0; 9]), "no descriptor");
        assert_eq!(opened(), 0);
    }

    /// A listener at another process's name that is not that process (here: this one, at the
    /// name of pid 1's) is sent nothing: no handle, no descriptor.
    #[test]
    fn a_stranger_at_a_peers_name_gets_nothing() {
        let fake = process_key(1, pid_namespace());
        let addr = SocketAddr::from_abstract_name(service_name(fake)).unwrap();
        let l = UnixListener::bind_addr(&addr).unwrap();
        assert_eq!(ask(fake, OPEN, 1, &[0; 16], &[7; 64], None), None);
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut b = [0u8; 1];
        assert!(matches!(s.read(&mut b), Ok(0)), "the client sent {b:?}");
    }

    /// A process without a service is asked nothing twice: its sends of the buffer go through
    /// the slots. A range no registration holds has no offset.
    #[test]
    fn registrations_hold_ranges_until_deregistered() {
        // (Registry 1000 is this test's own.)
        register(1000, 1, 0x10_0000, 0x1000);
        assert!(any());
        assert_eq!(
            peer_offset(1000, 42, 0x20_0000, 0x20_0010),
            None,
            "not registered"
        );
        // No driver here: the buffer has no handle to send.
        assert_eq!(peer_offset(1000, 42, 0x10_0000, 0x10_0010), None);
        assert_eq!(
            peer_offset(1001, 42, 0x10_0000, 0x10_0010),
            None,
            "another communicator's registration"
        );
        assert!(REGS
            .lock()
            .iter()
            .any(|r| r.owner == 1000 && matches!(r.export, Some(None))));
        deregister(1000, Some(1));
        assert!(!REGS.lock().iter().any(|r| r.owner == 1000));
    }
}
