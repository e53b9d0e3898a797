//! A seeded fuzzer over the whole gRPC surface, against a real server with
//! all three tiers (the NVMe one on a real file) and small limits.
//!
//! It sends valid requests of every method (so that sequences exist and
//! hold pages), the same requests mutated field by field at the protobuf
//! wire level (edge values, off-by-one lengths, fields dropped, repeated,
//! added or mistyped, nested messages mutated in turn), raw byte mutations
//! and broken gRPC framing. Some of the FetchPages, SelectPages and
//! AppendTokens calls go over an shm region's socket instead (the same
//! messages as `kvtier.v1.LocalCall` frames, most of them naming the
//! region, and raw bytes as calls). Every answer must be a status the API
//! documents for a client's mistake or a refusal: never INTERNAL or
//! UNKNOWN, never a hang (each call has a watchdog), and the socket's
//! connection never drops. At the end every lease is released and
//! every sequence it created is dropped, and the server must hold nothing:
//! no sequence, page, lease, metadata or memory-tier byte.
//!
//! `KVTIER_FUZZ_CALLS` (default 5000) and `KVTIER_FUZZ_SEED` (default: from
//! the clock, printed) size and replay a run; `KVTIER_FUZZ_OUT` names a file
//! for the run's counts as JSON. `bench/fuzz.sh` runs it long.

#[path = "../common/mod.rs"]
mod common;
mod corpus;
mod rng;
mod wire;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::TestServer;
use common::raw::{self, Answer};
use kvtier_client::pb;
use kvtier_server::ServerConfig;
use kvtier_store::{EngineChoice, Limits, NvmeConfig, Quota, StoreConfig};
use prost::Message;
use tonic::Code;
use tonic::transport::Channel;

use corpus::{Corpus, METHODS};
use rng::Rng;

/// Longest any call may take before the run counts it as a hang.
const WATCHDOG: Duration = Duration::from_secs(20);

/// Codes that mean a bug, whatever the request.
const NEVER: [Code; 4] = [Code::Internal, Code::Unknown, Code::DataLoss, Code::DeadlineExceeded];

/// The call, or a panic if it takes longer than the watchdog allows.
async fn call(channel: &mut Channel, path: &str, body: Bytes) -> Answer {
    match tokio::time::timeout(WATCHDOG, raw::call(channel, path, body)).await {
        Ok(answer) => answer,
        Err(_) => panic!("{path}: no answer in {WATCHDOG:?}: a hang"),
    }
}

/// The LocalCall field that carries `method`'s request, if it goes over the
/// shm socket.
fn local_field(method: &str) -> Option<u8> {
    match method {
        "FetchPages" => Some(1),
        "SelectPages" => Some(2),
        "AppendTokens" => Some(3),
        _ => None,
    }
}

/// `message` with its `shm` window set to `window`, if it decodes as the
/// request of `method` (the others are sent as they are).
fn naming(method: &str, message: &[u8], window: pb::ShmWindow) -> Option<Vec<u8>> {
    match method {
        "FetchPages" => pb::FetchPagesRequest::decode(message)
            .ok()
            .map(|r| pb::FetchPagesRequest { shm: Some(window), ..r }.encode_to_vec()),
        "SelectPages" => pb::SelectPagesRequest::decode(message).ok().map(|r| {
            pb::SelectPagesRequest {
                shm: r.include_data.then_some(window),
                ..r
            }
            .encode_to_vec()
        }),
        _ => None,
    }
}

/// A `LocalCall` whose field `field` (a request message) holds `message`.
fn local_call(field: u8, message: &[u8]) -> Vec<u8> {
    let mut call = vec![(field << 3) | 2];
    prost::encoding::encode_varint(message.len() as u64, &mut call);
    call.extend_from_slice(message);
    call
}

/// What a run did, per method and code.
#[derive(Default)]
struct Counts {
    calls: BTreeMap<String, BTreeMap<String, u64>>,
    kinds: BTreeMap<&'static str, u64>,
}

impl Counts {
    fn add(&mut self, method: &str, kind: &'static str, code: Code) {
        *self
            .calls
            .entry(method.to_owned())
            .or_default()
            .entry(format!("{code:?}"))
            .or_default() += 1;
        *self.kinds.entry(kind).or_default() += 1;
    }

    fn json(&self, seed: u64, calls: u64, seconds: f64) -> String {
        let methods: Vec<String> = self
            .calls
            .iter()
            .map(|(m, codes)| {
                let codes: Vec<String> = codes.iter().map(|(c, n)| format!("\"{c}\": {n}")).collect();
                format!("    \"{m}\": {{{}}}", codes.join(", "))
            })
            .collect();
        let kinds: Vec<String> = self.kinds.iter().map(|(k, n)| format!("\"{k}\": {n}")).collect();
        format!(
            "{{\n  \"seed\": {seed},\n  \"calls\": {calls},\n  \"seconds\": {seconds:.1},\n  \"kinds\": {{{}}},\n  \"methods\": {{\n{}\n  }}\n}}\n",
            kinds.join(", "),
            methods.join(",\n")
        )
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn no_request_crashes_hangs_or_leaks() {
    let calls = env_u64("KVTIER_FUZZ_CALLS").unwrap_or(5000);
    let seed = env_u64("KVTIER_FUZZ_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    });
    println!("fuzz: seed {seed}, {calls} calls (KVTIER_FUZZ_SEED={seed} replays this run)");
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start_with(
        StoreConfig {
            device_bytes: 256 << 10,
            host_bytes: 1 << 20,
            nvme: Some(NvmeConfig {
                path: dir.path().join("nvme"),
                capacity: 16 << 20,
                engine: EngineChoice::Auto,
                queue_depth: 8,
                direct: true,
            }),
            manifest_path: Some(dir.path().join("manifest")),
            limits: Limits {
                metadata_bytes: 8 << 20,
                default_quota: Quota {
                    sequences: Some(64),
                    ..Quota::default()
                },
                ..Limits::default()
            },
            ..StoreConfig::default()
        },
        ServerConfig {
            max_message_bytes: 256 << 10,
            max_inflight_bytes: 1 << 20,
            access_trace_dir: Some(dir.path().join("traces")),
            access_trace_max_bytes: 1 << 20,
            shm_socket: Some(dir.path().join("shm.sock")),
            ..ServerConfig::default()
        },
    )
    .await;
    let mut region = server
        .client()
        .await
        .register_shm(&dir.path().join("shm.sock"), 1 << 20)
        .await
        .unwrap();
    let mut channel = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let corpus = Corpus::new();
    let mut rng = Rng::new(seed);
    let mut counts = Counts::default();
    let mut created: HashSet<(String, String)> = HashSet::new();
    let mut leases: HashSet<(String, u64)> = HashSet::new();
    let mut failures = Vec::new();
    let started = Instant::now();
    for i in 0..calls {
        let method = *rng.pick(&METHODS);
        let (kind, body, sent) = corpus.request(&mut rng, method);
        if let (Some(field), Some(message)) = (local_field(method), &sent)
            && rng.chance(40)
        {
            // Over the region's socket: mostly naming the region, now and
            // then raw bytes as the whole call.
            let call = match rng.below(20) {
                0 => {
                    let n = rng.below(64) as usize;
                    rng.bytes(n)
                }
                1 => Vec::new(), // a call naming no method
                2..14 => local_call(
                    field,
                    &naming(method, message, region.whole()).unwrap_or_else(|| message.clone()),
                ),
                _ => local_call(field, message),
            };
            let answer = match tokio::time::timeout(WATCHDOG, region.call_encoded(&call)).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(e)) => panic!("seed {seed}: call {i} ({kind} local {method}): the connection broke: {e}"),
                Err(_) => panic!("seed {seed}: call {i} ({kind} local {method}): no answer in {WATCHDOG:?}: a hang"),
            };
            let code = answer.as_ref().map_or_else(tonic::Status::code, |_| Code::Ok);
            counts.add(&format!("local {method}"), kind, code);
            if NEVER.contains(&code) || code == Code::Unimplemented {
                let why = answer
                    .as_ref()
                    .err()
                    .map(|s| s.message().to_owned())
                    .unwrap_or_default();
                failures.push(format!("call {i} ({kind} local {method}): {code:?} {why}"));
                if failures.len() >= 10 {
                    break;
                }
            }
            if let (Ok(reply), Ok(r)) = (&answer, pb::SelectPagesRequest::decode(message.as_slice())) {
                for m in &reply.select_pages {
                    if m.lease_id != 0 {
                        leases.insert((r.tenant.clone(), m.lease_id));
                    }
                }
            }
            continue;
        }
        let path = if kind == "unknown-method" {
            format!("/kvtier.v1.KvTier/{method}Nope")
        } else {
            format!("/kvtier.v1.KvTier/{method}")
        };
        let answer = call(&mut channel, &path, body).await;
        counts.add(method, kind, answer.code);
        let expected_unimplemented = kind == "unknown-method";
        if NEVER.contains(&answer.code) || (answer.code == Code::Unimplemented) != expected_unimplemented {
            failures.push(format!(
                "call {i} ({kind} {method}): {:?} {}",
                answer.code, answer.message
            ));
            if failures.len() >= 10 {
                break;
            }
        }
        if answer.code != Code::Ok {
            continue;
        }
        // Track what must be given back at the end.
        match (method, sent.as_deref().map(Bytes::copy_from_slice)) {
            ("CreateSequence", Some(m)) => {
                let r = pb::CreateSequenceRequest::decode(m).unwrap();
                created.insert((r.tenant, r.sequence_id));
            }
            ("SelectPages", Some(m)) => {
                let r = pb::SelectPagesRequest::decode(m).unwrap();
                for msg in &answer.messages {
                    let lease = pb::SelectPagesResponse::decode(msg.clone()).unwrap().lease_id;
                    if lease != 0 {
                        leases.insert((r.tenant.clone(), lease));
                    }
                }
            }
            _ => {}
        }
    }
    let summary = counts.json(seed, calls, started.elapsed().as_secs_f64());
    println!("{summary}");
    assert!(failures.is_empty(), "seed {seed}:\n{}", failures.join("\n"));

    // Everything given back, nothing may be left.
    let mut client = server.client().await;
    for (tenant, id) in leases {
        let _ = client.clone().with_tenant(tenant).release_lease(id).await;
    }
    for (tenant, id) in created {
        let _ = client.clone().with_tenant(tenant).drop_sequence(&id).await;
    }
    let stats = client.stats().await.unwrap();
    let memory_used: u64 = stats
        .tiers
        .iter()
        .filter(|t| t.tier != pb::Tier::Nvme as i32)
        .map(|t| t.used_bytes)
        .sum();
    assert_eq!(
        (
            stats.sequences,
            stats.physical_pages,
            stats.leases,
            stats.metadata_bytes,
            memory_used
        ),
        (0, 0, 0, 0, 0),
        "seed {seed}: left after giving everything back: {stats:?}"
    );
    // And it still serves a valid round trip.
    let layout = kvtier_client::layout(1, 1, 1, 4, pb::DType::DtypeF32, 4);
    client.create_sequence("after", layout, vec![]).await.unwrap();
    let kv: Vec<u8> = (0..2 * 4 * 4 * 4).map(|i| i as u8).collect();
    client
        .put_pages("after", 0, 0..1, 0, 4, kv.clone().into())
        .await
        .unwrap();
    let pages = client.fetch_pages("after", 0, 0..1, vec![]).await.unwrap();
    assert_eq!(pages[0].kv.as_ref(), &kv[..]);
    // Only a run that found nothing leaves its counts.
    if let Ok(path) = std::env::var("KVTIER_FUZZ_OUT") {
        std::fs::write(&path, summary).unwrap_or_else(|e| panic!("writing {path}: {e}"));
    }
}
