#!/bin/sh
# The two runs of this folder: jobs/train_compare.sh at 1 Gbit/s, one seed, 10 steps, bf16,
# PowerSGD and ccoll interleaved, first the working tree ("new"), then a checkout of
# 68a43d6 ("old", warm numba cache). As root, from the working tree, after `make minilm`:
#   BASE=/path/to/68a43d6-checkout OUT=/tmp/train sh train_ab.sh
NEW=$(pwd)
OUT=${OUT:-/tmp/train}
mkdir -p "$OUT"
for side in new old; do
  if [ $side = new ]; then D=$NEW; else D=$BASE; fi
  cd "$D"
  echo "== $side $(date -u +%H:%M:%S)" >> "$OUT/log.txt"
  PYTHONPATH=$D LINKS=1gbit SEEDS=5 STEPS=10 EVAL_EVERY=5 METHODS_1gbit=bf16,powersgd,ccoll \
    OUT="$OUT/train_$side" sh jobs/train_compare.sh > "$OUT/$side.txt" 2>&1
  echo "rc=$? $(date -u +%H:%M:%S)" >> "$OUT/log.txt"
done
