//! Exclusive advisory locks (`flock`): one process at a time may use a tier's
//! file or a manifest. Two servers over the same files would each believe
//! they own every extent and every record, and destroy each other's writes.
//!
//! The kernel drops a lock when its holder exits, however it exits, so a
//! killed server never leaves a stale lock behind.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// How long to wait for a lock held by this process's own earlier user (a
/// store being dropped on a background thread) before calling it taken.
pub const LOCK_WAIT: Duration = Duration::from_secs(2);

/// Why [`LockFile::acquire`] failed.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process, or another open file of this one, held the lock for the whole wait.
    #[error("{path} is in use by another process ({holder}); stop it, or give this one other files")]
    Held {
        /// The lock file.
        path: PathBuf,
        /// The holder's description as it wrote it (`pid ...: command, since date`), or
        /// `holder unknown` when the file says nothing.
        holder: String,
    },
    /// Opening, locking or writing the lock file failed.
    #[error("cannot lock {path}: {source}")]
    Io {
        /// The lock file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

/// Takes an exclusive lock on `file`, retrying for up to `wait`; false if
/// another open file description still holds it then.
pub(crate) fn lock_exclusive(file: &File, wait: Duration) -> io::Result<bool> {
    let deadline = Instant::now() + wait;
    loop {
        // SAFETY: flock only reads the descriptor number, which `file` keeps
        // open for the duration of the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(true);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(err);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A lock file that says who holds it: the holder's pid, command line and
/// start time are written into it, and a process refused the lock reads
/// them back for its error message. Held until dropped.
#[derive(Debug)]
pub struct LockFile {
    _file: File,
}

impl LockFile {
    /// Opens (creating it if needed) `path` and takes an exclusive `flock` on it, retrying for up
    /// to `wait` (see [`LOCK_WAIT`]), then writes this process's description into it. Errors:
    /// [`LockError::Held`] when it is still held after `wait`, [`LockError::Io`] when the file
    /// cannot be opened, locked or written.
    pub fn acquire(path: &Path, wait: Duration) -> Result<Self, LockError> {
        let io = |source| LockError::Io {
            path: path.to_owned(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        if !lock_exclusive(&file, wait).map_err(io)? {
            let holder = std::fs::read_to_string(path)
                .ok()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "holder unknown".to_owned());
            return Err(LockError::Held {
                path: path.to_owned(),
                holder,
            });
        }
        file.set_len(0).map_err(io)?;
        writeln!(file, "{}", holder_description()).map_err(io)?;
        Ok(Self { _file: file })
    }
}

/// `pid 1234: kvtier serve --data-dir d, since Mon, 30 Nov 2026 15:27:55 GMT`.
fn holder_description() -> String {
    let command = std::fs::read("/proc/self/cmdline")
        .map(|raw| {
            raw.split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    let since = httpdate::fmt_http_date(SystemTime::now());
    format!("pid {}: {command}, since {since}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_description() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lock");
        let first = LockFile::acquire(&path, Duration::ZERO).unwrap();
        let err = LockFile::acquire(&path, Duration::from_millis(30)).unwrap_err();
        let message = err.to_string();
        assert!(message.contains(&format!("pid {}", std::process::id())), "{message}");
        drop(first);
        LockFile::acquire(&path, Duration::ZERO).unwrap();
    }
}
