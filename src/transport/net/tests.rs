//! A receiving end's slots read into the caller's memory (`Proxy::post_recv_ref`), byte by
//! byte as they arrive on a socket this test writes to.

use super::{inproc, wire, Dest, NetEnd, State, Wire};
use crate::transport::{Conn, Proxy, Region};
use parking_lot::Mutex;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use wire::Target;

const NSTEPS: usize = 2;
const BYTES: usize = 8192;
const GONE: u8 = 0xa5;

/// A receiving end reading from a socket, and the socket's other end to write slots to.
fn receiving_end() -> (NetEnd, TcpStream) {
    let (end, mut tx) = receiving_end_of(1, BYTES);
    (end, tx.remove(0))
}

/// A receiving end of slots of `bytes` reading from `k` sockets, and their other ends.
fn receiving_end_of(k: usize, bytes: usize) -> (NetEnd, Vec<TcpStream>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut txs = Vec::new();
    let mut rxs = Vec::new();
    for _ in 0..k {
        txs.push(TcpStream::connect(l.local_addr().unwrap()).unwrap());
        let rx = l.accept().unwrap().0;
        rx.set_nonblocking(true).unwrap();
        rxs.push(rx);
    }
    (end_in(State::Connected(rxs), k, bytes), txs)
}

/// A receiving end of slots of `bytes` over `k` sockets, in `state`.
fn end_in(state: State, k: usize, bytes: usize) -> NetEnd {
    let name = format!("net-tests-{}-{:?}", std::process::id(), Instant::now());
    let region = inproc::open(&name, crate::transport::region_bytes(NSTEPS, bytes)).unwrap();
    inproc::forget(&name);
    let view = Conn::new(Region::Heap(region), NSTEPS, bytes, (1, 0), false);
    view.attach();
    view.attach();
    NetEnd {
        view,
        me: 1,
        peer: 0,
        peer_host: "test".into(),
        is_sender: false,
        state: Mutex::new(Wire {
            state,
            p: wire::Progress::new(k),
            helpers: None,
        }),
        publish: None,
        closed: Default::default(),
        polled: Default::default(),
        waker: Default::default(),
        driven: Default::default(),
        passes: Default::default(),
        threads: 1,
        dests: (0..NSTEPS).map(|_| Dest::default()).collect(),
    }
}

/// A receiving end whose peer never connects fails once it has waited twice the setup bound
/// (the peer died before it connected): not a wait for good, though operations wait on live
/// peers without a bound. A stranger's connection meanwhile fails nothing.
#[test]
fn a_receiving_end_whose_peer_never_connects_fails_at_twice_the_bound() {
    let listening = || {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        (
            super::listen::Listening::new(l, [7; super::TOKEN], 1).unwrap(),
            a,
        )
    };
    let (l, a) = listening();
    let fresh = end_in(State::Listening(l), 1, BYTES);
    let mut stranger = TcpStream::connect(a).unwrap();
    stranger.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(50) {
        fresh.progress().expect("a stranger fails nothing");
    }
    let (mut l, _) = listening();
    let waited = 2 * crate::param::bound() + Duration::from_secs(1);
    match Instant::now().checked_sub(waited) {
        Some(t) => l.since = t,
        // (A machine up for less than that.)
        None => return,
    }
    let e = end_in(State::Listening(l), 1, BYTES)
        .progress()
        .unwrap_err();
    assert_eq!(e.code, crate::error::Code::RemoteError, "{e}");
    assert!(
        e.msg.contains("from rank 0") && e.msg.contains("never connected"),
        "{e}"
    );
}

fn header(call: [u64; 2], bytes: usize) -> Vec<u8> {
    [call[0], call[1], bytes as u64]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect()
}

fn pattern(step: u64) -> Vec<u8> {
    pattern_of(step, BYTES)
}

fn pattern_of(step: u64, bytes: usize) -> Vec<u8> {
    (0..bytes)
        .map(|i| (i as u8).wrapping_mul(7) ^ step as u8)
        .collect()
}

/// Drives the end until `done` holds (5 s at most).
fn until(end: &NetEnd, done: impl Fn(&NetEnd) -> bool) {
    let t = Instant::now();
    while !done(end) {
        end.progress().unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the end never got there"
        );
        std::thread::yield_now();
    }
}

fn slot(end: &NetEnd, step: u64) -> Vec<u8> {
    // SAFETY: a published slot that nothing writes meanwhile.
    unsafe { std::slice::from_raw_parts(end.view.slot(step), end.view.slot_bytes) }.to_vec()
}

/// A slot named for memory arrives there; a revoke then copies it into the slot.
#[test]
fn a_named_slot_arrives_in_its_memory_and_a_revoke_moves_it_to_the_slot() {
    let (end, mut tx) = receiving_end();
    let mut mem = vec![0u8; BYTES];
    end.post_recv_ref(0, [1, 2], mem.as_mut_ptr(), BYTES);
    tx.write_all(&header([1, 2], BYTES)).unwrap();
    tx.write_all(&pattern(0)).unwrap();
    until(&end, |e| e.view.tail().load(Ordering::Acquire) == 1);
    assert!(end.view.delivered(0));
    assert_eq!(end.view.call_of(0), [1, 2]);
    assert!(mem == pattern(0));
    end.revoke_recv_refs();
    mem.fill(GONE);
    assert!(!end.view.delivered(0));
    assert!(slot(&end, 0) == pattern(0));
}

/// A slot from another call, or of another size, than named goes into the slot.
#[test]
fn a_slot_unlike_the_one_named_goes_into_the_slot() {
    let (end, mut tx) = receiving_end();
    let mut mem = vec![GONE; BYTES];
    end.post_recv_ref(0, [1, 2], mem.as_mut_ptr(), BYTES);
    end.post_recv_ref(1, [1, 3], mem.as_mut_ptr(), BYTES - 8);
    for s in 0..2 {
        tx.write_all(&header([1, 3], BYTES)).unwrap();
        tx.write_all(&pattern(s)).unwrap();
    }
    until(&end, |e| e.view.tail().load(Ordering::Acquire) == 2);
    for s in 0..2 {
        assert!(!end.view.delivered(s));
        assert!(slot(&end, s) == pattern(s));
    }
    assert!(mem.iter().all(|&b| b == GONE));
}

/// A revoke while a named slot is half read: the half read moves into the slot, the rest
/// follows it there, and the named memory is not written again.
#[test]
fn a_revoke_mid_slot_moves_what_arrived_and_the_rest_follows() {
    let (end, mut tx) = receiving_end();
    let mut mem = vec![0u8; BYTES];
    end.post_recv_ref(0, [1, 2], mem.as_mut_ptr(), BYTES);
    let data = pattern(0);
    tx.write_all(&header([1, 2], BYTES)).unwrap();
    tx.write_all(&data[..BYTES / 2 + 3]).unwrap();
    until(&end, |e| e.state.lock().p.done[0] == BYTES / 2 + 3);
    assert_eq!(mem[..BYTES / 2 + 3], data[..BYTES / 2 + 3]);
    end.revoke_recv_refs();
    mem.fill(GONE);
    tx.write_all(&data[BYTES / 2 + 3..]).unwrap();
    until(&end, |e| e.view.tail().load(Ordering::Acquire) == 1);
    assert!(!end.view.delivered(0));
    assert!(slot(&end, 0) == data);
    assert!(mem.iter().all(|&b| b == GONE));
}

/// A revoke once the header is in and nothing else: every byte goes into the slot.
#[test]
fn a_revoke_after_the_header_sends_the_whole_slot_to_the_slot() {
    let (end, mut tx) = receiving_end();
    let mut mem = vec![0u8; BYTES];
    end.post_recv_ref(0, [1, 2], mem.as_mut_ptr(), BYTES);
    tx.write_all(&header([1, 2], BYTES)).unwrap();
    until(&end, |e| {
        matches!(e.state.lock().p.target, Target::Caller(_))
    });
    end.revoke_recv_refs();
    mem.fill(GONE);
    tx.write_all(&pattern(0)).unwrap();
    until(&end, |e| e.view.tail().load(Ordering::Acquire) == 1);
    assert!(!end.view.delivered(0));
    assert!(slot(&end, 0) == pattern(0));
    assert!(mem.iter().all(|&b| b == GONE));
}

/// A slot cut into parts over two sockets, both half read at the revoke: each part's bytes
/// so far move into the slot, the rest follows there.
#[test]
fn a_revoke_mid_slot_over_two_sockets_moves_each_part() {
    let bytes = 256 << 10;
    let (end, mut tx) = receiving_end_of(2, bytes);
    assert_eq!(wire::parts(bytes, 2), 2);
    let mid = wire::part_start(bytes, 2, 1);
    let mut mem = vec![0u8; bytes];
    end.post_recv_ref(0, [1, 2], mem.as_mut_ptr(), bytes);
    let data = pattern_of(0, bytes);
    tx[0].write_all(&header([1, 2], bytes)).unwrap();
    tx[0].write_all(&data[..1000]).unwrap();
    tx[1].write_all(&data[mid..mid + 3000]).unwrap();
    until(&end, |e| e.state.lock().p.done == [1000, 3000]);
    end.revoke_recv_refs();
    mem.fill(GONE);
    tx[0].write_all(&data[1000..mid]).unwrap();
    tx[1].write_all(&data[mid + 3000..]).unwrap();
    until(&end, |e| e.view.tail().load(Ordering::Acquire) == 1);
    assert!(!end.view.delivered(0));
    assert!(slot(&end, 0) == data);
    assert!(mem.iter().all(|&b| b == GONE));
}

/// A revoke finds a delivered slot's bytes where they went, not where its cell names now: the
/// cell is shared with the slot `nsteps` later, named here (against `post_recv_ref`'s rule,
/// to show the revoke does not depend on it) before slot 0 is taken.
#[test]
fn a_revoke_copies_from_where_the_slot_went_not_from_its_cell() {
    let (end, mut tx) = receiving_end();
    let mut first = vec![0u8; BYTES];
    let later = vec![GONE; BYTES];
    end.post_recv_ref(0, [1, 2], first.as_mut_ptr(), BYTES);
    tx.write_all(&header([1, 2], BYTES)).unwrap();
    tx.write_all(&pattern(0)).unwrap();
    until(&end, |e| e.view.tail().load(Ordering::Acquire) == 1);
    assert!(end.view.delivered(0));
    end.post_recv_ref(NSTEPS as u64, [1, 2], later.as_ptr() as *mut u8, BYTES);
    end.revoke_recv_refs();
    assert!(!end.view.delivered(0));
    assert!(slot(&end, 0) == pattern(0));
    assert!(later.iter().all(|&b| b == GONE));
}

/// A sending end's connect to a receiving end that does not answer (its listener's queue is
/// full: the kernel drops the request) ends when the communicator is aborted, not at
/// `OXCCL_BOOTSTRAP_CONNECT_S`; a refusal (the receiving end is gone) ends it at once.
#[test]
fn a_sending_ends_connect_ends_at_an_abort_or_a_refusal() {
    use crate::transport::{tests::spec_for_tests, Transport};
    use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, SockaddrIn};
    use std::os::fd::AsRawFd;
    let spec = |health| spec_for_tests(true, NSTEPS, BYTES, health);
    let blob = |addr: std::net::SocketAddr| {
        let mut b = vec![7u8; super::TOKEN];
        b.push(1);
        b.extend_from_slice(addr.to_string().as_bytes());
        b
    };
    // A listener with room for two connections in its queue, which two take (a request
    // past a full queue is dropped, whatever the SYN cookie setting).
    let fd = socket::socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    socket::bind(fd.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, 0)).unwrap();
    socket::listen(&fd, Backlog::new(1).unwrap()).unwrap();
    let at: SockaddrIn = socket::getsockname(fd.as_raw_fd()).unwrap();
    let addr = std::net::SocketAddr::V4(at.into());
    let _queued = [
        TcpStream::connect(addr).unwrap(),
        TcpStream::connect(addr).unwrap(),
    ];
    let health = std::sync::Arc::new(crate::health::Health::default());
    let (ep, _) = super::Net.setup(&spec(Some(health.clone()))).unwrap();
    let h = health.clone();
    let aborter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        h.abort();
    });
    let t = Instant::now();
    let e = ep.connect(&blob(addr)).map(|_| ()).unwrap_err();
    aborter.join().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(e.code, crate::error::Code::InvalidUsage, "{e}");
    assert!(e.msg.contains("aborted"), "{e}");
    // Nobody listens there any more: refused at once.
    drop(fd);
    let (ep, _) = super::Net.setup(&spec(None)).unwrap();
    let t = Instant::now();
    let e = ep.connect(&blob(addr)).map(|_| ()).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert_eq!(e.code, crate::error::Code::RemoteError, "{e}");
    assert!(e.msg.contains("connecting to rank 1"), "{e}");
}
