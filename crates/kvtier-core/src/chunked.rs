//! A vector kept in fixed-size chunks. Pushing never moves what is there, so
//! growing by one costs the same at any length: a doubling vector copies and
//! faults in its whole contents on the push that crosses a power of two,
//! which for per-lane metadata lands on one unlucky decode step.

/// Elements per chunk.
const CHUNK: usize = 512;

/// A growable vector of `T` kept in chunks of 512 elements, so a push never
/// moves existing elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkedVec<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for ChunkedVec<T> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T> ChunkedVec<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `value` at the end, opening a new chunk when the last is full.
    pub fn push(&mut self, value: T) {
        if self.len.is_multiple_of(CHUNK) {
            // The first chunk grows as needed (most vectors stay short).
            let capacity = if self.chunks.is_empty() { 0 } else { CHUNK };
            self.chunks.push(Vec::with_capacity(capacity));
        }
        self.chunks.last_mut().expect("pushed above").push(value);
        self.len += 1;
    }

    /// Element `i`, or `None` if `i` is out of bounds.
    pub fn get(&self, i: usize) -> Option<&T> {
        self.chunks.get(i / CHUNK)?.get(i % CHUNK)
    }

    /// Element `i` mutably, or `None` if `i` is out of bounds.
    pub fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.chunks.get_mut(i / CHUNK)?.get_mut(i % CHUNK)
    }

    /// The elements in order.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }

    /// Takes every element out, leaving the vector empty.
    pub fn take(&mut self) -> impl Iterator<Item = T> + use<T> {
        self.len = 0;
        std::mem::take(&mut self.chunks).into_iter().flatten()
    }
}

/// Fixed-size byte entries kept in chunks of `per_chunk` contiguous
/// entries: scanning is a few sequential reads, and growing never moves what
/// is there (see [`ChunkedVec`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkedEntries {
    entry_bytes: usize,
    per_chunk: usize,
    chunks: Vec<Vec<u8>>,
    len: usize,
}

impl ChunkedEntries {
    /// An empty set of entries of `entry_bytes` bytes each, `per_chunk` entries per chunk.
    pub fn new(entry_bytes: usize, per_chunk: usize) -> Self {
        Self {
            entry_bytes,
            per_chunk,
            chunks: Vec::new(),
            len: 0,
        }
    }

    /// Bytes of one entry.
    pub fn entry_bytes(&self) -> usize {
        self.entry_bytes
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of all entries.
    pub fn byte_len(&self) -> usize {
        self.len * self.entry_bytes
    }

    /// The entries in order: every chunk holds `per_chunk` entries but the last.
    pub fn chunks(&self) -> impl Iterator<Item = &[u8]> {
        self.chunks.iter().map(Vec::as_slice)
    }

    /// Entry `i` (`entry_bytes` bytes). Panics if `i` is out of bounds.
    pub fn get(&self, i: usize) -> &[u8] {
        let at = i % self.per_chunk * self.entry_bytes;
        &self.chunks[i / self.per_chunk][at..at + self.entry_bytes]
    }

    /// Entry `i` mutably. Panics if `i` is out of bounds.
    pub fn get_mut(&mut self, i: usize) -> &mut [u8] {
        let at = i % self.per_chunk * self.entry_bytes;
        &mut self.chunks[i / self.per_chunk][at..at + self.entry_bytes]
    }

    /// Appends a zeroed entry and returns it.
    pub fn push_zeroed(&mut self) -> &mut [u8] {
        if self.len.is_multiple_of(self.per_chunk) {
            // The first chunk grows as needed (most columns stay small);
            // later ones are made whole.
            let capacity = if self.chunks.is_empty() {
                0
            } else {
                self.per_chunk * self.entry_bytes
            };
            self.chunks.push(Vec::with_capacity(capacity));
        }
        let chunk = self.chunks.last_mut().expect("pushed above");
        chunk.resize(chunk.len() + self.entry_bytes, 0);
        self.len += 1;
        let end = chunk.len();
        &mut chunk[end - self.entry_bytes..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_keep_their_order_across_chunks() {
        let mut e = ChunkedEntries::new(3, 4);
        for i in 0..10u8 {
            e.push_zeroed()[0] = i;
        }
        assert_eq!((e.len(), e.byte_len()), (10, 30));
        e.get_mut(5)[2] = 9;
        let sizes: Vec<usize> = e.chunks().map(<[u8]>::len).collect();
        assert_eq!(sizes, [12, 12, 6]);
        assert_eq!(e.get(5), [5, 0, 9]);
        let firsts: Vec<u8> = e
            .chunks()
            .flat_map(|c| c.chunks(3).map(|x| x[0]).collect::<Vec<_>>())
            .collect();
        assert_eq!(firsts, (0..10).collect::<Vec<u8>>());
    }

    #[test]
    fn behaves_like_a_vector_across_chunks() {
        let mut v = ChunkedVec::default();
        let n = 2 * CHUNK + 5;
        for i in 0..n {
            v.push(i);
        }
        assert_eq!(v.len(), n);
        assert_eq!(v.get(CHUNK), Some(&CHUNK));
        assert_eq!(v.get(n), None);
        *v.get_mut(CHUNK + 1).unwrap() = 0;
        let want: Vec<usize> = (0..n).map(|i| if i == CHUNK + 1 { 0 } else { i }).collect();
        assert_eq!(v.iter().copied().collect::<Vec<_>>(), want);
        assert_eq!(v.take().collect::<Vec<_>>(), want);
        assert!(v.is_empty());
        assert_eq!(v.get(0), None);
    }
}
