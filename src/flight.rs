//! The flight recorder: with `OXCCL_FLIGHT_RECORDER=N`, each communicator keeps its last N
//! operations (what, when queued, begun and ended, how they ended), and dumps them when the
//! watchdog fires, when an operation fails, and (with `OXCCL_FLIGHT_RECORDER_SIGNAL=1`) when the
//! process gets SIGUSR2 while an operation waits: like PyTorch's flight recorder, it says which
//! rank stopped where. Dumps go to the log (`NCCL_DEBUG=WARN` and up) or, with
//! `OXCCL_FLIGHT_RECORDER_FILE=PREFIX`, to `PREFIX.<comm hash>.<rank>` (rewritten each time).

use crate::plan::What;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

#[derive(Clone, Debug, PartialEq)]
enum State {
    Queued,
    Running,
    Done,
    Failed(String),
}

struct Entry {
    /// The operation's number on its communicator (1, 2, ...), as the watchdog names it.
    seq: u64,
    what: What,
    queued: Instant,
    began: Option<Instant>,
    ended: Option<Instant>,
    state: State,
}

/// One communicator's last operations.
pub struct Recorder {
    cap: usize,
    entries: Mutex<VecDeque<Entry>>,
    /// The signal generation (`SIGNALS`) this recorder has dumped for.
    seen: AtomicU64,
    /// (hash, name, rank) for the dump's header.
    hash: u64,
    name: Option<String>,
    rank: usize,
}

/// The recorder a communicator keeps: None unless `OXCCL_FLIGHT_RECORDER` asks for one.
pub fn for_comm(hash: u64, name: Option<String>, rank: usize) -> Option<Recorder> {
    let cap = crate::param::get_u64("OXCCL_FLIGHT_RECORDER") as usize;
    if cap == 0 {
        return None;
    }
    install_signal();
    Some(Recorder {
        cap,
        entries: Mutex::new(VecDeque::with_capacity(cap)),
        seen: AtomicU64::new(SIGNALS.load(Ordering::Relaxed)),
        hash,
        name,
        rank,
    })
}

impl Recorder {
    /// Operation `seq` is queued.
    pub fn queued(&self, seq: u64, what: What) {
        let mut e = self.entries.lock();
        if e.len() == self.cap {
            e.pop_front();
        }
        e.push_back(Entry {
            seq,
            what,
            queued: Instant::now(),
            began: None,
            ended: None,
            state: State::Queued,
        });
    }

    fn update(&self, seq: u64, f: impl FnOnce(&mut Entry)) {
        if let Some(x) = self.entries.lock().iter_mut().rev().find(|x| x.seq == seq) {
            f(x);
        }
    }

    /// Operation `seq` begins (touches user memory, waits for peers).
    pub fn began(&self, seq: u64) {
        self.update(seq, |x| {
            x.began = Some(Instant::now());
            x.state = State::Running;
        });
    }

    /// Operation `seq` ended, with `error` when it failed.
    pub fn ended(&self, seq: u64, error: Option<&crate::error::Error>) {
        self.update(seq, |x| {
            x.ended = Some(Instant::now());
            x.state = match error {
                None => State::Done,
                Some(e) => State::Failed(format!("{:?}: {}", e.code, e.msg)),
            };
        });
    }

    /// The recorded operations, oldest first, one line each, after a header saying why.
    pub fn dump(&self, why: &str) -> String {
        let now = Instant::now();
        let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
        let e = self.entries.lock();
        let mut out = format!(
            "flight recorder: comm {:#x}{} rank {}: the last {} operations ({why}):\n",
            self.hash,
            self.name
                .as_deref()
                .map_or(String::new(), |n| format!(" ({n})")),
            self.rank,
            e.len()
        );
        for x in e.iter() {
            let state = match (&x.state, x.began, x.ended) {
                (State::Queued, _, _) => {
                    format!("queued {:.3} ms ago, not begun", ms(x.queued, now))
                }
                (State::Running, Some(b), _) => format!("running for {:.3} ms", ms(b, now)),
                (State::Done, Some(b), Some(d)) => format!("done in {:.3} ms", ms(b, d)),
                (State::Failed(m), _, Some(d)) => {
                    format!("failed {:.3} ms ago: {m}", ms(d, now))
                }
                (s, _, _) => format!("{s:?}"),
            };
            out.push_str(&format!("  #{} {}: {state}\n", x.seq, x.what));
        }
        out
    }

    /// Whether a signal asked for a dump since this recorder last looked.
    pub fn asked(&self) -> bool {
        let g = SIGNALS.load(Ordering::Relaxed);
        g != self.seen.load(Ordering::Relaxed) && self.seen.swap(g, Ordering::SeqCst) != g
    }

    /// Writes the dump where `OXCCL_FLIGHT_RECORDER_FILE` says, else to the log.
    pub fn emit(&self, why: &str) {
        let text = self.dump(why);
        match crate::param::get_str("OXCCL_FLIGHT_RECORDER_FILE") {
            Some(prefix) if !prefix.is_empty() => {
                let path = format!("{prefix}.{:016x}.{}", self.hash, self.rank);
                if let Err(e) = std::fs::write(&path, &text) {
                    crate::debug::warn(&format!("flight recorder: cannot write {path}: {e}"));
                }
            }
            _ => {
                for l in text.lines() {
                    crate::debug::warn(l);
                }
            }
        }
    }
}

/// SIGUSR2s received (see `install_signal`); each recorder dumps once per new one.
static SIGNALS: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_signal(_: nix::libc::c_int) {
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// With `OXCCL_FLIGHT_RECORDER_SIGNAL=1`, SIGUSR2 asks for a dump (the handler only sets a
/// flag: async-signal-safe). Installed once per process.
fn install_signal() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if crate::param::get_str("OXCCL_FLIGHT_RECORDER_SIGNAL").as_deref() != Some("1") {
        return;
    }
    ONCE.call_once(|| {
        use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
        let a = SigAction::new(
            SigHandler::Handler(on_signal),
            SaFlags::SA_RESTART,
            SigSet::empty(),
        );
        // SAFETY: the handler only stores to an atomic.
        if let Err(e) = unsafe { sigaction(Signal::SIGUSR2, &a) } {
            crate::debug::warn(&format!("flight recorder: cannot handle SIGUSR2: {e}"));
        }
    });
}
