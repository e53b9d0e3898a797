//! `kvtier tune TRACE`: tier sizes from a workload's own accesses. The
//! trace (`kvtier bench decode --trace`) lists every selection; with the
//! prefill and the appends that the bench interleaves with them, it is the
//! access stream the store's tiers see. Both tiers are LRU caches of that
//! stream — the device an inclusive LRU over host memory that admits every
//! written page and every page a selection swaps in, host memory an LRU of
//! everything — so one pass of byte-weighted stack distances (`stack.rs`)
//! gives each tier's exact miss ratio at every size.

mod stack;

use std::path::PathBuf;

use anyhow::{Context, ensure};
use clap::Args;
use serde::Serialize;

use crate::bench::fetch::{TraceEntry, TraceHeader, read_trace};
use crate::bench::plot::{Chart, Series};
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
}

impl Replay {
    /// A write puts the page in both tiers; it is not a hit or a miss.
    fn write(&mut self, key: PageKey) {
        self.device.access(key, self.page_bytes, false);
        self.host.access(key, self.page_bytes, false);
    }

    /// A page a selection chose: made hot, so on the device afterwards.
    fn read(&mut self, key: PageKey) {
        self.device.access(key, self.page_bytes, true);
        self.host.access(key, self.page_bytes, true);
    }
}

/// Replays the prefill, then each step's selections and appends, as
/// `kvtier bench decode` made them.
fn replay(header: &TraceHeader, entries: &mut [TraceEntry], page_bytes: u64) -> anyhow::Result<(MissCurve, MissCurve)> {
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
    for e in entries.iter() {
        let seq = e.sequence as u32;
        for (head, pages) in e.pages.iter().enumerate() {
            for &page in pages {
                r.read((seq, e.layer, head as u32, page));
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
    Ok((r.device.curve(), r.host.curve()))
}

#[derive(Debug, Serialize)]
struct Point {
    bytes: u64,
    fraction: f64,
    device_miss_ratio: f64,
    host_miss_ratio: f64,
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
}

pub(crate) fn run(args: TuneArgs) -> anyhow::Result<()> {
    ensure!(
        (0.0..1.0).contains(&args.target_miss),
        "--target-miss: a share in [0, 1)"
    );
    let (header, shape, mut entries) = read_trace(&args.trace)?;
    let page_bytes = shape.page_bytes() as u64;
    let (device, host) = replay(&header, &mut entries, page_bytes)?;
    let lanes = u64::from(shape.layers * shape.kv_heads) * header.sequences as u64;
    let working_set = lanes * (u64::from(header.pages_per_lane) + 1) * page_bytes;
    let point = |fraction: f64| {
        let bytes = (working_set as f64 * fraction) as u64;
        Point {
            bytes,
            fraction,
            device_miss_ratio: device.miss_ratio(bytes),
            host_miss_ratio: host.miss_ratio(bytes),
        }
    };
    // 1 % to 100 % of the working set, 40 steps per decade.
    let curve: Vec<Point> = (0..=80)
        .map(|i| point(10f64.powf(-2.0 + f64::from(i) / 40.0)))
        .collect();
    let report = Report {
        trace: args.trace.clone(),
        working_set_bytes: working_set,
        selected_pages: device.accesses(),
        target_miss: args.target_miss,
        device_bytes: device.smallest_for(args.target_miss),
        host_bytes: host.smallest_for(args.target_miss),
        at: args.device_fraction.iter().map(|&f| point(f)).collect(),
        curve,
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
    println!(
        "{:>10} {:>12} {:>12} {:>12}",
        "share", "bytes", "device miss", "host miss"
    );
    for p in r.at.iter().chain(r.curve.iter().step_by(10)) {
        println!(
            "{:>9.1}% {:>12} {:>12.4} {:>12.4}",
            100.0 * p.fraction,
            mib(p.bytes),
            p.device_miss_ratio,
            p.host_miss_ratio
        );
    }
    println!("plots: {}", out.join("miss-ratio.png").display());
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
    .write(out, "miss-ratio")
}
