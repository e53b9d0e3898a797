//! Prometheus text exposition at `/metrics`: the store's statistics and
//! counters, and latency histograms (seconds) of calls, swap-ins, NVMe I/O,
//! selections by miss class and checkpoints.

use std::fmt::Write;
use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode};
use kvtier_core::PageState;
use kvtier_store::{HistogramSnapshot, Latency, StatsSnapshot, Store};

use crate::auth::Auth;
use crate::rpc_metrics::RpcMetrics;

/// `/metrics`. Where the server has tokens, a scrape must carry an admin
/// token (`authorization: Bearer <token>`): the statistics are server-wide,
/// as `GetStats` without a tenant is.
pub(crate) fn router(store: Arc<Store>, rpc: Arc<RpcMetrics>, auth: Auth) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move |headers: HeaderMap| {
            let store = Arc::clone(&store);
            let rpc = Arc::clone(&rpc);
            let allowed = auth.caller(&headers).and_then(|caller| caller.check_admin("/metrics"));
            async move {
                if let Err(status) = allowed {
                    // 401 says how to authenticate (RFC 9110 §11.6.1).
                    let (code, challenge) = match status.code() {
                        tonic::Code::Unauthenticated => (StatusCode::UNAUTHORIZED, "Bearer"),
                        _ => (StatusCode::FORBIDDEN, "Bearer error=\"insufficient_scope\""),
                    };
                    return (
                        code,
                        [("content-type", "text/plain"), ("www-authenticate", challenge)],
                        format!("{}\n", status.message()),
                    );
                }
                let rendered = tokio::task::spawn_blocking(move || {
                    let mut out = render(&store.stats());
                    render_latency(&mut out, store.latency(), &rpc);
                    out
                })
                .await;
                match rendered {
                    Ok(text) => (
                        StatusCode::OK,
                        [
                            ("content-type", "text/plain; version=0.0.4"),
                            ("cache-control", "no-store"),
                        ],
                        text,
                    ),
                    Err(e) => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        [("content-type", "text/plain"), ("cache-control", "no-store")],
                        format!("stats failed: {e}\n"),
                    ),
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
        (
            "kvtier_integrity_failures_total",
            "NVMe copies that failed their CRC32C check or their read (the page is gone unless it had another copy).",
            s.integrity_failures,
        ),
        (
            "kvtier_pages_migrated_total",
            "Host copies dropped to make room because the page is on NVMe (migrations).",
            s.pages_migrated,
        ),
    ] {
        family(name, "counter", help, &[(String::new(), value)]);
    }
    family(
        "kvtier_swapped_in_pages_total",
        "counter",
        "Pages selections made hot, by the tier they came from.",
        &[
            ("{source=\"host\"}".to_owned(), s.swapped_from_host),
            ("{source=\"nvme\"}".to_owned(), s.swapped_from_nvme),
        ],
    );
    let prefetch: Vec<_> = [("asked", &s.prefetch), ("layer_ahead", &s.layer_ahead)]
        .into_iter()
        .flat_map(|(kind, p)| {
            [
                ("issued", p.issued),
                ("used", p.used),
                ("late", p.late),
                ("wasted", p.wasted),
            ]
            .map(|(outcome, n)| (format!("{{kind=\"{kind}\",outcome=\"{outcome}\"}}"), n))
        })
        .collect();
    family(
        "kvtier_prefetch_pages_total",
        "counter",
        "Pages prefetches made hot (issued), later selected while still hot (used), selected while still on their way (late), or demoted or freed first (wasted); by kind: asked by clients, or the loop device policy's layer-ahead.",
        &prefetch,
    );
    family(
        "kvtier_device_selected_pages_total",
        "counter",
        "Pages selections chose, by where the device had them: hot in the loop policy's resident subset, hot in the LRU-ordered stream region (every hot page under the lru policy), or not hot (miss).",
        &[
            ("{region=\"resident\"}".to_owned(), s.device_hits.resident),
            ("{region=\"stream\"}".to_owned(), s.device_hits.stream),
            ("{region=\"miss\"}".to_owned(), s.device_hits.misses),
        ],
    );
    let moved: Vec<_> = s
        .bytes_moved
        .iter()
        .map(|(from, to, bytes)| (format!("{{from=\"{}\",to=\"{}\"}}", from.name(), to.name()), *bytes))
        .collect();
    family(
        "kvtier_tier_moved_bytes_total",
        "counter",
        "Bytes copied into a tier, by the tier they were read from: swap-ins, migrations and persists, promotions (a swap-in from NVMe that also promotes the page counts both nvme→host and nvme→device).",
        &moved,
    );
    family("kvtier_leases", "gauge", "Active leases.", &[(String::new(), s.leases)]);
    family(
        "kvtier_index_sketch_bytes",
        "gauge",
        "Bytes of the page index's sketch rows held in host memory (those of NVMe-only pages are spilled).",
        &[(String::new(), s.index.sketch_bytes)],
    );
    family(
        "kvtier_index_pages",
        "gauge",
        "Pages of the page index, all of them and those whose sketches are spilled to NVMe.",
        &[
            (
                "{sketches=\"resident\"}".to_owned(),
                s.index.pages - s.index.spilled_pages,
            ),
            ("{sketches=\"spilled\"}".to_owned(), s.index.spilled_pages),
        ],
    );
    out
}

/// One histogram family: `series` are (labels without braces, snapshot).
fn histogram(out: &mut String, name: &str, help: &str, series: &[(String, HistogramSnapshot)]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} histogram");
    for (labels, h) in series {
        let sep = if labels.is_empty() { "" } else { "," };
        for (bound, count) in &h.cumulative {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}", h.count);
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", h.sum_seconds);
        let _ = writeln!(out, "{name}_count{braces} {}", h.count);
    }
}

/// The latency histograms: calls by method and code, and the store's.
pub(crate) fn render_latency(out: &mut String, l: &Latency, rpc: &RpcMetrics) {
    let calls: Vec<_> = rpc
        .observed()
        .map(|(transport, method, code, h)| {
            (
                format!(
                    "method=\"{method}\",code=\"{}\",transport=\"{}\"",
                    code_name(code),
                    transport.label()
                ),
                h.snapshot(),
            )
        })
        .collect();
    histogram(
        out,
        "kvtier_rpc_duration_seconds",
        "kvtier.v1 calls from request to the end of the response, by method, status code and transport (grpc, or shm-socket for calls over a registered shm connection).",
        &calls,
    );
    histogram(
        out,
        "kvtier_swap_in_duration_seconds",
        "One swap-in batch's copy to the device, by the tier its pages came from.",
        &[
            ("source=\"host\"".to_owned(), l.swap_in_from_host.snapshot()),
            ("source=\"nvme\"".to_owned(), l.swap_in_from_nvme.snapshot()),
        ],
    );
    histogram(
        out,
        "kvtier_nvme_read_duration_seconds",
        "One batch of NVMe reads, CRC checks included.",
        &[(String::new(), l.nvme_read.snapshot())],
    );
    histogram(
        out,
        "kvtier_nvme_write_duration_seconds",
        "One batch of NVMe writes (migrations and persists).",
        &[(String::new(), l.nvme_write.snapshot())],
    );
    histogram(
        out,
        "kvtier_selection_duration_seconds",
        "Selections with a swap-in (a decode step's layer), whole call in the store, by miss class: every chosen page already hot, some from host memory, some from NVMe, or answered at its deadline before the swap-in finished.",
        &[
            ("miss_class=\"hot\"".to_owned(), l.selection_hot.snapshot()),
            ("miss_class=\"host\"".to_owned(), l.selection_from_host.snapshot()),
            ("miss_class=\"nvme\"".to_owned(), l.selection_from_nvme.snapshot()),
            (
                "miss_class=\"deadline\"".to_owned(),
                l.selection_past_deadline.snapshot(),
            ),
        ],
    );
    histogram(
        out,
        "kvtier_checkpoint_duration_seconds",
        "Rewriting the manifest as a checkpoint.",
        &[(String::new(), l.checkpoint.snapshot())],
    );
}

/// A status code as gRPC names it (`NOT_FOUND`).
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}
