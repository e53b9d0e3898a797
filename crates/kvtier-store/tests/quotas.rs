//! Property test of the metadata budget and tenants' quotas: random runs of
//! creates (some with prefix chains, so that pages are shared), puts,
//! appends, swap-ins, offloads, evictions, attention reports and drops by a
//! limited tenant and an unlimited one, over real host memory
//! and (half the runs) a real NVMe file. After every step: no tenant holds
//! more than its quotas in any tier, in metadata or in sequences, and the
//! server no more metadata than its budget; a refusal changed nothing; every
//! row still held reads back bit-exact. Once everything is dropped, every
//! count is back to zero.

mod common;

use std::collections::HashMap;

use kvtier_core::{Action, ColdTier, DType, Layout, Reason, SequenceKey, TenantId};
use kvtier_store::{
    AppendTokens, AttentionWeights, EngineChoice, FetchPages, HeadRange, Limits, NvmeConfig, PageContent, PageList,
    PageSelection, PutPages, Quota, ReportAttention, SetPageState, Store, StoreConfig, StoreError, Usage,
};
use proptest::prelude::*;

const LAYERS: u32 = 2;
const HEADS: u32 = 2;
const DIM: usize = 4;
const PAGE: usize = 4;
/// K + V rows of f32 for one page of one head, a multiple of every granule.
const PAGE_BYTES: u64 = (2 * PAGE * DIM * 4) as u64;
const SEQS: usize = 3;
const TENANTS: [&str; 2] = ["limited", "free"];

fn layout() -> Layout {
    common::layout(DType::F32, LAYERS, HEADS, DIM as u32, PAGE as u32)
}

fn tenant(t: usize) -> TenantId {
    TenantId::parse("tenant", TENANTS[t]).unwrap()
}

fn key(t: usize, seq: usize) -> SequenceKey {
    SequenceKey::parse(TENANTS[t], &format!("s{seq}")).unwrap()
}

/// The limited tenant's quota: small enough that each kind binds in some
/// runs, in pages of one head.
fn quota() -> impl Strategy<Value = Quota> {
    (1u64..4, 2u64..16, 1u64..5, 2u64..10, 2u64..20).prop_map(|(sequences, metadata_kib, device, host, nvme)| Quota {
        sequences: Some(sequences),
        metadata_bytes: Some(metadata_kib << 10),
        device_bytes: Some(device * PAGE_BYTES),
        host_bytes: Some(host * PAGE_BYTES),
        nvme_bytes: Some(nvme * PAGE_BYTES),
    })
}

#[derive(Debug, Clone)]
enum Op {
    /// With `chain`, the first two pages have prefix hashes: full pages put
    /// there are shared between the tenant's chained sequences.
    Create {
        t: usize,
        seq: usize,
        chain: bool,
    },
    /// One full page per head where the lanes end.
    Put {
        t: usize,
        seq: usize,
        layer: u32,
    },
    Append {
        t: usize,
        seq: usize,
        layer: u32,
        tokens: u32,
    },
    Set {
        t: usize,
        seq: usize,
        layer: u32,
        first: u32,
        action: u8,
    },
    Report {
        t: usize,
        seq: usize,
        layer: u32,
    },
    Drop {
        t: usize,
        seq: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let (t, seq) = (0..2usize, 0..SEQS);
    prop_oneof![
        2 => (t.clone(), seq.clone(), any::<bool>()).prop_map(|(t, seq, chain)| Op::Create { t, seq, chain }),
        3 => (t.clone(), seq.clone(), 0..LAYERS).prop_map(|(t, seq, layer)| Op::Put { t, seq, layer }),
        2 => (t.clone(), seq.clone(), 0..LAYERS, 1u32..10)
            .prop_map(|(t, seq, layer, tokens)| Op::Append { t, seq, layer, tokens }),
        1 => (t.clone(), seq.clone(), 0..LAYERS, 0u32..4, 0u8..4)
            .prop_map(|(t, seq, layer, first, action)| Op::Set { t, seq, layer, first, action }),
        1 => (t.clone(), seq.clone(), 0..LAYERS).prop_map(|(t, seq, layer)| Op::Report { t, seq, layer }),
        1 => (t, seq).prop_map(|(t, seq)| Op::Drop { t, seq }),
    ]
}

/// The rows each lane should hold: K rows and V rows, per (tenant, seq,
/// layer, head); `None` for a row whose page was evicted.
type Lanes = HashMap<(usize, usize, u32, u32), Vec<Option<(Vec<u8>, Vec<u8>)>>>;

/// A K (or V) row, the same wherever a tenant writes position `i` of
/// (layer, head): pages shared under a prefix hash hold what each sequence
/// would have written.
fn row(t: usize, layer: u32, head: u32, i: usize, value: bool) -> Vec<u8> {
    let base = (t * 1000 + layer as usize * 100 + head as usize * 10 + usize::from(value)) as f32;
    (0..DIM)
        .flat_map(|d| (base + (i * DIM + d) as f32 * 0.25).to_le_bytes())
        .collect()
}

/// Rows `from..from + n` of every head, as a write sends them (per head, K
/// rows then V rows), and per head as the model keeps them.
type Rows = Vec<Option<(Vec<u8>, Vec<u8>)>>;
fn rows(t: usize, layer: u32, from: usize, n: usize) -> (Vec<u8>, Vec<Rows>) {
    let mut kv = Vec::new();
    let mut per_head = Vec::new();
    for h in 0..HEADS {
        let k: Vec<Vec<u8>> = (from..from + n).map(|i| row(t, layer, h, i, false)).collect();
        let v: Vec<Vec<u8>> = (from..from + n).map(|i| row(t, layer, h, i, true)).collect();
        kv.extend(k.concat());
        kv.extend(v.concat());
        per_head.push(k.into_iter().zip(v).map(Some).collect());
    }
    (kv, per_head)
}

/// What a refusal must leave as it was: the tenant's sequences, metadata
/// and pages. (Its bytes per tier may move: making room demotes and
/// migrates its own pages first.)
fn observe(store: &Store, t: usize) -> (u64, u64, u64) {
    let stats = store.tenant_stats(&tenant(t));
    let usage: Usage = stats.usage.unwrap();
    (usage.sequences, usage.metadata_bytes, stats.pages.total())
}

fn apply(store: &Store, lanes: &mut Lanes, op: &Op) -> Result<(), TestCaseError> {
    let t = match op {
        Op::Create { t, .. }
        | Op::Put { t, .. }
        | Op::Append { t, .. }
        | Op::Set { t, .. }
        | Op::Report { t, .. }
        | Op::Drop { t, .. } => *t,
    };
    let before = observe(store, t);
    let result = match op {
        Op::Create { t, seq, chain } => {
            let hashes = if *chain {
                vec![vec![1u8; 8], vec![2u8; 8]]
            } else {
                vec![]
            };
            let created = store.create_sequence(key(*t, *seq), layout(), hashes);
            if let Ok(c) = &created {
                for layer in 0..LAYERS {
                    let (_, attached) = rows(*t, layer, 0, c.attached_pages as usize * PAGE);
                    for (h, rows) in attached.into_iter().enumerate() {
                        lanes.insert((*t, *seq, layer, h as u32), rows);
                    }
                }
            }
            created.map(|_| ())
        }
        Op::Put { t, seq, layer } => {
            let at = lanes.get(&(*t, *seq, *layer, 0)).map_or(0, Vec::len);
            let (kv, written) = rows(*t, *layer, at, PAGE);
            let done = store.put_pages(
                &key(*t, *seq),
                PutPages {
                    layer: *layer,
                    heads: HeadRange { start: 0, count: HEADS },
                    first_page: (at / PAGE) as u32,
                    num_tokens: PAGE as u32,
                    kv: &kv,
                    persist: false,
                },
            );
            if done.is_ok() {
                for (h, rows) in written.into_iter().enumerate() {
                    lanes.entry((*t, *seq, *layer, h as u32)).or_default().extend(rows);
                }
            }
            done.map(|_| ())
        }
        Op::Append { t, seq, layer, tokens } => {
            let at = lanes.get(&(*t, *seq, *layer, 0)).map_or(0, Vec::len);
            let (kv, rows) = rows(*t, *layer, at, *tokens as usize);
            let done = store.append_tokens(
                &key(*t, *seq),
                AppendTokens {
                    layer: *layer,
                    heads: HeadRange { start: 0, count: HEADS },
                    num_tokens: *tokens,
                    kv: &kv,
                    expected_position: None,
                    persist: false,
                },
            );
            if done.is_ok() {
                for (h, rows) in rows.into_iter().enumerate() {
                    lanes.entry((*t, *seq, *layer, h as u32)).or_default().extend(rows);
                }
            }
            done.map(|_| ())
        }
        Op::Set {
            t,
            seq,
            layer,
            first,
            action,
        } => {
            let action = match action {
                0 => Action::SwapIn,
                1 => Action::Offload(ColdTier::Host),
                2 => Action::Offload(ColdTier::Nvme),
                _ => Action::Evict,
            };
            let done = store.set_page_state(
                &key(*t, *seq),
                SetPageState {
                    layer_start: *layer,
                    layer_count: 1,
                    heads: HeadRange { start: 0, count: HEADS },
                    pages: PageSelection::Range {
                        first: *first,
                        count: 1,
                    },
                    action,
                    summary_rows: 0,
                    reason: Reason::Explicit,
                },
            );
            if done.is_ok() && action == Action::Evict {
                for h in 0..HEADS {
                    if let Some(rows) = lanes.get_mut(&(*t, *seq, *layer, h)) {
                        let range =
                            (*first as usize * PAGE).min(rows.len())..((*first as usize + 1) * PAGE).min(rows.len());
                        rows[range].iter_mut().for_each(|r| *r = None);
                    }
                }
            }
            done.map(|_| ())
        }
        Op::Report { t, seq, layer } => {
            let tokens = lanes.get(&(*t, *seq, *layer, 0)).map_or(0, Vec::len);
            let weights = vec![0.5f32; tokens * HEADS as usize];
            store.report_attention(
                &key(*t, *seq),
                ReportAttention {
                    layer: *layer,
                    heads: HeadRange { start: 0, count: HEADS },
                    weights: AttentionWeights::Tokens(&weights),
                    decay: None,
                },
            )
        }
        Op::Drop { t, seq } => {
            let done = store.drop_sequence(&key(*t, *seq));
            if done.is_ok() {
                lanes.retain(|k, _| (k.0, k.1) != (*t, *seq));
            }
            done
        }
    };
    match result {
        Err(StoreError::OverLimit(e)) => {
            // The unlimited tenant meets only the server's budget.
            prop_assert!(t == 0 || e.setting == "metadata_bytes", "{}", e);
            prop_assert_eq!(observe(store, t), before, "a refusal changed something ({})", e);
        }
        Err(StoreError::ResourceExhausted(e)) => {
            // Only the limited tenant's own quota may stop it, never a full
            // tier (every tier here is far larger than the quotas).
            return Err(TestCaseError::fail(format!("a tier filled up: {e}")));
        }
        _ => {}
    }
    Ok(())
}

fn check(store: &Store, lanes: &Lanes, limits: &Limits, q: &Quota) -> Result<(), TestCaseError> {
    let server = store.stats();
    prop_assert!(server.metadata_bytes <= limits.metadata_bytes);
    let usage = store.tenant_stats(&tenant(0)).usage.unwrap();
    for (i, limit) in [q.device_bytes, q.host_bytes, q.nvme_bytes].into_iter().enumerate() {
        prop_assert!(
            usage.tier_bytes[i] <= limit.unwrap(),
            "tier {i}: {} > {:?}",
            usage.tier_bytes[i],
            limit
        );
    }
    prop_assert!(usage.metadata_bytes <= q.metadata_bytes.unwrap());
    prop_assert!(usage.sequences <= q.sequences.unwrap());
    // Every row still held reads back as written.
    for (&(t, seq, layer, head), rows) in lanes {
        let pages = store
            .fetch_pages(
                &key(t, seq),
                FetchPages {
                    layer,
                    heads: HeadRange { start: head, count: 1 },
                    pages: PageList::All,
                    with_digests: false,
                },
            )
            .map_err(|e| TestCaseError::fail(format!("fetch: {e}")))?;
        for page in pages {
            let first = page.page as usize * PAGE;
            let expected = &rows[first..first + page.rows as usize];
            match page.content {
                PageContent::Original(kv) => {
                    let (k, v) = kv.split_at(kv.len() / 2);
                    for (i, want) in expected.iter().enumerate() {
                        let Some((wk, wv)) = want else {
                            return Err(TestCaseError::fail(format!(
                                "page {} of an evicted row is back",
                                page.page
                            )));
                        };
                        prop_assert_eq!(&k[i * DIM * 4..(i + 1) * DIM * 4], &wk[..], "K row {}", first + i);
                        prop_assert_eq!(&v[i * DIM * 4..(i + 1) * DIM * 4], &wv[..], "V row {}", first + i);
                    }
                }
                PageContent::Gone(_) => prop_assert!(expected.iter().all(Option::is_none), "rows lost"),
                PageContent::Summary { .. } => return Err(TestCaseError::fail("no summaries in this test")),
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn quotas_and_the_budget_hold_under_any_run(
        ops in proptest::collection::vec(op(), 1..80),
        quota in quota(),
        nvme in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let limits = Limits {
            metadata_bytes: 24 << 10,
            default_quota: Quota::default(),
            tenants: [(tenant(0), quota)].into_iter().collect(),
        };
        let store = Store::new(StoreConfig {
            device_bytes: 64 * PAGE_BYTES,
            host_bytes: 256 * PAGE_BYTES,
            cache_writes_on_device: true,
            nvme: nvme.then(|| NvmeConfig {
                path: dir.path().join("nvme"),
                capacity: 1 << 20,
                engine: EngineChoice::Auto,
                queue_depth: 8,
                direct: true,
            }),
            limits: limits.clone(),
            ..StoreConfig::default()
        })
        .unwrap();
        let mut lanes = Lanes::new();
        for op in &ops {
            apply(&store, &mut lanes, op)?;
            check(&store, &lanes, &limits, &quota)?;
        }
        for t in 0..2 {
            for seq in 0..SEQS {
                let _ = store.drop_sequence(&key(t, seq));
            }
        }
        store.wait_idle();
        // Extents of dropped pages are free once the manifest no longer
        // names them.
        store.checkpoint();
        for t in 0..2 {
            let usage = store.tenant_stats(&tenant(t)).usage.unwrap();
            prop_assert_eq!((usage.sequences, usage.metadata_bytes, usage.tier_bytes), (0, 0, [0; 3]), "left after dropping everything");
        }
        prop_assert_eq!(store.stats().metadata_bytes, 0);
    }
}
