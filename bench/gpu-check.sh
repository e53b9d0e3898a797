#!/usr/bin/env bash
# The GPU check of the device tier, for one CUDA machine (an H200 here),
# with no network and no Rust toolchain: run bench/gpu-prepare.sh on the
# build machine first and bring bench/gpu-bin/ along. Finishes in a few
# minutes (each step is time-boxed; on an H200 steps 1-3 took under a
# minute and step 4 about six).
#
# 1. The device-tier conformance suite and the pinned host tier on the real
#    device, and the swap-in kernel checked bit-exact against the copy-engine
#    path (built where there is no CUDA driver, they are ignored tests:
#    --include-ignored runs them, and KVTIER_REQUIRE_GPU=1 makes a missing
#    GPU fail instead of skipping).
# 2. Swap-in bandwidth, both paths, against one plain host-to-device copy of
#    the same bytes.
# 3. `kvtier serve` picks the GPU for the device tier.
# 4. The device policy on the decode loop (bench/loop-policy.sh) with the
#    device tier on the GPU: lru against loop at 1/4, 1/2 and 1x a step's
#    working set (LOOP_PRESETS, default synthetic and llama3-8b; LOOP_STEPS).
#
# Output: $OUT (the device tool's folder) or bench/results/gpu-check/.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${GPU_BIN:-bench/gpu-bin}
out=${OUT:-bench/results/gpu-check}
mkdir -p "$out"
status=0

{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
} > "$out/machine.txt"
cat "$out/machine.txt"

echo "== 1. device tier tests on the GPU"
KVTIER_REQUIRE_GPU=1 timeout 150 "$bin/kvtier-cuda-tests" --include-ignored --test-threads 1 > "$out/tests.txt" 2>&1 || status=1
tail -5 "$out/tests.txt"

echo "== 2. swap-in bandwidth"
: > "$out/swapin.jsonl"
for path in kernel copy_engine; do
  for shape in "256 8192" "1024 8192" "4096 8192" "1024 65536"; do
    set -- $shape
    timeout 30 "$bin/kvtier" bench swapin --pages "$1" --page-bytes "$2" --path "$path" --json >> "$out/swapin.jsonl" \
      || { echo "swapin $path $shape failed" >> "$out/swapin.jsonl"; status=1; }
  done
done
cat "$out/swapin.jsonl"

echo "== 3. kvtier serve uses the GPU"
data=$(mktemp -d)
timeout -s INT 5 "$bin/kvtier" serve --listen 127.0.0.1:0 --metrics-listen off --nvme-bytes 0 \
  --device-bytes 1GiB --host-bytes 1GiB --data-dir "$data" > "$out/serve.log" 2>&1
grep -q "device tier on the GPU" "$out/serve.log" || { echo "serve did not use the GPU" >> "$out/serve.log"; status=1; }
tail -3 "$out/serve.log"
rm -rf "$data"

echo "== 4. the device policy on the decode loop, device on the GPU"
OUT="$out" STEPS=${LOOP_STEPS:-48} PRESETS=${LOOP_PRESETS:-synthetic,llama3-8b} \
  timeout "${LOOP_TIMEOUT:-420}" bench/loop-policy.sh "$bin/kvtier" > "$out/loop-policy.log" 2>&1 || status=1
tail -25 "$out/loop-policy.log"

echo "gpu-check status: $status" | tee "$out/status.txt"
exit $status
