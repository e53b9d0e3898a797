//! Valid requests of every method over three sequences (three layouts, two
//! tenants), and the ways the fuzzer bends them.

use bytes::Bytes;
use kvtier_client::pb;
use prost::Message;

use crate::common::raw::frame;
use crate::rng::Rng;
use crate::wire;

pub(crate) use kvtier_client::pb::METHODS;

const TENANTS: [&str; 2] = ["", "t"];

/// (layers, KV heads, query heads, head_dim, dtype, page size) of `s0..s2`.
const LAYOUTS: [(u32, u32, u32, u32, pb::DType, u32); 3] = [
    (2, 2, 4, 8, pb::DType::DtypeF16, 4),
    (1, 1, 1, 4, pb::DType::DtypeF32, 2),
    (2, 1, 2, 16, pb::DType::DtypeBf16, 8),
];

/// Fields the fuzzer mostly leaves alone, so that mutated requests reach a
/// sequence that exists: tenant and sequence id.
const NAMES: [u32; 2] = [1, 2];

pub(crate) struct Corpus {
    valid: Vec<(&'static str, Vec<u8>)>,
}

fn layout(i: usize) -> pb::Layout {
    let (layers, heads, queries, dim, dtype, page) = LAYOUTS[i];
    kvtier_client::layout(layers, heads, queries, dim, dtype, page)
}

fn element_bytes(dtype: pb::DType) -> usize {
    if dtype == pb::DType::DtypeF32 { 4 } else { 2 }
}

/// Finite values of every kind of magnitude, as `dtype` bytes.
fn kv(dtype: pb::DType, elements: usize, seed: usize) -> Bytes {
    let mut out = Vec::with_capacity(elements * 4);
    for i in 0..elements {
        let v = ((i * 7 + seed * 13) % 23) as f32 - 11.0;
        match dtype {
            pb::DType::DtypeF32 => out.extend(v.to_le_bytes()),
            pb::DType::DtypeF16 => out.extend(half::f16::from_f32(v).to_le_bytes()),
            _ => out.extend(half::bf16::from_f32(v).to_le_bytes()),
        }
    }
    out.into()
}

fn floats(n: usize) -> Bytes {
    (0..n)
        .flat_map(|i| ((i % 5) as f32 - 2.0).to_le_bytes())
        .collect::<Vec<u8>>()
        .into()
}

impl Corpus {
    pub(crate) fn new() -> Self {
        let mut valid: Vec<(&'static str, Vec<u8>)> = Vec::new();
        let mut add = |method: &'static str, m: &dyn Fn() -> Vec<u8>| valid.push((method, m()));
        for tenant in TENANTS {
            for (s, &(layers, heads, queries, dim, dtype, page)) in LAYOUTS.iter().enumerate() {
                let (t, id) = (tenant.to_owned(), format!("s{s}"));
                let group = queries / heads;
                let row = dim as usize * element_bytes(dtype);
                add("CreateSequence", &|| {
                    pb::CreateSequenceRequest {
                        tenant: t.clone(),
                        sequence_id: id.clone(),
                        layout: Some(layout(s)),
                        prefix_hashes: vec![vec![1u8; 8].into(), vec![2u8; 8].into()],
                        group: None,
                    }
                    .encode_to_vec()
                });
                add("GetSequence", &|| {
                    pb::GetSequenceRequest {
                        tenant: t.clone(),
                        sequence_id: id.clone(),
                    }
                    .encode_to_vec()
                });
                add("LookupPrefix", &|| {
                    pb::LookupPrefixRequest {
                        tenant: t.clone(),
                        layout: Some(layout(s)),
                        prefix_hashes: vec![vec![1u8; 8].into(), vec![2u8; 8].into()],
                    }
                    .encode_to_vec()
                });
                add("DropSequence", &|| {
                    pb::DropSequenceRequest {
                        tenant: t.clone(),
                        sequence_id: id.clone(),
                    }
                    .encode_to_vec()
                });
                for (first_page, pages, persist) in [(0, 2, false), (2, 1, true), (3, 3, false)] {
                    let tokens = pages * page;
                    add("PutPages", &|| {
                        pb::PutPagesRequest {
                            tenant: t.clone(),
                            sequence_id: id.clone(),
                            layer: layers - 1,
                            kv_head_start: 0,
                            kv_head_count: heads,
                            first_page,
                            num_tokens: tokens,
                            kv: kv(dtype, (2 * heads * tokens) as usize * row / element_bytes(dtype), s),
                            persist,
                        }
                        .encode_to_vec()
                    });
                }
                for (tokens, position) in [(1, None), (3, Some(0)), (page + 1, None)] {
                    add("AppendTokens", &|| {
                        pb::AppendTokensRequest {
                            tenant: t.clone(),
                            sequence_id: id.clone(),
                            layer: 0,
                            kv_head_start: 0,
                            kv_head_count: heads,
                            num_tokens: tokens,
                            kv: kv(dtype, (2 * heads * tokens) as usize * row / element_bytes(dtype), s + 1),
                            position,
                            persist: tokens == 3,
                        }
                        .encode_to_vec()
                    });
                }
                for (pages, digests, chunk) in [(vec![], true, 0), (vec![0, 2], false, 64)] {
                    add("FetchPages", &|| {
                        pb::FetchPagesRequest {
                            tenant: t.clone(),
                            sequence_id: id.clone(),
                            layer: 0,
                            kv_head_start: 0,
                            kv_head_count: heads,
                            pages: pages.clone(),
                            max_chunk_bytes: chunk,
                            include_digests: digests,
                            per_head_pages: vec![],
                            // No region is registered: the window's checks.
                            shm: (chunk > 0).then_some(pb::ShmWindow {
                                region_id: 1,
                                offset: 64,
                                length: 4096,
                            }),
                        }
                        .encode_to_vec()
                    });
                }
                let select =
                    |data: bool, swap: bool, lease: u32, aggregation: pb::Aggregation, mode: pb::SelectionMode| {
                        let mass = matches!(mode, pb::SelectionMode::Sketch | pb::SelectionMode::TwoStage);
                        pb::SelectPagesRequest {
                            tenant: t.clone(),
                            sequence_id: id.clone(),
                            layer: 0,
                            kv_head_start: 0,
                            kv_head_count: heads,
                            queries: floats((heads * group * dim) as usize),
                            budget_pages: 3,
                            sink_pages: 1,
                            window_pages: 1,
                            aggregation: aggregation as i32,
                            shard: None,
                            include_data: data,
                            max_chunk_bytes: 0,
                            swap_in: swap,
                            deadline_us: if swap { 5_000 } else { 0 },
                            prefetch_pages: 1,
                            lease_ms: lease,
                            shm: (data && !swap).then_some(pb::ShmWindow {
                                region_id: 1,
                                offset: 0,
                                length: 1 << 20,
                            }),
                            mode: mode as i32,
                            candidates: if mass { 2 } else { 0 },
                            softmax_scale: 0.0,
                            top_p: if mass { 0.9 } else { 0.0 },
                            min_pages: if mass { 2 } else { 0 },
                            // Reuse across calls with the mass modes.
                            reuse_similarity: if mass { 0.9 } else { 0.0 },
                            // Each head's rows laid out together where a window takes them.
                            gather_heads: data && !swap && lease == 0,
                            // Attending where no page comes back.
                            attend: !data && !swap,
                            // A decode step's token with the leased selections.
                            append: (lease > 0).then(|| pb::AppendAfterSelection {
                                num_tokens: 1,
                                kv: kv(dtype, 2 * heads as usize * row / element_bytes(dtype), s + 2),
                                position: None,
                                persist: false,
                            }),
                        }
                    };
                for (data, swap, lease, aggregation, mode) in [
                    (true, false, 0, pb::Aggregation::Max, pb::SelectionMode::Quest),
                    (false, true, 50, pb::Aggregation::Mean, pb::SelectionMode::TwoStage),
                    (true, true, 0, pb::Aggregation::PerQueryHead, pb::SelectionMode::Sketch),
                    (false, false, 0, pb::Aggregation::Max, pb::SelectionMode::Cuboid),
                ] {
                    add("SelectPages", &|| {
                        select(data, swap, lease, aggregation, mode).encode_to_vec()
                    });
                }
                add("Prefetch", &|| {
                    select(false, false, 0, pb::Aggregation::Max, pb::SelectionMode::Unspecified).encode_to_vec()
                });
                add("ReleaseLease", &|| {
                    pb::ReleaseLeaseRequest {
                        lease_id: 1,
                        tenant: t.clone(),
                    }
                    .encode_to_vec()
                });
                use pb::set_page_state_request::Action;
                for action in [
                    Action::Offload(pb::Offload {
                        tier: pb::Tier::Nvme as i32,
                    }),
                    Action::Offload(pb::Offload {
                        tier: pb::Tier::Host as i32,
                    }),
                    Action::SwapIn(pb::SwapIn {}),
                    Action::Migrate(pb::Migrate {
                        tier: pb::Tier::Host as i32,
                    }),
                    Action::Summarize(pb::Summarize { rows: 2 }),
                    Action::Evict(pb::Evict {}),
                ] {
                    add("SetPageState", &|| {
                        pb::SetPageStateRequest {
                            tenant: t.clone(),
                            sequence_id: id.clone(),
                            layer_start: 0,
                            layer_count: layers,
                            kv_head_start: 0,
                            kv_head_count: heads,
                            first_page: 1,
                            page_count: 1,
                            pages: vec![],
                            action: Some(action),
                        }
                        .encode_to_vec()
                    });
                }
                use pb::apply_policy_request::Action as PolicyAction;
                use pb::policy::{Allocator, Scorer};
                for (scorer, allocator, queries) in [
                    (
                        Scorer::Streaming(pb::StreamingPolicy { sink_tokens: 2 }),
                        Allocator::Uniform(pb::UniformAllocator {}),
                        false,
                    ),
                    (
                        Scorer::H2o(pb::H2oPolicy::default()),
                        Allocator::Pyramid(pb::PyramidAllocator::default()),
                        false,
                    ),
                    (
                        Scorer::Snapkv(pb::SnapKvPolicy::default()),
                        Allocator::Ada(pb::AdaAllocator::default()),
                        true,
                    ),
                    (
                        Scorer::Tova(pb::TovaPolicy::default()),
                        Allocator::Uniform(pb::UniformAllocator {}),
                        true,
                    ),
                    (
                        Scorer::MaxMass(pb::MaxMassPolicy::default()),
                        Allocator::Uniform(pb::UniformAllocator {}),
                        true,
                    ),
                ] {
                    add("ApplyPolicy", &|| {
                        pb::ApplyPolicyRequest {
                            tenant: t.clone(),
                            sequence_id: id.clone(),
                            layer_start: 0,
                            layer_count: 1,
                            policy: Some(pb::Policy {
                                scorer: Some(scorer),
                                allocator: Some(allocator),
                            }),
                            budget_tokens: page * 2,
                            action: Some(PolicyAction::Offload(pb::Offload {
                                tier: pb::Tier::Host as i32,
                            })),
                            queries: if queries {
                                floats((queries as u32 * group * heads * dim) as usize)
                            } else {
                                Bytes::new()
                            },
                            trigger: 0,
                            every_tokens: 0,
                        }
                        .encode_to_vec()
                    });
                }
                for pages in [false, true] {
                    add("ReportAttention", &|| {
                        pb::ReportAttentionRequest {
                            tenant: t.clone(),
                            sequence_id: id.clone(),
                            layer: 0,
                            kv_head_start: 0,
                            kv_head_count: heads,
                            token_weights: if pages { vec![] } else { vec![0.25; 4 * heads as usize] },
                            page_weights: if pages { vec![0.5; heads as usize] } else { vec![] },
                            decay: 0.5,
                        }
                        .encode_to_vec()
                    });
                }
            }
            add("GetStats", &|| {
                pb::GetStatsRequest {
                    tenant: Some(tenant.to_owned()),
                }
                .encode_to_vec()
            });
        }
        add("GetStats", &|| pb::GetStatsRequest { tenant: None }.encode_to_vec());
        // A standalone server refuses these: the fuzzer sees that it stays so.
        add("GetCluster", &|| pb::GetClusterRequest {}.encode_to_vec());
        add("DrainNode", &|| {
            pb::DrainNodeRequest {
                node_id: "n0".into(),
                parallel: 2,
                stay: true,
            }
            .encode_to_vec()
        });
        add("MoveSequence", &|| {
            pb::MoveSequenceRequest {
                part: Some(pb::move_sequence_request::Part::Header(pb::MoveHeader {
                    tenant: "a".into(),
                    sequence_id: "m".into(),
                    layout: Some(layout(0)),
                    incarnation: 7,
                    from_node: "n1".into(),
                    ..pb::MoveHeader::default()
                })),
            }
            .encode_to_vec()
        });
        for (record, sample_rate, max_bytes) in [(true, 0.5, 64 << 10), (true, 0.0, 0), (false, 0.0, 0)] {
            add("SetAccessTrace", &|| {
                pb::SetAccessTraceRequest {
                    record,
                    sample_rate,
                    max_bytes,
                }
                .encode_to_vec()
            });
        }
        Self { valid }
    }

    fn pick(&self, rng: &mut Rng, method: &str) -> Vec<u8> {
        let of: Vec<&Vec<u8>> = self
            .valid
            .iter()
            .filter(|(m, _)| *m == method)
            .map(|(_, b)| b)
            .collect();
        of[rng.below(of.len() as u64) as usize].clone()
    }

    /// A request body for `method`: what kind of request it is, the body
    /// (framed), and the message when it is one well-formed message.
    pub(crate) fn request(&self, rng: &mut Rng, method: &str) -> (&'static str, Bytes, Option<Vec<u8>>) {
        let messages = if method == "PutPages" { 1 + rng.below(3) } else { 1 };
        let roll = rng.below(100);
        let kind = match roll {
            0..35 => "valid",
            35..85 => "mutated",
            85..93 => "raw-bytes",
            93..98 => "bad-framing",
            _ => "unknown-method",
        };
        let mut bodies = Vec::new();
        for _ in 0..messages {
            let mut m = self.pick(rng, method);
            match kind {
                "mutated" => {
                    let mut fields = wire::parse(&m).expect("the corpus is well-formed");
                    let keep: &[u32] = if rng.chance(85) { &NAMES } else { &[] };
                    for _ in 0..1 + rng.below(4) {
                        wire::mutate(rng, &mut fields, keep, 0);
                    }
                    m = wire::encode(&fields);
                }
                "raw-bytes" => match rng.below(3) {
                    0 => m.truncate(rng.below(m.len() as u64 + 1) as usize),
                    1 if !m.is_empty() => {
                        for _ in 0..1 + rng.below(8) {
                            let i = rng.below(m.len() as u64) as usize;
                            m[i] = rng.next() as u8;
                        }
                    }
                    _ => {
                        let n = rng.below(256) as usize;
                        m = rng.bytes(n);
                    }
                },
                _ => {}
            }
            bodies.push(m);
        }
        let mut body: Vec<u8> = bodies.iter().flat_map(|m| frame(0, m.len() as u32, m)).collect();
        if kind == "bad-framing" {
            match rng.below(4) {
                0 => body[0] = 1 + rng.below(255) as u8,
                1 => body.truncate(rng.below(body.len() as u64) as usize),
                2 => body[1..5].copy_from_slice(&(rng.next() as u32).to_be_bytes()),
                _ => {
                    let n = 1 + rng.below(8) as usize;
                    body.extend(rng.bytes(n));
                }
            }
        }
        let sent = (messages == 1 && matches!(kind, "valid" | "mutated" | "raw-bytes")).then(|| bodies.remove(0));
        (kind, body.into(), sent)
    }
}
