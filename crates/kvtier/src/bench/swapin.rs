//! `kvtier bench swapin`: a batch of pages copied into device slots the way a
//! swap-in step does it (one batch), against one plain host-to-device copy
//! of the same bytes, in the same run. On a machine without a GPU it
//! measures the emulated device and says so.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kvtier_cuda::{CudaDeviceTier, Gpu, SwapPath};
use kvtier_tiers::{ArenaTier, Slot, Tier};
use serde::Serialize;

use super::median_time;

#[derive(Debug, Args)]
pub(crate) struct SwapinBenchArgs {
    /// Pages per swap-in batch.
    #[arg(long, default_value_t = 1024)]
    pages: usize,
    /// Bytes per page (8192 = 16 tokens × 128 dims × 2 (K, V) × bf16).
    #[arg(long, default_value_t = 8192)]
    page_bytes: usize,
    /// kernel or copy_engine (on a GPU).
    #[arg(long, default_value = "kernel")]
    path: String,
    /// At least this many timed swap-ins (after one warm-up); the median counts.
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    device: String,
    emulated: bool,
    path: String,
    pages: usize,
    page_bytes: usize,
    /// Median seconds per batch.
    seconds: f64,
    swapin_gbps: f64,
    /// One host-to-device copy of the same total bytes, median.
    h2d_gbps: f64,
    ratio: f64,
}

pub(crate) fn run(args: SwapinBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.pages > 0 && args.page_bytes > 0,
        "--pages and --page-bytes must be positive"
    );
    let path = match args.path.as_str() {
        "kernel" => SwapPath::Kernel,
        "copy_engine" => SwapPath::CopyEngine,
        other => anyhow::bail!("--path {other:?}: kernel or copy_engine"),
    };
    let total = args.pages * args.page_bytes;
    let capacity = (2 * total + args.pages * 256 + (1 << 20)) as u64;
    let (device, name): (Arc<dyn Tier>, String) = match Gpu::open() {
        Ok(gpu) => (
            Arc::new(CudaDeviceTier::new(&gpu, capacity, path)?),
            gpu.name().to_owned(),
        ),
        Err(e) => {
            eprintln!("no GPU ({e}): measuring the emulated device");
            (Arc::new(ArenaTier::emulated_device(capacity)?), "emulated".to_owned())
        }
    };
    let pages: Vec<Vec<u8>> = (0..args.pages)
        .map(|i| vec![(i % 251) as u8; args.page_bytes])
        .collect();
    let mut slots: Vec<Slot> = pages
        .iter()
        .map(|p| device.allocate(p.len() as u64))
        .collect::<Result<_, _>>()?;
    let min_total = Duration::from_millis(300);
    let (batch, _) = median_time(args.runs, min_total, || {
        let writes = slots.iter_mut().zip(&pages).map(|(s, p)| (s, p.as_slice())).collect();
        device.write_batch(writes).expect("swap-in batch");
    });
    let mut one = device.allocate(total as u64)?;
    let flat: Vec<u8> = pages.concat();
    let (plain, _) = median_time(args.runs, min_total, || device.write(&mut one, 0, &flat).expect("copy"));
    let gbps = |t: Duration| total as f64 / t.as_secs_f64() / 1e9;
    let report = Report {
        emulated: device.emulated(),
        device: name,
        path: args.path,
        pages: args.pages,
        page_bytes: args.page_bytes,
        seconds: batch.as_secs_f64(),
        swapin_gbps: gbps(batch),
        h2d_gbps: gbps(plain),
        ratio: plain.as_secs_f64() / batch.as_secs_f64(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "swap-in on {}{} ({}): {} pages × {} B: {:.2} GB/s batched vs {:.2} GB/s one copy (ratio {:.2})",
            report.device,
            if report.emulated { " [emulated]" } else { "" },
            report.path,
            report.pages,
            report.page_bytes,
            report.swapin_gbps,
            report.h2d_gbps,
            report.ratio
        );
    }
    Ok(())
}
