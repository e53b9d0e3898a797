"""A client of a kvtier cluster: it learns the members from any node,
creates each sequence on the node placement gives it, and sends every
later call to the sequence's owner.

Placement is kvtier's own rule (weighted rendezvous hashing, computed by
the native module exactly as the nodes compute it): the tenant and the
first prefix hash when a sequence has a hash chain, else the tenant and
the sequence id, over the serving nodes. A context-parallel group's shards
are placed by the group's name, shard ``r`` on the r-th node of its
ranking, and a selection over the group fans out to them and merges
exactly (the Rust client's merge, through the native module).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar

from . import errors
from ._native import placement, select_partitioned
from .client import Client, _hash, _heads, _queries
from .types import Layout

T = TypeVar("T")


class Cluster:
    """Clients of every node of a cluster, for one tenant.

    >>> cluster = kvtier.Cluster(["http://127.0.0.1:50050", "http://127.0.0.1:50051"])
    >>> node = cluster.create("req-1", layout)          # the node it went to
    >>> cluster.client("req-1").put("req-1", 0, k, v)   # the owner's client

    ``addresses``: nodes to learn the membership from (any one that
    answers will do); the other keywords are :class:`kvtier.Client`'s and
    apply to every node.
    """

    def __init__(self, addresses: Iterable[str], *, tenant: str = "", **client_kw: Any):
        self.tenant = tenant
        self._kw = dict(client_kw, tenant=tenant)
        self._seeds: List[str] = list(addresses)
        if not self._seeds:
            raise ValueError("addresses: at least one node's address")
        self._clients: Dict[str, Client] = {}
        #: Per sequence routed: the owner's address while known, and the
        #: creation (incarnation) calls are meant for.
        self._owners: Dict[str, Tuple[Optional[str], int]] = {}
        self.nodes: List[Dict[str, Any]] = []
        self.refresh()

    def _node_client(self, address: str) -> Client:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = Client(address, **self._kw)
        return client

    def refresh(self) -> List[Dict[str, Any]]:
        """Reads the members again from the first node that answers."""
        tried: List[str] = []
        last: Optional[errors.KvtierError] = None
        for address in [n["addr"] for n in self.nodes] + self._seeds:
            if address in tried:
                continue
            tried.append(address)
            try:
                view = self._node_client(address).call("GetCluster", {})
            except (errors.Unavailable, errors.DeadlineExceeded) as e:
                last = e
                continue
            self.nodes = list(view["nodes"])
            return self.nodes
        raise errors.Unavailable(f"no node answered GetCluster (tried {', '.join(tried)}): {last}")

    def _placed(self, sequence_id: str, prefix_hashes: Sequence[bytes] = (), rank: int = 0) -> Dict[str, Any]:
        """The node of the rank-th place in the key's ranking (a group's
        shard ``rank``; 0: the owner), wrapping when fewer nodes serve."""
        serving = [n for n in self.nodes if n["state"] == "serving"]
        weights = [(n["node_id"], float(n["capacity"]["host"] + n["capacity"]["nvme"])) for n in serving]
        first = _hash(prefix_hashes[0]) if prefix_hashes else None
        ranked = placement(weights, self.tenant, sequence_id, first)
        if not ranked:
            raise errors.Unavailable("no node of the cluster is serving")
        return serving[ranked[rank % len(ranked)]]

    def owner(self, sequence_id: str, prefix_hashes: Sequence[bytes] = ()) -> Dict[str, Any]:
        """The node placement gives a sequence (its record from GetCluster)."""
        return self._placed(sequence_id, list(prefix_hashes))

    def _for(self, address: str, incarnation: int) -> Client:
        """The node's client, its calls meant for ``incarnation``."""
        client = copy.copy(self._node_client(address))
        client.incarnation = incarnation or None
        return client

    def create(self, sequence_id: str, layout: Layout, prefix_hashes: Iterable[bytes] = ()) -> Dict[str, Any]:
        """Creates the sequence on its placement's node (once more on the
        node a refusal names); the response, with the node's ``node_id``
        and ``addr``."""
        hashes = [_hash(h) for h in prefix_hashes]
        node = self._placed(sequence_id, hashes)
        return self._create_at(node, sequence_id, lambda c: c.create(sequence_id, layout, hashes))

    def _create_at(self, node: Dict[str, Any], sequence_id: str, create: Callable[[Client], Dict[str, Any]]) -> Dict[str, Any]:
        target = (node["node_id"], node["addr"])
        try:
            created = create(self._node_client(target[1]))
        except errors.FailedPrecondition as e:
            if e.owner is None:
                raise
            target = e.owner
            self.refresh()
            created = create(self._node_client(target[1]))
        self._owners[sequence_id] = (target[1], int(created.get("incarnation", 0)))
        return dict(created, node_id=target[0], addr=target[1])

    @staticmethod
    def shard_id(group: str, rank: int) -> str:
        """The sequence id of shard ``rank`` of context-parallel group ``group``."""
        return f"{group}.cp{rank}"

    def create_group(
        self, group: str, world: int, layout: Layout, prefix_hashes: Iterable[bytes] = ()
    ) -> List[Dict[str, Any]]:
        """Creates the ``world`` shards of context-parallel group ``group``,
        shard ``r`` (:meth:`shard_id`) on the r-th node of the group's
        placement (distinct nodes while as many serve): each holds its
        rank's block of positions, shard 0 the first. The create responses,
        with each node's ``node_id`` and ``addr``, in rank order."""
        hashes = [_hash(h) for h in prefix_hashes]
        created = []
        for rank in range(world):
            sid = self.shard_id(group, rank)
            request = {
                "tenant": self.tenant,
                "sequence_id": sid,
                "layout": layout.to_proto(),
                "prefix_hashes": hashes,
                "group": {"name": group, "rank": rank, "world": world},
            }
            node = self._placed(group, hashes, rank)
            created.append(self._create_at(node, sid, lambda c: c.call("CreateSequence", request)))
        return created

    def select_group(
        self,
        group: str,
        world: int,
        layer: int,
        queries: Any,
        budget_pages: int,
        *,
        kv_heads: Any = None,
        sink_pages: int = 0,
        window_pages: int = 0,
        aggregation: str = "max",
        mode: str = "quest",
    ) -> List[Dict[str, Any]]:
        """The exact selection over the whole group: each shard's node
        ranks its block (shard ``r`` holding the r-th block of pages, as
        the shards hold them now), and the answers merge into what one node
        holding every page would choose, per KV head (``HeadSelection``
        dicts, global page numbers). Scores must compare across nodes:
        ``"quest"`` or ``"cuboid"``."""
        parts = []
        first_page = 0
        layout = None
        for rank in range(world):
            sid = self.shard_id(group, rank)
            client = self.client(sid)
            info = client.info(sid)
            layout = info["layout"]
            pages = -(-int(info["max_tokens"]) // int(layout["page_size"]))
            parts.append((client._conn, sid, first_page, pages, client.incarnation or 0))
            first_page += pages
        assert layout is not None, "world: at least 1"
        start, count = _heads(kv_heads, int(layout["num_kv_heads"]))
        request = {
            "tenant": self.tenant,
            "layer": layer,
            "kv_head_start": start,
            "kv_head_count": count,
            "queries": _queries(queries),
            "budget_pages": budget_pages,
            "sink_pages": sink_pages,
            "window_pages": window_pages,
            "aggregation": aggregation,
            "mode": mode,
        }
        return select_partitioned(parts, request)

    def client(self, sequence_id: str) -> Client:
        """The client of the node that owns the sequence, its calls meant for
        the creation this cluster client created or first found: the node
        its create went to, else found by asking the node placement names
        (which answers with the owner when it is not)."""
        address, incarnation = self._owners.get(sequence_id, (None, 0))
        if address is not None:
            return self._for(address, incarnation)
        address = self._placed(sequence_id)["addr"]
        try:
            info = self._for(address, incarnation).info(sequence_id)
        except errors.FailedPrecondition as e:
            if e.owner is None:
                raise
            address = e.owner[1]
            info = self._for(address, incarnation).info(sequence_id)
        incarnation = incarnation or int(info.get("incarnation", 0))
        self._owners[sequence_id] = (address, incarnation)
        return self._for(address, incarnation)

    def call(self, sequence_id: str, fn: Callable[[Client], T]) -> T:
        """``fn(owner's client)``; refused because the sequence is elsewhere,
        or the node unreachable, it is routed afresh (still for the same
        creation) and run once more."""
        try:
            return fn(self.client(sequence_id))
        except (errors.FailedPrecondition, errors.Unavailable) as e:
            if isinstance(e, errors.FailedPrecondition) and e.owner is None:
                raise
            _, incarnation = self._owners.get(sequence_id, (None, 0))
            self._owners[sequence_id] = (e.owner[1] if e.owner else None, incarnation)
            self.refresh()
            return fn(self.client(sequence_id))

    def drop(self, sequence_id: str) -> None:
        """Drops the sequence on its owner and forgets where it was."""
        self.call(sequence_id, lambda c: c.drop(sequence_id))
        self._owners.pop(sequence_id, None)

    def lookup(self, layout: Layout, prefix_hashes: Iterable[bytes]) -> Tuple[Dict[str, Any], int]:
        """Where a prompt's leading pages are stored anywhere in the cluster,
        and how many, so a worker recomputes only the rest: the node its
        first hash places on is asked first (a create with the chain goes
        there and attaches them); unless it holds the whole chain, every
        other serving node too (after a join the pages stay where they were
        until a rebalance). The node holding the most answers, placement's
        on ties."""
        hashes = [_hash(h) for h in prefix_hashes]
        if not hashes:
            return self._placed(""), 0
        request = {"tenant": self.tenant, "layout": layout.to_proto(), "prefix_hashes": hashes}
        owner = self._placed("", hashes)
        best = (owner, int(self._node_client(owner["addr"]).call("LookupPrefix", request)["pages"]))
        if best[1] < len(hashes):
            others = sorted(
                (n for n in self.nodes if n["state"] == "serving" and n["node_id"] != owner["node_id"]),
                key=lambda n: n["node_id"],
            )
            for node in others:
                try:
                    pages = int(self._node_client(node["addr"]).call("LookupPrefix", request)["pages"])
                except (errors.Unavailable, errors.DeadlineExceeded):
                    continue  # a node that cannot answer holds nothing usable
                if pages > best[1]:
                    best = (node, pages)
        return best
