//! `kvtier bench fetch` replays a decode run's recorded selections through
//! every path it compares (inline, the shm data plane over gRPC and over
//! the region's socket, the echo answering each fetch's bytes), and each
//! path serves every byte the selections asked for.

mod common;

use common::kvtier;

#[test]
fn every_path_serves_the_recorded_selections_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("decode.trace");
    let (kv_heads, budget_pages, layers, steps) = (2u64, 4u64, 2u64, 6u64);
    kvtier(&[
        "bench",
        "decode",
        "--preset",
        "custom",
        "--dtype",
        "f16",
        "--layers",
        &layers.to_string(),
        "--kv-heads",
        &kv_heads.to_string(),
        "--query-heads",
        "4",
        "--head-dim",
        "64",
        "--context",
        "512",
        "--steps",
        &steps.to_string(),
        "--budget-pages",
        &budget_pages.to_string(),
        "--out",
        dir.path().join("decode").to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
    ]);
    let report: serde_json::Value = serde_json::from_str(&kvtier(&[
        "bench",
        "fetch",
        "--trace",
        trace.to_str().unwrap(),
        "--json",
    ]))
    .unwrap();

    let fetches = report["fetches"].as_u64().unwrap();
    assert_eq!(fetches, layers * steps, "one fetch per (step, layer)");
    let page_bytes = report["page_bytes"].as_u64().unwrap();
    let inline = &report["kvtier"];
    let bytes = inline["bytes"].as_u64().unwrap();
    assert_eq!(
        bytes,
        fetches * kv_heads * budget_pages * page_bytes,
        "every selected page, once"
    );
    for path in ["kvtier_shm", "kvtier_local", "kvtier_local_polling", "echo_sized"] {
        assert_eq!(report[path]["bytes"], bytes, "{path}");
        assert_eq!(report[path]["fetches"], fetches, "{path}");
    }
    assert!(report["echo_p50_us"].as_u64().unwrap() > 0);
    assert!(report["inline_over_echo_sized_p50"].as_f64().unwrap() > 0.0);
    assert!(report["redis"].is_null() && report["echo_sized_ratio_p50"].is_null());
}
