//! Access traces recorded by the real `kvtier serve`: `kvtier tune` on a
//! server's own recording predicts the device misses the server served; a
//! recording started over gRPC keeps every access of the pages its sample
//! keeps and none of the others, stops at its size bound, and is an admin's
//! call.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{Server, kvtier};
use kvtier_client::{Client, pb};
use kvtier_store::{Access, TraceHeader, TraceRecord};

/// The records of a trace file, after its header.
fn records(path: &Path) -> (TraceHeader, Vec<TraceRecord>) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    let header = serde_json::from_str(lines.next().unwrap()).unwrap();
    (header, lines.map(|l| serde_json::from_str(l).unwrap()).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tune_on_a_servers_recording_predicts_the_device_misses_it_served() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("server.trace");
    let device = 512u64 << 10;
    let mut server = Server::start(
        dir.path(),
        &[
            "--device-bytes",
            &device.to_string(),
            "--host-bytes",
            "64MiB",
            "--nvme-bytes",
            "0",
            "--access-trace",
            trace.to_str().unwrap(),
        ],
    );
    server.client().await;
    let out = dir.path().join("bench");
    let bench = kvtier(&[
        "bench",
        "decode",
        "--addr",
        &server.addr,
        "--preset",
        "custom",
        "--dtype",
        "f16",
        "--layers",
        "4",
        "--kv-heads",
        "2",
        "--query-heads",
        "8",
        "--head-dim",
        "64",
        "--context",
        "512",
        "--steps",
        "40",
        "--budget-pages",
        "8",
        "--drift",
        "0.2",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ]);
    server.terminate(); // finishes the recording
    let bench: serde_json::Value = serde_json::from_str(&bench).unwrap();
    let measured = bench["device_miss_ratio"].as_f64().unwrap();
    assert!(
        (0.05..0.95).contains(&measured),
        "the device must hold some of the pages a step selects, not all: {measured}"
    );

    // The recording agrees with itself: each swap-in's pages by source
    // tier are the ones its report counts.
    let (header, recorded) = records(&trace);
    assert_eq!((header.source.as_str(), header.sample), ("server", 1.0));
    let hot: Vec<&Access> = recorded
        .iter()
        .filter_map(|r| match r {
            TraceRecord::Read(a) if a.hot => Some(a),
            _ => None,
        })
        .collect();
    assert_eq!(hot.len(), 4 * 40, "one swap-in per layer per step");
    for a in &hot {
        let from: String = a.heads.iter().map(|h| h.from.as_str()).collect();
        let swap = a.swap.unwrap();
        assert_eq!(from.matches('H').count(), swap.from_host as usize, "{a:?}");
        assert_eq!(from.matches('N').count(), swap.from_nvme as usize, "{a:?}");
    }
    assert!(
        recorded
            .iter()
            .any(|r| matches!(r, TraceRecord::Write(a) if !a.heads.is_empty()))
    );

    // Tune, asked about exactly the server's device size.
    let plots = dir.path().join("tune");
    let tune = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "tune",
            trace.to_str().unwrap(),
            "--json",
            "--out",
            plots.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        serde_json::from_str(&kvtier(&args)).unwrap()
    };
    let working_set = tune(&[])["working_set_bytes"].as_u64().unwrap();
    let fraction = (device as f64 + 0.5) / working_set as f64;
    let predicted = tune(&["--device-fraction", &fraction.to_string()])["at"][0]["device_miss_ratio"]
        .as_f64()
        .unwrap();
    println!("device miss ratio: tune predicted {predicted:.4} from the recording; the server served {measured:.4}");
    assert!(
        (predicted - measured).abs() <= 0.02,
        "predicted {predicted}, the server served {measured}"
    );
}

/// One page's accesses: (layer, KV head, page).
type Page = (u32, u32, u32);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recordings_over_grpc_are_sampled_bounded_and_for_admins() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("kvtier.toml");
    let (admin_token, tenant_token) = ("admin-0123456789abcdef", "tenant-0123456789abcdef");
    std::fs::write(
        &config,
        format!(
            "[[auth.tokens]]\ntoken = \"{admin_token}\"\nadmin = true\n\
             [[auth.tokens]]\ntoken = \"{tenant_token}\"\ntenant = \"a\"\n"
        ),
    )
    .unwrap();
    let server = Server::start(dir.path(), &["--config", config.to_str().unwrap()]);
    let connect = |token: &str| {
        let (addr, token) = (server.addr.clone(), token.to_owned());
        async move {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            loop {
                if let Ok(c) = Client::connect(addr.clone()).await {
                    return c.with_token(&token).unwrap();
                }
                assert!(std::time::Instant::now() < deadline, "the server did not come up");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    };
    let mut admin = connect(admin_token).await;
    let mut tenant = connect(tenant_token).await.with_tenant("a");

    let code = |r: Result<pb::AccessTraceStatus, kvtier_client::ClientError>| match r {
        Err(kvtier_client::ClientError::Status(s)) => (s.code(), s.message().to_owned()),
        other => panic!("expected a refusal, got {other:?}"),
    };
    let (c, m) = code(tenant.start_access_trace(0.0, 0).await);
    assert_eq!(c, tonic::Code::PermissionDenied, "{m}");
    let (c, m) = code(admin.start_access_trace(1.5, 0).await);
    assert_eq!(c, tonic::Code::InvalidArgument);
    assert!(m.starts_with("sample_rate:"), "{m}");
    let req = pb::SetAccessTraceRequest {
        max_bytes: 10,
        ..Default::default()
    };
    let req = admin.request(req);
    let (c, m) = code(
        admin
            .raw()
            .set_access_trace(req)
            .await
            .map(tonic::Response::into_inner)
            .map_err(Into::into),
    );
    assert_eq!(c, tonic::Code::InvalidArgument);
    assert!(m.starts_with("max_bytes:"), "{m}");
    assert_eq!(
        admin.stop_access_trace().await.unwrap(),
        pb::AccessTraceStatus::default()
    );

    // Sampled at a half: a kept page keeps every access.
    let started = admin.start_access_trace(0.5, 0).await.unwrap();
    assert!(started.recording);
    assert!(
        Path::new(&started.path).starts_with(dir.path().join("traces")),
        "{}",
        started.path
    );
    let (c, m) = code(admin.start_access_trace(0.5, 0).await);
    assert_eq!(c, tonic::Code::FailedPrecondition);
    assert!(m.starts_with("record:"), "{m}");
    let fetched = workload(&mut tenant).await;
    let stopped = admin.stop_access_trace().await.unwrap();
    assert!(
        !stopped.recording && !stopped.full && stopped.dropped == 0,
        "{stopped:?}"
    );
    let (header, recorded) = records(Path::new(&stopped.path));
    assert_eq!(header.sample, 0.5);
    let mut seen: HashMap<Page, u32> = HashMap::new();
    for r in &recorded {
        if let TraceRecord::Read(a) = r {
            assert!(!a.hot);
            for h in &a.heads {
                assert!(h.from.chars().all(|c| "DHN".contains(c)), "{h:?}");
                for &p in &h.pages {
                    *seen.entry((a.layer, h.head, p)).or_default() += 1;
                }
            }
        }
    }
    for (page, count) in &seen {
        assert_eq!(Some(count), fetched.get(page), "page {page:?}: every access or none");
    }
    let kept = seen.len() as f64 / fetched.len() as f64;
    assert!(
        (0.35..=0.65).contains(&kept),
        "kept {kept} of the pages at a rate of 0.5"
    );

    // A name dropped and created again with another layout is another
    // sequence: the recording describes it again, and tune reads both.
    admin.start_access_trace(1.0, 0).await.unwrap();
    for (layers, heads) in [(2, 2), (3, 1)] {
        let layout = kvtier_client::layout(layers, heads, heads * 2, 8, pb::DType::DtypeF16, 16);
        tenant.create_sequence("again", layout, vec![]).await.unwrap();
        let kv = vec![1u8; heads as usize * 32 * 2 * 8 * 2];
        tenant
            .put_pages("again", layers - 1, 0..heads, 0, 32, kv.into())
            .await
            .unwrap();
        let req = pb::FetchPagesRequest {
            sequence_id: "again".into(),
            layer: layers - 1,
            kv_head_count: heads,
            ..Default::default()
        };
        tenant.fetch(req).await.unwrap();
        tenant.drop_sequence("again").await.unwrap();
    }
    let stopped = admin.stop_access_trace().await.unwrap();
    let (_, recorded) = records(Path::new(&stopped.path));
    let shapes: Vec<[u32; 4]> = recorded
        .iter()
        .filter_map(|r| match r {
            TraceRecord::Sequence { shape, .. } => Some(*shape),
            _ => None,
        })
        .collect();
    assert_eq!(shapes, [[2, 2, 4, 8], [3, 1, 2, 8]]);
    assert_eq!(
        recorded
            .iter()
            .filter(|r| matches!(r, TraceRecord::Drop { .. }))
            .count(),
        2
    );
    let plots = dir.path().join("tune-again");
    kvtier(&["tune", &stopped.path, "--json", "--out", plots.to_str().unwrap()]);

    // Bounded: the file stops at its bound and says so.
    let started = admin.start_access_trace(1.0, 2048).await.unwrap();
    workload(&mut tenant).await;
    let stopped = admin.stop_access_trace().await.unwrap();
    assert!(
        stopped.full && stopped.dropped > 0 && stopped.bytes <= 2048,
        "{stopped:?}"
    );
    let text = std::fs::read_to_string(&started.path).unwrap();
    let last = text.lines().last().unwrap();
    assert!(text.len() <= 2048 + last.len() + 1, "{} bytes", text.len());
    match serde_json::from_str(last).unwrap() {
        TraceRecord::End { reason, dropped } => {
            assert_eq!(reason, "max_bytes");
            assert_eq!(dropped, stopped.dropped);
        }
        other => panic!("the last record is {other:?}"),
    }
    server.terminate();
}

/// A fresh sequence of 2 layers × 2 KV heads × 64 pages, each page fetched
/// a known number of times; those counts.
async fn workload(client: &mut Client) -> HashMap<Page, u32> {
    let id = format!("s{}", rand_suffix());
    let layout = kvtier_client::layout(2, 2, 4, 8, pb::DType::DtypeF16, 16);
    client.create_sequence(&id, layout, vec![]).await.unwrap();
    let tokens = 64 * 16;
    for layer in 0..2 {
        let kv = vec![1u8; 2 * tokens * 2 * 8 * 2];
        client
            .put_pages(&id, layer, 0..2, 0, tokens as u32, kv.into())
            .await
            .unwrap();
    }
    let mut counts = HashMap::new();
    for round in 0..3u32 {
        for layer in 0..2u32 {
            let lists: Vec<Vec<u32>> = (0..2u32)
                .map(|head| (0..64u32).filter(|p| (p * 7 + round + layer + head) % 3 != 0).collect())
                .collect();
            for (head, list) in lists.iter().enumerate() {
                for &p in list {
                    *counts.entry((layer, head as u32, p)).or_default() += 1;
                }
            }
            let req = pb::FetchPagesRequest {
                sequence_id: id.clone(),
                layer,
                kv_head_count: 2,
                per_head_pages: lists.into_iter().map(|pages| pb::PageList { pages }).collect(),
                ..Default::default()
            };
            client.fetch(req).await.unwrap();
        }
    }
    counts
}

fn rand_suffix() -> u64 {
    kvtier_store::random_id()
}
