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
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
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

pub(crate) fn run(args: SelectBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.pages > 0 && args.head_dim > 0 && args.group > 0,
        "pages, head-dim and group must be positive"
    );
    let dtype = DType::from(args.dtype);
    let elements = args.pages * 2 * args.head_dim;
    let mut digests = vec![0u8; elements * dtype.size()];
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 4001) as f32 / 1000.0 - 2.0
    };
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
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        println!(
            "select: {} pages × d {} {} (group {}), {} kernel: {:.2} GB/s of digests, memcpy {:.2} GB/s, ratio {:.2}; scalar {:.2} GB/s; score+top-{} {:.1} µs",
            result.pages,
            result.head_dim,
            result.dtype,
            result.group,
            result.kernel,
            result.digest_gbps,
            result.memcpy_gbps,
            result.ratio,
            result.scalar_gbps,
            result.budget_pages,
            result.select_seconds * 1e6
        );
    }
    Ok(())
}
