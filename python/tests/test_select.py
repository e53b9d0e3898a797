"""Selections against an independent numpy model of Quest: per page the
bound sum_d max(q_d * min_d, q_d * max_d) over the page's stored keys,
combined over a KV head's query heads (max or mean), sinks and window kept,
the rest by bound; and the data a selection returns against a fetch of the
same pages."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import errors

_ids = itertools.count()

cases = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["f32", "f16", "bf16"]),
        "kv_heads": st.integers(1, 3),
        "group": st.sampled_from([1, 2, 4]),
        "head_dim": st.sampled_from([4, 16, 64]),
        "page_size": st.sampled_from([1, 4, 16]),
        "tokens": st.integers(1, 200),
        "budget": st.integers(1, 12),
        "sinks": st.integers(0, 2),
        "window": st.integers(0, 2),
        "aggregation": st.sampled_from(["max", "mean"]),
        "seed": st.integers(0, 2**32 - 1),
    }
)


def stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """What the server stores for float32 ``x`` (bf16: truncated bits, as
    the test writes them), as float64."""
    if dtype == "bf16":
        return ((x.astype(np.float32).view(np.uint32) >> 16) << 16).view(np.float32).astype(np.float64)
    return x.astype({"f32": np.float32, "f16": np.float16}[dtype]).astype(np.float64)


def as_input(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return x.astype({"f32": np.float32, "f16": np.float16}[dtype])


def quest_bounds(keys: np.ndarray, q: np.ndarray, page: int) -> tuple:
    """Per page and query head: the bound, and the sum of |terms| (its
    rounding scale). ``keys`` [tokens, d], ``q`` [group, d]."""
    n = -(-keys.shape[0] // page)
    lo = np.stack([keys[i * page : (i + 1) * page].min(axis=0) for i in range(n)])
    hi = np.stack([keys[i * page : (i + 1) * page].max(axis=0) for i in range(n)])
    terms = np.maximum(q[None, :, :] * lo[:, None, :], q[None, :, :] * hi[:, None, :])  # [n, group, d]
    return terms.sum(axis=2), np.abs(terms).sum(axis=2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_select_matches_a_numpy_model_of_quest(client, case):
    rng = np.random.default_rng(case["seed"])
    h, g, d, page = case["kv_heads"], case["group"], case["head_dim"], case["page_size"]
    n = -(-case["tokens"] // page)
    budget, sinks, window = case["budget"], case["sinks"], case["window"]
    assume(sinks + window <= budget)
    layout = kvtier.Layout(1, h, h * g, d, case["dtype"], page)
    keys = rng.standard_normal((h, case["tokens"], d)).astype(np.float32) * 3
    q = rng.standard_normal((h * g, d)).astype(np.float32)
    seq = f"sel-{next(_ids)}"
    client.create(seq, layout)
    try:
        client.put(seq, 0, as_input(keys, case["dtype"]), as_input(-keys, case["dtype"]))
        sel = client.select(
            seq, 0, q, budget, sink_pages=sinks, window_pages=window, aggregation=case["aggregation"], mode="quest"
        )
        assert sel.mode == "quest"
        assert sel.pages_scored == h * n
        assert [s.kv_head for s in sel.heads] == list(range(h))
        for head in sel.heads:
            bounds, scale = quest_bounds(stored(keys[head.kv_head], case["dtype"]), q[head.kv_head * g : (head.kv_head + 1) * g].astype(np.float64), page)
            combined = bounds.max(axis=1) if case["aggregation"] == "max" else bounds.mean(axis=1)
            slack = 1e-4 * scale.max(axis=1) + 1e-6
            kept = set(range(min(sinks, n))) | set(range(max(n - window, 0), n))
            rest = sorted((p for p in range(n) if p not in kept), key=lambda p: -combined[p])
            take = max(min(budget, n) - len(kept), 0)
            # a near-tie at the cut may go either way under f32 rounding
            if 0 < take < len(rest):
                assume(combined[rest[take - 1]] - combined[rest[take]] > 2 * slack.max())
            want = sorted(kept | set(rest[:take]))
            assert [p.page for p in head.pages] == want
            for p in head.pages:
                assert abs(p.bound - combined[p.page]) <= slack[p.page], (p.page, p.bound, combined[p.page])
        # the data is the chosen pages' bytes, as a fetch returns them
        per_head = [[p.page for p in head.pages] for head in sel.heads]
        fetched = client.fetch(seq, 0, per_head_pages=per_head)
        got = {(p.kv_head, p.page): p for p in sel.pages}
        assert len(got) == len(fetched)
        for f in fetched:
            s = got[(f.kv_head, f.page)]
            assert s.k.tobytes() == f.k.tobytes() and s.v.tobytes() == f.v.tobytes()
    finally:
        client.drop(seq)


def test_select_over_shm_with_swap_in_lease_and_prefetch(server, client):
    layout = kvtier.Layout(2, 2, 4, 32, "f16", 8)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 256, 32)).astype(np.float16)
    client.create("sel-shm", layout)
    client.put("sel-shm", 1, k, k)
    client.set_page_state("sel-shm", "offload", tier="nvme", layers=1)
    q = rng.standard_normal((4, 32)).astype(np.float32)
    region = client.register_shm(1 << 20)
    sel = client.select("sel-shm", 1, q, 6, swap_in=True, prefetch_pages=2, lease_ms=60_000, shm=region)
    inline = client.select("sel-shm", 1, q, 6)
    assert [[p.page for p in h.pages] for h in sel.heads] == [[p.page for p in h.pages] for h in inline.heads]
    assert sel.swap["from_nvme"] == 12 and sel.prefetch_queued > 0
    assert all(p.state == "hot" for h in sel.heads for p in h.pages)
    assert sel.lease_id is not None and sel.lease_expires_in_ms > 0
    assert client.stats()["leases"] == 1
    assert all(np.shares_memory(p.k, region.buffer) for p in sel.pages)
    assert {(p.kv_head, p.page, p.k.tobytes()) for p in sel.pages} == {(p.kv_head, p.page, p.k.tobytes()) for p in inline.pages}
    k0, v0, pages = sel.gather(0)
    assert k0.shape == (6 * 8, 32) and [p.page for p in pages] == [p.page for p in sel.heads[0].pages]
    client.release_lease(sel.lease_id)
    assert client.stats()["leases"] == 0
    assert client.prefetch("sel-shm", 1, q, 6) >= 0
    client.drop("sel-shm")


def test_context_parallel_shards_together_choose_what_the_unsharded_call_chooses(client):
    layout = kvtier.Layout(1, 1, 2, 16, "f32", 4)
    rng = np.random.default_rng(11)
    k = rng.standard_normal((1, 128, 16)).astype(np.float32)
    client.create("cp", layout)
    client.put("cp", 0, k, k)
    q = rng.standard_normal((2, 16)).astype(np.float32)
    whole = {p.page for p in client.select("cp", 0, q, 8, include_data=False).heads[0].pages}
    for ownership in ("contiguous", "strided"):
        parts = [client.select("cp", 0, q, 8, shard=(rank, 3, ownership), include_data=False) for rank in range(3)]
        union = [p.page for part in parts for p in part.heads[0].pages]
        assert sorted(union) == sorted(whole) and len(union) == len(whole)
    client.drop("cp")


def test_mass_modes_estimate_each_query_heads_attention(client):
    """Sketch mode over every page: each query head's page masses sum to
    one; a top-p cut keeps the best pages; ``two-stage`` is the default and
    may be spelled either way."""
    rng = np.random.default_rng(5)
    layout = kvtier.Layout(1, 2, 4, 16, "f16", 4)
    keys = rng.standard_normal((2, 37, 16)).astype(np.float32)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    seq = f"mass-{next(_ids)}"
    client.create(seq, layout)
    try:
        client.put(seq, 0, keys, -keys)
        assert client.select(seq, 0, q, 2, include_data=False).mode == "two_stage"
        assert client.select(seq, 0, q, 2, include_data=False, mode="two-stage").mode == "two_stage"
        whole = client.select(seq, 0, q, 10, include_data=False, mode="sketch", aggregation="per_query_head")
        assert whole.mode == "sketch" and len(whole.heads) == 4
        for head in whole.heads:
            assert len(head.pages) == 10
            assert abs(sum(p.bound for p in head.pages) - 1.0) < 1e-4
        cut = client.select(seq, 0, q, 10, include_data=False, mode="sketch", aggregation="per_query_head", top_p=0.5)
        for head, full in zip(cut.heads, whole.heads):
            masses = sorted((p.bound for p in full.pages), reverse=True)
            fewest = int(np.searchsorted(np.cumsum(masses), 0.5 - 1e-5)) + 1
            assert len(head.pages) == fewest
        with pytest.raises(ValueError, match="mode"):
            client.select(seq, 0, q, 2, mode="best")
        with pytest.raises(errors.InvalidArgument, match="top_p"):
            client.select(seq, 0, q, 2, mode="quest", top_p=0.9)
    finally:
        client.drop(seq)
