//! oxccl's own C extensions (declared in include/nccl.h after the NCCL declarations).

use super::types::*;
use super::{entry, non_null};
use crate::api;
use crate::error::{Code, Error};
use std::ffi::c_int;

/// Creates a host "stream": an ordered queue of asynchronous work.
#[no_mangle]
pub unsafe extern "C" fn oxcclHostStreamCreate(stream: *mut cudaStream_t) -> ncclResult_t {
    entry!("oxcclHostStreamCreate", {
        non_null(stream, "stream")?;
        let h = api::host_stream_create()?;
        // SAFETY: non-null out-parameter.
        unsafe { stream.write(h as cudaStream_t) };
        Ok(())
    })
}

/// Waits until all work queued on a host stream is done.
#[no_mangle]
pub unsafe extern "C" fn oxcclHostStreamSynchronize(stream: cudaStream_t) -> ncclResult_t {
    entry!("oxcclHostStreamSynchronize", {
        non_null(stream, "stream")?;
        api::host_stream_synchronize(stream as usize)
    })
}

/// `ncclSuccess` when the host stream is idle, `ncclInProgress` while work is queued.
#[no_mangle]
pub unsafe extern "C" fn oxcclHostStreamQuery(stream: cudaStream_t) -> ncclResult_t {
    entry!("oxcclHostStreamQuery", {
        non_null(stream, "stream")?;
        if api::host_stream_query(stream as usize)? {
            Ok(())
        } else {
            Err(Error::new(Code::InProgress, "work is queued"))
        }
    })
}

/// Destroys a host stream (after its queued work is done).
#[no_mangle]
pub unsafe extern "C" fn oxcclHostStreamDestroy(stream: cudaStream_t) -> ncclResult_t {
    entry!("oxcclHostStreamDestroy", {
        non_null(stream, "stream")?;
        api::host_stream_destroy(stream as usize)
    })
}

/// Which executor runs collectives: 0 = host executor, 1 = CUDA executor.
#[no_mangle]
pub unsafe extern "C" fn oxcclGetExecutor(executor: *mut c_int) -> ncclResult_t {
    entry!("oxcclGetExecutor", {
        non_null(executor, "executor")?;
        let v = match crate::gpu::kind() {
            crate::gpu::Kind::Host => 0,
            crate::gpu::Kind::Cuda => 1,
        };
        // SAFETY: non-null out-parameter.
        unsafe { executor.write(v) };
        Ok(())
    })
}
