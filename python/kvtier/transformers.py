"""A Hugging Face transformers ``Cache`` whose layers keep K/V in kvtier
(``pip install "kvtier[transformers]"``).

>>> from kvtier.transformers import KVTierCache
>>> cache = KVTierCache(client, model=model)                  # every page: as DynamicCache
>>> out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
>>> cache = KVTierCache(client, budget=1 / 8, model=model)    # sinks, selected pages, window
>>> cache = KVTierCache(client, model=model, prompt_ids=ids)   # shares a stored prompt prefix

Prefill writes the prompt's pages (those of a prompt prefix already
stored, named by the hash chain of ``prompt_ids``, are attached instead:
``generate`` then prefills only the rest); decode appends each token.
Without a budget every layer attends over all its pages, read back from
kvtier: tokens and logits equal :class:`transformers.DynamicCache`'s. With
a budget, a decode step's query reaches kvtier's selection through the
attention function this module registers with transformers'
``AttentionInterface`` (``kvtier_sdpa``/``kvtier_eager``, which the cache
switches the model to; for any other cache they are sdpa and eager), and
each layer attends over the pages kvtier selects for it, per KV head.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import sys
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from . import _arrays, errors
from .client import MAX_MESSAGE_BYTES, Client, SelectKvCall
from .types import Layout, SelectionKV, ShmRegion, ShmWindow, gather, window_of

__all__ = ["KVTierCache", "install_attention", "prompt_hashes"]

#: kvtier's page dtype for each torch dtype a model may run in.
_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
#: The attention implementations a model's own can become.
_BASES = ("sdpa", "eager")


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from kvtier (a writable array of their own) as a tensor of ``dtype``;
    bfloat16 arrives as its bits (or ml_dtypes' bfloat16)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """``t`` as numpy (bfloat16 as bits), a view where it can be: each
    torch call costs microseconds between a model's layers, so none is
    made that changes nothing."""
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    return t.numpy()


def _query_rows(query: torch.Tensor) -> np.ndarray:
    """A decode step's ``query`` (``[1, query heads, 1, head_dim]``) as
    float32 ``[query heads, head_dim]``, a view where it can be."""
    if query.dtype != torch.float32:
        query = query.float()
    q = _numpy(query)
    return q.reshape(q.shape[1], q.shape[3])


def _attention_over(
    query: torch.Tensor,
    chosen: List[Tuple[np.ndarray, np.ndarray]],
    own_k: np.ndarray,
    own_v: np.ndarray,
    scaling: float,
) -> torch.Tensor:
    """A decode step's attention, ``[1, query heads, 1, head_dim]``: each
    query head of ``query`` over its KV head's ``chosen`` rows (``(k, v)``,
    ``[rows, head_dim]``) and then the rows kvtier did not give (``own_k``,
    ``own_v``: ``[kv heads, n, head_dim]``, in the rows' storage dtype: the
    step's own token, after the last step's where that was appended after
    choosing)."""
    rows = [len(k) for k, _ in chosen]
    own = own_k.shape[1]
    width = max(rows) + own
    dtype = chosen[0][0].dtype
    # One copy: every head's rows (views of the region, or the answer's
    # own) and, last, the own rows, into arrays of their own, for one
    # attention call over all heads. A head with fewer rows (pages gone)
    # leaves a gap that the mask hides.
    k = np.empty((len(chosen), width, own_k.shape[-1]), dtype)
    v = np.empty_like(k)
    for i, (head_k, head_v) in enumerate(chosen):
        k[i, : rows[i]], v[i, : rows[i]] = head_k, head_v
    k[:, width - own :], v[:, width - own :] = own_k.view(dtype), own_v.view(dtype)
    mask = None
    if min(rows) < width - own:
        allowed = np.ones((len(chosen), width), dtype=bool)
        for i, n in enumerate(rows):
            # Zeros, not whatever was there: a masked NaN still poisons the sum.
            allowed[i, n : width - own], k[i, n : width - own], v[i, n : width - own] = False, 0, 0
        groups = query.shape[1] // len(chosen)
        mask = torch.from_numpy(np.repeat(allowed, groups, axis=0))[None, :, None].to(query.device)
    k_t = _tensor(k, query.dtype).to(query.device)[None]
    v_t = _tensor(v, query.dtype).to(query.device)[None]
    return torch.nn.functional.scaled_dot_product_attention(
        query, k_t, v_t, attn_mask=mask, scale=scaling, enable_gqa=True
    )


def prompt_hashes(prompt_ids: Sequence[int], page_size: int, model_key: str) -> List[bytes]:
    """The hash chain of a prompt: one SHA-256 per full page, each over the
    one before it, ``model_key`` and the page's token ids. The prompt's last
    token is left out (a prompt stored whole would leave ``generate``
    nothing to prefill)."""
    hashes = []
    h = hashlib.sha256(model_key.encode()).digest()
    pages = (len(prompt_ids) - 1) // page_size
    for p in range(max(pages, 0)):
        tokens = np.asarray(prompt_ids[p * page_size : (p + 1) * page_size], dtype="<i8")
        h = hashlib.sha256(h + tokens.tobytes()).digest()
        hashes.append(h)
    return hashes


def _model_key(model: Any, layout: Layout) -> str:
    """What prompt hashes are namespaced by: the model's name, type and
    page dtype, and a fingerprint of its weights (first and last
    parameters), so that two quantizations or revisions never share K/V."""
    config = model.config
    digest = hashlib.sha256()
    params = list(model.parameters())
    for p in (params[0], params[-1]):
        digest.update(p.detach().flatten()[:4096].to("cpu", torch.float32).numpy().tobytes())
    return f"{getattr(config, '_name_or_path', '')}:{config.model_type}:{layout.dtype}:{digest.hexdigest()[:32]}"


def _eager_of(module: torch.nn.Module):
    """The model's own eager attention (each modeling file defines one)."""
    forward = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if forward is None:
        raise TypeError(f"{type(module).__name__}: its modeling file has no eager_attention_forward")
    return forward


def _kvtier_attention(base: str):
    """The attention function registered as ``kvtier_<base>``: the base
    implementation, except for a decode step of a :class:`KVTierCache`
    with a budget, whose layer returned its new token tagged."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layer = getattr(key, "_kvtier_layer", None)
        if layer is not None:
            start = time.perf_counter()
            try:
                return layer.attend(query, key, value, attention_mask, scaling)
            finally:
                layer.cache.attention_seconds += time.perf_counter() - start
        forward = sdpa_attention_forward if base == "sdpa" else _eager_of(module)
        return forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    return attention


def install_attention(model: Any) -> str:
    """Switches ``model`` to kvtier's attention over its own (``sdpa`` or
    ``eager``): ``kvtier_sdpa`` or ``kvtier_eager``, which behave as the
    base for every cache but a budgeted :class:`KVTierCache`. Returns the
    implementation set."""
    current = model.config._attn_implementation
    if current.startswith("kvtier_"):
        return current
    if current not in _BASES:
        raise ValueError(f"model: attention {current!r}; kvtier wraps {' or '.join(_BASES)} (attn_implementation=...)")
    name = f"kvtier_{current}"
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _kvtier_attention(current))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ValueError(f"model: {type(model).__name__} cannot switch its attention to {name} at runtime")
    return name


#: A server's refusals: the call changed nothing.
_REFUSALS = (
    errors.InvalidArgument,
    errors.FailedPrecondition,
    errors.ResourceExhausted,
    errors.NotFound,
    errors.PermissionDenied,
    errors.AlreadyExists,
)


class _Ahead:
    """A layer's selection for its next decode step, made in the
    background (``KVTierCache(speculative=True)``): the call, at what
    position it chose, and the K/V it appends after choosing (``None``:
    none; the step's own call did)."""

    __slots__ = ("future", "position", "queries", "kept")

    def __init__(
        self,
        future: "concurrent.futures.Future[SelectionKV]",
        position: int,
        queries: np.ndarray,
        kept: Optional[Tuple[np.ndarray, np.ndarray]],
    ):
        self.future = future
        self.position = position
        #: The queries that chose, ``[query heads, head_dim]``, float32.
        self.queries = queries
        self.kept = kept


def _least_similarity(chose: np.ndarray, now: np.ndarray) -> float:
    """The least cosine similarity, over query heads, between the queries
    that chose a selection and ``now`` (each ``[query heads, head_dim]``)."""
    dot = (chose * now).sum(-1)
    norms = np.linalg.norm(chose, axis=-1) * np.linalg.norm(now, axis=-1)
    return float((dot / np.maximum(norms, 1e-30)).min())


class KVTierLayer(CacheLayerMixin):
    """One layer's K/V, kept in kvtier (the cache's sequence, this layer)."""

    is_sliding = False

    def __init__(self, cache: "KVTierCache", index: int, tokens: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cache = cache
        self.index = index
        #: Tokens this layer holds (every KV head alike).
        self.tokens = tokens
        #: A budgeted decode step tagged its token and its attention has not
        #: come through kvtier's attention function (yet).
        self.tagged = False
        #: Why the layer's length in kvtier is unknown, if it is: a decode
        #: step's call failed without a refusal (its append may have been
        #: made).
        self.unknown: Optional[str] = None
        #: With ``speculative``: the next step's selection, in flight.
        self.ahead: Optional[_Ahead] = None
        # Never holds K/V itself: initialized from the start.
        self.dtype, self.device = dtype, device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: Optional[Dict[str, Any]] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache
        cache._check_batch(key_states)
        self.check_stored()
        position = (cache_kwargs or {}).get("cache_position")
        if position is not None and int(position[0]) != self.tokens:
            raise ValueError(
                f"cache_position: starts at {int(position[0])}, but layer {self.index} holds {self.tokens} tokens"
                " (a KVTierCache only grows: rewrites and restarts are not supported)"
            )
        before = self.tokens
        count = key_states.shape[-2]
        if cache.budget is not None and count == 1 and before > cache.attached_tokens:
            self.tagged = True
            # A decode step: the attention function selects with the query
            # over what kvtier holds, adds this token, then stores it.
            key_states._kvtier_layer = self
            self.tokens += 1
            return key_states, value_states
        # Every layer's call made ahead lands first: this layer's append,
        # and no other layer's call writing its window into the region
        # while this layer's read views it.
        for layer in cache.layers:
            cache._drain(layer)
        cache._write(self, key_states[0], value_states[0])
        if before == 0:
            return key_states, value_states
        k, v = cache._read_all(self)
        return k.unsqueeze(0), v.unsqueeze(0)

    def check_stored(self) -> None:
        """Raises if the last budgeted step's token may not be in kvtier:
        its attention did not come through kvtier's attention function,
        which stores it, or that call failed without a refusal."""
        if self.unknown is not None:
            raise RuntimeError(f"layer {self.index}: {self.unknown}")
        if self.tagged:
            raise RuntimeError(
                f"layer {self.index}: the last step's attention did not go through kvtier's attention function"
                f" (the model's attention is {self.cache.model_config._attn_implementation!r}): its token is lost"
            )

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        scaling: float,
    ) -> Tuple[torch.Tensor, None]:
        """A decode step's attention over the pages kvtier selects for
        ``query`` (``[1, query heads, 1, head_dim]``), per KV head, and the
        step's own token (``key``, ``value``: ``[1, kv heads, 1, head_dim]``),
        which the same call appends once it has selected. With the cache's
        ``speculative``, over the pages the last step's query selected (and
        the last step's token): this step's selection is made in the
        background for the next step. With ``attend_in_store``, kvtier
        attends and answers the output."""
        if attention_mask is not None:
            allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            if not bool(allowed[..., : self.tokens].all()):
                raise ValueError("attention_mask: masked positions (padding) are not supported with a budget")
        cache = self.cache
        self.tagged = False
        stored = self.tokens - 1
        # In the layout's dtype: what is appended, and what the views'
        # rows are joined with. Converted (and checked) before any call,
        # whose failure would leave the layer's length in doubt.
        step_k, step_v = _arrays.kv_arrays(_numpy(key)[0], _numpy(value)[0], cache.layout.dtype, cache.layout.head_dim)
        queries = _query_rows(query)
        if cache.attend_in_store:
            return self._attend_in_store(query, stored, queries, (step_k, step_v), scaling), None
        # Of its own: a call made ahead reads it after the model has
        # reused the tensor's memory.
        queries = queries.copy()
        ahead = self.ahead
        self.ahead = None
        # Whether a call that has returned appended this step's token.
        appended = ahead is None
        if ahead is None:
            selection = self._select_now(stored, queries, (step_k, step_v), scaling)
            own = (step_k, step_v)
        else:
            # Chosen last step, with its query; its token was appended
            # after choosing, so it joins this step's own.
            selection = cache._wait(self, ahead)
            own = (step_k, step_v)
            if ahead.kept is not None:
                own = (np.concatenate([ahead.kept[0], step_k], 1), np.concatenate([ahead.kept[1], step_v], 1))
            if cache.correction and _least_similarity(ahead.queries, queries) < cache.correction:
                # This step's query has moved too far from the one that
                # chose: it selects for itself, among every token before
                # its own (the last step's landed with the call above).
                cache.corrections += 1
                selection = self._select_now(stored, queries, (step_k, step_v), scaling)
                own, appended = (step_k, step_v), True
        try:
            heads = [selection.head(h) for h in range(cache.layout.num_kv_heads)]
            out = _attention_over(query, [(h.k, h.v) for h in heads], *own, scaling)
            if cache.speculative:
                # The next step's selection, with this step's query, made
                # while the model computes; it appends this step's token
                # unless a call above did.
                self.ahead = cache._select_ahead(
                    self, queries, None if appended else (step_k, step_v), stored, scaling
                )
        except BaseException:
            if not appended:
                # The call that was to append this step's token was not
                # made: kvtier holds the tokens before it.
                self.tokens = stored
            raise
        return out.transpose(1, 2).contiguous(), None

    def _attend_in_store(
        self,
        query: torch.Tensor,
        stored: int,
        queries: np.ndarray,
        step: Tuple[np.ndarray, np.ndarray],
        scaling: float,
    ) -> torch.Tensor:
        """A decode step's attention output, ``[1, 1, query heads,
        head_dim]``, as kvtier computes it over the step's own selection
        and its token (which the same call appends): the client's buffer
        of its rows, wrapped."""
        selection = self._select_now(stored, queries, step, scaling)
        out = torch.frombuffer(selection.attention_out(), dtype=torch.float32).view((1, 1) + queries.shape)
        if query.dtype != torch.float32 or query.device.type != "cpu":
            out = out.to(query.device, query.dtype)
        return out

    def _select_now(
        self, stored: int, queries: np.ndarray, step: Tuple[np.ndarray, np.ndarray], scaling: float
    ) -> SelectionKV:
        """This step's selection, with its query, appending its token."""
        cache = self.cache
        try:
            return cache._select(self, stored, queries, step, scaling)
        except _REFUSALS:
            # Refused as a whole: neither selected nor appended.
            self.tokens = stored
            raise
        except BaseException as e:
            self.unknown = (
                f"the decode step at position {stored} failed ({type(e).__name__}: {e}) after its token may have"
                " been appended; this cache cannot go on (its length in kvtier is unknown)"
            )
            raise

    def get_mask_sizes(self, cache_position: torch.Tensor) -> Tuple[int, int]:
        return self.tokens + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return self.tokens

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("KVTierCache: reset is not supported; use a new cache")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KVTierCache: beam search (num_beams > 1) is not supported")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("KVTierCache: crop (assisted generation) is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("KVTierCache: one sequence, batch size 1 (no batch expansion)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("KVTierCache: one sequence, batch size 1 (no batch selection)")


class KVTierCache(Cache):
    """A transformers ``Cache`` backed by one kvtier sequence.

    ``client``: a :class:`kvtier.Client`. ``budget``: ``None`` (every page,
    identical to ``DynamicCache``), pages per KV head (an int), or a
    fraction of the sequence's pages (a float below 1); a decode step then
    attends over ``sink_pages`` first pages, the pages kvtier selects
    (``mode``, ``top_p``, ``min_pages``, ``candidates``, ``aggregation``,
    ``reuse_similarity``:
    as :meth:`kvtier.Client.select`) and ``window_pages`` last pages.
    ``model``: the model (its config gives the layout; its attention
    becomes ``kvtier_sdpa``/``kvtier_eager``). ``prompt_ids``: the
    prompt's token ids, whose leading pages are attached where already
    stored and published for later prompts: they must be the ids the model
    runs on (a hash is a promise, to every later prompt of the tenant, that
    its page holds those tokens' K/V). ``shm``: a registered region
    of ``client`` to read pages through (a decode step's attention reads
    its pages as views of the region, copied once, by the attention:
    no other thread may call on it while the model runs, but the cache's
    own with ``speculative``, into windows of its own; for a decode
    loop, poll: ``region.spin, region.server_poll = 1e-3, 5e-3``). Batch size 1; beam search,
    sliding-window layers, per-query-head aggregation, rewriting stored
    positions and padding under a budget are refused. A model on a GPU gets
    its K/V through host memory (untested: no GPU here).

    ``speculative`` (with a budget): each layer's selection for the next
    decode step is made in the background, on a thread of the cache's,
    with this step's query, while the model computes (FreeKV's speculative
    retrieval): a step attends over the pages the
    last step's query chose, the last step's token and its own, and waits
    only for a call that is usually done. Selections lag one step's query;
    ``correction`` (a cosine similarity; 0: never) makes a step whose
    query heads moved further than that from the ones that chose select
    for itself, as FreeKV corrects (``corrections`` counts them);
    bench/results/transformers.md has what each costs on tasks. With
    ``shm``, the region (or window) is split into one window per layer,
    each of which must hold a step's selection (its budget's pages of
    every KV head): the server refuses a call whose window is smaller.

    ``attend_in_store`` (with a budget, not ``speculative``): kvtier
    attends over each step's own selection where the pages are, and over
    the step's token the same call appends, and answers each query head's
    output: a row per query head crosses instead of the pages
    (``SelectPagesRequest.attend``). The same selection and the same
    attention as reading the pages, to float rounding; with ``shm`` only
    the region's connection is used.
    """

    def __init__(
        self,
        client: Client,
        budget: Union[None, int, float] = None,
        *,
        model: Any,
        prompt_ids: Optional[Sequence[int]] = None,
        sequence_id: Optional[str] = None,
        page_size: int = 16,
        sink_pages: int = 1,
        window_pages: int = 1,
        mode: Optional[str] = None,
        top_p: float = 0.0,
        min_pages: int = 0,
        candidates: int = 0,
        aggregation: Optional[str] = None,
        reuse_similarity: float = 0.0,
        shm: Optional[Union[ShmRegion, ShmWindow]] = None,
        model_key: Optional[str] = None,
        speculative: bool = False,
        correction: float = 0.0,
        attend_in_store: bool = False,
    ):
        config = model.config.get_text_config(decoder=True)
        if getattr(config, "sliding_window", None) or any(
            t != "full_attention" for t in getattr(config, "layer_types", None) or ()
        ):
            raise ValueError("model: sliding-window or chunked attention layers are not supported")
        if model.dtype not in _DTYPES:
            raise ValueError(f"model: dtype {model.dtype}; kvtier stores {', '.join(map(str, _DTYPES))}")
        if budget is not None and not (
            (isinstance(budget, int) and budget >= 1) or (isinstance(budget, float) and 0 < budget < 1)
        ):
            raise ValueError(f"budget: {budget!r}; None, pages (an int >= 1) or a fraction in (0, 1)")
        if speculative and budget is None:
            raise ValueError("speculative: selects ahead under a budget; give a budget")
        if not 0.0 <= correction <= 1.0 or (correction and not speculative):
            raise ValueError(f"correction: {correction!r}; a cosine similarity in [0, 1], with speculative=True")
        if attend_in_store and (budget is None or speculative):
            raise ValueError(
                "attend_in_store: attends over a step's own selection under a budget; give a budget,"
                " without speculative"
            )
        if aggregation == "per_query_head":
            raise ValueError("aggregation: per_query_head selects per query head; a KV head's K/V serve its whole group")
        install_attention(model)
        self.model_config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.layout = Layout(
            config.num_hidden_layers, config.num_key_value_heads, heads, head_dim, _DTYPES[model.dtype], page_size
        )
        self.client = client
        self.budget = budget
        self.sink_pages, self.window_pages = sink_pages, window_pages
        self.select_options = {
            "mode": mode,
            "top_p": top_p,
            "min_pages": min_pages,
            "candidates": candidates,
            "aggregation": aggregation,
            "reuse_similarity": reuse_similarity,
        }
        self.shm = shm
        #: Whether each layer's selection for the next decode step is made
        #: in the background with this step's query.
        self.speculative = speculative
        #: With ``speculative``: the least cosine similarity (over query
        #: heads) between a step's queries and those that chose its pages
        #: ahead under which the step selects for itself instead.
        self.correction = correction
        #: Steps of a layer that selected for themselves so.
        self.corrections = 0
        #: Whether kvtier attends over each step's selection, answering
        #: a row per query head instead of the pages.
        self.attend_in_store = attend_in_store
        # With `speculative`: a window per layer, each read by its next
        # step while the other layers' calls write theirs.
        self._windows = window_of(shm).split(config.num_hidden_layers) if speculative and shm is not None else None
        self._select_calls: Dict[Tuple[float, Optional[int]], SelectKvCall] = {}
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.sequence_id = sequence_id or f"hf-{uuid.uuid4().hex}"
        key = model_key or _model_key(model, self.layout)
        hashes = prompt_hashes(prompt_ids, page_size, key) if prompt_ids is not None else []
        created = client.create(self.sequence_id, self.layout, hashes)
        #: Tokens of the prompt found stored and attached (whole pages).
        self.attached_tokens = int(created.get("attached_pages", 0)) * page_size
        #: Calls made to kvtier by kind (append, put, fetch, select_kv; with
        #: ``speculative``, those made ahead counted when made), the
        #: seconds the model waited for them, the seconds of the decode
        #: steps' selections (with their appends) the server spent on them
        #: and the part of that in its store (the rest of the wait is the
        #: transport and the client), and the tokens this cache prefilled
        #: (not attached). ``attention_seconds``: the decode steps' whole
        #: attention under a budget (their kvtier calls, the copies around
        #: them and the attention over what came back).
        self.calls: Dict[str, int] = {}
        self.kvtier_seconds = 0.0
        self.attention_seconds = 0.0
        self.server_seconds = 0.0
        self.store_seconds = 0.0
        self.prefilled_tokens = 0
        self._closed = False
        super().__init__(
            layers=[
                KVTierLayer(self, i, self.attached_tokens, model.dtype, model.device)
                for i in range(config.num_hidden_layers)
            ]
        )

    # kvtier calls, each counted

    def _call(self, kind: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, counted as a call of ``kind``."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.kvtier_seconds += time.perf_counter() - start
            self.calls[kind] = self.calls.get(kind, 0) + 1

    def _check_batch(self, key_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise ValueError(
                f"batch size {key_states.shape[0]}: a KVTierCache holds one sequence (batch size 1, one beam)"
            )

    def _write(self, layer: KVTierLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores ``[kv_heads, tokens, head_dim]`` after the layer's tokens:
        what completes a partial page is appended, whole pages are put (and
        shared under the prompt's hash chain where it names them)."""
        k, v = _numpy(k), _numpy(v)
        count = k.shape[1]
        page = self.layout.page_size
        fill = min((-layer.tokens) % page, count)
        if fill:
            self._call(
                "append",
                self.client.append,
                self.sequence_id,
                layer.index,
                k[:, :fill],
                v[:, :fill],
                position=layer.tokens,
                shm=self.shm,
            )
        # Whole pages, as many per call as fit in a message.
        token_bytes = 2 * k.nbytes // count
        per_call = max(1, (MAX_MESSAGE_BYTES // 2) // (token_bytes * page)) * page
        for start in range(fill, count, per_call):
            end = min(start + per_call, count)
            first_page = (layer.tokens + start) // page
            self._call(
                "put", self.client.put, self.sequence_id, layer.index, k[:, start:end], v[:, start:end], first_page=first_page
            )
        # A prompt's tokens: a forward of several, or the first after what was attached.
        if layer.index == 0 and (count > 1 or layer.tokens == self.attached_tokens):
            self.prefilled_tokens += count
        layer.tokens += count

    def _read_all(self, layer: KVTierLayer) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every stored token of the layer, ``[kv_heads, tokens, head_dim]``."""
        pages = self._call("fetch", self.client.fetch, self.sequence_id, layer.index, shm=self.shm)
        for p in pages:
            if p.state not in ("hot", "cold"):
                raise RuntimeError(f"layer {layer.index} KV head {p.kv_head} page {p.page} is {p.state}")
        heads = [gather(pages, h)[:2] for h in range(self.layout.num_kv_heads)]
        k = np.stack([k for k, _ in heads])
        v = np.stack([v for _, v in heads])
        return _tensor(k, layer.dtype).to(layer.device), _tensor(v, layer.dtype).to(layer.device)

    def budget_pages(self, tokens: int) -> int:
        """Pages per KV head a decode step attends over at ``tokens``."""
        pages = -(-tokens // self.layout.page_size)
        floor = max(1, self.sink_pages + self.window_pages)
        if isinstance(self.budget, float):
            return max(floor, math.ceil(self.budget * pages))
        return max(floor, int(self.budget))

    def _select(
        self,
        layer: KVTierLayer,
        stored: int,
        queries: np.ndarray,
        step: Tuple[np.ndarray, np.ndarray],
        scaling: float,
    ) -> SelectionKV:
        """The pages ``queries`` (float32) select among the layer's
        ``stored`` tokens, with the step's own K/V (``step``, in the
        layout's dtype) appended by the same call, after them: one round
        trip per layer and step."""
        selection = self._call(
            "select_kv",
            self._select_call(float(scaling), layer.index),
            layer.index,
            queries,
            self.budget_pages(stored),
            append=step,
            append_position=stored,
        )
        self._count_server(selection)
        return selection

    def _count_server(self, selection: SelectionKV) -> None:
        self.server_seconds += selection.server_us / 1e6
        self.store_seconds += selection.store_us / 1e6

    def _select_ahead(
        self,
        layer: KVTierLayer,
        queries: np.ndarray,
        step: Optional[Tuple[np.ndarray, np.ndarray]],
        stored: int,
        scaling: float,
    ) -> _Ahead:
        """Starts, on the cache's thread, the layer's selection for its next
        step with this step's ``queries`` (float32, of their own; position
        ``stored``), appending ``step`` (this step's K/V) after choosing,
        or, without ``step``, among the tokens through this step's
        (appended already). ``step`` is copied: the model reuses its
        tensors' memory."""
        start = time.perf_counter()
        chosen_among = stored if step is not None else stored + 1
        options: Dict[str, Any] = {}
        if step is not None:
            step = (step[0].copy(), step[1].copy())
            options = {"append": step, "append_position": stored}
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-ahead")
        call = self._select_call(float(scaling), layer.index)
        future = self._pool.submit(call, layer.index, queries, self.budget_pages(chosen_among), **options)
        self.kvtier_seconds += time.perf_counter() - start
        self.calls["select_kv"] = self.calls.get("select_kv", 0) + 1
        return _Ahead(future, stored, queries, step)

    def _wait(self, layer: KVTierLayer, ahead: _Ahead) -> SelectionKV:
        """The selection ``ahead`` made. Where it failed after asking for
        an append, the layer's length in kvtier is unknown and the cache
        cannot go on; where it asked for none, the layer keeps the length
        kvtier has."""
        start = time.perf_counter()
        try:
            selection = ahead.future.result()
        except BaseException as e:
            if ahead.kept is None:
                # It appended nothing: kvtier holds the layer's tokens
                # through its position, and the step waiting on it is
                # refused as a whole.
                layer.tokens = ahead.position + 1
            else:
                layer.unknown = (
                    f"the selection made ahead at position {ahead.position} failed ({type(e).__name__}: {e}); its"
                    " token may have been appended; this cache cannot go on (its length in kvtier is unknown)"
                )
            raise
        finally:
            self.kvtier_seconds += time.perf_counter() - start
        self._count_server(selection)
        return selection

    def _drain(self, layer: KVTierLayer) -> None:
        """Waits for the layer's selection made ahead, if any: its append
        must be in kvtier before anything else reads or writes the layer."""
        ahead, layer.ahead = layer.ahead, None
        if ahead is not None:
            self._wait(layer, ahead)

    def _select_call(self, scaling: float, layer: int) -> SelectKvCall:
        """The decode steps' selection at the attention's ``scaling``
        (one model's layers share it), made once; with ``speculative``,
        one per layer, each into its own window."""
        key = (scaling, layer if self._windows is not None else None)
        call = self._select_calls.get(key)
        if call is None:
            shm = self.shm if self._windows is None else self._windows[layer]
            call = self._select_calls[key] = self.client.select_kv_call(
                self.sequence_id,
                sink_pages=self.sink_pages,
                window_pages=self.window_pages,
                softmax_scale=scaling,
                shm=shm,
                # Over a region of the client's: each head's pages as views
                # of it, which the step's attention copies before the next
                # call into the same window.
                views=self.client._via(shm) is not None and not self.attend_in_store,
                attend=self.attend_in_store,
                **self.select_options,
            )
        return call

    def close(self) -> None:
        """Drops the sequence (pages another sequence shares stay), raising
        if a step's token never reached kvtier; a second call does
        nothing."""
        if self._closed:
            return
        self._closed = True
        # Each layer's last append, made ahead, lands first; the first
        # failure is raised once the sequence is dropped.
        error: Optional[BaseException] = None
        for layer in self.layers:
            try:
                self._drain(layer)
                layer.check_stored()
            except Exception as e:
                error = error or e
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        try:
            self.client.drop(self.sequence_id)
        except Exception:
            if error is None:
                raise
        if error is not None:
            raise error

    def __enter__(self) -> "KVTierCache":
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        try:
            self.close()
        except Exception:
            if kind is None:
                raise  # else the error in flight is the one to see

    def __getitem__(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("KVTierCache keeps K/V in kvtier: read them with client.fetch(cache.sequence_id, layer)")

    def __iter__(self):
        raise NotImplementedError("KVTierCache keeps K/V in kvtier: read them with client.fetch(cache.sequence_id, layer)")
