//! A planned task as the host executor runs it: its communicator's state, its turn (ticket),
//! and its work with direct operations numbered and equipped (see `board::Direct`).

use super::board::Direct;
use super::steps::HostProgram;
use super::HostComm;
use crate::error::{Error, Result};
use crate::plan::{self, Addr, Program, Stash, What, Work};
use crate::transport::conns::Conns;
use crate::transport::{Conn, ConnKey};
use std::collections::VecDeque;
use std::sync::Arc;

/// One unit of a lane's work.
pub(super) enum Item {
    Steps(HostProgram),
    Board(Box<Direct>),
}

/// Stages run one after another (see `plan::Stage`).
#[derive(Default)]
pub(super) struct Stage {
    pub lanes: Vec<Vec<Item>>,
    pub fault: Option<(crate::types::DataType, usize, usize)>,
    pub stash: Scratch,
}

/// The scratch the host provides for a plan's `Stash`: private copies of inputs, allocated when
/// the task is made and filled when its work starts (in stream order).
#[derive(Default)]
pub(super) struct Scratch {
    /// (caller's range start, bytes, copy).
    copies: Vec<(usize, usize, Vec<u8>)>,
}

impl Scratch {
    fn new(s: &Stash) -> Scratch {
        Scratch {
            copies: s
                .copies
                .iter()
                .map(|&(src, bytes)| (src, bytes, vec![0u8; bytes.max(1)]))
                .collect(),
        }
    }

    /// Where `a` is in host memory: scratch becomes the address of its copy.
    fn place(&self, a: Addr) -> Result<Addr> {
        match a {
            Addr::Scratch { idx, off } => match self.copies.get(idx as usize) {
                Some((_, bytes, v)) if off <= *bytes => Ok(Addr::User(v.as_ptr() as usize + off)),
                _ => Err(Error::internal(format!(
                    "a plan points at scratch {idx}+{off}, which its stash does not have"
                ))),
            },
            a => Ok(a),
        }
    }

    /// Points a program's steps at host memory.
    fn place_program<C>(&self, p: &mut Program<C>) -> Result<()> {
        if self.copies.is_empty() {
            // Nothing to place (the common case: a stash is planned only for in-place inputs).
            return Ok(());
        }
        for s in &mut p.steps {
            s.src = self.place(s.src)?;
            s.dst = self.place(s.dst)?;
        }
        Ok(())
    }

    /// Takes the planned copies.
    ///
    /// # Safety
    /// Each planned source range is readable now (validated at enqueue, and no other work is
    /// writing it).
    pub unsafe fn fill(&mut self) {
        for (src, bytes, v) in &mut self.copies {
            // SAFETY: per the contract; `v` holds `bytes` and is private.
            unsafe { std::ptr::copy_nonoverlapping(*src as *const u8, v.as_mut_ptr(), *bytes) };
        }
    }
}

pub struct Task {
    pub comm: Arc<HostComm>,
    pub ticket: u64,
    pub(super) stages: VecDeque<Stage>,
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
            stages: VecDeque::new(),
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
        let lanes = |lanes: Vec<Vec<Work>>, sc: &Scratch| -> Result<Vec<Vec<Item>>> {
            // Collected in place (an Item is the size of the Work it replaces): no allocation.
            lanes
                .into_iter()
                .map(|l| l.into_iter().map(|w| item(comm, conns, w, sc)).collect())
                .collect()
        };
        // Converted in place (a host stage is the size of a planned one): no allocation.
        let stages: Vec<plan::Stage> = t.stages.into();
        task.stages = stages
            .into_iter()
            .map(|s| {
                let stash = Scratch::new(&s.stash);
                Ok(Stage {
                    lanes: lanes(s.lanes, &stash)?,
                    fault: s.fault,
                    stash,
                })
            })
            .collect::<Result<Vec<Stage>>>()?
            .into();
        task.p2p_stash = Scratch::new(&t.p2p_stash);
        task.p2p = lanes(t.p2p, &task.p2p_stash)?;
        // The ticket is taken only once planning succeeded, so a failed plan never blocks the comm.
        task.ticket = comm.take_ticket();
        if let Some(r) = &comm.recorder {
            r.queued(task.ticket + 1, what);
        }
        Ok(task)
    }
}

fn item(comm: &HostComm, conns: &Conns, w: Work, sc: &Scratch) -> Result<Item> {
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
        Work::Steps(mut p) => {
            sc.place_program(&mut p)?;
            Item::Steps(p.bind(&mut bind)?)
        }
        Work::Board(mut op) => match Direct::new(comm, {
            if let Some(f) = op.fallback.as_deref_mut() {
                sc.place_program(f)?;
            }
            op.bind(&mut bind)?
        }) {
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
