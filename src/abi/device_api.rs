//! Host-side helpers of NCCL's device API (nccl_device/host.h and core.h) that programs built
//! against the 2.32 headers import. NCCL declares them outside nccl.h, so include/nccl.h does not.
//! `ncclDevCommCreate`/`ncclDevCommDestroy` and the window/pointer queries are a later step.

use super::types::*;
use super::{comm_arg, comm_cuda_dev, comm_hash, comm_nranks, comm_rank, entry, non_null};
use crate::error::Error;
use std::ffi::c_int;
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
            // On the host executor a whole single-host communicator is one LSA team.
            nLsaTeams: 1,
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

/// Reads the leading fields of a device communicator (zeros for NULL: no panic, no crash).
///
/// # Safety
/// `comm` is NULL or points to an `ncclDevComm`.
unsafe fn dev(comm: *const ncclDevCommPrefix) -> (c_int, c_int, c_int, c_int) {
    if comm.is_null() {
        return (0, 0, 0, 0);
    }
    // SAFETY: per the contract above.
    let c = unsafe { &*comm };
    (c.rank, c.nRanks, c.lsaRank, c.lsaSize)
}

/// `ncclTeamWorld(ncclDevComm const&)`: every rank of the communicator.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamWorld(comm: *const ncclDevCommPrefix) -> ncclTeam {
    // SAFETY: the caller passes a device communicator by reference.
    let (rank, n, _, _) = unsafe { dev(comm) };
    ncclTeam {
        nRanks: n,
        rank,
        stride: 1,
    }
}

/// `ncclTeamLsa(ncclDevComm const&)`: the ranks sharing this rank's load/store domain.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamLsa(comm: *const ncclDevCommPrefix) -> ncclTeam {
    // SAFETY: the caller passes a device communicator by reference.
    let (_, _, lsa_rank, lsa_size) = unsafe { dev(comm) };
    ncclTeam {
        nRanks: lsa_size,
        rank: lsa_rank,
        stride: 1,
    }
}

/// `ncclTeamRail(ncclDevComm const&)`: one rank per LSA team, at this rank's LSA position.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamRail(comm: *const ncclDevCommPrefix) -> ncclTeam {
    // SAFETY: the caller passes a device communicator by reference.
    let (rank, n, _, lsa_size) = unsafe { dev(comm) };
    if lsa_size <= 0 {
        return ncclTeam {
            nRanks: 0,
            rank: 0,
            stride: 0,
        };
    }
    ncclTeam {
        nRanks: n / lsa_size,
        rank: rank / lsa_size,
        stride: lsa_size,
    }
}

/// `ncclTeamRankToWorld(ncclDevComm const&, ncclTeam, int)`.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamRankToWorld(
    comm: *const ncclDevCommPrefix,
    team: ncclTeam,
    rank: c_int,
) -> c_int {
    // SAFETY: the caller passes a device communicator by reference.
    let (my_rank, _, _, _) = unsafe { dev(comm) };
    my_rank.wrapping_add(rank.wrapping_sub(team.rank).wrapping_mul(team.stride))
}

/// `ncclTeamRankToLsa(ncclDevComm const&, ncclTeam, int)`.
#[no_mangle]
pub unsafe extern "C" fn ncclTeamRankToLsa(
    comm: *const ncclDevCommPrefix,
    team: ncclTeam,
    rank: c_int,
) -> c_int {
    // SAFETY: the caller passes a device communicator by reference.
    let (_, _, lsa_rank, _) = unsafe { dev(comm) };
    lsa_rank.wrapping_add(rank.wrapping_sub(team.rank).wrapping_mul(team.stride))
}
