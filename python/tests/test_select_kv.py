"""``select_kv`` against ``select``: per head the same pages, and K and V
equal to the chosen pages' bytes concatenated in position order, over
gRPC, over the client's own region and naming another client's region;
and a selection that appends the step's own token in the same call."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
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
        "tokens": st.integers(1, 120),
        "budget": st.integers(2, 10),
        "aggregation": st.sampled_from(["max", "mean", "per_query_head"]),
        "mode": st.sampled_from(["quest", "two_stage"]),
        "plane": st.sampled_from(["grpc", "shm", "foreign", "views"]),
        # Pages made gone or a summary before selecting, as (kv_head, page,
        # action): a head's pages with data need not be one run any more.
        "moved": st.lists(
            st.tuples(st.integers(0, 2), st.integers(0, 40), st.sampled_from(["evict", "summarize"])), max_size=4
        ),
        "seed": st.integers(0, 2**32 - 1),
    }
)


def rows(rng: np.random.Generator, shape: tuple, dtype: str) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32) * 2
    if dtype == "bf16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype({"f32": np.float32, "f16": np.float16}[dtype])


@pytest.fixture(scope="module")
def regions(server, client):
    """A region of ``client``'s own and one of another client's."""
    other = kvtier.Client(server.address, shm_socket=server.shm_socket)
    own, foreign = client.register_shm(1 << 20), other.register_shm(1 << 20)
    yield own, foreign
    own.close()
    foreign.close()
    other.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_select_kv_gathers_what_select_chooses(client, regions, case):
    rng = np.random.default_rng(case["seed"])
    h, g, d = case["kv_heads"], case["group"], case["head_dim"]
    layout = kvtier.Layout(1, h, h * g, d, case["dtype"], case["page_size"])
    seq = f"kv-{next(_ids)}"
    client.create(seq, layout)
    try:
        client.put(seq, 0, rows(rng, (h, case["tokens"], d), case["dtype"]), rows(rng, (h, case["tokens"], d), case["dtype"]))
        pages = -(-case["tokens"] // case["page_size"])
        # One move per page: a gone page cannot be moved again.
        for (kv_head, page), action in dict(((m[0], m[1]), m[2]) for m in reversed(case["moved"])).items():
            if kv_head < h and page < pages:
                client.set_page_state(seq, action, kv_heads=kv_head, pages=[page], rows=1 if action == "summarize" else None)
        q = rng.standard_normal((h * g, d)).astype(np.float32)
        shm = {"grpc": None, "shm": regions[0], "foreign": regions[1], "views": regions[0]}[case["plane"]]
        views = case["plane"] == "views"
        options = dict(sink_pages=1, window_pages=1, aggregation=case["aggregation"], mode=case["mode"])
        sel = client.select(seq, 0, q, case["budget"], **options)
        got = client.select_kv(seq, 0, q, case["budget"], shm=shm, views=views, **options)
        assert (got.pages_scored, got.mode) == (sel.pages_scored, sel.mode)
        data = {(p.kv_head, p.page): p for p in sel.pages}
        assert len(got.heads) == len(sel.heads)
        for head in sel.heads:
            mine = got.head(head.kv_head, head.query_head)
            # Gone pages come without data, and are in no head's rows.
            pages = [p.page for p in head.pages if (head.kv_head, p.page) in data]
            assert mine.pages.tolist() == pages
            assert mine.k.tobytes() == b"".join(data[(head.kv_head, p)].k.tobytes() for p in pages)
            assert mine.v.tobytes() == b"".join(data[(head.kv_head, p)].v.tobytes() for p in pages)
            assert mine.k.shape == (sum(data[(head.kv_head, p)].k.shape[0] for p in pages), d)
            # The answer's own arrays, not views of a region a later call
            # reuses; with views, read-only views of it, where the head's
            # rows lie in one run (per query head, its pages need not).
            if views and case["aggregation"] != "per_query_head" and pages and not case["moved"]:
                assert np.shares_memory(mine.k, shm.buffer) and np.shares_memory(mine.v, shm.buffer)
                assert not mine.k.flags.writeable
            elif shm is not None and not views:
                assert not np.shares_memory(mine.k, shm.buffer)
        if not views:
            check_attention(client, seq, q, case, shm, options, sel, data)
    finally:
        client.drop(seq)


def widened(a: np.ndarray) -> np.ndarray:
    """Rows as float64 (bfloat16 arrives as its bits)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def check_attention(client, seq, q, case, shm, options, sel, data):
    """``attend=True``: each query head's softmax over the rows its
    selection chose (a summary row weighted by its count), merged with one
    row held apart, equals one softmax over all of them, computed here."""
    g, d = case["group"], case["head_dim"]
    got = client.select_kv(seq, 0, q, case["budget"], shm=shm, attend=True, **options)
    assert all(len(h.k) == 0 for h in got.heads)
    scale = 1 / np.sqrt(d)
    rng = np.random.default_rng(case["seed"] + 1)
    # In the layout's storage dtype (bfloat16 as its bits), as a worker holds them.
    own_k, own_v = (rows(rng, (case["kv_heads"], 1, d), case["dtype"]) for _ in range(2))
    merged = got.attention.merged(q, own_k, own_v, scale)
    wanted = []
    for head in sel.heads:
        chose = [head.query_head] if head.query_head is not None else range(head.kv_head * g, (head.kv_head + 1) * g)
        pages = [data[(head.kv_head, p.page)] for p in head.pages if (head.kv_head, p.page) in data]
        k = np.concatenate([widened(p.k) for p in pages] + [widened(own_k[head.kv_head])])
        v = np.concatenate([widened(p.v) for p in pages] + [widened(own_v[head.kv_head])])
        counts = np.concatenate([p.summary_counts or [1] * len(p.k) for p in pages] + [[1]]).astype(np.float64)
        for query_head in chose:
            logits = k @ q[query_head].astype(np.float64) * scale + np.log(counts)
            w = np.exp(logits - logits.max())
            wanted.append((query_head, w @ v / w.sum(), int(counts[:-1].sum())))
    assert got.attention.query_heads.tolist() == [w[0] for w in wanted]
    assert got.attention.tokens.tolist() == [w[2] for w in wanted]
    np.testing.assert_allclose(merged, np.stack([w[1] for w in wanted]), rtol=1e-4, atol=1e-4)
    # The output rows in one buffer, as a decode step wraps them.
    assert np.array_equal(np.frombuffer(got.attention_out(), "<f4").reshape(got.attention.out.shape), got.attention.out)
    plain = client.select_kv(seq, 0, q, case["budget"], shm=shm, **options)
    assert plain.attention is None
    with pytest.raises(ValueError, match="attention: this selection holds none"):
        plain.attention_out()


@pytest.mark.parametrize("plane", ["grpc", "shm"])
def test_a_selection_appends_the_steps_token_after_choosing(client, regions, plane):
    rng = np.random.default_rng(7)
    layout = kvtier.Layout(2, 3, 6, 16, "f16", 4)
    seq = f"kv-append-{plane}"
    k, v = rows(rng, (3, 18, 16), "f16"), rows(rng, (3, 18, 16), "f16")
    client.create(seq, layout)
    shm = regions[0] if plane == "shm" else None
    try:
        client.put(seq, 1, k, v)
        q = rng.standard_normal((6, 16)).astype(np.float32)
        before = client.select_kv(seq, 1, q, 3, sink_pages=1, window_pages=1, shm=shm)
        new_k, new_v = rows(rng, (3, 1, 16), "f16"), rows(rng, (3, 1, 16), "f16")
        asked = time.perf_counter()
        step = client.select_kv(
            seq, 1, q, 3, sink_pages=1, window_pages=1, shm=shm, append=(new_k, new_v), append_position=18
        )
        waited_us = (time.perf_counter() - asked) * 1e6
        # The server's time for the call holds its store's (the append's
        # too) and lies within the call's.
        assert step.store_us <= step.server_us <= waited_us
        assert step.server_us == step.timing["server_us"]
        # Chosen among the 18 stored tokens: the new one is not in it.
        for a, b in zip(before.heads, step.heads):
            assert a.pages.tolist() == b.pages.tolist() and a.k.tobytes() == b.k.tobytes()
        assert step.appended["tokens"] == 19 and before.appended is None
        last = client.fetch(seq, 1, [4])
        for p in last:
            assert p.k.tobytes() == np.concatenate([k[p.kv_head, 16:], new_k[p.kv_head]]).tobytes()
            assert p.v.tobytes() == np.concatenate([v[p.kv_head, 16:], new_v[p.kv_head]]).tobytes()
        # The next step's selection sees it; `select` takes an append too.
        nxt = client.select(seq, 1, q, 3, window_pages=1, append=(new_k, new_v), append_position=19)
        assert nxt.appended["tokens"] == 20
        assert all(p.page == 4 and p.k.shape[0] == 3 for p in nxt.pages if p.page == 4)
    finally:
        client.drop(seq)


@pytest.mark.parametrize("plane", ["grpc", "shm"])
def test_a_selection_reuses_the_last_ranking_while_the_queries_hold(client, regions, plane):
    rng = np.random.default_rng(9)
    layout = kvtier.Layout(1, 2, 4, 16, "f16", 4)
    seq = f"kv-reuse-{plane}"
    client.create(seq, layout)
    shm = regions[0] if plane == "shm" else None
    try:
        client.put(seq, 0, rows(rng, (2, 40, 16), "f16"), rows(rng, (2, 40, 16), "f16"))
        q = rng.standard_normal((4, 16)).astype(np.float32)
        first = client.select_kv(seq, 0, q, 3, sink_pages=1, window_pages=1, shm=shm, reuse_similarity=0.95)
        again = client.select_kv(seq, 0, q * 1.01, 3, sink_pages=1, window_pages=1, shm=shm, reuse_similarity=0.95)
        assert (first.lanes_reused, again.lanes_reused) == (0, 2)
        for a, b in zip(first.heads, again.heads):
            assert a.pages.tolist() == b.pages.tolist() and a.k.tobytes() == b.k.tobytes()
        moved = client.select(seq, 0, -q, 3, sink_pages=1, window_pages=1, reuse_similarity=0.95)
        assert moved.lanes_reused == 0
        with pytest.raises(errors.InvalidArgument, match="reuse_similarity"):
            client.select(seq, 0, q, 3, reuse_similarity=2.0)
    finally:
        client.drop(seq)


def test_a_refused_append_refuses_the_selection_and_changes_nothing(client, regions):
    rng = np.random.default_rng(8)
    layout = kvtier.Layout(1, 2, 2, 8, "f32", 4)
    seq = "kv-append-refused"
    client.create(seq, layout)
    try:
        client.put(seq, 0, rows(rng, (2, 10, 8), "f32"), rows(rng, (2, 10, 8), "f32"))
        q = rng.standard_normal((2, 8)).astype(np.float32)
        one = (rows(rng, (2, 1, 8), "f32"), rows(rng, (2, 1, 8), "f32"))
        leases = client.stats()["leases"]
        for shm in (None, regions[0]):
            with pytest.raises(errors.FailedPrecondition, match=r"append\.position: is 9, but layer 0 holds 10"):
                client.select_kv(seq, 0, q, 2, lease_ms=60_000, shm=shm, append=one, append_position=9)
            with pytest.raises(errors.InvalidArgument, match=r"append\.kv"):
                client.select_kv(seq, 0, q, 2, shm=shm, append=(one[0][:1], one[1][:1]))
        assert client.info(seq)["tokens"] == 10
        assert client.stats()["leases"] == leases
        with pytest.raises(ValueError, match="append_position: applies to an append"):
            client.select_kv(seq, 0, q, 2, append_position=10)
    finally:
        client.drop(seq)


def test_gather_is_refused_for_other_calls(client, regions):
    client.create("kv-gather", kvtier.Layout(1, 1, 1, 4, "f32", 4))
    try:
        request = {"tenant": client.tenant, "sequence_id": "kv-gather"}
        with pytest.raises(ValueError, match="gather: only SelectPages"):
            client._conn.call("GetSequence", request, gather=True)
        fetch = {**request, "layer": 0, "kv_head_count": 1, "shm": regions[0].window().to_proto()}
        with pytest.raises(ValueError, match="gather: only SelectPages"):
            regions[0]._call("FetchPages", fetch, True)
    finally:
        client.drop("kv-gather")


@pytest.mark.parametrize("plane", ["grpc", "shm"])
def test_a_call_made_once_selects_and_appends_as_select_kv_every_step(client, regions, plane):
    rng = np.random.default_rng(11)
    layout = kvtier.Layout(2, 2, 4, 16, "f32", 4)
    mine, theirs = f"kv-call-{plane}", f"kv-calls-{plane}"
    shm = regions[0] if plane == "shm" else None
    options = dict(sink_pages=1, window_pages=1, mode="quest", shm=shm)
    for seq in (mine, theirs):
        client.create(seq, layout)
    try:
        for layer in (0, 1):
            k, v = rows(rng, (2, 20, 16), "f32"), rows(rng, (2, 20, 16), "f32")
            for seq in (mine, theirs):
                client.put(seq, layer, k, v)
        call = client.select_kv_call(mine, **options)
        position = 20
        for _ in range(4):
            for layer in (0, 1):
                q = rng.standard_normal((4, 16)).astype(np.float32)
                # Two tokens a step: the native side lays them out per head.
                new = rows(rng, (2, 2, 16), "f32"), rows(rng, (2, 2, 16), "f32")
                got = call(layer, q, 3, append=new, append_position=position)
                want = client.select_kv(theirs, layer, q, 3, append=new, append_position=position, **options)
                assert got.appended["tokens"] == want.appended["tokens"] == position + 2
                for a, b in zip(got.heads, want.heads):
                    assert (a.kv_head, a.pages.tolist()) == (b.kv_head, b.pages.tolist())
                    assert a.k.tobytes() == b.k.tobytes() and a.v.tobytes() == b.v.tobytes()
            position += 2
        for layer in (0, 1):
            for a, b in zip(client.fetch(mine, layer), client.fetch(theirs, layer)):
                assert (a.kv_head, a.page, a.k.tobytes(), a.v.tobytes()) == (b.kv_head, b.page, b.k.tobytes(), b.v.tobytes())
        last = client.fetch(mine, 1, [6])
        assert [p.tokens for p in last] == [4, 4]
        assert last[1].v[-2:].tobytes() == new[1][1].tobytes()
        # A step's own arguments are checked as select_kv checks them,
        # before anything is sent, each error naming its field.
        with pytest.raises(ValueError, match="append_position"):
            call(0, q, 3, append_position=position)
        for args, kw, field in (
            ((-1, q, 3), {}, "layer: "),
            ((0, q, 2**32), {}, "budget_pages: "),
            ((0, q, 3), {"append": new, "append_position": -1}, "append.position: "),
        ):
            with pytest.raises(TypeError, match=field):
                call(*args, **kw)
        with pytest.raises(ValueError, match="v: shape"):
            call(0, q, 3, append=(new[0], new[1][:, :1]), append_position=position)
        assert client.info(mine)["tokens"] == position
    finally:
        client.drop(mine)
        client.drop(theirs)


def test_views_need_a_region_and_the_server_lays_out_heads_only_into_one(client, regions):
    layout = kvtier.Layout(1, 2, 2, 8, "f32", 4)
    seq = "kv-views"
    client.create(seq, layout)
    try:
        client.put(seq, 0, np.ones((2, 8, 8), np.float32), np.ones((2, 8, 8), np.float32))
        q = np.ones((2, 8), np.float32)
        with pytest.raises(ValueError, match="views: "):
            client.select_kv(seq, 0, q, 2, views=True)
        with pytest.raises(ValueError, match="views: "):
            client.select_kv(seq, 0, q, 2, shm=regions[1], views=True)
        request = {"sequence_id": seq, "kv_head_count": 2, "queries": q.tobytes(), "budget_pages": 2}
        with pytest.raises(errors.InvalidArgument, match="gather_heads: ") as refused:
            client._conn.call("SelectPages", {**request, "include_data": True, "gather_heads": True})
        assert refused.value.field == "gather_heads"
        with pytest.raises(errors.InvalidArgument, match="gather_heads: "):
            client._conn.call("Prefetch", {**request, "gather_heads": True})
    finally:
        client.drop(seq)
