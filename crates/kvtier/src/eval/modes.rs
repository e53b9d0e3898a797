//! `kvtier eval --mode a,b,…`: each ranking mode through the store at the
//! same budget, and the share of the Quest → oracle mass gap it closes.

use anyhow::Context;
use kvtier_core::rank::{DEFAULT_MODE, Mode, Ranking};
use serde::Serialize;

use super::data::LayerData;
use super::{EvalConfig, Row, average, evaluate_layer};

/// One mode's quality and cost, pooled over layers, KV heads, their query
/// heads and positions.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ModeRow {
    pub(crate) mode: &'static str,
    pub(crate) mass: f64,
    /// Per query head, the best choice of as many pages (forced pages
    /// included): reads up to a group's times the pages.
    pub(crate) oracle_mass: f64,
    /// The best single choice for the group at equal pages read.
    pub(crate) shared_oracle_mass: f64,
    pub(crate) recall: f64,
    pub(crate) rel_err: f64,
    /// `(mass − quest) / (shared oracle − quest)`, each pooled (a ratio of
    /// means, not a mean of per-head ratios): the gap at equal pages read;
    /// absent where the gap is ~0.
    pub(crate) gap_closed: Option<f64>,
    /// The same against the per-head oracle.
    pub(crate) gap_closed_per_head: Option<f64>,
    pub(crate) pages_read: f64,
    pub(crate) index_bytes: f64,
    pub(crate) rank_us: f64,
    /// Share of selections that reused their lane's last ranking.
    pub(crate) reused: f64,
}

/// `--mode`: names, `all`, or nothing (the server's default).
pub(crate) fn parse(names: &[String]) -> anyhow::Result<Vec<Mode>> {
    if names.is_empty() {
        return Ok(vec![DEFAULT_MODE]);
    }
    if names.iter().any(|n| n == "all") {
        return Ok(Mode::ALL.to_vec());
    }
    names
        .iter()
        .map(|n| {
            Mode::parse(n).with_context(|| format!("--mode {n}: not one of quest, cuboid, sketch, two-stage, all"))
        })
        .collect()
}

/// Every mode of `modes` (the first's rows, `first`, already evaluated), and
/// Quest without top-p as the baseline of the gap.
pub(crate) fn compare(
    config: &EvalConfig,
    data: &[LayerData],
    modes: &[Mode],
    first: &[Row],
) -> anyhow::Result<Vec<ModeRow>> {
    let run = |mode: Mode, top_p, reuse| -> anyhow::Result<Row> {
        eprintln!("eval: mode {mode}");
        let config = EvalConfig {
            ranking: Ranking {
                mode,
                top_p,
                reuse,
                ..config.ranking
            },
            ..config.clone()
        };
        let mut rows = Vec::new();
        for d in data {
            rows.extend(evaluate_layer(d, &config)?);
        }
        Ok(average(&rows))
    };
    let mut rows = vec![(modes[0], average(first))];
    for &mode in &modes[1..] {
        rows.push((mode, run(mode, config.ranking.top_p, config.ranking.reuse)?));
    }
    let plain = config.ranking.top_p.is_none() && config.ranking.reuse.is_none();
    let quest = match rows.iter().find(|(m, _)| *m == Mode::Quest) {
        Some((_, r)) if plain => r.clone(),
        _ => run(Mode::Quest, None, None)?,
    };
    Ok(rows
        .into_iter()
        .map(|(mode, r)| {
            let closed = |oracle: f64| {
                let gap = oracle - quest.mass;
                (gap.abs() > 1e-9).then(|| (r.mass - quest.mass) / gap)
            };
            ModeRow {
                mode: mode.name(),
                mass: r.mass,
                oracle_mass: r.oracle_mass,
                shared_oracle_mass: r.shared_oracle_mass,
                recall: r.recall,
                rel_err: r.rel_err,
                gap_closed: closed(r.shared_oracle_mass),
                gap_closed_per_head: closed(r.oracle_mass),
                pages_read: r.pages_read,
                index_bytes: r.index_bytes,
                rank_us: r.rank_us,
                reused: r.reused,
            }
        })
        .collect())
}

pub(crate) fn print(rows: &[ModeRow]) {
    println!();
    println!(
        "{:<10} {:>7} {:>7} {:>7} {:>7} {:>8} {:>7} {:>7} {:>7} {:>9} {:>8} {:>7}",
        "mode",
        "mass",
        "shared",
        "oracle",
        "recall",
        "rel_err",
        "gap",
        "gap/hd",
        "pages",
        "indexB",
        "rank_us",
        "reused"
    );
    let gap = |g: Option<f64>| g.map_or("-".to_owned(), |g| format!("{g:.3}"));
    for r in rows {
        println!(
            "{:<10} {:>7.4} {:>7.4} {:>7.4} {:>7.4} {:>8.4} {:>7} {:>7} {:>7.1} {:>9.0} {:>8.0} {:>7.3}",
            r.mode,
            r.mass,
            r.shared_oracle_mass,
            r.oracle_mass,
            r.recall,
            r.rel_err,
            gap(r.gap_closed),
            gap(r.gap_closed_per_head),
            r.pages_read,
            r.index_bytes,
            r.rank_us,
            r.reused
        );
    }
}
