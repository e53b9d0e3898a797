//! Many clients at once on real threads: sequences that share prefixes are
//! created, written, appended, moved between tiers, read and dropped
//! concurrently. Every read is bit-exact, and when all are dropped every
//! byte of every tier is free again.

mod common;

use bytes::Bytes;
use common::finite_elements;
use kvtier_client::{Client, actions, pb};
use kvtier_store::StoreConfig;

const DTYPE: pb::DType = pb::DType::DtypeBf16;
const HEAD_DIM: usize = 32;
const PAGE: usize = 8;
const HEADS: u32 = 2;
const LAYERS: u32 = 2;
const ROW: usize = HEAD_DIM * 2;

/// K and V rows of one (layer, head) for positions `range`: a function of
/// the prefix (chain) for shared positions, of the sequence otherwise — as
/// real KV is a function of the tokens.
fn rows(owner: u64, layer: u32, head: u32, range: std::ops::Range<usize>) -> (Vec<u8>, Vec<u8>) {
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for t in range {
        let seed = owner * 1_000_000 + u64::from(layer) * 10_000 + u64::from(head) * 1000 + t as u64;
        k.extend(finite_elements(DTYPE, HEAD_DIM, 2 * seed));
        v.extend(finite_elements(DTYPE, HEAD_DIM, 2 * seed + 1));
    }
    (k, v)
}

fn message(owner: u64, layer: u32, range: std::ops::Range<usize>) -> Bytes {
    (0..HEADS)
        .flat_map(|h| {
            let (k, v) = rows(owner, layer, h, range.clone());
            [k, v].concat()
        })
        .collect::<Vec<u8>>()
        .into()
}

async fn worker(mut client: Client, id: u64) {
    for round in 0..12u64 {
        let seq = format!("w{id}-r{round}");
        let chain = 1 + (id + round) % 2; // two prompts shared by everyone
        let prompt_pages = 3;
        let hashes = (0..prompt_pages)
            .map(|p| Bytes::from(format!("prompt{chain}-{p}")))
            .collect();
        let layout = kvtier_client::layout(LAYERS, HEADS, 4, HEAD_DIM as u32, DTYPE, PAGE as u32);
        let created = client.create_sequence(&seq, layout, hashes).await.unwrap();
        let attached = created.attached_pages as usize;
        let prompt = prompt_pages * PAGE;
        let mut writes = Vec::new();
        for layer in 0..LAYERS {
            let from = attached * PAGE;
            if from < prompt {
                let kv = message(chain, layer, from..prompt);
                writes.push(client.page_write(&seq, layer, 0..HEADS, attached as u32, (prompt - from) as u32, kv));
            }
        }
        client.put_page_stream(writes).await.unwrap();
        // Decode: the sequence's own tokens.
        let own = 100 + id * 100 + round;
        for step in 0..5usize {
            for layer in 0..LAYERS {
                let t = prompt + step * 3;
                let kv = message(own, layer, t..t + 3);
                client
                    .append_tokens(&seq, layer, 0..HEADS, 3, kv, Some(t as u64))
                    .await
                    .unwrap();
            }
        }
        // Move pages around; shared pages may be moved by others meanwhile, so
        // races between legal transitions are expected and refused cleanly.
        let _ = client
            .set_page_state(&seq, 0..LAYERS, 0..HEADS, 0..2, actions::offload_to_host())
            .await;
        let _ = client
            .set_page_state(&seq, 0..1, 0..HEADS, 1..3, actions::swap_in())
            .await;
        if round % 3 == 0 {
            client
                .set_page_state(&seq, 1..2, 0..1, 3..4, actions::evict())
                .await
                .unwrap();
        }
        // Every page with original bytes reads back exactly.
        let total = prompt + 15;
        for layer in 0..LAYERS {
            for p in client.fetch_pages(&seq, layer, 0..HEADS, vec![]).await.unwrap() {
                if p.state() == pb::PageState::Gone {
                    assert!(round % 3 == 0 && layer == 1 && p.kv_head == 0 && p.page == 3);
                    continue;
                }
                let start = p.page as usize * PAGE;
                let end = (start + PAGE).min(total);
                let owner = |t: usize| if t < prompt { chain } else { own };
                let mut k = Vec::new();
                let mut v = Vec::new();
                for t in start..end {
                    let (kt, vt) = rows(owner(t), layer, p.kv_head, t..t + 1);
                    k.extend(kt);
                    v.extend(vt);
                }
                assert_eq!(p.kv.len(), 2 * (end - start) * ROW);
                assert!(
                    p.kv[..] == [k, v].concat()[..],
                    "{seq} layer {layer} head {} page {}",
                    p.kv_head,
                    p.page
                );
            }
        }
        client.drop_sequence(&seq).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_clients_share_move_and_free_without_losing_a_byte() {
    let server = common::TestServer::start(StoreConfig {
        // A small device forces LRU demotions between clients.
        device_bytes: 24 * (2 * PAGE * ROW) as u64,
        host_bytes: 64 << 20,
        cache_writes_on_device: true,
        ..StoreConfig::default()
    })
    .await;
    // Each prompt's pages 1 and 2 stay stored under their hashes all along
    // (page 0 under another), so that every worker's prompt write shares
    // them however the workers interleave: on a loaded machine they can run
    // one after another, each dropping its prompt before the next stores it.
    let mut holder = server.client().await;
    let layout = || kvtier_client::layout(LAYERS, HEADS, 4, HEAD_DIM as u32, DTYPE, PAGE as u32);
    for chain in 1..=2u64 {
        let name = format!("holder{chain}");
        let hashes = (0..3)
            .map(|p| {
                Bytes::from(if p == 0 {
                    format!("holder{chain}-0")
                } else {
                    format!("prompt{chain}-{p}")
                })
            })
            .collect();
        holder.create_sequence(&name, layout(), hashes).await.unwrap();
        for layer in 0..LAYERS {
            let kv = message(chain, layer, 0..3 * PAGE);
            holder
                .put_pages(&name, layer, 0..HEADS, 0, 3 * PAGE as u32, kv)
                .await
                .unwrap();
        }
    }
    let mut tasks = Vec::new();
    for id in 0..6 {
        let client = server.client().await;
        tasks.push(tokio::spawn(worker(client, id)));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for chain in 1..=2 {
        holder.drop_sequence(&format!("holder{chain}")).await.unwrap();
    }
    let mut client = server.client().await;
    let stats = client.stats().await.unwrap();
    assert_eq!((stats.sequences, stats.physical_pages), (0, 0));
    assert!(
        stats.tiers.iter().all(|t| t.used_bytes == 0 && t.slots == 0),
        "{:?}",
        stats.tiers
    );
    assert!(stats.pages_shared > 0, "prompts were shared");
    let demoted: u64 = stats
        .transitions
        .iter()
        .filter(|t| t.reason() == pb::Reason::Capacity)
        .map(|t| t.count)
        .sum();
    assert!(demoted > 0, "the device was under pressure");
}
