//! Lone operations on the calling thread: a launch of eager board operations (at most one per
//! communicator, as a group of `ncclAllReduce`s over the ranks of one thread makes) onto idle
//! streams or the NULL stream runs them here at once, polled together, without a task, a batch
//! or any allocation, which is what a small operation's latency is made of. An operation whose
//! peers are not there by the deadline becomes a one-task batch that goes on where it stopped,
//! like any other.

use super::batch::{spoil, Batch, CLOCK_EVERY};
use super::board::{BoardState, Direct};
use super::steps::Poll;
use super::task::{Item, Stage, Task};
use super::HostComm;
use crate::error::Result;
use crate::plan::board::{BoardKind, BoardOp};
use crate::plan::RedSpec;
use crate::transport::board::Board;
use crate::types::CollArgs;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One eager board operation, this rank's `ticket` of its communicator.
pub struct LoneOp<'a> {
    comm: &'a Arc<HostComm>,
    ticket: u64,
    /// Taken by `finish`.
    op: Option<Direct>,
    /// None when the operation cannot start here (earlier work of the communicator, or a broken
    /// or aborted communicator): the batch knows how to wait for it, or to fail.
    state: Option<BoardState>,
    result: Option<Result<()>>,
}

impl<'a> LoneOp<'a> {
    /// Starts call `a` as a lone eager operation of `comm`, number `seq` on `board`, built in
    /// place (a small operation's launch is made of such copies).
    #[inline]
    pub fn start(
        comm: &'a Arc<HostComm>,
        (board, seq): (Arc<Board>, u64),
        a: &CollArgs,
        red: Option<RedSpec>,
        kind: BoardKind,
    ) -> LoneOp<'a> {
        let ticket = comm.take_ticket();
        // The batch that goes on with an operation that cannot begin here fails it as it should.
        let state = (comm.is_serving(ticket) && comm.try_begin(ticket)).then(BoardState::new);
        // (Built as the value returned, with no local to move from: a copy of the whole
        // operation per launch otherwise.)
        LoneOp {
            comm,
            ticket,
            op: Some(Direct {
                op: {
                    let mut op = BoardOp::new(comm.rank, comm.nranks, a, red, kind, None);
                    op.seq = seq;
                    op
                },
                board,
                maps: None,
                cma: comm.cma,
                tuner: None,
            }),
            state,
            result: None,
        }
    }

    /// Polls once; true when the operation is finished (see `result`).
    fn poll(&mut self) -> bool {
        if self.result.is_some() {
            return true;
        }
        let (Some(state), Some(op)) = (&mut self.state, &self.op) else {
            return false;
        };
        let r = match state.poll(op) {
            Ok(Poll::Done) => {
                spoil(Some(op.output()));
                Ok(())
            }
            Err(e) => {
                self.comm.health.fail(e.clone());
                state.leave(op, &|p| self.comm.peer_alive(p));
                Err(e)
            }
            Ok(_) => return false,
        };
        self.comm.advance_serving(self.ticket);
        self.result = Some(r);
        true
    }

    /// The result when finished, or the batch that goes on with it (once: the operation is
    /// taken).
    pub fn finish(&mut self) -> std::result::Result<Result<()>, Batch> {
        if let Some(r) = self.result.take() {
            return Ok(r);
        }
        let op = Box::new(self.op.take().expect("a lone operation finishes once"));
        let mut t = Task::new(self.comm.clone(), op.what());
        t.ticket = self.ticket;
        let fault = Some(op.output());
        let stage = |lanes| Stage {
            lanes,
            fault,
            stash: Default::default(),
        };
        Err(match self.state.take() {
            Some(state) => {
                t.stages.push(stage(Default::default()));
                Batch::resume_board(t, op, state)
            }
            None => {
                t.stages
                    .push(stage(smallvec::smallvec![vec![Item::Board(op)]]));
                Batch::new(vec![t])
            }
        })
    }
}

/// Polls `ops` together until all are finished or they have waited for about `budget`.
pub fn run(ops: &mut [LoneOp<'_>], budget: Duration) {
    let mut spins = 0u32;
    // Read the clock only once the operations have to wait (it costs as much as one).
    let mut deadline = None;
    loop {
        let mut all = true;
        for o in ops.iter_mut() {
            all &= o.poll();
        }
        if all {
            return;
        }
        spins = spins.wrapping_add(1);
        let now = spins.is_multiple_of(CLOCK_EVERY).then(Instant::now);
        if now.is_some_and(|t| t >= *deadline.get_or_insert(t + budget)) {
            return;
        }
        std::hint::spin_loop();
    }
}
