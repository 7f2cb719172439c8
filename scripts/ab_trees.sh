#!/usr/bin/env bash
# A/B of fuser trees and settings on one machine: each configuration's benchmark rows in its own process, the
# configurations alternating for ROUNDS rounds (default 2), every process on the same machine one after another.
#   scripts/ab_trees.sh "<fuser.bench arguments>" LABEL=TREE[:VAR=VALUE,...] ...
# TREE: a git revision (its fuser/ extracted once per revision under $OUT/trees, or a temporary folder) or "." for the working
# tree. Example (the working tree against main, and with rows kept in shared memory turned off):
#   scripts/ab_trees.sh "--device cuda --sizes large --systems fuser --only =softmax_scale_r64k,=sum0_mul" \
#     main=main work=. unstaged=.:FUSER_CUDA_STAGED_ROWS=0
# Prints each process's table lines (prefixed with its label and round) and writes its JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
ARGS=$1; shift
OUT=${OUT:-$(mktemp -d -t fuser-ab-XXXXXX)}
TREES="$OUT/trees"
mkdir -p "$TREES"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for cfg in "$@"; do
    label=${cfg%%=*}; rest=${cfg#*=}
    tree=${rest%%:*}; envs=""; [[ "$rest" == *:* ]] && envs=${rest#*:}
    if [ "$tree" = "." ]; then
      path=$PWD
    else
      path="$TREES/$(git rev-parse --short "$tree")"
      [ -d "$path/fuser" ] || { mkdir -p "$path" && git archive "$tree" fuser | tar -x -C "$path"; }
    fi
    (
      IFS=','; for kv in $envs; do export "$kv"; done; unset IFS
      cd "$OUT" && PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" python3 -m fuser.bench $ARGS \
        --json "$OUT/${label}_r$round.json" 2>&1 | grep -E "^ *[a-z_0-9]+ +(float|bfloat)" | sed "s/^/$label r$round: /"
    )
  done
done
