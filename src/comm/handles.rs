//! C handles of communicators: the address of the `Comm`, valid while registered. Lookups never
//! dereference an unknown pointer, so destroyed or foreign handles are reported, not followed.

use super::Comm;
use crate::error::{Error, Result};
use crate::registry::{Recent, Registry};
use std::sync::Arc;

static LIVE: Registry<Comm> = Registry::new();
thread_local! {
    static RECENT: Recent<Comm> = const { Recent::new() };
}

pub fn register(c: &Arc<Comm>) -> usize {
    LIVE.insert(c)
}

/// Every call goes through here: inline across codegen units (which unit it lands in shifts
/// as the crate changes, and a call it cannot inline cost each launch about 20 instructions).
#[inline]
pub fn lookup(h: usize) -> Result<Arc<Comm>> {
    if h == 0 {
        return Err(Error::invalid_argument("communicator is NULL"));
    }
    LIVE.get_via(&RECENT, h).ok_or_else(|| {
        Error::invalid_argument(format!(
            "invalid communicator {h:#x} (destroyed, or not created by ncclCommInit*)"
        ))
    })
}

pub fn unregister(h: usize) -> Result<Arc<Comm>> {
    let c = lookup(h)?;
    LIVE.remove(h);
    Ok(c)
}
