//! Tests that read the realkv dataset (real queries and keys of SmolLM2) are
//! compiled as ignored when it is absent, so that `cargo test` reports them
//! as not run, with the reason, instead of passing without testing anything.

use std::path::Path;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kvtier_no_realkv)");
    // Where the tests look (`eval::tests::dataset`), as data/realkv/make.sh
    // builds it; the directory holds the script, so it always exists.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/realkv");
    println!("cargo::rerun-if-changed={}", dir.display());
    if !dir.join("small/meta.json").exists() {
        println!("cargo::rustc-cfg=kvtier_no_realkv");
    }
}
