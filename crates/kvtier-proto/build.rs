//! Generates the kvtier.v1 types with protox (a pure-Rust protobuf compiler),
//! so a fresh clone builds without a system `protoc`.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let proto = root.join("kvtier/v1/kvtier.proto");
    let echo = root.join("kvtier/bench/v1/echo.proto");
    for file in [&proto, &echo] {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    let fds = protox::compile([&proto], [&root])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // For the reflection service.
    std::fs::write(out.join("kvtier_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        // Payloads as `bytes::Bytes`: no copy between the HTTP/2 frames and
        // the store (2–3× the throughput of `Vec<u8>` here).
        .bytes(".kvtier.v1")
        .codec_path("crate::codec::KvTierCodec")
        .compile_fds(fds)?;
    // The benchmark's floor, kept out of the descriptor set reflection serves.
    tonic_prost_build::configure()
        .bytes(".kvtier.bench")
        .compile_fds(protox::compile([&echo], [&root])?)?;
    Ok(())
}
