//! Work over many independent items (a step's lanes) spread over the
//! machine's cores, with results in item order, so that a parallel run
//! returns exactly what a serial one would. Scoped threads, no pool: a
//! split is only made when each thread gets enough bytes to scan that
//! starting it (tens of microseconds) is small next to the scan; a parked
//! pool thread is no cheaper to wake on these VMs (≈ 47 µs a hand-off and
//! back, against ≈ 30 µs to start and join one).

use std::num::NonZeroUsize;
use std::sync::{Mutex, OnceLock};

/// The least work (bytes to scan) worth a thread of its own.
pub const MIN_BYTES_PER_THREAD: usize = 1 << 20;

/// Cores this process may run on (1 when unknown).
pub fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, NonZeroUsize::get))
}

/// How many threads `bytes` of work over `items` items gets on `cores` cores.
pub fn threads_for(items: usize, bytes: usize, cores: usize) -> usize {
    cores.min(items).min(bytes / MIN_BYTES_PER_THREAD).max(1)
}

/// `f` of every item, in order, spread over up to `threads` threads (the
/// calling thread one of them).
pub fn map<T: Sync, R: Send>(items: &[T], threads: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let mut refs: Vec<&T> = items.iter().collect();
    map_mut(&mut refs, threads, |item| f(item))
}

/// [`map`] over items it may change. Threads take items one at a time as
/// they come free rather than a fixed share each: a thread that starts
/// late (a woken vCPU can take a hundred microseconds here) leaves its
/// items to the threads already running instead of making them wait.
pub fn map_mut<T: Send, R: Send>(items: &mut [T], threads: usize, f: impl Fn(&mut T) -> R + Sync) -> Vec<R> {
    let threads = threads.clamp(1, items.len().max(1));
    if threads == 1 {
        return items.iter_mut().map(&f).collect();
    }
    let count = items.len();
    let queue = Mutex::new(items.iter_mut().enumerate());
    let work = || {
        let mut done = Vec::new();
        loop {
            // Taken apart from the call: the queue is not held while `f` runs.
            let next = lock(&queue).next();
            let Some((i, item)) = next else { break };
            done.push((i, f(item)));
        }
        done
    };
    let mut results: Vec<(usize, R)> = Vec::with_capacity(count);
    std::thread::scope(|scope| {
        let others: Vec<_> = (1..threads).map(|_| scope.spawn(work)).collect();
        results.extend(work());
        for handle in others {
            match handle.join() {
                Ok(done) => results.extend(done),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    results.sort_unstable_by_key(|&(i, _)| i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// The queue's lock; a thread that panicked holding it left the iterator
/// whole (`next` cannot panic halfway), and its panic is raised at join.
fn lock<Q>(queue: &Mutex<Q>) -> std::sync::MutexGuard<'_, Q> {
    queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_same_results_in_the_same_order_for_any_split(
            items in proptest::collection::vec(any::<u32>(), 0..200),
            threads in 1usize..9,
        ) {
            let serial: Vec<u64> = items.iter().map(|&x| u64::from(x) * 3 + 1).collect();
            prop_assert_eq!(map(&items, threads, |&x| u64::from(x) * 3 + 1), serial.clone());
            let mut changed = items.clone();
            let seen = map_mut(&mut changed, threads, |x| { *x = x.wrapping_add(1); u64::from(*x) });
            prop_assert_eq!(seen, items.iter().map(|&x| u64::from(x.wrapping_add(1))).collect::<Vec<_>>());
            prop_assert!(changed.iter().zip(&items).all(|(c, x)| *c == x.wrapping_add(1)));
        }
    }

    #[test]
    fn small_work_stays_on_one_thread() {
        assert_eq!(threads_for(8, MIN_BYTES_PER_THREAD - 1, 16), 1);
        assert_eq!(threads_for(8, 3 * MIN_BYTES_PER_THREAD, 16), 3);
        assert_eq!(threads_for(2, 64 * MIN_BYTES_PER_THREAD, 16), 2);
        assert_eq!(threads_for(8, 64 * MIN_BYTES_PER_THREAD, 4), 4);
    }
}
