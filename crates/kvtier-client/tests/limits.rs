//! Messages against the limits: request bodies that are not valid gRPC
//! messages, requests over the server's limit, and responses that must fit
//! a stock client's receive limit, framing included.

mod common;

use bytes::Bytes;
use common::raw::{self, frame, message};
use common::{TestServer, small_store};
use kvtier_client::pb::kv_tier_client::KvTierClient;
use kvtier_client::{ClientError, SelectRequest, pb};
use kvtier_server::ServerConfig;
use prost::Message;
use tonic::Code;
use tonic::transport::Channel;

/// Sends `body` as the request body of `method` and returns the status.
async fn raw_call(channel: &mut Channel, method: &str, body: Bytes) -> (Code, String) {
    let answer = raw::call(channel, &format!("/kvtier.v1.KvTier/{method}"), body).await;
    (answer.code, answer.message)
}

async fn channel(server: &TestServer) -> Channel {
    Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn layout(layers: u32, heads: u32, head_dim: u32, page_size: u32) -> pb::Layout {
    kvtier_client::layout(layers, heads, heads, head_dim, pb::DType::DtypeF32, page_size)
}

#[tokio::test]
async fn malformed_bodies_are_invalid_arguments_and_oversize_is_resource_exhausted() {
    let server = TestServer::start_with(
        small_store(),
        ServerConfig {
            max_message_bytes: 64 << 10,
            ..ServerConfig::default()
        },
    )
    .await;
    let mut ch = channel(&server).await;
    let get = pb::GetSequenceRequest {
        tenant: String::new(),
        sequence_id: "s".into(),
    };
    let valid = message(&get);
    let two = [valid.clone(), valid.clone()].concat();
    let garbage = [0xffu8; 12];
    let cases: Vec<(&str, Bytes, Code, &str)> = vec![
        (
            "GetSequence",
            frame(0, 12, &garbage),
            Code::InvalidArgument,
            "does not decode",
        ),
        (
            "CreateSequence",
            frame(0, 3, &[0x0a, 0x05, 0x61]),
            Code::InvalidArgument,
            "does not decode",
        ),
        (
            "GetSequence",
            frame(7, 0, &[]),
            Code::InvalidArgument,
            "compression flag",
        ),
        ("GetSequence", frame(1, 0, &[]), Code::InvalidArgument, "compressed"),
        (
            "GetSequence",
            valid.slice(..valid.len() - 1),
            Code::InvalidArgument,
            "ends inside",
        ),
        ("GetSequence", valid.slice(..3), Code::InvalidArgument, "ends inside"),
        ("GetSequence", Bytes::new(), Code::InvalidArgument, "no message"),
        ("GetSequence", two.into(), Code::InvalidArgument, "more than one"),
        (
            "PutPages",
            frame(0, 12, &garbage),
            Code::InvalidArgument,
            "does not decode",
        ),
        (
            "GetSequence",
            frame(0, (64 << 10) + 1, &[]),
            Code::ResourceExhausted,
            "limit",
        ),
        (
            "PutPages",
            frame(0, 1 << 30, &[0; 100]),
            Code::ResourceExhausted,
            "limit",
        ),
        // A valid request still gets its own answer.
        ("GetSequence", valid, Code::NotFound, "s"),
    ];
    for (method, body, want, says) in cases {
        let (code, message) = raw_call(&mut ch, method, body.clone()).await;
        assert_eq!(code, want, "{method} with {body:?}: {message}");
        assert!(message.contains(says), "{method}: {message:?} should say {says:?}");
    }
    // An oversize PutPages through the typed client as well.
    let mut client = server.client().await;
    client.create_sequence("s", layout(1, 1, 64, 16), vec![]).await.unwrap();
    let err = client
        .put_pages("s", 0, 0..1, 0, 256, vec![0u8; 2 * 256 * 64 * 4].into())
        .await;
    match err {
        Err(ClientError::Status(s)) => assert_eq!(s.code(), Code::ResourceExhausted, "{}", s.message()),
        other => panic!("{other:?}"),
    }
    assert_eq!(client.get_sequence("s").await.unwrap().tokens, 0, "changed nothing");
}

/// Writes `tokens` rows of one layer of `heads` heads, in writes of at most
/// `write_bytes`.
async fn fill(
    client: &mut kvtier_client::Client,
    (heads, head_dim, page_size, tokens): (u32, u32, u32, u32),
    write_bytes: u32,
) {
    let per_write = write_bytes / (2 * heads * head_dim * 4) / page_size * page_size;
    let mut at = 0;
    while at < tokens {
        let n = per_write.min(tokens - at);
        let kv: Vec<u8> = (0..(2 * heads * n * head_dim * 4) as usize)
            .map(|i| (i % 251) as u8)
            .collect();
        client
            .put_pages("s", 0, 0..heads, at / page_size, n, kv.into())
            .await
            .unwrap();
        at += n;
    }
}

#[tokio::test]
async fn a_stock_client_with_a_4_mib_receive_limit_reads_large_fetches_and_selections() {
    let server = TestServer::start_with(
        kvtier_store::StoreConfig {
            host_bytes: 256 << 20,
            ..small_store()
        },
        ServerConfig::default(),
    )
    .await;
    let mut client = server.client().await;
    // 6 MiB in one layer: 4 heads × 1536 tokens × 128 dims × f32 × K and V.
    let (heads, head_dim, page_size, tokens) = (4, 128, 16, 1536);
    client
        .create_sequence("s", layout(1, heads, head_dim, page_size), vec![])
        .await
        .unwrap();
    fill(&mut client, (heads, head_dim, page_size, tokens), 1 << 20).await;
    // A stock generated client: tonic's default 4 MiB receive limit.
    let mut stock = KvTierClient::new(channel(&server).await);
    let fetch = pb::FetchPagesRequest {
        sequence_id: "s".into(),
        kv_head_start: 0,
        kv_head_count: heads,
        ..Default::default()
    };
    let mut stream = stock.fetch_pages(fetch).await.unwrap().into_inner();
    let mut bytes = 0;
    while let Some(msg) = stream.message().await.unwrap() {
        assert!(msg.encoded_len() <= 4 << 20, "{}", msg.encoded_len());
        bytes += msg.pages.iter().map(|p| p.kv.len()).sum::<usize>();
    }
    assert_eq!(bytes, (2 * heads * tokens * head_dim * 4) as usize);
    // A selection of every page, with its data.
    let select = pb::SelectPagesRequest {
        sequence_id: "s".into(),
        kv_head_count: heads,
        queries: vec![0u8; (heads * head_dim * 4) as usize].into(),
        budget_pages: tokens / page_size,
        aggregation: pb::Aggregation::Max as i32,
        include_data: true,
        ..Default::default()
    };
    let mut stream = stock.select_pages(select).await.unwrap().into_inner();
    let mut bytes = 0;
    while let Some(msg) = stream.message().await.unwrap() {
        bytes += msg.pages.iter().map(|p| p.kv.len()).sum::<usize>();
    }
    assert_eq!(bytes, (2 * heads * tokens * head_dim * 4) as usize);
}

#[tokio::test]
async fn no_response_passes_the_servers_limit_whatever_the_request_asks() {
    let limit = 64 << 10;
    let server = TestServer::start_with(
        small_store(),
        ServerConfig {
            max_message_bytes: limit,
            ..ServerConfig::default()
        },
    )
    .await;
    let mut client = server.client().await;
    // Many heads with many small pages: the selection alone (bounds and
    // states per page) passes 64 KiB.
    let (heads, head_dim, page_size, tokens) = (64, 4, 4, 1024);
    client
        .create_sequence("s", layout(1, heads, head_dim, page_size), vec![])
        .await
        .unwrap();
    fill(&mut client, (heads, head_dim, page_size, tokens), 32 << 10).await;
    let mut stock = KvTierClient::new(channel(&server).await).max_decoding_message_size(limit);
    for max_chunk_bytes in [0, 32 << 20, 10_000] {
        let fetch = pb::FetchPagesRequest {
            sequence_id: "s".into(),
            kv_head_count: heads,
            max_chunk_bytes,
            ..Default::default()
        };
        let mut stream = stock.fetch_pages(fetch).await.unwrap().into_inner();
        let mut pages = 0;
        while let Some(msg) = stream.message().await.unwrap() {
            assert!(
                msg.encoded_len()
                    <= limit.min(if max_chunk_bytes == 0 {
                        usize::MAX
                    } else {
                        max_chunk_bytes as usize
                    })
            );
            pages += msg.pages.len();
        }
        assert_eq!(pages as u32, heads * tokens / page_size);
    }
    let req = SelectRequest {
        include_data: true,
        ..SelectRequest::new(0, 0..heads, vec![0.5; (heads * head_dim) as usize], tokens / page_size)
    };
    let answer = client.select_pages("s", &req).await.unwrap();
    assert_eq!(answer.heads.len() as u32, heads, "every head, over several messages");
    assert!(answer.heads.iter().all(|h| h.pages.len() as u32 == tokens / page_size));
    assert_eq!(answer.pages.len() as u32, heads * tokens / page_size);
    // A selection that appends holds room in its first message for the
    // append's answer, which comes after the messages are cut.
    for (i, max_chunk_bytes) in [0u32, 10_000].into_iter().enumerate() {
        let select = pb::SelectPagesRequest {
            sequence_id: "s".into(),
            kv_head_count: heads,
            queries: vec![0u8; (heads * head_dim * 4) as usize].into(),
            budget_pages: tokens / page_size,
            aggregation: pb::Aggregation::Max as i32,
            max_chunk_bytes,
            append: Some(pb::AppendAfterSelection {
                num_tokens: 1,
                kv: vec![0u8; (2 * heads * head_dim * 4) as usize].into(),
                position: Some(u64::from(tokens) + i as u64),
                persist: false,
            }),
            ..Default::default()
        };
        let mut stream = stock.select_pages(select).await.unwrap().into_inner();
        let mut appended = vec![];
        while let Some(msg) = stream.message().await.unwrap() {
            let cap = if max_chunk_bytes == 0 {
                limit
            } else {
                max_chunk_bytes as usize
            };
            assert!(msg.encoded_len() <= cap, "{} > {cap}", msg.encoded_len());
            appended.extend(msg.appended.map(|a| a.tokens));
        }
        assert_eq!(appended, [u64::from(tokens) + i as u64 + 1]);
    }
    // One page that cannot fit the asked size: refused, naming the field.
    let fetch = pb::FetchPagesRequest {
        sequence_id: "s".into(),
        kv_head_count: 1,
        max_chunk_bytes: 16,
        ..Default::default()
    };
    let err = stock.fetch_pages(fetch).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().starts_with("max_chunk_bytes:"), "{}", err.message());
    // An attending selection's rows (64 query heads') and its first head's
    // selection go in its first message: a size they cannot fit in is
    // refused before anything is selected or appended, naming the field
    // (the rows alone fit in 4,500 bytes, with 256 pages' head not); one
    // they fit in is kept to.
    let mut len = client.get_sequence("s").await.unwrap().max_tokens;
    for (max_chunk_bytes, budget_pages, fits) in [
        (1_500u32, 4, false),
        (4_500, 256, false),
        (10_000, 4, true),
        (20_000, 256, true),
    ] {
        let attend = pb::SelectPagesRequest {
            sequence_id: "s".into(),
            kv_head_count: heads,
            queries: vec![0u8; (heads * head_dim * 4) as usize].into(),
            budget_pages,
            aggregation: pb::Aggregation::Max as i32,
            attend: true,
            max_chunk_bytes,
            append: Some(pb::AppendAfterSelection {
                num_tokens: 1,
                kv: vec![0u8; (2 * heads * head_dim * 4) as usize].into(),
                position: Some(len),
                persist: false,
            }),
            ..Default::default()
        };
        let case = format!("max_chunk_bytes {max_chunk_bytes}, {budget_pages} pages");
        match stock.select_pages(attend).await {
            Ok(answer) if fits => {
                let mut stream = answer.into_inner();
                let mut rows = 0;
                while let Some(msg) = stream.message().await.unwrap() {
                    assert!(msg.encoded_len() <= max_chunk_bytes as usize, "{case}");
                    rows += msg.attention.len();
                }
                assert_eq!(rows as u32, heads, "{case}");
                len += 1;
            }
            Err(err) if !fits => {
                assert_eq!(err.code(), Code::InvalidArgument, "{case}");
                let message = err.message();
                assert!(message.starts_with("max_chunk_bytes:"), "{case}: {message}");
                assert!(
                    message.contains("64 query heads' rows"),
                    "{case}: blames the rows: {message}"
                );
            }
            other => panic!("{case}: {other:?}"),
        }
        assert_eq!(client.get_sequence("s").await.unwrap().max_tokens, len, "{case}");
    }
}

/// Responses share the server's in-flight bytes with requests: concurrent
/// large fetches wait for one another and all complete; a selection whose
/// data could not fit at all is refused before anything is read.
#[tokio::test]
async fn responses_wait_for_room_in_flight_and_one_that_cannot_fit_is_refused() {
    let server = TestServer::start_with(
        kvtier_store::StoreConfig {
            host_bytes: 64 << 20,
            ..small_store()
        },
        ServerConfig {
            max_message_bytes: 64 << 10,
            max_inflight_bytes: 256 << 10,
            ..ServerConfig::default()
        },
    )
    .await;
    let mut client = server.client().await;
    // 1 MiB in one layer: 2 heads × 1024 tokens × 64 dims × f32 × K and V.
    let shape = (2, 64, 16, 1024);
    let (heads, head_dim, page_size, tokens) = shape;
    client
        .create_sequence("s", layout(1, heads, head_dim, page_size), vec![])
        .await
        .unwrap();
    fill(&mut client, shape, 32 << 10).await;
    let total = (2 * heads * tokens * head_dim * 4) as usize;
    let fetches = (0..8).map(|_| {
        let mut c = client.clone();
        tokio::spawn(async move {
            let pages = c.fetch_pages("s", 0, 0..heads, vec![]).await.unwrap();
            pages.iter().map(|p| p.kv.len()).sum::<usize>()
        })
    });
    for fetch in fetches.collect::<Vec<_>>() {
        assert_eq!(fetch.await.unwrap(), total);
    }
    let everything = SelectRequest {
        include_data: true,
        ..SelectRequest::new(0, 0..heads, vec![0.5; (heads * head_dim) as usize], tokens / page_size)
    };
    match client.select_pages("s", &everything).await {
        Err(ClientError::Status(s)) => {
            assert_eq!(s.code(), Code::ResourceExhausted);
            assert!(s.message().contains("max_inflight_bytes"), "{}", s.message());
        }
        other => panic!("{other:?}"),
    }
    let one = SelectRequest {
        include_data: true,
        ..SelectRequest::new(0, 0..heads, vec![0.5; (heads * head_dim) as usize], 1)
    };
    assert_eq!(client.select_pages("s", &one).await.unwrap().pages.len() as u32, heads);
}

/// Past max_connections a new connection is closed at once: its calls fail
/// fast instead of hanging, and the connections already open still work.
#[tokio::test]
async fn past_max_connections_new_ones_are_closed_not_left_hanging() {
    let server = TestServer::start_with(
        small_store(),
        ServerConfig {
            max_connections: 1,
            ..ServerConfig::default()
        },
    )
    .await;
    let mut first = server.client().await;
    first.stats().await.unwrap();
    let second = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        match kvtier_client::Client::connect(format!("http://{}", server.addr)).await {
            Ok(mut c) => c.stats().await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .expect("a refused connection fails fast");
    assert!(second.is_err(), "a second connection was served");
    first.stats().await.unwrap();
}
