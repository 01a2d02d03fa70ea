//! C handles of communicators: the address of the `Comm`, valid while registered. Lookups never
//! dereference an unknown pointer, so destroyed or foreign handles are reported, not followed.

use super::Comm;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

static LIVE: Mutex<Option<HashMap<usize, Arc<Comm>>>> = Mutex::new(None);

pub fn register(c: &Arc<Comm>) -> usize {
    let h = Arc::as_ptr(c) as usize;
    LIVE.lock()
        .get_or_insert_with(HashMap::new)
        .insert(h, c.clone());
    h
}

pub fn lookup(h: usize) -> Result<Arc<Comm>> {
    if h == 0 {
        return Err(Error::invalid_argument("communicator is NULL"));
    }
    LIVE.lock()
        .as_ref()
        .and_then(|m| m.get(&h).cloned())
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "invalid communicator {h:#x} (destroyed, or not created by ncclCommInit*)"
            ))
        })
}

pub fn unregister(h: usize) -> Result<Arc<Comm>> {
    let c = lookup(h)?;
    if let Some(m) = LIVE.lock().as_mut() {
        m.remove(&h);
    }
    Ok(c)
}
