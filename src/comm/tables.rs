//! Per-communicator tables: user-created PreMulSum operators and registered buffers.

use crate::error::{Error, Result};
use crate::types::ScalarArg;
use crate::types::{DataType, NUM_BUILTIN_OPS};
use parking_lot::Mutex;
use std::collections::HashMap;

/// PreMulSum operators: `ncclRedOp_t` values from `NUM_BUILTIN_OPS` up.
#[derive(Default)]
pub struct RedOps {
    ops: Mutex<Vec<Option<(DataType, ScalarArg)>>>,
}

impl RedOps {
    pub fn create(&self, dtype: DataType, scalar: ScalarArg) -> Result<i32> {
        let mut ops = self.ops.lock();
        let idx = match ops.iter().position(Option::is_none) {
            Some(i) => {
                ops[i] = Some((dtype, scalar));
                i
            }
            None => {
                ops.push(Some((dtype, scalar)));
                ops.len() - 1
            }
        };
        Ok(NUM_BUILTIN_OPS + idx as i32)
    }

    pub fn destroy(&self, op: i32) -> Result<()> {
        if (0..NUM_BUILTIN_OPS).contains(&op) {
            return Err(Error::invalid_argument(format!(
                "ncclRedOpDestroy: operator {op} is builtin, not created by ncclRedOpCreate*"
            )));
        }
        let mut ops = self.ops.lock();
        match usize::try_from(op - NUM_BUILTIN_OPS).ok().and_then(|i| ops.get_mut(i)) {
            Some(slot @ Some(_)) => {
                *slot = None;
                Ok(())
            }
            _ => Err(Error::invalid_argument(format!(
                "ncclRedOpDestroy: operator {op} was not created on this communicator (or is already destroyed)"
            ))),
        }
    }

    pub fn get(&self, op: i32) -> Option<(DataType, ScalarArg)> {
        let i = usize::try_from(op - NUM_BUILTIN_OPS).ok()?;
        self.ops.lock().get(i).copied().flatten()
    }
}

/// Buffers registered with `ncclCommRegister`; the host executor needs no pinning, but handles
/// are real and checked.
#[derive(Default)]
pub struct Registry {
    regs: Mutex<HashMap<usize, (usize, usize)>>,
    next: Mutex<usize>,
}

impl Registry {
    pub fn register(&self, buf: usize, size: usize) -> Result<usize> {
        let mut n = self.next.lock();
        *n += 1;
        let h = *n;
        self.regs.lock().insert(h, (buf, size));
        Ok(h)
    }

    pub fn deregister(&self, h: usize) -> Result<()> {
        self.regs.lock().remove(&h).map(|_| ()).ok_or_else(|| {
            Error::invalid_argument(format!("ncclCommDeregister: unknown handle {h:#x}"))
        })
    }
}
