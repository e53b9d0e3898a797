//! Latency histograms for the metrics endpoint: fixed bucket bounds in
//! seconds (Prometheus' convention), updated without locks.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds, in seconds, from 25 µs (a hot in-memory call) to 10 s (a
/// checkpoint of a large manifest): roughly ×2–2.5 apart, so a tail is
/// located within a factor of 2.5.
pub const LATENCY_BOUNDS: [f64; 18] = [
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5,
    5.0, 10.0,
];

/// Observations per bucket (not cumulative), their count and their sum.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BOUNDS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

/// A histogram as Prometheus exposes it: cumulative counts per upper bound
/// (the last, `+Inf`, is `count`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HistogramSnapshot {
    /// (upper bound in seconds, observations at or below it), one per
    /// [`LATENCY_BOUNDS`] entry, in order.
    pub cumulative: Vec<(f64, u64)>,
    /// Every observation, those above the last bound included.
    pub count: u64,
    /// The observations' total, in seconds.
    pub sum_seconds: f64,
}

impl Histogram {
    /// Counts one observation of `elapsed` in the first bucket that holds it
    /// (past 10 s: only in the count and the sum).
    pub fn observe(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        if let Some(i) = LATENCY_BOUNDS.iter().position(|&bound| seconds <= bound) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_nanos
            .fetch_add(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    /// The counts so far, made cumulative; taken without a lock, so it may
    /// miss observations made meanwhile.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut running = 0;
        let cumulative = LATENCY_BOUNDS
            .iter()
            .zip(&self.buckets)
            .map(|(&bound, n)| {
                running += n.load(Relaxed);
                (bound, running)
            })
            .collect();
        // Read after the buckets, so +Inf never counts fewer than they do.
        let count = self.count.load(Relaxed).max(running);
        HistogramSnapshot {
            cumulative,
            count,
            sum_seconds: self.sum_nanos.load(Relaxed) as f64 * 1e-9,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_first_bucket_that_holds_them() {
        let h = Histogram::default();
        for micros in [10, 25, 26, 1_000, 20_000_000] {
            h.observe(Duration::from_micros(micros));
        }
        let s = h.snapshot();
        let at = |bound: f64| s.cumulative.iter().find(|(b, _)| *b == bound).unwrap().1;
        assert_eq!(at(25e-6), 2); // 10 µs and exactly 25 µs
        assert_eq!(at(50e-6), 3);
        assert_eq!(at(1e-3), 4); // exactly 1 ms
        assert_eq!(at(10.0), 4); // 20 s is above every bound: only in +Inf
        assert_eq!(s.count, 5);
        assert!((s.sum_seconds - 20.001061).abs() < 1e-9);
    }
}
