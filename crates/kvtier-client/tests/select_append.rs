//! A selection that appends the decode step's own token (`append`), over
//! gRPC and over a region's socket: the selection is made among the tokens
//! stored before, the token lands after them, and a refusal of the append
//! after the selection (a tenant's quota) fails the call with nothing
//! appended and the selection's lease given back.

mod common;

use common::{TestServer, small_store};
use kvtier_client::{Client, ClientError, SelectRequest, pb};
use kvtier_core::TenantId;
use kvtier_store::{Limits, Quota, StoreConfig};
use tonic::Code;

const D: usize = 64;
const PAGE: u32 = 16;
/// One page of f32 K and V for one head (8 KiB: no granule rounding).
const PAGE_BYTES: u64 = 2 * PAGE as u64 * D as u64 * 4;

fn layout() -> pb::Layout {
    kvtier_client::layout(1, 2, 2, D as u32, pb::DType::DtypeF32, PAGE)
}

/// `tokens` rows of K then V per head for 2 heads, each value `seed + i`.
fn kv(tokens: usize, seed: f32) -> Vec<u8> {
    (0..2 * 2 * tokens * D)
        .flat_map(|i| (seed + i as f32 / 64.0).to_le_bytes())
        .collect()
}

fn step(tokens: u32, seed: f32, position: Option<u64>) -> SelectRequest {
    SelectRequest {
        sink_pages: 1,
        window_pages: 1,
        include_data: true,
        lease_ms: 60_000,
        append: Some(pb::AppendAfterSelection {
            num_tokens: 1,
            kv: kv(1, seed).into(),
            position: position.or(Some(u64::from(tokens))),
            persist: false,
        }),
        ..SelectRequest::new(0, 0..2, vec![0.25; 2 * D], 2)
    }
}

async fn stored(c: &mut Client, id: &str) -> u64 {
    c.get_sequence(id).await.unwrap().tokens
}

#[tokio::test]
async fn the_step_token_lands_after_the_selection_over_grpc_and_shm() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, mut c, mut region) = common::with_region(dir.path()).await;
    c.create_sequence("s", layout(), vec![]).await.unwrap();
    c.put_pages("s", 0, 0..2, 0, 40, kv(40, 0.0).into()).await.unwrap();
    let plain = SelectRequest {
        append: None,
        lease_ms: 0,
        ..step(40, 0.0, None)
    };
    let before = c.select_pages("s", &plain).await.unwrap();
    for (tokens, local) in [(40u32, false), (41, true)] {
        let req = step(tokens, 100.0 + tokens as f32, None);
        let got = match local {
            false => c.select_pages("s", &req).await.unwrap(),
            true => c.select_pages_local(&mut region, "s", &req).await.unwrap(),
        };
        let appended = got.appended.expect("an append's answer");
        assert_eq!(appended.tokens, u64::from(tokens) + 1, "local {local}");
        if tokens == 40 {
            // Chosen among the 40 tokens stored before: the same as without.
            assert_eq!(got.heads, before.heads);
        }
        c.release_lease(got.lease.unwrap().0).await.unwrap();
    }
    // Page 2: tokens 32..40 stored before, then 40 and 41.
    let last = c.fetch_pages("s", 0, 0..2, vec![2]).await.unwrap();
    for page in &last {
        let h = page.kv_head as usize;
        let row = |seed: f32, half: usize| {
            let one = kv(1, seed);
            one[(h * 2 + half) * D * 4..(h * 2 + half + 1) * D * 4].to_vec()
        };
        let old = kv(40, 0.0);
        let old_rows = |half: usize| {
            let at = ((h * 2 + half) * 40 + 32) * D * 4;
            old[at..at + 8 * D * 4].to_vec()
        };
        let want_k = [old_rows(0), row(140.0, 0), row(141.0, 0)].concat();
        let want_v = [old_rows(1), row(140.0, 1), row(141.0, 1)].concat();
        assert_eq!(page.tokens, 10);
        assert_eq!(page.kv[..10 * D * 4], want_k[..], "head {h} K");
        assert_eq!(page.kv[10 * D * 4..], want_v[..], "head {h} V");
    }
    assert_eq!(stored(&mut c, "s").await, 42);
}

#[tokio::test]
async fn an_append_refused_after_the_selection_appends_nothing_and_gives_the_lease_back() {
    let tenant = TenantId::parse("tenant", "small").unwrap();
    let server = TestServer::start(StoreConfig {
        limits: Limits {
            tenants: [(
                tenant,
                Quota {
                    // Three pages per head: the fourth (opened by token 48) is over.
                    host_bytes: Some(2 * 3 * PAGE_BYTES),
                    ..Quota::default()
                },
            )]
            .into_iter()
            .collect(),
            ..Limits::default()
        },
        ..small_store()
    })
    .await;
    let mut c = server.client().await.with_tenant("small");
    c.create_sequence("s", layout(), vec![]).await.unwrap();
    c.put_pages("s", 0, 0..2, 0, 48, kv(48, 0.0).into()).await.unwrap();
    let refused = |r: Result<_, ClientError>, code: Code, needle: &str| match r {
        Err(ClientError::Status(s)) if s.code() == code && s.message().contains(needle) => {}
        other => panic!("expected {code:?} naming {needle}, got {other:?}"),
    };
    refused(
        c.select_pages("s", &step(48, 1.0, None)).await,
        Code::ResourceExhausted,
        "quota host_bytes",
    );
    assert_eq!(stored(&mut c, "s").await, 48, "nothing appended");
    assert_eq!(c.stats().await.unwrap().leases, 0, "the selection's lease given back");
    // Refused before the selection: a wrong position, and a shard.
    refused(
        c.select_pages("s", &step(48, 1.0, Some(47))).await,
        Code::FailedPrecondition,
        "append.position",
    );
    let sharded = SelectRequest {
        shard: Some(pb::ContextShard {
            rank: 0,
            world: 2,
            ownership: pb::Ownership::Contiguous as i32,
            scope: pb::Scope::Global as i32,
        }),
        ..step(48, 1.0, None)
    };
    refused(c.select_pages("s", &sharded).await, Code::InvalidArgument, "append:");
    assert_eq!(stored(&mut c, "s").await, 48);
}
