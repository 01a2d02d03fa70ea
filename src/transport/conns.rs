//! A rank's connections to its peers, made when a launch first needs them: every end a launch
//! needs (on all the communicators one thread launches together) is set up by its transport and
//! its blob sent to the peer through the bootstrap; then the peers' blobs are received and the
//! ends finished. Ends are sent before any is awaited, so ranks driven by one thread never wait
//! for each other.

use super::peer::PeerInfo;
use super::{pick, Conn, ConnKey, ConnSpec, Endpoint, KeyHasher, Locality};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Arc;

/// A rank's view of its communicator's peers and the connections made so far.
pub struct Conns {
    pub rank: usize,
    pub nranks: usize,
    pub hash: u64,
    /// FIFO geometry (rank 0's, for every rank).
    pub slot_bytes: usize,
    pub nsteps: usize,
    peers: Vec<PeerInfo>,
    map: Mutex<HashMap<ConnKey, Arc<Conn>, BuildHasherDefault<KeyHasher>>>,
    /// The out-of-band channel; None once the communicator is torn down.
    bootstrap: Mutex<Option<Bootstrap>>,
    /// The ring's order of ranks when it is not rank order: each host's ranks together, hosts
    /// in the order their first rank appears (the ring crosses each host boundary once).
    ring: Option<Vec<usize>>,
    /// Where network ends listen (this rank's bootstrap address).
    pub(super) local_ip: std::net::IpAddr,
    /// The communicator's health: its proxy thread reports failures there.
    health: Arc<crate::health::Health>,
    /// Started with the first connection whose data a proxy moves.
    proxy: Mutex<Option<super::proxy::ProxyThread>>,
    /// On the CUDA executor, the communicator's context: connections in device memory are
    /// made (allocated, or opened by CUDA IPC) in it, whichever communicator's context the
    /// thread making them is in.
    device_ctx: once_cell::sync::OnceCell<usize>,
    /// The executor's `proxy::Busy` (the CUDA executor's: its kernels are running), handed to
    /// the proxy thread when it starts.
    busy: once_cell::sync::OnceCell<Arc<dyn super::proxy::Busy>>,
}

/// Ranks grouped by host (hosts in the order of their first rank, ranks ascending within a
/// host); None when that is rank order already.
pub(super) fn ring_order(peers: &[PeerInfo]) -> Option<Vec<usize>> {
    let mut hosts: Vec<u64> = Vec::new();
    for p in peers {
        if !hosts.contains(&p.host) {
            hosts.push(p.host);
        }
    }
    let ring: Vec<usize> = hosts
        .iter()
        .flat_map(|h| (0..peers.len()).filter(move |&r| peers[r].host == *h))
        .collect();
    (!ring.iter().enumerate().all(|(i, &r)| i == r)).then_some(ring)
}

fn finish_missing(mut v: Vec<ConnKey>) -> Vec<ConnKey> {
    if v.len() > 1 {
        v.sort();
        v.dedup();
    }
    v
}

/// Blob status bytes: the end is set up (the transport's blob follows), or it failed (a message
/// follows), so the peer fails too instead of waiting.
const READY: u8 = 0;
const FAILED: u8 = 1;

impl Conns {
    pub fn new(
        boot: Bootstrap,
        peers: Vec<PeerInfo>,
        hash: u64,
        health: Arc<crate::health::Health>,
    ) -> Conns {
        Conns {
            ring: ring_order(&peers),
            local_ip: boot.peer_addrs()[boot.rank()].ip(),
            health,
            proxy: Mutex::new(None),
            rank: boot.rank(),
            nranks: boot.nranks(),
            hash,
            slot_bytes: PeerInfo::comm_slot_bytes(&peers),
            nsteps: peers[0].nsteps as usize,
            peers,
            map: Mutex::new(HashMap::default()),
            bootstrap: Mutex::new(Some(boot)),
            device_ctx: Default::default(),
            busy: Default::default(),
        }
    }

    /// The CUDA context of the communicator's device (see `device_ctx`).
    pub fn set_device_ctx(&self, ctx: usize) {
        let _ = self.device_ctx.set(ctx);
    }

    /// See `busy`.
    pub fn set_busy(&self, busy: Arc<dyn super::proxy::Busy>) {
        let _ = self.busy.set(busy);
    }

    /// Makes the communicator's CUDA context current while the guard lives (nothing on the
    /// host executor).
    fn enter_device(&self) -> Result<Option<crate::gpu::driver::CtxGuard>> {
        self.device_ctx
            .get()
            .map(|&c| crate::gpu::driver::CtxGuard::enter(c))
            .transpose()
    }

    /// How many hosts the communicator's ranks are on.
    pub fn nodes(&self) -> usize {
        let mut hosts: Vec<u64> = self.peers.iter().map(|p| p.host).collect();
        hosts.sort_unstable();
        hosts.dedup();
        hosts.len()
    }

    /// See `ring`.
    pub fn ring_order(&self) -> Option<&[usize]> {
        self.ring.as_deref()
    }

    /// This rank's ring neighbours: (next, previous).
    pub fn ring_neighbours(&self) -> (usize, usize) {
        let n = self.nranks;
        match &self.ring {
            None => ((self.rank + 1) % n, (self.rank + n - 1) % n),
            Some(ring) => {
                let p = ring.iter().position(|&x| x == self.rank).unwrap_or(0);
                (ring[(p + 1) % n], ring[(p + n - 1) % n])
            }
        }
    }

    pub fn peers(&self) -> &[PeerInfo] {
        &self.peers
    }

    pub fn locality(&self, peer: usize) -> Locality {
        Locality::of(&self.peers[self.rank], &self.peers[peer])
    }

    /// `ConnSpec::peer_device`: `peer` is a rank of this host on another GPU that this rank's
    /// GPU reaches, and the other way (`PeerInfo::peer_gpus`: both ends decide alike); in this
    /// process, with peer access enabled between the two (`gpu::memory::peer_access`, whose
    /// answer is the same for both ends).
    fn peer_device(&self, peer: usize) -> bool {
        let (me, q) = (&self.peers[self.rank], &self.peers[peer]);
        crate::gpu::kind() == crate::gpu::Kind::Cuda
            && self.locality(peer) != Locality::OtherHost
            && me.peer_gpus(q)
            && (!me.same_process(q) || crate::gpu::memory::peer_access(me.dev, q.dev))
    }

    /// Whether this rank's kernels' atomics on the memory of `peer`'s GPU are native
    /// (`gpu::memory::native_atomics`; its GPU found by UUID among those this process sees).
    fn peer_atomics(&self, peer: usize) -> bool {
        crate::gpu::memory::device_of_uuid(&self.peers[peer].gpu)
            .is_some_and(|d| crate::gpu::memory::native_atomics(self.peers[self.rank].dev, d))
    }

    /// The connection of `key`, if it is made.
    pub fn get(&self, key: ConnKey) -> Option<Arc<Conn>> {
        self.map.lock().get(&key).cloned()
    }

    /// The connection of `key`, which a launch must have made.
    pub fn bound(&self, key: ConnKey) -> Result<Arc<Conn>> {
        self.get(key).ok_or_else(|| {
            Error::internal(format!(
                "rank {}: connection {key:?} was not set up at launch",
                self.rank
            ))
        })
    }

    /// The keys of `keys` not connected yet, each once, in order.
    pub fn missing(&self, keys: impl IntoIterator<Item = ConnKey>) -> Vec<ConnKey> {
        let mut v = Vec::new();
        let mut visit = self.missing_visitor(&mut v);
        keys.into_iter().for_each(&mut visit);
        drop(visit);
        finish_missing(v)
    }

    /// `missing` over keys a caller visits (`plan::Task::for_each_key`).
    pub fn missing_of(&self, visit: impl FnOnce(&mut dyn FnMut(ConnKey))) -> Vec<ConnKey> {
        let mut v = Vec::new();
        let mut f = self.missing_visitor(&mut v);
        visit(&mut f);
        drop(f);
        finish_missing(v)
    }

    fn missing_visitor<'a>(&'a self, out: &'a mut Vec<ConnKey>) -> impl FnMut(ConnKey) + 'a {
        let map = self.map.lock();
        // Steps name the same few connections over and over: look each up once.
        let mut last = None;
        move |k| {
            if last.replace(k) != Some(k) && !map.contains_key(&k) {
                out.push(k);
            }
        }
    }

    /// Connects the ring (to the next rank, from the previous one) where the peers share this
    /// host, as NCCL connects its rings at init, and the rings of the other `channels - 1`
    /// channels where the executor splits collectives (`CommExec::channels`): a launch then
    /// never waits for a peer's end of a ring, so that a peer that called something else is
    /// seen on the board or in the slots' call words, not in an exchange that waits for it.
    pub fn connect_ring(&self, channels: usize) -> Result<()> {
        if self.nranks < 2 {
            return Ok(());
        }
        let (next, prev) = self.ring_neighbours();
        let keys = (0..channels.clamp(1, super::Class::RINGS)).flat_map(|c| {
            [(next, true), (prev, false)]
                .into_iter()
                .filter(|&(p, _)| self.locality(p) != Locality::OtherHost)
                .map(move |(peer, is_sender)| ConnKey::new(peer, is_sender, super::Class::ring(c)))
        });
        let keys = self.missing(keys);
        connect_all(&[(self, keys)])
    }

    /// The `NCCL_DEBUG=INFO` line NCCL prints for a connection, for the sending end of `k`
    /// (`on_device`: the connection lives in device memory).
    fn log_connection(&self, k: ConnKey, on_device: bool) {
        if crate::debug::level() < crate::debug::Level::Info {
            return;
        }
        let plugin = super::plugin::net()
            .filter(|_| self.peers[self.rank].net_plugin())
            .map(|n| format!("NET/{}/0", n.name));
        let via = match self.locality(k.peer()) {
            Locality::SameProcess if on_device => "P2P/direct pointer",
            Locality::SameProcess => "SHM/direct/direct",
            Locality::SameHost if on_device => "P2P/IPC",
            Locality::SameHost => "SHM/direct/direct",
            Locality::OtherHost => plugin.as_deref().unwrap_or("NET/Socket/0"),
        };
        let dev = |r: usize| self.peers[r].dev.max(0);
        crate::debug::info(&format!(
            "Channel {:02}/{} : {}[{}] -> {}[{}] via {via} (comm {:#x})",
            k.class.channel(),
            k.class.kind(),
            self.rank,
            dev(self.rank),
            k.peer(),
            dev(k.peer()),
            self.hash
        ));
    }

    /// Hands an end to the communicator's proxy thread (started on first use).
    fn drive(&self, end: Arc<dyn super::Proxy>) -> Result<()> {
        let mut p = self.proxy.lock();
        if p.is_none() {
            *p = Some(super::proxy::ProxyThread::start(
                self.rank,
                self.health.clone(),
                self.busy.get().cloned(),
            )?);
        }
        if let Some(t) = p.as_ref() {
            t.add(end);
        }
        Ok(())
    }

    /// Where `peer` runs on this host in another process that has died: the error that says
    /// so (an operation's dead peer, as `HostComm::dead_peer` finds it).
    fn dead_peer_error(&self, peer: usize) -> Option<Error> {
        let probe = PeerInfo::local_probes(self.peers(), self.rank)
            .get(peer)
            .copied()
            .flatten()?;
        (!probe.alive()).then(|| {
            Error::remote(format!(
                "rank {}: {} has died: a connection to it could not be set up",
                self.rank,
                self.peers()[peer].describe(peer)
            ))
        })
    }

    pub fn with_bootstrap<T>(&self, f: impl FnOnce(&Bootstrap) -> Result<T>) -> Result<T> {
        let b = self.bootstrap.lock();
        match b.as_ref() {
            Some(b) => f(b),
            None => Err(Error::invalid_usage("communicator has been destroyed")),
        }
    }

    /// Drops the connections and closes the bootstrap (its sockets and threads). `idle`: the
    /// communicator's work is done; where it is not (kernels that did not stop), the device
    /// memory of connections between processes is left allocated and mapped, since they may
    /// still touch it (see `Conn::abandon_device_memory`).
    pub fn teardown(&self, idle: bool) {
        // The proxy thread first: it drives ends of the connections. What the last operations
        // handed it goes out before it stops (their peers wait for it).
        let proxy = self.proxy.lock().take();
        if let Some(p) = &proxy {
            p.flush(
                std::time::Instant::now() + crate::param::bound(),
                &self.health,
            );
        }
        drop(proxy);
        // Each end lets go of its connection now, whoever still holds it (the other end stops
        // waiting for this one: `Conn::peer_closed`).
        let mut map = self.map.lock();
        if !idle {
            map.values().for_each(|c| c.abandon_device_memory());
        }
        map.values().for_each(|c| c.close());
        map.clear();
        drop(map);
        let _ = self.bootstrap.lock().take();
    }

    fn spec(&self, k: ConnKey) -> ConnSpec {
        let peer_device = self.peer_device(k.peer());
        ConnSpec {
            local_ip: self.local_ip,
            comm_hash: self.hash,
            me: self.rank,
            peer: k.peer(),
            is_sender: k.is_sender,
            class: k.class,
            nsteps: self.nsteps,
            slot_bytes: self.slot_bytes,
            same_device: self.peers[self.rank].same_gpu(&self.peers[k.peer()]),
            peer_device,
            shared_blocks: !(k.is_sender && peer_device && !self.peer_atomics(k.peer())),
            ipc: self.peers[self.rank].ipc_with(&self.peers[k.peer()]),
            peer_pid: self.peers[self.rank].pid_seen_by(&self.peers[k.peer()]),
            peer_host: self.peers[k.peer()].hostname.clone(),
            health: Some(self.health.clone()),
        }
    }

    /// Sets up this end of `k`: the end to finish, or why it failed.
    fn setup(&self, k: ConnKey) -> (Result<Box<dyn Endpoint>>, Vec<u8>) {
        let r = pick(&self.peers[self.rank], &self.peers[k.peer()])
            .and_then(|t| t.setup(&self.spec(k)));
        match r {
            Ok((ep, blob)) => {
                let mut b = vec![READY];
                b.extend_from_slice(&blob);
                (Ok(ep), b)
            }
            Err(e) => self.failed_setup(e),
        }
    }

    /// An end that could not be set up: the error, and the blob that tells the peer why.
    fn failed_setup(&self, e: Error) -> (Result<Box<dyn Endpoint>>, Vec<u8>) {
        let mut b = vec![FAILED];
        b.extend_from_slice(e.msg.as_bytes());
        (Err(e), b)
    }
}

/// The bootstrap tag of the blob the sending end of `k`'s connection sends (`sent_by_sender`)
/// or the receiving end does.
fn blob_tag(k: ConnKey, sent_by_sender: bool) -> u32 {
    k.class as u32 * 2 + u32::from(sent_by_sender)
}

/// Makes the connections `needs` lists for each communicator (one thread's ranks launched
/// together), in one exchange through each one's bootstrap. Every end is set up and announced
/// before any peer's blob is awaited; an end that fails is announced as failed, so its peer
/// fails too rather than waiting. The first error, if any.
pub fn connect_all(needs: &[(&Conns, Vec<ConnKey>)]) -> Result<()> {
    let mut first_err: Option<Error> = None;
    let mut pending = Vec::new();
    for (c, keys) in needs {
        // Receiving ends first: a sending end shares the sockets of its rank's receiving end
        // from the same peer where that end exists (see `net::pair`).
        let (recvs, sends): (Vec<ConnKey>, Vec<ConnKey>) = keys.iter().partition(|k| !k.is_sender);
        let guard = c.enter_device();
        for k in recvs.into_iter().chain(sends) {
            let (ep, blob) = match &guard {
                Ok(_) => c.setup(k),
                Err(e) => c.failed_setup(e.clone()),
            };
            let sent =
                c.with_bootstrap(|b| b.send_setup(k.peer(), blob_tag(k, k.is_sender), &blob));
            let told = sent.is_ok();
            // A peer of this host that could not be reached may have died: then say so.
            let sent = sent.map_err(|e| c.dead_peer_error(k.peer()).unwrap_or(e));
            if let Err(e) = ep.as_ref().err().cloned().map_or(sent, Err) {
                first_err.get_or_insert(e);
            }
            pending.push((*c, k, ep, told));
        }
    }
    for (c, k, ep, told) in pending {
        if !told {
            // The peer could not be reached (its error is recorded): it will send nothing
            // either, and a rank that died before it ever connected here looks only late.
            continue;
        }
        let blob = c.with_bootstrap(|b| b.recv_setup(k.peer(), blob_tag(k, !k.is_sender)));
        let r = blob.and_then(|blob| {
            let ep = ep?;
            let _g = c.enter_device()?;
            match blob.split_first() {
                Some((&READY, rest)) => ep.connect(rest),
                Some((_, msg)) => Err(Error::remote(format!(
                    "rank {} could not set up its end of the connection with rank {}: {}",
                    k.peer(),
                    c.rank,
                    String::from_utf8_lossy(msg)
                ))),
                None => Err(Error::internal("an empty connection blob")),
            }
        });
        match r {
            Ok(mut conn) => {
                conn.class = k.class;
                if k.is_sender {
                    c.log_connection(k, conn.on_device());
                }
                if let Some(p) = &conn.proxy {
                    if let Err(e) = c.drive(p.clone()) {
                        first_err.get_or_insert(e);
                    }
                }
                c.map.lock().insert(k, Arc::new(conn));
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
