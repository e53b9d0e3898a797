//! `kvtier tune TRACE`: tier sizes from a workload's own accesses. The
//! trace (`kvtier bench decode --trace`) lists every selection; with the
//! prefill and the appends that the bench interleaves with them, it is the
//! access stream the store's tiers see. Both tiers are LRU caches of that
//! stream — the device an inclusive LRU over host memory that admits every
//! written page and every page a selection swaps in, host memory an LRU of
//! everything — so one pass of byte-weighted stack distances (`stack.rs`)
//! gives each tier's exact miss ratio at every size. With the trace's
//! timings, `latency.rs` predicts step latency at every size too.

mod latency;
mod stack;

use std::path::PathBuf;

use anyhow::{Context, ensure};
use clap::Args;
use serde::Serialize;

use crate::bench::fetch::{TraceEntry, TraceHeader, read_trace};
use crate::bench::plot::{Chart, Series};
use latency::{LatencyModel, Read};
use stack::{MissCurve, StackDistances};

#[derive(Debug, Args)]
pub(crate) struct TuneArgs {
    /// A trace written by `kvtier bench decode --trace FILE`.
    trace: PathBuf,
    /// The largest share of selected pages that may miss a tier.
    #[arg(long, default_value_t = 0.05)]
    target_miss: f64,
    /// Also predict at these device sizes, as shares of the working set
    /// (as `kvtier bench decode --device-fraction` sizes the device).
    #[arg(long, value_delimiter = ',')]
    device_fraction: Vec<f64>,
    /// The largest predicted p99 step latency, in milliseconds: recommends
    /// the smallest device that meets it (needs a trace with timings).
    #[arg(long)]
    target_p99_ms: Option<f64>,
    /// Host tier size for the latency predictions (default: the whole
    /// working set, no NVMe), e.g. 64MiB.
    #[arg(long)]
    host_bytes: Option<crate::config::ByteSize>,
    /// Swap-in cost per page from host memory, in µs (default: as the
    /// trace's recording measured it).
    #[arg(long)]
    host_page_us: Option<f64>,
    /// Swap-in cost per page from NVMe, in µs (default: as recorded).
    #[arg(long)]
    nvme_page_us: Option<f64>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Where the plots go (SVG and PNG).
    #[arg(long, default_value = "kvtier-tune-out")]
    out: PathBuf,
}

/// One page of one (sequence, layer, KV head).
type PageKey = (u32, u32, u32, u32);

/// The access stream, replayed into each tier's stack distances.
struct Replay {
    device: StackDistances<PageKey>,
    host: StackDistances<PageKey>,
    page_bytes: u64,
    reads: Vec<Read>,
}

impl Replay {
    /// A write puts the page in both tiers; it is not a hit or a miss.
    fn write(&mut self, key: PageKey) {
        self.device.access(key, self.page_bytes, false);
        self.host.access(key, self.page_bytes, false);
    }

    /// A page a selection of step `step` chose: made hot, so on the device
    /// afterwards.
    fn read(&mut self, key: PageKey, step: u32) {
        let device = self.device.access(key, self.page_bytes, true);
        let host = self.host.access(key, self.page_bytes, true);
        self.reads.push(Read { step, device, host });
    }
}

/// What a replay gives: each tier's curve, and the latency model.
struct Replayed {
    device: MissCurve,
    host: MissCurve,
    latency: LatencyModel,
}

/// Replays the prefill, then each step's selections and appends, as
/// `kvtier bench decode` made them.
fn replay(header: &TraceHeader, entries: &mut [TraceEntry], page_bytes: u64) -> anyhow::Result<Replayed> {
    let context = header
        .context
        .context("the trace has no `context` (recorded by an older kvtier); record it again")?;
    let [layers, kv_heads, ..] = header.shape;
    let page_size = u64::from(header.page_size);
    let prefill_pages = context.div_ceil(page_size) as u32;
    let selected: usize = entries
        .iter()
        .map(|e| e.pages.iter().map(Vec::len).sum::<usize>())
        .sum();
    let prefill = header.sequences * (layers * kv_heads) as usize * prefill_pages as usize;
    let events = selected + prefill + entries.len() * kv_heads as usize;
    let mut r = Replay {
        device: StackDistances::new(events),
        host: StackDistances::new(events),
        page_bytes,
        reads: Vec::with_capacity(selected),
    };
    for seq in 0..header.sequences as u32 {
        for layer in 0..layers {
            for head in 0..kv_heads {
                for page in 0..prefill_pages {
                    r.write((seq, layer, head, page));
                }
            }
        }
    }
    // Sequences decode side by side: step by step, each sequence's layers.
    entries.sort_by_key(|e| (e.step, e.sequence, e.layer));
    let mut base_us: Vec<f64> = Vec::new();
    let mut step_of = None;
    let (mut host, mut nvme) = ((0u64, 0u64), (0u64, 0u64)); // (pages, µs)
    for e in entries.iter() {
        if step_of != Some((e.step, e.sequence)) {
            step_of = Some((e.step, e.sequence));
            base_us.push(0.0);
        }
        let step = (base_us.len() - 1) as u32;
        if let Some(t) = e.timing {
            base_us[step as usize] += t.us.saturating_sub(t.host_us + t.nvme_us) as f64;
            host = (host.0 + u64::from(t.from_host), host.1 + t.host_us);
            nvme = (nvme.0 + u64::from(t.from_nvme), nvme.1 + t.nvme_us);
        }
        let seq = e.sequence as u32;
        for (head, pages) in e.pages.iter().enumerate() {
            for &page in pages {
                r.read((seq, e.layer, head as u32, page), step);
            }
        }
        // The step's append to this layer opens a new page on a page
        // boundary (placed like any write); a write into the partial last
        // page neither admits nor refreshes it.
        let position = context + e.step as u64;
        if position.is_multiple_of(page_size) {
            for head in 0..kv_heads {
                r.write((seq, e.layer, head, (position / page_size) as u32));
            }
        }
    }
    let per_page = |(pages, us): (u64, u64)| (pages > 0).then(|| us as f64 / pages as f64);
    let timed = entries.iter().all(|e| e.timing.is_some());
    Ok(Replayed {
        device: r.device.curve(),
        host: r.host.curve(),
        latency: LatencyModel {
            base_us: if timed { base_us } else { Vec::new() },
            reads: r.reads,
            host_page_us: per_page(host),
            nvme_page_us: per_page(nvme),
        },
    })
}

#[derive(Debug, Serialize)]
struct Point {
    bytes: u64,
    fraction: f64,
    device_miss_ratio: f64,
    host_miss_ratio: f64,
    /// Predicted step latency with a device of this size over the host
    /// size of `latency` (with a timed trace).
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
}

/// The latency model's inputs and its recommendation.
#[derive(Debug, Serialize)]
struct LatencyReport {
    host_bytes: u64,
    host_page_us: Option<f64>,
    nvme_page_us: Option<f64>,
    target_p99_ms: Option<f64>,
    /// The smallest device whose predicted p99 meets the target.
    device_bytes_for_p99: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Report {
    trace: PathBuf,
    /// As `kvtier bench decode` sizes tiers: every lane's pages, plus one.
    working_set_bytes: u64,
    selected_pages: u64,
    target_miss: f64,
    /// The smallest sizes whose miss ratio is at most the target (none:
    /// even the whole working set misses more, from first accesses).
    device_bytes: Option<u64>,
    host_bytes: Option<u64>,
    curve: Vec<Point>,
    at: Vec<Point>,
    /// Without timings in the trace: none.
    latency: Option<LatencyReport>,
}

pub(crate) fn run(args: TuneArgs) -> anyhow::Result<()> {
    ensure!(
        (0.0..1.0).contains(&args.target_miss),
        "--target-miss: a share in [0, 1)"
    );
    let (header, shape, mut entries) = read_trace(&args.trace)?;
    let page_bytes = shape.page_bytes() as u64;
    let Replayed {
        device,
        host,
        mut latency,
    } = replay(&header, &mut entries, page_bytes)?;
    latency.host_page_us = args.host_page_us.or(latency.host_page_us);
    latency.nvme_page_us = args.nvme_page_us.or(latency.nvme_page_us);
    let timed = !latency.base_us.is_empty();
    ensure!(
        timed || args.target_p99_ms.is_none(),
        "--target-p99-ms: the trace has no timings (recorded by an older kvtier); record it again"
    );
    let lanes = u64::from(shape.layers * shape.kv_heads) * header.sequences as u64;
    let working_set = lanes * (u64::from(header.pages_per_lane) + 1) * page_bytes;
    let host_bytes = args.host_bytes.map_or(working_set, |b| b.0);
    let point = |fraction: f64| -> anyhow::Result<Point> {
        let bytes = (working_set as f64 * fraction) as u64;
        let quantile = |q| -> anyhow::Result<Option<f64>> {
            Ok(match timed {
                true => Some(latency.quantile_us(q, bytes, host_bytes)? / 1e3),
                false => None,
            })
        };
        Ok(Point {
            bytes,
            fraction,
            device_miss_ratio: device.miss_ratio(bytes),
            host_miss_ratio: host.miss_ratio(bytes),
            p50_ms: quantile(0.5)?,
            p99_ms: quantile(0.99)?,
        })
    };
    // 1 % to 100 % of the working set, 40 steps per decade.
    let curve = (0..=80)
        .map(|i| point(10f64.powf(-2.0 + f64::from(i) / 40.0)))
        .collect::<anyhow::Result<Vec<Point>>>()?;
    let latency_report = match timed {
        true => Some(LatencyReport {
            host_bytes,
            host_page_us: latency.host_page_us,
            nvme_page_us: latency.nvme_page_us,
            target_p99_ms: args.target_p99_ms,
            device_bytes_for_p99: match args.target_p99_ms {
                Some(ms) => latency.smallest_for_p99(ms * 1e3, host_bytes, working_set)?,
                None => None,
            },
        }),
        false => None,
    };
    let report = Report {
        trace: args.trace.clone(),
        working_set_bytes: working_set,
        selected_pages: device.accesses(),
        target_miss: args.target_miss,
        device_bytes: device.smallest_for(args.target_miss),
        host_bytes: host.smallest_for(args.target_miss),
        at: args
            .device_fraction
            .iter()
            .map(|&f| point(f))
            .collect::<anyhow::Result<_>>()?,
        curve,
        latency: latency_report,
    };
    plot(&report, &args.out)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report, &args.out);
    }
    Ok(())
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

fn print_table(r: &Report, out: &std::path::Path) {
    println!(
        "kvtier tune {}: {} selected pages; working set {}",
        r.trace.display(),
        r.selected_pages,
        mib(r.working_set_bytes)
    );
    let recommend = |what: &str, bytes: Option<u64>| match bytes {
        Some(b) => println!(
            "  {what}: at least {} ({:.1} % of the working set) for at most {:.1} % of selected pages to miss it",
            mib(b),
            100.0 * b as f64 / r.working_set_bytes as f64,
            100.0 * r.target_miss
        ),
        None => println!(
            "  {what}: no size meets {:.1} %: first accesses alone miss more",
            100.0 * r.target_miss
        ),
    };
    recommend("device tier", r.device_bytes);
    recommend("host tier", r.host_bytes);
    if let Some(l) = &r.latency {
        let us = |v: Option<f64>| v.map_or("unknown".to_owned(), |v| format!("{v:.1} µs"));
        println!(
            "  latency model: host tier {}; swap-in per page from host {}, from NVMe {}",
            mib(l.host_bytes),
            us(l.host_page_us),
            us(l.nvme_page_us)
        );
        if let Some(target) = l.target_p99_ms {
            match l.device_bytes_for_p99 {
                Some(b) => println!(
                    "  device tier: at least {} for a predicted step p99 of at most {target} ms",
                    mib(b)
                ),
                None => println!("  device tier: no size meets a step p99 of {target} ms"),
            }
        }
    }
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
    println!(
        "{:>10} {:>12} {:>12} {:>12} {:>10} {:>10}",
        "share", "bytes", "device miss", "host miss", "p50 ms", "p99 ms"
    );
    for p in r.at.iter().chain(r.curve.iter().step_by(10)) {
        println!(
            "{:>9.1}% {:>12} {:>12.4} {:>12.4} {:>10} {:>10}",
            100.0 * p.fraction,
            mib(p.bytes),
            p.device_miss_ratio,
            p.host_miss_ratio,
            ms(p.p50_ms),
            ms(p.p99_ms)
        );
    }
    println!("plots: {}", out.display());
}

fn plot(r: &Report, out: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let line = |name: &str, f: fn(&Point) -> f64| Series {
        name: name.to_owned(),
        points: r.curve.iter().map(|p| (mib(p.bytes), f(p))).collect(),
        dots: false,
    };
    // Both tiers see the same accesses here, so one curve serves both;
    // draw the host's only where it differs.
    let mut series = vec![line("device", |p| p.device_miss_ratio)];
    if r.curve.iter().any(|p| p.host_miss_ratio != p.device_miss_ratio) {
        series.push(line("host", |p| p.host_miss_ratio));
    }
    if let Some(b) = r.device_bytes {
        series.push(Series {
            name: format!("≤ {:.0} %: {:.1} MiB", 100.0 * r.target_miss, mib(b)),
            points: vec![(mib(b), 0.0), (mib(b), 1.0)],
            dots: false,
        });
    }
    Chart {
        title: format!(
            "Selected pages missing an LRU tier, by its size ({} MiB working set)",
            mib(r.working_set_bytes).round()
        ),
        x_label: "tier size (MiB)".into(),
        y_label: "miss ratio".into(),
        log_x: true,
        log_y: false,
        series,
    }
    .write(out, "miss-ratio")?;
    let Some(latency) = &r.latency else {
        return Ok(());
    };
    let mut series = vec![Series {
        name: "predicted p99".into(),
        points: r.curve.iter().filter_map(|p| Some((mib(p.bytes), p.p99_ms?))).collect(),
        dots: false,
    }];
    if let (Some(target), Some(b)) = (latency.target_p99_ms, latency.device_bytes_for_p99) {
        // A size below the plotted ones (no device needed) sits at the left edge.
        let x = mib(b).max(r.curve.first().map_or(0.0, |p| mib(p.bytes)));
        series.push(Series {
            name: format!("≤ {target} ms: {:.1} MiB", mib(b)),
            points: vec![(x, 0.0), (x, target)],
            dots: false,
        });
    }
    Chart {
        title: format!(
            "Predicted decode-step p99 against device size (host {:.0} MiB)",
            mib(latency.host_bytes)
        ),
        x_label: "device tier size (MiB)".into(),
        y_label: "step p99 (ms)".into(),
        log_x: true,
        log_y: false,
        series,
    }
    .write(out, "step-p99")
}
