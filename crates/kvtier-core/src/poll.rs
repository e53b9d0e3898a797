//! Polling for an event before sleeping on it, where that pays. On these
//! VMs a thread that sleeps on a socket starts tens of microseconds after
//! its bytes arrive (an idle vCPU halts, and waking it goes through the
//! host), most of a small call, on both ends of one: a client waiting for
//! its reply, a server thread waiting for a connection's next call. Polling
//! saves that only if the event comes while it polls; otherwise its CPU is
//! taken from whatever else runs, the other end's work included. So a
//! waiter polls only while its recent waits were within the poll, and
//! while they were not, still polls one wait in [`PROBE_EVERY`]: a waiter
//! that only sleeps measures its own wake-ups, and where those alone are
//! longer than the poll (a slow host, or both ends asleep: the other end's
//! wake-up is in this one's wait) it would never see a quick wait again
//! and never poll again, though the events would come within the poll
//! (an SmolLM2 fetch over a region on a 2-core VM: 212 us at p50 so, 45 us
//! polling).

use std::time::{Duration, Instant};

/// While a waiter's recent waits were longer than its poll, one wait in
/// this many polls all the same (a probe); one that catches its event
/// within the poll starts the waiter polling again. A probe that catches
/// nothing costs one poll's CPU per this many waits.
pub const PROBE_EVERY: u32 = 16;

/// How long one waiter (a connection's end) polls before sleeping: up to
/// `cap`, while the running mean of its recent waits (the newest weighing a
/// quarter) is within it, and on a probe ([`PROBE_EVERY`]) while it is
/// not. A wait is counted at most 4 × `cap` long: how long a wait was, once
/// well past the poll, says nothing more, and a long pause must not keep a
/// waiter from polling for dozens of events after.
#[derive(Debug, Clone)]
pub struct AdaptivePoll {
    cap: Duration,
    mean: Option<Duration>,
    /// Waits slept on without polling since the last probe or poll.
    slept: u32,
    /// The last poll was a probe and caught its event, not yet observed.
    caught: bool,
}

impl AdaptivePoll {
    /// A waiter that polls for up to `cap` (zero: never), with no waits seen yet.
    pub const fn new(cap: Duration) -> Self {
        Self {
            cap,
            mean: None,
            slept: 0,
            caught: false,
        }
    }

    /// The longest poll; zero: never polls.
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// Changes the longest poll; the history of recent waits is kept.
    pub fn set_cap(&mut self, cap: Duration) {
        self.cap = cap;
    }

    /// An event came `waited` after its wait began, polled for or slept on
    /// (a sleeper's wake-up counts too, which errs toward not polling). A
    /// probe's event, caught by polling, starts the mean afresh: the waits
    /// slept on before it measured wake-ups, not the events.
    pub fn observe(&mut self, waited: Duration) {
        // Saturating: a cap may be as long as a caller likes.
        let waited = waited.min(self.cap.saturating_mul(4));
        self.mean = Some(match self.mean {
            Some(mean) if !std::mem::take(&mut self.caught) => mean.saturating_mul(3).saturating_add(waited) / 4,
            _ => waited,
        });
    }

    /// How long the next wait polls, probes aside: all of `cap` while
    /// recent waits were within it (or before any), none once they take
    /// longer.
    pub fn budget(&self) -> Duration {
        match self.mean {
            Some(mean) if mean > self.cap => Duration::ZERO,
            _ => self.cap,
        }
    }

    /// Tries `attempt` until it yields a value or the wait's poll is spent
    /// ([`Self::budget`], or all of `cap` on a probe), yielding the CPU
    /// between tries (the other end may be waiting for this very CPU):
    /// `None` once it is spent, and the caller sleeps instead.
    pub fn poll<T, E>(&mut self, mut attempt: impl FnMut() -> Result<Option<T>, E>) -> Result<Option<T>, E> {
        // A catch not observed (a wait the caller did not clock) is stale.
        self.caught = false;
        let mut budget = self.budget();
        let probe = budget.is_zero() && !self.cap.is_zero() && {
            self.slept += 1;
            self.slept >= PROBE_EVERY
        };
        if !budget.is_zero() || probe {
            self.slept = 0;
        }
        if probe {
            budget = self.cap;
        }
        if budget.is_zero() {
            return Ok(None);
        }
        let start = Instant::now();
        loop {
            if let Some(value) = attempt()? {
                self.caught = probe;
                return Ok(Some(value));
            }
            if start.elapsed() >= budget {
                return Ok(None);
            }
            std::thread::yield_now();
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

    fn settled(at: u64) -> AdaptivePoll {
        let mut p = AdaptivePoll::new(CAP);
        for _ in 0..30 {
            p.observe(us(at));
        }
        p
    }

    #[test]
    fn a_waiter_polls_until_its_waits_take_longer_than_the_poll() {
        let mut p = AdaptivePoll::new(CAP);
        assert_eq!(p.budget(), CAP, "before any wait");
        p = settled(40);
        assert_eq!(p.budget(), CAP);
        p.observe(us(1000));
        // counted as 400: (3 * 40 + 400) / 4 = 130, past the cap.
        assert_eq!(p.budget(), Duration::ZERO);
        p.set_cap(Duration::ZERO);
        assert_eq!(p.budget(), Duration::ZERO, "a zero cap never polls");
        let mut forever = AdaptivePoll::new(Duration::MAX);
        forever.observe(Duration::MAX);
        forever.observe(Duration::MAX);
        assert_eq!(forever.budget(), Duration::MAX, "no overflow at the longest cap");
    }

    #[test]
    fn after_any_pause_a_waiter_polls_again_within_a_few_quick_waits() {
        for pause in [us(500), Duration::from_secs(10), Duration::MAX] {
            let mut p = settled(5000);
            p.observe(pause);
            let mut quick = 0;
            while p.budget().is_zero() {
                p.observe(us(30));
                quick += 1;
                assert!(quick < 10, "still not polling after {quick} quick waits ({pause:?})");
            }
            // 400 falls to within 100 (with 30 us waits) in
            // ln(370 / 70) / ln(4 / 3) = 5.8 steps.
            assert_eq!(quick, 6, "{pause:?}");
        }
    }

    #[test]
    fn one_odd_wait_among_quick_ones_does_not_stop_polling() {
        let mut p = settled(30);
        p.observe(us(250));
        // (3 * 30 + 250) / 4 = 85
        assert_eq!(p.budget(), CAP);
    }

    #[test]
    fn a_poll_stops_at_the_first_value_or_the_budget() {
        let mut p = AdaptivePoll::new(Duration::from_millis(2));
        let mut tries = 0;
        assert_eq!(
            p.poll(|| {
                tries += 1;
                Ok::<_, ()>((tries == 3).then_some(tries))
            }),
            Ok(Some(3))
        );
        let start = Instant::now();
        assert_eq!(p.poll(|| Ok::<Option<()>, ()>(None)), Ok(None));
        assert!(start.elapsed() >= Duration::from_millis(2), "gave up before its budget");
        assert_eq!(p.poll(|| Err::<Option<()>, _>("broken")), Err("broken"));
        let mut never = settled(5000);
        let mut tried = false;
        assert_eq!(
            never.poll(|| {
                tried = true;
                Ok::<Option<()>, ()>(None)
            }),
            Ok(None)
        );
        assert!(!tried, "a waiter past its budget tries nothing");
    }

    /// The waiter's next `n` waits, each slept on (its poll catches
    /// nothing): how many of them polled.
    fn polls_among(p: &mut AdaptivePoll, n: u32, each: Duration) -> u32 {
        (0..n)
            .filter(|_| {
                let mut tried = false;
                let caught = p.poll(|| {
                    tried = true;
                    Ok::<Option<()>, ()>(None)
                });
                assert_eq!(caught, Ok(None));
                p.observe(each);
                tried
            })
            .count() as u32
    }

    #[test]
    fn a_waiter_that_only_sleeps_probes_and_a_caught_probe_restarts_polling() {
        // Wake-ups alone take 200 us: slept-on waits never fall within
        // the poll, whatever the events do.
        let mut p = settled(5000);
        assert_eq!(
            polls_among(&mut p, 2 * PROBE_EVERY, us(200)),
            2,
            "one probe per PROBE_EVERY waits"
        );
        assert_eq!(p.budget(), Duration::ZERO, "probes that catch nothing change nothing");
        // The next probe catches its event at once.
        for _ in 1..PROBE_EVERY {
            assert_eq!(p.poll(|| Ok::<_, ()>(Some(()))), Ok(None), "not a probe: slept on");
            p.observe(us(200));
        }
        assert_eq!(p.poll(|| Ok::<_, ()>(Some(()))), Ok(Some(())), "the probe");
        p.observe(us(15));
        assert_eq!(p.budget(), CAP, "polls again after a caught probe");
        // A caught wait that is not a probe is averaged as before.
        p = settled(90);
        assert_eq!(p.poll(|| Ok::<_, ()>(Some(()))), Ok(Some(())));
        p.observe(us(10));
        assert_eq!(p.mean, Some(us(70)));
        assert_eq!(
            polls_among(&mut AdaptivePoll::new(Duration::ZERO), 3 * PROBE_EVERY, us(5)),
            0,
            "a zero cap never probes"
        );
        // Waits slept on count afresh after polling: locked out again
        // after PROBE_EVERY - 1 sleeps and a spell of polling, the next
        // probe is PROBE_EVERY sleeps away.
        p = settled(5000);
        assert_eq!(polls_among(&mut p, PROBE_EVERY - 1, us(5000)), 0);
        p.mean = Some(us(10));
        assert_eq!(polls_among(&mut p, 1, us(10)), 1, "polls while quick");
        p.mean = Some(us(5000));
        assert_eq!(polls_among(&mut p, PROBE_EVERY - 1, us(5000)), 0, "probed too soon");
        assert_eq!(polls_among(&mut p, 1, us(5000)), 1);
        // A probe's catch the caller never observed does not restart a
        // later wait's mean.
        p = settled(5000);
        for _ in 1..PROBE_EVERY {
            assert_eq!(p.poll(|| Ok::<_, ()>(Some(()))), Ok(None));
            p.observe(us(5000));
        }
        assert_eq!(p.poll(|| Ok::<_, ()>(Some(()))), Ok(Some(())), "the probe, unclocked");
        assert_eq!(p.poll(|| Ok::<_, ()>(Some(()))), Ok(None), "slept on");
        p.observe(us(20));
        assert_ne!(p.mean, Some(us(20)), "a stale catch restarted the mean");
    }
}
