#!/usr/bin/env bash
# Decode-step latency by miss class through the real gRPC path, for the
# configurations issue 6 asks for. Writes bench/results/decode/<run>/ (JSON,
# per-step CSV, SVG and PNG plots) and bench/results/decode.md.
#   llama3-8b-host: llama3-8b layout, 32K context, device 10/25/50 % of the
#                   sequence, host holding all of it
#   llama3-8b-nvme: the same with host at 50 % and the rest on NVMe
#   smollm2-realkv: real queries (data/realkv/small, built if absent) on smollm2-135m
# Usage: bench/decode.sh [path/to/kvtier] [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
steps=${2:-256}
realkv=${KVTIER_REALKV:-data/realkv/small}
[ -n "${KVTIER_REALKV:-}" ] || data/realkv/make.sh
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p kvtier
  bin=target/release/kvtier
fi
out=bench/results/decode
rm -rf "$out"
mkdir -p "$out"
llama=(--preset llama3-8b --context 32768 --steps "$steps" --budget-pages 32 --sinks 1 --window 1 --drift 0.1)
declare -A commands=(
  [llama3-8b-host]="$bin bench decode ${llama[*]} --host-fraction 1.0 --sweep device_fraction=0.1,0.25,0.5 --out $out/llama3-8b-host"
  [llama3-8b-nvme]="$bin bench decode ${llama[*]} --host-fraction 0.5 --sweep device_fraction=0.1,0.25,0.5 --out $out/llama3-8b-nvme"
  [smollm2-realkv]="$bin bench decode --preset smollm2-135m --queries realkv:$realkv --context 1536 --steps 512 --budget-pages 16 --device-fraction 0.25 --host-fraction 0.6 --out $out/smollm2-realkv"
)
for run in llama3-8b-host llama3-8b-nvme smollm2-realkv; do
  echo "== $run: ${commands[$run]}"
  ${commands[$run]} | tee "$out/$run.txt"
  echo "${commands[$run]}" > "$out/$run/command.txt"
done
{
  echo "# Decode steps by miss class"
  echo
  echo "- command: \`bench/decode.sh\` (steps $steps); each run's exact command is in its directory's \`command.txt\`"
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(free -g | awk '/Mem:/{print $2" GiB"}'), $(df -hT . | awk 'NR==2{print $2" on "$1}'); $(uname -r)"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo "- in-process server over loopback gRPC; the device tier is emulated in host memory"
  echo "  (no GPU here), so \"hot\" costs no PCIe transfer."
  echo "- a step = per layer one SelectPages (swap-in, data) + one AppendTokens; latency in µs."
  echo "  Breakdown of the slowest 1 % of each class's steps (µs per step, summed over layers):"
  echo "  select = transport (gRPC, handler, encode/decode) + the store's time (rank + swap host + swap nvme + read + other)."
  echo
  python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
print("| run | device | host | class | steps | p50 | p90 | p99 | p99.9 | max | p99 steps: transport / rank / swap host / swap nvme / read / other ; append |")
print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
def rows(run, report):
    c = report["config"]
    for name, k in report["classes"].items():
        if k["count"] == 0:
            continue
        b = k["breakdown_p99"]
        other = b["store_us"] - b["rank_us"] - b["swap_host_us"] - b["swap_nvme_us"] - b["read_us"]
        parts = " / ".join(f"{v:.0f}" for v in (b["transport_us"], b["rank_us"], b["swap_host_us"], b["swap_nvme_us"], b["read_us"], other))
        print(f"| {run} | {c['device_fraction']:.2f} | {c['host_fraction']:.2f} | {name} | {k['count']} | {k['p50_us']} | {k['p90_us']} | "
              f"{k['p99_us']} | {k['p999_us']} | {k['max_us']} | {parts} ; {b['append_us']:.0f} |")
for run in sorted(os.listdir(out)):
    d = os.path.join(out, run)
    if not os.path.isdir(d):
        continue
    if os.path.exists(os.path.join(d, "sweep.json")):
        for row in json.load(open(os.path.join(d, "sweep.json")))["sweep"]:
            rows(run, row["report"])
    else:
        rows(run, json.load(open(os.path.join(d, "report.json"))))
print()
print("| run | device | steps/s | host→device MB | nvme→device MB | host→nvme MB | served MB | read fraction | emulated device |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
for run in sorted(os.listdir(out)):
    d = os.path.join(out, run)
    if not os.path.isdir(d):
        continue
    if os.path.exists(os.path.join(d, "sweep.json")):
        reports = [row["report"] for row in json.load(open(os.path.join(d, "sweep.json")))["sweep"]]
    else:
        reports = [json.load(open(os.path.join(d, "report.json")))]
    for r in reports:
        m = r["bytes_moved"]
        print(f"| {run} | {r['config']['device_fraction']:.2f} | {r['steps_per_s']:.1f} | {m['host_to_device']/1e6:.0f} | "
              f"{m['nvme_to_device']/1e6:.0f} | {m['host_to_nvme']/1e6:.0f} | {m['served']/1e6:.0f} | {r['read_fraction']:.3f} | {r['emulated_device']} |")
PY
} > bench/results/decode.md
echo "wrote bench/results/decode.md"
