//! Host streams: ordered queues of work with their own worker thread (the `oxcclHostStream*`
//! extension), standing in for `cudaStream_t` on the host executor.

use crate::error::{Error, Result};
use std::sync::Arc;

pub struct HostStream {}

impl HostStream {
    pub fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    pub fn query(&self) -> Result<bool> {
        Ok(true)
    }
}

pub fn create() -> Result<usize> {
    Err(Error::not_yet("host streams"))
}

pub fn lookup(h: usize) -> Result<Arc<HostStream>> {
    Err(Error::invalid_argument(format!(
        "stream {h:#x} is not an oxccl host stream"
    )))
}

pub fn destroy(h: usize) -> Result<()> {
    lookup(h).map(|_| ())
}
