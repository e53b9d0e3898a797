#!/usr/bin/env bash
# The device policy on the decode loop: device miss ratio and step p50/p99
# for `lru` and `loop` at device sizes of 1/4, 1/2 and 1x one decode step's
# working set (the pages one step's selections touch over all layers), in
# one run, on the GPU when one is usable (bench/gpu-check.sh runs it there)
# and on the emulated device otherwise. Presets: smollm2-135m with synthetic
# drifting queries, the realkv dataset (its 2048 positions: context 1984;
# when built: data/realkv/make.sh),
# and llama3-8b at 32K context.
# Writes bench/results/loop-policy.md and .jsonl (OUT=DIR elsewhere).
# Usage: bench/loop-policy.sh [path/to/kvtier]   (STEPS=N measured steps per run,
# default 48, after WARMUP=N steps that fill the device, default 4;
# REALKV=DIR the realkv dataset, default data/realkv/small; PRESETS=a,b only
# those of synthetic, realkv, llama3-8b)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p kvtier
  bin=target/release/kvtier
fi
out=${OUT:-bench/results}
mkdir -p "$out"
jsonl=$out/loop-policy.jsonl
: > "$jsonl"
steps=${STEPS:-48}
warmup=${WARMUP:-4}
realkv=${REALKV:-data/realkv/small}
wanted=${PRESETS:-synthetic,realkv,llama3-8b}
presets=()
[[ ,$wanted, == *,synthetic,* ]] && presets+=("synthetic|--preset smollm2-135m --context 4096 --queries synthetic --drift 0.1")
if [[ ,$wanted, == *,realkv,* && -f "$realkv/meta.json" ]]; then
  presets+=("realkv|--preset smollm2-135m --context 1984 --queries realkv:$realkv")
fi
[[ ,$wanted, == *,llama3-8b,* ]] && presets+=("llama3-8b 32K|--preset llama3-8b --context 32768 --queries synthetic --drift 0.1")
# The commit: what bench/gpu-prepare.sh recorded with the binary, or git's.
commit=$(cat "$(dirname "$bin")/COMMIT" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
for preset in "${presets[@]}"; do
  name=${preset%%|*}
  flags=${preset#*|}
  for size in 0.25 0.5 1; do
    for policy in lru loop; do
      # shellcheck disable=SC2086
      "$bin" bench decode $flags --steps "$steps" --warmup-steps "$warmup" --device-step-fraction "$size" --device-policy "$policy" \
        --out target/loop-policy-run --json |
        python3 -c "import json,sys; r=json.load(sys.stdin); r['preset']='$name'; print(json.dumps(r))" >> "$jsonl"
    done
  done
done
{
  echo "# The device policy on the decode loop"
  echo
  echo "- command: \`bench/loop-policy.sh\` (each row: \`kvtier bench decode <preset flags> --steps $steps --warmup-steps $warmup --device-step-fraction F --device-policy P --json\`)"
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(free -g | awk '/Mem:/{print $2" GiB"}'); $(uname -r)"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $commit"
  if grep -q '"emulated_device": *false' "$jsonl"; then
    echo "- device: the GPU ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)), swap-in by kernel; host tier in pinned memory"
  else
    echo "- device: EMULATED in host memory (no GPU here): a prefetch is a CPU copy that competes with ranking;"
    echo "  the same comparison with the device on an H200: [loop-policy-gpu.md](loop-policy-gpu.md)"
  fi
  echo "- host tier holds the whole context; budget 32 pages per KV head"
  echo "  (sinks 1, window 1), two-stage ranking. Device size: F × one step's working set (every lane's budget)."
  echo "- miss ratio: selected pages not hot when selected; loop/lru: the loop policy's value over LRU's, same preset"
  echo "  and size."
  echo
  echo "- hits by region: of the selected pages, the share hot in the resident subset / in the stream region (the"
  echo "  server's counters, kvtier_device_selected_pages_total); layer-ahead: pages the loop policy's layer-ahead"
  echo "  prefetch made hot (issued), then selected while hot (used), or selected while still on their way (late)."
  echo
  echo "| preset | device / step | policy | device miss ratio | hits resident / stream | step p50 ms | step p99 ms | p99 loop/lru | layer-ahead issued / used / late |"
  echo "|---|---:|---|---:|---:|---:|---:|---:|---:|"
  python3 - "$jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
lru = {(r['preset'], r['config']['device_step_fraction']): r for r in rows if r['config']['device_policy'] == 'lru'}
for r in rows:
    c = r['config']
    base = lru[(r['preset'], c['device_step_fraction'])]
    ratio = r['step_p99_us'] / base['step_p99_us'] if base['step_p99_us'] else float('nan')
    a = r['prefetch']['layer_ahead']
    d = r['device_regions']
    chosen = max(1, d['resident'] + d['stream'] + d['misses'])
    print(f"| {r['preset']} | {c['device_step_fraction']:g} | {c['device_policy']} | {r['device_miss_ratio']:.3f} | "
          f"{d['resident']/chosen:.2f} / {d['stream']/chosen:.2f} | "
          f"{r['step_p50_us']/1e3:.1f} | {r['step_p99_us']/1e3:.1f} | {ratio:.2f} | {a['issued']} / {a['used']} / {a['late']} |")
PY
} > "$out/loop-policy.md"
cat "$out/loop-policy.md"
