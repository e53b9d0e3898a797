#!/usr/bin/env bash
# The gRPC fuzzer (crates/kvtier-client/tests/fuzz) run long: several seeds
# of many calls each against a real server (all three tiers, small limits),
# in release mode. Each run's counts (calls per method and status code, and
# per kind: valid, mutated, raw bytes, bad framing, unknown method) land in
# bench/results/fuzz/<seed>.json; bench/results/fuzz.md sums them up.
# CI runs the same test with 5000 calls and a seed from the clock.
# Usage: bench/fuzz.sh [calls per seed] [seeds...]
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-200000}
shift || true
seeds=("${@:-1 2 3 4 5}")
out=bench/results/fuzz
mkdir -p "$out"
cargo test --release --locked -q -p kvtier-client --test fuzz --no-run
for seed in ${seeds[@]}; do
  echo "::: seed $seed, $calls calls"
  KVTIER_FUZZ_SEED=$seed KVTIER_FUZZ_CALLS=$calls KVTIER_FUZZ_OUT="$PWD/$out/$seed.json" \
    cargo test --release --locked -q -p kvtier-client --test fuzz -- --nocapture
done
python3 - "$out" "$calls" <<'PY' > bench/results/fuzz.md
import json, sys, glob, os, datetime, platform, subprocess
out, calls = sys.argv[1], sys.argv[2]
runs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "*.json")))]
methods, kinds = {}, {}
for r in runs:
    for k, n in r["kinds"].items():
        kinds[k] = kinds.get(k, 0) + n
    for m, codes in r["methods"].items():
        for c, n in codes.items():
            methods.setdefault(m, {}).setdefault(c, 0)
            methods[m][c] += n
codes = sorted({c for cs in methods.values() for c in cs})
cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True).stdout.strip()
print("# gRPC fuzzing: counts\n")
print(f"Command: `bench/fuzz.sh {calls} {' '.join(str(r['seed']) for r in runs)}`  ")
print(f"Machine: {cpu}, {os.cpu_count()} cores; {platform.system()} {platform.release()}  ")
print(f"Date: {datetime.date.today()}\n")
total = sum(r["calls"] for r in runs)
secs = sum(r["seconds"] for r in runs)
print(f"{len(runs)} runs, {total} calls in {secs:.0f} s; no INTERNAL, UNKNOWN, hang or leak "
      "(a run that found one would have failed and written nothing).\n")
print("| kind | calls |\n|---|---:|")
for k, n in sorted(kinds.items()):
    print(f"| {k} | {n} |")
print("\n| method | " + " | ".join(codes) + " |")
print("|---|" + "---:|" * len(codes))
for m in sorted(methods):
    print(f"| {m} | " + " | ".join(str(methods[m].get(c, 0)) for c in codes) + " |")
PY
echo "wrote bench/results/fuzz.md"
