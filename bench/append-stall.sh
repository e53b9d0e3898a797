#!/usr/bin/env bash
# Append stalls during a manifest checkpoint, before and after the fix (issue
# 11). Three release binaries of `kvtier`, run back to back on one machine:
#   before: the tree before the fix (default 60890f1, the start of issue 11)
#   nofix:  this tree with only the fix undone (the checkpoint snapshot takes
#           each lane's read lock with a plain `read()` again)
#   after:  this tree
# Two experiments, each repeated, the binaries alternating:
#   natural: the llama3-8b NVMe sweep of bench/decode.sh (device 10/25/50 %);
#            checkpoints fall wherever the manifest doubles
#   forced:  the same at device 25 % with a checkpoint forced at step 32
#            (`--checkpoint-at-step`, which the before binary does not have)
# Writes bench/results/append-stall.md; the runs stay in $work.
# Usage: bench/append-stall.sh [before-rev] [repeats]
set -euo pipefail
cd "$(dirname "$0")/.."
before_rev=${1:-60890f1}
repeats=${2:-2}
root=$PWD
work=${KVTIER_STALL_WORK:-$(mktemp -d /tmp/kvtier-append-stall.XXXXXX)}
mkdir -p "$work/bin"
target=${CARGO_TARGET_DIR:-$root/target}

build() { # build <name> <source dir>
  (cd "$2" && CARGO_TARGET_DIR=$target cargo build --release --locked -q -p kvtier)
  cp "$target/release/kvtier" "$work/bin/$1"
}
trees=()
cleanup() { for t in "${trees[@]}"; do git -C "$root" worktree remove --force "$t"; done; }
trap cleanup EXIT
worktree() { # worktree <dir> <rev>
  git -C "$root" worktree add -q --detach "$1" "$2"
  trees+=("$1")
}

worktree "$work/before-src" "$before_rev"
build before "$work/before-src"
worktree "$work/nofix-src" HEAD
sed -i 's/cell\.read_behind_writers()/cell.read()/' "$work/nofix-src/crates/kvtier-store/src/durability/snapshot.rs"
grep -q 'cell.read()' "$work/nofix-src/crates/kvtier-store/src/durability/snapshot.rs"
build nofix "$work/nofix-src"
build after "$root" # last, so target/release/kvtier is this tree's again

llama=(--preset llama3-8b --context 32768 --steps 256 --budget-pages 32 --sinks 1 --window 1 --drift 0.1 --host-fraction 0.5)
natural=("${llama[@]}" --sweep device_fraction=0.1,0.25,0.5)
forced=("${llama[@]}" --device-fraction 0.25 --checkpoint-at-step 32)
export KVTIER_LOG=kvtier_store=info # the checkpoint lines the tables count
for i in $(seq "$repeats"); do
  for b in before after; do
    "$work/bin/$b" bench decode "${natural[@]}" --out "$work/natural-$b-$i" > "$work/natural-$b-$i.txt" 2>&1
  done
  for b in nofix after; do
    "$work/bin/$b" bench decode "${forced[@]}" --out "$work/forced-$b-$i" > "$work/forced-$b-$i.txt" 2>&1
  done
done

{
  echo "# Append stalls during a manifest checkpoint"
  echo
  echo "- command: \`bench/append-stall.sh $before_rev $repeats\`, which runs, for each binary:"
  echo "  - natural: \`kvtier bench decode ${natural[*]}\`"
  echo "  - forced: \`kvtier bench decode ${forced[*]}\`"
  echo "- binaries: before = $before_rev; nofix = $(git rev-parse --short HEAD) with the checkpoint"
  echo "  snapshot taking each lane's lock with a plain \`read()\`; after = $(git describe --always --dirty)"
  echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/ {print $2}') GiB; $(uname -r); device tier emulated"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  python3 bench/append_stall_table.py "$work"
} > bench/results/append-stall.md
cat bench/results/append-stall.md
