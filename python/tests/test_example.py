"""The SmolLM2 example (examples/smollm2): with a budget that covers every
page, decoding through kvtier's selections reproduces dense decoding token
for token, and the reference continuation's perplexity exactly; a smaller
budget fetches fewer bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "smollm2"))

decode = pytest.importorskip("decode", reason="the example needs the `gguf` package (python/test.sh installs it)")


@pytest.fixture(scope="module")
def model():
    return decode.Model(decode.gguf_path())


@pytest.mark.parametrize("data_plane", ["inline", "shm"])
def test_a_budget_of_every_page_reproduces_dense_decoding(model, server, data_plane):
    client = server.client()
    text = (decode.ROOT / "docs" / "ARCHITECTURE.md").read_text()
    runs, meta = decode.experiment(model, client, text, 160, 6, 4, ["1/4", "all"], 1, 1, data_plane)
    dense, quarter, everything = runs
    assert everything.tokens == dense.tokens and len(dense.tokens) == 6
    assert everything.nll == dense.nll
    assert 0 < sum(quarter.bytes_fetched) < sum(everything.bytes_fetched)
    assert meta["prompt_pages"] == 10
