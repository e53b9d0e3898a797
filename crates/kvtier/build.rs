//! Tests that read the realkv dataset (real queries and keys of SmolLM2) are
//! compiled as ignored when it is absent, so that `cargo test` reports them
//! as not run, with the reason, instead of passing without testing anything.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kvtier_no_realkv)");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // Where the tests look (`eval::tests::dataset`): built in the repository
    // (data/realkv/make.sh), or beside it.
    let dirs: [PathBuf; 2] = [root.join("data/realkv"), root.join("../shared/data/realkv")];
    for dir in dirs.iter().filter(|d| d.exists()) {
        println!("cargo::rerun-if-changed={}", dir.display());
    }
    if !dirs.iter().any(|d| d.join("small/meta.json").exists()) {
        println!("cargo::rustc-cfg=kvtier_no_realkv");
    }
}
