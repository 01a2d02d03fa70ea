//! The CUDA driver API, loaded at run time from `libcuda.so.1` with `libloading`: the functions
//! the CUDA executor calls, each resolved once. The library links no CUDA library; a symbol the
//! installed driver lacks makes loading fail with an error naming it (nothing panics, unlike a
//! binding that resolves symbols lazily and panics at the first call of a missing one).
//!
//! Every call goes through [`check`], which turns a `CUresult` into the NCCL error code with the
//! driver's name and description of the error and what was being done.

use crate::error::{Code, Error, Result};
use once_cell::sync::OnceCell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUdeviceptr = u64;
pub type CUgraph = *mut c_void;
pub type CUuserObject = *mut c_void;
/// A host function the driver calls (here: a user object's destructor).
pub type CUhostFn = unsafe extern "C" fn(*mut c_void);

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: CUresult = 712;
pub const CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: CUresult = 704;
/// A wait would merge two independent stream captures (streams capturing different graphs).
pub const CUDA_ERROR_STREAM_CAPTURE_MERGE: CUresult = 902;
/// The legacy stream was used while a blocking stream captures (implicitly joining it).
pub const CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: CUresult = 906;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;
pub const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;
pub const CU_MEMHOSTREGISTER_DEVICEMAP: c_uint = 2;
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
/// `cuEventRecordWithFlags` while capturing: an event record node (it records at each replay).
pub const CU_EVENT_RECORD_EXTERNAL: c_uint = 1;
/// `cuStreamWaitEvent` while capturing: an event wait node (it waits at each replay for the
/// event's latest record then, which may be outside the graph).
pub const CU_EVENT_WAIT_EXTERNAL: c_uint = 1;
/// `CUstreamCaptureStatus`: not capturing, active, invalidated.
pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
/// `CUstreamCaptureMode`: relaxed (what a library may do while a caller's stream captures).
pub const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
/// `cuUserObjectCreate`'s one flag (required): the destructor is not ordered after any CUDA
/// work by the driver.
pub const CU_USER_OBJECT_NO_DESTRUCTOR_SYNC: c_uint = 1;
/// `cuGraphRetainUserObject`: the caller's references move to the graph.
pub const CU_GRAPH_USER_OBJECT_MOVE: c_uint = 1;
pub const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
pub const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
pub const CU_POINTER_ATTRIBUTE_IS_MANAGED: c_int = 8;
pub const CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: c_int = 10;
/// The allocation that holds an address: its base (a device pointer) and size (a size_t).
pub const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
pub const CU_POINTER_ATTRIBUTE_RANGE_SIZE: c_int = 12;
pub const CU_MEMORYTYPE_HOST: c_uint = 1;
pub const CU_MEMORYTYPE_DEVICE: c_uint = 2;
pub const CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
/// `cuIpcOpenMemHandle`'s flag: enable peer access to the memory's device where it is another.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
/// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`: atomics on the peer's memory are native
/// (NVLink; not PCIe).
pub const CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED: c_int = 3;

pub const CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int = 102;
pub const CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: c_int = 103;
pub const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: c_int = 110;
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_uint = 1;
pub const CU_MEM_HANDLE_TYPE_NONE: c_uint = 0;
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_uint = 1;
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_uint = 1;
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_uint = 3;
pub const CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: c_uint = 1;

/// `CUmemLocation` (a device: `id` its ordinal).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUmemLocation {
    pub kind: c_uint,
    pub id: c_int,
}

/// `CUmemAllocationProp` (`allocFlags`: compressionType, gpuDirectRDMACapable, usage,
/// reserved[4], as bytes: `ALLOC_FLAG_GPU_DIRECT_RDMA` is the second).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemAllocationProp {
    pub kind: c_uint,
    pub requested_handle_types: c_uint,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: c_uint,
}

/// The byte of `CUmemAllocationProp::alloc_flags` that is `gpuDirectRDMACapable`.
pub const ALLOC_FLAG_GPU_DIRECT_RDMA: usize = 1;
const _: () = assert!(std::mem::size_of::<CUmemAllocationProp>() == 32);
const _: () = assert!(std::mem::size_of::<CUmemAccessDesc>() == 12);

/// `CUipcMemHandle`: device memory of one process, as another opens it (passed by value).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUipcMemHandle {
    pub reserved: [u8; 64],
}

/// `cuStreamGetCaptureInfo`, as called here: the stream, the status, the capture id, then
/// outputs (graph, dependencies, edge data or their count) that are all passed NULL. Version 2
/// has six parameters, version 3 seven, version 1 three; passing seven to any of them is sound
/// in the C calling conventions of x86-64 and aarch64 (the callee ignores what it does not
/// take).
pub type CaptureInfoFn = unsafe extern "C" fn(
    CUstream,
    *mut c_int,
    *mut u64,
    *mut c_void,
    *mut c_void,
    *mut c_void,
    *mut c_void,
) -> CUresult;
/// `cuUserObjectCreate(object, pointer, destructor, references, flags)`.
pub type UserObjectCreateFn =
    unsafe extern "C" fn(*mut CUuserObject, *mut c_void, CUhostFn, c_uint, c_uint) -> CUresult;
/// `cuGraphRetainUserObject(graph, object, references, flags)`.
pub type GraphRetainFn = unsafe extern "C" fn(CUgraph, CUuserObject, c_uint, c_uint) -> CUresult;
/// `cuUserObjectRelease(object, references)`.
pub type UserObjectReleaseFn = unsafe extern "C" fn(CUuserObject, c_uint) -> CUresult;

/// `cuDeviceGetPCIBusId(text, length, device)`.
pub type PciBusIdFn = unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult;
/// The CUDA runtime's `cudaGetDevice` (a `cudaError_t`, 0 for success).
pub type RuntimeGetDeviceFn = unsafe extern "C" fn(*mut c_int) -> c_int;

/// User objects (CUDA 11.3): what a graph keeps alive until it and its instances are gone.
#[derive(Clone, Copy)]
pub struct UserObjects {
    pub create: UserObjectCreateFn,
    pub retain: GraphRetainFn,
    pub release: UserObjectReleaseFn,
}

const CAPTURE_INFO_SYMBOLS: [&str; 3] = [
    "cuStreamGetCaptureInfo_v2\0",
    "cuStreamGetCaptureInfo_v3\0",
    "cuStreamGetCaptureInfo\0",
];

macro_rules! driver_api {
    ($( $field:ident = $sym:literal : fn($($arg:ty),*) ;)*) => {
        /// The resolved driver functions.
        #[allow(non_snake_case)]
        pub struct Api {
            $( pub $field: unsafe extern "C" fn($($arg),*) -> CUresult, )*
            /// `cuStreamGetCaptureInfo` (v2, v3 or v1: whichever the driver has; called with
            /// the stream, the status and the id, every later output NULL, which each version
            /// allows); None where the driver has none (then graphs are told apart by the
            /// driver's refusals only).
            pub capture_info: Option<CaptureInfoFn>,
            /// User objects, where the driver has them (None: a graph keeps nothing of ours
            /// alive, so a communicator whose launches were captured leaks what they name).
            pub user_objects: Option<UserObjects>,
            /// `cuDeviceGetPCIBusId`, where the driver has it (None: two GPUs' PCIe distance
            /// is unknown).
            pub pci_bus_id: Option<PciBusIdFn>,
            /// The CUDA runtime's `cudaGetDevice`, where the process has loaded the runtime
            /// (`runtime_get_device`; oxccl loads none): the device of a thread with no
            /// current context (`current_device`).
            pub runtime_device: Option<RuntimeGetDeviceFn>,
            _lib: Option<libloading::Library>,
            /// The runtime library `runtime_device` is from, where it was found by name.
            _runtime: Option<libloading::Library>,
        }

        impl Api {
            fn load(lib: libloading::Library) -> Result<Api> {
                // SAFETY: every symbol has the C signature given in the table in every driver
                // that exports it (CUDA's `cuda.h`); the library stays loaded as long as the
                // table lives.
                let mut api = unsafe {
                    Api::resolve(|name| lib.get::<*const c_void>(name.as_bytes()).ok().map(|s| *s))
                }?;
                api._lib = Some(lib);
                if let Some((f, rt)) = runtime_get_device() {
                    api.runtime_device = Some(f);
                    api._runtime = rt;
                }
                Ok(api)
            }

            /// The table from `lookup(symbol name with its NUL)`, an error naming the first
            /// symbol it cannot give.
            ///
            /// # Safety
            /// Each address `lookup` gives is a function with the C signature the table lists
            /// for that symbol, valid while the table is used.
            pub unsafe fn resolve(
                lookup: impl Fn(&str) -> Option<*const c_void>,
            ) -> Result<Api> {
                Ok(Api {
                    $( $field: {
                        let s = lookup(concat!($sym, "\0")).filter(|p| !p.is_null());
                        // SAFETY: per the contract, the address is such a function.
                        s.map(|p| unsafe {
                            std::mem::transmute::<*const c_void, unsafe extern "C" fn($($arg),*) -> CUresult>(p)
                        }).ok_or_else(|| Error::new(
                            Code::UnhandledCudaError,
                            format!(
                                "the CUDA driver (libcuda.so.1) lacks {}: it is too old for \
                                 oxccl's CUDA executor (set OXCCL_DEVICE=host to run on host \
                                 memory)",
                                $sym
                            ),
                        ))?
                    }, )*
                    capture_info: CAPTURE_INFO_SYMBOLS.iter().find_map(|name| {
                        lookup(name).filter(|p| !p.is_null()).map(|p| {
                            // SAFETY: per the contract; every version's leading parameters
                            // are the stream, the status and the id (see `CaptureInfoFn`).
                            unsafe { std::mem::transmute::<*const c_void, CaptureInfoFn>(p) }
                        })
                    }),
                    user_objects: {
                        let f = |name: &str| lookup(name).filter(|p| !p.is_null());
                        match (
                            f("cuUserObjectCreate\0"),
                            f("cuGraphRetainUserObject\0"),
                            f("cuUserObjectRelease\0"),
                        ) {
                            // SAFETY: per the contract, each address is the function of its
                            // symbol, whose signature `UserObjects` gives.
                            (Some(c), Some(r), Some(l)) => Some(unsafe {
                                UserObjects {
                                    create: std::mem::transmute::<
                                        *const c_void,
                                        UserObjectCreateFn,
                                    >(c),
                                    retain: std::mem::transmute::<*const c_void, GraphRetainFn>(
                                        r,
                                    ),
                                    release: std::mem::transmute::<
                                        *const c_void,
                                        UserObjectReleaseFn,
                                    >(l),
                                }
                            }),
                            _ => None,
                        }
                    },
                    pci_bus_id: lookup("cuDeviceGetPCIBusId\0").filter(|p| !p.is_null()).map(
                        // SAFETY: per the contract, the function of that symbol.
                        |p| unsafe { std::mem::transmute::<*const c_void, PciBusIdFn>(p) },
                    ),
                    runtime_device: lookup("cudaGetDevice\0").filter(|p| !p.is_null()).map(
                        // SAFETY: per the contract, the function of that symbol.
                        |p| unsafe { std::mem::transmute::<*const c_void, RuntimeGetDeviceFn>(p) },
                    ),
                    _lib: None,
                    _runtime: None,
                })
            }
        }
    };
}

driver_api! {
    init = "cuInit": fn(c_uint);
    driver_version = "cuDriverGetVersion": fn(*mut c_int);
    device_count = "cuDeviceGetCount": fn(*mut c_int);
    device_get = "cuDeviceGet": fn(*mut CUdevice, c_int);
    device_attr = "cuDeviceGetAttribute": fn(*mut c_int, c_int, CUdevice);
    device_name = "cuDeviceGetName": fn(*mut c_char, c_int, CUdevice);
    primary_retain = "cuDevicePrimaryCtxRetain": fn(*mut CUcontext, CUdevice);
    ctx_get_current = "cuCtxGetCurrent": fn(*mut CUcontext);
    ctx_set_current = "cuCtxSetCurrent": fn(CUcontext);
    ctx_get_device = "cuCtxGetDevice": fn(*mut CUdevice);
    ctx_enable_peer_access = "cuCtxEnablePeerAccess": fn(CUcontext, c_uint);
    module_load_data = "cuModuleLoadData": fn(*mut CUmodule, *const c_void);
    module_get_function = "cuModuleGetFunction": fn(*mut CUfunction, CUmodule, *const c_char);
    func_set_attr = "cuFuncSetAttribute": fn(CUfunction, c_int, c_int);
    launch_kernel = "cuLaunchKernel": fn(CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint,
        c_uint, c_uint, CUstream, *mut *mut c_void, *mut *mut c_void);
    mem_alloc = "cuMemAlloc_v2": fn(*mut CUdeviceptr, usize);
    mem_free = "cuMemFree_v2": fn(CUdeviceptr);
    mem_alloc_async = "cuMemAllocAsync": fn(*mut CUdeviceptr, usize, CUstream);
    mem_free_async = "cuMemFreeAsync": fn(CUdeviceptr, CUstream);
    host_register = "cuMemHostRegister_v2": fn(*mut c_void, usize, c_uint);
    host_unregister = "cuMemHostUnregister": fn(*mut c_void);
    host_device_pointer = "cuMemHostGetDevicePointer_v2": fn(*mut CUdeviceptr, *mut c_void, c_uint);
    memcpy_dtod_async = "cuMemcpyDtoDAsync_v2": fn(CUdeviceptr, CUdeviceptr, usize, CUstream);
    memcpy_dtoh = "cuMemcpyDtoH_v2": fn(*mut c_void, CUdeviceptr, usize);
    memset_d8_async = "cuMemsetD8Async": fn(CUdeviceptr, u8, usize, CUstream);
    memset_d32_async = "cuMemsetD32Async": fn(CUdeviceptr, c_uint, usize, CUstream);
    stream_create = "cuStreamCreate": fn(*mut CUstream, c_uint);
    stream_destroy = "cuStreamDestroy_v2": fn(CUstream);
    stream_synchronize = "cuStreamSynchronize": fn(CUstream);
    stream_query = "cuStreamQuery": fn(CUstream);
    stream_is_capturing = "cuStreamIsCapturing": fn(CUstream, *mut c_int);
    stream_wait_event = "cuStreamWaitEvent": fn(CUstream, CUevent, c_uint);
    exchange_capture_mode = "cuThreadExchangeStreamCaptureMode": fn(*mut c_int);
    event_create = "cuEventCreate": fn(*mut CUevent, c_uint);
    event_record = "cuEventRecord": fn(CUevent, CUstream);
    event_record_flags = "cuEventRecordWithFlags": fn(CUevent, CUstream, c_uint);
    event_query = "cuEventQuery": fn(CUevent);
    event_destroy = "cuEventDestroy_v2": fn(CUevent);
    pointer_attrs = "cuPointerGetAttributes": fn(c_uint, *mut c_int, *mut *mut c_void,
        CUdeviceptr);
    device_uuid = "cuDeviceGetUuid_v2": fn(*mut [u8; 16], CUdevice);
    ipc_get_mem_handle = "cuIpcGetMemHandle": fn(*mut CUipcMemHandle, CUdeviceptr);
    ipc_open_mem_handle = "cuIpcOpenMemHandle_v2": fn(*mut CUdeviceptr, CUipcMemHandle, c_uint);
    ipc_close_mem_handle = "cuIpcCloseMemHandle": fn(CUdeviceptr);
    device_can_access_peer = "cuDeviceCanAccessPeer": fn(*mut c_int, CUdevice, CUdevice);
    device_p2p_attr = "cuDeviceGetP2PAttribute": fn(*mut c_int, c_int, CUdevice, CUdevice);
    mem_granularity = "cuMemGetAllocationGranularity": fn(*mut usize,
        *const CUmemAllocationProp, c_uint);
    mem_create = "cuMemCreate": fn(*mut u64, usize, *const CUmemAllocationProp, u64);
    mem_release = "cuMemRelease": fn(u64);
    mem_address_reserve = "cuMemAddressReserve": fn(*mut CUdeviceptr, usize, usize, CUdeviceptr,
        u64);
    mem_address_free = "cuMemAddressFree": fn(CUdeviceptr, usize);
    mem_map = "cuMemMap": fn(CUdeviceptr, usize, usize, u64, u64);
    mem_unmap = "cuMemUnmap": fn(CUdeviceptr, usize);
    mem_set_access = "cuMemSetAccess": fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize);
    mem_export = "cuMemExportToShareableHandle": fn(*mut c_void, u64, c_uint, u64);
    mem_import = "cuMemImportFromShareableHandle": fn(*mut u64, *mut c_void, c_uint);
    error_name = "cuGetErrorName": fn(CUresult, *mut *const c_char);
    error_string = "cuGetErrorString": fn(CUresult, *mut *const c_char);
}

static API: OnceCell<std::result::Result<Api, Error>> = OnceCell::new();

/// Uses `api` as the driver from now on (a stand-in that records calls, for tests of the CUDA
/// executor's host-side logic on machines without a GPU); false if a driver was loaded already.
#[doc(hidden)]
pub fn install(api: Api) -> bool {
    API.set(Ok(api)).is_ok()
}

/// Whether `libcuda.so.1` can be loaded at all (the executor choice probes this first).
pub fn present() -> bool {
    // SAFETY: loading libcuda runs its initialisers only.
    unsafe { libloading::Library::new("libcuda.so.1").is_ok() }
}

/// Whether the driver sees a device through its two oldest calls (`cuInit`,
/// `cuDeviceGetCount`), whatever else it lacks: then the process's own CUDA code has device
/// memory, even where the executor cannot use this driver. The library stays loaded (a driver
/// initialised here is not unloaded).
pub fn sees_devices() -> bool {
    type InitFn = unsafe extern "C" fn(c_uint) -> CUresult;
    type CountFn = unsafe extern "C" fn(*mut c_int) -> CUresult;
    // SAFETY: as in `present`.
    let Ok(lib) = (unsafe { libloading::Library::new("libcuda.so.1") }) else {
        return false;
    };
    // SAFETY: `cuInit(unsigned int)` and `cuDeviceGetCount(int*)` (cuda.h), in every driver.
    let calls = unsafe {
        (
            lib.get::<InitFn>(b"cuInit\0"),
            lib.get::<CountFn>(b"cuDeviceGetCount\0"),
        )
    };
    let (Ok(init), Ok(count)) = calls else {
        return false;
    };
    let mut n = 0;
    // SAFETY: flags 0; writes one int.
    let seen = unsafe { init(0) == CUDA_SUCCESS && count(&mut n) == CUDA_SUCCESS } && n > 0;
    std::mem::forget(lib);
    seen
}

/// The driver, loaded and initialised once (`cuInit`).
pub fn api() -> Result<&'static Api> {
    API.get_or_init(|| {
        // SAFETY: as in `present`.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }.map_err(|e| {
            Error::new(
                Code::UnhandledCudaError,
                format!(
                    "OXCCL_DEVICE=cuda, but the CUDA driver library libcuda.so.1 could not be \
                     loaded ({e}): is the NVIDIA driver installed?"
                ),
            )
        })?;
        let api = Api::load(lib)?;
        // SAFETY: cuInit takes flags 0.
        let r = unsafe { (api.init)(0) };
        if r != CUDA_SUCCESS {
            return Err(cuda_error(&api, r, "cuInit (initialising the CUDA driver)"));
        }
        Ok(api)
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn cuda_error(api: &Api, r: CUresult, what: &str) -> Error {
    let mut name: *const c_char = std::ptr::null();
    let mut desc: *const c_char = std::ptr::null();
    // SAFETY: both return pointers to static strings (or leave them null for unknown codes).
    unsafe {
        (api.error_name)(r, &mut name);
        (api.error_string)(r, &mut desc);
    }
    let s = |p: *const c_char| {
        if p.is_null() {
            "?".to_string()
        } else {
            // SAFETY: a NUL-terminated static string from the driver.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    Error::new(
        Code::UnhandledCudaError,
        format!("{what}: CUDA error {r} {} ({})", s(name), s(desc)),
    )
}

/// `r` as a result: an error names the CUDA error and `what` was being done.
pub fn check(r: CUresult, what: impl FnOnce() -> String) -> Result<()> {
    if r == CUDA_SUCCESS {
        return Ok(());
    }
    match api() {
        Ok(api) => Err(cuda_error(api, r, &what())),
        Err(e) => Err(e),
    }
}

/// The driver's version (e.g. 12040 for 12.4).
pub fn version() -> Result<i32> {
    let api = api()?;
    let mut v = 0;
    // SAFETY: writes one int.
    check(unsafe { (api.driver_version)(&mut v) }, || {
        "cuDriverGetVersion".into()
    })?;
    Ok(v)
}

/// The UUID of device number `ordinal` (a MIG instance's own where the device is one): the
/// GPU's identity across processes, whose device numbers may differ (`CUDA_VISIBLE_DEVICES`).
pub fn device_uuid(ordinal: c_int) -> Result<[u8; 16]> {
    let api = api()?;
    let mut dev: CUdevice = 0;
    // SAFETY: writes one device handle.
    check(unsafe { (api.device_get)(&mut dev, ordinal) }, || {
        format!("cuDeviceGet({ordinal})")
    })?;
    let mut u = [0u8; 16];
    // SAFETY: writes 16 bytes.
    check(unsafe { (api.device_uuid)(&mut u, dev) }, || {
        format!("cuDeviceGetUuid of device {ordinal}")
    })?;
    Ok(u)
}

/// Device `ordinal`'s PCI bus id as the driver spells it (None: the driver does not say).
pub fn pci_bus_id(ordinal: c_int) -> Result<Option<String>> {
    let api = api()?;
    let Some(f) = api.pci_bus_id else {
        return Ok(None);
    };
    let mut dev: CUdevice = 0;
    // SAFETY: writes one device handle.
    check(unsafe { (api.device_get)(&mut dev, ordinal) }, || {
        format!("cuDeviceGet({ordinal})")
    })?;
    let mut text = [0 as c_char; 32];
    // SAFETY: writes at most 32 bytes, NUL-terminated.
    check(unsafe { f(text.as_mut_ptr(), 32, dev) }, || {
        format!("cuDeviceGetPCIBusId of device {ordinal}")
    })?;
    text[31] = 0;
    // SAFETY: NUL-terminated above.
    let s = unsafe { CStr::from_ptr(text.as_ptr()) };
    Ok(Some(s.to_string_lossy().into_owned()))
}

pub fn device_count() -> Result<i32> {
    let api = api()?;
    let mut n = 0;
    // SAFETY: writes one int.
    check(unsafe { (api.device_count)(&mut n) }, || {
        "cuDeviceGetCount".into()
    })?;
    Ok(n)
}

pub fn attr(dev: CUdevice, a: c_int) -> Result<i32> {
    let api = api()?;
    let mut v = 0;
    // SAFETY: writes one int.
    check(unsafe { (api.device_attr)(&mut v, a, dev) }, || {
        format!("cuDeviceGetAttribute({a}) of device {dev}")
    })?;
    Ok(v)
}

/// The CUDA runtime's `cudaGetDevice`, where this process has loaded a runtime: in the
/// global scope (a program linked with it, PyTorch's global dependencies), else a
/// `libcudart` some library loaded on its own (found by name, never loaded here). With the
/// library to keep open where it was found by name.
fn runtime_get_device() -> Option<(RuntimeGetDeviceFn, Option<libloading::Library>)> {
    use libloading::os::unix::{Library, RTLD_NOW};
    const SYM: &[u8] = b"cudaGetDevice\0";
    // SAFETY: dlopen(NULL) loads nothing; the symbol, where there, is the runtime's
    // `cudaError_t cudaGetDevice(int*)`, and the program's scope stays loaded.
    if let Ok(f) = unsafe { Library::this().get::<RuntimeGetDeviceFn>(SYM) } {
        return Some((*f, None));
    }
    for name in [
        "libcudart.so.13",
        "libcudart.so.12",
        "libcudart.so.11.0",
        "libcudart.so",
    ] {
        // SAFETY: RTLD_NOLOAD opens only a library already loaded (no initialisers run); the
        // symbol is as above, valid while the handle is kept.
        let lib = match unsafe { Library::open(Some(name), RTLD_NOW | nix::libc::RTLD_NOLOAD) } {
            Ok(l) => l,
            Err(_) => continue,
        };
        // SAFETY: as above.
        if let Ok(f) = unsafe { lib.get::<RuntimeGetDeviceFn>(SYM) } {
            let f = *f;
            return Some((f, Some(lib.into())));
        }
    }
    None
}

/// The device the calling thread's current context belongs to (the CUDA runtime's current
/// device, as NCCL reads it with `cudaGetDevice`). A thread with no context yet (CUDA 11's
/// `cudaSetDevice` makes none; CUDA 12's does) asks the runtime, where the process has one;
/// else device 0 (the runtime's default).
pub fn current_device() -> Result<i32> {
    let api = api()?;
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: writes one pointer.
    check(unsafe { (api.ctx_get_current)(&mut ctx) }, || {
        "cuCtxGetCurrent".into()
    })?;
    if ctx.is_null() {
        let mut d = 0;
        // SAFETY: writes one int.
        return Ok(match api.runtime_device {
            Some(f) if unsafe { f(&mut d) } == 0 && d >= 0 => d,
            _ => 0,
        });
    }
    let mut d = 0;
    // SAFETY: writes one int.
    check(unsafe { (api.ctx_get_device)(&mut d) }, || {
        "cuCtxGetDevice".into()
    })?;
    Ok(d)
}

/// The primary context of `dev` (retained once, for the life of the process, as the runtime
/// does).
pub fn primary_context(dev: i32) -> Result<usize> {
    static RETAINED: parking_lot::Mutex<Vec<(i32, usize)>> = parking_lot::Mutex::new(Vec::new());
    if let Some(&(_, c)) = RETAINED.lock().iter().find(|(d, _)| *d == dev) {
        return Ok(c);
    }
    let c = retain_primary(dev)?;
    RETAINED.lock().push((dev, c));
    Ok(c)
}

fn retain_primary(dev: i32) -> Result<usize> {
    let api = api()?;
    let n = device_count()?;
    if dev < 0 || dev >= n {
        return Err(Error::invalid_argument(format!(
            "CUDA device {dev} does not exist (this machine has {n})"
        )));
    }
    let mut d: CUdevice = 0;
    // SAFETY: writes one int.
    check(unsafe { (api.device_get)(&mut d, dev) }, || {
        format!("cuDeviceGet({dev})")
    })?;
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: writes one pointer.
    check(unsafe { (api.primary_retain)(&mut ctx, d) }, || {
        format!("cuDevicePrimaryCtxRetain of device {dev}")
    })?;
    Ok(ctx as usize)
}

/// Makes `ctx` current on this thread until the guard drops (then the previous one is current
/// again): every call runs on its communicator's device, whatever the caller's current device.
pub struct CtxGuard {
    prev: CUcontext,
    changed: bool,
}

impl CtxGuard {
    /// `ctx`: a context handle (as `usize`: handles are opaque to us).
    pub fn enter(ctx: usize) -> Result<CtxGuard> {
        let ctx = ctx as CUcontext;
        let api = api()?;
        let mut prev: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        check(unsafe { (api.ctx_get_current)(&mut prev) }, || {
            "cuCtxGetCurrent".into()
        })?;
        if prev == ctx {
            return Ok(CtxGuard {
                prev,
                changed: false,
            });
        }
        // SAFETY: a context retained for the life of the process.
        check(unsafe { (api.ctx_set_current)(ctx) }, || {
            "cuCtxSetCurrent".into()
        })?;
        Ok(CtxGuard {
            prev,
            changed: true,
        })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if self.changed {
            if let Ok(api) = api() {
                // SAFETY: restores the context that was current (possibly none).
                unsafe { (api.ctx_set_current)(self.prev) };
            }
        }
    }
}

/// Whether `stream` is capturing a CUDA graph now.
pub fn capturing(stream: usize) -> Result<bool> {
    Ok(capture(stream)? != Capture::No)
}

/// What a stream captures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capture {
    No,
    /// A graph: its capture id, where the driver tells it (`Api::capture_info`).
    Graph(Option<u64>),
}

/// What `stream` captures now.
pub fn capture(stream: usize) -> Result<Capture> {
    capture_of(stream, false).map(|(cap, _)| cap)
}

/// The graph `stream` captures into now (None: it captures none, or the driver does not say:
/// `cuStreamGetCaptureInfo` before version 2).
pub fn capture_graph(stream: usize) -> Result<Option<CUgraph>> {
    let (cap, graph) = capture_of(stream, true)?;
    Ok((cap != Capture::No && !graph.is_null()).then_some(graph))
}

/// What `stream` captures now, and, where `graph` asks for it, the graph it captures into
/// (NULL where the driver does not say).
fn capture_of(stream: usize, graph: bool) -> Result<(Capture, CUgraph)> {
    let h = stream as CUstream;
    let api = api()?;
    let mut st = 0;
    let mut id = 0u64;
    let mut g: CUgraph = std::ptr::null_mut();
    let null = std::ptr::null_mut();
    let g_out = if graph {
        (&mut g as *mut CUgraph).cast()
    } else {
        null
    };
    let r = match api.capture_info {
        // SAFETY: writes the status, the id and, where asked, the graph (versions 2 and 3
        // take it fourth; version 1 ignores it, leaving it NULL); the dependencies are not
        // asked for (NULL); the stream is the caller's.
        Some(f) => unsafe { f(h, &mut st, &mut id, g_out, null, null, null) },
        // SAFETY: writes one int; the stream is the caller's.
        None => unsafe { (api.stream_is_capturing)(h, &mut st) },
    };
    if r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT {
        return Err(Error::invalid_usage(format!(
            "the NULL stream (CUDA's legacy default stream, {h:p}) was given while another \
             stream of this device captures a CUDA graph: CUDA forbids the legacy stream then \
             (give a stream of your own, or capture it)"
        )));
    }
    check(r, || format!("cuStreamGetCaptureInfo on stream {h:p}"))?;
    let cap = match st {
        CU_STREAM_CAPTURE_STATUS_NONE => Capture::No,
        _ => Capture::Graph(api.capture_info.map(|_| id)),
    };
    Ok((cap, g))
}

/// Readies a thread of the library's own that queries the driver in the background (a proxy
/// thread): `ctx` current for good, and its capture mode relaxed for good, so that its calls
/// (event queries) are legal while another thread's stream captures a graph in global mode
/// (PyTorch's default), which they would otherwise spoil.
pub fn background_thread(ctx: usize) -> Result<()> {
    let api = api()?;
    let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: sets this thread's mode; the thread is ours and keeps it.
    check(unsafe { (api.exchange_capture_mode)(&mut mode) }, || {
        "cuThreadExchangeStreamCaptureMode".into()
    })?;
    // SAFETY: a context retained for the life of the process.
    check(unsafe { (api.ctx_set_current)(ctx as CUcontext) }, || {
        "cuCtxSetCurrent".into()
    })
}

/// Runs `f` with this thread's capture mode relaxed: setup calls (allocations, host memory
/// registration) are legal even while a caller's stream captures a graph.
pub fn relaxed<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let api = api()?;
    let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: swaps the thread's mode; restored when `_restore` goes.
    check(unsafe { (api.exchange_capture_mode)(&mut mode) }, || {
        "cuThreadExchangeStreamCaptureMode".into()
    })?;
    // The previous mode goes back also if `f` panics (the panic is caught at the C boundary;
    // the caller's thread must not stay relaxed, which would let its later captures hold
    // what CUDA refuses in them).
    struct Restore(&'static Api, c_int);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: puts the previous mode back.
            unsafe { (self.0.exchange_capture_mode)(&mut self.1) };
        }
    }
    let _restore = Restore(api, mode);
    f()
}
