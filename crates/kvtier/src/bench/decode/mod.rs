//! `kvtier bench decode`: per-step latency of a decode workload through the
//! real gRPC path, split by miss class (every selected page already hot;
//! some came from host; some from NVMe), with the bytes each tier moved,
//! prefetch accuracy and read sparsity; plots as SVG and PNG; sweeps over
//! one parameter.

mod run;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail, ensure};
use clap::Args;
use kvtier_client::pb;
use serde::Serialize;

use super::plot::{Chart, Series};
use crate::shape::Shape;
use kvtier_store::{Access, HeadPages, TRACE_FORMAT, TraceHeader, TraceRecord};
pub(crate) use run::histogram;
use run::{Class, Measured, RunConfig};
use run::{DataPlane, DeviceChoice};
use workload::{Queries, RealKv};

#[derive(Debug, Clone, Args)]
pub(crate) struct DecodeArgs {
    /// llama3-8b, smollm2-135m, or custom (with --layers ... --dtype).
    #[arg(long, default_value = "smollm2-135m")]
    preset: String,
    /// Layers (with --preset custom).
    #[arg(long)]
    layers: Option<u32>,
    /// KV heads per layer (with --preset custom).
    #[arg(long)]
    kv_heads: Option<u32>,
    /// Query heads per layer, a multiple of the KV heads (with --preset custom).
    #[arg(long)]
    query_heads: Option<u32>,
    /// Elements per head (with --preset custom).
    #[arg(long)]
    head_dim: Option<u32>,
    /// f32, f16 or bf16 (custom layouts).
    #[arg(long)]
    dtype: Option<String>,
    /// Tokens of context before decoding starts.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Tokens per page.
    #[arg(long, default_value_t = 16)]
    page_size: u32,
    /// Pages selected per KV head per step (sinks and window included).
    #[arg(long, default_value_t = 32)]
    budget_pages: u32,
    /// Leading pages every selection keeps (attention sinks).
    #[arg(long, default_value_t = 1)]
    sinks: u32,
    /// Newest pages every selection keeps.
    #[arg(long, default_value_t = 1)]
    window: u32,
    /// How selections rank pages: quest, cuboid, sketch or two-stage
    /// (default: the server's default, two-stage).
    #[arg(long, default_value = kvtier_core::rank::DEFAULT_MODE.name())]
    mode: String,
    /// Two-stage: stage one keeps this many times the budget.
    #[arg(long, default_value_t = kvtier_core::rank::DEFAULT_CANDIDATES)]
    candidates: u32,
    /// Reuse each lane's last ranking while every query head's cosine
    /// similarity to the query that made it is at least this (0: rank
    /// every step).
    #[arg(long, default_value_t = 0.0)]
    reuse_similarity: f32,
    /// Sequences decoding concurrently.
    #[arg(long, default_value_t = 1)]
    sequences: usize,
    /// Decode steps per sequence (each: every layer's selection and append).
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Steps per sequence run before the measured ones, neither timed nor
    /// counted: the first steps fill an empty device whatever its policy.
    #[arg(long, default_value_t = 0)]
    warmup_steps: usize,
    /// In-process server: device tier as a share of the working set.
    #[arg(long, default_value_t = 0.25)]
    device_fraction: f64,
    /// In-process server: device tier as a share of one decode step's
    /// working set (the pages one step's selections touch over all layers
    /// and sequences); overrides --device-fraction.
    #[arg(long)]
    device_step_fraction: Option<f64>,
    /// In-process server: which hot page the device demotes for room (lru or
    /// loop).
    #[arg(long, default_value_t = kvtier_store::DevicePolicy::Lru)]
    device_policy: kvtier_store::DevicePolicy,
    /// In-process server: the device tier on the GPU when one is usable
    /// (auto, as `kvtier serve` does: the host tier then in pinned memory)
    /// or emulated in host memory.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// In-process server: which host pages migrate to NVMe first (lru or
    /// frequency).
    #[arg(long, default_value_t = kvtier_store::HostPolicy::Lru)]
    host_policy: kvtier_store::HostPolicy,
    /// In-process server: sketches of NVMe-cold pages leave host memory
    /// (true or false).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, value_name = "BOOL")]
    spill_sketches: bool,
    /// In-process server: host tier as a share of the working set (below 1,
    /// the rest lives on NVMe).
    #[arg(long, default_value_t = 1.0)]
    host_fraction: f64,
    /// `synthetic` or `realkv:DIR`.
    #[arg(long, default_value = "synthetic")]
    queries: String,
    /// Synthetic queries: share of the active query dimensions replaced per step.
    #[arg(long, default_value_t = 0.1)]
    drift: f64,
    /// Seed of the synthetic keys and queries.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Open loop: steps per second per sequence, latency from the intended start.
    #[arg(long)]
    rate: Option<f64>,
    /// Pages ranked next after each selection to promote in the background,
    /// per KV head (0: no prefetch).
    #[arg(long, default_value_t = 0)]
    prefetch_pages: u32,
    /// Swap-in deadline per SelectPages, microseconds (0: none).
    #[arg(long, default_value_t = 0)]
    deadline_us: u32,
    /// With the in-process server: rewrite its manifest as a checkpoint
    /// when the run reaches this step, to see what a checkpoint costs steps.
    #[arg(long)]
    checkpoint_at_step: Option<usize>,
    /// A running server instead of an in-process one.
    #[arg(long)]
    addr: Option<String>,
    /// How selected pages' bytes reach the client: inline in the gRPC
    /// messages; shm, written into a shared-memory region it registered,
    /// each selection and append called over the region's own socket; or
    /// shm-grpc, the same region with the calls over gRPC.
    #[arg(long, value_enum, default_value_t = DataPlane::Inline)]
    data_plane: DataPlane,
    /// With --addr and --data-plane shm: the server's shm socket.
    #[arg(long, value_name = "PATH")]
    shm_socket: Option<PathBuf>,
    /// With --data-plane shm: how long a call over the region polls for its
    /// reply at most before sleeping on it, while its replies come within
    /// that (`ShmRegion::set_spin`; 0: never polls).
    #[arg(long, value_name = "MICROSECONDS", default_value_t = kvtier_client::DEFAULT_SPIN.as_micros() as u64)]
    shm_poll_us: u64,
    /// With the in-process server: how long a region's connection thread
    /// polls for the next call at most (`kvtier serve --shm-poll-us`).
    #[arg(long, value_name = "MICROSECONDS", default_value_t = kvtier_server::DEFAULT_SHM_POLL.as_micros() as u64)]
    server_shm_poll_us: u64,
    /// One parameter swept over values: device_fraction, host_fraction,
    /// budget_pages, drift or sequences, e.g. `device_fraction=0.1,0.25,0.5`.
    #[arg(long)]
    sweep: Option<String>,
    /// A small run (under a minute here) that produces every miss class.
    #[arg(long)]
    quick: bool,
    /// Where the report, steps.csv and plots go; replaced as a whole by
    /// each run (refused if it holds files no kvtier run wrote).
    #[arg(long, default_value = "kvtier-bench-out")]
    out: PathBuf,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// Write every selection's page lists here (JSON lines), for
    /// `kvtier bench fetch`.
    #[arg(long)]
    trace: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct ClassReport {
    count: u64,
    p50_us: u64,
    p90_us: u64,
    p99_us: u64,
    p999_us: u64,
    max_us: u64,
    /// Where a step's time went (mean µs per step), over this class's steps
    /// and over its slowest 1 %.
    breakdown: Breakdown,
    breakdown_p99: Breakdown,
}

/// A step's time: its SelectPages calls as the client saw them (`select_us`)
/// are the server's store work (`store_us`: ranking, swap-in per source,
/// reading the pages, and the rest — locks, bookkeeping) plus gRPC and the
/// handler around it (`transport_us`); then its AppendTokens calls.
#[derive(Debug, Default, Serialize)]
struct Breakdown {
    select_us: f64,
    transport_us: f64,
    store_us: f64,
    rank_us: f64,
    swap_host_us: f64,
    swap_nvme_us: f64,
    read_us: f64,
    append_us: f64,
}

#[derive(Debug, Serialize)]
struct BytesMoved {
    host_to_device: u64,
    nvme_to_device: u64,
    host_to_nvme: u64,
    served: u64,
}

/// Prefetches' outcomes over the measured steps (the server's counters).
#[derive(Debug, Serialize)]
struct Prefetch {
    /// The pages ranked next (`--prefetch-pages`).
    asked: PrefetchOutcomes,
    /// The loop device policy's layer-ahead prefetches.
    layer_ahead: PrefetchOutcomes,
}

#[derive(Debug, Serialize)]
struct PrefetchOutcomes {
    issued: u64,
    used: u64,
    late: u64,
    wasted: u64,
}

impl PrefetchOutcomes {
    fn between(before: Option<&pb::PrefetchCounts>, after: Option<&pb::PrefetchCounts>) -> Self {
        let (b, a) = (before.copied().unwrap_or_default(), after.copied().unwrap_or_default());
        Self {
            issued: a.issued - b.issued,
            used: a.used - b.used,
            late: a.late - b.late,
            wasted: a.wasted - b.wasted,
        }
    }
}

/// The page index's sketches: all of them, and those in host memory.
#[derive(Debug, Serialize)]
struct IndexMemory {
    pages: u64,
    spilled_pages: u64,
    sketch_bytes: u64,
}

impl IndexMemory {
    fn of(stats: &pb::Stats) -> Self {
        let i = stats.index.unwrap_or_default();
        Self {
            pages: i.pages,
            spilled_pages: i.spilled_pages,
            sketch_bytes: i.sketch_bytes,
        }
    }
}

/// The chosen pages the device held over the measured steps, by the
/// device policy's region, as the server counted them.
#[derive(Debug, Serialize)]
struct DeviceRegions {
    resident: u64,
    stream: u64,
    misses: u64,
}

impl DeviceRegions {
    fn between(before: Option<&pb::DeviceHits>, after: Option<&pb::DeviceHits>) -> Self {
        let (b, a) = (before.copied().unwrap_or_default(), after.copied().unwrap_or_default());
        Self {
            resident: a.resident - b.resident,
            stream: a.stream - b.stream,
            misses: a.misses - b.misses,
        }
    }
}

#[derive(Debug, Serialize)]
struct Report {
    config: RunConfig,
    emulated_device: bool,
    steps: u64,
    steps_per_s: f64,
    /// Open loop: the steps per second each sequence achieved, against
    /// `config.rate`; when it falls short, latencies include queueing
    /// behind the schedule.
    achieved_rate: Option<f64>,
    rate_missed: bool,
    prefill_seconds: f64,
    /// Only the classes that occurred.
    classes: std::collections::BTreeMap<&'static str, ClassReport>,
    bytes_moved: BytesMoved,
    prefetch: Prefetch,
    device_regions: DeviceRegions,
    /// Where the page index's sketches were when the measured steps began
    /// and when they ended (the server's view).
    index_before: IndexMemory,
    index_after: IndexMemory,
    read_fraction: f64,
    /// Pages selections asked to make hot that were not on the device, over
    /// all steps: what `kvtier tune` predicts.
    device_miss_ratio: f64,
    /// Step latency over all steps, whatever their class (µs).
    step_p50_us: u64,
    step_p99_us: u64,
}

fn breakdown<'a>(steps: impl Iterator<Item = &'a run::Step>) -> Breakdown {
    let (mut b, mut n) = (Breakdown::default(), 0.0);
    for s in steps {
        b.select_us += s.select_us as f64;
        b.transport_us += s.select_us.saturating_sub(s.store_us) as f64;
        b.store_us += s.store_us as f64;
        b.rank_us += s.rank_us as f64;
        b.swap_host_us += s.swap_host_us as f64;
        b.swap_nvme_us += s.swap_nvme_us as f64;
        b.read_us += s.read_us as f64;
        b.append_us += s.append_us as f64;
        n += 1.0;
    }
    if n > 0.0 {
        for v in [
            &mut b.select_us,
            &mut b.transport_us,
            &mut b.store_us,
            &mut b.rank_us,
            &mut b.swap_host_us,
            &mut b.swap_nvme_us,
            &mut b.read_us,
            &mut b.append_us,
        ] {
            *v /= n;
        }
    }
    b
}

fn transitions(stats: &pb::Stats, from: (pb::PageState, pb::Tier), to: (pb::PageState, pb::Tier)) -> u64 {
    stats
        .transitions
        .iter()
        .filter(|t| (t.from_state(), t.from_tier()) == from && (t.to_state(), t.to_tier()) == to)
        .map(|t| t.count)
        .sum()
}

fn report(cfg: RunConfig, m: &Measured) -> Report {
    let mut classes = std::collections::BTreeMap::new();
    for class in Class::ALL {
        let mut steps: Vec<&run::Step> = m.steps.iter().filter(|s| s.class == class).collect();
        if steps.is_empty() {
            continue;
        }
        let h = histogram(steps.iter().map(|s| s.latency_us));
        steps.sort_by_key(|s| s.latency_us);
        let slowest = &steps[steps.len() - steps.len().div_ceil(100).min(steps.len())..];
        classes.insert(
            class.name(),
            ClassReport {
                count: h.len(),
                p50_us: h.value_at_quantile(0.5),
                p90_us: h.value_at_quantile(0.9),
                p99_us: h.value_at_quantile(0.99),
                p999_us: h.value_at_quantile(0.999),
                max_us: h.max(),
                breakdown: breakdown(steps.iter().copied()),
                breakdown_p99: breakdown(slowest.iter().copied()),
            },
        );
    }
    let page_bytes = cfg.shape.page_bytes() as u64;
    let (b, a) = (&m.before, &m.after);
    let host = (pb::PageState::Cold, pb::Tier::Host);
    let nvme = (pb::PageState::Cold, pb::Tier::Nvme);
    let steps_per_s = m.steps.len() as f64 / m.wall.as_secs_f64();
    let achieved_rate = cfg.rate.map(|_| steps_per_s / cfg.sequences as f64);
    Report {
        emulated_device: a.tiers.iter().any(|t| t.tier() == pb::Tier::Device && t.emulated),
        steps: m.steps.len() as u64,
        steps_per_s,
        achieved_rate,
        rate_missed: cfg.rate.zip(achieved_rate).is_some_and(|(want, got)| got < 0.95 * want),
        prefill_seconds: m.prefill_seconds,
        classes,
        bytes_moved: BytesMoved {
            host_to_device: (a.swapped_from_host - b.swapped_from_host) * page_bytes,
            nvme_to_device: (a.swapped_from_nvme - b.swapped_from_nvme) * page_bytes,
            host_to_nvme: (transitions(a, host, nvme) - transitions(b, host, nvme)) * page_bytes,
            served: m.steps.iter().map(|s| s.bytes).sum(),
        },
        prefetch: Prefetch {
            asked: PrefetchOutcomes::between(b.prefetch.as_ref(), a.prefetch.as_ref()),
            layer_ahead: PrefetchOutcomes::between(b.layer_ahead.as_ref(), a.layer_ahead.as_ref()),
        },
        device_regions: DeviceRegions::between(b.device_hits.as_ref(), a.device_hits.as_ref()),
        index_before: IndexMemory::of(b),
        index_after: IndexMemory::of(a),
        read_fraction: m.read_fraction,
        device_miss_ratio: m.steps.iter().map(|s| s.missed).sum::<u64>() as f64
            / m.steps.iter().map(|s| s.chosen).sum::<u64>().max(1) as f64,
        step_p50_us: quantile_us(&m.steps, 0.5),
        step_p99_us: quantile_us(&m.steps, 0.99),
        config: cfg,
    }
}

/// The `q` quantile of the steps' latency (nearest rank).
fn quantile_us(steps: &[run::Step], q: f64) -> u64 {
    let mut us: Vec<u64> = steps.iter().map(|s| s.latency_us).collect();
    us.sort_unstable();
    let rank = ((q * us.len() as f64).ceil() as usize).clamp(1, us.len().max(1));
    us.get(rank - 1).copied().unwrap_or(0)
}

fn print_table(r: &Report) {
    let c = &r.config;
    println!(
        "kvtier bench decode  {} ({} layers, {}/{} heads, d {}, {})  context {}  budget {} pages ({})  {} seq × {} steps  device {} ({})  host {:.0}% ({})  queries {}{}",
        c.shape.name,
        c.shape.layers,
        c.shape.kv_heads,
        c.shape.query_heads,
        c.shape.head_dim,
        c.shape.dtype,
        c.context,
        c.budget_pages,
        c.mode,
        c.sequences,
        c.steps,
        match c.device_step_fraction {
            Some(f) => format!("{:.0}% of a step", 100.0 * f),
            None => format!("{:.0}%", 100.0 * c.device_fraction),
        },
        c.device_policy,
        100.0 * c.host_fraction,
        c.host_policy,
        c.queries,
        if r.emulated_device { "  [device EMULATED]" } else { "" }
    );
    let absent: Vec<&str> = Class::ALL
        .iter()
        .map(|c| c.name())
        .filter(|n| !r.classes.contains_key(n))
        .collect();
    println!(
        "{:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9}   slowest 1 %, µs: transport + rank + swap host + swap nvme + read + other = select; append",
        "class", "steps", "p50 µs", "p90 µs", "p99 µs", "p99.9 µs", "max µs"
    );
    for (name, k) in &r.classes {
        let b = &k.breakdown_p99;
        println!(
            "{name:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9}   {:.0} + {:.0} + {:.0} + {:.0} + {:.0} + {:.0} = {:.0}; {:.0}",
            k.count,
            k.p50_us,
            k.p90_us,
            k.p99_us,
            k.p999_us,
            k.max_us,
            b.transport_us,
            b.rank_us,
            b.swap_host_us,
            b.swap_nvme_us,
            b.read_us,
            b.store_us - b.rank_us - b.swap_host_us - b.swap_nvme_us - b.read_us,
            b.select_us,
            b.append_us
        );
    }
    if !absent.is_empty() {
        println!("{:>6} no steps", absent.join(", "));
    }
    let m = &r.bytes_moved;
    println!(
        "{:.1} steps/s; device miss ratio {:.4}; moved host→device {:.1} MB, nvme→device {:.1} MB, host→nvme {:.1} MB; served {:.1} MB; read fraction {:.3}; prefetch issued {} used {}; layer-ahead issued {} used {} late {}; device hits resident {} stream {}; index sketches {:.1} MB in memory, {} of {} pages spilled",
        r.steps_per_s,
        r.device_miss_ratio,
        m.host_to_device as f64 / 1e6,
        m.nvme_to_device as f64 / 1e6,
        m.host_to_nvme as f64 / 1e6,
        m.served as f64 / 1e6,
        r.read_fraction,
        r.prefetch.asked.issued,
        r.prefetch.asked.used,
        r.prefetch.layer_ahead.issued,
        r.prefetch.layer_ahead.used,
        r.prefetch.layer_ahead.late,
        r.device_regions.resident,
        r.device_regions.stream,
        r.index_after.sketch_bytes as f64 / 1e6,
        r.index_after.spilled_pages,
        r.index_after.pages
    );
}

/// Every step as a CSV row, for looking at outliers.
fn steps_csv(dir: &std::path::Path, m: &Measured, stem: &str, device: &str) -> anyhow::Result<()> {
    let mut out = String::from(
        "device,at_s,latency_us,class,select_us,store_us,rank_us,swap_host_us,swap_nvme_us,read_us,append_us,bytes,\
         append_store_us,append_max_us,append_lock_wait_us,append_reserve_us,append_migration_wait_us,\
         append_migration_us,append_durability_us,append_policy_us\n",
    );
    for s in &m.steps {
        let a = &s.append;
        out += &format!(
            "{device},{:.6},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            s.at,
            s.latency_us,
            s.class.name(),
            s.select_us,
            s.store_us,
            s.rank_us,
            s.swap_host_us,
            s.swap_nvme_us,
            s.read_us,
            s.append_us,
            s.bytes,
            a.store_us,
            a.max_us,
            a.lock_wait_us,
            a.reserve_us,
            a.migration_wait_us,
            a.migration_us,
            a.durability_us,
            a.policy_us
        );
    }
    let path = dir.join(format!("{stem}steps.csv"));
    std::fs::write(&path, out).with_context(|| format!("writing {}", path.display()))
}

/// The steps as CSV and plots; `device` (`emulated` or `gpu`) is in every
/// row and every title.
fn plots(dir: &std::path::Path, m: &Measured, stem: &str, device: &str) -> anyhow::Result<()> {
    steps_csv(dir, m, stem, device)?;
    let mut cdf = Vec::new();
    let mut time = Vec::new();
    for class in Class::ALL {
        let mut lat: Vec<u64> = m
            .steps
            .iter()
            .filter(|s| s.class == class)
            .map(|s| s.latency_us)
            .collect();
        if lat.is_empty() {
            continue;
        }
        lat.sort_unstable();
        let n = lat.len() as f64;
        let points = lat
            .iter()
            .enumerate()
            .map(|(i, &v)| (v as f64, (i + 1) as f64 / n))
            .collect();
        cdf.push(Series {
            name: class.name().into(),
            points,
            dots: false,
        });
        let points = m
            .steps
            .iter()
            .filter(|s| s.class == class)
            .map(|s| (s.at, s.latency_us as f64))
            .collect();
        time.push(Series {
            name: class.name().into(),
            points,
            dots: true,
        });
    }
    Chart {
        title: format!("Step latency CDF by miss class (device {device})"),
        x_label: "step latency (µs, log)".into(),
        y_label: "fraction of steps".into(),
        log_x: true,
        log_y: false,
        series: cdf,
    }
    .write(dir, &format!("{stem}cdf"))?;
    Chart {
        title: format!("Step latency over time (device {device})"),
        x_label: "time since the first step (s)".into(),
        y_label: "step latency (µs, log)".into(),
        log_x: false,
        log_y: true,
        series: time,
    }
    .write(dir, &format!("{stem}timeline"))
}

fn config(args: &DecodeArgs) -> anyhow::Result<RunConfig> {
    let mut a = args.clone();
    if a.quick {
        // Small enough for a CI smoke run, with a device smaller than a step's
        // selection and most of the context on NVMe: every class occurs.
        (a.preset, a.context, a.steps, a.budget_pages) = ("custom".into(), 2048, 64, 16);
        (a.layers, a.kv_heads, a.query_heads, a.head_dim, a.dtype) =
            (Some(4), Some(2), Some(4), Some(64), Some("bf16".into()));
        (a.device_fraction, a.host_fraction, a.drift) = (0.25, 0.6, 0.03);
    }
    let shape = if a.preset == "custom" {
        let need = |v: Option<u32>, n: &str| v.with_context(|| format!("--{n} is needed with --preset custom"));
        let parts = [
            need(a.layers, "layers")?,
            need(a.kv_heads, "kv-heads")?,
            need(a.query_heads, "query-heads")?,
            need(a.head_dim, "head-dim")?,
        ];
        Shape::custom(parts, a.dtype.as_deref().unwrap_or("bf16"), a.page_size).context("--dtype")?
    } else {
        let custom = [a.layers, a.kv_heads, a.query_heads, a.head_dim]
            .iter()
            .any(Option::is_some);
        ensure!(
            !custom && a.dtype.is_none(),
            "--layers, --kv-heads, --query-heads, --head-dim and --dtype shape a model with --preset custom; \
             --preset {} has its own shape",
            a.preset
        );
        Shape::preset(&a.preset, a.page_size)?
    };
    ensure!(
        a.context > 0 && a.steps > 0 && a.sequences > 0,
        "--context, --steps and --sequences must be positive"
    );
    ensure!(
        (0.0..=1.0).contains(&a.device_fraction) && a.host_fraction > 0.0,
        "fractions: device in 0..=1, host above 0"
    );
    // A trace starts at the prefill: the warm-up's appends and choices
    // would be missing from it, and a replay would start cold anyway.
    ensure!(
        a.trace.is_none() || a.warmup_steps == 0,
        "--trace records from the prefill on: use it without --warmup-steps"
    );
    let source = match a.queries.strip_prefix("realkv:") {
        Some(dir) => {
            let real = RealKv::load(std::path::Path::new(dir), &shape)?;
            ensure!(
                a.context + a.warmup_steps + a.steps <= real.tokens(),
                "--context + --warmup-steps + --steps must fit the dataset's {} tokens",
                real.tokens()
            );
            Queries::Real(Arc::new(real))
        }
        None if a.queries == "synthetic" => Queries::Synthetic {
            drift: a.drift,
            seed: a.seed,
        },
        None => bail!("--queries {:?}: synthetic or realkv:DIR", a.queries),
    };
    Ok(RunConfig {
        shape,
        context: a.context,
        budget_pages: a.budget_pages,
        sink_pages: a.sinks,
        window_pages: a.window,
        mode: kvtier_core::rank::Mode::parse(&a.mode)
            .with_context(|| format!("--mode {}: not one of quest, cuboid, sketch, two-stage", a.mode))?,
        candidates: a.candidates,
        reuse_similarity: a.reuse_similarity,
        sequences: a.sequences,
        steps: a.steps,
        warmup_steps: a.warmup_steps,
        device_fraction: a.device_fraction,
        device_step_fraction: a.device_step_fraction,
        device_policy: a.device_policy,
        device: a.device,
        host_policy: a.host_policy,
        spill_sketches: a.spill_sketches,
        host_fraction: a.host_fraction,
        queries: a.queries.clone(),
        source,
        drift: a.drift,
        rate: a.rate,
        prefetch_pages: a.prefetch_pages,
        deadline_us: a.deadline_us,
        checkpoint_at_step: a.checkpoint_at_step,
        addr: a.addr.clone(),
        data_plane: a.data_plane,
        shm_socket: a.shm_socket.clone(),
        shm_poll_us: a.shm_poll_us,
        server_shm_poll_us: a.server_shm_poll_us,
        record_trace: a.trace.is_some(),
    })
}

/// The trace file, in the format the server records (`kvtier_store::TraceRecord`):
/// the header (sized against the working set as this run sized its tiers),
/// each sequence's shape and prefill, then every selection and append in
/// the order they finished.
fn write_trace(path: &std::path::Path, cfg: &RunConfig, m: &Measured, emulated: bool) -> anyhow::Result<()> {
    use std::io::Write;
    let s = &cfg.shape;
    let pages_per_lane = (cfg.context + cfg.steps).div_ceil(s.page_size as usize) as u64;
    let lanes = u64::from(s.layers * s.kv_heads) * cfg.sequences as u64;
    let header = TraceHeader {
        kvtier_trace: TRACE_FORMAT,
        source: "bench decode".into(),
        sample: 1.0,
        working_set_bytes: Some(lanes * (pages_per_lane + 1) * s.page_bytes() as u64),
        device: Some(if emulated { "emulated" } else { "gpu" }.into()),
    };
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    fn line(out: &mut impl Write, record: &impl serde::Serialize) -> anyhow::Result<()> {
        writeln!(out, "{}", serde_json::to_string(record)?)?;
        Ok(())
    }
    line(&mut out, &header)?;
    let prefill: Vec<u32> = (0..cfg.context.div_ceil(s.page_size as usize) as u32).collect();
    for seq in 0..cfg.sequences as u64 {
        line(
            &mut out,
            &TraceRecord::Sequence {
                seq,
                shape: [s.layers, s.kv_heads, s.query_heads, s.head_dim],
                dtype: s.dtype.into(),
                page_size: s.page_size,
                // The bench's sequences share no prefix.
                prefix: Vec::new(),
            },
        )?;
        for layer in 0..s.layers {
            let heads = (0..s.kv_heads)
                .map(|head| HeadPages {
                    head,
                    pages: prefill.clone(),
                    from: String::new(),
                })
                .collect();
            line(
                &mut out,
                &TraceRecord::Write(Access {
                    t_us: 0,
                    seq,
                    layer,
                    step: 0,
                    heads,
                    hot: false,
                    us: 0,
                    swap: None,
                }),
            )?;
        }
    }
    let mut records: Vec<&TraceRecord> = m.trace.iter().collect();
    records.sort_by_key(|r| match r {
        TraceRecord::Read(a) | TraceRecord::Write(a) => a.t_us,
        _ => 0,
    });
    for r in records {
        line(&mut out, r)?;
    }
    out.flush()?;
    Ok(())
}

fn device_label(r: &Report) -> &'static str {
    if r.emulated_device { "emulated" } else { "gpu" }
}

/// An open-loop run whose sequences fell behind their schedule measured
/// queueing too: say so, where it cannot be missed.
fn warn_if_rate_missed(r: &Report) {
    if let (true, Some(want), Some(got)) = (r.rate_missed, r.config.rate, r.achieved_rate) {
        eprintln!(
            "warning: open loop at {want} steps/s per sequence, but {got:.1} were achieved: the steps fell behind \
             their schedule, so their latencies include time queued behind it (lower --rate to measure the steps alone)"
        );
    }
}

/// Applies `name=value` to a copy of the arguments.
fn with_param(args: &DecodeArgs, name: &str, value: &str) -> anyhow::Result<DecodeArgs> {
    let mut a = args.clone();
    let f = || {
        value
            .parse::<f64>()
            .with_context(|| format!("{name}={value}: a number"))
    };
    match name {
        "device_fraction" => a.device_fraction = f()?,
        "device_step_fraction" => a.device_step_fraction = Some(f()?),
        "device_policy" => a.device_policy = value.parse().map_err(|e: String| anyhow::anyhow!("{name}: {e}"))?,
        "host_policy" => a.host_policy = value.parse().map_err(|e: String| anyhow::anyhow!("{name}: {e}"))?,
        "host_fraction" => a.host_fraction = f()?,
        "budget_pages" => a.budget_pages = value.parse()?,
        "drift" => a.drift = f()?,
        "sequences" => a.sequences = value.parse()?,
        other => bail!(
            "--sweep {other}: one of device_fraction, device_step_fraction, device_policy, host_policy, \
             host_fraction, budget_pages, drift, sequences"
        ),
    }
    Ok(a)
}

pub(crate) fn run(args: DecodeArgs) -> anyhow::Result<()> {
    super::fresh_out_dir(&args.out)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let Some(sweep) = &args.sweep else {
        let cfg = config(&args)?;
        let measured = runtime.block_on(run::run(cfg.clone()))?;
        let r = report(cfg.clone(), &measured);
        plots(&args.out, &measured, "", device_label(&r))?;
        if let Some(path) = &args.trace {
            write_trace(path, &cfg, &measured, r.emulated_device)?;
        }
        std::fs::write(args.out.join("report.json"), serde_json::to_string_pretty(&r)?)?;
        if args.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            print_table(&r);
            eprintln!("report and plots in {}", args.out.display());
        }
        warn_if_rate_missed(&r);
        // The quick run is the CI smoke test of the miss paths: one that
        // missed a class has tested less than it claims.
        if let Some(name) = Class::ALL
            .iter()
            .map(|c| c.name())
            .find(|n| args.quick && !r.classes.contains_key(n))
        {
            match &args.addr {
                Some(addr) => bail!(
                    "the --quick run produced no {name} step: the server at {addr} has its own tier sizes, \
                     and --quick sizes only its in-process server's"
                ),
                None => {
                    bail!("the --quick run produced no {name} step; its tier sizes no longer exercise every miss class")
                }
            }
        }
        return Ok(());
    };
    ensure!(
        args.trace.is_none(),
        "--trace records one run; it cannot go with --sweep"
    );
    let (name, values) = sweep.split_once('=').context("--sweep PARAM=V1,V2,...")?;
    let mut rows = Vec::new();
    let mut lines: Vec<Series> = ["p50", "p99", "p99.9"]
        .iter()
        .map(|n| Series {
            name: (*n).into(),
            points: Vec::new(),
            dots: false,
        })
        .collect();
    let mut device = "emulated";
    for value in values.split(',') {
        let cfg = config(&with_param(&args, name, value)?)?;
        let measured = runtime.block_on(run::run(cfg.clone()))?;
        let r = report(cfg.clone(), &measured);
        device = device_label(&r);
        plots(&args.out, &measured, &format!("{name}-{value}-"), device)?;
        let all = histogram(measured.steps.iter().map(|s| s.latency_us));
        let x: f64 = value.parse()?;
        for (series, q) in lines.iter_mut().zip([0.5, 0.99, 0.999]) {
            series.points.push((x, all.value_at_quantile(q) as f64));
        }
        if !args.json {
            println!("== {name} = {value}");
            print_table(&r);
        }
        warn_if_rate_missed(&r);
        rows.push(serde_json::json!({ "param": name, "value": x, "report": r }));
    }
    Chart {
        title: format!("Step latency against {name} (device {device})"),
        x_label: name.into(),
        y_label: "step latency (µs, log)".into(),
        log_x: false,
        log_y: true,
        series: lines,
    }
    .write(&args.out, &format!("sweep-{name}"))?;
    let out = serde_json::json!({ "sweep": rows });
    std::fs::write(args.out.join("sweep.json"), serde_json::to_string_pretty(&out)?)?;
    if args.json {
        println!("{}", serde_json::to_string(&out)?);
    }
    Ok(())
}
