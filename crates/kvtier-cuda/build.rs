//! Without a CUDA driver on the build machine, the GPU tests are compiled as
//! ignored (`cargo test` reports them as not run, with the reason) instead of
//! passing without testing anything. `cargo test -- --include-ignored` runs
//! them, on a GPU machine, from binaries built anywhere; `KVTIER_REQUIRE_GPU`
//! at build time compiles them as ordinary tests.

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kvtier_no_gpu)");
    println!("cargo::rerun-if-env-changed=KVTIER_REQUIRE_GPU");
    if std::env::var_os("KVTIER_REQUIRE_GPU").is_none() && !driver_present() {
        println!("cargo::rustc-cfg=kvtier_no_gpu");
    }
}

/// Whether the dynamic loader can find the CUDA driver library.
fn driver_present() -> bool {
    let listed = Command::new("ldconfig")
        .arg("-p")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("libcuda.so.1"));
    listed
        || [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib/wsl/lib",
        ]
        .iter()
        .any(|dir| Path::new(dir).join("libcuda.so.1").exists())
}
