//! Cross-memory attach: reading and writing another process's memory with one kernel copy
//! (`process_vm_readv` / `process_vm_writev`). Direct algorithms use it for buffers of ranks in
//! other processes that cannot be mapped (ordinary `malloc` memory), where the alternative is a
//! copy into a shared FIFO and another out of it. The kernel allows it between processes of one
//! user unless ptrace is restricted (Yama, seccomp, containers). With `OXCCL_CMA=1` (see
//! `param::cma_enabled` for why it is off by default), communicators probe it at init and use it
//! only when every rank can reach every other.

use crate::error::{Error, Result};
use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;
use std::io::{IoSlice, IoSliceMut};

/// A word every process holds at a known address, for peers to try reading at init.
static PROBE: u64 = 0x6f78_6363_6c5f_636d;

/// This process's probe address, to publish.
pub fn probe_addr() -> u64 {
    &PROBE as *const u64 as u64
}

/// Whether this process can read `pid`'s memory (its probe word at `addr`).
pub fn can_reach(pid: u32, addr: u64) -> bool {
    if addr == 0 {
        return false;
    }
    let mut word = [0u8; 8];
    // SAFETY: `word` is valid for 8 bytes.
    match unsafe { read(pid, addr as usize, word.as_mut_ptr(), 8) } {
        Ok(()) => u64::from_ne_bytes(word) == PROBE,
        Err(_) => false,
    }
}

fn os(what: &str, pid: u32, e: nix::Error) -> Error {
    Error::system(format!(
        "{what} of process {pid}'s memory failed: {e} (unset OXCCL_CMA to avoid cross-memory attach)"
    ))
}

/// Moves `len` bytes in turns of `step(done)` (a system call that moves what it can of the
/// bytes from offset `done` on, and says how many) until all are moved.
fn whole(
    pid: u32,
    what: &str,
    len: usize,
    mut step: impl FnMut(usize) -> nix::Result<usize>,
) -> Result<()> {
    let mut done = 0;
    while done < len {
        let n = step(done).map_err(|e| os(what, pid, e))?;
        if n == 0 {
            return Err(Error::system(format!(
                "{what} process {pid}'s memory made no progress"
            )));
        }
        done += n;
    }
    Ok(())
}

/// Copies `len` bytes at `remote` in process `pid` to `local`.
///
/// # Safety
/// `local` is valid for writing `len` bytes.
pub unsafe fn read(pid: u32, remote: usize, local: *mut u8, len: usize) -> Result<()> {
    whole(pid, "reading", len, |done| {
        // SAFETY: per the contract.
        let buf = unsafe { std::slice::from_raw_parts_mut(local.add(done), len - done) };
        let r = RemoteIoVec {
            base: remote + done,
            len: len - done,
        };
        process_vm_readv(Pid::from_raw(pid as i32), &mut [IoSliceMut::new(buf)], &[r])
    })
}

/// Copies `len` bytes from `local` to `remote` in process `pid`.
///
/// # Safety
/// `local` is valid for reading `len` bytes.
pub unsafe fn write(pid: u32, remote: usize, local: *const u8, len: usize) -> Result<()> {
    whole(pid, "writing", len, |done| {
        // SAFETY: per the contract.
        let buf = unsafe { std::slice::from_raw_parts(local.add(done), len - done) };
        let r = RemoteIoVec {
            base: remote + done,
            len: len - done,
        };
        process_vm_writev(Pid::from_raw(pid as i32), &[IoSlice::new(buf)], &[r])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_round_trip() {
        let me = std::process::id();
        assert!(can_reach(me, probe_addr()));
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        // SAFETY: both valid for their lengths.
        unsafe { read(me, src.as_ptr() as usize, dst.as_mut_ptr(), src.len()).unwrap() };
        assert_eq!(src, dst);
        let mut back = vec![0u8; src.len()];
        // SAFETY: as above.
        unsafe { write(me, back.as_mut_ptr() as usize, src.as_ptr(), src.len()).unwrap() };
        assert_eq!(src, back);
        let mut w = [0u8; 8];
        // SAFETY: `w` holds 8 bytes; the remote address is unmapped, which must be an error.
        assert!(unsafe { read(me, 8, w.as_mut_ptr(), 8) }.is_err());
    }
}
