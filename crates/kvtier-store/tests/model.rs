//! Model-based property test of the store: random runs of creates (with
//! shared prefix chains), puts, appends, transitions, fetches and drops,
//! checked after every step against a simple independent model. Catches lost
//! or corrupted bytes, leaked slots and refcount mistakes.

mod common;

use std::collections::HashMap;

use kvtier_core::{Action, ColdTier, DType, Layout, PageState, Reason, SequenceKey};
use kvtier_store::{
    AppendTokens, FetchPages, HeadRange, PageContent, PageList, PageSelection, PutPages, SetPageState, Store,
    StoreConfig, StoreError,
};
use proptest::prelude::*;

const LAYERS: u32 = 2;
const HEADS: u32 = 2;
const DIM: usize = 4;
const PAGE: usize = 4;
/// K + V rows of f32: 2 × 4 × 4 × 4 bytes, already a multiple of the 64-byte granule.
const PAGE_BYTES: u64 = 128;
const DEVICE_PAGES: u64 = 10;
const SEQS: usize = 3;

fn layout() -> Layout {
    common::layout(DType::F32, LAYERS, HEADS, DIM as u32, PAGE as u32)
}

fn key(seq: usize) -> SequenceKey {
    SequenceKey::parse("t", &format!("s{seq}")).unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    Create {
        seq: usize,
        chain: Option<u8>,
        len: usize,
    },
    Put {
        seq: usize,
        layer: u32,
        tokens: usize,
        seed: u32,
    },
    Append {
        seq: usize,
        layer: u32,
        head: u32,
        tokens: usize,
        seed: u32,
    },
    Set {
        seq: usize,
        layer: u32,
        first: u32,
        count: u32,
        action: u8,
        rows: u32,
    },
    Drop {
        seq: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let seq = 0..SEQS;
    prop_oneof![
        (seq.clone(), proptest::option::of(0u8..2), 1usize..5).prop_map(|(seq, chain, len)| Op::Create {
            seq,
            chain,
            len
        }),
        (seq.clone(), 0..LAYERS, 1usize..11, any::<u32>()).prop_map(|(seq, layer, tokens, seed)| Op::Put {
            seq,
            layer,
            tokens,
            seed
        }),
        (seq.clone(), 0..LAYERS, 0..HEADS, 1usize..7, any::<u32>()).prop_map(|(seq, layer, head, tokens, seed)| {
            Op::Append {
                seq,
                layer,
                head,
                tokens,
                seed,
            }
        }),
        (seq.clone(), 0..LAYERS, 0u32..4, 0u32..3, 0u8..4, 1u32..5).prop_map(
            |(seq, layer, first, count, action, rows)| Op::Set {
                seq,
                layer,
                first,
                count,
                action,
                rows
            }
        ),
        seq.prop_map(|seq| Op::Drop { seq }),
    ]
}

/// Original bytes of a page, K rows then V rows, as the model expects them.
type Bytes = Vec<u8>;

#[derive(Debug, Clone, PartialEq)]
enum ModelPage {
    /// Original bytes; `shared` names the registry entry it uses.
    Original {
        kv: Bytes,
        shared: Option<(u8, usize, usize)>,
    },
    Summary {
        rows: usize,
        tokens: usize,
    },
    Gone,
}

#[derive(Debug, Clone, Default)]
struct ModelLane {
    tokens: usize,
    pages: Vec<ModelPage>,
}

#[derive(Debug, Default)]
struct Model {
    seqs: HashMap<usize, (Option<u8>, usize, Vec<ModelLane>)>,
    /// (chain, page, lane) → (bytes, references).
    registry: HashMap<(u8, usize, usize), (Bytes, u32)>,
}

fn rows(seed: u32, n: usize) -> Vec<u8> {
    (0..n * DIM)
        .flat_map(|i| ((seed as f32) * 0.001 + i as f32 * 0.5 - 3.0).to_le_bytes())
        .collect()
}

impl Model {
    fn release(&mut self, page: &ModelPage) {
        if let ModelPage::Original { shared: Some(k), .. } = page {
            let entry = self.registry.get_mut(k).unwrap();
            entry.1 -= 1;
            if entry.1 == 0 {
                self.registry.remove(k);
            }
        }
    }

    fn physical_pages(&self) -> u64 {
        let unshared = self
            .seqs
            .values()
            .flat_map(|s| s.2.iter().flat_map(|l| l.pages.iter()))
            .filter(|p| matches!(p, ModelPage::Original { shared: None, .. }))
            .count();
        (unshared + self.registry.len()) as u64
    }

    fn host_bytes(&self) -> u64 {
        let summaries: u64 = self
            .seqs
            .values()
            .flat_map(|s| s.2.iter().flat_map(|l| l.pages.iter()))
            .map(|p| match p {
                ModelPage::Summary { rows, .. } => ((2 * rows * DIM * 4) as u64).div_ceil(64) * 64,
                _ => 0,
            })
            .sum();
        self.physical_pages() * PAGE_BYTES + summaries
    }
}

fn states(store: &Store, seq: usize, layer: u32) -> Vec<Vec<PageState>> {
    let pages = store
        .fetch_pages(
            &key(seq),
            FetchPages {
                layer,
                heads: HeadRange { start: 0, count: HEADS },
                pages: PageList::All,
                with_digests: false,
            },
        )
        .unwrap();
    let mut out = vec![Vec::new(); HEADS as usize];
    for p in pages {
        out[p.kv_head as usize].push(p.state);
    }
    out
}

fn check(store: &Store, model: &Model) -> Result<(), TestCaseError> {
    let stats = store.stats();
    prop_assert_eq!(stats.physical_pages, model.physical_pages());
    let device = &stats.tiers[0];
    let host = &stats.tiers[1];
    prop_assert_eq!(host.used_bytes, model.host_bytes());
    prop_assert!(device.used_bytes <= DEVICE_PAGES * PAGE_BYTES);
    prop_assert_eq!(device.used_bytes, device.slots * PAGE_BYTES);
    prop_assert!(
        device.slots <= stats.pages.get(PageState::Hot),
        "a device slot without a hot page"
    );
    for (&seq, (_, _, lanes)) in &model.seqs {
        // The shape a call is sized by: the longest lane.
        let longest = lanes.iter().map(|l| l.tokens).max().unwrap_or(0);
        prop_assert_eq!(store.shape(&key(seq)).unwrap().1, longest as u64);
        for layer in 0..LAYERS {
            let fetched = store
                .fetch_pages(
                    &key(seq),
                    FetchPages {
                        layer,
                        heads: HeadRange { start: 0, count: HEADS },
                        pages: PageList::All,
                        with_digests: false,
                    },
                )
                .unwrap();
            let mut i = 0;
            for head in 0..HEADS as usize {
                let lane = &lanes[layer as usize * HEADS as usize + head];
                for (p, want) in lane.pages.iter().enumerate() {
                    let got = &fetched[i];
                    i += 1;
                    prop_assert_eq!((got.kv_head as usize, got.page as usize), (head, p));
                    match (want, &got.content) {
                        (ModelPage::Original { kv, .. }, PageContent::Original(bytes)) => {
                            prop_assert!(
                                kv == bytes,
                                "seq {} layer {} head {} page {} bytes differ",
                                seq,
                                layer,
                                head,
                                p
                            );
                        }
                        (ModelPage::Summary { rows, tokens }, PageContent::Summary { counts, .. }) => {
                            prop_assert_eq!(counts.len(), *rows);
                            prop_assert_eq!(counts.iter().sum::<u32>() as usize, *tokens);
                        }
                        (ModelPage::Gone, PageContent::Gone(Reason::Explicit)) => {}
                        (want, got) => prop_assert!(false, "page {} expected {:?}, got {:?}", p, want, got),
                    }
                }
            }
            prop_assert_eq!(i, fetched.len());
        }
    }
    Ok(())
}

fn apply(store: &Store, model: &mut Model, op: Op) -> Result<(), TestCaseError> {
    let page_kv = |k: &[u8], v: &[u8], p: usize, n: usize| -> Bytes {
        let row = DIM * 4;
        [
            &k[p * PAGE * row..(p * PAGE + n) * row],
            &v[p * PAGE * row..(p * PAGE + n) * row],
        ]
        .concat()
    };
    match op {
        Op::Create { seq, chain, len } => {
            let hashes = chain.map_or(vec![], |c| (0..len).map(|p| format!("{c}-{p}").into_bytes()).collect());
            let result = store.create_sequence(key(seq), layout(), hashes);
            if model.seqs.contains_key(&seq) {
                prop_assert!(
                    matches!(result, Err(StoreError::AlreadyExists { .. })),
                    "expected ALREADY_EXISTS"
                );
                return Ok(());
            }
            let created = result.unwrap();
            let lanes_n = (LAYERS * HEADS) as usize;
            let mut lanes = vec![ModelLane::default(); lanes_n];
            let mut attached = 0;
            if let Some(c) = chain {
                while attached < len && (0..lanes_n).all(|l| model.registry.contains_key(&(c, attached, l))) {
                    for (l, lane) in lanes.iter_mut().enumerate() {
                        let entry = model.registry.get_mut(&(c, attached, l)).unwrap();
                        entry.1 += 1;
                        lane.pages.push(ModelPage::Original {
                            kv: entry.0.clone(),
                            shared: Some((c, attached, l)),
                        });
                        lane.tokens += PAGE;
                    }
                    attached += 1;
                }
            }
            prop_assert_eq!(created.attached_pages, attached as u64);
            model.seqs.insert(seq, (chain, len, lanes));
        }
        Op::Put {
            seq,
            layer,
            tokens,
            seed,
        } => {
            let k: Vec<u8> = (0..HEADS)
                .flat_map(|h| [rows(seed + h, tokens), rows(seed + h + 77, tokens)].concat())
                .collect();
            let Some((chain, len, lanes)) = model.seqs.get_mut(&seq) else {
                let r = store.put_pages(
                    &key(seq),
                    PutPages {
                        layer,
                        heads: HeadRange { start: 0, count: HEADS },
                        first_page: 0,
                        num_tokens: tokens as u32,
                        kv: &k,
                        persist: false,
                    },
                );
                prop_assert!(matches!(r, Err(StoreError::NotFound { .. })), "expected NOT_FOUND");
                return Ok(());
            };
            let base = layer as usize * HEADS as usize;
            let start = lanes[base].tokens;
            let aligned = start % PAGE == 0 && lanes[base + 1].tokens == start;
            let first_page = (start / PAGE) as u32;
            let r = store.put_pages(
                &key(seq),
                PutPages {
                    layer,
                    heads: HeadRange { start: 0, count: HEADS },
                    first_page,
                    num_tokens: tokens as u32,
                    kv: &k,
                    persist: false,
                },
            );
            if !aligned {
                prop_assert!(matches!(r, Err(StoreError::FailedPrecondition(_))), "{:?}", r);
                return Ok(());
            }
            r.unwrap();
            let (chain, len) = (*chain, *len);
            for h in 0..HEADS as usize {
                let lane_index = base + h;
                let msg = &k[h * 2 * tokens * DIM * 4..(h + 1) * 2 * tokens * DIM * 4];
                let (kk, vv) = msg.split_at(tokens * DIM * 4);
                for i in 0..tokens.div_ceil(PAGE) {
                    let n = (tokens - i * PAGE).min(PAGE);
                    let p = first_page as usize + i;
                    let kv = page_kv(kk, vv, i, n);
                    let lane = &mut model.seqs.get_mut(&seq).unwrap().2[lane_index];
                    lane.tokens += n;
                    let page = match chain.filter(|_| n == PAGE && p < len) {
                        Some(c) => {
                            let entry = model.registry.entry((c, p, lane_index)).or_insert((kv, 0));
                            entry.1 += 1;
                            ModelPage::Original {
                                kv: entry.0.clone(),
                                shared: Some((c, p, lane_index)),
                            }
                        }
                        None => ModelPage::Original { kv, shared: None },
                    };
                    model.seqs.get_mut(&seq).unwrap().2[lane_index].pages.push(page);
                }
            }
        }
        Op::Append {
            seq,
            layer,
            head,
            tokens,
            seed,
        } => {
            let kv = [rows(seed, tokens), rows(seed + 5, tokens)].concat();
            let req = AppendTokens {
                layer,
                heads: HeadRange { start: head, count: 1 },
                num_tokens: tokens as u32,
                kv: &kv,
                expected_position: None,
                persist: false,
            };
            let r = store.append_tokens(&key(seq), req);
            let Some((_, _, lanes)) = model.seqs.get_mut(&seq) else {
                prop_assert!(matches!(r, Err(StoreError::NotFound { .. })), "expected NOT_FOUND");
                return Ok(());
            };
            let lane = &mut lanes[(layer * HEADS + head) as usize];
            let room = (PAGE - lane.tokens % PAGE) % PAGE;
            if room > 0 && !matches!(lane.pages.last(), Some(ModelPage::Original { .. })) {
                prop_assert!(matches!(r, Err(StoreError::FailedPrecondition(_))), "{:?}", r);
                return Ok(());
            }
            r.unwrap();
            let (kk, vv) = kv.split_at(tokens * DIM * 4);
            let row = DIM * 4;
            let mut t = 0;
            if room > 0 {
                let fill = room.min(tokens);
                let Some(ModelPage::Original { kv: page, .. }) = lane.pages.last_mut() else {
                    unreachable!()
                };
                let have = page.len() / (2 * row);
                let (pk, pv) = page.split_at(have * row);
                *page = [pk, &kk[..fill * row], pv, &vv[..fill * row]].concat();
                t = fill;
            }
            while t < tokens {
                let n = (tokens - t).min(PAGE);
                lane.pages.push(ModelPage::Original {
                    kv: [&kk[t * row..(t + n) * row], &vv[t * row..(t + n) * row]].concat(),
                    shared: None,
                });
                t += n;
            }
            lane.tokens += tokens;
        }
        Op::Set {
            seq,
            layer,
            first,
            count,
            action,
            rows,
        } => {
            let action = [
                Action::Offload(ColdTier::Host),
                Action::SwapIn,
                Action::Summarize,
                Action::Evict,
            ][action as usize];
            let req = SetPageState {
                layer_start: layer,
                layer_count: 1,
                heads: HeadRange { start: 0, count: HEADS },
                pages: PageSelection::Range { first, count },
                action,
                summary_rows: rows,
                reason: Reason::Explicit,
            };
            if !model.seqs.contains_key(&seq) {
                prop_assert!(
                    matches!(store.set_page_state(&key(seq), req), Err(StoreError::NotFound { .. })),
                    "expected NOT_FOUND"
                );
                return Ok(());
            }
            let now = states(store, seq, layer);
            let lanes = &model.seqs[&seq].2;
            let base = (layer * HEADS) as usize;
            let mut targets = Vec::new();
            let mut out_of_range = false;
            for h in 0..HEADS as usize {
                let held = lanes[base + h].pages.len();
                let end = if count == 0 { held } else { (first + count) as usize };
                if first as usize > held || end > held {
                    out_of_range = true;
                }
                targets.extend((first as usize..end.min(held)).map(|p| (h, p)));
            }
            let before = check(store, model);
            let r = store.set_page_state(&key(seq), req);
            if out_of_range || targets.is_empty() {
                prop_assert!(matches!(r, Err(StoreError::InvalidArgument(_))), "{:?}", r);
                return before;
            }
            if targets.iter().any(|&(h, p)| now[h][p].apply(action).is_err()) {
                prop_assert!(matches!(r, Err(StoreError::FailedPrecondition(_))), "{:?}", r);
                return before;
            }
            if action == Action::SwapIn && targets.len() as u64 > DEVICE_PAGES {
                prop_assert!(matches!(r, Err(StoreError::ResourceExhausted(_))), "{:?}", r);
                return before;
            }
            prop_assert_eq!(r.unwrap().pages, targets.len() as u64);
            for (h, p) in targets {
                let lane_tokens = model.seqs[&seq].2[base + h].tokens;
                let valid = (lane_tokens - p * PAGE).min(PAGE);
                let new = match action {
                    Action::Summarize => ModelPage::Summary {
                        rows: (rows as usize).min(valid),
                        tokens: valid,
                    },
                    Action::Evict => ModelPage::Gone,
                    _ => continue,
                };
                let old = std::mem::replace(&mut model.seqs.get_mut(&seq).unwrap().2[base + h].pages[p], new);
                model.release(&old);
            }
        }
        Op::Drop { seq } => {
            let r = store.drop_sequence(&key(seq));
            match model.seqs.remove(&seq) {
                Some((_, _, lanes)) => {
                    r.unwrap();
                    for page in lanes.iter().flat_map(|l| l.pages.iter()) {
                        model.release(page);
                    }
                }
                None => prop_assert!(matches!(r, Err(StoreError::NotFound { .. })), "expected NOT_FOUND"),
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]
    #[test]
    fn the_store_agrees_with_a_model(ops in proptest::collection::vec(op(), 1..48)) {
        let store = Store::new(StoreConfig {
            device_bytes: DEVICE_PAGES * PAGE_BYTES,
            host_bytes: 64 << 20,
            cache_writes_on_device: true,
            ..StoreConfig::default()
        }).unwrap();
        let mut model = Model::default();
        for op in ops {
            apply(&store, &mut model, op)?;
            check(&store, &model)?;
        }
        for seq in 0..SEQS {
            apply(&store, &mut model, Op::Drop { seq })?;
        }
        let stats = store.stats();
        prop_assert_eq!(stats.physical_pages, 0);
        prop_assert!(stats.tiers.iter().all(|t| t.used_bytes == 0 && t.slots == 0), "{:?}", stats.tiers);
    }
}
