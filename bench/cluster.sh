#!/usr/bin/env bash
# A cluster on loopback (a real etcd and three kvtier nodes, all started by
# `kvtier bench cluster`): what routing through kvtier_client::Cluster adds
# to a fetch against a direct connection to the owner (interleaved, same
# run), how fast a drain streams a node's sequences to the others while a
# reader fetches them, and how long a node killed with -9 takes to be
# noticed, at two lease TTLs. Writes bench/results/cluster.md.
# Usage: bench/cluster.sh [path/to/kvtier]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v etcd >/dev/null || { echo "needs etcd (Debian's etcd-server)"; exit 1; }
bin=${1:-}
if [ -z "$bin" ]; then
  cargo build --release --locked -q -p kvtier
  bin=target/release/kvtier
fi
runs=()
for ttl in 1 1 2 2; do
  runs+=("$("$bin" bench cluster --ttl-secs "$ttl" --fetches 2000 --json)")
done
{
  echo "# Cluster: routing cost, drain throughput, time to notice a lost node"
  echo
  echo "- command: \`bench/cluster.sh\` (four runs of \`kvtier bench cluster --fetches 2000 --json\`, TTL 1, 1, 2, 2 s)"
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(free -g | awk '/Mem:/{print $2" GiB"}'); $(uname -r); device tier emulated"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo "- setup: one etcd, three nodes (device 64 MiB, host 256 MiB, NVMe 1 GiB each), all on loopback; SmolLM2-135M's layout, one layer's 16 pages of 3 KV heads per fetch"
  echo
  echo "Routing:"
  echo
  echo "| TTL s | fetch bytes | direct p50 µs | direct p99 µs | routed p50 µs | routed p99 µs | routed/direct p50 | lost node noticed ms | out of the view ms | creates rerouted ms |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  for r in "${runs[@]}"; do
    python3 -c '
import json, sys
r = json.loads(sys.argv[1])
print("| {ttl_secs} | {fetch_bytes} | {direct_p50_us:.0f} | {direct_p99_us:.0f} | {routed_p50_us:.0f} | {routed_p99_us:.0f} | {routed_over_direct_p50:.3f} | {notice_lost_ms} | {view_without_node_ms} | {create_rerouted_ms} |".format(**r))
' "$r"
  done
  echo
  echo "Drain (24 sequences of 256 tokens written persisted, about 5.9 MB each; the drained node's moved to the other two, two at a time, while a reader fetches them through the cluster client):"
  echo
  echo "| sequences moved | MB moved | drain ms | MB/s | one move p50 ms | one move max ms | fetches during it | their p50 µs | their p99 µs |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for r in "${runs[@]}"; do
    python3 -c '
import json, sys
r = json.loads(sys.argv[1])
print("| {drain_sequences} | {mb:.1f} | {drain_ms} | {drain_mb_per_s:.1f} | {move_p50_ms:.1f} | {move_max_ms:.1f} | {during_drain_fetches} | {during_drain_p50_us:.0f} | {during_drain_p99_us:.0f} |".format(mb=r["drain_bytes"] / 1e6, **r))
' "$r"
  done
  echo
  echo "Routed calls go through \`Cluster::call\`: the owner's connection from a map"
  echo "(learnt at the create), then the same call as the direct client on its own"
  echo "connection. A lost node is noticed when its membership lease lapses (the TTL,"
  echo "rounded up by etcd's lease checks); until then calls for its sequences fail"
  echo "on the connection. etcd raises a lease's TTL to its minimum (1.5 x the election"
  echo "timeout, 1 s by default, rounded up: 2 s), so TTL 1 behaves as TTL 2 here."
  echo
  echo "A drain's move reads each lane from the sender's tiers (NVMe included),"
  echo "streams it in messages of up to 4 MiB, and the receiver writes it through"
  echo "its store, persisting the pages that were durable (every page here), then"
  echo "commits in etcd. Sender and receivers share this machine's two cores and"
  echo "its one disk, so the MB/s is that of one box doing both ends at once."
} > bench/results/cluster.md
cat bench/results/cluster.md
