//! Per-communicator tables: user-created PreMulSum operators and registered buffers.

use crate::error::{Error, Result};
use crate::types::ScalarArg;
use crate::types::{DataType, NUM_BUILTIN_OPS};
use parking_lot::Mutex;
use std::collections::HashMap;

/// PreMulSum operators: `ncclRedOp_t` values from `NUM_BUILTIN_OPS` up, each naming its
/// communicator as well as its slot: `NUM_BUILTIN_OPS + (tag << SLOT_BITS | slot)`, with a tag
/// (1..=`TAGS`) that differs between the communicators of a process (the first `TAGS` of them;
/// NCCL likewise mixes the communicator into its values). An operator used on another
/// communicator is then refused rather than taken for whichever operator has its slot there.
pub struct RedOps {
    tag: i32,
    ops: Mutex<Vec<Option<(DataType, ScalarArg)>>>,
}

const SLOT_BITS: u32 = 20;
const SLOTS: usize = 1 << SLOT_BITS;
/// Tags fit below `i32::MAX` with every slot: `NUM_BUILTIN_OPS + (TAGS << 20 | SLOTS - 1)`.
const TAGS: i32 = 2046;

impl Default for RedOps {
    fn default() -> RedOps {
        use std::sync::atomic::{AtomicU32, Ordering};
        static MADE: AtomicU32 = AtomicU32::new(0);
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        RedOps {
            tag: 1 + (n % TAGS as u32) as i32,
            ops: Mutex::default(),
        }
    }
}

impl RedOps {
    pub fn create(&self, dtype: DataType, scalar: ScalarArg) -> Result<i32> {
        let mut ops = self.ops.lock();
        let slot = match ops.iter().position(Option::is_none) {
            Some(i) => {
                ops[i] = Some((dtype, scalar));
                i
            }
            None if ops.len() < SLOTS => {
                ops.push(Some((dtype, scalar)));
                ops.len() - 1
            }
            None => {
                return Err(Error::invalid_usage(format!(
                    "ncclRedOpCreatePreMulSum: {SLOTS} operators live on this communicator \
                     already: destroy some with ncclRedOpDestroy"
                )))
            }
        };
        Ok(NUM_BUILTIN_OPS + (self.tag << SLOT_BITS | slot as i32))
    }

    pub fn destroy(&self, op: i32) -> Result<()> {
        if (0..NUM_BUILTIN_OPS).contains(&op) {
            return Err(Error::invalid_argument(format!(
                "ncclRedOpDestroy: operator {op} is builtin, not created by ncclRedOpCreate*"
            )));
        }
        // (Looked up and freed under one lock: two destroys of one operator cannot free a slot
        // that a create took between them.)
        let mut ops = self.ops.lock();
        let slot = self.slot(&ops, op).map_err(|why| {
            Error::invalid_argument(format!("ncclRedOpDestroy: operator {op} {why}"))
        })?;
        ops[slot] = None;
        Ok(())
    }

    /// The operator `op` (`op >= NUM_BUILTIN_OPS`), or why there is none here.
    pub fn get(&self, op: i32) -> std::result::Result<(DataType, ScalarArg), &'static str> {
        let ops = self.ops.lock();
        let slot = self.slot(&ops, op)?;
        ops[slot].ok_or(GONE)
    }

    /// The live slot `op` names on this communicator (`ops`: its table, locked).
    fn slot(
        &self,
        ops: &[Option<(DataType, ScalarArg)>],
        op: i32,
    ) -> std::result::Result<usize, &'static str> {
        let v = op
            .checked_sub(NUM_BUILTIN_OPS)
            .filter(|v| *v >= 0)
            .ok_or(GONE)?;
        let slot = (v as usize) & (SLOTS - 1);
        match v >> SLOT_BITS {
            t if t == self.tag => match ops.get(slot) {
                Some(Some(_)) => Ok(slot),
                _ => Err(GONE),
            },
            t if (1..=TAGS).contains(&t) => Err(
                "was created on another communicator (an operator belongs to the communicator \
                 that ncclRedOpCreatePreMulSum was given)",
            ),
            _ => Err("was not created by ncclRedOpCreatePreMulSum"),
        }
    }
}

const GONE: &str = "was not created on this communicator, or is destroyed";

/// Buffers registered with `ncclCommRegister`: the host executor needs no pinning, but handles
/// are real and checked; the CUDA executor lets kernels of other processes on the GPU read
/// them where they are (`transport::registered`), until they are deregistered or the
/// communicator's executor ends (`CudaComm`'s drop).
pub struct Registry {
    regs: Mutex<HashMap<usize, (usize, usize)>>,
    next: Mutex<usize>,
    /// The registry's number among the process's (what `registered` knows it by).
    id: u64,
}

impl Default for Registry {
    fn default() -> Registry {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Registry {
            regs: Mutex::default(),
            next: Mutex::default(),
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }
}

/// Whether registrations are the CUDA executor's.
fn on_cuda() -> bool {
    crate::exec::kind() == crate::exec::Kind::Cuda
}

impl Registry {
    /// Its number among the process's registries.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn register(&self, buf: usize, size: usize) -> Result<usize> {
        let mut n = self.next.lock();
        *n += 1;
        let h = *n;
        self.regs.lock().insert(h, (buf, size));
        if on_cuda() {
            crate::transport::registered::register(self.id, h, buf, size);
        }
        Ok(h)
    }

    pub fn deregister(&self, h: usize) -> Result<()> {
        self.regs.lock().remove(&h).ok_or_else(|| {
            Error::invalid_argument(format!("ncclCommDeregister: unknown handle {h:#x}"))
        })?;
        if on_cuda() {
            crate::transport::registered::deregister(self.id, Some(h));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest value fits an `ncclRedOp_t` below `ncclMaxRedOp` (`i32::MAX`); values name
    /// their communicator, and a slot freed is used again under the same value.
    #[test]
    fn operator_values_name_their_communicator() {
        let top = i64::from(NUM_BUILTIN_OPS) + (i64::from(TAGS) << SLOT_BITS) + SLOTS as i64 - 1;
        assert!(top <= i64::from(i32::MAX), "{top}");
        let s = ScalarArg::Host(crate::types::Scalar { bits: 0 });
        let (a, b) = (RedOps::default(), RedOps::default());
        let a0 = a.create(DataType::Float32, s).unwrap();
        let a1 = a.create(DataType::Float64, s).unwrap();
        let b0 = b.create(DataType::Float32, s).unwrap();
        assert!(a0 >= NUM_BUILTIN_OPS && a1 == a0 + 1 && b0 != a0);
        assert!(a.get(a1).is_ok_and(|(d, _)| d == DataType::Float64));
        assert!(b.get(a0).unwrap_err().contains("another communicator"));
        assert!(a.get(b0).unwrap_err().contains("another communicator"));
        assert!(a
            .get(NUM_BUILTIN_OPS + 99)
            .unwrap_err()
            .contains("not created by"));
        assert!(a.get(a1 + 1).unwrap_err().contains("destroyed"));
        a.destroy(a0).unwrap();
        assert!(a.get(a0).unwrap_err().contains("destroyed"));
        assert!(a.destroy(a0).is_err());
        assert_eq!(a.create(DataType::Float32, s).unwrap(), a0);
    }
}
