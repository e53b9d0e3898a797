"""What calls take and return: a sequence's layout, pages with their K and
V as numpy arrays, selections, shared-memory regions."""

from __future__ import annotations

import concurrent.futures
import mmap
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _arrays


@dataclass(frozen=True)
class Layout:
    """How a sequence's KV is shaped: ``num_layers`` x ``num_kv_heads``
    lanes of pages of ``page_size`` tokens, each token a K and a V row of
    ``head_dim`` elements of ``dtype`` (``"f32"``, ``"f16"``, ``"bf16"``)."""

    num_layers: int
    num_kv_heads: int
    num_query_heads: int
    head_dim: int
    dtype: str = "f16"
    page_size: int = 16
    #: ``(first_layer, num_layers)`` groups that share one KV (CLA, YOCO).
    layer_groups: Tuple[Tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in _arrays.DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of f32, f16, bf16")

    def to_proto(self) -> Dict[str, Any]:
        """The `kvtier.v1.Layout` message, as a dict."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "num_query_heads": self.num_query_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "page_size": self.page_size,
            "layer_groups": [{"first_layer": f, "num_layers": n} for f, n in self.layer_groups],
        }

    @classmethod
    def from_proto(cls, m: Dict[str, Any]) -> "Layout":
        """The layout a `kvtier.v1.Layout` message (as a dict) describes."""
        return cls(
            num_layers=m["num_layers"],
            num_kv_heads=m["num_kv_heads"],
            num_query_heads=m["num_query_heads"],
            head_dim=m["head_dim"],
            dtype=m["dtype"],
            page_size=m["page_size"],
            layer_groups=tuple((g["first_layer"], g["num_layers"]) for g in m["layer_groups"]),
        )

    @property
    def queries_per_kv_head(self) -> int:
        """Query heads sharing each KV head (the GQA group size)."""
        return self.num_query_heads // self.num_kv_heads


@dataclass
class Page:
    """One page of one (layer, KV head). ``k`` and ``v`` are
    ``[rows, head_dim]`` in the layout's dtype: the original rows for hot
    and cold pages (``tokens`` of them), summary rows for a summary (one per
    entry of ``summary_counts``), empty for a gone page. They are read-only
    views of the reply (``.copy()`` for a writable array); over shared
    memory, of the region, valid until a later call names an overlapping
    window."""

    kv_head: int
    page: int
    state: str
    tokens: int
    k: np.ndarray
    v: np.ndarray
    #: For a cold page: ``"host"`` or ``"nvme"``.
    cold_tier: Optional[str] = None
    summary_counts: List[int] = field(default_factory=list)
    #: For a gone page: why (``"explicit"``, ``"policy"``, ``"integrity"``, ...).
    gone_reason: Optional[str] = None
    #: With ``include_digests``: the page's element-wise key minimum and maximum.
    digest: Optional[Tuple[np.ndarray, np.ndarray]] = None


@dataclass
class SelectedPage:
    page: int
    #: The score bound it was ranked by.
    bound: float
    state: str
    cold_tier: Optional[str]
    #: Why a page asked to be hot is not: ``"none"``, ``"deadline"``, ``"no_room"``.
    miss: str


@dataclass
class HeadSelection:
    kv_head: int
    #: With per-query-head aggregation.
    query_head: Optional[int]
    #: In position order.
    pages: List[SelectedPage]
    selected_but_gone: int


@dataclass
class Selection:
    """A ``select`` answer: per head the pages chosen, and with
    ``include_data`` their K and V (``pages``, gone pages never)."""

    heads: List[HeadSelection]
    pages: List[Page]
    pages_scored: int
    digest_bytes: int
    #: Where the swap-in's pages came from and its time per source.
    swap: Dict[str, int]
    #: Where the server spent the call (microseconds).
    timing: Dict[str, int]
    prefetch_queued: int
    lease_id: Optional[int]
    lease_expires_in_ms: int
    #: The mode that ranked: ``"quest"``, ``"cuboid"``, ``"sketch"`` or
    #: ``"two_stage"``; a page's ``bound`` is its score in that mode.
    mode: str = "two_stage"
    #: With ``append``: the ``AppendTokensResponse`` of the step's tokens.
    appended: Optional[Dict[str, Any]] = None
    #: With ``reuse_similarity``: lanes chosen from their last ranking.
    lanes_reused: int = 0

    def gather(self, kv_head: int) -> Tuple[np.ndarray, np.ndarray, List[Page]]:
        """The data pages of ``kv_head`` in position order, their K and V
        concatenated: ``(k [rows, head_dim], v, pages)``."""
        return gather(self.pages, kv_head)


class HeadKV:
    """One head's chosen pages that came with data (gone pages never), in
    position order, and their K and V rows concatenated: ``[rows,
    head_dim]`` in the layout's dtype, writable arrays of their own (a
    summary page gives its summary rows, as :func:`gather` does), or with
    ``views`` read-only views of the region, valid until its next call."""

    # Made on every decode step's call: slots, and the page indices
    # unpacked only when read.
    __slots__ = ("kv_head", "query_head", "k", "v", "_pages")

    def __init__(self, kv_head: int, query_head: Optional[int], pages: Any, k: np.ndarray, v: np.ndarray):
        """``pages``: the indices as little-endian uint32 bytes (as the
        native client gives them) or anything ``np.asarray`` takes."""
        #: The KV head.
        self.kv_head = kv_head
        #: With per-query-head aggregation: the query head.
        self.query_head = query_head
        #: K rows, ``[rows, head_dim]``.
        self.k = k
        #: V rows, as ``k``'s.
        self.v = v
        self._pages = pages

    @property
    def pages(self) -> np.ndarray:
        """The pages' indices (uint32), in the order of ``k``'s and ``v``'s rows."""
        if isinstance(self._pages, (bytes, bytearray)):
            return np.frombuffer(self._pages, dtype="<u4")
        return np.asarray(self._pages, dtype="<u4")

    def __repr__(self) -> str:
        return f"HeadKV(kv_head={self.kv_head}, query_head={self.query_head}, pages={self.pages.tolist()}, rows={len(self.k)})"


def _total(name: str, doc: str) -> Any:
    """A :class:`SelectionKV` total, read from its totals once made."""

    def get(self: "SelectionKV") -> Any:
        return self._totals()[name]

    get.__doc__ = doc
    return property(get)


@dataclass(frozen=True)
class Attention:
    """What an attending selection (``select_kv(attend=True)``) answers:
    each query head's attention over the rows kvtier chose for it (and the
    call's ``append``, after them), and only those. ``out`` ``[query heads, head_dim]`` float32 is the
    softmax-weighted sum of their values, ``lse`` ``[query heads]`` the log
    of the softmax's normaliser (−inf without rows), ``tokens`` the tokens
    the rows stand for, ``query_heads`` which query head each row is."""

    query_heads: np.ndarray
    out: np.ndarray
    lse: np.ndarray
    tokens: np.ndarray

    def merged(self, queries: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
        """The attention over kvtier's rows and ``k``, ``v`` (``[KV heads,
        rows, head_dim]``: rows kvtier does not hold, such as the step's
        own token, for every KV head of :attr:`query_heads`, in order; a
        float dtype or a layout's storage dtype) for ``queries`` (``[query
        heads, head_dim]``, float32), exact: the two softmaxes merged by
        their log-sum-exps."""
        if k.shape[1] == 0:
            return self.out.copy()
        group = len(self.query_heads) // k.shape[0]
        k = np.repeat(_arrays.widened(k), group, axis=0)
        v = np.repeat(_arrays.widened(v), group, axis=0)
        logits = np.einsum("hd,hnd->hn", queries, k) * np.float32(scale)
        top = np.maximum(self.lse, logits.max(axis=1))
        kept = np.exp(self.lse - top)
        weights = np.exp(logits - top[:, None])
        total = kept + weights.sum(axis=1)
        return (kept[:, None] * self.out + np.einsum("hn,hnd->hd", weights, v)) / total[:, None]


#: An attribute not computed yet.
_UNREAD = object()


def _attention(native: Optional[Tuple[bytes, bytes, bytes, bytes]], head_dim: int) -> Optional[Attention]:
    if native is None:
        return None
    query_heads, out, lse, tokens = native
    return Attention(
        np.frombuffer(query_heads, "<u4"),
        np.frombuffer(out, "<f4").reshape(-1, head_dim),
        np.frombuffer(lse, "<f4"),
        np.frombuffer(tokens, "<u8"),
    )


class SelectionKV:
    """A ``select_kv`` answer: per head the chosen pages' K and V, gathered
    by the native client (no object per page), and the selection's totals
    as :class:`Selection` has them (converted when first read: a decode
    step reads :attr:`store_us` alone)."""

    __slots__ = ("heads", "_head_dim", "_attention", "_native", "_dict")

    def __init__(self, heads: List[HeadKV], totals: Any, head_dim: int):
        #: Per KV head (and query head, with per-query-head aggregation).
        self.heads = heads
        self._head_dim = head_dim
        self._attention: Any = _UNREAD
        self._native = totals
        self._dict: Optional[Dict[str, Any]] = None

    @property
    def attention(self) -> Optional[Attention]:
        """With ``attend``: each query head's attention over its chosen
        rows (the heads then hold none); ``None`` otherwise. Made when
        first read (:meth:`attention_out` needs none)."""
        if self._attention is _UNREAD:
            self._attention = _attention(self._native.attention, self._head_dim)
        return self._attention

    def attention_out(self) -> bytearray:
        """With ``attend``: :attr:`attention`'s ``out``, every query head's
        row in order, as little-endian float32 in a new ``bytearray``:
        what a decode step wraps as its output tensor
        (``torch.frombuffer``), with no array made per call."""
        return self._native.attention_out()

    def _totals(self) -> Dict[str, Any]:
        if self._dict is None:
            self._dict = _selection_totals(self._native.to_dict())
        return self._dict

    @property
    def store_us(self) -> int:
        """Microseconds the server's store spent on the call: its
        selection's (``timing["store_us"]``) and its append's
        (``appended["timing"]["store_us"]``)."""
        return self._native.store_us

    @property
    def server_us(self) -> int:
        """Microseconds the server spent on the call, its append included
        (``timing["server_us"]``): the call's own time less this is what
        the transport and the client cost."""
        return self._native.server_us

    pages_scored = _total("pages_scored", "Pages whose digests were scored.")
    digest_bytes = _total("digest_bytes", "Digest bytes scanned.")
    swap = _total("swap", "Where the swap-in's pages came from and its time per source.")
    timing = _total("timing", "Where the server spent the call (microseconds).")
    prefetch_queued = _total("prefetch_queued", "Pages queued for promotion in the background.")
    lease_id = _total("lease_id", "The lease taken on the chosen pages, if asked.")
    lease_expires_in_ms = _total("lease_expires_in_ms", "When the lease ends.")
    mode = _total("mode", "The mode that ranked.")
    appended = _total("appended", "With ``append``: the ``AppendTokensResponse`` of the step's tokens.")
    lanes_reused = _total("lanes_reused", "With ``reuse_similarity``: lanes chosen from their last ranking.")

    def head(self, kv_head: int, query_head: Optional[int] = None) -> HeadKV:
        """The selection of ``kv_head`` (and, with per-query-head
        aggregation, of ``query_head``)."""
        for h in self.heads:
            if h.kv_head == kv_head and h.query_head == query_head:
                return h
        raise LookupError(f"kv_head: no selection of KV head {kv_head} (query head {query_head}) in this answer")

    def __repr__(self) -> str:
        return f"SelectionKV(heads={self.heads!r}, **{self._totals()!r})"


def gather(pages: Sequence[Page], kv_head: int) -> Tuple[np.ndarray, np.ndarray, List[Page]]:
    """The pages of ``kv_head`` among ``pages`` in position order, their K
    and V concatenated: ``(k [rows, head_dim], v, pages)``."""
    mine = sorted((p for p in pages if p.kv_head == kv_head), key=lambda p: p.page)
    if not mine:
        raise LookupError(f"kv_head: no page of KV head {kv_head} among these pages")
    return np.concatenate([p.k for p in mine]), np.concatenate([p.v for p in mine]), mine


class ShmRegion:
    """A shared-memory region registered with the server: fetches and
    selections that name it get their pages' bytes written into it, and
    their pages' arrays are views of it (no copy). Those calls, and appends
    that name it, go over the region's own connection to the server rather
    than gRPC (a call costs one socket round trip); calls naming one region
    run one at a time. Registered until :meth:`close` (or until this object
    or the process goes)."""

    def __init__(self, native: Any, owner: Any = None):
        self._native = native
        #: The connection that registered it: only its calls go over the
        #: region's own connection (another client's reach its server by gRPC).
        self._owner = owner
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._id: int = native.id
        self._size: int = native.size
        self._map: Optional[mmap.mmap] = mmap.mmap(native.fd, self._size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        #: The region's bytes.
        self.buffer = np.frombuffer(self._map, dtype=np.uint8)

    def _registered(self) -> Any:
        if self._native is None:
            raise ValueError("shm: this region was closed")
        return self._native

    def _call(self, method: str, request: Any, gather: bool = False, views: bool = False) -> Any:
        """``method`` over the region's connection (blocking)."""
        return self._registered().call(method, request, gather, views)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one thread asyncio calls on this region run on: they run one
        at a time anyway, and must not take the loop's default executor."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-shm")
        return self._pool

    @property
    def id(self) -> int:
        """The server's id of this region (what `ShmWindow`s name)."""
        self._registered()
        return self._id

    @property
    def size(self) -> int:
        """The region's size in bytes."""
        self._registered()
        return self._size

    @property
    def spin(self) -> float:
        """Seconds a call polls for its reply at most before it sleeps on it
        (1e-4 by default; 0: never polls; the CPU is yielded at every poll).
        A thread woken on another CPU starts tens of microseconds after its
        reply arrives, most of a small call, which polling saves. A region
        polls only while its recent replies came within this: where calls
        take longer (ranking a long context), polling would take the
        server's CPU and shorten nothing."""
        return float(self._registered().spin)

    @spin.setter
    def spin(self, seconds: float) -> None:
        self._registered().spin = seconds

    @property
    def server_poll(self) -> float:
        """Seconds the server's thread for this region polls for its next
        call at most before it sleeps on it, as every call asks (0, until
        set: the server's own ``shm_poll_us``; the server cuts an ask to its
        ``shm_poll_max_us``, and gives polls longer than its own to as many
        regions at once as half its cores). Where calls come a few
        milliseconds apart, as an engine's decode loop makes them (one per
        layer, a layer's compute apart), each then skips that thread's
        wake-up, at the cost of a core polling between them; the thread
        polls only while calls come within this."""
        return float(self._registered().server_poll)

    @server_poll.setter
    def server_poll(self, seconds: float) -> None:
        self._registered().server_poll = seconds

    def window(self, offset: int = 0, length: Optional[int] = None) -> "ShmWindow":
        """A window of the region for one call (the whole region by
        default). The arrays a call returns view its window until a later
        call names a window that overlaps it: calls in flight together
        (asyncio) need windows of their own (:meth:`split`)."""
        return ShmWindow(self, offset, self.size - offset if length is None else length)

    def split(self, n: int) -> List["ShmWindow"]:
        """``n`` disjoint windows of equal size, for ``n`` calls at once."""
        return self.window().split(n)

    def close(self) -> None:
        """Ends the registration; arrays that still view the region keep
        the mapping alive."""
        self.buffer = np.empty(0, dtype=np.uint8)
        self._map = None
        self._native = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


@dataclass(frozen=True)
class ShmWindow:
    region: ShmRegion
    offset: int
    length: int

    def split(self, n: int) -> List["ShmWindow"]:
        """``n`` disjoint windows of equal size of this one, for ``n``
        calls at once."""
        part = self.length // n
        return [ShmWindow(self.region, self.offset + i * part, part) for i in range(n)]

    def to_proto(self) -> Dict[str, int]:
        """The `kvtier.v1.ShmWindow` message, as a dict."""
        return {"region_id": self.region.id, "offset": self.offset, "length": self.length}


def window_of(shm: Optional[Union["ShmRegion", "ShmWindow"]]) -> Optional["ShmWindow"]:
    if shm is None or isinstance(shm, ShmWindow):
        return shm
    return shm.window()


def page_from_proto(m: Dict[str, Any], layout: Layout, window: Optional[ShmWindow]) -> Page:
    rows = len(m["summary_counts"]) if m["state"] == "summary" else m["tokens"]
    if m["state"] == "gone":
        rows = 0
    if window is not None and m["shm_bytes"]:
        data: Any = window.region.buffer[m["shm_offset"] : m["shm_offset"] + m["shm_bytes"]]
    else:
        data = m["kv"]
    k, v = _arrays.unpack(data, rows, layout.head_dim, layout.dtype)
    digest = None
    if m["digest"]:
        lo_hi = np.frombuffer(m["digest"], dtype=_arrays.storage_dtype(layout.dtype)).reshape(2, layout.head_dim)
        digest = (lo_hi[0], lo_hi[1])
    return Page(
        kv_head=m["kv_head"],
        page=m["page"],
        state=m["state"],
        tokens=m["tokens"],
        k=k,
        v=v,
        cold_tier=m["cold_tier"] if m["state"] == "cold" else None,
        summary_counts=list(m["summary_counts"]),
        gone_reason=m["gone_reason"] if m["state"] == "gone" else None,
        digest=digest,
    )


def selection_from_proto(
    replies: Sequence[Dict[str, Any]], layout: Layout, window: Optional[ShmWindow]
) -> Selection:
    first = replies[0]
    heads = [
        HeadSelection(
            kv_head=h["kv_head"],
            query_head=h["query_head"],
            pages=[SelectedPage(p["page"], p["bound"], p["state"], p["cold_tier"] if p["state"] == "cold" else None, p["miss"]) for p in h["pages"]],
            selected_but_gone=h["selected_but_gone"],
        )
        for r in replies
        for h in r["heads"]
    ]
    return Selection(
        heads=heads,
        pages=[page_from_proto(p, layout, window) for r in replies for p in r["pages"]],
        **_selection_totals(first),
    )


def _selection_totals(first: Dict[str, Any]) -> Dict[str, Any]:
    """What a selection's first message says of the whole selection."""
    return {
        "pages_scored": first["pages_scored"],
        "digest_bytes": first["digest_bytes"],
        "swap": dict(first["swap"] or {}),
        "timing": dict(first["timing"] or {}),
        "prefetch_queued": first["prefetch_queued"],
        "lease_id": first["lease_id"] or None,
        "lease_expires_in_ms": first["lease_expires_in_ms"],
        "mode": first["mode"],
        "appended": first["appended"],
        "lanes_reused": first["lanes_reused"],
    }


def selection_kv_from_native(
    gathered: Tuple[Any, List[Tuple[Any, ...]]], layout: Layout, region: Optional["ShmRegion"] = None
) -> SelectionKV:
    """A selection the native client gathered per head (``gather=True``):
    each head's K and V its own bytes, or where they lie in ``region``
    (``(offset, length)``, with ``views``), as read-only views of it."""
    totals, heads = gathered
    dtype = _arrays.storage_dtype(layout.dtype)
    head_dim = layout.head_dim

    def rows(data: Any) -> np.ndarray:
        if isinstance(data, tuple):
            offset, length = data
            # A slice of the region's array: a view, read-only as it is.
            return region.buffer[offset : offset + length].view(dtype).reshape(-1, head_dim)  # type: ignore[union-attr]
        return np.frombuffer(data, dtype=dtype).reshape(-1, head_dim)

    return SelectionKV(
        [HeadKV(kv_head, query_head, pages, rows(k), rows(v)) for kv_head, query_head, pages, k, v in heads],
        totals,
        head_dim,
    )
