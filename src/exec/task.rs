//! A task: the work one group launch gives one communicator, in the order it must run.
//! Collective stages run one after another; point-to-point lanes run alongside them.
//! Tasks of one communicator run in ticket order, whichever thread or stream runs them.

use crate::comm::Core;
use crate::error::Result;
use crate::plan::{Stage, Work};
use std::collections::VecDeque;
use std::sync::Arc;

pub struct Task {
    pub core: Arc<Core>,
    pub ticket: u64,
    pub stages: VecDeque<Stage>,
    pub p2p: Vec<Vec<Work>>,
    /// What the task does, for log and timeout messages.
    pub what: String,
}

impl Task {
    pub fn new(core: Arc<Core>, what: String) -> Task {
        Task {
            core,
            ticket: u64::MAX,
            stages: VecDeque::new(),
            p2p: Vec::new(),
            what,
        }
    }
}

/// The outcome of running a set of tasks: one result per task.
pub type Outcome = Vec<Result<()>>;
