//! The validated Rust API under the C ABI: every `nccl*` entry point converts its arguments and
//! calls exactly one function here. Nothing in this module sees a raw C struct.

use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::types::DataType;
use std::sync::Arc;

pub const VERSION_CODE: i32 = 23203;
pub use crate::bootstrap::ID_BYTES as UNIQUE_ID_BYTES;

pub use crate::exec::Stream as StreamArg;
pub use crate::types::{CollArgs, CommConfig, ScalarArg};

pub fn version() -> i32 {
    VERSION_CODE
}

pub fn get_unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    crate::bootstrap::UniqueId::generate().map(|id| id.to_bytes())
}

/// `ncclCommInitRank[Config]`: blocking, or deferred to `ncclGroupEnd` inside a group.
pub fn comm_init_rank(
    nranks: i32,
    id: &[u8; UNIQUE_ID_BYTES],
    rank: i32,
    config: CommConfig,
) -> Result<Arc<Comm>> {
    comm_init_rank_scalable(nranks, rank, &[*id], config)
}

pub fn comm_init_rank_scalable(
    nranks: i32,
    rank: i32,
    ids: &[[u8; UNIQUE_ID_BYTES]],
    config: CommConfig,
) -> Result<Arc<Comm>> {
    let comm = crate::comm::pending_rank(nranks, rank, ids, config)?;
    if !crate::group::defer_init(&comm) {
        comm.start_init()?;
    }
    Ok(comm)
}

/// `ncclCommInitAll`: `devs` are the device (or host slot) numbers, one per rank.
pub fn comm_init_all(devs: &[i32]) -> Result<Vec<Arc<Comm>>> {
    crate::comm::init_all(devs)
}

/// Hand a comm to C: its handle stays valid until `release_comm_handle`.
pub fn comm_handle(comm: &Arc<Comm>) -> usize {
    crate::comm::handles::register(comm)
}

/// Look a C handle up: null, never-issued or destroyed handles are `ncclInvalidArgument`.
pub fn comm_from_handle(h: usize) -> Result<Arc<Comm>> {
    crate::comm::handles::lookup(h)
}

pub fn comm_finalize(comm: &Arc<Comm>) -> Result<()> {
    comm.finalize()
}

/// `ncclCommDestroy`: the handle is invalid afterwards.
pub fn comm_destroy(h: usize) -> Result<()> {
    // A non-blocking init still running: refused, the handle kept (as NCCL's, which says to
    // wait for it or abort), rather than wait for peers that may never come.
    if crate::comm::handles::lookup(h).is_ok_and(|c| c.init_running()) {
        return Err(Error::invalid_argument(
            "ncclCommDestroy: a non-blocking init is still in progress (the communicator's, or \
             that of one split or shrunk from it): wait until ncclCommGetAsyncError returns \
             ncclSuccess, or call ncclCommAbort",
        ));
    }
    let comm = crate::comm::handles::unregister(h)?;
    comm.destroy()
}

/// `ncclCommAbort`: stops in-flight work, then destroys. What the teardown met (kernels that
/// did not stop in time, a failed device) is a WARN, not the call's error, as NCCL's abort
/// ends the communicator whatever it meets: a caller aborts in its own error paths and
/// destructors (PyTorch's `~ProcessGroupNCCL` rethrows an abort's error, which ends the
/// process there).
pub fn comm_abort(h: usize) -> Result<()> {
    let comm = crate::comm::handles::unregister(h)?;
    comm.abort();
    if let Err(e) = comm.destroy() {
        crate::debug::warn(&format!("ncclCommAbort: {}", e.msg));
    }
    Ok(())
}

/// A communicator's load/store domains (the ranks of one host): (rank, nRanks, this rank's
/// index on its host, ranks on its host, number of hosts).
pub fn comm_lsa(comm: &Arc<Comm>) -> Result<(usize, usize, usize, usize, usize)> {
    let core = comm.core()?;
    let hosts: Vec<u64> = (0..core.nranks).filter_map(|r| core.host_of(r)).collect();
    let mine = hosts[core.rank];
    let lsa_rank = hosts[..core.rank].iter().filter(|&&h| h == mine).count();
    let lsa_size = hosts.iter().filter(|&&h| h == mine).count();
    Ok((
        core.rank,
        core.nranks,
        lsa_rank,
        lsa_size,
        core.conns.nodes(),
    ))
}

pub fn comm_async_error(comm: &Arc<Comm>) -> crate::error::Code {
    comm.async_error()
}

pub fn comm_split(
    comm: &Arc<Comm>,
    color: i32,
    key: i32,
    config: Option<CommConfig>,
) -> Result<Option<Arc<Comm>>> {
    if crate::group::depth() > 0 {
        return crate::comm::split_at_group_end(comm, color, key, config, |c| {
            crate::group::defer_init(c);
        });
    }
    crate::comm::split(comm, color, key, config)
}

/// `ncclCommShrink`: the ranks not in `exclude` make a new communicator (`abort`:
/// `NCCL_SHRINK_ABORT`, stop the old one's work first).
pub fn comm_shrink(
    comm: &Arc<Comm>,
    exclude: &[i32],
    config: Option<CommConfig>,
    abort: bool,
) -> Result<Arc<Comm>> {
    if crate::group::depth() > 0 {
        return crate::comm::shrink_at_group_end(comm, exclude, config, abort, |c| {
            crate::group::defer_init(c);
        });
    }
    crate::comm::shrink(comm, exclude, config, abort)
}

/// `ncclCommRevoke`: stops the communicator's work; it can then only be shrunk, split,
/// destroyed or aborted.
pub fn comm_revoke(comm: &Arc<Comm>) -> Result<()> {
    comm.revoke()
}

/// Queue a collective or a send/recv (executes at once outside a group).
pub fn enqueue(comm: &Arc<Comm>, args: CollArgs, stream: StreamArg) -> Result<()> {
    crate::group::enqueue(comm, args, stream)
}

pub fn group_start() -> Result<()> {
    crate::group::start()
}

pub fn group_end() -> Result<()> {
    crate::group::end()
}

/// `r`, whose error (not `ncclInProgress`) inside a group becomes the group's error (a call
/// or an init refused before it was queued).
pub fn group_noted<T>(r: Result<T>) -> Result<T> {
    if let Err(e) = &r {
        if e.code != crate::error::Code::InProgress {
            crate::group::note_error(e);
        }
    }
    r
}

/// How deep the calling thread is in groups (0: in none).
pub fn group_depth() -> usize {
    crate::group::depth()
}

/// `ncclGroupSimulateEnd`: closes the group without launching its calls; whether it held
/// calls.
pub fn group_simulate_end() -> Result<bool> {
    crate::group::simulate_end()
}

pub fn redop_create_premulsum(comm: &Arc<Comm>, dtype: DataType, scalar: ScalarArg) -> Result<i32> {
    comm.redops.create(dtype, scalar)
}

pub fn redop_destroy(comm: &Arc<Comm>, op: i32) -> Result<()> {
    comm.redops.destroy(op)
}

/// `ncclMemAlloc`. Zero bytes: NULL and success (as NCCL's, whose fallback `cudaMalloc` of 0
/// gives NULL); `ncclMemFree(NULL)` is a no-op.
pub fn mem_alloc(size: usize) -> Result<usize> {
    if size == 0 {
        return Ok(0);
    }
    crate::exec::mem_alloc(size)
}

pub fn mem_free(ptr: usize) -> Result<()> {
    crate::exec::mem_free(ptr)
}

pub fn comm_register(comm: &Arc<Comm>, buf: usize, size: usize) -> Result<usize> {
    comm.registry.register(buf, size)
}

pub fn comm_deregister(comm: &Arc<Comm>, handle: usize) -> Result<()> {
    comm.registry.deregister(handle)
}

/// What a `cudaStream_t` means to this process's executor.
pub fn stream_from_handle(h: usize) -> Result<StreamArg> {
    StreamArg::from_handle(h)
}

// Host streams: the host executor's extension (`oxcclHostStream*`).

pub fn host_stream_create() -> Result<usize> {
    crate::exec::host::stream::create()
}

pub fn host_stream_synchronize(h: usize) -> Result<()> {
    crate::exec::host::stream::lookup(h)?.synchronize()
}

/// `Ok(true)` when all work queued on the stream is done.
pub fn host_stream_query(h: usize) -> Result<bool> {
    crate::exec::host::stream::lookup(h)?.query()
}

pub fn host_stream_destroy(h: usize) -> Result<()> {
    crate::exec::host::stream::destroy(h)
}

/// For features that belong to a later issue: a clear `ncclInvalidUsage`.
pub fn not_yet<T>(what: &str) -> Result<T> {
    Err(Error::not_yet(what))
}
