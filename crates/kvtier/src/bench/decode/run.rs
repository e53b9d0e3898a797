//! One decode benchmark run: a server (in-process unless an address is
//! given), sequences prefilled over gRPC, then steps — per layer one
//! `SelectPages` with data and swap-in, and one `AppendTokens` — timed per
//! step and classed by the slowest source a step's pages came from.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use kvtier_client::{Client, SelectRequest, pb};
use kvtier_core::rank::Mode;
use kvtier_server::{BoundServer, ServerConfig};
use kvtier_store::{EngineChoice, NvmeConfig, Store, StoreConfig};
use serde::Serialize;

use super::workload::{Queries, SequenceData};
use crate::shape::Shape;
use kvtier_store::{Access, HeadPages, SwapTiming, TraceRecord};

/// Everything one run needs.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RunConfig {
    pub(crate) shape: Shape,
    pub(crate) context: usize,
    pub(crate) budget_pages: u32,
    pub(crate) sink_pages: u32,
    pub(crate) window_pages: u32,
    #[serde(serialize_with = "mode_name")]
    pub(crate) mode: Mode,
    pub(crate) candidates: u32,
    /// 0: rank every step.
    pub(crate) reuse_similarity: f32,
    pub(crate) sequences: usize,
    pub(crate) steps: usize,
    /// Steps per sequence before the measured ones (not timed or counted).
    pub(crate) warmup_steps: usize,
    /// Tier sizes as shares of the working set (the prefilled KV of all
    /// sequences) for the in-process server; NVMe gets the rest (and room).
    pub(crate) device_fraction: f64,
    /// The device as a share of one step's working set instead.
    pub(crate) device_step_fraction: Option<f64>,
    #[serde(serialize_with = "policy_name")]
    pub(crate) device_policy: kvtier_store::DevicePolicy,
    pub(crate) device: DeviceChoice,
    #[serde(serialize_with = "policy_name")]
    pub(crate) host_policy: kvtier_store::HostPolicy,
    /// Sketches of NVMe-only pages leave host memory.
    pub(crate) spill_sketches: bool,
    pub(crate) host_fraction: f64,
    pub(crate) queries: String,
    #[serde(skip)]
    pub(crate) source: Queries,
    pub(crate) drift: f64,
    /// Steps per second per sequence (open loop); `None`: closed loop.
    pub(crate) rate: Option<f64>,
    pub(crate) prefetch_pages: u32,
    pub(crate) deadline_us: u32,
    /// With the in-process server: rewrite the manifest as a checkpoint
    /// when the run reaches this step (what a large manifest does by itself).
    pub(crate) checkpoint_at_step: Option<usize>,
    pub(crate) addr: Option<String>,
    pub(crate) data_plane: DataPlane,
    /// The shm socket of the server at `addr`.
    pub(crate) shm_socket: Option<std::path::PathBuf>,
    /// How long a call over the region polls for its reply at most.
    pub(crate) shm_poll_us: u64,
    /// How long the in-process server's region connections poll for calls.
    pub(crate) server_shm_poll_us: u64,
    /// Keep every selection's page lists (for `--trace`).
    #[serde(skip)]
    pub(crate) record_trace: bool,
}

/// Where the in-process server's device tier lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub(crate) enum DeviceChoice {
    /// On the GPU when one is usable, emulated otherwise (the log says why).
    Auto,
    /// Emulated in host memory even where a GPU is usable.
    Emulated,
}

/// How selected pages' bytes reach the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub(crate) enum DataPlane {
    /// In the gRPC messages.
    Inline,
    /// Written into a shared-memory region the client registered, each
    /// selection and append called over the region's own socket.
    Shm,
    /// Written into a shared-memory region, each selection and append
    /// called over gRPC.
    ShmGrpc,
}

/// The miss class of a step: the slowest tier any selected page came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Class {
    Hot,
    Host,
    Nvme,
}

impl Class {
    pub(crate) const ALL: [Class; 3] = [Class::Hot, Class::Host, Class::Nvme];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Class::Hot => "hot",
            Class::Host => "host",
            Class::Nvme => "nvme",
        }
    }
}

/// One measured step.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Step {
    /// Seconds since the first step started.
    pub(crate) at: f64,
    pub(crate) latency_us: u64,
    pub(crate) class: Class,
    /// Time in SelectPages calls and in AppendTokens calls as the client saw
    /// it, and the server's own account of its SelectPages time: all of it
    /// in the store, and of that ranking, swap-in per source and reading
    /// the pages; each summed over the step's layers.
    pub(crate) select_us: u64,
    pub(crate) append_us: u64,
    pub(crate) store_us: u64,
    pub(crate) rank_us: u64,
    pub(crate) swap_host_us: u64,
    pub(crate) swap_nvme_us: u64,
    pub(crate) read_us: u64,
    pub(crate) bytes: u64,
    /// Pages the step's selections asked to make hot, and of those the ones
    /// that were not on the device (device-tier misses).
    pub(crate) chosen: u64,
    pub(crate) missed: u64,
    /// The server's account of the step's appends, summed over layers.
    pub(crate) append: AppendSpans,
}

/// Where the server spent a step's appends (µs summed over its layers, and
/// the slowest single append).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct AppendSpans {
    pub(crate) store_us: u64,
    pub(crate) max_us: u64,
    pub(crate) lock_wait_us: u64,
    pub(crate) reserve_us: u64,
    pub(crate) migration_wait_us: u64,
    pub(crate) migration_us: u64,
    pub(crate) durability_us: u64,
    pub(crate) policy_us: u64,
}

impl AppendSpans {
    fn add(&mut self, t: &pb::AppendTiming) {
        self.store_us += t.store_us;
        self.max_us = self.max_us.max(t.store_us);
        self.lock_wait_us += t.lock_wait_us;
        self.reserve_us += t.reserve_us;
        self.migration_wait_us += t.migration_wait_us;
        self.migration_us += t.migration_us;
        self.durability_us += t.durability_us;
        self.policy_us += t.policy_us;
    }
}

#[derive(Debug, Default)]
pub(crate) struct Measured {
    pub(crate) steps: Vec<Step>,
    pub(crate) wall: Duration,
    pub(crate) read_fraction: f64,
    pub(crate) before: pb::Stats,
    pub(crate) after: pb::Stats,
    pub(crate) prefill_seconds: f64,
    /// With `record_trace`: every selection and append, in the order they
    /// finished.
    pub(crate) trace: Vec<TraceRecord>,
}

/// A server for the run and how to reach it.
struct Target {
    addr: String,
    /// Where the server takes shm registrations.
    shm_socket: Option<std::path::PathBuf>,
    /// The in-process server's store.
    store: Option<Arc<Store>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn target(cfg: &RunConfig) -> anyhow::Result<Target> {
    if let Some(addr) = &cfg.addr {
        return Ok(Target {
            addr: addr.clone(),
            shm_socket: cfg.shm_socket.clone(),
            store: None,
            stop: None,
            _dir: None,
        });
    }
    let s = &cfg.shape;
    let lanes = (s.layers * s.kv_heads) as u64 * cfg.sequences as u64;
    let pages = (cfg.context + cfg.warmup_steps + cfg.steps).div_ceil(s.page_size as usize) as u64 + 1;
    let working_set = lanes * pages * s.page_bytes() as u64;
    let dir = tempfile::Builder::new()
        .prefix("kvtier-bench-")
        .tempdir_in(".")
        .context("a scratch directory")?;
    let host = ((working_set as f64 * cfg.host_fraction) as u64).max(64 * s.page_bytes() as u64);
    // One step's selections: every lane's budget (the newest page too).
    let step_set = lanes * u64::from(cfg.budget_pages) * s.page_bytes() as u64;
    let device_bytes = match cfg.device_step_fraction {
        Some(f) => (step_set as f64 * f) as u64,
        None => (working_set as f64 * cfg.device_fraction) as u64,
    };
    let config = StoreConfig {
        device_bytes,
        device_policy: cfg.device_policy,
        host_policy: cfg.host_policy,
        spill_sketches: cfg.spill_sketches,
        host_bytes: host,
        cache_writes_on_device: true,
        nvme: (cfg.host_fraction < 1.0).then(|| NvmeConfig {
            path: dir.path().join("nvme.data"),
            capacity: working_set + working_set / 4 + (64 << 20),
            engine: EngineChoice::Auto,
            queue_depth: 32,
            direct: true,
        }),
        // The page index is about a fifth of the KV bytes, the rest of the
        // metadata less: half the working set is room enough.
        limits: kvtier_store::Limits {
            metadata_bytes: (working_set / 2).max(1 << 30),
            ..kvtier_store::Limits::default()
        },
        ..StoreConfig::default()
    };
    let (device, host) = match cfg.device {
        DeviceChoice::Auto => crate::serve::gpu_tiers(&config, kvtier_cuda::SwapPath::Kernel),
        DeviceChoice::Emulated => (None, None),
    };
    let store = Store::new_with(config, device, host)?;
    let server = ServerConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        metrics_listen: None,
        shm_socket: Some(dir.path().join("shm.sock")),
        shm_poll: Duration::from_micros(cfg.server_shm_poll_us),
        ..ServerConfig::default()
    };
    let shm_socket = server.shm_socket.clone();
    let bound = BoundServer::bind(Arc::clone(&store), server).await?;
    let addr = format!("http://{}", bound.grpc_addr());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(bound.serve(async {
        let _ = stopped.await;
    }));
    Ok(Target {
        addr,
        shm_socket,
        store: Some(store),
        stop: Some(stop),
        _dir: Some(dir),
    })
}

/// Prefills `context` tokens of every layer, in messages of about 16 MiB.
async fn prefill(
    client: &mut Client,
    seq: &str,
    data: &SequenceData,
    cfg: &RunConfig,
    done: &Mutex<usize>,
) -> anyhow::Result<()> {
    let s = &cfg.shape;
    let per_token = s.kv_heads as usize * 2 * s.row_bytes();
    let chunk_pages = ((16 << 20) / (per_token * s.page_size as usize)).max(1);
    let chunk = chunk_pages * s.page_size as usize;
    for layer in 0..s.layers {
        let mut writes = Vec::new();
        for start in (0..cfg.context).step_by(chunk) {
            let end = (start + chunk).min(cfg.context);
            let first_page = (start / s.page_size as usize) as u32;
            writes.push(client.page_write(
                seq,
                layer,
                0..s.kv_heads,
                first_page,
                (end - start) as u32,
                data.kv(layer, start..end),
            ));
        }
        client
            .put_page_stream(writes)
            .await
            .with_context(|| format!("prefilling layer {layer}"))?;
        *done.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    }
    Ok(())
}

/// What one sequence's decode measured, and its data to go on with.
struct SequenceRun {
    steps: Vec<Step>,
    read_fraction: f64,
    trace: Vec<TraceRecord>,
    data: SequenceData,
}

/// Runs steps `range` of sequence number `index`.
async fn decode(
    mut client: Client,
    (index, seq): (usize, String),
    mut data: SequenceData,
    (cfg, shm_socket): (Arc<RunConfig>, Option<std::path::PathBuf>),
    (range, start): (std::ops::Range<usize>, Instant),
    progress: Arc<Mutex<usize>>,
) -> anyhow::Result<SequenceRun> {
    let first = range.start;
    let s = &cfg.shape;
    // One window for every selection: they run one after another.
    let mut region = match (cfg.data_plane, &shm_socket) {
        (DataPlane::Inline, _) => None,
        (DataPlane::Shm | DataPlane::ShmGrpc, None) => {
            anyhow::bail!("--data-plane shm needs the server's --shm-socket")
        }
        (DataPlane::Shm | DataPlane::ShmGrpc, Some(socket)) => {
            let bytes = cfg.budget_pages as usize * s.kv_heads as usize * s.page_bytes();
            let mut region = client.register_shm(socket, bytes).await?;
            region.set_spin(Duration::from_micros(cfg.shm_poll_us));
            Some(region)
        }
    };
    let mut steps = Vec::with_capacity(range.len());
    let mut trace = Vec::new();
    let mut read = 0.0;
    for step in range.clone() {
        let position = cfg.context + step;
        let intended = cfg
            .rate
            .map(|r| start + Duration::from_secs_f64((step - first) as f64 / r));
        if let Some(at) = intended {
            tokio::time::sleep_until(at.into()).await;
        }
        let began = Instant::now();
        let mut m = Step {
            at: 0.0,
            latency_us: 0,
            class: Class::Hot,
            select_us: 0,
            append_us: 0,
            store_us: 0,
            rank_us: 0,
            swap_host_us: 0,
            swap_nvme_us: 0,
            read_us: 0,
            bytes: 0,
            chosen: 0,
            missed: 0,
            append: AppendSpans::default(),
        };
        for layer in 0..s.layers {
            let req = SelectRequest {
                sink_pages: cfg.sink_pages,
                window_pages: cfg.window_pages,
                include_data: true,
                swap_in: true,
                deadline: (cfg.deadline_us > 0).then(|| Duration::from_micros(u64::from(cfg.deadline_us))),
                prefetch_pages: cfg.prefetch_pages,
                shm: region.as_ref().map(|r| r.whole()),
                mode: kvtier_server::mode_to_pb(cfg.mode),
                candidates: cfg.candidates,
                reuse_similarity: cfg.reuse_similarity,
                ..SelectRequest::new(layer, 0..s.kv_heads, data.queries(layer, position), cfg.budget_pages)
            };
            let t = Instant::now();
            let sel = match (&mut region, cfg.data_plane) {
                (Some(region), DataPlane::Shm) => client.select_pages_local(region, &seq, &req).await,
                _ => client.select_pages(&seq, &req).await,
            }
            .with_context(|| format!("step {step} layer {layer}"))?;
            let selected = t.elapsed();
            m.select_us += selected.as_micros() as u64;
            m.store_us += sel.timing.store_us;
            m.rank_us += sel.timing.rank_us;
            m.swap_host_us += sel.swap.host_us;
            m.swap_nvme_us += sel.swap.nvme_us;
            m.read_us += sel.timing.read_us;
            let missed = u64::from(sel.swap.from_host + sel.swap.from_nvme + sel.swap.not_hot);
            m.chosen += u64::from(sel.swap.already_hot) + missed;
            m.missed += missed;
            m.class = m.class.max(if sel.swap.from_nvme > 0 {
                Class::Nvme
            } else if sel.swap.from_host > 0 {
                Class::Host
            } else {
                Class::Hot
            });
            let got: u64 = sel.pages.iter().map(|p| p.kv.len() as u64 + p.shm_bytes).sum();
            m.bytes += got;
            let resident = (position.div_ceil(s.page_size as usize) * s.page_bytes() * s.kv_heads as usize) as f64;
            read += got as f64 / resident;
            let t = Instant::now();
            let (kv, at) = (data.kv(layer, position..position + 1), Some(position as u64));
            let appended = match (&mut region, cfg.data_plane) {
                (Some(region), DataPlane::Shm) => {
                    let append = client.append_request(&seq, layer, 0..s.kv_heads, 1, kv, at);
                    client.append_tokens_local(region, append).await
                }
                _ => client.append_tokens(&seq, layer, 0..s.kv_heads, 1, kv, at).await,
            }
            .with_context(|| format!("append at step {step} layer {layer}"))?;
            m.append_us += t.elapsed().as_micros() as u64;
            m.append.add(&appended.timing.unwrap_or_default());
            if cfg.record_trace {
                let access = |heads: Vec<HeadPages>, us: u64| Access {
                    t_us: start.elapsed().as_micros() as u64,
                    seq: index as u64,
                    layer,
                    step: position as u64,
                    heads,
                    hot: false,
                    us,
                    swap: None,
                };
                let chosen = sel
                    .heads
                    .iter()
                    .map(|h| HeadPages {
                        head: h.kv_head,
                        pages: h.pages.iter().map(|p| p.page).collect(),
                        from: String::new(),
                    })
                    .collect();
                trace.push(TraceRecord::Read(Access {
                    hot: true,
                    swap: Some(SwapTiming {
                        from_host: sel.swap.from_host,
                        from_nvme: sel.swap.from_nvme,
                        host_us: sel.swap.host_us,
                        nvme_us: sel.swap.nvme_us,
                    }),
                    ..access(chosen, selected.as_micros() as u64)
                }));
                // The append opens a page on a page boundary.
                let opened = (position % s.page_size as usize == 0).then_some((position / s.page_size as usize) as u32);
                let written = (0..s.kv_heads)
                    .filter_map(|head| {
                        opened.map(|page| HeadPages {
                            head,
                            pages: vec![page],
                            from: String::new(),
                        })
                    })
                    .collect();
                trace.push(TraceRecord::Write(access(written, t.elapsed().as_micros() as u64)));
            }
        }
        data.advance();
        let done = Instant::now();
        m.latency_us = done.duration_since(intended.unwrap_or(began)).as_micros() as u64;
        m.at = began.duration_since(start).as_secs_f64();
        steps.push(m);
        *progress.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    }
    Ok(SequenceRun {
        steps,
        read_fraction: read / (range.len().max(1) * s.layers as usize) as f64,
        trace,
        data,
    })
}

/// Rewrites the store's manifest once `at` steps are done, on a thread of
/// its own (as the store's checkpoint thread would).
fn checkpoint_at(store: Arc<Store>, done: Arc<Mutex<usize>>, at: usize) {
    std::thread::spawn(move || {
        while *done.lock().unwrap_or_else(|p| p.into_inner()) < at {
            std::thread::sleep(Duration::from_millis(1));
        }
        store.checkpoint();
    });
}

/// Prints a progress bar on stderr while a phase runs (`what`: its unit),
/// once it has taken more than a few seconds.
fn progress_bar(done: Arc<Mutex<usize>>, total: usize, what: &'static str) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let start = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let n = *done.lock().unwrap_or_else(|p| p.into_inner());
            if start.elapsed() > Duration::from_secs(3) {
                let filled = 30 * n / total.max(1);
                eprint!(
                    "\r[{}{}] {n}/{total} {what}",
                    "#".repeat(filled),
                    " ".repeat(30 - filled)
                );
            }
            if n >= total {
                if start.elapsed() > Duration::from_secs(3) {
                    eprintln!();
                }
                return;
            }
        }
    })
}

pub(crate) async fn run(cfg: RunConfig) -> anyhow::Result<Measured> {
    let target = target(&cfg).await?;
    let mut client = Client::connect(target.addr.clone()).await?;
    let cfg = Arc::new(cfg);
    let prefill_start = Instant::now();
    let prefilled = Arc::new(Mutex::new(0));
    let prefill_bar = progress_bar(
        Arc::clone(&prefilled),
        cfg.sequences * cfg.shape.layers as usize,
        "layers prefilled",
    );
    let mut sequences = Vec::new();
    for i in 0..cfg.sequences {
        let seq = format!("bench-{}-{i}", std::process::id());
        let data = SequenceData::new(
            &cfg.shape,
            &cfg.source,
            i as u64,
            cfg.context,
            cfg.budget_pages as usize,
        );
        client.create_sequence(&seq, cfg.shape.layout(), vec![]).await?;
        prefill(&mut client, &seq, &data, &cfg, &prefilled).await?;
        sequences.push((seq, data));
    }
    prefill_bar.await?;
    let prefill_seconds = prefill_start.elapsed().as_secs_f64();
    let shm_socket = target.shm_socket.clone();
    let steps_client = client.clone();
    // Steps `range` of every sequence at once; each sequence's data back.
    let run_steps = |sequences: Vec<(String, SequenceData)>, range: std::ops::Range<usize>, progress| {
        let start = Instant::now();
        let tasks: Vec<_> = sequences
            .into_iter()
            .enumerate()
            .map(|(i, (seq, data))| {
                let run = tokio::spawn(decode(
                    steps_client.clone(),
                    (i, seq.clone()),
                    data,
                    (Arc::clone(&cfg), shm_socket.clone()),
                    (range.clone(), start),
                    Arc::clone(&progress),
                ));
                (seq, run)
            })
            .collect();
        (start, tasks)
    };
    if cfg.warmup_steps > 0 {
        let (_, warmup) = run_steps(sequences, 0..cfg.warmup_steps, Arc::new(Mutex::new(0)));
        let mut warmed = Vec::new();
        for (seq, run) in warmup {
            warmed.push((seq, run.await??.data));
        }
        sequences = warmed;
    }
    let before = client.stats().await?;
    let progress = Arc::new(Mutex::new(0));
    let bar = progress_bar(Arc::clone(&progress), cfg.steps * cfg.sequences, "steps");
    let measured = cfg.warmup_steps..cfg.warmup_steps + cfg.steps;
    let (start, tasks) = run_steps(sequences, measured, Arc::clone(&progress));
    if let (Some(at), Some(store)) = (cfg.checkpoint_at_step, &target.store) {
        checkpoint_at(Arc::clone(store), Arc::clone(&progress), at);
    }
    let mut steps = Vec::new();
    let mut trace = Vec::new();
    let mut read = 0.0;
    for (_, run) in tasks {
        let run = run.await??;
        steps.extend(run.steps);
        trace.extend(run.trace);
        read += run.read_fraction;
    }
    let wall = start.elapsed();
    bar.await?; // ends once it has drawn the last step
    let after = client.stats().await?;
    steps.sort_by(|a, b| a.at.total_cmp(&b.at));
    Ok(Measured {
        steps,
        wall,
        read_fraction: read / cfg.sequences as f64,
        before,
        after,
        prefill_seconds,
        trace,
    })
}

/// An HDR histogram of microseconds with explicit bounds.
pub(crate) fn histogram(values: impl Iterator<Item = u64>) -> Histogram<u64> {
    let mut h = Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds");
    for v in values {
        h.saturating_record(v.max(1));
    }
    h
}

fn mode_name<S: serde::Serializer>(mode: &Mode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(mode.name())
}

fn policy_name<S: serde::Serializer, P: std::fmt::Display>(policy: &P, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(policy)
}
