//! The host executor: runs tasks on the calling thread (or a host stream's worker) by polling
//! every lane of every task, moving one FIFO slot per primitive whenever its counters allow.
//! Nothing blocks: several ranks' tasks can be driven by one thread, as `ncclGroupEnd` over
//! several communicators requires.

use super::task::{Outcome, Task};
use crate::comm::Core;
use crate::error::{Error, Result};
use crate::plan::{Prim, Program};
use crate::reduce::Reducer;
use std::time::{Duration, Instant};

/// Where a program is: iteration, step, and its resolved reduction.
struct Cursor {
    iter: usize,
    step: usize,
    reducer: Option<Reducer>,
}

struct Lane {
    programs: std::collections::VecDeque<Program>,
    cur: Option<Cursor>,
}

impl Lane {
    fn new(programs: Vec<Program>) -> Lane {
        Lane {
            programs: programs.into(),
            cur: None,
        }
    }
    fn done(&self) -> bool {
        self.programs.is_empty()
    }
}

#[derive(PartialEq, Eq, Clone, Copy)]
enum Poll {
    Done,
    Progress,
    Blocked,
}

/// Copy `bytes` bytes; `src == dst` is a no-op.
///
/// # Safety
/// Both ranges valid; equal or disjoint.
#[inline]
unsafe fn copy(dst: *mut u8, src: *const u8, bytes: usize) {
    if bytes > 0 && !std::ptr::eq(dst, src) {
        // SAFETY: per the contract above.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) };
    }
}

/// Runs as many slices of the lane's current program as the connections allow.
fn poll_lane(lane: &mut Lane) -> Poll {
    let mut progressed = false;
    loop {
        let Some(prog) = lane.programs.front() else {
            return Poll::Done;
        };
        let cur = lane.cur.get_or_insert_with(|| Cursor {
            iter: 0,
            step: 0,
            reducer: prog.red.map(|r| Reducer::new(r.resolve())),
        });
        if cur.iter >= prog.niter || prog.steps.is_empty() {
            lane.programs.pop_front();
            lane.cur = None;
            progressed = true;
            continue;
        }
        let (off, n) = prog.slice_of(cur.step, cur.iter);
        if n > 0 && !run_step(prog, cur, off, n) {
            return if progressed {
                Poll::Progress
            } else {
                Poll::Blocked
            };
        }
        progressed = true;
        cur.step += 1;
        if cur.step == prog.steps.len() {
            cur.step = 0;
            cur.iter += 1;
        }
    }
}

/// Performs step `cur.step` on `n` elements at element offset `off`, if its slots are ready.
fn run_step(prog: &Program, cur: &Cursor, off: usize, n: usize) -> bool {
    let s = &prog.steps[cur.step];
    let es = prog.esize;
    let bytes = n * es;
    let rslot = match &s.recv {
        Some(c) => match c.recv_slot() {
            Some(x) => Some(x),
            None => return false,
        },
        None => None,
    };
    let sslot = match &s.send {
        Some(c) => match c.send_slot() {
            Some(x) => Some(x),
            None => return false,
        },
        None => None,
    };
    let src = (s.src + off * es) as *const u8;
    let dst = (s.dst + off * es) as *mut u8;
    let inp = rslot.map(|x| x.1).unwrap_or(std::ptr::null());
    let out = sslot.map(|x| x.1).unwrap_or(std::ptr::null_mut());
    let red = cur.reducer.as_ref();
    // SAFETY: src/dst lie inside the caller's buffers (validated at enqueue: `len` elements from
    // the segment start), slots hold `slot_bytes >= bytes`, and a slot is owned by this side
    // between seeing it ready and posting it.
    unsafe {
        match s.prim {
            Prim::Send => match red {
                Some(r) if s.prep => r.prep(out, src, n),
                _ => copy(out, src, bytes),
            },
            Prim::Recv => copy(dst, inp, bytes),
            Prim::CopySend => {
                copy(dst, src, bytes);
                copy(out, src, bytes);
            }
            Prim::RecvCopySend => {
                copy(dst, inp, bytes);
                copy(out, inp, bytes);
            }
            Prim::RecvReduceSend => reducer(red).combine(out, src, inp, n),
            Prim::RecvReduceCopy => {
                let r = reducer(red);
                r.combine(dst, src, inp, n);
                r.finish(dst, dst, n);
            }
            Prim::RecvReduceCopySend => {
                let r = reducer(red);
                r.combine(dst, src, inp, n);
                r.finish(dst, dst, n);
                copy(out, dst, bytes);
            }
            Prim::LocalCopy => copy(dst, src, bytes),
            Prim::LocalReduce => {
                let r = reducer(red);
                r.prep(dst, src, n);
                r.finish(dst, dst, n);
            }
        }
    }
    if let (Some(c), Some((step, _))) = (&s.recv, rslot) {
        c.post_recv(step);
    }
    if let (Some(c), Some((step, _))) = (&s.send, sslot) {
        c.post_send(step);
    }
    true
}

fn reducer(r: Option<&Reducer>) -> &Reducer {
    r.expect("planner attaches a reduction to every reducing program")
}

/// A task being run.
struct Running {
    task: Task,
    started: bool,
    stage_lanes: Vec<Lane>,
    p2p: Vec<Lane>,
    result: Option<Result<()>>,
    last_progress: Instant,
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
            last_progress: Instant::now(),
        }
    }

    fn core(&self) -> &Core {
        &self.task.core
    }

    /// One pass over the task's lanes.
    fn poll(&mut self) -> Poll {
        if self.result.is_some() {
            return Poll::Done;
        }
        if !self.started {
            if !self.core().is_serving(self.task.ticket) {
                return Poll::Blocked;
            }
            if let Some(e) = self.core().broken() {
                return self.finish(Err(e));
            }
            self.started = true;
            self.load_stage();
        }
        let mut progress = false;
        loop {
            let mut all_done = true;
            for l in &mut self.stage_lanes {
                match poll_lane(l) {
                    Poll::Progress => {
                        progress = true;
                        all_done = false;
                    }
                    Poll::Blocked => all_done = false,
                    Poll::Done => {}
                }
            }
            if !all_done || self.task.stages.is_empty() {
                break;
            }
            self.end_stage();
            self.load_stage();
            progress = true;
        }
        let stage_done = self.task.stages.is_empty() && self.stage_lanes.iter().all(Lane::done);
        let mut p2p_done = true;
        for l in &mut self.p2p {
            match poll_lane(l) {
                Poll::Progress => {
                    progress = true;
                    p2p_done = false;
                }
                Poll::Blocked => p2p_done = false,
                Poll::Done => {}
            }
        }
        if stage_done && p2p_done {
            self.end_stage();
            return self.finish(Ok(()));
        }
        if progress {
            self.last_progress = Instant::now();
            Poll::Progress
        } else {
            Poll::Blocked
        }
    }

    /// Makes the front stage's lanes current (the stage stays queued until it ends).
    fn load_stage(&mut self) {
        self.stage_lanes = match self.task.stages.front_mut() {
            Some(st) => std::mem::take(&mut st.lanes)
                .into_iter()
                .map(Lane::new)
                .collect(),
            None => Vec::new(),
        };
    }

    fn end_stage(&mut self) {
        if let Some(st) = self.task.stages.pop_front() {
            if let Some((dtype, addr, count)) = st.fault {
                if count > 0 && crate::param::fault_corrupt() {
                    // SAFETY: the stage's output buffer holds `count` elements of `dtype`.
                    unsafe { crate::reduce::fault_corrupt(dtype, addr as *mut u8, count) };
                }
            }
        }
        self.stage_lanes.clear();
    }

    fn finish(&mut self, r: Result<()>) -> Poll {
        if let Err(e) = &r {
            self.core().set_broken(e.clone());
        }
        self.core().advance_serving(self.task.ticket);
        self.result = Some(r);
        Poll::Done
    }

    /// Abort and timeout checks while blocked.
    fn check_stuck(&mut self, timeout: Duration) {
        if self.result.is_some() {
            return;
        }
        if self.core().aborted() {
            let e = Error::remote(format!(
                "{} on rank {}: communicator aborted",
                self.task.what,
                self.core().rank
            ));
            if self.started {
                self.finish(Err(e));
            } else {
                self.result = Some(Err(e));
            }
            return;
        }
        if self.started && self.last_progress.elapsed() > timeout {
            let waiting = self
                .stage_lanes
                .iter()
                .chain(self.p2p.iter())
                .find_map(describe_wait)
                .unwrap_or_else(|| "its peers".into());
            let e = Error::timeout(format!(
                "{} on rank {} made no progress for {} s: waiting for {}",
                self.task.what,
                self.core().rank,
                timeout.as_secs(),
                waiting
            ));
            self.finish(Err(e));
        }
    }
}

fn describe_wait(l: &Lane) -> Option<String> {
    let p = l.programs.front()?;
    let c = l.cur.as_ref()?;
    let s = p.steps.get(c.step)?;
    let conn = s
        .recv
        .as_ref()
        .filter(|c| c.recv_slot().is_none())
        .or(s.send.as_ref())?;
    Some(conn.describe())
}

/// Runs tasks to completion on this thread; returns each task's result.
pub fn run(tasks: Vec<Task>) -> Outcome {
    let timeout = crate::param::timeout();
    let mut running: Vec<Running> = tasks.into_iter().map(Running::new).collect();
    let mut idle_spins: u32 = 0;
    loop {
        let mut all_done = true;
        let mut progress = false;
        for t in &mut running {
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
            break;
        }
        if progress {
            idle_spins = 0;
            continue;
        }
        idle_spins += 1;
        if idle_spins < 64 {
            std::hint::spin_loop();
        } else if idle_spins < 2048 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
            if idle_spins.is_multiple_of(256) {
                for t in &mut running {
                    t.check_stuck(timeout);
                }
            }
        }
    }
    running
        .into_iter()
        .map(|r| r.result.unwrap_or(Ok(())))
        .collect()
}
