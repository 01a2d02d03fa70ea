//! The root service: one thread per process serves the listeners of every pending unique id and
//! every connection they accepted, through one `poll`, never blocking on any of them.
//!
//! - The thread starts with the first pending id and exits once no id is pending (each id leaves
//!   when its rendezvous is complete or failed, or at its deadline), so an unused id costs a
//!   listening socket until its deadline, and no thread of its own.
//! - A connection is read only as far as `Root::next` allows: a stranger that sends garbage or a
//!   wrong secret is dropped as soon as that shows; one that does not prove the secret within
//!   [`HELLO_WAIT`] is dropped then; and at most [`MAX_UNPROVEN`] connections (over all ids) may
//!   wait to prove it: beyond that the oldest is dropped. A rank's connection proves the secret
//!   with its first segment, so strangers, hundreds at once, delay it by the time of one `poll`
//!   round, and memory and descriptors stay bounded.
//! - A rendezvous that is done leaves the service; the blocking rest (writing the answers, or a
//!   group root's exchange with the root of id 0) runs on a short-lived thread of its own.

use super::root::{Next, Refusal, Root};
use super::wire;
use crate::debug::warn;
use crate::error::{Error, Result};
use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags};
use once_cell::sync::Lazy;
use parking_lot::Mutex;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// How long a connection may take to prove the unique id's secret (a rank sends it with its
/// first write, right after connecting).
pub(crate) const HELLO_WAIT: Duration = Duration::from_secs(2);
/// Most connections, over all ids, that may wait to prove the secret at once.
pub(crate) const MAX_UNPROVEN: usize = 128;
/// Most connections accepted from one listener per round (the others get their turn).
const ACCEPT_BATCH: usize = 64;
/// Longest sleep of the thread while nothing happens (it wakes at the next deadline anyway).
const IDLE_POLL: Duration = Duration::from_secs(1);

struct State {
    /// Ids handed over since the thread last looked.
    incoming: Vec<(TcpListener, Root)>,
    /// The thread runs (in process `pid`: a child forked from this process has none).
    running: bool,
    pid: u32,
    /// Written to wake the thread (its other end is in the thread's poll set).
    waker: Option<UnixStream>,
}

static STATE: Lazy<Mutex<State>> = Lazy::new(|| {
    Mutex::new(State {
        incoming: Vec::new(),
        running: false,
        pid: 0,
        waker: None,
    })
});

/// Hands a root (its listener bound, its deadline set) to the service, starting its thread if
/// none runs.
pub(crate) fn serve(listener: TcpListener, root: Root) -> Result<()> {
    let mut st = STATE.lock();
    let pid = std::process::id();
    if st.pid != pid {
        // Forked: the thread, and the ids it was to serve, belong to the parent (dropping them
        // closes only this process's copies of their descriptors).
        st.waker = None;
        st.incoming.clear();
        st.running = false;
        st.pid = pid;
    }
    if !st.running {
        let (waker, woken) = UnixStream::pair()
            .map_err(|e| Error::os("creating the bootstrap root service's waker", e))?;
        waker
            .set_nonblocking(true)
            .and_then(|()| woken.set_nonblocking(true))
            .map_err(|e| Error::os("setting up the bootstrap root service's waker", e))?;
        std::thread::Builder::new()
            .name("oxccl-bootroot".into())
            .spawn(move || {
                let run = std::panic::AssertUnwindSafe(|| Service::default().run(woken));
                if std::panic::catch_unwind(run).is_err() {
                    // Its ids are lost (their listeners closed: ranks get refused and say so);
                    // the next id starts a new thread.
                    warn(
                        "bootstrap root service: internal error (panic); its pending unique \
                         ids are closed",
                    );
                    let mut st = STATE.lock();
                    st.running = false;
                    st.waker = None;
                    st.incoming.clear();
                }
            })
            .map_err(|e| Error::os("spawning the bootstrap root service thread", e))?;
        st.running = true;
        st.waker = Some(waker);
    }
    st.incoming.push((listener, root));
    if let Some(w) = &mut st.waker {
        // A full pipe is already readable: the thread will look.
        let _ = w.write(&[1]);
    }
    Ok(())
}

/// A pending id.
struct Served {
    key: u64,
    listener: TcpListener,
    root: Root,
    /// Accepting failed (out of descriptors?): the listener rests until then.
    rest_until: Option<Instant>,
}

/// A connection that has not completed its hello yet.
struct Conn {
    stream: TcpStream,
    from: SocketAddr,
    /// Key of the root it came to.
    root: u64,
    accepted: Instant,
    /// What it sent so far (`have` bytes of it).
    buf: Vec<u8>,
    have: usize,
    /// It presented the right secret.
    proven: bool,
}

enum Fate {
    Keep,
    Drop(Refusal),
    Hello,
}

#[derive(Default)]
struct Service {
    served: Vec<Served>,
    conns: Vec<Conn>,
    next_key: u64,
}

impl Service {
    fn run(mut self, woken: UnixStream) {
        loop {
            {
                let mut st = STATE.lock();
                for (listener, root) in st.incoming.drain(..) {
                    self.served.push(Served {
                        key: self.next_key,
                        listener,
                        root,
                        rest_until: None,
                    });
                    self.next_key += 1;
                }
                if self.served.is_empty() {
                    // Conns belong to served roots: none are left either.
                    st.running = false;
                    st.waker = None;
                    return;
                }
            }
            self.round(&woken);
        }
    }

    /// One poll over the waker, the listeners and the connections, then whatever it found.
    fn round(&mut self, woken: &UnixStream) {
        let now = Instant::now();
        let next = self
            .served
            .iter()
            .map(|s| s.rest_until.unwrap_or(s.root.wait.deadline))
            .chain(
                self.conns
                    .iter()
                    .filter(|c| !c.proven)
                    .map(|c| c.accepted + HELLO_WAIT),
            )
            .min()
            .unwrap_or(now + IDLE_POLL);
        let wait = next.saturating_duration_since(now).min(IDLE_POLL);
        // Rounded up: waking just before a deadline would only poll again.
        let ms = (wait.as_micros().div_ceil(1000) as u16).max(1);
        // The clients each root admitted, which wait for its answer: one that closes its
        // connection meanwhile has left the rendezvous (`Root::client_stirred`).
        let clients: Vec<(usize, usize)> = self
            .served
            .iter()
            .enumerate()
            .flat_map(|(i, s)| (0..s.root.clients().count()).map(move |j| (i, j)))
            .collect();
        let (listeners_ready, conns_ready, clients_ready) = {
            let mut fds = Vec::with_capacity(1 + self.served.len() + self.conns.len());
            fds.push(PollFd::new(woken.as_fd(), PollFlags::POLLIN));
            for s in &self.served {
                let ev = if s.rest_until.is_some() {
                    PollFlags::empty()
                } else {
                    PollFlags::POLLIN
                };
                fds.push(PollFd::new(s.listener.as_fd(), ev));
            }
            for c in &self.conns {
                fds.push(PollFd::new(c.stream.as_fd(), PollFlags::POLLIN));
            }
            for s in &self.served {
                for c in s.root.clients() {
                    fds.push(PollFd::new(c.as_fd(), PollFlags::POLLIN));
                }
            }
            match poll(&mut fds, ms) {
                Ok(_) => {}
                Err(Errno::EINTR) => return,
                Err(e) => {
                    warn(&format!("bootstrap root service: poll failed: {e}"));
                    std::thread::sleep(wire::SLICE);
                    return;
                }
            }
            let ready = |f: &PollFd| f.revents().is_some_and(|r| !r.is_empty());
            let (nl, nc) = (self.served.len(), self.conns.len());
            let l: Vec<bool> = fds[1..1 + nl].iter().map(ready).collect();
            let c: Vec<bool> = fds[1 + nl..1 + nl + nc].iter().map(ready).collect();
            let k: Vec<bool> = fds[1 + nl + nc..].iter().map(ready).collect();
            (l, c, k)
        };
        let mut sink = [0u8; 64];
        while matches!((&*woken).read(&mut sink), Ok(n) if n > 0) {}

        // Admitted clients first (the roots' lists only grow until `expire` below).
        for (&(i, j), _) in clients.iter().zip(&clients_ready).filter(|(_, &r)| r) {
            self.served[i].root.client_stirred(j);
        }
        // Connections (in reverse: `swap_remove` moves only those already looked at).
        for i in (0..conns_ready.len()).rev() {
            if conns_ready[i] {
                let fate = self.read(i);
                self.settle(i, fate);
            }
        }
        for (i, &ready) in listeners_ready.iter().enumerate() {
            if ready {
                self.accept(i);
            }
        }
        self.evict();
        self.expire();
    }

    fn root_of(&mut self, key: u64) -> Option<&mut Root> {
        self.served
            .iter_mut()
            .find(|s| s.key == key)
            .map(|s| &mut s.root)
    }

    /// Reads what connection `i` has, no further than its root allows.
    fn read(&mut self, i: usize) -> Fate {
        let key = self.conns[i].root;
        let Some(pos) = self.served.iter().position(|s| s.key == key) else {
            return Fate::Drop(Refusal::Closed);
        };
        let root = &self.served[pos].root;
        let c = &mut self.conns[i];
        loop {
            let need = match root.next(&c.buf[..c.have]) {
                Next::Need(n) => n,
                Next::Refuse(r) => return Fate::Drop(r),
                Next::Hello => return Fate::Hello,
            };
            // Past the handshake, the secret is proven.
            c.proven = c.have >= super::root::HS_BYTES;
            if c.buf.len() < need {
                c.buf.resize(need, 0);
            }
            match c.stream.read(&mut c.buf[c.have..need]) {
                Ok(0) => return Fate::Drop(Refusal::Closed),
                Ok(n) => c.have += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Fate::Keep,
                Err(_) => return Fate::Drop(Refusal::Closed),
            }
        }
    }

    /// Acts on what `read` found for connection `i`.
    fn settle(&mut self, i: usize, fate: Fate) {
        match fate {
            Fate::Keep => {}
            Fate::Drop(why) => {
                let c = self.conns.swap_remove(i);
                if let Some(root) = self.root_of(c.root) {
                    root.dropped(why, c.from);
                }
            }
            Fate::Hello => {
                let c = self.conns.swap_remove(i);
                let from = c.from;
                let Some(root) = self.root_of(c.root) else {
                    return;
                };
                let mut buf = c.buf;
                buf.truncate(c.have);
                match c.stream.set_nonblocking(false) {
                    Ok(()) => root.admit(c.stream, &buf),
                    Err(_) => root.dropped(Refusal::Closed, from),
                }
            }
        }
    }

    /// Accepts what listener `i` has (a batch), reading each new connection at once: a rank's
    /// hello is often there already.
    fn accept(&mut self, i: usize) {
        for _ in 0..ACCEPT_BATCH {
            let s = &mut self.served[i];
            match s.listener.accept() {
                Ok((stream, from)) => {
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    wire::keepalive(&stream, true);
                    self.conns.push(Conn {
                        stream,
                        from,
                        root: s.key,
                        accepted: Instant::now(),
                        buf: Vec::new(),
                        have: 0,
                        proven: false,
                    });
                    let j = self.conns.len() - 1;
                    let fate = self.read(j);
                    self.settle(j, fate);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::ConnectionAborted => {}
                Err(e) => {
                    // Out of descriptors, most likely: let the listener rest for a slice (its
                    // backlog keeps the connections) instead of spinning on it.
                    warn(&format!("{}: accept failed: {e}", s.root.me));
                    s.rest_until = Some(Instant::now() + wire::SLICE);
                    return;
                }
            }
        }
    }

    /// Beyond `MAX_UNPROVEN` connections that have not proven the secret, the oldest go.
    fn evict(&mut self) {
        let unproven = self.conns.iter().filter(|c| !c.proven).count();
        if unproven <= MAX_UNPROVEN {
            return;
        }
        let mut ages: Vec<(Instant, usize)> = self
            .conns
            .iter()
            .enumerate()
            .filter(|(_, c)| !c.proven)
            .map(|(i, c)| (c.accepted, i))
            .collect();
        ages.sort();
        let mut gone: Vec<usize> = ages[..unproven - MAX_UNPROVEN]
            .iter()
            .map(|&(_, i)| i)
            .collect();
        gone.sort_unstable();
        for i in gone.into_iter().rev() {
            self.settle(i, Fate::Drop(Refusal::Evicted));
        }
    }

    /// Drops connections past their hello deadline, ends the roots that are done (or past their
    /// own deadline), and starts what is left to do for them.
    fn expire(&mut self) {
        let now = Instant::now();
        for i in (0..self.conns.len()).rev() {
            let c = &self.conns[i];
            if !c.proven && now >= c.accepted + HELLO_WAIT {
                self.settle(i, Fate::Drop(Refusal::Silent));
            }
        }
        for s in &mut self.served {
            if s.rest_until.is_some_and(|t| now >= t) {
                s.rest_until = None;
            }
            s.root.expire(now);
        }
        let mut i = 0;
        while i < self.served.len() {
            if !self.served[i].root.done() {
                i += 1;
                continue;
            }
            let s = self.served.swap_remove(i);
            // Its unfinished connections go with it (their clients see the close).
            let before = self.conns.len();
            self.conns.retain(|c| c.root != s.key);
            let unfinished = before - self.conns.len();
            drop(s.listener);
            if let Some(work) = s.root.finish(unfinished) {
                run_detached(work);
            }
        }
    }
}

/// Runs `work` on a thread of its own (on this one if none can be started).
fn run_detached(work: Box<dyn FnOnce() + Send>) {
    let slot = std::sync::Arc::new(Mutex::new(Some(work)));
    let mine = slot.clone();
    let spawned = std::thread::Builder::new()
        .name("oxccl-bootans".into())
        .spawn(move || {
            if let Some(w) = mine.lock().take() {
                w()
            }
        });
    if spawned.is_err() {
        if let Some(w) = slot.lock().take() {
            w()
        }
    }
}
