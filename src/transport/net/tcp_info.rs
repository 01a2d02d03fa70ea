//! What the kernel's TCP_INFO says of a connection's peer: how long it has been silent while
//! this end waits on it. A file of its own, with nothing but `std` and `nix`, because the net
//! plugin (`net-plugin/`, which must not link oxccl) shares it.

use std::net::TcpStream;

/// How long `s` has heard nothing from its peer while it waits on it (TCP_INFO): segments sent
/// and not yet acknowledged, or, with the peer's window closed, two window probes in a row
/// unanswered (a live peer answers every one: the count starts again at each answer); then the
/// time since the last acknowledgement. None where it waits on nothing, or the kernel does not
/// say.
pub fn unacknowledged_for(s: &TcpStream) -> Option<std::time::Duration> {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain C struct of integers; all zeros is a valid value.
    let mut info: nix::libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<nix::libc::tcp_info>() as nix::libc::socklen_t;
    // SAFETY: TCP_INFO writes at most `len` bytes of a tcp_info into `info`.
    let r = unsafe {
        nix::libc::getsockopt(
            s.as_raw_fd(),
            nix::libc::IPPROTO_TCP,
            nix::libc::TCP_INFO,
            (&mut info as *mut nix::libc::tcp_info).cast(),
            &mut len,
        )
    };
    (r == 0 && (info.tcpi_unacked > 0 || info.tcpi_probes >= 2))
        .then(|| std::time::Duration::from_millis(u64::from(info.tcpi_last_ack_recv)))
}
