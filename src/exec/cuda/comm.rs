//! The CUDA executor's per-communicator state: none can be built yet (the type has no values,
//! so every use of one is statically unreachable).

use crate::error::Result;
use crate::exec::CommSetup;

pub enum CudaComm {}

impl CudaComm {
    pub fn init(_s: CommSetup<'_>) -> Result<CudaComm> {
        Err(super::missing())
    }
}
