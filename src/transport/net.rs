//! Ranks on other hosts: the socket transport. Each end of a connection keeps its FIFO in local
//! memory, as the other transports do, so the executor works on it unchanged; the slots move
//! over TCP (`wire`: one socket, or several at once, `NCCL_NSOCKS_PERTHREAD` x
//! `NCCL_SOCKET_NTHREADS`), moved by the executor's thread as it fills and frees slots and
//! while it waits, and by the communicator's proxy thread (`proxy`) otherwise (with
//! `NCCL_SOCKET_NTHREADS` > 1, helper threads move all but the first group of sockets:
//! `helpers`): on the sending
//! host each filled slot's header (call words, bytes) and bytes go to the sockets and then the
//! slot is freed; on the receiving host they are read into the next free slot, which is then
//! published. TCP's flow control is the FIFO's: a receiver whose slots are full stops reading,
//! and the sender stops freeing.
//!
//! Set-up goes through the transport seam: the receiving end listens (on the address its
//! bootstrap uses) and its blob is a random token, its number of sockets and that address; the
//! sending end opens the sockets and presents the token (and the socket's index) on each before
//! anything else (the blob came through the bootstrap, whose connections prove the unique id's
//! secret, so only a rank of the communicator knows it). The reverse connection between the
//! same two ranks uses the same sockets the other way where it can (`pair`): its sending end's
//! blob says so.

mod helpers;
mod listen;
mod pair;
mod tcp_info;
#[cfg(test)]
mod tests;
mod wire;

use super::inproc;
use super::peer::PeerInfo;
use super::{ConnSpec, Endpoint, Locality, Proxy, Region, Transport, Wait};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub struct Net;

const TOKEN: usize = 16;
/// A slot on the wire: call words and bytes (little endian), then the bytes.
const HDR: usize = 24;
/// The most sockets a connection uses.
const MAX_SOCKS: usize = 64;

/// Sockets per connection: `NCCL_NSOCKS_PERTHREAD` x `NCCL_SOCKET_NTHREADS` (at most 64, as
/// NCCL caps them). Which thread moves which socket is each end's own affair (`helpers`).
fn sockets() -> usize {
    let per = crate::param::get_u64("NCCL_NSOCKS_PERTHREAD").max(1) as usize;
    per.saturating_mul(socket_threads()).min(MAX_SOCKS)
}

/// Threads per end of a connection (`NCCL_SOCKET_NTHREADS`, at most 16): see `helpers`.
fn socket_threads() -> usize {
    crate::param::get_u64("NCCL_SOCKET_NTHREADS").clamp(1, 16) as usize
}
/// A header whose byte count is this is a heartbeat, not a slot: an idle sending end sends one
/// every `BEAT_EVERY`, so that the receiving end can tell a quiet peer from a lost one.
const BEAT: u64 = u64::MAX;
const BEAT_EVERY: Duration = Duration::from_secs(1);

impl Transport for Net {
    fn name(&self) -> &'static str {
        "network"
    }
    fn reaches(&self, me: &PeerInfo, peer: &PeerInfo) -> bool {
        Locality::of(me, peer) == Locality::OtherHost
    }
    fn setup(&self, spec: &ConnSpec) -> Result<(Box<dyn Endpoint>, Vec<u8>)> {
        // A private region: only this end maps it, named for it alone (both ends of one
        // connection may live in one process).
        let end = if spec.is_sender { "send" } else { "recv" };
        let name = format!("{}-net-{}-{end}", spec.name(), std::process::id());
        let region = inproc::open(&name, super::region_bytes(spec.nsteps, spec.slot_bytes))?;
        inproc::forget(&name);
        let (lo, hi) = (spec.me.min(spec.peer), spec.me.max(spec.peer));
        let side = |opener| pair::Side {
            comm_hash: spec.comm_hash,
            lo,
            hi,
            class: spec.class as u8,
            opener,
        };
        // The sockets lo -> hi: registered by the ends that connect them (the opener, lo's
        // sending end; the acceptor, hi's receiving end), shared by hi's sending end if hi's
        // receiving end is there (see `pair`).
        let mut share = None;
        let mut publish = None;
        if spec.is_sender && spec.me > spec.peer {
            share = pair::existing(side(false));
        } else if spec.is_sender || spec.me > spec.peer {
            publish = Some(pair::register(side(spec.is_sender)));
        }
        let (listener, token, blob) = if spec.is_sender {
            (None, [0u8; TOKEN], vec![u8::from(share.is_some())])
        } else {
            let bind = SocketAddr::new(spec.local_ip, 0);
            let l = TcpListener::bind(bind).map_err(|e| {
                Error::os(
                    format!(
                        "rank {}: listening for rank {} on {bind}",
                        spec.me, spec.peer
                    ),
                    e,
                )
            })?;
            l.set_nonblocking(true)
                .map_err(|e| Error::os("a non-blocking listener", e))?;
            let at = l
                .local_addr()
                .map_err(|e| Error::os("the listener's address", e))?;
            let token = random_token()?;
            let mut blob = token.to_vec();
            blob.push(sockets() as u8);
            blob.extend_from_slice(at.to_string().as_bytes());
            (Some(l), token, blob)
        };
        Ok((
            Box::new(NetSetup {
                region,
                listener,
                token,
                me: spec.me,
                peer: spec.peer,
                peer_host: spec.peer_host.clone(),
                is_sender: spec.is_sender,
                nsteps: spec.nsteps,
                slot_bytes: spec.slot_bytes,
                share,
                publish,
                opener: side(true),
                health: spec.health.clone(),
            }),
            blob,
        ))
    }
}

fn random_token() -> Result<[u8; TOKEN]> {
    let mut t = [0u8; TOKEN];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut t))
        .map_err(|e| Error::os("reading /dev/urandom for a connection token", e))?;
    Ok(t)
}

/// An end set up, waiting for the peer's blob.
struct NetSetup {
    region: Arc<inproc::HeapRegion>,
    listener: Option<TcpListener>,
    token: [u8; TOKEN],
    me: usize,
    peer: usize,
    peer_host: String,
    is_sender: bool,
    nsteps: usize,
    slot_bytes: usize,
    /// The sending end hi -> lo uses the sockets that hi's receiving end accepts.
    share: Option<pair::Sockets>,
    /// Where this end publishes the sockets it connects, for its rank's reverse end.
    publish: Option<pair::Sockets>,
    /// The opener's side of these two ranks' sockets: lo's receiving end reads from it when
    /// hi's sending end shares.
    opener: pair::Side,
    /// The communicator's health (an abort ends the sending end's connect).
    health: Option<Arc<crate::health::Health>>,
}

impl Endpoint for NetSetup {
    fn connect(self: Box<Self>, peer_blob: &[u8]) -> Result<super::Conn> {
        let n = *self;
        let view = |r: &Arc<inproc::HeapRegion>| {
            super::Conn::new(
                Region::Heap(r.clone()),
                n.nsteps,
                n.slot_bytes,
                (n.me, n.peer),
                n.is_sender,
            )
        };
        let mut conn = view(&n.region);
        // The region is this end's alone: both "ends" of it are here.
        conn.attach();
        conn.attach();
        // Only lo's sending end and hi's receiving end publish (see `setup`): a borrowing end
        // never has a cell of its own.
        let publish = n.publish.clone();
        let (state, k) = if let Some(s) = n.share.clone() {
            (State::Borrowing(s, std::time::Instant::now()), 1)
        } else if !n.is_sender && peer_blob == [1] {
            // The peer (hi) sends on the sockets this rank's (lo's) sending end opens.
            (
                State::Borrowing(pair::register(n.opener), std::time::Instant::now()),
                1,
            )
        } else if n.is_sender {
            let token = peer_blob
                .get(..TOKEN)
                .ok_or_else(|| bad_blob(&n, peer_blob))?;
            let k = *peer_blob
                .get(TOKEN)
                .filter(|&&k| (1..=MAX_SOCKS).contains(&(k as usize)))
                .ok_or_else(|| bad_blob(&n, peer_blob))? as usize;
            let addr: SocketAddr = std::str::from_utf8(&peer_blob[TOKEN + 1..])
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| bad_blob(&n, peer_blob))?;
            let who = || format!("rank {}: connecting to rank {} at {addr}", n.me, n.peer);
            // The receiving end listened before it handed out its address: a refusal means
            // it is gone. No answer ends at OXCCL_BOOTSTRAP_CONNECT_S, an abort at once.
            let w = crate::health::Wait::new(
                format!("rank {}", n.me),
                crate::param::bootstrap_connect(),
                n.health.as_deref(),
            );
            let what = || format!("rank {}'s network end at {addr}", n.peer);
            let mut socks = Vec::with_capacity(k);
            for j in 0..k {
                let mut s = crate::bootstrap::connect_once(addr, &w, &what)?
                    .map_err(|why| Error::remote(format!("{}: {why}", who())))?;
                s.write_all(token)
                    .and_then(|_| s.write_all(&[j as u8]))
                    .map_err(|e| Error::remote(format!("{}: {e}", who())))?;
                tune(&s)?;
                socks.push(s);
            }
            if let Some(p) = &publish {
                pair::publish(p, &socks)
                    .map_err(|e| Error::os("sharing a network connection's sockets", e))?;
            }
            (State::Connected(socks), k)
        } else {
            let l = n
                .listener
                .ok_or_else(|| Error::internal("a receiving end without a listener"))?;
            let k = sockets();
            let l = listen::Listening::new(l, n.token, k)
                .map_err(|e| Error::os("setting up a network connection's listener", e))?;
            (State::Listening(l), k)
        };
        let end = Arc::new(NetEnd {
            view: view(&n.region),
            me: n.me,
            peer: n.peer,
            peer_host: n.peer_host,
            is_sender: n.is_sender,
            state: Mutex::new(Wire {
                state,
                p: wire::Progress::new(k),
                helpers: None,
            }),
            publish,
            closed: Default::default(),
            polled: Default::default(),
            driven: Default::default(),
            passes: Default::default(),
            waker: Default::default(),
            threads: socket_threads(),
            dests: (0..n.nsteps).map(|_| Dest::default()).collect(),
        });
        {
            let w = &mut *end.state.lock();
            if let State::Connected(socks) = &w.state {
                w.helpers = end.start_helpers(socks)?;
            }
        }
        conn.proxy = Some(end);
        Ok(conn)
    }
}

fn bad_blob(n: &NetSetup, blob: &[u8]) -> Error {
    Error::internal(format!(
        "rank {}: rank {}'s end of a network connection sent a malformed address ({} bytes)",
        n.me,
        n.peer,
        blob.len()
    ))
}

fn tune(s: &TcpStream) -> Result<()> {
    s.set_nodelay(true)
        .and_then(|_| s.set_nonblocking(true))
        .map_err(|e| Error::os("setting up a network connection's socket", e))
}

enum State {
    /// The receiving end, until its peer has opened every socket and presented the token on
    /// each.
    Listening(listen::Listening),
    Connected(Vec<TcpStream>),
    /// Using the sockets of the reverse connection's end on this rank, once they are connected
    /// (since when it waits: the communicator's timeout bounds it).
    Borrowing(pair::Sockets, std::time::Instant),
}

struct Wire {
    state: State,
    p: wire::Progress,
    /// The helper threads of a connected end (`NCCL_SOCKET_NTHREADS` > 1).
    helpers: Option<helpers::Helpers>,
}

/// One end of a network connection, as the proxy thread drives it: `view` is the same FIFO the
/// executor's `Conn` works on.
pub struct NetEnd {
    view: super::Conn,
    me: usize,
    peer: usize,
    /// The peer's host name (for messages).
    peer_host: String,
    is_sender: bool,
    state: Mutex<Wire>,
    /// The cell where this end publishes the sockets it connects (the opener's, at once; the
    /// acceptor's, once it accepted them all), held while the end lives: a reverse end set up
    /// later finds them there (see `pair`).
    publish: Option<pair::Sockets>,
    /// The peer closed the connection between slots.
    closed: std::sync::atomic::AtomicBool,
    /// The sockets in the proxy thread's last poll set (bit j: socket j, or the listener), set
    /// under `state`'s lock (`wait_for`).
    polled: std::sync::atomic::AtomicU64,
    /// Set when the proxy thread takes the end (shared with the helper threads).
    waker: Arc<once_cell::sync::OnceCell<super::proxy::Waker>>,
    /// When the executor's thread last polled this end while waiting on it (`progress_inline`;
    /// nanoseconds on `clock`).
    driven: std::sync::atomic::AtomicU64,
    /// The executor's passes over this end while it waits (`progress_inline`): it notes the
    /// time at every `DRIVEN_EVERY`th, since reading the clock costs more than the rest of a
    /// pass that finds nothing.
    passes: std::sync::atomic::AtomicU32,
    /// Threads that move its sockets (`NCCL_SOCKET_NTHREADS` when it was made): more than one
    /// means helper threads, and then no slots by reference.
    threads: usize,
    /// A receiving end's destinations in the caller's memory, by slot (`post_recv_ref`).
    dests: Box<[Dest]>,
}

/// Where the executor wants a slot read (`Proxy::post_recv_ref`). It writes the fields, then
/// the tag; the end reads the tag, then the fields, under the end's lock, once per slot when
/// it starts reading it. The executor writes a slot's cell again only for the slot `nsteps`
/// later, which the end cannot start before the executor has taken this one, or after a
/// revoke (which takes the lock and clears every tag), so a tag that matches comes with its
/// own fields. Where a delivered slot went is kept in the slot itself (`Conn::arrived`): the
/// cell may already name the slot `nsteps` later.
#[derive(Default)]
struct Dest {
    /// The slot's step plus one (0: none).
    tag: std::sync::atomic::AtomicU64,
    call: [std::sync::atomic::AtomicU64; 2],
    addr: std::sync::atomic::AtomicUsize,
    bytes: std::sync::atomic::AtomicUsize,
}

/// A waiting executor's pass of a few hundred nanoseconds notes the time at every 8th, well
/// within `DRIVEN_NS`.
const DRIVEN_EVERY: u32 = 8;

/// Nanoseconds since the first call: a clock the executor's and the proxy's threads share.
fn clock() -> u64 {
    static START: once_cell::sync::Lazy<std::time::Instant> =
        once_cell::sync::Lazy::new(std::time::Instant::now);
    START.elapsed().as_nanos() as u64
}

/// A receiving end of small slots (below `SMALL_SLOT`) that the executor's thread polled this
/// recently is left to it: the proxy thread does not wait on its sockets, where each arriving
/// packet would wake it only to find the data gone, which cost a 1 KiB all-reduce between two
/// hosts a few microseconds on this 2-core VM; it looks again at its usual pace. Where slots
/// are large it keeps reading ahead while the executor reduces.
const DRIVEN_NS: u64 = 100_000;
const SMALL_SLOT: usize = 64 << 10;

impl Proxy for NetEnd {
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn wait_for(&self, out: &mut Vec<Wait>) {
        use std::os::fd::AsRawFd;
        let w = self.state.lock();
        let mask = self.waiting_on(&w);
        match &w.state {
            State::Listening(l) if mask != 0 => out.extend(l.fds().map(Wait::Readable)),
            State::Listening(..) => {}
            State::Borrowing(..) if mask != 0 => out.push(Wait::Soon),
            State::Borrowing(..) => {}
            // Bytes to write: room in those sockets; room in the FIFO (or a slot half read):
            // bytes on those, unless the executor's thread is reading them (`DRIVEN_NS`). Then
            // the proxy looks again soon rather than at its usual pace: the executor may have
            // moved on to a step that does not drive this end, and a peer whose bytes nobody
            // reads stops sending, which stalled both hosts until the proxy's poll timed out
            // (at 20 ms then: 4 MiB all-reduces that took 1.5 ms at best took up to 93).
            State::Connected(_)
                if mask != 0
                    && !self.is_sender
                    && w.p.last_bytes < SMALL_SLOT
                    && clock().saturating_sub(self.driven.load(Ordering::Relaxed)) < DRIVEN_NS =>
            {
                out.push(Wait::Soon)
            }
            State::Connected(socks) => {
                for (_, s) in socks
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| (mask >> j) & 1 == 1)
                {
                    out.push(if self.is_sender {
                        Wait::Writable(s.as_raw_fd())
                    } else {
                        Wait::Readable(s.as_raw_fd())
                    });
                }
            }
        }
        // Under the lock: a kick compares what it leaves against this.
        self.polled.store(mask, Ordering::Release);
    }

    fn set_waker(&self, w: super::proxy::Waker) {
        let _ = self.waker.set(w);
    }

    /// The executor filled a slot (sending end) or freed one (receiving end): move what can
    /// move now, on its thread (the slot is on the wire without a hand-over to the proxy
    /// thread), and wake the proxy thread only where something is left that its poll would
    /// not see (bytes the socket did not take; a FIFO that was full when it went to sleep).
    #[inline]
    fn kick(&self) {
        if !self.is_sender {
            // A freed slot matters only to a wire that stopped reading for want of one (the
            // FIFO was full). Otherwise it reads on when bytes come: a read now would find
            // none, a system call on every small operation's path after its data arrived.
            let v = &self.view;
            let used = v.tail().load(Ordering::Acquire) - v.head().load(Ordering::Acquire);
            if used + 1 < v.nsteps {
                return;
            }
        }
        if let Some(mut w) = self.state.try_lock() {
            if !self.closed() {
                // Errors are left to the proxy thread, which meets them too.
                let _ = self.step(&mut w);
            }
            // Settled when the proxy's poll already covers every socket left to move.
            let settled = (self.waiting_on(&w) & !self.polled.load(Ordering::Acquire)) == 0;
            drop(w);
            if settled {
                return;
            }
        }
        if let Some(w) = self.waker.get() {
            w.kick();
        }
    }

    fn silent_for(&self) -> Option<Duration> {
        let w = self.state.try_lock()?;
        let State::Connected(socks) = &w.state else {
            return None;
        };
        if !self.is_sender {
            return Some(w.p.last.elapsed());
        }
        // A sending end hears from its peer only in TCP's acknowledgements: silent for as long
        // as it has waited for one (`tcp_info::unacknowledged_for`). A live peer that does not
        // read (a rank late for minutes) acknowledges what arrived and answers the probes of
        // its closed window, so it is waited for (TCP_USER_TIMEOUT would drop it: not used).
        socks.iter().filter_map(tcp_info::unacknowledged_for).max()
    }

    /// A sending end has written every slot it was handed and the peer has acknowledged every
    /// byte: only then may its sockets close. They carry the reverse direction too (`pair`),
    /// and a socket closed with bytes unread is reset, which would drop what is still queued.
    fn flushed(&self) -> bool {
        if !self.is_sender || self.closed() {
            return true;
        }
        let w = self.state.lock();
        w.p.step >= self.view.tail().load(Ordering::Acquire)
            && match &w.state {
                State::Connected(socks) => socks.iter().all(wire::acknowledged),
                _ => true,
            }
    }

    fn progress(&self) -> Result<bool> {
        if self.closed() {
            return Ok(false);
        }
        self.step(&mut self.state.lock())
    }

    /// Only without helper threads (decided when the end was made, as they are): they read a
    /// slot's parts outside the end's lock, which `settle` relies on.
    fn by_reference(&self) -> bool {
        self.is_sender && self.threads == 1 && crate::param::net_zero_copy()
    }

    fn settle(&self) {
        let _w = self.state.lock();
        self.view.settle_refs_held();
    }

    /// Like `by_reference`, for receiving ends.
    fn recv_by_reference(&self) -> bool {
        !self.is_sender && self.threads == 1 && crate::param::net_zero_copy()
    }

    fn post_recv_ref(&self, step: u64, call: [u64; 2], dst: *mut u8, bytes: usize) {
        let d = &self.dests[(step % self.view.nsteps) as usize];
        d.call[0].store(call[0], Ordering::Relaxed);
        d.call[1].store(call[1], Ordering::Relaxed);
        d.addr.store(dst as usize, Ordering::Relaxed);
        d.bytes.store(bytes, Ordering::Relaxed);
        d.tag.store(step + 1, Ordering::Release);
    }

    fn revoke_recv_refs(&self) {
        let mut w = self.state.lock();
        let w = &mut *w;
        let v = &self.view;
        // Slots read into the caller's memory, published, not taken yet: each holds where.
        v.settle_refs_held();
        // The slot being read: what has arrived of it moves into the slot, the rest follows.
        if let (State::Connected(socks), wire::Target::Caller(at)) = (&w.state, w.p.target) {
            let bytes = self.bytes_of(&w.p.hdr).unwrap_or(0);
            let k = socks.len();
            for j in 0..wire::parts(bytes, k) {
                let lo = wire::part_start(bytes, k, j);
                // SAFETY: the executor's memory for this slot is still valid (the contract of
                // `revoke_recv_refs`) and part j's first `done[j]` bytes were read there; the
                // slot holds `bytes <= slot_bytes` and is not that memory.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (at + lo) as *const u8,
                        v.slot(w.p.step).add(lo),
                        w.p.done[j],
                    )
                };
            }
            w.p.target = wire::Target::Slot;
        }
        for d in self.dests.iter() {
            d.tag.store(0, Ordering::Release);
        }
    }

    fn sockets(&self) -> Vec<(SocketAddr, SocketAddr)> {
        match &self.state.lock().state {
            State::Connected(socks) => socks
                .iter()
                .filter_map(|s| Some((s.local_addr().ok()?, s.peer_addr().ok()?)))
                .collect(),
            _ => Vec::new(),
        }
    }

    fn progress_inline(&self) {
        if self.closed() {
            return;
        }
        if !self.is_sender {
            // Only the executor's thread counts: no read-modify-write needed.
            let n = self.passes.load(Ordering::Relaxed);
            self.passes.store(n.wrapping_add(1), Ordering::Relaxed);
            if n.is_multiple_of(DRIVEN_EVERY) {
                self.driven.store(clock(), Ordering::Relaxed);
            }
        }
        if let Some(mut w) = self.state.try_lock() {
            let _ = self.step(&mut w);
        }
    }
}

impl Drop for NetEnd {
    /// The helper threads stop before the FIFO (`view`) goes: they may be moving a slot.
    fn drop(&mut self) {
        self.state.get_mut().helpers.take();
    }
}

impl NetEnd {
    /// What this end waits for now (see `wire::pending`; the listener is bit 0).
    fn waiting_on(&self, w: &Wire) -> u64 {
        if self.closed() {
            return 0;
        }
        match &w.state {
            State::Listening(..) | State::Borrowing(..) => 1,
            State::Connected(socks) => self.pending(socks.len(), &w.p, w.helpers.as_ref()),
        }
    }

    /// One round of `progress` with the end's state held.
    fn step(&self, w: &mut Wire) -> Result<bool> {
        let socks = match &mut w.state {
            State::Connected(s) => s,
            State::Listening(l) => {
                if let Some(why) = super::never_connected(l.since) {
                    return Err(self.failed(&why));
                }
                let warn = |w: &str| crate::debug::warn(&format!("rank {}: {w}", self.me));
                return match l.step(&warn).map_err(|why| self.failed(&why))? {
                    listen::Heard::Nothing => Ok(false),
                    listen::Heard::Some => Ok(true),
                    listen::Heard::All(socks) => {
                        for s in &socks {
                            tune(s)?;
                        }
                        if let Some(p) = &self.publish {
                            pair::publish(p, &socks)
                                .map_err(|e| self.failed(&format!("sharing its sockets: {e}")))?;
                        }
                        self.connected(w, socks).map(|()| true)
                    }
                };
            }
            State::Borrowing(cell, since) => {
                return match pair::take(cell) {
                    None if since.elapsed() > crate::param::bound() => Err(self
                        .failed("the reverse connection whose sockets it shares never connected")),
                    None => Ok(false),
                    Some(Err(e)) => Err(self.failed(&format!("sharing sockets: {e}"))),
                    Some(Ok(socks)) => self.connected(w, socks).map(|()| true),
                };
            }
        };
        if self.is_sender {
            self.send(socks, &mut w.p, w.helpers.as_ref())
        } else {
            self.recv(socks, &mut w.p, w.helpers.as_ref())
        }
    }

    /// The end's sockets are all there (accepted, or borrowed from the reverse end): it moves
    /// slots from now on, with its helper threads if it has any.
    fn connected(&self, w: &mut Wire, socks: Vec<TcpStream>) -> Result<()> {
        w.p = wire::Progress::new(socks.len());
        w.helpers = self.start_helpers(&socks)?;
        w.state = State::Connected(socks);
        Ok(())
    }

    /// The helper threads for the sockets of a connected end, if it has any.
    fn start_helpers(&self, socks: &[TcpStream]) -> Result<Option<helpers::Helpers>> {
        let who = format!(
            "rank {}: network connection {} rank {}",
            self.me,
            if self.is_sender { "to" } else { "from" },
            self.peer
        );
        helpers::Helpers::start(
            socks,
            self.threads,
            self.view.slot_bytes,
            self.is_sender,
            &who,
            self.waker.clone(),
        )
        .map_err(|e| self.failed(&format!("starting its helper threads: {e}")))
    }

    fn failed(&self, what: &str) -> Error {
        Error::remote(format!(
            "rank {}: the network connection {} rank {} on host {} failed: {what}",
            self.me,
            if self.is_sender { "to" } else { "from" },
            self.peer,
            self.peer_host
        ))
    }

    /// The connection broke under this end (reset, broken, timed out by the kernel).
    fn broke(&self, e: &std::io::Error) -> Error {
        self.failed(&format!(
            "the connection broke ({e}): the peer's process ended, or its host or the link \
             to it is down"
        ))
    }

    /// Where slot `step` with header `hdr` of `bytes` bytes is to be read: the caller's memory
    /// the executor posted for it, if the call and the byte count match (else None: the slot).
    fn take_dest(&self, step: u64, hdr: &[u8; HDR], bytes: usize) -> Option<usize> {
        let d = &self.dests[(step % self.view.nsteps) as usize];
        if d.tag.load(Ordering::Acquire) != step + 1 {
            return None;
        }
        let word = |i: usize| u64::from_le_bytes(hdr[8 * i..8 * i + 8].try_into().unwrap());
        let call = [
            d.call[0].load(Ordering::Relaxed),
            d.call[1].load(Ordering::Relaxed),
        ];
        let addr = d.addr.load(Ordering::Relaxed);
        (call == [word(0), word(1)] && d.bytes.load(Ordering::Relaxed) == bytes && addr != 0)
            .then_some(addr)
    }

    /// The byte count of a slot header, checked against the slot's size.
    fn bytes_of(&self, hdr: &[u8; HDR]) -> Result<usize> {
        let b = u64::from_le_bytes(hdr[16..24].try_into().unwrap()) as usize;
        if b > self.view.slot_bytes {
            return Err(self.failed(&format!(
                "a slot of {b} bytes arrived, more than the {} a slot holds",
                self.view.slot_bytes
            )));
        }
        Ok(b)
    }
}
