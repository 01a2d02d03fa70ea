//! Byte encodings and socket helpers shared by the root and the ranks: every blocking step runs in
//! short slices that watch an abort flag and a deadline.

use crate::error::{Code, Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpStream};
use std::time::{Duration, Instant};

pub(crate) use crate::health::{fmt_secs, Wait, SLICE};

/// Encoded size of a socket address: family u8, 0 u8, port u16 BE, 16 address bytes, scope u32 LE.
pub(crate) const ADDR_BYTES: usize = 24;

pub(crate) fn encode_addr(a: &SocketAddr) -> [u8; ADDR_BYTES] {
    let mut b = [0u8; ADDR_BYTES];
    b[2..4].copy_from_slice(&a.port().to_be_bytes());
    match a {
        SocketAddr::V4(v4) => {
            b[0] = 4;
            b[4..8].copy_from_slice(&v4.ip().octets());
        }
        SocketAddr::V6(v6) => {
            b[0] = 6;
            b[4..20].copy_from_slice(&v6.ip().octets());
            b[20..24].copy_from_slice(&v6.scope_id().to_le_bytes());
        }
    }
    b
}

pub(crate) fn decode_addr(b: &[u8]) -> Option<SocketAddr> {
    if b.len() < ADDR_BYTES || b[1] != 0 {
        return None;
    }
    let port = u16::from_be_bytes([b[2], b[3]]);
    if port == 0 {
        return None;
    }
    match b[0] {
        4 => {
            if b[8..24].iter().any(|&x| x != 0) {
                return None;
            }
            let ip = Ipv4Addr::new(b[4], b[5], b[6], b[7]);
            Some(SocketAddr::V4(SocketAddrV4::new(ip, port)))
        }
        6 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(&b[4..20]);
            let scope = u32::from_le_bytes([b[20], b[21], b[22], b[23]]);
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(o),
                port,
                0,
                scope,
            )))
        }
        _ => None,
    }
}

/// An unspecified address becomes the matching loopback (a listener bound to 0.0.0.0 is reached
/// through 127.0.0.1 on this host).
pub(crate) fn reachable(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), a.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), a.port())
        }
        _ => a,
    }
}

pub(crate) fn put_u32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}

pub(crate) fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

pub(crate) fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// Compares two secrets without an early exit.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A read or write timeout (`SO_RCVTIMEO`, `SO_SNDTIMEO`: `EAGAIN`) or a signal; not
/// `ETIMEDOUT` (`TimedOut`), the keepalive's end of a connection (`failure`).
fn transient(k: ErrorKind) -> bool {
    matches!(k, ErrorKind::WouldBlock | ErrorKind::Interrupted)
}

pub(crate) fn read_exact(
    s: &mut TcpStream,
    buf: &mut [u8],
    w: &Wait,
    what: &dyn Fn() -> String,
) -> Result<()> {
    let mut off = 0;
    while off < buf.len() {
        s.set_read_timeout(Some(w.slice()))?;
        match s.read(&mut buf[off..]) {
            Ok(0) => {
                return Err(Error::remote(format!(
                    "{}: connection closed by {}",
                    w.who,
                    what()
                )))
            }
            Ok(n) => off += n,
            Err(e) if transient(e.kind()) => w.check(what)?,
            Err(e) => {
                return Err(Error::remote(format!(
                    "{}: connection to {} failed: {}",
                    w.who,
                    what(),
                    failure(&e)
                )))
            }
        }
    }
    Ok(())
}

pub(crate) fn write_all(
    s: &mut TcpStream,
    mut buf: &[u8],
    w: &Wait,
    what: &dyn Fn() -> String,
) -> Result<()> {
    while !buf.is_empty() {
        s.set_write_timeout(Some(w.slice()))?;
        // std's TcpStream writes with MSG_NOSIGNAL on Linux: a dead peer is EPIPE, not SIGPIPE.
        match s.write(buf) {
            Ok(0) => {
                return Err(Error::remote(format!(
                    "{}: connection to {} closed",
                    w.who,
                    what()
                )))
            }
            Ok(n) => buf = &buf[n..],
            Err(e) if transient(e.kind()) => w.check(what)?,
            Err(e) => {
                return Err(Error::remote(format!(
                    "{}: sending to {} failed: {}",
                    w.who,
                    what(),
                    failure(&e)
                )))
            }
        }
    }
    Ok(())
}

/// Connection attempts to one address, retried while it refuses or does not answer, for at most
/// `OXCCL_BOOTSTRAP_CONNECT_S` (and never past the wait's own deadline). Attempts are counted
/// across calls, so a caller that loses a fresh connection (see `note`) and connects again stays
/// within the same bound; the error says what was tried.
pub(crate) struct Connector {
    addr: SocketAddr,
    start: Instant,
    /// The bound of `OXCCL_BOOTSTRAP_CONNECT_S` (cut by the wait's deadline in `connect`).
    until: Instant,
    attempts: u32,
    last: Option<String>,
}

/// Pause after the first refused attempt; it doubles up to `RETRY_MAX`.
const RETRY_MIN: Duration = Duration::from_millis(10);
const RETRY_MAX: Duration = Duration::from_millis(500);

impl Connector {
    pub fn new(addr: SocketAddr) -> Connector {
        let start = Instant::now();
        Connector {
            addr,
            start,
            until: start + crate::param::bootstrap_connect(),
            attempts: 0,
            last: None,
        }
    }

    /// Records why a connection made by `connect` was of no use (it is then made again).
    pub fn note(&mut self, why: String) {
        self.last = Some(why);
    }

    /// Whether the bound leaves time for another attempt.
    pub fn may_retry(&self, w: &Wait) -> bool {
        Instant::now() < self.until.min(w.deadline)
    }

    /// A connection to the address (blocking mode, no delay), or the error of the last attempt
    /// once the bound is spent (`Timeout`), or the wait's abort.
    pub fn connect(&mut self, w: &Wait, what: &dyn Fn() -> String) -> Result<TcpStream> {
        let mut pause = RETRY_MIN;
        loop {
            aborted(w, what)?;
            if !self.may_retry(w) {
                return Err(self.give_up(w, what));
            }
            self.attempts += 1;
            match self.attempt(w, what)? {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => self.last = Some(e),
            }
            // Nobody listens (yet): wait a little longer after each refusal.
            let resume = Instant::now() + pause;
            pause = (pause * 2).min(RETRY_MAX);
            while Instant::now() < resume.min(self.until).min(w.deadline) {
                aborted(w, what)?;
                std::thread::sleep(
                    w.slice()
                        .min(resume.saturating_duration_since(Instant::now())),
                );
            }
        }
    }

    /// One non-blocking connect, polled in slices that watch the wait; Ok(Err(why)) when it
    /// failed or got no answer before the bound.
    fn attempt(
        &self,
        w: &Wait,
        what: &dyn Fn() -> String,
    ) -> Result<std::result::Result<TcpStream, String>> {
        use nix::errno::Errno;
        use nix::poll::{poll, PollFd, PollFlags};
        use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage};
        use std::os::fd::{AsFd, AsRawFd};
        let fam = if self.addr.is_ipv4() {
            AddressFamily::Inet
        } else {
            AddressFamily::Inet6
        };
        let fd = socket::socket(
            fam,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(|e| Error::os(format!("{}: creating a socket", w.who), e))?;
        match socket::connect(fd.as_raw_fd(), &SockaddrStorage::from(self.addr)) {
            Ok(()) => {}
            Err(Errno::EINPROGRESS) | Err(Errno::EINTR) => loop {
                let end = self.until.min(w.deadline);
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(Err("no answer to the connection request".into()));
                }
                let ms = w.slice().min(left).as_millis().max(1) as u16;
                let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLOUT)];
                match poll(&mut fds, ms) {
                    Ok(0) | Err(Errno::EINTR) => aborted(w, what)?,
                    Ok(_) => match socket::getsockopt(&fd, sockopt::SocketError) {
                        Ok(0) => break,
                        Ok(e) => return Ok(Err(std::io::Error::from_raw_os_error(e).to_string())),
                        Err(e) => return Ok(Err(e.to_string())),
                    },
                    Err(e) => return Ok(Err(e.to_string())),
                }
            },
            Err(e) => return Ok(Err(std::io::Error::from(e).to_string())),
        }
        let s = TcpStream::from(fd);
        s.set_nonblocking(false)?;
        Ok(Ok(s))
    }

    /// The error once the bound is spent: the address, the attempts, over how long, why the last
    /// one failed, and which bound ended them.
    fn give_up(&self, w: &Wait, what: &dyn Fn() -> String) -> Error {
        let bound = crate::param::bootstrap_connect();
        let limit = if self.until <= w.deadline {
            format!("OXCCL_BOOTSTRAP_CONNECT_S={}", bound.as_secs())
        } else {
            format!("the timeout of {}", fmt_secs(w.timeout))
        };
        let last = self.last.as_deref().unwrap_or("no attempt was made");
        Error::timeout(format!(
            "{} waited {} for {} to accept a connection: {} attempt(s) failed, the last with: \
             {last} (attempts end after {limit})",
            w.who,
            fmt_secs(Duration::from_millis(
                self.start.elapsed().as_millis() as u64
            )),
            what(),
            self.attempts,
        ))
    }
}

/// The wait's abort, if any (its deadline is the connector's business).
fn aborted(w: &Wait, what: &dyn Fn() -> String) -> Result<()> {
    match w.health {
        Some(h) => h.stopped(&w.who, what),
        None => Ok(()),
    }
}

/// Turns the kernel's keepalive on a bootstrap socket on or off. On, a connection to a host
/// that stops answering (it died without closing it, or the link to it is down) fails within
/// `OXCCL_HEARTBEAT_S` instead of at the setup bound: probes once a second after a second of
/// quiet, the connection dropped (`ETIMEDOUT`, see `failure`) when as many go unanswered as the
/// limit allows. A live peer's kernel answers them, however long its rank takes to come. (Not
/// TCP_USER_TIMEOUT, which drops a live peer whose window stays closed that long.) On for the
/// rendezvous' connections; on a rank's connections from and to a peer only while a receive
/// waits on that peer (`peer::Watch`, `LinkWatch`), so a link down for a while between setups
/// is no failure, as for the network transport's heartbeats. Best effort: a socket that
/// refuses the options keeps the wait's bound.
pub(crate) fn keepalive(s: &TcpStream, on: bool) {
    use nix::sys::socket::{setsockopt, sockopt};
    let Some(limit) = crate::param::heartbeat() else {
        return;
    };
    if !on {
        let _ = setsockopt(s, sockopt::KeepAlive, &false);
        return;
    }
    let probes = u32::try_from(limit.as_secs())
        .unwrap_or(u32::MAX)
        .saturating_sub(1)
        .max(1);
    let _ = setsockopt(s, sockopt::TcpKeepIdle, &1)
        .and_then(|_| setsockopt(s, sockopt::TcpKeepInterval, &1))
        .and_then(|_| setsockopt(s, sockopt::TcpKeepCount, &probes))
        .and_then(|_| setsockopt(s, sockopt::KeepAlive, &true));
}

/// What a connection's error says: a timeout is the keepalive's (`keepalive`), the other
/// host silent for `OXCCL_HEARTBEAT_S`.
pub(crate) fn failure(e: &std::io::Error) -> String {
    match crate::param::heartbeat() {
        Some(t) if e.raw_os_error() == Some(nix::errno::Errno::ETIMEDOUT as i32) => format!(
            "its host did not answer for {} (OXCCL_HEARTBEAT_S): the host, or the link to it, \
             is down",
            fmt_secs(t)
        ),
        _ => e.to_string(),
    }
}

/// One connection attempt, as [`Connector::connect`] makes them (no delay, blocking mode):
/// Ok(Err(why)) when it was refused or failed, or got no answer within
/// `OXCCL_BOOTSTRAP_CONNECT_S` or the wait's deadline; Err when the wait's communicator is
/// aborted meanwhile. For an address that listens before it is handed out (a network
/// transport's end), where a refusal means the other end is gone, not late.
pub(crate) fn connect_once(
    addr: SocketAddr,
    w: &Wait,
    what: &dyn Fn() -> String,
) -> Result<std::result::Result<TcpStream, String>> {
    let s = Connector::new(addr).attempt(w, what)?;
    if let Ok(s) = &s {
        let _ = s.set_nodelay(true);
    }
    Ok(s)
}

/// Whether a failure `connect_once` gave (its `why`) is a refusal: nobody listens there.
pub(crate) fn refused(why: &str) -> bool {
    why == std::io::Error::from_raw_os_error(nix::errno::Errno::ECONNREFUSED as i32).to_string()
}

/// Connects as [`Connector::connect`] does, for one connection.
pub(crate) fn connect(addr: SocketAddr, w: &Wait, what: &dyn Fn() -> String) -> Result<TcpStream> {
    Connector::new(addr).connect(w, what)
}

/// Reads a status byte, then either an error (code u8 as status, message) or a payload closure.
pub(crate) fn read_status(s: &mut TcpStream, w: &Wait, what: &dyn Fn() -> String) -> Result<()> {
    let mut st = [0u8; 1];
    read_exact(s, &mut st, w, what)?;
    status_after(st[0], s, w, what)
}

/// As `read_status`; Ok(false) when the other side closed or reset the connection before the
/// status byte (it dropped the connection unread, or it died).
pub(crate) fn read_status_or_closed(
    s: &mut TcpStream,
    w: &Wait,
    what: &dyn Fn() -> String,
) -> Result<bool> {
    let mut st = [0u8; 1];
    loop {
        s.set_read_timeout(Some(w.slice()))?;
        match s.read(&mut st) {
            Ok(0) => return Ok(false),
            Ok(_) => break,
            Err(e) if transient(e.kind()) => w.check(what)?,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return Ok(false),
            Err(e) => {
                return Err(Error::remote(format!(
                    "{}: connection to {} failed: {}",
                    w.who,
                    what(),
                    failure(&e)
                )))
            }
        }
    }
    status_after(st[0], s, w, what).map(|()| true)
}

fn status_after(st: u8, s: &mut TcpStream, w: &Wait, what: &dyn Fn() -> String) -> Result<()> {
    if st == 0 {
        return Ok(());
    }
    let mut lenb = [0u8; 4];
    read_exact(s, &mut lenb, w, what)?;
    let len = (u32::from_le_bytes(lenb) as usize).min(1 << 16);
    let mut msg = vec![0u8; len];
    read_exact(s, &mut msg, w, what)?;
    let code = Code::from_raw(st as i32).unwrap_or(Code::RemoteError);
    Err(Error::new(code, String::from_utf8_lossy(&msg).into_owned()))
}

/// Encodes an error reply (see `read_status`).
pub(crate) fn error_reply(code: Code, msg: &str) -> Vec<u8> {
    let mut v = vec![(code as i32).clamp(1, 255) as u8];
    let m = &msg.as_bytes()[..msg.len().min(1 << 16)];
    put_u32(&mut v, m.len() as u32);
    v.extend_from_slice(m);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addr_roundtrip() {
        for s in [
            "127.0.0.1:5000",
            "10.1.2.3:1",
            "[::1]:65535",
            "[fe80::1%3]:77",
        ] {
            let a: SocketAddr = s.parse().unwrap();
            assert_eq!(decode_addr(&encode_addr(&a)), Some(a), "{s}");
        }
        assert_eq!(decode_addr(&[0u8; ADDR_BYTES]), None);
        let mut b = encode_addr(&"127.0.0.1:5000".parse().unwrap());
        b[0] = 5;
        assert_eq!(decode_addr(&b), None);
    }

    #[test]
    fn secrets_compare() {
        assert!(same_secret(&[1, 2, 3], &[1, 2, 3]));
        assert!(!same_secret(&[1, 2, 3], &[1, 2, 4]));
        assert!(!same_secret(&[1, 2], &[1, 2, 3]));
    }
}
