#!/usr/bin/env bash
# GPU check of ccoll, for a machine with an NVIDIA GPU and no network: versions,
# GPU-vs-CPU byte equality on the real gradient dumps and the throughput table for stream
# formats 1 and 2 (compressor_gpu.py), then the training loop's slowdown from compressing
# on the scheduler's lanes (sched_gpu.py). Uses the system python (PYTHON=... to override)
# with the repository on PYTHONPATH; installs nothing. With OUT set, results also go to
# $OUT/compressor_gpu.json and $OUT/sched_gpu.txt.
#   [SCHED_ARGS="--iters 400"] bench/gpu/run.sh [compressor_gpu.py options, e.g. --reps 30 --gib 2]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
LIMIT="${LIMIT_S:-240}"  # the compressor check's limit; the scheduler check gets SCHED_S more
SCHED_LIMIT="${SCHED_S:-100}"

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

echo "== scheduler: training loop beside compression on the lanes (t=${SECONDS}s)"
src=0
# shellcheck disable=SC2086  # SCHED_ARGS: options, split on spaces
timeout -k 10 "$SCHED_LIMIT" "$PY" -u bench/gpu/sched_gpu.py ${SCHED_ARGS:---repeats 3} \
  | tee "${OUT:-/tmp}/sched_gpu.txt" || src=$?
[ "$src" -eq 0 ] || echo "sched_gpu.py exited with status $src (124/137: ran past ${SCHED_LIMIT}s)"
[ "$rc" -ne 0 ] || rc=$src
exit "$rc"
