#!/usr/bin/env bash
# Validates `kvtier tune`'s host-memory curves on the workload where the
# host policy matters: `kvtier bench burst` (tenant A's shared prefix read
# by each of its requests while tenant B writes bursts of one-off prompts).
# Per migration setting, records one trace (under LRU at the default host
# size), predicts A's hit ratio at several host sizes from it under each
# host policy (both run as the store's own policy code on miniature host
# memory), then measures it with `bench burst` at each size. Writes
# bench/results/tune-validation-host.md.
# Usage: bench/tune-host-validate.sh [path/to/kvtier]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
if [ -z "$bin" ]; then
  cargo build -q --release --locked -p kvtier
  bin=target/release/kvtier
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
burst="bench burst --requests 10"
page_bytes=4096 # bench burst's page: 16 tokens × 64 dims × 2 (K, V) × f16
rows=()
commands=()

validate() { # watermarks (HIGH,LOW), lru sizes, frequency sizes (host pages), runs per size
  local marks=$1 lru_sizes=$2 freq_sizes=$3 runs=$4
  # shellcheck disable=SC2086
  "$bin" $burst --host-policy lru --host-watermarks "$marks" --trace "$work/$marks.trace" --json > /dev/null
  local ws
  ws=$("$bin" tune "$work/$marks.trace" --host-watermarks "$marks" --json --out "$work/tune" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["working_set_bytes"])')
  for policy in lru frequency; do
    local sizes=$lru_sizes
    [ "$policy" = frequency ] && sizes=$freq_sizes
    local fractions
    fractions=$(python3 -c "print(','.join(repr(int(p) * $page_bytes / $ws) for p in '$sizes'.split(',')))")
    "$bin" tune "$work/$marks.trace" --host-watermarks "$marks" --host-fraction "$fractions" --host-policy "$policy" \
      --json --out "$work/tune" > "$work/tune-$marks-$policy.json"
    local i=0
    for pages in ${sizes//,/ }; do
      for run in $(seq 1 "$runs"); do
        # shellcheck disable=SC2086
        "$bin" $burst --host-policy "$policy" --host-watermarks "$marks" --host-pages "$pages" --json > "$work/burst-$run.json"
      done
      rows+=("$(python3 - "$work/tune-$marks-$policy.json" "$i" "$marks" "$pages" "$work"/burst-*.json <<'PY'
import json, sys
tune, i, marks, pages = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3], sys.argv[4]
runs = [json.load(open(f))["a_hit_ratio"] for f in sys.argv[5:]]
curve = next(c for c in tune["policies"] if c["tier"] == "host")
p = curve["at"][i]
predicted, measured = 1 - p["miss_ratio"], sum(runs) / len(runs)
spread = f"{min(runs):.4f}–{max(runs):.4f}" if len(runs) > 1 else "-"
print(f"| {marks} | {curve['policy']} ({curve['method']}) | {pages} | {p['fraction']:.4f} | {predicted:.4f} | {measured:.4f} | {spread} | {abs(predicted - measured):.4f} |")
PY
)")
      rm -f "$work"/burst-*.json
      i=$((i + 1))
    done
  done
  commands+=("- watermarks $marks: \`kvtier $burst --host-policy lru --host-watermarks $marks --trace T\`, then \`kvtier tune T --host-watermarks $marks --host-policy P --host-fraction F,…\` per policy P, then \`kvtier $burst --host-policy P --host-watermarks $marks --host-pages N\` at each size, $runs time(s)")
}

validate 1,1 1024,3072,3584,4096 256,320,384,512 1
runs_default=10
validate 0.9,0.8 1024,3072,3584,4096 256,320,384,512 "$runs_default"

{
  echo "# \`kvtier tune\`: predicted against measured host-memory hit ratios, per host policy"
  echo
  echo "- command: \`bench/tune-host-validate.sh\`, which runs, per host watermark setting:"
  printf '%s\n' "${commands[@]}" | sed 's/^/  /'
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/ {print $2}') GiB; in process, real NVMe file"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo
  echo "Hit ratio: the share of A's prefix pages its requests found in memory (\`a_hit_ratio\`"
  echo "in the bench's report, before and during B's bursts), which are all the reads of this"
  echo "workload; predicted as 1 − tune's host miss ratio at that host size. Both policies"
  echo "run as the store's own host code on miniature host memory (the store's LRU is not an"
  echo "ideal one: a page read from NVMe comes back only where memory has room), replaying"
  echo "the trace's writes, attaches of shared prefixes, reads and drops."
  echo
  echo "Watermarks 1,1 leave all migration to the writes that find memory full: the"
  echo "policies' own order. With the default 0.9,0.8 a background round also opens at the"
  echo "call that takes memory past the high watermark (less what the pages already chosen will"
  echo "free), sized down to the low one; the calls that follow choose its pages, two per page"
  echo "they allocate or touch, and a background thread migrates them. Which pages go does not"
  echo "depend on that thread's timing, and the replay runs the same code. What can: a read that"
  echo "comes before the pages chosen have moved finds them still in memory, and a promotion on"
  echo "read finds room or not. The bench lets the store settle"
  echo "before each of A's reads (\`Store::wait_idle\`, as a real request's reads come with gaps);"
  echo "a promotion during a read can still find room the round freed meanwhile."
  echo "Each size is measured $runs_default times (the mean, and the lowest and highest run)"
  echo "and predicted from one recording at another size (the bench's default host size)."
  echo
  echo "| watermarks | host policy | host pages | share of working set | predicted hit | measured hit (mean) | runs (min–max) | abs. error |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|"
  printf '%s\n' "${rows[@]}"
} > bench/results/tune-validation-host.md
cat bench/results/tune-validation-host.md
