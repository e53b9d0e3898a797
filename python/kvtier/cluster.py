"""A client of a kvtier cluster: it learns the members from any node,
creates each sequence on the node placement gives it, and sends every
later call to the sequence's owner.

Placement is kvtier's own rule (weighted rendezvous hashing, computed by
the native module exactly as the nodes compute it): the tenant and the
first prefix hash when a sequence has a hash chain, else the tenant and
the sequence id, over the serving nodes.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar

from . import errors
from ._native import placement
from .client import Client, _hash
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

    def _placed(self, sequence_id: str, prefix_hashes: Sequence[bytes] = ()) -> Dict[str, Any]:
        serving = [n for n in self.nodes if n["state"] == "serving"]
        weights = [(n["node_id"], float(n["capacity"]["host"] + n["capacity"]["nvme"])) for n in serving]
        first = _hash(prefix_hashes[0]) if prefix_hashes else None
        ranked = placement(weights, self.tenant, sequence_id, first)
        if not ranked:
            raise errors.Unavailable("no node of the cluster is serving")
        return serving[ranked[0]]

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
        target = (node["node_id"], node["addr"])
        try:
            created = self._node_client(target[1]).create(sequence_id, layout, hashes)
        except errors.FailedPrecondition as e:
            if e.owner is None:
                raise
            target = e.owner
            self.refresh()
            created = self._node_client(target[1]).create(sequence_id, layout, hashes)
        self._owners[sequence_id] = (target[1], int(created.get("incarnation", 0)))
        return dict(created, node_id=target[0], addr=target[1])

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
        """The node a prompt's hash chain places on, and how many of its
        leading pages are stored there: a create with the chain attaches
        them, and the worker recomputes only the rest."""
        hashes = [_hash(h) for h in prefix_hashes]
        if not hashes:
            return self._placed(""), 0
        node = self._placed("", hashes)
        reply = self._node_client(node["addr"]).call(
            "LookupPrefix", {"tenant": self.tenant, "layout": layout.to_proto(), "prefix_hashes": hashes}
        )
        return node, int(reply["pages"])
