#!/bin/sh
# The A/B of this folder: format_ab.py at 4 ranks, REL 1e-3, on the emulated 100 Mbit/s and
# 1 Gbit/s links, the working tree ("new", 3724501) and a checkout of e009e93 ("base", with
# its own .venv link and warm numba cache) in turn, twice per link. As root, from the
# working tree:  BASE=/path/to/e009e93-checkout OUT=/tmp/ab sh run_ab.sh
NEW=$(pwd)
OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT"
for rate in 100mbit 1gbit; do
  for round in 1 2; do
    for side in new base; do
      if [ $side = new ]; then D=$NEW; else D=$BASE; fi
      cd "$D"
      echo "== $side $rate round $round $(date -u +%H:%M:%S)" >> "$OUT/log.txt"
      PYTHONPATH=$D timeout 900 .venv/bin/python jobs/emulated_cluster.py --ranks 4 --rate $rate -- \
        .venv/bin/python bench/format_ab.py --rel 1e-3 --iters 5 \
        --json "$OUT/${side}_${rate}_r${round}.json" > "$OUT/${side}_${rate}_r${round}.txt" 2>&1
      echo "rc=$? $(date -u +%H:%M:%S)" >> "$OUT/log.txt"
    done
  done
done
