//! Real threads on tiny tiers, so that migration to NVMe, device demotion,
//! swap-in, prefetch and checkpoints run all the time: concurrent fetches,
//! selections with swap-in, leases and prefetch, appends (persisted and
//! not), explicit moves, policies and drops, most of them on a small hot
//! set of pages. A watchdog fails the test, printing what every thread was
//! doing, when no operation completes for a while; every byte read back
//! must be the byte written at its position, no call may answer
//! `Internal`, and once everything is dropped every tier is empty again.
//!
//! `KVTIER_STRESS_SECS` (default 30) sets how long it runs,
//! `KVTIER_STRESS_THREADS` (default 8) how many threads.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_core::policy::{Allocator, Scorer};
use kvtier_core::select::Budget;
use kvtier_core::{Action, ColdTier, DType, Layout, Reason, SequenceKey};
use kvtier_store::{
    AppendTokens, ApplyPolicy, EngineChoice, FetchPages, HeadRange, NvmeConfig, PageContent, PageList, PageSelection,
    PolicyAction, PolicySpec, PutOutcome, PutPages, SelectPages, SetPageState, StatsSnapshot, Store, StoreConfig,
    StoreError, Trigger,
};

const LAYERS: u32 = 8;
const HEADS: u32 = 2;
const DIM: usize = 16;
const PAGE: u32 = 4;
const PAGE_BYTES: u64 = 2 * PAGE as u64 * DIM as u64 * 2;
/// Sequences every thread reads, selects and moves; each thread appends to
/// its own layer of them.
const HOT: [&str; 2] = ["hot0", "hot1"];
/// The sequences all threads create, write and drop under one another.
/// They share a hash chain over their first two pages, whose rows both
/// write alike (`CHURNED_ROWS`'s): each attaches the other's pages when
/// they are stored, so pages are shared and attached again.
const CHURNED: [&str; 2] = ["churn-a", "churn-b"];
/// Whose rows the churned sequences write.
const CHURNED_ROWS: &str = "churn";
/// No operation completing for this long is a hang.
const STALL: Duration = Duration::from_secs(20);

fn layout() -> Layout {
    common::layout(DType::F16, LAYERS, HEADS, DIM as u32, PAGE)
}

fn key(name: &str) -> SequenceKey {
    SequenceKey::parse("t", name).unwrap()
}

/// One SplitMix64 step: the golden-ratio increment, then the mixer.
fn mix(x: u64) -> u64 {
    kvtier_core::hash::mix64(x.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// One row (K, or V with `value`) of `name`'s `lane` at `pos`: a function of
/// its place alone, so any page read can be checked.
fn row(name: &str, lane: u32, pos: u64, value: bool) -> Vec<u8> {
    let seed = name.bytes().fold(0u64, |a, b| mix(a ^ u64::from(b)));
    let base = mix(seed ^ mix(u64::from(lane) << 40 | pos << 1 | u64::from(value)));
    (0..DIM as u64)
        .flat_map(|i| {
            let h = mix(base ^ i);
            ((h % 0x7800) as u16 | (((h >> 32) & 1) as u16 * 0x8000)).to_le_bytes()
        })
        .collect()
}

/// A write message for every head of `layer`, positions `from..to`.
fn kv(name: &str, layer: u32, from: u64, to: u64) -> Vec<u8> {
    let mut out = Vec::new();
    for h in 0..HEADS {
        for value in [false, true] {
            for pos in from..to {
                out.extend(row(name, layer * HEADS + h, pos, value));
            }
        }
    }
    out
}

/// Checks a page's original bytes against what was written there.
fn check(name: &str, layer: u32, head: u32, page: u32, rows: u32, bytes: &[u8]) -> Result<(), String> {
    let lane = layer * HEADS + head;
    let positions = u64::from(page * PAGE)..u64::from(page * PAGE + rows);
    let k = positions.clone().flat_map(|p| row(name, lane, p, false));
    let expected: Vec<u8> = k.chain(positions.flat_map(|p| row(name, lane, p, true))).collect();
    if bytes == expected {
        Ok(())
    } else {
        Err(format!("{name} layer {layer} head {head} page {page}: wrong bytes"))
    }
}

/// A tiny deterministic generator per thread.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = mix(self.0);
        self.0 % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What the threads share: the store, progress, and what each is doing.
struct Shared {
    store: Arc<Store>,
    done: AtomicU64,
    stop: AtomicBool,
    /// Per thread: what it is doing, since when.
    doing: Vec<Mutex<(String, Instant)>>,
    failures: Mutex<Vec<String>>,
}

impl Shared {
    fn fail(&self, what: String) {
        self.failures.lock().unwrap().push(what);
    }

    /// An answer: `Internal` is a failure, refusals are fine.
    fn answer<T>(&self, op: &str, r: Result<T, StoreError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e @ StoreError::Internal(_)) => {
                self.fail(format!("{op}: {e}"));
                None
            }
            Err(_) => None,
        }
    }
}

fn heads() -> HeadRange {
    HeadRange { start: 0, count: HEADS }
}

/// Writes positions `0..tokens` of every head of `layer`.
fn put_from_start(store: &Store, name: &str, layer: u32, tokens: u64, persist: bool) -> Result<PutOutcome, StoreError> {
    put_rows(store, name, name, layer, 0, tokens, persist)
}

/// Writes `rows_of`'s rows at positions `first_page · PAGE..tokens` of every
/// head of `layer` of sequence `name`.
fn put_rows(
    store: &Store,
    name: &str,
    rows_of: &str,
    layer: u32,
    first_page: u32,
    tokens: u64,
    persist: bool,
) -> Result<PutOutcome, StoreError> {
    let from = u64::from(first_page * PAGE);
    let req = PutPages {
        layer,
        heads: heads(),
        first_page,
        num_tokens: tokens.saturating_sub(from) as u32,
        kv: &kv(rows_of, layer, from, tokens),
        persist,
    };
    store.put_pages(&key(name), req)
}

fn fetch_and_check(shared: &Shared, name: &str, layer: u32) {
    fetch_and_check_rows(shared, name, name, layer);
}

/// Reads every page of `layer` of `name` and checks them against
/// `rows_of`'s rows.
fn fetch_and_check_rows(shared: &Shared, name: &str, rows_of: &str, layer: u32) {
    let req = FetchPages {
        layer,
        heads: heads(),
        pages: PageList::All,
        with_digests: false,
    };
    if let Some(pages) = shared.answer("fetch", shared.store.fetch_pages(&key(name), req)) {
        for p in pages {
            if let PageContent::Original(bytes) = &p.content
                && let Err(e) = check(rows_of, layer, p.kv_head, p.page, p.rows, bytes)
            {
                shared.fail(e);
            }
        }
    }
}

fn select(shared: &Shared, rng: &mut Rng, name: &str, layer: u32) {
    let queries: Vec<f32> = (0..HEADS as usize * DIM)
        .map(|_| rng.below(200) as f32 / 100.0 - 1.0)
        .collect();
    let mut req = SelectPages::new(
        layer,
        heads(),
        &queries,
        Budget {
            pages: 4,
            sinks: 1,
            window: 1,
        },
    );
    req.with_data = true;
    req.swap_in = rng.chance(80);
    req.prefetch_pages = if rng.chance(50) { 2 } else { 0 };
    req.lease = rng.chance(30).then(|| Duration::from_millis(rng.below(50)));
    req.deadline = rng.chance(20).then(|| Duration::from_millis(rng.below(5)));
    let Some(selection) = shared.answer("select", shared.store.select_pages(&key(name), req)) else {
        return;
    };
    for p in &selection.data {
        if let PageContent::Original(bytes) = &p.content
            && let Err(e) = check(name, layer, p.kv_head, p.page, p.rows, bytes)
        {
            shared.fail(format!("select: {e}"));
        }
    }
    if let Some((lease, _)) = selection.lease
        && rng.chance(50)
    {
        shared.store.release_lease(&key(name).tenant, lease);
    }
}

fn append(shared: &Shared, rng: &mut Rng, name: &str, layer: u32, at: &mut u64) {
    let n = 1 + rng.below(5);
    let req = AppendTokens {
        layer,
        heads: heads(),
        num_tokens: n as u32,
        kv: &kv(name, layer, *at, *at + n),
        expected_position: Some(*at),
        persist: rng.chance(20),
    };
    if shared
        .answer("append", shared.store.append_tokens(&key(name), req))
        .is_some()
    {
        *at += n;
    }
}

fn move_pages(shared: &Shared, rng: &mut Rng, name: &str, pages: u64) {
    let action = match rng.below(4) {
        0 => Action::Offload(ColdTier::Host),
        1 => Action::Offload(ColdTier::Nvme),
        2 => Action::Migrate(ColdTier::Nvme),
        _ => Action::SwapIn,
    };
    let first = rng.below(pages.max(1)) as u32;
    let req = SetPageState {
        layer_start: rng.below(u64::from(LAYERS)) as u32,
        layer_count: 1,
        heads: heads(),
        pages: PageSelection::Range { first, count: 1 },
        action,
        summary_rows: 1,
        reason: Reason::Explicit,
    };
    shared.answer("set_page_state", shared.store.set_page_state(&key(name), req));
}

fn policy(shared: &Shared, rng: &mut Rng, name: &str, action: PolicyAction) {
    let spec = PolicySpec {
        layer_start: rng.below(u64::from(LAYERS)) as u32,
        layer_count: 1,
        scorer: Scorer::Streaming { sink_tokens: 4 },
        allocator: Allocator::Uniform,
        budget_tokens: 8 + rng.below(16) as u32,
        action,
    };
    let req = ApplyPolicy {
        spec: &spec,
        queries: &[],
        trigger: Trigger::Now,
    };
    shared.answer("apply_policy", shared.store.apply_policy(&key(name), req));
}

/// Creates, writes, runs a policy on, reads and drops the sequence all
/// threads churn: each step may find it created, half written or dropped by
/// another.
fn churn(shared: &Shared, rng: &mut Rng) {
    let (store, name) = (&shared.store, CHURNED[rng.below(2) as usize]);
    let chain = vec![b"churn-0".to_vec(), b"churn-1".to_vec()];
    let attached = shared
        .answer("create", store.create_sequence(key(name), layout(), chain))
        .map_or(0, |c| c.attached_pages as u32);
    let tokens = 1 + rng.below(24);
    for layer in 0..LAYERS {
        let put = put_rows(store, name, CHURNED_ROWS, layer, attached, tokens, rng.chance(30));
        shared.answer("put", put);
    }
    let action = if rng.chance(50) {
        PolicyAction::Evict
    } else {
        PolicyAction::Summarize { rows: 1 }
    };
    policy(shared, rng, name, action);
    fetch_and_check_rows(shared, name, CHURNED_ROWS, rng.below(u64::from(LAYERS)) as u32);
    shared.answer("drop", store.drop_sequence(&key(name)));
}

fn work(shared: Arc<Shared>, index: usize, hot_tokens: u64) {
    let mut rng = Rng(index as u64 + 1);
    // Each thread appends to its own layer of every hot sequence.
    let layer = index as u32 % LAYERS;
    let mut at: Vec<u64> = HOT.iter().map(|_| hot_tokens).collect();
    let writer = (index as u32) < LAYERS;
    while !shared.stop.load(Ordering::Relaxed) {
        let h = rng.below(HOT.len() as u64) as usize;
        let name = HOT[h];
        let any_layer = rng.below(u64::from(LAYERS)) as u32;
        let choice = rng.below(100);
        let what = match choice {
            0..30 => "fetch",
            30..60 => "select",
            60..75 => "append",
            75..88 => "move",
            88..95 => "offload policy",
            _ => "churn",
        };
        let on = if what == "churn" { "a churned sequence" } else { name };
        *shared.doing[index].lock().unwrap() = (format!("{what} on {on}"), Instant::now());
        match what {
            "fetch" => fetch_and_check(&shared, name, any_layer),
            "select" => select(&shared, &mut rng, name, any_layer),
            "append" if writer => append(&shared, &mut rng, name, layer, &mut at[h]),
            "append" => fetch_and_check(&shared, name, any_layer),
            "move" => move_pages(&shared, &mut rng, name, hot_tokens / u64::from(PAGE)),
            "offload policy" => policy(&shared, &mut rng, name, PolicyAction::Offload(ColdTier::Host)),
            _ => churn(&shared, &mut rng),
        }
        *shared.doing[index].lock().unwrap() = (format!("between operations, after {what}"), Instant::now());
        shared.done.fetch_add(1, Ordering::Relaxed);
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Half the time under the LRU policies, half under the others (the loop
/// policy's resident subset and layer-ahead prefetches, the frequency
/// policy's two queues, move pages their own way).
#[test]
fn concurrent_operations_on_tiny_tiers_neither_hang_nor_fail_nor_corrupt() {
    use kvtier_store::{DevicePolicy, HostPolicy};
    let secs = env("KVTIER_STRESS_SECS", 30);
    let threads = env("KVTIER_STRESS_THREADS", 8) as usize;
    for policies in [
        (DevicePolicy::Lru, HostPolicy::Lru),
        (DevicePolicy::Loop, HostPolicy::Frequency),
    ] {
        stress_under(policies, secs.div_ceil(2), threads);
    }
}

fn stress_under(
    (policy, host_policy): (kvtier_store::DevicePolicy, kvtier_store::HostPolicy),
    secs: u64,
    threads: usize,
) {
    println!("device policy {policy}, host policy {host_policy}");
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(StoreConfig {
        // A handful of pages per tier: every operation moves pages.
        device_bytes: 24 * PAGE_BYTES,
        host_bytes: 64 * PAGE_BYTES,
        host_high_watermark: 0.5,
        host_low_watermark: 0.25,
        nvme: Some(NvmeConfig {
            path: dir.path().join("nvme.data"),
            capacity: 64 << 20,
            engine: match std::env::var("KVTIER_STRESS_ENGINE").as_deref() {
                Ok("psync") => EngineChoice::Psync,
                _ => EngineChoice::Auto,
            },
            queue_depth: 8,
            direct: true,
        }),
        checkpoint_bytes: 1,
        device_policy: policy,
        host_policy,
        ..StoreConfig::default()
    })
    .unwrap();
    let hot_tokens = 4 * u64::from(PAGE) + 2;
    for name in HOT {
        store.create_sequence(key(name), layout(), vec![]).unwrap();
        for layer in 0..LAYERS {
            put_from_start(&store, name, layer, hot_tokens, true).unwrap();
        }
    }
    let shared = Arc::new(Shared {
        store,
        done: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        doing: (0..threads)
            .map(|_| Mutex::new(("starting".into(), Instant::now())))
            .collect(),
        failures: Mutex::default(),
    });
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("stress-{i}"))
                .spawn(move || work(shared, i, hot_tokens))
                .unwrap()
        })
        .collect();
    // The watchdog.
    let started = Instant::now();
    let (mut last, mut last_change) = (0, Instant::now());
    while started.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(100));
        let done = shared.done.load(Ordering::Relaxed);
        if done != last {
            (last, last_change) = (done, Instant::now());
        } else if last_change.elapsed() > STALL {
            let doing: Vec<String> = shared
                .doing
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    let (what, since) = &*d.lock().unwrap();
                    format!("thread {i}: {what}, for {:?}", since.elapsed())
                })
                .collect();
            panic!(
                "no operation completed for {STALL:?} after {done}: a hang. Every thread:\n{}",
                doing.join("\n")
            );
        }
    }
    shared.stop.store(true, Ordering::Relaxed);
    for h in handles {
        if h.join().is_err() {
            shared.fail("a worker thread panicked".into());
        }
    }
    shared.store.wait_idle();
    // Everything that is left, read back.
    for name in HOT {
        for layer in 0..LAYERS {
            fetch_and_check(&shared, name, layer);
        }
    }
    // Nothing leaks: once every sequence is dropped and the leases have
    // expired, every tier is empty.
    let store = &shared.store;
    for name in HOT.into_iter().chain(CHURNED) {
        shared.answer("drop", store.drop_sequence(&key(name)));
    }
    store.checkpoint();
    let deadline = Instant::now() + Duration::from_secs(5);
    let empty = |s: &StatsSnapshot| s.leases == 0 && s.physical_pages == 0 && s.tiers.iter().all(|t| t.used_bytes == 0);
    while !empty(&store.stats()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = store.stats();
    if !empty(&left) {
        shared.fail(format!(
            "left after dropping everything: {} leases, {} physical pages, tiers {:?}",
            left.leases, left.physical_pages, left.tiers
        ));
    }
    let failures = shared.failures.lock().unwrap();
    println!(
        "{} operations in {:.1} s on {threads} threads; {} failures",
        shared.done.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
