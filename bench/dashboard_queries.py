"""Runs every query of the Grafana dashboard against a Prometheus and
reports which came back with a finite value.

    python3 bench/dashboard_queries.py PROMETHEUS_URL [--out FILE --command CMD --setup TEXT]

Prints one line per query; with --out, writes the markdown report
(bench/results/dashboard-check.md is one). Exits non-zero if any query
returned no finite value. Used by bench/dashboard-check.sh (a local
Prometheus) and docker/ci-check.sh (the compose file's).
"""

import argparse
import json
import math
import os
import time
import urllib.parse
import urllib.request

DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "docker", "grafana", "dashboards", "kvtier.json")


def query(prometheus: str, expr: str) -> list:
    q = urllib.parse.urlencode({"query": expr})
    reply = json.load(urllib.request.urlopen(f"{prometheus}/api/v1/query?{q}", timeout=10))
    return reply["data"]["result"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prometheus", help="e.g. http://127.0.0.1:9090")
    parser.add_argument("--out", help="write the markdown report here")
    parser.add_argument("--command", default="", help="the workload, for the report")
    parser.add_argument("--setup", default="", help="what served and scraped, for the report")
    parser.add_argument("--version", default="", help="Prometheus's version line, for the report")
    args = parser.parse_args()

    rows, empty = [], []
    for panel in json.load(open(DASHBOARD))["panels"]:
        for target in panel["targets"]:
            series = query(args.prometheus, target["expr"])
            finite = [s for s in series if math.isfinite(float(s["value"][1]))]
            if not finite:
                empty.append(panel["title"])
            example = ", ".join(
                f'{ {k: v for k, v in s["metric"].items() if k not in ("__name__", "job", "instance")} or ""} = {float(s["value"][1]):.4g}'
                for s in finite[:3]
            )
            rows.append(f'| {panel["title"]} | `{target["expr"]}` | {len(series)} | {len(finite)} | {example} |')
            print(f'dashboard query: {panel["title"]}: {len(finite)} of {len(series)} series finite')
    summary = f"{len(rows) - len(empty)} of {len(rows)} queries returned a finite value."
    print(f"dashboard queries: {summary}")
    if args.out:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        with open(args.out, "w") as out:
            out.write("# Every dashboard query returns data from a real Prometheus\n\n")
            out.write(f"- command: {args.setup}; the workload: `{args.command}`\n")
            out.write(f"- Prometheus: {args.version}\n")
            out.write(f"- machine: {os.cpu_count()} cores, {cpu}; no GPU (device tier emulated)\n")
            out.write(f"- date: {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}\n\n")
            out.write(f"{summary}\n\n")
            out.write("| panel | query | series | finite | first values |\n|---|---|---:|---:|---|\n")
            out.write("\n".join(rows) + "\n")
    if empty:
        raise SystemExit(f"no data for: {empty}")


if __name__ == "__main__":
    main()
