//! Room for the page bytes a read returns: a response chunk's spare
//! capacity, a client's shared-memory window, or a plain buffer. Reads copy
//! straight from the tier into it, once, without zeroing it first; each page
//! says which range of it holds its bytes.
//!
//! A page's bytes are its K rows then its V rows, halves of one length. A
//! buffer lays them out one page after another, or, made
//! [`PageBuf::per_head`], each run of pages (a KV head's, in a read of
//! several heads) as all its pages' K rows then all their V rows: what a
//! decode step's attention reads per head, without a second copy to gather
//! it.

use std::mem::MaybeUninit;
use std::ops::Range;

use kvtier_core::wire;

use crate::{StoreError, StoreResult};

/// Bytes are taken from the front in read order. Every taken byte is
/// written before the read that took it returns `Ok`, so after a successful
/// read the first [`PageBuf::used`] bytes are initialised; after a failed
/// one, the buffer's contents are unspecified and must not be read.
///
/// Ranges are handed out as if pages lay one after another. Per head, a
/// range stands for its two halves in its run ([`PageBuf::halves`]): a run
/// `[s, s + n)` holds the K half of the page at `s + x` (of length `2h`) at
/// `s + x / 2`, and its V half at `s + n / 2 + x / 2`, `h` bytes each, so
/// that the runs' pages fill exactly the bytes they take.
#[derive(Debug)]
pub struct PageBuf<'a> {
    room: &'a mut [MaybeUninit<u8>],
    used: usize,
    /// Where `room` starts in the buffer it was split from: ranges handed
    /// out count from there.
    origin: usize,
    /// Per head: the runs declared so far ([`PageBuf::declare_runs`]), in
    /// order, counted from the buffer's start; `None` lays pages out one
    /// after another.
    runs: Option<Vec<Range<usize>>>,
}

impl<'a> PageBuf<'a> {
    /// A buffer over all of `room`, nothing taken yet, pages one after
    /// another; ranges count from its start.
    pub fn new(room: &'a mut [MaybeUninit<u8>]) -> Self {
        Self {
            room,
            used: 0,
            origin: 0,
            runs: None,
        }
    }

    /// A buffer over all of `room` that lays each run of pages the read
    /// declares out as their K halves then their V halves.
    pub fn per_head(room: &'a mut [MaybeUninit<u8>]) -> Self {
        Self {
            runs: Some(Vec::new()),
            ..Self::new(room)
        }
    }

    /// Says that the next pages taken come in runs of these many bytes,
    /// each to be laid out per head (where the buffer does that; nothing
    /// otherwise). Each run must be taken whole before the next starts.
    pub(crate) fn declare_runs(&mut self, lens: &[usize]) -> StoreResult<()> {
        let Some(runs) = self.runs.as_mut() else {
            return Ok(());
        };
        let mut at = runs.last().map_or(self.origin + self.used, |r| r.end);
        for &len in lens {
            if !len.is_multiple_of(2) {
                return Err(StoreError::Internal(format!(
                    "a run of {len} bytes has no two equal halves"
                )));
            }
            runs.push(at..at + len);
            at += len;
        }
        if at - self.origin > self.room.len() {
            return Err(too_small(at - self.origin - self.used, self.remaining()));
        }
        Ok(())
    }

    /// Takes `lens` bytes after another and hands each stretch out as a
    /// buffer of its own (for reads on several threads), whose ranges still
    /// count from this buffer's start. Each must be filled whole, as any
    /// taken byte (see [`PageBuf::zero_rest`]). Per head, each stretch
    /// holds whole runs, and keeps them.
    pub(crate) fn split(&mut self, lens: &[usize]) -> StoreResult<Vec<PageBuf<'_>>> {
        let total: usize = lens.iter().sum();
        let start = self.take_bytes(total)?.start;
        let mut rest = &mut self.room[start - self.origin..start - self.origin + total];
        let mut origin = start;
        let mut parts = Vec::with_capacity(lens.len());
        for &len in lens {
            let (part, tail) = rest.split_at_mut(len);
            let stretch = origin..origin + len;
            let runs = match &self.runs {
                Some(runs) => Some(runs_within(runs, &stretch)?),
                None => None,
            };
            parts.push(PageBuf {
                room: part,
                used: 0,
                origin,
                runs,
            });
            rest = tail;
            origin += len;
        }
        Ok(parts)
    }

    /// Takes and zeroes whatever is left, so that all of it counts as
    /// filled. Per head, every run must have been taken whole: a run taken
    /// in part has bytes inside it that no page wrote.
    pub(crate) fn zero_rest(&mut self) -> StoreResult<()> {
        let at = self.origin + self.used;
        if let Some(runs) = &self.runs
            && runs.iter().any(|r| r.start < at && at < r.end)
        {
            return Err(StoreError::Internal(format!(
                "a per-head read stopped at {at}, inside one of its runs"
            )));
        }
        let rest = self.used..self.room.len();
        self.room[rest].fill(MaybeUninit::new(0));
        self.used = self.room.len();
        Ok(())
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
    /// Per head, a page must lie within the run it starts in.
    pub(crate) fn take(&mut self, len: usize) -> StoreResult<Range<usize>> {
        let start = self.origin + self.used;
        if let Some(runs) = &self.runs
            && len > 0
        {
            if !len.is_multiple_of(2) {
                return Err(StoreError::Internal(format!(
                    "a page of {len} bytes has no two equal halves to lay out per head"
                )));
            }
            let free = runs
                .iter()
                .find(|r| r.start <= start && start < r.end)
                .map_or(0, |r| r.end - start);
            if len > free {
                return Err(too_small(len, free));
            }
        }
        self.take_bytes(len)
    }

    /// The next `len` bytes, runs or not.
    fn take_bytes(&mut self, len: usize) -> StoreResult<Range<usize>> {
        if len > self.remaining() {
            return Err(too_small(len, self.remaining()));
        }
        self.used += len;
        Ok(self.origin + self.used - len..self.origin + self.used)
    }

    /// Where a taken range's K half and V half lie, counted from the
    /// buffer's start: one after the other, or per head in its run.
    pub fn halves(&self, range: &Range<usize>) -> (Range<usize>, Range<usize>) {
        let half = range.len() / 2;
        let run = self
            .runs
            .as_ref()
            .and_then(|runs| runs.iter().find(|r| r.start <= range.start && range.end <= r.end));
        match run {
            Some(run) => {
                let k = run.start + (range.start - run.start) / 2;
                let v = k + run.len() / 2;
                (k..k + half, v..v + half)
            }
            None => (range.start..range.start + half, range.start + half..range.end),
        }
    }

    /// The room of a range this buffer handed out: its K half's, and its
    /// V half's.
    #[allow(clippy::type_complexity)]
    pub(crate) fn at(&mut self, range: &Range<usize>) -> (&mut [MaybeUninit<u8>], &mut [MaybeUninit<u8>]) {
        let (k, v) = self.halves(range);
        let (k, v) = (
            k.start - self.origin..k.end - self.origin,
            v.start - self.origin..v.end - self.origin,
        );
        // The K half always lies before the V half, apart or adjoining.
        let (front, back) = self.room.split_at_mut(v.start);
        (&mut front[k], &mut back[..v.len()])
    }

    /// Fills a taken range (as long as `bytes`) with `bytes`.
    pub(crate) fn fill(&mut self, range: &Range<usize>, bytes: &[u8]) {
        assert_eq!(range.len(), bytes.len());
        let (k_bytes, v_bytes) = bytes.split_at(bytes.len() / 2);
        let (k, v) = self.at(range);
        write(k, k_bytes);
        write(v, v_bytes);
    }

    /// Fills a taken range whose bytes are not to be had (a page found lost).
    pub(crate) fn zero(&mut self, range: &Range<usize>) {
        let (k, v) = self.at(range);
        k.fill(MaybeUninit::new(0));
        v.fill(MaybeUninit::new(0));
    }

    /// Runs `read` over a new buffer of `capacity` bytes and, once it
    /// has succeeded, gives back the bytes it took as a vector of their
    /// own, which outlives whatever lock the read held.
    pub(crate) fn read_owned<T>(
        capacity: usize,
        read: impl FnOnce(&mut PageBuf<'_>) -> StoreResult<T>,
    ) -> StoreResult<(T, Vec<u8>)> {
        let mut room = Vec::with_capacity(capacity);
        let (value, used) = {
            let mut buf = PageBuf::new(room.spare_capacity_mut());
            let value = read(&mut buf)?;
            (value, buf.used())
        };
        // SAFETY: the buffer took its first `used` bytes (at most
        // `capacity`) from `room`, and a read that returned `Ok` wrote
        // every byte it took (the type's invariant, as `filled` has it).
        unsafe { room.set_len(used) };
        Ok((value, room))
    }

    /// The bytes taken, after a successful read (of a buffer not split
    /// from another).
    pub(crate) fn filled(&self) -> &[u8] {
        debug_assert_eq!(self.origin, 0);
        // SAFETY: every taken byte was written before the read that took it
        // returned `Ok` (the type's invariant: per head too, since a run's
        // pages' halves cover exactly the bytes they took), and callers only
        // look after a successful read.
        unsafe { &*(&self.room[..self.used] as *const [MaybeUninit<u8>] as *const [u8]) }
    }
}

/// The runs of `runs` inside `stretch`, which must hold each it meets whole.
fn runs_within(runs: &[Range<usize>], stretch: &Range<usize>) -> StoreResult<Vec<Range<usize>>> {
    let mut inside = Vec::new();
    for r in runs.iter().filter(|r| r.start < stretch.end && stretch.start < r.end) {
        if r.start < stretch.start || stretch.end < r.end {
            return Err(StoreError::Internal(format!(
                "a run {r:?} straddles a share {stretch:?} of a per-head read"
            )));
        }
        inside.push(r.clone());
    }
    Ok(inside)
}

/// Copies `src` into `dst`, of the same length.
fn write(dst: &mut [MaybeUninit<u8>], src: &[u8]) {
    assert_eq!(dst.len(), src.len());
    // SAFETY: `dst` and `src` are the same length (asserted), `dst` is a
    // unique borrow so they cannot overlap, and writing initialised bytes
    // into `MaybeUninit<u8>` is always valid.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), src.len()) };
}

/// A read that needs `len` bytes more where `free` are left.
fn too_small(len: usize, free: usize) -> StoreError {
    StoreError::precondition(
        wire::SEQUENCE_ID,
        format!(
            "grew while the call ran, past the room taken for its pages ({len} bytes more, {free} free); ask again"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A page's bytes: K half then V half, `2 * half` bytes, each byte
    /// naming its page and half.
    fn page_bytes(id: u8, half: usize) -> Vec<u8> {
        (0..2 * half)
            .map(|i| id.wrapping_mul(2).wrapping_add(u8::from(i >= half)))
            .collect()
    }

    /// The model: per run, its pages' K halves in order, then their V halves.
    fn gathered(runs: &[Vec<usize>]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut id = 0u8;
        for run in runs {
            let pages: Vec<Vec<u8>> = run
                .iter()
                .map(|&half| {
                    id = id.wrapping_add(1);
                    page_bytes(id, half)
                })
                .collect();
            for (p, &half) in pages.iter().zip(run) {
                out.extend_from_slice(&p[..half]);
            }
            for (p, &half) in pages.iter().zip(run) {
                out.extend_from_slice(&p[half..]);
            }
        }
        out
    }

    /// Reads `runs` (pages' half lengths) into `buf` as a store read does:
    /// runs declared, shared out over `shares` stretches, each page taken
    /// and filled; returns each page's range.
    fn read(buf: &mut PageBuf<'_>, runs: &[Vec<usize>], shares: usize) -> Vec<Range<usize>> {
        let lens: Vec<usize> = runs.iter().map(|r| 2 * r.iter().sum::<usize>()).collect();
        buf.declare_runs(&lens).unwrap();
        let per = runs.len().div_ceil(shares).max(1);
        let share_lens: Vec<usize> = lens.chunks(per).map(|c| c.iter().sum()).collect();
        let mut parts = buf.split(&share_lens).unwrap();
        let mut ranges = Vec::new();
        let mut id = 0u8;
        for (part, share) in parts.iter_mut().zip(runs.chunks(per)) {
            for &half in share.iter().flatten() {
                id = id.wrapping_add(1);
                let range = part.take(2 * half).unwrap();
                part.fill(&range, &page_bytes(id, half));
                ranges.push(range);
            }
            part.zero_rest().unwrap();
        }
        ranges
    }

    fn runs() -> impl Strategy<Value = Vec<Vec<usize>>> {
        proptest::collection::vec(proptest::collection::vec(0usize..40, 0..6), 0..6)
    }

    proptest! {
        /// Per head, the buffer holds each run's K halves then its V
        /// halves, however the runs are shared out; each range's halves
        /// say where its page's are.
        #[test]
        fn per_head_lays_each_run_out_as_the_model_gathers_it(runs in runs(), shares in 1usize..4) {
            let want = gathered(&runs);
            let mut room = vec![MaybeUninit::new(0xEE); want.len()];
            let mut buf = PageBuf::per_head(&mut room);
            let ranges = read(&mut buf, &runs, shares);
            prop_assert_eq!(buf.used(), want.len());
            prop_assert_eq!(buf.filled(), &want[..]);
            let mut id = 0u8;
            for (range, &half) in ranges.iter().zip(runs.iter().flatten()) {
                id = id.wrapping_add(1);
                let (k, v) = buf.halves(range);
                let page = page_bytes(id, half);
                prop_assert_eq!(&buf.filled()[k], &page[..half]);
                prop_assert_eq!(&buf.filled()[v], &page[half..]);
            }
        }

        /// One after another, the same reads leave the pages as they came.
        #[test]
        fn one_after_another_pages_lie_as_read(runs in runs(), shares in 1usize..4) {
            let len: usize = runs.iter().flatten().map(|h| 2 * h).sum();
            let mut room = vec![MaybeUninit::new(0xEE); len];
            let mut buf = PageBuf::new(&mut room);
            read(&mut buf, &runs, shares);
            let mut id = 0u8;
            let want: Vec<u8> = runs.iter().flatten().flat_map(|&h| {
                id = id.wrapping_add(1);
                page_bytes(id, h)
            }).collect();
            prop_assert_eq!(buf.filled(), &want[..]);
        }
    }

    #[test]
    fn a_page_past_its_run_is_refused_as_a_grown_sequence() {
        let mut room = vec![MaybeUninit::new(0); 64];
        let mut buf = PageBuf::per_head(&mut room);
        buf.declare_runs(&[8, 8]).unwrap();
        buf.take(4).unwrap();
        let refused = buf.take(8).unwrap_err().to_string();
        assert!(refused.contains("grew while the call ran"), "{refused}");
        assert!(buf.take(3).is_err(), "a page with no equal halves");
        assert!(buf.zero_rest().is_err(), "a run taken in part");
        assert!(buf.declare_runs(&[3]).is_err(), "a run with no equal halves");
        assert!(buf.declare_runs(&[64]).is_err(), "a run past the room");
    }
}
