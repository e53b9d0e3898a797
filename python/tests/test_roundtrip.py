"""Bit-exact round trips in every dtype, through every way in (numpy,
buffer protocol, DLPack) and out (inline, shared memory), over layouts and
lengths a generator explores."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier

_ids = itertools.count()

NP_DTYPES = {"f32": np.float32, "f16": np.float16}


def bits(a: np.ndarray) -> np.ndarray:
    """Element bit patterns, to compare NaN-free data exactly (and -0.0
    apart from 0.0)."""
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def random_kv(rng: np.random.Generator, dtype: str, heads: int, tokens: int, head_dim: int) -> np.ndarray:
    """``[heads, tokens, head_dim]`` of finite values in the layout's storage
    dtype, extremes included (bf16 as bit patterns)."""
    if dtype == "bf16":
        x = rng.standard_normal((heads, tokens, head_dim)).astype(np.float32) * 100
        out = (x.view(np.uint32) >> 16).astype(np.uint16)
        return out.view(kvtier.storage_dtype("bf16"))
    t = NP_DTYPES[dtype]
    x = (rng.standard_normal((heads, tokens, head_dim)) * 50).astype(t)
    info = np.finfo(t)
    flat = x.reshape(-1)
    picks = rng.integers(0, flat.size, size=min(4, flat.size))
    flat[picks] = rng.choice(np.array([info.max, -info.max, info.tiny, -0.0], dtype=t), size=picks.size)
    return x


class DLPackOnly:
    """A tensor that offers only DLPack, like a CPU torch tensor."""

    def __init__(self, a: np.ndarray):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


layouts = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["f32", "f16", "bf16"]),
        "heads": st.integers(1, 4),
        "head_dim": st.sampled_from([1, 3, 8, 64]),
        "page_size": st.sampled_from([1, 4, 16]),
        "tokens": st.integers(1, 40),
        "appended": st.integers(0, 6),
        "seed": st.integers(0, 2**32 - 1),
        "way_in": st.sampled_from(["numpy", "dlpack", "memoryview", "list"]),
        # how calls over the region wait for their replies: sleeping at once
        # (the default), or polling first; and whether the calls ask the
        # server's thread to poll for the next one
        "spin": st.sampled_from([None, 0.0001]),
        "server_poll": st.sampled_from([None, 0.002]),
    }
)


def way_in(a: np.ndarray, how: str):
    if how == "dlpack" and a.dtype.kind == "f":
        return DLPackOnly(a)
    if how == "memoryview" and a.dtype.kind == "f":
        return memoryview(a)
    if how == "list" and a.dtype.kind == "f" and a.dtype == np.float32:
        return a.tolist()
    return a


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=layouts)
def test_put_append_fetch_are_bit_exact_inline_and_over_shm(client, case):
    rng = np.random.default_rng(case["seed"])
    dtype, heads, dim, page = case["dtype"], case["heads"], case["head_dim"], case["page_size"]
    layout = kvtier.Layout(num_layers=2, num_kv_heads=heads, num_query_heads=heads, head_dim=dim, dtype=dtype, page_size=page)
    seq = f"rt-{next(_ids)}"
    client.create(seq, layout)
    try:
        # put takes whole pages (a partial last page is allowed), appends go one token at a time
        tokens = case["tokens"]
        k = random_kv(rng, dtype, heads, tokens, dim)
        v = random_kv(rng, dtype, heads, tokens, dim)
        client.put(seq, 1, way_in(k, case["way_in"]), way_in(v, case["way_in"]))
        # the window holds every page whole, the last one too
        pages_per_head = -(-(tokens + case["appended"]) // page)
        region = client.register_shm(heads * pages_per_head * page * 2 * dim * k.dtype.itemsize)
        if case["spin"] is not None:
            region.spin = case["spin"]
        if case["server_poll"] is not None:
            region.server_poll = case["server_poll"]
        for i in range(case["appended"]):
            k1 = random_kv(rng, dtype, heads, 1, dim)
            v1 = random_kv(rng, dtype, heads, 1, dim)
            # every other append over the region's connection
            client.append(seq, 1, k1, v1, position=tokens + i, shm=region if i % 2 else None)
            k = np.concatenate([k, k1], axis=1)
            v = np.concatenate([v, v1], axis=1)

        inline = client.fetch(seq, 1)
        shared = client.fetch(seq, 1, shm=region)
        for pages in (inline, shared):
            assert [(p.kv_head, p.page) for p in pages] == [(h, i) for h in range(heads) for i in range(-(-k.shape[1] // page))]
            for h in range(heads):
                mine = [p for p in pages if p.kv_head == h]
                got_k = np.concatenate([p.k for p in mine])
                got_v = np.concatenate([p.v for p in mine])
                assert got_k.dtype == kvtier.storage_dtype(dtype)
                assert (bits(got_k) == bits(k[h])).all()
                assert (bits(got_v) == bits(v[h])).all()
                assert [p.tokens for p in mine] == [min(page, k.shape[1] - i * page) for i in range(len(mine))]
        # over shared memory the arrays are the region's bytes, not copies
        assert all(np.shares_memory(p.k, region.buffer) for p in shared)
        region.close()
    finally:
        client.drop(seq)


def test_float32_input_is_rounded_to_bf16_nearest_even(client):
    layout = kvtier.Layout(1, 1, 1, 4, "bf16", 4)
    client.create("bf16-round", layout)
    # 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0);
    # 1 + 3*2^-8 rounds up to 1 + 2^-6... checked against the bit patterns
    x = np.array([[[1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5]]], dtype=np.float32)
    client.put("bf16-round", 0, x, x)
    page = client.fetch("bf16-round", 0)[0]
    want = np.array([0x3F80, 0x3F80, 0x3F82, 0xC020], dtype=np.uint16)
    assert (bits(page.k[0]) == want).all()
    client.drop("bf16-round")


def test_put_layers_streams_a_whole_prefill(client):
    layout = kvtier.Layout(4, 2, 4, 16, "f16", 8)
    client.create("prefill", layout)
    rng = np.random.default_rng(7)
    kv = rng.standard_normal((4, 2, 2, 20, 16)).astype(np.float16)  # [layer, k|v, head, token, dim]
    reply = client.put_layers("prefill", [(layer, kv[layer, 0], kv[layer, 1]) for layer in range(4)])
    assert reply["writes"] == 4 and reply["pages_written"] == 4 * 2 * 3
    for layer in range(4):
        pages = client.fetch("prefill", layer, kv_heads=1)
        assert (np.concatenate([p.v for p in pages]) == kv[layer, 1, 1]).all()
    client.drop("prefill")
