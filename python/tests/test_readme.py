"""The README's Python quick start runs as written (against this module's
server instead of the default address)."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_quick_start_runs(server):
    text = README.read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start : text.index("```", start)]
    assert "kvtier.Client(" in code
    namespace: dict = {}
    exec(compile(code.replace("http://127.0.0.1:50051", server.address), str(README), "exec"), namespace)
    k0, pages = namespace["k0"], namespace["pages"]
    # 8 pages of 16 tokens, unless the partial last one (8 tokens) is among them
    assert len(pages) == 8 and k0.shape[1] == 64 and k0.shape[0] in (8 * 16, 7 * 16 + 8)
