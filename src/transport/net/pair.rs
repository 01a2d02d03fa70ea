//! Both directions between two ranks on one set of sockets. A connection's sockets carry its
//! slots one way only; the reverse connection between the same two ranks (same communicator,
//! same class) can use the same sockets the other way, so that TCP carries each direction's
//! acknowledgements on the other's data instead of in packets of their own: half the packets
//! where ranks exchange small messages (an all-reduce between two hosts).
//!
//! Who shares is decided without a round trip. For ranks lo < hi, the sending end lo -> hi opens
//! the sockets as any sending end does (the *opener*), and hi's receiving end accepts them (the
//! *acceptor*). hi's sending end hi -> lo, when it is set up while hi's receiving end lo -> hi
//! exists, sends on the acceptor's sockets and says so in its blob; lo's receiving end then
//! reads from the opener's sockets instead of listening. The process-wide table below lets an
//! end find its partner; the sockets appear in it once connected (a partner may be set up
//! before they are, or later, in another launch).

use once_cell::sync::{Lazy, OnceCell};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::{Arc, Weak};

/// One side of the sockets between two ranks: filled once they are connected.
pub type Sockets = Arc<Cell>;
type Cell = OnceCell<Vec<TcpStream>>;

/// A side of the sockets lo -> hi of one communicator and class: the opener's (on rank lo) or
/// the acceptor's (on rank hi).
#[derive(Clone, Copy, Hash, PartialEq, Eq, Debug)]
pub struct Side {
    pub comm_hash: u64,
    pub lo: usize,
    pub hi: usize,
    pub class: u8,
    pub opener: bool,
}

static TABLE: Lazy<Mutex<HashMap<Side, Weak<Cell>>>> = Lazy::new(Default::default);

/// The side's sockets, registered by the end that connects them (or taken by its partner): the
/// same cell for both, as long as one of them holds it.
pub fn register(side: Side) -> Sockets {
    let mut t = TABLE.lock();
    if let Some(s) = t.get(&side).and_then(Weak::upgrade) {
        return s;
    }
    t.retain(|_, w| w.strong_count() > 0);
    let s: Sockets = Default::default();
    t.insert(side, Arc::downgrade(&s));
    s
}

/// The side's sockets if an end of this process holds them (registered and alive).
pub fn existing(side: Side) -> Option<Sockets> {
    TABLE.lock().get(&side).and_then(Weak::upgrade)
}

/// Copies of the sockets' handles (the same connections) once they are connected.
pub fn take(s: &Sockets) -> Option<std::io::Result<Vec<TcpStream>>> {
    s.get()
        .map(|v| v.iter().map(TcpStream::try_clone).collect())
}

/// Publishes connected sockets (copies of their handles) for the partner end.
pub fn publish(s: &Sockets, socks: &[TcpStream]) -> std::io::Result<()> {
    let v = socks
        .iter()
        .map(TcpStream::try_clone)
        .collect::<std::io::Result<Vec<_>>>()?;
    let _ = s.set(v);
    Ok(())
}
