"""The blocking client, and the calls both clients share.

Every method is written once, as a generator that yields the RPCs it needs
(:class:`_Rpc`) and returns the result; :class:`Client` runs it blocking
(the GIL released while it waits), :class:`kvtier.AsyncClient` awaits it.
"""

from __future__ import annotations

import operator
import os
from typing import Any, Dict, Generator, Iterable, List, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np

from . import _arrays
from ._native import Connection, SelectRequest
from .types import (
    Layout,
    Page,
    Selection,
    SelectionKV,
    ShmRegion,
    ShmWindow,
    page_from_proto,
    selection_from_proto,
    selection_kv_from_native,
    window_of,
)

T = TypeVar("T")

DEFAULT_ADDRESS = "http://127.0.0.1:50051"
#: Where ``kvtier serve`` puts its shm socket by default, from the directory it runs in.
DEFAULT_SHM_SOCKET = os.path.join("kvtier-data", "shm.sock")

Heads = Union[int, Tuple[int, int], range, None]
Shm = Optional[Union[ShmRegion, ShmWindow]]

#: The largest message the client sends (as the server accepts by default).
MAX_MESSAGE_BYTES = 64 << 20


class _Rpc:
    """One RPC a method needs: its name and request (a dict, or a list of
    dicts for PutPages), the shm region whose connection carries it
    (``None``: gRPC), and whether its answer (SelectPages') comes gathered
    per head (``(info, heads)``, see ``python/src/gathered.rs``)."""

    __slots__ = ("method", "request", "via", "gather", "views")

    def __init__(
        self, method: str, request: Any, via: Optional[ShmRegion] = None, gather: bool = False, views: bool = False
    ):
        self.method = method
        self.request = request
        self.via = via
        self.gather = gather
        #: With ``gather`` over a region: heads laid out in one run each
        #: come as where they are in it (``(offset, length)``), not copied.
        self.views = views


Steps = Generator[_Rpc, Any, T]

#: The arguments of :meth:`_Api.select_kv` that every step of a decode
#: loop shares: :meth:`_Api.select_kv_call`'s.
_KV_CALL_OPTIONS = (
    "kv_heads",
    "sink_pages",
    "window_pages",
    "aggregation",
    "shard",
    "swap_in",
    "deadline_us",
    "prefetch_pages",
    "lease_ms",
    "shm",
    "mode",
    "candidates",
    "softmax_scale",
    "top_p",
    "min_pages",
    "reuse_similarity",
    "views",
    "attend",
)


def _select_options(
    sink_pages: int,
    window_pages: int,
    aggregation: Optional[str],
    shard: Any,
    include_data: bool,
    swap_in: bool,
    deadline_us: int,
    prefetch_pages: int,
    lease_ms: int,
) -> Dict[str, Any]:
    """The fields of a ``SelectPagesRequest`` that ``select`` and
    ``select_kv`` take as they are."""
    return {
        "sink_pages": sink_pages,
        "window_pages": window_pages,
        "aggregation": aggregation,
        "shard": shard,
        "include_data": include_data,
        "swap_in": swap_in,
        "deadline_us": deadline_us,
        "prefetch_pages": prefetch_pages,
        "lease_ms": lease_ms,
    }


def _heads(kv_heads: Heads, default_count: int) -> Tuple[int, int]:
    """``(start, count)`` from an int (one head), a ``(start, count)`` pair
    or a range; all ``default_count`` heads from 0 when None."""
    return _span(kv_heads, default_count, "kv_heads")


def _span(value: Any, default_count: int, name: str) -> Tuple[int, int]:
    """``(start, count)`` from None (all ``default_count`` from 0), one
    index, a ``(start, count)`` pair or a range of consecutive indices."""
    if value is None:
        return 0, default_count
    if isinstance(value, range):
        if value.step != 1:
            raise ValueError(f"{name}: a range of consecutive indices")
        return value.start, len(value)
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"{name}: (start, count), got {value!r}")
        return operator.index(value[0]), operator.index(value[1])
    try:
        return operator.index(value), 1
    except TypeError:
        raise TypeError(f"{name}: an index, (start, count) or a range, got {type(value).__name__}") from None


def _indices(values: Any, name: str) -> List[int]:
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        raise TypeError(f"{name}: a sequence of integer indices") from None


def _hash(h: Any) -> bytes:
    if isinstance(h, int) or not isinstance(h, (bytes, bytearray, memoryview)):
        raise TypeError(f"prefix_hashes: each hash is bytes, got {type(h).__name__}")
    return bytes(h)


def _queries(queries: Any) -> bytes:
    return np.ascontiguousarray(_arrays.as_array(queries, "queries"), dtype="<f4").tobytes()


class _Api:
    """The calls, written once for both clients."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        tenant: str = "",
        token: Optional[str] = None,
        tls_ca: Optional[bytes] = None,
        tls_domain: Optional[str] = None,
        persist: bool = False,
        shm_socket: Optional[str] = None,
        timeout: Optional[float] = None,
    ):
        if not address.startswith(("http://", "https://")):
            raise ValueError(f"address: {address!r} must start with http:// (or https:// with tls_ca)")
        # Connecting is one short blocking step, as constructors are.
        self._conn = Connection(address, token, tls_ca, tls_domain, timeout)
        self.tenant = tenant
        #: In a cluster: the creation of the sequence calls are meant for
        #: (set by :class:`kvtier.Cluster` on the client it hands out); a
        #: node refuses them with NotFound once the id is created again.
        self.incarnation: Optional[int] = None
        self.persist = persist
        self.shm_socket = shm_socket or DEFAULT_SHM_SOCKET
        self._layouts: Dict[str, Layout] = {}

    def _run(self, steps: Steps[T]) -> T:
        raise NotImplementedError

    def _via(self, shm: Shm) -> Optional[ShmRegion]:
        """The region whose connection carries a call naming ``shm``: one
        this client registered (a region of another client's is named over
        gRPC, as before)."""
        window = window_of(shm)
        if window is None or window.region._owner is not self._conn:
            return None
        return window.region

    def _seq(self, sequence_id: str) -> Dict[str, Any]:
        return {"tenant": self.tenant, "sequence_id": sequence_id}

    def _write(
        self, sequence_id: str, layout: Layout, layer: int, k: Any, v: Any, kv_head_start: int, persist: Optional[bool]
    ) -> Dict[str, Any]:
        """The fields a put and an append share: K and V packed for heads
        ``kv_head_start..``."""
        kv, heads, tokens = _arrays.pack_kv(k, v, layout.dtype, layout.head_dim)
        if len(kv) > MAX_MESSAGE_BYTES - 4096:
            raise ValueError(
                f"k, v: {len(kv)} bytes in one message; at most {MAX_MESSAGE_BYTES} fit: write fewer tokens per call"
            )
        return {
            **self._seq(sequence_id),
            "layer": layer,
            "kv_head_start": kv_head_start,
            "kv_head_count": heads,
            "num_tokens": tokens,
            "kv": kv,
            "persist": self.persist if persist is None else persist,
        }

    def _step_kv(
        self, layout: Layout, append: Optional[Tuple[Any, Any]], position: Optional[int]
    ) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """A selection's ``append`` (``SelectPagesRequest.append``): the
        step's own ``(k, v)`` checked, in the layout's dtype."""
        if append is None:
            if position is not None:
                raise ValueError("append_position: applies to an append; give append=(k, v) too")
            return None
        k, v = _arrays.kv_arrays(*append, layout.dtype, layout.head_dim)
        if 2 * k.nbytes > MAX_MESSAGE_BYTES - 4096:
            raise ValueError(f"append: {2 * k.nbytes} bytes of K and V; at most {MAX_MESSAGE_BYTES} fit in one message")
        return k, v

    def _layout(self, sequence_id: str) -> Steps[Layout]:
        """The sequence's layout: known from ``create``, else asked once.
        (A sequence another client drops and creates again under the same
        id with another layout needs :meth:`forget`.)"""
        layout = self._layouts.get(sequence_id)
        if layout is None:
            info = yield _Rpc("GetSequence", self._seq(sequence_id))
            layout = self._layouts[sequence_id] = Layout.from_proto(info["layout"])
        return layout

    def forget(self, sequence_id: str) -> None:
        """Forgets the layout this client knows for ``sequence_id``; the
        next call asks the server again."""
        self._layouts.pop(sequence_id, None)

    # Sequences

    def create(self, sequence_id: str, layout: Layout, prefix_hashes: Iterable[bytes] = ()) -> Dict[str, Any]:
        """Creates a sequence; with ``prefix_hashes`` (one per full page of
        the prompt) it shares the longest prefix already stored. Returns the
        ``CreateSequenceResponse`` as a dict (``attached_pages``, ``info``)."""

        def steps() -> Steps[Dict[str, Any]]:
            reply = yield _Rpc(
                "CreateSequence",
                {**self._seq(sequence_id), "layout": layout.to_proto(), "prefix_hashes": [_hash(h) for h in prefix_hashes]},
            )
            self._layouts[sequence_id] = layout
            return reply

        return self._run(steps())

    def info(self, sequence_id: str) -> Dict[str, Any]:
        """The sequence's ``SequenceInfo`` as a dict: layout, tokens, pages by
        state, bytes per tier, gone pages by reason."""

        def steps() -> Steps[Dict[str, Any]]:
            return (yield _Rpc("GetSequence", self._seq(sequence_id)))

        return self._run(steps())

    def drop(self, sequence_id: str) -> None:
        """Drops the sequence and every page only it uses."""

        def steps() -> Steps[None]:
            yield _Rpc("DropSequence", self._seq(sequence_id))
            self._layouts.pop(sequence_id, None)

        return self._run(steps())

    # Writes

    def put(
        self,
        sequence_id: str,
        layer: int,
        k: Any,
        v: Any,
        *,
        kv_head_start: int = 0,
        first_page: int = 0,
        persist: Optional[bool] = None,
    ) -> Dict[str, Any]:
        """Writes whole pages of one layer: ``k`` and ``v`` are ``[kv_heads,
        tokens, head_dim]`` for heads ``kv_head_start..``, starting at page
        ``first_page`` (where those heads end). Returns the
        ``PutPagesResponse`` as a dict (``durability`` is ``"memory"``, or
        ``"relaxed"``/``"fsync"`` with ``persist``)."""
        return self.put_layers(sequence_id, [(layer, k, v)], kv_head_start=kv_head_start, first_page=first_page, persist=persist)

    def put_layers(
        self,
        sequence_id: str,
        layers: Iterable[Tuple[int, Any, Any]],
        *,
        kv_head_start: int = 0,
        first_page: int = 0,
        persist: Optional[bool] = None,
    ) -> Dict[str, Any]:
        """Writes ``(layer, k, v)`` for many layers in one streamed call (a
        whole prefill)."""

        def steps() -> Steps[Dict[str, Any]]:
            layout = yield from self._layout(sequence_id)
            writes = [
                {**self._write(sequence_id, layout, layer, k, v, kv_head_start, persist), "first_page": first_page}
                for layer, k, v in layers
            ]
            return (yield _Rpc("PutPages", writes))

        return self._run(steps())

    def append(
        self,
        sequence_id: str,
        layer: int,
        k: Any,
        v: Any,
        *,
        kv_head_start: int = 0,
        position: Optional[int] = None,
        persist: Optional[bool] = None,
        shm: Shm = None,
    ) -> Dict[str, Any]:
        """Appends decode tokens to one layer: ``k`` and ``v`` are
        ``[kv_heads, tokens, head_dim]``. With ``position``, refused unless
        the heads hold exactly that many tokens (a safe retry). With
        ``shm``, a region this client registered (or a window of it), the
        call goes over the region's connection instead of gRPC. Returns the ``AppendTokensResponse`` as a dict
        (``tokens``, ``durability``, ``timing``)."""

        def steps() -> Steps[Dict[str, Any]]:
            layout = yield from self._layout(sequence_id)
            request = {**self._write(sequence_id, layout, layer, k, v, kv_head_start, persist), "position": position}
            return (yield _Rpc("AppendTokens", request, self._via(shm)))

        return self._run(steps())

    # Reads

    def fetch(
        self,
        sequence_id: str,
        layer: int,
        pages: Optional[Sequence[int]] = None,
        *,
        kv_heads: Heads = None,
        per_head_pages: Optional[Sequence[Sequence[int]]] = None,
        include_digests: bool = False,
        shm: Shm = None,
    ) -> List[Page]:
        """Reads pages of one layer (every page when ``pages`` is None) for
        ``kv_heads`` (all by default; an int for one, or ``(start, count)``), or ``per_head_pages`` (one list per head); an empty list fetches nothing. Returns a list
        of :class:`Page`, head by head. With ``shm`` the bytes land in the
        region and each page's arrays view it, and the call goes over the
        region's connection instead of gRPC."""

        def steps() -> Steps[List[Page]]:
            layout = yield from self._layout(sequence_id)
            start, count = _heads(kv_heads, layout.num_kv_heads if per_head_pages is None else len(per_head_pages))
            wanted = None if pages is None else _indices(pages, "pages")
            lists = None if per_head_pages is None else [_indices(p, "per_head_pages") for p in per_head_pages]
            # An empty list asks for no page (the proto's empty field means all).
            if wanted == [] or (lists is not None and not any(lists)):
                return []
            window = window_of(shm)
            request = {
                **self._seq(sequence_id),
                "layer": layer,
                "kv_head_start": start,
                "kv_head_count": count,
                "pages": wanted or [],
                "per_head_pages": [{"pages": p} for p in lists or []],
                "include_digests": include_digests,
                "shm": window.to_proto() if window else None,
            }
            replies = yield _Rpc("FetchPages", request, self._via(window))
            return [page_from_proto(p, layout, window) for r in replies for p in r["pages"]]

        return self._run(steps())

    def _select_request(
        self, sequence_id: str, layout: Layout, layer: int, queries: Any, budget_pages: int, kv_heads: Heads, options: Dict[str, Any]
    ) -> Dict[str, Any]:
        """A ``SelectPagesRequest`` (select and prefetch send the same)."""
        start, count = _heads(kv_heads, layout.num_kv_heads)
        return {
            **self._seq(sequence_id),
            "layer": layer,
            "kv_head_start": start,
            "kv_head_count": count,
            "queries": _queries(queries),
            "budget_pages": budget_pages,
            **options,
            "shard": _shard(options.get("shard")),
        }

    def select(
        self,
        sequence_id: str,
        layer: int,
        queries: Any,
        budget_pages: int,
        *,
        kv_heads: Heads = None,
        sink_pages: int = 0,
        window_pages: int = 0,
        aggregation: Optional[str] = None,
        shard: Any = None,
        include_data: bool = True,
        swap_in: bool = False,
        deadline_us: int = 0,
        prefetch_pages: int = 0,
        lease_ms: int = 0,
        shm: Shm = None,
        mode: Optional[str] = None,
        candidates: int = 0,
        softmax_scale: float = 0.0,
        top_p: float = 0.0,
        min_pages: int = 0,
        reuse_similarity: float = 0.0,
        append: Optional[Tuple[Any, Any]] = None,
        append_position: Optional[int] = None,
    ) -> Selection:
        """Chooses the pages a decode step's ``queries`` (``[query heads,
        head_dim]`` of the KV heads' groups, post-RoPE) need: per KV head the
        top ``budget_pages`` as ``mode`` ranks them (``"quest"``, the sound
        bound; ``"cuboid"``; ``"sketch"`` or ``"two_stage"``, by attention
        mass estimated from per-token key sketches; ``None``: the server's
        default, two-stage), ``sink_pages`` first and ``window_pages`` last
        pages included. ``candidates``: two-stage's stage-one factor (0: 4);
        ``softmax_scale`` (0: 1/sqrt(head_dim)); ``top_p``/``min_pages``: a
        top-p budget for the mass modes (0: off); ``reuse_similarity``:
        reuse each lane's last ranking while every query head's cosine
        similarity to the query that made it is at least this (0: rank
        every call; the answer's ``lanes_reused`` counts). Aggregation over a group:
        ``"max"``, ``"mean"`` or ``"per_query_head"`` (``None``: the mode's
        own, max for quest and cuboid, mean for the mass modes). ``shard``: a
        context-parallel rank as ``(rank, world[, "contiguous"|"strided"[,
        "global"|"local"]])``. ``swap_in`` makes the chosen pages hot
        (answering by ``deadline_us`` if set), ``prefetch_pages`` promotes
        the next-ranked in the background, ``lease_ms`` pins the chosen
        pages. ``append=(k, v)``: a decode step's own tokens
        (``[kv_heads, tokens, head_dim]`` for the selected KV heads),
        appended in the same call once the selection is made (which leaves
        them out), their shape and position checked before it, persisted
        as the client's ``persist`` says; ``append_position`` as
        :meth:`append`'s ``position`` (give it: a call that fails without
        a refusal may have appended); the answer's ``appended`` is the
        ``AppendTokensResponse``. Unsharded only. Returns a :class:`Selection`; with
        ``include_data`` its pages' K and V (over ``shm``, views of the
        region; the call then goes over the region's connection instead of
        gRPC)."""

        window = window_of(shm)
        options = _select_options(
            sink_pages, window_pages, aggregation, shard, include_data, swap_in, deadline_us, prefetch_pages, lease_ms
        )
        options.update(shm=window.to_proto() if window else None, **_ranking(mode, candidates, softmax_scale, top_p, min_pages, reuse_similarity))

        def steps() -> Steps[Selection]:
            layout = yield from self._layout(sequence_id)
            request = self._select_request(sequence_id, layout, layer, queries, budget_pages, kv_heads, options)
            step = self._step_kv(layout, append, append_position)
            if step is not None:
                kv, _, tokens = _arrays.pack_kv(*step, layout.dtype, layout.head_dim)
                request["append"] = {"num_tokens": tokens, "kv": kv, "position": append_position, "persist": self.persist}
            replies = yield _Rpc("SelectPages", request, self._via(window))
            return selection_from_proto(replies, layout, window)

        return self._run(steps())

    def select_kv(
        self,
        sequence_id: str,
        layer: int,
        queries: Any,
        budget_pages: int,
        *,
        kv_heads: Heads = None,
        sink_pages: int = 0,
        window_pages: int = 0,
        aggregation: Optional[str] = None,
        shard: Any = None,
        swap_in: bool = False,
        deadline_us: int = 0,
        prefetch_pages: int = 0,
        lease_ms: int = 0,
        shm: Shm = None,
        mode: Optional[str] = None,
        candidates: int = 0,
        softmax_scale: float = 0.0,
        top_p: float = 0.0,
        min_pages: int = 0,
        reuse_similarity: float = 0.0,
        append: Optional[Tuple[Any, Any]] = None,
        append_position: Optional[int] = None,
        views: bool = False,
        attend: bool = False,
    ) -> SelectionKV:
        """:meth:`select` for a decode step's attention: per head, the chosen
        pages' K and V rows concatenated in position order
        (``answer.head(h).k``), gathered by the native client without an
        object per page, which is most of a small selection's cost through
        ``select`` and :meth:`Selection.gather`. The arrays are the
        answer's own. With ``shm``, a region this client registered, the
        call goes over the region's connection and the pages are copied
        out of it as the call returns; the arguments are ``select``'s.
        ``append=(k, v)`` (``[kv_heads, tokens, head_dim]``) appends the
        step's own tokens once selected, at ``append_position`` if given
        (``SelectPagesRequest.append``). ``views`` (with ``shm``, a region
        of this client's): the server lays each head's K rows out in one
        run of the region, and its V rows in another
        (``SelectPagesRequest.gather_heads``), and ``k``, ``v`` are
        read-only views of them, copied nowhere: valid until the next call
        on the region (calls that may overlap, an asyncio client's, need
        windows of their own: :meth:`ShmRegion.window`). A loop making
        this call every step: :meth:`select_kv_call`. ``attend``: the
        server attends over the chosen pages with ``queries`` (at
        ``softmax_scale``) instead of returning them
        (``SelectPagesRequest.attend``): the answer's
        :attr:`SelectionKV.attention` holds each query head's output and
        log-sum-exp (over the tokens of ``append`` too, after the chosen
        pages), to merge with rows the caller holds
        (:meth:`Attention.merged`), and its heads hold no rows; over
        ``shm``, only the region's connection is used."""
        args = locals()
        options = {name: args[name] for name in _KV_CALL_OPTIONS}

        def steps() -> Steps[SelectionKV]:
            call = yield from self._select_kv_call(sequence_id, options)
            return (yield from call._steps(layer, queries, budget_pages, append, append_position))

        return self._run(steps())

    def select_kv_call(
        self,
        sequence_id: str,
        *,
        kv_heads: Heads = None,
        sink_pages: int = 0,
        window_pages: int = 0,
        aggregation: Optional[str] = None,
        shard: Any = None,
        swap_in: bool = False,
        deadline_us: int = 0,
        prefetch_pages: int = 0,
        lease_ms: int = 0,
        shm: Shm = None,
        mode: Optional[str] = None,
        candidates: int = 0,
        softmax_scale: float = 0.0,
        top_p: float = 0.0,
        min_pages: int = 0,
        reuse_similarity: float = 0.0,
        views: bool = False,
        attend: bool = False,
    ) -> SelectKvCall:
        """:meth:`select_kv` with every argument but a step's own made
        once (checked and converted when made, not on every call): a
        decode loop's selection, ``call(layer, queries, budget_pages,
        append=(k, v), append_position=p)`` per layer and step."""
        args = locals()
        options = {name: args[name] for name in _KV_CALL_OPTIONS}
        return self._run(self._select_kv_call(sequence_id, options))

    def _select_kv_call(self, sequence_id: str, options: Dict[str, Any]) -> Steps[SelectKvCall]:
        layout = yield from self._layout(sequence_id)
        shm, views, attend = options.pop("shm"), options.pop("views"), options.pop("attend")
        via = self._via(shm)
        # Attending, the region's connection carries the call and no page.
        window = window_of(shm) if via is not None and not attend else None
        if views and via is None:
            raise ValueError("views: the pages are viewed in a region; give shm, a region this client registered")
        if views and attend:
            raise ValueError("views: an attending selection returns no pages to view; leave views unset")
        ranking = _ranking(*(options.pop(k) for k in ("mode", "candidates", "softmax_scale", "top_p", "min_pages", "reuse_similarity")))
        start, count = _heads(options.pop("kv_heads"), layout.num_kv_heads)
        fields = {
            **self._seq(sequence_id),
            "kv_head_start": start,
            "kv_head_count": count,
            **_select_options(include_data=not attend, **options),
            "shard": _shard(options["shard"]),
            "shm": window.to_proto() if window else None,
            "gather_heads": bool(views),
            "attend": bool(attend),
            **ranking,
        }
        return SelectKvCall(self, layout, SelectRequest(fields), via, bool(views))

    def prefetch(
        self,
        sequence_id: str,
        layer: int,
        queries: Any,
        budget_pages: int,
        *,
        kv_heads: Heads = None,
        sink_pages: int = 0,
        window_pages: int = 0,
        aggregation: Optional[str] = None,
        shard: Any = None,
        mode: Optional[str] = None,
        candidates: int = 0,
    ) -> int:
        """Promotes, in the background, what ``select`` with these
        arguments would choose (a layer ahead, say); returns the pages
        queued."""

        def steps() -> Steps[int]:
            layout = yield from self._layout(sequence_id)
            options = {
                "sink_pages": sink_pages,
                "window_pages": window_pages,
                "aggregation": aggregation,
                "shard": shard,
                **_ranking(mode, candidates, 0.0, 0.0, 0, 0.0),
            }
            request = self._select_request(sequence_id, layout, layer, queries, budget_pages, kv_heads, options)
            return (yield _Rpc("Prefetch", request))["pages_queued"]

        return self._run(steps())

    def release_lease(self, lease_id: int) -> None:
        """Ends a lease before it expires."""

        def steps() -> Steps[None]:
            yield _Rpc("ReleaseLease", {"tenant": self.tenant, "lease_id": lease_id})

        return self._run(steps())

    # State changes and policies

    def set_page_state(
        self,
        sequence_id: str,
        action: str,
        *,
        layers: Heads = None,
        kv_heads: Heads = None,
        pages: Optional[Sequence[int]] = None,
        page_range: Optional[Tuple[int, int]] = None,
        tier: Optional[str] = None,
        rows: Optional[int] = None,
    ) -> int:
        """Moves pages between states: ``action`` is ``"offload"`` (hot →
        cold in ``tier``, ``"host"`` or ``"nvme"``), ``"swap_in"``,
        ``"migrate"`` (to ``tier``), ``"summarize"`` (to ``rows`` summary
        rows) or ``"evict"``. ``layers``/``kv_heads``: all by default, an
        int for one, ``(start, count)`` or a range; ``pages``: a list of
        page indices, or ``page_range``: ``(first, count)``; every page by
        default. Returns the number of pages that changed."""

        def steps() -> Steps[int]:
            layout = yield from self._layout(sequence_id)
            layer_start, layer_count = _span(layers, layout.num_layers, "layers")
            head_start, head_count = _heads(kv_heads, layout.num_kv_heads)
            request: Dict[str, Any] = {
                **self._seq(sequence_id),
                "layer_start": layer_start,
                "layer_count": layer_count,
                "kv_head_start": head_start,
                "kv_head_count": head_count,
                action: _action(action, tier, rows),
            }
            if pages is not None and page_range is not None:
                raise ValueError("pages: give pages or page_range, not both")
            if page_range is not None:
                request["first_page"], request["page_count"] = (operator.index(x) for x in page_range)
            elif pages is not None:
                request["pages"] = _indices(pages, "pages")
                if not request["pages"]:
                    return 0
            return (yield _Rpc("SetPageState", request))["pages"]

        return self._run(steps())

    def apply_policy(
        self,
        sequence_id: str,
        policy: Union[str, Dict[str, Any]],
        budget_tokens: int,
        *,
        action: str = "evict",
        tier: Optional[str] = None,
        rows: Optional[int] = None,
        layers: Heads = None,
        allocator: Union[str, Dict[str, Any], None] = None,
        queries: Any = None,
        trigger: Optional[str] = None,
        every_tokens: int = 0,
        **options: Any,
    ) -> Dict[str, Any]:
        """Runs an eviction/summary/offload policy (``"streaming"``,
        ``"h2o"``, ``"snapkv"``, ``"tova"``, ``"scissorhands"``,
        ``"max_mass"``; ``options`` are its fields, e.g.
        ``window_tokens=16``) keeping ``budget_tokens`` per head, over
        ``layers`` (all by default; an int for one, ``(start, count)`` or a
        range), budgets split by ``allocator``
        (``"uniform"``, ``"pyramid"`` with ``beta``, ``"ada"`` with
        ``floor``: pass a dict for options). ``trigger``: ``"now"``,
        ``"after_prefill"``, ``"every_tokens"`` (with ``every_tokens``) or
        ``"off"``. Returns the ``ApplyPolicyResponse`` as a dict."""

        def steps() -> Steps[Dict[str, Any]]:
            layout = yield from self._layout(sequence_id)
            layer_start, layer_count = _span(layers, layout.num_layers, "layers")
            spec = {policy: options} if isinstance(policy, str) else dict(policy)
            if allocator is not None:
                spec.update({allocator: {}} if isinstance(allocator, str) else allocator)
            request = {
                **self._seq(sequence_id),
                "layer_start": layer_start,
                "layer_count": layer_count,
                "policy": spec,
                "budget_tokens": budget_tokens,
                action: _action(action, tier, rows),
                "queries": None if queries is None else _queries(queries),
                "trigger": trigger,
                "every_tokens": every_tokens,
            }
            return (yield _Rpc("ApplyPolicy", request))

        return self._run(steps())

    def report_attention(
        self, sequence_id: str, layer: int, token_weights: Any, *, kv_head_start: int = 0, decay: float = 0.0
    ) -> None:
        """Reports one query's attention weights, ``[kv_heads, tokens]``
        (for H2O-style policies)."""

        def steps() -> Steps[None]:
            w = np.asarray(_arrays.as_array(token_weights, "token_weights"), dtype=np.float32)
            if w.ndim != 2:
                raise ValueError(f"token_weights: expected [kv_heads, tokens], got shape {w.shape}")
            request = {
                **self._seq(sequence_id),
                "layer": layer,
                "kv_head_start": kv_head_start,
                "kv_head_count": w.shape[0],
                "token_weights": w.ravel().tolist(),
                "decay": decay,
            }
            yield _Rpc("ReportAttention", request)

        return self._run(steps())

    def stats(self, *, tenant_only: bool = False) -> Dict[str, Any]:
        """The server's ``Stats`` as a dict (with ``tenant_only``, this
        client's tenant's view)."""

        def steps() -> Steps[Dict[str, Any]]:
            return (yield _Rpc("GetStats", {"tenant": self.tenant if tenant_only else None}))

        return self._run(steps())

    def start_access_trace(self, *, sample_rate: float = 0.0, max_bytes: int = 0) -> Dict[str, Any]:
        """Starts recording page accesses on the server, the input of
        ``kvtier tune``: ``sample_rate`` of the pages (0: all), up to
        ``max_bytes`` (0: the server's default). Returns the status, whose
        ``path`` names the file on the server. Needs an admin token on a
        server that checks tokens."""

        def steps() -> Steps[Dict[str, Any]]:
            request = {"record": True, "sample_rate": sample_rate, "max_bytes": max_bytes}
            return (yield _Rpc("SetAccessTrace", request))

        return self._run(steps())

    def stop_access_trace(self) -> Dict[str, Any]:
        """Stops the server's recording; returns its final status."""

        def steps() -> Steps[Dict[str, Any]]:
            return (yield _Rpc("SetAccessTrace", {}))

        return self._run(steps())

    def call(self, method: str, request: Any) -> Any:
        """Any RPC by name with a request dict (fields as in the proto);
        returns the reply as a dict (a list of dicts for a stream)."""

        def steps() -> Steps[Any]:
            return (yield _Rpc(method, request))

        return self._run(steps())


class SelectKvCall:
    """One sequence's :meth:`Client.select_kv` with every argument but a
    step's own fixed (:meth:`Client.select_kv_call`): calling it selects
    in ``layer`` for ``queries`` and returns the pages' K and V
    (:class:`SelectionKV`), a coroutine for :class:`kvtier.AsyncClient`'s."""

    __slots__ = ("_api", "_layout", "_request", "_via", "_views")

    def __init__(self, api: "_Api", layout: Layout, request: SelectRequest, via: Optional[ShmRegion], views: bool):
        self._api = api
        self._layout = layout
        self._request = request
        self._via = via
        self._views = views

    def __call__(
        self,
        layer: int,
        queries: Any,
        budget_pages: int,
        *,
        append: Optional[Tuple[Any, Any]] = None,
        append_position: Optional[int] = None,
    ) -> SelectionKV:
        return self._api._run(self._steps(layer, queries, budget_pages, append, append_position))

    def _steps(
        self, layer: int, queries: Any, budget_pages: int, append: Optional[Tuple[Any, Any]], position: Optional[int]
    ) -> Steps[SelectionKV]:
        layout = self._layout
        step_append = None
        step = self._api._step_kv(layout, append, position)
        if step is not None:
            k, v = step
            # Interleaved per head (K rows, then V rows) by the native side.
            step_append = (k.shape[0], k.shape[1], k.tobytes(), v.tobytes(), position, self._api.persist)
        request = self._request.step(layer, _queries(queries), budget_pages, step_append)
        gathered = yield _Rpc("SelectPages", request, self._via, gather=True, views=self._views)
        return selection_kv_from_native(gathered, layout, self._via)


def _ranking(
    mode: Optional[str], candidates: int, softmax_scale: float, top_p: float, min_pages: int, reuse_similarity: float
) -> Dict[str, Any]:
    """A selection's ranking fields; ``mode`` as the CLI spells it
    (``two-stage``) or as the proto does (``two_stage``)."""
    return {
        "mode": 0 if mode is None else mode.replace("-", "_"),
        "candidates": candidates,
        "softmax_scale": softmax_scale,
        "top_p": top_p,
        "min_pages": min_pages,
        "reuse_similarity": reuse_similarity,
    }


def _shard(shard: Any) -> Optional[Dict[str, Any]]:
    """A ``ContextShard`` from ``(rank, world[, ownership[, scope]])`` (or a dict)."""
    if shard is None or isinstance(shard, dict):
        return shard
    rank, world, *rest = shard
    ownership, scope = (list(rest) + ["contiguous", "global"][len(rest) :])[:2]
    return {"rank": rank, "world": world, "ownership": ownership, "scope": scope}


def _action(action: str, tier: Optional[str], rows: Optional[int]) -> Dict[str, Any]:
    if action in ("offload", "migrate"):
        return {"tier": tier}
    if action == "summarize":
        return {"rows": rows}
    if action in ("evict", "swap_in"):
        return {}
    raise ValueError(f"action: {action!r} is not one of offload, swap_in, migrate, summarize, evict")


class Client(_Api):
    """A blocking client of one kvtier server, for one tenant.

    >>> client = kvtier.Client("http://127.0.0.1:50051")
    >>> client.create("req-1", kvtier.Layout(30, 3, 9, 64, "f16", 16))

    ``token``: sent with every call (servers with ``[[auth.tokens]]``);
    ``tls_ca``: PEM of the authority for ``https://`` addresses;
    ``persist``: every write acknowledged only once durable;
    ``shm_socket``: the server's shm socket, for :meth:`register_shm`;
    ``timeout``: seconds within which connecting and every call must
    answer (:class:`kvtier.errors.DeadlineExceeded` otherwise; default: no
    limit). Ctrl-C interrupts a call in progress.
    """

    def _run(self, steps: Steps[T]) -> T:
        try:
            rpc = next(steps)
            while True:
                try:
                    if rpc.via is not None:
                        reply = rpc.via._call(rpc.method, rpc.request, rpc.gather, rpc.views)
                    else:
                        reply = self._conn.call(rpc.method, rpc.request, incarnation=self.incarnation, gather=rpc.gather)
                except BaseException as e:  # let the method see its RPC's failure
                    rpc = steps.throw(e)
                else:
                    rpc = steps.send(reply)
        except StopIteration as done:
            return done.value

    def register_shm(self, size: int, socket: Optional[str] = None) -> ShmRegion:
        """Registers a shared-memory region of ``size`` bytes with the
        server (on this machine) for this tenant."""
        return ShmRegion(self._conn.register_shm(socket or self.shm_socket, size, self.tenant), self._conn)

    def close(self) -> None:
        """Closes the connection (when the last client sharing it goes)."""
        self._conn = None  # type: ignore[assignment]

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
