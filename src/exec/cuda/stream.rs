//! What a `cudaStream_t` is to the CUDA executor: the CUDA stream itself (the runtime's and the
//! driver's handles are the same); NULL is the legacy default stream. And the rules of a group's
//! streams: which calls the legacy stream needs in one launch, that one communicator's streams
//! capture alike, and the events that join a communicator's streams to its launch and keep its
//! launches in issue order across streams.

use super::{Call, CudaComm};
use crate::error::{Error, Result};
use crate::exec::Stream;
use crate::gpu::driver::{self, check};

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
/// capturing stream cannot wait for work outside its graph, while a stream that does not
/// capture would be drawn into the graph by waiting for a captured launch. (Streams of two
/// different graphs are found when the join's wait is refused, `join_before`.) An error before
/// anything is enqueued.
pub(super) fn captures_alike(per_comm: &[Vec<Call<'_>>]) -> Result<()> {
    for qs in per_comm {
        let mut streams: Vec<usize> = Vec::new();
        for q in qs {
            let h = handle(&q.stream);
            if !streams.contains(&h) {
                streams.push(h);
            }
        }
        if streams.len() < 2 {
            continue;
        }
        let _g = qs[0].cuda().enter()?;
        let first = driver::capturing(streams[0])?;
        for &h in &streams[1..] {
            if driver::capturing(h)? != first {
                let (yes, no) = if first {
                    (streams[0], h)
                } else {
                    (h, streams[0])
                };
                return Err(Error::invalid_usage(format!(
                    "{}: the streams given to its calls in this group must all capture the \
                     same CUDA graph, or none: stream {yes:#x} captures a graph and stream \
                     {no:#x} does not",
                    qs[0].cuda().describe()
                )));
            }
        }
    }
    Ok(())
}

/// Orders the launch on `stream` after `comm`'s earlier work: what its other streams `joins`
/// have queued (marked by its join event) and, unless `stream` captures a graph (whose launches
/// must not wait for work outside it), its last launch, where that went to another stream.
pub(super) fn join_before(
    api: &driver::Api,
    comm: &CudaComm,
    stream: usize,
    joins: &[usize],
    capturing: bool,
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
                "{}: the streams given to its calls in this group ({stream:#x} and {other:#x}) \
                 capture different CUDA graphs; they must all capture the same graph, or none",
                comm.describe()
            )));
        }
        check(r, || "cuStreamWaitEvent (joining a group's streams)".into())?;
    }
    if capturing {
        return Ok(());
    }
    let l = comm.last.lock();
    if l.recorded && l.stream != Some(stream) {
        // SAFETY: our event, recorded on the communicator's last stream.
        check(
            unsafe { (api.stream_wait_event)(stream as _, l.event as _, 0) },
            || "cuStreamWaitEvent (ordering a communicator's launches)".into(),
        )?;
    }
    Ok(())
}

/// Makes the other streams `joins` of a group captured into a graph wait for the launch on
/// `stream` (edges of the graph: the communicator's last event, which eager launches wait for,
/// is left as it is).
pub(super) fn join_captured(
    api: &driver::Api,
    comm: &CudaComm,
    stream: usize,
    joins: &[usize],
) -> Result<()> {
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
