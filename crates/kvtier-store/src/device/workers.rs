//! Background workers: swap-ins that outlived their call's deadline, and
//! prefetches, which always run after the demand jobs waiting.

use std::collections::VecDeque;
use std::sync::Arc;

use kvtier_sync::{Condvar, Mutex, Rank};

type Job = Box<dyn FnOnce() + Send>;

/// Background workers: demand jobs (swap-ins past their deadline) always run
/// before prefetch jobs.
#[derive(Debug)]
pub(crate) struct Workers {
    queue: Mutex<JobQueue>,
    ready: Condvar,
}

#[derive(Default)]
struct JobQueue {
    demand: VecDeque<Job>,
    prefetch: VecDeque<Job>,
    /// Jobs taken and not finished yet.
    running: usize,
    closed: bool,
}

impl std::fmt::Debug for JobQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobQueue")
            .field("demand", &self.demand.len())
            .field("prefetch", &self.prefetch.len())
            .field("closed", &self.closed)
            .finish()
    }
}

/// Prefetch jobs waiting beyond this many are dropped: a prediction that
/// old is stale anyway.
const PREFETCH_BACKLOG: usize = 256;

impl Workers {
    pub(crate) fn start(threads: usize) -> Arc<Self> {
        let workers = Arc::new(Self {
            queue: Mutex::new(Rank::WorkerQueue, JobQueue::default()),
            ready: Condvar::new(),
        });
        for i in 0..threads {
            let w = Arc::clone(&workers);
            let spawned = std::thread::Builder::new()
                .name(format!("kvtier-swap-{i}"))
                .spawn(move || w.run());
            if let Err(e) = spawned {
                tracing::error!(error = %e, "cannot start a swap-in worker");
            }
        }
        workers
    }

    fn run(&self) {
        loop {
            let job = {
                let mut q = self.queue.lock();
                loop {
                    if let Some(job) = q.demand.pop_front().or_else(|| q.prefetch.pop_front()) {
                        q.running += 1;
                        break job;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.ready.wait(q);
                }
            };
            job();
            self.queue.lock().running -= 1;
            self.ready.notify_all();
        }
    }

    /// Blocks until no job is queued or running.
    pub(crate) fn wait_idle(&self) {
        let mut q = self.queue.lock();
        while q.running > 0 || !q.demand.is_empty() || !q.prefetch.is_empty() {
            q = self.ready.wait(q);
        }
    }

    pub(crate) fn demand(&self, job: Job) {
        self.queue.lock().demand.push_back(job);
        self.ready.notify_one();
    }

    /// Queues a prefetch; false when the backlog is full and it was dropped.
    pub(crate) fn prefetch(&self, job: Job) -> bool {
        let mut q = self.queue.lock();
        if q.prefetch.len() >= PREFETCH_BACKLOG {
            return false;
        }
        q.prefetch.push_back(job);
        drop(q);
        self.ready.notify_one();
        true
    }

    pub(crate) fn close(&self) {
        self.queue.lock().closed = true;
        self.ready.notify_all();
    }
}
