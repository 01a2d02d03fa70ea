//! A communicator's proxy thread: it drives the ends of the connections whose data it moves
//! (`Proxy`, the network's), polling each in turn, spinning while they move data and backing
//! off (yield, then short sleeps) while they wait. An end that fails breaks the communicator:
//! its error is recorded in the communicator's health and its waiting operations stop.

use super::Proxy;
use crate::health::{Backoff, Health};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

struct Shared {
    ends: Mutex<Vec<Arc<dyn Proxy>>>,
    /// Bumped when `ends` changes: the thread then takes a new copy.
    generation: AtomicU64,
    stop: AtomicBool,
}

pub struct ProxyThread {
    shared: Arc<Shared>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl ProxyThread {
    /// Starts the thread of rank `rank`'s communicator, reporting failures to `health`.
    pub fn start(rank: usize, health: Arc<Health>) -> crate::error::Result<ProxyThread> {
        let shared = Arc::new(Shared {
            ends: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let sh = shared.clone();
        let handle = std::thread::Builder::new()
            .name(format!("oxccl-proxy-{rank}"))
            .spawn(move || run(&sh, &health))
            .map_err(|e| crate::error::Error::os("starting a proxy thread", e))?;
        Ok(ProxyThread {
            shared,
            handle: Some(handle),
        })
    }

    /// Adds an end to drive.
    pub fn add(&self, end: Arc<dyn Proxy>) {
        self.shared.ends.lock().push(end);
        self.shared.generation.fetch_add(1, Ordering::Release);
    }
}

impl ProxyThread {
    /// Waits until every end has sent what it was handed (or `deadline`, or the health says
    /// stop): a communicator being destroyed right after its last send loses nothing.
    pub fn flush(&self, deadline: std::time::Instant, health: &Health) {
        let mut backoff = Backoff::default();
        while !self.shared.ends.lock().iter().all(|e| e.flushed()) {
            if health.halted() || std::time::Instant::now() >= deadline {
                return;
            }
            backoff.pause();
        }
    }
}

impl Drop for ProxyThread {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn run(sh: &Shared, health: &Health) {
    let mut ends: Vec<Arc<dyn Proxy>> = Vec::new();
    let mut seen = u64::MAX;
    let mut backoff = Backoff::default();
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
                    health.fail(err);
                    health.abort_from(e.peer());
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
            backoff.reset();
        } else {
            backoff.pause();
        }
    }
}
