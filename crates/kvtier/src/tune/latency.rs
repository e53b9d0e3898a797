//! Step latency at other tier sizes, from the trace's own timings: each
//! recorded layer keeps what it cost beyond its swap-in (transport,
//! ranking, reading, appending, with their real noise), and at another size
//! pays its predicted misses at the per-page swap-in costs the recording
//! measured (from host memory, from NVMe).

/// One counted read: its step, the smallest device and host sizes in
/// which it hits (`None`: a first access), and the tier the recording
/// served it from, when it says (`D`, `H`, `N`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Read {
    pub(crate) step: u32,
    pub(crate) device: Option<u64>,
    pub(crate) host: Option<u64>,
    pub(crate) served: Option<char>,
}

#[derive(Debug)]
pub(crate) struct LatencyModel {
    /// Per step: the recorded time of its layers without their swap-ins (µs).
    pub(crate) base_us: Vec<f64>,
    pub(crate) reads: Vec<Read>,
    /// How many reads each stands for (1/R of a trace sampled at rate R).
    pub(crate) read_weight: f64,
    /// Swap-in cost per page by source (µs), as recorded or given.
    pub(crate) host_page_us: Option<f64>,
    pub(crate) nvme_page_us: Option<f64>,
}

impl LatencyModel {
    /// Every step's predicted latency (µs) with a device of `device` bytes
    /// over a host tier of `host` bytes.
    fn steps_us(&self, device: u64, host: u64) -> anyhow::Result<Vec<f64>> {
        let mut steps = self.base_us.clone();
        for r in &self.reads {
            let source = match (r.device, r.host) {
                (Some(need), _) if need <= device => continue,
                (_, Some(need)) if need <= host => 'H',
                (_, Some(_)) => 'N',
                // A first access (the recording began after the page was
                // written) costs what it cost when recorded; without a
                // record of that, a read from NVMe.
                (_, None) => r.served.unwrap_or('N'),
            };
            let cost = match source {
                'D' => continue,
                'H' => self.host_page_us.ok_or_else(|| {
                    anyhow::anyhow!("the trace has no swap-in from host memory to time: pass --host-page-us")
                })?,
                _ => self.nvme_page_us.ok_or_else(|| {
                    anyhow::anyhow!("the trace has no swap-in from NVMe to time: pass --nvme-page-us")
                })?,
            };
            steps[r.step as usize] += cost * self.read_weight;
        }
        Ok(steps)
    }

    /// The `q` quantile of step latency (µs).
    pub(crate) fn quantile_us(&self, q: f64, device: u64, host: u64) -> anyhow::Result<f64> {
        let mut steps = self.steps_us(device, host)?;
        anyhow::ensure!(!steps.is_empty(), "the trace has no steps");
        steps.sort_by(f64::total_cmp);
        let rank = ((q * steps.len() as f64).ceil() as usize).clamp(1, steps.len());
        Ok(steps[rank - 1])
    }

    /// The smallest device (bytes, up to `most`) whose predicted p99 step
    /// is at most `target_us`: misses only fall as the device grows (LRU
    /// keeps what a smaller LRU keeps), so a binary search finds it.
    pub(crate) fn smallest_for_p99(&self, target_us: f64, host: u64, most: u64) -> anyhow::Result<Option<u64>> {
        if self.quantile_us(0.99, most, host)? > target_us {
            return Ok(None);
        }
        let (mut lo, mut hi) = (0u64, most);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.quantile_us(0.99, mid, host)? <= target_us {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Ok(Some(lo))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misses_add_their_tiers_cost_to_their_step() {
        let model = LatencyModel {
            base_us: vec![100.0, 100.0],
            reads: vec![
                Read {
                    step: 0,
                    device: Some(10),
                    host: Some(10),
                    served: None,
                },
                Read {
                    step: 1,
                    device: Some(50),
                    host: Some(50),
                    served: None,
                },
                Read {
                    step: 1,
                    device: None,
                    host: None,
                    served: None,
                },
            ],
            read_weight: 1.0,
            host_page_us: Some(5.0),
            nvme_page_us: Some(40.0),
        };
        // Device 10, host 100: step 1 misses twice: once to host, once (a
        // first access) to NVMe.
        assert_eq!(model.steps_us(10, 100).unwrap(), vec![100.0, 145.0]);
        // Host 20: the second read of step 1 comes from NVMe too.
        assert_eq!(model.steps_us(10, 20).unwrap(), vec![100.0, 180.0]);
        assert_eq!(model.quantile_us(0.99, 60, 100).unwrap(), 140.0);
        assert_eq!(model.smallest_for_p99(145.0, 100, 1000).unwrap(), Some(0));
        assert_eq!(model.smallest_for_p99(140.0, 100, 1000).unwrap(), Some(50));
        assert_eq!(model.smallest_for_p99(139.0, 100, 1000).unwrap(), None);
        // A first access recorded as served from host memory costs that.
        let mut recorded = LatencyModel {
            reads: model.reads.clone(),
            ..model
        };
        recorded.reads[2].served = Some('H');
        assert_eq!(recorded.steps_us(10, 100).unwrap(), vec![100.0, 110.0]);
        recorded.reads[2].served = Some('D');
        assert_eq!(recorded.steps_us(10, 100).unwrap(), vec![100.0, 105.0]);
        let model = recorded;
        let untimed = LatencyModel {
            host_page_us: None,
            ..model
        };
        assert!(untimed.steps_us(10, 100).is_err());
    }
}
