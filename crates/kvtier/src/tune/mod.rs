//! `kvtier tune TRACE`: tier sizes from a workload's own accesses. The
//! trace — recorded by the server (`kvtier serve --access-trace`, or
//! `SetAccessTrace`) or by `kvtier bench decode --trace` — lists every
//! write and every read of pages in the order the store saw them. Under
//! LRU the device is an inclusive cache of that stream over host memory,
//! admitting every written page and every page a selection swaps in, so
//! one pass of byte-weighted stack distances (`stack.rs`) gives its exact
//! miss ratio at every size (and host memory's as an ideal LRU of
//! everything, the reference `host_bytes` reports). Reads that make
//! nothing hot (fetches, selections without a swap-in) count for host
//! memory only. With the trace's timings, `latency.rs` predicts step
//! latency at every size too.
//!
//! Policies an ideal LRU does not describe run as the store's own code on
//! miniature tiers (`simulate.rs`, over the pages `pages.rs` names, shared
//! prefixes included): the device's loop policy, and both host policies,
//! since the store's host LRU promotes a page read from NVMe only where
//! memory has room.
//!
//! A trace too large to replay whole is sampled by page hash
//! (`--sample`), on top of any sampling at recording: SHARDS-style, each
//! kept page keeps all its accesses and distances are scaled by the rate.

mod latency;
mod pages;
mod simulate;
mod stack;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use anyhow::ensure;
use clap::Args;
use serde::Serialize;

use crate::bench::plot::{Chart, Series};
use crate::trace::Trace;
use kvtier_store::{DevicePolicy, HostPolicy};
use latency::{LatencyModel, Read};
use pages::{PageKey, Walk, walk};
use simulate::{HostSetting, PolicyPoint, Simulated, Stream};
use stack::{MissCurve, StackDistances};

#[derive(Debug, Args)]
pub(crate) struct TuneArgs {
    /// An access trace: recorded by `kvtier serve --access-trace FILE` (or
    /// the SetAccessTrace RPC), or written by `kvtier bench decode --trace FILE`.
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
    /// Replay only this share of the pages (by page hash; distances are
    /// scaled back), for traces too large to replay whole.
    #[arg(long, default_value_t = 1.0)]
    sample: f64,
    /// Device policies to predict for: lru (exact, from stack distances)
    /// and loop (simulated on a miniature device).
    #[arg(long = "device-policy", value_name = "POLICY", default_values_t = DevicePolicy::ALL)]
    policies: Vec<DevicePolicy>,
    /// Host policies to predict for: lru and frequency, both simulated on
    /// miniature host memory (the store's LRU promotes a page read from
    /// NVMe only where memory has room, which an ideal LRU does not).
    #[arg(long = "host-policy", value_name = "POLICY", default_values_t = HostPolicy::ALL)]
    host_policies: Vec<HostPolicy>,
    /// Also predict host memory's miss ratio at these sizes, as shares of
    /// the working set.
    #[arg(long, value_delimiter = ',')]
    host_fraction: Vec<f64>,
    /// Host memory's watermarks, as the recording server had them
    /// (`host_high_watermark`, `host_low_watermark`), for the simulated
    /// host policies' background migration.
    #[arg(long, value_delimiter = ',', default_values_t = [0.9, 0.8])]
    host_watermarks: Vec<f64>,
    /// Whether the recording server promoted pages read from NVMe back to
    /// host memory (`promote_on_read`), for the simulated host policies.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    promote_on_read: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Where the plots go (SVG and PNG); replaced as a whole by each run.
    #[arg(long, default_value = "kvtier-tune-out")]
    out: PathBuf,
}

/// The access stream, replayed into each tier's stack distances.
struct Replay {
    device: StackDistances<PageKey>,
    host: StackDistances<PageKey>,
    reads: Vec<Read>,
    /// The distinct pages seen (of the sample), and their bytes: a page
    /// freed and written again counts once.
    seen: HashSet<PageKey>,
    distinct_bytes: u64,
}

impl Replay {
    /// Host memory sees every access: the first one of a page counts the
    /// page's bytes.
    fn host_access(&mut self, key: PageKey, bytes: u64, counted: bool) -> Option<u64> {
        if self.seen.insert(key) {
            self.distinct_bytes += bytes;
        }
        self.host.access(key, bytes, counted)
    }

    /// A write puts the page in both tiers; it is not a hit or a miss.
    fn write(&mut self, key: PageKey, bytes: u64) {
        self.device.access(key, bytes, false);
        self.host_access(key, bytes, false);
    }

    /// Freed pages leave both tiers.
    fn free(&mut self, keys: &[PageKey]) {
        self.device.forget(keys);
        self.host.forget(keys);
    }

    /// A page a selection of step `step` made hot: on the device afterwards.
    /// `served`: where the recording says it came from, if it says.
    fn read_hot(&mut self, key: PageKey, bytes: u64, step: u32, served: Option<char>) {
        let device = self.device.access(key, bytes, true);
        let host = self.host_access(key, bytes, true);
        self.reads.push(Read {
            step,
            device,
            host,
            served,
        });
    }

    /// A page read where it is (a fetch): host memory sees it.
    fn read_in_place(&mut self, key: PageKey, bytes: u64) {
        self.host_access(key, bytes, true);
    }
}

/// What a replay gives: each tier's curve, the latency model and the
/// bytes of the distinct pages the trace touched.
struct Replayed {
    device: MissCurve,
    host: MissCurve,
    latency: LatencyModel,
    distinct_bytes: u64,
}

/// Replays the trace's writes and reads in the order recorded, the pages
/// of `rate` (this replay's sampling; the recording's is in the header).
fn replay(trace: &Trace, rate: f64) -> Replayed {
    let scale = 1.0 / (trace.header.sample * rate);
    let walk = walk(trace, rate);
    let events: usize = walk
        .iter()
        .map(|w| match w {
            Walk::Access(_, pages) => pages.len(),
            _ => 0,
        })
        .sum();
    let mut r = Replay {
        device: StackDistances::new(events, scale),
        host: StackDistances::new(events, scale),
        reads: Vec::new(),
        seen: HashSet::new(),
        distinct_bytes: 0,
    };
    // A decode step is a sequence's layers at one position, in order of
    // first appearance; only steps with a swap-in are decode steps (a
    // prefill's writes are not).
    let mut steps: HashMap<(usize, u64), u32> = HashMap::new();
    let mut base_us: Vec<f64> = Vec::new();
    let mut decode: Vec<bool> = Vec::new();
    let (mut host, mut nvme) = ((0u64, 0u64), (0u64, 0u64)); // (pages, µs)
    let mut timed = true;
    for step in &walk {
        let (e, pages) = match step {
            Walk::Access(e, pages) => (*e, pages),
            Walk::Free(keys) => {
                r.free(keys);
                continue;
            }
            // An attach moves no page in an ideal LRU (the simulated host
            // policies count it).
            Walk::Attach(_) => continue,
        };
        let a = &e.access;
        let step = *steps.entry((e.sequence, a.step)).or_insert_with(|| {
            base_us.push(0.0);
            decode.push(false);
            (base_us.len() - 1) as u32
        });
        decode[step as usize] |= a.hot && !e.write;
        let swap = a.swap.unwrap_or_default();
        timed &= !a.hot || a.swap.is_some();
        base_us[step as usize] += a.us.saturating_sub(swap.host_us + swap.nvme_us) as f64;
        host = (host.0 + u64::from(swap.from_host), host.1 + swap.host_us);
        nvme = (nvme.0 + u64::from(swap.from_nvme), nvme.1 + swap.nvme_us);
        let bytes = trace.shapes[e.sequence].page_bytes() as u64;
        for &(key, served) in pages {
            match (e.write, a.hot) {
                (true, _) => r.write(key, bytes),
                (false, true) => r.read_hot(key, bytes, step, served),
                (false, false) => r.read_in_place(key, bytes),
            }
        }
    }
    // Renumber the decode steps; every counted read is in one.
    let mut renumbered = Vec::with_capacity(decode.len());
    let mut decode_us = Vec::new();
    for (us, is_decode) in base_us.into_iter().zip(decode) {
        renumbered.push(decode_us.len() as u32);
        if is_decode {
            decode_us.push(us);
        }
    }
    for read in &mut r.reads {
        read.step = renumbered[read.step as usize];
    }
    let per_page = |(pages, us): (u64, u64)| (pages > 0).then(|| us as f64 / pages as f64);
    Replayed {
        device: r.device.curve(),
        host: r.host.curve(),
        latency: LatencyModel {
            base_us: if timed { decode_us } else { Vec::new() },
            reads: r.reads,
            read_weight: scale,
            host_page_us: per_page(host),
            nvme_page_us: per_page(nvme),
        },
        distinct_bytes: (r.distinct_bytes as f64 * scale) as u64,
    }
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
pub(crate) struct Report {
    trace: PathBuf,
    /// The share of pages replayed: the recording's sample times `--sample`.
    sample: f64,
    /// The device tier the recording's timings come from (`gpu`,
    /// `emulated`), when it says.
    device: Option<String>,
    /// As `kvtier bench decode` sizes tiers: every lane's pages, plus one.
    working_set_bytes: u64,
    selected_pages: u64,
    target_miss: f64,
    /// The smallest sizes whose miss ratio is at most the target (none:
    /// even the whole working set misses more, from first accesses);
    /// host memory's under an ideal LRU (each host policy's own is in
    /// `policies`).
    device_bytes: Option<u64>,
    host_bytes: Option<u64>,
    curve: Vec<Point>,
    at: Vec<Point>,
    /// Without timings in the trace: none.
    latency: Option<LatencyReport>,
    /// Each tier's curve per policy asked for: the device's LRU exact (the
    /// same as `curve` and `device_bytes`), the others simulated.
    policies: Vec<PolicyCurve>,
}

/// One policy's miss ratios on one tier, and its recommendation.
#[derive(Debug, Serialize)]
struct PolicyCurve {
    /// `device` or `host`.
    tier: &'static str,
    policy: String,
    /// `exact` (stack distances) or `simulated` (the store's policy code
    /// on a miniature tier).
    method: &'static str,
    /// The smallest size on the curve whose miss ratio is at most the target.
    bytes_for_target: Option<u64>,
    curve: Vec<PolicyPoint>,
    /// At the `--device-fraction` (device) or `--host-fraction` (host) sizes.
    at: Vec<PolicyPoint>,
}

/// What [`policy_curves`] needs besides the trace.
struct CurveArgs<'a> {
    rate: f64,
    /// How the recording server ran host memory.
    host: HostSetting,
    working_set: u64,
    target_miss: f64,
    device_at: &'a [f64],
    host_at: &'a [f64],
}

/// Each policy of `device` and `host` at 1 % to 100 % of the working set,
/// 10 sizes a decade, and at the tier's `at` sizes: the device's LRU from
/// its exact curve, the others simulated.
fn policy_curves(
    trace: &Trace,
    replayed: (&MissCurve, &MissCurve),
    device: &[DevicePolicy],
    host: &[HostPolicy],
    a: &CurveArgs<'_>,
) -> anyhow::Result<Vec<PolicyCurve>> {
    let sizes: Vec<f64> = (0..=20).map(|i| 10f64.powf(-2.0 + f64::from(i) / 10.0)).collect();
    let exact = |curve: &MissCurve, fractions: &[f64]| -> Vec<PolicyPoint> {
        fractions
            .iter()
            .map(|&fraction| {
                let bytes = (a.working_set as f64 * fraction) as u64;
                PolicyPoint {
                    bytes,
                    fraction,
                    miss_ratio: curve.miss_ratio(bytes),
                }
            })
            .collect()
    };
    let mut stream = None;
    let mut out = Vec::new();
    let wanted = device
        .iter()
        .map(|&p| {
            (
                "device",
                p.to_string(),
                (p != DevicePolicy::Lru).then_some(Simulated::Device(p)),
            )
        })
        .chain(host.iter().map(|&p| ("host", p.to_string(), Some(Simulated::Host(p)))));
    for (tier, policy, simulated) in wanted {
        let (lru, at) = match tier {
            "device" => (replayed.0, a.device_at),
            _ => (replayed.1, a.host_at),
        };
        let (method, curve, at) = match simulated {
            None => ("exact", exact(lru, &sizes), exact(lru, at)),
            Some(sim) => {
                let stream = stream.get_or_insert_with(|| Stream::of(trace, a.rate));
                (
                    "simulated",
                    stream.curve(sim, a.working_set, &sizes, a.host)?,
                    stream.curve(sim, a.working_set, at, a.host)?,
                )
            }
        };
        out.push(PolicyCurve {
            tier,
            policy,
            method,
            bytes_for_target: match simulated {
                None => lru.smallest_for(a.target_miss),
                Some(_) => curve.iter().find(|p| p.miss_ratio <= a.target_miss).map(|p| p.bytes),
            },
            curve,
            at,
        });
    }
    Ok(out)
}

pub(crate) fn run(args: TuneArgs) -> anyhow::Result<()> {
    let report = report(&args)?;
    plot(&report, &args.out)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report, &args.out);
    }
    Ok(())
}

/// Everything `kvtier tune` predicts from `args.trace`.
pub(crate) fn report(args: &TuneArgs) -> anyhow::Result<Report> {
    ensure!(
        (0.0..1.0).contains(&args.target_miss),
        "--target-miss: a share in [0, 1)"
    );
    ensure!(args.sample > 0.0 && args.sample <= 1.0, "--sample: a share in (0, 1]");
    let trace = Trace::read(&args.trace)?;
    if let Some((reason, dropped)) = &trace.ended {
        eprintln!("note: the recording stopped early ({reason}) and dropped {dropped} records");
    }
    let &[high, low] = args.host_watermarks.as_slice() else {
        anyhow::bail!("--host-watermarks: two shares, HIGH,LOW");
    };
    ensure!(
        0.0 < low && low <= high && high <= 1.0,
        "--host-watermarks: HIGH,LOW with 0 < LOW <= HIGH <= 1"
    );
    for (flag, fractions) in [
        ("--device-fraction", &args.device_fraction),
        ("--host-fraction", &args.host_fraction),
    ] {
        ensure!(
            fractions.iter().all(|&f| f > 0.0 && f.is_finite()),
            "{flag}: positive shares of the working set"
        );
    }
    let Replayed {
        device,
        host,
        mut latency,
        distinct_bytes,
    } = replay(&trace, args.sample);
    latency.host_page_us = args.host_page_us.or(latency.host_page_us);
    latency.nvme_page_us = args.nvme_page_us.or(latency.nvme_page_us);
    let timed = !latency.base_us.is_empty();
    ensure!(
        timed || args.target_p99_ms.is_none(),
        "--target-p99-ms: the trace has swap-ins without timings; record it again"
    );
    // The bytes the recording sized its tiers by, or those it touched.
    let working_set = trace.header.working_set_bytes.unwrap_or(distinct_bytes).max(1);
    let host_bytes = args.host_bytes.map_or(working_set, |b| b.0);
    // Predicting latency down to no device needs what a swap-in from each
    // tier costs; a recording that never swapped in from one cannot say.
    let timed = timed
        && match latency.quantile_us(0.99, 0, host_bytes) {
            Ok(_) => true,
            Err(e) if args.target_p99_ms.is_none() => {
                eprintln!("note: no latency predictions: {e}");
                false
            }
            Err(e) => return Err(e.context("--target-p99-ms")),
        };
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
    Ok(Report {
        trace: args.trace.clone(),
        sample: trace.header.sample * args.sample,
        device: trace.header.device.clone(),
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
        policies: policy_curves(
            &trace,
            (&device, &host),
            &args.policies,
            &args.host_policies,
            &CurveArgs {
                rate: args.sample,
                host: HostSetting {
                    watermarks: (high, low),
                    promote_on_read: args.promote_on_read,
                },
                working_set,
                target_miss: args.target_miss,
                device_at: &args.device_fraction,
                host_at: &args.host_fraction,
            },
        )?,
    })
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
    for c in &r.policies {
        recommend(
            &format!("{} tier ({}, {})", c.tier, c.policy, c.method),
            c.bytes_for_target,
        );
    }
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
    for c in r.policies.iter().filter(|c| c.method == "simulated") {
        println!("{} policy {} (simulated):", c.tier, c.policy);
        println!("{:>10} {:>12} {:>12}", "share", "bytes", "miss");
        for p in c.at.iter().chain(c.curve.iter().step_by(5)) {
            println!(
                "{:>9.1}% {:>12} {:>12.4}",
                100.0 * p.fraction,
                mib(p.bytes),
                p.miss_ratio
            );
        }
    }
    println!("plots: {}", out.display());
}

fn plot(r: &Report, out: &std::path::Path) -> anyhow::Result<()> {
    crate::bench::fresh_out_dir(out)?;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let line = |name: &str, f: fn(&Point) -> f64| Series {
        name: name.to_owned(),
        points: r.curve.iter().map(|p| (mib(p.bytes), f(p))).collect(),
        dots: false,
    };
    // Both tiers see the same accesses here, so one curve serves both;
    // draw the host's only where it differs.
    let mut series = vec![line("device (lru)", |p| p.device_miss_ratio)];
    if r.curve.iter().any(|p| p.host_miss_ratio != p.device_miss_ratio) {
        series.push(line("host", |p| p.host_miss_ratio));
    }
    for c in r.policies.iter().filter(|c| c.method == "simulated") {
        series.push(Series {
            name: format!("{} ({}, sim.)", c.tier, c.policy),
            points: c.curve.iter().map(|p| (mib(p.bytes), p.miss_ratio)).collect(),
            dots: true,
        });
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
            "Selected pages missing a tier, by its size and policy ({} MiB working set)",
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
            "Predicted decode-step p99 against device size (host {:.0} MiB; timings from a{} device)",
            mib(latency.host_bytes),
            match r.device.as_deref() {
                Some("emulated") => "n emulated",
                Some(_) => " GPU",
                None => "n unrecorded",
            }
        ),
        x_label: "device tier size (MiB)".into(),
        y_label: "step p99 (ms)".into(),
        log_x: true,
        log_y: false,
        series,
    }
    .write(out, "step-p99")
}

#[cfg(test)]
mod tests {
    use kvtier_store::{Access, HeadPages, TRACE_FORMAT, TraceHeader};

    use super::*;
    use crate::shape::Shape;
    use crate::trace::Event;

    /// A trace of `reads` swap-ins of one page each over `pages` pages of 4
    /// KV heads, skewed towards low pages (about Zipf's law).
    fn skewed_trace(pages: u32, reads: usize) -> Trace {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let events = (0..reads)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x >> 11) as f64 / (1u64 << 53) as f64;
                let page = ((f64::from(pages)).powf(u) - 1.0) as u32;
                Event {
                    sequence: 0,
                    write: false,
                    access: Access {
                        t_us: i as u64,
                        seq: 7,
                        layer: 0,
                        step: i as u64,
                        heads: vec![HeadPages {
                            head: (x % 4) as u32,
                            pages: vec![page],
                            from: String::new(),
                        }],
                        hot: true,
                        us: 0,
                        swap: None,
                    },
                }
            })
            .collect();
        Trace {
            header: TraceHeader {
                kvtier_trace: TRACE_FORMAT,
                source: "test".into(),
                sample: 1.0,
                working_set_bytes: None,
                device: None,
            },
            shapes: vec![Shape::custom([1, 4, 4, 64], "f16", 16).unwrap()],
            prefixes: vec![Vec::new()],
            drops: Vec::new(),
            events,
            ended: None,
        }
    }

    /// A prefill (writes only, however slow) is not a decode step: the
    /// latency quantiles are over the steps that selected pages.
    #[test]
    fn writes_alone_make_no_decode_step() {
        let mut trace = skewed_trace(64, 100);
        for (i, e) in trace.events.iter_mut().enumerate() {
            e.access.us = 100;
            e.access.step = 1_000 + i as u64;
            e.access.swap = Some(Default::default());
        }
        let prefill = Event {
            sequence: 0,
            write: true,
            access: Access {
                t_us: 0,
                seq: 7,
                layer: 0,
                step: 0,
                heads: vec![HeadPages {
                    head: 0,
                    pages: (0..64).collect(),
                    from: String::new(),
                }],
                hot: false,
                us: 5_000_000,
                swap: None,
            },
        };
        trace.events.insert(0, prefill);
        let latency = replay(&trace, 1.0).latency;
        assert_eq!(latency.base_us.len(), 100, "one decode step per selection");
        let full = 1 << 30;
        let with_costs = LatencyModel {
            host_page_us: Some(1.0),
            nvme_page_us: Some(1.0),
            ..latency
        };
        assert!(with_costs.quantile_us(1.0, full, full).unwrap() < 1_000.0);
    }

    /// Host memory as a device simulation ignores it.
    const UNUSED_HOST: HostSetting = HostSetting {
        watermarks: (1.0, 1.0),
        promote_on_read: true,
    };

    /// The simulation runs the store's own policy code: under LRU it must
    /// agree with the stack-distance model, an independent one, whole and
    /// sampled (a miniature device of a fifth of the size over a fifth of
    /// the pages, against distances scaled by five: the same estimate).
    #[test]
    fn the_simulated_lru_agrees_with_the_stack_distances() {
        let trace = skewed_trace(4000, 60_000);
        let (exact, shards) = (replay(&trace, 1.0), replay(&trace, 0.2));
        let (whole, mini) = (Stream::of(&trace, 1.0), Stream::of(&trace, 0.2));
        let page_bytes = trace.shapes[0].page_bytes() as u64;
        for pages in [200, 400, 800, 1600, 2800] {
            let bytes = pages * page_bytes;
            let want = exact.device.miss_ratio(bytes);
            let got = whole
                .miss_ratio(Simulated::Device(DevicePolicy::Lru), bytes, UNUSED_HOST)
                .unwrap();
            assert!(
                (want - got).abs() < 1e-9,
                "{pages} pages: stack distances {want}, simulated {got}"
            );
            let want = shards.device.miss_ratio(bytes);
            let got = mini
                .miss_ratio(Simulated::Device(DevicePolicy::Lru), bytes, UNUSED_HOST)
                .unwrap();
            assert!(
                (want - got).abs() < 1e-9,
                "{pages} pages, a fifth: scaled distances {want}, miniature {got}"
            );
        }
    }

    #[test]
    fn a_sampled_replay_estimates_the_whole_streams_miss_ratios() {
        let trace = skewed_trace(4000, 60_000);
        let exact = replay(&trace, 1.0);
        let sampled = replay(&trace, 0.2);
        let ws = exact.distinct_bytes;
        let estimate = sampled.distinct_bytes as f64 / ws as f64;
        assert!(
            (0.85..1.15).contains(&estimate),
            "distinct bytes estimated at {estimate}×"
        );
        for share in [0.05, 0.1, 0.2, 0.4, 0.7] {
            let bytes = (ws as f64 * share) as u64;
            let (want, got) = (exact.device.miss_ratio(bytes), sampled.device.miss_ratio(bytes));
            assert!(
                (want - got).abs() < 0.03,
                "at {share} of the pages: exact {want}, sampled {got}"
            );
        }
        // Sampling keeps whole pages: about a fifth of the accesses.
        let kept = sampled.device.accesses() as f64 / exact.device.accesses() as f64;
        assert!((0.15..0.25).contains(&kept), "kept {kept} of the accesses");
    }
}
