#!/usr/bin/env bash
# Two tenants on one store, per host policy, in one run: tenant A's
# requests share a prompt prefix; tenant B sends a burst of unique prompts
# that writes more than host memory holds between two of A's requests.
# Measured: the share of A's prefix pages each request finds in memory
# (not only on NVMe) before and during the burst, and A's read times.
# Then, so that the frequency policy is seen to cost nothing where nothing
# is shared, `bench decode` with host memory at half the working set under
# each host policy. Writes bench/results/tenant-burst.md.
# Usage: bench/tenant-burst.sh [path/to/kvtier]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p kvtier
  bin=target/release/kvtier
fi
burst_command="kvtier bench burst --requests 40 --json"
decode_command="kvtier bench decode --preset smollm2-135m --context 4096 --steps 96 --host-fraction 0.5 --json"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck disable=SC2086
"$bin" ${burst_command#kvtier } > "$work/burst.jsonl"
for policy in lru frequency; do
  # shellcheck disable=SC2086
  "$bin" ${decode_command#kvtier } --host-policy "$policy" --out target/tenant-burst-run >> "$work/decode.jsonl"
done
{
  echo "# A tenant's shared prefix during another tenant's burst, per host policy"
  echo
  echo "- commands: \`$burst_command\` (both host policies); \`$decode_command --host-policy P\`"
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(free -g | awk '/Mem:/{print $2" GiB"}'); $(uname -r)"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo "- workload (in process, real NVMe file): host memory 2048 pages of 4 KiB (8 MiB); A's prefix 64 pages × 4 lanes"
  echo "  (1 MiB), kept by a long-lived sequence and attached by each of A's requests, which reads it and ends; B writes"
  echo "  12 prompts of 64 pages × 4 lanes (12 MiB) between two of A's requests and keeps them. 40 requests of A before"
  echo "  the burst, 40 during it."
  echo "- in memory: A's prefix pages found hot or in host memory when the request reads them (not only on NVMe)."
  echo
  echo "| host policy | A's prefix in memory, before | during B's burst | A's read p50 µs, before | during | p99 during | pages migrated |"
  echo "|---|---:|---:|---:|---:|---:|---:|"
  python3 - "$work/burst.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"| {r['host_policy']} | {r['a_hit_ratio_before']:.3f} | {r['a_hit_ratio_during']:.3f} | "
          f"{r['a_read_p50_us_before']} | {r['a_read_p50_us_during']} | {r['a_read_p99_us_during']} | {r['pages_migrated']} |")
PY
  echo
  echo "Nothing shared (one decode bench per policy, host memory at half the working set, device emulated):"
  echo
  echo "| host policy | device miss ratio | step p50 ms | step p99 ms | moved nvme→device MB |"
  echo "|---|---:|---:|---:|---:|"
  python3 - "$work/decode.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"| {r['config']['host_policy']} | {r['device_miss_ratio']:.3f} | {r['step_p50_us']/1e3:.1f} | "
          f"{r['step_p99_us']/1e3:.1f} | {r['bytes_moved']['nvme_to_device']/1e6:.1f} |")
PY
} > bench/results/tenant-burst.md
cat bench/results/tenant-burst.md
