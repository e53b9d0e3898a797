//! The real server's resident memory stays within its documented bound,
//!
//!   RSS ≤ device_bytes + host_bytes + 1.5 × metadata_bytes
//!         + 3 × max_inflight_bytes + 96 MiB,
//!
//! under a hostile mix from many connections at once: sequences at the
//! layout maxima and smaller ones until the metadata budget refuses them,
//! attention reports that grow policy statistics, writes of the largest
//! messages allowed, oversized ones, large fetches and selections with data
//! from clients that read slowly, and churn. The 1.5 covers what the
//! allocator adds to the charged metadata; the 3 a response's encoded copy
//! and a request's decoded one (up to 4× its encoding); the 96 MiB the
//! binary, the runtimes' threads and the connections' buffers. (ARCHITECTURE, "Memory", states the same.)
//!
//! `KVTIER_MEMORY_SECONDS` (default 8) sizes the run; `KVTIER_MEMORY_OUT`
//! names a file for the measurement (`bench/memory.sh`).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::Server;
use kvtier_client::{Client, SelectRequest, pb};

const MIB: u64 = 1 << 20;
const DEVICE: u64 = 16 * MIB;
const HOST: u64 = 32 * MIB;
const METADATA: u64 = 32 * MIB;
const IN_FLIGHT: u64 = 32 * MIB;
const MESSAGE: u64 = 4 * MIB;
const BASE: u64 = 96 * MIB;

fn bound() -> u64 {
    DEVICE + HOST + METADATA * 3 / 2 + 3 * IN_FLIGHT + BASE
}

/// The child's resident set, from /proc.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Every call of the mix, as one closure per kind of client.
async fn hostile(mut c: Client, kind: usize, stop: Arc<AtomicBool>, calls: Arc<AtomicU64>) {
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let name = format!("k{kind}-{i}");
        match kind {
            // Sequences at the maxima and mid-sized, until refused; a few dropped.
            0 => {
                let huge = kvtier_client::layout(1024, 1024, 1024, 128, pb::DType::DtypeF16, 16);
                let _ = c.create_sequence(&format!("{name}-huge"), huge, vec![]).await;
                let mid = kvtier_client::layout(64, 64, 64, 128, pb::DType::DtypeF16, 16);
                let _ = c.create_sequence(&name, mid, vec![]).await;
                if i.is_multiple_of(3) {
                    let _ = c.drop_sequence(&format!("k0-{}", i - 2)).await;
                }
            }
            // Writes of the largest messages, into one sequence per round,
            // until a limit says no; then it is dropped.
            1 | 2 => {
                let layout = kvtier_client::layout(1, 8, 8, 128, pb::DType::DtypeF32, 16);
                if c.create_sequence(&name, layout, vec![]).await.is_ok() {
                    // 8 heads × 2 × 128 × 4 bytes = 8 KiB per token: 480 tokens
                    // per message (under 4 MiB with framing).
                    let tokens = 480u32;
                    for w in 0..8u32 {
                        let kv = vec![(w % 7) as u8; (tokens as usize) * 8 * 1024];
                        if c.put_pages(&name, 0, 0..8, w * tokens / 16, tokens, kv.into())
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                    // Everything back at once, in chunks, then dropped.
                    let _ = c.fetch_pages(&name, 0, 0..8, vec![]).await;
                    let select = SelectRequest {
                        include_data: true,
                        ..SelectRequest::new(0, 0..8, vec![0.5; 8 * 128], 64)
                    };
                    let _ = c.select_pages(&name, &select).await;
                    let _ = c.drop_sequence(&name).await;
                }
            }
            // Oversized requests, refused on their header.
            3 => {
                let layout = kvtier_client::layout(1, 8, 8, 128, pb::DType::DtypeF32, 16);
                let _ = c.create_sequence(&name, layout, vec![]).await;
                let kv = vec![1u8; (MESSAGE + 4096) as usize];
                let _ = c.put_pages(&name, 0, 0..8, 0, 528, kv.into()).await;
                let _ = c.drop_sequence(&name).await;
            }
            // Appends with attention reports that grow the statistics.
            _ => {
                let layout = kvtier_client::layout(4, 8, 8, 64, pb::DType::DtypeF16, 16);
                if c.create_sequence(&name, layout, vec![]).await.is_ok() {
                    for step in 1..64usize {
                        let kv = vec![0u8; 8 * 2 * 64 * 2 * 16];
                        if c.append_tokens(&name, 0, 0..8, 16, kv.into(), None).await.is_err() {
                            break;
                        }
                        let weights = vec![0.01f32; 8 * 16 * step];
                        let _ = c.report_attention(&name, 0, 0..8, weights, 0.0).await;
                    }
                    if i.is_multiple_of(2) {
                        let _ = c.drop_sequence(&name).await;
                    }
                }
            }
        }
        calls.fetch_add(1, Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn resident_memory_stays_within_its_bound_under_a_hostile_mix() {
    let seconds: u64 = std::env::var("KVTIER_MEMORY_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let dir = tempfile::tempdir().unwrap();
    let mib = |b: u64| format!("{}MiB", b / MIB);
    let flags = [
        ("--device-bytes", mib(DEVICE)),
        ("--host-bytes", mib(HOST)),
        ("--nvme-bytes", "256MiB".to_owned()),
        ("--metadata-bytes", mib(METADATA)),
        ("--max-inflight-bytes", mib(IN_FLIGHT)),
        ("--max-message-bytes", mib(MESSAGE)),
        ("--max-connections", "48".to_owned()),
    ];
    let args: Vec<&str> = flags.iter().flat_map(|(f, v)| [*f, v.as_str()]).collect();
    let mut server = Server::start(dir.path(), &args);
    let first = server.client().await;
    let idle = rss(server.pid());
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    // 40 connections: 8 of each kind of client (or of the kinds named in
    // KVTIER_MEMORY_KINDS, to see what each costs).
    let kinds: Vec<usize> = std::env::var("KVTIER_MEMORY_KINDS")
        .ok()
        .map(|k| k.split(',').filter_map(|k| k.parse().ok()).collect::<Vec<usize>>())
        .filter(|k| !k.is_empty())
        .unwrap_or_else(|| (0..5).collect());
    for n in 0..40 {
        let kind = kinds[n % kinds.len()];
        let c = Client::connect(server.addr.clone())
            .await
            .unwrap()
            .with_tenant(format!("t{kind}"));
        clients.push(tokio::spawn(hostile(c, kind, Arc::clone(&stop), Arc::clone(&calls))));
    }
    let (started, mut peak) = (Instant::now(), idle);
    while started.elapsed() < Duration::from_secs(seconds) {
        peak = peak.max(rss(server.pid()));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    peak = peak.max(rss(server.pid()));
    let stats = first.clone().stats().await.unwrap();
    let report = format!(
        "{} calls in {seconds} s from 40 connections; RSS idle {:.0} MiB, peak {:.0} MiB; bound {:.0} MiB \
         (device {} + host {} + 1.5 × metadata {} + 3 × in flight {} + {} MiB); metadata at the end {:.1} MiB",
        calls.load(Ordering::Relaxed),
        idle as f64 / MIB as f64,
        peak as f64 / MIB as f64,
        bound() as f64 / MIB as f64,
        DEVICE / MIB,
        HOST / MIB,
        METADATA / MIB,
        IN_FLIGHT / MIB,
        BASE / MIB,
        stats.metadata_bytes as f64 / MIB as f64,
    );
    println!("{report}");
    if let Ok(path) = std::env::var("KVTIER_MEMORY_OUT") {
        std::fs::write(&path, format!("{report}\n")).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
    assert!(calls.load(Ordering::Relaxed) > 40, "the mix barely ran: {report}");
    assert!(peak <= bound(), "{report}\n{}", server.stderr());
    server.terminate();
}
