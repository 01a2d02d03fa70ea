//! Buffers registered with `ncclCommRegister` that kernels of other processes on this GPU read
//! where they are: sends by reference between processes (`exec::cuda::desc::mark_refs`).
//!
//! - A kernel of another process reads this process's buffer only where that process has
//!   opened the buffer's allocation by a CUDA IPC handle, at an address of its own. The first
//!   launch that would send a registered buffer by reference to a kernel of such a process asks
//!   that process's registration service for it: a thread (started once the process has a
//!   receiving end a kernel of another process on its GPU sends on, `serve`) that opens the
//!   handle in the GPU's primary context and answers the address it sees the allocation at. The
//!   launch's slots then carry the address as the receiver sees it: the sender adds the offset
//!   between the two (`OxConnD::ref_delta`).
//! - `ncclCommDeregister`, and the communicator's end, ask every process that opened a buffer
//!   to close it, and wait for the answer: the caller may free the buffer once it returns.
//! - A process that cannot open a buffer (no service, another user, the handle refused, no
//!   answer within `ASK_WAIT`) is not asked again for it: its receives of that buffer go
//!   through the slots, as everything did before. So does memory whose allocation has no legacy
//!   IPC handle (`ncclMemAlloc`'s cuMem allocations, for now), and every launch captured into a
//!   CUDA graph (a replay may come after the buffer is deregistered).
//! - The service answers only processes of this user, and closes a buffer only at the request
//!   of the process that sent it (told by the socket's credentials).

use crate::debug;
use crate::gpu::driver::{self, check, CtxGuard};
use crate::liveness::{my_process_key, pid_namespace, process_key};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// How long a request to another process's service may take.
const ASK_WAIT: Duration = Duration::from_secs(10);
/// How long the service waits for a request's bytes (a process sends them as it connects; one
/// that does not holds the service up no longer).
const SERVE_WAIT: Duration = Duration::from_secs(2);
/// A request: what (`OPEN`, `CLOSE`), the asking process's key, the buffer's number there, the
/// GPU's UUID and the allocation's IPC handle.
const REQUEST: usize = 1 + 8 + 8 + 16 + 64;
const OPEN: u8 = 1;
const CLOSE: u8 = 2;

/// An allocation as another process opens it: its base, IPC handle and GPU's UUID.
type Export = (u64, [u8; 64], [u8; 16]);

/// A registered buffer of this process.
struct Reg {
    /// The registry (communicator) it was registered with, and the handle it got there.
    owner: u64,
    handle: usize,
    at: u64,
    end: u64,
    /// Its number among this process's registrations (what its peers know it by).
    id: u64,
    /// Its allocation's base, IPC handle and GPU, once asked for (None inside: it has none).
    export: Option<Option<Export>>,
    /// The processes asked to open it: their key, and where they see the allocation's base
    /// (None: they could not open it).
    peers: Vec<(u64, Option<u64>)>,
}

static REGS: Mutex<Vec<Reg>> = Mutex::new(Vec::new());
/// How many registrations there are (a launch looks only where there are some).
static COUNT: AtomicUsize = AtomicUsize::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

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
    for r in gone {
        let Some(Some((_, h, uuid))) = r.export else {
            continue;
        };
        for (peer, _) in r.peers.iter().filter(|p| p.1.is_some()) {
            if ask(*peer, CLOSE, r.id, &uuid, &h).is_none() {
                debug::info(&format!(
                    "ncclCommDeregister: the process of key {peer:#x} did not confirm it closed \
                     buffer {:#x} (it may have ended)",
                    r.at
                ));
            }
        }
    }
}

/// What to add to an address of this process in `[at, end)` for the kernels of process `peer`
/// (on this GPU) to read it: Some only where a registered buffer holds the range and that
/// process has opened it (asked here the first time).
pub fn peer_offset(peer: u64, at: u64, end: u64) -> Option<i64> {
    let mut regs = REGS.lock();
    let r = regs.iter_mut().find(|r| r.at <= at && end <= r.end)?;
    let (base, handle, uuid) = (*r.export.get_or_insert_with(|| export(r.at)))?;
    let seen = match r.peers.iter().find(|p| p.0 == peer) {
        Some(p) => p.1,
        None => {
            let b = ask(peer, OPEN, r.id, &uuid, &handle);
            if b.is_none() {
                debug::info(&format!(
                    "registered buffer {:#x}: the process of key {peer:#x} did not open it; \
                     what it receives of it goes through the connection's slots",
                    r.at
                ));
            }
            r.peers.push((peer, b));
            b
        }
    }?;
    Some(seen.wrapping_sub(base) as i64)
}

/// The base, IPC handle and GPU of the allocation that holds `at` (None where the driver gives
/// no legacy IPC handle for it).
fn export(at: u64) -> Option<Export> {
    let api = driver::api().ok()?;
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
    let ctx = driver::primary_context(dev).ok()?;
    let _g = CtxGuard::enter(ctx).ok()?;
    let h = driver::relaxed(|| {
        let mut h = driver::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: writes one handle; `base` is the allocation's.
        check(unsafe { (api.ipc_get_mem_handle)(&mut h, base) }, || {
            format!("cuIpcGetMemHandle of registered buffer {at:#x}")
        })?;
        Ok(h.reserved)
    })
    .ok()?;
    Some((base, h, driver::device_uuid(dev).ok()?))
}

/// The name of process `key`'s service (abstract: nothing to remove).
fn service_name(key: u64) -> String {
    format!("oxccl-registered-{key:016x}")
}

/// Asks process `peer`'s service to open (`OPEN`: the address it sees the allocation at) or
/// close (`CLOSE`: Some(0)) this process's buffer `id`.
fn ask(peer: u64, op: u8, id: u64, uuid: &[u8; 16], handle: &[u8; 64]) -> Option<u64> {
    let addr = SocketAddr::from_abstract_name(service_name(peer)).ok()?;
    let mut s = UnixStream::connect_addr(&addr).ok()?;
    s.set_read_timeout(Some(ASK_WAIT)).ok()?;
    s.set_write_timeout(Some(ASK_WAIT)).ok()?;
    let mut req = Vec::with_capacity(REQUEST);
    req.push(op);
    req.extend_from_slice(&my_process_key().to_le_bytes());
    req.extend_from_slice(&id.to_le_bytes());
    req.extend_from_slice(uuid);
    req.extend_from_slice(handle);
    s.write_all(&req).ok()?;
    let mut ans = [0u8; 9];
    s.read_exact(&mut ans).ok()?;
    (ans[0] == 1).then(|| u64::from_le_bytes(ans[1..].try_into().expect("8 bytes")))
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
                for s in l.incoming().flatten() {
                    let _ = answer(s);
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

/// Buffers of other processes this process opened: by (their process, their number), the
/// address and the context; and the handle (a handle opened twice is mapped once).
type Opened = HashMap<(u64, u64), (u64, usize, [u8; 64])>;
static OPENED: Mutex<Option<Opened>> = Mutex::new(None);

/// How many buffers of other processes this process has open.
pub fn opened() -> usize {
    OPENED.lock().as_ref().map_or(0, |m| m.len())
}

/// Serves one request.
fn answer(mut s: UnixStream) -> std::io::Result<()> {
    s.set_read_timeout(Some(SERVE_WAIT))?;
    s.set_write_timeout(Some(SERVE_WAIT))?;
    let cred = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)?;
    let mut req = [0u8; REQUEST];
    s.read_exact(&mut req)?;
    let word = |i: usize| u64::from_le_bytes(req[i..i + 8].try_into().expect("8 bytes"));
    let (op, from, id) = (req[0], word(1), word(9));
    let uuid: [u8; 16] = req[17..33].try_into().expect("16 bytes");
    let handle: [u8; 64] = req[33..].try_into().expect("64 bytes");
    // Only a process of this user, and only for its own buffers.
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { nix::libc::geteuid() };
    let mine = cred.uid() == uid && from == process_key(cred.pid() as u32, pid_namespace());
    let r = match op {
        _ if !mine => None,
        OPEN => open(from, id, &uuid, &handle),
        CLOSE => close(from, id).then_some(0),
        _ => None,
    };
    let mut ans = [0u8; 9];
    if let Some(a) = r {
        ans[0] = 1;
        ans[1..].copy_from_slice(&a.to_le_bytes());
    }
    s.write_all(&ans)
}

/// Opens process `from`'s buffer `id` (once), in the primary context of the GPU of `uuid`.
fn open(from: u64, id: u64, uuid: &[u8; 16], handle: &[u8; 64]) -> Option<u64> {
    let mut opened = OPENED.lock();
    let m = opened.get_or_insert_with(HashMap::new);
    if let Some(&v) = m
        .get(&(from, id))
        .or_else(|| m.values().find(|v| &v.2 == handle))
    {
        m.insert((from, id), v);
        return Some(v.0);
    }
    let api = driver::api().ok()?;
    let dev = crate::gpu::memory::device_of_uuid(uuid)?;
    let ctx = driver::primary_context(dev).ok()?;
    let _g = CtxGuard::enter(ctx).ok()?;
    let a = driver::relaxed(|| {
        let mut p: driver::CUdeviceptr = 0;
        let h = driver::CUipcMemHandle { reserved: *handle };
        // SAFETY: writes one device pointer; the handle came from the other process's
        // cuIpcGetMemHandle (a wrong one is refused).
        check(
            unsafe {
                (api.ipc_open_mem_handle)(&mut p, h, driver::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            },
            || "cuIpcOpenMemHandle of another process's registered buffer".into(),
        )?;
        Ok(p)
    })
    .ok()?;
    m.insert((from, id), (a, ctx, *handle));
    Some(a)
}

/// Closes process `from`'s buffer `id` (its mapping once no other number names it).
fn close(from: u64, id: u64) -> bool {
    let mut opened = OPENED.lock();
    let Some(m) = opened.as_mut() else {
        return false;
    };
    let Some((a, ctx, h)) = m.remove(&(from, id)) else {
        return false;
    };
    if m.values().any(|v| v.2 == h) {
        return true;
    }
    let (Ok(api), Ok(_g)) = (driver::api(), CtxGuard::enter(ctx)) else {
        return false;
    };
    driver::relaxed(|| {
        // SAFETY: opened by `open`, closed once (the kernels that read it ended: the sender's
        // drained before its buffer could be deregistered).
        check(unsafe { (api.ipc_close_mem_handle)(a) }, || {
            "cuIpcCloseMemHandle".into()
        })
    })
    .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(opened(), 0);
    }

    /// A process without a service is asked nothing twice: its sends of the buffer go through
    /// the slots. A range no registration holds has no offset.
    #[test]
    fn registrations_hold_ranges_until_deregistered() {
        // (Registry 1000 is this test's own.)
        register(1000, 1, 0x10_0000, 0x1000);
        assert!(any());
        assert_eq!(
            peer_offset(42, 0x20_0000, 0x20_0010),
            None,
            "not registered"
        );
        // No driver here: the buffer has no handle to send.
        assert_eq!(peer_offset(42, 0x10_0000, 0x10_0010), None);
        assert!(REGS
            .lock()
            .iter()
            .any(|r| r.owner == 1000 && r.export == Some(None)));
        deregister(1000, Some(1));
        assert!(!REGS.lock().iter().any(|r| r.owner == 1000));
    }
}
