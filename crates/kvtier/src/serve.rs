//! `kvtier serve`.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use kvtier_cuda::{CudaDeviceTier, PinnedHostTier, SwapPath};
use kvtier_server::{BoundServer, ServerConfig, TlsFiles};
use kvtier_store::{
    DeviceCache, DevicePolicy, Durability, EngineChoice, HostPolicy, NvmeConfig, Store, StoreConfig, Tier, TraceConfig,
};

use crate::cluster::{ClusterArgs, Listening, node_config, peer_config};
use crate::config::{
    ByteSize, FileConfig, default_inflight_bytes, default_metadata_bytes, default_nvme_bytes, default_tier_bytes,
};

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// TOML configuration file; flags override its values.
    #[arg(long, value_name = "FILE", env = "KVTIER_CONFIG")]
    config: Option<PathBuf>,
    /// gRPC listen address [default: 127.0.0.1:50051].
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Prometheus metrics listen address, or `off` [default: 127.0.0.1:9464].
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// Directory for durable data [default: ./kvtier-data].
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Device tier capacity, e.g. 1GiB [default: 1/16 of available memory, within the cgroup limit, at most 1GiB].
    #[arg(long, value_name = "SIZE")]
    device_bytes: Option<ByteSize>,
    /// Host tier capacity, e.g. 8GiB [default: 1/4 of available memory, within the cgroup limit, at most 8GiB].
    #[arg(long, value_name = "SIZE")]
    host_bytes: Option<ByteSize>,
    /// Which hot page the device demotes for room: lru, or loop (a resident
    /// subset of the most reused pages plus a stream region that layer-ahead
    /// prefetches fill) [default: lru].
    #[arg(long, value_name = "POLICY")]
    device_policy: Option<DevicePolicy>,
    /// Which host pages migrate to NVMe first: lru, or frequency (pages
    /// more than one request attached, a shared prompt prefix, get a second
    /// chance per extra request, so a burst of one-off prompts does not
    /// push them out) [default: lru].
    #[arg(long, value_name = "POLICY")]
    host_policy: Option<HostPolicy>,
    /// Sketches of NVMe-cold pages leave host memory and are read back
    /// from the pages for two-stage's candidates (less memory, more NVMe
    /// reads per ranking): true or false [default: false].
    #[arg(long, value_name = "BOOL")]
    spill_sketches: Option<bool>,
    /// NVMe tier capacity; 0 disables it [default: 1/4 of the free space, at most 16GiB].
    #[arg(long, value_name = "SIZE")]
    nvme_bytes: Option<ByteSize>,
    /// NVMe tier file or block device [default: DATA_DIR/nvme.data].
    #[arg(long, value_name = "PATH")]
    nvme_path: Option<PathBuf>,
    /// NVMe I/O engine: auto (io_uring if allowed), uring or psync [default: auto].
    #[arg(long, value_name = "ENGINE")]
    nvme_engine: Option<String>,
    /// How swap-ins reach a GPU: kernel (one gather launch per step) or
    /// copy_engine (one async copy per page) [default: kernel].
    #[arg(long, value_name = "PATH")]
    swap_in_path: Option<String>,
    /// What a persisting write waits for: relaxed (written to the OS) or
    /// fsync (on disk) [default: relaxed].
    #[arg(long, value_name = "MODE")]
    durability: Option<String>,
    /// Rewrite the manifest compactly once it passes this size (and has
    /// doubled since the last rewrite) [default: 64MiB].
    #[arg(long, value_name = "SIZE")]
    checkpoint_bytes: Option<ByteSize>,
    /// Largest gRPC message accepted or sent [default: 64MiB].
    #[arg(long, value_name = "SIZE")]
    max_message_bytes: Option<ByteSize>,
    /// Resident metadata of all sequences (lanes, page tables, page index:
    /// digests and key sketches, about a fifth of the KV bytes; statistics);
    /// more is refused with RESOURCE_EXHAUSTED [default: a quarter of the
    /// host and NVMe tiers, at least 1GiB, at most half the available memory].
    #[arg(long, value_name = "SIZE")]
    metadata_bytes: Option<ByteSize>,
    /// Request and response bytes held at once over all calls: a request
    /// past it is refused with RESOURCE_EXHAUSTED, a response waits for room
    /// [default: 1GiB, at most 1/8 of available memory, at least two messages].
    #[arg(long, value_name = "SIZE")]
    max_inflight_bytes: Option<ByteSize>,
    /// Open connections at once; more are closed as they arrive [default: 256].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// TLS certificate chain (PEM); with --tls-key, serves gRPC over TLS.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve on a non-loopback address without auth tokens or without TLS
    /// (refused otherwise).
    #[arg(long)]
    insecure: bool,
    /// Unix socket where clients on this machine register shared-memory
    /// regions for the shm data plane, or `off` [default: DATA_DIR/shm.sock].
    #[arg(long, value_name = "PATH")]
    shm_socket: Option<String>,
    /// How long a region's connection thread polls for the next call at
    /// most before sleeping on it, while calls come within that, unless a
    /// call asks for another after it; 0: never [default: 50].
    #[arg(long, value_name = "MICROSECONDS")]
    shm_poll_us: Option<u64>,
    /// The longest poll for the next call a region's call may ask for
    /// (`LocalCall.poll_next_us`; a longer ask counts as this; polls longer
    /// than --shm-poll-us go to as many connections at once as half the
    /// cores); 0: calls cannot ask
    /// [default: 10000].
    #[arg(long, value_name = "MICROSECONDS")]
    shm_poll_max_us: Option<u64>,
    /// Record page accesses from startup into this file, the input of
    /// `kvtier tune` (recordings can also be started over gRPC).
    #[arg(long, value_name = "FILE")]
    access_trace: Option<PathBuf>,
    /// The share of pages an access recording keeps, sampled by page hash
    /// [default: 1].
    #[arg(long, value_name = "SHARE")]
    access_trace_sample: Option<f64>,
    /// An access recording stops growing at this size [default: 1GiB].
    #[arg(long, value_name = "SIZE")]
    access_trace_max_bytes: Option<ByteSize>,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

/// Logs to stderr at `KVTIER_LOG`'s levels, or `default` when it is unset.
pub(crate) fn init_logging(format: LogFormat, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVTIER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn parse_metrics(value: &str) -> anyhow::Result<Option<SocketAddr>> {
    if value == "off" {
        return Ok(None);
    }
    value
        .parse()
        .map(Some)
        .with_context(|| format!("metrics_listen: {value:?} is neither an address nor \"off\""))
}

pub(crate) fn run(args: ServeArgs) -> anyhow::Result<()> {
    init_logging(args.log_format, "info");
    crate::alloc::tune();
    let mut file = match &args.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    };
    let cluster_file = std::mem::take(&mut file.cluster);
    let defaults = ServerConfig::default();
    // What this machine or container leaves for the server, read once.
    let available = crate::memory::available_memory().unwrap_or(4 << 30);
    let (default_device, default_host) = default_tier_bytes(available);
    // How each tier was sized, for the startup line.
    let sized = |given: Option<ByteSize>, default: &'static str| match given {
        Some(_) => "as configured",
        None => default,
    };
    let device_sized = sized(
        args.device_bytes.or(file.tiers.device_bytes),
        "default: 1/16 of available memory (the cgroup limit counts), at most 1 GiB",
    );
    let host_sized = sized(
        args.host_bytes.or(file.tiers.host_bytes),
        "default: 1/4 of available memory (the cgroup limit counts), at most 8 GiB",
    );
    let nvme_sized = sized(
        args.nvme_bytes.or(file.tiers.nvme_bytes),
        "default: 1/4 of the free disk, at most 16 GiB, sparse",
    );
    let max_message_bytes = args
        .max_message_bytes
        .or(file.max_message_bytes)
        .map_or(defaults.max_message_bytes, |b| b.0 as usize);
    let max_inflight_bytes =
        args.max_inflight_bytes
            .or(file.max_inflight_bytes)
            .map_or_else(|| default_inflight_bytes(max_message_bytes as u64, available), |b| b.0) as usize;
    let mut server = ServerConfig {
        listen: args.listen.or(file.listen).unwrap_or(defaults.listen),
        metrics_listen: match args.metrics_listen.or(file.metrics_listen) {
            Some(value) => parse_metrics(&value)?,
            None => defaults.metrics_listen,
        },
        max_message_bytes,
        max_inflight_bytes,
        max_connections: args
            .max_connections
            .or(file.max_connections)
            .unwrap_or(defaults.max_connections),
        auth: file.auth.auth()?,
        tls: match (args.tls_cert, args.tls_key, &file.tls) {
            (Some(cert), Some(key), _) => Some(TlsFiles { cert, key }),
            (_, _, Some(t)) => Some(TlsFiles {
                cert: t.cert.clone(),
                key: t.key.clone(),
            }),
            _ => None,
        },
        insecure: args.insecure || file.insecure.unwrap_or(false),
        shm_socket: None,
        shm_poll: args
            .shm_poll_us
            .or(file.shm_poll_us)
            .map_or(defaults.shm_poll, std::time::Duration::from_micros),
        shm_poll_max: args
            .shm_poll_max_us
            .or(file.shm_poll_max_us)
            .map_or(defaults.shm_poll_max, std::time::Duration::from_micros),
        access_trace_dir: None,
        access_trace_max_bytes: args
            .access_trace_max_bytes
            .or(file.access_trace.max_bytes)
            .map_or(defaults.access_trace_max_bytes, |b| b.0),
    };
    let defaults_store = StoreConfig::default();
    let store = StoreConfig {
        device_bytes: args
            .device_bytes
            .or(file.tiers.device_bytes)
            .map_or(default_device, |b| b.0),
        host_bytes: args.host_bytes.or(file.tiers.host_bytes).map_or(default_host, |b| b.0),
        cache_writes_on_device: file
            .tiers
            .cache_writes_on_device
            .unwrap_or(defaults_store.cache_writes_on_device),
        nvme: None,
        host_high_watermark: file
            .tiers
            .host_high_watermark
            .unwrap_or(defaults_store.host_high_watermark),
        host_low_watermark: file
            .tiers
            .host_low_watermark
            .unwrap_or(defaults_store.host_low_watermark),
        promote_on_read: file.tiers.promote_on_read.unwrap_or(defaults_store.promote_on_read),
        spill_sketches: args
            .spill_sketches
            .or(file.tiers.spill_sketches)
            .unwrap_or(defaults_store.spill_sketches),
        durability: match args.durability.or(file.durability).as_deref() {
            None | Some("relaxed") => Durability::Relaxed,
            Some("fsync") => Durability::Fsync,
            Some(other) => bail!("durability: {other:?} is not one of relaxed, fsync"),
        },
        manifest_path: None,
        checkpoint_bytes: args
            .checkpoint_bytes
            .or(file.checkpoint_bytes)
            .map_or(defaults_store.checkpoint_bytes, |b| b.0),
        device_cache: match file.tiers.device_cache.as_deref() {
            None | Some("inclusive") => DeviceCache::Inclusive,
            Some("exclusive") => DeviceCache::Exclusive,
            Some(other) => bail!("device_cache: {other:?} is not one of inclusive, exclusive"),
        },
        limits: file.limits.limits(args.metadata_bytes)?,
        device_policy: policy(args.device_policy, file.tiers.device_policy.as_deref(), "device_policy")?,
        host_policy: policy(args.host_policy, file.tiers.host_policy.as_deref(), "host_policy")?,
    };
    let data_dir = args
        .data_dir
        .or(file.data_dir)
        .unwrap_or_else(|| PathBuf::from("kvtier-data"));
    std::fs::create_dir_all(&data_dir).with_context(|| format!("creating data directory {}", data_dir.display()))?;
    server.access_trace_dir = Some(file.access_trace.dir.clone().unwrap_or_else(|| data_dir.join("traces")));
    let access_trace = args
        .access_trace
        .or(file.access_trace.path.clone())
        .map(|path| TraceConfig {
            path,
            sample: args.access_trace_sample.or(file.access_trace.sample).unwrap_or(1.0),
            max_bytes: server.access_trace_max_bytes,
        });
    server.shm_socket = match args.shm_socket.or(file.shm_socket).as_deref() {
        Some("off") => None,
        Some(path) => Some(PathBuf::from(path)),
        None => Some(data_dir.join("shm.sock")),
    };
    let swap_path = match args.swap_in_path.or(file.tiers.swap_in_path.clone()).as_deref() {
        None | Some("kernel") => SwapPath::Kernel,
        Some("copy_engine") => SwapPath::CopyEngine,
        Some(other) => bail!("swap_in_path: {other:?} is not one of kernel, copy_engine"),
    };
    let nvme_bytes = args
        .nvme_bytes
        .or(file.tiers.nvme_bytes)
        .map_or_else(|| default_nvme_bytes(&data_dir), |b| b.0);
    let engine = match args.nvme_engine.or(file.tiers.nvme_engine).as_deref() {
        None | Some("auto") => EngineChoice::Auto,
        Some("uring") => EngineChoice::Uring,
        Some("psync") => EngineChoice::Psync,
        Some(other) => bail!("nvme_engine: {other:?} is not one of auto, uring, psync"),
    };
    let nvme = (nvme_bytes > 0).then(|| NvmeConfig {
        path: args
            .nvme_path
            .or(file.tiers.nvme_path)
            .unwrap_or_else(|| data_dir.join("nvme.data")),
        capacity: nvme_bytes,
        engine,
        queue_depth: file.tiers.nvme_queue_depth.unwrap_or(32),
        direct: true,
    });
    let metadata_given = args.metadata_bytes.is_some() || file.limits.metadata_bytes.is_some();
    let mut store = StoreConfig {
        manifest_path: nvme.as_ref().map(|_| data_dir.join("manifest")),
        nvme,
        ..store
    };
    if !metadata_given {
        store.limits.metadata_bytes = default_metadata_bytes(store.host_bytes, nvme_bytes, available);
    }
    let metadata_sized = sized(
        metadata_given.then_some(ByteSize(0)),
        "default: 1/4 of host + NVMe, at least 1 GiB, at most 1/2 of available memory",
    );
    tracing::info!(
        config = %args.config.as_ref().map_or("none (embedded defaults and flags)".into(), |p| p.display().to_string()),
        data_dir = %data_dir.display(),
        device = %format!("{} ({device_sized})", ByteSize(store.device_bytes)),
        host = %format!("{} ({host_sized})", ByteSize(store.host_bytes)),
        nvme = %match nvme_bytes {
            0 => "off".to_owned(),
            n => format!("{} ({nvme_sized})", ByteSize(n)),
        },
        metadata = %format!("{} ({metadata_sized})", ByteSize(store.limits.metadata_bytes)),
        durability = ?store.durability,
        // The widest the CPU runs (docs/ARCHITECTURE.md, Selection).
        rank_kernel = kvtier_core::score::Kernel::detect().name(),
        "starting kvtier"
    );

    // Nodes share tokens and an authority: the first admin token and the
    // TLS authority reach the others.
    let admin_token = file.auth.tokens.iter().find(|t| t.admin).map(|t| t.token.as_str());
    let tls_ca = file
        .tls
        .as_ref()
        .map(|t| t.ca.clone().unwrap_or_else(|| t.cert.clone()));
    let tls_ca = tls_ca.or_else(|| server.tls.as_ref().map(|t| t.cert.clone()));
    let peers = peer_config(&cluster_file, admin_token, tls_ca.as_deref())?;
    let node = node_config(
        args.cluster,
        cluster_file,
        &Listening {
            listen: server.listen,
            tls: server.tls.is_some(),
        },
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let (device, host) = gpu_tiers(&store, swap_path);
        let store = Store::new_with(store, device, host).context("creating the store")?;
        if let Some(trace) = access_trace {
            let path = trace.path.clone();
            store
                .start_access_trace(trace)
                .with_context(|| format!("access_trace: recording into {}", path.display()))?;
        }
        let mut bound = BoundServer::bind(Arc::clone(&store), server).await?;
        if let Some(mut node) = node {
            node.capacity = kvtier_server::capacity(&store);
            let local = Arc::new(kvtier_server::StoreSequences(Arc::clone(&store)));
            let (node, _) = kvtier_cluster::Node::join(node, local)
                .await
                .context("joining the cluster")?;
            bound = bound.with_cluster(node, peers);
        }
        bound.serve(shutdown_signal()).await?;
        Ok(())
    })
}

type SharedTier = Arc<dyn Tier>;

/// The device and host tiers on a GPU when one is usable; `None`s (emulated
/// device, plain host memory) otherwise, with the reason in the log.
pub(crate) fn gpu_tiers(config: &StoreConfig, path: SwapPath) -> (Option<SharedTier>, Option<SharedTier>) {
    let gpu = match kvtier_cuda::Gpu::open() {
        Ok(gpu) => gpu,
        Err(e) => {
            tracing::info!(reason = %e, "the device tier is emulated in host memory");
            return (None, None);
        }
    };
    let tiers = CudaDeviceTier::new(&gpu, config.device_bytes, path)
        .and_then(|d| Ok((d, PinnedHostTier::new(&gpu, config.host_bytes)?)));
    match tiers {
        Ok((device, host)) => {
            tracing::info!(
                gpu = gpu.name(),
                ?path,
                "device tier on the GPU; host tier in pinned memory"
            );
            (Some(Arc::new(device)), Some(Arc::new(host)))
        }
        Err(e) => {
            tracing::warn!(error = %e, "the GPU could not hold the tiers; the device tier is emulated in host memory");
            (None, None)
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = interrupt => tracing::info!("SIGINT: shutting down"),
        () = terminate => tracing::info!("SIGTERM: shutting down"),
    }
}

/// A cache policy: the flag's, else the config file's `key`, else the default.
fn policy<P: std::str::FromStr<Err = String> + Default>(
    flag: Option<P>,
    file: Option<&str>,
    key: &str,
) -> anyhow::Result<P> {
    match (flag, file) {
        (Some(policy), _) => Ok(policy),
        (None, Some(name)) => name.parse().map_err(|e| anyhow::anyhow!("{key}: {e}")),
        (None, None) => Ok(P::default()),
    }
}
