//! One typed registry of every knob: environment variables (NCCL's and `OXCCL_*`), read once.
//! Later: `NCCL_CONF_FILE`, `~/.nccl.conf`, `/etc/nccl.conf` and the `ncclParam*` API.

use std::time::Duration;

/// A parameter: name, documentation, default.
pub struct Param {
    pub name: &'static str,
    pub doc: &'static str,
    pub default: &'static str,
}

pub const PARAMS: &[Param] = &[
    Param {
        name: "NCCL_DEBUG",
        doc: "log level: VERSION, WARN, INFO, TRACE",
        default: "",
    },
    Param {
        name: "OXCCL_DEVICE",
        doc: "executor: 'host' forces the host executor",
        default: "",
    },
    Param {
        name: "OXCCL_TIMEOUT_S",
        doc: "seconds an operation waits for a peer that is alive but makes no progress before \
              ncclTimeout (unset or 0: as long as the peer lives, as NCCL does; peers that died \
              are found without it), and the bound of the rendezvous (init, split, shrink) and \
              of bootstrap sends: 300 s where unset",
        default: "",
    },
    Param {
        name: "OXCCL_BOOTSTRAP_CONNECT_S",
        doc: "seconds a rank keeps trying to connect to a bootstrap root or peer that refuses or \
              does not answer before it gives up with ncclTimeout (never longer than \
              OXCCL_TIMEOUT_S)",
        default: "30",
    },
    Param {
        name: "OXCCL_WATCHDOG_S",
        doc: "seconds without progress after which a waiting operation (or CUDA kernels, or a \
              bootstrap wait, or a unique id's root) logs a WARN naming what it waits for \
              (0: never)",
        default: "30",
    },
    Param {
        name: "OXCCL_CHUNK_BYTES",
        doc: "bytes per FIFO slot of a connection (unset: 128 KiB, 512 KiB for a communicator across hosts, 1 MiB on the CUDA executor; rank 0's value counts)",
        default: "131072",
    },
    Param {
        name: "OXCCL_NSTEPS",
        doc: "slots per connection FIFO",
        default: "8",
    },
    Param {
        name: "OXCCL_STREAM_BYTES",
        doc: "outputs of at least this many bytes (per rank) are written with streaming stores",
        default: "8388608",
    },
    Param {
        name: "OXCCL_INLINE_US",
        doc: "microseconds a thread launching on an idle host stream runs the work itself first",
        default: "50",
    },
    Param {
        name: "OXCCL_FIFO_STREAM",
        doc: "how ring senders fill FIFO slots that a peer on this host reads: auto (measured), 0 (ordinary stores), 1 (streaming stores); slots sent over the network always take ordinary stores",
        default: "auto",
    },
    Param {
        name: "OXCCL_CMA",
        doc: "1 lets cross-memory attach (process_vm_readv/writev) compete with the ring for large direct operations on other processes' ordinary buffers (off by default)",
        default: "0",
    },
    Param {
        name: "OXCCL_CMA_MIN_BYTES",
        doc: "smallest operation (bytes of its vector) for which cross-memory attach competes with the ring (K/M/G suffixes)",
        default: "16777216",
    },
    Param {
        name: "NCCL_P2P_DISABLE",
        doc: "1: on the CUDA executor, connections between ranks stage data in pinned host memory instead of device memory (one GPU's, or that of two GPUs NCCL_P2P_LEVEL lets share it)",
        default: "0",
    },
    Param {
        name: "NCCL_P2P_LEVEL",
        doc: "CUDA executor: the farthest two GPUs that reach each other's memory (cuDeviceCanAccessPeer) may be apart to keep their connections in device memory, as in NCCL: LOC (or 0) never (as NCCL_P2P_DISABLE=1); NVL or NVB over NVLink only (native peer atomics); PIX (1) one PCIe switch between them, PXB (2) several, PHB (3) through the CPU's host bridges on one NUMA node, SYS (4, 5) across NUMA nodes; NVLink always qualifies. The PCIe distance is read from sysfs (OXCCL_SYSFS_ROOT); unknown counts as SYS. Farther pairs stage in pinned host memory. Default PXB (NCCL's on most machines)",
        default: "",
    },
    Param {
        name: "NCCL_CUMEM_ENABLE",
        doc: "CUDA executor: ncclMemAlloc takes memory from the driver's virtual memory management (cuMemCreate, exportable as a POSIX file descriptor, mapped read-write), as NCCL does where it can (NCCL's default is automatic; any value but 0, NCCL's -2 included, means on here); 0: cuMemAlloc",
        default: "1",
    },
    Param {
        name: "OXCCL_CUDA_COPY_KERNEL",
        doc: "1: on the CUDA executor, the plain copies that `OXCCL_CUDA_CE_COPY_BYTES` (when not 0) gives to a kernel (a one-rank collective out of place) go to a kernel that only copies (the runner's copy loop without its dispatch: few registers, no spills) rather than the general wide kernel (default 0; with `OXCCL_CUDA_CE_COPY_BYTES` at its default every such copy is on the copy engine and this does nothing)",
        default: "0",
    },
    Param {
        name: "OXCCL_CUDA_DIRECT",
        doc: "CUDA executor: a group holding an all-reduce of every rank of a communicator on one GPU (ncclCommInitAll with a repeated device, all_reduce_perf -g N) runs it as one kernel that reads every rank's input and writes every rank's output once; where every rank is in this process on one GPU but they launch apart (a thread per rank, all_reduce_perf -t N), their all-reduces, reduces, broadcasts, all-gathers and reduce-scatters meet on the communicator's device board and read and write every buffer once too (default 1; 0: the ring, which moves every byte through FIFO slots n - 1 times). On an H100 the one kernel reached 100% of the bandwidth limit of 2 ranks on one GPU where the ring reached 9%; the board has not run on a GPU yet",
        default: "1",
    },
    Param {
        name: "NCCL_P2P_DIRECT_DISABLE",
        doc: "1: on the CUDA executor, what goes through a connection's FIFO between ranks of this process is copied into its slots, never read from the sender's buffer. Otherwise (the default), where both ends of a connection are kernels of this process on one GPU and a program sends more slots on it than its FIFO holds (OXCCL_NSTEPS slots of the communicator's slot bytes: 8 of 1 MiB by default), the steps that send a caller's buffer (or scratch) as it is send its address instead of its bytes, and the receiving kernel reads them there (one copy instead of two; the sending kernel then waits at its program's end until the receiver has read them). The device board and the one-kernel all-reduce read peers' buffers whatever this says (OXCCL_CUDA_DIRECT=0 turns them off)",
        default: "0",
    },
    Param {
        name: "OXCCL_SYSFS_ROOT",
        doc: "where the CUDA executor reads the PCIe tree (bus/pci/devices/<GPU's bus id>, a link into devices/pci...) to tell how far apart two GPUs are (NCCL_P2P_LEVEL): for containers that mount sysfs elsewhere, and tests",
        default: "/sys",
    },
    Param {
        name: "OXCCL_CUDA_IPC",
        doc: "on the CUDA executor, connections between processes of one PID namespace whose ranks share one GPU, or sit on two GPUs that reach each other's memory, live in the receiving end's device memory, which the sending end opens by CUDA IPC (as NCCL's P2P/IPC); 0: in pinned host memory instead (as NCCL_P2P_DISABLE=1 does for every pair)",
        default: "1",
    },
    Param {
        name: "OXCCL_CUDA_BLOCKS",
        doc: "most blocks of a CUDA kernel per lane (one rank's collective) where its connections are in device memory: each step is shared out among them (1 to 64)",
        default: "8",
    },
    Param {
        name: "OXCCL_CUDA_CHANNELS",
        doc: "CUDA executor: the rings (1 to 4) a large all-reduce, broadcast or reduce on the ring is split across, each on connections of its own and run at once by lanes of one kernel, at least 256 KiB each (default 1 until the GPU check has measured more; rank 0's value holds for a communicator)",
        default: "1",
    },
    Param {
        name: "OXCCL_CUDA_FENCE",
        doc: "CUDA executor: gpu: where every connection of a launch has both ends on one GPU, in its memory, the runner publishes and takes steps with device-scope fences instead of system-scope ones (default sys until the GPU check has measured it)",
        default: "sys",
    },
    Param {
        name: "OXCCL_NET_ZERO_COPY",
        doc: "0: the host executor copies what it sends to another host into the connection's slots; 1 (default): the socket takes it from the caller's buffer (a later step that writes where a slot not yet sent refers first copies it into the slot; not with NCCL_SOCKET_NTHREADS > 1 or a net plugin)",
        default: "1",
    },
    Param {
        name: "OXCCL_CUDA_CE_COPY_BYTES",
        doc: "CUDA executor: plain copies (a one-rank collective out of place) go to the copy engine (cuMemcpyDtoDAsync, as NVIDIA's NCCL makes them); when this is not 0, those of this many bytes and more go to a kernel instead (K/M/G suffixes; 0, the default: every copy on the copy engine)",
        default: "0",
    },
    Param {
        name: "NCCL_GRAPH_MIXING_SUPPORT",
        doc: "CUDA executor; when set, overrides `ncclConfig_t.graphUsageMode` (whose default is 2) as NCCL does: 1 is mode 2: a communicator's CUDA graph replays and eager launches run in the order they are issued, whatever their streams (event record and wait nodes in its graphs); 0 is mode 0: no such nodes (for graphs launched from the device or whose collectives sit in conditional or loop bodies, which may not hold them; the program orders replays and eager calls itself, and lets its replays end before destroying the communicator; a capture logs an INFO line, since mode 0 promises none; mode 1, from the config, is the same without the line)",
        default: "1",
    },
    Param {
        name: "OXCCL_RUN_AHEAD",
        doc: "0: step programs run strictly slice after slice (no run-ahead across iterations)",
        default: "1",
    },
    Param {
        name: "NCCL_ALGO",
        doc: "algorithms allowed, NCCL's syntax: Ring, Direct, Tree (a comma list, ^ to exclude, per collective as allreduce:ring;broadcast:direct); Tree is the hierarchical all-reduce across hosts, Direct also the exchange of 2 ranks on 2 hosts (chosen below 8 MiB; Direct without Ring asks for it at any size); a list naming none of a collective's candidates (NVLS, ...) leaves oxccl its choice",
        default: "",
    },
    Param {
        name: "NCCL_NSOCKS_PERTHREAD",
        doc: "sockets per network connection and thread: a connection uses NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS sockets (at most 64), each slot cut into parts that travel at once; the receiving end's value counts",
        default: "1",
    },
    Param {
        name: "NCCL_SOCKET_NTHREADS",
        doc: "threads per end of a network connection (at most 16): its NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS sockets are split into this many groups; the thread driving the connection (the executor's or the proxy's) moves the first, a helper thread each of the others (each end decides for itself; the default 1 was measured here: see the README)",
        default: "1",
    },
    Param {
        name: "OXCCL_FAULT",
        doc: "fault injection for tests: 'corrupt' flips a bit in every reduction result",
        default: "",
    },
];

fn raw(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Whether the environment (or nccl.conf) sets `name`.
pub fn is_set(name: &str) -> bool {
    raw(name).is_some()
}

pub fn get_str(name: &str) -> Option<String> {
    raw(name).or_else(|| {
        PARAMS
            .iter()
            .find(|p| p.name == name && !p.default.is_empty())
            .map(|p| p.default.to_string())
    })
}

/// A number, optionally with a K, M or G suffix (powers of 1024), as the perf tools take sizes.
fn parse_u64(v: &str) -> Option<u64> {
    let v = v.trim();
    let (digits, mult) = match v.char_indices().last()? {
        (i, 'k' | 'K') => (&v[..i], 1u64 << 10),
        (i, 'm' | 'M') => (&v[..i], 1 << 20),
        (i, 'g' | 'G') => (&v[..i], 1 << 30),
        _ => (v, 1),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(mult)
}

pub fn get_u64(name: &str) -> u64 {
    get_str(name)
        .and_then(|v| parse_u64(&v))
        .unwrap_or_else(|| {
            PARAMS
                .iter()
                .find(|p| p.name == name)
                .and_then(|p| p.default.parse().ok())
                .unwrap_or(0)
        })
}

pub fn nccl_debug_subsys() -> Option<String> {
    raw("NCCL_DEBUG_SUBSYS")
}

pub fn nccl_debug() -> Option<String> {
    raw("NCCL_DEBUG")
}

/// How long an operation may wait for a live peer that does not move (`OXCCL_TIMEOUT_S`);
/// None: as long as it lives. Peers that die, close their connections, abort or fall silent
/// across hosts are found by the operations' health checks, whatever this says.
pub fn timeout() -> Option<Duration> {
    static T: once_cell::sync::Lazy<Option<Duration>> = once_cell::sync::Lazy::new(|| {
        Some(get_u64("OXCCL_TIMEOUT_S"))
            .filter(|&s| s > 0)
            .map(|s| Duration::from_secs(s).min(FOREVER))
    });
    *T
}

/// The length of a wait with no bound (`OXCCL_TIMEOUT_S` unset): a century, so that its
/// deadline is still a plain `Instant` that nothing reaches.
pub const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `timeout` as the length of a `health::Wait`: unbounded is [`FOREVER`].
pub fn wait_limit() -> Duration {
    timeout().unwrap_or(FOREVER)
}

/// The bound of the waits that have one whatever `OXCCL_TIMEOUT_S` says (that, else 300 s):
/// - setup: the bootstrap's rendezvous (init, split, shrink) and its sends, and a connection's
///   setup once both ends have their peer's blob. In the rendezvous a peer that died before it
///   ever came cannot be told from a late one (no process or link to watch yet). A wait for a
///   peer's bootstrap message after the rendezvous has no such bound ([`wait_limit`]): it
///   watches the peer;
/// - a communicator that stops (aborted, failed) waiting for its own work to stop, and its
///   last sends to leave at its end. Its kernels and threads stop at once when told; this
///   bounds what they wait behind (a stream another kernel holds).
pub fn bound() -> Duration {
    timeout().unwrap_or(Duration::from_secs(300))
}

/// How long connecting to a bootstrap root or peer may be retried (`OXCCL_BOOTSTRAP_CONNECT_S`,
/// at least 1 s); every wait also stops at its own timeout.
pub fn bootstrap_connect() -> Duration {
    static T: once_cell::sync::Lazy<Duration> = once_cell::sync::Lazy::new(|| {
        Duration::from_secs(get_u64("OXCCL_BOOTSTRAP_CONNECT_S").max(1))
    });
    *T
}

/// How long an operation may wait without progress before it says so (None: never).
pub fn watchdog() -> Option<Duration> {
    static T: once_cell::sync::Lazy<Option<Duration>> = once_cell::sync::Lazy::new(|| {
        Some(get_u64("OXCCL_WATCHDOG_S"))
            .filter(|&s| s > 0)
            .map(Duration::from_secs)
    });
    *T
}

pub fn chunk_bytes() -> usize {
    static B: once_cell::sync::Lazy<usize> = once_cell::sync::Lazy::new(|| {
        (get_u64("OXCCL_CHUNK_BYTES") as usize).clamp(4096, 64 << 20) & !63
    });
    *B
}

pub fn nsteps() -> usize {
    static N: once_cell::sync::Lazy<usize> =
        once_cell::sync::Lazy::new(|| (get_u64("OXCCL_NSTEPS") as usize).clamp(2, 64));
    *N
}

/// How long a launch on an idle host stream runs the work on the calling thread first.
pub fn inline_budget() -> Duration {
    static B: once_cell::sync::Lazy<Duration> =
        once_cell::sync::Lazy::new(|| Duration::from_micros(get_u64("OXCCL_INLINE_US")));
    *B
}

/// Whether direct algorithms may use cross-memory attach for other processes' buffers
/// (`OXCCL_CMA=1`). Off by default: on the 2-core VMs measured, it never beat the ring (4-5 GB/s
/// against 5-10 at 256 MiB, 2 processes), and letting the two compete cost more than it could
/// win: 256 MiB allreduces ran faster with it off in 10 of 12 paired rounds (5.96 against 4.91
/// GB/s busbw on average).
pub fn cma_enabled() -> bool {
    static C: once_cell::sync::Lazy<bool> =
        once_cell::sync::Lazy::new(|| get_u64("OXCCL_CMA") != 0);
    *C
}

/// The smallest operation that reaches other processes' buffers by cross-memory attach.
pub fn cma_min_bytes() -> usize {
    static B: once_cell::sync::Lazy<usize> =
        once_cell::sync::Lazy::new(|| get_u64("OXCCL_CMA_MIN_BYTES") as usize);
    *B
}

/// `OXCCL_FIFO_STREAM`: Some(forced choice), or None to measure (see `plan::tune`).
pub fn fifo_stream() -> Option<bool> {
    static F: once_cell::sync::Lazy<Option<bool>> =
        once_cell::sync::Lazy::new(|| match get_str("OXCCL_FIFO_STREAM").as_deref() {
            Some("0") => Some(false),
            Some("1") => Some(true),
            _ => None,
        });
    *F
}

/// `OXCCL_NET_ZERO_COPY=0`: the host executor copies what it sends to another host into the
/// connection's slots, rather than let the socket take it from the caller's buffers.
pub fn net_zero_copy() -> bool {
    static Z: once_cell::sync::Lazy<bool> =
        once_cell::sync::Lazy::new(|| get_u64("OXCCL_NET_ZERO_COPY") != 0);
    *Z
}

/// A parameter the CUDA executor consults at each launch: read once, as the others, but read
/// again after `reread` (tests switch these within one process). Two reads of the environment
/// a call were a fifth of a one-rank call's host-side instructions (getenv scans every
/// variable, under a lock: `CUDA=1 scripts/launch-cost.sh`).
struct PerLaunch {
    name: &'static str,
    /// How the variable's value reads as a number (`get_u64`'s, unless said otherwise).
    read: fn(&str) -> u64,
    /// The value, or `UNREAD`.
    value: std::sync::atomic::AtomicU64,
}

const UNREAD: u64 = u64::MAX;

impl PerLaunch {
    const fn new(name: &'static str) -> PerLaunch {
        PerLaunch::read_by(name, get_u64)
    }

    const fn read_by(name: &'static str, read: fn(&str) -> u64) -> PerLaunch {
        PerLaunch {
            name,
            read,
            value: std::sync::atomic::AtomicU64::new(UNREAD),
        }
    }

    fn get(&self) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        match self.value.load(Relaxed) {
            UNREAD => {
                let v = (self.read)(self.name).min(UNREAD - 1);
                self.value.store(v, Relaxed);
                v
            }
            v => v,
        }
    }
}

static CUDA_CE_COPY_BYTES: PerLaunch = PerLaunch::new("OXCCL_CUDA_CE_COPY_BYTES");
static CUDA_COPY_KERNEL: PerLaunch = PerLaunch::new("OXCCL_CUDA_COPY_KERNEL");
static CUDA_DIRECT: PerLaunch = PerLaunch::new("OXCCL_CUDA_DIRECT");
static CUDA_CHANNELS: PerLaunch = PerLaunch::new("OXCCL_CUDA_CHANNELS");
static P2P_DIRECT_DISABLE: PerLaunch = PerLaunch::new("NCCL_P2P_DIRECT_DISABLE");
/// `OXCCL_CUDA_FENCE`: 0 sys (or unset), 1 gpu, 2 neither.
static CUDA_FENCE: PerLaunch = PerLaunch::read_by("OXCCL_CUDA_FENCE", |name| match get_str(name) {
    None => 0,
    Some(v) if v.eq_ignore_ascii_case("sys") => 0,
    Some(v) if v.eq_ignore_ascii_case("gpu") => 1,
    Some(_) => 2,
});

/// Has the CUDA executor's per-launch parameters (`OXCCL_CUDA_CE_COPY_BYTES`,
/// `OXCCL_CUDA_COPY_KERNEL`, `OXCCL_CUDA_DIRECT`, `OXCCL_CUDA_CHANNELS`, `OXCCL_CUDA_FENCE`,
/// `NCCL_P2P_DIRECT_DISABLE`) read from the environment again at their next use: for tests
/// that change them between launches.
#[doc(hidden)]
pub fn reread() {
    for p in [
        &CUDA_CE_COPY_BYTES,
        &CUDA_COPY_KERNEL,
        &CUDA_DIRECT,
        &CUDA_CHANNELS,
        &CUDA_FENCE,
        &P2P_DIRECT_DISABLE,
    ] {
        p.value.store(UNREAD, std::sync::atomic::Ordering::Relaxed);
    }
}

/// `OXCCL_CUDA_CE_COPY_BYTES`: 0 (every plain copy on the copy engine), or the size from which
/// a plain copy goes to a kernel instead (see `PerLaunch`).
pub fn cuda_ce_copy_bytes() -> u64 {
    CUDA_CE_COPY_BYTES.get()
}

/// `OXCCL_CUDA_DIRECT`: a group of every rank of a communicator on one device runs its
/// all-reduce as one kernel (see `PerLaunch`).
pub fn cuda_direct() -> bool {
    CUDA_DIRECT.get() != 0
}

/// Not `NCCL_P2P_DIRECT_DISABLE=1`: the CUDA executor's kernels may read the buffers of ranks
/// of their process (`exec::cuda::desc`'s sends by reference).
pub fn p2p_direct() -> bool {
    P2P_DIRECT_DISABLE.get() == 0
}

/// Whether step programs may run later slices ahead of blocked earlier ones.
pub fn run_ahead() -> bool {
    static R: once_cell::sync::Lazy<bool> =
        once_cell::sync::Lazy::new(|| get_u64("OXCCL_RUN_AHEAD") != 0);
    *R
}

/// `NCCL_P2P_DISABLE=1`, or `NCCL_P2P_LEVEL=LOC`: no device-memory connections between ranks
/// (host-staged instead).
pub fn p2p_disabled() -> bool {
    static R: once_cell::sync::Lazy<bool> = once_cell::sync::Lazy::new(|| {
        p2p_off(
            get_u64("NCCL_P2P_DISABLE"),
            get_str("NCCL_P2P_LEVEL").as_deref(),
        )
    });
    *R
}

/// `p2p_disabled` from the two variables' values: NCCL_P2P_LEVEL's LOC (or 0) is NCCL's
/// "never"; its other levels (NVL, PIX, PXB, PHB, SYS or 1 to 5) allow at least NVLink.
fn p2p_off(disable: u64, level: Option<&str>) -> bool {
    disable != 0 || level_is(level, &["LOC", "0"])
}

fn level_is(level: Option<&str>, names: &[&str]) -> bool {
    level.is_some_and(|l| names.contains(&l.trim().to_ascii_uppercase().as_str()))
}

/// The farthest PCIe distance (`gpu::topo::Level` as a number: 1 PIX, 2 PXB, 3 PHB, 4 SYS)
/// over which two GPUs share device memory, from `NCCL_P2P_LEVEL`: 0 for NVL or NVB (NVLink
/// only, told by native peer atomics); PXB where unset, as NCCL's default on most machines
/// (not through the CPU's host bridges). LOC is `p2p_disabled`.
pub fn p2p_max_pcie() -> u8 {
    static R: once_cell::sync::Lazy<u8> =
        once_cell::sync::Lazy::new(|| max_pcie(get_str("NCCL_P2P_LEVEL").as_deref()));
    *R
}

/// `NCCL_P2P_LEVEL`'s names by `p2p_max_pcie` number (the first of each is what messages say).
const P2P_LEVELS: [(&[&str], u8); 5] = [
    (&["NVL", "NVB", "LOC"], 0),
    (&["PIX"], 1),
    (&["PXB"], 2),
    (&["PHB"], 3),
    (&["SYS"], 4),
];

/// The name of `p2p_max_pcie`'s number `n` (4 and up: SYS).
pub fn p2p_level_name(n: u8) -> &'static str {
    P2P_LEVELS[usize::from(n.min(4))].0[0]
}

/// `p2p_max_pcie` from the variable's value (NCCL's old numbers: 1 PIX .. 4 and up SYS).
fn max_pcie(level: Option<&str>) -> u8 {
    if let Some(n) = level.and_then(|l| l.trim().parse::<i64>().ok()) {
        return n.clamp(0, 4) as u8;
    }
    // (Numbers were taken above.)
    P2P_LEVELS
        .iter()
        .find(|(names, _)| level_is(level, names))
        .map_or(2, |&(_, n)| n)
}

/// Output size from which copies into the caller's buffers use streaming stores.
pub fn stream_bytes() -> usize {
    static B: once_cell::sync::Lazy<usize> =
        once_cell::sync::Lazy::new(|| get_u64("OXCCL_STREAM_BYTES") as usize);
    *B
}

/// `OXCCL_FAULT=corrupt`: spoil every collective's output on purpose (tests of result checks).
pub fn fault_corrupt() -> bool {
    static F: once_cell::sync::Lazy<bool> =
        once_cell::sync::Lazy::new(|| raw("OXCCL_FAULT").as_deref() == Some("corrupt"));
    *F
}

/// An `NCCL_ALGO` / `NCCL_PROTO` value in NCCL's syntax: a comma list of names (any case),
/// `^` first to exclude them instead, optionally per collective:
/// `allreduce:tree,ring;broadcast:ring` (a collective without a rule of its own takes the rule
/// without a collective, if any, else everything is allowed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// (collective or None for all, excluding, names), all lower case.
    rules: Vec<(Option<String>, bool, Vec<String>)>,
}

impl Selection {
    pub fn parse(v: &str) -> Selection {
        let mut rules = Vec::new();
        for part in v.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (coll, list) = match part.split_once(':') {
                Some((c, l)) => (Some(c.trim().to_ascii_lowercase()), l.trim()),
                None => (None, part),
            };
            let (exclude, list) = match list.strip_prefix('^') {
                Some(l) => (true, l),
                None => (false, list),
            };
            let names = list
                .split(',')
                .map(|n| n.trim().to_ascii_lowercase())
                .filter(|n| !n.is_empty())
                .collect();
            rules.push((coll, exclude, names));
        }
        Selection { rules }
    }

    /// The rule for collective `coll` (lower case): (excluding, names).
    fn rule(&self, coll: &str) -> Option<(bool, &[String])> {
        let pick = |c: Option<&str>| {
            self.rules
                .iter()
                .find(|(rc, _, _)| rc.as_deref() == c)
                .map(|(_, ex, n)| (*ex, n.as_slice()))
        };
        pick(Some(coll)).or_else(|| pick(None))
    }

    /// Whether `name` may serve `coll`, where `ours` are the names the library has: a list that
    /// names only algorithms it lacks (NCCL's Tree, NVLS, ...) leaves the choice among its own.
    pub fn allows(&self, coll: &str, name: &str, ours: &[&str]) -> bool {
        match self.rule(coll) {
            None => true,
            Some((true, names)) => !names.iter().any(|n| n == name),
            Some((false, names)) => {
                names.iter().any(|n| n == name) || !names.iter().any(|n| ours.contains(&n.as_str()))
            }
        }
    }

    /// Every name the value uses (for checking them against the known ones).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.rules
            .iter()
            .flat_map(|(_, _, n)| n.iter().map(String::as_str))
    }
}

/// The raw value of `NCCL_ALGO` (or `OXCCL_ALGO=ring`, an older spelling of `NCCL_ALGO=Ring`).
pub fn algo_value() -> Option<String> {
    raw("NCCL_ALGO").or_else(|| raw("OXCCL_ALGO").filter(|v| v.eq_ignore_ascii_case("ring")))
}

/// The raw value of `NCCL_PROTO`.
pub fn proto_value() -> Option<String> {
    raw("NCCL_PROTO")
}

/// `OXCCL_HEARTBEAT_S`: how long a peer on another host may stay silent (no data, no heartbeat:
/// idle network connections carry one a second) while an operation waits on it before that is
/// an error (default 5; 0: only the timeout).
pub fn heartbeat() -> Option<Duration> {
    static T: once_cell::sync::Lazy<Option<Duration>> = once_cell::sync::Lazy::new(|| {
        let v = match get_str("OXCCL_HEARTBEAT_S") {
            Some(s) => s.trim().parse().unwrap_or(5),
            None => 5,
        };
        (v > 0).then(|| Duration::from_secs(v))
    });
    *T
}

/// Whether connections between processes may live in device memory opened by CUDA IPC
/// (`OXCCL_CUDA_IPC`, on unless 0).
pub fn cuda_ipc() -> bool {
    static B: once_cell::sync::Lazy<bool> =
        once_cell::sync::Lazy::new(|| get_u64("OXCCL_CUDA_IPC") != 0);
    *B
}

/// `OXCCL_CUDA_COPY_KERNEL=1`: the plain copies given to a kernel by the copy kernel (see
/// `PerLaunch`).
pub fn cuda_copy_kernel() -> bool {
    CUDA_COPY_KERNEL.get() != 0
}

/// `OXCCL_CUDA_FENCE`: the scope of the CUDA runner's step fences where a launch's
/// connections allow device scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// `sys`, or unset: system scope.
    Sys,
    /// `gpu`: device scope.
    Gpu,
    /// Anything else: system scope (the executor says so).
    Unknown,
}

/// `OXCCL_CUDA_FENCE` (read once, and again after `reread`).
pub fn cuda_fence() -> Fence {
    match CUDA_FENCE.get() {
        1 => Fence::Gpu,
        2 => Fence::Unknown,
        _ => Fence::Sys,
    }
}

/// `OXCCL_CUDA_CHANNELS`: the rings a large ring collective is split across, at least 1 (the
/// transport's `Class::RINGS` at most, where it is used; see `plan::build::channel_parts`).
pub fn cuda_channels() -> usize {
    (CUDA_CHANNELS.get().clamp(1, 64)) as usize
}

/// The most blocks per lane of the CUDA runner (`OXCCL_CUDA_BLOCKS`, 1 to 64).
pub fn cuda_blocks() -> usize {
    static B: once_cell::sync::Lazy<usize> =
        once_cell::sync::Lazy::new(|| (get_u64("OXCCL_CUDA_BLOCKS") as usize).clamp(1, 64));
    *B
}

#[cfg(test)]
mod tests {
    use super::Selection;
    use super::{max_pcie, p2p_off, parse_u64};

    #[test]
    fn p2p_level_loc_disables_p2p() {
        assert!(!p2p_off(0, None));
        assert!(p2p_off(1, None));
        for l in ["LOC", "loc", " 0"] {
            assert!(p2p_off(0, Some(l)), "{l}");
        }
        for l in ["NVL", "PIX", "PXB", "PHB", "SYS", "1", "5"] {
            assert!(!p2p_off(0, Some(l)), "{l}");
        }
        // NCCL's names and old numbers (1 is PIX, not NVL); PXB when unset or unknown.
        for (l, n) in [
            (" nvl", 0),
            ("NVB", 0),
            ("pix", 1),
            ("1", 1),
            ("PXB", 2),
            ("2", 2),
        ] {
            assert_eq!(max_pcie(Some(l)), n, "{l}");
        }
        for (l, n) in [
            ("PHB", 3),
            ("3", 3),
            ("SYS", 4),
            ("4", 4),
            ("7", 4),
            ("", 2),
        ] {
            assert_eq!(max_pcie(Some(l)), n, "{l}");
        }
        assert_eq!(max_pcie(None), 2);
    }

    #[test]
    fn nccl_algo_syntax() {
        let ours = ["ring", "direct"];
        let s = Selection::parse("Ring");
        assert!(s.allows("allreduce", "ring", &ours) && !s.allows("allreduce", "direct", &ours));
        let s = Selection::parse("^ring");
        assert!(!s.allows("broadcast", "ring", &ours) && s.allows("broadcast", "direct", &ours));
        // Per collective, with a default for the others.
        let s = Selection::parse("allreduce:direct;broadcast:^direct; ring");
        assert!(s.allows("allreduce", "direct", &ours) && !s.allows("allreduce", "ring", &ours));
        assert!(!s.allows("broadcast", "direct", &ours) && s.allows("broadcast", "ring", &ours));
        assert!(s.allows("reduce", "ring", &ours) && !s.allows("reduce", "direct", &ours));
        // Only algorithms oxccl lacks: its own choice.
        let s = Selection::parse("Tree,NVLS");
        assert!(s.allows("allreduce", "ring", &ours) && s.allows("allreduce", "direct", &ours));
        let s = Selection::parse("tree,ring");
        assert!(s.allows("allreduce", "ring", &ours) && !s.allows("allreduce", "direct", &ours));
        assert!(Selection::parse("").allows("allreduce", "direct", &ours));
        assert_eq!(
            Selection::parse("a:x;y").names().collect::<Vec<_>>(),
            vec!["x", "y"]
        );
    }

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(parse_u64("4096"), Some(4096));
        assert_eq!(parse_u64(" 64K "), Some(64 << 10));
        assert_eq!(parse_u64("16M"), Some(16 << 20));
        assert_eq!(parse_u64("2g"), Some(2 << 30));
        assert_eq!(parse_u64("M"), None);
        assert_eq!(parse_u64("-1"), None);
        assert_eq!(parse_u64("1.5M"), None);
        assert_eq!(parse_u64("99999999999G"), None);
    }
}
