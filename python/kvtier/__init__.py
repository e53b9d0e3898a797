"""kvtier: the Python client of a tiered KV-cache store for LLM inference.

>>> import kvtier, numpy as np
>>> client = kvtier.Client("http://127.0.0.1:50051")
>>> client.create("req-1", kvtier.Layout(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=64))
>>> client.put("req-1", 0, k, v)            # k, v: [kv_heads, tokens, head_dim]
>>> sel = client.select("req-1", 0, q, budget_pages=8)   # q: [query_heads, head_dim]
>>> k0, v0, pages = sel.gather(kv_head=0)
"""

from . import errors
from ._arrays import storage_dtype
from ._native import __version__
from .aio import AsyncClient
from .client import DEFAULT_ADDRESS, DEFAULT_SHM_SOCKET, Client, SelectKvCall
from .cluster import Cluster
from .errors import KvtierError
from .types import Attention, HeadKV, HeadSelection, Layout, Page, SelectedPage, Selection, SelectionKV, ShmRegion, ShmWindow

__all__ = [
    "AsyncClient",
    "Attention",
    "Client",
    "Cluster",
    "DEFAULT_ADDRESS",
    "DEFAULT_SHM_SOCKET",
    "HeadKV",
    "HeadSelection",
    "KvtierError",
    "Layout",
    "Page",
    "SelectKvCall",
    "SelectedPage",
    "Selection",
    "SelectionKV",
    "ShmRegion",
    "ShmWindow",
    "__version__",
    "errors",
    "storage_dtype",
]
