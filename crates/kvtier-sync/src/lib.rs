#![warn(missing_docs)]
//! Locks with ranks: every lock of the store and the server is one of
//! these, made with its [`Rank`], and [`Rank`]'s order is the only order in
//! which a thread may hold two of them. In debug builds (and so in every
//! test) taking a lock whose rank is not above every rank the thread holds
//! panics, naming both locks, and so does taking any lock while holding a
//! leaf; release builds check nothing and pay nothing.
//!
//! The check sees a thread's own locks only: it catches an order that
//! could deadlock with another thread as soon as one thread takes it,
//! without the race having to happen (wgpu's `lock/rank.rs` does the same
//! for its device locks).
//!
//! Poisoning is ignored: a critical section in kvtier does not panic on
//! any input, and should one panic through a bug, what it guarded is
//! still consistent bookkeeping, so later callers proceed instead of
//! cascading the panic.

mod held;
mod rank;

use std::ops::{Deref, DerefMut};

pub use rank::Rank;

use held::Held;

/// A mutex with a rank.
#[derive(Debug)]
pub struct Mutex<T> {
    rank: Rank,
    inner: std::sync::Mutex<T>,
}

impl<T> Mutex<T> {
    /// A mutex holding `value`, taken at `rank` in the lock order; `const`, so it can be a
    /// `static`.
    pub const fn new(rank: Rank, value: T) -> Self {
        Self {
            rank,
            inner: std::sync::Mutex::new(value),
        }
    }

    /// Locks it; panics in debug builds when `rank` is out of order.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        let held = Held::take(self.rank);
        MutexGuard {
            inner: self.inner.lock().unwrap_or_else(|p| p.into_inner()),
            _held: held,
        }
    }

    /// Locks it unless that would wait.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        let held = Held::take(self.rank);
        let inner = match self.inner.try_lock() {
            Ok(inner) => inner,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(MutexGuard { inner, _held: held })
    }
}

/// A held [`Mutex`].
#[derive(Debug)]
pub struct MutexGuard<'a, T> {
    inner: std::sync::MutexGuard<'a, T>,
    // Dropped after `inner`: the rank is released once the lock is.
    _held: Held,
}

impl<T> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

/// A reader-writer lock with a rank (a read counts as holding it).
#[derive(Debug)]
pub struct RwLock<T> {
    rank: Rank,
    inner: std::sync::RwLock<T>,
}

impl<T> RwLock<T> {
    /// A reader-writer lock holding `value`, taken at `rank` in the lock order (read or write
    /// alike); `const`, so it can be a `static`.
    pub const fn new(rank: Rank, value: T) -> Self {
        Self {
            rank,
            inner: std::sync::RwLock::new(value),
        }
    }

    /// Read-locks it, waiting while a writer holds it; panics in debug builds when `rank` is out
    /// of order.
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        let held = Held::take(self.rank);
        RwLockReadGuard {
            inner: self.inner.read().unwrap_or_else(|p| p.into_inner()),
            _held: held,
        }
    }

    /// Read-locks it unless that would wait (a writer holds it, or, with
    /// std's lock, waits for it).
    pub fn try_read(&self) -> Option<RwLockReadGuard<'_, T>> {
        let held = Held::take(self.rank);
        let inner = match self.inner.try_read() {
            Ok(inner) => inner,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(RwLockReadGuard { inner, _held: held })
    }

    /// Write-locks it, waiting for every reader and writer to leave; panics in debug builds when
    /// `rank` is out of order.
    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        let held = Held::take(self.rank);
        RwLockWriteGuard {
            inner: self.inner.write().unwrap_or_else(|p| p.into_inner()),
            _held: held,
        }
    }

    /// Write-locks it unless that would wait (a reader or a writer holds
    /// it): for background work that skips what is busy.
    pub fn try_write(&self) -> Option<RwLockWriteGuard<'_, T>> {
        let held = Held::take(self.rank);
        let inner = match self.inner.try_write() {
            Ok(inner) => inner,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(RwLockWriteGuard { inner, _held: held })
    }
}

/// A read-held [`RwLock`].
#[derive(Debug)]
pub struct RwLockReadGuard<'a, T> {
    inner: std::sync::RwLockReadGuard<'a, T>,
    _held: Held,
}

impl<T> Deref for RwLockReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

/// A write-held [`RwLock`].
#[derive(Debug)]
pub struct RwLockWriteGuard<'a, T> {
    inner: std::sync::RwLockWriteGuard<'a, T>,
    _held: Held,
}

impl<T> Deref for RwLockWriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T> DerefMut for RwLockWriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

/// A condition variable for a ranked [`Mutex`]. While a thread waits its
/// lock counts as held: the thread takes nothing else meanwhile.
#[derive(Debug, Default)]
pub struct Condvar(std::sync::Condvar);

impl Condvar {
    /// A condition variable with no waiters; `const`, so it can be a `static`.
    pub const fn new() -> Self {
        Self(std::sync::Condvar::new())
    }

    /// Unlocks the guard's mutex and sleeps until notified (or woken spuriously: callers recheck
    /// their condition), then locks it again. The rank stays held throughout.
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        let MutexGuard { inner, _held } = guard;
        MutexGuard {
            inner: self.0.wait(inner).unwrap_or_else(|p| p.into_inner()),
            _held,
        }
    }

    /// As [`Condvar::wait`], for at most `timeout`; whether it timed out.
    pub fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: std::time::Duration,
    ) -> (MutexGuard<'a, T>, bool) {
        let MutexGuard { inner, _held } = guard;
        let (inner, result) = self.0.wait_timeout(inner, timeout).unwrap_or_else(|p| p.into_inner());
        (MutexGuard { inner, _held }, result.timed_out())
    }

    /// Wakes one thread waiting on it, if any.
    pub fn notify_one(&self) {
        self.0.notify_one();
    }

    /// Wakes every thread waiting on it.
    pub fn notify_all(&self) {
        self.0.notify_all();
    }
}

#[cfg(test)]
mod tests;
