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
DATASETS = {
    "small": "prose: the Python Language Reference's 'Special method names'",
    "code": "source code: CPython's Lib/textwrap.py",
}
REUSE = ["0.95", "0.9", "0.8", "0.7"]


def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def load(name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def gap(g):
    return "–" if g is None else f"{g:.3f}"


print("# Selection modes: quality at equal pages read, and rank time")
print()
print(f"- command: `bench/selection.sh` (eval rows: `kvtier eval data/realkv/DATA --layers 4,13,29 --last 128 "
      f"--budget-tokens B --sinks F --window F --mode all --json`; reuse rows: the same with `--sinks 1 --window 1 "
      f"--mode two-stage,quest --reuse-similarity S`; decode rows: `kvtier bench decode --preset llama3-8b "
      f"--context 32768 --steps {steps} --device-fraction 0.25 --mode M [--reuse-similarity S] [--host-fraction 0.25 "
      f"[--spill-sketches true]] --json`)")
cpu = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'")
mem = sh("free -g | awk '/Mem:/{print $2}'")
print(f"- machine: {os.cpu_count()} cores, {cpu}, {mem} GiB; {platform.release()}; no GPU (emulated device)")
print(f"- date: {sh('date -u +%Y-%m-%dT%H:%MZ')}, commit {sh('git rev-parse --short HEAD')}")
print("- data: two realkv datasets built by `data/realkv/make.sh` (SmolLM2-135M, 2048 tokens = 128 pages of 16;")
print("  3 KV heads × 3 query heads; d = 64): " + "; ".join(f"`{k}`, {v}" for k, v in DATASETS.items()) + ".")
print("  Layers 4, 13, 29, the last 128 decode positions; each position's keys appended to a real store, its real")
print("  queries through `Store::select_pages`, each mode with its own GQA aggregation (quest and cuboid: max;")
print("  sketch and two-stage: mean).")
print("- mass: dense attention mass on the selected tokens (f64), pooled over layers, KV heads, query heads and")
print("  positions. shared oracle: the best single set of as many pages as the KV head read, for its whole query")
print("  group (forced pages, then pages by true mass summed over the group) — what any selection reading that")
print("  many pages can reach. per-head oracle: each query head's own best pages (up to a group's times the pages")
print("  read). gap = (mass − quest) / (oracle − quest), each pooled (a ratio of means), against Quest ranking every")
print("  step. pages: pages read per KV head per step. index B: index bytes scanned per KV head per step. rank µs:")
print("  one selection (3 KV heads), as the store timed it.")
print()
for data, label in DATASETS.items():
    for forced in (1, 0):
        what = "sinks and window forced (1 page each)" if forced else "nothing forced (sinks 0, window 0)"
        print(f"## Eval on `{data}` ({label}), {what}")
        print()
        print("| budget | pages of 128 | mode | mass | shared oracle | gap closed | per-head oracle | gap closed, per head "
              "| recall | rel_err | pages read | index B | rank µs |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for b in BUDGETS:
            for r in load(f"eval-{data}-{b}-forced{forced}.json")["modes"]:
                print(f"| {b} | 1/{128 // (b // 16)} | {r['mode']} | {r['mass']:.4f} | {r['shared_oracle_mass']:.4f} | "
                      f"{gap(r['gap_closed'])} | {r['oracle_mass']:.4f} | {gap(r['gap_closed_per_head'])} | "
                      f"{r['recall']:.4f} | {r['rel_err']:.4f} | {r['pages_read']:.1f} | {r['index_bytes']:.0f} | "
                      f"{r['rank_us']:.0f} |")
        print()

print("## Reusing rankings across decode steps (sinks and window forced)")
print()
print("Two-stage (the default) with `--reuse-similarity S`: a lane's last ranking answers while every query head's")
print("cosine similarity to the query that made it is at least S; `reused`: the share of lane selections answered")
print("so. The row without S ranks every step. Gap against Quest ranking every step.")
print()
print("| data | budget | S | reused | mass | gap closed | rank µs |")
print("|---|---:|---:|---:|---:|---:|---:|")
for data in DATASETS:
    for b in (64, 128):
        every = next(r for r in load(f"eval-{data}-{b}-forced1.json")["modes"] if r["mode"] == "two-stage")
        print(f"| {data} | {b} | – | 0.000 | {every['mass']:.4f} | {gap(every['gap_closed'])} | {every['rank_us']:.0f} |")
        for s in REUSE:
            r = next(r for r in load(f"reuse-{data}-{b}-{s}.json")["modes"] if r["mode"] == "two-stage")
            print(f"| {data} | {b} | {s} | {r['reused']:.3f} | {r['mass']:.4f} | {gap(r['gap_closed'])} | "
                  f"{r['rank_us']:.0f} |")
print()

print("## Rank time in the decode bench: llama3-8b, 32K context, host holds all, device 25 %")
print()
print("Budget 32 pages per KV head (sinks 1, window 1), two-stage with 4 × candidates; per step = 32 layers × 8 KV")
print("heads × GQA group 4. Means per step over all steps (µs); the same binary, one mode after another. Synthetic")
print("queries (the bench's drift model), so the reuse row shows the mechanism's cost, not real queries' reuse.")
print()
print("| mode | step p50 ms | step p99 ms | rank ms/step | rank ÷ quest | store ms/step | read ms/step | append ms/step "
      "| prefill s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def rank_row(label, name, quest_rank):
    d = load(name)
    classes = d["classes"].values()
    n = sum(c["count"] for c in classes)

    def mean(k):
        return sum(c["breakdown"][k] * c["count"] for c in classes) / max(n, 1)

    rank = mean("rank_us")
    ratio = "–" if quest_rank is None else f"{rank / quest_rank:.2f}"
    print(f"| {label} | {d['step_p50_us'] / 1000:.1f} | {d['step_p99_us'] / 1000:.1f} | {rank / 1000:.1f} | {ratio} | "
          f"{mean('store_us') / 1000:.1f} | {mean('read_us') / 1000:.1f} | {mean('append_us') / 1000:.1f} | "
          f"{d['prefill_seconds']:.1f} |")
    return rank


quest_rank = rank_row("quest", "decode-quest.json", None)
for m in MODES[1:]:
    rank_row(m, f"decode-{m}.json", quest_rank)
rank_row("two-stage, reuse 0.9", "decode-two-stage-reuse.json", quest_rank)

print()
print("## The index's host memory with NVMe: llama3-8b, 32K context, device 25 %")
print()
print("Host 100 %: the rows above (every page host-resident, every sketch in memory). Host 25 %: three quarters of")
print("the pages NVMe-only. `kept`: every sketch in memory (the default). `spilled` (`--spill-sketches true`): a")
print("64-page chunk's sketches leave memory once three quarters of its pages are NVMe-only; a ranking reads the")
print("pages back (whole pages, CRC-checked, not promoted) for the sketches it needs — two-stage its candidates,")
print("Quest none — and gives them back to the index, where they stay for the next steps (loose, up to a quarter")
print("of the chunk; a sweep spills them again once it is full). Sketch MB: the index's sketch rows in host memory")
print("as the server reported them when the measured steps began and ended (1 MB = 10^6 B). rank ÷ quest: against")
print("Quest at the same host size and sketches.")
print()
print("| mode | host | sketches | index pages | spilled before | sketch MB before | spilled after | sketch MB after | "
      "rank ms/step | rank ÷ quest | read ms/step | step p50 ms | step p99 ms |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def memory_row(mode, host, sketches, name, quest_rank):
    d = load(name)
    classes = d["classes"].values()
    n = max(sum(c["count"] for c in classes), 1)
    rank = sum(c["breakdown"]["rank_us"] * c["count"] for c in classes) / n
    read = sum(c["breakdown"]["read_us"] * c["count"] for c in classes) / n
    b, a = d["index_before"], d["index_after"]
    ratio = "–" if quest_rank is None else f"{rank / quest_rank:.2f}"
    print(f"| {mode} | {host} | {sketches} | {a['pages']} | {b['spilled_pages']} | {b['sketch_bytes'] / 1e6:.1f} | "
          f"{a['spilled_pages']} | {a['sketch_bytes'] / 1e6:.1f} | {rank / 1000:.1f} | {ratio} | {read / 1000:.1f} | "
          f"{d['step_p50_us'] / 1000:.1f} | {d['step_p99_us'] / 1000:.1f} |")
    return rank


for host, sketches, prefix, suffix in (("100 %", "kept", "decode-", ""), ("25 %", "kept", "decode-nvme-", "-resident"),
                                       ("25 %", "spilled", "decode-nvme-", "")):
    q = memory_row("quest", host, sketches, f"{prefix}quest{suffix}.json", None)
    memory_row("two-stage", host, sketches, f"{prefix}two-stage{suffix}.json", q)
