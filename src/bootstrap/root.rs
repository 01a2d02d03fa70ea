//! The root of one unique id: a listener and a thread that collects the ranks of its group and
//! hands every one of them the full address table, then exits.
//!
//! With several ids (`ncclCommInitRankScalable`), rank r registers with the root of id
//! `floor(r * nids / nranks)`. The root of id 0 assembles the table: once the root of id g > 0
//! has all its ranks, it connects to the root of id 0 (whose id every rank sent it), presents
//! id 0's secret, forwards its group's entries and waits; root 0, once it has its own ranks and
//! every non-empty group, answers every rank and every group root with the full table, and each
//! group root relays that answer to its ranks. All roots then exit.
//!
//! Wire format (after the handshake `b"OXBR"`, 16-byte secret, kind u8), little endian:
//! - kind 1 (rank):  rank u32, nranks u32, nids u32, idx u32, listen address (24), id 0 (128)
//! - kind 2 (group): nranks u32, nids u32, idx u32, count u32, count x (rank u32, address (24))
//! - answer: status u8 = 0, nranks u32, nranks x address (24); or status = error code, len u32,
//!   message bytes.

use super::id::{self, ID_BYTES, SECRET_BYTES};
use super::wire::{self, Wait, ADDR_BYTES};
use crate::debug::warn;
use crate::error::{Code, Error, Result};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

pub(crate) const ROOT_MAGIC: &[u8; 4] = b"OXBR";
pub(crate) const KIND_RANK: u8 = 1;
pub(crate) const KIND_GROUP: u8 = 2;
pub(crate) const HS_BYTES: usize = 4 + SECRET_BYTES + 1;
pub(crate) const RANK_HELLO_BYTES: usize = 16 + ADDR_BYTES + ID_BYTES;
/// Most ranks a rendezvous accepts (a sanity bound on lengths read from the wire).
pub(crate) const MAX_RANKS: usize = 1 << 22;
/// How long a root waits for a just-connected client's hello before dropping it.
const HELLO_WAIT: Duration = Duration::from_secs(5);

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

/// Binds the root's listener and starts its thread; returns the address to put in the id.
pub(crate) fn start(secret: [u8; SECRET_BYTES], timeout: Duration) -> Result<SocketAddr> {
    let bind = id::root_bind_addr()?;
    let listener = TcpListener::bind(bind)
        .map_err(|e| Error::os(format!("bootstrap root: binding {bind}"), e))?;
    let addr = wire::reachable(listener.local_addr()?);
    listener.set_nonblocking(true)?;
    std::thread::Builder::new()
        .name("oxccl-bootroot".into())
        .spawn(move || {
            let mut root = Root {
                me: format!("bootstrap root {addr}"),
                secret,
                timeout,
                deadline: Instant::now() + timeout,
                meta: None,
                ranks: Vec::new(),
                groups: Vec::new(),
            };
            if let Err(e) = root.run(&listener) {
                warn(&e.msg);
            }
            crate::debug::info(&format!("{}: done", root.me));
        })
        .map_err(|e| Error::os("spawning the bootstrap root thread", e))?;
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

struct Root {
    me: String,
    secret: [u8; SECRET_BYTES],
    timeout: Duration,
    deadline: Instant,
    meta: Option<Meta>,
    ranks: Vec<RankConn>,
    groups: Vec<GroupConn>,
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

    /// Answers every waiting client with an error; the root then exits.
    fn fail_all(&mut self, code: Code, msg: &str) -> Error {
        let reply = wire::error_reply(code, msg);
        let w = Wait::new(self.me.clone(), Duration::from_secs(2), None);
        for s in self
            .ranks
            .iter_mut()
            .map(|r| &mut r.stream)
            .chain(self.groups.iter_mut().map(|g| &mut g.stream))
        {
            let _ = wire::write_all(s, &reply, &w, &|| "a waiting client".into());
        }
        self.ranks.clear();
        self.groups.clear();
        Error::new(code, msg)
    }

    fn run(&mut self, listener: &TcpListener) -> Result<()> {
        while !self.complete() {
            let now = Instant::now();
            if now >= self.deadline {
                let msg = format!(
                    "{} waited {} for {}",
                    self.me,
                    wire::fmt_secs(self.timeout),
                    self.missing()
                );
                return Err(self.fail_all(Code::Timeout, &msg));
            }
            let left = self.deadline - now;
            let ms = left.min(Duration::from_millis(100)).as_millis().max(1) as u16;
            let mut fds = [nix::poll::PollFd::new(
                listener.as_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            let _ = nix::poll::poll(&mut fds, ms);
            match listener.accept() {
                Ok((s, from)) => self.serve(s, from)?,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => warn(&format!("{}: accept failed: {e}", self.me)),
            }
        }
        let m = self.meta.clone().expect("complete implies meta");
        if m.idx == 0 {
            let mut table: Vec<Option<SocketAddr>> = vec![None; m.nranks];
            for r in &self.ranks {
                table[r.rank] = Some(r.addr);
            }
            for g in &self.groups {
                for &(r, a) in &g.entries {
                    table[r] = Some(a);
                }
            }
            let table: Vec<SocketAddr> = match table.into_iter().collect::<Option<Vec<_>>>() {
                Some(t) => t,
                None => {
                    let msg = format!("{}: incomplete table (internal error)", self.me);
                    return Err(self.fail_all(Code::InternalError, &msg));
                }
            };
            self.answer_all(&ok_reply(&table));
        } else {
            let reply = match self.forward_to_root0(&m) {
                Ok(table) => ok_reply(&table),
                Err(e) => {
                    warn(&e.msg);
                    wire::error_reply(e.code, &e.msg)
                }
            };
            self.answer_all(&reply);
        }
        Ok(())
    }

    fn answer_all(&mut self, reply: &[u8]) {
        let w = Wait::new(self.me.clone(), self.timeout, None);
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
            who: self.me.clone(),
            deadline: self.deadline,
            timeout: self.timeout,
            health: None,
        };
        let what = || format!("the root of id 0 at {addr0}");
        let mut s = wire::connect(addr0, &w, &what)?;
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
            deadline: self.deadline + Duration::from_secs(1),
            ..w
        };
        read_reply(&mut s, m.nranks, &w2, &what)
    }

    /// One new connection: check the secret, read its hello, record it or fail the rendezvous.
    fn serve(&mut self, mut s: TcpStream, from: SocketAddr) -> Result<()> {
        let _ = s.set_nonblocking(false);
        let _ = s.set_nodelay(true);
        let w = Wait::new(
            self.me.clone(),
            HELLO_WAIT.min(self.deadline.saturating_duration_since(Instant::now())),
            None,
        );
        let what = || format!("the client at {from}");
        let mut hs = [0u8; HS_BYTES];
        if let Err(e) = wire::read_exact(&mut s, &mut hs, &w, &what) {
            warn(&format!("{}: dropped a connection: {}", self.me, e.msg));
            return Ok(());
        }
        if &hs[0..4] != ROOT_MAGIC || !wire::same_secret(&hs[4..4 + SECRET_BYTES], &self.secret) {
            warn(&format!(
                "{}: refused a connection from {from}: wrong magic or secret",
                self.me
            ));
            return Ok(());
        }
        let kind = hs[HS_BYTES - 1];
        let res = match kind {
            KIND_RANK => self.serve_rank(s, &w, &what),
            KIND_GROUP => self.serve_group(s, &w, &what),
            _ => {
                warn(&format!(
                    "{}: unknown client kind {kind} from {from}",
                    self.me
                ));
                Ok(())
            }
        };
        match res {
            Ok(()) => Ok(()),
            // An unreadable hello only loses that client.
            Err(e) if e.code == Code::RemoteError || e.code == Code::Timeout => {
                warn(&format!("{}: dropped a client: {}", self.me, e.msg));
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Merges a client's view of the rendezvous into ours; Err(InvalidUsage) on a mismatch.
    fn agree(&mut self, m: Meta, who: &str) -> Result<()> {
        match &mut self.meta {
            None => {
                self.meta = Some(m);
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

    fn reject(&mut self, mut s: TcpStream, e: Error) -> Result<()> {
        let w = Wait::new(self.me.clone(), Duration::from_secs(2), None);
        let _ = wire::write_all(&mut s, &wire::error_reply(e.code, &e.msg), &w, &|| {
            "a client".into()
        });
        Err(self.fail_all(e.code, &e.msg))
    }

    fn serve_rank(&mut self, mut s: TcpStream, w: &Wait, what: &dyn Fn() -> String) -> Result<()> {
        let mut b = [0u8; RANK_HELLO_BYTES];
        wire::read_exact(&mut s, &mut b, w, what)?;
        let rank = wire::get_u32(&b, 0) as usize;
        let nranks = wire::get_u32(&b, 4) as usize;
        let nids = wire::get_u32(&b, 8) as usize;
        let idx = wire::get_u32(&b, 12) as usize;
        let addr = wire::decode_addr(&b[16..16 + ADDR_BYTES]);
        let mut id0 = [0u8; ID_BYTES];
        id0.copy_from_slice(&b[16 + ADDR_BYTES..]);
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
            return self.reject(s, Error::invalid_argument(format!("{}: {why}", self.me)));
        }
        let m = Meta {
            nranks,
            nids,
            idx,
            id0: (idx > 0).then_some(id0),
        };
        if let Err(e) = self.agree(m, &format!("rank {rank}")) {
            return self.reject(s, e);
        }
        if self.ranks.iter().any(|r| r.rank == rank) {
            let e = Error::invalid_usage(format!("{}: rank {rank} joined twice", self.me));
            return self.reject(s, e);
        }
        self.ranks.push(RankConn {
            stream: s,
            rank,
            addr: addr.expect("checked"),
        });
        Ok(())
    }

    fn serve_group(&mut self, mut s: TcpStream, w: &Wait, what: &dyn Fn() -> String) -> Result<()> {
        let mut b = [0u8; 16];
        wire::read_exact(&mut s, &mut b, w, what)?;
        let nranks = wire::get_u32(&b, 0) as usize;
        let nids = wire::get_u32(&b, 4) as usize;
        let idx = wire::get_u32(&b, 8) as usize;
        let count = wire::get_u32(&b, 12) as usize;
        if nranks == 0 || nranks > MAX_RANKS || count > nranks || idx == 0 || idx >= nids {
            let e = Error::invalid_argument(format!("{}: malformed group message", self.me));
            return self.reject(s, e);
        }
        let mut raw = vec![0u8; count * (4 + ADDR_BYTES)];
        wire::read_exact(&mut s, &mut raw, w, what)?;
        let mut entries = Vec::with_capacity(count);
        for c in raw.chunks(4 + ADDR_BYTES) {
            let r = wire::get_u32(c, 0) as usize;
            match wire::decode_addr(&c[4..]) {
                Some(a) if r < nranks && group_of(r, nranks, nids) == idx => entries.push((r, a)),
                _ => {
                    let e = Error::invalid_argument(format!(
                        "{}: bad entry from the root of id {idx}",
                        self.me
                    ));
                    return self.reject(s, e);
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
            return self.reject(s, e);
        }
        let expect = Self::group_size(self.meta.as_ref().expect("set"), idx);
        if self.groups.iter().any(|g| g.idx == idx) || entries.len() != expect {
            let e = Error::invalid_usage(format!(
                "{}: the root of id {idx} came twice or with {} of {expect} ranks",
                self.me,
                entries.len()
            ));
            return self.reject(s, e);
        }
        self.groups.push(GroupConn {
            stream: s,
            idx,
            entries,
        });
        Ok(())
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
