//! `ncclMemAlloc` / `ncclMemFree` on the host executor: page-aligned memory that peers can map.

use crate::error::{Error, Result};

pub fn alloc(size: usize) -> Result<usize> {
    let _ = size;
    Err(Error::not_yet("ncclMemAlloc"))
}

pub fn free(ptr: usize) -> Result<()> {
    let _ = ptr;
    Err(Error::not_yet("ncclMemFree"))
}
