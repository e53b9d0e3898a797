//! A selection large enough to be ranked and read over several threads
//! (lanes of megabytes of digests and pages) is the union of the same
//! selection made head by head (one lane each, one thread), and the bytes it
//! returns are those a fetch of the chosen pages returns.

mod common;

use kvtier_core::select::Budget;
use kvtier_core::{DType, SequenceKey};
use kvtier_store::{FetchPages, HeadRange, PageList, PutPages, SelectPages, Store, StoreConfig};

const HEADS: u32 = 4;
const PAGE: u32 = 16;
const D: u32 = 128;
/// 2048 pages per lane: 2 MiB of f32 digests and 32 MiB of pages per lane.
const TOKENS: u32 = 2048 * PAGE;

#[test]
fn a_parallel_selection_is_the_serial_one() {
    let store = Store::new(StoreConfig {
        device_bytes: 0,
        host_bytes: 160 << 20,
        cache_writes_on_device: false,
        ..StoreConfig::default()
    })
    .unwrap();
    let layout = common::layout(DType::F32, 1, HEADS, D, PAGE);
    let key = SequenceKey::parse("", "big").unwrap();
    store.create_sequence(key.clone(), layout, vec![]).unwrap();
    let mut x = 0x9E37_79B9_7F4A_7C15_u64;
    let kv: Vec<u8> = (0..(HEADS * 2 * TOKENS * D) as usize)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x % 2001) as f32 / 1000.0 - 1.0).to_le_bytes()
        })
        .collect();
    let all = HeadRange { start: 0, count: HEADS };
    store
        .put_pages(
            &key,
            PutPages {
                layer: 0,
                heads: all,
                first_page: 0,
                num_tokens: TOKENS,
                kv: &kv,
                persist: false,
            },
        )
        .unwrap();
    let queries: Vec<f32> = (0..HEADS * D).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
    let request = |heads: HeadRange| {
        let q = &queries[(heads.start * D) as usize..((heads.start + heads.count) * D) as usize];
        let mut req = SelectPages::new(
            0,
            heads,
            q,
            Budget {
                pages: 96,
                sinks: 1,
                window: 1,
            },
        );
        req.with_data = true;
        req
    };
    // 4 lanes of 2 MiB of digests and 1.5 MiB of chosen pages: over threads
    // wherever there are cores for them.
    let together = store.select_pages(&key, request(all)).unwrap();
    let mut one_by_one = Vec::new();
    let mut data = Vec::new();
    for h in 0..HEADS {
        let alone = store
            .select_pages(&key, request(HeadRange { start: h, count: 1 }))
            .unwrap();
        one_by_one.extend(alone.heads);
        data.extend(alone.data);
    }
    assert_eq!(together.heads, one_by_one);
    assert_eq!(together.data, data);

    let lists: Vec<Vec<u32>> = together
        .heads
        .iter()
        .map(|h| h.pages.iter().map(|p| p.page).collect())
        .collect();
    let fetched = store
        .fetch_pages(
            &key,
            FetchPages {
                layer: 0,
                heads: all,
                pages: PageList::PerHead(&lists),
                with_digests: false,
            },
        )
        .unwrap();
    assert_eq!(fetched.len(), together.data.len());
    for (f, s) in fetched.iter().zip(&together.data) {
        assert_eq!((f.kv_head, f.page, &f.content), (s.kv_head, s.page, &s.content));
    }
}
