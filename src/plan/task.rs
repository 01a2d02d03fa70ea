//! A task: the work one group launch gives one communicator, in the order it must run, as plain
//! data any executor can run. Collective stages run one after another; point-to-point lanes run
//! alongside them. The executor decides when the task runs (in issue order per communicator)
//! and gives its direct operations their sequence numbers.

use super::{Stage, Stash, Work};
use crate::transport::ConnKey;

/// A task's stages, in order. Most tasks have one, held in place (see `Lanes`).
pub type Stages<S = Stage> = smallvec::SmallVec<[S; 1]>;

#[derive(Default)]
pub struct Task {
    pub stages: Stages,
    pub p2p: Vec<Vec<Work>>,
    /// Copies of send buffers that receives of the same task overwrite (see `Stash`).
    pub p2p_stash: Stash,
    /// The stages of the task before its first point-to-point call (None: it has none). An
    /// executor that runs stages one after the other runs the point-to-point lanes beside the
    /// last of those (`p2p_stage`), so that a peer that makes the same calls in the same
    /// order, grouped otherwise, never waits for a collective queued behind them.
    pub p2p_after: Option<usize>,
}

impl Task {
    /// The stage beside which the point-to-point lanes run (see `p2p_after`).
    pub fn p2p_stage(&self) -> usize {
        self.p2p_after.unwrap_or(0).saturating_sub(1)
    }

    /// Calls `f` with every connection the task may use (with repeats; a plain loop).
    pub fn for_each_key(&self, f: &mut impl FnMut(ConnKey)) {
        for lane in self
            .stages
            .iter()
            .flat_map(|s| s.lanes.iter())
            .chain(self.p2p.iter())
        {
            for w in lane {
                w.for_each_key(f);
            }
        }
    }
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
