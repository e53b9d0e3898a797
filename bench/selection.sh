#!/usr/bin/env bash
# Selection modes on real KV: `kvtier eval --mode all` on both realkv
# datasets (SmolLM2-135M over prose, `small`, and over source code, `code`;
# layers 4, 13, 29; the last 128 decode positions; each mode with its own
# GQA aggregation) at budgets of 64–512 tokens, with sinks and window forced
# (1 page each) and without; the default mode reusing rankings across steps
# at several similarity thresholds; then each mode's rank time in the decode
# bench at llama3-8b 32K (host holds all, device 25 %), every mode in the
# same run; then quest and two-stage with the host at 25 % (the rest on
# NVMe), their rank time and the index's host memory against the host-only
# runs', with sketches kept (the default) and spilled (--spill-sketches
# true). Writes bench/results/selection.md and bench/results/selection/*.json.
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
data/realkv/make.sh data/realkv/code --text textwrap >/dev/null
out=bench/results/selection
mkdir -p "$out"
eval_args=(--layers 4,13,29 --last 128)
for data in small code; do
  for budget in 64 128 256 512; do
    for forced in 1 0; do
      "$bin" eval "data/realkv/$data" "${eval_args[@]}" --budget-tokens "$budget" \
        --sinks "$forced" --window "$forced" --mode all --json > "$out/eval-$data-$budget-forced$forced.json"
    done
  done
  for budget in 64 128; do
    for reuse in 0.95 0.9 0.8 0.7; do
      "$bin" eval "data/realkv/$data" "${eval_args[@]}" --budget-tokens "$budget" --sinks 1 --window 1 \
        --mode two-stage,quest --reuse-similarity "$reuse" --json > "$out/reuse-$data-$budget-$reuse.json"
    done
  done
done
decode() {
  "$bin" bench decode --preset llama3-8b --context 32768 --steps "$steps" --device-fraction 0.25 \
    "$@" --out "$out/decode-run" --json
  rm -rf "$out/decode-run"
}
for mode in quest cuboid sketch two-stage; do
  decode --mode "$mode" > "$out/decode-$mode.json"
done
decode --mode two-stage --reuse-similarity 0.9 > "$out/decode-two-stage-reuse.json"
# The same context with the host holding a quarter: most pages NVMe-only,
# their sketches spilled (read back only for two-stage's candidates).
for mode in quest two-stage; do
  decode --mode "$mode" --host-fraction 0.25 > "$out/decode-nvme-$mode-resident.json"
  decode --mode "$mode" --host-fraction 0.25 --spill-sketches true > "$out/decode-nvme-$mode.json"
done
python3 bench/selection_table.py "$out" "$steps" > bench/results/selection.md
echo "wrote bench/results/selection.md"
