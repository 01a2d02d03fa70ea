//! A planned task as the host executor runs it: its communicator's state, its turn (ticket),
//! and its work with direct operations numbered and equipped (see `board::Direct`).

use super::board::Direct;
use super::steps::HostProgram;
use super::HostComm;
use crate::error::{Error, Result};
use crate::plan::{self, Addr, Program, Stash, What, Work};
use crate::transport::conns::Conns;
use crate::transport::{Conn, ConnKey};
use std::sync::Arc;

/// One unit of a lane's work.
pub(super) enum Item {
    Steps(HostProgram),
    Board(Box<Direct>),
}

/// Stages run one after another (see `plan::Stage`).
#[derive(Default)]
pub(super) struct Stage {
    pub lanes: plan::Lanes<Item>,
    pub fault: Option<(crate::types::DataType, usize, usize)>,
    pub stash: Scratch,
}

/// The scratch the host provides for a plan's `Stash`: private copies of inputs, taken from
/// the communicator's pool and filled when the work starts (in stream order: a queued task
/// holds no memory), then pointed at by the work's programs, and given back when dropped (a
/// stage's when the stage ends, the task's point-to-point copies with the task).
#[derive(Default)]
pub(super) struct Scratch {
    /// (caller's range start, bytes, copy: empty until filled, then at least `bytes` long).
    copies: Vec<(usize, usize, Vec<u8>)>,
    pool: Option<Arc<StashPool>>,
}

impl Scratch {
    fn new(s: &Stash, pool: &Arc<StashPool>) -> Scratch {
        if s.copies.is_empty() {
            return Scratch::default();
        }
        Scratch {
            copies: s
                .copies
                .iter()
                .map(|&(src, b)| (src, b, Vec::new()))
                .collect(),
            pool: Some(pool.clone()),
        }
    }

    /// Where `a` is in host memory: scratch becomes the address of its copy.
    fn place(&self, a: Addr) -> Result<Addr> {
        match a {
            Addr::Scratch { idx, off } => match self.copies.get(idx as usize) {
                Some((_, bytes, v)) if off <= *bytes && v.len() >= *bytes => {
                    Ok(Addr::User(v.as_ptr() as usize + off))
                }
                _ => Err(Error::internal(format!(
                    "a plan points at scratch {idx}+{off}, which its stash does not have"
                ))),
            },
            a => Ok(a),
        }
    }

    /// Points a program's steps at host memory.
    fn place_program<C>(&self, p: &mut Program<C>) -> Result<()> {
        for s in &mut p.steps {
            s.src = self.place(s.src)?;
            s.dst = self.place(s.dst)?;
        }
        Ok(())
    }

    /// Takes the planned copies, then points the work that reads them at them (`items`: the
    /// work of the stage, or the task's point-to-point work, not started yet).
    ///
    /// # Safety
    /// Each planned source range is readable now (validated at enqueue, and no other work is
    /// writing it).
    pub unsafe fn fill<'a>(&mut self, items: impl Iterator<Item = &'a mut Item>) -> Result<()> {
        let Some(pool) = &self.pool else {
            return Ok(()); // nothing planned (the common case: only in-place inputs are)
        };
        let sizes: Vec<usize> = self.copies.iter().map(|c| c.1.max(1)).collect();
        for ((src, bytes, v), buf) in self.copies.iter_mut().zip(pool.take(&sizes)) {
            *v = buf;
            // SAFETY: per the contract; `v` holds `bytes` and is private.
            unsafe { std::ptr::copy_nonoverlapping(*src as *const u8, v.as_mut_ptr(), *bytes) };
        }
        for it in items {
            match it {
                Item::Steps(p) => self.place_program(p)?,
                Item::Board(d) => {
                    if let Some(f) = d.op.fallback.as_deref_mut() {
                        self.place_program(f)?;
                    }
                }
            }
        }
        Ok(())
    }
}

impl Drop for Scratch {
    /// Nothing refers to the copies any more: the programs that read them settled their slots
    /// sent by reference when they ended (see `steps::Cursor`), and they are dropped first.
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            pool.give(self.copies.drain(..).map(|c| c.2).filter(|v| !v.is_empty()));
        }
    }
}

/// The buffers of a communicator's private copies (in-place sends whose memory a receive of
/// the same task writes), kept from one task to the next. A fresh allocation this large costs
/// a page fault and a cleared page per 4 KiB at every launch: a 4 MiB sendrecv in place between
/// two processes took 3.2-3.9 ms against 0.5 ms out of place, 70% of it in the kernel clearing
/// pages. The pool holds at most as many bytes as the largest set of copies one fill took (a
/// grouped in-place all-to-all takes one per peer), the memory that task needed at once anyway,
/// until the communicator goes; past that it lets go of its smallest buffers.
#[derive(Default)]
pub struct StashPool(parking_lot::Mutex<Kept>);

#[derive(Default)]
struct Kept {
    buffers: Vec<Vec<u8>>,
    /// The most bytes one fill took.
    peak: usize,
}

impl StashPool {
    /// Buffers for copies of `sizes` bytes, the largest first (a small copy does not take the
    /// buffer a large one could use): for each, the smallest kept that is large enough, or a
    /// new one.
    fn take(&self, sizes: &[usize]) -> Vec<Vec<u8>> {
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_unstable_by_key(|&i| std::cmp::Reverse(sizes[i]));
        let mut out: Vec<Vec<u8>> = sizes.iter().map(|_| Vec::new()).collect();
        let mut kept = self.0.lock();
        for i in order {
            let fit = (kept.buffers.iter().enumerate())
                .filter(|(_, v)| v.len() >= sizes[i])
                .min_by_key(|(_, v)| v.len())
                .map(|(j, _)| j);
            if let Some(j) = fit {
                out[i] = kept.buffers.swap_remove(j);
            }
        }
        let total = out.iter().zip(sizes).map(|(v, &b)| v.len().max(b)).sum();
        kept.peak = kept.peak.max(total);
        drop(kept);
        // Allocated outside the lock.
        for (v, &b) in out.iter_mut().zip(sizes) {
            if v.is_empty() {
                *v = vec![0u8; b];
            }
        }
        out
    }

    /// Keeps `bufs`, then lets go of the smallest buffers while it holds more than its peak.
    fn give(&self, bufs: impl Iterator<Item = Vec<u8>>) {
        let mut kept = self.0.lock();
        kept.buffers.extend(bufs);
        kept.buffers
            .sort_unstable_by_key(|v| std::cmp::Reverse(v.len()));
        let mut total = 0;
        let fits = kept.buffers.iter().take_while(|v| {
            total += v.len();
            total <= kept.peak
        });
        let n = fits.count();
        let gone = kept.buffers.split_off(n);
        drop(kept);
        drop(gone); // outside the lock: a large buffer's unmapping takes a while
    }

    /// The sizes of the buffers held, smallest first.
    #[cfg(test)]
    fn held(&self) -> Vec<usize> {
        let mut l: Vec<usize> = self.0.lock().buffers.iter().map(Vec::len).collect();
        l.sort_unstable();
        l
    }
}

pub struct Task {
    pub comm: Arc<HostComm>,
    pub ticket: u64,
    pub(super) stages: plan::Stages<Stage>,
    pub(super) p2p: Vec<Vec<Item>>,
    pub(super) p2p_stash: Scratch,
    /// What the task does, for log and timeout messages.
    pub what: What,
}

impl Task {
    /// An empty task of `comm` (its ticket is given by whoever queues it).
    pub(super) fn new(comm: Arc<HostComm>, what: What) -> Task {
        Task {
            comm,
            ticket: u64::MAX,
            stages: plan::Stages::new(),
            p2p: Vec::new(),
            p2p_stash: Scratch::default(),
            what,
        }
    }

    /// The host's form of a planned task, bound to the connections made at launch, with its
    /// ticket taken: call in issue order (direct operations are numbered here, identically on
    /// every rank).
    pub(super) fn from_plan(
        comm: &Arc<HostComm>,
        conns: &Conns,
        t: plan::Task,
        what: What,
    ) -> Result<Task> {
        let mut task = Task::new(comm.clone(), what);
        // Each lane collected in place (an Item is the size of the Work it replaces).
        let lane = |l: Vec<Work>| -> Result<Vec<Item>> {
            l.into_iter().map(|w| item(comm, conns, w)).collect()
        };
        // A stage's one lane is held in place; several stay in the planned stage's vector,
        // converted in place too. A task's one stage is held in place: no allocation.
        let stage_lanes = |l: plan::Lanes| -> Result<plan::Lanes<Item>> {
            if l.spilled() {
                let v = l.into_vec().into_iter().map(&lane).collect::<Result<_>>()?;
                Ok(plan::Lanes::from_vec(v))
            } else {
                l.into_iter().map(&lane).collect()
            }
        };
        task.stages = t
            .stages
            .into_iter()
            .map(|s| {
                Ok(Stage {
                    lanes: stage_lanes(s.lanes)?,
                    fault: s.fault,
                    stash: Scratch::new(&s.stash, &comm.stash_pool),
                })
            })
            .collect::<Result<_>>()?;
        task.p2p_stash = Scratch::new(&t.p2p_stash, &comm.stash_pool);
        task.p2p = t.p2p.into_iter().map(&lane).collect::<Result<_>>()?;
        // The ticket is taken only once planning succeeded, so a failed plan never blocks the comm.
        task.ticket = comm.take_ticket();
        if let Some(r) = &comm.recorder {
            r.queued(task.ticket + 1, what);
        }
        Ok(task)
    }
}

fn item(comm: &HostComm, conns: &Conns, w: Work) -> Result<Item> {
    // A program names the same few connections step after step: look each up once.
    // (A few, in place: a launch allocates enough already.)
    let mut seen: [Option<(ConnKey, Arc<Conn>)>; 4] = Default::default();
    let mut bind = |k: ConnKey| -> Result<Arc<Conn>> {
        if let Some((_, c)) = seen.iter().flatten().find(|(x, _)| *x == k) {
            return Ok(c.clone());
        }
        let c = conns.bound(k)?;
        if let Some(free) = seen.iter_mut().find(|s| s.is_none()) {
            *free = Some((k, c.clone()));
        }
        Ok(c)
    };
    Ok(match w {
        Work::Steps(p) => Item::Steps(p.bind(&mut bind)?),
        Work::Board(op) => match Direct::new(comm, op.bind(&mut bind)?) {
            Some(d) => Item::Board(Box::new(d)),
            None => {
                return Err(Error::internal(
                    "a direct operation was planned for a communicator without a board",
                ))
            }
        },
    })
}

/// The outcome of running a set of tasks: one result per task.
pub type Outcome = Vec<Result<()>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stash_pool_hands_back_what_it_kept_up_to_the_most_one_fill_took() {
        let pool = Arc::new(StashPool::default());
        let src: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
        let stash = |bytes: &[usize]| Stash {
            copies: bytes.iter().map(|&b| (src.as_ptr() as usize, b)).collect(),
        };
        let filled = |bytes: &[usize]| {
            let mut s = Scratch::new(&stash(bytes), &pool);
            // SAFETY: `src` holds every planned range.
            unsafe { s.fill(std::iter::empty()).unwrap() };
            for (_, b, v) in &s.copies {
                assert!(v.len() >= *b);
                assert_eq!(v[..*b], src[..*b], "a copy holds its source");
            }
            s
        };
        // Planned copies take no memory until the work starts.
        let s = Scratch::new(&stash(&[4096]), &pool);
        assert!(s.copies[0].2.is_empty());
        assert!(s.place(Addr::Scratch { idx: 0, off: 0 }).is_err());
        drop(s);
        assert_eq!(pool.held(), Vec::<usize>::new());
        // Filled from the pool, given back when dropped.
        let s = filled(&[4096, 100]);
        let first = s.copies[0].2.as_ptr();
        drop(s);
        assert_eq!(pool.held(), vec![100, 4096]);
        // The smallest kept buffer that is large enough: the same memory again.
        let s = filled(&[3000]);
        assert_eq!(s.copies[0].2.as_ptr(), first);
        assert_eq!(pool.held(), vec![100]);
        // Placed scratch points into its copy, within the planned bytes only.
        let at = s.place(Addr::Scratch { idx: 0, off: 8 }).unwrap();
        assert!(matches!(at, Addr::User(a) if a == first as usize + 8));
        assert!(s.place(Addr::Scratch { idx: 0, off: 3001 }).is_err());
        assert!(s.place(Addr::Scratch { idx: 1, off: 0 }).is_err());
        drop(s);
        // The largest copy chooses first: the small one before it does not take its buffer.
        let s = filled(&[200, 4000]);
        assert_eq!(s.copies[1].2.as_ptr(), first);
        drop(s);
        // Up to the most one fill took (4296 bytes): the 100 goes.
        assert_eq!(pool.held(), vec![200, 4096]);
        // Past the most one fill took (11000 bytes), the smallest go.
        drop(filled(&[5000, 6000]));
        assert_eq!(pool.held(), vec![5000, 6000]);
        // Nothing planned: no pool, nothing taken or given.
        let none = Scratch::new(&stash(&[]), &pool);
        assert!(none.pool.is_none());
        drop(none);
        assert_eq!(pool.held(), vec![5000, 6000]);
    }
}
