//! What a `cudaStream_t` is to the CUDA executor: the CUDA stream itself (the runtime's and the
//! driver's handles are the same); NULL is the legacy default stream. And the rules of a group's
//! streams: which calls the legacy stream needs in one launch, that one communicator's streams
//! capture alike, and the events that join a communicator's streams to its launch and keep its
//! launches in issue order across streams.

use super::{Call, CudaComm};
use crate::error::{Error, Result};
use crate::exec::Stream;
use crate::gpu::driver::{self, check, Capture};

pub fn from_handle(h: usize) -> Result<Stream> {
    Ok(Stream::Cuda(h))
}

/// The driver's handle of a stream argument.
pub fn handle(s: &Stream) -> usize {
    match s {
        Stream::Cuda(h) => *h,
        Stream::Null | Stream::Host(_) => 0,
    }
}

/// The legacy default stream (NULL) runs its kernels one after another, and blocking streams
/// wait for it: so the ranks a call on it needs (a collective: all of its communicator's; a
/// send or receive: its peer), where they are on the same GPU in this process, must be in the
/// same launch on it (one group: one kernel). Else one rank's kernel would wait for ever for
/// another's, queued behind it. An error before anything is enqueued.
pub(super) fn legacy_stream_together(ops: &[Call<'_>]) -> Result<()> {
    let legacy = |q: &Call<'_>| handle(&q.stream) <= 1; // NULL, CU_STREAM_LEGACY
    for q in ops.iter().filter(|q| legacy(q)) {
        let c = q.cuda();
        let local = &c.process_ranks_on_device;
        if local.len() <= 1 {
            continue; // (one rank of it on this GPU in this process: the usual case)
        }
        let here: Vec<usize> = ops
            .iter()
            .filter(|o| legacy(o) && o.cuda().hash == c.hash && o.cuda().ctx == c.ctx)
            .map(|o| o.cuda().rank)
            .collect();
        let p2p = q.args.kind.is_p2p();
        let missing = local
            .iter()
            .filter(|&&r| !p2p || r == q.args.root as usize)
            .filter(|r| !here.contains(r))
            .count();
        if missing > 0 {
            return Err(Error::invalid_usage(format!(
                "{}: {} on the NULL stream (CUDA's legacy default stream), while {} other \
                 rank(s) of this communicator on this GPU in this process are launched apart \
                 from it (other threads, groups or streams): the legacy stream runs kernels \
                 one after another, so theirs would wait for each other for ever. Launch this \
                 GPU's ranks in one group, or give each rank a stream of its own, created \
                 non-blocking",
                c.describe(),
                q.args.kind.name(),
                missing
            )));
        }
    }
    Ok(())
}

/// The streams given to one communicator's calls in a group must all capture the same CUDA
/// graph, or none (NCCL's rule): they are joined to the launch's stream with events, and a
/// capturing stream cannot wait for work outside its graph (nor for another graph's), while a
/// stream that does not capture would be drawn into the graph by waiting for a captured launch.
/// Checked as each call joins the group, for stream `b` against the communicator's first
/// stream in it, `a` (as NCCL does; the group layer calls it through `exec::streams_alike`), so
/// before anything is enqueued. (Where the driver does not tell capture ids apart, streams of
/// two graphs are found when the join's wait is refused, `join_before`.)
pub fn streams_alike(comm: &CudaComm, a: usize, b: usize) -> Result<()> {
    if a == b {
        return Ok(());
    }
    let _g = comm.enter()?;
    let (ca, cb) = (driver::capture(a)?, driver::capture(b)?);
    let why = match (ca, cb) {
        (Capture::No, Capture::No) => return Ok(()),
        (Capture::Graph(x), Capture::Graph(y)) if x.is_none() || y.is_none() || x == y => {
            return Ok(())
        }
        (Capture::Graph(_), Capture::Graph(_)) => "they capture different graphs".to_string(),
        (Capture::Graph(_), Capture::No) => {
            format!("stream {a:#x} captures a graph and {b:#x} does not")
        }
        (Capture::No, Capture::Graph(_)) => {
            format!("stream {b:#x} captures a graph and {a:#x} does not")
        }
    };
    Err(Error::invalid_usage(format!(
        "{}: the streams given to its calls in one group ({a:#x} and {b:#x}) must all capture \
         the same CUDA graph, or none: {why}",
        comm.describe()
    )))
}

/// Orders the launch on `stream` after `comm`'s earlier work: what its other streams `joins`
/// have queued (marked by its join event), and its last launch where that went to another
/// stream: outside graph capture its last launch of all; while `stream` captures `cap`, its
/// last launch captured into the same graph (a captured launch must not wait for work outside
/// its graph, and two launches of one communicator must not run side by side in a replay).
pub(super) fn join_before(
    api: &driver::Api,
    comm: &CudaComm,
    stream: usize,
    joins: &[usize],
    cap: Capture,
) -> Result<()> {
    for &other in joins {
        // SAFETY: the communicator's join event, recorded on the caller's stream.
        check(
            unsafe { (api.event_record)(comm.join_event as _, other as _) },
            || "cuEventRecord (joining a group's streams)".into(),
        )?;
        // SAFETY: as above.
        let r = unsafe { (api.stream_wait_event)(stream as _, comm.join_event as _, 0) };
        if r == driver::CUDA_ERROR_STREAM_CAPTURE_MERGE {
            return Err(Error::invalid_usage(format!(
                "{}: the streams given to its calls in one group ({stream:#x} and {other:#x}) \
                 capture different CUDA graphs; they must all capture the same graph, or none",
                comm.describe()
            )));
        }
        check(r, || "cuStreamWaitEvent (joining a group's streams)".into())?;
    }
    // Replays and eager launches in issue order (NCCL's graph mixing support): an eager launch
    // waits for the replays issued before it (their launches' record nodes); the first
    // captured launch of the communicator in a graph, at each replay, for the eager launches
    // and the replays issued before that replay (wait nodes, the `EXTERNAL` flags: no edges
    // of the graph; both events were recorded when the communicator was made, so every
    // capture gets them). Its later launches in the graph follow it by edges.
    let (last, last_on, last_event) = {
        let l = comm.last.lock();
        (l.recorded.then_some(l.event), l.stream, l.event)
    };
    let c = comm.captured.lock();
    let replays = (c.mixing && c.any).then_some(c.replayed);
    let (event, on, first_in_graph) = match cap {
        Capture::No => (last, last_on, false),
        Capture::Graph(id) => match id.and_then(|id| c.tip(id)) {
            Some(t) => (Some(t.event), Some(t.stream), false),
            None => (None, None, true),
        },
    };
    let wait = |event: usize, flags: std::ffi::c_uint| {
        // SAFETY: our events; the caller's stream.
        check(
            unsafe { (api.stream_wait_event)(stream as _, event as _, flags) },
            || "cuStreamWaitEvent (ordering a communicator's launches)".into(),
        )
    };
    if let (Some(event), true) = (event, on != Some(stream)) {
        wait(event, 0)?; // its last launch (in this graph), on another stream
    }
    match cap {
        Capture::No => replays.map_or(Ok(()), |e| wait(e, 0)),
        Capture::Graph(_) if c.mixing && first_in_graph => {
            for e in [last_event, c.replayed] {
                wait(e, driver::CU_EVENT_WAIT_EXTERNAL)?;
            }
            Ok(())
        }
        Capture::Graph(_) => Ok(()),
    }
}

/// After a launch captured on `stream` into graph `id`: the communicator's later launches
/// captured into the same graph wait for it (its captured event, recorded here: edges of the
/// graph; its last event, which eager launches wait for and `wait_quiescent` queries, is left
/// as it is); an event record node marks it for the eager launches and other graphs' replays
/// issued after a replay (`join_before`); and the group's other streams `joins` wait for it.
pub(super) fn join_captured(
    api: &driver::Api,
    comm: &CudaComm,
    stream: usize,
    joins: &[usize],
    id: Option<u64>,
) -> Result<()> {
    {
        let mut c = comm.captured.lock();
        if std::mem::take(&mut c.no_graphs) {
            crate::debug::info(&format!(
                "{}: its graphUsageMode is 0 (no CUDA graphs), yet a launch is captured into a \
                 graph; without mode 2 (the default), the program orders its graphs' replays and \
                 its eager calls itself",
                comm.describe()
            ));
        }
        // The record node first, so that the communicator's next launch in the graph follows
        // it too (its record nodes form a chain: the last is the latest).
        if c.mixing {
            // SAFETY: our event, on the caller's stream (a node: it records at each replay).
            check(
                unsafe {
                    (api.event_record_flags)(
                        c.replayed as _,
                        stream as _,
                        driver::CU_EVENT_RECORD_EXTERNAL,
                    )
                },
                || "cuEventRecordWithFlags (ordering replays and eager launches)".into(),
            )?;
            c.any = true;
        }
        // (A driver that does not tell graphs apart gets no edges: each launch is taken as the
        // first in its graph.)
        // The graph holds the control block and events its launch names (it may be replayed
        // after the communicator is destroyed), from its first launch there.
        let first = id.is_none_or(|id| c.tip(id).is_none());
        if first && !c.unkept {
            let k = super::kept::Kept {
                ctl: comm.ctl.clone(),
                events: c.events.clone(),
                board: comm.board.clone(),
            };
            c.unkept = id.is_none() || !super::kept::keep(&k, stream);
        }
        if let Some(id) = id {
            let (i, event) = c.slot(api, id, stream, comm.describe())?;
            // SAFETY: the graph's event (recorded in captures only, never queried), the
            // caller's stream.
            check(
                unsafe { (api.event_record)(event as _, stream as _) },
                || "cuEventRecord (ordering a communicator's captured launches)".into(),
            )?;
            c.commit(i, id, stream);
        }
    }
    if joins.is_empty() {
        return Ok(());
    }
    // SAFETY: the communicator's join event, on the caller's stream.
    check(
        unsafe { (api.event_record)(comm.join_event as _, stream as _) },
        || "cuEventRecord (joining a group's streams)".into(),
    )?;
    wait_all(api, comm.join_event, joins)
}

/// Makes each of `streams` wait for `event` (all of them, the first error returned).
fn wait_all(api: &driver::Api, event: usize, streams: &[usize]) -> Result<()> {
    let mut result = Ok(());
    for &other in streams {
        // SAFETY: one of the communicator's events, just recorded; the caller's stream.
        let w = check(
            unsafe { (api.stream_wait_event)(other as _, event as _, 0) },
            || "cuStreamWaitEvent (joining a group's streams)".into(),
        );
        if result.is_ok() {
            result = w;
        }
    }
    result
}

/// Records `comm`'s last event after the launch on `stream` and makes `joins` wait for it (all
/// of them, the first error returned). `own`: the stream whose later launches of `comm` need no
/// wait (`stream`, or one of `joins` once it waits).
pub(super) fn join_after(
    api: &driver::Api,
    comm: &CudaComm,
    stream: usize,
    joins: &[usize],
    own: usize,
) -> Result<()> {
    let mut l = comm.last.lock();
    // SAFETY: our event, on the stream just used.
    check(
        unsafe { (api.event_record)(l.event as _, stream as _) },
        || "cuEventRecord".into(),
    )?;
    l.recorded = true;
    l.stream = Some(stream);
    let result = wait_all(api, l.event, joins);
    if result.is_ok() {
        l.stream = Some(own);
    }
    result
}

/// Forks `side` from `stream`: work queued on `side` from now on follows what `stream` has
/// queued (`event` recorded on `stream`, waited for on `side`; while `stream` captures a graph,
/// this draws `side` into it, until `stream` waits for it again: `wait`).
pub(super) fn fork(api: &driver::Api, stream: usize, side: usize, event: usize) -> Result<()> {
    record(api, stream, event)?;
    wait(api, side, event)
}

/// Records `event` on `stream`.
pub(super) fn record(api: &driver::Api, stream: usize, event: usize) -> Result<()> {
    // SAFETY: one of the communicator's events; the caller's stream or its side stream.
    check(
        unsafe { (api.event_record)(event as _, stream as _) },
        || "cuEventRecord (a group's side stream)".into(),
    )
}

/// Makes `stream` wait for `event`'s last record.
pub(super) fn wait(api: &driver::Api, stream: usize, event: usize) -> Result<()> {
    // SAFETY: one of the communicator's events, recorded; the caller's stream or its side
    // stream.
    check(
        unsafe { (api.stream_wait_event)(stream as _, event as _, 0) },
        || "cuStreamWaitEvent (a group's side stream)".into(),
    )
}
