#!/usr/bin/env bash
# The resident-memory bound under a hostile mix (crates/kvtier/tests/memory.rs:
# the real release binary, 40 connections: sequences at the layout maxima,
# the largest writes, oversized requests, large fetches and selections,
# growing statistics), run longer than CI does, once with the whole mix and
# once per kind of client. Writes bench/results/memory.md.
# Usage: bench/memory.sh [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
out=bench/results/memory.md
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
cargo test --release --locked -q -p kvtier --test memory --no-run
run() { # run <label> [kinds]
  KVTIER_MEMORY_SECONDS=$seconds KVTIER_MEMORY_KINDS=${2:-} KVTIER_MEMORY_OUT="$tmp" \
    cargo test --release --locked -q -p kvtier --test memory -- --nocapture >/dev/null
  echo "| $1 | $(cat "$tmp") |"
}
{
  echo "# Resident memory under a hostile mix"
  echo
  echo "Command: \`bench/memory.sh $seconds\`  "
  echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB; $(uname -sr)  "
  echo "Date: $(date -u +%F)"
  echo
  echo "Server: device 16 MiB (emulated), host 32 MiB, NVMe 256 MiB, metadata budget 32 MiB,"
  echo "in flight 32 MiB, messages up to 4 MiB, 48 connections. Bound asserted: tiers + 1.5 ×"
  echo "metadata + 3 × in flight + 96 MiB = 288 MiB. Kinds: 0 sequences at the layout maxima"
  echo "and mid-sized ones until refused; 1, 2 largest writes, then the whole sequence fetched"
  echo "and selected with data; 3 oversized requests; 4 appends with growing attention statistics."
  echo
  echo "| mix | result |"
  echo "|---|---|"
  run "all kinds"
  for k in 0 1 3 4; do run "kind $k only" "$k"; done
} > "$out"
echo "wrote $out"
