//! What a `cudaStream_t` is to the CUDA executor: the CUDA stream itself (the runtime's and the
//! driver's handles are the same); NULL is the legacy default stream.

use crate::error::Result;
use crate::exec::Stream;

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
