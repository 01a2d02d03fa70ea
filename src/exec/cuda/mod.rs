//! The CUDA executor: not there yet. It sits behind the same seam as the host executor, with the
//! same files, so that the CUDA issue replaces these stubs without touching the layers above:
//! every entry point says plainly that it is missing, and its communicator state cannot be
//! built (so nothing else here is ever reached).

pub mod comm;
pub mod memory;
pub mod stream;

pub use comm::CudaComm;

use crate::error::Error;

/// The error every stub returns.
pub(crate) fn missing() -> Error {
    Error::not_yet(
        "the CUDA executor (a CUDA driver was found; set OXCCL_DEVICE=host to run on host memory)",
    )
}
