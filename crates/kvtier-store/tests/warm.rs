//! Warming the next layer (what the shm plane's thread does after each
//! answered selection) only reads: every selection after it is the one
//! before it, for every layer (the last wraps to the first), and heads or
//! sequences that do not exist are passed over.

mod common;

use std::sync::Arc;

use kvtier_core::select::Budget;
use kvtier_core::{DType, SequenceKey};
use kvtier_store::{HeadRange, PutPages, SelectPages, Selection, Store, StoreConfig};

const LAYERS: u32 = 3;
const HEADS: u32 = 2;
const D: u32 = 16;
const TOKENS: u32 = 150;
const ALL: HeadRange = HeadRange { start: 0, count: HEADS };

/// Layer `layer`'s selection, with its pages' bytes; its timing zeroed.
fn select(store: &Arc<Store>, key: &SequenceKey, layer: u32) -> Selection {
    let queries: Vec<f32> = (0..HEADS * D).map(|i| ((i * 7 + layer) % 5) as f32 - 2.0).collect();
    let budget = Budget {
        pages: 4,
        sinks: 1,
        window: 1,
    };
    let mut req = SelectPages::new(layer, ALL, &queries, budget);
    req.with_data = true;
    let mut selection = store.select_pages(key, req).unwrap();
    selection.timing = Default::default();
    selection
}

#[test]
fn warming_changes_no_selection() {
    let store = Store::new(StoreConfig::default()).unwrap();
    let key = SequenceKey::parse("", "warm").unwrap();
    store
        .create_sequence(key.clone(), common::layout(DType::F32, LAYERS, HEADS, D, 16), vec![])
        .unwrap();
    for layer in 0..LAYERS {
        let kv: Vec<u8> = (0..HEADS * 2 * TOKENS * D)
            .flat_map(|i| (((i * 31 + layer * 7) % 97) as f32 / 50.0 - 1.0).to_le_bytes())
            .collect();
        let put = PutPages {
            layer,
            heads: ALL,
            first_page: 0,
            num_tokens: TOKENS,
            kv: &kv,
            persist: false,
        };
        store.put_pages(&key, put).unwrap();
    }
    let before: Vec<Selection> = (0..LAYERS).map(|l| select(&store, &key, l)).collect();
    for layer in 0..LAYERS + 2 {
        store.warm_next_layer(&key, layer, ALL);
    }
    store.warm_next_layer(&key, 0, HeadRange { start: HEADS, count: 1 });
    store.warm_next_layer(&SequenceKey::parse("", "missing").unwrap(), 0, ALL);
    let after: Vec<Selection> = (0..LAYERS).map(|l| select(&store, &key, l)).collect();
    assert_eq!(before, after);
}
