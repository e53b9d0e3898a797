//! Access traces: which pages each call read or wrote, from which tier, at
//! which decode step — the input of `kvtier tune`. `kvtier bench decode
//! --trace` writes the same format from the client's side.
//!
//! The format is JSON lines: a [`TraceHeader`], then [`TraceRecord`]s. A
//! sequence appears as a `sequence` record (its shape and prefix hash
//! chain) before its first access; sequences are named by a salted 53-bit
//! hash of (tenant, sequence id), and chain hashes by one of (tenant,
//! layout, hash), so a trace names no tenant, sequence or prompt, and the
//! ids stay exact in any JSON reader. A page under a chain hash is one
//! page for every sequence that names the hash (attached, not copied):
//! that is how a replay sees sharing.
//!
//! Off by default, a call pays one atomic load. On, pages are sampled by
//! a hash of (sequence, layer, KV head, page), or (chain hash, layer, KV
//! head) for a page under a chain hash — SHARDS-style spatial sampling: a
//! kept page keeps every one of its accesses, by every sequence sharing
//! it, so its reuse distances survive, scaled by the rate — and each
//! call's record goes
//! through a bounded channel to a writer thread. The serving path never
//! waits for the disk: a record that finds the channel full is dropped and
//! counted; the file stops at its size bound with an `end` record.
//!
//! Host memory's background migration needs no marks: its rounds fall due
//! where the calls make them (`host/`), so a replay of the calls runs them
//! there. Format 3 marked where each ended (`round` records); they are
//! read and ignored.

use std::collections::HashSet;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

use kvtier_core::hash::mix64;
use kvtier_core::{ColdTier, Layout, PageState, SequenceKey, wire};
use kvtier_sync::{Mutex, Rank, RwLock};
use serde::{Deserialize, Serialize};

use crate::{StoreError, StoreResult};

/// The format's version, in every header.
pub const TRACE_FORMAT: u32 = 4;

/// Records waiting for the writer thread before the next one is dropped.
const CHANNEL_RECORDS: usize = 4096;

/// A trace's first line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceHeader {
    /// [`TRACE_FORMAT`].
    pub kvtier_trace: u32,
    /// Who recorded it: `server` or `bench decode`.
    pub source: String,
    /// The share of pages whose accesses were kept (1: all of them).
    pub sample: f64,
    /// The bytes the recording sized its tiers against, when it knew them
    /// (`bench decode`: every lane's pages, plus one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_set_bytes: Option<u64>,
    /// The device tier the timings were measured on: `gpu`, or `emulated`
    /// (in host memory; no GPU number).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

/// One line after the header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum TraceRecord {
    /// A sequence's shape, before its first access.
    Sequence {
        /// The sequence's salted hash, as its accesses name it.
        seq: u64,
        /// Layers, KV heads, query heads, head dim.
        shape: [u32; 4],
        /// The element type's name (`f32`, `f16`, `bf16`).
        dtype: String,
        /// Tokens per page.
        page_size: u32,
        /// The salted hashes of its prefix hash chain, one per leading
        /// page: page `p < prefix.len()` is the page stored under
        /// `prefix[p]`, shared by every sequence naming that hash (empty
        /// in traces that predate it, and for sequences without a chain).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        prefix: Vec<u64>,
    },
    /// Pages a call read: a selection that made them hot or read their
    /// bytes, or a fetch.
    Read(Access),
    /// Pages a write placed (new pages; an append that only fills a
    /// partial page lists none).
    Write(Access),
    /// The sequence was dropped: a sequence created again under the same
    /// name is another one (with its own `sequence` record).
    Drop {
        /// Microseconds since the recording began.
        t_us: u64,
        /// The dropped sequence's hash.
        seq: u64,
    },
    /// Format 3's mark of the end of a round of host memory's background
    /// migration: no longer written, and ignored (see the module's doc).
    Round {
        /// Microseconds since the recording began.
        t_us: u64,
        /// The round's time in microseconds.
        us: u64,
    },
    /// Why the recording stopped before it was stopped, and what it
    /// dropped.
    End {
        /// `max_bytes` (the size bound was reached) or `write failed: ` and
        /// the error.
        reason: String,
        /// Records dropped over the whole recording.
        dropped: u64,
    },
}

/// One call's pages in one layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Access {
    /// Microseconds since the recording began.
    pub t_us: u64,
    /// The sequence's salted hash (see the `sequence` record).
    pub seq: u64,
    /// The stored layer: layers that share one KV (a layer group) are
    /// recorded as the group's first layer, so their pages are one page.
    pub layer: u32,
    /// The decode step: the layer's position (tokens before the call's
    /// first row) — a step's layers share it. A write's step is where it
    /// began.
    pub step: u64,
    /// The pages, KV head by KV head.
    pub heads: Vec<HeadPages>,
    /// A read that made its pages hot (a swap-in): the device tier saw it.
    #[serde(default)]
    pub hot: bool,
    /// The call's time in microseconds.
    pub us: u64,
    /// What its swap-in moved and how long that took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap: Option<SwapTiming>,
}

/// A KV head's pages in one access.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadPages {
    /// The KV head.
    pub head: u32,
    /// Page numbers within the head's lane.
    pub pages: Vec<u32>,
    /// Where each page was served from, one letter per page: `D` device,
    /// `H` host memory, `N` NVMe, `S` a summary, `G` gone; empty when the
    /// recorder did not know.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub from: String,
}

/// A swap-in's pages by source tier and the time each copy took (a trace's
/// view of a `SwapReport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SwapTiming {
    /// Pages made hot from host memory.
    pub from_host: u32,
    /// Pages made hot from NVMe.
    pub from_nvme: u32,
    /// Microseconds spent copying the host pages up.
    pub host_us: u64,
    /// Microseconds spent reading and copying the NVMe pages up.
    pub nvme_us: u64,
}

/// The letter of [`HeadPages::from`] for a page in `state`.
pub fn tier_letter(state: PageState) -> char {
    match state {
        PageState::Hot => 'D',
        PageState::Cold(ColdTier::Host) => 'H',
        PageState::Cold(ColdTier::Nvme) => 'N',
        PageState::Summary => 'S',
        PageState::Gone => 'G',
    }
}

/// Where and how much to record.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceConfig {
    /// Created (or truncated), with its directory, when the recording starts.
    pub path: PathBuf,
    /// The share of pages whose accesses are kept, in (0, 1].
    pub sample: f64,
    /// The file stops growing here.
    pub max_bytes: u64,
}

/// Refuses a sample rate outside (0, 1], naming the request's field.
pub fn check_sample(sample: f64) -> StoreResult<()> {
    if sample > 0.0 && sample <= 1.0 {
        Ok(())
    } else {
        Err(StoreError::invalid(
            wire::SAMPLE_RATE.path,
            format!("is {sample}, a share in (0, 1] needed"),
        ))
    }
}

/// A recording, running or finished.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceStatus {
    /// The file, sample rate and size bound it was started with.
    pub config: TraceConfig,
    /// Still running (`false`: stopped, and this is the last recording).
    pub recording: bool,
    /// Records written and their bytes.
    pub records: u64,
    /// Bytes written to the file, the header included.
    pub bytes: u64,
    /// Records dropped: the channel was full, or the size bound was reached.
    pub dropped: u64,
    /// The size bound was reached.
    pub full: bool,
}

#[derive(Debug, Default)]
struct Counts {
    records: AtomicU64,
    bytes: AtomicU64,
    dropped: AtomicU64,
    full: AtomicBool,
}

/// A record on its way to the writer, with its sequence's layout and
/// chain (for its `sequence` record).
struct Event {
    of: (Arc<Layout>, Chain),
    record: TraceRecord,
}

/// A sequence's prefix hash chain, with what scopes it (a page is shared
/// only within one tenant and layout): the salted hash of both, made once
/// per call rather than once per page.
#[derive(Clone)]
struct Chain {
    scope: u64,
    hashes: Arc<[Arc<[u8]>]>,
}

/// The low 53 bits: exact in any JSON reader.
const NAME_BITS: u64 = (1 << 53) - 1;

/// A chain hash's name in a recording salted with `salt`.
fn chain_name(salt: &RandomState, chain: &Chain, page: usize) -> u64 {
    salt.hash_one((chain.scope, &*chain.hashes[page])) & NAME_BITS
}

#[derive(Debug)]
struct Recorder {
    config: TraceConfig,
    salt: RandomState,
    /// Pages whose hash is below this are kept (`None`: every page).
    keep_below: Option<u64>,
    started: Instant,
    tx: SyncSender<Event>,
    counts: Arc<Counts>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("record", &self.record)
            .finish_non_exhaustive()
    }
}

/// The store's recorder: off, or one recording.
#[derive(Debug)]
pub(crate) struct AccessTrace {
    on: AtomicBool,
    current: RwLock<Option<Arc<Recorder>>>,
    /// The last recording, once stopped.
    last: Mutex<Option<TraceStatus>>,
}

impl Default for AccessTrace {
    fn default() -> Self {
        Self {
            on: AtomicBool::new(false),
            current: RwLock::new(Rank::TraceRecorder, None),
            last: Mutex::new(Rank::TraceStatus, None),
        }
    }
}

/// A recording in progress, as one call sees it.
pub(crate) struct Tracer {
    recorder: Arc<Recorder>,
    seq: u64,
    layout: Arc<Layout>,
    chain: Chain,
}

/// A store that goes away finishes its recording: everything queued is
/// written and the file flushed.
impl Drop for AccessTrace {
    fn drop(&mut self) {
        self.stop();
    }
}

impl AccessTrace {
    /// The recording, if one runs, for a call on `key`'s sequence (of
    /// `layout`, under the chain `hashes`).
    pub(crate) fn tracer(&self, key: &SequenceKey, layout: &Arc<Layout>, hashes: &Arc<[Arc<[u8]>]>) -> Option<Tracer> {
        if !self.on.load(Ordering::Relaxed) {
            return None;
        }
        let recorder = self.current.read().clone()?;
        let chain = Chain {
            scope: recorder.salt.hash_one((&key.tenant, &**layout)),
            hashes: Arc::clone(hashes),
        };
        Some(Tracer {
            seq: recorder.salt.hash_one(key) & NAME_BITS,
            recorder,
            layout: Arc::clone(layout),
            chain,
        })
    }

    pub(crate) fn start(&self, config: TraceConfig, source: &str, device: &str) -> StoreResult<TraceStatus> {
        check_sample(config.sample)?;
        let mut current = self.current.write();
        if let Some(r) = current.as_ref() {
            return Err(StoreError::precondition(
                wire::RECORD.path,
                format!("a recording to {} is running; stop it first", r.config.path.display()),
            ));
        }
        let header = TraceHeader {
            kvtier_trace: TRACE_FORMAT,
            source: source.into(),
            sample: config.sample,
            working_set_bytes: None,
            device: Some(device.into()),
        };
        let io = |e: std::io::Error| {
            StoreError::Unavailable(kvtier_tiers::TierError::Io {
                op: "recording page accesses",
                offset: 0,
                errno: e.raw_os_error(),
                message: format!("{}: {e}", config.path.display()),
            })
        };
        if let Some(dir) = config.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let file = std::fs::File::create(&config.path).map_err(io)?;
        let (tx, rx) = sync_channel(CHANNEL_RECORDS);
        let counts = Arc::new(Counts::default());
        let mut out = std::io::BufWriter::new(file);
        let line = serde_json::to_string(&header).map_err(|e| StoreError::Internal(e.to_string()))?;
        writeln!(out, "{line}").map_err(io)?;
        counts.bytes.store(line.len() as u64 + 1, Ordering::Relaxed);
        let salt = RandomState::new();
        let writer = {
            let (counts, max_bytes, salt) = (Arc::clone(&counts), config.max_bytes, salt.clone());
            std::thread::Builder::new()
                .name("kvtier-trace".into())
                .spawn(move || write_records(rx, out, &counts, max_bytes, &salt))
                .map_err(io)?
        };
        let keep_below = (config.sample < 1.0).then(|| (config.sample * 2f64.powi(64)) as u64);
        let recorder = Arc::new(Recorder {
            config,
            salt,
            keep_below,
            started: Instant::now(),
            tx,
            counts,
            writer: Mutex::new(Rank::TraceWriter, Some(writer)),
        });
        let status = recorder.status(true);
        tracing::info!(path = %status.config.path.display(), sample = status.config.sample, max_bytes = status.config.max_bytes, "recording page accesses");
        *current = Some(recorder);
        self.on.store(true, Ordering::Relaxed);
        Ok(status)
    }

    /// Stops the recording, once its writer has written everything queued;
    /// then, or with none running, the last recording's status.
    pub(crate) fn stop(&self) -> Option<TraceStatus> {
        let recorder = {
            let mut current = self.current.write();
            self.on.store(false, Ordering::Relaxed);
            current.take()
        };
        if let Some(recorder) = recorder {
            // Calls holding a tracer keep the sender alive; the writer ends
            // when the last of them is gone.
            let writer = recorder.writer.lock().take();
            let counts = Arc::clone(&recorder.counts);
            let config = recorder.config.clone();
            drop(recorder);
            if let Some(w) = writer
                && w.join().is_err()
            {
                tracing::error!("the access trace's writer panicked");
            }
            let status = status_of(config, &counts, false);
            tracing::info!(path = %status.config.path.display(), records = status.records, bytes = status.bytes, dropped = status.dropped, "stopped recording page accesses");
            *self.last.lock() = Some(status);
        }
        self.status()
    }

    /// The running recording's status, or the last one's.
    pub(crate) fn status(&self) -> Option<TraceStatus> {
        // One lock at a time: the recorder's is a leaf.
        let running = self.current.read().as_ref().map(|r| r.status(true));
        running.or_else(|| self.last.lock().clone())
    }
}

impl Recorder {
    fn status(&self, recording: bool) -> TraceStatus {
        status_of(self.config.clone(), &self.counts, recording)
    }

    fn now_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    /// Hands `event` to the writer; drops it if the writer is behind.
    fn send(&self, event: Event) {
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(event) {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn status_of(config: TraceConfig, counts: &Counts, recording: bool) -> TraceStatus {
    TraceStatus {
        config,
        recording,
        records: counts.records.load(Ordering::Relaxed),
        bytes: counts.bytes.load(Ordering::Relaxed),
        dropped: counts.dropped.load(Ordering::Relaxed),
        full: counts.full.load(Ordering::Relaxed),
    }
}

impl Tracer {
    /// Whether the sample keeps this page's accesses (`layer` stored): a
    /// page under a chain hash is kept or not for every sequence sharing it.
    pub(crate) fn keeps(&self, layer: u32, head: u32, page: u32) -> bool {
        let Some(below) = self.recorder.keep_below else {
            return true;
        };
        let p = page as usize;
        let page_key = match p < self.chain.hashes.len() {
            true => chain_name(&self.recorder.salt, &self.chain, p),
            false => mix64(self.seq ^ u64::from(page)),
        };
        mix64(mix64(page_key ^ u64::from(layer)) ^ u64::from(head)) < below
    }

    /// The layer a record names for `layer`: its layer group's first.
    pub(crate) fn stored_layer(&self, layer: u32) -> u32 {
        self.layout.group_of(layer).map_or(layer, |g| g.first_layer)
    }

    /// An access of `layer` with no pages yet, stamped now.
    pub(crate) fn access(&self, layer: u32, step: u64, us: u64) -> Access {
        Access {
            t_us: self.recorder.now_us(),
            seq: self.seq,
            layer: self.stored_layer(layer),
            step,
            heads: Vec::new(),
            hot: false,
            us,
            swap: None,
        }
    }

    /// Records that the sequence was dropped.
    pub(crate) fn dropped(&self) {
        self.record(TraceRecord::Drop {
            t_us: self.recorder.now_us(),
            seq: self.seq,
        });
    }

    /// Hands `record` to the writer; drops it if the writer is behind.
    pub(crate) fn record(&self, record: TraceRecord) {
        self.recorder.send(Event {
            of: (Arc::clone(&self.layout), self.chain.clone()),
            record,
        });
    }
}

/// The writer thread: each sequence's shape before its first access, then
/// the records, until the senders are gone or the size bound is reached.
fn write_records(
    rx: Receiver<Event>,
    mut out: std::io::BufWriter<std::fs::File>,
    counts: &Counts,
    max_bytes: u64,
    salt: &RandomState,
) {
    let mut seen = HashSet::new();
    let mut failed = None;
    for event in &rx {
        if failed.is_some() || counts.full.load(Ordering::Relaxed) {
            counts.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        // The sequence a record names, and whether it is an access (after
        // which the sequence is described) or its drop.
        let (seq, access) = match &event.record {
            TraceRecord::Read(a) | TraceRecord::Write(a) => (a.seq, true),
            TraceRecord::Drop { seq, .. } => (*seq, false),
            TraceRecord::Sequence { .. } | TraceRecord::Round { .. } | TraceRecord::End { .. } => continue,
        };
        let mut lines = String::new();
        if access && !seen.contains(&seq) {
            let (l, chain) = &event.of;
            let shape = TraceRecord::Sequence {
                seq,
                shape: [l.num_layers(), l.num_kv_heads(), l.num_query_heads(), l.head_dim()],
                dtype: l.dtype().name().into(),
                page_size: l.page_size(),
                prefix: (0..chain.hashes.len()).map(|p| chain_name(salt, chain, p)).collect(),
            };
            lines.push_str(&to_line(&shape));
        }
        lines.push_str(&to_line(&event.record));
        let bytes = counts.bytes.load(Ordering::Relaxed);
        if bytes + lines.len() as u64 > max_bytes {
            counts.full.store(true, Ordering::Relaxed);
            counts.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        if let Err(e) = out.write_all(lines.as_bytes()) {
            tracing::error!(error = %e, "writing the access trace failed; the recording stops");
            failed = Some(e.to_string());
            continue;
        }
        if access {
            seen.insert(seq);
        } else {
            seen.remove(&seq);
        }
        counts.bytes.fetch_add(lines.len() as u64, Ordering::Relaxed);
        counts.records.fetch_add(1, Ordering::Relaxed);
    }
    let dropped = counts.dropped.load(Ordering::Relaxed);
    let reason = match (failed, counts.full.load(Ordering::Relaxed)) {
        (Some(e), _) => Some(format!("write failed: {e}")),
        (None, true) => Some("max_bytes".to_string()),
        (None, false) => None,
    };
    // The end record may pass the bound by its own few bytes.
    let end = reason.map(|reason| TraceRecord::End { reason, dropped });
    let result = end
        .map_or(Ok(()), |end| out.write_all(to_line(&end).as_bytes()))
        .and_then(|()| out.flush());
    if let Err(e) = result {
        tracing::error!(error = %e, "finishing the access trace failed");
    }
}

fn to_line(record: &TraceRecord) -> String {
    // A record is numbers and known strings: it always serialises.
    let mut line = serde_json::to_string(record).unwrap_or_default();
    line.push('\n');
    line
}
