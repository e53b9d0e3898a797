//! `kvtier bench tier`: random page-slot writes and reads through the NVMe
//! tier's own code path (slots, owned buffers, the chosen engine), with the
//! queue kept full, and read latency percentiles.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Args;
use hdrhistogram::Histogram;
use kvtier_tiers::{AlignedBuf, Completion, EngineChoice, NvmeConfig, NvmeTier, ReadDone, Slot, Tier, WriteDone};
use serde::Serialize;

use crate::config::ByteSize;

#[derive(Debug, Args)]
pub(crate) struct TierBenchArgs {
    /// The tier to measure (only `nvme` has I/O to measure).
    #[arg(long, default_value = "nvme")]
    tier: String,
    /// File or block device.
    #[arg(long)]
    path: PathBuf,
    /// Bytes per page slot (a multiple of 4 KiB).
    #[arg(long, default_value = "64KiB")]
    block_size: ByteSize,
    /// I/Os in flight at once.
    #[arg(long, default_value_t = 32)]
    queue_depth: u32,
    /// Seconds of random reads.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Bytes of the file used (filled with data first).
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// auto, uring or psync.
    #[arg(long, default_value = "auto")]
    engine: String,
    /// Keep the file afterwards (a file this run created is removed).
    #[arg(long)]
    keep: bool,
    /// Print one JSON object instead of a line.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    tier: String,
    engine: &'static str,
    path: String,
    block_size: u64,
    queue_depth: u32,
    size: u64,
    write_mbps: f64,
    read_mbps: f64,
    reads: u64,
    read_p50_us: f64,
    read_p99_us: f64,
    read_p999_us: f64,
    read_max_us: f64,
}

/// A small xorshift generator: reproducible slot order without a dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

pub(crate) fn run(args: TierBenchArgs) -> anyhow::Result<()> {
    ensure!(
        args.tier == "nvme",
        "--tier: only `nvme` can be benchmarked (memory tiers have no I/O path)"
    );
    let block = args.block_size.0;
    ensure!(
        block > 0 && block.is_multiple_of(4096),
        "--block-size must be a positive multiple of 4 KiB"
    );
    ensure!(args.queue_depth > 0, "--queue-depth must be at least 1");
    let engine = match args.engine.as_str() {
        "auto" => EngineChoice::Auto,
        "uring" => EngineChoice::Uring,
        "psync" => EngineChoice::Psync,
        other => bail!("--engine {other:?}: one of auto, uring, psync"),
    };
    let created = !args.path.exists();
    let tier = NvmeTier::open(NvmeConfig {
        path: args.path.clone(),
        capacity: args.size.0,
        engine,
        queue_depth: args.queue_depth,
        direct: true,
    })
    .with_context(|| format!("opening {}", args.path.display()))?;
    let count = (tier.capacity_bytes() / block) as usize;
    ensure!(count >= 2, "--size must hold at least two blocks");
    let qd = args.queue_depth as usize;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);

    // Fill every slot once, in random order, with the queue full.
    let mut by_index: Vec<Option<Slot>> = (0..count)
        .map(|_| tier.allocate(block).map(Some))
        .collect::<Result<_, _>>()?;
    let mut order: Vec<usize> = (0..count).collect();
    for i in (1..count).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut slots: Vec<Option<Arc<Slot>>> = vec![None; count];
    let mut data = AlignedBuf::zeroed(block as usize);
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    let mut spare: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::copy_of(&data)).collect();
    let start = Instant::now();
    let mut in_flight: VecDeque<(usize, Completion<WriteDone>)> = VecDeque::new();
    for &i in &order {
        if in_flight.len() == qd {
            let (idx, c) = in_flight.pop_front().expect("queue is full");
            let (slot, buf) = finish_write(c)?;
            slots[idx] = Some(slot);
            spare.push(buf);
        }
        let slot = by_index[i].take().expect("each slot written once");
        let buf = spare.pop().expect("a buffer per queue slot");
        let done = tier.write_many(vec![(slot, buf)]).pop().expect("one completion");
        in_flight.push_back((i, done));
    }
    for (idx, c) in in_flight.drain(..) {
        slots[idx] = Some(finish_write(c)?.0);
    }
    tier.sync()?;
    let write_secs = start.elapsed().as_secs_f64();
    let slots: Vec<Arc<Slot>> = slots.into_iter().map(|s| s.expect("all written")).collect();

    // Random reads for the given time, `qd` in flight, latency per read.
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut pending: Vec<(Instant, Completion<ReadDone>)> = Vec::with_capacity(qd);
    let mut spare: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::zeroed(block as usize)).collect();
    drop(data);
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let read_start = Instant::now();
    let mut reads = 0u64;
    loop {
        let open = Instant::now() < deadline;
        while open && pending.len() < qd {
            let slot = Arc::clone(&slots[rng.below(count)]);
            let buf = spare.pop().unwrap_or_else(|| AlignedBuf::zeroed(block as usize));
            let c = tier.read_many(vec![(slot, buf)]).pop().expect("one completion");
            pending.push((Instant::now(), c));
        }
        if pending.is_empty() {
            break;
        }
        let mut i = 0;
        while i < pending.len() {
            if let Some(done) = pending[i].1.try_wait() {
                let elapsed = pending[i].0.elapsed();
                let done = done.context("read abandoned")?;
                done.result?;
                hist.record(elapsed.as_micros().max(1) as u64)?;
                reads += 1;
                spare.push(done.buf);
                pending.swap_remove(i);
            } else {
                i += 1;
            }
        }
        std::hint::spin_loop();
    }
    let read_secs = read_start.elapsed().as_secs_f64();
    let engine = tier.backend();
    drop(tier);
    if created && !args.keep {
        std::fs::remove_file(&args.path).with_context(|| format!("removing {}", args.path.display()))?;
    }
    let report = Report {
        tier: args.tier,
        engine,
        path: args.path.display().to_string(),
        block_size: block,
        queue_depth: args.queue_depth,
        size: count as u64 * block,
        write_mbps: (count as u64 * block) as f64 / write_secs / 1e6,
        read_mbps: (reads * block) as f64 / read_secs / 1e6,
        reads,
        read_p50_us: hist.value_at_quantile(0.5) as f64,
        read_p99_us: hist.value_at_quantile(0.99) as f64,
        read_p999_us: hist.value_at_quantile(0.999) as f64,
        read_max_us: hist.max() as f64,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "nvme {} bs {} qd {}: write {:.0} MB/s, read {:.0} MB/s ({} reads), p50 {} µs, p99 {} µs, p99.9 {} µs",
            report.engine,
            block,
            args.queue_depth,
            report.write_mbps,
            report.read_mbps,
            reads,
            report.read_p50_us,
            report.read_p99_us,
            report.read_p999_us
        );
    }
    Ok(())
}

fn finish_write(c: Completion<WriteDone>) -> anyhow::Result<(Arc<Slot>, AlignedBuf)> {
    let done = c.wait().context("write abandoned")?;
    done.result?;
    Ok((Arc::new(done.slot), done.buf))
}
