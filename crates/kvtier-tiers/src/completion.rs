//! A one-shot completion that a caller can block on or `.await`, without
//! tying the tiers to an async runtime. The producer side is held by the I/O
//! engine; dropping the consumer side early is always safe: the engine still
//! owns every buffer and slot of the operation until it completes.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};

#[derive(Debug)]
struct Shared<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

#[derive(Debug)]
struct State<T> {
    value: Option<T>,
    /// The producer went away without a value (the engine stopped).
    abandoned: bool,
    waker: Option<Waker>,
}

/// The consumer side.
#[derive(Debug)]
pub struct Completion<T> {
    shared: Arc<Shared<T>>,
}

/// The producer side.
#[derive(Debug)]
pub struct Completer<T> {
    shared: Option<Arc<Shared<T>>>,
}

/// The engine that owed the value stopped before producing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the I/O engine stopped before completing the operation")]
pub struct Abandoned;

/// A connected pair.
pub fn completion<T>() -> (Completer<T>, Completion<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            value: None,
            abandoned: false,
            waker: None,
        }),
        ready: Condvar::new(),
    });
    (
        Completer {
            shared: Some(Arc::clone(&shared)),
        },
        Completion { shared },
    )
}

fn lock<T>(shared: &Shared<T>) -> std::sync::MutexGuard<'_, State<T>> {
    shared.state.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T> Completer<T> {
    /// Delivers `value` and wakes whoever waits (a blocked thread or a task). A `Completer`
    /// dropped without this reports [`Abandoned`] instead; if the consumer is gone, the value is
    /// simply dropped.
    pub fn complete(mut self, value: T) {
        if let Some(shared) = self.shared.take() {
            let waker = {
                let mut state = lock(&shared);
                state.value = Some(value);
                state.waker.take()
            };
            shared.ready.notify_all();
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            let waker = {
                let mut state = lock(&shared);
                state.abandoned = true;
                state.waker.take()
            };
            shared.ready.notify_all();
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

impl<T> Completion<T> {
    /// Already completed with `value`.
    pub fn ready(value: T) -> Self {
        let (tx, rx) = completion();
        tx.complete(value);
        rx
    }

    /// The value if it is there, without blocking.
    pub fn try_wait(&mut self) -> Option<Result<T, Abandoned>> {
        let mut state = lock(&self.shared);
        if let Some(v) = state.value.take() {
            return Some(Ok(v));
        }
        state.abandoned.then_some(Err(Abandoned))
    }

    /// Blocks until the value is there or `timeout` passes; `None` on
    /// timeout (the completion can be waited on again).
    pub fn wait_timeout(&mut self, timeout: std::time::Duration) -> Option<Result<T, Abandoned>> {
        let deadline = std::time::Instant::now() + timeout;
        let mut state = lock(&self.shared);
        loop {
            if let Some(v) = state.value.take() {
                return Some(Ok(v));
            }
            if state.abandoned {
                return Some(Err(Abandoned));
            }
            let left = deadline.checked_duration_since(std::time::Instant::now())?;
            state = self
                .shared
                .ready
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Blocks the calling thread until the value is there.
    pub fn wait(self) -> Result<T, Abandoned> {
        let mut state = lock(&self.shared);
        loop {
            if let Some(v) = state.value.take() {
                return Ok(v);
            }
            if state.abandoned {
                return Err(Abandoned);
            }
            state = self.shared.ready.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl<T> Future for Completion<T> {
    type Output = Result<T, Abandoned>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = lock(&self.shared);
        if let Some(v) = state.value.take() {
            return Poll::Ready(Ok(v));
        }
        if state.abandoned {
            return Poll::Ready(Err(Abandoned));
        }
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_cross_threads_and_abandonment_is_reported() {
        let (tx, mut rx) = completion();
        assert!(rx.wait_timeout(std::time::Duration::from_millis(10)).is_none());
        std::thread::spawn(move || tx.complete(7));
        assert_eq!(rx.wait_timeout(std::time::Duration::from_secs(10)), Some(Ok(7)));
        let (tx, rx) = completion();
        std::thread::spawn(move || tx.complete(8));
        assert_eq!(rx.wait(), Ok(8));
        let (tx, rx) = completion::<u8>();
        drop(tx);
        assert_eq!(rx.wait(), Err(Abandoned));
        let (tx, rx) = completion::<u8>();
        drop(rx);
        tx.complete(1); // nobody listening: fine
    }
}
