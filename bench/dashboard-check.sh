#!/usr/bin/env bash
# A real Prometheus (Debian's `prometheus` package) scrapes a running
# release `kvtier serve` (tiny tiers, so decode steps miss to host and NVMe,
# the loop device policy so that its regions and layer-ahead prefetches count,
# pages migrate and checkpoints run) while `kvtier bench decode` drives it;
# then every query of the Grafana dashboard
# (docker/grafana/dashboards/kvtier.json) is run against that Prometheus and
# must return at least one series with a finite value. Writes
# bench/results/dashboard-check.md; exits non-zero if a query came back empty.
# Usage: bench/dashboard-check.sh   (needs: apt-get install prometheus)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v prometheus >/dev/null || { echo "needs Prometheus: apt-get install prometheus" >&2; exit 2; }
cargo build -q --release --locked -p kvtier
kvtier=target/release/kvtier
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

"$kvtier" serve --listen 127.0.0.1:50071 --metrics-listen 127.0.0.1:9471 --data-dir "$work/data" --device-policy loop \
  --device-bytes 16MiB --host-bytes 48MiB --nvme-bytes 1GiB --checkpoint-bytes 1 --shm-socket off \
  > "$work/kvtier.log" 2>&1 &
sed 's/kvtier:9464/127.0.0.1:9471/; s/scrape_interval: 5s/scrape_interval: 1s/' docker/prometheus.yml > "$work/prometheus.yml"
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address=127.0.0.1:9490 > "$work/prometheus.log" 2>&1 &

python3 - <<'EOF'
import time, urllib.request
for url in ("http://127.0.0.1:9490/-/ready", "http://127.0.0.1:9471/metrics"):
    for _ in range(300):
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    else:
        raise SystemExit(f"{url} never answered")
# Prometheus has scraped kvtier before the workload starts, so every rate
# has a sample from before it.
import json
for _ in range(300):
    q = urllib.request.urlopen("http://127.0.0.1:9490/api/v1/query?query=up", timeout=1)
    if any(r["value"][1] == "1" for r in json.load(q)["data"]["result"]):
        break
    time.sleep(0.1)
else:
    raise SystemExit("Prometheus never scraped kvtier")
EOF

# smollm2-135m at 4096 tokens: a 94 MB working set over a 16 MiB device and
# a 48 MiB host tier, so steps miss to host and NVMe.
command="$kvtier bench decode --addr http://127.0.0.1:50071 --context 4096 --steps 384 --prefetch-pages 4"
$command --out "$work/bench" > "$work/bench.txt"
sleep 3

setup="\`bench/dashboard-check.sh\` (starts \`target/release/kvtier serve\` with a 16 MiB device under \`--device-policy loop\`, 48 MiB host and 1 GiB NVMe tier and \`--checkpoint-bytes 1\` (a checkpoint whenever the manifest has doubled), and Debian's Prometheus scraping it every second)"
python3 bench/dashboard_queries.py http://127.0.0.1:9490 --out bench/results/dashboard-check.md \
  --command "$command" --setup "$setup" --version "$(prometheus --version 2>&1 | awk 'NR == 1')"
