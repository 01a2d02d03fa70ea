//! Helper threads of one end of a network connection (`NCCL_SOCKET_NTHREADS`): with T threads,
//! the end's k sockets are cut into T groups of consecutive sockets; the thread that drives the
//! end (the executor's or the proxy's) moves group 0, which holds the first socket (headers,
//! heartbeats, small slots), and helper thread g moves group g's parts of each slot. How many
//! threads move a direction is each end's own choice: the two ends agree only on how a slot is
//! cut into parts (`wire::parts`, from its byte count and k).
//!
//! For each slot the driver posts a job (the step, the slot's address and bytes) to the helpers
//! that hold one of its parts; each moves its parts, blocking in poll(2) on its sockets, then
//! says it is done with the step and wakes the proxy thread. The driver frees (sending end) or
//! publishes (receiving end) the slot only once its own parts and the helpers' are done, so a
//! slot is the helpers' only while nobody else touches it. A helper that fails keeps its error
//! for the driver, which fails the end with it.

use super::wire::{part_start, parts};
use crate::transport::proxy::Waker;
use once_cell::sync::OnceCell;
use parking_lot::{Condvar, Mutex};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// A slot to move: its step, address and byte count, and the connection's socket count.
#[derive(Clone, Copy)]
struct Job {
    step: u64,
    slot: usize,
    bytes: usize,
    k: usize,
}

#[derive(Default)]
struct Shared {
    job: Mutex<Option<Job>>,
    posted: Condvar,
    /// Steps done: the last job's step + 1.
    done: AtomicU64,
    /// Bytes moved so far, for the receiving end's silence check.
    moved: AtomicU64,
    error: Mutex<Option<String>>,
    stop: AtomicBool,
}

struct Helper {
    shared: Arc<Shared>,
    /// The first socket of its group.
    first: usize,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The helper threads of one end (groups 1 and up).
pub struct Helpers {
    helpers: Vec<Helper>,
    /// The driver's sockets: those below this.
    driver: usize,
}

impl Helpers {
    /// Starts the helpers for `socks` when `threads` (`NCCL_SOCKET_NTHREADS`) is more than
    /// one and there are sockets to give them; `None` where the driver moves every socket.
    /// Only the sockets that a slot of `slot_bytes` can use (`wire::parts`) are shared out,
    /// as evenly as they go, among at most `threads` threads.
    pub fn start(
        socks: &[TcpStream],
        threads: usize,
        slot_bytes: usize,
        is_sender: bool,
        who: &str,
        waker: Arc<OnceCell<Waker>>,
    ) -> std::io::Result<Option<Helpers>> {
        let k = socks.len();
        let usable = parts(slot_bytes, k);
        let t = threads.min(usable);
        if t <= 1 {
            return Ok(None);
        }
        let bound = |g: usize| g * usable / t;
        // Built first, so that an early return stops the helpers already started.
        let mut hs = Helpers {
            helpers: Vec::new(),
            driver: bound(1),
        };
        for g in 1..t {
            let (first, end) = (bound(g), bound(g + 1));
            let mine = socks[first..end]
                .iter()
                .map(TcpStream::try_clone)
                .collect::<std::io::Result<Vec<_>>>()?;
            let shared = Arc::new(Shared::default());
            let (sh, wk) = (shared.clone(), waker.clone());
            let thread = std::thread::Builder::new()
                .name(format!("oxccl-net-{first}"))
                .spawn(move || run(&sh, mine, first, is_sender, &wk))?;
            hs.helpers.push(Helper {
                shared,
                first,
                thread: Some(thread),
            });
        }
        crate::debug::info(&format!(
            "{who}: {k} sockets, {} helper thread(s) besides the driving one",
            hs.helpers.len()
        ));
        Ok(Some(hs))
    }

    /// Whether socket `j` is a helper's.
    #[inline]
    pub fn owns(&self, j: usize) -> bool {
        j >= self.driver
    }

    /// The helpers that hold a part of a slot of `bytes` bytes cut for `k` sockets.
    fn busy(&self, bytes: usize, k: usize) -> impl Iterator<Item = &Helper> {
        let np = parts(bytes, k);
        self.helpers.iter().filter(move |h| h.first < np)
    }

    /// Hands slot `step` (at `slot`, `bytes` bytes) to the helpers that hold a part of it.
    pub fn post(&self, step: u64, slot: *mut u8, bytes: usize, k: usize) {
        for h in self.busy(bytes, k) {
            *h.shared.job.lock() = Some(Job {
                step,
                slot: slot as usize,
                bytes,
                k,
            });
            h.shared.posted.notify_one();
        }
    }

    /// Whether the helpers are done with slot `step`; a helper's error.
    pub fn finished(&self, step: u64, bytes: usize, k: usize) -> Result<bool, String> {
        // Any helper's error first: the others may wait for bytes that will never come.
        for h in self.busy(bytes, k) {
            if let Some(e) = h.shared.error.lock().clone() {
                return Err(e);
            }
        }
        Ok(self
            .busy(bytes, k)
            .all(|h| h.shared.done.load(Ordering::Acquire) > step))
    }

    /// Bytes the helpers moved so far.
    pub fn moved(&self) -> u64 {
        self.helpers
            .iter()
            .map(|h| h.shared.moved.load(Ordering::Relaxed))
            .sum()
    }
}

impl Drop for Helpers {
    fn drop(&mut self) {
        for h in &self.helpers {
            h.shared.stop.store(true, Ordering::Release);
            let _guard = h.shared.job.lock();
            h.shared.posted.notify_one();
        }
        for h in &mut self.helpers {
            if let Some(t) = h.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// How long a helper sleeps in poll before it looks at `stop` again (ms).
const POLL_MS: u16 = 50;

fn run(
    sh: &Shared,
    mut socks: Vec<TcpStream>,
    first: usize,
    is_sender: bool,
    waker: &OnceCell<Waker>,
) {
    loop {
        let job = {
            let mut j = sh.job.lock();
            loop {
                if sh.stop.load(Ordering::Acquire) {
                    return;
                }
                if let Some(job) = j.take() {
                    break job;
                }
                sh.posted.wait(&mut j);
            }
        };
        let np = parts(job.bytes, job.k);
        for (i, s) in socks.iter_mut().enumerate() {
            let j = first + i;
            if j >= np {
                break;
            }
            let (lo, hi) = (
                part_start(job.bytes, job.k, j),
                part_start(job.bytes, job.k, j + 1),
            );
            if let Err(e) = move_part(sh, s, job.slot + lo, hi - lo, is_sender) {
                if !sh.stop.load(Ordering::Acquire) {
                    *sh.error.lock() = Some(format!("socket {j}: {e}"));
                }
                if let Some(w) = waker.get() {
                    w.kick();
                }
                return;
            }
        }
        sh.done.store(job.step + 1, Ordering::Release);
        if let Some(w) = waker.get() {
            w.kick();
        }
    }
}

/// Moves `len` bytes at `at` over `s` (non-blocking: it waits in poll), or fails.
fn move_part(
    sh: &Shared,
    s: &mut TcpStream,
    at: usize,
    len: usize,
    is_sender: bool,
) -> std::io::Result<()> {
    use nix::poll::{PollFd, PollFlags, PollTimeout};
    let mut off = 0;
    while off < len {
        if sh.stop.load(Ordering::Acquire) {
            return Err(std::io::Error::other("stopped"));
        }
        // SAFETY: the slot is this helper's until it says it is done (see the module's
        // comment): the driver neither frees nor publishes it before, and the region outlives
        // the helpers (the end stops them before it lets go of its FIFO).
        let r = unsafe {
            if is_sender {
                s.write(std::slice::from_raw_parts(
                    (at + off) as *const u8,
                    len - off,
                ))
            } else {
                s.read(std::slice::from_raw_parts_mut(
                    (at + off) as *mut u8,
                    len - off,
                ))
            }
        };
        match r {
            Ok(0) => {
                return Err(std::io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "the peer closed the connection mid-slot",
                ))
            }
            Ok(n) => {
                off += n;
                sh.moved.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let ev = if is_sender {
                    PollFlags::POLLOUT
                } else {
                    PollFlags::POLLIN
                };
                let mut fds = [PollFd::new(s.as_fd(), ev)];
                let _ = nix::poll::poll(&mut fds, PollTimeout::from(POLL_MS));
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// `k` connected socket pairs over loopback, non-blocking: (sending ends, receiving ends).
    fn pairs(k: usize) -> (Vec<TcpStream>, Vec<TcpStream>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut tx, mut rx) = (Vec::new(), Vec::new());
        for _ in 0..k {
            let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (b, _) = l.accept().unwrap();
            a.set_nonblocking(true).unwrap();
            b.set_nonblocking(true).unwrap();
            tx.push(a);
            rx.push(b);
        }
        (tx, rx)
    }

    fn wait(h: &Helpers, step: u64, bytes: usize, k: usize) -> Result<(), String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !h.finished(step, bytes, k)? {
            assert!(
                std::time::Instant::now() < deadline,
                "step {step}: never finished ({:?})",
                h.helpers
                    .iter()
                    .map(|h| h.shared.done.load(Ordering::Relaxed))
                    .collect::<Vec<_>>()
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(())
    }

    /// A slot cut into 4 parts: the sending end's two threads (a helper for sockets 2-3) and the
    /// receiving end's four (helpers for sockets 1, 2, 3) move it; the test's thread is both
    /// drivers. Every byte arrives where it belongs, slot after slot; a socket closed
    /// mid-slot is the receiving helper's error.
    #[test]
    fn helpers_move_their_parts_and_report_a_closed_socket() {
        let k = 4;
        let (mut tx, mut rx) = pairs(k);
        let none = || Arc::new(OnceCell::new());
        let bytes = 1 << 20;
        let send = Helpers::start(&tx, 2, bytes, true, "test", none())
            .unwrap()
            .unwrap();
        let recv = Helpers::start(&rx, 4, bytes, false, "test", none())
            .unwrap()
            .unwrap();
        assert!(!send.owns(1) && send.owns(2));
        assert!(!recv.owns(0) && recv.owns(1));
        assert_eq!(parts(bytes, k), 4);
        for step in 0..3u64 {
            let mut src: Vec<u8> = (0..bytes).map(|i| (i as u64 * 7 + step) as u8).collect();
            let mut dst = vec![0u8; bytes];
            send.post(step, src.as_mut_ptr(), bytes, k);
            recv.post(step, dst.as_mut_ptr(), bytes, k);
            // The drivers' parts: 0 and 1 sent, 0 received.
            let sh = Shared::default();
            let (p1, p2) = (part_start(bytes, k, 1), part_start(bytes, k, 2));
            let reader = std::thread::scope(|sc| {
                let dst0 = &mut dst[..p1];
                let rx0 = &mut rx[0];
                let r = sc.spawn(move || {
                    move_part(
                        &Shared::default(),
                        rx0,
                        dst0.as_mut_ptr() as usize,
                        dst0.len(),
                        false,
                    )
                });
                move_part(&sh, &mut tx[0], src.as_ptr() as usize, p1, true).unwrap();
                move_part(&sh, &mut tx[1], src.as_ptr() as usize + p1, p2 - p1, true).unwrap();
                r.join().unwrap()
            });
            reader.unwrap();
            wait(&send, step, bytes, k).unwrap();
            wait(&recv, step, bytes, k).unwrap();
            assert!(dst == src, "step {step}: the slot arrived changed");
        }
        assert_eq!(recv.moved(), 3 * (bytes - part_start(bytes, k, 1)) as u64);
        // Socket 3's sending side goes away while the receiving helper waits for its part.
        let mut dst = vec![0u8; bytes];
        drop(send);
        recv.post(3, dst.as_mut_ptr(), bytes, k);
        tx.truncate(3);
        let e = wait(&recv, 3, bytes, k).unwrap_err();
        assert!(e.contains("socket") && e.contains("closed"), "{e}");
        // The helpers still hold the job's pointer into `dst`: they go first.
        drop(recv);
        drop(dst);
    }

    /// Threads share out only the sockets a slot can use, evenly: 5 sockets and 4 threads give
    /// 4 groups for 1 MiB slots; 128 KiB slots use 2 sockets (2 groups); 64 KiB slots one.
    #[test]
    fn helpers_take_the_usable_sockets_evenly() {
        let (tx, _rx) = pairs(5);
        let none = || Arc::new(OnceCell::new());
        let h = Helpers::start(&tx, 4, 1 << 20, true, "test", none())
            .unwrap()
            .unwrap();
        let firsts: Vec<usize> = h.helpers.iter().map(|h| h.first).collect();
        // Groups [0], [1], [2], [3, 4].
        assert_eq!((h.driver, firsts), (1, vec![1, 2, 3]));
        let h = Helpers::start(&tx, 4, 128 << 10, true, "test", none())
            .unwrap()
            .unwrap();
        assert_eq!((h.driver, h.helpers.len()), (1, 1));
        assert!(Helpers::start(&tx, 4, 64 << 10, true, "test", none())
            .unwrap()
            .is_none());
    }
}
