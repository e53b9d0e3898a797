#!/usr/bin/env bash
# Builds, on an x86-64 build machine, what bench/gpu-check.sh runs on a GPU
# machine that has no Rust toolchain: the release `kvtier` binary and the
# kvtier-cuda test executable, copied into bench/gpu-bin/ (git-ignored; carry
# it along with the repository).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -q -p kvtier
tests=$(cargo test --release --locked -q -p kvtier-cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "kvtier_cuda":
        print(m["executable"])')
mkdir -p bench/gpu-bin
# Stripped: the release profile keeps debug info, and the device tool
# carries at most 64 MiB.
strip -o bench/gpu-bin/kvtier target/release/kvtier
strip -o bench/gpu-bin/kvtier-cuda-tests "$tests"
# The GPU machine's copy of the tree may have no git: the results name this.
git rev-parse --short HEAD > bench/gpu-bin/COMMIT
ls -l bench/gpu-bin
