//! One direct I/O operation as the engines see it. The operation owns its
//! buffer and, for owned-buffer calls, keeps the slot alive, so nothing it
//! points at can be freed or reused before the kernel is done with it.

use std::io;
use std::sync::Arc;

use crate::{AlignedBuf, Slot};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Read,
    Write,
}

/// What keeps the operation's file extent reserved until it completes.
#[derive(Debug)]
pub(crate) enum Keep {
    /// The caller blocks until completion while holding the slot.
    Borrowed,
    Shared(#[expect(dead_code, reason = "held, never read: keeps the extent reserved")] Arc<Slot>),
    Owned(Slot),
}

/// Delivers a finished operation to whoever waits for it; dropped unrun, it
/// tells the waiter the engine stopped.
pub(crate) type Finish = Box<dyn FnOnce(IoDone) + Send>;

pub(crate) struct IoOp {
    pub(crate) kind: OpKind,
    /// File offset; a multiple of the I/O alignment.
    pub(crate) offset: u64,
    /// Bytes to transfer from the start of `buf`; a multiple of the alignment.
    pub(crate) len: usize,
    pub(crate) buf: AlignedBuf,
    pub(crate) keep: Keep,
    pub(crate) done: Finish,
}

impl std::fmt::Debug for IoOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoOp")
            .field("kind", &self.kind)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

/// A finished operation: the buffer back, the slot back if it was moved in.
#[derive(Debug)]
pub(crate) struct IoDone {
    pub(crate) buf: AlignedBuf,
    pub(crate) keep: Keep,
    pub(crate) result: io::Result<()>,
}

impl IoOp {
    pub(crate) fn finish(self, result: io::Result<()>) {
        let IoOp { buf, keep, done, .. } = self;
        done(IoDone { buf, keep, result });
    }

    /// Gives up on an operation the kernel may still be using: its buffer
    /// and slot are leaked (a leak is safe, a use after free is not) and the
    /// waiter is told the engine stopped.
    pub(crate) fn abandon(self) {
        let IoOp { buf, keep, done, .. } = self;
        std::mem::forget(buf);
        std::mem::forget(keep);
        drop(done);
    }
}
