//! Room for the page bytes a read returns: a response chunk's spare
//! capacity, a client's shared-memory window, or a plain buffer. Reads copy
//! straight from the tier into it, once, without zeroing it first; each page
//! says which range of it holds its bytes.

use std::mem::MaybeUninit;
use std::ops::Range;

use kvtier_core::wire;

use crate::{StoreError, StoreResult};

/// Bytes are taken from the front in read order. Every taken byte is
/// written before the read that took it returns `Ok`, so after a successful
/// read the first [`PageBuf::used`] bytes are initialised; after a failed
/// one, the buffer's contents are unspecified and must not be read.
#[derive(Debug)]
pub struct PageBuf<'a> {
    room: &'a mut [MaybeUninit<u8>],
    used: usize,
    /// Where `room` starts in the buffer it was split from: ranges handed
    /// out count from there.
    origin: usize,
}

impl<'a> PageBuf<'a> {
    /// A buffer over all of `room`, nothing taken yet; ranges count from its start.
    pub fn new(room: &'a mut [MaybeUninit<u8>]) -> Self {
        Self {
            room,
            used: 0,
            origin: 0,
        }
    }

    /// Takes `lens` bytes after another and hands each stretch out as a
    /// buffer of its own (for reads on several threads), whose ranges still
    /// count from this buffer's start. Each must be filled whole, as any
    /// taken byte (see [`PageBuf::zero_rest`]).
    pub(crate) fn split(&mut self, lens: &[usize]) -> StoreResult<Vec<PageBuf<'_>>> {
        let total: usize = lens.iter().sum();
        let start = self.take(total)?.start;
        let mut rest = &mut self.room[start - self.origin..start - self.origin + total];
        let mut origin = start;
        let mut parts = Vec::with_capacity(lens.len());
        for &len in lens {
            let (part, tail) = rest.split_at_mut(len);
            parts.push(PageBuf {
                room: part,
                used: 0,
                origin,
            });
            rest = tail;
            origin += len;
        }
        Ok(parts)
    }

    /// Takes and zeroes whatever is left, so that all of it counts as filled.
    pub(crate) fn zero_rest(&mut self) {
        let rest = self.used..self.room.len();
        self.room[rest].fill(MaybeUninit::new(0));
        self.used = self.room.len();
    }

    /// Bytes taken so far, from the start.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Bytes still free.
    pub fn remaining(&self) -> usize {
        self.room.len() - self.used
    }

    /// The next `len` bytes, which the caller fills before its read returns.
    /// Room is taken for what a call can return when it starts; a sequence
    /// that grows meanwhile (a fetch of every page, a selection on a short
    /// sequence) can pass it, and the call is then refused, to be retried.
    pub(crate) fn take(&mut self, len: usize) -> StoreResult<Range<usize>> {
        if len > self.remaining() {
            return Err(StoreError::precondition(
                wire::SEQUENCE_ID,
                format!(
                    "grew while the call ran, past the room taken for its pages ({len} bytes more, {} free); ask again",
                    self.remaining()
                ),
            ));
        }
        self.used += len;
        Ok(self.origin + self.used - len..self.origin + self.used)
    }

    /// The room of a range this buffer handed out.
    pub(crate) fn at(&mut self, range: &Range<usize>) -> &mut [MaybeUninit<u8>] {
        &mut self.room[range.start - self.origin..range.end - self.origin]
    }

    /// Fills a taken range (as long as `bytes`) with `bytes`.
    pub(crate) fn fill(&mut self, range: &Range<usize>, bytes: &[u8]) {
        let dst = self.at(range);
        assert_eq!(dst.len(), bytes.len());
        // SAFETY: `dst` and `bytes` are the same length (asserted), `dst` is
        // a unique borrow so they cannot overlap, and writing initialised
        // bytes into `MaybeUninit<u8>` is always valid.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.as_mut_ptr().cast::<u8>(), bytes.len()) };
    }

    /// Fills a taken range whose bytes are not to be had (a page found lost).
    pub(crate) fn zero(&mut self, range: &Range<usize>) {
        self.at(range).fill(MaybeUninit::new(0));
    }

    /// The bytes taken, after a successful read (of a buffer not split
    /// from another).
    pub(crate) fn filled(&self) -> &[u8] {
        debug_assert_eq!(self.origin, 0);
        // SAFETY: every taken byte was written before the read that took it
        // returned `Ok` (the type's invariant), and callers only look after
        // a successful read.
        unsafe { &*(&self.room[..self.used] as *const [MaybeUninit<u8>] as *const [u8]) }
    }
}
