//! The plugin's sockets: listeners with their token, comms and their in-order requests.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// NCCL_NET_HANDLE_MAXSIZE.
pub const HANDLE_BYTES: usize = 128;
const MAGIC: &[u8; 4] = b"OXSK";
const TOKEN: usize = 16;
/// Requests a comm holds at once (a post beyond them gets a NULL request: later).
const NREQ: usize = 32;

/// A listening socket and the token its connections must present.
pub struct Listener {
    l: TcpListener,
    token: [u8; TOKEN],
}

impl Listener {
    pub fn new(l: TcpListener) -> std::io::Result<Listener> {
        l.set_nonblocking(true)?;
        let mut token = [0u8; TOKEN];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut token)?;
        Ok(Listener { l, token })
    }

    /// Writes the handle a peer connects with: magic, token, address (text, NUL-terminated).
    pub fn handle(&self, h: &mut [u8; HANDLE_BYTES]) {
        h.fill(0);
        h[..4].copy_from_slice(MAGIC);
        h[4..4 + TOKEN].copy_from_slice(&self.token);
        if let Ok(a) = self.l.local_addr() {
            let a = a.to_string();
            let n = a.len().min(HANDLE_BYTES - 4 - TOKEN - 1);
            h[4 + TOKEN..4 + TOKEN + n].copy_from_slice(&a.as_bytes()[..n]);
        }
    }

    /// A connection that presented the token, if one is waiting (connections that do not are
    /// dropped).
    pub fn accept(&self) -> std::io::Result<Option<Comm>> {
        let (mut s, from) = match self.l.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut got = [0u8; TOKEN];
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        if s.read_exact(&mut got).is_err() || got != self.token {
            crate::log(
                2,
                &format!("oxsocket: dropped a connection from {from} without the token"),
            );
            return Ok(None);
        }
        Comm::new(s).map(Some)
    }
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
        let reqs: Box<[Request; NREQ]> = Box::new([Request::FREE; NREQ]);
        Ok(Comm {
            s,
            reqs: Box::into_raw(reqs) as *mut Request,
            head: 0,
            tail: 0,
        })
    }

    /// Connects to the listener whose handle is `h` and presents its token.
    pub fn connect(h: &[u8; HANDLE_BYTES]) -> Result<Comm, String> {
        if &h[..4] != MAGIC {
            return Err("a handle that is not this plugin's".into());
        }
        let text = &h[4 + TOKEN..];
        let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
        let addr: SocketAddr = std::str::from_utf8(&text[..end])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or("a handle without an address")?;
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(30))
            .map_err(|e| format!("{addr}: {e}"))?;
        s.write_all(&h[4..4 + TOKEN])
            .map_err(|e| format!("{addr}: {e}"))?;
        Comm::new(s).map_err(|e| format!("{addr}: {e}"))
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
