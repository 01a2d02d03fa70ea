//! The executor seam. An executor runs planned work in stream order on the memory it owns:
//! `host` on host memory (CPU copies and reductions, polling the connections' counters); `cuda`
//! on a GPU stream with kernels, over the same plans and the same counters. Both have the same files: `mod.rs` (launch), `comm.rs` (per-communicator
//! state), `stream.rs` (what a `cudaStream_t` is), `memory.rs` (`ncclMemAlloc`).
//!
//! Everything above this module (`group`, `launch`, `api`, `comm`) talks to executors only
//! through what is here: [`Stream`], [`CommExec`], [`Call`], [`launch`], [`mem_alloc`].

pub mod cuda;
pub mod host;

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::health::Health;
use crate::plan::RedSpec;
use crate::transport::conns::Conns;
use crate::transport::peer::PeerInfo;
use crate::types::CollArgs;
use std::sync::Arc;
use std::time::Instant;

/// Which executor runs this process's communicators (chosen once by `device`: the CUDA
/// executor where a driver is found, unless `OXCCL_DEVICE=host`).
pub use crate::gpu::Kind;

pub fn kind() -> Kind {
    crate::gpu::kind()
}

/// What a `cudaStream_t` argument means to the executor.
#[derive(Clone)]
pub enum Stream {
    /// NULL. Host executor: the call (or the `ncclGroupEnd` of its group) returns when the work
    /// is done, run by the calling thread. CUDA executor: the legacy default stream (the call
    /// returns once the work is enqueued).
    Null,
    /// An oxccl host stream (created with `oxcclHostStreamCreate`).
    Host(Arc<host::stream::HostStream>),
    /// A CUDA stream handle.
    Cuda(usize),
}

impl Stream {
    /// The executor's meaning of a C stream handle; an unknown handle is `ncclInvalidArgument`.
    pub fn from_handle(h: usize) -> Result<Stream> {
        if h == 0 {
            return Ok(Stream::Null);
        }
        match kind() {
            Kind::Host => host::stream::lookup(h).map(Stream::Host),
            Kind::Cuda => cuda::stream::from_handle(h),
        }
    }
}

/// The executor's state of one rank of a communicator.
pub enum CommExec {
    Host(Arc<host::HostComm>),
    Cuda(Box<cuda::CudaComm>),
}

/// What an executor needs to set a communicator's rank up (a collective call: every rank of the
/// communicator makes it, in the same order as its other bootstrap collectives).
pub struct CommSetup<'a> {
    pub rank: usize,
    pub nranks: usize,
    pub hash: u64,
    pub peers: &'a [PeerInfo],
    pub boot: &'a Bootstrap,
    pub health: Arc<Health>,
    /// `ncclConfig_t.commName`, for log lines.
    pub name: Option<String>,
    /// The device (CUDA executor) or host slot the rank is bound to.
    pub dev: i32,
    /// `CommConfig::graph_usage` (CUDA executor): 2 orders graph replays and eager launches.
    pub graph_usage: i32,
    /// The communicator's registry of `ncclCommRegister` buffers (`Registry::id`): the CUDA
    /// executor's launches look there for buffers other processes may read in place.
    pub registry: u64,
}

impl CommExec {
    pub fn init(s: CommSetup<'_>) -> Result<CommExec> {
        match kind() {
            Kind::Host => {
                host::HostComm::init(s.rank, s.nranks, s.hash, s.peers, s.boot, s.health, s.name)
                    .map(|h| CommExec::Host(Arc::new(h)))
            }
            Kind::Cuda => cuda::CudaComm::init(s).map(|c| CommExec::Cuda(Box::new(c))),
        }
    }

    /// Waits until all work queued on the communicator is done; after an abort, until nothing
    /// touches user memory any more. `ncclTimeout` past `deadline`.
    pub fn wait_quiescent(&self, deadline: Instant) -> Result<()> {
        match self {
            CommExec::Host(h) => h.wait_quiescent(deadline),
            CommExec::Cuda(c) => c.wait_quiescent(deadline),
        }
    }

    /// The communicator ends (destroyed or aborted, its work stopped): peers that wait for
    /// this rank in shared memory stop waiting (see `HostComm::end`); graphs that captured its
    /// launches no longer run them (`CudaComm::end`).
    pub fn end(&self) {
        match self {
            CommExec::Host(h) => h.end(),
            CommExec::Cuda(c) => c.end(),
        }
    }

    /// The CUDA context of the communicator's device (None on the host executor).
    pub fn device_ctx(&self) -> Option<usize> {
        match self {
            CommExec::Host(_) => None,
            CommExec::Cuda(c) => Some(c.ctx()),
        }
    }

    /// What tells the communicator's proxy thread that kernels are running (see
    /// `transport::proxy::Busy`); None on the host executor, which kicks it.
    pub fn proxy_busy(&self) -> Option<Arc<dyn crate::transport::proxy::Busy>> {
        match self {
            CommExec::Host(_) => None,
            CommExec::Cuda(c) => Some(c.proxy_busy()),
        }
    }

    /// The rings a large ring collective of the communicator is split across: 1 on the host
    /// executor (one thread runs a task's lanes); on the CUDA executor rank 0's
    /// `OXCCL_CUDA_CHANNELS` (1 where a rank of the communicator runs the host executor:
    /// `PeerInfo::comm_channels`), or fewer where a rank's launch would not fit the ordinary
    /// kernel parameter. The transport connects that many rings at init.
    pub fn channels(&self) -> usize {
        match self {
            CommExec::Host(_) => 1,
            CommExec::Cuda(c) => c.channels,
        }
    }

    /// Makes the rank's device current on this thread until the guard drops (connections made
    /// now put their device memory there); nothing on the host executor.
    pub fn enter_device(&self) -> Result<Option<crate::gpu::driver::CtxGuard>> {
        match self {
            CommExec::Host(_) => Ok(None),
            CommExec::Cuda(c) => c.enter().map(Some),
        }
    }

    /// The name of the executor, for log lines.
    pub fn name(&self) -> &'static str {
        match self {
            CommExec::Host(_) => "host executor",
            CommExec::Cuda(_) => "CUDA executor",
        }
    }
}

/// One validated call, as an executor is handed it.
#[derive(Clone)]
pub struct Call<'a> {
    pub comm: &'a CommExec,
    /// The communicator's peers and connections (planning reads its shape; the executor makes
    /// the connections a plan needs at launch).
    pub conns: &'a Conns,
    pub args: CollArgs,
    /// The reduction (reducing collectives only), a device-resident scalar still unread.
    pub red: Option<RedSpec>,
    pub stream: Stream,
}

/// Launches one call outside a group.
#[inline(always)]
pub fn launch_one(call: Call<'_>) -> Result<()> {
    match call.comm {
        CommExec::Host(_) => host::launch_one(&call),
        CommExec::Cuda(_) => cuda::launch(vec![call]),
    }
}

/// Whether a communicator's call on stream `b` may join, in one group, its calls on stream `a`
/// (the CUDA executor's streams of one communicator in a group must all capture the same graph,
/// or none: checked at each call, as NCCL does).
pub fn streams_alike(comm: &CommExec, a: &Stream, b: &Stream) -> Result<()> {
    match comm {
        CommExec::Host(_) => Ok(()),
        CommExec::Cuda(c) => {
            cuda::stream::streams_alike(c, cuda::stream::handle(a), cuda::stream::handle(b))
        }
    }
}

/// Launches one `ncclGroupEnd`'s calls, all communicators together (ranks driven by one thread
/// must progress together).
pub fn launch(calls: Vec<Call<'_>>) -> Result<()> {
    let Some(first) = calls.first() else {
        return Ok(());
    };
    match first.comm {
        CommExec::Host(_) => {
            if calls.iter().any(|c| !matches!(c.comm, CommExec::Host(_))) {
                return Err(Error::invalid_usage(
                    "one group mixes communicators of the host and the CUDA executor",
                ));
            }
            host::launch(calls)
        }
        CommExec::Cuda(_) => {
            if calls.iter().any(|c| !matches!(c.comm, CommExec::Cuda(_))) {
                return Err(Error::invalid_usage(
                    "one group mixes communicators of the host and the CUDA executor",
                ));
            }
            cuda::launch(calls)
        }
    }
}

/// `ncclMemAlloc`: memory peers can import.
pub fn mem_alloc(bytes: usize) -> Result<usize> {
    match kind() {
        Kind::Host => host::memory::alloc(bytes),
        Kind::Cuda => cuda::memory::alloc(bytes),
    }
}

/// `ncclMemFree`.
pub fn mem_free(ptr: usize) -> Result<()> {
    match kind() {
        Kind::Host => host::memory::free(ptr),
        Kind::Cuda => cuda::memory::free(ptr),
    }
}
