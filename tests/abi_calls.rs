//! Calls the C entry points directly: argument validation, error codes and messages,
//! ncclGetErrorString against the strings inside NVIDIA's libnccl.so.2, config size/magic handling,
//! not-yet features, and the device-API team helpers.

use nccl::abi::*;
use std::ffi::{c_int, c_void, CStr};
use std::ptr::{null, null_mut};

const INVALID_ARGUMENT: i32 = 4;
const INVALID_USAGE: i32 = 5;

fn last_error() -> String {
    // SAFETY: ncclGetLastError returns a valid C string.
    unsafe { CStr::from_ptr(ncclGetLastError(null_mut())) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn version_and_its_twin() {
    let (mut a, mut b) = (0, 0);
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(ncclGetVersion(&mut a).0, 0);
        assert_eq!(pncclGetVersion(&mut b).0, 0);
        assert_eq!(ncclGetVersion(null_mut()).0, INVALID_ARGUMENT);
    }
    assert_eq!((a, b), (23203, 23203));
    assert!(last_error().contains("ncclGetVersion"), "{}", last_error());
}

#[test]
fn error_strings_are_nccls() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("abi_calls");
    let so = dir.join("nvidia/nccl/lib/libnccl.so.2");
    if !so.exists() {
        let st = std::process::Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/scripts/fetch-upstream-nccl.sh"
            ))
            .arg(&dir)
            .arg("--lib")
            .status()
            .unwrap();
        assert!(st.success());
    }
    let lib = std::fs::read(so).unwrap();
    for code in 0..=9 {
        // SAFETY: ncclGetErrorString returns a static C string.
        let s = unsafe { CStr::from_ptr(ncclGetErrorString(ncclResult_t(code))) };
        // As a whole NUL-delimited string inside NVIDIA's library.
        let mut needle = vec![0u8];
        needle.extend_from_slice(s.to_bytes_with_nul());
        assert!(
            lib.windows(needle.len()).any(|w| w == needle.as_slice()),
            "error string {code} {s:?} is not in NCCL 2.32.3's libnccl.so.2"
        );
    }
    // SAFETY: as above.
    let unknown = unsafe { CStr::from_ptr(ncclGetErrorString(ncclResult_t(-3))) };
    assert_eq!(unknown.to_str().unwrap(), "unknown result code");
}

#[test]
fn null_and_range_checks() {
    let mut x = 1.0f32;
    let p = &mut x as *mut f32 as *mut c_void;
    // SAFETY: invalid arguments on purpose; nothing is dereferenced past validation.
    unsafe {
        // NULL comm.
        assert_eq!(
            ncclAllReduce(
                p,
                p,
                1,
                ncclDataType_t(7),
                ncclRedOp_t(0),
                null_mut(),
                null_mut()
            )
            .0,
            INVALID_ARGUMENT
        );
        // Datatype out of range comes before the comm lookup.
        assert_eq!(
            ncclAllReduce(
                p,
                p,
                1,
                ncclDataType_t(12),
                ncclRedOp_t(0),
                null_mut(),
                null_mut()
            )
            .0,
            INVALID_ARGUMENT
        );
        assert!(last_error().contains("datatype 12"), "{}", last_error());
        assert_eq!(
            ncclAllReduce(
                p,
                p,
                1,
                ncclDataType_t(7),
                ncclRedOp_t(-1),
                null_mut(),
                null_mut()
            )
            .0,
            INVALID_ARGUMENT
        );
        assert!(last_error().contains("operator -1"), "{}", last_error());
        assert_eq!(
            ncclCommInitRank(null_mut(), 2, std::mem::zeroed(), 0).0,
            INVALID_ARGUMENT
        );
        let mut c: ncclComm_t = null_mut();
        assert_eq!(
            ncclCommInitRank(&mut c, 2, std::mem::zeroed(), 2).0,
            INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("rank 2 is out of range"),
            "{}",
            last_error()
        );
        assert_eq!(ncclCommInitAll(&mut c, 0, null()).0, INVALID_ARGUMENT);
        assert_eq!(ncclCommCount(null_mut(), null_mut()).0, INVALID_ARGUMENT);
        assert_eq!(
            ncclRedOpDestroy(ncclRedOp_t(2), null_mut()).0,
            INVALID_ARGUMENT
        );
        // Destroying NULL is a no-op, as in NCCL.
        assert_eq!(ncclCommDestroy(null_mut()).0, 0);
    }
}

#[test]
fn config_magic_and_size() {
    let mut c: ncclComm_t = null_mut();
    let mut cfg = ncclConfig_t::undefined();
    cfg.magic = 0x1234;
    // SAFETY: valid pointers.
    unsafe {
        assert_eq!(
            ncclCommInitRankConfig(&mut c, 1, std::mem::zeroed(), 0, &mut cfg).0,
            INVALID_ARGUMENT
        );
    }
    assert!(last_error().contains("NCCL_API_MAGIC"), "{}", last_error());
    // A caller with an older, shorter struct: the bad `blocking` past its size is never read...
    let mut short = ncclConfig_t::undefined();
    short.size = 16;
    short.blocking = 7;
    // ...but inside its size it is rejected.
    let mut full = ncclConfig_t::undefined();
    full.blocking = 7;
    // SAFETY: valid pointers.
    unsafe {
        let mut id: ncclUniqueId = std::mem::zeroed();
        assert_eq!(ncclGetUniqueId(&mut id).0, 0);
        let r = ncclCommInitRankConfig(&mut c, 1, id, 0, &mut short).0;
        assert_eq!(r, 0, "{}", last_error());
        assert_eq!(ncclCommDestroy(c).0, 0);
        assert_eq!(
            ncclCommInitRankConfig(&mut c, 1, std::mem::zeroed(), 0, &mut full).0,
            INVALID_ARGUMENT
        );
        assert!(last_error().contains("blocking is 7"), "{}", last_error());
        let mut cc = ncclCollConfig_t::undefined();
        cc.magic = 0;
        let mut x = 0u8;
        let p = &mut x as *mut u8 as *mut c_void;
        assert_eq!(
            ncclAllReduceConfig(
                p,
                p,
                1,
                ncclDataType_t(0),
                ncclRedOp_t(0),
                null_mut(),
                null_mut(),
                &cc
            )
            .0,
            INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("collective config magic"),
            "{}",
            last_error()
        );
    }
}

#[test]
fn later_features_say_not_yet() {
    let mut h: ncclParamHandle_t = null_mut();
    let key = c"NCCL_DEBUG";
    let mut info = ncclSimInfo_t {
        size: 24,
        magic: SIM_INFO_MAGIC,
        version: 23203,
        estimatedTime: -1.0,
    };
    // SAFETY: valid pointers.
    unsafe {
        assert_eq!(ncclParamBind(&mut h, key.as_ptr()).0, INVALID_USAGE);
        assert!(
            last_error().contains("not available yet"),
            "{}",
            last_error()
        );
        assert_eq!(ncclGroupSimulateEnd(&mut info).0, INVALID_USAGE);
        info.magic = 1;
        assert_eq!(ncclGroupSimulateEnd(&mut info).0, INVALID_ARGUMENT);
    }
}

#[test]
fn team_helpers() {
    // 8 ranks, LSA teams of 4: rank 6 is LSA rank 2.
    let dc = ncclDevCommPrefix {
        magic: 0,
        version: 0,
        rank: 6,
        nRanks: 8,
        nRanks_rcp32: 0,
        lsaRank: 2,
        lsaSize: 4,
        lsaSize_rcp32: 0,
    };
    // SAFETY: a valid device-communicator prefix.
    unsafe {
        let world = ncclTeamWorld(&dc);
        assert_eq!(
            world,
            ncclTeam {
                nRanks: 8,
                rank: 6,
                stride: 1
            }
        );
        let lsa = ncclTeamLsa(&dc);
        assert_eq!(
            lsa,
            ncclTeam {
                nRanks: 4,
                rank: 2,
                stride: 1
            }
        );
        let rail = ncclTeamRail(&dc);
        assert_eq!(
            rail,
            ncclTeam {
                nRanks: 2,
                rank: 1,
                stride: 4
            }
        );
        // Rail rank 0 is world rank 2; LSA rank 0 is world rank 4.
        assert_eq!(ncclTeamRankToWorld(&dc, rail, 0), 2);
        assert_eq!(ncclTeamRankToWorld(&dc, lsa, 0), 4);
        assert_eq!(ncclTeamRankToLsa(&dc, lsa, 3), 3);
        assert_eq!(ncclTeamRankToLsa(&dc, world, 7), 3);
        let _: c_int = ncclTeamRankToWorld(null(), world, 0);
    }
}
