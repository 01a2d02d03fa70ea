//! In-process tests: threads play the ranks.

use super::*;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

const T: Duration = Duration::from_secs(60);

fn no_abort() -> Arc<AtomicBool> {
    Arc::new(AtomicBool::new(false))
}

/// Runs `f` on every rank (one thread each) after a successful init; results by rank.
fn run_ranks<R: Send>(
    ids: &[UniqueId],
    nranks: usize,
    f: impl Fn(Bootstrap) -> R + Sync,
) -> Vec<R> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..nranks)
            .map(|r| {
                let f = &f;
                sc.spawn(move || {
                    let b = Bootstrap::init_with_timeout(ids, r, nranks, no_abort(), T)
                        .unwrap_or_else(|e| panic!("rank {r}: init failed: {e}"));
                    assert_eq!(b.rank(), r);
                    assert_eq!(b.nranks(), nranks);
                    f(b)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn payload(r: usize, salt: usize) -> Vec<u8> {
    let len = (r * 37 + salt * 11) % 301 + (r % 3);
    (0..len)
        .map(|i| (r * 131 + i * 7 + salt * 13) as u8)
        .collect()
}

/// Allgather, barrier, point-to-point with out-of-order tags; returns the comm hash.
fn exercise(b: Bootstrap) -> u64 {
    let n = b.nranks();
    let r = b.rank();
    for salt in 0..3 {
        let all = b.allgather(&payload(r, salt)).unwrap();
        assert_eq!(all.len(), n);
        for (q, got) in all.iter().enumerate() {
            assert_eq!(got, &payload(q, salt), "rank {r}: block of rank {q}");
        }
    }
    b.barrier().unwrap();
    // Ring both ways, several tags; the receiver asks in another order than the sender sent.
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    b.send(next, 5, format!("first 5 from {r}").as_bytes())
        .unwrap();
    b.send(next, 3, format!("3 from {r}").as_bytes()).unwrap();
    b.send(next, 5, format!("second 5 from {r}").as_bytes())
        .unwrap();
    b.send(prev, 9, &payload(r, 7)).unwrap();
    assert_eq!(b.recv(next, 9).unwrap(), payload(next, 7));
    assert_eq!(
        b.recv(prev, 3).unwrap(),
        format!("3 from {prev}").as_bytes()
    );
    assert_eq!(
        b.recv(prev, 5).unwrap(),
        format!("first 5 from {prev}").as_bytes()
    );
    assert_eq!(
        b.recv(prev, 5).unwrap(),
        format!("second 5 from {prev}").as_bytes()
    );
    b.barrier().unwrap();
    let hashes = b.allgather(&b.comm_hash().to_le_bytes()).unwrap();
    for h in &hashes {
        assert_eq!(h, &b.comm_hash().to_le_bytes());
    }
    b.comm_hash()
}

#[test]
fn rendezvous_1_2_3_4_8() {
    for n in [1, 2, 3, 4, 8] {
        let id = UniqueId::generate_with_timeout(T).unwrap();
        let hashes = run_ranks(&[id], n, exercise);
        assert!(hashes.iter().all(|&h| h == hashes[0]));
        assert_eq!(hashes[0], id::fnv1a(&id.secret()));
    }
}

#[test]
fn allgather_64_ranks() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let n = 64;
    run_ranks(&[id], n, |b| {
        let r = b.rank();
        let all = b.allgather(&payload(r, 1)).unwrap();
        for (q, got) in all.iter().enumerate() {
            assert_eq!(got, &payload(q, 1));
        }
        b.barrier().unwrap();
    });
}

#[test]
fn scalable_init_2_and_3_ids() {
    for (nids, n) in [(2, 2), (2, 5), (3, 3), (3, 7), (3, 8)] {
        let ids: Vec<UniqueId> = (0..nids)
            .map(|_| UniqueId::generate_with_timeout(T).unwrap())
            .collect();
        let hashes = run_ranks(&ids, n, exercise);
        assert!(hashes.iter().all(|&h| h == id::fnv1a(&ids[0].secret())));
    }
}

#[test]
fn distinct_ids_distinct_hashes() {
    let a = UniqueId::generate_with_timeout(T).unwrap();
    let b = UniqueId::generate_with_timeout(T).unwrap();
    assert_ne!(a.secret(), b.secret());
    let ha = run_ranks(&[a], 1, |b| b.comm_hash());
    let hb = run_ranks(&[b], 1, |b| b.comm_hash());
    assert_ne!(ha, hb);
}

#[test]
fn from_bytes_validates() {
    let e = UniqueId::from_bytes(&[0u8; ID_BYTES]).unwrap_err();
    assert_eq!(e.code, Code::InvalidArgument);
    assert!(e.msg.contains("magic"), "{}", e.msg);
    let id = UniqueId::generate_with_timeout(Duration::from_secs(1)).unwrap();
    let back = UniqueId::from_bytes(&id.to_bytes()).unwrap();
    assert_eq!(back, id);
    // On the interface NCCL would pick (loopback only where there is nothing else).
    assert!(!back.root_addr().ip().is_unspecified());
    assert_eq!(
        format!("{id:?}"),
        format!("UniqueId(root {})", back.root_addr())
    );
    let mut junk = id.to_bytes();
    junk[0] ^= 0xff;
    assert_eq!(
        UniqueId::from_bytes(&junk).unwrap_err().code,
        Code::InvalidArgument
    );
}

#[test]
fn bad_arguments() {
    let id = UniqueId::generate_with_timeout(Duration::from_secs(5)).unwrap();
    let a = no_abort();
    let e = |r: std::result::Result<Bootstrap, Error>| r.err().unwrap().code;
    assert_eq!(
        e(Bootstrap::init(&[], 0, 1, a.clone())),
        Code::InvalidArgument
    );
    assert_eq!(
        e(Bootstrap::init(&[id], 1, 1, a.clone())),
        Code::InvalidArgument
    );
    assert_eq!(
        e(Bootstrap::init(&[id, id], 0, 1, a.clone())),
        Code::InvalidArgument
    );
    run_ranks(&[id], 1, |b| {
        assert_eq!(b.send(1, 0, b"x").unwrap_err().code, Code::InvalidArgument);
        assert_eq!(
            b.send(0, TAG_RESERVED | 4, b"x").unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(
            b.recv(0, TAG_RESERVED).unwrap_err().code,
            Code::InvalidArgument
        );
        // Sending to oneself works.
        b.send(0, 1, b"self").unwrap();
        assert_eq!(b.recv(0, 1).unwrap(), b"self");
    });
}

#[test]
fn wrong_secret_is_refused_by_root() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let mut forged = id.to_bytes();
    forged[40] ^= 0x5a; // inside the secret
    let forged = UniqueId::from_bytes(&forged).unwrap();
    let t0 = Instant::now();
    let e = Bootstrap::init_with_timeout(&[forged], 0, 2, no_abort(), T)
        .err()
        .unwrap();
    assert_eq!(e.code, Code::RemoteError, "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10));
    // A raw client with a wrong secret is dropped too, without a word.
    let mut raw = TcpStream::connect(id.root_addr()).unwrap();
    let mut hs = root::handshake(&[9u8; SECRET_BYTES], root::KIND_RANK);
    hs.extend_from_slice(&[0u8; root::RANK_HELLO_BYTES]);
    raw.write_all(&hs).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 16];
    assert!(matches!(raw.read(&mut buf), Ok(0) | Err(_)));
    // The root still serves the real ranks.
    run_ranks(&[id], 2, exercise);
}

#[test]
fn wrong_secret_is_refused_by_peer() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    run_ranks(&[id], 2, |b| {
        if b.rank() == 1 {
            let addr = b.peer_addrs()[0];
            let mut raw = TcpStream::connect(addr).unwrap();
            let mut msg = peer::peer_handshake(&[3u8; SECRET_BYTES], 1, 2);
            msg.extend_from_slice(&peer::frame_header(7, 5));
            msg.extend_from_slice(b"forge");
            raw.write_all(&msg).unwrap();
            raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut buf = [0u8; 4];
            assert!(matches!(raw.read(&mut buf), Ok(0) | Err(_)));
            b.barrier().unwrap();
            b.send(0, 7, b"real").unwrap();
        } else {
            b.barrier().unwrap();
            assert_eq!(b.recv(1, 7).unwrap(), b"real");
        }
        b.barrier().unwrap();
    });
}

#[test]
fn missing_rank_times_out() {
    let short = Duration::from_millis(1500);
    let id = UniqueId::generate_with_timeout(short).unwrap();
    let t0 = Instant::now();
    let errs: Vec<Error> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                sc.spawn(move || {
                    Bootstrap::init_with_timeout(&[id], r, 3, no_abort(), short)
                        .err()
                        .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    for e in errs {
        assert_eq!(e.code, Code::Timeout, "{e}");
        assert!(e.msg.contains("waited 1.5 s"), "{e}");
        // The root's report names the missing rank; the rank's own names the rendezvous.
        assert!(
            e.msg.contains("rank(s) 2 of 3") || e.msg.contains("collect all 3 ranks"),
            "{e}"
        );
    }
}

#[test]
fn dead_root_times_out() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let id = UniqueId::from_bytes(&id::encode(&port, &[1u8; SECRET_BYTES])).unwrap();
    let t0 = Instant::now();
    let e = Bootstrap::init_with_timeout(&[id], 0, 2, no_abort(), Duration::from_millis(500))
        .err()
        .unwrap();
    assert_eq!(e.code, Code::Timeout);
    assert!(
        e.msg.contains("rank 0 waited") && e.msg.contains("bootstrap root"),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn abort_stops_waiting_init() {
    let id = UniqueId::generate_with_timeout(Duration::from_secs(5)).unwrap();
    let abort = no_abort();
    let t0 = Instant::now();
    let e = std::thread::scope(|sc| {
        let a = abort.clone();
        let h = sc.spawn(move || {
            Bootstrap::init_with_timeout(&[id], 0, 2, a, T)
                .err()
                .unwrap()
        });
        std::thread::sleep(Duration::from_millis(200));
        abort.store(true, Ordering::Release);
        h.join().unwrap()
    });
    assert_eq!(e.code, Code::InvalidUsage);
    assert!(e.msg.contains("aborted"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3));
}

#[test]
fn abort_stops_waiting_recv() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let abort = no_abort();
    let b = Bootstrap::init_with_timeout(&[id], 0, 1, abort.clone(), T).unwrap();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            abort.store(true, Ordering::Release);
        });
        let e = b.recv(0, 1).unwrap_err();
        assert_eq!(e.code, Code::InvalidUsage);
    });
}

#[test]
fn nranks_mismatch_fails_both() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let errs: Vec<Error> = std::thread::scope(|sc| {
        let hs: Vec<_> = [(0, 2), (1, 3)]
            .into_iter()
            .map(|(r, n)| {
                sc.spawn(move || {
                    Bootstrap::init_with_timeout(&[id], r, n, no_abort(), T)
                        .err()
                        .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert_eq!(e.code, Code::InvalidUsage, "{e}");
        assert!(e.msg.contains("nranks"), "{e}");
    }
}

#[test]
fn large_crossing_sends_do_not_deadlock() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let big = |r: usize| -> Vec<u8> {
        (0..(24 << 20) + r * 1001)
            .map(|i| (i * 31 + r * 17 + (i >> 12)) as u8)
            .collect()
    };
    run_ranks(&[id], 2, |b| {
        let r = b.rank();
        let o = 1 - r;
        b.send(o, 1, &big(r)).unwrap();
        b.send(o, 2, b"tail").unwrap();
        assert_eq!(b.recv(o, 2).unwrap(), b"tail");
        assert!(b.recv(o, 1).unwrap() == big(o));
    });
}

#[test]
fn closed_peer_is_remote_error() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    run_ranks(&[id], 2, |b| {
        if b.rank() == 1 {
            b.send(0, 1, b"bye").unwrap();
            drop(b);
        } else {
            assert_eq!(b.recv(1, 1).unwrap(), b"bye");
            let e = b.recv(1, 2).unwrap_err();
            assert_eq!(e.code, Code::RemoteError);
            assert!(e.msg.contains("rank 1 closed"), "{e}");
        }
    });
}

#[test]
fn recv_times_out_naming_peer() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let ids = [id];
    // Neither closes its bootstrap before both have timed out (a closed peer is another error).
    let both = std::sync::Barrier::new(2);
    std::thread::scope(|sc| {
        for r in 0..2 {
            let (ids, both) = (&ids, &both);
            sc.spawn(move || {
                let b = Bootstrap::init_with_timeout(ids, r, 2, no_abort(), Duration::from_secs(1))
                    .unwrap();
                b.send(1 - r, 0, b"keepalive").unwrap();
                let e = b.recv(1 - r, 4).unwrap_err();
                both.wait();
                assert_eq!(e.code, Code::Timeout);
                assert!(
                    e.msg
                        .contains(&format!("rank {r} waited 1 s for rank {}", 1 - r)),
                    "{e}"
                );
            });
        }
    });
}

/// A wait for a peer's message after the rendezvous is not held to the rendezvous' bound: a
/// peer that sends later than that (a pipeline stage's first send after a long compile) is
/// waited for while it is there. Rank 0 watches rank 1, which has no connection to it, through
/// a connection of its own from the first second on (`watch_link`): a live peer is no failure.
#[test]
fn a_late_peer_is_waited_for_past_the_setup_bound() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let ids = [id];
    let setup = Duration::from_secs(2);
    std::thread::scope(|sc| {
        for r in 0..2 {
            let ids = &ids;
            sc.spawn(move || {
                let forever = crate::param::FOREVER;
                let b =
                    Bootstrap::init_with_timeouts(ids, r, 2, no_abort(), setup, forever).unwrap();
                if r == 1 {
                    std::thread::sleep(Duration::from_millis(4500));
                    b.send(0, 4, b"late").unwrap();
                    assert_eq!(b.recv(0, 5).unwrap(), b"got it");
                } else {
                    let t0 = Instant::now();
                    assert_eq!(b.recv(1, 4).unwrap(), b"late");
                    assert!(t0.elapsed() > 2 * setup);
                    b.send(1, 5, b"got it").unwrap();
                }
            });
        }
    });
}

/// A peer that closes its bootstrap without ever having connected to this rank ends a wait
/// for its message at once (`RemoteError` naming it), not at the wait's bound (60 s here):
/// closed before this rank watches it (its listener refuses), and after (the watching
/// connection closes).
#[test]
fn a_peer_gone_before_it_ever_connected_ends_the_wait() {
    for delay in [Duration::ZERO, Duration::from_millis(2500)] {
        let id = UniqueId::generate_with_timeout(T).unwrap();
        let ids = [id];
        std::thread::scope(|sc| {
            for r in 0..2 {
                let ids = &ids;
                sc.spawn(move || {
                    let b = Bootstrap::init_with_timeouts(ids, r, 2, no_abort(), T, T).unwrap();
                    if r == 1 {
                        std::thread::sleep(delay);
                        drop(b);
                        return;
                    }
                    let t0 = Instant::now();
                    let e = b.recv(1, 4).unwrap_err();
                    let took = t0.elapsed();
                    assert_eq!(e.code, Code::RemoteError, "{e}");
                    assert!(e.msg.contains("rank 1 is gone"), "{e}");
                    assert!(took < delay + Duration::from_secs(10), "{took:?}: {e}");
                });
            }
        });
    }
}

/// A closed bootstrap closes the connections it accepted (also their second handles, kept
/// for the keepalive, `peer::Watch`), though the value lives on: a peer's sends fail.
#[test]
fn a_closed_bootstrap_closes_what_it_accepted() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let ids = [id];
    let [sent, closed, done] = [(); 3].map(|()| std::sync::Barrier::new(2));
    std::thread::scope(|sc| {
        for r in 0..2 {
            let (ids, sent, closed, done) = (&ids, &sent, &closed, &done);
            sc.spawn(move || {
                let mut b = Bootstrap::init_with_timeout(ids, r, 2, no_abort(), T).unwrap();
                if r == 1 {
                    b.send(0, 1, b"hello").unwrap();
                    sent.wait();
                    closed.wait();
                    let t0 = std::time::Instant::now();
                    let e = loop {
                        match b.send(0, 1, b"again") {
                            Ok(()) if t0.elapsed() > Duration::from_secs(3) => break None,
                            Ok(()) => std::thread::sleep(Duration::from_millis(10)),
                            Err(e) => break Some(e),
                        }
                    };
                    done.wait();
                    let e = e.expect("rank 0's closed bootstrap still takes what is sent");
                    assert_eq!(e.code, Code::RemoteError, "{e}");
                } else {
                    assert_eq!(b.recv(1, 1).unwrap(), b"hello");
                    sent.wait();
                    b.close();
                    closed.wait();
                    // (Alive until rank 1 is done.)
                    done.wait();
                    drop(b);
                }
            });
        }
    });
}

#[test]
fn close_is_idempotent_and_refuses_use() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let mut b = Bootstrap::init_with_timeout(&[id], 0, 1, no_abort(), T).unwrap();
    b.close();
    b.close();
    assert_eq!(b.send(0, 1, b"x").unwrap_err().code, Code::InvalidUsage);
    assert_eq!(b.allgather(b"x").unwrap_err().code, Code::InvalidUsage);
    assert_eq!(b.barrier().unwrap_err().code, Code::InvalidUsage);
}

/// Tests that open connections without the secret (the cap on them is per process).
static STRANGERS: parking_lot::Mutex<()> = parking_lot::const_mutex(());

/// Whether the other side closed `s` within `wait` (what it sent before is skipped).
fn closed(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
    }
}

/// Strangers on the root's port: silent, slow, garbage (some of it large) and wrong-secret
/// connections, hundreds at once, opened before the ranks come. The ranks' init must not wait
/// for them, and those that broke the protocol must be dropped at once.
#[test]
fn flood_of_strangers_does_not_delay_init() {
    let _g = STRANGERS.lock();
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let addr = id.root_addr();
    let open = || TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    let silent: Vec<TcpStream> = (0..200).map(|_| open()).collect();
    // Slow: the magic, then a few bytes of a secret, then nothing.
    let slow: Vec<TcpStream> = (0..10)
        .map(|i| {
            let mut s = open();
            s.write_all(root::ROOT_MAGIC).unwrap();
            s.write_all(&[i as u8; 3]).unwrap();
            s
        })
        .collect();
    // Garbage, every 10th one 1 MiB of it (the root must not read, let alone keep, all that).
    let garbage: Vec<TcpStream> = (0..50)
        .map(|i| {
            let mut s = open();
            let len = if i % 10 == 0 { 1 << 20 } else { 1 + i * 7 };
            let junk: Vec<u8> = (0..len).map(|k| (k * 13 + i * 29 + 1) as u8).collect();
            // The root may close mid-write: what it sent is garbage either way.
            let _ = s.write_all(&junk);
            s
        })
        .collect();
    let wrong: Vec<TcpStream> = (0..20)
        .map(|i| {
            let mut s = open();
            let mut hs = root::handshake(&[i as u8 + 1; SECRET_BYTES], root::KIND_RANK);
            hs.extend_from_slice(&[0u8; root::RANK_HELLO_BYTES]);
            let _ = s.write_all(&hs);
            s
        })
        .collect();

    let t0 = Instant::now();
    let hashes = run_ranks(&[id], 4, |b| {
        b.barrier().unwrap();
        b.comm_hash()
    });
    let took = t0.elapsed();
    assert!(hashes.iter().all(|&h| h == id::fnv1a(&id.secret())));
    assert!(
        took < Duration::from_secs(2),
        "init of 4 ranks took {took:?} behind 280 strangers"
    );

    // Garbage and wrong secrets were dropped (not left waiting for their hello deadline).
    for (i, s) in garbage.into_iter().chain(wrong).enumerate() {
        let mut s = s;
        assert!(
            closed(&mut s, Duration::from_millis(500)),
            "stranger {i} that broke the protocol is still connected"
        );
    }
    // The silent and slow ones are gone too by now: the rendezvous is over, its root closed.
    for (i, mut s) in silent.into_iter().chain(slow).enumerate() {
        assert!(
            closed(&mut s, Duration::from_secs(5)),
            "silent stranger {i} is still connected"
        );
    }
}

/// Connections that do not prove the secret: beyond the cap the oldest go at once, the others
/// at the hello deadline, while the id stays pending and then serves its ranks.
#[test]
fn strangers_are_dropped_by_cap_and_deadline() {
    use super::service::{HELLO_WAIT, MAX_UNPROVEN};
    let _g = STRANGERS.lock();
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let addr = id.root_addr();
    let open = || TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    let mut oldest: Vec<TcpStream> = (0..20).map(|_| open()).collect();
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    let mut rest: Vec<TcpStream> = (0..MAX_UNPROVEN).map(|_| open()).collect();
    for (i, s) in oldest.iter_mut().enumerate() {
        assert!(
            closed(s, Duration::from_millis(500)),
            "connection {i} of the oldest 20 was not dropped for the cap of {MAX_UNPROVEN}"
        );
    }
    assert!(
        t0.elapsed() < HELLO_WAIT / 2
            && !closed(rest.last_mut().unwrap(), Duration::from_millis(10)),
        "the youngest stranger went before its hello deadline"
    );
    for (i, s) in rest.iter_mut().enumerate() {
        assert!(
            closed(s, HELLO_WAIT + Duration::from_secs(2)),
            "silent stranger {i} is still connected past the hello deadline"
        );
    }
    assert!(t0.elapsed() >= HELLO_WAIT, "{:?}", t0.elapsed());
    run_ranks(&[id], 2, exercise);
}

/// A rank that registered with the root and then leaves before the rendezvous completes (its
/// init aborted here; a process that dies closes its connection the same way) fails the
/// rendezvous at once for every rank, naming it, instead of leaving them to wait for the
/// deadline (a rank that comes later would complete it with a rank that is gone).
#[test]
fn a_rank_that_leaves_the_rendezvous_fails_it_at_once() {
    let id = UniqueId::generate_with_timeout(T).unwrap();
    let leaver = no_abort();
    let t0 = Instant::now();
    let errs: Vec<Error> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let a = if r == 2 { leaver.clone() } else { no_abort() };
                sc.spawn(move || {
                    Bootstrap::init_with_timeout(&[id], r, 4, a, T)
                        .err()
                        .unwrap()
                })
            })
            .collect();
        // Rank 3 never comes; rank 2 gives up once all three are in.
        std::thread::sleep(Duration::from_millis(300));
        leaver.store(true, Ordering::Release);
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(errs[2].code, Code::InvalidUsage, "{}", errs[2]);
    for e in &errs[..2] {
        assert_eq!(e.code, Code::RemoteError, "{e}");
        assert!(
            e.msg
                .contains("rank 2 closed its connection before the rendezvous completed"),
            "{e}"
        );
    }
}
