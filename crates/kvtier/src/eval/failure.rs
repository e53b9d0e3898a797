//! Failure tests: planted keys that one final query needs, in situations
//! where policies that remove information for good are known to fail, run
//! for a policy and for Quest read selection on the same data. A method
//! passes when the final query can use the planted key (the policy still
//! holds its page; Quest selects it within the same budget).
//!
//! - `early_key_late_query`: a key written early, attended once right after
//!   it was written, then not again until the final query.
//! - `near_duplicate`: two adjacent pages with the same keys and values but
//!   one planted key in the second; the final query needs the second.
//! - `updated_key`: a fact written early (and attended for a while), then
//!   rewritten later under the same key direction with a new value and a
//!   slightly stronger key; the final query must get the newer one.
//! - `late_relevance`: a key nobody attends to for the whole sequence, until
//!   the final query.
//!
//! On synthetic data (Gaussian Q/K/V) or on a realkv layer with keys planted
//! into KV head 0 (and the queries of its group rewritten where planted).

use kvtier_core::policy::{Allocator, Scorer};
use kvtier_core::rank::Ranking;
use kvtier_core::select::Budget;
use kvtier_store::SelectPages;
use serde::Serialize;

use super::data::LayerData;
use super::policy::PolicyRun;

pub(crate) const NAMES: [&str; 4] = [
    "early_key_late_query",
    "near_duplicate",
    "updated_key",
    "late_relevance",
];

/// Decode positions each test runs before its final query.
const DECODE: usize = 16;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct FailureTest {
    pub(crate) name: String,
    /// `synthetic` or `realkv`.
    pub(crate) data: String,
    pub(crate) method: String,
    pub(crate) passed: bool,
    pub(crate) detail: String,
}

/// A planted scenario: the data, the token the final query needs, and a
/// token it must not prefer (the outdated fact).
pub(crate) struct Scenario {
    pub(crate) name: &'static str,
    pub(crate) data: LayerData,
    pub(crate) target: usize,
    pub(crate) outdated: Option<usize>,
}

/// xorshift64* → standard normal (Box–Muller): reproducible Gaussian data.
struct Gaussian(u64);

impl Gaussian {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn next(&mut self) -> f32 {
        let (a, b) = (self.uniform(), self.uniform());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    }
    fn unit(&mut self, d: usize) -> Vec<f32> {
        let v: Vec<f32> = (0..d).map(|_| self.next()).collect();
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter().map(|x| x / norm).collect()
    }
}

/// Gaussian queries, keys and values: one KV head, two query heads.
pub(crate) fn synthetic(tokens: usize, head_dim: usize, seed: u64) -> LayerData {
    let mut g = Gaussian(seed | 1);
    let mut draw = |n: usize, f16: bool| -> Vec<f32> {
        (0..n)
            .map(|_| {
                let x = g.next();
                if f16 { half::f16::from_f32(x).to_f32() } else { x }
            })
            .collect()
    };
    LayerData {
        layer: 0,
        heads: 2,
        kv_heads: 1,
        head_dim,
        tokens,
        scale: 1.0 / (head_dim as f64).sqrt(),
        q: draw(2 * tokens * head_dim, false),
        k: draw(tokens * head_dim, true),
        v: draw(tokens * head_dim, true),
    }
}

fn norm(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum::<f32>().sqrt()
}

fn scaled(u: &[f32], s: f32) -> Vec<f32> {
    u.iter().map(|x| x * s).collect()
}

/// The four scenarios planted into `base` (KV head 0 and its query group),
/// each planted key deviating from the mean key by `strength` times the
/// typical deviation (1: a key as ordinary as any other).
pub(crate) fn scenarios(base: &LayerData, page: usize, seed: u64, strength: f32) -> Vec<Scenario> {
    let (t, d) = (base.tokens, base.head_dim);
    let last = t - 1;
    let mut g = Gaussian(seed.wrapping_mul(0x9E37_79B9) | 1);
    // A planted key is the lane's mean key plus a deviation of typical size
    // along a random direction, so other queries attend to it no more than
    // to any key (real keys share a large common component: a key without
    // it would stand out to every query). A planted query is 8 times the
    // typical query norm along that direction: the pair dominates its
    // softmax.
    let keys = base.keys(0, t);
    let mean: Vec<f32> = (0..d)
        .map(|i| keys.chunks_exact(d).map(|k| k[i]).sum::<f32>() / t as f32)
        .collect();
    let spread = (keys
        .chunks_exact(d)
        .map(|k| k.iter().zip(&mean).map(|(a, m)| (a - m) * (a - m)).sum::<f32>())
        .sum::<f32>()
        / t as f32)
        .sqrt();
    let planted =
        |u: &[f32], s: f32| -> Vec<f32> { mean.iter().zip(u).map(|(m, x)| m + x * spread * strength * s).collect() };
    let query_norm = 8.0 * (0..base.group()).map(|h| norm(base.query(h, last))).sum::<f32>() / base.group() as f32;
    let plant_queries = |data: &mut LayerData, at: &[usize], u: &[f32]| {
        for &p in at {
            for h in 0..data.group() {
                data.set_query(h, p, &scaled(u, query_norm));
            }
        }
    };
    let mut out = Vec::new();
    // early_key_late_query
    let mut data = base.clone();
    let u = g.unit(d);
    let key = t / 16;
    data.set_key(0, key, &planted(&u, 1.0));
    plant_queries(&mut data, &[key + 1, last], &u);
    out.push(Scenario {
        name: NAMES[0],
        data,
        target: key,
        outdated: None,
    });
    // near_duplicate: page b repeats page a, plus the planted key.
    let mut data = base.clone();
    let u = g.unit(d);
    let (a, b) = (t / 2 / page * page, t / 2 / page * page + page);
    for r in 0..page {
        let (k, v) = (
            data.keys(0, t)[(a + r) * d..(a + r + 1) * d].to_vec(),
            data.v[(a + r) * d..(a + r + 1) * d].to_vec(),
        );
        data.set_key(0, b + r, &k);
        data.v[(b + r) * d..(b + r + 1) * d].copy_from_slice(&v);
    }
    data.set_key(0, b + page / 2, &planted(&u, 1.0));
    plant_queries(&mut data, &[last], &u);
    out.push(Scenario {
        name: NAMES[1],
        data,
        target: b + page / 2,
        outdated: None,
    });
    // updated_key
    let mut data = base.clone();
    let u = g.unit(d);
    let (old, new) = (t / 8, t * 3 / 4);
    data.set_key(0, old, &planted(&u, 1.0));
    data.set_key(0, new, &planted(&u, 1.1));
    let attended: Vec<usize> = (old + 1..old + 9).chain([last]).collect();
    plant_queries(&mut data, &attended, &u);
    out.push(Scenario {
        name: NAMES[2],
        data,
        target: new,
        outdated: Some(old),
    });
    // late_relevance
    let mut data = base.clone();
    let u = g.unit(d);
    let key = t * 3 / 8;
    data.set_key(0, key, &planted(&u, 1.0));
    plant_queries(&mut data, &[last], &u);
    out.push(Scenario {
        name: NAMES[3],
        data,
        target: key,
        outdated: None,
    });
    out
}

/// The dense attention share of the target (and of the outdated token) for
/// the final query, over the tokens a method made available.
fn shares(s: &Scenario, available: &[bool]) -> (f64, f64) {
    let last = s.data.tokens - 1;
    let group = s.data.group();
    let mut target = 0.0;
    let mut outdated = 0.0;
    for h in 0..group {
        let a = s.data.attention(h, last, Some(available));
        target += a[s.target] / group as f64;
        outdated += s.outdated.map_or(0.0, |o| a[o]) / group as f64;
    }
    (target, outdated)
}

fn verdict(s: &Scenario, available: &[bool], data: &str, method: &str, how: &str) -> FailureTest {
    let has_target = available[s.target];
    let (target, outdated) = shares(s, available);
    let passed = has_target && target > outdated;
    let mut detail = format!(
        "target token {} {how}; final query's attention on it {target:.3}",
        s.target,
        how = if has_target { how } else { "not available" }
    );
    if let Some(o) = s.outdated {
        detail += &format!(
            "; outdated token {o} {} ({outdated:.3})",
            if available[o] { "available" } else { "not available" }
        );
    }
    FailureTest {
        name: s.name.to_owned(),
        data: data.to_owned(),
        method: method.to_owned(),
        passed,
        detail,
    }
}

/// Runs the policy over the scenario's last decode positions; what it holds
/// when the final query comes.
pub(crate) fn run_policy(
    s: &Scenario,
    data: &str,
    scorer: &Scorer,
    allocator: &Allocator,
    page: u32,
    budget_tokens: u32,
) -> anyhow::Result<FailureTest> {
    let t = s.data.tokens;
    let layers = std::slice::from_ref(&s.data);
    let mut run = PolicyRun::start(layers, *scorer, *allocator, page, budget_tokens, t - DECODE)?;
    let mut kept = Vec::new();
    for p in t - DECODE..t {
        kept = run.step(p)?;
    }
    Ok(verdict(s, &kept[0][0], data, scorer.name(), "kept"))
}

/// Query-driven selection, ranked as `ranking` says, over the whole
/// sequence for the final query, at the same budget.
pub(crate) fn run_selection(
    s: &Scenario,
    data: &str,
    ranking: Ranking,
    page: u32,
    budget_tokens: u32,
) -> anyhow::Result<FailureTest> {
    let d = &s.data;
    let (store, key, heads) = d.store(page, s.name, d.tokens)?;
    let queries = d.queries_at(d.tokens - 1);
    let budget = Budget {
        pages: (budget_tokens / page) as usize,
        sinks: 1,
        window: 1,
    };
    let selection = store.select_pages(
        &key,
        SelectPages {
            aggregation: None,
            ranking,
            ..SelectPages::new(0, heads, &queries, budget)
        },
    )?;
    let mut available = vec![false; d.tokens];
    for p in &selection.heads[0].pages {
        let start = p.page as usize * page as usize;
        available[start..(start + page as usize).min(d.tokens)].fill(true);
    }
    Ok(verdict(s, &available, data, ranking.mode.name(), "selected"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_core::rank::Mode;

    fn outcomes(scorer: &str, strength: f32) -> Vec<(&'static str, bool)> {
        let base = synthetic(512, 64, 7);
        scenarios(&base, 16, 11, strength)
            .iter()
            .map(|s| {
                let t = match scorer {
                    "quest" => run_selection(s, "synthetic", Ranking::new(Mode::Quest), 16, 128),
                    name => run_policy(
                        s,
                        "synthetic",
                        &Scorer::defaults(name).unwrap(),
                        &Allocator::Uniform,
                        16,
                        128,
                    ),
                }
                .unwrap();
                assert_eq!((t.name.as_str(), t.method.as_str()), (s.name, scorer));
                (s.name, t.passed)
            })
            .collect()
    }

    /// A key three times as distinctive as usual scores above any other
    /// page's bound, so read selection cannot miss it; nothing was removed.
    #[test]
    fn quest_finds_every_distinctive_planted_key() {
        let quest = outcomes("quest", 3.0);
        assert!(quest.iter().all(|(_, passed)| *passed), "{quest:?}");
    }

    /// Structural certainties, not measurements: StreamingLLM keeps only
    /// sinks and the recent window, and H2O cannot know a key nobody
    /// attended to.
    #[test]
    fn windows_and_history_miss_what_they_cannot_see() {
        let streaming = outcomes("streaming", 1.0);
        for (name, passed) in &streaming {
            assert_eq!(*passed, *name == "updated_key", "streaming {name}");
        }
        let h2o = outcomes("h2o", 1.0);
        assert_eq!(h2o[3], ("late_relevance", false), "{h2o:?}");
        assert_eq!(h2o[0], ("early_key_late_query", true), "attended once, kept: {h2o:?}");
    }
}
