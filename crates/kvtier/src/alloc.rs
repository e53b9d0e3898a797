//! glibc's allocator, set up for a server whose memory the operator bounds.
//! By default glibc gives each thread that contends for the heap an arena of
//! its own (up to 8 per core), and memory freed in an arena stays mapped
//! until the top of that arena is free: after a burst of large messages the
//! resident set stays near the burst's peak, across arenas, long after the
//! messages are gone. Four arenas, and a trim every second that hands freed
//! pages back to the kernel, keep the resident set near what is in use
//! (measured: `bench/memory.sh`).

#[cfg(all(target_os = "linux", target_env = "gnu"))]
use std::time::Duration;

/// Arenas for all threads (the runtime's workers, the blocking pool, the
/// store's background threads).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const ARENAS: i32 = 4;
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_EVERY: Duration = Duration::from_secs(1);

/// Applies the settings; call before the runtime starts its threads.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) fn tune() {
    // SAFETY: mallopt only sets a parameter of the allocator; no other
    // thread exists yet to allocate concurrently.
    if unsafe { libc::mallopt(libc::M_ARENA_MAX, ARENAS) } != 1 {
        tracing::warn!("glibc refused M_ARENA_MAX; memory may stay high after bursts");
    }
    let trim = std::thread::Builder::new().name("kvtier-trim".into()).spawn(|| {
        loop {
            std::thread::sleep(TRIM_EVERY);
            // SAFETY: malloc_trim is thread-safe and takes no pointers.
            unsafe { libc::malloc_trim(0) };
        }
    });
    if let Err(e) = trim {
        tracing::warn!(error = %e, "cannot start the trim thread; memory may stay high after bursts");
    }
}

/// Other allocators return memory their own way.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(crate) fn tune() {}
