//! What the decode benchmark writes and asks: model shapes, the context's
//! K/V, and each step's queries — synthetic with a tunable drift, or real
//! (a realkv dataset's consecutive positions).

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, ensure};
use bytes::Bytes;

use crate::eval::npz;
use crate::shape::Shape;

/// A cheap, seeded, stateless hash.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// A real dataset's arrays for some layers.
#[derive(Debug)]
pub(crate) struct RealKv {
    tokens: usize,
    /// Per dataset layer: (q `[H][T][d]`, k `[KV][T][d]`, v `[KV][T][d]`) as f32.
    layers: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
}

impl RealKv {
    pub(crate) fn load(dir: &Path, shape: &Shape) -> anyhow::Result<Self> {
        let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json"))?)?;
        let tokens = meta["T"].as_u64().context("meta.json: T")? as usize;
        ensure!(
            meta["n_kv_heads"].as_u64() == Some(u64::from(shape.kv_heads))
                && meta["n_heads"].as_u64() == Some(u64::from(shape.query_heads))
                && meta["head_dim"].as_u64() == Some(u64::from(shape.head_dim)),
            "the dataset's heads and head_dim do not match the layout (use --preset smollm2-135m)"
        );
        let mut layers = Vec::new();
        for l in meta["layers"].as_array().context("meta.json: layers")? {
            let arrays = npz::read_npz(&dir.join(format!("layer{:02}.npz", l.as_u64().unwrap_or(0))))?;
            let get = |n: &str| arrays.get(n).context("missing array").and_then(npz::Array::to_f32);
            layers.push((get("q")?, get("k")?, get("v")?));
        }
        ensure!(!layers.is_empty(), "no layers in the dataset");
        Ok(Self { tokens, layers })
    }

    pub(crate) fn tokens(&self) -> usize {
        self.tokens
    }
}

/// Where queries come from.
#[derive(Debug, Clone)]
pub(crate) enum Queries {
    /// Keys cluster on one dimension per page; a query weighs a set of
    /// dimensions, of which a `drift` fraction changes each step.
    Synthetic {
        drift: f64,
        seed: u64,
    },
    Real(Arc<RealKv>),
}

/// One sequence's data and its queries, step by step.
#[derive(Debug)]
pub(crate) struct SequenceData {
    shape: Shape,
    queries: Queries,
    id: u64,
    /// Active query dimensions per (layer, KV head) for synthetic queries.
    active: Vec<Vec<usize>>,
    step: u64,
}

impl SequenceData {
    pub(crate) fn new(shape: &Shape, queries: &Queries, id: u64, context: usize, budget_pages: usize) -> Self {
        let d = shape.head_dim as usize;
        let lanes = (shape.layers * shape.kv_heads) as usize;
        let pages = context.div_ceil(shape.page_size as usize).max(1);
        // Enough active dimensions that their pages about fill the budget.
        let m = (budget_pages * d).div_ceil(pages).clamp(1, d);
        let active = (0..lanes)
            .map(|lane| {
                (0..m)
                    .map(|i| (mix(id * 1_000_003 + lane as u64 * 7919 + i as u64) % d as u64) as usize)
                    .collect()
            })
            .collect();
        Self {
            shape: shape.clone(),
            queries: queries.clone(),
            id,
            active,
            step: 0,
        }
    }

    fn dim_of(&self, layer: u32, head: u32, page: usize) -> usize {
        let key = self.id.wrapping_mul(0x9E37) ^ (u64::from(layer) << 40) ^ (u64::from(head) << 32) ^ page as u64;
        (mix(key) % u64::from(self.shape.head_dim)) as usize
    }

    /// K then V rows of every KV head of `layer` for `tokens`, head-major.
    pub(crate) fn kv(&self, layer: u32, tokens: std::ops::Range<usize>) -> Bytes {
        let s = &self.shape;
        let d = s.head_dim as usize;
        let mut out = Vec::with_capacity(s.kv_heads as usize * 2 * tokens.len() * s.row_bytes());
        for h in 0..s.kv_heads {
            match &self.queries {
                Queries::Real(real) => {
                    let (_, k, v) = &real.layers[layer as usize % real.layers.len()];
                    for src in [k, v] {
                        for t in tokens.clone() {
                            let at = (h as usize * real.tokens + t % real.tokens) * d;
                            src[at..at + d].iter().for_each(|x| s.encode(*x, &mut out));
                        }
                    }
                }
                Queries::Synthetic { .. } => {
                    for t in tokens.clone() {
                        let hot = self.dim_of(layer, h, t / s.page_size as usize);
                        for i in 0..d {
                            let noise = (mix(t as u64 * 131 + i as u64) % 1000) as f32 / 20_000.0;
                            s.encode(if i == hot { 1.0 } else { noise }, &mut out);
                        }
                    }
                    for t in tokens.clone() {
                        for i in 0..d {
                            s.encode(
                                ((mix(self.id ^ ((t as u64) << 8) ^ i as u64) % 2000) as f32 - 1000.0) / 1000.0,
                                &mut out,
                            );
                        }
                    }
                }
            }
        }
        Bytes::from(out)
    }

    /// The queries of `layer` at decode position `position`: every query
    /// head of every KV head, `[query head][head_dim]`.
    pub(crate) fn queries(&self, layer: u32, position: usize) -> Vec<f32> {
        let s = &self.shape;
        let d = s.head_dim as usize;
        let mut out = Vec::with_capacity(s.query_heads as usize * d);
        match &self.queries {
            Queries::Real(real) => {
                let (q, _, _) = &real.layers[layer as usize % real.layers.len()];
                for qh in 0..s.query_heads as usize {
                    let at = (qh * real.tokens + position % real.tokens) * d;
                    out.extend_from_slice(&q[at..at + d]);
                }
            }
            Queries::Synthetic { .. } => {
                for h in 0..s.kv_heads as usize {
                    let active = &self.active[layer as usize * s.kv_heads as usize + h];
                    for g in 0..s.group() {
                        let mut q = vec![0f32; d];
                        for (i, &dim) in active.iter().enumerate() {
                            q[dim] += 1.0 + (mix(self.step * 31 + (g * 131 + i) as u64) % 100) as f32 / 1000.0;
                        }
                        out.extend(q);
                    }
                }
            }
        }
        out
    }

    /// Moves to the next step: a `drift` share of each lane's active
    /// dimensions (at least one with probability `drift`) is replaced.
    pub(crate) fn advance(&mut self) {
        self.step += 1;
        let Queries::Synthetic { drift, seed } = self.queries else {
            return;
        };
        let d = self.shape.head_dim as u64;
        for (lane, active) in self.active.iter_mut().enumerate() {
            let base = mix(seed ^ (self.id << 20) ^ (self.step << 40) ^ lane as u64);
            let want = drift * active.len() as f64;
            let whole = want.floor() as usize + usize::from(((base % 10_000) as f64 / 10_000.0) < want.fract());
            for i in 0..whole.min(active.len()) {
                let slot = (mix(base + i as u64) % active.len() as u64) as usize;
                active[slot] = (mix(base ^ (0xABCD + i as u64)) % d) as usize;
            }
        }
    }
}
