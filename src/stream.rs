//! Host streams (`oxcclHostStream*`): ordered queues of work, each with one worker thread, standing
//! in for `cudaStream_t` on the host executor. Work handed over by one `ncclGroupEnd` is run as
//! one batch, so several ranks of one process may share a stream without deadlock.

use crate::error::{Error, Result};
use crate::exec::Task;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    queue: VecDeque<Vec<Task>>,
    busy: bool,
    error: Option<Error>,
    shutdown: bool,
}

pub struct HostStream {
    state: Mutex<State>,
    cv: Condvar,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Batches handed over / finished: lets both sides poll briefly before sleeping, which keeps
    /// the latency of small operations at microseconds instead of a futex wake-up each way.
    submitted: AtomicU64,
    completed: AtomicU64,
}

/// How long a stream's worker, or a thread synchronizing with it, polls before sleeping.
const POLL_BEFORE_SLEEP: Duration = Duration::from_micros(200);

fn poll_until(mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let mut spins = 0u32;
    while start.elapsed() < POLL_BEFORE_SLEEP {
        if ready() {
            return true;
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    ready()
}

impl HostStream {
    pub fn submit(&self, tasks: Vec<Task>) {
        let mut s = self.state.lock();
        s.queue.push_back(tasks);
        self.submitted.fetch_add(1, Ordering::AcqRel);
        self.cv.notify_all();
    }

    /// Waits for all queued work; returns (and clears) the first error it met.
    pub fn synchronize(&self) -> Result<()> {
        poll_until(|| {
            self.completed.load(Ordering::Acquire) == self.submitted.load(Ordering::Acquire)
        });
        let mut s = self.state.lock();
        while s.busy || !s.queue.is_empty() {
            self.cv.wait(&mut s);
        }
        match s.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// `Ok(true)` when idle; an error met by finished work is returned (and cleared).
    pub fn query(&self) -> Result<bool> {
        let mut s = self.state.lock();
        if let Some(e) = s.error.take() {
            return Err(e);
        }
        Ok(!s.busy && s.queue.is_empty())
    }

    fn work(self: Arc<Self>) {
        let mut taken = 0u64;
        loop {
            poll_until(|| self.submitted.load(Ordering::Acquire) > taken);
            let batch = {
                let mut s = self.state.lock();
                loop {
                    if let Some(b) = s.queue.pop_front() {
                        s.busy = true;
                        taken += 1;
                        break b;
                    }
                    if s.shutdown {
                        return;
                    }
                    self.cv.wait(&mut s);
                }
            };
            let results = crate::exec::host::run(batch);
            let mut s = self.state.lock();
            for r in results {
                if let Err(e) = r {
                    s.error.get_or_insert(e);
                }
            }
            s.busy = false;
            self.completed.fetch_add(1, Ordering::AcqRel);
            self.cv.notify_all();
        }
    }
}

static STREAMS: Mutex<Option<HashMap<usize, Arc<HostStream>>>> = Mutex::new(None);

pub fn create() -> Result<usize> {
    let s = Arc::new(HostStream {
        state: Mutex::new(State::default()),
        cv: Condvar::new(),
        worker: Mutex::new(None),
        submitted: AtomicU64::new(0),
        completed: AtomicU64::new(0),
    });
    let w = s.clone();
    let h = std::thread::Builder::new()
        .name("oxccl-stream".into())
        .spawn(move || w.work())
        .map_err(|e| Error::os("cannot start a host stream thread", e))?;
    *s.worker.lock() = Some(h);
    let id = Arc::as_ptr(&s) as usize;
    STREAMS
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(id, s);
    Ok(id)
}

pub fn lookup(h: usize) -> Result<Arc<HostStream>> {
    STREAMS
        .lock()
        .as_ref()
        .and_then(|m| m.get(&h).cloned())
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "stream {h:#x} is not an oxccl host stream (the host executor cannot run on CUDA streams; create one with oxcclHostStreamCreate)"
            ))
        })
}

/// Waits for the stream's work, stops its thread and forgets it.
pub fn destroy(h: usize) -> Result<()> {
    let s = lookup(h)?;
    let r = s.synchronize();
    if let Some(m) = STREAMS.lock().as_mut() {
        m.remove(&h);
    }
    s.state.lock().shutdown = true;
    s.cv.notify_all();
    if let Some(t) = s.worker.lock().take() {
        let _ = t.join();
    }
    r
}
