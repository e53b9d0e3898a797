//! `/metrics` after real traffic through a real server with tiny tiers:
//! every histogram and counter the operator needs has data, a call is
//! counted once under its method and code, and every histogram is
//! well-formed (cumulative buckets, `+Inf` equal to the count).

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use kvtier_client::{Client, SelectRequest, actions, pb};
use kvtier_server::{BoundServer, ServerConfig};
use kvtier_store::{EngineChoice, NvmeConfig, Store, StoreConfig};
use kvtier_tiers::faults::{Faults, FaultyTier};
use kvtier_tiers::{ArenaTier, NvmeTier};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PAGE: u32 = 16;
const HEAD_DIM: usize = 64;
/// f16: 16 rows of K and of V, 64 wide.
const PAGE_BYTES: u64 = 2 * PAGE as u64 * HEAD_DIM as u64 * 2;

/// Every sample of the exposition, by its name with labels.
fn parse(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (name, value) = l.rsplit_once(' ').unwrap_or_else(|| panic!("malformed sample: {l}"));
            (
                name.to_owned(),
                value.parse().unwrap_or_else(|_| panic!("malformed value: {l}")),
            )
        })
        .collect()
}

async fn scrape(addr: std::net::SocketAddr) -> String {
    let mut http = tokio::net::TcpStream::connect(addr).await.unwrap();
    http.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    http.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    body.to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_cover_calls_swap_ins_nvme_selections_checkpoints_and_moves() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = NvmeConfig {
        path: dir.path().join("nvme.data"),
        capacity: 256 * 4096,
        engine: EngineChoice::Auto,
        queue_depth: 8,
        direct: true,
    };
    // The real NVMe tier, slowed on command for the selection past its deadline.
    let faults = Faults::none();
    let slowed = FaultyTier::new(NvmeTier::open(nvme.clone()).unwrap(), Arc::clone(&faults));
    let store = Store::with_tiers(
        Arc::new(ArenaTier::emulated_device(8 * PAGE_BYTES).unwrap()),
        Arc::new(ArenaTier::host(8 * PAGE_BYTES).unwrap()),
        Some(Arc::new(slowed)),
        StoreConfig {
            cache_writes_on_device: false,
            nvme: Some(nvme),
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let config = ServerConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        metrics_listen: Some(([127, 0, 0, 1], 0).into()),
        shm_socket: Some(dir.path().join("shm.sock")),
        ..ServerConfig::default()
    };
    let bound = BoundServer::bind(Arc::clone(&store), config).await.unwrap();
    let (grpc, metrics) = (bound.grpc_addr(), bound.metrics_addr().unwrap());
    tokio::spawn(bound.serve(std::future::pending()));
    let mut client = Client::connect(format!("http://{grpc}")).await.unwrap();

    // 32 pages into an 8-page host tier: most migrate to NVMe.
    let layout = kvtier_client::layout(1, 1, 4, HEAD_DIM as u32, pb::DType::DtypeF16, PAGE);
    client.create_sequence("s", layout, vec![]).await.unwrap();
    // Four pages per write: a write's own pages cannot migrate until it is done.
    for first in (0..32).step_by(4) {
        let kv: Vec<u8> = (0..4 * PAGE_BYTES)
            .map(|i| ((i + u64::from(first)) % 61) as u8 & 0x3b)
            .collect();
        client
            .put_pages("s", 0, 0..1, first, 4 * PAGE, kv.into())
            .await
            .unwrap();
    }
    let mut queries = vec![0.0f32; 4 * HEAD_DIM];
    for (i, q) in queries.iter_mut().enumerate() {
        *q = (i as f32 * 0.37).sin();
    }
    // Selections with swap-in: from NVMe the first time, hot the next.
    let mut req = SelectRequest::new(0, 0..1, queries, 3);
    req.swap_in = true;
    req.prefetch_pages = 2;
    client.select_pages("s", &req).await.unwrap();
    let chosen = client.select_pages("s", &req).await.unwrap();
    store.wait_idle();
    // Then from host: one chosen page is sent there first, so the swap-in
    // from host does not hang on which pages background migration left.
    let first = chosen.heads[0].pages[0].page;
    client
        .set_page_state("s", 0..1, 0..1, first..first + 1, actions::offload_to_host())
        .await
        .unwrap();
    let chosen = client.select_pages("s", &req).await.unwrap();
    // A selection answered at its deadline, before NVMe could deliver its
    // pages (sent there first, and each read slowed to 200 ms).
    for p in &chosen.heads[0].pages {
        client
            .set_page_state("s", 0..1, 0..1, p.page..p.page + 1, actions::offload_to_nvme())
            .await
            .unwrap();
    }
    let mut late = req.clone();
    late.deadline = Some(std::time::Duration::from_micros(1));
    late.prefetch_pages = 0;
    faults.read_delay_us.store(200_000, Relaxed);
    client.select_pages("s", &late).await.unwrap();
    store.wait_idle();
    faults.read_delay_us.store(0, Relaxed);
    client
        .set_page_state("s", 0..1, 0..1, 0..32, actions::offload_to_host())
        .await
        .ok();
    // Exactly five GetSequence calls, and a call refused NOT_FOUND.
    for _ in 0..5 {
        client.get_sequence("s").await.unwrap();
    }
    assert!(client.fetch_pages("nope", 0, 0..1, vec![]).await.is_err());
    // Two calls over an shm region's socket: one served, one refused.
    let mut region = client
        .register_shm(&dir.path().join("shm.sock"), 1 << 20)
        .await
        .unwrap();
    let one_page = pb::FetchPagesRequest {
        sequence_id: "s".into(),
        kv_head_count: 1,
        pages: vec![0],
        ..Default::default()
    };
    client.fetch_local(&mut region, one_page.clone()).await.unwrap();
    let missing = pb::FetchPagesRequest {
        sequence_id: "nope".into(),
        ..one_page
    };
    assert!(client.fetch_local(&mut region, missing).await.is_err());
    store.checkpoint();
    // A corrupted NVMe extent: reading it is an integrity failure.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.path().join("nvme.data"))
        .unwrap();
    for block in 0..64u64 {
        let mut byte = [0u8; 1];
        file.read_exact_at(&mut byte, block * 4096 + 100).unwrap();
        file.write_all_at(&[byte[0] ^ 0x40], block * 4096 + 100).unwrap();
    }
    file.sync_all().unwrap();
    client.fetch_pages("s", 0, 0..1, vec![]).await.unwrap();

    let text = scrape(metrics).await;
    let samples = parse(&text);
    let get = |name: &str| {
        samples
            .get(name)
            .copied()
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
    };
    let positive = |name: &str| assert!(get(name) > 0.0, "{name} is {}:\n{text}", get(name));

    assert_eq!(
        get("kvtier_rpc_duration_seconds_count{method=\"GetSequence\",code=\"OK\",transport=\"grpc\"}"),
        5.0
    );
    assert_eq!(
        get("kvtier_rpc_duration_seconds_count{method=\"FetchPages\",code=\"NOT_FOUND\",transport=\"grpc\"}"),
        1.0
    );
    assert_eq!(
        get("kvtier_rpc_duration_seconds_count{method=\"SelectPages\",code=\"OK\",transport=\"grpc\"}"),
        4.0
    );
    positive("kvtier_rpc_duration_seconds_count{method=\"PutPages\",code=\"OK\",transport=\"grpc\"}");
    for code in ["OK", "NOT_FOUND"] {
        let name = format!(
            "kvtier_rpc_duration_seconds_count{{method=\"FetchPages\",code=\"{code}\",transport=\"shm-socket\"}}"
        );
        assert_eq!(get(&name), 1.0, "{name}");
    }
    for name in [
        "kvtier_swap_in_duration_seconds_count{source=\"host\"}",
        "kvtier_swap_in_duration_seconds_count{source=\"nvme\"}",
        "kvtier_nvme_read_duration_seconds_count",
        "kvtier_nvme_write_duration_seconds_count",
        "kvtier_selection_duration_seconds_count{miss_class=\"hot\"}",
        "kvtier_selection_duration_seconds_count{miss_class=\"nvme\"}",
        "kvtier_selection_duration_seconds_count{miss_class=\"deadline\"}",
        "kvtier_checkpoint_duration_seconds_count",
        "kvtier_integrity_failures_total",
        "kvtier_pages_migrated_total",
        "kvtier_swapped_in_pages_total{source=\"nvme\"}",
        "kvtier_prefetch_pages_total{kind=\"asked\",outcome=\"issued\"}",
        "kvtier_device_selected_pages_total{region=\"miss\"}",
        "kvtier_tier_moved_bytes_total{from=\"host\",to=\"nvme\"}",
        "kvtier_tier_moved_bytes_total{from=\"nvme\",to=\"device\"}",
    ] {
        positive(name);
    }
    assert!(
        samples
            .iter()
            .any(|(k, v)| k.starts_with("kvtier_page_transitions_total{")
                && k.contains("reason=\"integrity\"")
                && *v > 0.0),
        "no integrity transition:\n{text}"
    );

    // Every histogram series: cumulative buckets, +Inf == count, sum >= 0.
    let mut series = 0;
    for (name, count) in samples.iter().filter(|(k, _)| k.contains("_seconds_count")) {
        let base = name.replace("_count", "_bucket");
        let labels = base
            .split_once('{')
            .map_or(String::new(), |(_, l)| l.trim_end_matches('}').to_owned());
        let family = base.split('{').next().unwrap();
        let prefix = if labels.is_empty() {
            format!("{family}{{le=")
        } else {
            format!("{family}{{{labels},le=")
        };
        let mut buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter_map(|(k, v)| {
                let le = k.strip_prefix(&prefix)?.trim_start_matches('"').split('"').next()?;
                Some((if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? }, *v))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let buckets: Vec<f64> = buckets.into_iter().map(|(_, v)| v).collect();
        assert_eq!(buckets.len(), kvtier_store::LATENCY_BOUNDS.len() + 1, "{name}");
        assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "{name}: {buckets:?}");
        assert_eq!(*buckets.last().unwrap(), *count, "{name}");
        series += 1;
    }
    assert!(series >= 10, "{series} histogram series");
}
