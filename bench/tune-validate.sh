#!/usr/bin/env bash
# Validates `kvtier tune`: on two workloads (synthetic queries with drift,
# and a real model's queries), records a trace with `kvtier bench decode
# --trace`, predicts the device tier's miss ratio at several sizes from it,
# then measures the miss ratio `kvtier bench decode` sees at each of those
# sizes, under each device policy (lru: exact; loop: simulated). Writes bench/results/tune-validation.md and the tune plots under
# bench/results/tune/.
# Usage: bench/tune-validate.sh [realkv dir]   (default data/realkv/small, built if absent)
set -euo pipefail
cd "$(dirname "$0")/.."
realkv=${1:-data/realkv/small}
[ -n "${1:-}" ] || data/realkv/make.sh
cargo build -q --release --locked -p kvtier
kvtier=target/release/kvtier
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out=bench/results/tune
mkdir -p "$out"
rows=()

validate() { # name, LRU fractions, loop fractions, p99 target (ms), bench args...
  local name=$1 fractions=$2 loop_fractions=$3 target=$4
  shift 4
  "$kvtier" bench decode "$@" --device-fraction 0.25 --trace "$work/$name.trace" --out "$work/$name-trace" > /dev/null
  rm -rf "${out:?}/$name"
  "$kvtier" tune "$work/$name.trace" --device-fraction "$fractions,$loop_fractions" --target-p99-ms "$target" --json --out "$out/$name" > "$work/$name-tune.json"
  for policy in lru loop; do
    local sizes=$fractions
    [ "$policy" = loop ] && sizes=$loop_fractions
    for f in ${sizes//,/ }; do
      "$kvtier" bench decode "$@" --device-fraction "$f" --device-policy "$policy" --json --out "$work/$name-$f" > "$work/$name-$policy-$f.json"
      rows+=("$(python3 - "$work/$name-tune.json" "$work/$name-$policy-$f.json" "$f" "$name" "$policy" <<'EOF'
import json, sys
tune, bench, f, name, policy = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), float(sys.argv[3]), sys.argv[4], sys.argv[5]
# LRU from exact stack distances (with the latency model); others simulated.
at = lambda points: next(p for p in points if abs(p["fraction"] - f) < 1e-12)
p = at(next(c for c in tune["policies"] if c["tier"] == "device" and c["policy"] == policy)["at"])
m = bench["device_miss_ratio"]
late = bench["prefetch"]["layer_ahead"]["late"]
p99_ms = at(tune["at"]).get("p99_ms") if policy == "lru" else None
p99 = f"{p99_ms:.1f}" if p99_ms is not None else "-"
print(f"| {name} | {policy} | {f:.2f} | {p['bytes'] / 2**20:.1f} | {p['miss_ratio']:.4f} | {m:.4f} | {abs(p['miss_ratio'] - m):.4f} | {late} | {p99} | {bench['step_p99_us'] / 1e3:.1f} |")
EOF
)")
    done
  done
  commands+=("- $name: \`kvtier bench decode $* --device-fraction 0.25 --trace T\`, then \`kvtier tune T --device-fraction $fractions,$loop_fractions --target-p99-ms $target\`, then \`kvtier bench decode $* --device-fraction F --device-policy P --json\` for each policy P and its sizes F")
}

commands=()
validate synthetic 0.1,0.2,0.3,0.5 0.02,0.05,0.1,0.3 25 --steps 128 --drift 0.1
validate realkv 0.25,0.4,0.5,0.7 0.05,0.1,0.25,0.5 18 --queries "realkv:$realkv" --context 1536 --steps 256

{
  echo "# \`kvtier tune\`: predicted against measured device-tier miss ratios"
  echo
  echo "- command: \`bench/tune-validate.sh\`, which runs, per workload (smollm2-135m layout, one sequence):"
  printf '%s\n' "${commands[@]}" | sed 's/^/  /'
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/ {print $2}') GiB; device tier emulated"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo
  echo "Miss ratio: the share of the pages selections asked to make hot that were not"
  echo "on the device (\`device_miss_ratio\` in the bench's report: swapped in from host or"
  echo "NVMe, or left cold); predicted from a trace recorded at 25 % under LRU (a selection"
  echo "does not depend on where pages are, so one trace serves every size and policy):"
  echo "for \`lru\` by exact stack distances, for \`loop\` by running the store's own policy"
  echo "code on a simulated device (\`kvtier_store::DeviceSimulation\`), which assumes that"
  echo "every layer-ahead prefetch lands before its layer; \`late\` counts the measured"
  echo "runs' prefetches that did not."
  echo
  echo "Step p99: predicted from the trace's own timings (each recorded layer's time"
  echo "without its swap-in, plus its predicted misses at the per-page swap-in cost the"
  echo "recording measured) against the p99 \`bench decode\` measured at that size. A"
  echo "shared 2-core VM: the measured tails move by tens of percent from run to run."
  echo
  echo "| workload | device policy | device share | device MiB | predicted miss | measured miss | abs. error | late prefetches | predicted p99 ms | measured p99 ms |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "Curves: miss ratio ([synthetic](tune/synthetic/miss-ratio.png), [realkv](tune/realkv/miss-ratio.png)),"
  echo "predicted step p99 with the recommendation for the target ([synthetic](tune/synthetic/step-p99.png),"
  echo "[realkv](tune/realkv/step-p99.png))."
  echo
  echo "Host memory's curves per host policy are validated on the workload where the host"
  echo "policy matters, in [tune-validation-host.md](tune-validation-host.md)."
} > bench/results/tune-validation.md
cat bench/results/tune-validation.md
