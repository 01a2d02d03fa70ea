//! Group calls.

use super::entry;
use super::types::*;
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

/// The estimate of a group whose time is not estimated (NCCL's value where it cannot).
const NOT_ESTIMATED: f32 = -1000.0;

#[no_mangle]
pub unsafe extern "C" fn ncclGroupSimulateEnd(simInfo: *mut ncclSimInfo_t) -> ncclResult_t {
    entry!("ncclGroupSimulateEnd", {
        // Outside a group: that error first, as NCCL's.
        if api::group_depth() == 0 {
            return api::group_simulate_end().map(|_| ());
        }
        // No simInfo: nothing to estimate into, a plain ncclGroupEnd (as NCCL's).
        if simInfo.is_null() {
            return api::group_end();
        }
        // SAFETY: non-null; size, magic and version lead the struct.
        let magic = unsafe { (*simInfo).magic };
        // The level is closed whatever the magic says (its calls not launched): else the
        // thread's later calls would queue into a group nobody ends.
        let closed = api::group_simulate_end();
        if magic != SIM_INFO_MAGIC {
            return Err(Error::invalid_argument(format!(
                "simInfo magic {magic:#x} is wrong: initialize it with NCCL_SIM_INFO_INITIALIZER \
                 (the group is closed, its calls were not launched)"
            )));
        }
        // No calls: no time. Calls: oxccl does not estimate their time yet, and says so as
        // NCCL does where it cannot: -1000 (PyTorch's inductor then uses its own model).
        let time = if closed? { NOT_ESTIMATED } else { 0.0 };
        // SAFETY: non-null, checked above.
        unsafe { (*simInfo).estimatedTime = time };
        Ok(())
    })
}
