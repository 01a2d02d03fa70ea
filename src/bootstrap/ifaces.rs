//! Network interfaces as NCCL picks them: `NCCL_SOCKET_IFNAME`'s syntax (a comma list of name
//! prefixes, `=` for exact names, a leading `^` to exclude instead of select) and the default
//! that skips loopback and container interfaces. Self-contained (std and nix only):
//! `net-plugin/` includes this file too, so that the plugin picks the interface oxccl does.

use std::net::SocketAddr;

/// Interfaces NCCL does not pick unless told to (loopback, container bridges and their veths).
pub const SKIPPED_BY_DEFAULT: &str = "^lo,docker,virbr,veth";

/// Does interface `name` match an `NCCL_SOCKET_IFNAME` spec?
pub fn ifname_matches(spec: &str, name: &str) -> bool {
    let (exclude, rest) = match spec.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, spec),
    };
    let (exact, rest) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let hit = rest
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .any(|p| {
            if exact {
                name == p
            } else {
                name.starts_with(p)
            }
        });
    hit != exclude
}

/// The first address (port 0) of an interface `spec` selects: IPv4 first, or IPv6 first where
/// `want6` (`NCCL_SOCKET_FAMILY=AF_INET6`); None when no interface with an address matches.
pub fn first_addr(spec: &str, want6: bool) -> Option<SocketAddr> {
    let mut v4 = None;
    let mut v6 = None;
    for ifa in nix::ifaddrs::getifaddrs().ok()? {
        if !ifname_matches(spec, &ifa.interface_name) {
            continue;
        }
        let Some(a) = ifa.address else { continue };
        if let Some(sin) = a.as_sockaddr_in() {
            v4.get_or_insert(SocketAddr::V4(std::net::SocketAddrV4::from(*sin)));
        } else if let Some(sin6) = a.as_sockaddr_in6() {
            v6.get_or_insert(SocketAddr::V6(std::net::SocketAddrV6::from(*sin6)));
        }
    }
    let mut a = if want6 { v6.or(v4) } else { v4.or(v6) }?;
    a.set_port(0);
    Some(a)
}
