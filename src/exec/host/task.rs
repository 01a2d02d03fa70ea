//! A planned task as the host executor runs it: its communicator's state, its turn (ticket),
//! and its work with direct operations numbered and equipped (see `board::Direct`).

use super::board::Direct;
use super::HostComm;
use crate::error::{Error, Result};
use crate::plan::{self, Program, Stash, What, Work};
use std::collections::VecDeque;
use std::sync::Arc;

/// One unit of a lane's work.
pub(super) enum Item {
    Steps(Program),
    Board(Box<Direct>),
}

/// Stages run one after another (see `plan::Stage`).
#[derive(Default)]
pub(super) struct Stage {
    pub lanes: Vec<Vec<Item>>,
    pub fault: Option<(crate::types::DataType, usize, usize)>,
    pub stash: Stash,
}

pub struct Task {
    pub comm: Arc<HostComm>,
    pub ticket: u64,
    pub(super) stages: VecDeque<Stage>,
    pub(super) p2p: Vec<Vec<Item>>,
    pub(super) p2p_stash: Stash,
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
            p2p_stash: Stash::default(),
            what,
        }
    }

    /// The host's form of a planned task, with its ticket taken: call in issue order (direct
    /// operations are numbered here, identically on every rank).
    pub(super) fn from_plan(comm: &Arc<HostComm>, t: plan::Task, what: What) -> Result<Task> {
        let mut task = Task::new(comm.clone(), what);
        let lanes = |lanes: Vec<Vec<Work>>| -> Result<Vec<Vec<Item>>> {
            lanes
                .into_iter()
                .map(|l| l.into_iter().map(|w| item(comm, w)).collect())
                .collect()
        };
        for s in t.stages {
            task.stages.push_back(Stage {
                lanes: lanes(s.lanes)?,
                fault: s.fault,
                stash: s.stash,
            });
        }
        task.p2p = lanes(t.p2p)?;
        task.p2p_stash = t.p2p_stash;
        // The ticket is taken only once planning succeeded, so a failed plan never blocks the comm.
        task.ticket = comm.take_ticket();
        Ok(task)
    }
}

fn item(comm: &HostComm, w: Work) -> Result<Item> {
    Ok(match w {
        Work::Steps(p) => Item::Steps(p),
        Work::Board(op) => match Direct::new(comm, *op) {
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
