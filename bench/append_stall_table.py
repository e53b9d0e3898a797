"""Markdown tables for bench/append-stall.sh from the runs' steps.csv files.

Usage: python3 bench/append_stall_table.py <work dir>
"""

import csv
import glob
import os
import re
import sys


def pct(sorted_values, p):
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * p))]


def ms(us):
    return f"{us / 1000:.1f}"


def runs(work):
    """(experiment, binary, repeat, device fraction, rows, checkpoints) per steps.csv."""
    for d in sorted(glob.glob(os.path.join(work, "*-*-*"))):
        m = re.fullmatch(r"(natural|forced)-(before|nofix|after)-(\d+)", os.path.basename(d))
        if not m or not os.path.isdir(d):
            continue
        with open(d + ".txt", errors="replace") as log:
            checkpoints = log.read().count("manifest checkpoint written")
        for f in sorted(glob.glob(os.path.join(d, "*steps.csv"))):
            frac = re.search(r"device_fraction-([0-9.]+)-", os.path.basename(f))
            with open(f) as fh:
                rows = list(csv.DictReader(fh))
            yield m[1], m[2], int(m[3]), frac[1] if frac else "0.25", rows, checkpoints


def main(work):
    print(
        "Per run: a step's append is the client-side time of its 32 `AppendTokens` calls (one"
        " per layer); the slowest single append and the sequence-lock wait are what the server"
        " reports in `AppendTiming` (the before binary has no timing). Checkpoints are counted"
        " over the whole run (the natural sweep's three runs share one server log)."
    )
    print()
    print(
        "| experiment | binary | run | device | step p99 ms | append/step p50 ms | p99 ms | max ms"
        " | slowest single append ms | most lock wait in a step ms | checkpoints |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst = {}
    for exp, binary, i, frac, rows, checkpoints in runs(work):
        step = sorted(int(r["latency_us"]) for r in rows)
        append = sorted(int(r["append_us"]) for r in rows)
        timed = "append_max_us" in rows[0]
        single = max(int(r["append_max_us"]) for r in rows) if timed else None
        wait = max(int(r["append_lock_wait_us"]) for r in rows) if timed else None
        w = worst.setdefault((exp, binary), [0, 0])
        w[0] = max(w[0], pct(append, 0.99))
        w[1] = max(w[1], append[-1])
        print(
            f"| {exp} | {binary} | {i} | {frac} | {ms(pct(step, 0.99))} | {ms(pct(append, 0.5))}"
            f" | {ms(pct(append, 0.99))} | {ms(append[-1])}"
            f" | {ms(single) if timed else 'n/a'} | {ms(wait) if timed else 'n/a'} | {checkpoints} |"
        )
    print()
    print("Worst over all runs of each binary (append per step):")
    print()
    print("| experiment | binary | worst p99 ms | worst max ms |")
    print("|---|---|---:|---:|")
    for (exp, binary), (p99, mx) in sorted(worst.items()):
        print(f"| {exp} | {binary} | {ms(p99)} | {ms(mx)} |")


if __name__ == "__main__":
    main(sys.argv[1])
