//! `kvtier bench cluster`: what routing through a cluster costs a fetch,
//! how fast a drain moves a node's sequences to the others (while a reader
//! keeps fetching them), and how long a lost node takes to be noticed.
//! Starts its own etcd (Debian's `etcd-server` on the PATH) and three nodes
//! of this binary on loopback, and stops them at the end.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use hdrhistogram::Histogram;
use kvtier_client::{Client, ClientError, Cluster, Connect, EtcdConfig, layout, pb};
use serde::Serialize;

#[derive(Debug, Args)]
pub(crate) struct ClusterBenchArgs {
    /// Fetches per path (direct and routed, interleaved).
    #[arg(long, default_value_t = 2000)]
    fetches: usize,
    /// The nodes' membership lease: a lost node is noticed within about it.
    #[arg(long, default_value_t = 2)]
    ttl_secs: u64,
    /// Sequences written before the drain (SmolLM2-135M's layout, 256
    /// tokens each, persisted: about 5.9 MB each).
    #[arg(long, default_value_t = 24)]
    drain_sequences: usize,
    /// Sequences the drained node moves at once.
    #[arg(long, default_value_t = 2)]
    drain_parallel: u32,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    nodes: usize,
    fetches: usize,
    fetch_bytes: usize,
    direct_p50_us: f64,
    direct_p99_us: f64,
    routed_p50_us: f64,
    routed_p99_us: f64,
    /// Routed over direct, p50: what the routing client adds.
    routed_over_direct_p50: f64,
    /// The drained node's sequences and their page bytes.
    drain_sequences: u32,
    drain_bytes: u64,
    drain_parallel: u32,
    /// From the DrainNode call to its totals.
    drain_ms: u64,
    /// Page bytes moved per second, MB (10^6).
    drain_mb_per_s: f64,
    /// One sequence's move, p50 and max (from its start to the commit).
    move_p50_ms: f64,
    move_max_ms: f64,
    /// Routed fetches of the moving sequences during the drain: p50, p99
    /// and how many (all must succeed).
    during_drain_fetches: u64,
    during_drain_p50_us: f64,
    during_drain_p99_us: f64,
    ttl_secs: u64,
    /// From the kill to the first read refused as the node being out.
    notice_lost_ms: u64,
    /// From the kill to the client's view without the node.
    view_without_node_ms: u64,
    /// From the kill to a create placed on a remaining node.
    create_rerouted_ms: u64,
}

/// Children killed on drop, whatever happens to the run.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn spawn_etcd(dir: &Path) -> anyhow::Result<(Child, String)> {
    let (client, peer) = (free_port()?, free_port()?);
    let url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let child = Command::new("etcd")
        .args(["--data-dir", &dir.join("etcd").display().to_string()])
        .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
        .args([
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
        ])
        .args(["--initial-cluster", &format!("default={peer_url}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting etcd (Debian's etcd-server)")?;
    Ok((child, url))
}

fn spawn_node(dir: &Path, id: &str, etcd: &str, ttl: u64) -> anyhow::Result<Child> {
    let data = dir.join(id);
    std::fs::create_dir_all(&data)?;
    let port = free_port()?;
    Command::new(std::env::current_exe()?)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--metrics-listen",
            "off",
        ])
        .args(["--data-dir", &data.display().to_string(), "--shm-socket", "off"])
        .args([
            "--device-bytes",
            "64MiB",
            "--host-bytes",
            "256MiB",
            "--nvme-bytes",
            "1GiB",
        ])
        .args(["--etcd", etcd, "--node-id", id, "--lease-ttl-secs", &ttl.to_string()])
        .env("KVTIER_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(data.with_extension("log"))?)
        .spawn()
        .context("starting a node")
}

pub(crate) fn run(args: ClusterBenchArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = runtime.block_on(measure(&args))?;
    super::emit(args.json, &report, |r| {
        format!(
            "{} nodes, {} fetches of {} B per path: direct p50 {:.0} µs p99 {:.0} µs; routed p50 {:.0} µs p99 {:.0} µs \
             ({:.3}x); drain of {} sequences ({:.1} MB, {} at once): {} ms, {:.1} MB/s, a move p50 {:.1} ms max \
             {:.1} ms, {} fetches during it p50 {:.0} µs p99 {:.0} µs; ttl {} s: lost node noticed after {} ms, gone \
             from the view after {} ms, creates rerouted after {} ms",
            r.nodes,
            r.fetches,
            r.fetch_bytes,
            r.direct_p50_us,
            r.direct_p99_us,
            r.routed_p50_us,
            r.routed_p99_us,
            r.routed_over_direct_p50,
            r.drain_sequences,
            r.drain_bytes as f64 / 1e6,
            r.drain_parallel,
            r.drain_ms,
            r.drain_mb_per_s,
            r.move_p50_ms,
            r.move_max_ms,
            r.during_drain_fetches,
            r.during_drain_p50_us,
            r.during_drain_p99_us,
            r.ttl_secs,
            r.notice_lost_ms,
            r.view_without_node_ms,
            r.create_rerouted_ms
        )
    })
}

const NODES: usize = 3;
const SEQ: &str = "bench";

async fn measure(args: &ClusterBenchArgs) -> anyhow::Result<Report> {
    let dir = tempfile::tempdir()?;
    let (etcd, url) = spawn_etcd(dir.path())?;
    let mut children = Children(vec![etcd]);
    let config = EtcdConfig::new(vec![url.clone()]);
    // Nodes need etcd to join: it answers first.
    let cluster = connect(&config).await?;
    for i in 0..NODES {
        children
            .0
            .push(spawn_node(dir.path(), &format!("n{i}"), &url, args.ttl_secs)?);
    }
    cluster.wait_for_serving(NODES, Duration::from_secs(60)).await?;

    // SmolLM2-135M's layout; one layer's 16 pages per fetch (~0.2 MB).
    let model = layout(30, 3, 9, 64, pb::DType::DtypeBf16, 16);
    let (placed, _) = cluster.create_sequence(SEQ, model, vec![]).await?;
    let tokens = 256u32;
    let kv = vec![0x3fu8; 3 * 2 * tokens as usize * 64 * 2];
    cluster
        .call(SEQ, |mut c| {
            let kv = kv.clone();
            async move { c.put_pages(SEQ, 0, 0..3, 0, tokens, kv.into()).await }
        })
        .await?;
    let mut direct = Client::connect(placed.addr.clone()).await?;
    let hist = || Histogram::<u64>::new_with_bounds(1, 60_000_000, 3);
    let (mut direct_us, mut routed_us) = (hist()?, hist()?);
    let mut fetch_bytes = 0;
    for i in 0..args.fetches + args.fetches / 10 {
        // The first tenth warms both paths up; the order alternates.
        let warm = i < args.fetches / 10;
        for routed in [i % 2 == 0, i % 2 == 1] {
            let t = Instant::now();
            let pages = if routed {
                cluster
                    .call(SEQ, |mut c| async move { c.fetch_pages(SEQ, 0, 0..3, vec![]).await })
                    .await?
            } else {
                direct.fetch_pages(SEQ, 0, 0..3, vec![]).await?
            };
            let us = t.elapsed().as_micros() as u64;
            fetch_bytes = pages.iter().map(|p| p.kv.len()).sum();
            if !warm {
                if routed { &mut routed_us } else { &mut direct_us }.saturating_record(us);
            }
        }
    }

    let drained = drain(&cluster, &placed.node_id, args).await?;

    // Kill -9 the owner; time what the client sees.
    let victim = placed.node_id.clone();
    let index: usize = victim[1..].parse()?;
    let killed = Instant::now();
    children.0[1 + index].kill()?;
    let (mut notice, mut view_gone, mut rerouted) = (None, None, None);
    let mut probe = 0u32;
    while notice.is_none() || view_gone.is_none() || rerouted.is_none() {
        if killed.elapsed() > Duration::from_secs(args.ttl_secs * 10 + 30) {
            bail!("the lost node was not noticed within {:?}", killed.elapsed());
        }
        if notice.is_none() {
            match cluster
                .call(SEQ, |mut c| async move { c.get_sequence(SEQ).await })
                .await
            {
                Err(ClientError::Status(s))
                    if s.code() == tonic::Code::Unavailable && s.message().contains("out of the cluster") =>
                {
                    notice = Some(killed.elapsed());
                }
                _ => {}
            }
        }
        if view_gone.is_none() && cluster.view().member(&victim).is_none() {
            view_gone = Some(killed.elapsed());
        }
        if rerouted.is_none() {
            probe += 1;
            let id = format!("probe-{probe}");
            let created = cluster.create_sequence(&id, layout(1, 1, 1, 4, pb::DType::DtypeF32, 16), vec![]);
            if let Ok(Ok((p, _))) = tokio::time::timeout(Duration::from_millis(500), created).await
                && p.node_id != victim
                && cluster.view().member(&victim).is_none()
            {
                rerouted = Some(killed.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ms = |d: Option<Duration>| d.map_or(0, |d| d.as_millis() as u64);
    let p = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64;
    Ok(Report {
        nodes: NODES,
        fetches: args.fetches,
        fetch_bytes,
        direct_p50_us: p(&direct_us, 0.5),
        direct_p99_us: p(&direct_us, 0.99),
        routed_p50_us: p(&routed_us, 0.5),
        routed_p99_us: p(&routed_us, 0.99),
        routed_over_direct_p50: p(&routed_us, 0.5) / p(&direct_us, 0.5),
        drain_sequences: drained.sequences,
        drain_bytes: drained.bytes,
        drain_parallel: args.drain_parallel,
        drain_ms: drained.ms,
        drain_mb_per_s: drained.bytes as f64 / 1e6 / (drained.ms as f64 / 1000.0).max(1e-3),
        move_p50_ms: drained.moves.value_at_quantile(0.5) as f64 / 1000.0,
        move_max_ms: drained.moves.max() as f64 / 1000.0,
        during_drain_fetches: drained.fetches.len(),
        during_drain_p50_us: p(&drained.fetches, 0.5),
        during_drain_p99_us: p(&drained.fetches, 0.99),
        ttl_secs: args.ttl_secs,
        notice_lost_ms: ms(notice),
        view_without_node_ms: ms(view_gone),
        create_rerouted_ms: ms(rerouted),
    })
}

/// What a drain measured.
struct Drained {
    sequences: u32,
    bytes: u64,
    ms: u64,
    /// Each sequence's move, µs.
    moves: Histogram<u64>,
    /// Routed fetches of the moving sequences during the drain, µs.
    fetches: Histogram<u64>,
}

/// Writes the drain's sequences, then drains a node other than `keep`'s
/// (which holds the sequence the kill measurement needs) while a reader
/// fetches the drained node's sequences through the cluster client.
async fn drain(cluster: &Cluster, keep: &str, args: &ClusterBenchArgs) -> anyhow::Result<Drained> {
    let model = layout(30, 3, 9, 64, pb::DType::DtypeBf16, 16);
    let tokens = 256u32;
    let kv = bytes::Bytes::from(vec![0x3fu8; 3 * 2 * tokens as usize * 64 * 2]);
    let mut placed = Vec::new();
    for i in 0..args.drain_sequences {
        let id = format!("drain-{i}");
        let (node, _) = cluster.create_sequence(&id, model.clone(), vec![]).await?;
        for layer in 0..30 {
            let (kv, id) = (kv.clone(), id.as_str());
            cluster
                .call(id, |c| {
                    let kv = kv.clone();
                    async move { c.with_persist(true).put_pages(id, layer, 0..3, 0, tokens, kv).await }
                })
                .await?;
        }
        placed.push((id, node));
    }
    let view = cluster.view();
    let target = view
        .members()
        .map(|n| n.node_id.clone())
        .find(|n| n != keep)
        .context("a node to drain")?;
    let addr = view.member(&target).context("the drained node's address")?.addr.clone();
    let moving: Vec<String> = placed
        .iter()
        .filter(|(_, n)| n.node_id == target)
        .map(|(id, _)| id.clone())
        .collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (cluster, stop, moving) = (cluster.clone(), std::sync::Arc::clone(&stop), moving.clone());
        tokio::spawn(async move {
            let mut fetches = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for id in &moving {
                    let t = Instant::now();
                    let id = id.as_str();
                    cluster
                        .call(id, |mut c| async move { c.fetch_pages(id, 0, 0..3, vec![]).await })
                        .await
                        .with_context(|| format!("fetching {id} during the drain"))?;
                    fetches.saturating_record(t.elapsed().as_micros() as u64);
                }
            }
            anyhow::Ok(fetches)
        })
    };
    let started = Instant::now();
    let mut progress = Client::connect(addr)
        .await?
        .drain_node(&target, args.drain_parallel, false)
        .await?;
    let mut moves = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    let done = loop {
        let message = progress
            .message()
            .await?
            .context("the drain ended without its totals")?;
        match message.event {
            Some(pb::drain_progress::Event::Sequence(s)) if !s.error.is_empty() => {
                bail!("{} did not move: {}", s.sequence_id, s.error)
            }
            Some(pb::drain_progress::Event::Sequence(s)) => moves.saturating_record(s.micros),
            Some(pb::drain_progress::Event::Done(done)) => break done,
            None => {}
        }
    };
    let ms = started.elapsed().as_millis() as u64;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let fetches = reader.await??;
    if !done.left {
        bail!(
            "the drained node did not leave ({} sequences did not move)",
            done.failed
        );
    }
    cluster.wait_for_serving(NODES - 1, Duration::from_secs(30)).await?;
    Ok(Drained {
        sequences: done.moved,
        bytes: done.bytes,
        ms,
        moves,
        fetches,
    })
}

async fn connect(config: &EtcdConfig) -> anyhow::Result<Cluster> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match Cluster::connect(config, Connect::default()).await {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() > deadline => return Err(e).context("reaching the bench's etcd"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
