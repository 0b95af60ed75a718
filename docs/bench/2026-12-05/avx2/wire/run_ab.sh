#!/bin/sh
# The A/B of this folder: bench/format_ab.py (REL 1e-3, 64 MiB of MiniLM per rank) on the
# emulated links, the working tree ("new") and a checkout of 68a43d6 ("base", warm numba
# cache) in turn. As root, from the working tree:
#   BASE=/path/to/68a43d6-checkout OUT=/tmp/ab sh run_ab.sh
NEW=$(pwd)
OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT"
for spec in "4 1gbit 1" "4 1gbit 2" "4 100mbit 1" "2 1gbit 1"; do
  set -- $spec
  for side in new base; do
    if [ $side = new ]; then D=$NEW; else D=$BASE; fi
    cd "$D"
    name="${side}_$2_$1ranks_r$3"
    echo "== $name $(date -u +%H:%M:%S)" >> "$OUT/log.txt"
    PYTHONPATH=$D timeout 900 .venv/bin/python jobs/emulated_cluster.py --ranks $1 --rate $2 -- \
      .venv/bin/python bench/format_ab.py --rel 1e-3 --iters 5 \
      --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
    echo "rc=$? $(date -u +%H:%M:%S)" >> "$OUT/log.txt"
  done
done
