//! A launch's work as the kernels read it: a flat descriptor passed by value as the kernel's
//! parameter. Programs and steps are in the plan's one flat form (`plan::encode`'s
//! `FlatProgram` / `FlatStep`); around them this adds what only a launch knows: the connections
//! (where each one's counters and slots are) and the lanes (one block each, with the control
//! block of the lane's communicator). Layout shared with `cuda/runner.cu`: `OxHeadD`, then
//! connections, programs, steps, lanes. Nothing in it points at host memory the caller owns, so
//! a captured CUDA graph replays it as it is.

use crate::error::{Error, Result};
use crate::plan::encode::{encode_program, FlatProgram, FlatStep, NONE};
use crate::plan::{Prim, Program, Step};
use crate::transport::{Class, Conn};
use smallvec::SmallVec;
use std::sync::Arc;

/// The kernels' parameter size (`OX_PARAM_BYTES`), and their `_large` twins' (CUDA 12.1 and
/// later: `OX_PARAM_BYTES_LARGE`), which serve larger descriptors.
pub const PARAM_BYTES: usize = 4000;
pub const PARAM_BYTES_LARGE: usize = 32760;

const HEAD: usize = 16;
/// The header's first word: a launch captured into a CUDA graph, whose blocks return at once
/// where their lane's control block says stop (`OX_HEAD_CAPTURED`; the low 16 bits are the
/// blocks per lane).
pub const HEAD_CAPTURED: u64 = 1 << 16;
/// The header flag for device-scope step fences (`OX_HEAD_GPU_FENCES`): see `gpu_fences`.
pub const HEAD_GPU_FENCES: u64 = 1 << 17;
const CONN: usize = 32;
const PROG: usize = std::mem::size_of::<FlatProgram>();
const STEP: usize = std::mem::size_of::<FlatStep>();
const LANE: usize = 24;
const _: () = assert!(PROG == 80 && STEP == 56);
/// Connections a launch may have to run several blocks per lane (`OX_MAX_CONNS`).
const MAX_CONNS_MULTI: usize = 64;
/// A step's flags beside `prep` (bit 0): it sends its source's address (`OX_STEP_REF_SRC`), or
/// its destination's once written (`OX_STEP_REF_DST`), in place of the bytes (`mark_refs`).
const STEP_REF_SRC: u32 = 2;
const STEP_REF_DST: u32 = 4;
/// Beside one of those: the receiver is a kernel of another process (`OX_STEP_REF_PEER`: a
/// sender that revokes its slots waits for its claims only so long).
const STEP_REF_PEER: u32 = 8;

/// A program bound to this rank's connections, its addresses in device memory.
pub type DevProgram = Program<Arc<Conn>>;

/// What a lane's blocks read beside its programs (`OxLaneD`): its communicator's control
/// block, and for a board lane (`board` not 0) the communicator's device board and this rank's
/// place on it (`super::board`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaneComm {
    pub ctl: u64,
    pub board: u64,
    pub rank: u16,
    pub nranks: u16,
    /// The communicator's registry of `ncclCommRegister` buffers (`transport::registered`;
    /// not in the descriptor).
    pub registry: u64,
}

impl LaneComm {
    /// An ordinary lane of the communicator whose control block is at `ctl`.
    pub fn of(ctl: u64) -> LaneComm {
        LaneComm {
            ctl,
            ..LaneComm::default()
        }
    }
}

/// The descriptor of one kernel launch.
#[derive(Default)]
pub struct Desc {
    conns: Vec<Arc<Conn>>,
    // (In place for a launch or two of one step: a one-rank call's allocations.)
    progs: SmallVec<[FlatProgram; 2]>,
    steps: SmallVec<[FlatStep; 4]>,
    /// (first program, programs, what the lane reads beside them).
    lanes: SmallVec<[(u16, u16, LaneComm); 2]>,
    /// Board lanes among them.
    boards: usize,
    /// The largest step, in bytes.
    max_bytes: usize,
    /// The largest operation of a board lane, in bytes of every rank's segment where the
    /// call's count is one rank's (what the kernel cuts into parts: `ox_board_parts`).
    board_bytes: usize,
    /// Whether some step is more than a plain copy.
    transforms: bool,
    /// Whether steps may send registered buffers by reference to kernels of other processes
    /// (`allow_peer_refs`).
    peer_refs: bool,
    /// What the kernels add to the addresses they send by reference on a connection (by its
    /// index; 0 where not listed): where the receiver sees the memory (`mark_refs`).
    offsets: SmallVec<[(u32, i64); 2]>,
}

/// The bytes of a descriptor of `conns` connections, `progs` programs, `steps` steps and
/// `lanes` lanes.
fn descriptor_bytes(conns: usize, progs: usize, steps: usize, lanes: usize) -> usize {
    HEAD + CONN * conns + PROG * progs + STEP * steps + LANE * lanes
}

/// The most of `channels` rings that one rank's ring all-reduce over `nranks` ranks can be
/// split across with its descriptor still in a kernel's ordinary parameter (`PARAM_BYTES`):
/// each ring is a lane of one program of 2 n - 1 steps on two connections.
pub fn channels_that_fit(nranks: usize, channels: usize) -> usize {
    let steps = (2 * nranks).saturating_sub(1);
    (1..=channels.max(1))
        .rev()
        .find(|&c| descriptor_bytes(2 * c, c, c * steps, c) <= PARAM_BYTES)
        .unwrap_or(1)
}

/// The error of a launch whose descriptor does not fit a kernel parameter (`large`: the driver
/// takes the large-parameter kernels).
fn too_large(size: usize, large: bool, lanes: usize, progs: usize, steps: usize) -> Result<()> {
    let limit = if large {
        PARAM_BYTES_LARGE
    } else {
        PARAM_BYTES
    };
    if size <= limit {
        return Ok(());
    }
    let older = if large {
        ""
    } else {
        " with this driver (a driver of CUDA 12.1 or later takes 32760)"
    };
    Err(Error::invalid_usage(format!(
        "this launch needs a {size}-byte descriptor ({lanes} lanes, {progs} programs, {steps} \
         steps); one CUDA launch takes {limit}{older} (fewer calls per group, fewer ranks \
         sharing a stream, or fewer peers per all-to-all fit)"
    )))
}

fn as_bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: `T` is a `#[repr(C)]` record of integers (FlatProgram / FlatStep) with no padding
    // bytes (checked by the sizes above), read as its bytes.
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, std::mem::size_of::<T>()) }
}

impl Desc {
    pub fn new() -> Desc {
        Desc::default()
    }

    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Lets the lanes added from now on send registered buffers by reference to kernels of
    /// other processes on this GPU (`registered`): not for a launch captured into a graph,
    /// whose replays may come after a buffer is deregistered.
    pub fn allow_peer_refs(&mut self) {
        self.peer_refs = true;
    }

    /// Board lanes among them.
    pub fn boards(&self) -> usize {
        self.boards
    }

    /// Whether the launch is wide work: no connection, and each lane one program of at most one
    /// step (so that every block may take a share of every step, in no particular order).
    pub fn wide(&self) -> bool {
        self.conns.is_empty()
            && self.boards == 0
            && self
                .lanes
                .iter()
                .all(|&(first, n, _)| n <= 1 && (n == 0 || self.progs[first as usize].nsteps <= 1))
    }

    /// Adds a lane running `progs` in order, for the communicator whose control block is at
    /// `ctl`. Scratch addresses must have been placed (made the device's) before.
    pub fn lane<'p>(
        &mut self,
        progs: impl IntoIterator<Item = &'p DevProgram>,
        ctl: u64,
    ) -> Result<()> {
        self.lane_on(progs, LaneComm::of(ctl))
    }

    /// `lane`, with what the lane reads beside its programs: a board lane's one program is one
    /// step over the rank's own buffers, its call words saying the collective (`super::board`).
    pub fn lane_on<'p>(
        &mut self,
        progs: impl IntoIterator<Item = &'p DevProgram>,
        lc: LaneComm,
    ) -> Result<()> {
        let first = self.progs.len();
        for p in progs {
            for s in &p.steps {
                self.max_bytes = self.max_bytes.max(s.len * p.esize);
                // A one-rank reduction that scales nothing is a copy.
                let identity = match p.red {
                    None => true,
                    Some(crate::plan::RedSpec::Ready(r)) => {
                        r.premul.is_none() && r.postdiv.unwrap_or(0) <= 1
                    }
                    Some(_) => false,
                };
                self.transforms |=
                    !(s.prim == Prim::LocalCopy || (s.prim == Prim::LocalReduce && identity));
                if matches!(s.src, crate::plan::Addr::Scratch { .. })
                    || matches!(s.dst, crate::plan::Addr::Scratch { .. })
                {
                    return Err(Error::internal("scratch reached a launch unplaced"));
                }
            }
            let conns = &mut self.conns;
            let at = self.steps.len();
            encode_program(p, &mut self.steps, &mut self.progs, |c| match c {
                None => Ok(NONE),
                Some(c) => Ok(match conns.iter().position(|x| Arc::ptr_eq(x, c)) {
                    Some(i) => i as u32,
                    None => {
                        conns.push(c.clone());
                        conns.len() as u32 - 1
                    }
                }),
            })?;
            let peer = self.peer_refs && crate::transport::registered::any();
            if crate::param::p2p_direct()
                && p.steps
                    .iter()
                    .any(|s| s.send.as_ref().is_some_and(|c| by_ref_may(c, peer)))
            {
                mark_refs(
                    p,
                    &mut self.steps[at..],
                    peer,
                    &mut self.offsets,
                    |k, a, e| crate::transport::registered::peer_offset(lc.registry, k, a, e),
                );
            }
        }
        let n = self.progs.len() - first;
        let (Ok(first), Ok(n)) = (u16::try_from(first), u16::try_from(n)) else {
            return Err(Error::internal("too many programs in one launch"));
        };
        if lc.board != 0 {
            if n != 1 || self.progs[usize::from(first)].nsteps != 1 {
                return Err(Error::internal("a board lane of more than one step"));
            }
            self.boards += 1;
            let p = &self.progs[usize::from(first)];
            let len = self.steps[p.first_step as usize].len;
            let segments = if crate::plan::call::segmented(p.call) {
                u64::from(lc.nranks)
            } else {
                1
            };
            let bytes = (len * p.esize * segments) as usize;
            self.board_bytes = self.board_bytes.max(bytes);
        }
        self.lanes.push((first, n, lc));
        Ok(())
    }

    /// Whether `lanes` fit one launch's descriptor (`large`: the driver takes the large
    /// parameters): checked for every launch of a group before any is launched, so that a group
    /// fails whole rather than half run.
    pub fn check_fits<'p>(
        lanes: impl IntoIterator<Item = &'p [DevProgram]>,
        large: bool,
    ) -> Result<()> {
        let mut conns: Vec<*const Conn> = Vec::new();
        let (mut np, mut ns, mut nl) = (0, 0, 0);
        for lane in lanes {
            nl += 1;
            for p in lane {
                np += 1;
                ns += p.steps.len();
                for c in p.steps.iter().flat_map(Step::conns) {
                    if !conns.contains(&Arc::as_ptr(c)) {
                        conns.push(Arc::as_ptr(c));
                    }
                }
            }
        }
        too_large(descriptor_bytes(conns.len(), np, ns, nl), large, nl, np, ns)
    }

    /// The descriptor's size in bytes.
    pub fn size(&self) -> usize {
        descriptor_bytes(
            self.conns.len(),
            self.progs.len(),
            self.steps.len(),
            self.lanes.len(),
        )
    }

    /// Whether the descriptor needs the large-parameter kernels.
    pub fn large(&self) -> bool {
        self.size() > PARAM_BYTES
    }

    /// Blocks per lane for the runner: several where every connection is in device memory
    /// that takes this end's atomics natively (their arrival counts live in the headers:
    /// `Conn::shared_blocks`) and steps are large enough to share out, one per 256 KiB of the
    /// largest step, at most `OXCCL_CUDA_BLOCKS`.
    pub fn blocks_per_lane(&self) -> u16 {
        // Board lanes: a block for each part of their operation (`ox_board_parts`: one per
        // 64 KiB, at most 64), as many as the device holds beside the other ranks' (`run`'s
        // room).
        if self.boards > 0 && self.conns.is_empty() {
            return (self.board_bytes / (64 << 10)).clamp(1, 64) as u16;
        }
        if self.conns.is_empty()
            || self.conns.len() > MAX_CONNS_MULTI
            || !self.conns.iter().all(|c| c.on_device() && c.shared_blocks)
        {
            return 1;
        }
        (self.max_bytes / (256 << 10)).clamp(1, crate::param::cuda_blocks()) as u16
    }

    /// Whether the runner may publish and take steps with device-scope fences: every
    /// connection has both ends on this GPU, in its memory (`Conn::same_device`).
    pub fn gpu_fences(&self) -> bool {
        !self.conns.is_empty() && self.conns.iter().all(|c| c.same_device)
    }

    /// The bytes of the kernel parameter, for `nb` blocks per lane: `PARAM_BYTES` of them, or
    /// `PARAM_BYTES_LARGE` where the descriptor needs them (`large`: the driver takes them).
    pub fn params(&self, nb: u16, large: bool) -> Result<Vec<u64>> {
        too_large(
            self.size(),
            large,
            self.lanes.len(),
            self.progs.len(),
            self.steps.len(),
        )?;
        let bytes = if self.large() {
            PARAM_BYTES_LARGE
        } else {
            PARAM_BYTES
        };
        let mut b = Vec::with_capacity(bytes);
        let n16 = |v: usize| (v as u16).to_le_bytes();
        b.extend_from_slice(&u64::from(nb).to_le_bytes());
        for n in [
            self.conns.len(),
            self.progs.len(),
            self.steps.len(),
            self.lanes.len(),
        ] {
            b.extend_from_slice(&n16(n));
        }
        for (i, c) in self.conns.iter().enumerate() {
            let (hdr, slots) = c.device_view();
            let (Ok(n), Ok(sb)) = (u32::try_from(c.nsteps), u32::try_from(c.slot_bytes)) else {
                return Err(Error::internal(format!(
                    "a connection of {} slots of {} bytes",
                    c.nsteps, c.slot_bytes
                )));
            };
            let offset = self.offset(i);
            let steps = u64::from(n) | u64::from(sb) << 32;
            for v in [hdr as u64, slots as u64, steps, offset as u64] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        for p in &self.progs {
            b.extend_from_slice(as_bytes(p));
        }
        for s in &self.steps {
            b.extend_from_slice(as_bytes(s));
        }
        for &(f, n, lc) in &self.lanes {
            for v in [f, n, lc.rank, lc.nranks] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            b.extend_from_slice(&lc.ctl.to_le_bytes());
            b.extend_from_slice(&lc.board.to_le_bytes());
        }
        b.resize(bytes, 0);
        Ok(b.chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }

    /// The launch in words, for `OXCCL_CUDA_TRACE`.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        for (l, &(first, n, lc)) in self.lanes.iter().enumerate() {
            out += &format!(" lane {l}:");
            if lc.board != 0 {
                out += &format!(" board {:#x} rank {} of {}", lc.board, lc.rank, lc.nranks);
            }
            for p in &self.progs[first as usize..(first + n) as usize] {
                out += &format!(
                    " [prog niter {} slice {} esize {} red {}/{}:",
                    p.niter, p.slice, p.esize, p.red.kind, p.red.op
                );
                let (a, m) = (p.first_step as usize, p.nsteps as usize);
                for s in &self.steps[a..a + m] {
                    let c = |i: u32| {
                        if i == NONE {
                            "-".to_string()
                        } else {
                            i.to_string()
                        }
                    };
                    let by = match s.prep & (STEP_REF_SRC | STEP_REF_DST) {
                        0 => "",
                        STEP_REF_SRC => " ref src",
                        _ => " ref dst",
                    };
                    out += &format!(
                        " p{} r{} s{} len {} {:#x}->{:#x}{by};",
                        s.prim,
                        c(s.recv),
                        c(s.send),
                        s.len,
                        s.src.at,
                        s.dst.at
                    );
                }
                out += "]";
            }
        }
        for (i, c) in self.conns.iter().enumerate() {
            let (h, sl) = c.device_view();
            out += &format!(" conn {i} {} hdr {h:#x} slots {sl:#x}", c.counters());
            if self.offset(i) != 0 {
                out += &format!(" refs {:+#x}", self.offset(i));
            }
            out += ";";
        }
        out
    }

    /// What the kernels add to an address they send by reference on connection `i`.
    fn offset(&self, i: usize) -> i64 {
        self.offsets
            .iter()
            .find(|o| o.0 as usize == i)
            .map_or(0, |o| o.1)
    }

    /// The largest step, in bytes (sizes a local launch).
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// (dst, src, bytes) of each step, where every step is a plain local copy.
    pub fn plain_copies(&self) -> Option<Vec<(u64, u64, u64)>> {
        if self.transforms || !self.conns.is_empty() || self.boards > 0 {
            return None;
        }
        Some(
            self.progs
                .iter()
                .flat_map(|p| {
                    let (a, n) = (p.first_step as usize, p.nsteps as usize);
                    self.steps[a..a + n]
                        .iter()
                        .map(move |s| (s.dst.at, s.src.at, s.len * p.esize))
                })
                .collect(),
        )
    }
}

/// Marks the steps of `p` (`flat`, as encoded) that send by reference: the receiving kernel
/// reads the slice where the step found it (the caller's buffer, or scratch that lives until
/// this launch ends) instead of out of a slot, which spares the copy into the slot. Only
/// - on a connection whose ends are both kernels of this process on one GPU
///   (`Conn::same_device`: the receiver reads this memory at the same address, whatever
///   allocated it), or whose receiver is a kernel of another process on this GPU
///   (`Conn::peer_process`) that opened the registered buffer holding the memory
///   (`registered`; `peer`: not in a captured launch). The slot then carries the address as
///   that process sees it: the kernels add the connection's offset (`offsets`), one per
///   connection;
/// - for a step whose slices go out as they are (no pre-multiplication to apply): the source of a
///   `Send` or `CopySend`, the destination of a `RecvCopySend` or `RecvReduceCopySend` once
///   the step wrote it;
/// - where no other step of the program writes that memory (in place, a ring all-reduce writes
///   its result over the input it sent first);
/// - where the program sends more slots on the connection than its FIFO holds. The kernel
///   waits at the program's end until the receiver has taken every slot (`ox_drain`), so that
///   nothing reads the memory once the launch is done. A program that fills its FIFO waited
///   for that receiver already, though only for the slots before the FIFO's last worth: the
///   wait for those is new (where every rank makes the same calls in the same order and the
///   device holds a ring's lanes at once, as `lane_key` needs, it ends; a short send still
///   ends without its receiver, as before).
#[inline(never)]
fn mark_refs(
    p: &DevProgram,
    flat: &mut [FlatStep],
    peer: bool,
    offsets: &mut SmallVec<[(u32, i64); 2]>,
    mut peer_offset: impl FnMut(u64, u64, u64) -> Option<i64>,
) {
    let es = p.esize as u64;
    let premul = match p.red {
        Some(crate::plan::RedSpec::Ready(r)) => r.premul.is_some(),
        Some(crate::plan::RedSpec::PreMul { .. }) => true,
        None => false,
    };
    for (k, s) in p.steps.iter().enumerate() {
        let Some(c) = s.send.as_ref().filter(|c| by_ref_may(c, peer)) else {
            continue;
        };
        let (flag, at) = match s.prim {
            _ if s.prep && premul => continue,
            Prim::Send | Prim::CopySend => (STEP_REF_SRC, flat[k].src.at),
            Prim::RecvCopySend | Prim::RecvReduceCopySend => (STEP_REF_DST, flat[k].dst.at),
            _ => continue,
        };
        let slots: usize = p
            .steps
            .iter()
            .filter(|t| t.send.as_ref().is_some_and(|x| Arc::ptr_eq(x, c)))
            .map(|t| t.len.div_ceil(p.slice))
            .sum();
        if at == 0 || slots as u64 <= c.nsteps {
            continue;
        }
        let end = at + s.len as u64 * es;
        let written = flat
            .iter()
            .enumerate()
            .any(|(j, t)| j != k && t.dst.at != 0 && t.dst.at < end && at < t.dst.at + t.len * es);
        if written {
            continue;
        }
        // Where the receiver sees the memory: here on this GPU in this process; in the
        // receiving process, a registered buffer it opened. One offset per connection (a
        // step whose memory the receiver sees at another sends its bytes).
        let (offset, peer_flag) = match c.peer_process {
            _ if c.same_device => (0, 0),
            Some(key) => match peer_offset(key, at, end) {
                Some(o) => (o, STEP_REF_PEER),
                None => continue,
            },
            None => continue,
        };
        let ci = flat[k].send;
        match offsets.iter().find(|o| o.0 == ci) {
            Some(o) if o.1 != offset => continue,
            Some(_) => {}
            None => offsets.push((ci, offset)),
        }
        flat[k].prep |= flag | peer_flag;
    }
}

/// Whether steps sending on `c` may send by reference (`mark_refs`): its receiver is a kernel
/// of this process on this GPU, or (`peer`: registered buffers, outside a capture) of another
/// process on this GPU.
fn by_ref_may(c: &Conn, peer: bool) -> bool {
    c.same_device || (peer && c.peer_process.is_some())
}

/// Where a lane goes in a launch (lanes sort by it; ties keep their order).
///
/// A GPU starts a launch's blocks in the order of their index, the later ones as earlier ones
/// end when not all fit on its SMs at once, and blocks wait for one another only through
/// connections. So lanes come by communicator (no lane waits on another communicator's), then
/// by ring channel (a collective split across channels runs a ring on each, whose lanes wait
/// only on one another; everything else is on channel 0). Within a channel first come the
/// lanes that wait on nobody (local copies); then the two ends of each connection next to each
/// other, connections by their distance `d` on the ring of ranks (receiver minus sender, mod
/// n: every rank sends `d` ranks on while it receives from `d` back, as NCCL's point-to-point
/// schedule pairs them), and by class where a rank has lanes of two classes to one peer; then
/// lanes on several connections, and every lane on ring connections (a ring, or a chain, whose
/// end ranks have one connection each): the same lane of every rank together. The lanes first
/// in line can then always end, whether their other ends are in this launch or in the same
/// launch of another rank, as long as the device holds a ring's lanes at once (one per rank).
/// (A chain of the direct class, the hierarchical algorithms' inside a host, sorts its ends
/// with the pairs, before its middle: on a device that holds fewer lanes than its ranks and the
/// pairs beside it, the ends could wait there for middles that have no room.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LaneKey(usize, usize, u8, usize, usize, u8, u8);

/// The key of a lane of rank `rank` of an `nranks`-rank communicator (`comm`: a number the
/// same on all its ranks, its hash), lane `index` of that rank's in the launch, whose programs
/// use connections with the ends `ends` (this end's rank, the other's, whether this end sends,
/// the connection's class).
pub fn lane_key(
    ends: impl IntoIterator<Item = (usize, usize, bool, Class)>,
    nranks: usize,
    comm: usize,
    index: usize,
    rank: usize,
) -> LaneKey {
    let mut ends = ends.into_iter();
    let Some(first) = ends.next() else {
        return LaneKey(comm, 0, 0, 0, 0, 0, 0);
    };
    let (me, peer, sends, class) = first;
    let channel = class.channel();
    let (mut single, mut ring) = (true, class.kind() == 0);
    for e in ends {
        single &= e == first;
        ring &= e.3.kind() == 0;
    }
    if ring || !single {
        return LaneKey(comm, channel, 2, index, rank, 0, 0);
    }
    let n = nranks.max(1);
    if sends {
        LaneKey(comm, channel, 1, (peer + n - me) % n, me, class as u8, 0)
    } else {
        LaneKey(comm, channel, 1, (me + n - peer) % n, peer, class as u8, 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Addr, RedSpec, Step};
    use crate::transport::{inproc, Region};
    use crate::types::{CollKind, DataType, ReduceKind, Reduction};
    const P2P: Class = Class::P2p;
    const RING: Class = Class::Ring;

    fn rd64(b: &[u64], byte: usize) -> u64 {
        assert_eq!(byte % 8, 0);
        b[byte / 8]
    }
    fn rd32(b: &[u64], byte: usize) -> u32 {
        (b[byte / 8] >> (8 * (byte % 8))) as u32
    }
    fn rd16(b: &[u64], byte: usize) -> u16 {
        (b[byte / 8] >> (8 * (byte % 8))) as u16
    }
    /// The OxLaneD at byte `l`: (first program, programs, board rank, board ranks), (ctl,
    /// board).
    fn lane_at(b: &[u64], l: usize) -> ([u16; 4], [u64; 2]) {
        (
            [rd16(b, l), rd16(b, l + 2), rd16(b, l + 4), rd16(b, l + 6)],
            [rd64(b, l + 8), rd64(b, l + 16)],
        )
    }

    /// A program of `steps` local steps of `prim` and no connection, step `i` over
    /// (source, destination, length) `at(i)`; prepared where it reduces.
    fn local_program(
        steps: usize,
        prim: Prim,
        at: impl Fn(usize) -> (usize, usize, usize),
        esize: usize,
        slice: usize,
        call: [u64; 2],
    ) -> DevProgram {
        Program {
            steps: (0..steps)
                .map(|i| {
                    let (src, dst, len) = at(i);
                    Step {
                        prim,
                        recv: None,
                        send: None,
                        src: Addr::User(src),
                        dst: Addr::User(dst),
                        len,
                        prep: prim != Prim::LocalCopy,
                    }
                })
                .collect(),
            esize,
            slice,
            niter: 1,
            red: None,
            call,
        }
    }

    /// The descriptor's bytes are where `cuda/runner.cu` reads them (OxHeadD, OxConnD,
    /// OxProgD = FlatProgram, OxStepD = FlatStep, OxLaneD, in that order).
    #[test]
    fn layout_matches_the_kernel() {
        let region = inproc::open("oxccl-desc-test", crate::transport::region_bytes(4, 4096))
            .expect("region");
        let conn = Arc::new(Conn::new(Region::Heap(region), 4, 4096, (0, 1), true));
        let red = Reduction {
            dtype: DataType::Float32,
            kind: ReduceKind::Max,
            premul: None,
            postdiv: Some(3),
        };
        let step = |prim, recv: Option<&Arc<Conn>>, send: Option<&Arc<Conn>>, src, dst, len| Step {
            prim,
            recv: recv.cloned(),
            send: send.cloned(),
            src,
            dst,
            len,
            prep: prim == Prim::Send,
        };
        let prog: DevProgram = Program {
            steps: vec![
                step(
                    Prim::Send,
                    None,
                    Some(&conn),
                    Addr::User(0x1000),
                    Addr::None,
                    100,
                ),
                step(
                    Prim::RecvReduceCopySend,
                    Some(&conn),
                    Some(&conn),
                    Addr::User(0x2000),
                    Addr::User(0x3000),
                    50,
                ),
            ],
            esize: 4,
            slice: 1024,
            niter: 1,
            red: Some(RedSpec::Ready(red)),
            call: [7, 9],
        };
        let mut d = Desc::new();
        d.lane([&prog], 0xc7c7).expect("lane");
        // A connection not known to be on this GPU: system-scope fences only.
        assert!(!d.gpu_fences());
        let b = d.params(3, false).expect("params");
        assert_eq!(b[0], 3);
        assert_eq!(b.len() * 8, PARAM_BYTES);
        assert_eq!(
            [rd16(&b, 8), rd16(&b, 10), rd16(&b, 12), rd16(&b, 14)],
            [1, 1, 2, 1]
        );
        let (hdr, slots) = conn.device_view();
        assert_eq!([rd64(&b, 16), rd64(&b, 24)], [hdr as u64, slots as u64]);
        // (Steps and slot bytes, 32 bits each; the offset of sends by reference: none.)
        assert_eq!([rd32(&b, 32), rd32(&b, 36)], [4, 4096]);
        assert_eq!(rd64(&b, 40), 0);
        // OxProgD: first_step, nsteps, esize, slice, niter, red {kind, dtype, op, flags,
        // scalar, postdiv}, call.
        let p = 16 + CONN;
        assert_eq!([rd32(&b, p), rd32(&b, p + 4)], [0, 2]);
        assert_eq!(
            [rd64(&b, p + 8), rd64(&b, p + 16), rd64(&b, p + 24)],
            [4, 1024, 1]
        );
        assert_eq!(
            [
                rd32(&b, p + 32),
                rd32(&b, p + 36),
                rd32(&b, p + 40),
                rd32(&b, p + 44)
            ],
            [1, DataType::Float32 as u32, 2, 2]
        );
        assert_eq!(rd64(&b, p + 56), 3);
        assert_eq!([rd64(&b, p + 64), rd64(&b, p + 72)], [7, 9]);
        // OxStepD: prim, prep, send, recv, src {kind, idx, at}, dst, len.
        let s = p + PROG;
        assert_eq!(
            [
                rd32(&b, s),
                rd32(&b, s + 4),
                rd32(&b, s + 8),
                rd32(&b, s + 12)
            ],
            [0, 1, 0, NONE]
        );
        assert_eq!((rd32(&b, s + 16), rd64(&b, s + 24)), (1, 0x1000));
        assert_eq!((rd32(&b, s + 32), rd64(&b, s + 48)), (0, 100));
        let s2 = s + STEP;
        assert_eq!(
            [rd32(&b, s2), rd32(&b, s2 + 8), rd32(&b, s2 + 12)],
            [6, 0, 0]
        );
        assert_eq!([rd64(&b, s2 + 40), rd64(&b, s2 + 48)], [0x3000, 50]);
        // OxLaneD: first program, programs, board rank, board ranks, ctl, board.
        assert_eq!(lane_at(&b, s2 + STEP), ([0, 1, 0, 0], [0xc7c7, 0]));
        assert_eq!(b.len() * 8, PARAM_BYTES);
        inproc::forget("oxccl-desc-test");
    }

    /// A board lane: one program of one step, its lane naming the board and the rank's place;
    /// no wide kernel, no copies on the copy engine, blocks by its size; more is refused.
    #[test]
    fn board_lanes_name_the_board() {
        let prog = |steps: usize, prim: Prim| {
            local_program(
                steps,
                prim,
                |_| (0x1000, 0x2000, 1 << 20),
                4,
                1 << 22,
                [1, 2],
            )
        };
        let lc = LaneComm {
            ctl: 0xc7c7,
            board: 0xb0a4d,
            rank: 2,
            nranks: 3,
            registry: 0,
        };
        let mut d = Desc::new();
        d.lane_on([&prog(1, Prim::LocalReduce)], lc)
            .expect("a board lane");
        assert!(!d.wide() && d.plain_copies().is_none());
        // 4 MiB: a block per 64 KiB part.
        assert_eq!(d.blocks_per_lane(), 64);
        let b = d.params(16, false).expect("fits");
        assert_eq!(
            lane_at(&b, 16 + PROG + STEP),
            ([0, 1, 2, 3], [0xc7c7, 0xb0a4d])
        );
        let mut d = Desc::new();
        let two = prog(2, Prim::LocalReduce);
        assert!(d.lane_on([&two], lc).is_err(), "a board lane of two steps");
        // An all-gather's or a reduce-scatter's parts (and blocks) count every rank's segment.
        for (kind, blocks) in [
            (CollKind::AllGather, 12),
            (CollKind::ReduceScatter, 12),
            (CollKind::AllReduce, 4),
        ] {
            // 256 KiB a rank, 3 ranks.
            let mut p = prog(1, Prim::LocalReduce);
            p.steps[0].len = 1 << 16;
            p.call = crate::plan::call::of_coll(kind, 1 << 16, DataType::Float32, None, 0);
            let mut d = Desc::new();
            d.lane_on([&p], lc).expect("a board lane");
            assert_eq!(d.blocks_per_lane(), blocks, "{kind:?}");
        }
    }

    /// Past `PARAM_BYTES`, a descriptor takes the large parameter where the driver has it, and
    /// is an error where it has not; past `PARAM_BYTES_LARGE`, an error.
    #[test]
    fn large_descriptors_take_the_large_parameter() {
        let prog =
            |steps: usize| local_program(steps, Prim::LocalCopy, |i| (8 + i, 16, 1), 2, 1, [0, 0]);
        // 16 + 80 + 100 x 56 + 24 bytes.
        let mut d = Desc::new();
        d.lane([&prog(100)], 0).expect("lane");
        assert_eq!(d.size(), 5720);
        assert!(d.large());
        let e = d
            .params(1, false)
            .expect_err("too large for an older driver");
        assert!(
            e.msg
                .contains("one CUDA launch takes 4000 with this driver"),
            "{}",
            e.msg
        );
        let b = d.params(1, true).expect("the large parameter");
        assert_eq!(b.len() * 8, PARAM_BYTES_LARGE);
        assert_eq!(rd16(&b, 12), 100);
        // The last step's source, then the lane after it, where the kernel looks.
        let last = 16 + PROG + 99 * STEP;
        assert_eq!(rd64(&b, last + 24), 8 + 99);
        assert_eq!(rd16(&b, last + STEP + 2), 1);
        assert!(b[d.size() / 8..].iter().all(|&w| w == 0));
        let c = d.plain_copies().expect("copies only");
        assert_eq!((c.len(), c[0]), (100, (16, 8, 2)));
        // 69 steps fit 4000 bytes; 582 fit 32760, 583 do not.
        for (steps, large) in [(69, false), (70, true), (582, true)] {
            let mut d = Desc::new();
            d.lane([&prog(steps)], 0).expect("lane");
            assert_eq!(d.large(), large, "{steps} steps");
            let b = d.params(1, true).expect("fits");
            let want = if large {
                PARAM_BYTES_LARGE
            } else {
                PARAM_BYTES
            };
            assert_eq!(b.len() * 8, want);
        }
        let mut d = Desc::new();
        d.lane([&prog(583)], 0).expect("lane");
        let e = d.params(1, true).expect_err("too large");
        assert!(e.msg.contains("one CUDA launch takes 32760 ("), "{}", e.msg);
        let p = prog(583);
        let e = Desc::check_fits([std::slice::from_ref(&p)], true).expect_err("too large");
        assert!(e.msg.contains("32768-byte descriptor"), "{}", e.msg);
        assert!(Desc::check_fits([std::slice::from_ref(&prog(100))], true).is_ok());
    }

    /// An all-to-all of 5 ranks in one launch, and a ring's lanes: in `lane_key`'s order the
    /// local copies come first, each send has its receive right after it, sends go by their
    /// distance on the ring, and the rings' lanes come last, lane by lane.
    #[test]
    fn lanes_go_in_pairs_by_distance() {
        let n = 5;
        let mut lanes = Vec::new();
        for r in 0..n {
            lanes.push((lane_key([], n, 0, 0, r), format!("copy {r}")));
            for p in (0..n).filter(|&p| p != r) {
                let i = lanes.len();
                lanes.push((
                    lane_key([(r, p, true, P2P)], n, 0, i, r),
                    format!("{r}>{p}"),
                ));
                lanes.push((
                    lane_key([(r, p, false, P2P)], n, 0, i + 1, r),
                    format!("{p}>{r}"),
                ));
            }
            for c in 0..2 {
                let ring = [
                    (r, (r + 1) % n, true, RING),
                    (r, (r + n - 1) % n, false, RING),
                ];
                lanes.push((lane_key(ring, n, 0, c, r), format!("ring {c} {r}")));
            }
        }
        lanes.sort_by_key(|l| l.0);
        let names: Vec<&str> = lanes.iter().map(|l| l.1.as_str()).collect();
        assert!(
            names[..n].iter().all(|l| l.starts_with("copy")),
            "{names:?}"
        );
        let pairs = &names[n..n + 2 * n * (n - 1)];
        let mut d_seen = 0;
        for pair in pairs.chunks(2) {
            assert_eq!(pair[0], pair[1], "{names:?}");
            let (a, b) = pair[0].split_once('>').unwrap();
            let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
            let d = (b + n - a) % n;
            assert!(d >= d_seen, "distance {d} after {d_seen}: {names:?}");
            d_seen = d;
        }
        let rings: Vec<String> = (0..2)
            .flat_map(|c| (0..n).map(move |r| format!("ring {c} {r}")))
            .collect();
        assert_eq!(names[n + 2 * n * (n - 1)..], rings, "{names:?}");
    }

    /// A sending end of 4 slots of 4 KiB in region `name` (kept until `inproc::forget`), its
    /// ends kernels on one GPU in this process where `same`.
    fn conn(name: &str, same: bool) -> Arc<Conn> {
        let region = inproc::open(name, crate::transport::region_bytes(4, 4096)).unwrap();
        let mut c = Conn::new(Region::Heap(region), 4, 4096, (0, 1), true);
        c.same_device = same;
        Arc::new(c)
    }

    /// Device-scope fences only where every connection of the descriptor is on this GPU.
    #[test]
    fn gpu_fences_need_every_connection_on_the_gpu() {
        let (a, b) = (
            conn("oxccl-desc-fence-a", true),
            conn("oxccl-desc-fence-b", false),
        );
        let prog = |send: &Arc<Conn>| -> DevProgram {
            Program {
                steps: vec![Step {
                    prim: Prim::Send,
                    recv: None,
                    send: Some(send.clone()),
                    src: Addr::User(0x1000),
                    dst: Addr::None,
                    len: 10,
                    prep: true,
                }],
                esize: 4,
                slice: 1024,
                niter: 1,
                red: None,
                call: [1, 2],
            }
        };
        let mut d = Desc::new();
        d.lane([&prog(&a)], 1).unwrap();
        assert!(d.gpu_fences());
        d.lane([&prog(&b)], 1).unwrap();
        assert!(!d.gpu_fences());
        assert!(!Desc::new().gpu_fences(), "no connection: nothing to fence");
    }

    /// Broadcasts split across 3 channels, on 2 and on 4 ranks, in one launch: the root's
    /// lanes each send on one ring connection, the last rank's each receive on one, the middle
    /// ranks' use two. Each channel's lanes come together, channel by channel, rank by rank
    /// (a chain's ends with its middle), so a device that holds one ring's lanes at once ends
    /// the launch.
    #[test]
    fn a_split_chain_keeps_each_channel_together() {
        for n in [2usize, 4] {
            let mut lanes = Vec::new();
            for r in 0..n {
                for c in 0..3 {
                    let mut ends = Vec::new();
                    if r > 0 {
                        ends.push((r, r - 1, false, Class::ring(c)));
                    }
                    if r + 1 < n {
                        ends.push((r, r + 1, true, Class::ring(c)));
                    }
                    lanes.push((lane_key(ends, n, 7, c, r), (c, r)));
                }
            }
            lanes.sort_by_key(|l| l.0);
            let order: Vec<(usize, usize)> = lanes.iter().map(|l| l.1).collect();
            let want: Vec<(usize, usize)> =
                (0..3).flat_map(|c| (0..n).map(move |r| (c, r))).collect();
            assert_eq!(order, want, "{n} ranks");
        }
        // Another communicator's lanes never come between one communicator's.
        let a = lane_key([(0, 1, true, Class::Ring3)], 2, 1, 0, 0);
        let b = lane_key([], 2, 2, 0, 0);
        assert!(a < b);
    }

    /// A rank with lanes of two classes to one peer in one launch (an all-to-all's and a
    /// send's, both ends on this device): each connection's two ends still go together, so a
    /// device that holds two lanes ends it. A chain's end lanes (one ring connection each) come
    /// after the pairs, with the chain's middle.
    #[test]
    fn lanes_of_two_classes_to_one_peer_pair_up() {
        let mut lanes = Vec::new();
        for (class, what) in [(Class::Direct, "a2a"), (P2P, "send")] {
            lanes.push((
                lane_key([(0, 1, true, class)], 2, 0, 0, 0),
                format!("{what} 0"),
            ));
            lanes.push((
                lane_key([(1, 0, false, class)], 2, 0, 0, 1),
                format!("{what} 1"),
            ));
        }
        lanes.push((lane_key([(0, 1, true, RING)], 2, 0, 0, 0), "chain 0".into()));
        lanes.push((
            lane_key([(1, 0, false, RING)], 2, 0, 0, 1),
            "chain 1".into(),
        ));
        lanes.sort_by_key(|l| l.0);
        let names: Vec<&str> = lanes.iter().map(|l| l.1.as_str()).collect();
        assert_eq!(
            names,
            ["send 0", "send 1", "a2a 0", "a2a 1", "chain 0", "chain 1"]
        );
    }

    /// One rank's split all-reduce fits the ordinary parameter on 2 ranks with 4 channels,
    /// not on 8 (4016 bytes), where 3 do; 1 always.
    #[test]
    fn channels_fit_the_parameter() {
        assert_eq!(channels_that_fit(2, 4), 4);
        assert_eq!(channels_that_fit(8, 4), 3);
        assert_eq!(channels_that_fit(8, 1), 1);
        assert_eq!(channels_that_fit(1000, 4), 1);
        for n in [2, 3, 4, 8, 16] {
            let c = channels_that_fit(n, 4);
            assert!(descriptor_bytes(2 * c, c, c * (2 * n - 1), c) <= PARAM_BYTES || c == 1);
        }
    }

    /// Which steps send by reference (`mark_refs`): on a connection between kernels of this
    /// process on one GPU, past a FIFO's worth of slots, the source of a send and the finished
    /// destination of a forwarding step, unless another step of the program writes it or the
    /// slice needs its pre-multiplication; nothing otherwise.
    #[test]
    fn sends_by_reference_only_where_the_memory_stays() {
        let (gpu, apart) = (
            conn("oxccl-desc-ref-a", true),
            conn("oxccl-desc-ref-b", false),
        );
        let step = |prim, c: &Arc<Conn>, src: usize, dst: usize, len: usize| Step {
            prim,
            recv: (prim != Prim::Send).then(|| c.clone()),
            send: (prim != Prim::Recv).then(|| c.clone()),
            src: Addr::user(src),
            dst: Addr::user(dst),
            len,
            prep: prim == Prim::Send,
        };
        // A ring all-reduce's shape over 2 ranks (send my half, reduce and pass on the other,
        // receive my half's result), out of place (`dst` 0x100000) or in place, `len`
        // elements a step and 8 a slice: 2 len / 8 slots sent on the connection, 4 in its FIFO.
        let flags = |c: &Arc<Conn>, dst: usize, len: usize, red: Option<RedSpec>| -> Vec<u32> {
            let prog: DevProgram = Program {
                steps: vec![
                    step(Prim::Send, c, 0x1000, 0, len),
                    step(
                        Prim::RecvReduceCopySend,
                        c,
                        0x1000 + 4 * len,
                        dst + 4 * len,
                        len,
                    ),
                    step(Prim::Recv, c, 0, dst, len),
                ],
                esize: 4,
                slice: 8,
                niter: len.div_ceil(8),
                red,
                call: [1, 2],
            };
            let mut d = Desc::new();
            d.lane([&prog], 1).unwrap();
            d.steps.iter().map(|s| s.prep & !1).collect()
        };
        let sum = |premul: Option<u64>| {
            Some(RedSpec::Ready(Reduction {
                dtype: DataType::Float32,
                kind: ReduceKind::Sum,
                premul: premul.map(|bits| crate::types::Scalar { bits }),
                postdiv: None,
            }))
        };
        assert_eq!(
            flags(&gpu, 0x100000, 64, sum(None)),
            [STEP_REF_SRC, STEP_REF_DST, 0]
        );
        // In place, the first step's source is the last step's destination.
        assert_eq!(flags(&gpu, 0x1000, 64, sum(None)), [0, STEP_REF_DST, 0]);
        // A slice to scale before it goes.
        assert_eq!(
            flags(&gpu, 0x100000, 64, sum(Some(1))),
            [0, STEP_REF_DST, 0]
        );
        // Within the FIFO (2 slots of 8 each step): as before, the bytes go in the slots.
        assert_eq!(flags(&gpu, 0x100000, 16, sum(None)), [0, 0, 0]);
        // The receiver is not a kernel of this process on this GPU.
        assert_eq!(flags(&apart, 0x100000, 64, sum(None)), [0, 0, 0]);
        for name in ["oxccl-desc-ref-a", "oxccl-desc-ref-b"] {
            inproc::forget(name);
        }
    }

    /// To a kernel of another process on this GPU (`Conn::peer_process`), only memory that
    /// process opened (`registered`) goes by reference, and on a connection only memory it sees
    /// at one offset (the connection's, which the kernels add): here a ring all-reduce's
    /// source and destination, two allocations.
    #[test]
    fn sends_by_reference_to_another_process_where_it_opened_the_memory() {
        let name = "oxccl-desc-ref-p";
        let mut c = conn(name, false);
        Arc::get_mut(&mut c).unwrap().peer_process = Some(77);
        let step = |prim, src: usize, dst: usize| Step {
            prim,
            recv: (prim != Prim::Send).then(|| c.clone()),
            send: (prim != Prim::Recv).then(|| c.clone()),
            src: Addr::user(src),
            dst: Addr::user(dst),
            len: 64,
            prep: prim == Prim::Send,
        };
        let prog: DevProgram = Program {
            steps: vec![
                step(Prim::Send, 0x1000, 0),
                step(Prim::RecvReduceCopySend, 0x1100, 0x100100),
                step(Prim::Recv, 0, 0x100000),
            ],
            esize: 4,
            slice: 8,
            niter: 8,
            red: None,
            call: [1, 2],
        };
        // (The offsets of the source's allocation and the destination's, where opened.)
        let marks = |peer: bool, src: Option<i64>, dst: Option<i64>| {
            let (mut steps, mut progs) = (Vec::new(), Vec::new());
            encode_program(&prog, &mut steps, &mut progs, |c| {
                Ok(if c.is_some() { 0 } else { NONE })
            })
            .unwrap();
            let mut offsets = SmallVec::new();
            mark_refs(&prog, &mut steps, peer, &mut offsets, |key, at, _| {
                assert_eq!(key, 77, "the receiving process's key");
                if at < 0x100000 {
                    src
                } else {
                    dst
                }
            });
            let flags: Vec<u32> = steps.iter().map(|s| s.prep & !1).collect();
            (flags, offsets.to_vec())
        };
        assert_eq!(
            marks(true, Some(0x5000), Some(-0x9000)),
            (vec![STEP_REF_SRC | STEP_REF_PEER, 0, 0], vec![(0, 0x5000)]),
            "one offset a connection: the first step's"
        );
        assert_eq!(
            marks(true, Some(0x5000), Some(0x5000)),
            (
                vec![
                    STEP_REF_SRC | STEP_REF_PEER,
                    STEP_REF_DST | STEP_REF_PEER,
                    0
                ],
                vec![(0, 0x5000)]
            )
        );
        assert_eq!(
            marks(true, None, Some(-0x9000)),
            (vec![0, STEP_REF_DST | STEP_REF_PEER, 0], vec![(0, -0x9000)])
        );
        assert_eq!(marks(true, None, None), (vec![0, 0, 0], vec![]));
        // A captured launch (or nothing registered): the offsets are not even asked for.
        assert_eq!(marks(false, Some(1), Some(1)), (vec![0, 0, 0], vec![]));
        inproc::forget(name);
    }
}
