//! A communicator's proxy thread: it drives the ends of the connections whose data it moves
//! (`Proxy`, the network's), polling each in turn while they move data. Once a pass moves
//! nothing it sleeps in poll(2) on what each end waits for (`Proxy::wait_for`: a socket to
//! read from or to write to) and on a wake-up socket that an end writes to when the executor
//! left it something the poll would not see (`Waker`). It does not spin: the executor moves
//! the data itself as it fills and frees slots and while it waits, and on a host with few
//! cores a spinning proxy takes the core that the executor and the kernel's network stack
//! need. An end that fails breaks the communicator: its error is recorded in the
//! communicator's health and its waiting operations stop.
//!
//! Kernels (the CUDA executor) fill and free slots without a kick, so while the executor says
//! its device work is under way (`Busy`) the thread sleeps only `BUSY_SLEEP` at a time.
//! Without that, a slot a kernel filled could wait up to the whole sleep (1 ms) before it left.
//! (The 2.3 ms per operation seen between two "hosts" on one H100 on 12-06 is mostly the two
//! processes time-slicing the GPU: the same pair on one host took 4.5 ms.)

use super::{Proxy, Wait};
use crate::health::{Backoff, Health};
use parking_lot::Mutex;
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

struct Shared {
    ends: Mutex<Vec<Arc<dyn Proxy>>>,
    /// Bumped when `ends` changes: the thread then takes a new copy.
    generation: AtomicU64,
    stop: AtomicBool,
    /// The thread is (about to be) asleep in poll: a kick must write to `wake_tx`.
    sleeping: AtomicBool,
    wake_tx: UnixStream,
    wake_rx: UnixStream,
}

/// How the executor wakes a communicator's proxy thread (see `Proxy::kick`).
#[derive(Clone)]
pub struct Waker(Arc<Shared>);

impl Waker {
    /// Wakes the thread if it sleeps (cheap when it does not).
    #[inline]
    pub fn kick(&self) {
        // Orders the caller's counter store before the check (the thread sets `sleeping`, then
        // looks at the counters once more before it sleeps).
        fence(Ordering::SeqCst);
        if self.0.sleeping.load(Ordering::Relaxed) {
            let _ = (&self.0.wake_tx).write(&[1]);
        }
    }
}

/// The longest sleep (ms): shutdown and ends added meanwhile are seen within it, and so is
/// work that no socket or kick announced. There is such work: with 20 ms, a 4 MiB all-reduce
/// between two hosts that takes 1.5-5 ms took 46-93 ms once or more in every run of 80, each
/// stall ended by this timeout (the poll saw nothing and no kick came, yet an end could move
/// right after); with 2 ms the worst of 80 was 9-13 ms. What leaves that work unannounced is
/// not found yet. Later (12-05, with sends from the caller's buffer), the same calls with a
/// 20 ms sleep again had slow calls of 10-22 ms, but logging every poll that timed out found
/// none during them: what is left of the stalls comes with the packet reordering and spurious
/// fast retransmits that `nstat` shows on the namespaces' veth link (MPI's TCP has more).
const SLEEP_MS: u16 = 2;

/// The longest sleep while the executor says kernels are running (`Busy`). Not a spin, as
/// NCCL's proxy does: on the emulated device of the tests (2 cores, kernels as threads) a
/// proxy that yielded between passes made 8-byte sends between two hosts 1.3-1.7x slower than
/// sleeping 1 ms, and this one left them as they were. (On a GPU: not measured yet.)
const BUSY_SLEEP: std::time::Duration = std::time::Duration::from_micros(20);

/// The executor's word on whether work that moves slots without kicking the thread (kernels) is
/// under way: while it is, the thread sleeps no longer than `BUSY_SLEEP`.
pub trait Busy: Send + Sync {
    /// Called once, on the proxy thread, before its first `busy`.
    fn on_thread_start(&self) {}
    fn busy(&self) -> bool;
}

pub struct ProxyThread {
    shared: Arc<Shared>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl ProxyThread {
    /// Starts the thread of rank `rank`'s communicator, reporting failures to `health`; `busy`:
    /// the executor's `Busy`, where it has one.
    pub fn start(
        rank: usize,
        health: Arc<Health>,
        busy: Option<Arc<dyn Busy>>,
    ) -> crate::error::Result<ProxyThread> {
        let (wake_tx, wake_rx) = UnixStream::pair()
            .and_then(|(a, b)| {
                a.set_nonblocking(true)?;
                b.set_nonblocking(true)?;
                Ok((a, b))
            })
            .map_err(|e| crate::error::Error::os("a proxy thread's wake-up socket", e))?;
        let shared = Arc::new(Shared {
            ends: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            wake_tx,
            wake_rx,
        });
        let sh = shared.clone();
        let handle = std::thread::Builder::new()
            .name(format!("oxccl-proxy-{rank}"))
            .spawn(move || run(&sh, &health, busy.as_deref()))
            .map_err(|e| crate::error::Error::os("starting a proxy thread", e))?;
        Ok(ProxyThread {
            shared,
            handle: Some(handle),
        })
    }

    /// Adds an end to drive.
    pub fn add(&self, end: Arc<dyn Proxy>) {
        end.set_waker(Waker(self.shared.clone()));
        self.shared.ends.lock().push(end);
        self.shared.generation.fetch_add(1, Ordering::Release);
        Waker(self.shared.clone()).kick();
    }
}

impl ProxyThread {
    /// Waits until every end has sent what it was handed (or `deadline`, or the health says
    /// stop): a communicator being destroyed right after its last send loses nothing. An end
    /// whose peer has been silent past `OXCCL_HEARTBEAT_S` (its host or the link to it is
    /// down: what it was sent waits unacknowledged) is not waited for.
    pub fn flush(&self, deadline: std::time::Instant, health: &Health) {
        let limit = crate::param::heartbeat();
        let lost = |e: &Arc<dyn Proxy>| {
            limit.is_some_and(|t| e.silent_for().is_some_and(|quiet| quiet > t))
        };
        let mut backoff = Backoff::default();
        loop {
            let (mut waiting, mut gone) = (0, 0);
            for e in self.shared.ends.lock().iter().filter(|e| !e.flushed()) {
                waiting += 1;
                gone += usize::from(lost(e));
            }
            if waiting == 0 || health.halted() || std::time::Instant::now() >= deadline {
                return;
            }
            if gone == waiting {
                crate::debug::warn(&format!(
                    "{gone} network connection(s) whose peer has not been heard from for over \
                     {} (OXCCL_HEARTBEAT_S) closed with what they were sent unacknowledged",
                    crate::health::fmt_secs(limit.unwrap_or_default())
                ));
                return;
            }
            backoff.pause();
        }
    }
}

impl Drop for ProxyThread {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        Waker(self.shared.clone()).kick();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        // Each end holds a `Waker`, which holds `shared`: let go of the ends here, or neither
        // would ever be freed (nor their sockets, FIFOs and helper threads). Dropped outside
        // the lock: an end's drop stops its helpers, which may kick.
        let ends = std::mem::take(&mut *self.shared.ends.lock());
        drop(ends);
    }
}

fn run(sh: &Shared, health: &Health, busy: Option<&dyn Busy>) {
    if let Some(b) = busy {
        // Short sleeps end when asked, not up to the default 50 us later.
        let _ = nix::sys::prctl::set_timerslack(1000);
        b.on_thread_start();
    }
    let mut ends: Vec<Arc<dyn Proxy>> = Vec::new();
    let mut seen = u64::MAX;
    while !sh.stop.load(Ordering::Acquire) {
        let g = sh.generation.load(Ordering::Acquire);
        if g != seen {
            seen = g;
            ends = sh.ends.lock().clone();
        }
        let mut moved = false;
        let mut failed = None;
        for (i, e) in ends.iter().enumerate() {
            match e.progress() {
                Ok(m) => moved |= m,
                Err(err) => {
                    health.fail_and_announce(err.clone());
                    health.stop_work(err);
                    failed = Some(i);
                    break;
                }
            }
        }
        if let Some(i) = failed {
            // A failed end moves nothing more.
            let gone = ends.remove(i);
            sh.ends.lock().retain(|x| !Arc::ptr_eq(x, &gone));
            seen = sh.generation.fetch_add(1, Ordering::AcqRel) + 1;
        }
        if moved {
            continue;
        }
        // Asleep until a socket is ready, an end kicks, or a while has passed.
        sh.sleeping.store(true, Ordering::SeqCst);
        // Orders the store before the looks at the counters (as `Waker::kick` orders its
        // counter store before its look at `sleeping`).
        fence(Ordering::SeqCst);
        let again = ends.iter().any(|e| e.progress().unwrap_or(true));
        if !again {
            sleep(sh, &ends, busy.is_some_and(|b| b.busy()));
        }
        sh.sleeping.store(false, Ordering::SeqCst);
    }
}

/// Sleeps until a socket an end waits on is ready, a kick, or a while (`busy`: kernels are
/// running, `BUSY_SLEEP`).
fn sleep(sh: &Shared, ends: &[Arc<dyn Proxy>], busy: bool) {
    use nix::poll::{PollFd, PollFlags};
    let mut waits = Vec::new();
    for e in ends {
        e.wait_for(&mut waits);
    }
    let mut fds = vec![PollFd::new(sh.wake_rx.as_fd(), PollFlags::POLLIN)];
    let mut soon = false;
    for w in &waits {
        let (fd, flags) = match *w {
            Wait::Readable(fd) => (fd, PollFlags::POLLIN),
            Wait::Writable(fd) => (fd, PollFlags::POLLOUT),
            Wait::Soon => {
                soon = true;
                continue;
            }
        };
        // SAFETY: poll(2) only asks for readiness; nothing reads or writes through these fds.
        // A connected end's sockets live as long as the end (`ends` holds it). A listening
        // end's listener and unverified connections may be closed by an executor thread
        // that moves it on after `wait_for` (its lock is not held here). Then poll sees a
        // closed fd (POLLNVAL, it returns at once) or, if the number was reused, another
        // file: a wakeup early or late by at most the timeout, after which the loop asks
        // the ends again.
        let b = unsafe { BorrowedFd::borrow_raw(fd) };
        fds.push(PollFd::new(b, flags));
    }
    // Kernels fill slots without kicking the thread: on the CUDA executor it looks again soon.
    // So do a net plugin's requests, which have no socket to wait on.
    let ms = match crate::gpu::kind() {
        _ if soon => 1u16,
        crate::gpu::Kind::Cuda => 1u16,
        crate::gpu::Kind::Host => SLEEP_MS,
    };
    if busy {
        let t = nix::sys::time::TimeSpec::from_duration(BUSY_SLEEP);
        let _ = nix::poll::ppoll(&mut fds, Some(t), None);
    } else {
        let _ = nix::poll::poll(&mut fds, ms);
    }
    let mut sink = [0u8; 64];
    while (&sh.wake_rx).read(&mut sink).is_ok_and(|n| n > 0) {}
}
