#!/usr/bin/env bash
# Selection quality on real KV: kvtier eval on realkv/small at page size 16,
# token budgets 64..512 and dense. Writes bench/results/eval.md and eval-*.json.
# Usage: bench/eval.sh [path/to/kvtier] [dataset dir]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
data=${2:-data/realkv/small}
[ -n "${2:-}" ] || data/realkv/make.sh
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p kvtier
  bin=target/release/kvtier
fi
out=bench/results
mkdir -p "$out"
budgets="64 128 256 512 all"
for b in $budgets; do
  "$bin" eval "$data" --page-size 16 --budget-tokens "$b" --sinks 1 --window 1 --aggregation max --json > "$out/eval-$b.json"
done
{
  echo "# kvtier eval on realkv/small"
  echo
  echo "- command: \`bench/eval.sh\` (each budget: \`kvtier eval $data --page-size 16 --budget-tokens B --sinks 1 --window 1 --aggregation max --json\`)"
  echo "- data: SmolLM2-135M real q/k/v (30 layers, 9 query heads, 3 KV heads, d 64, f16), layers 0, 4, 13, 29; decode positions 1984..2047 (the last 64), causal."
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'); date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo "- recall: share of the dense top-B tokens selected; mass: dense attention mass on the selected tokens;"
  echo "  oracle: mass of the best choice of as many pages (true page mass), so oracle − mass is the cost of the bound's looseness;"
  echo "  rel_err: ‖o_sparse − o_dense‖/‖o_dense‖ with the softmax renormalised over the selection; read: bytes read / bytes resident."
  echo "  Means over positions and the 3 query heads of each KV head. Selection is read selection only: nothing is evicted."
  echo
  python3 - "$out" $budgets <<'PY'
import json, sys
out, budgets = sys.argv[1], sys.argv[2:]
reports = {b: json.load(open(f"{out}/eval-{b}.json")) for b in budgets}
print("## Overall\n")
print("| budget | recall | mass | oracle | rel_err | read | digest B/lane |")
print("|---|---:|---:|---:|---:|---:|---:|")
for b, r in reports.items():
    o = r["overall"]
    label = "dense" if b == "all" else f"{b} tokens"
    print(f"| {label} | {o['recall']:.4f} | {o['mass']:.4f} | {o['oracle_mass']:.4f} | {o['rel_err']:.4f} | {o['read_fraction']:.4f} | {o['digest_bytes']} |")
print("\n## Per layer and KV head (recall / mass / oracle / rel_err)\n")
print("| layer | kv_head | " + " | ".join(("dense" if b == "all" else b) for b in budgets) + " |")
print("|---:|---:|" + "---|" * len(budgets))
rows = {}
for b, r in reports.items():
    for row in r["rows"]:
        rows.setdefault((row["layer"], row["kv_head"]), {})[b] = row
for (layer, h), by in sorted(rows.items()):
    cells = [f"{by[b]['recall']:.3f} / {by[b]['mass']:.3f} / {by[b]['oracle_mass']:.3f} / {by[b]['rel_err']:.3f}" for b in budgets]
    print(f"| {layer} | {h} | " + " | ".join(cells) + " |")
PY
} > "$out/eval.md"
cat "$out/eval.md"
