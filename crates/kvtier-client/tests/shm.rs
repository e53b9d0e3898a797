//! The shared-memory data plane over a real Unix socket and real gRPC:
//! pages served into a region, called over gRPC and over the region's own
//! socket, are bit-exact against the same pages served inline (a generator
//! of layouts, page states and page lists, shrunk on failure); windows
//! outside the region are refused with nothing written, on both; a killed
//! client's region is reclaimed; a stopping server ends its connections.

mod common;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{LaneData, TestServer, random_kv, small_store};
use kvtier_client::{Client, SelectRequest, ShmRegion, actions, pb};
use kvtier_server::ServerConfig;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const REGION: usize = 8 << 20;

async fn server(dir: &Path) -> (TestServer, PathBuf) {
    let socket = dir.join("shm.sock");
    let config = ServerConfig {
        shm_socket: Some(socket.clone()),
        ..ServerConfig::default()
    };
    (TestServer::start_with(small_store(), config).await, socket)
}

#[derive(Debug, Clone)]
struct Case {
    dtype: pb::DType,
    kv_heads: u32,
    head_dim: u32,
    page_size: u32,
    tokens: u32,
    /// Per page: 0 stays, 1 offloaded to host, 2 summarised, 3 evicted.
    states: Vec<u8>,
    /// Per KV head, pages to fetch (indices modulo the page count).
    lists: Vec<Vec<u32>>,
    /// Where the window starts, and its slack past what the call needs.
    offset: u64,
    slack: u64,
    queries_seed: u64,
    /// Local calls poll for their replies before sleeping on them.
    poll: bool,
}

fn cases() -> impl Strategy<Value = Case> {
    let dtype = prop_oneof![
        Just(pb::DType::DtypeF16),
        Just(pb::DType::DtypeBf16),
        Just(pb::DType::DtypeF32)
    ];
    (
        dtype,
        1u32..4,
        prop_oneof![Just(4u32), Just(8), Just(64)],
        prop_oneof![Just(1u32), Just(4), Just(16)],
        1u32..160,
        proptest::collection::vec(0u8..4, 0..48),
        proptest::collection::vec(proptest::collection::vec(0u32..1000, 0..12), 4),
        0u64..4096,
        0u64..64,
        any::<u64>(),
        any::<bool>(),
    )
        .prop_map(
            |(dtype, kv_heads, head_dim, page_size, tokens, states, lists, offset, slack, queries_seed, poll)| Case {
                dtype,
                kv_heads,
                head_dim,
                page_size,
                tokens,
                states,
                lists,
                offset,
                slack,
                queries_seed,
                poll,
            },
        )
}

/// Everything of a served page but where its bytes travelled.
fn without_bytes(p: &pb::Page) -> pb::Page {
    pb::Page {
        kv: Default::default(),
        shm_offset: 0,
        shm_bytes: 0,
        shm_v_offset: None,
        ..p.clone()
    }
}

/// Checks shm pages against inline ones: same pages, same bytes, laid one
/// after another from the window's start.
fn same_pages(region: &ShmRegion, window: &pb::ShmWindow, inline: &[pb::Page], shm: &[pb::Page]) {
    assert_eq!(inline.len(), shm.len());
    let mut next = window.offset;
    for (a, b) in inline.iter().zip(shm) {
        assert_eq!(without_bytes(a), without_bytes(b));
        assert!(b.kv.is_empty(), "an shm page's bytes came inline too");
        if a.kv.is_empty() {
            assert_eq!(b.shm_bytes, 0, "a page without bytes took room");
            continue;
        }
        assert_eq!(b.shm_offset, next, "pages are laid one after another");
        assert_eq!(
            region.page_bytes(b).unwrap(),
            a.kv.to_vec(),
            "page {} head {}",
            a.page,
            a.kv_head
        );
        next += b.shm_bytes;
    }
    assert!(next <= window.offset + window.length);
}

/// Checks a `gather_heads` selection's shm pages against inline ones: same
/// pages, same bytes, and from the window's start, head after head, the
/// head's K rows in one run then its V rows in another.
fn gathered_pages(region: &ShmRegion, window: &pb::ShmWindow, inline: &[pb::Page], shm: &[pb::Page]) {
    assert_eq!(inline.len(), shm.len());
    let mut next = window.offset;
    for head in inline
        .iter()
        .map(|p| p.kv_head)
        .collect::<std::collections::BTreeSet<_>>()
    {
        let pages: Vec<(&pb::Page, &pb::Page)> = inline
            .iter()
            .zip(shm)
            .filter(|(a, b)| a.kv_head == head && b.shm_bytes > 0)
            .collect();
        let k_rows: u64 = pages.iter().map(|(_, b)| b.shm_bytes / 2).sum();
        let (mut k, mut v) = (next, next + k_rows);
        for (a, b) in pages {
            assert_eq!(
                (b.shm_offset, b.shm_v_offset),
                (k, Some(v)),
                "page {} head {head}",
                b.page
            );
            assert_eq!(
                region.page_bytes(b).unwrap(),
                a.kv.to_vec(),
                "page {} head {head}",
                a.page
            );
            (k, v) = (k + b.shm_bytes / 2, v + b.shm_bytes / 2);
        }
        next = v;
    }
    for (a, b) in inline.iter().zip(shm) {
        assert_eq!(without_bytes(a), without_bytes(b));
        assert_eq!(b.shm_bytes, a.kv.len() as u64, "page {} head {}", a.page, a.kv_head);
    }
    assert!(next <= window.offset + window.length);
}

async fn check(client: &mut Client, region: &mut ShmRegion, seq: &str, c: Case) {
    let layout = kvtier_client::layout(1, c.kv_heads, c.kv_heads * 2, c.head_dim, c.dtype, c.page_size);
    client.create_sequence(seq, layout, vec![]).await.unwrap();
    let mut lanes = vec![LaneData::default(); c.kv_heads as usize];
    let kv = random_kv(
        c.dtype,
        c.head_dim as usize,
        &mut lanes.iter_mut().collect::<Vec<_>>(),
        c.tokens as usize,
        7,
    );
    client.put_pages(seq, 0, 0..c.kv_heads, 0, c.tokens, kv).await.unwrap();
    let pages = c.tokens.div_ceil(c.page_size);
    for (p, state) in c.states.iter().enumerate().filter(|(p, _)| (*p as u32) < pages) {
        let action = match state {
            1 => actions::offload_to_host(),
            2 => actions::summarize(1),
            3 => actions::evict(),
            _ => continue,
        };
        let p = p as u32;
        client
            .set_page_state(seq, 0..1, 0..c.kv_heads, p..p + 1, action)
            .await
            .unwrap();
    }
    let lists: Vec<pb::PageList> = c.lists[..c.kv_heads as usize]
        .iter()
        .map(|l| pb::PageList {
            pages: l.iter().map(|p| p % pages).collect(),
        })
        .collect();
    let fetch = pb::FetchPagesRequest {
        sequence_id: seq.to_owned(),
        kv_head_count: c.kv_heads,
        per_head_pages: lists.clone(),
        include_digests: true,
        ..Default::default()
    };
    let page_bytes = 2 * u64::from(c.page_size * c.head_dim) * common::size_of(c.dtype) as u64;
    let listed: u64 = lists.iter().map(|l| l.pages.len() as u64).sum();
    let window = region.window(c.offset, listed * page_bytes + c.slack + 1);
    region.set_spin(if c.poll {
        std::time::Duration::from_micros(100)
    } else {
        std::time::Duration::ZERO
    });
    let inline = client.fetch(fetch.clone()).await.unwrap();
    let fetch = pb::FetchPagesRequest {
        shm: Some(window),
        ..fetch
    };
    let shm = client.fetch(fetch.clone()).await.unwrap();
    same_pages(region, &window, &inline, &shm);
    clear(region);
    let local = client.fetch_local(region, fetch).await.unwrap();
    same_pages(region, &window, &inline, &local);

    let queries = common::finite_elements(
        pb::DType::DtypeF32,
        (c.kv_heads * 2 * c.head_dim) as usize,
        c.queries_seed,
    )
    .chunks(4)
    .map(|b| f32::from_le_bytes(b.try_into().unwrap()).clamp(-8.0, 8.0))
    .collect();
    let mut select = SelectRequest::new(0, 0..c.kv_heads, queries, 3);
    select.include_data = true;
    let window = region.window(c.offset, 3 * u64::from(c.kv_heads) * page_bytes + c.slack);
    let inline = client.select_pages(seq, &select).await.unwrap();
    select.shm = Some(window);
    let shm = client.select_pages(seq, &select).await.unwrap();
    assert_eq!(inline.heads, shm.heads);
    same_pages(region, &window, &inline.pages, &shm.pages);
    clear(region);
    let local = client.select_pages_local(region, seq, &select).await.unwrap();
    assert_eq!(inline.heads, local.heads);
    assert_eq!(inline.mode, local.mode);
    same_pages(region, &window, &inline.pages, &local.pages);
    // Each head's rows together, over gRPC and over the socket.
    select.gather_heads = true;
    clear(region);
    let shm = client.select_pages(seq, &select).await.unwrap();
    assert_eq!(inline.heads, shm.heads);
    gathered_pages(region, &window, &inline.pages, &shm.pages);
    clear(region);
    let asked = Instant::now();
    let local = client.select_pages_local(region, seq, &select).await.unwrap();
    let round_trip = asked.elapsed().as_micros() as u64;
    assert_eq!(inline.heads, local.heads);
    gathered_pages(region, &window, &inline.pages, &local.pages);
    // The server's whole time for the call: the store's within it, and
    // itself within the client's.
    let t = local.timing;
    assert!(
        t.store_us <= t.server_us && t.server_us <= round_trip,
        "{t:?} in {round_trip} us"
    );
    client.drop_sequence(seq).await.unwrap();
}

/// Zeroes the region, so that a call's bytes cannot be an earlier call's.
fn clear(region: &ShmRegion) {
    // SAFETY: the region is this test's and no call is running on it; the
    // mapping is `len()` bytes and lives as long as `region`.
    unsafe { std::ptr::write_bytes(region.as_ptr().cast_mut(), 0, region.len()) };
}

#[test]
fn shm_pages_are_bit_exact_against_inline_ones() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (server, socket) = rt.block_on(server(dir.path()));
    let client = rt.block_on(server.client());
    let region = std::sync::Mutex::new(rt.block_on(client.register_shm(&socket, REGION)).unwrap());
    let mut runner = TestRunner::new(Config {
        cases: 40,
        ..Config::default()
    });
    let n = std::sync::atomic::AtomicU32::new(0);
    runner
        .run(&cases(), |c| {
            let seq = format!("case-{}", n.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            rt.block_on(check(
                &mut client.clone(),
                &mut region.lock().unwrap_or_else(|p| p.into_inner()),
                &seq,
                c,
            ));
            Ok(())
        })
        .unwrap();
}

/// Appends over the region's socket store what the same appends over gRPC
/// store: two sequences fed the same rows, one each way, read back equal,
/// page for page; a stale position is refused naming `position` either way
/// and changes nothing.
#[test]
fn appends_over_the_socket_match_appends_over_grpc() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (server, socket) = rt.block_on(server(dir.path()));
    let client = rt.block_on(server.client());
    let region = std::sync::Mutex::new(rt.block_on(client.register_shm(&socket, 1 << 20)).unwrap());
    let cases = (
        prop_oneof![
            Just(pb::DType::DtypeF32),
            Just(pb::DType::DtypeF16),
            Just(pb::DType::DtypeBf16)
        ],
        1u32..4,
        prop_oneof![Just(4u32), Just(8), Just(64)],
        prop_oneof![Just(1u32), Just(4), Just(16)],
        0u32..40,
        proptest::collection::vec(1u32..6, 1..12),
    );
    let mut runner = TestRunner::new(Config {
        cases: 24,
        ..Config::default()
    });
    let n = std::sync::atomic::AtomicU32::new(0);
    runner
        .run(&cases, |(dtype, kv_heads, head_dim, page_size, prefill, appends)| {
            let case = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut region = region.lock().unwrap_or_else(|p| p.into_inner());
            rt.block_on(async {
                let mut client = client.clone();
                let layout = kvtier_client::layout(1, kv_heads, kv_heads, head_dim, dtype, page_size);
                let (grpc, local) = (format!("grpc-{case}"), format!("local-{case}"));
                let mut lanes = vec![LaneData::default(); kv_heads as usize];
                let mut lanes = lanes.iter_mut().collect::<Vec<_>>();
                let mut position = 0u64;
                for seq in [&grpc, &local] {
                    client.create_sequence(seq, layout.clone(), vec![]).await.unwrap();
                }
                if prefill > 0 {
                    let kv = random_kv(dtype, head_dim as usize, &mut lanes, prefill as usize, 1);
                    for seq in [&grpc, &local] {
                        client
                            .put_pages(seq, 0, 0..kv_heads, 0, prefill, kv.clone())
                            .await
                            .unwrap();
                    }
                    position = u64::from(prefill);
                }
                for (i, &tokens) in appends.iter().enumerate() {
                    let kv = random_kv(dtype, head_dim as usize, &mut lanes, tokens as usize, 2 + i as u64);
                    let at = Some(position);
                    let by_grpc = client
                        .append_tokens(&grpc, 0, 0..kv_heads, tokens, kv.clone(), at)
                        .await
                        .unwrap();
                    let req = client.append_request(&local, 0, 0..kv_heads, tokens, kv, at);
                    let by_socket = client.append_tokens_local(&mut region, req.clone()).await.unwrap();
                    assert_eq!(
                        (by_grpc.tokens, by_grpc.pages_opened, by_grpc.durability),
                        (by_socket.tokens, by_socket.pages_opened, by_socket.durability)
                    );
                    position += u64::from(tokens);
                    // The same request again is stale now: refused, nothing
                    // appended.
                    let refused = client.append_tokens_local(&mut region, req).await.unwrap_err();
                    let kvtier_client::ClientError::Status(status) = refused else {
                        panic!("{refused:?}")
                    };
                    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{}", status.message());
                    assert!(status.message().starts_with("position"), "{}", status.message());
                }
                let a = client.fetch_pages(&grpc, 0, 0..kv_heads, vec![]).await.unwrap();
                let b = client.fetch_pages(&local, 0, 0..kv_heads, vec![]).await.unwrap();
                assert_eq!(a, b);
                for seq in [&grpc, &local] {
                    client.drop_sequence(seq).await.unwrap();
                }
            });
            Ok(())
        })
        .unwrap();
}

/// Whether every byte of the region is still zero (as a new memfd is).
fn untouched(region: &ShmRegion) -> bool {
    let mut all = vec![0u8; region.len()];
    region.read(0, &mut all).unwrap();
    all.iter().all(|&b| b == 0)
}

#[tokio::test]
async fn windows_outside_the_region_are_refused_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let (server, socket) = server(dir.path()).await;
    let mut client = server.client().await;
    let mut region = client.register_shm(&socket, 64 << 10).await.unwrap();
    let layout = kvtier_client::layout(1, 2, 2, 8, pb::DType::DtypeF32, 16);
    client.create_sequence("s", layout.clone(), vec![]).await.unwrap();
    let mut lanes = vec![LaneData::default(); 2];
    let kv = random_kv(pb::DType::DtypeF32, 8, &mut lanes.iter_mut().collect::<Vec<_>>(), 64, 3);
    client.put_pages("s", 0, 0..2, 0, 64, kv).await.unwrap();
    // Every page of both heads: 8 pages of 1 KiB.
    let fetch = |shm: pb::ShmWindow| pb::FetchPagesRequest {
        sequence_id: "s".into(),
        kv_head_count: 2,
        shm: Some(shm),
        ..Default::default()
    };
    let len = region.len() as u64;
    let refused = [
        (region.window(len, 8192), tonic::Code::InvalidArgument, "shm.offset"),
        (
            region.window(len - 4096, 8192),
            tonic::Code::InvalidArgument,
            "shm.length",
        ),
        (region.window(8, u64::MAX), tonic::Code::InvalidArgument, "shm.length"),
        (region.window(0, 0), tonic::Code::InvalidArgument, "shm.length"),
        (region.window(0, 8191), tonic::Code::InvalidArgument, "shm.length"),
        (
            pb::ShmWindow {
                region_id: region.id() ^ 1,
                offset: 0,
                length: 8192,
            },
            tonic::Code::NotFound,
            "shm.region_id",
        ),
    ];
    let status = |result: Result<_, kvtier_client::ClientError>| match result {
        Err(kvtier_client::ClientError::Status(s)) => s,
        other => panic!("{other:?}"),
    };
    for (window, code, field) in refused {
        let refusal = status(client.fetch(fetch(window)).await.map(|_| ()));
        assert_eq!(refusal.code(), code, "{window:?}: {}", refusal.message());
        assert!(
            refusal.message().starts_with(field),
            "{window:?}: {}",
            refusal.message()
        );
        let refusal = status(client.fetch_local(&mut region, fetch(window)).await.map(|_| ()));
        assert_eq!(refusal.code(), code, "local {window:?}: {}", refusal.message());
        assert!(refusal.message().starts_with(field), "local: {}", refusal.message());
        // A selection of 2 pages per head needs 4 KiB of window.
        let window = match window.length {
            8191 => region.window(0, 4095),
            _ => window,
        };
        let mut select = SelectRequest::new(0, 0..2, vec![1.0; 16], 2);
        select.include_data = true;
        select.shm = Some(window);
        let refusal = status(client.select_pages("s", &select).await.map(|_| ()));
        assert_eq!(refusal.code(), code, "{window:?}: {}", refusal.message());
        assert!(
            refusal.message().starts_with(field),
            "{window:?}: {}",
            refusal.message()
        );
        let refusal = status(client.select_pages_local(&mut region, "s", &select).await.map(|_| ()));
        assert_eq!(refusal.code(), code, "local {window:?}: {}", refusal.message());
        assert!(refusal.message().starts_with(field), "local: {}", refusal.message());
    }
    // Over the socket, page bytes go to a region: a call without a window
    // for them, or without a call, is refused naming the field.
    let mut inline_select = SelectRequest::new(0, 0..2, vec![1.0; 16], 2);
    inline_select.include_data = true;
    let calls = [
        (
            pb::local_call::Call::FetchPages(pb::FetchPagesRequest {
                shm: None,
                ..fetch(region.whole())
            }),
            "shm: is required",
        ),
        (
            pb::local_call::Call::SelectPages(pb::SelectPagesRequest {
                sequence_id: "s".into(),
                kv_head_count: 2,
                queries: vec![0u8; 64].into(),
                budget_pages: 2,
                include_data: true,
                ..Default::default()
            }),
            "shm: is required",
        ),
    ];
    for (call, message) in calls {
        let refusal = region
            .call(&pb::LocalCall {
                call: Some(call),
                ..Default::default()
            })
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(refusal.code(), tonic::Code::InvalidArgument, "{}", refusal.message());
        assert!(refusal.message().starts_with(message), "{}", refusal.message());
    }
    let refusal = region.call(&pb::LocalCall::default()).await.unwrap().unwrap_err();
    assert_eq!(refusal.code(), tonic::Code::InvalidArgument);
    assert!(
        refusal.message().starts_with("call: names no call"),
        "{}",
        refusal.message()
    );
    // A selection without data needs no window.
    let ranked = client
        .select_pages_local(&mut region, "s", &SelectRequest::new(0, 0..2, vec![1.0; 16], 2))
        .await
        .unwrap();
    assert_eq!(ranked.heads.len(), 2);
    assert!(ranked.pages.is_empty());
    // Data without include_data, and another tenant's region.
    let mut select = SelectRequest::new(0, 0..2, vec![1.0; 16], 2);
    select.shm = Some(region.whole());
    let status = client.select_pages("s", &select).await.unwrap_err().to_string();
    assert!(status.contains("shm: carries page bytes"), "{status}");
    let mut other = server.client().await.with_tenant("other");
    other.create_sequence("s", layout, vec![]).await.unwrap();
    let status = other.fetch(fetch(region.whole())).await.unwrap_err().to_string();
    assert!(status.contains("shm.region_id"), "{status}");
    assert!(untouched(&region), "a refused call wrote into the region");

    // The same window, large enough, is written, over gRPC and over the
    // region's socket.
    let pages = client.fetch(fetch(region.window(len - 8192, 8192))).await.unwrap();
    assert_eq!(pages.len(), 8);
    assert!(!untouched(&region));
    let window = region.window(len - 8192, 8192);
    let local = client.fetch_local(&mut region, fetch(window)).await.unwrap();
    assert_eq!(local, pages);
}

/// A call dropped before its reply is read still gets its reply read (and
/// discarded) before the next call's: every call is answered with its own
/// reply.
#[tokio::test]
async fn a_dropped_call_never_hands_its_reply_to_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let (server, socket) = server(dir.path()).await;
    let mut client = server.client().await;
    let layout = kvtier_client::layout(1, 4, 4, 64, pb::DType::DtypeF32, 16);
    client.create_sequence("s", layout, vec![]).await.unwrap();
    let mut lanes = vec![LaneData::default(); 4];
    let kv = random_kv(
        pb::DType::DtypeF32,
        64,
        &mut lanes.iter_mut().collect::<Vec<_>>(),
        1024,
        5,
    );
    client.put_pages("s", 0, 0..4, 0, 1024, kv).await.unwrap();
    // Every page: 4 heads × 64 pages × 8 KiB = 2 MiB, too much to be read
    // back before the first poll gives up.
    let every_page = pb::FetchPagesRequest {
        sequence_id: "s".into(),
        kv_head_count: 4,
        ..Default::default()
    };
    let one_page = pb::FetchPagesRequest {
        sequence_id: "s".into(),
        kv_head_count: 1,
        pages: vec![3],
        ..Default::default()
    };
    let mut region = client.register_shm(&socket, 4 << 20).await.unwrap();
    // A first poll that polls for its reply may get it: this is about calls
    // dropped while they sleep on theirs.
    region.set_spin(std::time::Duration::ZERO);
    for dropped in 0..3 {
        // Polled once (which sends it), then dropped, as a timeout or a
        // cancelled task would; `dropped + 1` of them in a row. A call the
        // server answered before its first poll returned was not dropped
        // asleep (a preempted client thread lets that happen): it is tried
        // again, a bounded number of times.
        let mut asleep = 0;
        for _ in 0..50 {
            let mut call = std::pin::pin!(client.fetch_local(&mut region, every_page.clone()));
            let first = std::future::poll_fn(|cx| std::task::Poll::Ready(call.as_mut().poll(cx).is_ready())).await;
            asleep += usize::from(!first);
            if asleep == dropped + 1 {
                break;
            }
        }
        assert_eq!(asleep, dropped + 1, "too many fetches finished within their first poll");
        let pages = client.fetch_local(&mut region, one_page.clone()).await.unwrap();
        assert_eq!(
            pages.iter().map(|p| (p.kv_head, p.page)).collect::<Vec<_>>(),
            [(0, 3)],
            "after {} dropped calls",
            dropped + 1
        );
    }
}

#[tokio::test]
async fn a_stopping_server_ends_its_shm_connections() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("shm.sock");
    let config = ServerConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        metrics_listen: None,
        shm_socket: Some(socket.clone()),
        ..ServerConfig::default()
    };
    let bound = kvtier_server::BoundServer::bind(kvtier_store::Store::new(small_store()).unwrap(), config)
        .await
        .unwrap();
    let client = Client::connect(format!("http://{}", bound.grpc_addr())).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(bound.serve(async {
        let _ = stopped.await;
    }));
    let mut region = client.register_shm(&socket, 1 << 20).await.unwrap();
    let layout = kvtier_client::layout(1, 1, 1, 4, pb::DType::DtypeF32, 4);
    client.clone().create_sequence("s", layout, vec![]).await.unwrap();
    let fetch = pb::FetchPagesRequest {
        sequence_id: "s".into(),
        kv_head_count: 1,
        ..Default::default()
    };
    assert!(client.fetch_local(&mut region, fetch.clone()).await.unwrap().is_empty());
    // The client keeps its region; the server still stops, and its store
    // (which the connection's thread held) with it.
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), serving)
        .await
        .expect("the server stopped within 10 s")
        .unwrap()
        .unwrap();
    let err = client.fetch_local(&mut region, fetch).await.unwrap_err();
    assert!(matches!(err, kvtier_client::ClientError::Shm(_)), "{err:?}");
}

/// Not a test on its own: the child process of the next test, which
/// registers a region and waits to be killed.
#[test]
#[ignore = "run by a_killed_clients_region_is_reclaimed as its child"]
fn shm_child_registers_and_waits() {
    let Some(socket) = std::env::var_os("KVTIER_SHM_CHILD_SOCKET") else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let region = rt
        .block_on(ShmRegion::register(Path::new(&socket), 1 << 20, "", None))
        .unwrap();
    println!("registered {}", region.id());
    std::thread::sleep(Duration::from_secs(120));
}

#[tokio::test]
async fn a_killed_clients_region_is_reclaimed() {
    let dir = tempfile::tempdir().unwrap();
    let (server, socket) = server(dir.path()).await;
    let mut client = server.client().await;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "shm_child_registers_and_waits", "--ignored", "--nocapture"])
        .env("KVTIER_SHM_CHILD_SOCKET", &socket)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let id: u64 = tokio::task::spawn_blocking(move || {
        let lines = std::io::BufReader::new(stdout).lines();
        lines
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix("registered ").map(|id| id.parse().unwrap()))
            .expect("the child registered a region")
    })
    .await
    .unwrap();
    let stats = client.stats().await.unwrap();
    assert_eq!((stats.shm_regions, stats.shm_region_bytes), (1, 1 << 20));

    // The child's region takes this client's pages while the child lives.
    let layout = kvtier_client::layout(1, 1, 1, 4, pb::DType::DtypeF32, 4);
    client.create_sequence("s", layout, vec![]).await.unwrap();
    client
        .put_pages("s", 0, 0..1, 0, 4, vec![1u8; 128].into())
        .await
        .unwrap();
    let fetch = pb::FetchPagesRequest {
        sequence_id: "s".into(),
        kv_head_count: 1,
        shm: Some(pb::ShmWindow {
            region_id: id,
            offset: 0,
            length: 1 << 20,
        }),
        ..Default::default()
    };
    assert_eq!(client.fetch(fetch.clone()).await.unwrap()[0].shm_bytes, 128);

    child.kill().unwrap(); // SIGKILL: no destructor runs
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.stats().await.unwrap().shm_regions != 0 {
        assert!(
            Instant::now() < deadline,
            "the killed client's region is still registered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = client.fetch(fetch).await.unwrap_err().to_string();
    assert!(status.contains("shm.region_id"), "{status}");
}

/// A selection laid out per head (`gather_heads`) is read straight into
/// the window, as one laid out page after page is: it holds nothing in
/// flight, so one larger than responses may hold at once is answered, over
/// gRPC and the socket, with the bytes the straight read gave, each head's
/// K rows in one run then its V rows in another.
#[tokio::test]
async fn a_per_head_layout_is_read_straight_into_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("shm.sock");
    let config = ServerConfig {
        shm_socket: Some(socket.clone()),
        max_message_bytes: 1 << 20,
        // Responses may hold 1 MiB at once.
        max_inflight_bytes: 2 << 20,
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(small_store(), config).await;
    let mut client = server.client().await;
    let mut region = client.register_shm(&socket, REGION).await.unwrap();
    let (heads, dim, tokens) = (2u32, 128u32, 1024u32);
    let layout = kvtier_client::layout(1, heads, heads, dim, pb::DType::DtypeF32, 16);
    client.create_sequence("s", layout, vec![]).await.unwrap();
    let mut lanes = vec![LaneData::default(); heads as usize];
    for first in (0..tokens).step_by(256) {
        let kv = random_kv(
            pb::DType::DtypeF32,
            dim as usize,
            &mut lanes.iter_mut().collect::<Vec<_>>(),
            256,
            5,
        );
        client.put_pages("s", 0, 0..heads, first / 16, 256, kv).await.unwrap();
    }
    // Every page of both heads: 2 MiB, in a window that holds it.
    let mut select = SelectRequest::new(0, 0..heads, vec![0.5; (heads * dim) as usize], tokens / 16);
    select.include_data = true;
    let window = region.window(0, 2 << 20);
    select.shm = Some(window);
    let straight = client.select_pages_local(&mut region, "s", &select).await.unwrap();
    assert_eq!(straight.pages.len(), 2 * 64);
    // Their bytes, taken before the next call writes over them.
    let want: Vec<pb::Page> = straight
        .pages
        .iter()
        .map(|p| pb::Page {
            kv: region.page_bytes(p).unwrap().into(),
            ..p.clone()
        })
        .collect();
    select.gather_heads = true;
    clear(&region);
    let grpc = client.select_pages("s", &select).await.unwrap();
    gathered_pages(&region, &window, &want, &grpc.pages);
    clear(&region);
    let local = client.select_pages_local(&mut region, "s", &select).await.unwrap();
    gathered_pages(&region, &window, &want, &local.pages);
}

/// Polls `future` on this thread with no tokio runtime entered: a
/// registered region may be called from any executor.
fn block_on_without_tokio<F: std::future::Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let std::task::Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// A region's calls that must sleep on their reply (no polling) register
/// with the reactor of the runtime that registered the region when the
/// caller's executor is not a tokio runtime's: the reply arrives, nothing
/// panics.
#[test]
fn a_region_called_outside_any_runtime_sleeps_on_its_reply() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (server, socket) = rt.block_on(server(dir.path()));
    let mut client = rt.block_on(server.client());
    let mut region = rt.block_on(client.register_shm(&socket, REGION)).unwrap();
    region.set_spin(Duration::ZERO);
    let layout = kvtier_client::layout(1, 1, 1, 8, pb::DType::DtypeF32, 4);
    rt.block_on(client.create_sequence("outside", layout, vec![])).unwrap();
    let mut lanes = [LaneData::default()];
    let kv = random_kv(pb::DType::DtypeF32, 8, &mut lanes.iter_mut().collect::<Vec<_>>(), 8, 3);
    rt.block_on(client.put_pages("outside", 0, 0..1, 0, 8, kv)).unwrap();
    let fetch = pb::FetchPagesRequest {
        sequence_id: "outside".to_owned(),
        kv_head_count: 1,
        per_head_pages: vec![pb::PageList { pages: vec![0, 1] }],
        ..Default::default()
    };
    let pages = std::thread::scope(|s| {
        s.spawn(|| {
            assert!(tokio::runtime::Handle::try_current().is_err());
            (0..20)
                .map(|_| block_on_without_tokio(client.fetch_local(&mut region, fetch.clone())).unwrap())
                .last()
                .unwrap()
        })
        .join()
        .unwrap()
    });
    assert_eq!(pages.len(), 2);
    for p in &pages {
        assert_eq!(region.page_bytes(p).unwrap().len(), 2 * 4 * 8 * 4, "page {}", p.page);
    }
}
