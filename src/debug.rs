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

pub fn info(msg: &str) {
    if level() >= Level::Info {
        emit("INFO", msg);
    }
}

pub fn version_banner() {
    if level() >= Level::Version {
        emit("INFO", "NCCL version 2.32.3+oxccl (host executor)");
    }
}
