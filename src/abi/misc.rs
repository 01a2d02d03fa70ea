//! Version, unique ids, error strings, memory, reduction operators, encryption, parameters.

use super::types::*;
use super::{buffer, comm_arg, entry, non_null, run_value};
use crate::api::{self, ScalarArg};
use crate::error::{Error, Result};
use crate::types::{DataType, Scalar, NUM_BUILTIN_OPS};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};

#[no_mangle]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    entry!("ncclMemAlloc", {
        non_null(ptr, "ptr")?;
        let p = api::mem_alloc(size)?;
        // SAFETY: `ptr` is non-null and the caller gives a writable `void*`.
        unsafe { ptr.write(p as *mut c_void) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    entry!("ncclMemFree", { api::mem_free(ptr as usize) })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    entry!("ncclGetVersion", {
        non_null(version, "version")?;
        // SAFETY: non-null out-parameter owned by the caller.
        unsafe { version.write(api::version()) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(uniqueId: *mut ncclUniqueId) -> ncclResult_t {
    entry!("ncclGetUniqueId", {
        non_null(uniqueId, "uniqueId")?;
        let bytes = api::get_unique_id()?;
        // SAFETY: non-null out-parameter of NCCL_UNIQUE_ID_BYTES bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), uniqueId as *mut u8, bytes.len()) };
        Ok(())
    })
}

/// NCCL's string for each result code (static storage).
#[no_mangle]
pub unsafe extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    static STRINGS: once_cell::sync::Lazy<Vec<CString>> = once_cell::sync::Lazy::new(|| {
        (0..=9)
            .map(|c| CString::new(crate::error::error_string(c)).unwrap_or_default())
            .collect()
    });
    run_value("ncclGetErrorString", std::ptr::null(), || {
        let idx = if (0..9).contains(&result.0) {
            result.0 as usize
        } else {
            9
        };
        Ok(STRINGS[idx].as_ptr())
    })
}

thread_local! {
    /// The text last handed out by `ncclGetLastError` on this thread: the pointer stays valid
    /// until this thread calls it again and the message has changed.
    static LAST_ERROR_C: RefCell<CString> = RefCell::new(CString::default());
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    // NCCL falls back to the process-wide message; oxccl keeps only that one.
    let _ = comm;
    run_value("ncclGetLastError", std::ptr::null(), || {
        let msg = crate::error::last_error().replace('\0', " ");
        Ok(LAST_ERROR_C.with(|c| {
            let mut c = c.borrow_mut();
            if c.as_bytes() != msg.as_bytes() {
                *c = CString::new(msg).unwrap_or_default();
            }
            c.as_ptr()
        }))
    })
}

/// Deprecated NCCL entry point: reloads the logging settings.
#[no_mangle]
pub unsafe extern "C" fn ncclResetDebugInit() {
    run_value("ncclResetDebugInit", (), || {
        api::not_yet("ncclResetDebugInit (reloading NCCL_DEBUG)")
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut ncclRedOp_t,
    scalar: *mut c_void,
    datatype: ncclDataType_t,
    residence: ncclScalarResidence_t,
    comm: ncclComm_t,
) -> ncclResult_t {
    entry!("ncclRedOpCreatePreMulSum", {
        non_null(op, "op")?;
        non_null(scalar, "scalar")?;
        let dtype = DataType::from_raw(datatype.0)?;
        let scalar = match residence.0 {
            0 => ScalarArg::Device(scalar as usize),
            1 => {
                let mut bytes = [0u8; 8];
                // SAFETY: a host-immediate scalar is one element of `datatype` at `scalar`.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        scalar as *const u8,
                        bytes.as_mut_ptr(),
                        dtype.size(),
                    )
                };
                ScalarArg::Host(Scalar {
                    bits: u64::from_le_bytes(bytes),
                })
            }
            r => {
                return Err(Error::invalid_argument(format!(
                    "invalid scalar residence {r} (ncclScalarDevice=0, ncclScalarHostImmediate=1)"
                )))
            }
        };
        let comm = comm_arg(comm)?;
        let created = api::redop_create_premulsum(&comm, dtype, scalar)?;
        // SAFETY: non-null out-parameter.
        unsafe { op.write(ncclRedOp_t(created)) };
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclRedOpDestroy(op: ncclRedOp_t, comm: ncclComm_t) -> ncclResult_t {
    entry!("ncclRedOpDestroy", {
        if op.0 < NUM_BUILTIN_OPS {
            return Err(Error::invalid_argument(format!(
                "operator {} is a builtin or invalid operator and cannot be destroyed",
                op.0
            )));
        }
        let comm = comm_arg(comm)?;
        api::redop_destroy(&comm, op.0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclSetEncryption(config: *const ncclEncryptionConfig_t) -> ncclResult_t {
    entry!("ncclSetEncryption", {
        non_null(config, "config")?;
        // SAFETY: non-null; `size`, `magic` and `version` lead every NCCL config struct.
        let (size, magic) = unsafe { ((*config).size, (*config).magic) };
        if magic != API_MAGIC {
            return Err(Error::invalid_argument(format!(
                "config magic {magic:#x} is not NCCL_API_MAGIC: initialize it with NCCL_ENCRYPTION_CONFIG_INITIALIZER"
            )));
        }
        let mut cfg = ncclEncryptionConfig_t {
            size,
            magic,
            version: 0,
            mode: 0,
            psk: std::ptr::null(),
        };
        let n = size.min(std::mem::size_of::<ncclEncryptionConfig_t>());
        // SAFETY: the caller's struct is `size` bytes long; we copy at most that many.
        unsafe {
            std::ptr::copy_nonoverlapping(config as *const u8, &mut cfg as *mut _ as *mut u8, n)
        };
        match cfg.mode {
            0 => {}
            1 => buffer(cfg.psk as *const c_void, 1, "config->psk")?,
            m => {
                return Err(Error::invalid_argument(format!(
                    "invalid encryption mode {m}"
                )))
            }
        }
        api::not_yet("ncclSetEncryption (TLS-PSK sockets)")
    })
}

// ---- parameter access ----

fn key_arg(key: *const c_char) -> Result<String> {
    non_null(key, "key")?;
    // SAFETY: a non-null C string from the caller.
    Ok(unsafe { CStr::from_ptr(key) }
        .to_string_lossy()
        .into_owned())
}

fn handle_arg(h: ncclParamHandle_t) -> Result<()> {
    non_null(h, "parameter handle")
}

const PARAMS: &str = "the ncclParam* API";

#[no_mangle]
pub unsafe extern "C" fn ncclParamBind(
    out: *mut ncclParamHandle_t,
    key: *const c_char,
) -> ncclResult_t {
    entry!("ncclParamBind", {
        non_null(out, "out")?;
        let _key = key_arg(key)?;
        api::not_yet(PARAMS)
    })
}

fn param_get_typed(h: ncclParamHandle_t, out: *const c_void) -> Result<()> {
    handle_arg(h)?;
    non_null(out, "out")?;
    api::not_yet(PARAMS)
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetI8(h: ncclParamHandle_t, out: *mut i8) -> ncclResult_t {
    entry!("ncclParamGetI8", {
        param_get_typed(h, out as *const c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetI16(h: ncclParamHandle_t, out: *mut i16) -> ncclResult_t {
    entry!("ncclParamGetI16", {
        param_get_typed(h, out as *const c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetI32(h: ncclParamHandle_t, out: *mut i32) -> ncclResult_t {
    entry!("ncclParamGetI32", {
        param_get_typed(h, out as *const c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetI64(h: ncclParamHandle_t, out: *mut i64) -> ncclResult_t {
    entry!("ncclParamGetI64", {
        param_get_typed(h, out as *const c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetU8(h: ncclParamHandle_t, out: *mut u8) -> ncclResult_t {
    entry!("ncclParamGetU8", {
        param_get_typed(h, out as *const c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetU16(h: ncclParamHandle_t, out: *mut u16) -> ncclResult_t {
    entry!("ncclParamGetU16", {
        param_get_typed(h, out as *const c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetU32(h: ncclParamHandle_t, out: *mut u32) -> ncclResult_t {
    entry!("ncclParamGetU32", {
        param_get_typed(h, out as *const c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetU64(h: ncclParamHandle_t, out: *mut u64) -> ncclResult_t {
    entry!("ncclParamGetU64", {
        param_get_typed(h, out as *const c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetStr(
    h: ncclParamHandle_t,
    out: *mut *const c_char,
) -> ncclResult_t {
    entry!("ncclParamGetStr", {
        handle_arg(h)?;
        non_null(out, "out")?;
        api::not_yet(PARAMS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGet(
    h: ncclParamHandle_t,
    out: *mut c_void,
    maxLen: c_int,
    len: *mut c_int,
) -> ncclResult_t {
    entry!("ncclParamGet", {
        handle_arg(h)?;
        if maxLen < 0 {
            return Err(Error::invalid_argument(format!("maxLen {maxLen} < 0")));
        }
        buffer(out, maxLen as usize, "out")?;
        non_null(len, "len")?;
        api::not_yet(PARAMS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetParameter(
    key: *const c_char,
    value: *mut *const c_char,
    valueLen: *mut c_int,
) -> ncclResult_t {
    entry!("ncclParamGetParameter", {
        let _key = key_arg(key)?;
        non_null(value, "value")?;
        non_null(valueLen, "valueLen")?;
        api::not_yet(PARAMS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamGetAllParameterKeys(
    table: *mut *mut *const c_char,
    tableLen: *mut c_int,
) -> ncclResult_t {
    entry!("ncclParamGetAllParameterKeys", {
        non_null(table, "table")?;
        non_null(tableLen, "tableLen")?;
        api::not_yet(PARAMS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclParamDumpAll() {
    run_value("ncclParamDumpAll", (), || api::not_yet(PARAMS))
}
