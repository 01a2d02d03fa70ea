//! Rank-to-rank messages. Each rank listens; a connection is one-directional: the rank that
//! connected writes, the rank that accepted reads. Connections are made lazily by the first send
//! to a peer. One receiver thread per rank drains every accepted socket into per-(peer, tag) FIFO
//! queues, so a sender blocked on a full socket never stops its own rank from receiving: two
//! ranks sending each other large messages at once cannot deadlock.
//!
//! Wire format of a connection: `b"OXBP"`, 16-byte secret, sender rank u32, nranks u32; then
//! frames of tag u32, length u64 (little endian), payload.

use super::id::SECRET_BYTES;
use super::wire;
use crate::debug::warn;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(crate) const PEER_MAGIC: &[u8; 4] = b"OXBP";
pub(crate) const PEER_HS_BYTES: usize = 4 + SECRET_BYTES + 8;
pub(crate) const FRAME_HDR: usize = 12;
/// A connection that has not proven the secret within this time is dropped.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);

pub(crate) fn peer_handshake(secret: &[u8; SECRET_BYTES], from: usize, nranks: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(PEER_HS_BYTES);
    v.extend_from_slice(PEER_MAGIC);
    v.extend_from_slice(secret);
    wire::put_u32(&mut v, from as u32);
    wire::put_u32(&mut v, nranks as u32);
    v
}

pub(crate) fn frame_header(tag: u32, len: usize) -> [u8; FRAME_HDR] {
    let mut h = [0u8; FRAME_HDR];
    h[0..4].copy_from_slice(&tag.to_le_bytes());
    h[4..12].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

#[derive(Default)]
pub(crate) struct Inbox {
    pub queues: HashMap<(usize, u32), VecDeque<Vec<u8>>>,
    /// Open accepted connections per sending peer.
    pub open: Vec<u32>,
    /// The peer connected once and all its connections are closed now.
    pub closed: Vec<bool>,
    /// Why the peer's last connection ended, where it failed rather than closed.
    pub failed: Vec<Option<String>>,
    /// The peer's open connections (a second handle on each socket, by the connection's id),
    /// for `Watch` to turn their keepalive on and off.
    socks: Vec<Vec<(u64, TcpStream)>>,
    /// How many receives wait on the peer now (`Watch`).
    watched: Vec<u32>,
    /// The receiver thread is gone (the bootstrap is closing).
    pub stopped: bool,
}

pub(crate) struct Shared {
    pub inbox: Mutex<Inbox>,
    pub cv: Condvar,
    stop: AtomicBool,
    /// The communicator's health: a peer's failure announcement (`super::TAG_FAILED`) breaks
    /// it at once (the receiver thread sets it), so that ranks waiting on that peer stop.
    health: Arc<crate::health::Health>,
}

impl Shared {
    pub fn push(&self, peer: usize, tag: u32, msg: Vec<u8>) {
        if tag == super::TAG_FAILED {
            // The peer's error: its code (one digit), then its message. A usage error (calls
            // that differ) is this rank's too; anything else is, here, a remote one.
            let code = msg
                .first()
                .and_then(|&c| crate::error::Code::from_raw(i32::from(c) - i32::from(b'0')))
                .filter(|&c| c == crate::error::Code::InvalidUsage)
                .unwrap_or(crate::error::Code::RemoteError);
            let why = String::from_utf8_lossy(msg.get(1..).unwrap_or_default());
            self.health.stop_work(crate::error::Error::new(
                code,
                format!("rank {peer} failed: {why}"),
            ));
            self.cv.notify_all();
            return;
        }
        self.inbox
            .lock()
            .queues
            .entry((peer, tag))
            .or_default()
            .push_back(msg);
        self.cv.notify_all();
    }
}

/// A receive waiting on a peer: while one lives, the kernel's keepalive watches that peer's
/// connections (`wire::keepalive`), so one to a host that stops answering ends the receive.
pub(crate) struct Watch<'a> {
    shared: &'a Shared,
    peer: usize,
}

impl<'a> Watch<'a> {
    /// Not while holding the inbox's lock (it takes it, and so does the drop).
    pub fn new(shared: &'a Shared, peer: usize) -> Watch<'a> {
        let mut ib = shared.inbox.lock();
        ib.watched[peer] += 1;
        if ib.watched[peer] == 1 {
            for (_, s) in &ib.socks[peer] {
                wire::keepalive(s, true);
            }
        }
        Watch { shared, peer }
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let mut ib = self.shared.inbox.lock();
        ib.watched[self.peer] -= 1;
        if ib.watched[self.peer] == 0 {
            for (_, s) in &ib.socks[self.peer] {
                wire::keepalive(s, false);
            }
        }
    }
}

/// The receiver thread and the state it fills.
pub(crate) struct Receiver {
    pub shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Dropped to wake the thread when it should stop (it sleeps in `poll` without a timeout
    /// while no connection waits for its handshake: a thread that woke up every few
    /// milliseconds would take a core from the ranks' busy waits each time).
    waker: Option<std::os::unix::net::UnixStream>,
}

impl Receiver {
    pub fn start(
        listener: TcpListener,
        secret: [u8; SECRET_BYTES],
        rank: usize,
        nranks: usize,
        health: Arc<crate::health::Health>,
    ) -> crate::error::Result<Receiver> {
        listener.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox {
                open: vec![0; nranks],
                closed: vec![false; nranks],
                failed: vec![None; nranks],
                socks: (0..nranks).map(|_| Vec::new()).collect(),
                watched: vec![0; nranks],
                ..Default::default()
            }),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            health,
        });
        let sh = shared.clone();
        let (waker, woken) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| crate::error::Error::os("creating the bootstrap receiver's waker", e))?;
        let thread = std::thread::Builder::new()
            .name(format!("oxccl-boot{rank}"))
            .spawn(move || {
                let mut l = Loop {
                    me: format!("bootstrap rank {rank}"),
                    secret,
                    nranks,
                    shared: sh,
                    conns: Vec::new(),
                    next_id: 0,
                    tmp: vec![0u8; 1 << 16],
                };
                l.run(&listener, &woken);
                let mut ib = l.shared.inbox.lock();
                ib.stopped = true;
                // The second handles too: the connections close with the thread.
                ib.socks.iter_mut().for_each(Vec::clear);
                l.shared.cv.notify_all();
            })
            .map_err(|e| crate::error::Error::os("spawning the bootstrap receiver thread", e))?;
        Ok(Receiver {
            shared,
            thread: Some(thread),
            waker: Some(waker),
        })
    }

    /// Stops and joins the thread; its sockets (listener, accepted connections) close with it.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        drop(self.waker.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Conn {
    id: u64,
    stream: TcpStream,
    from: Option<usize>,
    since: Instant,
    buf: Vec<u8>,
    peer: SocketAddr,
}

struct Loop {
    me: String,
    secret: [u8; SECRET_BYTES],
    nranks: usize,
    shared: Arc<Shared>,
    conns: Vec<Conn>,
    next_id: u64,
    tmp: Vec<u8>,
}

enum After {
    Keep,
    Drop,
}

impl Loop {
    /// Serves the listener and the accepted connections until `stop` (`woken` becomes readable
    /// or hangs up when the receiver wants the thread to look at it).
    fn run(&mut self, listener: &TcpListener, woken: &std::os::unix::net::UnixStream) {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        while !self.shared.stop.load(Ordering::Acquire) {
            // Time matters only to drop connections that never send their handshake.
            let timeout = if self.conns.iter().any(|c| c.from.is_none()) {
                PollTimeout::from(wire::SLICE.as_millis() as u16)
            } else {
                PollTimeout::NONE
            };
            let ready: Vec<bool> = {
                let mut fds = Vec::with_capacity(self.conns.len() + 2);
                fds.push(PollFd::new(listener.as_fd(), PollFlags::POLLIN));
                for c in &self.conns {
                    fds.push(PollFd::new(c.stream.as_fd(), PollFlags::POLLIN));
                }
                fds.push(PollFd::new(woken.as_fd(), PollFlags::POLLIN));
                match poll(&mut fds, timeout) {
                    Ok(_) => fds[..fds.len() - 1]
                        .iter()
                        .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
                        .collect(),
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => {
                        warn(&format!("{}: poll failed: {e}", self.me));
                        std::thread::sleep(wire::SLICE);
                        continue;
                    }
                }
            };
            if ready[0] {
                self.accept_all(listener);
            }
            let now = Instant::now();
            let mut i = self.conns.len();
            while i > 0 {
                i -= 1;
                let r = i + 1 < ready.len() && ready[i + 1];
                let after = if r {
                    self.drain(i)
                } else if self.conns[i].from.is_none()
                    && now.duration_since(self.conns[i].since) > HANDSHAKE_WAIT
                {
                    warn(&format!(
                        "{}: dropped a connection from {} that sent no handshake",
                        self.me, self.conns[i].peer
                    ));
                    After::Drop
                } else {
                    After::Keep
                };
                if let After::Drop = after {
                    let c = self.conns.swap_remove(i);
                    if let Some(p) = c.from {
                        let mut ib = self.shared.inbox.lock();
                        ib.socks[p].retain(|(id, _)| *id != c.id);
                        ib.open[p] -= 1;
                        if ib.open[p] == 0 {
                            ib.closed[p] = true;
                        }
                        self.shared.cv.notify_all();
                    }
                }
            }
        }
    }

    fn accept_all(&mut self, listener: &TcpListener) {
        loop {
            match listener.accept() {
                Ok((s, peer)) => {
                    if s.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = s.set_nodelay(true);
                    self.next_id += 1;
                    self.conns.push(Conn {
                        id: self.next_id,
                        stream: s,
                        from: None,
                        since: Instant::now(),
                        buf: Vec::new(),
                        peer,
                    });
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    warn(&format!("{}: accept failed: {e}", self.me));
                    return;
                }
            }
        }
    }

    /// Reads what the socket has, delivers complete frames.
    fn drain(&mut self, i: usize) -> After {
        let mut eof = false;
        loop {
            let c = &mut self.conns[i];
            match c.stream.read(&mut self.tmp) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => {
                    c.buf.extend_from_slice(&self.tmp[..n]);
                    if c.buf.len() >= 1 << 20 {
                        // Deliver as we go so a large message's buffer is not rescanned.
                        if let After::Drop = self.parse(i) {
                            return After::Drop;
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => {
                    let c = &self.conns[i];
                    if let Some(p) = c.from {
                        let why = wire::failure(&e);
                        warn(&format!(
                            "{}: connection from rank {p} failed: {why}",
                            self.me
                        ));
                        self.shared.inbox.lock().failed[p] = Some(why);
                    }
                    eof = true;
                    break;
                }
            }
        }
        if let After::Drop = self.parse(i) {
            return After::Drop;
        }
        if eof {
            After::Drop
        } else {
            After::Keep
        }
    }

    fn parse(&mut self, i: usize) -> After {
        let c = &mut self.conns[i];
        let mut off = 0;
        if c.from.is_none() {
            if c.buf.len() < PEER_HS_BYTES {
                return After::Keep;
            }
            let b = &c.buf;
            let from = wire::get_u32(b, 4 + SECRET_BYTES) as usize;
            let n = wire::get_u32(b, 8 + SECRET_BYTES) as usize;
            if &b[0..4] != PEER_MAGIC || !wire::same_secret(&b[4..4 + SECRET_BYTES], &self.secret) {
                warn(&format!(
                    "{}: refused a connection from {}: wrong magic or secret",
                    self.me, c.peer
                ));
                return After::Drop;
            }
            if n != self.nranks || from >= self.nranks {
                warn(&format!(
                    "{}: refused a connection from {}: rank {from} of {n}, this communicator has {} ranks",
                    self.me, c.peer, self.nranks
                ));
                return After::Drop;
            }
            c.from = Some(from);
            let mut ib = self.shared.inbox.lock();
            ib.open[from] += 1;
            ib.closed[from] = false;
            ib.failed[from] = None;
            if let Ok(dup) = c.stream.try_clone() {
                wire::keepalive(&dup, ib.watched[from] > 0);
                ib.socks[from].push((c.id, dup));
            }
            off = PEER_HS_BYTES;
        }
        let from = c.from.expect("set above");
        while c.buf.len() - off >= FRAME_HDR {
            let tag = wire::get_u32(&c.buf, off);
            let len = wire::get_u64(&c.buf, off + 4);
            let have = (c.buf.len() - off - FRAME_HDR) as u64;
            if have < len {
                break;
            }
            let len = len as usize;
            let msg = if off == 0 && c.buf.len() == FRAME_HDR + len {
                let mut m = std::mem::take(&mut c.buf);
                m.drain(..FRAME_HDR);
                off = 0;
                m
            } else {
                let m = c.buf[off + FRAME_HDR..off + FRAME_HDR + len].to_vec();
                off += FRAME_HDR + len;
                m
            };
            self.shared.push(from, tag, msg);
        }
        if off > 0 {
            c.buf.drain(..off);
        }
        After::Keep
    }
}
