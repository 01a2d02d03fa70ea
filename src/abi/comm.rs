//! Communicator creation, destruction, queries, buffer registration and windows.

use super::types::*;
use super::{buffer, comm_arg, comm_cuda_dev, comm_nranks, comm_out, comm_rank, entry, non_null};
use crate::api::{self, CommConfig, UNIQUE_ID_BYTES};
use crate::error::{Error, Result};
use std::ffi::{c_int, c_void, CStr};
use std::mem::size_of;

/// Reads a caller's `ncclConfig_t` by its `size` field: fields past `size` keep their
/// `NCCL_CONFIG_INITIALIZER` values (callers built against older headers pass smaller structs).
///
/// # Safety
/// `config` is NULL or points to at least `config->size` readable bytes.
pub(crate) unsafe fn read_config(config: *const ncclConfig_t) -> Result<Option<CommConfig>> {
    if config.is_null() {
        return Ok(None);
    }
    // SAFETY: every ncclConfig_t version starts with size_t size, unsigned magic, unsigned version.
    let (size, magic) = unsafe { ((*config).size, (*config).magic) };
    if magic != API_MAGIC {
        return Err(Error::invalid_argument(format!(
            "config magic {magic:#x} is not NCCL_API_MAGIC (0xcafebeef): initialize ncclConfig_t with NCCL_CONFIG_INITIALIZER"
        )));
    }
    if size < 16 {
        return Err(Error::invalid_argument(format!(
            "config size {size} is too small for an ncclConfig_t"
        )));
    }
    let mut c = ncclConfig_t::undefined();
    let n = size.min(size_of::<ncclConfig_t>());
    // SAFETY: the caller's struct has `size` bytes; `c` has size_of::<ncclConfig_t>() >= n.
    unsafe { std::ptr::copy_nonoverlapping(config as *const u8, &mut c as *mut _ as *mut u8, n) };
    // Fields newer than the header the caller was built with (its `version`) are left
    // undefined, as NCCL leaves them: inside `size` they may be the older struct's tail
    // padding, which nobody initialised.
    let undef = ncclConfig_t::undefined();
    if c.version < 21400 {
        c.blocking = undef.blocking;
    }
    if c.version < 21700 {
        (c.minCTAs, c.maxCTAs, c.netName) = (undef.minCTAs, undef.maxCTAs, undef.netName);
        c.cgaClusterSize = undef.cgaClusterSize;
    }
    if c.version < 22700 {
        c.CTAPolicy = undef.CTAPolicy;
        (c.collnetEnable, c.shrinkShare) = (undef.collnetEnable, undef.shrinkShare);
        c.nvlsCTAs = undef.nvlsCTAs;
    }
    if c.version < 22800 {
        c.nChannelsPerNetPeer = undef.nChannelsPerNetPeer;
        c.nvlinkCentricSched = undef.nvlinkCentricSched;
    }
    if c.version < 22900 {
        c.graphUsageMode = undef.graphUsageMode;
        c.numRmaCtx = undef.numRmaCtx;
    }
    if c.version < 23000 {
        c.maxP2pPeers = undef.maxP2pPeers;
    }
    if c.version < 23005 {
        c.graphStreamOrdering = undef.graphStreamOrdering;
    }

    let opt = |v: c_int| (v != UNDEF_INT).then_some(v);
    let flag = |v: c_int, what: &str| -> Result<Option<bool>> {
        match v {
            UNDEF_INT => Ok(None),
            0 | 1 => Ok(Some(v == 1)),
            _ => Err(Error::invalid_argument(format!(
                "config->{what} is {v}; it must be 0 or 1"
            ))),
        }
    };
    let string = |p: *const std::ffi::c_char| {
        // SAFETY: a non-null name in a config is a C string the caller keeps alive for the call.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    let min_ctas = opt(c.minCTAs);
    let max_ctas = opt(c.maxCTAs);
    for (v, what) in [(min_ctas, "minCTAs"), (max_ctas, "maxCTAs")] {
        if matches!(v, Some(x) if x < 1) {
            return Err(Error::invalid_argument(format!(
                "config->{what} is {}; it must be at least 1",
                v.unwrap_or(0)
            )));
        }
    }
    if let (Some(lo), Some(hi)) = (min_ctas, max_ctas) {
        if lo > hi {
            return Err(Error::invalid_argument(format!(
                "config->minCTAs {lo} is larger than config->maxCTAs {hi}"
            )));
        }
    }
    let cta_policy = opt(c.CTAPolicy);
    if matches!(cta_policy, Some(p) if !(0..=3).contains(&p)) {
        return Err(Error::invalid_argument(format!(
            "config->CTAPolicy {} is not a combination of NCCL_CTA_POLICY_* flags",
            c.CTAPolicy
        )));
    }
    let graph_usage_mode = opt(c.graphUsageMode);
    if matches!(graph_usage_mode, Some(m) if !(0..=2).contains(&m)) {
        return Err(Error::invalid_argument(format!(
            "config->graphUsageMode is {}; it must be 0 (no CUDA graphs), 1 (graphs) or 2 \
             (graphs mixed with eager calls)",
            c.graphUsageMode
        )));
    }
    // `graphStreamOrdering` (0 or 1) is checked and has no effect: a communicator's launches
    // in a graph are always kept in issue order, which both values allow.
    flag(c.graphStreamOrdering, "graphStreamOrdering")?;
    // Fields for NCCL's own channels, CollNet, NVLS and RMA, which oxccl does not have: checked
    // as NCCL checks them (a program that NCCL refuses is refused here too), with no effect.
    for (v, what) in [
        (c.collnetEnable, "collnetEnable"),
        (c.shrinkShare, "shrinkShare"),
        (c.nvlinkCentricSched, "nvlinkCentricSched"),
    ] {
        flag(v, what)?;
    }
    let within = |v: c_int, min: c_int, max: c_int, what: &str| match v {
        UNDEF_INT => Ok(()),
        v if (min..=max).contains(&v) => Ok(()),
        v => Err(Error::invalid_argument(format!(
            "config->{what} is {v}; it must be {}",
            match max {
                c_int::MAX => format!("at least {min}"),
                _ => format!("between {min} and {max}"),
            }
        ))),
    };
    within(c.cgaClusterSize, 0, c_int::MAX, "cgaClusterSize")?;
    within(c.nvlsCTAs, 1, c_int::MAX, "nvlsCTAs")?;
    within(c.nChannelsPerNetPeer, 1, 64, "nChannelsPerNetPeer")?;
    within(c.numRmaCtx, 0, c_int::MAX, "numRmaCtx")?;
    within(c.maxP2pPeers, 1, c_int::MAX, "maxP2pPeers")?;
    Ok(Some(CommConfig {
        blocking: flag(c.blocking, "blocking")?,
        comm_name: string(c.commName),
        net_name: string(c.netName),
        split_share: flag(c.splitShare, "splitShare")?,
        min_ctas,
        max_ctas,
        cta_policy,
        graph_usage_mode,
    }))
}

fn rank_in(rank: c_int, nranks: c_int) -> Result<()> {
    if nranks < 1 {
        return Err(Error::invalid_argument(format!(
            "nranks {nranks} must be at least 1"
        )));
    }
    if rank < 0 || rank >= nranks {
        return Err(Error::invalid_argument(format!(
            "rank {rank} is out of range [0, {nranks})"
        )));
    }
    Ok(())
}

fn id_bytes(id: &ncclUniqueId) -> [u8; UNIQUE_ID_BYTES] {
    let mut b = [0u8; UNIQUE_ID_BYTES];
    for (d, s) in b.iter_mut().zip(id.internal.iter()) {
        *d = *s as u8;
    }
    b
}

/// # Safety
/// `comm` is a valid out-pointer (checked non-null), `config` as for [`read_config`].
unsafe fn init_rank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    ids: &[ncclUniqueId],
    rank: c_int,
    config: *const ncclConfig_t,
) -> Result<()> {
    // Like NCCL, before the arguments are checked.
    crate::debug::version_banner(rank);
    non_null(comm, "comm")?;
    rank_in(rank, nranks)?;
    // SAFETY: forwarded contract of `config`.
    let config = unsafe { read_config(config) }?.unwrap_or_default();
    let ids: Vec<[u8; UNIQUE_ID_BYTES]> = ids.iter().map(id_bytes).collect();
    let c = api::comm_init_rank_scalable(nranks, rank, &ids, config)?;
    // SAFETY: non-null out-parameter.
    unsafe { comm.write(comm_out(&c)) };
    in_progress(&c)
}

/// `ncclInProgress` while a non-blocking communicator's init runs (the handle is out already;
/// not for an init deferred to the group's end). Only the `ncclCommInitRank*` calls return it,
/// as NCCL's do; its split and shrink return `ncclSuccess`.
fn in_progress(c: &std::sync::Arc<crate::comm::Comm>) -> Result<()> {
    if c.init_running() {
        return Err(Error::new(
            crate::error::Code::InProgress,
            "init in progress",
        ));
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    // SAFETY: pointers as the C contract gives them.
    entry!("ncclCommInitRankConfig", {
        api::group_noted(unsafe { init_rank(comm, nranks, &[commId], rank, config) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    // SAFETY: pointers as the C contract gives them; no config.
    entry!("ncclCommInitRank", {
        api::group_noted(unsafe { init_rank(comm, nranks, &[commId], rank, std::ptr::null()) })
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    newcomm: *mut ncclComm_t,
    nranks: c_int,
    myrank: c_int,
    nId: c_int,
    commIds: *mut ncclUniqueId,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    entry!("ncclCommInitRankScalable", {
        // An init refused inside a group is the group's error (its end then runs none of
        // the group's inits and launches nothing, as NCCL's).
        api::group_noted((|| {
            if nId < 1 || nId > nranks.max(1) {
                return Err(Error::invalid_argument(format!(
                    "nId {nId} must be in [1, nranks={nranks}]"
                )));
            }
            non_null(commIds, "commIds")?;
            // SAFETY: the caller passes nId ids at commIds (checked non-null, nId >= 1).
            let ids = unsafe { std::slice::from_raw_parts(commIds, nId as usize) };
            // SAFETY: pointers as the C contract gives them.
            unsafe { init_rank(newcomm, nranks, ids, myrank, config) }
        })())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comm: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> ncclResult_t {
    entry!("ncclCommInitAll", {
        non_null(comm, "comm")?;
        if ndev < 0 {
            return Err(Error::invalid_argument(format!(
                "ndev {ndev} must not be negative"
            )));
        }
        // (As NCCL's: no devices, no communicators, and no error.)
        if ndev == 0 {
            return Ok(());
        }
        let devs: Vec<i32> = if devlist.is_null() {
            (0..ndev).collect()
        } else {
            // SAFETY: a non-null devlist has ndev entries.
            unsafe { std::slice::from_raw_parts(devlist, ndev as usize) }.to_vec()
        };
        if let Some(d) = devs.iter().find(|&&d| d < 0) {
            return Err(Error::invalid_argument(format!(
                "invalid device {d} in devlist"
            )));
        }
        // NCCL inits rank 0 first.
        crate::debug::version_banner(0);
        let comms = api::comm_init_all(&devs)?;
        for (i, c) in comms.iter().enumerate().take(ndev as usize) {
            // SAFETY: `comm` has room for ndev handles.
            unsafe { comm.add(i).write(comm_out(c)) };
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    entry!("ncclCommFinalize", {
        // Like NCCL: finalizing NULL is a no-op.
        if comm.is_null() {
            return Ok(());
        }
        api::comm_finalize(&comm_arg(comm)?)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    entry!("ncclCommDestroy", {
        // Like NCCL: destroying NULL is a no-op.
        if comm.is_null() {
            return Ok(());
        }
        api::comm_destroy(comm as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    entry!("ncclCommAbort", {
        if comm.is_null() {
            return Ok(());
        }
        api::comm_abort(comm as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommRevoke(comm: ncclComm_t, revokeFlags: c_int) -> ncclResult_t {
    entry!("ncclCommRevoke", {
        // Like NCCL: revoking NULL is a no-op.
        if comm.is_null() {
            return Ok(());
        }
        if revokeFlags != 0 {
            return Err(Error::invalid_argument(format!(
                "revokeFlags {revokeFlags} must be NCCL_REVOKE_DEFAULT (0)"
            )));
        }
        api::comm_revoke(&comm_arg(comm)?)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    entry!("ncclCommSplit", {
        non_null(newcomm, "newcomm")?;
        // (A color below -1 is refused by every rank's split after the exchange: refused
        // here, the other ranks would wait in it for this one.)
        // SAFETY: NULL or a config of `size` bytes.
        let config = unsafe { read_config(config) }?;
        let parent = comm_arg(comm)?;
        let child = api::comm_split(&parent, color, key, config)?;
        let h = child.as_ref().map_or(std::ptr::null_mut(), comm_out);
        // SAFETY: non-null out-parameter.
        unsafe { newcomm.write(h) };
        // A non-blocking child's init runs on: `ncclSuccess` with the handle out, as NCCL's
        // split returns (its `ncclCommGetAsyncError` says `ncclInProgress` meanwhile).
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommShrink(
    comm: ncclComm_t,
    excludeRanksList: *mut c_int,
    excludeRanksCount: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
    shrinkFlags: c_int,
) -> ncclResult_t {
    entry!("ncclCommShrink", {
        non_null(newcomm, "newcomm")?;
        if excludeRanksCount < 1 {
            return Err(Error::invalid_argument(format!(
                "excludeRanksCount is {excludeRanksCount}: a shrink excludes at least one rank, \
                 as NCCL's (ncclCommSplit makes a communicator of every rank)"
            )));
        }
        buffer(
            excludeRanksList as *const c_void,
            excludeRanksCount as usize,
            "excludeRanksList",
        )?;
        if shrinkFlags & !1 != 0 {
            return Err(Error::invalid_argument(format!(
                "invalid shrinkFlags {shrinkFlags:#x}"
            )));
        }
        // SAFETY: NULL or a config of `size` bytes.
        let config = unsafe { read_config(config) }?;
        let parent = comm_arg(comm)?;
        let exclude: &[c_int] = if excludeRanksCount == 0 {
            &[]
        } else {
            // SAFETY: checked non-null above; the caller gives `excludeRanksCount` ints.
            unsafe { std::slice::from_raw_parts(excludeRanksList, excludeRanksCount as usize) }
        };
        let child = api::comm_shrink(&parent, exclude, config, shrinkFlags & 1 != 0)?;
        // SAFETY: non-null out-parameter.
        unsafe { newcomm.write(comm_out(&child)) };
        // As the split: `ncclSuccess`, the non-blocking child's init running on.
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetUniqueId(
    comm: ncclComm_t,
    uniqueId: *mut ncclUniqueId,
) -> ncclResult_t {
    entry!("ncclCommGetUniqueId", {
        non_null(uniqueId, "uniqueId")?;
        comm_arg(comm)?;
        api::not_yet("ncclCommGetUniqueId (communicator grow)")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGrow(
    comm: ncclComm_t,
    nRanks: c_int,
    uniqueId: *const ncclUniqueId,
    rank: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    entry!("ncclCommGrow", {
        non_null(newcomm, "newcomm")?;
        if nRanks < 1 {
            return Err(Error::invalid_argument(format!(
                "nRanks {nRanks} must be at least 1"
            )));
        }
        if comm.is_null() {
            // A new rank joins: it needs the id and its rank.
            non_null(uniqueId, "uniqueId")?;
            rank_in(rank, nRanks)?;
        } else if rank != -1 {
            return Err(Error::invalid_argument(format!(
                "rank {rank} must be -1 for an existing member"
            )));
        }
        // SAFETY: NULL or a config of `size` bytes.
        unsafe { read_config(config) }?;
        api::not_yet("ncclCommGrow")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    comm: ncclComm_t,
    asyncError: *mut ncclResult_t,
) -> ncclResult_t {
    entry!("ncclCommGetAsyncError", {
        non_null(asyncError, "asyncError")?;
        let code = api::comm_async_error(&comm_arg(comm)?);
        // SAFETY: non-null out-parameter.
        unsafe { asyncError.write(ncclResult_t(code as i32)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    entry!("ncclCommCount", {
        non_null(count, "count")?;
        let n = comm_nranks(&*comm_arg(comm)?)?;
        // SAFETY: non-null out-parameter.
        unsafe { count.write(n) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    entry!("ncclCommCuDevice", {
        non_null(device, "device")?;
        let d = comm_cuda_dev(&*comm_arg(comm)?)?;
        // SAFETY: non-null out-parameter.
        unsafe { device.write(d) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    entry!("ncclCommUserRank", {
        non_null(rank, "rank")?;
        let r = comm_rank(&*comm_arg(comm)?)?;
        // SAFETY: non-null out-parameter.
        unsafe { rank.write(r) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    entry!("ncclCommRegister", {
        non_null(handle, "handle")?;
        buffer(buff, size, "buff")?;
        let h = api::comm_register(&comm_arg(comm)?, buff as usize, size)?;
        // SAFETY: non-null out-parameter.
        unsafe { handle.write(h as *mut c_void) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    entry!("ncclCommDeregister", {
        non_null(handle, "handle")?;
        api::comm_deregister(&comm_arg(comm)?, handle as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommSuspend(comm: ncclComm_t, flags: c_int) -> ncclResult_t {
    entry!("ncclCommSuspend", {
        if flags & !1 != 0 {
            return Err(Error::invalid_argument(format!(
                "invalid suspend flags {flags:#x} (only NCCL_SUSPEND_MEM)"
            )));
        }
        comm_arg(comm)?;
        api::not_yet("ncclCommSuspend")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommResume(comm: ncclComm_t) -> ncclResult_t {
    entry!("ncclCommResume", {
        comm_arg(comm)?;
        api::not_yet("ncclCommResume")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommMemStats(
    comm: ncclComm_t,
    stat: ncclCommMemStat_t,
    value: *mut u64,
) -> ncclResult_t {
    entry!("ncclCommMemStats", {
        non_null(value, "value")?;
        if !(0..=3).contains(&stat.0) {
            return Err(Error::invalid_argument(format!(
                "invalid ncclCommMemStat_t {}",
                stat.0
            )));
        }
        comm_arg(comm)?;
        api::not_yet("ncclCommMemStats")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    winFlags: c_int,
) -> ncclResult_t {
    entry!("ncclCommWindowRegister", {
        non_null(win, "win")?;
        buffer(buff, size, "buff")?;
        if winFlags & !0x0f != 0 {
            return Err(Error::invalid_argument(format!(
                "invalid winFlags {winFlags:#x}"
            )));
        }
        comm_arg(comm)?;
        api::not_yet("ncclCommWindowRegister (memory windows)")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowDeregister(
    comm: ncclComm_t,
    win: ncclWindow_t,
) -> ncclResult_t {
    entry!("ncclCommWindowDeregister", {
        non_null(win, "win")?;
        comm_arg(comm)?;
        api::not_yet("ncclCommWindowDeregister (memory windows)")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclWinGetUserPtr(
    comm: ncclComm_t,
    win: ncclWindow_t,
    outUserPtr: *mut *mut c_void,
) -> ncclResult_t {
    entry!("ncclWinGetUserPtr", {
        non_null(win, "win")?;
        non_null(outUserPtr, "outUserPtr")?;
        comm_arg(comm)?;
        api::not_yet("ncclWinGetUserPtr (memory windows)")
    })
}
