//! `kvtier bench select`: digest bytes scored per second by the scoring
//! kernel, against a memcpy of the same bytes in the same run.

use std::hint::black_box;
use std::time::Duration;

use clap::{Args, ValueEnum};
use kvtier_core::DType;
use kvtier_core::score::{Kernel, score_column_with};
use kvtier_core::select::{Budget, select};
use serde::Serialize;

use super::median_time;

#[derive(Debug, Args)]
pub(crate) struct SelectBenchArgs {
    /// Pages in the digest column (one lane).
    #[arg(long, default_value_t = 65536)]
    pages: usize,
    /// Elements per key row.
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// The keys' element type (digests are kept in it).
    #[arg(long, value_enum, default_value_t = DTypeArg::F16)]
    dtype: DTypeArg,
    /// Query heads per KV head scored in the same pass (GQA group).
    #[arg(long, default_value_t = 1)]
    group: usize,
    /// Budget for the score + top-k measurement.
    #[arg(long, default_value_t = 64)]
    budget_pages: usize,
    /// At least this many timed runs (more while under 0.3 s of measuring).
    #[arg(long, default_value_t = 15)]
    runs: usize,
    /// Score this many lanes (columns of `pages` pages) as one decode step
    /// does: over all cores, against reading the same bytes over all cores.
    #[arg(long, default_value_t = 1)]
    lanes: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DTypeArg {
    F32,
    F16,
    Bf16,
}

impl From<DTypeArg> for DType {
    fn from(d: DTypeArg) -> Self {
        match d {
            DTypeArg::F32 => DType::F32,
            DTypeArg::F16 => DType::F16,
            DTypeArg::Bf16 => DType::Bf16,
        }
    }
}

#[derive(Debug, Serialize)]
struct Result {
    pages: usize,
    head_dim: usize,
    dtype: &'static str,
    group: usize,
    kernel: &'static str,
    digest_bytes: usize,
    /// Median seconds to score the whole column once.
    seconds: f64,
    digest_gbps: f64,
    /// memcpy of `digest_bytes` in the same run, median.
    memcpy_gbps: f64,
    ratio: f64,
    /// The same scoring with the scalar kernel.
    scalar_gbps: f64,
    /// Median seconds for scoring plus top-k selection of `budget_pages`.
    select_seconds: f64,
    budget_pages: usize,
    runs: usize,
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Deterministic values in [-2, 2], a thousandth apart.
fn values() -> impl FnMut() -> f32 {
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 4001) as f32 / 1000.0 - 2.0
    }
}

pub(crate) fn run(args: SelectBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.pages > 0 && args.head_dim > 0 && args.group > 0 && args.lanes > 0,
        "pages, head-dim, group and lanes must be positive"
    );
    if args.lanes > 1 {
        return step(&args);
    }
    let dtype = DType::from(args.dtype);
    let elements = args.pages * 2 * args.head_dim;
    let mut digests = vec![0u8; elements * dtype.size()];
    let mut next = values();
    for i in 0..elements {
        dtype.put_f32(&mut digests, i, next());
    }
    let queries: Vec<f32> = (0..args.group * args.head_dim).map(|_| next()).collect();
    let mut out = vec![0f32; args.pages * args.group];
    let kernel = Kernel::detect();
    let min_total = Duration::from_millis(300);
    let mut score = |k: Kernel| {
        median_time(args.runs, min_total, || {
            score_column_with(k, dtype, args.head_dim, black_box(&digests), &queries, &mut out);
            black_box(&out);
        })
    };
    let (fast, runs) = score(kernel);
    let (scalar, _) = score(Kernel::Scalar);
    let mut copy = vec![1u8; digests.len()];
    let (memcpy, _) = median_time(args.runs, min_total, || {
        copy.copy_from_slice(black_box(&digests));
        black_box(&copy);
    });
    let budget = Budget {
        pages: args.budget_pages,
        sinks: 1,
        window: 1,
    };
    let (selected, _) = median_time(args.runs, min_total, || {
        score_column_with(kernel, dtype, args.head_dim, black_box(&digests), &queries, &mut out);
        let per_page: Vec<f32> = out
            .chunks_exact(args.group)
            .map(|g| g.iter().copied().fold(f32::MIN, f32::max))
            .collect();
        black_box(select(&per_page, budget, None));
    });
    let result = Result {
        pages: args.pages,
        head_dim: args.head_dim,
        dtype: dtype.name(),
        group: args.group,
        kernel: kernel.name(),
        digest_bytes: digests.len(),
        seconds: fast.as_secs_f64(),
        digest_gbps: gbps(digests.len(), fast),
        memcpy_gbps: gbps(digests.len(), memcpy),
        ratio: memcpy.as_secs_f64() / fast.as_secs_f64(),
        scalar_gbps: gbps(digests.len(), scalar),
        select_seconds: selected.as_secs_f64(),
        budget_pages: args.budget_pages,
        runs,
    };
    super::emit(args.json, &result, |r| {
        format!(
            "select: {} pages × d {} {} (group {}), {} kernel: {:.2} GB/s of digests, memcpy {:.2} GB/s, ratio {:.2}; scalar {:.2} GB/s; score+top-{} {:.1} µs",
            r.pages,
            r.head_dim,
            r.dtype,
            r.group,
            r.kernel,
            r.digest_gbps,
            r.memcpy_gbps,
            r.ratio,
            r.scalar_gbps,
            r.budget_pages,
            r.select_seconds * 1e6
        )
    })
}

#[derive(Debug, Serialize)]
struct StepResult {
    lanes: usize,
    pages: usize,
    head_dim: usize,
    dtype: &'static str,
    group: usize,
    kernel: &'static str,
    threads: usize,
    digest_bytes: usize,
    /// Scoring every lane once over all cores, median seconds and GB/s.
    scan_seconds: f64,
    scan_gbps: f64,
    /// Reading the same bytes (a sum of their words) over all cores: the
    /// memory bandwidth the scan is held to.
    read_gbps: f64,
    /// scan_gbps / read_gbps.
    ratio: f64,
    /// The scan on one thread, and the scan with top-k per lane over all cores.
    serial_scan_gbps: f64,
    scan_select_gbps: f64,
    runs: usize,
}

/// A decode step's ranking: `lanes` digest columns scored over all cores,
/// as the store ranks a selection's lanes (`kvtier_core::parallel`).
fn step(args: &SelectBenchArgs) -> anyhow::Result<()> {
    let dtype = DType::from(args.dtype);
    let column = args.pages * 2 * args.head_dim * dtype.size();
    let mut next = values();
    let columns: Vec<Vec<u8>> = (0..args.lanes)
        .map(|_| {
            let mut c = vec![0u8; column];
            for i in 0..column / dtype.size() {
                dtype.put_f32(&mut c, i, next());
            }
            c
        })
        .collect();
    let queries: Vec<f32> = (0..args.group * args.head_dim).map(|_| next()).collect();
    let kernel = Kernel::detect();
    let threads = kvtier_core::parallel::cores();
    let budget = Budget {
        pages: args.budget_pages,
        sinks: 1,
        window: 1,
    };
    let score = |c: &Vec<u8>| {
        let mut out = vec![0f32; args.pages * args.group];
        score_column_with(kernel, dtype, args.head_dim, black_box(c), &queries, &mut out);
        out
    };
    let min_total = Duration::from_millis(500);
    let timed = |threads: usize, top_k: bool| {
        median_time(args.runs, min_total, || {
            black_box(kvtier_core::parallel::map(&columns, threads, |c| {
                let scores = score(c);
                top_k.then(|| {
                    let per_page: Vec<f32> = scores
                        .chunks_exact(args.group)
                        .map(|g| g.iter().copied().fold(f32::MIN, f32::max))
                        .collect();
                    select(&per_page, budget, None)
                })
            }));
        })
    };
    let (scan, runs) = timed(threads, false);
    let (serial, _) = timed(1, false);
    let (scan_select, _) = timed(threads, true);
    let (read, _) = median_time(args.runs, min_total, || {
        black_box(kvtier_core::parallel::map(&columns, threads, |c| {
            let (words, _) = c.as_chunks::<8>();
            words.iter().fold(0u64, |a, w| a.wrapping_add(u64::from_ne_bytes(*w)))
        }));
    });
    let bytes = column * args.lanes;
    let result = StepResult {
        lanes: args.lanes,
        pages: args.pages,
        head_dim: args.head_dim,
        dtype: dtype.name(),
        group: args.group,
        kernel: kernel.name(),
        threads,
        digest_bytes: bytes,
        scan_seconds: scan.as_secs_f64(),
        scan_gbps: gbps(bytes, scan),
        read_gbps: gbps(bytes, read),
        ratio: read.as_secs_f64() / scan.as_secs_f64(),
        serial_scan_gbps: gbps(bytes, serial),
        scan_select_gbps: gbps(bytes, scan_select),
        runs,
    };
    super::emit(args.json, &result, |r| {
        format!(
            "step: {} lanes × {} pages × d {} {} (group {}), {} kernel, {} threads: scan {:.2} GB/s ({:.1} ms), all-core read {:.2} GB/s, ratio {:.2}; one thread {:.2} GB/s; with top-{} {:.2} GB/s",
            r.lanes,
            r.pages,
            r.head_dim,
            r.dtype,
            r.group,
            r.kernel,
            r.threads,
            r.scan_gbps,
            r.scan_seconds * 1e3,
            r.read_gbps,
            r.ratio,
            r.serial_scan_gbps,
            args.budget_pages,
            r.scan_select_gbps
        )
    })
}
