#!/usr/bin/env bash
# NVMe tier random reads through kvtier's own code path vs fio (io_uring,
# O_DIRECT) on the same file, back to back, per block size and queue depth.
# Writes bench/results/tier-vs-fio.md and tier-vs-fio.jsonl.
# Usage: bench/tier-vs-fio.sh [path/to/kvtier] [file] [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
file=${2:-$PWD/target/kvtier-bench-tier.data}
secs=${3:-5}
size=1GiB
command -v fio >/dev/null || { echo "fio is needed (apt-get install fio)"; exit 1; }
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p kvtier
  bin=target/release/kvtier
fi
out=bench/results
mkdir -p "$out"
jsonl=$out/tier-vs-fio.jsonl
: > "$jsonl"
for bs in 16 64 256; do
  for qd in 1 32; do
    kv=$("$bin" bench tier --tier nvme --path "$file" --keep --size "$size" --block-size "${bs}KiB" \
          --queue-depth "$qd" --seconds "$secs" --json)
    fio_json=$(fio --name=randread --filename="$file" --ioengine=io_uring --direct=1 --rw=randread \
          --bs="${bs}k" --iodepth="$qd" --runtime="$secs" --time_based --size=1G --output-format=json)
    python3 - "$kv" "$fio_json" >> "$jsonl" <<'PY'
import json, sys
kv, fio = json.loads(sys.argv[1]), json.loads(sys.argv[2])
r = fio["jobs"][0]["read"]
pct = r["clat_ns"]["percentile"]
row = dict(kvtier=kv, fio=dict(read_mbps=r["bw_bytes"] / 1e6, iops=r["iops"],
           p50_us=pct["50.000000"] / 1e3, p99_us=pct["99.000000"] / 1e3, p999_us=pct["99.900000"] / 1e3))
row["ratio"] = kv["read_mbps"] / row["fio"]["read_mbps"]
print(json.dumps(row))
PY
  done
done
rm -f "$file"
{
  echo "# NVMe tier vs fio, random reads"
  echo
  echo "- command: \`bench/tier-vs-fio.sh\` — per row, back to back on one 1 GiB file:"
  echo "  \`kvtier bench tier --tier nvme --path F --keep --size 1GiB --block-size B --queue-depth Q --seconds $secs --json\`"
  echo "  (fills every slot with random-order writes, then random slot reads) and"
  echo "  \`fio --ioengine=io_uring --direct=1 --rw=randread --bs=B --iodepth=Q --runtime=$secs --time_based --size=1G\`"
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(df -hT "$(dirname "$file")" | awk 'NR==2{print $2" on "$1}'); $(uname -r); fio $(fio --version)"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo "- kvtier latency: submit to completion as seen by the caller (busy-polled); fio: completion latency (clat)."
  echo
  echo "| block | QD | engine | kvtier MB/s | fio MB/s | ratio | kvtier p50/p99/p99.9 µs | fio p50/p99/p99.9 µs | kvtier write MB/s |"
  echo "|---:|---:|---|---:|---:|---:|---|---|---:|"
  python3 - "$jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); k, f = r["kvtier"], r["fio"]
    print(f"| {k['block_size']//1024} KiB | {k['queue_depth']} | {k['engine']} | {k['read_mbps']:.0f} | {f['read_mbps']:.0f} | "
          f"{r['ratio']:.2f} | {k['read_p50_us']:.0f} / {k['read_p99_us']:.0f} / {k['read_p999_us']:.0f} | "
          f"{f['p50_us']:.0f} / {f['p99_us']:.0f} / {f['p999_us']:.0f} | {k['write_mbps']:.0f} |")
PY
} > "$out/tier-vs-fio.md"
cat "$out/tier-vs-fio.md"
