"""kvtier.Cluster against a real etcd and three real nodes: placement that
agrees with the nodes' (each create is accepted where the Python client
computed it), refusals that name the owner, routed round trips, prefix
lookups (also of a prompt stored away from its placement), and a
context-parallel group on distinct nodes whose merged selection equals one
node's over the whole sequence; a standalone server has no cluster to
report."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, List

import numpy as np
import pytest

import kvtier
from conftest import Server, free_port, start, stop
from kvtier._native import placement

LAYOUT = kvtier.Layout(num_layers=2, num_kv_heads=2, num_query_heads=4, head_dim=8, dtype="f32", page_size=4)


def _wait_port(port: int, deadline: float) -> None:
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("etcd did not come up")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> Iterator[str]:
    if shutil.which("etcd") is None:
        pytest.fail("needs etcd (Debian's etcd-server)")
    root = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    process = subprocess.Popen(
        ["etcd", "--data-dir", str(root / "data"), "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
         "--initial-cluster", f"default={peer_url}"],
        stdout=subprocess.DEVNULL, stderr=open(root / "etcd.log", "w"),
    )
    _wait_port(client, time.monotonic() + 30)
    yield url
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, etcd: str) -> Iterator[List[Server]]:
    servers = [
        start(tmp_path_factory.mktemp(f"n{i}") / "data", "--etcd", etcd, "--node-id", f"n{i}", "--lease-ttl-secs", "2")
        for i in range(3)
    ]
    yield servers
    for s in servers:
        stop(s)


@pytest.fixture(scope="module")
def cluster(nodes: List[Server]) -> kvtier.Cluster:
    c = kvtier.Cluster([nodes[0].address])
    deadline = time.monotonic() + 30
    while sum(n["state"] == "serving" for n in c.nodes) < 3:
        assert time.monotonic() < deadline, c.nodes
        time.sleep(0.1)
        c.refresh()
    return c


def kv(seed: int, tokens: int) -> np.ndarray:
    return (np.arange(2 * tokens * 8, dtype=np.float32).reshape(2, tokens, 8) + seed * 1000)


def test_placement_agrees_with_the_nodes_and_refusals_name_the_owner(cluster: kvtier.Cluster) -> None:
    placed = {}
    for i in range(12):
        seq = f"py{i}"
        owner = cluster.owner(seq)
        # Straight to the node this client computed: it accepts.
        kvtier.Client(owner["addr"]).create(seq, LAYOUT)
        placed[seq] = owner["node_id"]
        for other in cluster.nodes:
            if other["node_id"] == owner["node_id"]:
                continue
            with pytest.raises(kvtier.errors.FailedPrecondition) as refused:
                kvtier.Client(other["addr"]).info(seq)
            assert refused.value.owner == (owner["node_id"], owner["addr"])
            assert owner["node_id"] in str(refused.value)
    assert len(set(placed.values())) == 3, placed


def test_routed_round_trips(cluster: kvtier.Cluster) -> None:
    for i in range(6):
        seq = f"rt{i}"
        created = cluster.create(seq, LAYOUT)
        assert created["node_id"] == cluster.owner(seq)["node_id"]
        data = kv(i, 6)
        cluster.call(seq, lambda c: c.put(seq, 1, data, data + 0.5))
        fresh = kvtier.Cluster([cluster.nodes[0]["addr"]])  # knows no owner yet
        pages = fresh.call(seq, lambda c: c.fetch(seq, 1))
        k = np.concatenate([p.k for p in pages if p.kv_head == 0])
        np.testing.assert_array_equal(k, data[0])
        fresh.drop(seq)
        with pytest.raises(kvtier.errors.NotFound):
            cluster.client(seq).info(seq)


def test_lookup_finds_a_prompts_stored_pages(cluster: kvtier.Cluster) -> None:
    hashes = [b"prompt-a-0", b"prompt-a-1", b"prompt-a-2"]
    node, pages = cluster.lookup(LAYOUT, hashes)
    assert pages == 0
    first = cluster.create("prompt-a", LAYOUT, hashes)
    assert first["node_id"] == node["node_id"]
    client = cluster.client("prompt-a")
    for layer in range(2):
        client.put("prompt-a", layer, kv(7, 8), kv(7, 8) + 0.5)  # two full pages
    node, pages = cluster.lookup(LAYOUT, hashes)
    assert (node["node_id"], pages) == (first["node_id"], 2)
    second = cluster.create("prompt-b", LAYOUT, hashes)
    assert (second["node_id"], int(second["attached_pages"])) == (first["node_id"], 2)


def test_a_groups_shards_land_on_distinct_nodes_and_select_as_one_sequence(cluster: kvtier.Cluster) -> None:
    created = cluster.create_group("grp", 3, LAYOUT)
    assert len({c["node_id"] for c in created}) == 3, created
    rng = np.random.default_rng(5)
    k, v = rng.standard_normal((2, 3 * 16, 8)).astype(np.float32), rng.standard_normal((2, 3 * 16, 8)).astype(np.float32)
    for rank in range(3):
        sid = kvtier.Cluster.shard_id("grp", rank)
        block = slice(rank * 16, (rank + 1) * 16)  # 4 pages per shard
        cluster.call(sid, lambda c: c.put(sid, 1, k[:, block], v[:, block]))
    cluster.create("grp-whole", LAYOUT)
    cluster.call("grp-whole", lambda c: c.put("grp-whole", 1, k, v))
    q = rng.standard_normal((4, 8)).astype(np.float32)
    for budget, sinks, window in [(5, 1, 1), (12, 0, 0), (3, 1, 2)]:
        merged = cluster.select_group("grp", 3, 1, q, budget, sink_pages=sinks, window_pages=window)
        whole = cluster.call(
            "grp-whole",
            lambda c: c.select("grp-whole", 1, q, budget, sink_pages=sinks, window_pages=window, mode="quest",
                               include_data=False),
        )
        got = [[(p["page"], p["bound"]) for p in h["pages"]] for h in merged]
        want = [[(p.page, p.bound) for p in h.pages] for h in whole.heads]
        assert got == want, (budget, sinks, window)


def test_a_lookup_finds_a_prompt_on_its_old_node_after_a_join(tmp_path_factory, etcd: str) -> None:
    # A cluster of its own on the same etcd, which a third node joins.
    def node(name: str) -> Server:
        data = tmp_path_factory.mktemp(name) / "data"
        return start(data, "--etcd", etcd, "--cluster", "py-join", "--node-id", name, "--lease-ttl-secs", "2")

    servers = [node("j0"), node("j1")]
    try:
        c = kvtier.Cluster([servers[0].address])
        deadline = time.monotonic() + 30
        while sum(n["state"] == "serving" for n in c.nodes) < 2:
            assert time.monotonic() < deadline, c.nodes
            time.sleep(0.1)
            c.refresh()
        # A prompt whose first hash three equal nodes place on j2.
        weight = float(c.nodes[0]["capacity"]["host"] + c.nodes[0]["capacity"]["nvme"])
        three = [("j0", weight), ("j1", weight), ("j2", weight)]
        first = next(h for h in (f"joined-{i}".encode() for i in range(256)) if placement(three, "", "", h)[0] == 2)
        hashes = [first, b"joined-page-1"]
        before = c.create("pj", LAYOUT, hashes)
        for layer in range(2):
            c.call("pj", lambda cl: cl.put("pj", layer, kv(3, 8), kv(3, 8) + 0.5))  # two full pages
        assert (c.lookup(LAYOUT, hashes)[0]["node_id"], c.lookup(LAYOUT, hashes)[1]) == (before["node_id"], 2)
        servers.append(node("j2"))
        deadline = time.monotonic() + 30
        while sum(n["state"] == "serving" for n in c.nodes) < 3:
            assert time.monotonic() < deadline, c.nodes
            time.sleep(0.1)
            c.refresh()
        assert c.owner("", hashes)["node_id"] == "j2"
        node_found, pages = c.lookup(LAYOUT, hashes)
        assert (node_found["node_id"], pages) == (before["node_id"], 2)
    finally:
        for s in servers:
            stop(s)


def test_a_standalone_server_is_in_no_cluster(tmp_path: Path) -> None:
    server = start(tmp_path / "data")
    try:
        with pytest.raises(kvtier.errors.FailedPrecondition, match="not in a cluster"):
            kvtier.Cluster([server.address])
    finally:
        stop(server)


def test_a_client_never_reads_a_later_creation_of_the_id(cluster: kvtier.Cluster) -> None:
    first = kvtier.Cluster([cluster.nodes[0]["addr"]])
    created = first.create("again", LAYOUT)
    assert int(created["incarnation"]) != 0
    first.call("again", lambda c: c.put("again", 0, kv(1, 4), kv(1, 4)))
    # Another client drops the id and creates it again, with other bytes.
    other = kvtier.Cluster([cluster.nodes[0]["addr"]])
    other.drop("again")
    other.create("again", LAYOUT)
    other.call("again", lambda c: c.put("again", 0, kv(2, 4), kv(2, 4)))
    with pytest.raises(kvtier.errors.NotFound, match="created again"):
        first.call("again", lambda c: c.fetch("again", 0))
    pages = other.call("again", lambda c: c.fetch("again", 0))
    np.testing.assert_array_equal(pages[0].k, kv(2, 4)[0])
