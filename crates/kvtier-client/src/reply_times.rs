//! When a call over a region polls for its reply. Polling shortens a call
//! only if the reply comes while it polls; otherwise its time is taken from
//! whatever else the machine runs, the server's call included. So a region
//! polls only while its recent replies came within the poll.

use std::time::Duration;

/// The recent reply times of a region's calls: a running mean in which the
/// newest reply weighs a quarter, so that after a change of workload (small
/// fetches after long selections, or back) a region follows within a few
/// calls, while one odd call moves it little.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ReplyTimes {
    mean: Option<Duration>,
}

impl ReplyTimes {
    /// A call's reply came `took` after the call was sent.
    pub(crate) fn observe(&mut self, took: Duration) {
        self.mean = Some(match self.mean {
            None => took,
            Some(mean) => (mean * 3 + took) / 4,
        });
    }

    /// How long the next call polls before sleeping, for a poll of at most
    /// `cap`: all of it while replies come within it (or before any came),
    /// none once they take longer. A call that polls in vain is counted
    /// with its whole time, so a region stops polling where it does not
    /// pay; one that sleeps is counted with its wake-up too, which errs on
    /// the side of not polling.
    pub(crate) fn poll_for(&self, cap: Duration) -> Duration {
        match self.mean {
            Some(mean) if mean > cap => Duration::ZERO,
            _ => cap,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Duration = Duration::from_micros(100);

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn a_region_polls_until_its_replies_take_longer_than_the_poll() {
        let mut t = ReplyTimes::default();
        assert_eq!(t.poll_for(CAP), CAP, "before any reply");
        for _ in 0..20 {
            t.observe(us(40));
        }
        assert_eq!(t.poll_for(CAP), CAP);
        assert_eq!(t.poll_for(Duration::ZERO), Duration::ZERO, "a zero cap never polls");
        t.observe(us(1000));
        // (3 * 40 + 1000) / 4 = 280: one long call after short ones stops it.
        assert_eq!(t.poll_for(CAP), Duration::ZERO);
    }

    #[test]
    fn a_region_polls_again_within_a_few_calls_once_replies_are_quick() {
        let mut t = ReplyTimes::default();
        for _ in 0..20 {
            t.observe(us(5000));
        }
        let mut calls = 0;
        while t.poll_for(CAP) == Duration::ZERO {
            t.observe(us(30));
            calls += 1;
            assert!(calls < 20, "still not polling after {calls} quick replies");
        }
        // 5000 us falls to within 100 us (with 30 us replies) in
        // ln(4970 / 70) / ln(4 / 3) = 14.8 steps: the 15th reply.
        assert_eq!(calls, 15);
    }

    #[test]
    fn one_odd_reply_among_quick_ones_does_not_stop_polling() {
        let mut t = ReplyTimes::default();
        for _ in 0..20 {
            t.observe(us(30));
        }
        t.observe(us(250));
        // (3 * 30 + 250) / 4 = 85
        assert_eq!(t.poll_for(CAP), CAP);
    }
}
