"""The package's metadata: the `test` extra (with the `transformers` extra
for kvtier.transformers' tests) installs every third-party module the
tests (and the example they run) import."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Modules of this repository the tests import by path.
LOCAL = {"kvtier", "conftest", "decode", "model", "api_reference"}
# Import names whose distribution is named otherwise.
DISTRIBUTION = {"numpy": "numpy"}


def imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip":
            names.add(node.args[0].value.split(".")[0])
    return names


def requirement_names(pyproject: str, key: str) -> set[str]:
    block = re.search(rf"^{key} = \[(.*?)\]", pyproject, re.M | re.S).group(1)
    return {re.split(r"[<>=!~ \[]", r)[0].lower() for r in re.findall(r'"([^"]+)"', block)}


@pytest.mark.skipif(sys.version_info < (3, 10), reason="sys.stdlib_module_names is 3.10+")
def test_the_test_extra_installs_what_the_tests_import() -> None:
    files = list((ROOT / "python" / "tests").glob("*.py")) + list((ROOT / "examples" / "smollm2").glob("*.py"))
    third_party = set()
    for path in files:
        third_party |= imported(path) - set(sys.stdlib_module_names) - LOCAL
    pyproject = (ROOT / "python" / "pyproject.toml").read_text()
    installed = set().union(*(requirement_names(pyproject, key) for key in ("dependencies", "test", "transformers")))
    missing = sorted(m for m in third_party if DISTRIBUTION.get(m, m).lower() not in installed)
    assert not missing, f"the tests import {missing}, which neither the dependencies nor the test extra install"


def test_the_api_reference_is_generated_from_the_docstrings() -> None:
    pytest.importorskip("torch", reason="python/API.md documents kvtier.transformers, which needs the transformers extra")
    sys.path.insert(0, str(ROOT / "python" / "tools"))
    import api_reference

    committed = (ROOT / "python" / "API.md").read_text()
    python = f"Python {sys.version_info[0]}.{sys.version_info[1]} "
    if python not in committed.split("\n\n")[1]:
        pytest.skip(f"python/API.md was generated under another Python than {python}(signatures differ)")
    assert committed == api_reference.generate(), (
        "python/API.md is not what the docstrings generate: python python/tools/api_reference.py > python/API.md"
    )
