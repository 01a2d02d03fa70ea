//! Ranks on other hosts through a net plugin (`plugin::net`): the same FIFO as every transport,
//! its slots moved by the plugin's isend/irecv. Each slot travels as two messages on the
//! connection's comm: its header (call words, bytes) from a small registered array, then its
//! bytes straight from (into) the FIFO slot, registered once. Up to `INFLIGHT` slots are posted
//! at once; requests complete in order.
//!
//! Unlike the socket transport, nothing travels while a connection is idle (no heartbeats): a
//! peer whose connection closes is seen at once (a failed header wait), but a link that goes
//! down only at the communicator's timeout.
//!
//! Set-up goes through the transport seam: the receiving end listens on device 0 and its blob
//! is the plugin's handle; the sending end connects to it. Both finish (connect, accept: the
//! plugin may need several calls) while the executor and the proxy thread drive the end.

use super::inproc;
use super::peer::PeerInfo;
use super::plugin::abi::{Net as Plugin, HANDLE_BYTES};
use super::{ConnSpec, Endpoint, Locality, Proxy, Region, Transport, Wait};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub struct NetPlugin;

const HDR: usize = 24;
/// Slots posted at once (two requests each: within NCCL_NET_MAX_REQUESTS = 8 of older ABIs).
const INFLIGHT: u64 = 4;

fn plugin() -> Result<&'static Plugin> {
    super::plugin::net().ok_or_else(|| Error::internal("the net plugin is gone"))
}

/// A rank's context in a v11+ plugin, which NCCL initialises once per communicator of each rank
/// (with the communicator's hash as its id) and finalizes when the communicator ends. The
/// rank's connections through the plugin share it; the last of them to go finalizes it, after
/// closing its own comms (`PluginEnd` holds it in its last field).
struct CommContext(Comm);

impl Drop for CommContext {
    fn drop(&mut self) {
        if let Ok(net) = plugin() {
            net.finalize(self.0 .0);
        }
    }
}

// SAFETY: the context is only handed back to the plugin, from any thread (as NCCL's proxy
// threads do).
unsafe impl Sync for CommContext {}

/// The contexts of the ranks with connections through the plugin, by (communicator, rank)
/// (`ncclCommInitAll` puts several ranks of one communicator in a process).
type Contexts = Vec<((u64, usize), std::sync::Weak<CommContext>)>;
static CONTEXTS: Mutex<Contexts> = Mutex::new(Vec::new());

/// Rank `key.1`'s context in communicator `key.0`, made at its first connection through the
/// plugin (None where the plugin's ABI, before v11, has none).
fn comm_context(net: &Plugin, key: (u64, usize)) -> Result<Option<Arc<CommContext>>> {
    let mut all = CONTEXTS.lock();
    all.retain(|(_, w)| w.strong_count() > 0);
    if let Some(c) = all
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, w)| w.upgrade())
    {
        return Ok(Some(c));
    }
    let Some(ctx) = net.comm_context(key.0)? else {
        return Ok(None);
    };
    let c = Arc::new(CommContext(Comm(ctx)));
    all.push((key, Arc::downgrade(&c)));
    Ok(Some(c))
}

/// The plugin's pointer for a context (null: none, before v11; a v11+ plugin may also give
/// null, which it then gets back).
fn ctx_ptr(c: &Option<Arc<CommContext>>) -> *mut c_void {
    c.as_ref().map_or(std::ptr::null_mut(), |c| c.0 .0)
}

impl Transport for NetPlugin {
    fn name(&self) -> &'static str {
        "network (net plugin)"
    }
    fn reaches(&self, me: &PeerInfo, peer: &PeerInfo) -> bool {
        Locality::of(me, peer) == Locality::OtherHost
    }
    fn setup(&self, spec: &ConnSpec) -> Result<(Box<dyn Endpoint>, Vec<u8>)> {
        let net = plugin()?;
        let ctx = comm_context(net, (spec.comm_hash, spec.me))?;
        // Named for this end alone (both ends of one connection may live in one process).
        let end = if spec.is_sender { "send" } else { "recv" };
        let name = format!("{}-netp-{}-{end}", spec.name(), std::process::id());
        let region = inproc::open(&name, super::region_bytes(spec.nsteps, spec.slot_bytes))?;
        inproc::forget(&name);
        let (listen, blob) = if spec.is_sender {
            (Comm::null(), Vec::new())
        } else {
            let mut handle = [0u8; HANDLE_BYTES];
            let l = net.listen(ctx_ptr(&ctx), 0, &mut handle)?;
            (Comm(l), handle.to_vec())
        };
        Ok((
            Box::new(Setup {
                region,
                listen,
                spec: (spec.me, spec.peer, spec.is_sender),
                geometry: (spec.nsteps, spec.slot_bytes),
                ctx,
            }),
            blob,
        ))
    }
}

/// A plugin object (comm, request or memory handle), ours to pass back to it.
#[derive(Clone, Copy)]
struct Comm(*mut c_void);

impl Comm {
    fn null() -> Comm {
        Comm(std::ptr::null_mut())
    }
}

// SAFETY: plugin objects are used under the end's lock only, from any thread (as NCCL's
// proxy threads do).
unsafe impl Send for Comm {}

struct Setup {
    region: Arc<inproc::HeapRegion>,
    listen: Comm,
    spec: (usize, usize, bool),
    geometry: (usize, usize),
    ctx: Option<Arc<CommContext>>,
}

impl Drop for Setup {
    /// A receiving end that never connected (the peer's set-up failed) closes its listening
    /// comm, before its context may be finalized (fields drop after this).
    fn drop(&mut self) {
        if !self.listen.0.is_null() {
            if let Ok(net) = plugin() {
                net.close_listen(self.listen.0);
            }
        }
    }
}

impl Endpoint for Setup {
    fn connect(mut self: Box<Self>, peer_blob: &[u8]) -> Result<super::Conn> {
        // Handed on to the end (`Setup::drop` closes what is left).
        let listen = std::mem::replace(&mut self.listen, Comm::null());
        let ctx = self.ctx.take();
        let s = &*self;
        let (me, peer, is_sender) = s.spec;
        let (nsteps, slot_bytes) = s.geometry;
        let view = || {
            super::Conn::new(
                Region::Heap(s.region.clone()),
                nsteps,
                slot_bytes,
                (me, peer),
                is_sender,
            )
        };
        let mut conn = view();
        // The region is this end's alone: both "ends" of it are here.
        conn.attach();
        conn.attach();
        let state = if is_sender {
            let mut handle = [0u8; HANDLE_BYTES];
            if peer_blob.len() != HANDLE_BYTES {
                return Err(Error::internal(format!(
                    "rank {me}: rank {peer}'s net plugin handle has {} bytes",
                    peer_blob.len()
                )));
            }
            handle.copy_from_slice(peer_blob);
            State::Connecting(Box::new(handle))
        } else {
            State::Accepting(listen)
        };
        conn.proxy = Some(Arc::new(PluginEnd {
            view: view(),
            me,
            peer,
            is_sender,
            hdrs: Headers::new(nsteps),
            state: Mutex::new(Wire {
                state,
                posted: 0,
                done: 0,
                reqs: VecDeque::new(),
                failed: None,
                last: std::time::Instant::now(),
            }),
            closed: Default::default(),
            waker: Default::default(),
            ctx,
        }));
        Ok(conn)
    }
}

enum State {
    Connecting(Box<[u8; HANDLE_BYTES]>),
    Accepting(Comm),
    /// The comm and the registrations of the FIFO's slots and of the header array.
    Ready {
        comm: Comm,
        slots: Comm,
        hdrs: Comm,
    },
    Closed,
}

/// A slot's message on the comm.
#[derive(Clone, Copy)]
enum Req {
    /// Not posted yet: the plugin was busy (the bytes after their header only).
    Unposted,
    Pending(Comm),
    Done,
}

impl Req {
    /// A post's answer: a request, or null when the plugin was busy.
    fn posted(r: *mut c_void) -> Req {
        if r.is_null() {
            Req::Unposted
        } else {
            Req::Pending(Comm(r))
        }
    }
}

struct Wire {
    state: State,
    /// Slots posted, and completed (freed on the sending end, published on the receiving end).
    posted: u64,
    done: u64,
    /// Each posted slot's two requests (header, bytes), oldest first.
    reqs: VecDeque<[Req; 2]>,
    /// The error that ended the end: every later round returns it again, so that the proxy
    /// thread meets it even where the executor's thread met it first (and let it go).
    failed: Option<Error>,
    /// When a slot last completed.
    last: std::time::Instant,
}

/// Slot headers as the plugin reads and writes them (outside any Rust borrow): `len` of them.
struct Headers {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a plain allocation; header k is touched by one side at a time (see `step_ready`).
unsafe impl Send for Headers {}
// SAFETY: as above.
unsafe impl Sync for Headers {}

impl Headers {
    fn new(len: usize) -> Headers {
        let b: Box<[u8]> = vec![0u8; len * HDR].into_boxed_slice();
        Headers {
            ptr: Box::into_raw(b) as *mut u8,
            len,
        }
    }
    fn at(&self, k: usize) -> *mut u8 {
        assert!(k < self.len);
        // SAFETY: within the allocation.
        unsafe { self.ptr.add(k * HDR) }
    }
}

impl Drop for Headers {
    fn drop(&mut self) {
        // SAFETY: made by `new` from a boxed slice of len * HDR bytes; the plugin is done with
        // it (the comm was closed first: PluginEnd's fields drop after its own Drop).
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len * HDR))
        });
    }
}

/// One end of a connection through the plugin.
pub struct PluginEnd {
    view: super::Conn,
    me: usize,
    peer: usize,
    is_sender: bool,
    /// Each slot's header on the wire (its own buffer: the FIFO's header area is not
    /// registered with the plugin).
    hdrs: Headers,
    state: Mutex<Wire>,
    /// The peer closed the connection between slots.
    closed: std::sync::atomic::AtomicBool,
    /// Set when the proxy thread takes the end.
    waker: once_cell::sync::OnceCell<super::proxy::Waker>,
    /// Its communicator's context in a v11+ plugin. Last: it is finalized (if this end holds
    /// it last) only after `drop` closed the end's comms and its other fields went.
    ctx: Option<Arc<CommContext>>,
}

impl PluginEnd {
    fn failed(&self, e: Error) -> Error {
        Error::remote(format!(
            "rank {}: the network connection {} rank {} (net plugin) failed: {}",
            self.me,
            if self.is_sender { "to" } else { "from" },
            self.peer,
            e.msg
        ))
    }

    /// A connect or accept that has not completed since `since` (when the end was made): an
    /// error once the peer has had far too long (`super::never_connected`).
    fn not_yet(&self, since: std::time::Instant) -> Result<bool> {
        match super::never_connected(since) {
            Some(why) => Err(self.failed(Error::remote(why))),
            None => Ok(false),
        }
    }

    /// One round: connect/accept, post what can be posted, complete what is done. After an
    /// error the end moves nothing more and each round returns that error.
    fn step(&self, w: &mut Wire) -> Result<bool> {
        if let Some(e) = &w.failed {
            return Err(e.clone());
        }
        if self.closed.load(Ordering::Acquire) {
            return Ok(false);
        }
        let r = self.step_ready(w);
        if let Err(e) = &r {
            w.failed = Some(e.clone());
        }
        r
    }

    fn step_ready(&self, w: &mut Wire) -> Result<bool> {
        let net = plugin()?;
        match &mut w.state {
            State::Connecting(handle) => {
                let c = net.connect(ctx_ptr(&self.ctx), 0, handle);
                let c = c.map_err(|e| self.failed(e))?;
                if c.is_null() {
                    return self.not_yet(w.last);
                }
                w.state = State::Closed;
                w.state = self
                    .register(net, Comm(c))
                    .inspect_err(|_| net.close_send(c))?;
                return Ok(true);
            }
            State::Accepting(l) => {
                let c = net.accept(l.0).map_err(|e| self.failed(e))?;
                if c.is_null() {
                    return self.not_yet(w.last);
                }
                let l = *l;
                w.state = State::Closed;
                net.close_listen(l.0);
                w.state = self
                    .register(net, Comm(c))
                    .inspect_err(|_| net.close_recv(c))?;
                return Ok(true);
            }
            State::Closed => return Ok(false),
            State::Ready { .. } => {}
        }
        let State::Ready { comm, slots, hdrs } = w.state else {
            unreachable!()
        };
        let v = &self.view;
        let mut moved = false;
        // First the bytes of a slot whose header went out but whose bytes the plugin did not
        // take (it was busy): nothing else may go on the comm before them.
        if let Some(last) = w.reqs.back_mut() {
            if matches!(last[1], Req::Unposted) {
                last[1] = Req::posted(self.post_bytes(net, comm, slots, w.posted - 1)?);
                if matches!(last[1], Req::Unposted) {
                    return self.complete(net, w, moved);
                }
                moved = true;
            }
        }
        // Post: filled slots (sending end), free ones (receiving end).
        loop {
            let ready = if self.is_sender {
                w.posted < v.tail().load(Ordering::Acquire)
            } else {
                w.posted - v.head().load(Ordering::Acquire) < v.nsteps
            };
            if !ready || w.posted - w.done >= INFLIGHT {
                break;
            }
            let k = (w.posted % v.nsteps) as usize;
            let hdr = self.hdrs.at(k);
            if self.is_sender {
                let meta = v.meta(w.posted);
                // SAFETY: header k is free: its last slot (posted - nsteps) has completed.
                let h = unsafe { std::slice::from_raw_parts_mut(hdr, HDR) };
                for (i, m) in meta.iter().enumerate() {
                    h[8 * i..8 * i + 8].copy_from_slice(&m.to_le_bytes());
                }
            }
            let a = self.post(net, comm, hdr, HDR, hdrs)?;
            if a.is_null() {
                break; // busy: again later
            }
            let b = self.post_bytes(net, comm, slots, w.posted)?;
            // A plugin that took the header but not the bytes: retried first next time.
            w.reqs.push_back([Req::Pending(Comm(a)), Req::posted(b)]);
            w.posted += 1;
            moved = true;
            if b.is_null() {
                break;
            }
        }
        self.complete(net, w, moved)
    }

    /// Posts a message on `comm` in this end's direction: `len` bytes of `buf` sent, or room
    /// for `len` received into it (`mr`: its registration). Null: the plugin is busy.
    fn post(
        &self,
        net: &Plugin,
        comm: Comm,
        buf: *mut u8,
        len: usize,
        mr: Comm,
    ) -> Result<*mut c_void> {
        if self.is_sender {
            net.isend(comm.0, buf, len, mr.0)
        } else {
            net.irecv(comm.0, buf, len, mr.0)
        }
        .map_err(|e| self.failed(e))
    }

    /// Posts slot `step`'s bytes: the bytes it holds (sending end), or room for a full slot.
    fn post_bytes(&self, net: &Plugin, comm: Comm, slots: Comm, step: u64) -> Result<*mut c_void> {
        let v = &self.view;
        let len = if self.is_sender {
            v.meta(step)[2] as usize
        } else {
            v.slot_bytes
        };
        self.post(net, comm, v.slot(step), len, slots)
    }

    /// Completes posted slots, in order: frees them (sending end) or publishes them.
    fn complete(&self, net: &Plugin, w: &mut Wire, mut moved: bool) -> Result<bool> {
        let v = &self.view;
        while let Some(front) = w.reqs.front_mut() {
            let mut size = 0;
            for (i, r) in front.iter_mut().enumerate() {
                let req = match *r {
                    Req::Unposted => return Ok(moved),
                    Req::Done => continue,
                    Req::Pending(req) => req,
                };
                let tested = net.test(req.0);
                // A receiving end's wait for a header that the plugin ends with a remote error:
                // the peer is done with the connection (it may have ended its communicator);
                // only a wait for more from it is an error (`closed`), as on the socket
                // transport. Other errors are failures.
                if !self.is_sender && i == 0 {
                    if let Err(e) = &tested {
                        if e.code == crate::error::Code::RemoteError {
                            self.closed.store(true, Ordering::Release);
                            return Ok(moved);
                        }
                    }
                }
                match tested.map_err(|e| self.failed(e))? {
                    None => return Ok(moved),
                    Some(n) => {
                        *r = Req::Done;
                        if i == 0 && !self.is_sender && n != HDR {
                            return Err(self.failed(Error::internal(format!(
                                "a slot header of {n} bytes arrived, not {HDR}"
                            ))));
                        }
                        if i == 1 {
                            size = n;
                        }
                    }
                }
            }
            w.reqs.pop_front();
            w.last = std::time::Instant::now();
            let step = w.done;
            if self.is_sender {
                v.head().store(step + 1, Ordering::Release);
            } else {
                let k = (step % v.nsteps) as usize;
                // SAFETY: header k was filled by the completed receive; not reposted yet.
                let h = unsafe { std::slice::from_raw_parts(self.hdrs.at(k), HDR) };
                let word = |i: usize| u64::from_le_bytes(h[8 * i..8 * i + 8].try_into().unwrap());
                if word(2) as usize != size || size > v.slot_bytes {
                    return Err(self.failed(Error::internal(format!(
                        "a slot said {} bytes and {size} arrived",
                        word(2)
                    ))));
                }
                v.arrived(step, [word(0), word(1)], size, None);
            }
            w.done += 1;
            moved = true;
        }
        Ok(moved)
    }

    /// Registers the FIFO's slots and the header array with a new comm.
    fn register(&self, net: &Plugin, comm: Comm) -> Result<State> {
        let v = &self.view;
        let slots = net
            .reg_mr(comm.0, v.slot(0), v.nsteps as usize * v.slot_bytes)
            .map_err(|e| self.failed(e))?;
        let hdrs = net
            .reg_mr(comm.0, self.hdrs.at(0), self.hdrs.len * HDR)
            .map_err(|e| {
                net.dereg_mr(comm.0, slots);
                self.failed(e)
            })?;
        Ok(State::Ready {
            comm,
            slots: Comm(slots),
            hdrs: Comm(hdrs),
        })
    }
}

impl Proxy for PluginEnd {
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn progress(&self) -> Result<bool> {
        self.step(&mut self.state.lock())
    }

    fn progress_inline(&self) {
        if let Some(mut w) = self.state.try_lock() {
            let _ = self.step(&mut w);
        }
    }

    fn set_waker(&self, w: super::proxy::Waker) {
        let _ = self.waker.set(w);
    }

    /// Moves what it can on the executor's thread; where the proxy thread holds the end, wakes
    /// it instead (it may be about to sleep).
    fn kick(&self) {
        match self.state.try_lock() {
            Some(mut w) => {
                let _ = self.step(&mut w);
            }
            None => {
                if let Some(k) = self.waker.get() {
                    k.kick();
                }
            }
        }
    }

    /// A plugin has no socket to sleep on: the proxy looks again soon (1 ms) while sends are
    /// pending, the end is not connected yet, or slots moved in the last 100 ms; a receiving
    /// end that only waits for its peer is looked at every `SLEEP_MS` (the executor moves it
    /// itself while it waits).
    fn wait_for(&self, out: &mut Vec<Wait>) {
        let w = self.state.lock();
        if self.closed() || w.failed.is_some() {
            return;
        }
        let busy = match w.state {
            State::Connecting(_) | State::Accepting(_) => true,
            State::Ready { .. } => {
                (self.is_sender
                    && (!w.reqs.is_empty() || self.view.tail().load(Ordering::Acquire) > w.posted))
                    || (!self.is_sender && w.last.elapsed() < std::time::Duration::from_millis(100))
            }
            State::Closed => false,
        };
        if busy {
            out.push(Wait::Soon);
        }
    }

    fn flushed(&self) -> bool {
        !self.is_sender || {
            let w = self.state.lock();
            w.done >= self.view.tail().load(Ordering::Acquire)
        }
    }
}

impl Drop for PluginEnd {
    fn drop(&mut self) {
        let Ok(net) = plugin() else { return };
        let w = self.state.get_mut();
        match std::mem::replace(&mut w.state, State::Closed) {
            State::Ready { comm, slots, hdrs } => {
                net.dereg_mr(comm.0, slots.0);
                net.dereg_mr(comm.0, hdrs.0);
                if self.is_sender {
                    net.close_send(comm.0);
                } else {
                    net.close_recv(comm.0);
                }
            }
            State::Accepting(l) => net.close_listen(l.0),
            State::Connecting(_) | State::Closed => {}
        }
    }
}
