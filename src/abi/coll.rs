//! Collectives, their `*Config` variants, point-to-point and one-sided operations.

use super::types::*;
use super::{buffer, comm_arg, entry, non_null};
use crate::api::{self, CollArgs};
use crate::error::{Error, Result};
use crate::types::{CollKind, DataType};
use std::ffi::{c_int, c_uint, c_void};
use std::mem::size_of;

/// One collective call as C gave it, before validation.
struct Call {
    kind: CollKind,
    send: *const c_void,
    recv: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: Option<ncclRedOp_t>,
    root: Option<c_int>,
    comm: ncclComm_t,
    stream: cudaStream_t,
}

fn enqueue(c: Call) -> Result<()> {
    let dtype = DataType::from_raw(c.datatype.0)?;
    let op = match c.op {
        Some(op) if op.0 < 0 => {
            return Err(Error::invalid_argument(format!(
                "invalid reduction operator {}",
                op.0
            )))
        }
        Some(op) => op.0,
        None => 0,
    };
    let comm = comm_arg(c.comm)?;
    // Roots, peers, NULL buffers and counts are checked against the communicator by the engine
    // (`group::validate`), which Rust callers go through too.
    let root = c.root.unwrap_or(0);
    let stream = api::stream_from_handle(c.stream as usize)?;
    let args = CollArgs {
        kind: c.kind,
        send: c.send as usize,
        recv: c.recv as usize,
        count: c.count,
        dtype,
        op,
        root,
    };
    api::enqueue(&comm, args, stream)
}

/// Validates a caller's `ncclCollConfig_t` by its `size` field (NULL means no config).
///
/// # Safety
/// `config` is NULL or points to at least `config->size` readable bytes.
unsafe fn check_coll_config(config: *const ncclCollConfig_t) -> Result<()> {
    // SAFETY: the caller's contract.
    api::group_noted(unsafe { read_coll_config(config) })
}

/// `check_coll_config`'s checks.
///
/// # Safety
/// As `check_coll_config`.
unsafe fn read_coll_config(config: *const ncclCollConfig_t) -> Result<()> {
    if config.is_null() {
        return Ok(());
    }
    // SAFETY: every config version starts with size_t size, unsigned magic, unsigned version.
    let (size, magic): (usize, c_uint) = unsafe { ((*config).size, (*config).magic) };
    if magic != API_MAGIC {
        return Err(Error::invalid_argument(format!(
            "collective config magic {magic:#x} is not NCCL_API_MAGIC (0xcafebeef): initialize ncclCollConfig_t with NCCL_COLLCONFIG_INITIALIZER"
        )));
    }
    if size < 16 {
        return Err(Error::invalid_argument(format!(
            "collective config size {size} is too small"
        )));
    }
    let mut c = ncclCollConfig_t::undefined();
    let n = size.min(size_of::<ncclCollConfig_t>());
    // SAFETY: the caller's struct has `size` bytes; `c` has at least n.
    unsafe { std::ptr::copy_nonoverlapping(config as *const u8, &mut c as *mut _ as *mut u8, n) };
    for (v, what) in [
        (c.minCTAs, "minCTAs"),
        (c.maxCTAs, "maxCTAs"),
        (c.nvlsCTAs, "nvlsCTAs"),
    ] {
        if v != UNDEF_INT && v < 1 {
            return Err(Error::invalid_argument(format!(
                "collective config {what} is {v}; it must be at least 1"
            )));
        }
    }
    if c.minCTAs != UNDEF_INT && c.maxCTAs != UNDEF_INT && c.minCTAs > c.maxCTAs {
        return Err(Error::invalid_argument(format!(
            "collective config minCTAs {} is larger than maxCTAs {}",
            c.minCTAs, c.maxCTAs
        )));
    }
    if c.CTAPolicy != UNDEF_INT && !(0..=3).contains(&c.CTAPolicy) {
        return Err(Error::invalid_argument(format!(
            "collective config CTAPolicy {} is not a combination of NCCL_CTA_POLICY_* flags",
            c.CTAPolicy
        )));
    }
    if c.forceAlgSelection != 0 && c.forceAlgSelection != 1 {
        return Err(Error::invalid_argument(format!(
            "collective config forceAlgSelection {} must be 0 or 1",
            c.forceAlgSelection
        )));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn call(
    kind: CollKind,
    send: *const c_void,
    recv: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: Option<ncclRedOp_t>,
    root: Option<c_int>,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<()> {
    // A refused call is its group's error, wherever it was refused.
    api::group_noted(enqueue(Call {
        kind,
        send,
        recv,
        count,
        datatype,
        op,
        root,
        comm,
        stream,
    }))
}

use CollKind::*;

#[no_mangle]
pub unsafe extern "C" fn ncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclReduce", {
        call(
            Reduce,
            sendbuff,
            recvbuff,
            count,
            datatype,
            Some(op),
            Some(root),
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclBcast", {
        call(
            Broadcast,
            buff,
            buff,
            count,
            datatype,
            None,
            Some(root),
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclBroadcast", {
        call(
            Broadcast,
            sendbuff,
            recvbuff,
            count,
            datatype,
            None,
            Some(root),
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclAllReduce", {
        call(
            AllReduce,
            sendbuff,
            recvbuff,
            count,
            datatype,
            Some(op),
            None,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclReduceScatter", {
        call(
            ReduceScatter,
            sendbuff,
            recvbuff,
            recvcount,
            datatype,
            Some(op),
            None,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclAllGather", {
        call(
            AllGather, sendbuff, recvbuff, sendcount, datatype, None, None, comm, stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclAlltoAll", {
        call(
            AlltoAll, sendbuff, recvbuff, count, datatype, None, None, comm, stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclGather", {
        call(
            Gather,
            sendbuff,
            recvbuff,
            count,
            datatype,
            None,
            Some(root),
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclScatter", {
        call(
            Scatter,
            sendbuff,
            recvbuff,
            count,
            datatype,
            None,
            Some(root),
            comm,
            stream,
        )
    })
}

// ---- nccl*Config: validate the per-collective config, then the plain call ----

#[no_mangle]
pub unsafe extern "C" fn ncclAllReduceConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    entry!("ncclAllReduceConfig", {
        // SAFETY: NULL or a config of `size` bytes.
        unsafe { check_coll_config(config) }?;
        call(
            AllReduce,
            sendbuff,
            recvbuff,
            count,
            datatype,
            Some(op),
            None,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclBroadcastConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    entry!("ncclBroadcastConfig", {
        // SAFETY: NULL or a config of `size` bytes.
        unsafe { check_coll_config(config) }?;
        call(
            Broadcast,
            sendbuff,
            recvbuff,
            count,
            datatype,
            None,
            Some(root),
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduceConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    entry!("ncclReduceConfig", {
        // SAFETY: NULL or a config of `size` bytes.
        unsafe { check_coll_config(config) }?;
        call(
            Reduce,
            sendbuff,
            recvbuff,
            count,
            datatype,
            Some(op),
            Some(root),
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllGatherConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    entry!("ncclAllGatherConfig", {
        // SAFETY: NULL or a config of `size` bytes.
        unsafe { check_coll_config(config) }?;
        call(
            AllGather, sendbuff, recvbuff, sendcount, datatype, None, None, comm, stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduceScatterConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    entry!("ncclReduceScatterConfig", {
        // SAFETY: NULL or a config of `size` bytes.
        unsafe { check_coll_config(config) }?;
        call(
            ReduceScatter,
            sendbuff,
            recvbuff,
            recvcount,
            datatype,
            Some(op),
            None,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclAlltoAllConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    entry!("ncclAlltoAllConfig", {
        // SAFETY: NULL or a config of `size` bytes.
        unsafe { check_coll_config(config) }?;
        call(
            AlltoAll, sendbuff, recvbuff, count, datatype, None, None, comm, stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGatherConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    entry!("ncclGatherConfig", {
        // SAFETY: NULL or a config of `size` bytes.
        unsafe { check_coll_config(config) }?;
        call(
            Gather,
            sendbuff,
            recvbuff,
            count,
            datatype,
            None,
            Some(root),
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclScatterConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    entry!("ncclScatterConfig", {
        // SAFETY: NULL or a config of `size` bytes.
        unsafe { check_coll_config(config) }?;
        call(
            Scatter,
            sendbuff,
            recvbuff,
            count,
            datatype,
            None,
            Some(root),
            comm,
            stream,
        )
    })
}

// ---- point to point ----

#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclSend", {
        call(
            Send,
            sendbuff,
            std::ptr::null(),
            count,
            datatype,
            None,
            Some(peer),
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclRecv", {
        call(
            Recv,
            std::ptr::null(),
            recvbuff,
            count,
            datatype,
            None,
            Some(peer),
            comm,
            stream,
        )
    })
}

// ---- one-sided (memory windows: a later step) ----

#[no_mangle]
pub unsafe extern "C" fn ncclPutSignal(
    localbuff: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    peerWin: ncclWindow_t,
    peerWinOffset: usize,
    sigIdx: c_int,
    ctx: c_int,
    flags: c_uint,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclPutSignal", {
        let dtype = DataType::from_raw(datatype.0)?;
        count
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::invalid_argument("count overflows"))?;
        buffer(localbuff, count, "localbuff")?;
        non_null(peerWin, "peerWin")?;
        if peer < 0 || sigIdx < 0 || ctx < 0 {
            return Err(Error::invalid_argument(format!(
                "negative peer {peer}, sigIdx {sigIdx} or ctx {ctx}"
            )));
        }
        let _ = (peerWinOffset, flags, stream);
        comm_arg(comm)?;
        api::not_yet("ncclPutSignal (one-sided operations)")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclSignal(
    peer: c_int,
    sigIdx: c_int,
    ctx: c_int,
    flags: c_uint,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclSignal", {
        if peer < 0 || sigIdx < 0 || ctx < 0 {
            return Err(Error::invalid_argument(format!(
                "negative peer {peer}, sigIdx {sigIdx} or ctx {ctx}"
            )));
        }
        let _ = (flags, stream);
        comm_arg(comm)?;
        api::not_yet("ncclSignal (one-sided operations)")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclWaitSignal(
    nDesc: c_int,
    signalDescs: *mut ncclWaitSignalDesc_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    entry!("ncclWaitSignal", {
        if nDesc < 0 {
            return Err(Error::invalid_argument(format!("nDesc {nDesc} < 0")));
        }
        buffer(signalDescs as *const c_void, nDesc as usize, "signalDescs")?;
        let _ = stream;
        comm_arg(comm)?;
        api::not_yet("ncclWaitSignal (one-sided operations)")
    })
}
