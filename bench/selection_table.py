#!/usr/bin/env python3
"""bench/results/selection.md from bench/selection.sh's JSON (argv: dir, steps)."""
import json
import os
import platform
import subprocess
import sys

out, steps = sys.argv[1], sys.argv[2]
MODES = ["quest", "cuboid", "sketch", "two-stage"]
BUDGETS = [64, 128, 256, 512]


def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def load(name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)


print("# Selection modes: quality at equal pages read, and rank time")
print()
print(f"- command: `bench/selection.sh` (eval rows: `kvtier eval data/realkv/small --layers 4,13,29 --last 128 "
      f"--budget-tokens B --sinks F --window F --mode all --json`; decode rows: `kvtier bench decode --preset llama3-8b "
      f"--context 32768 --steps {steps} --device-fraction 0.25 --mode M --json`)")
cpu = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'")
mem = sh("free -g | awk '/Mem:/{print $2}'")
print(f"- machine: {os.cpu_count()} cores, {cpu}, {mem} GiB; {platform.release()}; no GPU (emulated device)")
print(f"- date: {sh('date -u +%Y-%m-%dT%H:%MZ')}, commit {sh('git rev-parse --short HEAD')}")
print("- data: realkv small (SmolLM2-135M, 2048 tokens = 128 pages of 16; 3 KV heads × 3 query heads; d = 64),")
print("  layers 4, 13, 29, the last 128 decode positions; each position's keys appended to a real store, its real")
print("  queries through `Store::select_pages` (GQA group shared, max aggregation).")
print("- mass: dense attention mass on the selected tokens (f64), pooled over layers, KV heads, query heads and")
print("  positions. oracle: per query head, the same forced pages then the pages of most true mass, as many pages as")
print("  chosen (a per-head oracle: no group-shared selection can reach it). gap = (mass − quest) / (oracle − quest),")
print("  each pooled (a ratio of means). pages: pages read per KV head per step. index B: index bytes scanned per KV")
print("  head per step. rank µs: one selection (3 KV heads), as the store timed it.")
print()
for forced in (1, 0):
    label = "sinks and window forced (1 page each)" if forced else "nothing forced (sinks 0, window 0)"
    print(f"## Eval, {label}")
    print()
    print("| budget | pages of 128 | mode | mass | oracle | gap closed | recall | rel_err | pages read | index B | rank µs |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in BUDGETS:
        report = load(f"eval-{b}-forced{forced}.json")
        for r in report["modes"]:
            gap = "–" if r["gap_closed"] is None else f"{r['gap_closed']:.3f}"
            print(f"| {b} | 1/{128 // (b // 16)} | {r['mode']} | {r['mass']:.4f} | {r['oracle_mass']:.4f} | {gap} | "
                  f"{r['recall']:.4f} | {r['rel_err']:.4f} | {r['pages_read']:.1f} | {r['index_bytes']:.0f} | {r['rank_us']:.0f} |")
    print()
print("Unforced against the forced oracle (does a good estimator make forcing unnecessary?):")
print()
print("| budget | mode | mass, nothing forced | oracle, forced | mass, forced |")
print("|---:|---|---:|---:|---:|")
for b in BUDGETS:
    free = {r["mode"]: r for r in load(f"eval-{b}-forced0.json")["modes"]}
    held = {r["mode"]: r for r in load(f"eval-{b}-forced1.json")["modes"]}
    for m in MODES:
        print(f"| {b} | {m} | {free[m]['mass']:.4f} | {held[m]['oracle_mass']:.4f} | {held[m]['mass']:.4f} |")
print()
print("## Rank time in the decode bench: llama3-8b, 32K context, host holds all, device 25 %")
print()
print("Budget 32 pages per KV head (sinks 1, window 1), two-stage with 4 × candidates; per step = 32 layers × 8 KV")
print("heads × GQA group 4. Means per step over all steps (µs); the same binary, one mode after another.")
print()
print("| mode | step p50 ms | step p99 ms | rank ms/step | store ms/step | read ms/step | append ms/step | prefill s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for m in MODES:
    d = load(f"decode-{m}.json")
    classes = d["classes"].values()
    n = sum(c["count"] for c in classes)
    mean = lambda k: sum(c["breakdown"][k] * c["count"] for c in classes) / max(n, 1)
    print(f"| {m} | {d['step_p50_us'] / 1000:.1f} | {d['step_p99_us'] / 1000:.1f} | {mean('rank_us') / 1000:.1f} | "
          f"{mean('store_us') / 1000:.1f} | {mean('read_us') / 1000:.1f} | {mean('append_us') / 1000:.1f} | "
          f"{d['prefill_seconds']:.1f} |")
