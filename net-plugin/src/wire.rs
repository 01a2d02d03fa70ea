//! The plugin's sockets: listeners with their token, comms and their in-order requests.

use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// NCCL_NET_HANDLE_MAXSIZE.
pub const HANDLE_BYTES: usize = 128;
const MAGIC: &[u8; 4] = b"OXSK";
const TOKEN: usize = 16;
/// Where a connecting end keeps its state between `connect` calls: the handle's last 8 bytes
/// (the caller passes the same handle until the connection is made), after the address text.
const STAGE_AT: usize = HANDLE_BYTES - 8;
/// How long a connection may take to connect, or to present its token once accepted.
const SETUP_LIMIT: Duration = Duration::from_secs(30);
/// Requests a comm holds at once (a post beyond them gets a NULL request: later).
const NREQ: usize = 32;

/// A listening socket and the token its connections must present.
pub struct Listener {
    l: TcpListener,
    token: [u8; TOKEN],
    /// Accepted connections whose token has not all arrived yet.
    pending: Mutex<Vec<Hello>>,
}

/// An accepted connection and the token bytes it sent so far.
struct Hello {
    s: TcpStream,
    from: SocketAddr,
    got: [u8; TOKEN],
    n: usize,
    since: Instant,
}

impl Listener {
    pub fn new(l: TcpListener) -> std::io::Result<Listener> {
        l.set_nonblocking(true)?;
        let mut token = [0u8; TOKEN];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut token)?;
        Ok(Listener {
            l,
            token,
            pending: Mutex::new(Vec::new()),
        })
    }

    /// Writes the handle a peer connects with: magic, token, address (text, NUL-terminated).
    pub fn handle(&self, h: &mut [u8; HANDLE_BYTES]) {
        h.fill(0);
        h[..4].copy_from_slice(MAGIC);
        h[4..4 + TOKEN].copy_from_slice(&self.token);
        if let Ok(a) = self.l.local_addr() {
            let a = a.to_string();
            let n = a.len().min(STAGE_AT - 4 - TOKEN - 1);
            h[4 + TOKEN..4 + TOKEN + n].copy_from_slice(&a.as_bytes()[..n]);
        }
    }

    /// A connection that presented the token, if one has (without blocking: accepted
    /// connections wait in `pending` until their token is all there; those that present
    /// another, close, or take longer than `SETUP_LIMIT` are dropped).
    pub fn accept(&self) -> std::io::Result<Option<Comm>> {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match self.l.accept() {
                Ok((s, from)) => {
                    s.set_nonblocking(true)?;
                    pending.push(Hello {
                        s,
                        from,
                        got: [0; TOKEN],
                        n: 0,
                        since: Instant::now(),
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        let mut i = 0;
        while i < pending.len() {
            let h = &mut pending[i];
            let gone = match h.s.read(&mut h.got[h.n..]) {
                Ok(0) => true,
                Ok(k) => {
                    h.n += k;
                    false
                }
                Err(e) => e.kind() != ErrorKind::WouldBlock && e.kind() != ErrorKind::Interrupted,
            };
            if h.n == TOKEN || gone || h.since.elapsed() > SETUP_LIMIT {
                let h = pending.remove(i);
                if h.n == TOKEN && h.got == self.token {
                    return Comm::new(h.s).map(Some);
                }
                crate::log(
                    2,
                    &format!(
                        "oxsocket: dropped a connection from {} without the token",
                        h.from
                    ),
                );
                continue;
            }
            i += 1;
        }
        Ok(None)
    }
}

/// A connection being made (kept behind the handle's `STAGE_AT` bytes between calls).
struct Connecting {
    s: TcpStream,
    addr: SocketAddr,
    sent: usize,
    since: Instant,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Active,
    /// Complete, not yet reported by `test`.
    Done,
}

/// A posted send or receive: the message's length (8 bytes, little endian), then its bytes.
pub struct Request {
    comm: *mut Comm,
    recv: bool,
    state: State,
    buf: *mut u8,
    /// Bytes to send, or room to receive.
    size: usize,
    len: [u8; 8],
    len_off: usize,
    off: usize,
}

impl Request {
    const FREE: Request = Request {
        comm: std::ptr::null_mut(),
        recv: false,
        state: State::Free,
        buf: std::ptr::null_mut(),
        size: 0,
        len: [0; 8],
        len_off: 0,
        off: 0,
    };
}

/// Moves `r`'s comm's requests on, in order, up to `r`: its size once complete.
///
/// # Safety
/// `r` is a request `Comm::post` returned, of a live comm, not yet reported complete.
pub unsafe fn test(r: *mut Request) -> Result<Option<usize>, Failure> {
    // SAFETY: `r` points into its comm's request allocation (`post`), and `comm` is that live
    // comm, whose struct does not hold the requests: the two never overlap.
    let c = unsafe { &mut *(*r).comm };
    // SAFETY: as above; each read is a short-lived access through the raw pointer.
    while unsafe { (*r).state } == State::Active && c.advance()? {}
    // SAFETY: as above.
    let q = unsafe { &mut *r };
    if q.state != State::Done {
        unacknowledged(&c.s)?;
        return Ok(None);
    }
    q.state = State::Free;
    Ok(Some(u64::from_le_bytes(q.len) as usize))
}

/// Why a comm failed; `closed`: the peer closed it between messages (the caller decides
/// whether that is a failure).
pub struct Failure {
    pub closed: bool,
    pub msg: String,
}

/// One connection, one direction of messages; requests complete in order. The requests live in
/// an allocation of their own, reached through a raw pointer only: the caller holds pointers to
/// them between calls, which no `&mut` to the comm may cover.
pub struct Comm {
    s: TcpStream,
    reqs: *mut Request,
    /// The oldest active request, and the next to hand out.
    head: usize,
    tail: usize,
}

impl Comm {
    fn new(s: TcpStream) -> std::io::Result<Comm> {
        s.set_nodelay(true)?;
        s.set_nonblocking(true)?;
        liveness(&s)?;
        let reqs: Box<[Request; NREQ]> = Box::new([Request::FREE; NREQ]);
        Ok(Comm {
            s,
            reqs: Box::into_raw(reqs) as *mut Request,
            head: 0,
            tail: 0,
        })
    }

    /// Connects to the listener whose handle is `h` and presents its token, without blocking:
    /// None until the connection is made and the token sent (call again with the same handle,
    /// which keeps the state meanwhile).
    pub fn connect(h: &mut [u8; HANDLE_BYTES]) -> Result<Option<Comm>, String> {
        if &h[..4] != MAGIC {
            return Err("a handle that is not this plugin's".into());
        }
        let stage = usize::from_le_bytes(h[STAGE_AT..].try_into().expect("8 bytes"));
        if stage == 0 {
            let text = &h[4 + TOKEN..STAGE_AT];
            let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
            let addr: SocketAddr = std::str::from_utf8(&text[..end])
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or("a handle without an address")?;
            let s = start_connect(addr).map_err(|e| format!("{addr}: {e}"))?;
            let c = Box::new(Connecting {
                s,
                addr,
                sent: 0,
                since: Instant::now(),
            });
            h[STAGE_AT..].copy_from_slice(&(Box::into_raw(c) as usize).to_le_bytes());
            return Ok(None);
        }
        // SAFETY: a Connecting this function boxed and stored in the handle, not yet freed
        // (freed, and the bytes zeroed, below once it ends).
        let c = unsafe { &mut *(stage as *mut Connecting) };
        let r = c.progress(&h[4..4 + TOKEN]);
        if !matches!(r, Ok(None)) {
            h[STAGE_AT..].fill(0);
            // SAFETY: as above; no reference to it outlives this.
            let c = unsafe { Box::from_raw(stage as *mut Connecting) };
            return match r {
                Ok(Some(())) => Comm::new(c.s).map(Some).map_err(|e| e.to_string()),
                Err(e) => Err(format!("{}: {e}", c.addr)),
                Ok(None) => unreachable!(),
            };
        }
        Ok(None)
    }

    /// Request `i` (below NREQ): a pointer into the requests' own allocation.
    fn req(&self, i: usize) -> *mut Request {
        assert!(i < NREQ);
        // SAFETY: within the allocation of NREQ requests made by `new`.
        unsafe { self.reqs.add(i) }
    }

    /// A request for `size` bytes at `buf`, or None while every request is in use.
    pub fn post(&mut self, recv: bool, buf: *mut u8, size: usize) -> Option<*mut Request> {
        let me = self as *mut Comm;
        let p = self.req(self.tail);
        // SAFETY: a request of this comm; no reference to it is alive (see `Comm`).
        let r = unsafe { &mut *p };
        if r.state != State::Free {
            return None;
        }
        *r = Request {
            comm: me,
            recv,
            state: State::Active,
            buf,
            size,
            len: (size as u64).to_le_bytes(),
            ..Request::FREE
        };
        self.tail = (self.tail + 1) % NREQ;
        Some(p)
    }

    /// Moves the oldest active request on: true when it completed.
    fn advance(&mut self) -> Result<bool, Failure> {
        // SAFETY: a request of this comm; no other reference to it is alive.
        let r = unsafe { &mut *self.req(self.head) };
        if r.state != State::Active {
            return Ok(false);
        }
        let fail = |msg: String| Failure { closed: false, msg };
        while r.len_off < 8 {
            let n = if r.recv {
                io(self.s.read(&mut r.len[r.len_off..]))
            } else {
                io(send(&self.s, &r.len[r.len_off..]))
            };
            match n.map_err(|e| fail(e.to_string()))? {
                Some(0) if r.recv && r.len_off == 0 => {
                    return Err(Failure {
                        closed: true,
                        msg: "the peer closed the connection".into(),
                    })
                }
                Some(0) => return Err(fail("the peer closed the connection mid-message".into())),
                Some(k) => r.len_off += k,
                None => return Ok(false),
            }
        }
        let len = u64::from_le_bytes(r.len) as usize;
        if len > r.size {
            return Err(fail(format!(
                "a message of {len} bytes for a buffer of {}",
                r.size
            )));
        }
        while r.off < len {
            // SAFETY: `buf` holds `size >= len` bytes until the request completes (`post`).
            let rest = unsafe { std::slice::from_raw_parts_mut(r.buf.add(r.off), len - r.off) };
            let n = if r.recv {
                io(self.s.read(rest))
            } else {
                io(send(&self.s, rest))
            };
            match n.map_err(|e| fail(e.to_string()))? {
                Some(0) => return Err(fail("the peer closed the connection mid-message".into())),
                Some(k) => r.off += k,
                None => return Ok(false),
            }
        }
        r.state = State::Done;
        self.head = (self.head + 1) % NREQ;
        Ok(true)
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: made by `new` with Box::into_raw of NREQ requests; the caller is done with
        // them (closeSend/closeRecv).
        drop(unsafe { Box::from_raw(self.reqs as *mut [Request; NREQ]) });
    }
}

impl Connecting {
    /// Some once connected with the whole token sent; None while still under way.
    fn progress(&mut self, token: &[u8]) -> std::io::Result<Option<()>> {
        use nix::poll::{poll, PollFd, PollFlags};
        use std::os::fd::AsFd;
        if self.since.elapsed() > SETUP_LIMIT {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                "connecting timed out",
            ));
        }
        let mut fds = [PollFd::new(self.s.as_fd(), PollFlags::POLLOUT)];
        if poll(&mut fds, nix::poll::PollTimeout::ZERO)? == 0 {
            return Ok(None);
        }
        if let Some(e) = self.s.take_error()? {
            return Err(e);
        }
        while self.sent < token.len() {
            match send(&self.s, &token[self.sent..]) {
                Ok(k) => self.sent += k,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Ok(Some(()))
    }
}

/// How long a peer may stay silent before its comm fails: `OXCCL_HEARTBEAT_S`, as oxccl's own
/// transport reads it (default 5 s; 0: never, the caller's timeout decides).
fn silence_limit() -> Option<u32> {
    let s: u32 = std::env::var("OXCCL_HEARTBEAT_S")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(5);
    (s > 0).then_some(s)
}

/// The kernel's liveness checks on a comm's socket, so that a link that goes down is an error
/// within the silence limit rather than a wait for ever (oxccl's own transport sends
/// heartbeats; a plugin's messages are the caller's, so TCP does it here): keepalive probes
/// once a second after a second of quiet, the connection dropped when as many go unanswered as
/// the limit allows. (Bytes sent and waiting for an acknowledgement are `unacknowledged`'s.
/// Not TCP_USER_TIMEOUT: since Linux 5.11 it also drops a live peer whose window stays closed
/// that long, a rank late for its receive.)
fn liveness(s: &TcpStream) -> std::io::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    let Some(limit) = silence_limit() else {
        return Ok(());
    };
    let probes = limit.saturating_sub(1).max(1);
    setsockopt(s, sockopt::KeepAlive, &true)?;
    setsockopt(s, sockopt::TcpKeepIdle, &1)?;
    setsockopt(s, sockopt::TcpKeepInterval, &1)?;
    setsockopt(s, sockopt::TcpKeepCount, &probes)?;
    Ok(())
}

/// A failure where `s` has heard nothing from its peer for longer than the silence limit while
/// it waits on it (oxccl's own check, `tcp_info::unacknowledged_for`: segments sent and not
/// acknowledged, or two window probes in a row unanswered, and no acknowledgement since). A
/// live peer that does not read acknowledges what arrived and answers every probe of its
/// closed window, so it is waited for.
fn unacknowledged(s: &TcpStream) -> Result<(), Failure> {
    let Some(limit) = silence_limit() else {
        return Ok(());
    };
    match crate::tcp_info::unacknowledged_for(s) {
        Some(t) if t.as_millis() > u128::from(limit) * 1000 => Err(Failure {
            closed: false,
            msg: format!(
                "nothing sent was acknowledged for {:.1} s (OXCCL_HEARTBEAT_S): the peer's host \
                 or the link to it is down",
                t.as_secs_f64()
            ),
        }),
        _ => Ok(()),
    }
}

/// A non-blocking socket connecting to `addr` (the connection completes in the background).
fn start_connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, SockaddrStorage};
    use std::os::fd::AsRawFd;
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    match connect(fd.as_raw_fd(), &SockaddrStorage::from(addr)) {
        Ok(()) | Err(nix::errno::Errno::EINPROGRESS) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(TcpStream::from(fd))
}

/// A write that is an error, not SIGPIPE, when the peer has gone.
fn send(s: &TcpStream, b: &[u8]) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    nix::sys::socket::send(s.as_raw_fd(), b, nix::sys::socket::MsgFlags::MSG_NOSIGNAL)
        .map_err(std::io::Error::from)
}

/// Bytes moved (0: the peer closed), None when the socket would block.
fn io(r: std::io::Result<usize>) -> std::io::Result<Option<usize>> {
    match r {
        Ok(n) => Ok(Some(n)),
        Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}
