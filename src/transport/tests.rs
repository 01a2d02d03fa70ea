//! The transport seam: ends set up by their transports, paired through the bootstrap in one
//! exchange, and data moving over what they made; failures on one end reach the other.

use super::conns::{connect_all, Conns};
use super::peer::PeerInfo;
use super::{pick, Class, ConnKey, ConnSpec, Locality};
use crate::bootstrap::{Bootstrap, UniqueId};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(30);

/// Runs `f` on every rank of an `n`-rank communicator of this process (a thread each), with
/// the peers' facts `peer` gives (this process's, unless changed).
fn ranks<R: Send>(
    n: usize,
    peer: impl Fn(usize) -> PeerInfo + Sync,
    f: impl Fn(Conns) -> R + Sync,
) -> Vec<R> {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (f, peer) = (&f, &peer);
                sc.spawn(move || {
                    let b = Bootstrap::init_with_timeout(
                        &[id],
                        r,
                        n,
                        Arc::new(AtomicBool::new(false)),
                        T,
                    )
                    .unwrap();
                    let peers = (0..n).map(peer).collect();
                    let hash = b.comm_hash();
                    f(Conns::new(b, peers, hash, Default::default()))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank `r`'s facts, on a host of its own (so its peers reach it over the network).
fn own_host(r: usize) -> PeerInfo {
    let mut p = PeerInfo::mine(-1);
    p.host ^= r as u64 + 1;
    p
}

/// This rank's point-to-point ends with `peer`, both set up in one exchange: (send, receive).
fn p2p_both_ways(c: &Conns, peer: usize) -> (Arc<super::Conn>, Arc<super::Conn>) {
    let keys = vec![key(peer, true, Class::P2p), key(peer, false, Class::P2p)];
    connect_all(&[(c, keys)]).unwrap();
    (
        c.bound(key(peer, true, Class::P2p)).unwrap(),
        c.bound(key(peer, false, Class::P2p)).unwrap(),
    )
}

fn key(peer: usize, is_sender: bool, class: Class) -> ConnKey {
    ConnKey::new(peer, is_sender, class)
}

/// Three ranks connect a ring (to the next, from the previous) and a point-to-point pair in one
/// exchange each; every slot written arrives, in order, at the other end.
#[test]
fn ends_pair_through_the_bootstrap_and_carry_data() {
    let n = 3;
    let got = ranks(
        n,
        |_| PeerInfo::mine(-1),
        |c| {
            let r = c.rank;
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let mut keys = vec![key(next, true, Class::Ring), key(prev, false, Class::Ring)];
            // Rank 0 sends to rank 2 on the point-to-point class too.
            match r {
                0 => keys.push(key(2, true, Class::P2p)),
                2 => keys.push(key(0, false, Class::P2p)),
                _ => {}
            }
            // Asking twice for the same end makes it once.
            keys.push(keys[0]);
            let missing = c.missing(keys.clone());
            assert_eq!(missing.len(), keys.len() - 1);
            connect_all(&[(&c, missing)]).unwrap();
            assert!(c.missing(keys).is_empty());
            let send = c.bound(key(next, true, Class::Ring)).unwrap();
            let recv = c.bound(key(prev, false, Class::Ring)).unwrap();
            assert_eq!(send.locality(), Locality::SameProcess);
            // Three slots each way: the value names sender and step.
            let mut seen = Vec::new();
            let deadline = Instant::now() + T;
            let (mut sent, mut step) = (0u64, 0u64);
            while (seen.len() < 3 || sent < 3) && Instant::now() < deadline {
                if sent < 3 {
                    if let Some((s, slot)) = send.send_slot() {
                        // SAFETY: a free slot of `slot_bytes`, ours until posted.
                        unsafe { (slot as *mut u64).write(100 * r as u64 + s) };
                        send.post_send(s, [0; 2], 0);
                        sent += 1;
                    }
                }
                if let Some((s, slot)) = recv.recv_slot() {
                    // SAFETY: a filled slot, ours until posted.
                    seen.push(unsafe { (slot as *const u64).read() });
                    recv.post_recv(s);
                    step += 1;
                }
            }
            assert_eq!(step, 3, "rank {r} received {seen:?}");
            assert!(c.bound(key(1, true, Class::Direct)).is_err());
            (r, seen)
        },
    );
    for (r, seen) in got {
        let prev = ((r + n - 1) % n) as u64;
        assert_eq!(
            seen,
            vec![100 * prev, 100 * prev + 1, 100 * prev + 2],
            "rank {r}"
        );
    }
}

/// An end whose set-up fails says why, naming the peer, and its peer fails too, at once,
/// rather than waiting: rank 1 (on another host) cannot listen on the address it is given.
#[test]
fn an_end_that_fails_fails_its_peer_without_waiting() {
    let t0 = Instant::now();
    let errs = ranks(
        2,
        |r| {
            let mut p = PeerInfo::mine(-1);
            p.host ^= r as u64; // rank 1 is on another host
            p
        },
        |mut c| {
            assert_eq!(c.locality(1 - c.rank), Locality::OtherHost);
            if c.rank == 1 {
                // TEST-NET-3: not an address of this machine.
                c.local_ip = std::net::Ipv4Addr::new(203, 0, 113, 77).into();
            }
            let k = key(1 - c.rank, c.rank == 0, Class::Ring);
            connect_all(&[(&c, vec![k])]).unwrap_err()
        },
    );
    assert!(
        errs[0].msg.contains("rank 1 could not set up its end"),
        "rank 0: {}",
        errs[0]
    );
    assert!(
        errs[1].msg.contains("listening for rank 0 on 203.0.113.77"),
        "rank 1: {}",
        errs[1]
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

/// A ring connection's end between ranks 0 (this one) and 1 on host memory, watching `health`.
pub(crate) fn spec_for_tests(
    is_sender: bool,
    nsteps: usize,
    slot_bytes: usize,
    health: Option<std::sync::Arc<crate::health::Health>>,
) -> ConnSpec {
    ConnSpec {
        local_ip: std::net::Ipv4Addr::LOCALHOST.into(),
        comm_hash: 0x7e57_7e57,
        me: 0,
        peer: 1,
        is_sender,
        class: Class::Ring,
        nsteps,
        slot_bytes,
        same_device: false,
        peer_device: false,
        shared_blocks: true,
        ipc: false,
        peer_pid: 0,
        peer_host: "elsewhere".into(),
        health,
    }
}

/// The transports cover every locality, and an end given a blob for another connection refuses
/// it.
#[test]
fn each_locality_has_its_transport_and_blobs_are_checked() {
    let me = PeerInfo::mine(-1);
    let mut other_proc = me.clone();
    other_proc.pid ^= 1;
    let mut other_host = me.clone();
    other_host.host ^= 1;
    assert_eq!(pick(&me, &me).unwrap().name(), "in-process");
    assert_eq!(pick(&me, &other_proc).unwrap().name(), "shared memory");
    assert_eq!(pick(&me, &other_host).unwrap().name(), "network");
    let spec = |is_sender| spec_for_tests(is_sender, 2, 4096, None);
    let t = pick(&me, &me).unwrap();
    let (ep, _) = t.setup(&spec(true)).unwrap();
    assert!(ep.connect(b"oxccl-somewhere-else").is_err());
    // A network end given a malformed address fails; a receiving end hands out its address.
    let net = pick(&me, &other_host).unwrap();
    let (ep, _) = net.setup(&spec(true)).unwrap();
    assert!(ep.connect(b"short").is_err());
    // Its blob: the token (16 bytes), its number of sockets, its address.
    let (_, blob) = net.setup(&spec(false)).unwrap();
    assert_eq!(blob[16], 1, "sockets per connection");
    let addr = std::str::from_utf8(&blob[17..]).unwrap();
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
}

/// The ring groups each host's ranks (hosts in the order of their first rank), so that it
/// crosses each host boundary once; rank order stays where it does already.
#[test]
fn rings_keep_a_hosts_ranks_together() {
    let on = |hosts: &[u64]| {
        let peers: Vec<PeerInfo> = hosts
            .iter()
            .map(|&h| {
                let mut p = PeerInfo::mine(-1);
                p.host = h;
                p
            })
            .collect();
        super::conns::ring_order(&peers)
    };
    assert_eq!(on(&[1, 1, 2, 2]), None);
    assert_eq!(on(&[1, 2, 1, 2]), Some(vec![0, 2, 1, 3]));
    assert_eq!(on(&[5, 3, 5, 3, 5, 3]), Some(vec![0, 2, 4, 1, 3, 5]));
}

/// Two ranks on different hosts: the reverse of a network connection shares its sockets,
/// whether it is made in the same exchange (class P2p, both ways at once) or in a later one
/// (class Direct: 0 -> 1 first, 1 -> 0 afterwards); slots move both ways on each, in order,
/// and each rank's two ends name the same sockets (so TCP carries each direction's
/// acknowledgements in the other's packets).
#[test]
fn reverse_network_connections_share_sockets_and_carry_data() {
    let slots = |send: &super::Conn, recv: &super::Conn, me: u64| {
        let (mut sent, mut got) = (0u64, Vec::new());
        let deadline = Instant::now() + T;
        while (sent < 3 || got.len() < 3) && Instant::now() < deadline {
            if sent < 3 {
                if let Some((s, slot)) = send.send_slot() {
                    // SAFETY: a free slot of `slot_bytes`, ours until posted.
                    unsafe { (slot as *mut u64).write(100 * me + s) };
                    send.post_send(s, [0; 2], 8);
                    sent += 1;
                }
            }
            if let Some((s, slot)) = recv.recv_slot() {
                // SAFETY: a filled slot, ours until posted.
                got.push(unsafe { (slot as *const u64).read() });
                recv.post_recv(s);
            }
            recv.drive();
            send.drive();
        }
        got
    };
    let got = ranks(2, own_host, |c| {
        let (me, peer) = (c.rank, 1 - c.rank);
        // Both ways in one exchange.
        let (send, recv) = p2p_both_ways(&c, peer);
        assert_eq!(c.locality(peer), Locality::OtherHost);
        let a = slots(&send, &recv, me as u64);
        let shared = |send: &super::Conn, recv: &super::Conn| {
            let s = send.sockets();
            assert_eq!(s.len(), 1, "rank {me}: {s:?}");
            assert_eq!(s, recv.sockets(), "rank {me}");
        };
        shared(&send, &recv);
        // One way, then the other in a later exchange.
        connect_all(&[(&c, vec![key(peer, me == 0, Class::Direct)])]).unwrap();
        connect_all(&[(&c, vec![key(peer, me == 1, Class::Direct)])]).unwrap();
        let send = c.bound(key(peer, true, Class::Direct)).unwrap();
        let recv = c.bound(key(peer, false, Class::Direct)).unwrap();
        let b = slots(&send, &recv, me as u64);
        shared(&send, &recv);
        (me, a, b)
    });
    for (me, a, b) in got {
        let want: Vec<u64> = (0..3).map(|s| 100 * (1 - me as u64) + s).collect();
        assert_eq!(a, want, "rank {me}, both ways at once");
        assert_eq!(b, want, "rank {me}, one way after the other");
    }
}

/// A rank that tears its connections down right after its last sends loses none of them, even
/// with bytes from its peer left unread on the shared socket (closing such a socket resets the
/// connection, which drops whatever is still queued to go; the teardown therefore waits until
/// the peer has acknowledged every byte): rank 1 fills rank 0's side with slots rank 0 never
/// reads, rank 0 posts full slots for a moment and tears down at once, and rank 1, reading only
/// after a pause, must get every one, in order, and see the reset as the end of the stream.
/// (On loopback the kernel sends what the window allows within the write, so this run passes
/// without the wait too; it checks the path, the wait itself follows Linux's tcp_close.)
#[test]
fn a_teardown_delivers_every_slot_despite_unread_bytes() {
    const END: u64 = u64::MAX;
    let got = ranks(2, own_host, |c| {
        let (me, peer) = (c.rank, 1 - c.rank);
        let (send, recv) = p2p_both_ways(&c, peer);
        let bytes = c.slot_bytes;
        let mut seen = Vec::new();
        if me == 1 {
            // Small slots rank 0 will never read, more than its FIFO holds.
            let t0 = Instant::now();
            let mut s = 0;
            while s < 4 * c.nsteps && t0.elapsed() < Duration::from_secs(5) {
                if let Some((step, _)) = send.send_slot() {
                    send.post_send(step, [0; 2], 8);
                    s += 1;
                }
                send.drive();
            }
            std::thread::sleep(Duration::from_millis(300));
            let deadline = Instant::now() + T;
            while seen.last() != Some(&END) && Instant::now() < deadline {
                if let Some((step, slot)) = recv.recv_slot() {
                    // SAFETY: a filled slot, ours until posted.
                    seen.push(unsafe { (slot as *const u64).read() });
                    recv.post_recv(step);
                } else {
                    assert!(
                        !recv.peer_closed(),
                        "rank 0 closed after {} slots",
                        seen.len()
                    );
                    recv.drive();
                }
            }
        } else {
            // Full slots for 100 ms (what the sockets take), then the end marker.
            let t0 = Instant::now();
            let mut n = 0u64;
            loop {
                let last = t0.elapsed() > Duration::from_millis(100);
                if let Some((step, slot)) = send.send_slot() {
                    // SAFETY: a free slot of `bytes`, ours until posted.
                    unsafe { (slot as *mut u64).write(if last { END } else { n }) };
                    send.post_send(step, [0; 2], bytes);
                    n += 1;
                    if last {
                        break;
                    }
                }
                send.drive();
            }
        }
        drop((send, recv));
        c.teardown(true);
        seen
    });
    let seen = &got[1];
    assert_eq!(seen.last(), Some(&END), "rank 1 got {} slots", seen.len());
    let n = seen.len() as u64 - 1;
    assert!(
        n > 0 && seen[..n as usize].iter().copied().eq(0..n),
        "{seen:?}"
    );
}

/// A receiving end's blob may carry the IPC handle of its connection in device memory after
/// the name (whose bytes are never 0); a sending end's is the name alone.
#[test]
fn a_blob_is_a_name_and_maybe_a_handle() {
    let name = super::conn_name(0xfeed, 1, 2, Class::Ring);
    assert!(!name.as_bytes().contains(&super::HANDLE_MARK));
    assert_eq!(super::split_blob(name.as_bytes()), (name.as_bytes(), None));
    let mut handle = [0u8; 64];
    handle[10] = 7; // handles hold zeros too
    let mut blob = name.as_bytes().to_vec();
    blob.push(super::HANDLE_MARK);
    blob.extend_from_slice(&handle);
    assert_eq!(
        super::split_blob(&blob),
        (name.as_bytes(), Some(&handle[..]))
    );
}

/// A network sending end takes slots by reference (`post_send_ref`): the receiver gets the
/// bytes the caller's memory held, and slots settled before they left (`settle_refs`) keep
/// them after the caller has overwritten and freed that memory. Rank 0 posts slots, each
/// referring to a buffer of its own, until its FIFO stays full (rank 1 reads nothing, so the
/// sockets fill up); it settles, overwrites and frees the buffers, then lets rank 1 read.
#[test]
fn slots_sent_by_reference_arrive_and_settled_ones_outlive_the_callers_memory() {
    use std::sync::atomic::{AtomicU64, Ordering};
    static POSTED: AtomicU64 = AtomicU64::new(0);
    let pattern = |s: u64, i: usize| (s as u8).wrapping_mul(31) ^ (i as u8);
    let got = ranks(2, own_host, |c| {
        let (me, peer) = (c.rank, 1 - c.rank);
        let (send, recv) = p2p_both_ways(&c, peer);
        let bytes = c.slot_bytes;
        let deadline = Instant::now() + T;
        if me == 0 {
            assert!(send.sends_by_reference());
            let mut bufs = Vec::new();
            let mut full_since = Instant::now();
            while full_since.elapsed() < Duration::from_millis(100) && Instant::now() < deadline {
                match send.send_slot() {
                    Some((s, _)) => {
                        let b: Vec<u8> = (0..bytes).map(|i| pattern(s, i)).collect();
                        send.post_send_ref(s, [7, 9], b.as_ptr(), bytes);
                        bufs.push(b);
                        full_since = Instant::now();
                    }
                    None => send.drive(),
                }
            }
            let unsent = send.tail().load(Ordering::Acquire) - send.head().load(Ordering::Acquire);
            send.settle_refs();
            for b in &mut bufs {
                b.fill(0xee);
            }
            let n = bufs.len() as u64;
            drop(bufs);
            POSTED.store(n, Ordering::Release);
            while send.head().load(Ordering::Acquire) < n && Instant::now() < deadline {
                send.drive();
            }
            return (unsent, Vec::new(), n);
        }
        while POSTED.load(Ordering::Acquire) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let posted = POSTED.load(Ordering::Acquire);
        let mut wrong = Vec::new();
        let mut n = 0;
        while n < posted && Instant::now() < deadline {
            if let Some((s, slot)) = recv.recv_slot() {
                assert_eq!(recv.call_of(s), [7, 9]);
                // SAFETY: a filled slot of `bytes`, ours until posted.
                let got = unsafe { std::slice::from_raw_parts(slot, bytes) };
                if let Some(i) = (0..bytes).find(|&i| got[i] != pattern(s, i)) {
                    wrong.push((s, i, got[i]));
                }
                recv.post_recv(s);
                n += 1;
            }
            recv.drive();
        }
        (0, wrong, n)
    });
    assert_eq!(got[1].2, got[0].2, "slots received against slots posted");
    assert!(
        got[1].1.is_empty(),
        "wrong bytes (step, index, byte): {:?}",
        got[1].1
    );
    // Else the settling went untested.
    assert!(got[0].0 > 0, "every slot left before the settling");
    assert_eq!(
        got[0].0,
        crate::param::nsteps() as u64,
        "the FIFO was not full"
    );
}

/// A network receiving end reads a slot into the memory named for it (`post_recv_ref`) when
/// the slot's call and byte count match what was named, into the slot otherwise; a revoke
/// (`revoke_recv_refs`) moves into their slots the bytes read into named memory and not taken
/// yet, and that memory is never written again (a slot half read: `net::tests`). Rank 0 sends
/// slots as fast as it can; rank 1 names memory for each slot `nsteps` ahead, as the host
/// executor does, and revokes everything it named every 20 slots.
#[test]
fn slots_received_by_reference_land_where_named_and_revoked_ones_in_their_slots() {
    const N: u64 = 240;
    const GONE: u8 = 0xa5;
    const EVERY: u64 = 20;
    let pattern = |s: u64, i: usize| (s as u8).wrapping_mul(37) ^ (i as u8).rotate_left(3);
    // Every 7th slot comes from another call, every 11th is shorter: neither goes where named.
    let call = |s: u64| [5, u64::from(s % 7 == 3)];
    let got = ranks(2, own_host, |c| {
        let (send, recv) = p2p_both_ways(&c, 1 - c.rank);
        let bytes = c.slot_bytes;
        let len = |s: u64| if s % 11 == 5 { bytes - 64 } else { bytes };
        let deadline = Instant::now() + T;
        if c.rank == 0 {
            let mut s = 0;
            while s < N && Instant::now() < deadline {
                if let Some((step, slot)) = send.send_slot() {
                    // SAFETY: a free slot of `bytes`, ours until posted.
                    let out = unsafe { std::slice::from_raw_parts_mut(slot, len(step)) };
                    out.iter_mut()
                        .enumerate()
                        .for_each(|(i, b)| *b = pattern(step, i));
                    send.post_send(step, call(step), len(step));
                    s += 1;
                }
                send.drive();
            }
            while send.head().load(std::sync::atomic::Ordering::Acquire) < N
                && Instant::now() < deadline
            {
                send.drive();
            }
            return (0, 0, Vec::new());
        }
        assert!(recv.receives_by_reference());
        let mut mem: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; bytes]).collect();
        let nsteps = recv.nsteps;
        let name = |s: u64, m: &mut Vec<Vec<u8>>| {
            if s < N {
                recv.post_recv_ref(s, [5, 0], m[s as usize].as_mut_ptr(), bytes);
            }
        };
        (0..nsteps).for_each(|s| name(s, &mut mem));
        let (mut delivered, mut revoked) = (0, 0);
        let mut wrong = Vec::new();
        let mut s = 0;
        while s < N && Instant::now() < deadline {
            let Some((step, slot)) = recv.recv_slot() else {
                recv.drive();
                continue;
            };
            assert_eq!((step, recv.call_of(step)), (s, call(s)));
            let from_mem = recv.delivered(step);
            let data = if from_mem {
                delivered += 1;
                if call(s)[1] != 0 || len(s) != bytes {
                    wrong.push((s, usize::MAX, 0));
                }
                &mem[s as usize][..]
            } else {
                // SAFETY: a filled slot of `bytes`, ours until posted.
                unsafe { std::slice::from_raw_parts(slot, len(s)) }
            };
            if let Some(i) = (0..len(s)).find(|&i| data[i] != pattern(s, i)) {
                wrong.push((s, i, data[i]));
            }
            if s % EVERY == EVERY - 1 {
                // Everything named after this slot goes back; its memory is spoiled at once.
                // Every other time the slot is freed first: the end is likely reading the
                // next one then.
                if revoked % 2 == 1 {
                    recv.post_recv(step);
                }
                recv.revoke_recv_refs();
                for m in &mut mem[s as usize + 1..] {
                    m.fill(GONE);
                }
                if revoked % 2 == 0 {
                    recv.post_recv(step);
                }
                revoked += 1;
            } else {
                name(s + nsteps, &mut mem);
                recv.post_recv(step);
            }
            s += 1;
        }
        assert_eq!(s, N, "slots received");
        // Memory named and revoked (and the slot after, never named): still spoiled.
        std::thread::sleep(Duration::from_millis(20));
        for r in 1..=revoked {
            let first = EVERY * r;
            for t in first..(first + nsteps).min(N) {
                if mem[t as usize].iter().any(|&b| b != GONE) {
                    wrong.push((t, 0, 1));
                }
            }
        }
        (delivered, revoked, wrong)
    });
    let (delivered, revoked, wrong) = &got[1];
    assert!(wrong.is_empty(), "wrong (slot, index, byte): {wrong:?}");
    assert_eq!(*revoked, N / EVERY);
    // Most slots that could go where named did.
    let eligible = (0..N).filter(|s| s % 7 != 3 && s % 11 != 5).count() as u64;
    assert!(
        *delivered > eligible / 2,
        "{delivered} of {eligible} slots read into named memory"
    );
}
