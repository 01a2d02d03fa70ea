//! The root of one unique id: a listener, and the state of the rendezvous that collects the ranks
//! of its group and hands every one of them the full address table.
//!
//! No root has a thread of its own: one thread per process (`service.rs`) serves the listeners
//! of every pending id and all their connections at once, without blocking on any of them. Once
//! a root's rendezvous is complete or failed, it leaves the service, and a short-lived thread
//! writes the answers ([`Root::finish`]); an id nobody used expires at its deadline and costs no
//! thread at all.
//!
//! With several ids (`ncclCommInitRankScalable`), rank r registers with the root of id
//! `floor(r * nids / nranks)`. The root of id 0 assembles the table: once the root of id g > 0
//! has all its ranks, it connects to the root of id 0 (whose id every rank sent it), presents
//! id 0's secret, forwards its group's entries and waits; root 0, once it has its own ranks and
//! every non-empty group, answers every rank and every group root with the full table, and each
//! group root relays that answer to its ranks. All roots then close.
//!
//! Wire format (after the handshake `b"OXBR"`, 16-byte secret, kind u8), little endian:
//! - kind 1 (rank):  rank u32, nranks u32, nids u32, idx u32, listen address (24), id 0 (128)
//! - kind 2 (group): nranks u32, nids u32, idx u32, count u32, count x (rank u32, address (24))
//! - answer: status u8 = 0, nranks u32, nranks x address (24); or status = error code, len u32,
//!   message bytes.
//!
//! A connection is read no further than the handshake until it proved the secret ([`Root::next`]):
//! one whose first bytes are not the magic is dropped at the first wrong byte, one with a wrong
//! secret as soon as the 16 bytes are in (never byte by byte, which would let a stranger guess
//! the secret a byte at a time).

use super::id::{self, ID_BYTES, SECRET_BYTES};
use super::wire::{self, Wait, ADDR_BYTES};
use crate::debug::{info, warn};
use crate::error::{Error, Result};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

pub(crate) const ROOT_MAGIC: &[u8; 4] = b"OXBR";
pub(crate) const KIND_RANK: u8 = 1;
pub(crate) const KIND_GROUP: u8 = 2;
pub(crate) const HS_BYTES: usize = 4 + SECRET_BYTES + 1;
pub(crate) const RANK_HELLO_BYTES: usize = 16 + ADDR_BYTES + ID_BYTES;
const GROUP_HDR_BYTES: usize = 16;
const GROUP_ENTRY_BYTES: usize = 4 + ADDR_BYTES;
/// Most ranks a rendezvous accepts (a sanity bound on lengths read from the wire).
pub(crate) const MAX_RANKS: usize = 1 << 22;

/// The id index rank `r` registers with.
pub(crate) fn group_of(r: usize, nranks: usize, nids: usize) -> usize {
    (r as u128 * nids as u128 / nranks as u128) as usize
}

pub(crate) fn handshake(secret: &[u8; SECRET_BYTES], kind: u8) -> Vec<u8> {
    let mut v = Vec::with_capacity(HS_BYTES);
    v.extend_from_slice(ROOT_MAGIC);
    v.extend_from_slice(secret);
    v.push(kind);
    v
}

pub(crate) fn ok_reply(table: &[SocketAddr]) -> Vec<u8> {
    let mut v = vec![0u8];
    wire::put_u32(&mut v, table.len() as u32);
    for a in table {
        v.extend_from_slice(&wire::encode_addr(a));
    }
    v
}

/// Reads an answer of the root: the full table, or the error it reports.
pub(crate) fn read_reply(
    s: &mut TcpStream,
    nranks: usize,
    w: &Wait,
    what: &dyn Fn() -> String,
) -> Result<Vec<SocketAddr>> {
    wire::read_status(s, w, what)?;
    read_table(s, nranks, w, what)
}

/// As `read_reply`; None when the root closed the connection before answering (it dropped the
/// connection before reading the hello, or it died).
pub(crate) fn read_reply_or_closed(
    s: &mut TcpStream,
    nranks: usize,
    w: &Wait,
    what: &dyn Fn() -> String,
) -> Result<Option<Vec<SocketAddr>>> {
    if !wire::read_status_or_closed(s, w, what)? {
        return Ok(None);
    }
    read_table(s, nranks, w, what).map(Some)
}

fn read_table(
    s: &mut TcpStream,
    nranks: usize,
    w: &Wait,
    what: &dyn Fn() -> String,
) -> Result<Vec<SocketAddr>> {
    let mut nb = [0u8; 4];
    wire::read_exact(s, &mut nb, w, what)?;
    let n = u32::from_le_bytes(nb) as usize;
    if n != nranks {
        return Err(Error::internal(format!(
            "{}: {} sent a table of {n} ranks, expected {nranks}",
            w.who,
            what()
        )));
    }
    let mut raw = vec![0u8; n * ADDR_BYTES];
    wire::read_exact(s, &mut raw, w, what)?;
    raw.chunks(ADDR_BYTES)
        .map(|c| {
            wire::decode_addr(c)
                .ok_or_else(|| Error::internal(format!("{}: {} sent a bad address", w.who, what())))
        })
        .collect()
}

/// Binds the root's listener and hands it to the root service; returns the address to put in
/// the id. The root answers its ranks once all have come, or fails them at `timeout`.
pub(crate) fn start(secret: [u8; SECRET_BYTES], timeout: Duration) -> Result<SocketAddr> {
    let bind = id::root_bind_addr()?;
    let listener = TcpListener::bind(bind)
        .map_err(|e| Error::os(format!("bootstrap root: binding {bind}"), e))?;
    let addr = wire::reachable(listener.local_addr()?);
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::os(format!("bootstrap root {addr}: setting up the listener"), e))?;
    let me = format!("bootstrap root {addr}");
    let root = Root {
        wait: Wait::new(me.clone(), timeout, None),
        first: None,
        me,
        secret,
        meta: None,
        ranks: Vec::new(),
        groups: Vec::new(),
        failure: None,
        drops: [0; Refusal::COUNT],
    };
    super::service::serve(listener, root)?;
    Ok(addr)
}

#[derive(Clone, PartialEq, Eq)]
struct Meta {
    nranks: usize,
    nids: usize,
    idx: usize,
    /// The id of root 0 (only needed, and only known, by group roots with idx > 0).
    id0: Option<[u8; ID_BYTES]>,
}

struct RankConn {
    stream: TcpStream,
    rank: usize,
    addr: SocketAddr,
}

struct GroupConn {
    stream: TcpStream,
    idx: usize,
    entries: Vec<(usize, SocketAddr)>,
}

/// Why a connection was dropped before it joined the rendezvous.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Refusal {
    /// Its first bytes are not the bootstrap protocol's magic.
    Garbage,
    /// The magic, then a wrong secret.
    WrongSecret,
    /// The right secret, then a kind of client the root does not know.
    UnknownKind,
    /// It closed (or failed) before its hello was complete.
    Closed,
    /// It did not prove the secret within the hello deadline.
    Silent,
    /// It had not proven the secret yet when too many connections had not: the oldest goes.
    Evicted,
}

impl Refusal {
    const COUNT: usize = 6;
    const ALL: [Refusal; Refusal::COUNT] = [
        Refusal::Garbage,
        Refusal::WrongSecret,
        Refusal::UnknownKind,
        Refusal::Closed,
        Refusal::Silent,
        Refusal::Evicted,
    ];

    fn describe(self) -> &'static str {
        match self {
            Refusal::Garbage => "sent bytes that are not the bootstrap protocol",
            Refusal::WrongSecret => "presented a wrong secret",
            Refusal::UnknownKind => "asked for an unknown kind of client",
            Refusal::Closed => "closed before its hello was complete",
            Refusal::Silent => "did not present the secret within the hello deadline",
            Refusal::Evicted => {
                "was the oldest of too many connections that had not presented the secret yet"
            }
        }
    }
}

/// What the service does next with a connection, given the bytes it sent so far.
pub(crate) enum Next {
    /// Read on until it has sent this many bytes in all.
    Need(usize),
    /// Drop it.
    Refuse(Refusal),
    /// Its hello is complete (or malformed in a way the rendezvous must hear of): `admit` it.
    Hello,
}

/// The rendezvous of one unique id.
pub(crate) struct Root {
    pub me: String,
    secret: [u8; SECRET_BYTES],
    /// The id's deadline (its timeout runs from `ncclGetUniqueId`).
    pub wait: Wait<'static>,
    /// A wait that began with its first client, when `meta` was set (for the watchdog).
    first: Option<Wait<'static>>,
    meta: Option<Meta>,
    ranks: Vec<RankConn>,
    groups: Vec<GroupConn>,
    /// The rendezvous failed: the error for everyone, and the client that caused it (if one
    /// did), which hears it first.
    failure: Option<(Error, Option<TcpStream>)>,
    /// Connections dropped before they joined, by `Refusal`.
    drops: [u32; Refusal::COUNT],
}

impl Root {
    fn group_size(m: &Meta, g: usize) -> usize {
        (0..m.nranks)
            .filter(|&r| group_of(r, m.nranks, m.nids) == g)
            .count()
    }

    /// Non-empty groups other than 0 (what root 0 waits for).
    fn other_groups(m: &Meta) -> Vec<usize> {
        let mut v: Vec<usize> = (0..m.nranks)
            .map(|r| group_of(r, m.nranks, m.nids))
            .filter(|&g| g != 0)
            .collect();
        v.dedup();
        v
    }

    fn complete(&self) -> bool {
        let Some(m) = &self.meta else { return false };
        if self.ranks.len() != Self::group_size(m, m.idx) {
            return false;
        }
        m.idx != 0 || self.groups.len() == Self::other_groups(m).len()
    }

    /// Whether the root is done with its listener: complete, or failed.
    pub fn done(&self) -> bool {
        self.failure.is_some() || self.complete()
    }

    /// Fails the rendezvous if its deadline passed; once its first rank came, names the ranks
    /// it still misses past the watchdog's time (`first`: a wait of its own since then).
    pub fn expire(&mut self, now: Instant) {
        if self.failure.is_none() && now >= self.wait.deadline {
            let e = self.wait.expired(&|| self.missing());
            self.failure = Some((e, None));
        } else if let Some(first) = self.first.as_ref().filter(|_| self.failure.is_none()) {
            first.watch(now, &|| self.missing());
        }
    }

    fn missing(&self) -> String {
        let Some(m) = &self.meta else {
            return "any rank to connect".into();
        };
        let mut have = vec![false; m.nranks];
        for r in &self.ranks {
            have[r.rank] = true;
        }
        for g in &self.groups {
            for &(r, _) in &g.entries {
                have[r] = true;
            }
        }
        let mut miss: Vec<String> = (0..m.nranks)
            .filter(|&r| !have[r] && (m.idx == 0 || group_of(r, m.nranks, m.nids) == m.idx))
            .take(16)
            .map(|r| r.to_string())
            .collect();
        if miss.len() == 16 {
            miss.push("...".into());
        }
        format!(
            "rank(s) {} of {} (id {} of {})",
            miss.join(","),
            m.nranks,
            m.idx,
            m.nids
        )
    }

    /// Reads a connection no further than this: the handshake first (the magic checked as it
    /// arrives, the secret once all of it is in), then a hello of the length its kind implies.
    pub fn next(&self, b: &[u8]) -> Next {
        let n = b.len().min(ROOT_MAGIC.len());
        if b[..n] != ROOT_MAGIC[..n] {
            return Next::Refuse(Refusal::Garbage);
        }
        if b.len() < HS_BYTES {
            return Next::Need(HS_BYTES);
        }
        if !wire::same_secret(&b[4..4 + SECRET_BYTES], &self.secret) {
            return Next::Refuse(Refusal::WrongSecret);
        }
        let body = &b[HS_BYTES..];
        match b[HS_BYTES - 1] {
            KIND_RANK if body.len() < RANK_HELLO_BYTES => Next::Need(HS_BYTES + RANK_HELLO_BYTES),
            KIND_RANK => Next::Hello,
            KIND_GROUP if body.len() < GROUP_HDR_BYTES => Next::Need(HS_BYTES + GROUP_HDR_BYTES),
            KIND_GROUP => {
                let nranks = wire::get_u32(body, 0) as usize;
                let count = wire::get_u32(body, 12) as usize;
                if nranks == 0 || nranks > MAX_RANKS || count > nranks {
                    // `admit` refuses it (and fails the rendezvous, as a bad rank hello does).
                    return Next::Hello;
                }
                let total = HS_BYTES + GROUP_HDR_BYTES + count * GROUP_ENTRY_BYTES;
                if b.len() < total {
                    Next::Need(total)
                } else {
                    Next::Hello
                }
            }
            _ => Next::Refuse(Refusal::UnknownKind),
        }
    }

    /// Counts a dropped connection; the first of each kind is logged (the rest are summed up
    /// when the root is done, so that a flood does not flood the log too).
    pub fn dropped(&mut self, why: Refusal, from: SocketAddr) {
        let i = Refusal::ALL.iter().position(|&r| r == why).expect("listed");
        self.drops[i] += 1;
        if self.drops[i] == 1 {
            warn(&format!(
                "{}: dropped a connection from {from} that {} (more like it are counted, not \
                 logged)",
                self.me,
                why.describe()
            ));
        }
    }

    /// A connection whose hello `b` (handshake included) `next` found complete: record it, or
    /// fail the rendezvous if it is inconsistent.
    pub fn admit(&mut self, s: TcpStream, b: &[u8]) {
        if self.failure.is_some() {
            return;
        }
        let res = match b[HS_BYTES - 1] {
            KIND_RANK => self.admit_rank(s, &b[HS_BYTES..]),
            _ => self.admit_group(s, &b[HS_BYTES..]),
        };
        if let Err((e, s)) = res {
            self.failure = Some((e, Some(s)));
        }
    }

    /// The streams of the clients admitted so far (ranks, then group roots), in a stable order
    /// until the rendezvous ends: they send nothing more, and wait for the answer.
    pub fn clients(&self) -> impl Iterator<Item = &TcpStream> {
        self.ranks
            .iter()
            .map(|r| &r.stream)
            .chain(self.groups.iter().map(|g| &g.stream))
    }

    /// Client `i` (of `clients`) became readable while it waits for the answer: it closed its
    /// connection (its process ended, its init was aborted or gave up) or broke the protocol.
    /// Either way it left: the rendezvous fails at once, for every rank, naming it (rather
    /// than at the deadline, or, where it came last, with the answer a dead rank never reads).
    pub fn client_stirred(&mut self, i: usize) {
        if self.failure.is_some() {
            return;
        }
        let nr = self.ranks.len();
        let (stream, who) = match self.ranks.get(i) {
            Some(r) => (&r.stream, format!("rank {}", r.rank)),
            None => match self.groups.get(i - nr) {
                Some(g) => (&g.stream, format!("the root of id {}", g.idx)),
                None => return,
            },
        };
        let how = match stream.peek(&mut [0u8; 1]) {
            Ok(0) => "closed its connection".to_string(),
            Ok(_) => "sent more than its hello".to_string(),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) => format!("lost its connection ({e})"),
        };
        let e = Error::remote(format!(
            "{}: {who} {how} before the rendezvous completed (its process ended, or its init \
             was aborted or gave up)",
            self.me
        ));
        self.failure = Some((e, None));
    }

    /// Merges a client's view of the rendezvous into ours; Err(InvalidUsage) on a mismatch.
    fn agree(&mut self, m: Meta, who: &str) -> Result<()> {
        match &mut self.meta {
            None => {
                self.meta = Some(m);
                self.first = Some(Wait::new(self.me.clone(), self.wait.timeout, None));
                Ok(())
            }
            Some(cur) => {
                let what = if cur.nranks != m.nranks {
                    format!("nranks {} vs {}", m.nranks, cur.nranks)
                } else if cur.nids != m.nids {
                    format!("{} unique ids vs {}", m.nids, cur.nids)
                } else if cur.idx != m.idx {
                    format!("id index {} vs {}", m.idx, cur.idx)
                } else if m.id0.is_some() && cur.id0.is_some() && m.id0 != cur.id0 {
                    "a different first unique id".into()
                } else {
                    if cur.id0.is_none() {
                        cur.id0 = m.id0;
                    }
                    return Ok(());
                };
                Err(Error::invalid_usage(format!(
                    "{}: {who} disagrees with the ranks before it: {what}",
                    self.me
                )))
            }
        }
    }

    fn admit_rank(
        &mut self,
        s: TcpStream,
        b: &[u8],
    ) -> std::result::Result<(), (Error, TcpStream)> {
        let rank = wire::get_u32(b, 0) as usize;
        let nranks = wire::get_u32(b, 4) as usize;
        let nids = wire::get_u32(b, 8) as usize;
        let idx = wire::get_u32(b, 12) as usize;
        let addr = wire::decode_addr(&b[16..16 + ADDR_BYTES]);
        let mut id0 = [0u8; ID_BYTES];
        id0.copy_from_slice(&b[16 + ADDR_BYTES..RANK_HELLO_BYTES]);
        let bad = if nranks == 0 || nranks > MAX_RANKS || rank >= nranks {
            Some(format!("rank {rank} of {nranks} is out of range"))
        } else if nids == 0 || idx >= nids || group_of(rank, nranks, nids) != idx {
            Some(format!("rank {rank} came to id {idx} of {nids}"))
        } else if addr.is_none() {
            Some(format!("rank {rank} sent a bad address"))
        } else if idx > 0 && id::decode(&id0).is_err() {
            Some(format!("rank {rank} sent a bad first unique id"))
        } else {
            None
        };
        if let Some(why) = bad {
            return Err((Error::invalid_argument(format!("{}: {why}", self.me)), s));
        }
        let m = Meta {
            nranks,
            nids,
            idx,
            id0: (idx > 0).then_some(id0),
        };
        if let Err(e) = self.agree(m, &format!("rank {rank}")) {
            return Err((e, s));
        }
        if self.ranks.iter().any(|r| r.rank == rank) {
            let e = Error::invalid_usage(format!("{}: rank {rank} joined twice", self.me));
            return Err((e, s));
        }
        self.ranks.push(RankConn {
            stream: s,
            rank,
            addr: addr.expect("checked"),
        });
        Ok(())
    }

    fn admit_group(
        &mut self,
        s: TcpStream,
        b: &[u8],
    ) -> std::result::Result<(), (Error, TcpStream)> {
        let nranks = wire::get_u32(b, 0) as usize;
        let nids = wire::get_u32(b, 4) as usize;
        let idx = wire::get_u32(b, 8) as usize;
        let count = wire::get_u32(b, 12) as usize;
        if nranks == 0 || nranks > MAX_RANKS || count > nranks || idx == 0 || idx >= nids {
            let e = Error::invalid_argument(format!("{}: malformed group message", self.me));
            return Err((e, s));
        }
        let raw = &b[GROUP_HDR_BYTES..GROUP_HDR_BYTES + count * GROUP_ENTRY_BYTES];
        let mut entries = Vec::with_capacity(count);
        for c in raw.chunks(GROUP_ENTRY_BYTES) {
            let r = wire::get_u32(c, 0) as usize;
            match wire::decode_addr(&c[4..]) {
                Some(a) if r < nranks && group_of(r, nranks, nids) == idx => entries.push((r, a)),
                _ => {
                    let e = Error::invalid_argument(format!(
                        "{}: bad entry from the root of id {idx}",
                        self.me
                    ));
                    return Err((e, s));
                }
            }
        }
        let m = Meta {
            nranks,
            nids,
            idx: 0,
            id0: None,
        };
        if let Err(e) = self.agree(m, &format!("the root of id {idx}")) {
            return Err((e, s));
        }
        let expect = Self::group_size(self.meta.as_ref().expect("set"), idx);
        if self.groups.iter().any(|g| g.idx == idx) || entries.len() != expect {
            let e = Error::invalid_usage(format!(
                "{}: the root of id {idx} came twice or with {} of {expect} ranks",
                self.me,
                entries.len()
            ));
            return Err((e, s));
        }
        self.groups.push(GroupConn {
            stream: s,
            idx,
            entries,
        });
        Ok(())
    }

    /// Called once `done`, after the root left the service (closing `unfinished` connections
    /// that had not completed their hello): logs how it ended and returns what is left to do,
    /// blocking (answering the waiting clients), or None when nobody waits.
    pub fn finish(mut self, unfinished: usize) -> Option<Box<dyn FnOnce() + Send>> {
        let dropped = self.drops.iter().sum::<u32>() as usize + unfinished;
        if dropped > 0 {
            let mut parts: Vec<String> = Refusal::ALL
                .iter()
                .zip(self.drops)
                .filter(|&(_, n)| n > 0)
                .map(|(r, n)| format!("{n} that {}", r.describe()))
                .collect();
            if unfinished > 0 {
                parts.push(format!("{unfinished} that had not completed a hello yet"));
            }
            warn(&format!(
                "{}: dropped {dropped} connection(s) that did not join the rendezvous: {}",
                self.me,
                parts.join("; ")
            ));
        }
        if let Some((e, rejected)) = self.failure.take() {
            let waiting = self.ranks.len() + self.groups.len() + rejected.is_some() as usize;
            if waiting == 0 {
                // Nobody came: an id generated and never used (common where every rank calls
                // ncclGetUniqueId and one id is shared) is no failure of anyone's.
                info(&format!("{} (the unique id expired unused)", e.msg));
                return None;
            }
            warn(&e.msg);
            return Some(Box::new(move || self.fail_all(rejected, &e)));
        }
        let m = self.meta.clone().expect("complete implies meta");
        if m.idx != 0 {
            return Some(Box::new(move || {
                let reply = match self.forward_to_root0(&m) {
                    Ok(table) => ok_reply(&table),
                    Err(e) => {
                        warn(&e.msg);
                        wire::error_reply(e.code, &e.msg)
                    }
                };
                self.answer_all(&reply);
                info(&format!("{}: done", self.me));
            }));
        }
        let mut table: Vec<Option<SocketAddr>> = vec![None; m.nranks];
        for r in &self.ranks {
            table[r.rank] = Some(r.addr);
        }
        for g in &self.groups {
            for &(r, a) in &g.entries {
                table[r] = Some(a);
            }
        }
        let reply = match table.into_iter().collect::<Option<Vec<_>>>() {
            Some(t) => ok_reply(&t),
            None => {
                let e = Error::internal(format!("{}: incomplete table (internal error)", self.me));
                warn(&e.msg);
                return Some(Box::new(move || self.fail_all(None, &e)));
            }
        };
        Some(Box::new(move || {
            self.answer_all(&reply);
            info(&format!("{}: done", self.me));
        }))
    }

    /// Answers every waiting client (the one that caused the failure first) with the error.
    fn fail_all(mut self, rejected: Option<TcpStream>, e: &Error) {
        let reply = wire::error_reply(e.code, &e.msg);
        let w = Wait::new(self.me.clone(), Duration::from_secs(2), None);
        if let Some(mut s) = rejected {
            let _ = wire::write_all(&mut s, &reply, &w, &|| "a client".into());
        }
        for s in self
            .ranks
            .iter_mut()
            .map(|r| &mut r.stream)
            .chain(self.groups.iter_mut().map(|g| &mut g.stream))
        {
            let _ = wire::write_all(s, &reply, &w, &|| "a waiting client".into());
        }
    }

    fn answer_all(&mut self, reply: &[u8]) {
        let w = Wait::new(self.me.clone(), self.wait.timeout, None);
        for r in &mut self.ranks {
            let rank = r.rank;
            if let Err(e) = wire::write_all(&mut r.stream, reply, &w, &|| format!("rank {rank}")) {
                warn(&e.msg);
            }
        }
        for g in &mut self.groups {
            let idx = g.idx;
            if let Err(e) = wire::write_all(&mut g.stream, reply, &w, &|| {
                format!("the root of id {idx}")
            }) {
                warn(&e.msg);
            }
        }
    }

    /// Group root (idx > 0): hand the group's entries to root 0 and get the full table back.
    fn forward_to_root0(&self, m: &Meta) -> Result<Vec<SocketAddr>> {
        let id0 = m.id0.expect("group roots learn id 0 from their ranks");
        let (addr0, secret0) = id::decode(&id0)?;
        let w = Wait {
            deadline: self.wait.deadline,
            ..Wait::new(self.me.clone(), self.wait.timeout, None)
        };
        let what = || format!("the root of id 0 at {addr0}");
        let mut s = wire::connect(addr0, &w, &what)?;
        wire::keepalive(&s, true);
        let mut msg = handshake(&secret0, KIND_GROUP);
        for x in [m.nranks, m.nids, m.idx, self.ranks.len()] {
            wire::put_u32(&mut msg, x as u32);
        }
        for r in &self.ranks {
            wire::put_u32(&mut msg, r.rank as u32);
            msg.extend_from_slice(&wire::encode_addr(&r.addr));
        }
        wire::write_all(&mut s, &msg, &w, &what)?;
        // Root 0 answers once every group is in: allow it its own full timeout for that.
        let w2 = Wait {
            deadline: self.wait.deadline + Duration::from_secs(1),
            ..w
        };
        read_reply(&mut s, m.nranks, &w2, &what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_partition_ranks() {
        for nranks in 1..20 {
            for nids in 1..=nranks {
                let mut last = 0;
                for r in 0..nranks {
                    let g = group_of(r, nranks, nids);
                    assert!(g < nids && g >= last);
                    last = g;
                }
                assert_eq!(group_of(0, nranks, nids), 0);
                assert_eq!(group_of(nranks - 1, nranks, nids), nids - 1);
                let m = Meta {
                    nranks,
                    nids,
                    idx: 0,
                    id0: None,
                };
                let total: usize = (0..nids).map(|g| Root::group_size(&m, g)).sum();
                assert_eq!(total, nranks);
            }
        }
    }
}
