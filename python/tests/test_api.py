"""Every RPC through the Python client, the typed exceptions a refusal
raises (naming the field, changing nothing), and the asyncio client."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

import kvtier
from kvtier import errors

LAYOUT = kvtier.Layout(num_layers=2, num_kv_heads=2, num_query_heads=4, head_dim=8, dtype="f32", page_size=4)


def kv(tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, tokens, 8)).astype(np.float32)


def test_prefix_sharing_states_policies_attention_stats_and_drop(client):
    k = kv(16)
    hashes = [hashlib.sha256(f"prefix {i}".encode()).digest() for i in range(4)]
    client.create("a", LAYOUT, prefix_hashes=hashes)
    for layer in range(2):
        client.put("a", layer, k, k)
    created = client.create("b", LAYOUT, prefix_hashes=hashes)
    assert created["attached_pages"] == 4  # the whole 4-page prefix, in every lane
    assert client.info("b")["shared_pages"] == 16

    assert client.set_page_state("a", "offload", tier="host", layers=0, pages=(0, 2)) == 4
    assert client.set_page_state("a", "migrate", tier="nvme", layers=0, kv_heads=1, pages=[0]) == 1
    assert client.set_page_state("a", "summarize", rows=1, layers=1, pages=[3]) == 2
    assert client.set_page_state("a", "evict", layers=1, kv_heads=0, pages=[2]) == 1
    pages = {(p.kv_head, p.page): p for p in client.fetch("a", 1)}
    assert pages[(0, 2)].state == "gone" and pages[(0, 2)].gone_reason == "explicit"
    assert pages[(0, 3)].state == "summary" and pages[(0, 3)].summary_counts == [4]
    assert pages[(0, 3)].k.shape == (1, 8)
    np.testing.assert_allclose(pages[(0, 3)].k[0], k[0, 12:16].mean(axis=0), rtol=1e-6)
    cold = {(p.kv_head, p.page): p for p in client.fetch("a", 0, include_digests=True)}
    assert cold[(1, 0)].cold_tier == "nvme" and cold[(0, 1)].cold_tier == "host"
    lo, hi = cold[(0, 0)].digest
    assert (lo == k[0, :4].min(axis=0)).all() and (hi == k[0, :4].max(axis=0)).all()
    # "b" still sees its own bytes: the changes were to "a"'s logical pages
    assert all(p.state == "hot" for p in client.fetch("b", 1))

    client.report_attention("b", 0, np.ones((2, 16), dtype=np.float32), decay=0.5)
    reply = client.apply_policy("b", "h2o", budget_tokens=8, layers=(0, 1), window_tokens=4)
    assert reply["pages_kept"] + reply["pages_changed"] == 8
    assert client.apply_policy("b", "streaming", 8, action="summarize", rows=1, layers=(1, 1), sink_tokens=4)["pages_changed"] == 4

    stats = client.stats()
    assert stats["sequences"] == 2 and {t["tier"] for t in stats["tiers"]} >= {"device", "host", "nvme"}
    assert client.stats(tenant_only=True)["tenant"] == "default"
    client.drop("a")
    client.drop("b")
    assert client.stats()["sequences"] == 0


def test_refusals_raise_typed_exceptions_naming_the_field_and_change_nothing(client):
    client.create("e", LAYOUT)
    client.put("e", 0, kv(6), kv(6))
    with pytest.raises(errors.AlreadyExists):
        client.create("e", LAYOUT)
    with pytest.raises(errors.NotFound):
        client.fetch("no-such-sequence", 0)
    with pytest.raises(errors.InvalidArgument) as e:
        client.select("e", 0, np.zeros((4, 8)), budget_pages=0)
    assert e.value.field == "budget_pages" and isinstance(e.value, ValueError)
    with pytest.raises(errors.InvalidArgument) as e:
        client.fetch("e", 5)
    assert e.value.field == "layer"
    with pytest.raises(errors.FailedPrecondition) as e:
        client.append("e", 0, kv(1), kv(1), position=5)  # it holds 6
    assert e.value.field == "position"
    with pytest.raises(errors.FailedPrecondition):
        client.set_page_state("e", "summarize", rows=1, layers=0, pages=[0])
        client.set_page_state("e", "offload", tier="host", layers=0, pages=[0])  # a summary cannot go cold
    with pytest.raises(errors.NotFound):
        client.release_lease(12345)
    bad = np.full((2, 1, 8), np.nan, dtype=np.float32)
    with pytest.raises(errors.InvalidArgument) as e:
        client.append("e", 0, bad, bad)
    assert e.value.field == "kv"
    # none of it changed the sequence
    assert client.info("e")["max_tokens"] == 6
    # refused before anything is sent: the message names the argument
    with pytest.raises(ValueError, match="head_dim"):
        client.put("e", 1, np.zeros((2, 4, 3)), np.zeros((2, 4, 3)))
    with pytest.raises(TypeError, match="k: expected floating-point"):
        client.put("e", 1, np.zeros((2, 4, 8), dtype=np.int32), np.zeros((2, 4, 8), dtype=np.int32))
    with pytest.raises(ValueError, match="action"):
        client.set_page_state("e", "freeze")
    with pytest.raises(ValueError, match="no such field"):
        client.call("GetSequence", {"sequence": "e"})
    with pytest.raises(ValueError, match="method"):
        client.call("Nope", {})
    with pytest.raises(ValueError, match="aggregation"):
        client.select("e", 0, np.zeros((4, 8)), 1, aggregation="median")
    client.drop("e")


def test_an_unreachable_server_is_unavailable():
    with pytest.raises(errors.Unavailable):
        kvtier.Client("http://127.0.0.1:1").stats()


def test_asyncio_client_runs_calls_concurrently_and_raises_typed_errors(server):
    async def main() -> None:
        async with kvtier.AsyncClient(server.address) as client:
            await client.create("aio", LAYOUT)
            k = kv(4, seed=1)
            await asyncio.gather(*(client.put("aio", layer, k, k) for layer in range(2)))
            # many appends to two layers in flight at once, each guarded by its position
            for t in range(8):
                step = kv(1, seed=10 + t)
                await asyncio.gather(*(client.append("aio", layer, step, step, position=4 + t) for layer in range(2)))
            fetched = await asyncio.gather(*(client.fetch("aio", layer) for layer in range(2)))
            for pages in fetched:
                got = np.concatenate([p.k for p in pages if p.kv_head == 1])
                want = np.concatenate([k[1]] + [kv(1, seed=10 + t)[1] for t in range(8)])
                assert (got == want).all()
            sel = await client.select("aio", 1, np.ones((4, 8)), 2)
            assert len(sel.heads) == 2
            with pytest.raises(errors.NotFound):
                await client.info("nope")
            # a ticker keeps running while calls are in flight: the loop is never blocked
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            task = asyncio.ensure_future(ticker())
            await asyncio.gather(*(client.fetch("aio", 0) for _ in range(20)))
            task.cancel()
            assert ticks > 20
            await client.drop("aio")

    asyncio.run(main())


def test_version():
    assert kvtier.__version__.count(".") == 2


def test_the_asyncio_stub_declares_every_call_with_the_blocking_signature():
    import ast
    from pathlib import Path

    package = Path(kvtier.__file__).parent

    def methods(path: Path, cls: str) -> dict:
        tree = ast.parse(path.read_text())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        return {
            f.name: (ast.unparse(f.args), ast.unparse(f.returns))
            for f in node.body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not f.name.startswith("_")
        }

    blocking = methods(package / "client.py", "_Api")
    asynchronous = methods(package / "aio.pyi", "AsyncClient")
    assert {name: asynchronous.get(name) for name in blocking} == blocking
