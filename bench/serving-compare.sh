#!/usr/bin/env bash
# The serving path before and after a change, back to back in one run: the
# decode bench at llama3-8b 32K (host holds the whole sequence, the device
# 25 %), with a `kvtier` built at the commit before and one built now (inline,
# over the shm data plane with its calls over the region's socket, and the
# same data plane with its calls over gRPC). The four run in turn, `rounds`
# times over (default 3), so that a slow minute of this shared machine falls
# on every binary alike: each round's ratios compare runs made within a few
# seconds of each other, and the table pools each run's steps over the rounds.
# Writes bench/results/serving-compare.md, with each run's report under
# bench/results/serving-compare/ (plots for the first round only).
# Usage: BEFORE_COMMIT=<sha> bench/serving-compare.sh BEFORE_BIN [AFTER_BIN] [steps] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: bench/serving-compare.sh BEFORE_BIN [AFTER_BIN] [steps] [rounds]}
after=${2:-}
steps=${3:-128}
rounds=${4:-3}
if [ -z "$after" ]; then
  cargo build --release --locked -q -p kvtier
  after=target/release/kvtier
fi
out=bench/results/serving-compare
rm -rf "$out"
mkdir -p "$out"
args=(bench decode --preset llama3-8b --context 32768 --steps "$steps" --budget-pages 32 --sinks 1 --window 1
  --drift 0.1 --host-fraction 1.0 --device-fraction 0.25)
run() {
  local name=$1 bin=$2; shift 2
  echo "== $name: $bin ${args[*]} $*"
  "$bin" "${args[@]}" "$@" --out "$out/$name" > "$out/$name.txt"
  echo "$bin ${args[*]} $* --out $out/$name" > "$out/$name/command.txt"
  case $name in *-r1) ;; *) rm -f "$out/$name"/*.png "$out/$name"/*.svg ;; esac
}
for r in $(seq "$rounds"); do
  run "before-r$r" "$before"
  # `before` predates ranking modes and ranks by Quest's bound; the after runs
  # rank the same way, so that the serving path is what differs.
  run "after-inline-r$r" "$after" --mode quest
  run "after-shm-r$r" "$after" --mode quest --data-plane shm
  run "after-shm-grpc-r$r" "$after" --mode quest --data-plane shm-grpc
done
{
  echo "# Decode steps before and after the serving-path work"
  echo
  echo "- command: \`bench/serving-compare.sh $before $after $steps $rounds\`; each run's exact command is in"
  echo "  \`serving-compare/<run>-r<round>/command.txt\`. \`before\` is \`kvtier\` built at ${BEFORE_COMMIT:-(not given)}, the after runs at this commit."
  echo "- rounds: $rounds, each running before, after-inline, after-shm and after-shm-grpc in turn ($steps steps each)."
  echo "  A row pools its run's steps over the rounds; \"per round\" is each round's p50 over that round's before."
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(free -g | awk '/Mem:/{print $2" GiB"}'); $(uname -r)"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo "- workload: llama3-8b layout (32 layers, 8 KV heads, 32 query heads, head_dim 128, bf16, 16-token pages),"
  echo "  32K context, budget 32 pages per head; a step = per layer one SelectPages (swap-in, data) + one"
  echo "  AppendTokens, through an in-process server on loopback; device emulated in host memory."
  echo "- ranking: Quest's bound in every run (\`before\` predates ranking modes; the after runs pass \`--mode quest\`)."
  echo "  The default mode now is two-stage, which adds ~20 ms of rank per step here (bench/results/selection.md)."
  echo "- per step, mean µs summed over its 32 layers: select = transport (gRPC, handler, encode/decode,"
  echo "  the thread hops; for after-shm the region's socket and its thread) + the store's time (rank + swap host + read"
  echo "  + the rest). Appends go over gRPC in every run."
  echo
  echo "| run | steps | p50 µs | p90 µs | p99 µs | p50 / before | per round | steps/s | select | transport | rank | swap host | read | store rest | append |"
  echo "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
  python3 - "$out" "$rounds" <<'PY'
import csv, json, os, sys
out, rounds = sys.argv[1], int(sys.argv[2])

def p50(lat):
    return sorted(lat)[len(lat) // 2]

def load(run, r):
    path = os.path.join(out, f"{run}-r{r}")
    rows = list(csv.DictReader(open(os.path.join(path, "steps.csv"))))
    return rows, json.load(open(os.path.join(path, "report.json")))

before = {r: p50([int(x["latency_us"]) for x in load("before", r)[0]]) for r in range(1, rounds + 1)}
base = None
for run in ["before", "after-inline", "after-shm", "after-shm-grpc"]:
    loaded = [load(run, r) for r in range(1, rounds + 1)]
    rows = [x for rs, _ in loaded for x in rs]
    lat = sorted(int(x["latency_us"]) for x in rows)
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
    mean = lambda k: sum(float(x[k]) for x in rows) / len(rows)
    sel, store = mean("select_us"), mean("store_us")
    rest = store - mean("rank_us") - mean("swap_host_us") - mean("swap_nvme_us") - mean("read_us")
    per_round = " / ".join(f"{p50([int(x['latency_us']) for x in rs]) / before[r]:.2f}" for r, (rs, _) in enumerate(loaded, 1))
    rate = sum(rep["steps_per_s"] for _, rep in loaded) / len(loaded)
    base = base or q(0.5)
    print(f"| {run} | {len(lat)} | {q(0.5)} | {q(0.9)} | {q(0.99)} | {q(0.5)/base:.2f} | {per_round} | {rate:.1f} | "
          f"{sel:.0f} | {sel - store:.0f} | {mean('rank_us'):.0f} | {mean('swap_host_us'):.0f} | {mean('read_us'):.0f} | {rest:.0f} | {mean('append_us'):.0f} |")
PY
} > bench/results/serving-compare.md
cat bench/results/serving-compare.md
