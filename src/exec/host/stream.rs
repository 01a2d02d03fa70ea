//! Host streams (`oxcclHostStream*`): ordered queues of work, each with one worker thread, standing
//! in for `cudaStream_t` on the host executor. Work handed over by one `ncclGroupEnd` is run as
//! one batch, so several ranks of one process may share a stream without deadlock.

use super::batch::{Batch, CLOCK_EVERY};
use super::task::Task;
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
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
    /// The worker leaves queued work alone until then: it was handed over by a launching thread
    /// whose inline time ran out, and that thread takes it back at its next launch or
    /// synchronize (see `claim_within`) unless it is busy elsewhere for longer.
    lazy_until: Option<Instant>,
    /// The worker sleeps until it is woken (not until `lazy_until`): lazy work must wake it once.
    worker_asleep: bool,
}

impl State {
    /// Keeps the first error met by the stream's work, for `synchronize` or `query`.
    fn keep(&mut self, errors: impl IntoIterator<Item = Error>) {
        for e in errors {
            self.error.get_or_insert(e);
        }
    }
}

/// How long the worker leaves work to the thread that handed it over (see `State::lazy_until`).
const LAZY: Duration = Duration::from_millis(1);

pub struct HostStream {
    state: Mutex<State>,
    cv: Condvar,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Batches handed over / finished: a synchronizing thread polls them briefly before it
    /// sleeps.
    submitted: AtomicU64,
    completed: AtomicU64,
    /// A thread in `claim_within` or `synchronize` waits for the worker's batch (see `work`).
    wanted: std::sync::atomic::AtomicBool,
}

/// How long a thread synchronizing with a stream's worker polls before sleeping.
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
    pub fn enqueue(&self, batch: Batch, claimed: bool) {
        let mut s = self.state.lock();
        if claimed {
            s.queue.push_front(batch);
            s.busy = false;
            s.lazy_until = Some(Instant::now() + LAZY);
        } else {
            s.queue.push_back(batch);
        }
        self.submitted.fetch_add(1, Ordering::AcqRel);
        self.wake(&s);
    }

    /// Marks the stream as run by the calling thread, if it is idle.
    pub fn claim(&self) -> bool {
        let mut s = self.state.lock();
        let idle = !s.busy && s.queue.is_empty();
        if idle {
            s.busy = true;
        }
        idle
    }

    /// Claims the stream for work of the calling thread, which first runs, in order, whatever
    /// the stream has queued that its worker has not begun: a thread launching one small
    /// operation after another then stays in step with its peers, and does not leave its work
    /// to a worker thread that has to wait for a core (on a host with few cores, the launching
    /// threads hold them). False, with the claim ended and what was not finished queued again,
    /// when the worker is busy or the queued work is not done within `budget`.
    pub fn claim_within(&self, budget: Duration) -> bool {
        let mut spins = 0u32;
        // The clock is read only when there is something to wait for.
        let mut deadline = None;
        let mut deadline = || *deadline.get_or_insert_with(|| Instant::now() + budget);
        loop {
            if let Some(work) = self.take_over_queued() {
                if spins > 0 {
                    self.wanted.store(false, Ordering::Release);
                }
                return work.is_none_or(|w| self.run_taken(w, Some(deadline()), true));
            }
            // The worker runs a batch: ask for it.
            self.wanted.store(true, Ordering::Release);
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(CLOCK_EVERY) && Instant::now() >= deadline() {
                self.wanted.store(false, Ordering::Release);
                return false;
            }
            std::hint::spin_loop();
        }
    }

    /// Runs work taken over, in order, until `deadline` (None: to the end); true when all of it
    /// finished (the claim goes on), false when the rest was queued again (the claim ended;
    /// `lazy`: for the worker to leave alone for a while, see `State::lazy_until`).
    fn run_taken(&self, mut work: VecDeque<Batch>, deadline: Option<Instant>, lazy: bool) -> bool {
        while let Some(mut b) = work.pop_front() {
            if !b.run_until(deadline) {
                work.push_front(b);
                self.give_back(work, lazy);
                return false;
            }
            // Taken before the lock is: the tasks are dropped here, not under it.
            self.record(b.first_error());
        }
        true
    }

    /// Claims the stream with the work queued on it, unless the worker is running some.
    fn take_over(&self) -> Option<VecDeque<Batch>> {
        self.take_over_queued().map(Option::unwrap_or_default)
    }

    /// `take_over`, with None for an empty queue (nothing to hand back or drop: the common case
    /// of a launch on an idle stream).
    fn take_over_queued(&self) -> Option<Option<VecDeque<Batch>>> {
        let mut s = self.state.lock();
        if s.busy {
            return None;
        }
        s.busy = true;
        s.lazy_until = None;
        Some((!s.queue.is_empty()).then(|| std::mem::take(&mut s.queue)))
    }

    /// Ends a claim, queueing `work` (taken over, not finished) again in front.
    fn give_back(&self, work: VecDeque<Batch>, lazy: bool) {
        let mut s = self.state.lock();
        for b in work.into_iter().rev() {
            s.queue.push_front(b);
        }
        s.busy = false;
        s.lazy_until = lazy.then(|| Instant::now() + LAZY);
        self.wake(&s);
    }

    /// Records the results of a batch that was queued and is finished (the claim goes on).
    fn record(&self, errors: Option<Error>) {
        self.state.lock().keep(errors);
        self.completed.fetch_add(1, Ordering::AcqRel);
    }

    /// Ends a claim, recording the errors of work that finished inline and queueing in front the
    /// work that did not (to be taken back by the next launch, see `State::lazy_until`).
    pub fn end_claim(&self, pending: Option<Batch>, errors: impl IntoIterator<Item = Error>) {
        match pending {
            None => self.release(errors),
            Some(b) => {
                self.state.lock().keep(errors);
                self.enqueue(b, true);
            }
        }
    }

    /// Ends a claim whose work finished inline, recording its errors.
    pub fn release(&self, errors: impl IntoIterator<Item = Error>) {
        let mut s = self.state.lock();
        s.keep(errors);
        s.busy = false;
        // Wake whoever waits on the claim: a synchronizing thread, or the worker, when another
        // thread queued work behind the claim meanwhile (the worker does not take work while a
        // submitter holds the stream, and nothing else would wake it).
        if !s.queue.is_empty() {
            self.wake(&s);
        } else if s.syncing > 0 {
            self.cv.notify_all();
        }
    }

    /// Wakes whoever must see new queued work, or a stream no longer busy: synchronizing
    /// threads, and the worker unless it already sleeps only until the lazy work is its own
    /// (each wake-up costs a context switch on the cores the launching threads use).
    fn wake(&self, s: &State) {
        if s.syncing > 0 || s.worker_asleep || s.lazy_until.is_none() {
            self.cv.notify_all();
        }
    }

    /// Waits for all queued work, running what the worker has not begun on this thread;
    /// returns (and clears) the first error it met.
    pub fn synchronize(&self) -> Result<()> {
        loop {
            if let Some(work) = self.take_over() {
                self.run_taken(work, None, false);
                self.release([]);
            } else {
                // The worker (or another thread) runs a batch: ask for it, to run it here.
                self.wanted.store(true, Ordering::Release);
                poll_until(|| {
                    self.completed.load(Ordering::Acquire) == self.submitted.load(Ordering::Acquire)
                        || !self.state.lock().busy
                });
                let mut s = self.state.lock();
                while s.busy {
                    s.syncing += 1;
                    self.cv.wait(&mut s);
                    s.syncing -= 1;
                }
                self.wanted.store(false, Ordering::Release);
            }
            let mut s = self.state.lock();
            if !s.busy && s.queue.is_empty() {
                return match s.error.take() {
                    Some(e) => Err(e),
                    None => Ok(()),
                };
            }
        }
    }

    /// `Ok(true)` when idle; an error met by finished work is returned (and cleared). Work the
    /// worker has not begun runs on the calling thread first, for up to `OXCCL_INLINE_US`: a
    /// thread that polls for completion then drives its own work.
    pub fn query(&self) -> Result<bool> {
        let budget = crate::param::inline_budget();
        if !budget.is_zero() {
            // What is not finished goes back to the worker at once: a polling thread sleeps
            // between queries, and the work must go on meanwhile.
            if let Some(work) = self.take_over() {
                if self.run_taken(work, Some(Instant::now() + budget), false) {
                    self.release([]);
                }
            }
        }
        let mut s = self.state.lock();
        if let Some(e) = s.error.take() {
            return Err(e);
        }
        Ok(!s.busy && s.queue.is_empty())
    }

    fn work(self: Arc<Self>) {
        loop {
            let batch = {
                let mut s = self.state.lock();
                loop {
                    // Not while a submitter runs work inline: it goes first.
                    if !s.busy && !s.queue.is_empty() {
                        match s.lazy_until {
                            Some(t) if Instant::now() < t && !s.shutdown => {
                                self.cv.wait_until(&mut s, t);
                                continue;
                            }
                            _ => {}
                        }
                        s.lazy_until = None;
                        s.busy = true;
                        let b = s.queue.pop_front().expect("queued work");
                        break b;
                    }
                    if s.shutdown {
                        return;
                    }
                    s.worker_asleep = true;
                    self.cv.wait(&mut s);
                    s.worker_asleep = false;
                }
            };
            let mut batch = batch;
            // A launching thread that wants the stream gets the batch back (it runs it inline):
            // on a host with few cores the worker would only compete with it for a core.
            if !batch.run_unless(None, &|| self.wanted.load(Ordering::Acquire)) {
                self.give_back(VecDeque::from([batch]), true);
                continue;
            }
            let error = batch.first_error();
            let mut s = self.state.lock();
            s.keep(error);
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

/// `submit_all` for one task on one stream (a launch of one communicator's work, the common
/// case), without its gathering.
pub fn submit_one(s: &Arc<HostStream>, task: Task) {
    let budget = crate::param::inline_budget();
    let batch = Batch::one(task);
    if budget.is_zero() || !s.claim() {
        s.enqueue(batch, false);
        return;
    }
    let mut batch = batch;
    if batch.run_until(Some(Instant::now() + budget)) {
        let error = batch.first_error();
        s.release(error);
    } else {
        s.enqueue(batch, true);
    }
}

static STREAMS: crate::registry::Registry<HostStream> = crate::registry::Registry::new();
thread_local! {
    static RECENT: crate::registry::Recent<HostStream> = const { crate::registry::Recent::new() };
}

pub fn create() -> Result<usize> {
    let s = Arc::new(HostStream {
        state: Mutex::new(State::default()),
        cv: Condvar::new(),
        worker: Mutex::new(None),
        submitted: AtomicU64::new(0),
        completed: AtomicU64::new(0),
        wanted: Default::default(),
    });
    let w = s.clone();
    let h = std::thread::Builder::new()
        .name("oxccl-stream".into())
        .spawn(move || w.work())
        .map_err(|e| Error::os("cannot start a host stream thread", e))?;
    *s.worker.lock() = Some(h);
    Ok(STREAMS.insert(&s))
}

pub fn lookup(h: usize) -> Result<Arc<HostStream>> {
    STREAMS.get_via(&RECENT, h).ok_or_else(|| {
            Error::invalid_argument(format!(
                "stream {h:#x} is not an oxccl host stream (the host executor cannot run on CUDA streams; create one with oxcclHostStreamCreate)"
            ))
        })
}

/// Waits for the stream's work, stops its thread and forgets it.
pub fn destroy(h: usize) -> Result<()> {
    let s = lookup(h)?;
    let r = s.synchronize();
    STREAMS.remove(h);
    s.state.lock().shutdown = true;
    s.cv.notify_all();
    if let Some(t) = s.worker.lock().take() {
        let _ = t.join();
    }
    r
}
