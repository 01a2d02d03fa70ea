//! A task: the work one group launch gives one communicator, in the order it must run.
//! Collective stages run one after another; point-to-point lanes run alongside them.
//! Tasks of one communicator run in ticket order, whichever thread or stream runs them.

use crate::comm::Core;
use crate::error::Result;
use crate::plan::{Stage, Stash, Work};
use std::collections::VecDeque;
use std::sync::Arc;

pub struct Task {
    pub core: Arc<Core>,
    pub ticket: u64,
    pub stages: VecDeque<Stage>,
    pub p2p: Vec<Vec<Work>>,
    /// Copies of send buffers that receives of the same task overwrite (see `Stash`).
    pub p2p_stash: Stash,
    /// What the task does, for log and timeout messages.
    pub what: What,
}

/// A task's description, formatted only when a message needs it (not on every launch).
#[derive(Clone, Copy, Debug)]
pub struct What {
    pub kind: &'static str,
    pub count: usize,
    pub dtype: &'static str,
    /// Further calls of the same communicator in the group.
    pub more: usize,
}

impl std::fmt::Display for What {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} of {} x {}", self.kind, self.count, self.dtype)?;
        if self.more > 0 {
            write!(f, " (+{} more in the group)", self.more)?;
        }
        Ok(())
    }
}

impl Task {
    pub fn new(core: Arc<Core>, what: What) -> Task {
        Task {
            core,
            ticket: u64::MAX,
            stages: VecDeque::new(),
            p2p: Vec::new(),
            p2p_stash: Stash::default(),
            what,
        }
    }
}

/// The outcome of running a set of tasks: one result per task.
pub type Outcome = Vec<Result<()>>;
