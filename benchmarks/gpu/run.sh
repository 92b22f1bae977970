#!/usr/bin/env bash
# The GPU measurement in one command (benchmarks/gpu/README.md): at most GPU_RUN_LIMIT_S seconds
# (default 470, under 8 minutes), writing $OUT/gpu.json (rewritten after every part) and $OUT/gpu.log.
#   OUT=/tmp/gpu benchmarks/gpu/run.sh [--commit HASH]          # on a GPU machine
#   OUT=/tmp/gpu benchmarks/gpu/run.sh --device cpu --tiny       # the dry run (seconds)
# Needs only torch, timm, numpy, tifffile, opencv and PyYAML: the project's modules run from src/
# (PYTHONPATH), not installed. Arguments go to `python -m gpu.run` (see benchmarks/gpu/run.py).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-${TMPDIR:-/tmp}/cellpath-gpu}"
PYTHON="${PYTHON:-python3}"
LIMIT_S="${GPU_RUN_LIMIT_S:-470}"
mkdir -p "$OUT"
cd "$ROOT" || exit 1
export OUT
export PYTHONPATH="$ROOT/src:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
timeout -k 10 "$LIMIT_S" "$PYTHON" -m gpu.run --out "$OUT" --total-s "$((LIMIT_S - 20))" "$@" 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
