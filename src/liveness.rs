//! Whether a peer's process on this host still runs, so that a wait for a dead peer ends in an
//! error rather than a hang.
//!
//! A peer in this process's PID namespace is asked by its pid (`/proc/<pid>/stat`). A peer in
//! another PID namespace (a container that shares this host's hostname and /dev/shm but not
//! its pids) has a pid that names nothing here, or another process: such a process instead
//! holds an exclusive lock on a file of its own in /dev/shm (`oxccl-alive-<key>`) while it has
//! communicators with peers of other namespaces, and the kernel releases the lock when the
//! process ends, however it ends. A peer that finds the lock free knows the process is gone
//! and removes its file.

use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::os::fd::AsRawFd;

/// The PID namespace of this process (the inode of `/proc/self/ns/pid`, 0 if unknown).
pub fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// A process's key among the processes of one host: its pid, with its PID namespace in the
/// high bits, so that processes of different namespaces (containers, where each rank may be
/// PID 1) never share a key.
pub fn process_key(pid: u32, pidns: u64) -> u64 {
    (((pidns ^ (pidns >> 32)) & 0xffff_ffff) << 32) | u64::from(pid)
}

/// This process's key (`process_key`).
pub fn my_process_key() -> u64 {
    static KEY: once_cell::sync::Lazy<u64> =
        once_cell::sync::Lazy::new(|| process_key(std::process::id(), pid_namespace()));
    *KEY
}

/// The pid by which this process reaches the process of `key` (its /proc entry, its memory
/// by cross-memory attach): where both are in one PID namespace.
pub fn pid_of_key(key: u64) -> Option<u32> {
    (key >> 32 == my_process_key() >> 32).then_some(key as u32)
}

/// How this process asks whether a peer process of this host runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// Its pid in this PID namespace.
    Pid(u32),
    /// Its process key (`my_process_key` in that process): its lock file.
    Lock(u64),
}

impl Probe {
    pub fn alive(self) -> bool {
        match self {
            Probe::Pid(pid) => process_alive(pid),
            Probe::Lock(key) => lock_alive(key),
        }
    }
}

/// Whether process `pid` (of this PID namespace) runs: a zombie has died, its parent has not
/// collected it yet.
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        // "pid (comm) S ...": the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|st| st != 'Z' && st != 'X'),
    }
}

fn lock_path(key: u64) -> String {
    format!("/dev/shm/oxccl-alive-{key:016x}")
}

/// `flock(fd, how | LOCK_NB)`: Ok(true) when taken, Ok(false) when another holds it.
fn try_flock(f: &std::fs::File, how: i32) -> std::io::Result<bool> {
    // SAFETY: a valid descriptor of `f`; flock takes no pointers.
    if unsafe { nix::libc::flock(f.as_raw_fd(), how | nix::libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(nix::libc::EWOULDBLOCK) => Ok(false),
        _ => Err(e),
    }
}

/// Whether the process of `key` holds its lock. Its file gone: it ended its last communicator
/// with peers of other namespaces, or died and a peer saw it (every peer holds the lock
/// before any looks: `hold` is followed by a barrier at init). A file that cannot be read
/// (another user's, say) counts as alive: no error from what this process cannot tell.
fn lock_alive(key: u64) -> bool {
    let path = lock_path(key);
    let f = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) => return e.kind() != std::io::ErrorKind::NotFound,
    };
    match try_flock(&f, nix::libc::LOCK_SH) {
        Ok(false) | Err(_) => true,
        Ok(true) => {
            // Nobody holds it: the process is gone. Its file goes too, unless a new one took
            // its place meanwhile (a new process with the same pid renames its locked file in).
            use std::os::unix::fs::MetadataExt;
            let same = |m: std::fs::Metadata| f.metadata().is_ok_and(|o| o.ino() == m.ino());
            if std::fs::metadata(&path).is_ok_and(same) {
                let _ = std::fs::remove_file(&path);
            }
            false
        }
    }
}

/// This process's lock and how many communicators hold it.
static HELD: Mutex<Option<(std::fs::File, usize)>> = Mutex::new(None);

/// This process's lock, held (the first one creates it) until every `Hold` has dropped; the
/// last removes the file.
pub struct Hold(());

pub fn hold() -> Result<Hold> {
    let mut held = HELD.lock();
    if let Some((_, users)) = held.as_mut() {
        *users += 1;
        return Ok(Hold(()));
    }
    let path = lock_path(my_process_key());
    // Locked under a name of its own, then renamed into place: a peer never finds the file
    // unlocked while this process lives.
    let tmp = format!("{path}.{}", std::process::id());
    let made = (|| {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&tmp)?;
        if !try_flock(&f, nix::libc::LOCK_EX)? {
            return Err(std::io::Error::from_raw_os_error(nix::libc::EWOULDBLOCK));
        }
        std::fs::rename(&tmp, &path)?;
        Ok(f)
    })();
    match made {
        Ok(f) => {
            *held = Some((f, 1));
            Ok(Hold(()))
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(Error::os(
                format!(
                    "making {path}, by which peers of other PID namespaces see this process live"
                ),
                e,
            ))
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut held = HELD.lock();
        let last = held.as_mut().is_some_and(|(_, users)| {
            *users -= 1;
            *users == 0
        });
        if last {
            // The name first, then the lock (closing the file): a peer then finds no file.
            let _ = std::fs::remove_file(lock_path(my_process_key()));
            *held = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_is_alive_and_a_released_one_is_not() {
        let me = my_process_key();
        let path = lock_path(me);
        assert!(!lock_alive(me), "no lock yet");
        let a = hold().unwrap();
        let b = hold().unwrap();
        assert!(std::path::Path::new(&path).exists());
        // (This process's own flock on another open of the file conflicts as another's does.)
        assert!(lock_alive(me));
        drop(a);
        assert!(lock_alive(me), "one holder left");
        drop(b);
        assert!(
            !std::path::Path::new(&path).exists(),
            "the last holder removes it"
        );
        assert!(!lock_alive(me));
        // A file left by a process that died (not locked): gone, and removed by who saw it.
        std::fs::write(&path, b"").unwrap();
        assert!(!lock_alive(me));
        assert!(!std::path::Path::new(&path).exists());
        assert!(Probe::Pid(std::process::id()).alive());
    }
}
