//! Prometheus text exposition of the store's statistics at `/metrics`.

use std::fmt::Write;
use std::sync::Arc;

use kvtier_core::PageState;
use kvtier_store::{StatsSnapshot, Store};

pub(crate) fn router(store: Arc<Store>) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let store = Arc::clone(&store);
            async move {
                let stats = tokio::task::spawn_blocking(move || store.stats()).await;
                match stats {
                    Ok(stats) => ([("content-type", "text/plain; version=0.0.4")], render(&stats)),
                    Err(e) => ([("content-type", "text/plain")], format!("stats failed: {e}\n")),
                }
            }
        }),
    )
}

fn state_label(state: PageState) -> &'static str {
    match state {
        PageState::Hot => "hot",
        PageState::Cold(kvtier_core::ColdTier::Host) => "cold_host",
        PageState::Cold(kvtier_core::ColdTier::Nvme) => "cold_nvme",
        PageState::Summary => "summary",
        PageState::Gone => "gone",
    }
}

/// Renders one snapshot. Every tier line carries `emulated`, so a number from
/// the emulated device never passes for a GPU number.
pub(crate) fn render(s: &StatsSnapshot) -> String {
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, samples: &[(String, u64)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    };
    let tier = |f: fn(&kvtier_store::TierStats) -> u64| -> Vec<(String, u64)> {
        s.tiers
            .iter()
            .map(|t| {
                let labels = format!(
                    "{{tier=\"{}\",backend=\"{}\",emulated=\"{}\"}}",
                    t.kind, t.backend, t.emulated
                );
                (labels, f(t))
            })
            .collect()
    };
    family(
        "kvtier_tier_capacity_bytes",
        "gauge",
        "Configured capacity of a tier.",
        &tier(|t| t.capacity_bytes),
    );
    family(
        "kvtier_tier_used_bytes",
        "gauge",
        "Bytes reserved by live slots of a tier.",
        &tier(|t| t.used_bytes),
    );
    family(
        "kvtier_tier_slots",
        "gauge",
        "Live slots (pages and summaries) of a tier.",
        &tier(|t| t.slots),
    );
    family(
        "kvtier_metadata_bytes",
        "gauge",
        "Resident metadata charged (lanes, page tables, digests, summaries' counts, policy statistics).",
        &[(String::new(), s.metadata_bytes)],
    );
    family(
        "kvtier_metadata_limit_bytes",
        "gauge",
        "The metadata budget (metadata_bytes).",
        &[(String::new(), s.metadata_limit_bytes.unwrap_or(0))],
    );
    let pages: Vec<_> = PageState::ALL
        .iter()
        .map(|st| (format!("{{state=\"{}\"}}", state_label(*st)), s.pages.get(*st)))
        .collect();
    family(
        "kvtier_pages",
        "gauge",
        "Logical pages of live sequences by state.",
        &pages,
    );
    family(
        "kvtier_sequences",
        "gauge",
        "Live sequences.",
        &[(String::new(), s.sequences)],
    );
    family(
        "kvtier_physical_pages",
        "gauge",
        "Distinct stored pages (shared pages once).",
        &[(String::new(), s.physical_pages)],
    );
    let transitions: Vec<_> = s
        .transitions
        .iter()
        .map(|t| {
            let labels = format!(
                "{{from=\"{}\",to=\"{}\",reason=\"{}\"}}",
                state_label(t.from),
                state_label(t.to),
                t.reason.name()
            );
            (labels, t.count)
        })
        .collect();
    family(
        "kvtier_page_transitions_total",
        "counter",
        "Page state transitions by reason.",
        &transitions,
    );
    for (name, help, value) in [
        ("kvtier_pages_written_total", "Pages stored by writes.", s.pages_written),
        (
            "kvtier_pages_shared_total",
            "Page writes served by an already stored prefix page.",
            s.pages_shared,
        ),
        (
            "kvtier_bytes_written_total",
            "K/V bytes received by writes.",
            s.bytes_written,
        ),
        ("kvtier_bytes_read_total", "K/V bytes served by reads.", s.bytes_read),
        (
            "kvtier_tokens_appended_total",
            "Tokens appended, per (layer, KV head).",
            s.tokens_appended,
        ),
    ] {
        family(name, "counter", help, &[(String::new(), value)]);
    }
    out
}
