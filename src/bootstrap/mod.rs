//! Unique ids and the TCP rendezvous between the ranks of a communicator.
//!
//! - [`UniqueId::generate`] binds a listener (on the interface NCCL would pick: the first not
//!   loopback or a container's, else loopback; the one `NCCL_SOCKET_IFNAME` names; or
//!   `OXCCL_BOOTSTRAP_ADDR`) and hands it to the process's root
//!   service (see `service.rs`, `root.rs`): one thread serves every pending id's listener and
//!   connections, so an unused id costs a socket until it expires, and no thread. The id holds
//!   the root's address and a 16-byte random secret.
//! - [`Bootstrap::init`] registers the rank with its root, gets every rank's listen address back,
//!   and from then on ranks talk directly (see `peer.rs`). Every connection, to a root or to a
//!   rank, starts with the secret; a connection with a wrong secret is dropped with a warning.
//!   A root serves all its connections at once: strangers (silent, slow, garbage, wrong secret)
//!   are dropped without delaying the ranks.
//! - Every wait polls in short slices and watches the communicator's health (`crate::health`:
//!   abort flag, remote abort) (-> `InvalidUsage`, "aborted") and its bound (-> `Timeout`,
//!   naming what was awaited; past `OXCCL_WATCHDOG_S` a WARN names it meanwhile). The
//!   rendezvous and every send are bounded by `param::bound` (`OXCCL_TIMEOUT_S`, 300 s where
//!   unset): a rank that died before it ever registered cannot be told from a late one.
//! - A wait for a peer's message after the rendezvous is bounded only by `OXCCL_TIMEOUT_S`,
//!   as NCCL's waits are not at all (a pipeline stage may reach its first send many minutes
//!   after its peer), and ends when the peer is seen gone: its connection to this rank closes
//!   or fails, or, where it has none, this rank's own connection to it does (made for the
//!   purpose after a second: `Bootstrap::watch_link`); the kernel's keepalive watches both
//!   (`wire::keepalive`), so a host that stops answering ends the wait after
//!   `OXCCL_HEARTBEAT_S`.
//!   Connecting to a root or a peer that refuses or does not answer is retried for at most
//!   `OXCCL_BOOTSTRAP_CONNECT_S` (default 30 s, never past the timeout): the `Timeout` then
//!   names the address, the attempts, how long they took and the last error.
//!
//! Tags: user tags are `0..=0x7fff_ffff`; tags with the top bit set ([`TAG_RESERVED`]) belong to
//! the bootstrap's own collectives (`allgather`, `barrier`) and are refused by `send`/`recv`.
//! Messages are matched by (peer, tag) in the order they were sent; messages for other tags wait
//! in queues until asked for.
//!
//! Collectives (`allgather`, `barrier`) must be called by every rank in the same order; calls on
//! one `Bootstrap` from several threads are serialized.

mod id;
mod ifaces;
mod peer;
mod root;
mod service;
mod wire;

pub use id::{ID_BYTES, SECRET_BYTES};
pub(crate) use wire::connect_once;

use crate::error::{Code, Error, Result};
use crate::health::{Health, IntoHealth};
use parking_lot::Mutex;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use wire::Wait;

/// Tags with this bit are reserved for the bootstrap's internal collectives.
pub const TAG_RESERVED: u32 = 0x8000_0000;
const TAG_ALLGATHER: u32 = TAG_RESERVED | 1;
/// Barrier round k uses `TAG_BARRIER + k`.
const TAG_BARRIER: u32 = TAG_RESERVED | 0x100;
/// Connection setup blobs use `TAG_SETUP + sub` (`sub < 0x1000`, see `transport::conns`).
const TAG_SETUP: u32 = TAG_RESERVED | 0x2000;
/// A rank's communicator broke: the message says why (see `Bootstrap::announce_failure`).
const TAG_FAILED: u32 = TAG_RESERVED | 0x3000;
/// How many times a rank connects to its root again when the root closed the connection
/// without answering (see `Bootstrap::init_with_timeout`).
const REGISTER_RETRIES: u32 = 3;

#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId {
    bytes: [u8; ID_BYTES],
}

/// Shows the root's address, never the secret.
impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId(root {})", self.root_addr())
    }
}

impl UniqueId {
    /// Starts the root's listener for this id (served by the process's root service thread) and
    /// returns the self-contained id. The listener closes once every rank of the id has been
    /// answered, or after the timeout.
    pub fn generate() -> Result<UniqueId> {
        Self::generate_with_timeout(crate::param::bound())
    }

    /// As `generate`, with the root's timeout given (tests; the C API uses `param::bound`).
    pub fn generate_with_timeout(timeout: Duration) -> Result<UniqueId> {
        let secret = id::random_secret()?;
        let addr = root::start(secret, timeout)?;
        crate::debug::info(&format!("bootstrap: unique id root listening on {addr}"));
        Ok(UniqueId {
            bytes: id::encode(&addr, &secret),
        })
    }

    /// Checks the layout (magic, version, address); `InvalidArgument` for anything else.
    pub fn from_bytes(b: &[u8; ID_BYTES]) -> Result<UniqueId> {
        id::decode(b)?;
        Ok(UniqueId { bytes: *b })
    }

    pub fn to_bytes(&self) -> [u8; ID_BYTES] {
        self.bytes
    }

    /// The root's listen address.
    pub fn root_addr(&self) -> SocketAddr {
        id::decode(&self.bytes)
            .expect("validated at construction")
            .0
    }

    /// The secret every connection of this rendezvous presents.
    pub fn secret(&self) -> [u8; SECRET_BYTES] {
        id::decode(&self.bytes)
            .expect("validated at construction")
            .1
    }
}

/// Out-of-band channel between the ranks of one communicator.
pub struct Bootstrap {
    rank: usize,
    nranks: usize,
    hash: u64,
    secret: [u8; SECRET_BYTES],
    addrs: Vec<SocketAddr>,
    /// Connections this rank writes to, made by the first send to each peer, or by a wait
    /// that watches the peer through one.
    out: Vec<Mutex<Option<TcpStream>>>,
    /// How many waits watch each peer through that connection (they keep its keepalive on:
    /// see `wire::keepalive`). Raised under the connection's lock; lowered apart from it,
    /// after which the last watcher turns the keepalive off under the lock where it can take
    /// it (left on otherwise: a stricter watch until the next wait).
    watchers: Vec<AtomicU32>,
    receiver: Option<peer::Receiver>,
    shared: Arc<peer::Shared>,
    health: Arc<Health>,
    /// The bound of the rendezvous and of every send.
    timeout: Duration,
    /// The bound of a wait for a peer's message (which also ends when the peer is gone).
    later: Duration,
    coll: Mutex<()>,
}

/// After this long without the message, a wait on a peer that has no connection to this rank
/// makes one of its own to it, to see it go (most waits are over long before).
const WATCH_AFTER: Duration = Duration::from_secs(1);

impl Bootstrap {
    /// Rendezvous through the root(s) of `ids`; every wait watches `health` (a comm's, or a
    /// bare abort flag). The rendezvous and sends are bounded by `param::bound`, waits for a
    /// peer's message by `OXCCL_TIMEOUT_S` only (see the module's comment).
    pub fn init(
        ids: &[UniqueId],
        rank: usize,
        nranks: usize,
        health: impl IntoHealth,
    ) -> Result<Bootstrap> {
        // With the heartbeat off (`OXCCL_HEARTBEAT_S=0`) a host that stops answering is not
        // seen: then those waits keep the bound too.
        let timeout = crate::param::bound();
        let later = match crate::param::heartbeat() {
            Some(_) => crate::param::wait_limit(),
            None => timeout,
        };
        Self::init_with_timeouts(ids, rank, nranks, health, timeout, later)
    }

    /// As `init`, with the timeout of every wait (now and later) given.
    pub fn init_with_timeout(
        ids: &[UniqueId],
        rank: usize,
        nranks: usize,
        health: impl IntoHealth,
        timeout: Duration,
    ) -> Result<Bootstrap> {
        Self::init_with_timeouts(ids, rank, nranks, health, timeout, timeout)
    }

    /// As `init`: `timeout` bounds the rendezvous and every send, `later` every wait for a
    /// peer's message.
    pub fn init_with_timeouts(
        ids: &[UniqueId],
        rank: usize,
        nranks: usize,
        health: impl IntoHealth,
        timeout: Duration,
        later: Duration,
    ) -> Result<Bootstrap> {
        let health = health.into_health();
        if ids.is_empty() {
            return Err(Error::invalid_argument("bootstrap: no unique id"));
        }
        if nranks == 0 || nranks > root::MAX_RANKS || rank >= nranks {
            return Err(Error::invalid_argument(format!(
                "bootstrap: rank {rank} of {nranks} is out of range"
            )));
        }
        if ids.len() > nranks {
            return Err(Error::invalid_argument(format!(
                "bootstrap: {} unique ids for {nranks} ranks (at most one id per rank)",
                ids.len()
            )));
        }
        let nids = ids.len();
        let idx = root::group_of(rank, nranks, nids);
        let (root_addr, root_secret) = id::decode(&ids[idx].bytes)?;
        let secret = ids[0].secret();
        let who = format!("rank {rank}");

        let bind = id::rank_bind_addr()?;
        let listener = TcpListener::bind(bind)
            .map_err(|e| Error::os(format!("{who}: binding the bootstrap listener {bind}"), e))?;
        let my_addr = wire::reachable(listener.local_addr()?);
        let receiver = peer::Receiver::start(listener, secret, rank, nranks, health.clone())?;
        let shared = receiver.shared.clone();

        let w = Wait::new(who.clone(), timeout, Some(&health));
        let what = || {
            format!("the bootstrap root at {root_addr} (id {idx} of {nids}, rendezvous of {nranks} ranks)")
        };
        let mut hello = root::handshake(&root_secret, root::KIND_RANK);
        for x in [rank, nranks, nids, idx] {
            wire::put_u32(&mut hello, x as u32);
        }
        hello.extend_from_slice(&wire::encode_addr(&my_addr));
        hello.extend_from_slice(&ids[0].bytes);
        // The root's own deadline usually expires first and names the missing ranks: give its
        // answer a moment to arrive.
        let w_reply = Wait {
            deadline: w.deadline + Duration::from_secs(1),
            ..Wait::new(who.clone(), timeout, Some(&health))
        };
        let what_reply = || {
            format!("the bootstrap root at {root_addr} to collect all {nranks} ranks (id {idx} of {nids})")
        };
        // A root under a flood of strangers may drop this connection before reading it (it
        // drops the oldest of too many unproven ones): a connection closed before any answer is
        // made again, a few times, within the connect bound. A wrong secret is closed so too.
        let mut conn = wire::Connector::new(root_addr);
        let mut closed = 0;
        let addrs = loop {
            let mut s = conn.connect(&w, &what)?;
            wire::keepalive(&s, true);
            let got = match wire::write_all(&mut s, &hello, &w, &what) {
                Ok(()) => root::read_reply_or_closed(&mut s, nranks, &w_reply, &what_reply),
                // Reset while writing: dropped too.
                Err(e) if e.code == Code::RemoteError => Ok(None),
                Err(e) => Err(e),
            };
            let got = got.map_err(|e| {
                if e.code == Code::RemoteError {
                    e.context("the root refused this rank (wrong secret or the rendezvous failed)")
                } else {
                    e
                }
            })?;
            closed += 1;
            match got {
                Some(addrs) => break addrs,
                None if closed <= REGISTER_RETRIES && conn.may_retry(&w) => {
                    conn.note("the root closed the connection before answering".into());
                }
                None => {
                    return Err(Error::remote(format!(
                        "{who}: {} closed the connection {closed} time(s) without answering: \
                         the unique id's secret is not that root's (a stale or altered id), or \
                         the root failed or exited",
                        what()
                    )))
                }
            }
        };
        crate::debug::info(&format!(
            "bootstrap: rank {rank} of {nranks} listening on {my_addr}, rendezvous done"
        ));
        Ok(Bootstrap {
            rank,
            nranks,
            hash: id::fnv1a(&secret),
            secret,
            addrs,
            out: (0..nranks).map(|_| Mutex::new(None)).collect(),
            watchers: (0..nranks).map(|_| AtomicU32::new(0)).collect(),
            receiver: Some(receiver),
            shared,
            health,
            timeout,
            later,
            coll: Mutex::new(()),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// 64-bit identity of the communicator (same on every rank, random per unique id).
    pub fn comm_hash(&self) -> u64 {
        self.hash
    }

    /// Every rank's bootstrap listen address, indexed by rank.
    pub fn peer_addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Every rank's `mine`, indexed by rank (sizes may differ). A ring: n-1 steps, each rank
    /// passes on to rank+1 the block it received from rank-1 the step before.
    pub fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let _g = self.coll.lock();
        if self.receiver.is_none() {
            return Err(self.closed_err());
        }
        let n = self.nranks;
        let r = self.rank;
        let mut out = vec![Vec::new(); n];
        out[r] = mine.to_vec();
        let next = (r + 1) % n;
        let prev = (r + n - 1) % n;
        for step in 0..n.saturating_sub(1) {
            let send_idx = (r + n - step) % n;
            let recv_idx = (r + 2 * n - step - 1) % n;
            self.send_raw(next, TAG_ALLGATHER, &out[send_idx])?;
            out[recv_idx] = self.recv_raw(prev, TAG_ALLGATHER)?;
        }
        Ok(out)
    }

    /// Returns once every rank has entered the barrier (dissemination: ceil(log2 n) rounds).
    pub fn barrier(&self) -> Result<()> {
        let _g = self.coll.lock();
        if self.receiver.is_none() {
            return Err(self.closed_err());
        }
        let n = self.nranks;
        let r = self.rank;
        let mut dist = 1;
        let mut round = 0u32;
        while dist < n {
            self.send_raw((r + dist) % n, TAG_BARRIER + round, &[])?;
            self.recv_raw((r + n - dist) % n, TAG_BARRIER + round)?;
            dist *= 2;
            round += 1;
        }
        Ok(())
    }

    /// Sends a transport's connection-setup blob to `peer` (`sub`: which end of which class).
    pub fn send_setup(&self, peer: usize, sub: u32, data: &[u8]) -> Result<()> {
        self.check_user(peer, sub & 0xfff)?;
        self.send_raw(peer, TAG_SETUP | (sub & 0xfff), data)
    }

    /// Receives the blob `peer` sent with `send_setup(.., sub, ..)`.
    pub fn recv_setup(&self, peer: usize, sub: u32) -> Result<Vec<u8>> {
        self.check_user(peer, sub & 0xfff)?;
        self.recv_raw(peer, TAG_SETUP | (sub & 0xfff))
    }

    /// Tells every peer that this rank's communicator broke (`why`), best effort and without
    /// waiting: their receiver threads break their communicators too, so that ranks waiting on
    /// something this rank will never do stop at once instead of at their timeout.
    pub fn announce_failure(&self, why: &str) {
        // Dead or unreachable peers must not hold the failing call up: a short budget for all,
        // watching no health (this rank's is broken already).
        let w = Wait::new(
            format!("rank {}", self.rank),
            std::time::Duration::from_millis(500),
            None,
        );
        for p in (0..self.nranks).filter(|&p| p != self.rank) {
            let _ = self.send_within(p, TAG_FAILED, why.as_bytes(), &w);
        }
    }

    /// Sends `data` to `peer` under `tag` (`tag < TAG_RESERVED`). Returns once the bytes are in
    /// the kernel's socket buffer; the peer's receiver thread drains them even while it sends.
    pub fn send(&self, peer: usize, tag: u32, data: &[u8]) -> Result<()> {
        self.check_user(peer, tag)?;
        self.send_raw(peer, tag, data)
    }

    /// The oldest message from `peer` under `tag` not received yet (waits for it).
    pub fn recv(&self, peer: usize, tag: u32) -> Result<Vec<u8>> {
        self.check_user(peer, tag)?;
        self.recv_raw(peer, tag)
    }

    /// Stops the receiver thread (joined) and closes every socket. Idempotent; `Drop` does it.
    pub fn close(&mut self) {
        if let Some(mut r) = self.receiver.take() {
            r.stop();
        }
        for o in &self.out {
            *o.lock() = None;
        }
    }

    fn check_user(&self, peer: usize, tag: u32) -> Result<()> {
        if peer >= self.nranks {
            return Err(Error::invalid_argument(format!(
                "bootstrap: peer {peer} out of range (nranks {})",
                self.nranks
            )));
        }
        if tag & TAG_RESERVED != 0 {
            return Err(Error::invalid_argument(format!(
                "bootstrap: tag {tag:#x} has the reserved top bit set"
            )));
        }
        Ok(())
    }

    fn closed_err(&self) -> Error {
        Error::invalid_usage(format!("bootstrap of rank {} is closed", self.rank))
    }

    fn send_raw(&self, peer: usize, tag: u32, data: &[u8]) -> Result<()> {
        let w = Wait::new(
            format!("rank {}", self.rank),
            self.timeout,
            Some(&self.health),
        );
        self.send_within(peer, tag, data, &w)
    }

    /// `send_raw` bounded by `w`.
    fn send_within(&self, peer: usize, tag: u32, data: &[u8], w: &Wait) -> Result<()> {
        if self.receiver.is_none() {
            return Err(self.closed_err());
        }
        if peer == self.rank {
            self.shared.push(peer, tag, data.to_vec());
            return Ok(());
        }
        let addr = self.addrs[peer];
        let what = || format!("rank {peer} at {addr} (bootstrap send, tag {tag:#x})");
        let mut slot = self.out[peer].lock();
        if slot.is_none() {
            let s = wire::connect(addr, w, &what)?;
            *slot = Some(self.introduce(peer, s, w, &what)?);
        }
        let s = slot.as_mut().expect("connected above");
        let hdr = peer::frame_header(tag, data.len());
        let res = if data.len() <= 4096 {
            let mut one = Vec::with_capacity(hdr.len() + data.len());
            one.extend_from_slice(&hdr);
            one.extend_from_slice(data);
            wire::write_all(s, &one, w, &what)
        } else {
            wire::write_all(s, &hdr, w, &what).and_then(|_| wire::write_all(s, data, w, &what))
        };
        if res.is_err() {
            // A partly written frame leaves the stream unusable.
            *slot = None;
        }
        res
    }

    /// A new connection to `peer` (under its lock), once this rank has introduced itself on
    /// it; its keepalive on where waits watch the peer.
    fn introduce(
        &self,
        peer: usize,
        mut s: TcpStream,
        w: &Wait,
        what: &dyn Fn() -> String,
    ) -> Result<TcpStream> {
        let hs = peer::peer_handshake(&self.secret, self.rank, self.nranks);
        wire::write_all(&mut s, &hs, w, what)?;
        wire::keepalive(&s, self.watchers[peer].load(Ordering::Relaxed) > 0);
        Ok(s)
    }

    /// Whether `peer`, which has no connection to this rank, is still there, seen through this
    /// rank's connection to it (made now where there is none, without holding its lock, so
    /// that sends to the peer go on meanwhile). The peer listened since the rendezvous: a
    /// refusal means its bootstrap is closed; other failures (no answer, no route) mean it is
    /// gone only once they have lasted `OXCCL_BOOTSTRAP_CONNECT_S`. The peer never writes on
    /// that connection: anything readable there is its end (a close, a reset, or the
    /// keepalive's verdict on a host that stopped answering). A send that holds the connection
    /// sees it fail for itself, so the check is skipped meanwhile.
    fn watch_link(
        &self,
        watch: &mut LinkWatch,
        tag: u32,
        w: &Wait,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        use nix::sys::socket::{recv, MsgFlags};
        use std::os::fd::AsRawFd;
        let peer = watch.peer;
        let gone = |why: String| {
            Error::remote(format!(
                "rank {}: rank {peer} is gone while rank {} waited for {}: {why}; did that rank \
                 exit, fail, or destroy its communicator?",
                self.rank,
                self.rank,
                what_tag(tag)
            ))
        };
        let linked = match self.out[peer].try_lock() {
            None => return Ok(()),
            Some(slot) => {
                if !watch.counted {
                    watch.counted = true;
                    if self.watchers[peer].fetch_add(1, Ordering::Relaxed) == 0 {
                        if let Some(s) = slot.as_ref() {
                            wire::keepalive(s, true);
                        }
                    }
                }
                slot.is_some()
            }
        };
        if !linked {
            let addr = self.addrs[peer];
            match wire::connect_once(addr, w, what)? {
                Ok(s) => {
                    let mut slot = self.out[peer].lock();
                    if slot.is_none() {
                        *slot = Some(self.introduce(peer, s, w, what)?);
                    }
                    watch.failing = None;
                }
                Err(why) => {
                    let since = *watch.failing.get_or_insert_with(std::time::Instant::now);
                    if wire::refused(&why) || since.elapsed() >= crate::param::bootstrap_connect() {
                        return Err(gone(format!(
                            "its bootstrap listener at {addr} cannot be reached ({why})"
                        )));
                    }
                    return Ok(());
                }
            }
        }
        let Some(mut slot) = self.out[peer].try_lock() else {
            return Ok(());
        };
        let Some(s) = slot.as_ref() else {
            return Ok(()); // a send's failure dropped it meanwhile: made again next time
        };
        let mut byte = [0u8; 1];
        let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
        let why = match recv(s.as_raw_fd(), &mut byte, flags) {
            Ok(0) => "it closed its bootstrap connection from this rank".to_string(),
            Ok(_) | Err(nix::errno::Errno::EAGAIN) | Err(nix::errno::Errno::EINTR) => return Ok(()),
            Err(e) => format!(
                "its bootstrap connection from this rank failed: {}",
                wire::failure(&std::io::Error::from(e))
            ),
        };
        *slot = None;
        Err(gone(why))
    }

    /// The oldest message from `peer` under `tag` in the inbox, taken out.
    fn pop(ib: &mut peer::Inbox, peer: usize, tag: u32) -> Option<Vec<u8>> {
        let q = ib.queues.get_mut(&(peer, tag))?;
        let m = q.pop_front();
        if q.is_empty() {
            ib.queues.remove(&(peer, tag));
        }
        m
    }

    fn recv_raw(&self, peer: usize, tag: u32) -> Result<Vec<u8>> {
        let w = Wait::new(
            format!("rank {}", self.rank),
            self.later,
            Some(&self.health),
        );
        let what = || format!("rank {peer} ({})", what_tag(tag));
        // (Before the lock: dropped after it.)
        let _watch = peer::Watch::new(&self.shared, peer);
        let mut link_watch = LinkWatch {
            boot: self,
            peer,
            counted: false,
            failing: None,
        };
        let mut ib = self.shared.inbox.lock();
        loop {
            if let Some(m) = Self::pop(&mut ib, peer, tag) {
                return Ok(m);
            }
            if ib.closed[peer] {
                return Err(Error::remote(match &ib.failed[peer] {
                    Some(why) => format!(
                        "rank {}: the bootstrap connection from rank {peer} failed while rank {} \
                         waited for {}: {why}",
                        self.rank,
                        self.rank,
                        what_tag(tag)
                    ),
                    None => format!(
                        "rank {}: rank {peer} closed its bootstrap connection while rank {} \
                         waited for {}; did that rank exit or fail?",
                        self.rank,
                        self.rank,
                        what_tag(tag)
                    ),
                }));
            }
            if ib.stopped {
                return Err(self.closed_err());
            }
            w.check(&what)?;
            if ib.open[peer] == 0 && peer != self.rank && w.since.elapsed() >= WATCH_AFTER {
                // (A message that comes meanwhile waits at most a slice.)
                let seen = parking_lot::MutexGuard::unlocked(&mut ib, || {
                    self.watch_link(&mut link_watch, tag, &w, &what)
                });
                if let Err(e) = seen {
                    // A peer that sent its message and then closed: the message may still be
                    // on its way through the receiver thread. A moment for it, then the error.
                    let until = std::time::Instant::now() + GONE_GRACE;
                    while std::time::Instant::now() < until {
                        if let Some(m) = Self::pop(&mut ib, peer, tag) {
                            return Ok(m);
                        }
                        self.shared.cv.wait_for(&mut ib, SLICE_GRACE);
                    }
                    return Self::pop(&mut ib, peer, tag).ok_or(e);
                }
            }
            self.shared.cv.wait_for(&mut ib, w.slice());
        }
    }
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        self.close();
    }
}

/// How long a wait that found its peer gone still looks for the message (it may have been
/// sent just before), and how often meanwhile.
const GONE_GRACE: Duration = Duration::from_millis(200);
const SLICE_GRACE: Duration = Duration::from_millis(20);

/// What a message under `tag` is, for errors.
fn what_tag(tag: u32) -> String {
    match tag {
        TAG_ALLGATHER => "its block of a bootstrap allgather".into(),
        TAG_SETUP..TAG_FAILED => format!("its half of a connection's setup (tag {tag:#x})"),
        TAG_BARRIER..TAG_SETUP => "a bootstrap barrier".into(),
        _ => format!("a bootstrap message (tag {tag:#x})"),
    }
}

/// A wait that watches a peer through this rank's connection to it (`watch_link`): while any
/// does (`counted`), the connection's keepalive is on.
struct LinkWatch<'a> {
    boot: &'a Bootstrap,
    peer: usize,
    counted: bool,
    /// Since when connecting to the peer has failed (other than refused).
    failing: Option<std::time::Instant>,
}

impl Drop for LinkWatch<'_> {
    fn drop(&mut self) {
        let b = self.boot;
        if self.counted && b.watchers[self.peer].fetch_sub(1, Ordering::Relaxed) == 1 {
            // Where a send holds the connection, its keepalive stays on: a stricter watch,
            // and the next wait's business.
            if let Some(slot) = b.out[self.peer].try_lock() {
                if let (0, Some(s)) = (b.watchers[self.peer].load(Ordering::Relaxed), &*slot) {
                    wire::keepalive(s, false);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
