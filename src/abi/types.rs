//! `#[repr(C)]` mirrors of NCCL 2.32.3's public C types.
//!
//! Enum-typed C parameters are `#[repr(transparent)]` integers on the Rust side: C may pass any
//! value, and an out-of-range value in a Rust enum would be undefined behaviour. Their C
//! definitions (with every alias) are written in cbindgen.toml; the structs below are emitted by
//! cbindgen.
#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_float, c_int, c_uint, c_void};

/// `NCCL_API_MAGIC`.
pub const API_MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`.
pub const UNDEF_INT: c_int = c_int::MIN;
/// The magic of `NCCL_SIM_INFO_INITIALIZER`.
pub const SIM_INFO_MAGIC: c_uint = 0x7468_5283;

/// `ncclResult_t`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclResult_t(pub c_int);

/// `ncclDataType_t` (any int value may arrive from C).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclDataType_t(pub c_int);

/// `ncclRedOp_t`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclRedOp_t(pub c_int);

/// `ncclScalarResidence_t`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclScalarResidence_t(pub c_int);

/// `ncclCommMemStat_t`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclCommMemStat_t(pub c_int);

/// `struct ncclComm` (opaque: a handle from `api::comm_handle`).
#[repr(C)]
pub struct ncclComm {
    _opaque: [u8; 0],
}
pub type ncclComm_t = *mut ncclComm;

/// `struct ncclWindow_vidmem` (opaque).
#[repr(C)]
pub struct ncclWindow_vidmem {
    _opaque: [u8; 0],
}
pub type ncclWindow_t = *mut ncclWindow_vidmem;

/// `struct ncclParamHandle` (opaque).
#[repr(C)]
pub struct ncclParamHandle {
    _opaque: [u8; 0],
}
pub type ncclParamHandle_t = *mut ncclParamHandle;

/// CUDA's `struct CUstream_st` (opaque; on the host executor a host-stream handle or NULL).
#[repr(C)]
pub struct CUstream_st {
    _opaque: [u8; 0],
}
pub type cudaStream_t = *mut CUstream_st;

/// CUDA's `struct CUevent_st` (opaque).
#[repr(C)]
pub struct CUevent_st {
    _opaque: [u8; 0],
}
pub type cudaEvent_t = *mut CUevent_st;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; 128],
}

/// `ncclConfig_t` as of NCCL 2.31/2.32 (callers built against older headers pass a smaller `size`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclConfig_v23100 {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cgaClusterSize: c_int,
    pub minCTAs: c_int,
    pub maxCTAs: c_int,
    pub netName: *const c_char,
    pub splitShare: c_int,
    pub trafficClass: c_int,
    pub commName: *const c_char,
    pub collnetEnable: c_int,
    pub CTAPolicy: c_int,
    pub shrinkShare: c_int,
    pub nvlsCTAs: c_int,
    pub nChannelsPerNetPeer: c_int,
    pub nvlinkCentricSched: c_int,
    pub graphUsageMode: c_int,
    pub numRmaCtx: c_int,
    pub maxP2pPeers: c_int,
    pub graphStreamOrdering: c_int,
    pub launchOrderImplicit: c_int,
    pub numRmaSig: c_int,
    pub rmaEagerInit: c_int,
    pub hostCftMode: c_int,
    pub nvlsHostMode: c_int,
}
pub type ncclConfig_t = ncclConfig_v23100;

/// The `key` member of `ncclConfigExt_t` (an unnamed struct in NCCL's header).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclConfigExtKey {
    pub vendorId: c_int,
    pub optionId: c_int,
}

/// The `val` member of `ncclConfigExt_t` (an unnamed union in NCCL's header).
#[repr(C)]
#[derive(Clone, Copy)]
pub union ncclConfigExtVal {
    pub i: c_int,
    pub s: *const c_char,
    pub raw: *mut c_void,
}

/// `ncclConfigExt_t`: one vendor option of a per-collective config.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclConfigExt {
    pub next: *mut ncclConfigExt,
    pub key: ncclConfigExtKey,
    pub val: ncclConfigExtVal,
}
pub type ncclConfigExt_t = ncclConfigExt;

/// `ncclCollConfig_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclCollConfig_v23200 {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub ext: *mut ncclConfigExt_t,
    pub minCTAs: c_int,
    pub maxCTAs: c_int,
    pub nvlsCTAs: c_int,
    pub cgaClusterSize: c_int,
    pub algSelection: *const c_char,
    pub forceAlgSelection: c_int,
    pub CTAPolicy: c_int,
    pub userProfilerTag: u64,
    pub launchCompletionEvent: cudaEvent_t,
}
pub type ncclCollConfig_t = ncclCollConfig_v23200;

/// `ncclSimInfo_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclSimInfo_v22200 {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub estimatedTime: c_float,
}
pub type ncclSimInfo_t = ncclSimInfo_v22200;

/// `ncclWaitSignalDesc_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclWaitSignalDesc_t {
    pub opCnt: c_int,
    pub peer: c_int,
    pub sigIdx: c_int,
    pub ctx: c_int,
}

/// `ncclEncryptionConfig_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclEncryptionConfig_v23200 {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub mode: c_int,
    pub psk: *const c_char,
}
pub type ncclEncryptionConfig_t = ncclEncryptionConfig_v23200;

impl ncclConfig_v23100 {
    /// What `NCCL_CONFIG_INITIALIZER` gives (every attribute undefined).
    pub fn undefined() -> Self {
        ncclConfig_v23100 {
            size: std::mem::size_of::<Self>(),
            magic: API_MAGIC,
            version: crate::api::VERSION_CODE as c_uint,
            blocking: UNDEF_INT,
            cgaClusterSize: UNDEF_INT,
            minCTAs: UNDEF_INT,
            maxCTAs: UNDEF_INT,
            netName: std::ptr::null(),
            splitShare: UNDEF_INT,
            trafficClass: UNDEF_INT,
            commName: std::ptr::null(),
            collnetEnable: UNDEF_INT,
            CTAPolicy: UNDEF_INT,
            shrinkShare: UNDEF_INT,
            nvlsCTAs: UNDEF_INT,
            nChannelsPerNetPeer: UNDEF_INT,
            nvlinkCentricSched: UNDEF_INT,
            graphUsageMode: UNDEF_INT,
            numRmaCtx: UNDEF_INT,
            maxP2pPeers: UNDEF_INT,
            graphStreamOrdering: UNDEF_INT,
            launchOrderImplicit: UNDEF_INT,
            numRmaSig: UNDEF_INT,
            rmaEagerInit: UNDEF_INT,
            hostCftMode: UNDEF_INT,
            nvlsHostMode: UNDEF_INT,
        }
    }
}

impl ncclCollConfig_v23200 {
    /// What `NCCL_COLLCONFIG_INITIALIZER` gives.
    pub fn undefined() -> Self {
        ncclCollConfig_v23200 {
            size: std::mem::size_of::<Self>(),
            magic: API_MAGIC,
            version: crate::api::VERSION_CODE as c_uint,
            ext: std::ptr::null_mut(),
            minCTAs: UNDEF_INT,
            maxCTAs: UNDEF_INT,
            nvlsCTAs: UNDEF_INT,
            cgaClusterSize: UNDEF_INT,
            algSelection: std::ptr::null(),
            forceAlgSelection: 1,
            CTAPolicy: UNDEF_INT,
            userProfilerTag: 0,
            launchCompletionEvent: std::ptr::null_mut(),
        }
    }
}

// ---- Device-API host types (declared by NCCL in nccl_device/*.h, not in nccl.h) ----

/// `struct ncclMultimemHandle` (nccl_device/impl/core__types.h), passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclMultimemHandle {
    pub mcBasePtr: *mut c_void,
}

/// `struct ncclTeam`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclTeam {
    pub nRanks: c_int,
    pub rank: c_int,
    pub stride: c_int,
}

/// `struct ncclDevComm` (nccl_device/impl/comm__types.h), opaque here: the host executor never
/// fills one.
#[repr(C)]
pub struct ncclDevComm {
    _opaque: [u8; 0],
}
pub type ncclDevComm_t = ncclDevComm;

/// `struct ncclDevCommRequirements` (nccl_device/host.h), opaque here: the host executor reads
/// none of it.
#[repr(C)]
pub struct ncclDevCommRequirements {
    _opaque: [u8; 0],
}
pub type ncclDevCommRequirements_t = ncclDevCommRequirements;

/// The device API's opaque out-parameters of the resource-requirement helpers (never touched:
/// those calls say the device API is not built), and `ncclCftTeamMode_t` (an enum there).
#[repr(C)]
pub struct ncclDevResourceRequirements {
    _opaque: [u8; 0],
}
pub type ncclDevResourceRequirements_t = ncclDevResourceRequirements;
#[repr(C)]
pub struct ncclLsaBarrierHandle {
    _opaque: [u8; 0],
}
pub type ncclLsaBarrierHandle_t = ncclLsaBarrierHandle;
#[repr(C)]
pub struct ncclGinBarrierHandle {
    _opaque: [u8; 0],
}
pub type ncclGinBarrierHandle_t = ncclGinBarrierHandle;
#[repr(C)]
pub struct ncclLLA2AHandle {
    _opaque: [u8; 0],
}
pub type ncclLLA2AHandle_t = ncclLLA2AHandle;
pub type ncclCftTeamMode_t = c_int;

/// `ncclCommProperties_t` (nccl_device/host.h). `ncclGinType_t` and `ncclGinConnectionType_t`
/// are C enums, i.e. `int`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclCommProperties {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub rank: c_int,
    pub nRanks: c_int,
    pub cudaDev: c_int,
    pub nvmlDev: c_int,
    pub deviceApiSupport: bool,
    pub multimemSupport: bool,
    pub ginType: c_int,
    pub nLsaTeams: c_int,
    pub hostRmaSupport: bool,
    pub railedGinType: c_int,
    pub commHash: u64,
    pub ginMinStride: c_int,
    pub ginConnectionType: c_int,
    pub ginSupport: [bool; 64],
    pub devCommRuntimeVersionSize: usize,
    pub cftSupport: bool,
    pub cftMulticastSupport: bool,
    pub cftCountedSupport: bool,
}
pub type ncclCommProperties_t = ncclCommProperties;
