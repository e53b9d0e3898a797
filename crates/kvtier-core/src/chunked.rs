//! A vector kept in fixed-size chunks. Pushing never moves what is there, so
//! growing by one costs the same at any length: a doubling vector copies and
//! faults in its whole contents on the push that crosses a power of two,
//! which for per-lane metadata lands on one unlucky decode step.

/// Elements per chunk.
const CHUNK: usize = 512;

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
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn push(&mut self, value: T) {
        if self.len.is_multiple_of(CHUNK) {
            // The first chunk grows as needed (most vectors stay short).
            let capacity = if self.chunks.is_empty() { 0 } else { CHUNK };
            self.chunks.push(Vec::with_capacity(capacity));
        }
        self.chunks.last_mut().expect("pushed above").push(value);
        self.len += 1;
    }

    pub fn get(&self, i: usize) -> Option<&T> {
        self.chunks.get(i / CHUNK)?.get(i % CHUNK)
    }

    pub fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.chunks.get_mut(i / CHUNK)?.get_mut(i % CHUNK)
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }

    /// Takes every element out, leaving the vector empty.
    pub fn take(&mut self) -> impl Iterator<Item = T> + use<T> {
        self.len = 0;
        std::mem::take(&mut self.chunks).into_iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
