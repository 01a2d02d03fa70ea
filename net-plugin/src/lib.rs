//! oxccl's socket transport as an NCCL net plugin: `libnccl_net_oxccl.so` exports
//! `ncclNetPlugin_v8`, so that oxccl (`NCCL_NET_PLUGIN=<path>`) or NVIDIA's NCCL can move data
//! between hosts through it. It speaks TCP the way oxccl's built-in transport does:
//! non-blocking sockets with `TCP_NODELAY`, each message its length (8 bytes, little endian)
//! and its bytes, written with `MSG_NOSIGNAL` (a gone peer is an error, not SIGPIPE), and a
//! random token that a connecting end presents before anything else (the handle travels
//! through the caller's bootstrap, so only a rank of the communicator knows it). Requests of a
//! comm complete in the order they were posted. Host memory only (`NCCL_PTR_HOST`), one
//! device: the interface oxccl would choose (`NCCL_SOCKET_IFNAME` in NCCL's syntax, else the
//! first that is not loopback or a container's); `OXCCL_NET_IP` names an address outright.
//!
//! No panic leaves a plugin function: each runs under `catch_unwind` and a panic becomes
//! `ncclInternalError`.

// oxccl's own interface choice, shared as a file (the plugin must not link oxccl).
#[path = "../../src/bootstrap/ifaces.rs"]
mod ifaces;
// And its check of a silent peer.
#[path = "../../src/transport/net/tcp_info.rs"]
mod tcp_info;
mod wire;

use std::ffi::{c_char, c_int, c_ulong, c_void};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use wire::{Comm, Listener, HANDLE_BYTES};

type R = c_int;
type P = *mut c_void;
type Logger =
    Option<unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, ...)>;

const SUCCESS: R = 0;
const SYSTEM_ERROR: R = 2;
const INTERNAL_ERROR: R = 3;
const INVALID_ARGUMENT: R = 4;
const REMOTE_ERROR: R = 6;
const PTR_HOST: c_int = 1;

/// The host's logger (NCCL_DEBUG), set by `init`.
static LOGGER: AtomicUsize = AtomicUsize::new(0);

/// Logs through the host's logger at `level` (2: WARN, 3: INFO).
fn log(level: c_int, msg: &str) {
    let f = LOGGER.load(Ordering::Acquire);
    if f == 0 {
        return;
    }
    let Ok(msg) = std::ffi::CString::new(msg) else {
        return;
    };
    // SAFETY: `f` is the non-null logger `init` was given, a C variadic function; "%s" takes
    // the one NUL-terminated string passed.
    unsafe {
        let f: unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, ...) =
            std::mem::transmute(f);
        f(
            level,
            0,
            c"oxccl-net".as_ptr(),
            0,
            c"%s".as_ptr(),
            msg.as_ptr(),
        );
    }
}

/// Runs a plugin function's body: its result code, or ncclInternalError if it panicked.
fn guard(f: impl FnOnce() -> R + std::panic::UnwindSafe) -> R {
    std::panic::catch_unwind(f).unwrap_or(INTERNAL_ERROR)
}

/// The address this plugin listens on: `OXCCL_NET_IP`, else the first address of the interface
/// `NCCL_SOCKET_IFNAME` selects (NCCL's syntax; `NCCL_SOCKET_FAMILY`), else of the first one
/// NCCL would pick (not loopback or a container's), else loopback. An `NCCL_SOCKET_IFNAME` that
/// selects nothing is an error naming it.
fn local_ip() -> Result<IpAddr, String> {
    if let Some(ip) = std::env::var("OXCCL_NET_IP")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return Ok(ip);
    }
    let want6 = std::env::var("NCCL_SOCKET_FAMILY")
        .is_ok_and(|f| f.trim().eq_ignore_ascii_case("AF_INET6"));
    match std::env::var("NCCL_SOCKET_IFNAME") {
        Ok(spec) => ifaces::first_addr(spec.trim(), want6)
            .map(|a| a.ip())
            .ok_or_else(|| {
                format!("no interface with an address matches NCCL_SOCKET_IFNAME={spec}")
            }),
        Err(_) => Ok(ifaces::first_addr(ifaces::SKIPPED_BY_DEFAULT, want6)
            .map_or(Ipv4Addr::LOCALHOST.into(), |a| a.ip())),
    }
}

unsafe extern "C" fn init(logger: Logger) -> R {
    LOGGER.store(logger.map_or(0, |f| f as usize), Ordering::Release);
    log(3, "oxccl socket net plugin initialised");
    SUCCESS
}

unsafe extern "C" fn devices(n: *mut c_int) -> R {
    if n.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: the caller passes a valid int pointer.
    unsafe { *n = 1 };
    SUCCESS
}

/// `ncclNetProperties_v8_t`.
#[repr(C)]
struct Props {
    name: *const c_char,
    pci_path: *const c_char,
    guid: u64,
    ptr_support: c_int,
    reg_is_global: c_int,
    speed: c_int,
    port: c_int,
    latency: f32,
    max_comms: c_int,
    max_recvs: c_int,
    net_device_type: c_int,
    net_device_version: c_int,
}

unsafe extern "C" fn get_properties(dev: c_int, props: P) -> R {
    if dev != 0 || props.is_null() {
        return INVALID_ARGUMENT;
    }
    let p = Props {
        name: c"oxsocket".as_ptr(),
        pci_path: std::ptr::null(),
        guid: 0x6f78_736f_636b,
        ptr_support: PTR_HOST,
        reg_is_global: 0,
        speed: 10_000,
        port: 0,
        latency: 0.0,
        max_comms: 65536,
        max_recvs: 1,
        net_device_type: 0,
        net_device_version: 0,
    };
    // SAFETY: the caller passes room for ncclNetProperties_v8_t.
    unsafe { (props as *mut Props).write(p) };
    SUCCESS
}

unsafe extern "C" fn listen(dev: c_int, handle: P, listen_comm: *mut P) -> R {
    if dev != 0 || handle.is_null() || listen_comm.is_null() {
        return INVALID_ARGUMENT;
    }
    guard(|| {
        let ip = match local_ip() {
            Ok(ip) => ip,
            Err(e) => {
                log(2, &format!("oxsocket: {e}"));
                return SYSTEM_ERROR;
            }
        };
        let at = SocketAddr::new(ip, 0);
        let l = match TcpListener::bind(at).and_then(Listener::new) {
            Ok(l) => l,
            Err(e) => {
                log(2, &format!("oxsocket: listening on {at}: {e}"));
                return SYSTEM_ERROR;
            }
        };
        // SAFETY: the handle holds NCCL_NET_HANDLE_MAXSIZE bytes; `listen_comm` is valid.
        unsafe {
            l.handle(
                (handle as *mut [u8; HANDLE_BYTES])
                    .as_mut()
                    .expect("non-null"),
            );
            *listen_comm = Box::into_raw(Box::new(l)) as P;
        }
        SUCCESS
    })
}

unsafe extern "C" fn connect(dev: c_int, handle: P, send_comm: *mut P, dev_comm: *mut P) -> R {
    if dev != 0 || handle.is_null() || send_comm.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: the handle holds what `listen` wrote on the peer (HANDLE_BYTES bytes); the
    // caller passes the same handle until the connection is made (its state lives there).
    let h = unsafe { &mut *(handle as *mut [u8; HANDLE_BYTES]) };
    guard(std::panic::AssertUnwindSafe(|| match Comm::connect(h) {
        Ok(c) => {
            // SAFETY: valid out-pointers from the caller.
            unsafe {
                *send_comm = c.map_or(std::ptr::null_mut(), |c| Box::into_raw(Box::new(c)) as P);
                if !dev_comm.is_null() {
                    *dev_comm = std::ptr::null_mut();
                }
            }
            SUCCESS
        }
        Err(e) => {
            log(2, &format!("oxsocket: connecting: {e}"));
            REMOTE_ERROR
        }
    }))
}

unsafe extern "C" fn accept(listen_comm: P, recv_comm: *mut P, dev_comm: *mut P) -> R {
    if listen_comm.is_null() || recv_comm.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: a listener `listen` made, not yet closed.
    let l = unsafe { &*(listen_comm as *const Listener) };
    guard(std::panic::AssertUnwindSafe(|| {
        let c = match l.accept() {
            Ok(c) => c,
            Err(e) => {
                log(2, &format!("oxsocket: accepting: {e}"));
                return SYSTEM_ERROR;
            }
        };
        // SAFETY: valid out-pointers from the caller.
        unsafe {
            *recv_comm = c.map_or(std::ptr::null_mut(), |c| Box::into_raw(Box::new(c)) as P);
            if !dev_comm.is_null() {
                *dev_comm = std::ptr::null_mut();
            }
        }
        SUCCESS
    }))
}

unsafe extern "C" fn reg_mr(_comm: P, _data: P, _size: usize, kind: c_int, mh: *mut P) -> R {
    if kind != PTR_HOST || mh.is_null() {
        return INTERNAL_ERROR;
    }
    // SAFETY: a valid out-pointer; host memory needs no registration.
    unsafe { *mh = 1 as P };
    SUCCESS
}

unsafe extern "C" fn dereg_mr(_comm: P, _mh: P) -> R {
    SUCCESS
}

unsafe extern "C" fn isend(comm: P, data: P, size: c_int, _tag: c_int, _mh: P, req: *mut P) -> R {
    if comm.is_null() || req.is_null() || size < 0 {
        return INVALID_ARGUMENT;
    }
    // SAFETY: a comm `connect` made; `data` holds `size` bytes until the request completes.
    unsafe { post(comm, false, data, size as usize, req) }
}

unsafe extern "C" fn irecv(
    comm: P,
    n: c_int,
    data: *mut P,
    sizes: *mut c_int,
    _tags: *mut c_int,
    _mh: *mut P,
    req: *mut P,
) -> R {
    if comm.is_null() || req.is_null() || n != 1 || data.is_null() || sizes.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: one buffer of sizes[0] bytes, valid until the request completes.
    unsafe {
        if *sizes < 0 {
            return INVALID_ARGUMENT;
        }
        post(comm, true, *data, *sizes as usize, req)
    }
}

/// Posts a send or receive on `comm`; a NULL request when the comm has no free request.
///
/// # Safety
/// `comm` is a live comm; `data` holds `size` bytes until the request completes.
unsafe fn post(comm: P, recv: bool, data: P, size: usize, req: *mut P) -> R {
    // SAFETY: see above; a comm is driven by one thread at a time (NCCL's proxy).
    let c = unsafe { &mut *(comm as *mut Comm) };
    let r = c.post(recv, data as *mut u8, size);
    // SAFETY: a valid out-pointer.
    unsafe { *req = r.map_or(std::ptr::null_mut(), |r| r as P) };
    SUCCESS
}

unsafe extern "C" fn test(req: P, done: *mut c_int, size: *mut c_int) -> R {
    if req.is_null() || done.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: a request `post` returned and not yet reported done.
    guard(std::panic::AssertUnwindSafe(|| {
        match unsafe { wire::test(req as *mut wire::Request) } {
            Ok(Some(n)) => {
                // SAFETY: valid out-pointers.
                unsafe {
                    *done = 1;
                    if !size.is_null() {
                        *size = n as c_int;
                    }
                }
                SUCCESS
            }
            Ok(None) => {
                // SAFETY: as above.
                unsafe { *done = 0 };
                SUCCESS
            }
            Err(e) => {
                if !e.closed {
                    log(2, &format!("oxsocket: {}", e.msg));
                }
                REMOTE_ERROR
            }
        }
    }))
}

unsafe extern "C" fn close_comm(comm: P) -> R {
    if !comm.is_null() {
        // SAFETY: a comm `connect` or `accept` made, closed once.
        drop(unsafe { Box::from_raw(comm as *mut Comm) });
    }
    SUCCESS
}

unsafe extern "C" fn close_listen(l: P) -> R {
    if !l.is_null() {
        // SAFETY: a listener `listen` made, closed once.
        drop(unsafe { Box::from_raw(l as *mut Listener) });
    }
    SUCCESS
}

/// `ncclNet_v8_t`.
#[repr(C)]
pub struct NetV8 {
    name: *const c_char,
    init: unsafe extern "C" fn(Logger) -> R,
    devices: unsafe extern "C" fn(*mut c_int) -> R,
    get_properties: unsafe extern "C" fn(c_int, P) -> R,
    listen: unsafe extern "C" fn(c_int, P, *mut P) -> R,
    connect: unsafe extern "C" fn(c_int, P, *mut P, *mut P) -> R,
    accept: unsafe extern "C" fn(P, *mut P, *mut P) -> R,
    reg_mr: unsafe extern "C" fn(P, P, usize, c_int, *mut P) -> R,
    reg_mr_dmabuf: P,
    dereg_mr: unsafe extern "C" fn(P, P) -> R,
    isend: unsafe extern "C" fn(P, P, c_int, c_int, P, *mut P) -> R,
    irecv: unsafe extern "C" fn(P, c_int, *mut P, *mut c_int, *mut c_int, *mut P, *mut P) -> R,
    iflush: P,
    test: unsafe extern "C" fn(P, *mut c_int, *mut c_int) -> R,
    close_send: unsafe extern "C" fn(P) -> R,
    close_recv: unsafe extern "C" fn(P) -> R,
    close_listen: unsafe extern "C" fn(P) -> R,
    get_device_mr: P,
    irecv_consumed: P,
}

// SAFETY: the table is immutable; its pointers are to static data and functions.
unsafe impl Sync for NetV8 {}

#[no_mangle]
pub static ncclNetPlugin_v8: NetV8 = NetV8 {
    name: c"oxsocket".as_ptr(),
    init,
    devices,
    get_properties,
    listen,
    connect,
    accept,
    reg_mr,
    reg_mr_dmabuf: std::ptr::null_mut(),
    dereg_mr,
    isend,
    irecv,
    iflush: std::ptr::null_mut(),
    test,
    close_send: close_comm,
    close_recv: close_comm,
    close_listen,
    get_device_mr: std::ptr::null_mut(),
    irecv_consumed: std::ptr::null_mut(),
};
