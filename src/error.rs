//! The one error type of the library, its NCCL result codes, and the `ncclGetLastError` store.

use parking_lot::Mutex;
use std::fmt;

/// `ncclResult_t` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum Code {
    Success = 0,
    UnhandledCudaError = 1,
    SystemError = 2,
    InternalError = 3,
    InvalidArgument = 4,
    InvalidUsage = 5,
    RemoteError = 6,
    InProgress = 7,
    Timeout = 8,
}

impl Code {
    pub fn from_raw(v: i32) -> Option<Code> {
        Some(match v {
            0 => Code::Success,
            1 => Code::UnhandledCudaError,
            2 => Code::SystemError,
            3 => Code::InternalError,
            4 => Code::InvalidArgument,
            5 => Code::InvalidUsage,
            6 => Code::RemoteError,
            7 => Code::InProgress,
            8 => Code::Timeout,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub code: Code,
    pub msg: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(code: Code, msg: impl Into<String>) -> Error {
        Error {
            code,
            msg: msg.into(),
        }
    }
    pub fn invalid_argument(msg: impl Into<String>) -> Error {
        Error::new(Code::InvalidArgument, msg)
    }
    pub fn invalid_usage(msg: impl Into<String>) -> Error {
        Error::new(Code::InvalidUsage, msg)
    }
    pub fn system(msg: impl Into<String>) -> Error {
        Error::new(Code::SystemError, msg)
    }
    pub fn internal(msg: impl Into<String>) -> Error {
        Error::new(Code::InternalError, msg)
    }
    pub fn remote(msg: impl Into<String>) -> Error {
        Error::new(Code::RemoteError, msg)
    }
    pub fn timeout(msg: impl Into<String>) -> Error {
        Error::new(Code::Timeout, msg)
    }
    /// A feature that belongs to a later part of the project: exported and validated, not there yet.
    pub fn not_yet(what: &str) -> Error {
        Error::invalid_usage(format!(
            "{what} is not available yet in oxccl (see README, 'Not there yet')"
        ))
    }
    /// Wrap an OS error with what was being done.
    pub fn os(what: impl fmt::Display, e: impl fmt::Display) -> Error {
        Error::system(format!("{what}: {e}"))
    }
    pub fn context(mut self, what: impl fmt::Display) -> Error {
        self.msg = format!("{what}: {}", self.msg);
        self
    }

    /// `context` with "`what` on rank `rank`", where the message need no longer begin with
    /// that rank ("AllReduce ... on rank 1: the network connection ...", not "... on rank 1:
    /// rank 1: the network connection ...").
    pub fn context_on_rank(mut self, what: impl fmt::Display, rank: usize) -> Error {
        if let Some(rest) = self.msg.strip_prefix(&format!("rank {rank}: ")) {
            self.msg = rest.to_string();
        }
        self.context(format_args!("{what} on rank {rank}"))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.code, self.msg)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::system(e.to_string())
    }
}

impl From<nix::Error> for Error {
    fn from(e: nix::Error) -> Error {
        Error::system(e.to_string())
    }
}

/// NCCL's own text for each result code (what `ncclGetErrorString` returns).
pub fn error_string(code: i32) -> &'static str {
    match code {
        0 => "no error",
        1 => "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2 => "unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => "internal error - please report this issue to the NCCL developers",
        4 => "invalid argument (run with NCCL_DEBUG=WARN for details)",
        5 => "invalid usage (run with NCCL_DEBUG=WARN for details)",
        6 => "remote process exited or there was a network error",
        7 => "NCCL operation in progress",
        8 => "timeout",
        _ => "unknown result code",
    }
}

/// The message of the last error, process-wide (NCCL keeps one per process, and one per comm when
/// a comm is given; `ncclGetLastError(comm)` falls back to the global one).
static LAST_ERROR: Mutex<String> = Mutex::new(String::new());

/// Sets the message and prints it as a WARN (not again when it is the last message with a
/// prefix: the call that returns a failure its communicator already reported says it again,
/// naming itself).
pub fn set_last_error(msg: &str) {
    let mut last = LAST_ERROR.lock();
    if last.is_empty() || msg == last.as_str() || !msg.ends_with(last.as_str()) {
        crate::debug::warn(msg);
    }
    *last = msg.to_string();
}

pub fn last_error() -> String {
    LAST_ERROR.lock().clone()
}
