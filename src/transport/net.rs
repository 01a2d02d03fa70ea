//! Ranks on other hosts: the socket transport. Each end of a connection keeps its FIFO in local
//! memory, as the other transports do, so the executor works on it unchanged; the
//! communicator's proxy thread (`proxy`) moves the slots over one TCP connection: on the
//! sending host it writes each filled slot's header (call words, bytes) and bytes to the socket
//! and then frees the slot; on the receiving host it reads them into the next free slot and
//! publishes it. TCP's flow control is the FIFO's: a receiver whose slots are full stops
//! reading, and the sender's proxy stops freeing.
//!
//! Set-up goes through the transport seam: the receiving end listens (on the address its
//! bootstrap uses) and its blob is that address and a random token; the sending end connects
//! and presents the token before anything else (the blob came through the bootstrap, whose
//! connections prove the unique id's secret, so only a rank of the communicator knows it).

use super::inproc;
use super::peer::PeerInfo;
use super::{ConnSpec, Endpoint, Locality, Proxy, Region, Transport, Wait};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub struct Net;

const TOKEN: usize = 16;
/// A slot on the wire: call words and bytes (little endian), then the bytes.
const HDR: usize = 24;
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
        // A private region: only this end maps it.
        let name = format!("{}-net-{}", spec.name(), std::process::id());
        let region = inproc::open(&name, super::region_bytes(spec.nsteps, spec.slot_bytes))?;
        inproc::forget(&name);
        let (listener, token, blob) = if spec.is_sender {
            (None, [0u8; TOKEN], Vec::new())
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
                is_sender: spec.is_sender,
                nsteps: spec.nsteps,
                slot_bytes: spec.slot_bytes,
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
    is_sender: bool,
    nsteps: usize,
    slot_bytes: usize,
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
        let state = if n.is_sender {
            let token = peer_blob
                .get(..TOKEN)
                .ok_or_else(|| bad_blob(&n, peer_blob))?;
            let addr: SocketAddr = std::str::from_utf8(&peer_blob[TOKEN..])
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| bad_blob(&n, peer_blob))?;
            let who = || format!("rank {}: connecting to rank {} at {addr}", n.me, n.peer);
            let mut s = TcpStream::connect_timeout(&addr, crate::param::timeout())
                .map_err(|e| Error::remote(format!("{}: {e}", who())))?;
            s.write_all(token)
                .map_err(|e| Error::remote(format!("{}: {e}", who())))?;
            tune(&s)?;
            State::Connected(s)
        } else {
            let l = n
                .listener
                .ok_or_else(|| Error::internal("a receiving end without a listener"))?;
            State::Listening(l, n.token)
        };
        conn.proxy = Some(Arc::new(NetEnd {
            view: view(&n.region),
            me: n.me,
            peer: n.peer,
            is_sender: n.is_sender,
            state: Mutex::new(Wire {
                state,
                step: 0,
                off: 0,
                hdr: [0; HDR],
                beat: false,
                last: std::time::Instant::now(),
            }),
            closed: Default::default(),
            polled: Default::default(),
            waker: Default::default(),
        }));
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
    /// The receiving end, until its peer connects and presents the token.
    Listening(TcpListener, [u8; TOKEN]),
    Connected(TcpStream),
}

struct Wire {
    state: State,
    /// The next step (slot) to move, and how many of its bytes (header first) have moved.
    step: u64,
    off: usize,
    hdr: [u8; HDR],
    /// Sending end: a heartbeat's header is on its way (in `hdr`).
    beat: bool,
    /// When bytes last went out (sending end) or came in (receiving end).
    last: std::time::Instant,
}

/// One end of a network connection, as the proxy thread drives it: `view` is the same FIFO the
/// executor's `Conn` works on.
pub struct NetEnd {
    view: super::Conn,
    me: usize,
    peer: usize,
    is_sender: bool,
    state: Mutex<Wire>,
    /// The peer closed the connection between slots.
    closed: std::sync::atomic::AtomicBool,
    /// The proxy thread's last poll set (it sleeps on it) includes this end's socket.
    polled: std::sync::atomic::AtomicBool,
    /// Set when the proxy thread takes the end.
    waker: once_cell::sync::OnceCell<super::proxy::Waker>,
}

impl Proxy for NetEnd {
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn wait_for(&self) -> Option<Wait> {
        use std::os::fd::AsRawFd;
        if self.closed() {
            return None;
        }
        let w = self.state.lock();
        let v = &self.view;
        let wait = match &w.state {
            State::Listening(l, _) => Some(Wait::Readable(l.as_raw_fd())),
            // Bytes to write: wait for room in the socket.
            State::Connected(s) if self.is_sender => (w.off > 0
                || w.step < v.tail().load(Ordering::Acquire))
            .then(|| Wait::Writable(s.as_raw_fd())),
            // Room in the FIFO (or a slot half read): wait for bytes.
            State::Connected(s) => (w.off > 0
                || w.step - v.head().load(Ordering::Acquire) < v.nsteps)
                .then(|| Wait::Readable(s.as_raw_fd())),
        };
        self.polled.store(wait.is_some(), Ordering::Release);
        wait
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
        if let Some(mut w) = self.state.try_lock() {
            if !self.closed() {
                // Errors are left to the proxy thread, which meets them too.
                let _ = self.step(&mut w);
            }
            let settled = if self.is_sender {
                w.off == 0 && w.step >= self.view.tail().load(Ordering::Acquire)
            } else {
                self.polled.load(Ordering::Acquire)
            };
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
        if self.is_sender {
            return None;
        }
        let w = self.state.try_lock()?;
        matches!(w.state, State::Connected(_)).then(|| w.last.elapsed())
    }

    fn flushed(&self) -> bool {
        !self.is_sender || self.state.lock().step >= self.view.tail().load(Ordering::Acquire)
    }

    fn progress(&self) -> Result<bool> {
        if self.closed() {
            return Ok(false);
        }
        self.step(&mut self.state.lock())
    }

    fn progress_inline(&self) {
        if self.closed() {
            return;
        }
        if let Some(mut w) = self.state.try_lock() {
            let _ = self.step(&mut w);
        }
    }
}

impl NetEnd {
    /// One round of `progress` with the end's state held.
    fn step(&self, w: &mut Wire) -> Result<bool> {
        let sock = match &mut w.state {
            State::Connected(s) => s,
            State::Listening(l, token) => match l.accept() {
                Ok((s, from)) => {
                    let s = self.hello(s, from, token)?;
                    w.state = State::Connected(s);
                    return Ok(true);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(self.failed(&e.to_string())),
            },
        };
        if self.is_sender {
            self.send(
                sock,
                &mut w.step,
                &mut w.off,
                &mut w.hdr,
                (&mut w.beat, &mut w.last),
            )
        } else {
            self.recv(sock, &mut w.step, &mut w.off, &mut w.hdr, &mut w.last)
        }
    }
}

impl NetEnd {
    /// The receiving end's first bytes from a connection: the token, or the connection is
    /// dropped (and the end keeps listening).
    fn hello(&self, mut s: TcpStream, from: SocketAddr, token: &[u8; TOKEN]) -> Result<TcpStream> {
        let mut got = [0u8; TOKEN];
        let ok = s.set_nonblocking(false).is_ok()
            && s.set_read_timeout(Some(Duration::from_secs(5))).is_ok()
            && s.read_exact(&mut got).is_ok()
            && got == *token;
        if !ok {
            crate::debug::warn(&format!(
                "rank {}: dropped a connection from {from} that did not present rank {}'s token",
                self.me, self.peer
            ));
            return Err(self.failed(&format!(
                "a connection from {from} did not present the connection's token"
            )));
        }
        tune(&s)?;
        Ok(s)
    }

    fn failed(&self, what: &str) -> Error {
        Error::remote(format!(
            "rank {}: the network connection {} rank {} failed: {what}",
            self.me,
            if self.is_sender { "to" } else { "from" },
            self.peer
        ))
    }

    /// Writes filled slots to the socket, freeing each once it is all written.
    fn send(
        &self,
        s: &mut TcpStream,
        step: &mut u64,
        off: &mut usize,
        hdr: &mut [u8; HDR],
        (beat, last): (&mut bool, &mut std::time::Instant),
    ) -> Result<bool> {
        let v = &self.view;
        let mut moved = false;
        loop {
            // Between slots: the next filled slot's header, or, once the end has been idle for
            // a while, a heartbeat's (a header with no bytes).
            if !*beat && *off == 0 {
                if *step < v.tail().load(Ordering::Acquire) {
                    for (i, m) in v.meta(*step).iter().enumerate() {
                        hdr[8 * i..8 * i + 8].copy_from_slice(&m.to_le_bytes());
                    }
                } else if last.elapsed() >= BEAT_EVERY {
                    *hdr = [0; HDR];
                    hdr[16..].copy_from_slice(&BEAT.to_le_bytes());
                    *beat = true;
                } else {
                    return Ok(moved);
                }
            }
            let data: &[u8] = if *beat {
                &[]
            } else {
                let bytes = v.meta(*step)[2] as usize;
                // SAFETY: the slot holds `bytes <= slot_bytes` bytes the executor filled
                // before publishing the tail; it stays ours until the head moves.
                unsafe { std::slice::from_raw_parts(v.slot(*step), bytes) }
            };
            while *off < HDR + data.len() {
                let r = if *off < HDR {
                    // Header and bytes in one system call (and one segment when small).
                    s.write_vectored(&[
                        std::io::IoSlice::new(&hdr[*off..]),
                        std::io::IoSlice::new(data),
                    ])
                } else {
                    s.write(&data[*off - HDR..])
                };
                match r {
                    Ok(0) => return Err(self.failed("the peer closed the connection")),
                    Ok(k) => {
                        *off += k;
                        // A heartbeat is no progress: the proxy may go back to sleep.
                        moved |= !*beat;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(self.failed(&e.to_string())),
                }
            }
            *off = 0;
            *last = std::time::Instant::now();
            if std::mem::take(beat) {
                continue;
            }
            v.head().store(*step + 1, Ordering::Release);
            *step += 1;
        }
    }

    /// Reads slots from the socket into free FIFO slots, publishing each once it is all there.
    fn recv(
        &self,
        s: &mut TcpStream,
        step: &mut u64,
        off: &mut usize,
        hdr: &mut [u8; HDR],
        last: &mut std::time::Instant,
    ) -> Result<bool> {
        let v = &self.view;
        let mut moved = false;
        loop {
            if *step - v.head().load(Ordering::Acquire) >= v.nsteps {
                return Ok(moved); // the FIFO is full: TCP holds the rest
            }
            loop {
                if *off == HDR && hdr[16..] == BEAT.to_le_bytes() {
                    *off = 0; // a heartbeat: nothing to publish
                }
                let bytes = if *off >= HDR { self.bytes_of(hdr)? } else { 0 };
                if *off >= HDR && *off == HDR + bytes {
                    break;
                }
                let r = if *off < HDR {
                    s.read(&mut hdr[*off..])
                } else {
                    // SAFETY: slot `step` is free (the head is within nsteps) and holds
                    // slot_bytes >= bytes; the executor reads it only once the tail moves.
                    let slot = unsafe { std::slice::from_raw_parts_mut(v.slot(*step), bytes) };
                    s.read(&mut slot[*off - HDR..])
                };
                match r {
                    // Between slots, the peer is done with the connection (it may have ended
                    // its communicator): only a wait for more from it is an error (`closed`).
                    Ok(0) if *off == 0 => {
                        self.closed.store(true, Ordering::Release);
                        return Ok(moved);
                    }
                    Ok(0) => return Err(self.failed("the peer closed the connection mid-slot")),
                    Ok(k) => {
                        *off += k;
                        *last = std::time::Instant::now();
                        moved = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(self.failed(&e.to_string())),
                }
            }
            let word = |i: usize| u64::from_le_bytes(hdr[8 * i..8 * i + 8].try_into().unwrap());
            v.set_meta(*step, [word(0), word(1), word(2)]);
            v.tail().store(*step + 1, Ordering::Release);
            *step += 1;
            *off = 0;
        }
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
