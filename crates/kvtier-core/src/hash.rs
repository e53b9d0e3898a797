//! A 64-bit mixer for sampling by hash: every input bit affects every
//! output bit, so `mix64(key) < rate · 2^64` keeps a uniform share `rate`
//! of any set of distinct keys, the same keys every time.

/// SplitMix64's finaliser (Steele, Lea and Flood, 2014).
pub fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Whether a sample at `rate` (in (0, 1]) keeps the item hashed to `hash`.
pub fn keeps(hash: u64, rate: f64) -> bool {
    rate >= 1.0 || hash < (rate * 2f64.powi(64)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_keeps_about_its_rate_of_distinct_keys() {
        for rate in [0.01, 0.1, 0.5] {
            let kept = (0..100_000u64).filter(|&k| keeps(mix64(k), rate)).count() as f64 / 1e5;
            assert!((kept - rate).abs() < 0.01 + rate * 0.05, "rate {rate}: kept {kept}");
        }
        assert!((0..1000u64).all(|k| keeps(mix64(k), 1.0)));
    }
}
