//! The host executor: runs tasks on the calling thread (or a host stream's worker) by polling
//! every lane of every task, moving one FIFO slot per primitive whenever its counters allow.
//! Nothing blocks: several ranks' tasks can be driven by one thread, as `ncclGroupEnd` over
//! several communicators requires.

use super::board::{BoardState, Direct};
use super::steps::{poll_program, Cursor, Poll};
use super::task::{Item, Outcome, Task};
use super::tune::BySize;
use super::HostComm;
use crate::error::{Error, Result};
use crate::health::{Backoff, Coarse};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Where the current work of a lane is. (In place, though a board's state is smaller: a boxed
/// cursor would be an allocation at every program's start.)
#[allow(clippy::large_enum_variant)]
enum Cur {
    Steps(Cursor),
    Board(BoardState),
}

struct Lane {
    works: VecDeque<Item>,
    cur: Option<Cur>,
}

impl Lane {
    fn new(works: Vec<Item>) -> Lane {
        Lane {
            works: works.into(),
            cur: None,
        }
    }
    fn done(&self) -> bool {
        self.works.is_empty()
    }
}

/// Runs the lane's work in order as far as it can go without waiting.
fn poll_lane(lane: &mut Lane, fifo: (&BySize, u64)) -> Result<Poll> {
    let mut progressed = false;
    loop {
        let Some(work) = lane.works.front_mut() else {
            return Ok(Poll::Done);
        };
        let cur = lane.cur.get_or_insert_with(|| match work {
            Item::Steps(p) => Cur::Steps(Cursor::new(p, Some(fifo))),
            Item::Board(_) => Cur::Board(BoardState::new()),
        });
        let p = match (work, cur) {
            (Item::Steps(prog), Cur::Steps(c)) => {
                let p = poll_program(prog, c)?;
                if p == Poll::Done {
                    c.finish(prog, fifo.0);
                }
                p
            }
            (Item::Board(op), Cur::Board(st)) => st.poll(op)?,
            _ => unreachable!("a lane's cursor matches its work"),
        };
        match p {
            Poll::Done => {
                lane.works.pop_front();
                lane.cur = None;
                progressed = true;
            }
            Poll::Progress => return Ok(Poll::Progress),
            Poll::Blocked if progressed => return Ok(Poll::Progress),
            Poll::Blocked => return Ok(Poll::Blocked),
        }
    }
}

/// Polls every lane once; sets `progress` when one moved; true when all are done.
fn poll_lanes(lanes: &mut [Lane], fifo: (&BySize, u64), progress: &mut bool) -> Result<bool> {
    let mut all_done = true;
    for l in lanes {
        match poll_lane(l, fifo)? {
            Poll::Progress => {
                *progress = true;
                all_done = false;
            }
            Poll::Blocked => all_done = false,
            Poll::Done => {}
        }
    }
    Ok(all_done)
}

/// A task being run.
struct Running {
    // (The lanes go before the task: a cursor dropped with slots sent by reference copies
    // them from the task's memory, and one with places named for slots to receive revokes
    // them, see `Cursor::settle`.)
    stage_lanes: Vec<Lane>,
    p2p: Vec<Lane>,
    task: Task,
    started: bool,
    result: Option<Result<()>>,
    /// For the timeout and the watchdog (seconds).
    last_progress: Coarse,
    /// The watchdog's WARN was logged for the current wait.
    warned: bool,
}

impl Running {
    fn new(mut task: Task) -> Running {
        let p2p = std::mem::take(&mut task.p2p)
            .into_iter()
            .map(Lane::new)
            .collect();
        Running {
            task,
            started: false,
            stage_lanes: Vec::new(),
            p2p,
            result: None,
            last_progress: Coarse::now(),
            warned: false,
        }
    }

    fn comm(&self) -> &HostComm {
        &self.task.comm
    }

    /// One pass over the task's lanes.
    fn poll(&mut self) -> Poll {
        if self.result.is_some() {
            return Poll::Done;
        }
        if !self.started {
            if !self.comm().is_serving(self.task.ticket) {
                return Poll::Blocked;
            }
            if let Err(e) = self.comm().begin(self.task.ticket) {
                return self.finish(Err(e.context(self.task.what.to_string())));
            }
            self.started = true;
            if let Some(r) = &self.task.comm.recorder {
                r.began(self.task.ticket + 1);
            }
            // SAFETY: the task's turn has come: earlier work of its stream and communicator is
            // done, and its sends' ranges were validated at enqueue.
            let filled = unsafe {
                let works = self.p2p.iter_mut().flat_map(|l| l.works.iter_mut());
                self.task.p2p_stash.fill(works)
            };
            if let Err(e) = filled.and_then(|()| self.load_stage()) {
                return self.finish(Err(e));
            }
        }
        // An aborted communicator's work stops at once, at a slot boundary (one load per pass).
        if self.comm().health.halted() {
            let e = self.aborted_error();
            return self.finish(Err(e));
        }
        let mut progress = false;
        loop {
            let fifo = (&self.task.comm.tuner.fifo, self.task.ticket);
            let all_done = match poll_lanes(&mut self.stage_lanes, fifo, &mut progress) {
                Ok(d) => d,
                Err(e) => return self.finish(Err(e)),
            };
            if !all_done || self.task.stages.is_empty() {
                break;
            }
            self.end_stage();
            if let Err(e) = self.load_stage() {
                return self.finish(Err(e));
            }
            progress = true;
        }
        let stage_done = self.task.stages.is_empty() && self.stage_lanes.iter().all(Lane::done);
        let fifo = (&self.task.comm.tuner.fifo, self.task.ticket);
        let p2p_done = match poll_lanes(&mut self.p2p, fifo, &mut progress) {
            Ok(d) => d,
            Err(e) => return self.finish(Err(e)),
        };
        if stage_done && p2p_done {
            self.end_stage();
            return self.finish(Ok(()));
        }
        if progress {
            self.last_progress = Coarse::now();
            self.warned = false;
            Poll::Progress
        } else {
            Poll::Blocked
        }
    }

    /// Makes the front stage's lanes current (the stage stays queued until it ends).
    fn load_stage(&mut self) -> Result<()> {
        self.stage_lanes = match self.task.stages.first_mut() {
            Some(st) => {
                let mut lanes = std::mem::take(&mut st.lanes);
                // SAFETY: the stages before this one are done, and the task's turn has come.
                unsafe { st.stash.fill(lanes.iter_mut().flatten())? };
                lanes.into_iter().map(Lane::new).collect()
            }
            None => Vec::new(),
        };
        Ok(())
    }

    fn end_stage(&mut self) {
        // The lanes first: the stage's copies go back to the pool with it.
        self.stage_lanes.clear();
        if !self.task.stages.is_empty() {
            spoil(self.task.stages.remove(0).fault);
        }
    }

    fn finish(&mut self, r: Result<()>) -> Poll {
        if let Err(e) = &r {
            let h = &self.comm().health;
            if h.halted() {
                h.fail(e.clone());
            } else {
                // This rank found the failure: its peers learn of it too.
                h.fail_and_announce(e.clone());
            }
            // Board operations under way are left: once this returns, no peer touches the
            // caller's buffers.
            let comm = &self.task.comm;
            for l in self.stage_lanes.iter_mut().chain(self.p2p.iter_mut()) {
                if let (Some(Item::Board(op)), Some(Cur::Board(st))) =
                    (l.works.front(), l.cur.as_mut())
                {
                    st.leave(op, &|p| comm.peer_alive(p));
                }
                // Slots that refer to the caller's buffers get copies before it has them back.
                if let Some(Cur::Steps(c)) = l.cur.as_mut() {
                    c.settle();
                }
            }
        }
        if let Some(rec) = &self.task.comm.recorder {
            rec.ended(self.task.ticket + 1, r.as_ref().err());
            if let Err(e) = &r {
                rec.emit(&format!(
                    "operation #{} failed: {}",
                    self.task.ticket + 1,
                    e.msg
                ));
            }
        }
        self.comm().advance_serving(self.task.ticket);
        self.result = Some(r);
        Poll::Done
    }

    /// The connections the task's programs wait on.
    fn waited_conns(&self) -> impl Iterator<Item = &std::sync::Arc<crate::transport::Conn>> {
        self.stage_lanes
            .iter()
            .chain(self.p2p.iter())
            .filter_map(|l| match (l.works.front()?, l.cur.as_ref()?) {
                (Item::Steps(p), Cur::Steps(c)) => c.waits_on(p),
                (Item::Board(op), Cur::Board(st)) => st.waits_on(op),
                _ => None,
            })
    }

    /// A peer on another host silent for longer than the heartbeat allows, on a connection
    /// the task waits on, and for how long.
    fn silent_peer(&self) -> Option<(usize, Duration)> {
        let limit = crate::param::heartbeat()?;
        self.waited_conns()
            .filter_map(|c| Some((c.peer, c.silent_for()?)))
            .find(|&(_, quiet)| quiet > limit)
    }

    /// A peer whose closed connection one of the task's programs waits on.
    fn closed_peer(&self) -> Option<usize> {
        self.waited_conns()
            .find(|c| c.peer_closed())
            .map(|c| c.peer)
    }

    /// What the task waits for, as the end of a sentence.
    fn waiting(&self) -> String {
        self.stage_lanes
            .iter()
            .chain(self.p2p.iter())
            .find_map(describe_wait)
            .unwrap_or_else(|| "its peers".into())
    }

    fn aborted_error(&self) -> Error {
        let h = &self.comm().health;
        // Stopped by a failure elsewhere (a network connection): that failure says why.
        if !h.aborted_here() && !h.revoked() {
            if let Some(e) = h.error() {
                return e.context_on_rank(self.task.what, self.comm().rank);
            }
        }
        Error::remote(format!(
            "{} on rank {}: communicator {}",
            self.task.what,
            self.comm().rank,
            h.halted_how()
        ))
    }

    /// Ends the task with `e` from a check while it waits: a begun task finishes (its turn
    /// ends, the communicator is broken); one that never began only records `e` (and breaks the
    /// communicator when `fail`), so it never touches memory.
    fn stop(&mut self, e: Error, fail: bool) {
        if self.started {
            self.finish(Err(e));
        } else {
            if fail {
                self.comm().health.fail(e.clone());
            }
            self.result = Some(Err(e));
        }
    }

    /// Abort and timeout checks while blocked.
    fn check_stuck(&mut self, timeout: Option<Duration>) {
        if self.result.is_some() {
            return;
        }
        if self.comm().health.halted() {
            let e = self.aborted_error();
            return self.stop(e, false);
        }
        if let Some((r, quiet)) = self.silent_peer() {
            let e = Error::remote(format!(
                "{} on rank {}: {} has not been heard from for {:.1} s while this rank waited \
                 for it (OXCCL_HEARTBEAT_S): its host, process or the link to it is down",
                self.task.what,
                self.comm().rank,
                self.comm().peer_name(r),
                quiet.as_secs_f64()
            ));
            return self.stop(e, true);
        }
        if let Some(r) = self.closed_peer() {
            // What it wrote before it went is visible now: look once more.
            if self.poll() != Poll::Blocked {
                return;
            }
            let e = Error::remote(format!(
                "{} on rank {}: {} closed its connection (it ended its communicator, exited or \
                 failed) while this rank waited for it",
                self.task.what,
                self.comm().rank,
                self.comm().peer_name(r)
            ));
            return self.stop(e, true);
        }
        // A dead peer this task waits on (any, where it waits on no connection: on the
        // board). Not one it does not wait on: if a peer it waits on (over the network, say)
        // waits for the dead one, that peer fails and says so to every rank.
        let waits_on = |r: usize| {
            let mut waited = self.waited_conns().map(|c| c.peer).peekable();
            waited.peek().is_none() || waited.any(|p| p == r)
        };
        if let Some(r) = self.comm().dead_peer(waits_on) {
            // A peer that did its part and then exited is no failure: look once more, now
            // that everything it wrote before exiting is visible.
            if self.poll() != Poll::Blocked {
                return;
            }
            let e = Error::remote(format!(
                "{} on rank {}: {} has died",
                self.task.what,
                self.comm().rank,
                self.comm().peer_name(r)
            ));
            return self.stop(e, true);
        }
        let waited = self.last_progress.elapsed();
        if self.started && !self.warned && crate::param::watchdog().is_some_and(|w| waited > w) {
            // The watchdog: which rank hangs, and on what.
            self.warned = true;
            let comm = self.comm();
            crate::debug::warn(&format!(
                "watchdog: comm {:#x}{} rank {}: operation #{} ({}) has made no progress for {} s: \
                 waiting for {}",
                comm.hash,
                comm.name.as_deref().map_or(String::new(), |n| format!(" ({n})")),
                comm.rank,
                self.task.ticket + 1,
                self.task.what,
                waited.as_secs(),
                self.waiting()
            ));
            if let Some(r) = &comm.recorder {
                r.emit("the watchdog fired");
            }
        }
        if let Some(r) = self.comm().recorder.as_ref().filter(|r| r.asked()) {
            r.emit("SIGUSR2");
        }
        // (Without OXCCL_TIMEOUT_S a live peer is waited for as long as it takes, as NCCL does:
        // one rank may keep the others waiting for minutes, writing a checkpoint.)
        if let Some(t) = timeout.filter(|&t| self.started && waited > t) {
            let waiting = self.waiting();
            let e = Error::timeout(format!(
                "{} on rank {} made no progress for {} s (OXCCL_TIMEOUT_S): waiting for {}",
                self.task.what,
                self.comm().rank,
                t.as_secs(),
                waiting
            ));
            self.finish(Err(e));
        }
    }
}

/// Spoils a finished stage's output on purpose when OXCCL_FAULT=corrupt asks for it.
pub(super) fn spoil(fault: Option<(crate::types::DataType, usize, usize)>) {
    if let Some((dtype, addr, count)) = fault {
        if count > 0 && crate::param::fault_corrupt() {
            // SAFETY: the stage's output buffer holds `count` elements of `dtype`.
            unsafe { crate::reduce::fault_corrupt(dtype, addr as *mut u8, count) };
        }
    }
}

fn describe_wait(l: &Lane) -> Option<String> {
    match (l.works.front()?, l.cur.as_ref()?) {
        (Item::Steps(p), Cur::Steps(c)) => c.describe_wait(p),
        (Item::Board(op), Cur::Board(st)) => Some(st.describe_wait(op)),
        _ => None,
    }
}

/// A busy wait with a deadline reads the clock once in this many turns (a read costs about as
/// much as a small operation's whole exchange; a turn is a pause of tens of nanoseconds).
pub const CLOCK_EVERY: u32 = 128;

/// Tasks being run together by one thread; they can be handed to another thread between polls.
pub struct Batch {
    running: Vec<Running>,
}

impl Batch {
    /// A batch of one task whose only work, a board operation, was begun by the caller (see
    /// `exec::lone`): it goes on from `state`.
    pub(super) fn resume_board(mut task: Task, op: Box<Direct>, state: BoardState) -> Batch {
        let _ = task.stages.first_mut().map(|s| s.lanes.clear());
        let mut r = Running::new(task);
        r.started = true;
        r.stage_lanes = vec![Lane {
            works: VecDeque::from([Item::Board(op)]),
            cur: Some(Cur::Board(state)),
        }];
        Batch { running: vec![r] }
    }

    /// A batch of one task.
    pub fn one(task: Task) -> Batch {
        Batch {
            running: vec![Running::new(task)],
        }
    }

    pub fn new(tasks: Vec<Task>) -> Batch {
        Batch {
            running: tasks.into_iter().map(Running::new).collect(),
        }
    }

    /// Runs until every task is done (true), or until `deadline` passes (false; call again, from
    /// any thread, to go on). Without a deadline it waits as long as it takes: spinning, then
    /// yielding, then sleeping, checking for aborts and timeouts.
    pub fn run_until(&mut self, deadline: Option<Instant>) -> bool {
        self.run_unless(deadline, &|| false)
    }

    /// `run_until`, also giving up (false) when, while it waits, `yield_to()` says another
    /// thread wants to run the batch.
    pub fn run_unless(&mut self, deadline: Option<Instant>, yield_to: &dyn Fn() -> bool) -> bool {
        let timeout = crate::param::timeout();
        let mut idle_spins: u32 = 0;
        let mut backoff = Backoff::default();
        loop {
            let mut all_done = true;
            let mut progress = false;
            for t in &mut self.running {
                match t.poll() {
                    Poll::Done => {}
                    Poll::Progress => {
                        progress = true;
                        all_done = false;
                    }
                    Poll::Blocked => all_done = false,
                }
            }
            if all_done {
                return true;
            }
            if progress {
                idle_spins = 0;
                backoff.reset();
                continue;
            }
            idle_spins = idle_spins.saturating_add(1);
            if idle_spins.is_multiple_of(16) && yield_to() {
                return false;
            }
            if let Some(d) = deadline {
                if idle_spins.is_multiple_of(CLOCK_EVERY) && Instant::now() >= d {
                    return false;
                }
                backoff.spin_or_yield();
                continue;
            }
            // Waiting: spin, then yield (peers on this host answer within microseconds), and
            // only after a while without progress sleep, checking for aborts and timeouts.
            if backoff.pause() {
                for t in &mut self.running {
                    t.check_stuck(timeout);
                }
            }
        }
    }

    /// One batch of several, keeping their task order.
    pub fn join(parts: Vec<Batch>) -> Batch {
        Batch {
            running: parts.into_iter().flat_map(|b| b.running).collect(),
        }
    }

    /// Splits the batch by `owner[i]` (in 0..k) of task i, keeping each part's task order.
    pub fn split(self, owner: &[usize], k: usize) -> Vec<Batch> {
        let mut parts: Vec<Batch> = (0..k)
            .map(|_| Batch {
                running: Vec::new(),
            })
            .collect();
        for (r, &o) in self.running.into_iter().zip(owner) {
            parts[o].running.push(r);
        }
        parts
    }

    /// The first of the tasks' errors, in task order (only call this when all are done): what a
    /// stream keeps and a launch returns. The tasks are dropped before it returns.
    pub fn first_error(self) -> Option<Error> {
        self.running.into_iter().find_map(|r| r.result?.err())
    }

    /// Each task's result (Ok for tasks that did not finish: only call this when all are done).
    pub fn results(self) -> Outcome {
        self.running
            .into_iter()
            .map(|r| r.result.unwrap_or(Ok(())))
            .collect()
    }
}

/// Runs one task to completion on this thread.
pub fn run_one(task: Task) -> Result<()> {
    let mut b = Batch::one(task);
    b.run_until(None);
    b.first_error().map_or(Ok(()), Err)
}

/// Runs tasks to completion on this thread; returns each task's result.
pub fn run(tasks: Vec<Task>) -> Outcome {
    let mut b = Batch::new(tasks);
    b.run_until(None);
    b.results()
}
