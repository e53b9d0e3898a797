#!/usr/bin/env bash
# Selection modes on real KV: `kvtier eval --mode all` on the realkv dataset
# (layers 4, 13, 29; the last 128 decode positions; GQA group shared, max)
# at budgets of 64–512 tokens, with sinks and window forced (1 page each) and
# without, then each mode's rank time in the decode bench at llama3-8b 32K
# (host holds all, device 25 %), every mode in the same run.
# Writes bench/results/selection.md and bench/results/selection/*.json.
# Usage: bench/selection.sh [path/to/kvtier] [decode steps, default 32]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
steps=${2:-32}
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p kvtier
  bin=target/release/kvtier
fi
data/realkv/make.sh >/dev/null
out=bench/results/selection
mkdir -p "$out"
for budget in 64 128 256 512; do
  for forced in 1 0; do
    "$bin" eval data/realkv/small --layers 4,13,29 --last 128 --budget-tokens "$budget" \
      --sinks "$forced" --window "$forced" --mode all --json > "$out/eval-$budget-forced$forced.json"
  done
done
for mode in quest cuboid sketch two-stage; do
  "$bin" bench decode --preset llama3-8b --context 32768 --steps "$steps" --device-fraction 0.25 \
    --mode "$mode" --out "$out/decode-$mode" --json > "$out/decode-$mode.json"
  rm -rf "$out/decode-$mode"
done
python3 bench/selection_table.py "$out" "$steps" > bench/results/selection.md
echo "wrote bench/results/selection.md"
