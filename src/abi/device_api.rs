//! Host-side helpers of NCCL's device API (nccl_device/host.h) that programs built against the
//! 2.32 headers import, with the prototypes NVIDIA's libnccl.so.2 exports (C linkage, taking the
//! host `ncclComm_t`; core.h's `ncclDevComm const&` overloads are device-only inline functions).
//! NCCL declares them outside nccl.h, so include/nccl.h does not.
//! Device communicators (`ncclDevCommCreate`/`ncclDevCommDestroy`) are not built yet, on either
//! executor: they check their arguments and say so; so do the window/pointer queries
//! (`ncclGetLsaDevicePointer`, ...) and the resource requirements, exported so that programs
//! importing them load.

use super::types::*;
use super::{
    comm_arg, comm_cuda_dev, comm_hash, comm_nranks, comm_rank, entry, non_null, run_value,
};
use crate::error::Error;
use std::ffi::{c_int, c_void};
use std::mem::{offset_of, size_of};

/// Fills `ncclCommProperties_t` up to the caller's `size` (older callers have shorter structs).
#[no_mangle]
pub unsafe extern "C" fn ncclCommQueryProperties(
    comm: ncclComm_t,
    props: *mut ncclCommProperties_t,
) -> ncclResult_t {
    entry!("ncclCommQueryProperties", {
        non_null(props, "props")?;
        // SAFETY: non-null; size and magic lead the struct.
        let (size, magic) = unsafe { ((*props).size, (*props).magic) };
        if magic != API_MAGIC {
            return Err(Error::invalid_argument(format!(
                "props magic {magic:#x} is not NCCL_API_MAGIC: initialize it with NCCL_COMM_PROPERTIES_INITIALIZER"
            )));
        }
        if size < offset_of!(ncclCommProperties_t, rank) {
            return Err(Error::invalid_argument(format!(
                "props size {size} is too small"
            )));
        }
        let c = comm_arg(comm)?;
        let nranks = comm_nranks(&c)?;
        let (.., hosts) = crate::api::comm_lsa(&c)?;
        let cuda_dev = comm_cuda_dev(&c)?;
        let filled = ncclCommProperties_t {
            size,
            magic,
            // SAFETY: within the caller's struct (size >= 16 checked above).
            version: unsafe { (*props).version },
            rank: comm_rank(&c)?,
            nRanks: nranks,
            cudaDev: cuda_dev,
            nvmlDev: cuda_dev,
            deviceApiSupport: false,
            multimemSupport: false,
            ginType: 0,
            // One LSA team per host.
            nLsaTeams: hosts as c_int,
            hostRmaSupport: false,
            railedGinType: 0,
            commHash: comm_hash(&c)?,
            ginMinStride: 0,
            ginConnectionType: 0,
            ginSupport: [false; 64],
            devCommRuntimeVersionSize: 0,
            cftSupport: false,
            cftMulticastSupport: false,
            cftCountedSupport: false,
        };
        let n = size.min(size_of::<ncclCommProperties_t>());
        // SAFETY: the caller's struct has `size` bytes; we write at most that many.
        unsafe {
            std::ptr::copy_nonoverlapping(&filled as *const _ as *const u8, props as *mut u8, n)
        };
        Ok(())
    })
}

/// Why there are no device communicators.
const DEV_COMM_NOT_BUILT: &str = "the device API (device communicators for kernels of your own, \
     nccl_device.h) is not built in oxccl yet, on either executor; collectives and \
     point-to-point calls do not need it";

/// `ncclResult_t ncclDevCommCreate(ncclComm_t, ncclDevCommRequirements_t const*,
/// ncclDevComm_t*)`: not built yet, so `ncclInvalidUsage` once the arguments are valid.
#[no_mangle]
pub unsafe extern "C" fn ncclDevCommCreate(
    comm: ncclComm_t,
    reqs: *const ncclDevCommRequirements_t,
    outDevComm: *mut ncclDevComm_t,
) -> ncclResult_t {
    entry!("ncclDevCommCreate", {
        non_null(reqs, "reqs")?;
        non_null(outDevComm, "outDevComm")?;
        comm_arg(comm)?.core()?;
        Err(Error::invalid_usage(DEV_COMM_NOT_BUILT))
    })
}

/// `ncclResult_t ncclDevCommDestroy(ncclComm_t, ncclDevComm_t const*)`: no device communicator
/// exists (not built yet), so `ncclInvalidUsage` once the arguments are valid.
#[no_mangle]
pub unsafe extern "C" fn ncclDevCommDestroy(
    comm: ncclComm_t,
    devComm: *const ncclDevComm_t,
) -> ncclResult_t {
    entry!("ncclDevCommDestroy", {
        non_null(devComm, "devComm")?;
        comm_arg(comm)?.core()?;
        Err(Error::invalid_usage(DEV_COMM_NOT_BUILT))
    })
}

/// What the team helpers need of a host communicator: (rank, nRanks, lsaRank, lsaSize).
///
/// An LSA team is the ranks of one host (NCCL lays them out contiguously, one team per host).
fn geometry(comm: ncclComm_t) -> crate::error::Result<(c_int, c_int, c_int, c_int)> {
    let c = comm_arg(comm)?;
    let (rank, n, lsa_rank, lsa_size, _) = crate::api::comm_lsa(&c)?;
    Ok((
        rank as c_int,
        n as c_int,
        lsa_rank as c_int,
        lsa_size as c_int,
    ))
}

/// The team a failed query returns (its message is kept for `ncclGetLastError`).
const NO_TEAM: ncclTeam = ncclTeam {
    nRanks: 0,
    rank: 0,
    stride: 0,
};

/// `ncclTeam_t ncclTeamWorld(ncclComm_t)` (nccl_device/host.h): every rank of the communicator.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamWorld(comm: ncclComm_t) -> ncclTeam {
    run_value("ncclTeamWorld", NO_TEAM, || {
        let (rank, n, _, _) = geometry(comm)?;
        Ok(ncclTeam {
            nRanks: n,
            rank,
            stride: 1,
        })
    })
}

/// `ncclTeam_t ncclTeamLsa(ncclComm_t)`: the ranks sharing this rank's load/store domain.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamLsa(comm: ncclComm_t) -> ncclTeam {
    run_value("ncclTeamLsa", NO_TEAM, || {
        let (_, _, lsa_rank, lsa_size) = geometry(comm)?;
        Ok(ncclTeam {
            nRanks: lsa_size,
            rank: lsa_rank,
            stride: 1,
        })
    })
}

/// `ncclTeam_t ncclTeamRail(ncclComm_t)`: one rank per LSA team, at this rank's LSA position.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamRail(comm: ncclComm_t) -> ncclTeam {
    run_value("ncclTeamRail", NO_TEAM, || {
        let (rank, n, _, lsa_size) = geometry(comm)?;
        Ok(ncclTeam {
            nRanks: n / lsa_size,
            rank: rank / lsa_size,
            stride: lsa_size,
        })
    })
}

/// `int ncclTeamRankToWorld(ncclComm_t, ncclTeam_t, int)`: the world rank of `rank` of `team`.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamRankToWorld(
    comm: ncclComm_t,
    team: ncclTeam,
    rank: c_int,
) -> c_int {
    run_value("ncclTeamRankToWorld", -1, || {
        let (my_rank, _, _, _) = geometry(comm)?;
        Ok(my_rank.wrapping_add(rank.wrapping_sub(team.rank).wrapping_mul(team.stride)))
    })
}

/// `int ncclTeamRankToLsa(ncclComm_t, ncclTeam_t, int)`: the LSA rank of `rank` of `team`.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamRankToLsa(comm: ncclComm_t, team: ncclTeam, rank: c_int) -> c_int {
    run_value("ncclTeamRankToLsa", -1, || {
        let (_, _, lsa_rank, _) = geometry(comm)?;
        Ok(lsa_rank.wrapping_add(rank.wrapping_sub(team.rank).wrapping_mul(team.stride)))
    })
}

/// The device API's window/multimem pointer queries and resource requirements
/// (`nccl_device/*.h`). They are exported so that programs importing them load: a PyTorch
/// built against NCCL >= 2.29 imports `ncclGetLsaMultimemDevicePointer`, and Python loads it
/// with every symbol bound at once, so a missing one fails `import torch`. There are no
/// windows nor device communicators yet, so every call is `ncclInvalidUsage` saying so, its
/// outputs untouched.
/// (The entry point's name leads the message already: `entry!`, `run_value`.)
fn device_api_not_built<T>() -> crate::error::Result<T> {
    Err(Error::invalid_usage(format!(
        "{DEV_COMM_NOT_BUILT} (nor windows, ncclCommWindowRegister)"
    )))
}

/// `ncclResult_t ncclGetLsaMultimemDevicePointer(ncclWindow_t, size_t, void**)`.
#[no_mangle]
pub unsafe extern "C" fn ncclGetLsaMultimemDevicePointer(
    window: ncclWindow_t,
    offset: usize,
    outPtr: *mut *mut c_void,
) -> ncclResult_t {
    let _ = (window, offset, outPtr);
    entry!("ncclGetLsaMultimemDevicePointer", {
        device_api_not_built()
    })
}

/// `ncclResult_t ncclGetMultimemDevicePointer(ncclWindow_t, size_t, ncclMultimemHandle_t,
/// void**)`.
#[no_mangle]
pub unsafe extern "C" fn ncclGetMultimemDevicePointer(
    window: ncclWindow_t,
    offset: usize,
    multimem: ncclMultimemHandle,
    outPtr: *mut *mut c_void,
) -> ncclResult_t {
    let _ = (window, offset, multimem, outPtr);
    entry!("ncclGetMultimemDevicePointer", { device_api_not_built() })
}

/// `ncclResult_t ncclGetLsaDevicePointer(ncclWindow_t, size_t, int lsaRank, void**)`.
#[no_mangle]
pub unsafe extern "C" fn ncclGetLsaDevicePointer(
    window: ncclWindow_t,
    offset: usize,
    lsaRank: c_int,
    outPtr: *mut *mut c_void,
) -> ncclResult_t {
    let _ = (window, offset, lsaRank, outPtr);
    entry!("ncclGetLsaDevicePointer", { device_api_not_built() })
}

/// `ncclResult_t ncclGetPeerDevicePointer(ncclWindow_t, size_t, int peer, void**)`.
#[no_mangle]
pub unsafe extern "C" fn ncclGetPeerDevicePointer(
    window: ncclWindow_t,
    offset: usize,
    peer: c_int,
    outPtr: *mut *mut c_void,
) -> ncclResult_t {
    let _ = (window, offset, peer, outPtr);
    entry!("ncclGetPeerDevicePointer", { device_api_not_built() })
}

/// `ncclResult_t ncclGetMultimemDeviceLeInfo(ncclWindow_t, size_t, ncclCftLeId*, size_t*)`.
#[no_mangle]
pub unsafe extern "C" fn ncclGetMultimemDeviceLeInfo(
    window: ncclWindow_t,
    offset: usize,
    leId: *mut u32,
    leOffset: *mut usize,
) -> ncclResult_t {
    let _ = (window, offset, leId, leOffset);
    entry!("ncclGetMultimemDeviceLeInfo", { device_api_not_built() })
}

/// `ncclResult_t ncclGetCftDeviceLeInfo(ncclWindow_t, size_t, int peerCft, ncclTeam_t cftTeam,
/// ncclCftLeId*, size_t*)`.
#[no_mangle]
pub unsafe extern "C" fn ncclGetCftDeviceLeInfo(
    window: ncclWindow_t,
    offset: usize,
    peerCft: c_int,
    cftTeam: ncclTeam,
    leId: *mut u32,
    leOffset: *mut usize,
) -> ncclResult_t {
    let _ = (window, offset, peerCft, cftTeam, leId, leOffset);
    entry!("ncclGetCftDeviceLeInfo", { device_api_not_built() })
}

/// `ncclResult_t ncclGetPeerDeviceLeInfo(ncclWindow_t, size_t, int peerWorld, ncclCftLeId*,
/// size_t*)`.
#[no_mangle]
pub unsafe extern "C" fn ncclGetPeerDeviceLeInfo(
    window: ncclWindow_t,
    offset: usize,
    peerWorld: c_int,
    leId: *mut u32,
    leOffset: *mut usize,
) -> ncclResult_t {
    let _ = (window, offset, peerWorld, leId, leOffset);
    entry!("ncclGetPeerDeviceLeInfo", { device_api_not_built() })
}

/// `ncclResult_t ncclLsaBarrierCreateRequirement(ncclTeam_t, int nBarriers,
/// ncclLsaBarrierHandle_t*, ncclDevResourceRequirements_t*)`.
#[no_mangle]
pub unsafe extern "C" fn ncclLsaBarrierCreateRequirement(
    team: ncclTeam,
    nBarriers: c_int,
    outHandle: *mut ncclLsaBarrierHandle_t,
    outReq: *mut ncclDevResourceRequirements_t,
) -> ncclResult_t {
    let _ = (team, nBarriers, outHandle, outReq);
    entry!("ncclLsaBarrierCreateRequirement", {
        device_api_not_built()
    })
}

/// `ncclResult_t ncclGinBarrierCreateRequirement(ncclComm_t, ncclTeam_t, int nBarriers,
/// ncclGinBarrierHandle_t*, ncclDevResourceRequirements_t*)`.
#[no_mangle]
pub unsafe extern "C" fn ncclGinBarrierCreateRequirement(
    comm: ncclComm_t,
    team: ncclTeam,
    nBarriers: c_int,
    outHandle: *mut ncclGinBarrierHandle_t,
    outReq: *mut ncclDevResourceRequirements_t,
) -> ncclResult_t {
    let _ = (team, nBarriers, outHandle, outReq);
    entry!("ncclGinBarrierCreateRequirement", {
        comm_arg(comm)?;
        device_api_not_built()
    })
}

/// `ncclResult_t ncclLLA2ACreateRequirement(int nBlocks, int nSlots, ncclLLA2AHandle_t*,
/// ncclDevResourceRequirements_t*)`.
#[no_mangle]
pub unsafe extern "C" fn ncclLLA2ACreateRequirement(
    nBlocks: c_int,
    nSlots: c_int,
    outHandle: *mut ncclLLA2AHandle_t,
    outReq: *mut ncclDevResourceRequirements_t,
) -> ncclResult_t {
    let _ = (nBlocks, nSlots, outHandle, outReq);
    entry!("ncclLLA2ACreateRequirement", { device_api_not_built() })
}

/// `int ncclLLA2ACalcSlots(int maxElts, int maxEltSize)`: -1 (no LL all-to-all without the
/// device API), the reason in `ncclGetLastError`.
#[no_mangle]
pub unsafe extern "C" fn ncclLLA2ACalcSlots(maxElts: c_int, maxEltSize: c_int) -> c_int {
    let _ = (maxElts, maxEltSize);
    run_value("ncclLLA2ACalcSlots", -1, device_api_not_built)
}

/// `ncclTeam_t ncclTeamCft(ncclComm_t, ncclCftTeamMode_t)`: no CFT teams without the device
/// API: the empty team, the reason in `ncclGetLastError`.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamCft(comm: ncclComm_t, mode: ncclCftTeamMode_t) -> ncclTeam {
    let _ = mode;
    run_value("ncclTeamCft", NO_TEAM, || {
        comm_arg(comm)?;
        device_api_not_built()
    })
}

/// `ncclTeam_t ncclTeamCftMultimem(ncclComm_t)`: as `ncclTeamCft`.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamCftMultimem(comm: ncclComm_t) -> ncclTeam {
    run_value("ncclTeamCftMultimem", NO_TEAM, || {
        comm_arg(comm)?;
        device_api_not_built()
    })
}
