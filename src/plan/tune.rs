//! Choosing between the ring and cross-memory attach for large direct operations, by measuring
//! both. Which is faster depends on the host and even on the run: on the 2-core VMs this project
//! is measured on, the ring's shared FIFOs move 6-8 GB/s in some runs and 1.6 GB/s in others
//! (whole runs; OpenMPI's shared-memory path drops the same way), while cross-memory attach stays
//! near 3.5-4.3 GB/s. Each rank keeps a running estimate of the bandwidth it saw on each path and
//! votes on the board; every rank derives the same verdict from the published votes, so the
//! choice is always collective. Every `EXPLORE`-th operation takes the other path, so that an
//! estimate that has gone stale is refreshed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// One operation in this many (by board sequence number) takes the path not chosen.
pub const EXPLORE: u64 = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    Ring,
    Cma,
}

/// Per-rank bandwidth estimates (bytes per second, as f64 bits; 0 = not measured yet).
#[derive(Default)]
pub struct Tuner {
    ring: AtomicU64,
    cma: AtomicU64,
}

impl Tuner {
    fn slot(&self, p: Path) -> &AtomicU64 {
        match p {
            Path::Ring => &self.ring,
            Path::Cma => &self.cma,
        }
    }

    pub fn estimate(&self, p: Path) -> Option<f64> {
        let v = f64::from_bits(self.slot(p).load(Ordering::Relaxed));
        (v > 0.0).then_some(v)
    }

    /// Records that `bytes` took `elapsed` on path `p`: the estimate moves halfway.
    pub fn record(&self, p: Path, bytes: usize, elapsed: Duration) {
        let bw = bytes as f64 / elapsed.as_secs_f64().max(1e-9);
        let new = match self.estimate(p) {
            Some(old) => 0.5 * old + 0.5 * bw,
            None => bw,
        };
        self.slot(p).store(new.to_bits(), Ordering::Relaxed);
    }

    /// This rank's vote: whether it wants cross-memory attach. A path never measured is
    /// presumed fast, so that each is tried once (the ring first).
    pub fn vote_cma(&self) -> bool {
        match (self.estimate(Path::Ring), self.estimate(Path::Cma)) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(r), Some(c)) => c > r,
        }
    }
}

/// The collective verdict for operation `seq` from every rank's vote: cross-memory attach when
/// any rank wants it (its side is the slow one), the other way on exploring operations.
pub fn verdict(seq: u64, votes: impl IntoIterator<Item = bool>) -> Path {
    let cma = votes.into_iter().any(|v| v);
    let cma = cma != seq.is_multiple_of(EXPLORE);
    if cma {
        Path::Cma
    } else {
        Path::Ring
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tries_both_then_follows_the_faster_and_explores() {
        let t = Tuner::default();
        assert!(!t.vote_cma(), "the ring first");
        t.record(Path::Ring, 1 << 30, Duration::from_millis(500)); // 2 GB/s
        assert!(t.vote_cma(), "then cross-memory attach, never measured");
        t.record(Path::Cma, 1 << 30, Duration::from_millis(250)); // 4 GB/s
        assert!(t.vote_cma());
        for _ in 0..4 {
            t.record(Path::Ring, 1 << 30, Duration::from_millis(125)); // 8 GB/s
        }
        assert!(!t.vote_cma(), "the ring got faster");
        assert_eq!(verdict(1, [false, false]), Path::Ring);
        assert_eq!(verdict(1, [false, true]), Path::Cma);
        assert_eq!(verdict(EXPLORE, [false, false]), Path::Cma);
        assert_eq!(verdict(2 * EXPLORE, [true, false]), Path::Ring);
    }
}
