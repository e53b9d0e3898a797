#!/usr/bin/env bash
# Scoring-engine bandwidth: digest bytes scored per second vs memcpy of the
# same bytes, same run. Writes bench/results/select.md and select.jsonl.
# Usage: bench/select.sh [path/to/kvtier]   (default: builds the release binary)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p kvtier
  bin=target/release/kvtier
fi
out=bench/results
mkdir -p "$out"
jsonl=$out/select.jsonl
: > "$jsonl"
for group in 1 4; do
  for d in 64 128; do
    for dtype in f16 bf16 f32; do
      for pages in 1024 4096 16384 65536 131072; do
        "$bin" bench select --pages "$pages" --head-dim "$d" --dtype "$dtype" --group "$group" --json >> "$jsonl"
      done
    done
  done
done
{
  echo "# kvtier bench select"
  echo
  echo "- command: \`bench/select.sh\` (each row: \`kvtier bench select --pages N --head-dim D --dtype T --group G --json\`)"
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(free -g | awk '/Mem:/{print $2}') GiB"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo "- digest_gbps: digest bytes scored per second (median); memcpy_gbps: a memcpy of the same bytes in the same run;"
  echo "  ratio = digest_gbps / memcpy_gbps (target ≥ 0.5). group = query heads scored per pass (GQA group)."
  echo
  echo "| group | d | dtype | pages | digest MiB | kernel | digest GB/s | memcpy GB/s | ratio | scalar GB/s | score+top-64 µs |"
  echo "|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|"
  python3 - "$jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"| {r['group']} | {r['head_dim']} | {r['dtype']} | {r['pages']} | {r['digest_bytes']/2**20:.2f} | {r['kernel']} | "
          f"{r['digest_gbps']:.2f} | {r['memcpy_gbps']:.2f} | {r['ratio']:.2f} | {r['scalar_gbps']:.2f} | {r['select_seconds']*1e6:.0f} |")
PY
} > "$out/select.md"
cat "$out/select.md"
