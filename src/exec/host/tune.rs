//! Choices the engine makes by measuring, not by rule, because the right answer depends on the
//! host and even on the run. On the 2-core VMs this project is measured on, data moved between
//! the two cores through cache (a FIFO slot written with ordinary stores and read by the other
//! core) runs at 6-9 GB/s in some runs and at 1.3-3.8 GB/s in others, for whole runs (OpenMPI's
//! shared memory drops the same way), while data that goes through memory (streaming stores
//! into the slot, or a kernel copy by cross-memory attach) stays at 3.5-7 GB/s. So:
//!
//! - ring senders fill FIFO slots with ordinary or with streaming stores (`Tuner::fifo`): a choice
//!   each rank makes alone, since the protocol is the same either way;
//! - with cross-memory attach turned on (`OXCCL_CMA=1`, off by default, see
//!   `param::cma_enabled`), large direct operations on other processes' `malloc` buffers use the
//!   ring or cross-memory attach (`Tuner::cma`): a collective choice, so each rank votes on the
//!   board and all derive the same verdict from the published votes (`verdict`).
//!
//! Each choice keeps a running estimate of the bandwidth seen with each option; now and then an
//! operation takes the option not chosen, so that an estimate gone stale is refreshed (exploring
//! operations are picked by sequence numbers that all ranks share). How often depends on how far
//! behind the other option is (`explore_every`): from every `EXPLORE`-th operation when the two
//! are close to every `8 * EXPLORE`-th when it is several times slower, since trying it then
//! costs the most (cached FIFO slots at 2 GB/s against streamed ones at 7 cost a quarter of the
//! bandwidth when tried one operation in eight).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// One operation in this many, at most, takes the option not chosen.
pub const EXPLORE: u64 = 8;

/// How many operations apart the option not chosen is tried, given how far behind it is
/// (`gap`: 1 - its bandwidth / the chosen one's): `EXPLORE` for a gap under a fifth, doubling
/// each further fifth, up to `8 * EXPLORE`. Always a power of two times `EXPLORE`, so ranks
/// whose estimates differ slightly still explore on the same operations most of the time.
pub fn explore_every(gap: f64) -> u64 {
    let steps = (gap.clamp(0.0, 1.0) * 5.0) as u32;
    EXPLORE << steps.min(3)
}

/// Bandwidth estimates (bytes per second, as f64 bits; 0 = not measured) of two options, and
/// how many times each was measured.
#[derive(Default)]
pub struct Estimates {
    bw: [AtomicU64; 2],
    samples: [AtomicU64; 2],
}

/// Each option is measured this many times before the estimates are compared. Twice, and the
/// second measurement replaces the first (see `record`): the first operations of a size often
/// pay for first touches (a ring's first 256 MiB measured 1 GB/s, its next ones 5-9), and a
/// first measurement must not decide alone. Every size class warms up on its own (see
/// `BySize`).
const WARM_SAMPLES: u64 = 2;

/// Measurements of the option behind before its gap sets how rarely it is tried (see `gap`).
const TRUSTED_SAMPLES: u64 = 3;
/// The largest gap of an option measured fewer times: under a fifth (see `explore_every`).
const UNTRUSTED_GAP: f64 = 0.19;

/// Weight of a new measurement in its option's estimate.
const ALPHA: f64 = 0.75;

impl Estimates {
    pub fn estimate(&self, option: usize) -> Option<f64> {
        let v = f64::from_bits(self.bw[option].load(Ordering::Relaxed));
        (v > 0.0).then_some(v)
    }

    fn samples(&self, option: usize) -> u64 {
        self.samples[option].load(Ordering::Relaxed)
    }

    /// Both options have been measured `WARM_SAMPLES` times.
    fn warm(&self) -> bool {
        self.samples(0).min(self.samples(1)) >= WARM_SAMPLES
    }

    /// Until warm, the option measured less (option 0 first).
    fn to_measure(&self) -> usize {
        usize::from(self.samples(1) < self.samples(0))
    }

    /// Records that `bytes` took `elapsed` with `option`.
    pub fn record(&self, option: usize, bytes: usize, elapsed: Duration) {
        let bw = bytes as f64 / elapsed.as_secs_f64().max(1e-9);
        let new = match self.estimate(option) {
            Some(old) if self.samples(option) > 1 => (1.0 - ALPHA) * old + ALPHA * bw,
            _ => bw,
        };
        self.bw[option].store(new.to_bits(), Ordering::Relaxed);
        self.samples[option].fetch_add(1, Ordering::Relaxed);
    }

    /// The option that looks faster; until both have been measured `WARM_SAMPLES` times, the
    /// one measured less (option 0 first).
    pub fn better(&self) -> usize {
        if !self.warm() {
            return self.to_measure();
        }
        match (self.estimate(0), self.estimate(1)) {
            (Some(a), Some(b)) => usize::from(b > a),
            _ => 0,
        }
    }

    /// The option for operation `round`: the better one, or the other on exploring rounds
    /// (once both are warm).
    pub fn pick(&self, round: u64) -> usize {
        let explore = self.warm() && round.is_multiple_of(explore_every(self.gap().abs()));
        self.better() ^ usize::from(explore)
    }

    /// How much faster option 1 has been than option 0, relative to the faster (in -1..=1).
    fn relative(&self) -> f64 {
        match (self.estimate(0), self.estimate(1)) {
            (Some(a), Some(b)) => (b - a) / a.max(b),
            _ => 0.0,
        }
    }

    /// This rank's published preference for option 1 over option 0 (see `verdict`): how much
    /// faster it has seen option 1, relative to the faster (in -1..=1), or a large value for
    /// whichever still needs measuring.
    pub fn vote(&self) -> f64 {
        if !self.warm() {
            return if self.to_measure() == 1 { 1e30 } else { -1e30 };
        }
        self.gap()
    }

    /// `relative`, for how often to try the option behind (`explore_every`), with its size
    /// held under a fifth (trying it every `EXPLORE`-th operation) while that option has been
    /// measured fewer than `TRUSTED_SAMPLES` times: early measurements are the noisiest (see
    /// `WARM_SAMPLES`), and one bad sample must not keep an option away for `8 * EXPLORE`
    /// operations.
    fn gap(&self) -> f64 {
        let r = self.relative();
        if self.samples(1 - self.better()) < TRUSTED_SAMPLES {
            r.clamp(-UNTRUSTED_GAP, UNTRUSTED_GAP)
        } else {
            r
        }
    }
}

/// Options of `Tuner::cma`.
pub const RING: usize = 0;
pub const CMA: usize = 1;
/// Options of `Tuner::fifo`.
pub const CACHED: usize = 0;
pub const STREAMED: usize = 1;

/// Estimates per size class (bytes measured, rounded down to a power of two): whether the data
/// fits a cache decides which option wins (cached FIFO slots win by far while a program's data
/// stays in the shared cache, and lose by far beyond it when the cores pass lines slowly), so
/// one size's measurements say little about another's.
pub struct BySize([Estimates; SIZE_CLASSES]);

const SIZE_CLASSES: usize = 64;

impl Default for BySize {
    fn default() -> Self {
        BySize(std::array::from_fn(|_| Estimates::default()))
    }
}

impl BySize {
    /// The estimates of operations that measure `bytes`.
    pub fn get(&self, bytes: usize) -> &Estimates {
        let class = (usize::BITS - bytes.leading_zeros()) as usize;
        &self.0[class.min(SIZE_CLASSES - 1)]
    }
}

/// A communicator's measured choices (one per rank).
#[derive(Default)]
pub struct Tuner {
    /// Ring or cross-memory attach, for large direct operations (voted).
    pub cma: BySize,
    /// Ordinary or streaming stores into FIFO slots, for large ring programs.
    pub fifo: BySize,
}

/// How far the rounds of a ring's FIFO choice are shifted from the sequence numbers of the
/// ring-or-cross-memory-attach verdict (`verdict` explores on multiples of `EXPLORE`, the FIFO
/// choice then on `EXPLORE / 2` past them): the two never explore on the same operation, so a
/// ring tried against cross-memory attach is measured with its better FIFO option.
pub const FIFO_ROUND_OFFSET: u64 = EXPLORE / 2;

/// Ring programs move at least this much per rank before their speed is measured (smaller ones
/// are dominated by latency) and before streaming stores are considered. From 64 KiB: a 2-rank
/// 64 KiB allreduce with cached slots ran at 1.3-1.4 GB/s busbw when the cores were far, and
/// at 3.8-4.3 with streamed ones (8-10 cached when near).
pub const FIFO_TUNE_BYTES: usize = 64 << 10;

/// The collective verdict for operation `seq` from every rank's published preference for
/// cross-memory attach (`Estimates::vote`): it when the preferences add up in its favour, the
/// other way on exploring operations (as often as the mean preference's size says, see
/// `explore_every`).
pub fn verdict(seq: u64, votes: impl IntoIterator<Item = f64>) -> usize {
    let (sum, n) = votes
        .into_iter()
        .fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    let cma = sum > 0.0;
    let explore = seq.is_multiple_of(explore_every(sum.abs() / n.max(1) as f64));
    usize::from(cma != explore)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_both_then_follows_the_faster_and_explores() {
        let t = Estimates::default();
        let gbs = |g: f64| Duration::from_secs_f64(1.0 / g);
        assert_eq!(t.better(), 0, "option 0 first");
        t.record(0, 1 << 30, gbs(0.5));
        assert_eq!(t.better(), 1, "then option 1, measured less");
        assert!(t.vote() > 1e20);
        assert_eq!(
            t.pick(8 * EXPLORE),
            1,
            "no exploring before both are measured"
        );
        t.record(1, 1 << 30, gbs(4.0));
        assert_eq!(t.better(), 0, "each is measured twice");
        assert_eq!(t.pick(8 * EXPLORE), 0);
        // The second measurement replaces the first (which paid for first touches).
        t.record(0, 1 << 30, gbs(2.0));
        assert!((t.estimate(0).expect("measured") - 2e9 * 1.073741824).abs() < 1.0);
        t.record(1, 1 << 30, gbs(4.0));
        assert_eq!(t.better(), 1);
        assert_eq!(t.pick(3), 1);
        // Option 0 at half the speed, measured twice: tried every EXPLORE operations until it
        // has been measured TRUSTED_SAMPLES times.
        assert!((t.vote() - UNTRUSTED_GAP).abs() < 1e-9);
        assert_eq!(t.pick(EXPLORE), 0, "exploring soon");
        t.record(0, 1 << 30, gbs(2.0));
        // Now trusted: tried every 4 * EXPLORE operations.
        assert!((t.vote() - 0.5).abs() < 1e-9);
        assert_eq!(t.pick(EXPLORE), 1, "not exploring yet");
        assert_eq!(t.pick(4 * EXPLORE), 0, "exploring");
        t.record(0, 1 << 30, gbs(8.0));
        assert_eq!(t.better(), 0, "option 0 got faster");
        assert!(t.vote() < 0.0);
        assert_eq!(verdict(1, [-0.1, -0.2]), RING);
        assert_eq!(verdict(1, [-0.1, 0.2]), CMA);
        assert_eq!(verdict(EXPLORE, [-0.1, 0.05]), CMA);
        assert_eq!(verdict(2 * EXPLORE, [0.3, -0.1]), RING);
        // Far apart: explored rarely; while measuring, the warm-up vote decides.
        assert_eq!(verdict(EXPLORE, [-0.9, -0.7]), RING);
        assert_eq!(verdict(8 * EXPLORE, [-0.9, -0.7]), CMA);
        assert_eq!(verdict(3, [1e30, -0.5]), CMA);
    }

    #[test]
    fn fifo_and_path_explore_on_different_operations() {
        for seq in 0..4096u64 {
            for a in 0..4 {
                for b in 0..4 {
                    let path = seq.is_multiple_of(EXPLORE << a);
                    let fifo = (seq + FIFO_ROUND_OFFSET).is_multiple_of(EXPLORE << b);
                    assert!(!(path && fifo), "both explore on operation {seq}");
                }
            }
        }
    }

    #[test]
    fn sizes_are_measured_apart() {
        let t = BySize::default();
        let gbs = |g: f64| Duration::from_secs_f64(1.0 / g);
        t.get(1 << 20).record(0, 1 << 20, gbs(9.0));
        assert!(t.get((1 << 21) - 1).estimate(0).is_some(), "same class");
        assert!(t.get(1 << 21).estimate(0).is_none(), "next class");
        assert!(t.get(usize::MAX).estimate(0).is_none());
    }

    #[test]
    fn exploring_gets_rarer_as_the_gap_grows() {
        assert_eq!(explore_every(0.0), EXPLORE);
        assert_eq!(explore_every(0.19), EXPLORE);
        assert_eq!(explore_every(0.3), 2 * EXPLORE);
        assert_eq!(explore_every(0.5), 4 * EXPLORE);
        assert_eq!(explore_every(0.7), 8 * EXPLORE);
        assert_eq!(explore_every(5.0), 8 * EXPLORE);
    }
}
