//! Physical page ids: unique within a data directory, forever.
//!
//! Ids are handed out from blocks reserved in the manifest (an `Ids` record,
//! written before the first id of the block is given), so no restart can give
//! out an id again, whatever became of the page that had it. The manifest
//! then never holds two meanings for one id: a stale record about a freed
//! page can never be mistaken for a record about a new one.

use std::ops::Range;

use kvtier_sync::{Mutex, Rank};

use super::record::Record;
use super::{Manifest, ManifestError};

/// Ids reserved per manifest record.
const BLOCK: u64 = 1 << 16;

#[derive(Debug)]
pub(crate) struct PageIds {
    state: Mutex<Reserved>,
}

#[derive(Debug)]
struct Reserved {
    next: u64,
    /// Ids below this are reserved in the manifest (or there is none).
    end: u64,
}

impl PageIds {
    /// Ids from `next` on; none reserved yet.
    pub(crate) fn starting_at(next: u64) -> Self {
        Self {
            state: Mutex::new(Rank::PageIds, Reserved { next, end: next }),
        }
    }

    /// `n` fresh ids. With a manifest, a new block is reserved (and the
    /// reservation written to the OS) before an id beyond the last one is
    /// given out.
    pub(crate) fn take(&self, n: u64, manifest: Option<&Manifest>) -> Result<Range<u64>, ManifestError> {
        let mut s = self.state.lock();
        let start = s.next;
        // 2^64 ids do not run out; saturating keeps the arithmetic panic-free.
        let end = start.saturating_add(n);
        match manifest {
            Some(m) if end > s.end => {
                let reserved = end.saturating_add(BLOCK);
                m.append(vec![Record::Ids { next: reserved }]);
                m.commit()?;
                s.end = reserved;
            }
            Some(_) => {}
            None => s.end = end,
        }
        s.next = end;
        Ok(start..end)
    }

    /// The bound to write into a checkpoint: no id at or above it was given.
    pub(crate) fn reserved(&self) -> u64 {
        self.state.lock().end
    }
}
