//! The ranks a thread holds, checked as each lock is taken (debug builds
//! only; in release builds [`Held`] is empty and its checks compile away).

use crate::Rank;

/// One held rank; released when dropped.
#[derive(Debug)]
pub(crate) struct Held {
    #[cfg(debug_assertions)]
    rank: Rank,
}

#[cfg(debug_assertions)]
thread_local! {
    static HELD: std::cell::RefCell<Vec<Rank>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Held {
    /// Records `rank` as held by this thread, first panicking if the
    /// thread holds a leaf or a rank at or above it.
    #[cfg(debug_assertions)]
    pub(crate) fn take(rank: Rank) -> Self {
        HELD.with_borrow_mut(|held| {
            // A thread already unwinding reports its first panic only: a
            // second, from a destructor, would abort the process.
            if std::thread::panicking() {
                held.push(rank);
                return;
            }
            if let Some(&leaf) = held.iter().find(|h| h.is_leaf()) {
                panic!("lock order: {rank} taken while the leaf {leaf} is held (held: {held:?})");
            }
            if let Some(&above) = held.iter().find(|&&h| h >= rank) {
                panic!("lock order: {rank} taken while {above} is held (held: {held:?})");
            }
            held.push(rank);
        });
        Self { rank }
    }

    #[cfg(not(debug_assertions))]
    pub(crate) fn take(_rank: Rank) -> Self {
        Self {}
    }
}

#[cfg(debug_assertions)]
impl Drop for Held {
    fn drop(&mut self) {
        // Guards may be dropped in any order; a thread that panicked in
        // `take` never pushed.
        let _ = HELD.try_with(|held| {
            let mut held = held.borrow_mut();
            if let Some(i) = held.iter().rposition(|&h| h == self.rank) {
                held.remove(i);
            }
        });
    }
}
