#!/bin/sh
# ccoll against bf16 and PowerSGD on time to accuracy (docs/training.md, "Against bf16 and
# PowerSGD"): all-MiniLM-L6-v2 under DDP, 4 ranks, each behind an emulated link (as root,
# jobs/emulated_cluster.py), every method from the same seed and interleaved step by step,
# one job per link and seed; then the table and the plots of bench/train_compare.py.
#
#   sh jobs/train_compare.sh                       # everything (hours on 2 cores)
#   LINKS=1gbit SEEDS="0 1" sh jobs/train_compare.sh
#   METHODS_100mbit=bf16,powersgd,ccoll sh jobs/train_compare.sh   # a link's own methods
#   LINKS=shm sh jobs/train_compare.sh             # one machine without shaping (mpiexec -n 4)
#
# A method@MB runs that method with DDP buckets of MB (examples/train_ddp.py --methods).
# Fixed before the runs: the target (0.76 retrieval accuracy), 20 steps, an evaluation
# every 4 steps, PowerSGD from step 2 at ranks 4 and 8, ccoll's defaults (REL 1e-3, auto)
# and its documented best setting (5 MB DDP buckets, docs/training.md "Bucket size"; error
# feedback, measured before, costs steps for no accuracy change over 20 steps).
# `none` is the same computation at every link (the exact average, from the same seed), so
# its accuracy from one link stands for all. Needs `make minilm`.
set -eu
OUT=${OUT:-runs/compare}
SEEDS=${SEEDS:-"0 1 2"}
LINKS=${LINKS:-"100mbit 1gbit 10gbit"}
STEPS=${STEPS:-20}
EVAL_EVERY=${EVAL_EVERY:-4}
METHODS=${METHODS:-none,bf16,powersgd,powersgd:8,ccoll,ccoll@5}
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1
$PY -m ccoll.speedindex
for link in $LINKS; do
  methods=$(eval echo "\${METHODS_$link:-$METHODS}")
  for seed in $SEEDS; do
    if [ "$link" = shm ]; then  # one machine, no shaping: the ranks talk through shared memory
      run="timeout 3600 ${PY%/python}/mpiexec -n 4"
    else
      run="$PY jobs/emulated_cluster.py --ranks 4 --rate $link --timeout 3600 --"
    fi
    $run $PY -m mpi4py examples/train_ddp.py --model minilm --methods "$methods" --interleave \
      --steps "$STEPS" --eval-every "$EVAL_EVERY" --target-accuracy 0.76 --powersgd-start-iter 2 \
      --seed "$seed" --out "$OUT/$link"
  done
done
$PY -m ccoll.speedindex
$PY bench/train_compare.py "$OUT"/* --png "$OUT/png"
