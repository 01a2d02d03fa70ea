//! Unique ids and the TCP rendezvous between the ranks of a communicator.
//! (Interface stub: the real implementation replaces the bodies.)

use crate::error::{Error, Result};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

pub const ID_BYTES: usize = 128;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UniqueId {
    bytes: [u8; ID_BYTES],
}

impl UniqueId {
    /// Starts the root's listener for this id and returns the self-contained id.
    pub fn generate() -> Result<UniqueId> {
        Err(Error::not_yet("bootstrap"))
    }
    pub fn from_bytes(b: &[u8; ID_BYTES]) -> Result<UniqueId> {
        Ok(UniqueId { bytes: *b })
    }
    pub fn to_bytes(&self) -> [u8; ID_BYTES] {
        self.bytes
    }
}

/// Out-of-band channel between the ranks of one communicator.
pub struct Bootstrap {
    rank: usize,
    nranks: usize,
}

impl Bootstrap {
    /// Rendezvous through the root(s) of `ids`; every wait watches `abort` and the timeout.
    pub fn init(
        _ids: &[UniqueId],
        rank: usize,
        nranks: usize,
        _abort: Arc<AtomicBool>,
    ) -> Result<Bootstrap> {
        let _ = (rank, nranks);
        Err(Error::not_yet("bootstrap"))
    }
    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn nranks(&self) -> usize {
        self.nranks
    }
    /// 64-bit identity of the communicator (same on every rank, random per unique id).
    pub fn comm_hash(&self) -> u64 {
        0
    }
    /// Every rank's `mine`, indexed by rank (sizes may differ).
    pub fn allgather(&self, _mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Err(Error::not_yet("bootstrap"))
    }
    pub fn barrier(&self) -> Result<()> {
        Err(Error::not_yet("bootstrap"))
    }
    pub fn send(&self, _peer: usize, _tag: u32, _data: &[u8]) -> Result<()> {
        Err(Error::not_yet("bootstrap"))
    }
    pub fn recv(&self, _peer: usize, _tag: u32) -> Result<Vec<u8>> {
        Err(Error::not_yet("bootstrap"))
    }
}
