#!/usr/bin/env bash
# A decode step's ranking: every lane's digest column scored over all cores
# (as the store ranks a selection's lanes), against reading the same bytes
# over all cores, in the same run. Shape: llama3-8b at 32K context (32
# layers × 8 KV heads = 256 lanes of 2048 pages, head_dim 128, GQA group 4).
# Writes bench/results/select-step.md and .jsonl.
# Usage: bench/select-step.sh [path/to/kvtier]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p kvtier
  bin=target/release/kvtier
fi
out=bench/results
jsonl=$out/select-step.jsonl
: > "$jsonl"
for dtype in bf16 f16; do
  "$bin" bench select --lanes 256 --pages 2048 --head-dim 128 --group 4 --dtype "$dtype" --budget-pages 32 --runs 15 --json >> "$jsonl"
done
{
  echo "# A decode step's digest scan over all cores"
  echo
  echo "- command: \`bench/select-step.sh\` (each row: \`kvtier bench select --lanes 256 --pages 2048 --head-dim 128 --group 4 --dtype T --budget-pages 32 --runs 15 --json\`)"
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(free -g | awk '/Mem:/{print $2" GiB"}'); $(uname -r)"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo "- scan: every lane scored once (medians); read: a sum over the same bytes on the same threads, the memory"
  echo "  bandwidth of all cores; ratio = scan GB/s / read GB/s (the bar: ≥ 0.7)."
  echo
  echo "| dtype | lanes × pages | digest MiB | threads | kernel | scan ms | scan GB/s | all-core read GB/s | ratio | one thread GB/s | speed-up | scan + top-32 GB/s |"
  echo "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"
  python3 - "$jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"| {r['dtype']} | {r['lanes']} × {r['pages']} | {r['digest_bytes']/2**20:.0f} | {r['threads']} | {r['kernel']} | "
          f"{r['scan_seconds']*1e3:.1f} | {r['scan_gbps']:.1f} | {r['read_gbps']:.1f} | {r['ratio']:.2f} | "
          f"{r['serial_scan_gbps']:.1f} | {r['scan_gbps']/r['serial_scan_gbps']:.2f} | {r['scan_select_gbps']:.1f} |")
PY
} > "$out/select-step.md"
cat "$out/select-step.md"
