#!/usr/bin/env bash
# The cluster's model-based test (crates/kvtier/tests/cluster_model.rs), long:
# random creates, writes, reads and drops through the routing client while
# nodes are killed (-9), stopped, restarted, cut off from etcd, drained and
# rebalanced, and etcd is killed and restarted, every read checked against
# the model. CI runs 120 operations; this runs
# OPS operations for each of SEEDS seeds and appends a line per run to
# bench/results/cluster-soak.md.
# Usage: bench/cluster-soak.sh [OPS] [SEEDS]
set -euo pipefail
cd "$(dirname "$0")/.."
ops=${1:-2000}
seeds=${2:-3}
out=bench/results/cluster-soak.md
[ -f "$out" ] || {
  echo "# Cluster soak: the model-based cluster test, long"
  echo
  echo "Each line: one run of \`bench/cluster-soak.sh\` (\`KVTIER_CLUSTER_OPS=OPS KVTIER_CLUSTER_SEED=SEED cargo test -p kvtier --test cluster_model\`)."
  echo
} > "$out"
for seed in $(seq 1 "$seeds"); do
  seed=$((seed * 7919 + $(date +%s) % 1000))
  started=$(date +%s)
  if log=$(KVTIER_CLUSTER_OPS=$ops KVTIER_CLUSTER_SEED=$seed cargo test -q --locked -p kvtier --test cluster_model -- --nocapture 2>&1); then
    verdict=passed
  else
    verdict=FAILED
    echo "$log" | tail -60
  fi
  # The test's closing count ("N operations: ..."), or what a failure said
  # (the assertion's message; its trail of operations is printed above).
  summary=$(echo "$log" | grep -m1 -E '^[0-9]+ operations:' ||
    echo "$log" | grep -m1 -A1 'panicked at' | tail -1 || echo "no summary")
  echo "- $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD), $(nproc) cores: seed $seed, $verdict in $(( $(date +%s) - started )) s: $summary" | tee -a "$out"
done
