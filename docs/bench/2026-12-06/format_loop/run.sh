#!/bin/sh
# "base": main at b130d6c (a worktree at /work/wt/base); "new": the measured loop over both
# formats. In turn, as the file names number them; 4 ranks, 64 MiB of MiniLM per rank.
for side in base new; do
  if [ $side = base ]; then PP=/work/wt/base; else PP=$PWD; fi
  PYTHONPATH=$PP .venv/bin/python jobs/emulated_cluster.py --ranks 4 --rate 1gbit -- \
    .venv/bin/python bench/format_ab.py --rel 1e-3 --iters 9 > ab_1gbit_${side}_1.txt 2>&1
done   # the same at --rate 100mbit and 10gbit: ab_100mbit_*.txt, ab_10gbit_*.txt
