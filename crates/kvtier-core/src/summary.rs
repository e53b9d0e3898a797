//! Summaries: `m` representative key/value rows that replace a page, each
//! with the number of original tokens it stands for. Attention over a summary
//! row weights it by its count, so a page of identical keys and values is
//! reproduced exactly.

use crate::DType;

/// The summary that replaces one page of one lane: `m` K/V rows with their
/// token counts.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Tokens represented by each row; they sum to the page's valid rows.
    pub counts: Vec<u32>,
    /// K rows `[m][head_dim]` then V rows `[m][head_dim]`, in the page dtype.
    pub kv: Vec<u8>,
}

impl Summary {
    /// Splits the page's `n` rows into `m` consecutive chunks (sizes differ
    /// by at most one; `m` is clamped to `1..=n`) and keeps each chunk's mean.
    /// Means are accumulated in f64, so identical rows give back exactly the
    /// same row in any dtype.
    pub fn chunk_means(dtype: DType, head_dim: usize, keys: &[u8], values: &[u8], m: u32) -> Self {
        let row = head_dim * dtype.size();
        let n = keys.len() / row;
        assert!(
            n >= 1 && values.len() == keys.len(),
            "summary needs matching K and V rows"
        );
        let m = (m as usize).clamp(1, n);
        let counts: Vec<u32> = (0..m).map(|i| ((n * (i + 1)) / m - (n * i) / m) as u32).collect();
        let mut kv = vec![0u8; 2 * m * row];
        let (k_out, v_out) = kv.split_at_mut(m * row);
        let mut first = 0;
        for (chunk, &count) in counts.iter().enumerate() {
            for (src, dst) in [(keys, &mut *k_out), (values, &mut *v_out)] {
                for i in 0..head_dim {
                    let sum: f64 = (first..first + count as usize)
                        .map(|r| f64::from(dtype.get_f32(src, r * head_dim + i)))
                        .sum();
                    dtype.put_f32(dst, chunk * head_dim + i, (sum / f64::from(count)) as f32);
                }
            }
            first += count as usize;
        }
        Self { counts, kv }
    }

    /// Number of summary rows, `m`.
    pub fn rows(&self) -> usize {
        self.counts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_rows_are_reproduced_exactly() {
        for dtype in DType::ALL {
            let d = 5;
            let mut keys = vec![0u8; 7 * d * dtype.size()];
            let mut values = keys.clone();
            for r in 0..7 {
                for i in 0..d {
                    dtype.put_f32(&mut keys, r * d + i, 0.1 + i as f32 * 1.37);
                    dtype.put_f32(&mut values, r * d + i, -3.3e3 + i as f32);
                }
            }
            for m in 1..=7 {
                let s = Summary::chunk_means(dtype, d, &keys, &values, m);
                assert_eq!(s.counts.iter().sum::<u32>(), 7);
                let row = d * dtype.size();
                for chunk in 0..s.rows() {
                    assert_eq!(&s.kv[chunk * row..(chunk + 1) * row], &keys[..row], "{dtype} m={m}");
                    let v0 = s.rows() * row;
                    assert_eq!(&s.kv[v0 + chunk * row..v0 + (chunk + 1) * row], &values[..row]);
                }
            }
        }
    }

    #[test]
    fn chunks_average_their_rows_and_count_them() {
        let d = DType::F32;
        let keys: Vec<u8> = [1.0f32, 3.0, 5.0, 10.0, 20.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let s = Summary::chunk_means(d, 1, &keys, &keys, 2);
        assert_eq!(s.counts, [2, 3]);
        assert_eq!(d.to_f32_vec(&s.kv), [2.0, 35.0 / 3.0, 2.0, 35.0 / 3.0]);
        // More rows asked than exist: one row per token, exact.
        let s = Summary::chunk_means(d, 1, &keys, &keys, 9);
        assert_eq!(s.counts, [1; 5]);
    }
}
