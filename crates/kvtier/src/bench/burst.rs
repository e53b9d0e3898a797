//! `kvtier bench burst`: two tenants on one store. Tenant A serves
//! requests that share one prompt prefix (attached through its hash
//! chain, kept by a long-lived sequence); tenant B sends a burst of unique
//! prompts whose KV stays stored. Between two of A's requests the burst
//! writes more than host memory holds. Measured per host policy, in one
//! run: the share of A's prefix pages each request finds in memory (not
//! only on NVMe), before and during the burst, and what A's reads cost.
//! In process (the policy is the store's, not the transport's), over a
//! real NVMe file. `--trace` records the store's accesses (of the first
//! policy's run: which pages are written and read does not depend on the
//! policy) for `kvtier tune`, whose host curves it validates.

use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use kvtier_core::{DType, Layout, LayoutSpec, PageState, SequenceKey};
use kvtier_store::{FetchPages, HeadRange, HostPolicy, PageList, PutPages, Store, StoreConfig, TraceConfig};
use kvtier_tiers::{ArenaTier, EngineChoice, NvmeConfig, NvmeTier, Tier};
use serde::Serialize;

#[derive(Debug, Args)]
pub(crate) struct BurstBenchArgs {
    /// Host policies to compare, in one run.
    #[arg(long = "host-policy", value_name = "POLICY", default_values_t = HostPolicy::ALL)]
    policies: Vec<HostPolicy>,
    /// Host memory, in pages of 4 KiB (16 tokens × 64 dims × 2 (K, V) × f16).
    #[arg(long, default_value_t = 2048)]
    host_pages: u64,
    /// Pages of A's shared prefix per lane (2 layers × 2 KV heads).
    #[arg(long, default_value_t = 64)]
    prefix_pages: u32,
    /// Pages of each of B's prompts per lane.
    #[arg(long, default_value_t = 64)]
    prompt_pages: u32,
    /// B's prompts between two of A's requests during the burst.
    #[arg(long, default_value_t = 12)]
    burst: u32,
    /// A's requests before the burst, and during it.
    #[arg(long, default_value_t = 20)]
    requests: u32,
    /// Host memory's watermarks (shares of it): above the first, the
    /// background migrates pages to NVMe down to the second; 1,1 leaves
    /// all migration to the writes that find memory full.
    #[arg(long, value_delimiter = ',', default_values_t = [0.9, 0.8])]
    host_watermarks: Vec<f64>,
    /// Record the store's page accesses (during the first policy's run)
    /// to this file, as `kvtier serve --access-trace` does.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Print one JSON object per policy.
    #[arg(long)]
    json: bool,
}

const LAYERS: u32 = 2;
const KV_HEADS: u32 = 2;
const PAGE_SIZE: u32 = 16;

/// What one policy did.
#[derive(Debug, Serialize)]
struct Report {
    host_policy: String,
    host_bytes: u64,
    /// Bytes B's burst writes between two of A's requests.
    burst_bytes_per_request: u64,
    /// Share of A's prefix pages its requests found in memory: over all
    /// of them, before the burst and during it.
    a_hit_ratio: f64,
    a_hit_ratio_before: f64,
    a_hit_ratio_during: f64,
    /// A request's read of its prefix, all layers (µs).
    a_read_p50_us_before: u64,
    a_read_p50_us_during: u64,
    a_read_p99_us_during: u64,
    /// Host pages migrated to NVMe over the run.
    pages_migrated: u64,
}

pub(crate) fn run(args: BurstBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.host_pages > 0 && args.prefix_pages > 0 && args.prompt_pages > 0 && args.requests > 0,
        "--host-pages, --prefix-pages, --prompt-pages and --requests must be positive"
    );
    anyhow::ensure!(
        matches!(args.host_watermarks.as_slice(), &[high, low] if 0.0 < low && low <= high && high <= 1.0),
        "--host-watermarks: HIGH,LOW with 0 < LOW <= HIGH <= 1"
    );
    for (i, &policy) in args.policies.iter().enumerate() {
        let trace = args.trace.as_deref().filter(|_| i == 0);
        let report = measure(&args, policy, trace)?;
        super::emit(args.json, &report, |r| {
            format!(
                "host policy {:<9}  A's prefix in memory: before {:.3}, during the burst {:.3}  \
                 A's read p50 {} µs before, {} µs during (p99 {} µs)  pages migrated {}",
                r.host_policy,
                r.a_hit_ratio_before,
                r.a_hit_ratio_during,
                r.a_read_p50_us_before,
                r.a_read_p50_us_during,
                r.a_read_p99_us_during,
                r.pages_migrated
            )
        })?;
    }
    Ok(())
}

fn layout() -> anyhow::Result<Layout> {
    Ok(Layout::new(LayoutSpec {
        num_layers: LAYERS,
        num_kv_heads: KV_HEADS,
        num_query_heads: KV_HEADS,
        head_dim: 64,
        dtype: DType::F16,
        page_size: PAGE_SIZE,
        layer_groups: vec![],
    })?)
}

fn measure(args: &BurstBenchArgs, policy: HostPolicy, trace: Option<&std::path::Path>) -> anyhow::Result<Report> {
    let layout = layout()?;
    let page_bytes = layout.page_bytes() as u64;
    let dir = tempfile::tempdir()?;
    let lanes = u64::from(LAYERS * KV_HEADS);
    let total_prompts = u64::from(args.requests * args.burst);
    let nvme_bytes =
        2 * page_bytes * lanes * (u64::from(args.prefix_pages) + total_prompts * u64::from(args.prompt_pages));
    let nvme: Arc<dyn Tier> = Arc::new(NvmeTier::open(NvmeConfig {
        path: dir.path().join("nvme.data"),
        capacity: nvme_bytes,
        engine: EngineChoice::Auto,
        queue_depth: 32,
        direct: true,
    })?);
    let host_bytes = args.host_pages * page_bytes;
    let store = Store::with_tiers(
        Arc::new(ArenaTier::emulated_device(16 * page_bytes)?),
        Arc::new(ArenaTier::host(host_bytes)?),
        Some(nvme),
        StoreConfig {
            cache_writes_on_device: false,
            manifest_path: Some(dir.path().join("manifest")),
            host_policy: policy,
            host_high_watermark: args.host_watermarks[0],
            host_low_watermark: args.host_watermarks[1],
            ..StoreConfig::default()
        },
    )?;
    if let Some(path) = trace {
        store.start_access_trace(TraceConfig {
            path: path.to_owned(),
            sample: 1.0,
            max_bytes: u64::MAX,
        })?;
    }
    let prefix: Vec<Vec<u8>> = (0..args.prefix_pages)
        .map(|p| format!("a-prefix-{p}").into_bytes())
        .collect();
    // A's system prompt, kept by a long-lived sequence.
    let anchor = SequenceKey::parse("a", "system-prompt")?;
    store.create_sequence(anchor.clone(), layout.clone(), prefix.clone())?;
    put(&store, &anchor, &layout, args.prefix_pages)?;

    let mut before = Vec::new();
    for i in 0..args.requests {
        before.push(a_request(&store, &layout, &prefix, &format!("before-{i}"))?);
    }
    let mut during = Vec::new();
    for i in 0..args.requests {
        for j in 0..args.burst {
            let key = SequenceKey::parse("b", &format!("prompt-{i}-{j}"))?;
            store.create_sequence(key.clone(), layout.clone(), vec![])?;
            put(&store, &key, &layout, args.prompt_pages)?;
        }
        during.push(a_request(&store, &layout, &prefix, &format!("during-{i}"))?);
    }
    if let Some(status) = store.stop_access_trace().filter(|_| trace.is_some()) {
        anyhow::ensure!(status.dropped == 0, "the trace dropped {} records", status.dropped);
    }
    let ratio = |rs: &[(f64, u64)]| rs.iter().map(|r| r.0).sum::<f64>() / rs.len() as f64;
    let quantile = |rs: &[(f64, u64)], q: f64| {
        let mut us: Vec<u64> = rs.iter().map(|r| r.1).collect();
        us.sort_unstable();
        us[((q * us.len() as f64).ceil() as usize).clamp(1, us.len()) - 1]
    };
    Ok(Report {
        host_policy: policy.to_string(),
        host_bytes,
        burst_bytes_per_request: u64::from(args.burst) * u64::from(args.prompt_pages) * lanes * page_bytes,
        a_hit_ratio: (ratio(&before) + ratio(&during)) / 2.0,
        a_hit_ratio_before: ratio(&before),
        a_hit_ratio_during: ratio(&during),
        a_read_p50_us_before: quantile(&before, 0.5),
        a_read_p50_us_during: quantile(&during, 0.5),
        a_read_p99_us_during: quantile(&during, 0.99),
        pages_migrated: store.stats().pages_migrated,
    })
}

/// Writes `pages` full pages into every lane of `key`.
fn put(store: &Store, key: &SequenceKey, layout: &Layout, pages: u32) -> anyhow::Result<()> {
    let tokens = pages * PAGE_SIZE;
    let row = layout.row_bytes();
    // Per head: K rows then V rows of finite f16s (each high byte below
    // 0x3C: an exponent short of infinity), seeded by the name's length
    // and the layer (only A's prefix is shared, and it is written once).
    let seed = key.to_string().len() as u8;
    for layer in 0..LAYERS {
        let kv: Vec<u8> = (0..KV_HEADS as usize * 2 * tokens as usize * row)
            .map(|i| {
                let b = (i as u8).wrapping_mul(31).wrapping_add(seed ^ layer as u8);
                if i % 2 == 1 { b & 0x3B } else { b }
            })
            .collect();
        store.put_pages(
            key,
            PutPages {
                layer,
                heads: HeadRange {
                    start: 0,
                    count: KV_HEADS,
                },
                first_page: 0,
                num_tokens: tokens,
                kv: &kv,
                persist: false,
            },
        )?;
    }
    Ok(())
}

/// One of A's requests: attaches the prefix, reads it (every layer), and
/// ends. Returns the share of its pages found in memory and the read's µs.
fn a_request(store: &Store, layout: &Layout, prefix: &[Vec<u8>], name: &str) -> anyhow::Result<(f64, u64)> {
    let key = SequenceKey::parse("a", name)?;
    let created = store.create_sequence(key.clone(), layout.clone(), prefix.to_vec())?;
    anyhow::ensure!(
        created.attached_pages == prefix.len() as u64,
        "{key}: attached {} of the {} prefix pages",
        created.attached_pages,
        prefix.len()
    );
    let (mut in_memory, mut pages) = (0u64, 0u64);
    let mut micros = 0;
    for layer in 0..LAYERS {
        // A real request's reads come with gaps (the model's compute);
        // back to back in process they would race the background round
        // the writes before them made due, whose pages would then be
        // found in memory or not by chance. `kvtier tune` replays the
        // round as done by the next call.
        store.wait_idle();
        let start = Instant::now();
        let read = store.fetch_pages(
            &key,
            FetchPages {
                layer,
                heads: HeadRange {
                    start: 0,
                    count: KV_HEADS,
                },
                pages: PageList::All,
                with_digests: false,
            },
        )?;
        micros += start.elapsed().as_micros() as u64;
        pages += read.len() as u64;
        in_memory += read
            .iter()
            .filter(|p| matches!(p.state, PageState::Hot | PageState::Cold(kvtier_core::ColdTier::Host)))
            .count() as u64;
    }
    store.drop_sequence(&key)?;
    Ok((in_memory as f64 / pages.max(1) as f64, micros))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The promise the frequency policy makes, at a small scale: B's burst
    /// (6 prompts of 64 pages between two of A's requests, in a host of
    /// 256) pushes A's prefix out under LRU, never under frequency.
    #[test]
    fn a_burst_of_one_off_prompts_keeps_another_tenants_prefix_only_under_frequency() {
        let args = BurstBenchArgs {
            policies: vec![],
            host_pages: 256,
            prefix_pages: 8,
            prompt_pages: 16,
            burst: 6,
            requests: 5,
            host_watermarks: vec![0.9, 0.8],
            trace: None,
            json: false,
        };
        let lru = measure(&args, HostPolicy::Lru, None).unwrap();
        let frequency = measure(&args, HostPolicy::Frequency, None).unwrap();
        for r in [&lru, &frequency] {
            assert_eq!(r.a_hit_ratio_before, 1.0, "{r:?}");
        }
        assert!(lru.a_hit_ratio_during < 0.25, "{lru:?}");
        assert_eq!(frequency.a_hit_ratio_during, 1.0, "{frequency:?}");
    }

    /// `kvtier tune` replays a trace of this bench (recorded under LRU, at
    /// one host size) and predicts A's hit ratio under each host policy
    /// at several others, within 0.02 of what the store then measures at
    /// each: with migration by the writes alone (watermarks 1,1), and
    /// with the background's rounds (0.9,0.8), which fall due where the
    /// calls make them, so the replay runs them there too.
    #[test]
    fn tune_predicts_each_host_policys_hit_ratio_on_the_burst() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            tune: crate::tune::TuneArgs,
        }
        // Per setting and policy, sizes about where it starts to keep A's
        // prefix.
        for (marks, watermarks, lru, frequency) in [
            ("1,1", [1.0, 1.0], [384u64, 392, 408, 416], [40u64, 44, 48, 64]),
            ("0.9,0.8", [0.9, 0.8], [448, 460, 464, 480], [40, 48, 64, 96]),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let trace = dir.path().join("burst.trace");
            let args = |host_pages| BurstBenchArgs {
                policies: vec![],
                host_pages,
                prefix_pages: 8,
                prompt_pages: 16,
                burst: 6,
                requests: 5,
                host_watermarks: watermarks.to_vec(),
                trace: None,
                json: false,
            };
            measure(&args(256), HostPolicy::Lru, Some(&trace)).unwrap();
            let tune = |fractions: &[f64]| {
                let mut argv: Vec<String> = ["tune", "--host-watermarks", marks, "--out"].map(String::from).into();
                argv.push(dir.path().join("tune").display().to_string());
                argv.push(trace.display().to_string());
                if !fractions.is_empty() {
                    let list: Vec<String> = fractions.iter().map(f64::to_string).collect();
                    argv.extend(["--host-fraction".to_owned(), list.join(",")]);
                }
                let cli = <Cli as clap::Parser>::parse_from(argv);
                serde_json::to_value(crate::tune::report(&cli.tune).unwrap()).unwrap()
            };
            let working_set = tune(&[])["working_set_bytes"].as_f64().unwrap();
            let page_bytes = layout().unwrap().page_bytes() as f64;
            for (policy, sizes) in [(HostPolicy::Lru, lru), (HostPolicy::Frequency, frequency)] {
                let fractions: Vec<f64> = sizes.iter().map(|&p| p as f64 * page_bytes / working_set).collect();
                let predicted = tune(&fractions);
                let curve = predicted["policies"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|c| c["tier"] == "host" && c["policy"] == policy.to_string())
                    .unwrap();
                for (&pages, point) in sizes.iter().zip(curve["at"].as_array().unwrap()) {
                    let measured = measure(&args(pages), policy, None).unwrap().a_hit_ratio;
                    let predicted = 1.0 - point["miss_ratio"].as_f64().unwrap();
                    eprintln!("{marks} {policy} {pages}: predicted {predicted:.4}, measured {measured:.4}");
                    assert!(
                        (predicted - measured).abs() <= 0.02,
                        "watermarks {marks}, {policy} at {pages} pages: predicted {predicted:.4}, measured {measured:.4}"
                    );
                }
            }
        }
    }
}
