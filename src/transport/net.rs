//! Ranks on other hosts: the network transport, with proxy threads moving FIFO slots over
//! sockets or an NCCL net plugin. Not there yet: it names itself so the rest of the library can
//! say which peer needs it.

use super::peer::PeerInfo;
use super::{ConnSpec, Endpoint, Locality, Transport};
use crate::error::{Error, Result};

pub struct Net;

impl Transport for Net {
    fn name(&self) -> &'static str {
        "network"
    }
    fn reaches(&self, me: &PeerInfo, peer: &PeerInfo) -> bool {
        Locality::of(me, peer) == Locality::OtherHost
    }
    fn setup(&self, spec: &ConnSpec) -> Result<(Box<dyn Endpoint>, Vec<u8>)> {
        Err(Error::not_yet(&format!(
            "the network transport (rank {} is on another host)",
            spec.peer
        )))
    }
}
