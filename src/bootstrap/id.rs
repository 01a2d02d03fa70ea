//! The unique id's byte layout and the choice of the local address to listen on.

use super::ifaces;
use super::wire::{decode_addr, encode_addr, ADDR_BYTES};
use crate::error::{Error, Result};
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

pub const ID_BYTES: usize = 128;
pub const SECRET_BYTES: usize = 16;

/// Layout of the 128 bytes (nothing in it points into process memory):
/// - `0..4`   magic `b"OXCI"`
/// - `4..6`   layout version (u16 LE), currently 1
/// - `6..8`   zero
/// - `8..32`  the root's listen address (see `wire::encode_addr`: IPv4 or IPv6, port, scope)
/// - `32..48` a 16-byte random secret every connection must present first
/// - `48..128` zero
pub(crate) const MAGIC: &[u8; 4] = b"OXCI";
pub(crate) const VERSION: u16 = 1;
const ADDR_AT: usize = 8;
const SECRET_AT: usize = ADDR_AT + ADDR_BYTES;
const END: usize = SECRET_AT + SECRET_BYTES;

pub(crate) fn encode(addr: &SocketAddr, secret: &[u8; SECRET_BYTES]) -> [u8; ID_BYTES] {
    let mut b = [0u8; ID_BYTES];
    b[0..4].copy_from_slice(MAGIC);
    b[4..6].copy_from_slice(&VERSION.to_le_bytes());
    b[ADDR_AT..SECRET_AT].copy_from_slice(&encode_addr(addr));
    b[SECRET_AT..END].copy_from_slice(secret);
    b
}

/// Checks the layout; returns the root address and the secret.
pub(crate) fn decode(b: &[u8; ID_BYTES]) -> Result<(SocketAddr, [u8; SECRET_BYTES])> {
    let bad = |why: &str| {
        Error::invalid_argument(format!(
            "invalid ncclUniqueId: {why} (an id must come from ncclGetUniqueId of this library, \
             copied unchanged to every rank)"
        ))
    };
    if &b[0..4] != MAGIC {
        return Err(bad("bad magic"));
    }
    let ver = u16::from_le_bytes([b[4], b[5]]);
    if ver != VERSION {
        return Err(bad(&format!("layout version {ver}, expected {VERSION}")));
    }
    if b[6..8].iter().chain(&b[END..]).any(|&x| x != 0) {
        return Err(bad("reserved bytes are not zero"));
    }
    let addr = decode_addr(&b[ADDR_AT..SECRET_AT]).ok_or_else(|| bad("bad root address"))?;
    let mut secret = [0u8; SECRET_BYTES];
    secret.copy_from_slice(&b[SECRET_AT..END]);
    if secret.iter().all(|&x| x == 0) {
        return Err(bad("empty secret"));
    }
    Ok((addr, secret))
}

/// 16 bytes from the kernel's random source.
pub(crate) fn random_secret() -> Result<[u8; SECRET_BYTES]> {
    let mut s = [0u8; SECRET_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut s))
        .map_err(|e| Error::os("reading /dev/urandom for the unique id secret", e))?;
    if s.iter().all(|&x| x == 0) {
        s[0] = 1;
    }
    Ok(s)
}

/// 64-bit FNV-1a (stable across builds and processes).
pub(crate) fn fnv1a(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// `OXCCL_BOOTSTRAP_ADDR` as an address: "IP" (port 0) or "IP:PORT" / "[IPv6]:PORT".
fn override_addr() -> Result<Option<SocketAddr>> {
    let Some(v) = crate::param::get_str("OXCCL_BOOTSTRAP_ADDR") else {
        return Ok(None);
    };
    let v = v.trim();
    if let Ok(a) = v.parse::<SocketAddr>() {
        return Ok(Some(a));
    }
    if let Ok(ip) = v.trim_matches(|c| c == '[' || c == ']').parse::<IpAddr>() {
        return Ok(Some(SocketAddr::new(ip, 0)));
    }
    Err(Error::invalid_argument(format!(
        "OXCCL_BOOTSTRAP_ADDR={v} is not an IP address or IP:port"
    )))
}

/// The first address of an interface selected by `NCCL_SOCKET_IFNAME` (IPv4 first unless
/// `NCCL_SOCKET_FAMILY=AF_INET6`).
fn interface_addr(spec: &str) -> Result<SocketAddr> {
    let want6 = crate::param::get_str("NCCL_SOCKET_FAMILY")
        .map(|f| f.trim().eq_ignore_ascii_case("AF_INET6"))
        .unwrap_or(false);
    ifaces::first_addr(spec, want6).ok_or_else(|| {
        Error::system(format!(
            "no network interface with an IP address matches NCCL_SOCKET_IFNAME={spec} (this \
             host has: {})",
            interfaces().join(", ")
        ))
    })
}

/// "name address" of every interface with an IP address, for messages.
fn interfaces() -> Vec<String> {
    let mut v: Vec<String> = nix::ifaddrs::getifaddrs()
        .map(|ifs| {
            ifs.filter_map(|i| {
                let a = i.address?;
                let ip = a
                    .as_sockaddr_in()
                    .map(|s| std::net::IpAddr::from(s.ip()).to_string())
                    .or_else(|| a.as_sockaddr_in6().map(|s| s.ip().to_string()))?;
                Some(format!("{} {ip}", i.interface_name))
            })
            .collect()
        })
        .unwrap_or_default();
    v.dedup();
    v
}

/// The interface a rank uses without `NCCL_SOCKET_IFNAME`, as NCCL picks it: the first with
/// an address that is not loopback or a container's; loopback where there is nothing else.
fn default_addr() -> SocketAddr {
    interface_addr(ifaces::SKIPPED_BY_DEFAULT)
        .unwrap_or_else(|_| SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))
}

/// Where a root listens: `OXCCL_BOOTSTRAP_ADDR` (with its port if given), else the address of the
/// `NCCL_SOCKET_IFNAME` interface, else the interface NCCL would pick (`default_addr`); port 0
/// means any.
pub(crate) fn root_bind_addr() -> Result<SocketAddr> {
    if let Some(a) = override_addr()? {
        return Ok(a);
    }
    rank_bind_addr()
}

/// Where a rank listens for its peers: as the root, but always on a free port.
pub(crate) fn rank_bind_addr() -> Result<SocketAddr> {
    if let Some(mut a) = override_addr()? {
        a.set_port(0);
        return Ok(a);
    }
    if let Some(spec) = crate::param::get_str("NCCL_SOCKET_IFNAME") {
        return interface_addr(spec.trim());
    }
    Ok(default_addr())
}

#[cfg(test)]
mod tests {
    use super::ifaces::ifname_matches;
    use super::*;

    #[test]
    fn interfaces_are_chosen_as_nccl_does() {
        let e = interface_addr("=oxccl-no-such-if0").unwrap_err();
        assert!(
            e.msg.contains("NCCL_SOCKET_IFNAME==oxccl-no-such-if0"),
            "{}",
            e.msg
        );
        assert!(
            e.msg.contains("lo 127.0.0.1"),
            "the message lists what exists: {}",
            e.msg
        );
        assert_eq!(interface_addr("=lo").unwrap().ip(), Ipv4Addr::LOCALHOST);
        // The default is never a loopback or container interface unless there is nothing else.
        let d = default_addr();
        let others = interfaces().iter().any(|i| {
            !i.starts_with("lo ") && ifaces::ifname_matches(ifaces::SKIPPED_BY_DEFAULT, i)
        });
        assert_eq!(
            d.ip().is_loopback(),
            !others,
            "{d} among {:?}",
            interfaces()
        );
    }

    #[test]
    fn layout_roundtrip_and_garbage() {
        let a: SocketAddr = "127.0.0.1:4242".parse().unwrap();
        let s = [7u8; SECRET_BYTES];
        let b = encode(&a, &s);
        assert_eq!(decode(&b).unwrap(), (a, s));
        let a6: SocketAddr = "[::1]:9".parse().unwrap();
        assert_eq!(decode(&encode(&a6, &s)).unwrap(), (a6, s));

        let e = decode(&[0u8; ID_BYTES]).unwrap_err();
        assert_eq!(e.code, crate::error::Code::InvalidArgument);
        assert!(e.msg.contains("magic"), "{}", e.msg);
        let mut g = b;
        g[100] = 1;
        assert!(decode(&g).unwrap_err().msg.contains("reserved"));
        let mut g = b;
        g[4] = 9;
        assert!(decode(&g).unwrap_err().msg.contains("version"));
        let mut g = b;
        g[ADDR_AT] = 9;
        assert!(decode(&g).unwrap_err().msg.contains("address"));
        let g = encode(&a, &[0u8; SECRET_BYTES]);
        assert!(decode(&g).unwrap_err().msg.contains("secret"));
    }

    #[test]
    fn secrets_are_random() {
        let a = random_secret().unwrap();
        let b = random_secret().unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn ifname_specs() {
        assert!(ifname_matches("lo", "lo"));
        assert!(ifname_matches("eth,ib", "ib0"));
        assert!(!ifname_matches("eth,ib", "lo"));
        assert!(ifname_matches("^docker,lo", "eth0"));
        assert!(!ifname_matches("^docker,lo", "docker0"));
        assert!(ifname_matches("=eth0", "eth0"));
        assert!(!ifname_matches("=eth0", "eth01"));
        assert!(!ifname_matches("^=eth0", "eth0"));
    }

    #[test]
    fn loopback_interface_is_found() {
        let a = interface_addr("lo").unwrap();
        assert!(a.ip().is_loopback(), "{a}");
        assert!(interface_addr("=no-such-if-oxccl").is_err());
    }

    #[test]
    fn fnv_known_value() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
