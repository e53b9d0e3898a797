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

DASHBOARD=docker/grafana/dashboards/kvtier.json COMMAND="$command" python3 - <<'EOF'
import json, math, os, subprocess, time, urllib.parse, urllib.request

dashboard = json.load(open(os.environ["DASHBOARD"]))
rows, empty = [], []
for panel in dashboard["panels"]:
    for target in panel["targets"]:
        q = urllib.parse.urlencode({"query": target["expr"]})
        reply = json.load(urllib.request.urlopen(f"http://127.0.0.1:9490/api/v1/query?{q}", timeout=10))
        series = reply["data"]["result"]
        finite = [s for s in series if math.isfinite(float(s["value"][1]))]
        if not finite:
            empty.append(panel["title"])
        example = ", ".join(
            f'{ {k: v for k, v in s["metric"].items() if k not in ("__name__", "job", "instance")} or ""} = {float(s["value"][1]):.4g}'
            for s in finite[:3]
        )
        rows.append(f'| {panel["title"]} | `{target["expr"]}` | {len(series)} | {len(finite)} | {example} |')
version = subprocess.run(["prometheus", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
with open("bench/results/dashboard-check.md", "w") as out:
    out.write("# Every dashboard query returns data from a real Prometheus\n\n")
    out.write("- command: `bench/dashboard-check.sh` (starts `target/release/kvtier serve` with a 16 MiB device "
              "under `--device-policy loop`, "
              "48 MiB host and 1 GiB NVMe tier and `--checkpoint-bytes 1` (a checkpoint whenever the manifest has doubled), and Debian's Prometheus scraping "
              f"it every second; the workload: `{os.environ['COMMAND']}`)\n")
    out.write(f"- Prometheus: {version}\n")
    out.write(f"- machine: {os.cpu_count()} cores, {cpu}; no GPU (device tier emulated)\n")
    out.write(f"- date: {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}\n\n")
    out.write(f"{len(rows) - len(empty)} of {len(rows)} queries returned a finite value.\n\n")
    out.write("| panel | query | series | finite | first values |\n|---|---|---:|---:|---|\n")
    out.write("\n".join(rows) + "\n")
print(open("bench/results/dashboard-check.md").read())
if empty:
    raise SystemExit(f"no data for: {empty}")
EOF
