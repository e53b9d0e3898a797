"""Writes the Python API reference (python/API.md) from the package's
docstrings and signatures: every name in `kvtier.__all__`, the public
methods and properties of its classes, the exceptions of `kvtier.errors`,
and `kvtier.transformers` (so it runs where the `transformers` extra is
installed).

    python python/tools/api_reference.py > python/API.md

tests/test_packaging.py fails when python/API.md is not what this prints.
"""

from __future__ import annotations

import inspect
import sys

import kvtier


def signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def doc(obj: object) -> str:
    text = inspect.getdoc(obj) or ""
    return text + "\n\n" if text else "*(no docstring)*\n\n"


def members(cls: type) -> list:
    """Public methods and properties, inherited ones included (the clients
    share their calls through a base class), each once, the most derived
    definition winning."""
    seen = {}
    # Only kvtier's own: KVTierCache inherits transformers' Cache API.
    for klass in reversed(cls.__mro__[:-1]):
        if klass.__module__.startswith("kvtier"):
            seen.update(klass.__dict__)
    out = []
    for name, value in seen.items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            out.append((f"`{cls.__name__}.{name}` (property)", value.fget))
        elif isinstance(value, (staticmethod, classmethod)):
            out.append((f"`{cls.__name__}.{name}{signature(value.__func__)}`", value.__func__))
        elif inspect.isfunction(value) or inspect.iscoroutinefunction(value):
            out.append((f"`{cls.__name__}.{name}{signature(value)}`", value))
    return out


def generate() -> str:
    parts = [
        "# kvtier Python API\n\n",
        "Generated from the docstrings by `python/tools/api_reference.py` under "
        f"Python {sys.version_info[0]}.{sys.version_info[1]} (signatures print differently on others); "
        "`tests/test_packaging.py` fails when this file and the package disagree. Do not edit by hand.\n\n",
        doc(kvtier),
    ]
    for name in sorted(kvtier.__all__, key=str.lower):
        obj = getattr(kvtier, name)
        if name == "errors":
            parts.append("## `kvtier.errors`\n\n" + doc(obj))
            for ename, exc in inspect.getmembers(obj, inspect.isclass):
                if issubclass(exc, Exception) and exc.__module__ == obj.__name__:
                    bases = ", ".join(b.__name__ for b in exc.__bases__)
                    parts.append(f"### `errors.{ename}({bases})`\n\n" + doc(exc))
        elif inspect.isclass(obj):
            parts.append(f"## `kvtier.{name}{signature(obj)}`\n\n" + doc(obj))
            for title, member in members(obj):
                parts.append(f"### {title}\n\n" + doc(member))
        elif callable(obj):
            parts.append(f"## `kvtier.{name}{signature(obj)}`\n\n" + doc(obj))
        elif name != "__version__":
            parts.append(f"## `kvtier.{name}`\n\n`{obj!r}`\n\n")
    parts.append(transformers_section())
    return "".join(parts).rstrip() + "\n"


def transformers_section() -> str:
    """`kvtier.transformers` (the `transformers` extra: needs torch)."""
    from kvtier import transformers

    parts = ["## `kvtier.transformers`\n\n" + doc(transformers)]
    for name in transformers.__all__:
        obj = getattr(transformers, name)
        parts.append(f"### `kvtier.transformers.{name}{signature(obj)}`\n\n" + doc(obj))
        if inspect.isclass(obj):
            for title, member in members(obj):
                parts.append(f"#### {title}\n\n" + doc(member))
    return "".join(parts)


if __name__ == "__main__":
    sys.stdout.write(generate())
