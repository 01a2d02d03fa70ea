//! Choices the engine makes by measuring, not by rule, because the right answer depends on the
//! host and even on the run. On the 2-core VMs this project is measured on, data moved between
//! the two cores through cache (a FIFO slot written with ordinary stores and read by the other
//! core) runs at 6-9 GB/s in some runs and at 1.3-3.8 GB/s in others, for whole runs (OpenMPI's
//! shared memory drops the same way), while data that goes through memory (streaming stores
//! into the slot, or a kernel copy by cross-memory attach) stays at 3.5-7 GB/s. So:
//!
//! - ring senders fill FIFO slots with ordinary or with streaming stores (`Tuner::fifo`): a choice
//!   each rank makes alone, since the protocol is the same either way;
//! - large direct operations on other processes' `malloc` buffers use the ring or cross-memory
//!   attach (`Tuner::cma`): a collective choice, so each rank votes on the board and all derive
//!   the same verdict from the published votes (`verdict`).
//!
//! Each choice keeps a running estimate of the bandwidth seen with each option; every
//! `EXPLORE`-th operation takes the option not chosen, so that an estimate gone stale is
//! refreshed (exploring operations are picked by sequence numbers that all ranks share).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// One operation in this many takes the option not chosen.
pub const EXPLORE: u64 = 8;

/// Bandwidth estimates (bytes per second, as f64 bits; 0 = not measured) of two options.
#[derive(Default)]
pub struct Estimates {
    bw: [AtomicU64; 2],
}

impl Estimates {
    pub fn estimate(&self, option: usize) -> Option<f64> {
        let v = f64::from_bits(self.bw[option].load(Ordering::Relaxed));
        (v > 0.0).then_some(v)
    }

    /// Records that `bytes` took `elapsed` with `option`: the estimate moves halfway.
    pub fn record(&self, option: usize, bytes: usize, elapsed: Duration) {
        let bw = bytes as f64 / elapsed.as_secs_f64().max(1e-9);
        let new = match self.estimate(option) {
            Some(old) => 0.5 * old + 0.5 * bw,
            None => bw,
        };
        self.bw[option].store(new.to_bits(), Ordering::Relaxed);
    }

    /// The option that looks faster. One never measured is presumed fast, so that each is
    /// tried (option 0 first).
    pub fn better(&self) -> usize {
        match (self.estimate(0), self.estimate(1)) {
            (None, _) => 0,
            (Some(_), None) => 1,
            (Some(a), Some(b)) => usize::from(b > a),
        }
    }

    /// The option for operation `round`: the better one, or the other on exploring rounds.
    pub fn pick(&self, round: u64) -> usize {
        self.better() ^ usize::from(round.is_multiple_of(EXPLORE))
    }
}

/// Options of `Tuner::cma`.
pub const RING: usize = 0;
pub const CMA: usize = 1;
/// Options of `Tuner::fifo`.
pub const CACHED: usize = 0;
pub const STREAMED: usize = 1;

/// A communicator's measured choices (one per rank).
#[derive(Default)]
pub struct Tuner {
    /// Ring or cross-memory attach, for large direct operations (voted).
    pub cma: Estimates,
    /// Ordinary or streaming stores into FIFO slots, for large ring programs.
    pub fifo: Estimates,
}

/// Ring programs move at least this much per rank before their speed is measured (smaller ones
/// are dominated by latency) and before streaming stores are considered.
pub const FIFO_TUNE_BYTES: usize = 256 << 10;

/// The collective verdict for operation `seq` from every rank's vote for cross-memory attach:
/// it when any rank wants it (its side is the slow one), the other way on exploring operations.
pub fn verdict(seq: u64, votes: impl IntoIterator<Item = bool>) -> usize {
    let cma = votes.into_iter().any(|v| v);
    usize::from(cma != seq.is_multiple_of(EXPLORE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tries_both_then_follows_the_faster_and_explores() {
        let t = Estimates::default();
        assert_eq!(t.better(), 0, "option 0 first");
        t.record(0, 1 << 30, Duration::from_millis(500)); // 2 GB/s
        assert_eq!(t.better(), 1, "then option 1, never measured");
        t.record(1, 1 << 30, Duration::from_millis(250)); // 4 GB/s
        assert_eq!(t.better(), 1);
        assert_eq!(t.pick(3), 1);
        assert_eq!(t.pick(EXPLORE), 0, "exploring");
        for _ in 0..4 {
            t.record(0, 1 << 30, Duration::from_millis(125)); // 8 GB/s
        }
        assert_eq!(t.better(), 0, "option 0 got faster");
        assert_eq!(verdict(1, [false, false]), RING);
        assert_eq!(verdict(1, [false, true]), CMA);
        assert_eq!(verdict(EXPLORE, [false, false]), CMA);
        assert_eq!(verdict(2 * EXPLORE, [true, false]), RING);
    }
}
