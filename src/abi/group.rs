//! Group calls.

use super::types::*;
use super::{entry, non_null};
use crate::api;
use crate::error::Error;

#[no_mangle]
pub unsafe extern "C" fn ncclGroupStart() -> ncclResult_t {
    entry!("ncclGroupStart", { api::group_start() })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGroupEnd() -> ncclResult_t {
    entry!("ncclGroupEnd", { api::group_end() })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGroupSimulateEnd(simInfo: *mut ncclSimInfo_t) -> ncclResult_t {
    entry!("ncclGroupSimulateEnd", {
        non_null(simInfo, "simInfo")?;
        // SAFETY: non-null; size, magic and version lead the struct.
        let magic = unsafe { (*simInfo).magic };
        if magic != SIM_INFO_MAGIC {
            return Err(Error::invalid_argument(format!(
                "simInfo magic {magic:#x} is wrong: initialize it with NCCL_SIM_INFO_INITIALIZER"
            )));
        }
        api::group_simulate_end()?;
        // (A group with no calls: no time.)
        // SAFETY: non-null, checked above.
        unsafe { (*simInfo).estimatedTime = 0.0 };
        Ok(())
    })
}
