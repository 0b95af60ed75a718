#!/usr/bin/env bash
# GPU check of the ccoll compressor, for a machine with an NVIDIA GPU and no network:
# versions, GPU-vs-CPU byte equality on the real gradient dumps, throughput table.
# Uses the system python (PYTHON=... to override) with the repository on PYTHONPATH;
# installs nothing. Results also go to $OUT/compressor_gpu.json when OUT is set.
#   bench/gpu/run.sh [compressor_gpu.py options, e.g. --reps 30 --gib 2]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
LIMIT="${LIMIT_S:-290}"  # the whole check must end within 5 minutes

echo "== $(date -u +%FT%TZ) $(hostname) in $PWD"
command -v nvidia-smi >/dev/null && { timeout 20 nvidia-smi || echo "nvidia-smi failed ($?)"; }
echo "python: $(command -v "$PY") $("$PY" --version 2>&1)"

rc=0
timeout -k 10 "$LIMIT" "$PY" -u bench/gpu/compressor_gpu.py --budget "$((LIMIT - 25))" "$@" || rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "compressor_gpu.py ran past ${LIMIT}s and was stopped; the lines above are partial results"
elif [ "$rc" -ne 0 ]; then
  echo "compressor_gpu.py exited with status $rc (see above; partial results were printed)"
fi
if [ -n "${OUT:-}" ] && [ -f "$OUT/compressor_gpu.json" ]; then
  echo "results: $OUT/compressor_gpu.json"
fi
exit "$rc"
