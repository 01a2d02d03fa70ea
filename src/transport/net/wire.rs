//! A network connection's slots on the wire, over one or several sockets (`NCCL_NSOCKS_PERTHREAD`
//! x `NCCL_SOCKET_NTHREADS`): each slot travels as a header (call words, bytes) on the first
//! socket, then its bytes cut into contiguous parts, part j on socket j, all moving at once.
//! Slots smaller than a part's minimum use fewer sockets, so that a small slot costs one
//! system call. Both ends cut a slot the same way from its byte count alone.
//!
//! The receiving end reads the first socket through a small staging buffer (`Stage`): a slot's
//! header and a small slot's bytes, and often the next slot's header too, come in one system
//! call; larger parts are read straight into the slot.
//!
//! Everything here is non-blocking: a call moves what the sockets take or hold and returns;
//! `Progress` remembers where the current slot stands.

use super::helpers::Helpers;
use super::{NetEnd, BEAT, BEAT_EVERY, HDR};
use crate::error::Result;
use crate::health::Coarse;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;

/// The smallest part worth a socket of its own.
const MIN_PART: usize = 64 << 10;
/// The receiving end's staging buffer for the first socket: reads that want less than this go
/// through it.
const STAGE: usize = 16 << 10;

/// Where part `j` of a slot of `bytes` bytes, cut for `k` sockets, starts (`j` = parts: the end).
pub fn part_start(bytes: usize, k: usize, j: usize) -> usize {
    let parts = parts(bytes, k);
    if j == 0 {
        0
    } else if j >= parts {
        bytes
    } else {
        (bytes * j / parts) & !63
    }
}

/// How many parts a slot of `bytes` bytes is cut into for `k` sockets.
pub fn parts(bytes: usize, k: usize) -> usize {
    (bytes / MIN_PART).clamp(1, k.max(1))
}

/// The state of a connection's current slot.
pub struct Progress {
    /// The next step (slot) to move.
    pub step: u64,
    /// Header bytes moved (a slot's or a heartbeat's).
    pub hdr_off: usize,
    pub hdr: [u8; HDR],
    /// Bytes of each part moved.
    pub done: Vec<usize>,
    /// Sending end: a heartbeat's header is on its way (in `hdr`).
    pub beat: bool,
    /// When bytes last went out (sending end) or came in (receiving end): heartbeats are
    /// seconds apart, so the coarse clock tells.
    pub last: Coarse,
    /// Receiving end: the size of the last slot that arrived.
    pub last_bytes: usize,
    /// Receiving end: where the current slot's bytes go.
    pub target: Target,
    /// Receiving end: bytes read from the first socket and not yet used.
    stage: Stage,
    /// The step last handed to the helper threads, plus one (0: none).
    posted: u64,
    /// The helper threads' byte count when last seen (their progress counts as traffic).
    helped: u64,
}

/// Where a receiving end reads the current slot's bytes, decided once its header is in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Target {
    Undecided,
    /// The FIFO slot.
    Slot,
    /// The caller's memory the executor named for the slot (`NetEnd::take_dest`).
    Caller(usize),
}

/// Bytes read ahead from a socket (`buf[lo..hi]`), handed out before the socket is read again.
struct Stage {
    buf: Vec<u8>,
    lo: usize,
    hi: usize,
}

impl Stage {
    /// Reads into `dst` like `Read::read` (0: the peer closed), from what is staged or else
    /// from `s`: straight into `dst` when it wants a full buffer or more, through the buffer
    /// otherwise (allocated at its first use: sending ends never use it).
    fn read(&mut self, s: &mut TcpStream, dst: &mut [u8]) -> std::io::Result<usize> {
        if self.lo == self.hi {
            if dst.len() >= STAGE {
                return s.read(dst);
            }
            if self.buf.is_empty() {
                self.buf = vec![0; STAGE];
            }
            self.hi = s.read(&mut self.buf)?;
            self.lo = 0;
        }
        let n = dst.len().min(self.hi - self.lo);
        dst[..n].copy_from_slice(&self.buf[self.lo..self.lo + n]);
        self.lo += n;
        Ok(n)
    }
}

impl Progress {
    pub fn new(k: usize) -> Progress {
        Progress {
            step: 0,
            hdr_off: 0,
            hdr: [0; HDR],
            done: vec![0; k],
            beat: false,
            last: Coarse::now(),
            last_bytes: 0,
            target: Target::Undecided,
            stage: Stage {
                buf: Vec::new(),
                lo: 0,
                hi: 0,
            },
            posted: 0,
            helped: 0,
        }
    }

    /// Between slots (nothing of the current one has moved).
    pub fn idle(&self) -> bool {
        self.hdr_off == 0 && self.done.iter().all(|&d| d == 0)
    }

    fn reset(&mut self) {
        self.hdr_off = 0;
        self.done.iter_mut().for_each(|d| *d = 0);
        self.target = Target::Undecided;
    }

    /// With helper threads: hands them the current slot (once), then whether they are done
    /// with it (their progress counts as the connection's traffic).
    fn helped(
        &mut self,
        h: Option<&Helpers>,
        slot: *mut u8,
        bytes: usize,
        k: usize,
        end: &NetEnd,
    ) -> Result<bool> {
        let Some(h) = h else { return Ok(true) };
        if self.posted != self.step + 1 {
            h.post(self.step, slot, bytes, k);
            self.posted = self.step + 1;
        }
        let moved = h.moved();
        if moved != self.helped {
            self.helped = moved;
            self.last = Coarse::now();
        }
        h.finished(self.step, bytes, k).map_err(|e| end.failed(&e))
    }
}

/// Whether socket `j` is the driving thread's to move (not a helper thread's).
fn ours(helpers: Option<&Helpers>, j: usize) -> bool {
    !helpers.is_some_and(|h| h.owns(j))
}

/// A header and the first part of a slot in one sendmsg(2), without SIGPIPE: writev(2) raises
/// it when the peer has gone, which kills a C program that did not ignore it (std's `write`
/// uses send(2) with MSG_NOSIGNAL: EPIPE only). Nothing is allocated: this runs once per slot
/// on the small operations' path.
fn send_vectored(s: &TcpStream, bufs: [&[u8]; 2]) -> std::io::Result<usize> {
    use nix::libc;
    use std::os::fd::AsRawFd;
    let mut iov = bufs.map(|b| libc::iovec {
        iov_base: b.as_ptr() as *mut libc::c_void,
        iov_len: b.len(),
    });
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    // SAFETY: `msg` points at two iovecs over live slices, which sendmsg only reads.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// The result of one non-blocking transfer.
enum Io {
    Moved(usize),
    Blocked,
    /// The peer closed the connection (end of stream).
    Closed,
    /// The connection was reset or broken (the peer closed it with bytes unread, or is gone).
    Reset(std::io::Error),
}

fn io(r: std::io::Result<usize>, end: &NetEnd) -> Result<Io> {
    match r {
        Ok(0) => Ok(Io::Closed),
        Ok(k) => Ok(Io::Moved(k)),
        Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(Io::Blocked),
        Err(e) if e.kind() == ErrorKind::Interrupted => Ok(Io::Moved(0)),
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe
            ) =>
        {
            Ok(Io::Reset(e))
        }
        Err(e) if e.kind() == ErrorKind::TimedOut => Err(end.broke(&e)),
        Err(e) => Err(end.failed(&e.to_string())),
    }
}

/// Whether every byte written to `s` has been acknowledged by the peer (SIOCOUTQ is 0; an
/// error counts as yes: there is nothing left to wait for).
pub fn acknowledged(s: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut n: nix::libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int: the bytes not yet acknowledged.
    let r = unsafe { nix::libc::ioctl(s.as_raw_fd(), nix::libc::TIOCOUTQ, &mut n) };
    r != 0 || n == 0
}

impl NetEnd {
    /// Writes filled slots to the sockets, freeing each once all of it is written.
    pub(super) fn send(
        &self,
        socks: &mut [TcpStream],
        w: &mut Progress,
        helpers: Option<&Helpers>,
    ) -> Result<bool> {
        let v = &self.view;
        let k = socks.len();
        let mut moved = false;
        loop {
            // Between slots: the next filled slot's header, or, once the end has been idle for
            // a while, a heartbeat's (a header with no bytes).
            if !w.beat && w.idle() {
                if w.step < v.tail().load(Ordering::Acquire) {
                    let (_, bytes) = v.slot_data(w.step);
                    let m = v.meta(w.step);
                    for (i, m) in [m[0], m[1], bytes as u64].iter().enumerate() {
                        w.hdr[8 * i..8 * i + 8].copy_from_slice(&m.to_le_bytes());
                    }
                } else if w.last.elapsed() >= BEAT_EVERY {
                    w.hdr = [0; HDR];
                    w.hdr[16..].copy_from_slice(&BEAT.to_le_bytes());
                    w.beat = true;
                } else {
                    return Ok(moved);
                }
            }
            let data: &[u8] = if w.beat {
                &[]
            } else {
                let (at, bytes) = v.slot_data(w.step);
                // SAFETY: the slot holds `bytes <= slot_bytes` bytes the executor filled
                // before publishing the tail, or refers to the caller's memory that holds
                // them (valid, unchanged, until the head moves or `settle` copies them into
                // the slot under this end's lock); it stays ours until the head moves.
                unsafe { std::slice::from_raw_parts(at, bytes) }
            };
            let np = if w.beat { 1 } else { parts(data.len(), k) };
            let mut complete = true;
            let at = data.as_ptr() as *mut u8;
            if np > 1 && !w.helped(helpers, at, data.len(), k, self)? {
                complete = false;
            }
            for j in (0..np).filter(|&j| ours(helpers, j)) {
                let part = &data[part_start(data.len(), k, j)..part_start(data.len(), k, j + 1)];
                loop {
                    let hdr_left = if j == 0 { HDR - w.hdr_off } else { 0 };
                    let left = &part[w.done[j]..];
                    if hdr_left == 0 && left.is_empty() {
                        break;
                    }
                    let r = if hdr_left > 0 {
                        // Header and first part in one system call (one segment when small).
                        send_vectored(&socks[0], [&w.hdr[w.hdr_off..], left])
                    } else {
                        socks[j].write(left)
                    };
                    match io(r, self)? {
                        // A heartbeat to a peer that is done with the connection (it ended its
                        // communicator): nothing more goes; a wait for it is an error (`closed`).
                        Io::Closed | Io::Reset(_) if w.beat => {
                            self.closed.store(true, Ordering::Release);
                            return Ok(moved);
                        }
                        Io::Closed => return Err(self.failed("the peer closed the connection")),
                        Io::Reset(e) => return Err(self.broke(&e)),
                        Io::Blocked => {
                            complete = false;
                            break;
                        }
                        Io::Moved(n) => {
                            let h = n.min(hdr_left);
                            w.hdr_off += h;
                            w.done[j] += n - h;
                            // A heartbeat is no progress: the proxy may go back to sleep.
                            moved |= !w.beat;
                        }
                    }
                }
            }
            if !complete {
                return Ok(moved);
            }
            w.reset();
            w.last = Coarse::now();
            if std::mem::take(&mut w.beat) {
                continue;
            }
            v.head().store(w.step + 1, Ordering::Release);
            w.step += 1;
            moved = true; // (a slot the helpers finished: no byte moved in this call)
        }
    }

    /// Reads slots from the sockets into free FIFO slots, publishing each once all of it is
    /// there.
    pub(super) fn recv(
        &self,
        socks: &mut [TcpStream],
        w: &mut Progress,
        helpers: Option<&Helpers>,
    ) -> Result<bool> {
        let v = &self.view;
        let k = socks.len();
        let mut moved = false;
        loop {
            if w.step - v.head().load(Ordering::Acquire) >= v.nsteps {
                return Ok(moved); // the FIFO is full: TCP holds the rest
            }
            while w.hdr_off < HDR {
                match io(w.stage.read(&mut socks[0], &mut w.hdr[w.hdr_off..]), self)? {
                    // Between slots, the peer is done with the connection (it may have ended
                    // its communicator; closing a socket with bytes unread resets it): only a
                    // wait for more from it is an error (`closed`).
                    Io::Closed | Io::Reset(_) if w.hdr_off == 0 => {
                        self.closed.store(true, Ordering::Release);
                        return Ok(moved);
                    }
                    Io::Closed => {
                        return Err(self.failed("the peer closed the connection mid-slot"))
                    }
                    Io::Reset(e) => return Err(self.broke(&e)),
                    Io::Blocked => return Ok(moved),
                    Io::Moved(n) => {
                        w.hdr_off += n;
                        w.last = Coarse::now();
                        moved = true;
                    }
                }
            }
            if w.hdr[16..] == BEAT.to_le_bytes() {
                w.reset(); // a heartbeat: nothing to publish
                continue;
            }
            let bytes = self.bytes_of(&w.hdr)?;
            // Decided once, before the first byte: the executor may have named a place for it.
            if w.target == Target::Undecided {
                w.target = match helpers {
                    None => self
                        .take_dest(w.step, &w.hdr, bytes)
                        .map_or(Target::Slot, Target::Caller),
                    Some(_) => Target::Slot,
                };
            }
            let base = match w.target {
                Target::Caller(at) => at as *mut u8,
                _ => v.slot(w.step),
            };
            let mut complete = true;
            if parts(bytes, k) > 1 && !w.helped(helpers, base, bytes, k, self)? {
                complete = false;
            }
            for (j, sock) in socks
                .iter_mut()
                .enumerate()
                .take(parts(bytes, k))
                .filter(|(j, _)| ours(helpers, *j))
            {
                let (lo, hi) = (part_start(bytes, k, j), part_start(bytes, k, j + 1));
                while lo + w.done[j] < hi {
                    // SAFETY: slot `step` is free (the head is within nsteps) and holds
                    // slot_bytes >= bytes; the executor reads it only once the tail moves. Or
                    // the executor posted `bytes` bytes of its memory for the slot, which stay
                    // valid and untouched until it takes the slot or revokes them (under this
                    // end's lock, which the caller holds).
                    let slot = unsafe {
                        std::slice::from_raw_parts_mut(
                            base.add(lo + w.done[j]),
                            hi - lo - w.done[j],
                        )
                    };
                    let r = if j == 0 {
                        w.stage.read(sock, slot)
                    } else {
                        sock.read(slot)
                    };
                    match io(r, self)? {
                        Io::Closed => {
                            return Err(self.failed("the peer closed the connection mid-slot"))
                        }
                        Io::Reset(e) => return Err(self.broke(&e)),
                        Io::Blocked => {
                            complete = false;
                            break;
                        }
                        Io::Moved(n) => {
                            w.done[j] += n;
                            w.last = Coarse::now();
                            moved = true;
                        }
                    }
                }
            }
            if !complete {
                return Ok(moved);
            }
            let word = |i: usize| u64::from_le_bytes(w.hdr[8 * i..8 * i + 8].try_into().unwrap());
            // (A slot delivered holds where its bytes went: a revoke copies them from there.)
            let at = match w.target {
                Target::Caller(at) => Some(at as *const u8),
                _ => None,
            };
            v.arrived(w.step, [word(0), word(1)], bytes, at);
            moved = true;
            w.last_bytes = bytes;
            w.step += 1;
            w.reset();
        }
    }

    /// The sockets a sleeping proxy waits on for this end's current slot, as a bit mask (bit j:
    /// socket j): for a sending end, those with bytes left to write; for a receiving end, those
    /// with bytes to read.
    /// Sockets of helper threads are theirs to wait on: not in the mask.
    pub(super) fn pending(&self, k: usize, w: &Progress, helpers: Option<&Helpers>) -> u64 {
        let v = &self.view;
        let parts_left = |bytes: usize| {
            (0..parts(bytes, k))
                .filter(|&j| ours(helpers, j))
                .filter(|&j| part_start(bytes, k, j) + w.done[j] < part_start(bytes, k, j + 1))
                .fold(0u64, |m, j| m | 1 << j)
        };
        if self.is_sender {
            if w.idle() && !w.beat && w.step >= v.tail().load(Ordering::Acquire) {
                0
            } else if w.beat || w.hdr_off < HDR || w.idle() {
                1
            } else {
                parts_left(v.slot_data(w.step).1)
            }
        } else if w.idle() && w.step - v.head().load(Ordering::Acquire) >= v.nsteps {
            0 // the FIFO is full: a freed slot kicks the proxy
        } else if w.hdr_off < HDR {
            1
        } else {
            self.bytes_of(&w.hdr).map_or(1, parts_left)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_slot_in_order() {
        for k in [1usize, 2, 3, 4, 8] {
            for bytes in [
                0usize,
                1,
                64,
                4095,
                MIN_PART,
                2 * MIN_PART + 17,
                1 << 20,
                (1 << 20) + 8,
            ] {
                let np = parts(bytes, k);
                assert!(np >= 1 && np <= k);
                assert_eq!(part_start(bytes, k, 0), 0);
                assert_eq!(part_start(bytes, k, np), bytes);
                for j in 0..np {
                    assert!(part_start(bytes, k, j) <= part_start(bytes, k, j + 1));
                }
            }
        }
        assert_eq!(parts(4096, 4), 1);
        assert_eq!(parts(1 << 20, 4), 4);
    }

    /// Writing to a socket whose peer has gone is EPIPE, not SIGPIPE, even where SIGPIPE kills
    /// (a C program's default; Rust's runtime ignores it, so a forked child restores it).
    #[test]
    fn a_gone_peer_is_an_error_not_sigpipe() {
        use nix::sys::signal::{signal, SigHandler, Signal};
        use nix::sys::wait::{waitpid, WaitStatus};
        use nix::unistd::{fork, ForkResult};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        drop(l.accept().unwrap());
        drop(l);
        std::thread::sleep(std::time::Duration::from_millis(50));
        // SAFETY: the child only makes system calls and exits.
        match unsafe { fork() }.unwrap() {
            ForkResult::Child => {
                // SAFETY: restoring the default disposition.
                unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) }.unwrap();
                let mut failed = false;
                for _ in 0..4 {
                    failed |= send_vectored(&s, [&[1u8; 24], &[2u8; 100]]).is_err();
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                // SAFETY: ends the forked child at once.
                unsafe { nix::libc::_exit(if failed { 0 } else { 1 }) }
            }
            ForkResult::Parent { child } => {
                let st = waitpid(child, None).unwrap();
                assert_eq!(st, WaitStatus::Exited(child, 0), "the writer: {st:?}");
            }
        }
    }
}
