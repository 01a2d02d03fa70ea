//! One health per communicator, and the one bounded wait every layer uses.
//!
//! A communicator's [`Health`] holds its abort flag (set by `ncclCommAbort`), its first error (a
//! failed operation leaves the communicator broken, as NCCL's async error does), and a word peers
//! may set to abort it from afar. Every wait of the library (the executors' polling loops, host
//! streams, the bootstrap's sockets, finalize and destroy) is a [`Wait`]: it watches one health
//! and a deadline, and says who waited for what when it gives up.

use crate::error::{Error, Result};
use crate::param::FOREVER;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A communicator's health: abort flag, first error, remote-abort word.
/// How a communicator tells its peers that it broke (see `Health::fail_and_announce`).
pub type Announcer = Box<dyn Fn(&str) + Send + Sync>;

pub struct Health {
    /// Shared with whoever may abort before the communicator exists (bootstrap tests, init).
    abort: Arc<AtomicBool>,
    /// Set by a peer (through memory both reach) to abort this rank's work; 0 while healthy,
    /// else the peer's rank + 1.
    remote: AtomicU32,
    error: Mutex<Option<Error>>,
    /// Whether `error` holds one (read first, so that a healthy check takes no lock).
    has_error: AtomicBool,
    /// `ncclCommRevoke`: the communicator's work stops as on an abort, but its bootstrap stays
    /// usable (to shrink or split it).
    revoked: AtomicBool,
    /// A failure elsewhere (a peer's announcement, a connection's proxy) stops the executor's
    /// work; the bootstrap stays usable (to shrink the communicator).
    work_stopped: AtomicBool,
    /// `ncclCommShrink` with `NCCL_SHRINK_ABORT` made a communicator of the survivors: the
    /// errors this one met were recovered from, and `ncclCommGetAsyncError` no longer reports
    /// them (as NCCL clears the abort it used); its calls still fail with them.
    retired: AtomicBool,
    /// Tells the peers that this rank's communicator broke (`fail_and_announce`), once.
    announcer: once_cell::sync::OnceCell<Announcer>,
    announced: AtomicBool,
}

impl Default for Health {
    fn default() -> Health {
        Health::with_flag(Arc::new(AtomicBool::new(false)))
    }
}

impl Health {
    /// A health whose abort flag is `flag` (which others may hold and set).
    pub fn with_flag(flag: Arc<AtomicBool>) -> Health {
        Health {
            abort: flag,
            remote: AtomicU32::new(0),
            error: Mutex::new(None),
            has_error: AtomicBool::new(false),
            revoked: AtomicBool::new(false),
            work_stopped: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            announcer: once_cell::sync::OnceCell::new(),
            announced: AtomicBool::new(false),
        }
    }

    /// `ncclCommAbort`: every wait watching this health gives up.
    pub fn abort(&self) {
        self.abort.store(true, Ordering::SeqCst);
    }

    /// Whether the communicator was aborted, here or by a peer.
    #[inline]
    pub fn aborted(&self) -> bool {
        self.abort.load(Ordering::SeqCst) || self.remote.load(Ordering::Relaxed) != 0
    }

    /// Whether `ncclCommAbort` was called here (not a peer's or a connection's failure).
    pub fn aborted_here(&self) -> bool {
        self.abort.load(Ordering::SeqCst)
    }

    /// `ncclCommRevoke`: work on the communicator stops (see `halted`); waits of its bootstrap
    /// go on.
    pub fn revoke(&self) {
        self.revoked.store(true, Ordering::SeqCst);
    }

    /// Whether the communicator was revoked.
    pub fn revoked(&self) -> bool {
        self.revoked.load(Ordering::SeqCst)
    }

    /// See `retired`: after a shrink with `NCCL_SHRINK_ABORT`.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::SeqCst);
    }

    /// What `ncclCommGetAsyncError` reports: the first error, unless the communicator was
    /// retired by a shrink.
    pub fn async_error(&self) -> Option<Error> {
        if self.retired.load(Ordering::SeqCst) {
            return None;
        }
        self.error()
    }

    /// Whether work on the communicator must stop: it was aborted (here or by a peer), revoked,
    /// or broken elsewhere (`stop_work`).
    #[inline]
    pub fn halted(&self) -> bool {
        self.aborted()
            || self.revoked.load(Ordering::Relaxed)
            || self.work_stopped.load(Ordering::Relaxed)
    }

    /// How the communicator's work was stopped, for messages: "revoked" or "aborted".
    pub fn halted_how(&self) -> &'static str {
        if self.revoked() {
            "revoked"
        } else {
            "aborted"
        }
    }

    /// Records `e` and stops the communicator's work (not its bootstrap): a failure found
    /// elsewhere than in the operations themselves.
    pub fn stop_work(&self, e: Error) {
        self.fail(e);
        self.work_stopped.store(true, Ordering::SeqCst);
    }

    /// A peer asks this rank to stop (`rank`: who asked).
    pub fn abort_from(&self, rank: usize) {
        let _ =
            self.remote
                .compare_exchange(0, rank as u32 + 1, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// The first error the communicator met, if any.
    #[inline]
    pub fn error(&self) -> Option<Error> {
        if !self.has_error.load(Ordering::Acquire) {
            return None;
        }
        self.error.lock().clone()
    }

    /// Whether the communicator has met an error.
    #[inline]
    pub fn failed(&self) -> bool {
        self.has_error.load(Ordering::Acquire)
    }

    /// Records an error (the first one stays). The first is also a WARN and
    /// `ncclGetLastError`'s message, as NCCL reports the failures it finds: a caller told of it
    /// only by `ncclCommGetAsyncError`'s code then finds what happened. Not after this
    /// process's own `ncclCommAbort`, which the caller asked for.
    pub fn fail(&self, e: Error) {
        if self.record(&e) && !self.aborted_here() {
            crate::error::set_last_error(&e.msg);
        }
    }

    /// Records an error (the first one stays) without reporting it (one the caller asked for,
    /// such as a revoke); whether it was the first.
    pub fn record(&self, e: &Error) -> bool {
        let mut b = self.error.lock();
        if b.is_some() {
            return false;
        }
        *b = Some(e.clone());
        self.has_error.store(true, Ordering::Release);
        true
    }

    /// Installs how a failure is announced to the peers (the communicator's bootstrap).
    pub fn set_announcer(&self, f: Announcer) {
        let _ = self.announcer.set(f);
    }

    /// Records `e` (as `fail`) and tells the peers, once per communicator, so that those
    /// waiting on something this rank will never do stop too (not for failures that came from
    /// a peer: they know).
    pub fn fail_and_announce(&self, e: Error) {
        // The code travels first, as one byte.
        let why = format!("{}{}", char::from(b'0' + e.code as u8), e.msg);
        self.fail(e);
        if !self.announced.swap(true, Ordering::AcqRel) {
            if let Some(a) = self.announcer.get() {
                a(&why);
            }
        }
    }

    /// Records `e`, and tells the peers unless it came from one (`ncclRemoteError`: the rank
    /// that failed tells everyone itself).
    pub fn fail_unless_told(&self, e: Error) {
        if e.code == crate::error::Code::RemoteError {
            self.fail(e);
        } else {
            self.fail_and_announce(e);
        }
    }

    /// Why waiting on this communicator must stop, if it must: "aborted" (an
    /// `ncclRemoteError`-coded error when a peer asked for it), for `who` waiting for `what`.
    pub fn stopped(&self, who: &dyn std::fmt::Display, what: &dyn Fn() -> String) -> Result<()> {
        if self.abort.load(Ordering::SeqCst) {
            return Err(Error::invalid_usage(format!(
                "{who} aborted while waiting for {}",
                what()
            )));
        }
        match self.remote.load(Ordering::Acquire) {
            0 => Ok(()),
            r => Err(Error::remote(format!(
                "{who}: rank {} aborted the communicator while this rank waited for {}",
                r - 1,
                what()
            ))),
        }
    }
}

/// Anything a bootstrap or wait can watch for an abort: a communicator's health, or a bare
/// flag (which becomes a health of its own).
pub trait IntoHealth {
    fn into_health(self) -> Arc<Health>;
}

impl IntoHealth for Arc<Health> {
    fn into_health(self) -> Arc<Health> {
        self
    }
}

impl IntoHealth for Arc<AtomicBool> {
    fn into_health(self) -> Arc<Health> {
        Arc::new(Health::with_flag(self))
    }
}

/// Longest single blocking step of a wait on a socket or a condition: every wait re-checks its
/// health and deadline this often.
pub const SLICE: Duration = Duration::from_millis(50);

/// A wait: who is waiting, until when, and the health it watches. Past the watchdog's time
/// (`OXCCL_WATCHDOG_S`) its `check` logs, once, a WARN saying who waits for what.
pub struct Wait<'a> {
    pub who: String,
    pub deadline: Instant,
    /// Its length: [`FOREVER`] for a wait with no bound.
    pub timeout: Duration,
    pub health: Option<&'a Health>,
    /// When it began (for the watchdog).
    pub since: Instant,
    /// The watchdog's WARN was logged.
    pub warned: std::cell::Cell<bool>,
}

impl<'a> Wait<'a> {
    pub fn new(who: String, timeout: Duration, health: Option<&'a Health>) -> Wait<'a> {
        let since = Instant::now();
        Wait {
            who,
            // (Linux's monotonic clock counts seconds since boot in 64 bits: a century fits.)
            deadline: since + timeout.min(FOREVER),
            timeout,
            health,
            since,
            warned: std::cell::Cell::new(false),
        }
    }

    /// Err when aborted (InvalidUsage, or RemoteError when a peer aborted) or past the deadline
    /// (Timeout, naming `what`).
    pub fn check(&self, what: &dyn Fn() -> String) -> Result<()> {
        if let Some(h) = self.health {
            h.stopped(&self.who, what)?;
        }
        let now = Instant::now();
        if now >= self.deadline {
            return Err(self.expired(what));
        }
        self.watch(now, what);
        Ok(())
    }

    /// The watchdog of a wait that has gone on too long: one WARN naming who waits for what.
    pub fn watch(&self, now: Instant, what: &dyn Fn() -> String) {
        if !self.warned.get()
            && crate::param::watchdog().is_some_and(|w| now.duration_since(self.since) > w)
        {
            self.warned.set(true);
            crate::debug::warn(&format!(
                "watchdog: {} has waited {} for {}",
                self.who,
                fmt_secs(Duration::from_secs(
                    now.duration_since(self.since).as_secs()
                )),
                what()
            ));
        }
    }

    /// The timeout error of this wait.
    pub fn expired(&self, what: &dyn Fn() -> String) -> Error {
        Error::timeout(format!(
            "{} waited {} for {}",
            self.who,
            fmt_secs(self.timeout),
            what()
        ))
    }

    /// The next blocking step's length: a slice, cut at the deadline (never zero).
    pub fn slice(&self) -> Duration {
        let left = self.deadline.saturating_duration_since(Instant::now());
        left.clamp(Duration::from_millis(1), SLICE)
    }

    /// Polls `ready` until it says true, pausing between polls as [`Backoff`] does and checking
    /// the health and deadline while it pauses.
    pub fn until(&self, what: &dyn Fn() -> String, mut ready: impl FnMut() -> bool) -> Result<()> {
        let mut b = Backoff::default();
        loop {
            if ready() {
                return Ok(());
            }
            if b.pause() {
                self.check(what)?;
            }
        }
    }
}

/// How a polling thread waits between polls that found nothing: spin briefly (peers on this
/// host answer within microseconds), then yield the core, and only after a while without
/// progress sleep (in 50 us naps). `pause` says when a check of health and deadline is due.
#[derive(Default)]
pub struct Backoff {
    spins: u32,
    since: Option<Instant>,
}

/// Spins before yielding.
const SPINS: u32 = 64;
/// How long a blocked thread yields its core before it starts sleeping.
const YIELD_BEFORE_SLEEP: Duration = Duration::from_millis(5);

impl Backoff {
    /// Progress was made: start again with spinning.
    #[inline]
    pub fn reset(&mut self) {
        self.spins = 0;
    }

    /// A wait with a deadline of its own (never a sleep): spin, then yield the core at every
    /// turn, so that what must run on it (the kernel's network processing deferred to its
    /// ksoftirqd thread, a proxy thread) is not kept off it for a whole time slice.
    #[inline]
    pub fn spin_or_yield(&mut self) {
        self.spins = self.spins.saturating_add(1);
        if self.spins < SPINS {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }

    /// Turns spent waiting since the last progress.
    pub fn turns(&self) -> u32 {
        self.spins
    }

    /// Waits a little; true when a check of health and deadline is due (while sleeping, every
    /// 64th turn: about every 3 ms).
    pub fn pause(&mut self) -> bool {
        if self.spins == 0 {
            self.since = Some(Instant::now());
        }
        self.spins = self.spins.saturating_add(1);
        if self.spins < SPINS {
            std::hint::spin_loop();
            return false;
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() < YIELD_BEFORE_SLEEP {
            std::thread::yield_now();
            return false;
        }
        std::thread::sleep(Duration::from_micros(50));
        self.spins.is_multiple_of(64)
    }
}

/// A point in time for the waits measured in seconds (timeouts, the watchdog, heartbeats and
/// silent peers): CLOCK_MONOTONIC_COARSE, to the kernel's tick (1 to 10 ms). The vDSO reads it
/// without the hardware clock, a few nanoseconds where `Instant::now` costs tens in a VM, so
/// the paths that note progress at every slot read it (a 1 KiB operation between two hosts
/// read the fine clock ten times).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Coarse(u64);

impl Coarse {
    #[inline]
    pub fn now() -> Coarse {
        let mut ts = nix::libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec; this clock exists since Linux 2.6.32.
        unsafe { nix::libc::clock_gettime(nix::libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
        Coarse(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
    }

    /// Time since `self` (to the tick: a wait of less than one may read as zero).
    #[inline]
    pub fn elapsed(self) -> Duration {
        Duration::from_nanos(Coarse::now().0.saturating_sub(self.0))
    }
}

/// "300 s", "1.5 s".
pub fn fmt_secs(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}
