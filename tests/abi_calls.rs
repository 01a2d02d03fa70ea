//! Calls the C entry points directly: argument validation, error codes and messages,
//! ncclGetErrorString against the strings inside NVIDIA's libnccl.so.2, config size/magic handling,
//! not-yet features, and the device-API team helpers on a real communicator.

use nccl::abi::*;
use std::ffi::{c_int, c_void, CStr};
use std::ptr::{null, null_mut};

const INVALID_ARGUMENT: i32 = 4;
const INVALID_USAGE: i32 = 5;

/// The last error message is the process's, and the tests of this binary run on threads of
/// one process: each test holds this while it runs, so that no other test's error comes
/// between its call and its check.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn last_error() -> String {
    // SAFETY: ncclGetLastError returns a valid C string.
    unsafe { CStr::from_ptr(ncclGetLastError(null_mut())) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn version_and_its_twin() {
    let _g = serial();
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
    let _g = serial();
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
    let _g = serial();
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
        assert_eq!(ncclCommInitAll(&mut c, -1, null()).0, INVALID_ARGUMENT);
        // No devices: nothing made, and no error (as NCCL's).
        assert_eq!(ncclCommInitAll(&mut c, 0, null()).0, 0);
        assert!(c.is_null());
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
    let _g = serial();
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
        // graphUsageMode takes 0, 1 or 2; graphStreamOrdering 0 or 1 (as NCCL checks them).
        let mut g = ncclConfig_t::undefined();
        g.graphUsageMode = 3;
        assert_eq!(
            ncclCommInitRankConfig(&mut c, 1, std::mem::zeroed(), 0, &mut g).0,
            INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("graphUsageMode is 3"),
            "{}",
            last_error()
        );
        let mut o = ncclConfig_t::undefined();
        o.graphStreamOrdering = 2;
        assert_eq!(
            ncclCommInitRankConfig(&mut c, 1, std::mem::zeroed(), 0, &mut o).0,
            INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("graphStreamOrdering is 2"),
            "{}",
            last_error()
        );
        // A caller built against an older header: what lies past its fields (its struct's
        // tail padding, say) is not read, as NCCL reads it by `version` too.
        let mut old = ncclConfig_t::undefined();
        old.version = 23000;
        old.graphStreamOrdering = 9;
        let mut id: ncclUniqueId = std::mem::zeroed();
        assert_eq!(ncclGetUniqueId(&mut id).0, 0);
        let r = ncclCommInitRankConfig(&mut c, 1, id, 0, &mut old).0;
        assert_eq!(r, 0, "a 2.30.0 caller's padding: {}", last_error());
        assert_eq!(ncclCommDestroy(c).0, 0);
        for m in 0..=2 {
            let mut ok = ncclConfig_t::undefined();
            ok.graphUsageMode = m;
            ok.graphStreamOrdering = m % 2;
            let mut id: ncclUniqueId = std::mem::zeroed();
            assert_eq!(ncclGetUniqueId(&mut id).0, 0);
            let r = ncclCommInitRankConfig(&mut c, 1, id, 0, &mut ok).0;
            assert_eq!(r, 0, "graphUsageMode {m}: {}", last_error());
            assert_eq!(ncclCommDestroy(c).0, 0);
        }
        // The fields of NCCL's channels, CollNet, NVLS and RMA: refused out of NCCL's ranges,
        // accepted in them, not read from a caller whose header predates them.
        type Field = fn(&mut ncclConfig_t) -> &mut c_int;
        let fields: [(Field, &str, c_int, c_int, u32); 8] = [
            (
                |c| &mut c.cgaClusterSize,
                "cgaClusterSize is -2",
                -2,
                0,
                21700,
            ),
            (|c| &mut c.collnetEnable, "collnetEnable is 2", 2, 1, 22700),
            (|c| &mut c.shrinkShare, "shrinkShare is 3", 3, 0, 22700),
            (
                |c| &mut c.nvlsCTAs,
                "nvlsCTAs is 0; it must be at least 1",
                0,
                16,
                22700,
            ),
            (
                |c| &mut c.nChannelsPerNetPeer,
                "between 1 and 64",
                65,
                64,
                22800,
            ),
            (
                |c| &mut c.nvlinkCentricSched,
                "nvlinkCentricSched is 5",
                5,
                1,
                22800,
            ),
            (|c| &mut c.numRmaCtx, "numRmaCtx is -3", -3, 0, 22900),
            (|c| &mut c.maxP2pPeers, "maxP2pPeers is 0", 0, 8, 23000),
        ];
        for (field, says, bad, good, since) in fields {
            let mut b = ncclConfig_t::undefined();
            *field(&mut b) = bad;
            let r = ncclCommInitRankConfig(&mut c, 1, std::mem::zeroed(), 0, &mut b).0;
            assert_eq!(r, INVALID_ARGUMENT, "{says}");
            assert!(last_error().contains(says), "{says}: {}", last_error());
            for (v, version) in [(good, since), (bad, since - 100)] {
                let mut ok = ncclConfig_t::undefined();
                ok.version = version;
                *field(&mut ok) = v;
                let mut id: ncclUniqueId = std::mem::zeroed();
                assert_eq!(ncclGetUniqueId(&mut id).0, 0);
                let r = ncclCommInitRankConfig(&mut c, 1, id, 0, &mut ok).0;
                assert_eq!(r, 0, "{says}: {v} at {version}: {}", last_error());
                assert_eq!(ncclCommDestroy(c).0, 0);
            }
        }
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
    let _g = serial();
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
        // Outside a group: that, whatever the magic (as NCCL's).
        assert_eq!(ncclGroupSimulateEnd(&mut info).0, INVALID_USAGE);
        info.magic = 1;
        assert_eq!(ncclGroupSimulateEnd(&mut info).0, INVALID_USAGE);
    }
}

/// `ncclTeamWorld/Lsa/Rail` and the rank conversions on a real 4-rank communicator (one process,
/// host executor): all four ranks are on this host, so they form one LSA team, as with NVIDIA's
/// library on a single node of 4 GPUs.
#[test]
fn team_helpers_on_a_four_rank_comm() {
    let _g = serial();
    let mut comms: [ncclComm_t; 4] = [null_mut(); 4];
    let devs: [c_int; 4] = [0, 1, 2, 3];
    // SAFETY: valid out-array of 4 comms and device list of 4.
    let rc = unsafe { ncclCommInitAll(comms.as_mut_ptr(), 4, devs.as_ptr()) };
    assert_eq!(rc.0, 0, "ncclCommInitAll: {}", last_error());
    let field = |what: &str, t: ncclTeam, want: (c_int, c_int, c_int), r: usize| {
        assert_eq!(t.nRanks, want.0, "{what} of rank {r}: nRanks");
        assert_eq!(t.rank, want.1, "{what} of rank {r}: rank");
        assert_eq!(t.stride, want.2, "{what} of rank {r}: stride");
    };
    for (r, &c) in comms.iter().enumerate() {
        let i = r as c_int;
        // SAFETY: a live communicator handle.
        unsafe {
            let world = ncclTeamWorld(c);
            field("ncclTeamWorld", world, (4, i, 1), r);
            field("pncclTeamWorld", pncclTeamWorld(c), (4, i, 1), r);
            let lsa = ncclTeamLsa(c);
            field("ncclTeamLsa", lsa, (4, i, 1), r);
            field("pncclTeamLsa", pncclTeamLsa(c), (4, i, 1), r);
            // One LSA team: the rail team is this rank alone, its stride the LSA team's size.
            let rail = ncclTeamRail(c);
            field("ncclTeamRail", rail, (1, 0, 4), r);
            field("pncclTeamRail", pncclTeamRail(c), (1, 0, 4), r);
            for j in 0..4 {
                assert_eq!(ncclTeamRankToWorld(c, world, j), j, "rank {r}: world {j}");
                assert_eq!(ncclTeamRankToWorld(c, lsa, j), j, "rank {r}: lsa {j}");
                assert_eq!(ncclTeamRankToLsa(c, lsa, j), j, "rank {r}: lsa {j}");
                assert_eq!(ncclTeamRankToLsa(c, world, j), j, "rank {r}: world {j}");
                assert_eq!(pncclTeamRankToWorld(c, world, j), j);
                assert_eq!(pncclTeamRankToLsa(c, lsa, j), j);
            }
            assert_eq!(ncclTeamRankToWorld(c, rail, 0), i);
            assert_eq!(ncclTeamRankToLsa(c, rail, 0), i);
        }
    }
    // SAFETY: a NULL comm: no crash, an empty team, and a message.
    unsafe {
        let t = ncclTeamLsa(null_mut());
        assert_eq!((t.nRanks, t.rank, t.stride), (0, 0, 0));
        assert!(last_error().contains("ncclTeamLsa"), "{}", last_error());
        assert_eq!(ncclTeamRankToWorld(null_mut(), t, 0), -1);
    }
    for c in comms {
        // SAFETY: each handle once.
        assert_eq!(unsafe { ncclCommDestroy(c) }.0, 0);
    }
}

/// `ncclDevCommCreate`/`ncclDevCommDestroy` (and their pnccl twins): NULL arguments are
/// `ncclInvalidArgument` without a crash; valid ones are `ncclInvalidUsage` (not built yet), with
/// a message that says so.
#[test]
fn dev_comm_create_and_destroy_say_they_are_not_built() {
    let _g = serial();
    let mut comm: ncclComm_t = null_mut();
    let dev: c_int = 0;
    // SAFETY: one comm, one device.
    assert_eq!(unsafe { ncclCommInitAll(&mut comm, 1, &dev) }.0, 0);
    // Stand-ins the host executor never reads: any non-NULL pointers will do.
    let mut reqs = [0u64; 32];
    let mut dev_comm = [0u64; 256];
    let reqs_p = reqs.as_mut_ptr() as *const ncclDevCommRequirements_t;
    let dev_p = dev_comm.as_mut_ptr() as *mut ncclDevComm_t;
    // SAFETY: NULL and valid pointers on purpose; none is dereferenced.
    unsafe {
        assert_eq!(ncclDevCommCreate(comm, null(), dev_p).0, INVALID_ARGUMENT);
        assert!(last_error().contains("reqs is NULL"), "{}", last_error());
        assert_eq!(
            ncclDevCommCreate(comm, reqs_p, null_mut()).0,
            INVALID_ARGUMENT
        );
        assert_eq!(
            ncclDevCommCreate(null_mut(), reqs_p, dev_p).0,
            INVALID_ARGUMENT
        );
        assert_eq!(
            ncclDevCommCreate(null_mut(), null(), null_mut()).0,
            INVALID_ARGUMENT
        );
        assert_eq!(ncclDevCommDestroy(comm, null()).0, INVALID_ARGUMENT);
        assert_eq!(ncclDevCommDestroy(null_mut(), dev_p).0, INVALID_ARGUMENT);
        assert_eq!(ncclDevCommDestroy(null_mut(), null()).0, INVALID_ARGUMENT);

        let calls: [(&str, &dyn Fn() -> ncclResult_t); 4] = [
            ("ncclDevCommCreate", &|| {
                ncclDevCommCreate(comm, reqs_p, dev_p)
            }),
            ("pncclDevCommCreate", &|| {
                pncclDevCommCreate(comm, reqs_p, dev_p)
            }),
            ("ncclDevCommDestroy", &|| ncclDevCommDestroy(comm, dev_p)),
            ("pncclDevCommDestroy", &|| pncclDevCommDestroy(comm, dev_p)),
        ];
        for (name, call) in calls {
            assert_eq!(call().0, INVALID_USAGE, "{name}");
            let msg = last_error();
            assert!(
                msg.starts_with(name.trim_start_matches('p'))
                    && msg.contains("device API")
                    && msg.contains("not built"),
                "{name}: {msg}"
            );
        }
        assert_eq!(ncclCommDestroy(comm).0, 0);
    }
    assert!(dev_comm.iter().all(|&w| w == 0), "outDevComm was written");
}

/// Communicators of one thread made in one group, as NCCL's example of several devices per
/// thread does (`NCCLCHECK` around each `ncclCommInitRank`): each call returns `ncclSuccess`
/// (the init runs at `ncclGroupEnd`), and the communicators then work.
#[test]
fn inits_in_a_group_return_success() {
    let _g = serial();
    let mut id: ncclUniqueId = unsafe { std::mem::zeroed() };
    let mut comms: [ncclComm_t; 2] = [null_mut(); 2];
    let mut bufs = [[1.0f32, 2.0, 3.0], [10.0, 20.0, 30.0]];
    // SAFETY: valid pointers; host buffers of 3 floats each, on the host executor.
    unsafe {
        assert_eq!(ncclGetUniqueId(&mut id).0, 0);
        assert_eq!(ncclGroupStart().0, 0);
        for (r, c) in comms.iter_mut().enumerate() {
            let rc = ncclCommInitRank(c, 2, id, r as c_int).0;
            assert_eq!(
                rc,
                0,
                "ncclCommInitRank of rank {r} in a group: {}",
                last_error()
            );
        }
        assert_eq!(ncclGroupEnd().0, 0, "{}", last_error());
        assert_eq!(ncclGroupStart().0, 0);
        for (b, &c) in bufs.iter_mut().zip(&comms) {
            let p = b.as_mut_ptr() as *mut c_void;
            let rc = ncclAllReduce(p, p, 3, ncclDataType_t(7), ncclRedOp_t(0), c, null_mut());
            assert_eq!(rc.0, 0, "{}", last_error());
        }
        assert_eq!(ncclGroupEnd().0, 0, "{}", last_error());
        for c in comms {
            assert_eq!(ncclCommDestroy(c).0, 0);
        }
    }
    for b in bufs {
        assert_eq!(b, [11.0, 22.0, 33.0]);
    }
}

/// `ncclGroupSimulateEnd` closes the group without launching its calls (their time is not
/// estimated yet: -1000, NCCL's value where it cannot), so that the thread's later calls run;
/// an empty group estimates no time.
#[test]
fn group_simulate_end_closes_the_group() {
    let _g = serial();
    let mut info = ncclSimInfo_t {
        size: 24,
        magic: SIM_INFO_MAGIC,
        version: 23203,
        estimatedTime: -1.0,
    };
    let mut comm: ncclComm_t = null_mut();
    let devs: [c_int; 1] = [0];
    let mut b = [1.0f32, 2.0];
    let p = b.as_mut_ptr() as *mut c_void;
    // SAFETY: valid pointers; a host buffer of 2 floats, on the host executor.
    unsafe {
        assert_eq!(ncclCommInitAll(&mut comm, 1, devs.as_ptr()).0, 0);
        assert_eq!(ncclGroupStart().0, 0);
        assert_eq!(ncclGroupSimulateEnd(&mut info).0, 0, "{}", last_error());
        assert_eq!(info.estimatedTime, 0.0, "an empty group");
        // A group whose only call was refused ends in that call's error, as ncclGroupEnd's.
        assert_eq!(ncclGroupStart().0, 0);
        let rc = ncclSend(p, 2, ncclDataType_t(7), 5, comm, null_mut());
        assert_eq!(rc.0, INVALID_ARGUMENT, "a send to peer 5 of 1 rank");
        assert_eq!(
            ncclGroupSimulateEnd(&mut info).0,
            INVALID_ARGUMENT,
            "{}",
            last_error()
        );
        // (Out of place: a one-rank all-reduce copies its input to its output.)
        let mut out = [0.0f32; 2];
        let o = out.as_mut_ptr() as *mut c_void;
        assert_eq!(ncclGroupStart().0, 0);
        let rc = ncclAllReduce(p, o, 2, ncclDataType_t(7), ncclRedOp_t(0), comm, null_mut());
        assert_eq!(rc.0, 0, "{}", last_error());
        // Its time is not estimated: -1000, as NCCL says where it cannot (PyTorch's inductor
        // then uses its own model), and success.
        assert_eq!(ncclGroupSimulateEnd(&mut info).0, 0, "{}", last_error());
        assert_eq!(info.estimatedTime, -1000.0);
        assert_eq!(out, [0.0, 0.0], "a simulated group's call ran");
        assert_eq!(ncclGroupEnd().0, INVALID_USAGE, "the group was left open");
        let rc = ncclAllReduce(p, o, 2, ncclDataType_t(7), ncclRedOp_t(0), comm, null_mut());
        assert_eq!(rc.0, 0, "{}", last_error());
        assert_eq!(out, [1.0, 2.0], "a call after the simulated group");
        // A wrong magic: ncclInvalidArgument, and the group is closed all the same, its call
        // not launched.
        let mut bad = ncclSimInfo_t { magic: 0, ..info };
        out = [0.0; 2];
        assert_eq!(ncclGroupStart().0, 0);
        let rc = ncclAllReduce(p, o, 2, ncclDataType_t(7), ncclRedOp_t(0), comm, null_mut());
        assert_eq!(rc.0, 0, "{}", last_error());
        assert_eq!(ncclGroupSimulateEnd(&mut bad).0, INVALID_ARGUMENT);
        assert!(last_error().contains("magic"), "{}", last_error());
        assert_eq!(out, [0.0, 0.0], "a simulated group's call ran");
        assert_eq!(ncclGroupEnd().0, INVALID_USAGE, "the group was left open");
        // Outside a group, that comes first (as NCCL's).
        assert_eq!(ncclGroupSimulateEnd(&mut bad).0, INVALID_USAGE);
        // NULL: a plain ncclGroupEnd, which launches the group's calls.
        assert_eq!(ncclGroupStart().0, 0);
        let rc = ncclAllReduce(p, o, 2, ncclDataType_t(7), ncclRedOp_t(0), comm, null_mut());
        assert_eq!(rc.0, 0, "{}", last_error());
        assert_eq!(ncclGroupSimulateEnd(null_mut()).0, 0, "{}", last_error());
        assert_eq!(out, [1.0, 2.0], "the group of a NULL simInfo");
        assert_eq!(ncclGroupEnd().0, INVALID_USAGE, "the group was left open");
        assert_eq!(ncclCommDestroy(comm).0, 0);
    }
}

/// A call refused inside a group, also by the C layer (a datatype out of range), or an init
/// refused there (a rank out of range), is the group's error: `ncclGroupEnd` returns it at
/// once and launches nothing of the group, its other inits included, whose communicators say
/// why (as NCCL's `ncclGroupErrCheck`); the thread is out of the group afterwards.
#[test]
fn a_call_refused_in_a_group_fails_the_group() {
    let _g = serial();
    let mut comm: ncclComm_t = null_mut();
    let devs: [c_int; 1] = [0];
    let b = [1.0f32, 2.0];
    let mut out = [0.0f32; 2];
    let (p, o) = (b.as_ptr() as *const c_void, out.as_mut_ptr() as *mut c_void);
    // SAFETY: valid pointers; host buffers of 2 floats, on the host executor.
    unsafe {
        assert_eq!(ncclCommInitAll(&mut comm, 1, devs.as_ptr()).0, 0);
        assert_eq!(ncclGroupStart().0, 0);
        let rc = ncclAllReduce(p, o, 2, ncclDataType_t(7), ncclRedOp_t(0), comm, null_mut());
        assert_eq!(rc.0, 0, "{}", last_error());
        let rc = ncclAllReduce(
            p,
            o,
            2,
            ncclDataType_t(12),
            ncclRedOp_t(0),
            comm,
            null_mut(),
        );
        assert_eq!(rc.0, INVALID_ARGUMENT);
        assert_eq!(ncclGroupEnd().0, INVALID_ARGUMENT, "the group's error");
        assert!(last_error().contains("datatype 12"), "{}", last_error());
        assert_eq!(out, [0.0, 0.0], "a failed group's call ran");
        assert_eq!(ncclGroupEnd().0, INVALID_USAGE, "the group was left open");

        let mut id: ncclUniqueId = std::mem::zeroed();
        assert_eq!(ncclGetUniqueId(&mut id).0, 0);
        let (mut c0, mut c1): (ncclComm_t, ncclComm_t) = (null_mut(), null_mut());
        assert_eq!(ncclGroupStart().0, 0);
        assert_eq!(ncclCommInitRank(&mut c0, 2, id, 0).0, 0, "{}", last_error());
        assert_eq!(ncclCommInitRank(&mut c1, 2, id, 7).0, INVALID_ARGUMENT);
        let t0 = std::time::Instant::now();
        assert_eq!(ncclGroupEnd().0, INVALID_ARGUMENT, "{}", last_error());
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "rank 0's init waited for rank 1: {:?}",
            t0.elapsed()
        );
        let mut n = 0;
        assert_eq!(ncclCommCount(c0, &mut n).0, INVALID_ARGUMENT);
        assert!(
            last_error().contains("was not made") && last_error().contains("rank 7"),
            "{}",
            last_error()
        );
        assert_eq!(ncclCommDestroy(c0).0, 0);
        assert_eq!(ncclCommDestroy(comm).0, 0);
    }
}

/// A scatter's send buffer is used only at the root (as NCCL says): NULL elsewhere is fine.
#[test]
fn a_scatter_needs_no_send_buffer_off_the_root() {
    let _g = serial();
    let mut comms: [ncclComm_t; 2] = [null_mut(); 2];
    let devs: [c_int; 2] = [0, 1];
    let send = [1.0f32, 2.0, 3.0, 4.0];
    let mut recv = [[0.0f32; 2]; 2];
    // SAFETY: valid pointers; host buffers, on the host executor.
    unsafe {
        assert_eq!(ncclCommInitAll(comms.as_mut_ptr(), 2, devs.as_ptr()).0, 0);
        assert_eq!(ncclGroupStart().0, 0);
        for (r, &c) in comms.iter().enumerate() {
            let s = if r == 0 {
                send.as_ptr() as *const c_void
            } else {
                null()
            };
            let d = recv[r].as_mut_ptr() as *mut c_void;
            let rc = ncclScatter(s, d, 2, ncclDataType_t(7), 0, c, null_mut());
            assert_eq!(rc.0, 0, "rank {r}: {}", last_error());
        }
        assert_eq!(ncclGroupEnd().0, 0, "{}", last_error());
        for c in comms {
            assert_eq!(ncclCommDestroy(c).0, 0);
        }
    }
    assert_eq!(recv, [[1.0, 2.0], [3.0, 4.0]]);
}

/// `ncclCommSplit` with a color below -1 on one rank: every rank's call returns
/// `ncclInvalidArgument` at once (the color is checked after the exchange, not before it,
/// where the other ranks would wait in it for this one).
#[test]
fn a_bad_split_color_fails_every_rank_at_once() {
    let _g = serial();
    let mut comms: [ncclComm_t; 2] = [null_mut(); 2];
    let devs: [c_int; 2] = [0, 1];
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, devs.as_ptr()) }.0,
        0
    );
    let t0 = std::time::Instant::now();
    let codes: Vec<i32> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, &c)| {
                let c = c as usize;
                s.spawn(move || {
                    let mut out: ncclComm_t = null_mut();
                    let color = if r == 0 { -5 } else { 0 };
                    // SAFETY: a live communicator; a valid out-pointer; no config.
                    unsafe { ncclCommSplit(c as ncclComm_t, color, 0, &mut out, null_mut()) }.0
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(codes, [INVALID_ARGUMENT, INVALID_ARGUMENT]);
    assert!(
        last_error().contains("rank 0 gave color -5"),
        "{}",
        last_error()
    );
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        t0.elapsed()
    );
    for c in comms {
        // SAFETY: live communicators.
        assert_eq!(unsafe { ncclCommDestroy(c) }.0, 0);
    }
}

/// A PreMulSum operator belongs to the communicator it was created on: used on another one
/// (here each of two single-rank communicators has made one, so the other holds an operator in
/// the same slot), the call is `ncclInvalidArgument` saying so, as NCCL's mangled values make it,
/// rather than a reduction with the other communicator's scalar. On its own communicator it
/// scales, and once destroyed it is refused there too.
#[test]
fn a_premulsum_operator_works_only_on_its_communicator() {
    let _g = serial();
    let mut a: ncclComm_t = null_mut();
    let mut b: ncclComm_t = null_mut();
    let dev: c_int = 0;
    let float = ncclDataType_t(7);
    // SAFETY: valid pointers; host buffers, on the host executor.
    unsafe {
        assert_eq!(ncclCommInitAll(&mut a, 1, &dev).0, 0);
        assert_eq!(ncclCommInitAll(&mut b, 1, &dev).0, 0);
        let (mut op_a, mut op_b) = (ncclRedOp_t(0), ncclRedOp_t(0));
        let (mut two, mut three) = (2.0f32, 3.0f32);
        let host = ncclScalarResidence_t(1);
        let s2 = &mut two as *mut f32 as *mut c_void;
        let s3 = &mut three as *mut f32 as *mut c_void;
        assert_eq!(ncclRedOpCreatePreMulSum(&mut op_a, s2, float, host, a).0, 0);
        assert_eq!(ncclRedOpCreatePreMulSum(&mut op_b, s3, float, host, b).0, 0);
        assert_ne!(op_a.0, op_b.0, "two communicators' first operators");
        assert!(op_a.0 >= 5 && op_b.0 >= 5);
        let x = [1.0f32, -4.0, 0.5];
        let mut y = [0.0f32; 3];
        let (xs, ys) = (x.as_ptr() as *const c_void, y.as_mut_ptr() as *mut c_void);
        let rc = ncclAllReduce(xs, ys, 3, float, op_a, b, null_mut());
        assert_eq!(rc.0, INVALID_ARGUMENT, "op of a on b");
        let e = last_error();
        assert!(e.contains("created on another communicator"), "{e}");
        assert_eq!(y, [0.0; 3], "nothing written");
        assert_eq!(ncclRedOpDestroy(op_a, b).0, INVALID_ARGUMENT);
        assert!(
            last_error().contains("another communicator"),
            "{}",
            last_error()
        );
        assert_eq!(ncclAllReduce(xs, ys, 3, float, op_a, a, null_mut()).0, 0);
        assert_eq!(y, [2.0, -8.0, 1.0]);
        assert_eq!(ncclAllReduce(xs, ys, 3, float, op_b, b, null_mut()).0, 0);
        assert_eq!(y, [3.0, -12.0, 1.5]);
        assert_eq!(ncclRedOpDestroy(op_a, a).0, 0);
        let rc = ncclAllReduce(xs, ys, 3, float, op_a, a, null_mut());
        assert_eq!(rc.0, INVALID_ARGUMENT, "a destroyed op");
        assert!(last_error().contains("destroyed"), "{}", last_error());
        assert_eq!(ncclRedOpDestroy(op_b, b).0, 0);
        assert_eq!(ncclCommDestroy(a).0, 0);
        assert_eq!(ncclCommDestroy(b).0, 0);
    }
}

/// Non-blocking communicators through the C entry points, as NCCL returns: the init says
/// `ncclInProgress`; a split and a shrink say `ncclSuccess` with the child's handle out while
/// its init runs on (its `ncclCommGetAsyncError` says `ncclInProgress` until it is done). A
/// shrink that excludes no rank is refused, as NCCL's.
#[test]
fn non_blocking_split_and_shrink_return_success_with_the_handle() {
    let _g = serial();
    const IN_PROGRESS: i32 = 7;
    // SAFETY: an all-zero ncclUniqueId is a valid value to overwrite.
    let mut id: ncclUniqueId = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }.0, 0);
    let settle = |c: ncclComm_t| {
        let t0 = std::time::Instant::now();
        loop {
            let mut st = ncclResult_t(-1);
            // SAFETY: a live communicator; a valid out-pointer.
            assert_eq!(unsafe { ncclCommGetAsyncError(c, &mut st) }.0, 0);
            match st.0 {
                IN_PROGRESS => assert!(t0.elapsed().as_secs() < 60, "never done"),
                0 => return,
                e => panic!("init failed: {e}: {}", last_error()),
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };
    // Ranks 0 and 1 shrink away rank 2 (which does not call it).
    let codes: Vec<(i32, i32, i32)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                s.spawn(move || {
                    let mut cfg = ncclConfig_t::undefined();
                    cfg.blocking = 0;
                    let (mut c, mut k, mut h): (ncclComm_t, ncclComm_t, ncclComm_t) =
                        (null_mut(), null_mut(), null_mut());
                    // SAFETY: valid pointers; the config and the exclude list outlive the calls.
                    unsafe {
                        let init = ncclCommInitRankConfig(&mut c, 3, id, r, &mut cfg).0;
                        assert!(!c.is_null());
                        settle(c);
                        let split = ncclCommSplit(c, 0, 2 - r, &mut k, &mut cfg).0;
                        assert!(!k.is_null(), "rank {r}: no split handle");
                        settle(k);
                        let mut rank = -1;
                        assert_eq!(ncclCommUserRank(k, &mut rank).0, 0);
                        assert_eq!(rank, 2 - r, "the split's key orders the child");
                        let mut none = [0 as c_int; 0];
                        let refused = ncclCommShrink(c, none.as_mut_ptr(), 0, &mut h, &mut cfg, 0);
                        assert_eq!(refused.0, INVALID_ARGUMENT, "rank {r}: a shrink of none");
                        let mut shrink = 0;
                        if r < 2 {
                            let mut out = [2 as c_int];
                            shrink = ncclCommShrink(c, out.as_mut_ptr(), 1, &mut h, &mut cfg, 0).0;
                            assert!(!h.is_null(), "rank {r}: no shrink handle");
                            settle(h);
                            assert_eq!(ncclCommCount(h, &mut rank).0, 0);
                            assert_eq!(rank, 2, "the shrunk communicator's ranks");
                            assert_eq!(ncclCommDestroy(h).0, 0, "{}", last_error());
                        }
                        for x in [k, c] {
                            assert_eq!(ncclCommDestroy(x).0, 0, "{}", last_error());
                        }
                        (init, split, shrink)
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, &(init, split, shrink)) in codes.iter().enumerate() {
        assert!(init == IN_PROGRESS || init == 0, "rank {r}: init {init}");
        assert_eq!((split, shrink), (0, 0), "rank {r}");
    }
}

/// The device API's pointer queries and resource requirements are exported (a PyTorch built
/// against NCCL >= 2.29 imports `ncclGetLsaMultimemDevicePointer`, and `import torch` binds
/// every symbol at once) and each says it is not built: `ncclInvalidUsage` naming itself, its
/// output untouched; the int and team helpers return -1 and the empty team.
#[test]
fn the_device_api_queries_load_and_say_they_are_not_built() {
    let _g = serial();
    const USAGE: i32 = INVALID_USAGE;
    let mut p: *mut c_void = 8usize as *mut c_void;
    let (mut le, mut off) = (7u32, 9usize);
    let team = ncclTeam {
        nRanks: 1,
        rank: 0,
        stride: 1,
    };
    let mm = ncclMultimemHandle {
        mcBasePtr: null_mut(),
    };
    let w: ncclWindow_t = null_mut();
    let mut h = [0u8; 64];
    let mut req = [0u8; 256];
    let (hp, rp) = (
        h.as_mut_ptr() as *mut c_void,
        req.as_mut_ptr() as *mut c_void,
    );
    let mut comm: ncclComm_t = null_mut();
    let dev: c_int = 0;
    // SAFETY: valid pointers; nothing is written through them (checked below).
    unsafe {
        assert_eq!(ncclCommInitAll(&mut comm, 1, &dev).0, 0);
        let calls: [(&str, i32); 11] = [
            (
                "ncclGetLsaMultimemDevicePointer",
                ncclGetLsaMultimemDevicePointer(w, 0, &mut p).0,
            ),
            (
                "ncclGetMultimemDevicePointer",
                ncclGetMultimemDevicePointer(w, 0, mm, &mut p).0,
            ),
            (
                "ncclGetLsaDevicePointer",
                ncclGetLsaDevicePointer(w, 0, 0, &mut p).0,
            ),
            (
                "ncclGetPeerDevicePointer",
                ncclGetPeerDevicePointer(w, 0, 0, &mut p).0,
            ),
            (
                "ncclGetMultimemDeviceLeInfo",
                ncclGetMultimemDeviceLeInfo(w, 0, &mut le, &mut off).0,
            ),
            (
                "ncclGetCftDeviceLeInfo",
                ncclGetCftDeviceLeInfo(w, 0, 0, team, &mut le, &mut off).0,
            ),
            (
                "ncclGetPeerDeviceLeInfo",
                ncclGetPeerDeviceLeInfo(w, 0, 0, &mut le, &mut off).0,
            ),
            (
                "ncclLsaBarrierCreateRequirement",
                ncclLsaBarrierCreateRequirement(team, 1, hp.cast(), rp.cast()).0,
            ),
            (
                "ncclGinBarrierCreateRequirement",
                ncclGinBarrierCreateRequirement(comm, team, 1, hp.cast(), rp.cast()).0,
            ),
            (
                "ncclLLA2ACreateRequirement",
                ncclLLA2ACreateRequirement(1, 8, hp.cast(), rp.cast()).0,
            ),
            (
                "pncclGetLsaMultimemDevicePointer",
                pncclGetLsaMultimemDevicePointer(w, 0, &mut p).0,
            ),
        ];
        for (name, rc) in calls {
            assert_eq!(rc, USAGE, "{name}");
        }
        assert!(last_error().contains("not built"), "{}", last_error());
        assert_eq!(ncclLLA2ACalcSlots(64, 16), -1);
        assert!(
            last_error().contains("ncclLLA2ACalcSlots"),
            "{}",
            last_error()
        );
        for t in [ncclTeamCft(comm, 0), ncclTeamCftMultimem(comm)] {
            assert_eq!((t.nRanks, t.rank, t.stride), (0, 0, 0));
        }
        assert!(
            last_error().contains("ncclTeamCftMultimem"),
            "{}",
            last_error()
        );
        assert_eq!(ncclCommDestroy(comm).0, 0);
    }
    assert_eq!((p as usize, le, off), (8, 7, 9), "outputs untouched");
    assert!(h.iter().chain(&req).all(|&b| b == 0), "outputs untouched");
}
