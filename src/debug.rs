//! `NCCL_DEBUG` logging in NCCL's line format: `host:pid:tid [dev] NCCL INFO message`.

use once_cell::sync::Lazy;
use std::io::Write;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Level {
    None = 0,
    Version = 1,
    Warn = 2,
    Info = 3,
    Abort = 4,
    Trace = 5,
}

static LEVEL: Lazy<Level> = Lazy::new(|| match crate::param::nccl_debug().as_deref() {
    Some(s) if s.eq_ignore_ascii_case("VERSION") => Level::Version,
    Some(s) if s.eq_ignore_ascii_case("WARN") => Level::Warn,
    Some(s) if s.eq_ignore_ascii_case("INFO") => Level::Info,
    Some(s) if s.eq_ignore_ascii_case("ABORT") => Level::Abort,
    Some(s) if s.eq_ignore_ascii_case("TRACE") => Level::Trace,
    _ => Level::None,
});

static HOST: Lazy<String> = Lazy::new(|| {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .map(|h| h.split('.').next().unwrap_or("").to_string())
        .unwrap_or_else(|| "localhost".into())
});

pub fn level() -> Level {
    *LEVEL
}

fn emit(kind: &str, msg: &str) {
    let tid = nix::unistd::gettid();
    let line = format!(
        "{}:{}:{} [{}] NCCL {} {}\n",
        *HOST,
        std::process::id(),
        tid,
        crate::device::current_device_for_log(),
        kind,
        msg
    );
    let _ = std::io::stdout().write_all(line.as_bytes());
}

pub fn warn(msg: &str) {
    if level() >= Level::Warn {
        emit("WARN", msg);
    }
}

/// NCCL's log subsystems that oxccl's INFO lines may be filtered by (`NCCL_DEBUG_SUBSYS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subsys {
    /// Which algorithm and protocol each collective got.
    Tuning,
}

/// Whether INFO lines of `s` are printed: `NCCL_DEBUG=INFO` (or more) and `NCCL_DEBUG_SUBSYS`
/// naming it or ALL (NCCL's syntax: a comma list, `^` to exclude; unset means NCCL's default,
/// INIT,BOOTSTRAP,ENV).
pub fn subsys_enabled(s: Subsys) -> bool {
    static TUNING: Lazy<bool> = Lazy::new(|| {
        let v = crate::param::nccl_debug_subsys().unwrap_or_else(|| "INIT,BOOTSTRAP,ENV".into());
        let v = v.to_ascii_uppercase();
        let (exclude, list) = match v.strip_prefix('^') {
            Some(l) => (true, l.to_string()),
            None => (false, v.clone()),
        };
        let named = list
            .split(',')
            .map(str::trim)
            .any(|n| n == "TUNING" || n == "ALL");
        named != exclude
    });
    // One flag per subsystem, level included (the check sits on launch paths).
    static ON: Lazy<bool> = Lazy::new(|| level() >= Level::Info && *TUNING);
    match s {
        Subsys::Tuning => *ON,
    }
}

pub fn info(msg: &str) {
    if level() >= Level::Info {
        emit("INFO", msg);
    }
}

/// The version line, as NCCL's `NCCL version 2.32.3+cuda13.4` with oxccl in place of the CUDA
/// build (no space: tools read the version as the last word).
pub const VERSION_LINE: &str = "NCCL version 2.32.3+oxccl";

/// Prints the version line the way NCCL does at a communicator init (`ncclCommInitRank*`,
/// `ncclCommInitAll`): once per process, from the first init of any rank at `INFO` and above,
/// or of rank 0 at `VERSION` and `WARN`; at `VERSION` and `WARN` as a bare line, above them as
/// an INFO log line.
pub fn version_banner(rank: i32) {
    static SHOWN: std::sync::Once = std::sync::Once::new();
    let l = level();
    if l > Level::Warn || (l != Level::None && rank == 0) {
        SHOWN.call_once(|| {
            if l > Level::Warn {
                emit("INFO", VERSION_LINE);
            } else {
                let _ = std::io::stdout().write_all(format!("{VERSION_LINE}\n").as_bytes());
            }
        });
    }
}
