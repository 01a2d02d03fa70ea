//! Whether a peer's process on this host still runs, so that a wait for a dead peer ends in an
//! error rather than a hang.
//!
//! A peer in this process's PID namespace is asked by its pid (`/proc/<pid>/stat`). A peer in
//! another PID namespace (a container that shares this host's hostname and /dev/shm but not
//! its pids) has a pid that names nothing here, or another process: such a process instead
//! holds an exclusive lock on a file of its own in /dev/shm (`oxccl-alive-<token>`, a random
//! token of the process, told to the peers at init) while it has communicators with peers of
//! other namespaces, and the kernel releases the lock when the process ends, however it ends.
//! A peer that finds the lock free knows the process is gone and removes its file; a normal
//! exit removes it too (atexit), and a new lock sweeps files whose owners are gone. A forked
//! child closes its copy of the lock (pthread_atfork): the lock says whether the process that
//! took it lives, not its children.

use crate::error::{Error, Result};
use std::os::fd::{AsRawFd, IntoRawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};

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

/// This process's key (`process_key`); a forked child computes its own.
pub fn my_process_key() -> u64 {
    static KEY: AtomicU64 = AtomicU64::new(0);
    let pid = std::process::id();
    let k = KEY.load(Ordering::Relaxed);
    if k != 0 && k as u32 == pid {
        return k;
    }
    let k = process_key(pid, pid_namespace());
    KEY.store(k, Ordering::Relaxed);
    k
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
    /// The token its process told at init: its lock file.
    Lock(u64),
}

impl Probe {
    pub fn alive(self) -> bool {
        match self {
            Probe::Pid(pid) => process_alive(pid),
            Probe::Lock(token) => lock_alive(token),
        }
    }
}

/// Whether process `pid` (of this PID namespace) runs: a zombie has died, its parent has not
/// collected it yet.
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // (Where this process cannot read its own /proc entry either, it cannot tell.)
        Err(_) => !std::path::Path::new("/proc/self/stat").exists(),
        // "pid (comm) S ...": the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|st| st != 'Z' && st != 'X'),
    }
}

const LOCK_PREFIX: &str = "oxccl-alive-";

fn lock_path(token: u64) -> String {
    format!("/dev/shm/{LOCK_PREFIX}{token:016x}")
}

/// `flock(fd, how | LOCK_NB)`: Ok(true) when taken, Ok(false) when another holds it.
fn try_flock(fd: i32, how: i32) -> std::io::Result<bool> {
    // SAFETY: flock takes no pointers; a bad descriptor is an error.
    if unsafe { nix::libc::flock(fd, how | nix::libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(nix::libc::EWOULDBLOCK) => Ok(false),
        _ => Err(e),
    }
}

/// Whether the process of `token` holds its lock. Its file gone: it ended its last
/// communicator with peers of other namespaces, exited, or died and a peer saw it (every
/// process holds its lock before any peer looks: `hold` is followed by a barrier at init). A
/// file that cannot be read (another user's, say) counts as alive: no error from what this
/// process cannot tell.
fn lock_alive(token: u64) -> bool {
    let path = lock_path(token);
    let f = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) => return e.kind() != std::io::ErrorKind::NotFound,
    };
    match try_flock(f.as_raw_fd(), nix::libc::LOCK_SH) {
        Ok(false) | Err(_) => true,
        Ok(true) => {
            // Nobody holds it: the process is gone (the token is its own: nobody else makes
            // this name).
            let _ = std::fs::remove_file(&path);
            false
        }
    }
}

/// This process's lock: its descriptor (-1: none), token and owner (a forked child's copy is
/// not its own), and how many communicators hold it. All atomics, and `BUSY` a spin lock
/// rather than a mutex, so that a child forked while another thread held it starts afresh
/// (`forget_in_child` resets them; a mutex held at fork would stay locked in the child).
static LOCK_FD: AtomicI32 = AtomicI32::new(-1);
static TOKEN: AtomicU64 = AtomicU64::new(0);
static OWNER: AtomicU32 = AtomicU32::new(0);
static USERS: AtomicUsize = AtomicUsize::new(0);
static BUSY: AtomicBool = AtomicBool::new(false);

/// `BUSY`, held until the guard drops.
struct Busy;

impl Busy {
    fn take() -> Busy {
        while BUSY.swap(true, Ordering::Acquire) {
            std::thread::yield_now();
        }
        Busy
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.store(false, Ordering::Release);
    }
}

/// In a forked child: the lock is the parent's; closing this copy of the descriptor keeps the
/// parent's lock (the same open file) but lets it go when the parent dies. Only atomics and
/// close(2): async-signal-safe.
extern "C" fn forget_in_child() {
    let fd = LOCK_FD.swap(-1, Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: our descriptor; close is async-signal-safe.
        unsafe { nix::libc::close(fd) };
    }
    TOKEN.store(0, Ordering::SeqCst);
    OWNER.store(0, Ordering::SeqCst);
    USERS.store(0, Ordering::SeqCst);
    BUSY.store(false, Ordering::SeqCst);
}

/// At a normal exit: the file goes with the lock.
extern "C" fn remove_at_exit() {
    let token = TOKEN.load(Ordering::SeqCst);
    if token != 0 && OWNER.load(Ordering::SeqCst) == std::process::id() {
        let _ = std::fs::remove_file(lock_path(token));
    }
}

fn random_token() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: writes at most 8 bytes into `b`.
    let n = unsafe { nix::libc::getrandom(b.as_mut_ptr().cast(), 8, nix::libc::GRND_NONBLOCK) };
    let t = u64::from_ne_bytes(b);
    if n == 8 && t != 0 {
        return t;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    (now ^ my_process_key().rotate_left(17)) | 1
}

/// Removes lock files whose owners are gone (killed, with no peer that looked), and files
/// left half made (a process killed between making its file and renaming it in: unlocked
/// and older than a minute; one being made is that old never).
fn sweep() {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let Some(rest) = name.strip_prefix(LOCK_PREFIX) else {
            continue;
        };
        let (hex, tmp) = rest
            .split_once('.')
            .map_or((rest, false), |(h, _)| (h, true));
        let Ok(token) = u64::from_str_radix(hex, 16) else {
            continue;
        };
        if hex.len() != 16 || token == TOKEN.load(Ordering::SeqCst) {
            continue;
        }
        if !tmp {
            lock_alive(token);
            continue;
        }
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|a| a.as_secs() > 60));
        let free = std::fs::File::open(e.path())
            .is_ok_and(|f| try_flock(f.as_raw_fd(), nix::libc::LOCK_SH).unwrap_or(false));
        if old && free {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// This process's lock, held (the first one makes it) until every `Hold` of it has dropped;
/// the last removes the file. Its token, for the peers.
pub struct Hold {
    pid: u32,
    token: u64,
}

impl Hold {
    pub fn token(&self) -> u64 {
        self.token
    }
}

pub fn hold() -> Result<Hold> {
    let _busy = Busy::take();
    let me = std::process::id();
    if OWNER.load(Ordering::SeqCst) == me && USERS.load(Ordering::SeqCst) > 0 {
        USERS.fetch_add(1, Ordering::SeqCst);
        return Ok(Hold {
            pid: me,
            token: TOKEN.load(Ordering::SeqCst),
        });
    }
    static HOOKS: std::sync::Once = std::sync::Once::new();
    HOOKS.call_once(|| {
        // SAFETY: plain functions that touch only atomics, the file system and close(2).
        unsafe {
            nix::libc::pthread_atfork(None, None, Some(forget_in_child));
            nix::libc::atexit(remove_at_exit);
        }
    });
    sweep();
    let token = random_token();
    let path = lock_path(token);
    // Locked under a name of its own, then renamed into place: a peer or a sweep never finds
    // the file unlocked while this process lives.
    let tmp = format!("{path}.{me}");
    let made = (|| {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)?;
        // Readable by every user whatever the umask (containers may run as other users).
        f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        if !try_flock(f.as_raw_fd(), nix::libc::LOCK_EX)? {
            return Err(std::io::Error::from_raw_os_error(nix::libc::EWOULDBLOCK));
        }
        std::fs::rename(&tmp, &path)?;
        Ok(f)
    })();
    match made {
        Ok(f) => {
            LOCK_FD.store(f.into_raw_fd(), Ordering::SeqCst);
            TOKEN.store(token, Ordering::SeqCst);
            OWNER.store(me, Ordering::SeqCst);
            USERS.store(1, Ordering::SeqCst);
            Ok(Hold { pid: me, token })
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
        if self.pid != std::process::id() {
            // A forked child's copy of its parent's hold: nothing of it is this process's.
            return;
        }
        let _busy = Busy::take();
        if self.token != TOKEN.load(Ordering::SeqCst) || USERS.load(Ordering::SeqCst) == 0 {
            return;
        }
        if USERS.fetch_sub(1, Ordering::SeqCst) == 1 {
            // The name first, then the lock: a peer then finds no file.
            let _ = std::fs::remove_file(lock_path(TOKEN.swap(0, Ordering::SeqCst)));
            let fd = LOCK_FD.swap(-1, Ordering::SeqCst);
            if fd >= 0 {
                // SAFETY: our descriptor, closed once (swapped out).
                unsafe { nix::libc::close(fd) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_is_alive_and_a_released_one_is_not() {
        let a = hold().unwrap();
        let b = hold().unwrap();
        let token = a.token();
        assert_eq!(b.token(), token);
        let path = lock_path(token);
        let mode = std::fs::metadata(&path).map(|m| {
            use std::os::unix::fs::PermissionsExt;
            m.permissions().mode() & 0o777
        });
        assert_eq!(mode.unwrap(), 0o644, "readable by other users");
        // (This process's own flock on another open of the file conflicts as another's does.)
        assert!(lock_alive(token));
        drop(a);
        assert!(lock_alive(token), "one holder left");
        drop(b);
        assert!(
            !std::path::Path::new(&path).exists(),
            "the last holder removes it"
        );
        assert!(!lock_alive(token));
        // A file left by a process that died (not locked): gone, and removed by who saw it,
        // or by the sweep of a new lock.
        let stale = lock_path(0x5eed_0000_0000_0001);
        std::fs::write(&stale, b"").unwrap();
        assert!(!lock_alive(0x5eed_0000_0000_0001));
        assert!(!std::path::Path::new(&stale).exists());
        std::fs::write(&stale, b"").unwrap();
        let c = hold().unwrap();
        assert!(!std::path::Path::new(&stale).exists(), "swept");
        assert_ne!(c.token(), token, "a new lock, a new token");
        drop(c);
        assert!(Probe::Pid(std::process::id()).alive());
        assert!(!Probe::Pid(u32::MAX - 1).alive());
    }
}
