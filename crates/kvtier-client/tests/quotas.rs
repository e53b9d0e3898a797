//! The metadata budget and tenants' quotas over gRPC: a refusal is
//! RESOURCE_EXHAUSTED naming the limit, creates nothing, and leaves room
//! for whoever is within theirs.

mod common;

use common::{TestServer, small_store};
use kvtier_client::{ClientError, pb};
use kvtier_core::TenantId;
use kvtier_store::{Limits, Quota, StoreConfig};
use tonic::Code;

fn refused<T: std::fmt::Debug>(result: Result<T, ClientError>) -> String {
    match result {
        Err(ClientError::Status(s)) if s.code() == Code::ResourceExhausted => s.message().to_owned(),
        other => panic!("expected RESOURCE_EXHAUSTED, got {other:?}"),
    }
}

async fn server(limits: Limits) -> TestServer {
    TestServer::start(StoreConfig {
        limits,
        ..small_store()
    })
    .await
}

/// 1024 layers × 1024 KV heads, no data: accepted before at ~96 MiB of
/// resident metadata each, with no limit at all.
#[tokio::test]
async fn sequences_at_the_layout_maxima_stop_at_the_metadata_budget() {
    let budget = 64 << 20;
    let server = server(Limits {
        metadata_bytes: budget,
        ..Limits::default()
    })
    .await;
    let mut c = server.client().await;
    let huge = kvtier_client::layout(1024, 1024, 1024, 128, pb::DType::DtypeF16, 16);
    let message = refused(c.create_sequence("huge", huge, vec![]).await);
    assert!(message.contains("metadata_bytes"), "{message}");
    let stats = c.stats().await.unwrap();
    assert_eq!((stats.sequences, stats.metadata_bytes), (0, 0), "nothing half-created");
    assert_eq!(stats.metadata_limit_bytes, budget);
    let (c404, _) = match c.get_sequence("huge").await {
        Err(ClientError::Status(s)) => (s.code(), ()),
        other => panic!("{other:?}"),
    };
    assert_eq!(c404, Code::NotFound);

    // Smaller ones until the budget is spent; never past it.
    let mid = || kvtier_client::layout(128, 64, 64, 128, pb::DType::DtypeF16, 16);
    let mut created = 0;
    let last = loop {
        match c.create_sequence(&format!("mid-{created}"), mid(), vec![]).await {
            Ok(_) => created += 1,
            Err(e) => break refused::<()>(Err(e)),
        }
        let used = c.stats().await.unwrap().metadata_bytes;
        assert!(used <= budget, "{used} > {budget}");
        assert!(created < 10_000, "never refused");
    };
    assert!(created > 0 && last.contains("metadata_bytes"), "{created}: {last}");
    // A drop gives its share back.
    c.drop_sequence("mid-0").await.unwrap();
    c.create_sequence("mid-again", mid(), vec![]).await.unwrap();
}

#[tokio::test]
async fn a_tenant_meets_its_own_quotas_and_no_one_else_does() {
    let page_bytes = 2 * 16 * 64 * 4; // 16 tokens × 64 dims × f32, K and V
    let quota = Quota {
        sequences: Some(2),
        host_bytes: Some(8 * page_bytes),
        ..Quota::default()
    };
    let server = server(Limits {
        tenants: [(TenantId::parse("tenant", "small").unwrap(), quota)]
            .into_iter()
            .collect(),
        ..Limits::default()
    })
    .await;
    let mut small = server.client().await.with_tenant("small");
    let mut big = server.client().await.with_tenant("big");
    let layout = || kvtier_client::layout(1, 1, 1, 64, pb::DType::DtypeF32, 16);
    for c in [&mut small, &mut big] {
        c.create_sequence("a", layout(), vec![]).await.unwrap();
        c.create_sequence("b", layout(), vec![]).await.unwrap();
    }
    let message = refused(small.create_sequence("c", layout(), vec![]).await);
    assert!(
        message.contains("quota sequences") && message.contains("small"),
        "{message}"
    );
    big.create_sequence("c", layout(), vec![]).await.unwrap();

    // Host bytes: 8 pages, no NVMe to migrate to.
    let page = |n: u32| vec![1u8; (n * page_bytes as u32) as usize];
    small.put_pages("a", 0, 0..1, 0, 16 * 8, page(8).into()).await.unwrap();
    let message = refused(small.put_pages("b", 0, 0..1, 0, 16, page(1).into()).await);
    assert!(message.contains("quota host_bytes"), "{message}");
    big.put_pages("a", 0, 0..1, 0, 16 * 16, page(16).into()).await.unwrap();

    let usage = small.tenant_stats().await.unwrap().usage.unwrap();
    assert_eq!(usage.host_bytes, 8 * page_bytes);
    assert_eq!((usage.sequences, usage.quota.unwrap().sequences), (2, Some(2)));
    assert_eq!(
        small.get_sequence("b").await.unwrap().tokens,
        0,
        "the refused write changed nothing"
    );
    // Dropping gives the bytes back.
    small.drop_sequence("a").await.unwrap();
    small.put_pages("b", 0, 0..1, 0, 16, page(1).into()).await.unwrap();
}
