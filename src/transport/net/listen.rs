//! A receiving end's listener, until its peer's sending end has opened every socket and
//! presented the connection's token on each. A connection that does not (a port scan, a health
//! check, a stale or foreign client; garbage, nothing, or a close) is dropped with a WARN and
//! the end listens on: such a connection can neither fail the communicator nor hold the thread
//! that accepted it, since every socket here is read without blocking.

use super::TOKEN;
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// How long an accepted connection may take to present the token.
const HELLO_WAIT: Duration = Duration::from_secs(5);

pub(super) struct Listening {
    listener: TcpListener,
    token: [u8; TOKEN],
    /// The sockets presented so far, by index.
    got: Vec<Option<TcpStream>>,
    /// Accepted connections whose first bytes have not all come yet.
    hellos: Vec<Hello>,
    /// Since when the end listens.
    pub since: Instant,
    /// The end's failure, once it failed (each later round says it again).
    failed: Option<String>,
}

struct Hello {
    s: TcpStream,
    from: SocketAddr,
    at: Instant,
    buf: [u8; TOKEN + 1],
    have: usize,
}

/// What a round heard.
pub(super) enum Heard {
    Nothing,
    /// Something came, not every socket yet.
    Some,
    /// Every socket, by index (non-blocking).
    All(Vec<TcpStream>),
}

impl Listening {
    pub fn new(listener: TcpListener, token: [u8; TOKEN], k: usize) -> std::io::Result<Listening> {
        listener.set_nonblocking(true)?;
        Ok(Listening {
            listener,
            token,
            got: (0..k).map(|_| None).collect(),
            hellos: Vec::new(),
            since: Instant::now(),
            failed: None,
        })
    }

    /// What to poll: the listener and the connections that have not presented the token yet.
    pub fn fds(&self) -> impl Iterator<Item = RawFd> + '_ {
        std::iter::once(self.listener.as_raw_fd())
            .chain(self.hellos.iter().map(|h| h.s.as_raw_fd()))
    }

    /// Accepts what is waiting and reads what the accepted connections sent. Err: why the end
    /// failed (the listener broke, or the peer opened one socket twice), every round after.
    /// `warn` says what was dropped.
    pub fn step(&mut self, warn: &dyn Fn(&str)) -> Result<Heard, String> {
        if let Some(why) = &self.failed {
            return Err(why.clone());
        }
        let r = self.accept_and_read(warn);
        if let Err(why) = &r {
            self.failed = Some(why.clone());
        }
        r
    }

    fn accept_and_read(&mut self, warn: &dyn Fn(&str)) -> Result<Heard, String> {
        let mut heard = false;
        loop {
            match self.listener.accept() {
                Ok((s, from)) => {
                    heard = true;
                    if s.set_nonblocking(true).is_ok() {
                        self.hellos.push(Hello {
                            s,
                            from,
                            at: Instant::now(),
                            buf: [0; TOKEN + 1],
                            have: 0,
                        });
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                // A connection reset before it was accepted; a signal.
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::ConnectionAborted | ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(format!("accepting its sockets: {e}")),
            }
        }
        let mut i = 0;
        while i < self.hellos.len() {
            let h = &mut self.hellos[i];
            let dropped = match h.s.read(&mut h.buf[h.have..]) {
                Ok(0) => Some("closed it before presenting the connection's token".to_string()),
                Ok(n) => {
                    heard = true;
                    h.have += n;
                    if h.have < h.buf.len() {
                        None
                    } else if self.presented(i)? {
                        // Taken: hello `i` is now another one.
                        continue;
                    } else {
                        Some("did not present the connection's token".to_string())
                    }
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                    (h.at.elapsed() > HELLO_WAIT)
                        .then(|| format!("presented no token within {} s", HELLO_WAIT.as_secs()))
                }
                Err(e) => Some(format!("failed before presenting the token: {e}")),
            };
            match dropped {
                Some(why) => {
                    let h = self.hellos.swap_remove(i);
                    warn(&format!("dropped a connection from {}: it {why}", h.from));
                }
                None => i += 1,
            }
        }
        if self.got.iter().all(Option::is_some) {
            return Ok(Heard::All(
                self.got
                    .iter_mut()
                    .map(|s| s.take().expect("all there"))
                    .collect(),
            ));
        }
        Ok(if heard { Heard::Some } else { Heard::Nothing })
    }

    /// Hello `i` is complete: Ok(true) when it presented the token (its socket is taken, by
    /// its index), Ok(false) when not (it stays, to be dropped), Err when the peer opened one
    /// index twice.
    fn presented(&mut self, i: usize) -> Result<bool, String> {
        let h = &self.hellos[i];
        let j = usize::from(h.buf[TOKEN]);
        if h.buf[..TOKEN] != self.token || j >= self.got.len() {
            return Ok(false);
        }
        if self.got[j].is_some() {
            return Err(format!("socket {j} was opened twice"));
        }
        self.got[j] = Some(self.hellos.swap_remove(i).s);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn listening(k: usize) -> (Listening, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        (Listening::new(l, [7; TOKEN], k).unwrap(), a)
    }

    /// Rounds until every socket is in, or 3 s.
    fn until_all(l: &mut Listening, warns: &std::cell::RefCell<Vec<String>>) -> Vec<TcpStream> {
        let t0 = Instant::now();
        loop {
            let r = l.step(&|w| warns.borrow_mut().push(w.to_string())).unwrap();
            if let Heard::All(s) = r {
                return s;
            }
            assert!(t0.elapsed() < Duration::from_secs(3), "never connected");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn strangers_are_dropped_and_the_peer_still_connects() {
        let (mut l, a) = listening(2);
        let warns = std::cell::RefCell::new(Vec::new());
        // Garbage, a close before anything, one byte and silence, the wrong token, and a
        // socket index out of range.
        let mut garbage = TcpStream::connect(a).unwrap();
        garbage.write_all(&[0xff; 40]).unwrap();
        drop(TcpStream::connect(a).unwrap());
        let mut slow = TcpStream::connect(a).unwrap();
        slow.write_all(&[7]).unwrap();
        let mut wrong = TcpStream::connect(a).unwrap();
        wrong.write_all(&[8; TOKEN + 1]).unwrap();
        let mut far = TcpStream::connect(a).unwrap();
        far.write_all(&[7; TOKEN]).unwrap();
        far.write_all(&[2]).unwrap();
        // The peer's two sockets, in reverse order, each in two pieces.
        let mut socks = Vec::new();
        for j in [1u8, 0] {
            let mut s = TcpStream::connect(a).unwrap();
            s.write_all(&[7; 3]).unwrap();
            s.write_all(&[7; TOKEN - 3]).unwrap();
            s.write_all(&[j]).unwrap();
            s.write_all(b"slot").unwrap();
            socks.push(s);
        }
        let got = until_all(&mut l, &warns);
        assert_eq!(got.len(), 2);
        // Each index has its own socket: what follows the token is there to read.
        for mut s in got {
            s.set_nonblocking(false).unwrap();
            let mut b = [0u8; 4];
            s.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"slot");
        }
        let w = warns.borrow();
        assert_eq!(w.len(), 4, "{w:?}");
        assert!(w.iter().any(|w| w.contains("closed it before")), "{w:?}");
        assert_eq!(
            w.iter().filter(|w| w.contains("did not present")).count(),
            3,
            "{w:?}"
        );
        drop(slow);
    }

    #[test]
    fn a_socket_opened_twice_fails_the_end_every_round() {
        let (mut l, a) = listening(2);
        let mut socks = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(a).unwrap();
            s.write_all(&[7; TOKEN]).unwrap();
            s.write_all(&[0]).unwrap();
            socks.push(s);
        }
        let t0 = Instant::now();
        let e = loop {
            match l.step(&|_| {}) {
                Err(e) => break e,
                Ok(_) => assert!(t0.elapsed() < Duration::from_secs(3)),
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(e.contains("socket 0 was opened twice"), "{e}");
        assert_eq!(l.step(&|_| {}).err(), Some(e));
    }
}
