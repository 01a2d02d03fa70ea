//! A lone operation on the calling thread: a launch of one eager board operation onto an idle
//! stream (or the NULL stream) runs it here at once, without a task, a batch or any allocation,
//! which is what a small operation's latency is made of. When the peers are not there by the
//! deadline, the operation becomes a one-task batch that goes on where it stopped, like any other.

use super::board::BoardState;
use super::host::{spoil, Batch, CLOCK_EVERY};
use super::steps::Poll;
use super::task::{Task, What};
use crate::comm::Core;
use crate::error::Result;
use crate::plan::board::BoardOp;
use crate::plan::{Stage, Work};
use crate::types::DataType;
use std::sync::Arc;
use std::time::Instant;

pub enum Lone {
    /// Finished here, with this result.
    Done(Result<()>),
    /// Not finished by the deadline: run the batch to go on.
    Pending(Batch),
}

/// Runs `op` (this rank's `ticket` of the communicator) until it is done or has waited for about
/// `budget`.
/// `fault` is the output that OXCCL_FAULT=corrupt spoils, as for a stage.
pub fn run(
    core: &Arc<Core>,
    ticket: u64,
    op: BoardOp,
    fault: Option<(DataType, usize, usize)>,
    what: What,
    budget: std::time::Duration,
) -> Lone {
    let task = |lanes| {
        let mut t = Task::new(core.clone(), what);
        t.ticket = ticket;
        t.stages.push_back(Stage {
            lanes,
            fault,
            scratch: Vec::new(),
        });
        t
    };
    // Earlier work of the communicator, or a broken or aborted communicator: the batch knows
    // how to wait for it, or to fail.
    if !core.is_serving(ticket) || core.aborted() || core.broken().is_some() {
        return Lone::Pending(Batch::new(vec![task(vec![vec![Work::Board(Box::new(
            op,
        ))]])]));
    }
    let mut state = BoardState::new(&op);
    let mut spins = 0u32;
    // Read the clock only once the operation has to wait (it costs as much as the operation).
    let mut deadline = None;
    loop {
        match state.poll(&op) {
            Ok(Poll::Done) => {
                spoil(fault);
                core.advance_serving(ticket);
                return Lone::Done(Ok(()));
            }
            Err(e) => {
                core.set_broken(e.clone());
                core.advance_serving(ticket);
                return Lone::Done(Err(e));
            }
            Ok(_) => {
                spins = spins.wrapping_add(1);
                let now = spins.is_multiple_of(CLOCK_EVERY).then(Instant::now);
                if now.is_some_and(|t| t >= *deadline.get_or_insert(t + budget)) {
                    return Lone::Pending(Batch::resume_board(
                        task(Vec::new()),
                        Box::new(op),
                        state,
                    ));
                }
                std::hint::spin_loop();
            }
        }
    }
}
