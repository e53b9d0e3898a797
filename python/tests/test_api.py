"""Every RPC through the Python client, the typed exceptions a refusal
raises (naming the field, changing nothing), and the asyncio client."""

from __future__ import annotations

import asyncio
import hashlib
import json

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

    assert client.set_page_state("a", "offload", tier="host", layers=0, page_range=(0, 2)) == 4
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


def test_an_access_recording_lists_the_pages_fetched(client):
    started = client.start_access_trace(sample_rate=1.0)
    assert started["recording"] and started["path"].endswith(".trace")
    with pytest.raises(errors.FailedPrecondition):
        client.start_access_trace()
    client.create("traced", LAYOUT)
    client.put("traced", 0, kv(8), kv(8))
    client.fetch("traced", 0, pages=[1])
    client.drop("traced")
    stopped = client.stop_access_trace()
    assert not stopped["recording"] and stopped["path"] == started["path"]
    with open(stopped["path"]) as f:
        lines = [json.loads(line) for line in f]
    # The sequence, its write, read and drop.
    assert len(lines[1:]) >= 4
    assert lines[0]["kvtier_trace"] == 4 and lines[0]["source"] == "server"
    reads = [line for line in lines if line.get("op") == "read"]
    fetched = sorted((h["head"], h["pages"]) for r in reads for h in r["heads"])
    assert fetched == [(0, [1]), (1, [1])]
    with pytest.raises(errors.InvalidArgument) as e:
        client.start_access_trace(sample_rate=2.0)
    assert e.value.field == "sample_rate"


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
    # the same refusals over an shm region's connection
    region = client.register_shm(1 << 16)
    with pytest.raises(errors.FailedPrecondition) as e:
        client.append("e", 0, kv(1), kv(1), position=5, shm=region)
    assert e.value.field == "position"
    with pytest.raises(errors.FailedPrecondition) as e:
        client.append("e", 0, kv(1), kv(1), position=5, shm=region.window(0, 4096))
    assert e.value.field == "position"
    with pytest.raises(errors.InvalidArgument) as e:
        client.append("e", 0, bad, bad, shm=region)
    assert e.value.field == "kv"
    with pytest.raises(errors.InvalidArgument) as e:
        client.fetch("e", 5, shm=region)
    assert e.value.field == "layer"
    with pytest.raises(errors.InvalidArgument) as e:
        client.select("e", 0, np.zeros((4, 8)), budget_pages=0, shm=region)
    assert e.value.field == "budget_pages"
    with pytest.raises(ValueError, match="method: GetSequence does not go over"):
        region._call("GetSequence", {"sequence_id": "e"})
    assert region.spin == pytest.approx(1e-4)
    for bad_spin in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="spin: is"):
            region.spin = bad_spin
    assert region.spin == pytest.approx(1e-4)
    assert region.server_poll == 0.0
    region.server_poll = 0.003
    assert region.server_poll == pytest.approx(0.003)
    for bad_poll in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="server_poll: is"):
            region.server_poll = bad_poll
    assert region.server_poll == pytest.approx(0.003)
    region.close()
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


def test_arguments_as_users_pass_them(client):
    """Regressions from a review: numpy indices, one layer as an int, a
    tuple of page indices, empty page lists, bf16 bits as int16, type hints."""
    import typing

    layout = kvtier.Layout(num_layers=3, num_kv_heads=2, num_query_heads=2, head_dim=8, dtype="bf16", page_size=4)
    client.create("args", layout)
    k = np.arange(2 * 16 * 8, dtype=np.int16).reshape(2, 16, 8)  # bf16 bit patterns
    for layer in range(3):
        client.put("args", layer, k, k)
    got = client.fetch("args", 1, pages=np.array([1, 2]), kv_heads=np.int64(1))
    assert [(p.kv_head, p.page) for p in got] == [(1, 1), (1, 2)]
    assert got[0].k.view(np.int16).tolist() == k[1, 4:8].tolist()
    assert client.fetch("args", 1, pages=[]) == []
    assert client.set_page_state("args", "evict", pages=[]) == 0
    # a tuple of pages is pages, not a range; page_range is a range
    assert client.set_page_state("args", "offload", tier="host", layers=0, pages=(1, 3)) == 4
    assert client.set_page_state("args", "offload", tier="host", layers=2, page_range=(0, 2)) == 4
    states = {(p.kv_head, p.page): p.state for p in client.fetch("args", 0)}
    assert [states[(0, i)] for i in range(4)] == ["hot", "cold", "hot", "cold"]
    # one layer as an int: the policy touches layer 1 only
    def pages_of(layer: int) -> list:
        return [(p.kv_head, p.page, p.state, p.k.tobytes()) for p in client.fetch("args", layer)]

    before = [pages_of(layer) for layer in (0, 2)]
    reply = client.apply_policy("args", "streaming", 4, layers=1, sink_tokens=4)
    assert reply["pages_changed"] == 2 * 3
    assert [pages_of(layer) for layer in (0, 2)] == before
    with pytest.raises(TypeError, match="prefix_hashes"):
        client.create("args2", layout, prefix_hashes=[1, 2])
    with pytest.raises(ValueError, match="address"):
        kvtier.Client("localhost:50051")
    with pytest.raises(ValueError, match="one message"):
        big = np.zeros((2, (64 << 20) // 32 + 64, 8), dtype=np.float32)
        client.put("args", 0, big, big)
    for method in (kvtier.Client.fetch, kvtier.Client.select, kvtier.Client.set_page_state):
        typing.get_type_hints(method)
    client.drop("args")


def test_a_call_that_gets_no_answer_times_out():
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    with pytest.raises(errors.DeadlineExceeded):
        client = kvtier.Client(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=0.5)
        client.stats()
    listener.close()


def test_after_fork_the_parents_client_refuses_and_a_new_one_works(server, client):
    import os

    client.stats()
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status, never return into pytest
        code = 0
        try:
            try:
                client.stats()
                code = 1
            except RuntimeError as e:
                code = 0 if "fork" in str(e) else 2
            if code == 0 and kvtier.Client(server.address).stats()["sequences"] < 0:
                code = 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    client.stats()


def test_asyncio_calls_in_flight_together_use_windows_of_their_own_and_can_be_cancelled(server):
    async def main() -> None:
        client = kvtier.AsyncClient(server.address, shm_socket=server.shm_socket)
        layout = kvtier.Layout(4, 1, 1, 8, "f32", 4)
        await client.create("aio-shm", layout)
        for layer in range(4):
            kv = np.full((1, 8, 8), layer, dtype=np.float32)
            await client.put("aio-shm", layer, kv, kv)
        region = await client.register_shm(1 << 16)
        windows = region.split(4)
        fetched = await asyncio.gather(*(client.fetch("aio-shm", layer, shm=windows[layer]) for layer in range(4)))
        for layer, pages in enumerate(fetched):
            assert all((p.k == layer).all() for p in pages)
        # a decode step's selection, made once: its answers viewed in the
        # call's own window, or over gRPC with the step's token appended
        q = np.ones((1, 8), np.float32)
        viewed = await client.select_kv_call("aio-shm", shm=windows[1], views=True)
        sel = await viewed(1, q, 2)
        assert (sel.head(0).k == 1).all() and np.shares_memory(sel.head(0).k, region.buffer)
        plain = await client.select_kv_call("aio-shm")
        step = np.full((1, 1, 8), 9, np.float32)
        sel = await plain(2, q, 2, append=(step, step), append_position=8)
        assert sel.appended["tokens"] == 9 and (sel.head(0).k == 2).all()
        # a cancelled call stops waiting; the client goes on working
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.fetch("aio-shm", 0), timeout=1e-9)
        assert len(await client.fetch("aio-shm", 0)) == 2
        await client.drop("aio-shm")

    asyncio.run(main())


def test_a_region_another_client_registered_is_named_over_grpc(server):
    owner = server.client()
    other = server.client()
    owner.create("shared-region", LAYOUT)
    owner.put("shared-region", 0, kv(6), kv(6))
    region = owner.register_shm(1 << 16)
    mine = owner.fetch("shared-region", 0, shm=region)
    theirs = other.fetch("shared-region", 0, shm=region.window(1 << 15, 1 << 15))
    assert [p.page for p in mine] == [p.page for p in theirs]
    for a, b in zip(mine, theirs):
        assert (a.k == b.k).all() and (a.v == b.v).all()
        assert np.shares_memory(b.k, region.buffer)
    region.close()
    owner.drop("shared-region")
