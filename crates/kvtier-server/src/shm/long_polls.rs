//! Slots for connection threads that poll for their next call longer than
//! the server's own poll, as their calls ask (`LocalCall.poll_next_us`):
//! each such thread keeps a core busy between calls, so at most half the
//! cores (one at least) are given to them, whatever the number of regions
//! or tenants; a thread without a slot polls the server's own poll.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The server's long-poll slots.
#[derive(Debug)]
pub(crate) struct LongPolls {
    held: AtomicUsize,
    slots: usize,
}

impl LongPolls {
    /// `slots` slots (zero: no thread polls long).
    pub(crate) fn new(slots: usize) -> Arc<Self> {
        Arc::new(Self {
            held: AtomicUsize::new(0),
            slots,
        })
    }

    /// Half the cores of this machine, one at least.
    pub(crate) fn for_cores() -> Arc<Self> {
        Self::new((kvtier_core::parallel::cores() / 2).max(1))
    }

    /// A slot, while one is free.
    pub(crate) fn try_take(self: &Arc<Self>) -> Option<LongPoll> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held < self.slots).then_some(held + 1)
            })
            .ok()
            .map(|_| LongPoll(Arc::clone(self)))
    }

    /// Slots held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

/// One slot, given back when dropped.
#[derive(Debug)]
pub(crate) struct LongPoll(Arc<LongPolls>);

impl Drop for LongPoll {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_taken_up_to_their_number_and_given_back_when_dropped() {
        let polls = LongPolls::new(2);
        let a = polls.try_take().unwrap();
        let b = polls.try_take().unwrap();
        assert!(polls.try_take().is_none(), "both taken");
        assert_eq!(polls.held(), 2);
        drop(a);
        let c = polls.try_take().expect("one given back");
        drop((b, c));
        assert_eq!(polls.held(), 0);
        assert!(LongPolls::new(0).try_take().is_none(), "no slots: no long polls");
    }
}
