#!/usr/bin/env bash
# Eviction policies against Quest read selection and dense attention on real
# KV, at kept budgets of 256 and 512 tokens per (layer, KV head), with each
# budget allocator; and the failure-test matrix (method x test). Writes
# bench/results/policies/ (one JSON per run, with its command) and
# bench/results/policies.md. Results are deterministic (no timing).
# Usage: bench/policies.sh [path/to/kvtier]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
data=${KVTIER_REALKV:-data/realkv/small}
[ -n "${KVTIER_REALKV:-}" ] || data/realkv/make.sh
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p kvtier
  bin=target/release/kvtier
fi
out=bench/results/policies
rm -rf "$out"
mkdir -p "$out"
for budget in 256 512; do
  for allocator in uniform pyramid ada; do
    cmd="$bin eval $data --policy all --budget-tokens $budget --allocator $allocator --json"
    echo "== $cmd"
    $cmd > "$out/budget$budget-$allocator.json"
    echo "$cmd" > "$out/budget$budget-$allocator.command.txt"
  done
done
python3 - "$out" "$(git rev-parse --short HEAD)" "$(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')" > bench/results/policies.md <<'PY'
import datetime, json, os, sys
out, commit, machine = sys.argv[1:4]
runs = {}
for name in sorted(os.listdir(out)):
    if name.endswith(".json"):
        budget, allocator = name[len("budget"):-len(".json")].split("-")
        runs[(int(budget), allocator)] = json.load(open(os.path.join(out, name)))
first = next(iter(runs.values()))["config"]
print("# Eviction policies vs Quest vs dense on real KV")
print()
print("- command: `bench/policies.sh`; each run's exact command is in `bench/results/policies/*.command.txt`")
print(f"- data: `{first['dataset']}` (SmolLM2-135M, layers {first['layers']}), page {first['page_size']},"
      f" decode positions {first['positions'][0]}..={first['positions'][-1]}")
print(f"- machine: {machine}; date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}; commit {commit}")
print("- policies run through the store's ApplyPolicy with action `evict`: prefill attention reported for every")
print("  prefill query, the policy applied at the end of prefill and after every decode token (SnapKV once, after")
print("  prefill, from its 32-query observation window; max-mass from the last 32 queries). Measured at every decode")
print("  position against dense f64 attention, averaged over layers, query heads and positions.")
print("- columns kept apart (DESIGN.md §2): `mass` = dense attention mass on what the query could use; `recall` =")
print("  share of the dense top-k tokens (k = budget) available; `rel_err` = output error vs dense; `compression` =")
print("  capacity compression (original / kept bytes; 1 when nothing is removed); `read` = read sparsity (bytes read")
print("  / bytes resident); `kept` = tokens held per (layer, KV head); `dropped` = dropped mass the store reported")
print("  for its observed queries (SnapKV, max-mass).")
print()
for budget in sorted({b for b, _ in runs}):
    print(f"## Kept budget {budget} tokens")
    print()
    print("| method | allocator | mass | recall | rel_err | compression | read | kept | dropped |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    seen = set()
    for allocator in ["uniform", "pyramid", "ada"]:
        for r in runs[(budget, allocator)]["policy"]:
            if r["allocator"] is None and r["method"] in seen:
                continue
            seen.add(r["method"])
            dropped = "-" if r["dropped_mass"] is None else f"{r['dropped_mass']:.4f}"
            print(f"| {r['method']} | {r['allocator'] or '-'} | {r['mass']:.4f} | {r['recall']:.4f} | {r['rel_err']:.4f} |"
                  f" {r['capacity_compression']:.2f} | {r['read_sparsity']:.4f} | {r['kept_tokens']:.1f} | {dropped} |")
    print()
    layers = [l["layer"] for l in runs[(budget, "uniform")]["policy"][0]["per_layer"]]
    print(f"Per layer, uniform allocator: mass / rel_err (kept tokens per KV head)")
    print()
    print("| method | " + " | ".join(f"layer {l}" for l in layers) + " |")
    print("|---|" + "---:|" * len(layers))
    for r in runs[(budget, "uniform")]["policy"]:
        cells = [f"{q['mass']:.3f} / {q['rel_err']:.3f} ({q['kept_tokens']:.0f})" for q in r["per_layer"]]
        print(f"| {r['method']} | " + " | ".join(cells) + " |")
    print()
print("## Failure tests (uniform allocator)")
print()
print("Planted keys with the data's typical deviation from the mean key (as ordinary as any other key), needed by")
print("the final query; `yes` = the final query could use it (policy: still held; Quest: selected within the budget).")
print()
for budget in sorted({b for b, _ in runs}):
    tests = runs[(budget, "uniform")]["failure_tests"]
    methods = list(dict.fromkeys(t["method"] for t in tests))
    for data in ["synthetic", "realkv"]:
        names = list(dict.fromkeys(t["name"] for t in tests if t["data"] == data))
        print(f"### budget {budget}, {data}")
        print()
        print("| test | " + " | ".join(methods) + " |")
        print("|---|" + "---|" * len(methods))
        for n in names:
            row = {t["method"]: t["passed"] for t in tests if t["data"] == data and t["name"] == n}
            print(f"| {n} | " + " | ".join("yes" if row[m] else "**no**" for m in methods) + " |")
        print()
PY
echo "wrote bench/results/policies.md"
