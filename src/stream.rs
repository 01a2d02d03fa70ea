//! Host streams (`oxcclHostStream*`): ordered queues of work, each with one worker thread, standing
//! in for `cudaStream_t` on the host executor. Work handed over by one `ncclGroupEnd` is run as
//! one batch, so several ranks of one process may share a stream without deadlock.

use crate::error::{Error, Result};
use crate::exec::host::Batch;
use crate::exec::Task;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    queue: VecDeque<Batch>,
    /// The worker is running a batch, or a submitting thread is running one inline.
    busy: bool,
    error: Option<Error>,
    shutdown: bool,
    /// Threads sleeping in `synchronize` (a claim's release wakes the worker only for queued work).
    syncing: usize,
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
    /// Queues a batch at the back, or (`claimed`: work this thread began inline while it held
    /// the stream) at the front, ending the claim.
    fn enqueue(&self, batch: Batch, claimed: bool) {
        let mut s = self.state.lock();
        if claimed {
            s.queue.push_front(batch);
            s.busy = false;
        } else {
            s.queue.push_back(batch);
        }
        self.submitted.fetch_add(1, Ordering::AcqRel);
        self.cv.notify_all();
    }

    /// Marks the stream as run by the calling thread, if it is idle.
    fn claim(&self) -> bool {
        let mut s = self.state.lock();
        let idle = !s.busy && s.queue.is_empty();
        if idle {
            s.busy = true;
        }
        idle
    }

    /// Ends a claim whose work finished inline, recording its errors.
    fn release(&self, errors: impl IntoIterator<Item = Error>) {
        let mut s = self.state.lock();
        for e in errors {
            s.error.get_or_insert(e);
        }
        s.busy = false;
        // Wake whoever waits on the claim: a synchronizing thread, or the worker, when another
        // thread queued work behind the claim meanwhile (the worker does not take work while a
        // submitter holds the stream, and nothing else would wake it).
        if s.syncing > 0 || !s.queue.is_empty() {
            self.cv.notify_all();
        }
    }

    /// Waits for all queued work; returns (and clears) the first error it met.
    pub fn synchronize(&self) -> Result<()> {
        poll_until(|| {
            self.completed.load(Ordering::Acquire) == self.submitted.load(Ordering::Acquire)
        });
        let mut s = self.state.lock();
        while s.busy || !s.queue.is_empty() {
            s.syncing += 1;
            self.cv.wait(&mut s);
            s.syncing -= 1;
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
                    // Not while a submitter runs work inline: it goes first.
                    if let Some(b) = (!s.busy).then(|| s.queue.pop_front()).flatten() {
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
            let mut batch = batch;
            batch.run_until(None);
            let results = batch.results();
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

/// Hands one `ncclGroupEnd`'s work to its streams. When every one of them is idle, the calling
/// thread first runs all of it together, for up to `OXCCL_INLINE_US`: small operations then
/// finish without a hand-over between threads (on a host with few cores that costs more than the
/// operation), and ranks of one process launched by one group (nccl-tests' `-g N`) meet inside
/// one polling loop. What is not done by then goes to each task's own stream, whose worker
/// carries on where the caller stopped; so a launch returns after a bounded time, as an
/// asynchronous launch must (a peer may be waiting for something this thread does next).
pub fn submit_all(per_stream: Vec<(Arc<HostStream>, Vec<Task>)>) {
    let budget = crate::param::inline_budget();
    let mut claimed = 0;
    if !budget.is_zero() {
        for (s, _) in &per_stream {
            if !s.claim() {
                break;
            }
            claimed += 1;
        }
    }
    if claimed < per_stream.len() {
        for (s, _) in &per_stream[..claimed] {
            s.release([]);
        }
        for (s, tasks) in per_stream {
            s.enqueue(Batch::new(tasks), false);
        }
        return;
    }
    let k = per_stream.len();
    let mut owner = Vec::new();
    let mut all = Vec::new();
    let mut streams = Vec::with_capacity(k);
    for (i, (s, tasks)) in per_stream.into_iter().enumerate() {
        owner.extend(std::iter::repeat_n(i, tasks.len()));
        all.extend(tasks);
        streams.push(s);
    }
    let mut batch = Batch::new(all);
    if batch.run_until(Some(Instant::now() + budget)) {
        let mut errors: Vec<Vec<Error>> = (0..k).map(|_| Vec::new()).collect();
        for (r, &o) in batch.results().into_iter().zip(&owner) {
            if let Err(e) = r {
                errors[o].push(e);
            }
        }
        for (s, e) in streams.iter().zip(errors) {
            s.release(e);
        }
        return;
    }
    for (s, part) in streams.iter().zip(batch.split(&owner, k)) {
        s.enqueue(part, true);
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
