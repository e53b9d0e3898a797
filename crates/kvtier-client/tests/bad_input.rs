//! Every kind of bad input gets its status code, a message that starts with
//! the offending field, and changes nothing.

mod common;

use bytes::Bytes;
use common::{LaneData, TestServer, random_kv};
use kvtier_client::pb::set_page_state_request::Action;
use kvtier_client::{Client, ClientError, actions, pb};
use tonic::Code;

const DTYPE: pb::DType = pb::DType::DtypeF16;

fn layout() -> pb::Layout {
    kvtier_client::layout(2, 2, 4, 8, DTYPE, 4)
}

/// Observable state: the sequence, its pages, and the server's counters.
async fn observe(client: &mut Client) -> (pb::SequenceInfo, Vec<pb::Page>, pb::Stats) {
    let info = client.get_sequence("s").await.unwrap();
    let mut pages = Vec::new();
    for layer in 0..2 {
        pages.extend(client.fetch_pages("s", layer, 0..2, vec![]).await.unwrap());
    }
    let mut stats = client.stats().await.unwrap();
    stats.bytes_read = 0; // our own reads move this one
    (info, pages, stats)
}

fn kv(heads: usize, tokens: usize) -> Bytes {
    let mut lanes = vec![LaneData::default(); heads];
    let mut refs: Vec<&mut LaneData> = lanes.iter_mut().collect();
    random_kv(DTYPE, 8, &mut refs, tokens, 42)
}

fn put(layer: u32, heads: (u32, u32), first_page: u32, num_tokens: u32, kv: Bytes) -> pb::PutPagesRequest {
    pb::PutPagesRequest {
        tenant: String::new(),
        sequence_id: "s".into(),
        layer,
        kv_head_start: heads.0,
        kv_head_count: heads.1,
        first_page,
        num_tokens,
        kv,
        persist: false,
    }
}

fn expect(result: Result<impl std::fmt::Debug, ClientError>, code: Code, field: &str) {
    match result {
        Err(ClientError::Status(s)) => {
            assert_eq!(s.code(), code, "{}", s.message());
            assert!(
                s.message().starts_with(field),
                "message {:?} should start with {field:?}",
                s.message()
            );
        }
        other => panic!("expected {code:?} naming {field}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_precisely_and_change_nothing() {
    let server = TestServer::default().await;
    let mut client = server.client().await;
    client.create_sequence("s", layout(), vec![]).await.unwrap();
    let w = client.page_write("s", 0, 0..2, 0, 6, kv(2, 6));
    client.put_page_stream(vec![w]).await.unwrap();
    let before = observe(&mut client).await;

    // CreateSequence.
    let mut c = client.clone();
    let create = |layout: Option<pb::Layout>, id: &str, hashes: Vec<Bytes>| pb::CreateSequenceRequest {
        tenant: String::new(),
        sequence_id: id.into(),
        layout,
        prefix_hashes: hashes,
        group: None,
    };
    let grouped = |rank: u32, world: u32, name: &str| pb::CreateSequenceRequest {
        group: Some(pb::PlacementGroup {
            name: name.into(),
            rank,
            world,
        }),
        ..create(Some(layout()), "g", vec![])
    };
    let with = |f: fn(&mut pb::Layout)| {
        let mut l = layout();
        f(&mut l);
        Some(l)
    };
    let cases: Vec<(pb::CreateSequenceRequest, Code, &str)> = vec![
        (create(None, "n", vec![]), Code::InvalidArgument, "layout:"),
        (grouped(2, 2, "g"), Code::InvalidArgument, "group.rank:"),
        (grouped(0, 0, "g"), Code::InvalidArgument, "group.world:"),
        (grouped(0, 5000, "g"), Code::InvalidArgument, "group.world:"),
        (grouped(0, 2, ""), Code::InvalidArgument, "group.name:"),
        (
            create(with(|l| l.dtype = 0), "n", vec![]),
            Code::InvalidArgument,
            "layout.dtype:",
        ),
        (
            create(with(|l| l.dtype = 99), "n", vec![]),
            Code::InvalidArgument,
            "layout.dtype:",
        ),
        (
            create(with(|l| l.page_size = 0), "n", vec![]),
            Code::InvalidArgument,
            "layout.page_size:",
        ),
        (
            create(with(|l| l.page_size = 2048), "n", vec![]),
            Code::InvalidArgument,
            "layout.page_size:",
        ),
        (
            create(with(|l| l.num_query_heads = 3), "n", vec![]),
            Code::InvalidArgument,
            "layout.num_query_heads:",
        ),
        (
            create(with(|l| l.head_dim = 0), "n", vec![]),
            Code::InvalidArgument,
            "layout.head_dim:",
        ),
        (
            create(with(|l| l.num_layers = 0), "n", vec![]),
            Code::InvalidArgument,
            "layout.num_layers:",
        ),
        (
            create(
                with(|l| {
                    l.layer_groups = vec![pb::LayerGroup {
                        first_layer: 1,
                        num_layers: 2,
                    }]
                }),
                "n",
                vec![],
            ),
            Code::InvalidArgument,
            "layout.layer_groups[0]:",
        ),
        (
            create(Some(layout()), "", vec![]),
            Code::InvalidArgument,
            "sequence_id:",
        ),
        (
            create(Some(layout()), "n", vec![Bytes::from(vec![1u8; 65])]),
            Code::InvalidArgument,
            "prefix_hashes[0]:",
        ),
        (
            create(Some(layout()), "n", vec![Bytes::new()]),
            Code::InvalidArgument,
            "prefix_hashes[0]:",
        ),
        (
            create(Some(layout()), "s", vec![]),
            Code::AlreadyExists,
            "sequence default/s",
        ),
    ];
    for (req, code, field) in cases {
        expect(
            c.raw().create_sequence(req).await.map_err(ClientError::from),
            code,
            field,
        );
    }
    let mut bad_tenant = pb::CreateSequenceRequest {
        tenant: "a/b".into(),
        ..create(Some(layout()), "n", vec![])
    };
    expect(
        c.raw()
            .create_sequence(bad_tenant.clone())
            .await
            .map_err(ClientError::from),
        Code::InvalidArgument,
        "tenant:",
    );
    bad_tenant.tenant = "x".repeat(65);
    expect(
        c.raw().create_sequence(bad_tenant).await.map_err(ClientError::from),
        Code::InvalidArgument,
        "tenant:",
    );

    // PutPages (the message names the write within the stream).
    let mut nan = kv(2, 4).to_vec();
    nan[2 * 5..2 * 5 + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
    let mut inf_value_ok = kv(1, 4).to_vec();
    let v_start = 4 * 8 * 2;
    inf_value_ok[v_start..v_start + 2].copy_from_slice(&half::f16::INFINITY.to_le_bytes());
    let puts: Vec<(pb::PutPagesRequest, Code, &str)> = vec![
        (put(1, (0, 2), 0, 4, kv(2, 3)), Code::InvalidArgument, "write 0: kv:"),
        (
            put(1, (0, 2), 0, 4, Bytes::new()),
            Code::InvalidArgument,
            "write 0: kv:",
        ),
        (put(2, (0, 2), 0, 4, kv(2, 4)), Code::InvalidArgument, "write 0: layer:"),
        (
            put(1, (0, 0), 0, 4, Bytes::new()),
            Code::InvalidArgument,
            "write 0: kv_head_count:",
        ),
        (
            put(1, (1, 2), 0, 4, kv(2, 4)),
            Code::InvalidArgument,
            "write 0: kv_head_count:",
        ),
        (
            put(1, (2, 1), 0, 4, kv(1, 4)),
            Code::InvalidArgument,
            "write 0: kv_head_start:",
        ),
        (
            put(1, (u32::MAX, 2), 0, 4, kv(2, 4)),
            Code::InvalidArgument,
            "write 0: kv_head_start:",
        ),
        (
            put(1, (0, 2), 0, 0, Bytes::new()),
            Code::InvalidArgument,
            "write 0: num_tokens:",
        ),
        (put(1, (0, 2), 0, 4, nan.into()), Code::InvalidArgument, "write 0: kv:"),
        (
            pb::PutPagesRequest {
                persist: true,
                ..put(1, (0, 2), 0, 4, kv(2, 4))
            },
            Code::FailedPrecondition,
            "write 0: persist:",
        ),
        (
            put(1, (0, 2), 1, 4, kv(2, 4)),
            Code::FailedPrecondition,
            "write 0: first_page:",
        ),
        (
            put(0, (0, 2), 2, 4, kv(2, 4)),
            Code::FailedPrecondition,
            "write 0: first_page:",
        ),
        (
            put(0, (0, 2), 1, 4, kv(2, 4)),
            Code::FailedPrecondition,
            "write 0: first_page:",
        ),
        (
            pb::PutPagesRequest {
                sequence_id: "nope".into(),
                ..put(1, (0, 2), 0, 4, kv(2, 4))
            },
            Code::NotFound,
            "write 0: sequence default/nope",
        ),
        (
            pb::PutPagesRequest {
                sequence_id: String::new(),
                ..put(1, (0, 2), 0, 4, kv(2, 4))
            },
            Code::InvalidArgument,
            "write 0: sequence_id:",
        ),
    ];
    for (req, code, field) in puts {
        expect(c.put_page_stream(vec![req]).await, code, field);
    }
    // AppendTokens.
    let append = |heads: (u32, u32), n: u32, kv: Bytes, position: Option<u64>| pb::AppendTokensRequest {
        tenant: String::new(),
        sequence_id: "s".into(),
        layer: 0,
        kv_head_start: heads.0,
        kv_head_count: heads.1,
        num_tokens: n,
        kv,
        position,
        persist: false,
    };
    let appends: Vec<(pb::AppendTokensRequest, Code, &str)> = vec![
        (append((0, 2), 2, kv(2, 1), None), Code::InvalidArgument, "kv:"),
        (
            append((0, 2), 0, Bytes::new(), None),
            Code::InvalidArgument,
            "num_tokens:",
        ),
        (
            append((0, 3), 1, kv(3, 1), None),
            Code::InvalidArgument,
            "kv_head_count:",
        ),
        (
            append((0, 2), 1, kv(2, 1), Some(5)),
            Code::FailedPrecondition,
            "position:",
        ),
        (
            pb::AppendTokensRequest {
                layer: 9,
                ..append((0, 2), 1, kv(2, 1), None)
            },
            Code::InvalidArgument,
            "layer:",
        ),
    ];
    for (req, code, field) in appends {
        expect(c.raw().append_tokens(req).await.map_err(ClientError::from), code, field);
    }

    // FetchPages.
    let fetch = |pages: Vec<u32>| pb::FetchPagesRequest {
        sequence_id: "s".into(),
        kv_head_count: 2,
        pages,
        ..Default::default()
    };
    expect(c.fetch(fetch(vec![0, 2])).await, Code::InvalidArgument, "pages[1]:");
    expect(
        c.fetch(pb::FetchPagesRequest {
            layer: 2,
            ..fetch(vec![])
        })
        .await,
        Code::InvalidArgument,
        "layer:",
    );
    let lists = |l: &[&[u32]]| l.iter().map(|p| pb::PageList { pages: p.to_vec() }).collect();
    expect(
        c.fetch(pb::FetchPagesRequest {
            per_head_pages: lists(&[&[0]]),
            ..fetch(vec![])
        })
        .await,
        Code::InvalidArgument,
        "per_head_pages:",
    );
    expect(
        c.fetch(pb::FetchPagesRequest {
            per_head_pages: lists(&[&[0], &[1]]),
            ..fetch(vec![0])
        })
        .await,
        Code::InvalidArgument,
        "per_head_pages:",
    );
    expect(
        c.fetch(pb::FetchPagesRequest {
            per_head_pages: lists(&[&[0], &[1, 0, 5]]),
            ..fetch(vec![])
        })
        .await,
        Code::InvalidArgument,
        "per_head_pages[1].pages[2]:",
    );
    expect(
        c.fetch(pb::FetchPagesRequest {
            max_chunk_bytes: 64 << 20,
            ..fetch(vec![])
        })
        .await,
        Code::InvalidArgument,
        "max_chunk_bytes:",
    );
    expect(
        c.fetch(pb::FetchPagesRequest {
            sequence_id: "nope".into(),
            ..fetch(vec![])
        })
        .await,
        Code::NotFound,
        "sequence default/nope",
    );

    // SetPageState.
    let set = |action: Option<Action>| pb::SetPageStateRequest {
        tenant: String::new(),
        sequence_id: "s".into(),
        layer_start: 0,
        layer_count: 1,
        kv_head_start: 0,
        kv_head_count: 2,
        first_page: 0,
        page_count: 1,
        pages: vec![],
        action,
    };
    let tier = |t: pb::Tier| Some(Action::Offload(pb::Offload { tier: t as i32 }));
    let sets: Vec<(pb::SetPageStateRequest, Code, &str)> = vec![
        (set(None), Code::InvalidArgument, "action:"),
        (set(tier(pb::Tier::Unspecified)), Code::InvalidArgument, "offload.tier:"),
        (set(tier(pb::Tier::Device)), Code::InvalidArgument, "offload.tier:"),
        (
            set(Some(Action::Offload(pb::Offload { tier: 17 }))),
            Code::InvalidArgument,
            "offload.tier:",
        ),
        (
            set(Some(actions::summarize(0))),
            Code::InvalidArgument,
            "summarize.rows:",
        ),
        (
            pb::SetPageStateRequest {
                layer_count: 0,
                ..set(Some(actions::evict()))
            },
            Code::InvalidArgument,
            "layer_count:",
        ),
        (
            pb::SetPageStateRequest {
                layer_count: 3,
                ..set(Some(actions::evict()))
            },
            Code::InvalidArgument,
            "layer_count:",
        ),
        (
            pb::SetPageStateRequest {
                kv_head_start: 2,
                kv_head_count: 1,
                ..set(Some(actions::evict()))
            },
            Code::InvalidArgument,
            "kv_head_start:",
        ),
        (
            pb::SetPageStateRequest {
                page_count: 3,
                ..set(Some(actions::evict()))
            },
            Code::InvalidArgument,
            "page_count:",
        ),
        (
            pb::SetPageStateRequest {
                layer_start: 1,
                ..set(Some(actions::evict()))
            },
            Code::InvalidArgument,
            "page_count:",
        ),
        (
            pb::SetPageStateRequest {
                first_page: 5,
                page_count: 0,
                ..set(Some(actions::evict()))
            },
            Code::InvalidArgument,
            "first_page:",
        ),
        (
            pb::SetPageStateRequest {
                page_count: 0,
                pages: vec![1, 0, 1],
                ..set(Some(actions::evict()))
            },
            Code::InvalidArgument,
            "pages[2]:",
        ),
        (
            pb::SetPageStateRequest {
                page_count: 0,
                pages: vec![0, 7],
                ..set(Some(actions::evict()))
            },
            Code::InvalidArgument,
            "pages[1]:",
        ),
        (
            pb::SetPageStateRequest {
                pages: vec![0],
                ..set(Some(actions::evict()))
            },
            Code::InvalidArgument,
            "pages:",
        ),
        (
            pb::SetPageStateRequest {
                sequence_id: "nope".into(),
                ..set(Some(actions::evict()))
            },
            Code::NotFound,
            "sequence default/nope",
        ),
    ];
    for (req, code, field) in sets {
        expect(
            c.raw().set_page_state(req).await.map_err(ClientError::from),
            code,
            field,
        );
    }

    // GetSequence / DropSequence of what does not exist.
    expect(c.get_sequence("nope").await, Code::NotFound, "sequence default/nope");
    expect(c.drop_sequence("nope").await, Code::NotFound, "sequence default/nope");

    assert_eq!(
        observe(&mut client).await,
        before,
        "a refused request changed something"
    );

    // A bad write after a good one in one stream: the error names write 1,
    // and write 0 stays applied (values may be infinite; keys may not).
    expect(
        c.put_page_stream(vec![
            put(1, (0, 1), 0, 4, inf_value_ok.into()),
            put(1, (0, 2), 0, 4, kv(1, 4)),
        ])
        .await,
        Code::InvalidArgument,
        "write 1: kv:",
    );
    let layer1 = client.fetch_pages("s", 1, 0..1, vec![]).await.unwrap();
    assert_eq!((layer1.len(), layer1[0].tokens), (1, 4));
    assert!(client.fetch_pages("s", 1, 1..2, vec![]).await.unwrap().is_empty());
}
