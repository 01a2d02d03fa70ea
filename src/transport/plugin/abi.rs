//! The net plugin ABI, `ncclNet_v6` .. `ncclNet_v12` (layouts from NCCL's public plugin headers,
//! `plugins/net/example/nccl/net_v*.h`), behind one set of calls (`Net`). What changed between
//! versions: v7 added device handles to connect/accept; v8 made regMr's size a size_t; v9 made
//! isend/irecv sizes size_t; v10 added a profiler callback to init, a comm config to connect
//! and profiler handles to isend/irecv; v11 and v12 made init return a context that
//! listen/connect take (one per communicator: `Net::comm_context`), and added finalize. oxccl
//! moves host memory only (`NCCL_PTR_HOST`) and posts one buffer per receive.

use crate::error::{Error, Result};
use std::ffi::{c_char, c_int, c_ulong, c_void, CStr};

type R = c_int;
type P = *mut c_void;
/// `ncclDebugLogger_t`, received as a plain pointer (see `logger`).
type Logger = *const c_void;
type F<T> = Option<T>;

/// NCCL_NET_HANDLE_MAXSIZE.
pub const HANDLE_BYTES: usize = 128;
const PTR_HOST: c_int = 1;

#[repr(C)]
pub struct V6 {
    name: *const c_char,
    init: F<unsafe extern "C" fn(Logger) -> R>,
    devices: F<unsafe extern "C" fn(*mut c_int) -> R>,
    get_properties: F<unsafe extern "C" fn(c_int, P) -> R>,
    listen: F<unsafe extern "C" fn(c_int, P, *mut P) -> R>,
    connect: F<unsafe extern "C" fn(c_int, P, *mut P) -> R>,
    accept: F<unsafe extern "C" fn(P, *mut P) -> R>,
    reg_mr: F<unsafe extern "C" fn(P, P, c_int, c_int, *mut P) -> R>,
    reg_mr_dmabuf: P,
    dereg_mr: F<unsafe extern "C" fn(P, P) -> R>,
    isend: F<unsafe extern "C" fn(P, P, c_int, c_int, P, *mut P) -> R>,
    irecv: F<unsafe extern "C" fn(P, c_int, *mut P, *mut c_int, *mut c_int, *mut P, *mut P) -> R>,
    iflush: P,
    test: F<unsafe extern "C" fn(P, *mut c_int, *mut c_int) -> R>,
    close_send: F<unsafe extern "C" fn(P) -> R>,
    close_recv: F<unsafe extern "C" fn(P) -> R>,
    close_listen: F<unsafe extern "C" fn(P) -> R>,
}

/// v7 and v8 (v8: regMr's size is a size_t, same place).
#[repr(C)]
pub struct V7<S> {
    name: *const c_char,
    init: F<unsafe extern "C" fn(Logger) -> R>,
    devices: F<unsafe extern "C" fn(*mut c_int) -> R>,
    get_properties: F<unsafe extern "C" fn(c_int, P) -> R>,
    listen: F<unsafe extern "C" fn(c_int, P, *mut P) -> R>,
    connect: F<unsafe extern "C" fn(c_int, P, *mut P, *mut P) -> R>,
    accept: F<unsafe extern "C" fn(P, *mut P, *mut P) -> R>,
    reg_mr: F<unsafe extern "C" fn(P, P, S, c_int, *mut P) -> R>,
    reg_mr_dmabuf: P,
    dereg_mr: F<unsafe extern "C" fn(P, P) -> R>,
    isend: F<unsafe extern "C" fn(P, P, c_int, c_int, P, *mut P) -> R>,
    irecv: F<unsafe extern "C" fn(P, c_int, *mut P, *mut c_int, *mut c_int, *mut P, *mut P) -> R>,
    iflush: P,
    test: F<unsafe extern "C" fn(P, *mut c_int, *mut c_int) -> R>,
    close_send: F<unsafe extern "C" fn(P) -> R>,
    close_recv: F<unsafe extern "C" fn(P) -> R>,
    close_listen: F<unsafe extern "C" fn(P) -> R>,
}

#[repr(C)]
pub struct V9 {
    name: *const c_char,
    init: F<unsafe extern "C" fn(Logger) -> R>,
    devices: F<unsafe extern "C" fn(*mut c_int) -> R>,
    get_properties: F<unsafe extern "C" fn(c_int, P) -> R>,
    listen: F<unsafe extern "C" fn(c_int, P, *mut P) -> R>,
    connect: F<unsafe extern "C" fn(c_int, P, *mut P, *mut P) -> R>,
    accept: F<unsafe extern "C" fn(P, *mut P, *mut P) -> R>,
    reg_mr: F<unsafe extern "C" fn(P, P, usize, c_int, *mut P) -> R>,
    reg_mr_dmabuf: P,
    dereg_mr: F<unsafe extern "C" fn(P, P) -> R>,
    isend: F<unsafe extern "C" fn(P, P, usize, c_int, P, *mut P) -> R>,
    irecv: F<unsafe extern "C" fn(P, c_int, *mut P, *mut usize, *mut c_int, *mut P, *mut P) -> R>,
    iflush: P,
    test: F<unsafe extern "C" fn(P, *mut c_int, *mut c_int) -> R>,
    close_send: F<unsafe extern "C" fn(P) -> R>,
    close_recv: F<unsafe extern "C" fn(P) -> R>,
    close_listen: F<unsafe extern "C" fn(P) -> R>,
}

/// v10.
#[repr(C)]
pub struct V10 {
    name: *const c_char,
    init: F<unsafe extern "C" fn(Logger, P) -> R>,
    devices: F<unsafe extern "C" fn(*mut c_int) -> R>,
    get_properties: F<unsafe extern "C" fn(c_int, P) -> R>,
    listen: F<unsafe extern "C" fn(c_int, P, *mut P) -> R>,
    connect: F<unsafe extern "C" fn(c_int, *mut c_int, P, *mut P, *mut P) -> R>,
    accept: F<unsafe extern "C" fn(P, *mut P, *mut P) -> R>,
    reg_mr: F<unsafe extern "C" fn(P, P, usize, c_int, *mut P) -> R>,
    reg_mr_dmabuf: P,
    dereg_mr: F<unsafe extern "C" fn(P, P) -> R>,
    isend: F<unsafe extern "C" fn(P, P, usize, c_int, P, P, *mut P) -> R>,
    irecv: F<
        unsafe extern "C" fn(P, c_int, *mut P, *mut usize, *mut c_int, *mut P, *mut P, *mut P) -> R,
    >,
    iflush: P,
    test: F<unsafe extern "C" fn(P, *mut c_int, *mut c_int) -> R>,
    close_send: F<unsafe extern "C" fn(P) -> R>,
    close_recv: F<unsafe extern "C" fn(P) -> R>,
    close_listen: F<unsafe extern "C" fn(P) -> R>,
}

/// v11 and v12 (the same calls; v12's property and attribute structs, which oxccl does not
/// read, grew).
#[repr(C)]
pub struct V11 {
    name: *const c_char,
    init: F<unsafe extern "C" fn(*mut P, u64, *mut c_int, Logger, P) -> R>,
    devices: F<unsafe extern "C" fn(*mut c_int) -> R>,
    get_properties: F<unsafe extern "C" fn(c_int, P) -> R>,
    listen: F<unsafe extern "C" fn(P, c_int, P, *mut P) -> R>,
    connect: F<unsafe extern "C" fn(P, c_int, P, *mut P, *mut P) -> R>,
    accept: F<unsafe extern "C" fn(P, *mut P, *mut P) -> R>,
    reg_mr: F<unsafe extern "C" fn(P, P, usize, c_int, *mut P) -> R>,
    reg_mr_dmabuf: P,
    dereg_mr: F<unsafe extern "C" fn(P, P) -> R>,
    isend: F<unsafe extern "C" fn(P, P, usize, c_int, P, P, *mut P) -> R>,
    irecv: F<
        unsafe extern "C" fn(P, c_int, *mut P, *mut usize, *mut c_int, *mut P, *mut P, *mut P) -> R,
    >,
    iflush: P,
    test: F<unsafe extern "C" fn(P, *mut c_int, *mut c_int) -> R>,
    close_send: F<unsafe extern "C" fn(P) -> R>,
    close_recv: F<unsafe extern "C" fn(P) -> R>,
    close_listen: F<unsafe extern "C" fn(P) -> R>,
    get_device_mr: P,
    irecv_consumed: P,
    make_vdevice: P,
    finalize: F<unsafe extern "C" fn(P) -> R>,
}

/// Field `$f` of whichever version's table, for the fields whose type every version shares.
macro_rules! same {
    ($table:expr, $f:ident) => {
        match $table {
            Table::V6(t) => t.$f,
            Table::V7(t) => t.$f,
            Table::V8(t) => t.$f,
            Table::V9(t) => t.$f,
            Table::V10(t) => t.$f,
            Table::V11(t) => t.$f,
        }
    };
}

/// A plugin's table, by version.
#[derive(Clone, Copy)]
pub enum Table {
    V6(&'static V6),
    V7(&'static V7<c_int>),
    V8(&'static V7<usize>),
    V9(&'static V9),
    V10(&'static V10),
    V11(&'static V11),
}

/// A loaded plugin: its table and (v11+, until `end_probe`) the context of its first init.
pub struct Net {
    pub name: String,
    table: Table,
    ctx: P,
}

// SAFETY: plugins are called from any thread, as NCCL's proxy threads call them.
unsafe impl Send for Net {}
// SAFETY: as above.
unsafe impl Sync for Net {}

extern "C" {
    /// The logger plugins are given (`logger.c`): variadic, formats, then calls the sink.
    fn oxccl_plugin_logger(
        level: c_int,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    );
    fn oxccl_plugin_log_sink(
        sink: unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char),
    );
}

/// A plugin's log line, formatted by `oxccl_plugin_logger`: NCCL's WARN (level 2) or INFO (3).
unsafe extern "C" fn log_sink(
    level: c_int,
    _file: *const c_char,
    _line: c_int,
    text: *const c_char,
) {
    if text.is_null() {
        return;
    }
    // SAFETY: logger.c passes its NUL-terminated buffer.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    match level {
        2 => crate::debug::warn(&format!("NET/Plugin: {}", text.trim_end())),
        3 => crate::debug::info(&format!("NET/Plugin: {}", text.trim_end())),
        _ => {}
    }
}

/// The logger to hand a plugin's init.
fn logger() -> Logger {
    // SAFETY: sets a function pointer logger.c keeps; `log_sink` lives as long as the library.
    unsafe { oxccl_plugin_log_sink(log_sink) };
    oxccl_plugin_logger as *const c_void
}

/// The profiler callback v10+ plugins get (`ncclProfilerCallback_t`): oxccl records no plugin
/// events, so it hands back no event. NCCL always passes one, and a plugin may call it without
/// checking for null.
unsafe extern "C" fn no_profiler(
    event: *mut P,
    _type: c_int,
    _parent: P,
    _plugin: i64,
    _ext: P,
) -> R {
    if !event.is_null() {
        // SAFETY: the plugin passes where the event handle goes.
        unsafe { *event = std::ptr::null_mut() };
    }
    0
}

/// A request's size as an int (what ABIs before v9 take).
fn int_bytes(bytes: usize, name: &str, what: &str) -> Result<c_int> {
    c_int::try_from(bytes).map_err(|_| {
        Error::internal(format!(
            "net plugin '{name}': a {what} of {bytes} bytes does not fit its ABI's int size"
        ))
    })
}

/// A v11+ init for communicator `comm_id` (0: none): its result and the context.
fn v11_init(t: &V11, name: &str, comm_id: u64, lg: Logger) -> Result<(R, P)> {
    let mut config: c_int = -1; // NCCL_NET_TRAFFIC_CLASS_UNDEF
    let mut ctx = std::ptr::null_mut();
    // SAFETY: the plugin's init, with arguments of the types its ABI declares.
    let r = unsafe {
        must(t.init, name, "init")?(&mut ctx, comm_id, &mut config, lg, no_profiler as P)
    };
    Ok((r, ctx))
}

fn must<T>(f: Option<T>, name: &str, what: &str) -> Result<T> {
    f.ok_or_else(|| Error::system(format!("net plugin '{name}' has no {what} function")))
}

impl Net {
    /// The table `sym` points at, for ABI `version` (6..=12).
    ///
    /// # Safety
    /// `sym` points at a plugin's `ncclNetPlugin_v<version>`, which outlives the process.
    pub unsafe fn new(version: u32, sym: *const c_void) -> Result<Net> {
        // SAFETY: per the contract; every table starts with the name.
        let table = unsafe {
            match version {
                6 => Table::V6(&*(sym as *const V6)),
                7 => Table::V7(&*(sym as *const V7<c_int>)),
                8 => Table::V8(&*(sym as *const V7<usize>)),
                9 => Table::V9(&*(sym as *const V9)),
                10 => Table::V10(&*(sym as *const V10)),
                11 | 12 => Table::V11(&*(sym as *const V11)),
                _ => return Err(Error::internal(format!("net plugin ABI v{version}"))),
            }
        };
        // SAFETY: as above: `name` is the first field of every version.
        let name = unsafe {
            let p = *(sym as *const *const c_char);
            if p.is_null() {
                String::from("(unnamed)")
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        Ok(Net {
            name,
            table,
            ctx: std::ptr::null_mut(),
        })
    }

    fn check(&self, what: &str, r: R) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        let msg = format!(
            "net plugin '{}': {what} failed with NCCL error {r}",
            self.name
        );
        // ncclSystemError 2, ncclInternalError 3, ncclRemoteError 6.
        Err(match r {
            6 => Error::remote(msg),
            2 => Error::system(msg),
            _ => Error::internal(msg),
        })
    }

    /// Initialises the plugin once per process, before its devices are asked for (v11+: a
    /// context with no communicator's id, which `end_probe` finalizes; each communicator then
    /// gets its own, `comm_context`).
    pub fn init(&mut self) -> Result<()> {
        let lg = logger();
        let n = self.name.clone();
        // SAFETY: calling the plugin's functions with arguments of the types its ABI declares.
        let r = unsafe {
            match self.table {
                Table::V6(t) => must(t.init, &n, "init")?(lg),
                Table::V7(t) => must(t.init, &n, "init")?(lg),
                Table::V8(t) => must(t.init, &n, "init")?(lg),
                Table::V9(t) => must(t.init, &n, "init")?(lg),
                Table::V10(t) => must(t.init, &n, "init")?(lg, no_profiler as P),
                Table::V11(t) => {
                    let (r, ctx) = v11_init(t, &n, 0, lg)?;
                    self.ctx = ctx;
                    r
                }
            }
        };
        self.check("init", r)
    }

    /// v11+ (NCCL initialises such a plugin once per communicator, with the communicator's
    /// hash as its id, and finalizes that context when the communicator ends): a context for
    /// the communicator `comm_id`; None for older ABIs, which have none.
    pub fn comm_context(&self, comm_id: u64) -> Result<Option<P>> {
        let Table::V11(t) = self.table else {
            return Ok(None);
        };
        let (r, ctx) = v11_init(t, &self.name, comm_id, logger())?;
        self.check("init", r)?;
        Ok(Some(ctx))
    }

    /// Ends a context `comm_context` gave (v11+), once nothing made with it is open; a failure
    /// is a WARN (the communicator is going anyway).
    pub fn finalize(&self, ctx: P) {
        if let Table::V11(t) = self.table {
            if let Some(f) = t.finalize {
                // SAFETY: `ctx` came from the plugin's init and is finalized once.
                let r = unsafe { f(ctx) };
                if let Err(e) = self.check("finalize", r) {
                    crate::debug::warn(&e.msg);
                }
            }
        }
    }

    /// Finalizes `init`'s context (v11+) once the plugin's devices and properties are read: as
    /// from NCCL, the plugin's contexts are then its communicators'.
    pub fn end_probe(&mut self) {
        let ctx = std::mem::replace(&mut self.ctx, std::ptr::null_mut());
        self.finalize(ctx);
    }

    /// A `what` request's size for this plugin's isend/irecv as an int: checked before v9,
    /// unused (0) from v9, which take a size_t.
    fn int_bytes(&self, bytes: usize, what: &str) -> Result<c_int> {
        match self.table {
            Table::V6(_) | Table::V7(_) | Table::V8(_) => int_bytes(bytes, &self.name, what),
            _ => Ok(0),
        }
    }

    /// The number of devices.
    pub fn devices(&self) -> Result<i32> {
        let mut n: c_int = 0;
        let f = same!(self.table, devices);
        // SAFETY: as in `init`.
        let r = unsafe { must(f, &self.name, "devices")?(&mut n) };
        self.check("devices", r)?;
        Ok(n)
    }

    /// Whether device `dev` moves host memory (`ptrSupport` & NCCL_PTR_HOST: the field sits at
    /// the same place, after name, pciPath and guid, in every version's properties).
    pub fn moves_host_memory(&self, dev: i32) -> Result<bool> {
        let f = same!(self.table, get_properties);
        // Larger than any version's properties.
        let mut props = vec![0u64; 1024];
        // SAFETY: as in `init`; the buffer outsizes the struct.
        let r = unsafe { must(f, &self.name, "getProperties")?(dev, props.as_mut_ptr() as P) };
        self.check("getProperties", r)?;
        let ptr_support = (props[3] & 0xffff_ffff) as c_int;
        Ok(ptr_support & PTR_HOST != 0)
    }

    /// Listens on device `dev` (v11+: in context `ctx`, its communicator's): the listening comm;
    /// `handle` is what the peer connects to.
    pub fn listen(&self, ctx: P, dev: i32, handle: &mut [u8; HANDLE_BYTES]) -> Result<P> {
        let mut l = std::ptr::null_mut();
        let h = handle.as_mut_ptr() as P;
        let n = &self.name;
        // SAFETY: as in `init`; the handle holds NCCL_NET_HANDLE_MAXSIZE bytes.
        let r = unsafe {
            match self.table {
                Table::V6(t) => must(t.listen, n, "listen")?(dev, h, &mut l),
                Table::V7(t) => must(t.listen, n, "listen")?(dev, h, &mut l),
                Table::V8(t) => must(t.listen, n, "listen")?(dev, h, &mut l),
                Table::V9(t) => must(t.listen, n, "listen")?(dev, h, &mut l),
                Table::V10(t) => must(t.listen, n, "listen")?(dev, h, &mut l),
                Table::V11(t) => must(t.listen, n, "listen")?(ctx, dev, h, &mut l),
            }
        };
        self.check("listen", r)?;
        Ok(l)
    }

    /// One try at connecting to `handle` (v11+: in context `ctx`, as `listen`): the send comm,
    /// or null (call again).
    pub fn connect(&self, ctx: P, dev: i32, handle: &mut [u8; HANDLE_BYTES]) -> Result<P> {
        let mut s = std::ptr::null_mut();
        let mut dc = std::ptr::null_mut();
        let h = handle.as_mut_ptr() as P;
        let n = &self.name;
        // SAFETY: as in `listen`.
        let r = unsafe {
            match self.table {
                Table::V6(t) => must(t.connect, n, "connect")?(dev, h, &mut s),
                Table::V7(t) => must(t.connect, n, "connect")?(dev, h, &mut s, &mut dc),
                Table::V8(t) => must(t.connect, n, "connect")?(dev, h, &mut s, &mut dc),
                Table::V9(t) => must(t.connect, n, "connect")?(dev, h, &mut s, &mut dc),
                Table::V10(t) => {
                    let mut config: c_int = -1;
                    must(t.connect, n, "connect")?(dev, &mut config, h, &mut s, &mut dc)
                }
                Table::V11(t) => must(t.connect, n, "connect")?(ctx, dev, h, &mut s, &mut dc),
            }
        };
        self.check("connect", r)?;
        Ok(s)
    }

    /// One try at accepting on `listen`: the receive comm, or null (call again).
    pub fn accept(&self, listen: P) -> Result<P> {
        let mut c = std::ptr::null_mut();
        let mut dc = std::ptr::null_mut();
        let n = &self.name;
        // SAFETY: as in `init`; `listen` came from `listen`.
        let r = unsafe {
            match self.table {
                Table::V6(t) => must(t.accept, n, "accept")?(listen, &mut c),
                Table::V7(t) => must(t.accept, n, "accept")?(listen, &mut c, &mut dc),
                Table::V8(t) => must(t.accept, n, "accept")?(listen, &mut c, &mut dc),
                Table::V9(t) => must(t.accept, n, "accept")?(listen, &mut c, &mut dc),
                Table::V10(t) => must(t.accept, n, "accept")?(listen, &mut c, &mut dc),
                Table::V11(t) => must(t.accept, n, "accept")?(listen, &mut c, &mut dc),
            }
        };
        self.check("accept", r)?;
        Ok(c)
    }

    /// Registers `bytes` of host memory at `data` with `comm`.
    pub fn reg_mr(&self, comm: P, data: *mut u8, bytes: usize) -> Result<P> {
        let mut mh = std::ptr::null_mut();
        let d = data as P;
        let n = &self.name;
        let small = c_int::try_from(bytes)
            .map_err(|_| Error::internal(format!("net plugin '{n}': {bytes} bytes to register")));
        // SAFETY: as in `init`; `data` holds `bytes` bytes that outlive the registration.
        let r = unsafe {
            match self.table {
                Table::V6(t) => must(t.reg_mr, n, "regMr")?(comm, d, small?, PTR_HOST, &mut mh),
                Table::V7(t) => must(t.reg_mr, n, "regMr")?(comm, d, small?, PTR_HOST, &mut mh),
                Table::V8(t) => must(t.reg_mr, n, "regMr")?(comm, d, bytes, PTR_HOST, &mut mh),
                Table::V9(t) => must(t.reg_mr, n, "regMr")?(comm, d, bytes, PTR_HOST, &mut mh),
                Table::V10(t) => must(t.reg_mr, n, "regMr")?(comm, d, bytes, PTR_HOST, &mut mh),
                Table::V11(t) => must(t.reg_mr, n, "regMr")?(comm, d, bytes, PTR_HOST, &mut mh),
            }
        };
        self.check("regMr", r)?;
        Ok(mh)
    }

    pub fn dereg_mr(&self, comm: P, mh: P) {
        let f = same!(self.table, dereg_mr);
        if let Some(f) = f {
            // SAFETY: `mh` came from `reg_mr` on `comm`.
            let _ = unsafe { f(comm, mh) };
        }
    }

    /// Posts a send of `bytes` at `data`: the request, or null (the plugin is busy: again later).
    pub fn isend(&self, comm: P, data: *const u8, bytes: usize, mh: P) -> Result<P> {
        let mut req = std::ptr::null_mut();
        let d = data as P;
        let n = &self.name;
        let b = self.int_bytes(bytes, "send")?;
        let none = std::ptr::null_mut();
        // SAFETY: as in `init`; the memory stays registered and unchanged until the request
        // completes.
        let r = unsafe {
            match self.table {
                Table::V6(t) => must(t.isend, n, "isend")?(comm, d, b, 0, mh, &mut req),
                Table::V7(t) => must(t.isend, n, "isend")?(comm, d, b, 0, mh, &mut req),
                Table::V8(t) => must(t.isend, n, "isend")?(comm, d, b, 0, mh, &mut req),
                Table::V9(t) => must(t.isend, n, "isend")?(comm, d, bytes, 0, mh, &mut req),
                Table::V10(t) => must(t.isend, n, "isend")?(comm, d, bytes, 0, mh, none, &mut req),
                Table::V11(t) => must(t.isend, n, "isend")?(comm, d, bytes, 0, mh, none, &mut req),
            }
        };
        self.check("isend", r)?;
        Ok(req)
    }

    /// Posts a receive of up to `bytes` into `data`: the request, or null (again later).
    pub fn irecv(&self, comm: P, data: *mut u8, bytes: usize, mh: P) -> Result<P> {
        let mut req = std::ptr::null_mut();
        let mut d = data as P;
        let mut mh = mh;
        let mut tag: c_int = 0;
        let mut b = self.int_bytes(bytes, "receive")?;
        let mut bz = bytes;
        let mut ph: P = std::ptr::null_mut();
        let n = &self.name;
        // SAFETY: as in `init`; one buffer (n = 1), registered, ours until the request completes.
        let r = unsafe {
            match self.table {
                Table::V6(t) => {
                    must(t.irecv, n, "irecv")?(comm, 1, &mut d, &mut b, &mut tag, &mut mh, &mut req)
                }
                Table::V7(t) => {
                    must(t.irecv, n, "irecv")?(comm, 1, &mut d, &mut b, &mut tag, &mut mh, &mut req)
                }
                Table::V8(t) => {
                    must(t.irecv, n, "irecv")?(comm, 1, &mut d, &mut b, &mut tag, &mut mh, &mut req)
                }
                Table::V9(t) => must(t.irecv, n, "irecv")?(
                    comm, 1, &mut d, &mut bz, &mut tag, &mut mh, &mut req,
                ),
                Table::V10(t) => must(t.irecv, n, "irecv")?(
                    comm, 1, &mut d, &mut bz, &mut tag, &mut mh, &mut ph, &mut req,
                ),
                Table::V11(t) => must(t.irecv, n, "irecv")?(
                    comm, 1, &mut d, &mut bz, &mut tag, &mut mh, &mut ph, &mut req,
                ),
            }
        };
        self.check("irecv", r)?;
        Ok(req)
    }

    /// Whether `req` is done, and the bytes it moved.
    pub fn test(&self, req: P) -> Result<Option<usize>> {
        let f = same!(self.table, test);
        let (mut done, mut size) = (0 as c_int, 0 as c_int);
        // SAFETY: `req` came from isend/irecv and is not done yet.
        let r = unsafe { must(f, &self.name, "test")?(req, &mut done, &mut size) };
        self.check("test", r)?;
        Ok((done != 0).then_some(size.max(0) as usize))
    }

    fn close_with(&self, f: F<unsafe extern "C" fn(P) -> R>, comm: P) {
        if let (Some(f), false) = (f, comm.is_null()) {
            // SAFETY: `comm` came from the matching listen/connect/accept, closed once.
            let _ = unsafe { f(comm) };
        }
    }

    pub fn close_send(&self, comm: P) {
        self.close_with(same!(self.table, close_send), comm)
    }
    pub fn close_recv(&self, comm: P) {
        self.close_with(same!(self.table, close_recv), comm)
    }
    pub fn close_listen(&self, comm: P) {
        self.close_with(same!(self.table, close_listen), comm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plugin_calling_the_profiler_gets_no_event_and_success() {
        let mut event: P = 8 as P;
        // SAFETY: called as a plugin would, with a place for the event handle.
        assert_eq!(
            unsafe { no_profiler(&mut event, 1, 16 as P, 7, 32 as P) },
            0
        );
        assert!(event.is_null());
        // SAFETY: a null place is ignored.
        assert_eq!(
            unsafe { no_profiler(std::ptr::null_mut(), 1, 16 as P, 7, 32 as P) },
            0
        );
    }

    #[test]
    fn sizes_past_an_int_are_an_error_for_abis_before_v9() {
        assert_eq!(int_bytes(1 << 20, "p", "send").unwrap(), 1 << 20);
        assert_eq!(
            int_bytes(c_int::MAX as usize, "p", "send").unwrap(),
            c_int::MAX
        );
        let e = int_bytes(1 << 31, "p", "receive").unwrap_err();
        assert!(
            e.msg
                .contains("net plugin 'p': a receive of 2147483648 bytes"),
            "{}",
            e.msg
        );
    }
}
