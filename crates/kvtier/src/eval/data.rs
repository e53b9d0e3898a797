//! One layer's queries, keys and values in memory: read from a realkv
//! dataset, or built (synthetic, or with planted keys) by the failure tests.
//! Keys and values are f16, as stored; the f32 copies are their exact values.

use std::path::Path;

use std::sync::Arc;

use anyhow::{Context, bail, ensure};
use kvtier_core::{DType, Layout, LayoutSpec, SequenceKey};
use kvtier_store::{HeadRange, PutPages, Store, StoreConfig};

use super::npz;

#[derive(Debug, Clone)]
pub(crate) struct LayerData {
    pub(crate) layer: u32,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) tokens: usize,
    pub(crate) scale: f64,
    /// `[heads][tokens][head_dim]`.
    pub(crate) q: Vec<f32>,
    /// `[kv_heads][tokens][head_dim]`, f16-exact.
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

impl LayerData {
    pub(crate) fn read(dir: &Path, meta: &super::Meta, layer: u32) -> anyhow::Result<Self> {
        let arrays = npz::read_npz(&dir.join(format!("layer{layer:02}.npz")))?;
        let get = |name: &str| {
            arrays
                .get(name)
                .with_context(|| format!("layer {layer}: no array {name:?}"))
        };
        let (q, k, v) = (get("q")?, get("k")?, get("v")?);
        let (h, kvh, d, t) = (meta.heads, meta.kv_heads, meta.head_dim, meta.tokens);
        ensure!(
            q.shape == [h, t, d] && k.shape == [kvh, t, d] && v.shape == [kvh, t, d],
            "layer {layer}: shapes"
        );
        if k.descr != "<f2" || v.descr != "<f2" {
            bail!("layer {layer}: keys and values must be float16");
        }
        Ok(Self {
            layer,
            heads: h,
            kv_heads: kvh,
            head_dim: d,
            tokens: t,
            scale: meta.scale,
            q: q.to_f32()?,
            k: k.to_f32()?,
            v: v.to_f32()?,
        })
    }

    /// The first `tokens` positions only.
    #[cfg(test)]
    pub(crate) fn truncated(&self, tokens: usize) -> Self {
        let cut = |a: &[f32], heads: usize| -> Vec<f32> {
            (0..heads)
                .flat_map(|h| {
                    a[h * self.tokens * self.head_dim..][..tokens * self.head_dim]
                        .iter()
                        .copied()
                })
                .collect()
        };
        Self {
            tokens,
            q: cut(&self.q, self.heads),
            k: cut(&self.k, self.kv_heads),
            v: cut(&self.v, self.kv_heads),
            ..self.clone()
        }
    }

    /// A host-only store with this layer as the one layer of sequence
    /// `eval/name`, tokens `0..prefill` written; and its KV heads.
    pub(crate) fn store(
        &self,
        page_size: u32,
        name: &str,
        prefill: usize,
    ) -> anyhow::Result<(Arc<Store>, SequenceKey, HeadRange)> {
        let layout = Layout::new(LayoutSpec {
            num_layers: 1,
            num_kv_heads: self.kv_heads as u32,
            num_query_heads: self.heads as u32,
            head_dim: self.head_dim as u32,
            dtype: DType::F16,
            page_size,
            layer_groups: vec![],
        })?;
        let store = Store::new(StoreConfig {
            device_bytes: 0,
            host_bytes: (2 * self.kv_heads * self.tokens * layout.row_bytes()) as u64 * 2 + (64 << 20),
            cache_writes_on_device: false,
            ..StoreConfig::default()
        })?;
        let key = SequenceKey::parse("eval", name)?;
        store.create_sequence(key.clone(), layout, vec![])?;
        let heads = HeadRange {
            start: 0,
            count: self.kv_heads as u32,
        };
        if prefill > 0 {
            let kv = self.kv_message(0..prefill);
            store.put_pages(
                &key,
                PutPages {
                    layer: 0,
                    heads,
                    first_page: 0,
                    num_tokens: prefill as u32,
                    kv: &kv,
                    persist: false,
                },
            )?;
        }
        Ok((store, key, heads))
    }

    pub(crate) fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    pub(crate) fn query(&self, head: usize, t: usize) -> &[f32] {
        let d = self.head_dim;
        &self.q[(head * self.tokens + t) * d..(head * self.tokens + t + 1) * d]
    }

    /// Every query head's query at position `t`, head after head.
    pub(crate) fn queries_at(&self, t: usize) -> Vec<f32> {
        (0..self.heads).flat_map(|h| self.query(h, t).iter().copied()).collect()
    }

    /// Keys (or values) of `kv_head` for tokens `0..n`, `[n][head_dim]`.
    pub(crate) fn keys(&self, kv_head: usize, n: usize) -> &[f32] {
        let base = kv_head * self.tokens * self.head_dim;
        &self.k[base..base + n * self.head_dim]
    }

    pub(crate) fn values(&self, kv_head: usize, n: usize) -> &[f32] {
        let base = kv_head * self.tokens * self.head_dim;
        &self.v[base..base + n * self.head_dim]
    }

    /// The store's `kv` message for tokens `range`: per KV head, K rows then
    /// V rows, in f16.
    pub(crate) fn kv_message(&self, range: std::ops::Range<usize>) -> Vec<u8> {
        let d = self.head_dim;
        let mut out = Vec::with_capacity(self.kv_heads * 2 * range.len() * d * 2);
        for h in 0..self.kv_heads {
            for a in [&self.k, &self.v] {
                let base = h * self.tokens * d;
                for x in &a[base + range.start * d..base + range.end * d] {
                    out.extend_from_slice(&half::f16::from_f32(*x).to_le_bytes());
                }
            }
        }
        out
    }

    /// Sets key `t` of `kv_head` (rounded to f16, as stored).
    pub(crate) fn set_key(&mut self, kv_head: usize, t: usize, key: &[f32]) {
        let d = self.head_dim;
        let at = (kv_head * self.tokens + t) * d;
        for (dst, x) in self.k[at..at + d].iter_mut().zip(key) {
            *dst = half::f16::from_f32(*x).to_f32();
        }
    }

    pub(crate) fn set_query(&mut self, head: usize, t: usize, q: &[f32]) {
        let d = self.head_dim;
        self.q[(head * self.tokens + t) * d..(head * self.tokens + t + 1) * d].copy_from_slice(q);
    }

    /// The attention of query head `head` at `t` over the tokens in `mask`
    /// (all of `0..=t` when `None`), per token of `0..=t`.
    pub(crate) fn attention(&self, head: usize, t: usize, mask: Option<&[bool]>) -> Vec<f64> {
        let d = self.head_dim;
        let q = self.query(head, t);
        let keys = self.keys(head / self.group(), t + 1);
        let logits: Vec<f64> = keys
            .chunks_exact(d)
            .enumerate()
            .map(|(j, k)| match mask {
                Some(m) if !m[j] => f64::NEG_INFINITY,
                _ => k.iter().zip(q).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() * self.scale,
            })
            .collect();
        let top = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = logits.iter().map(|l| (l - top).exp()).collect();
        let total: f64 = w.iter().sum();
        w.iter().map(|x| x / total).collect()
    }

    /// Per KV head, the mean over its query group of [`Self::attention`]:
    /// what a worker reports for the query at `t`. `[kv_heads][t + 1]`.
    pub(crate) fn group_attention(&self, t: usize, masks: Option<&[Vec<bool>]>) -> Vec<f32> {
        let group = self.group();
        let mut out = vec![0f32; self.kv_heads * (t + 1)];
        for h in 0..self.heads {
            let kv = h / group;
            let a = self.attention(h, t, masks.map(|m| &m[kv][..]));
            for (o, w) in out[kv * (t + 1)..(kv + 1) * (t + 1)].iter_mut().zip(a) {
                *o += (w / group as f64) as f32;
            }
        }
        out
    }
}
