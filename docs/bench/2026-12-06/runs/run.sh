#!/bin/sh
# The allreduce sweep of docs/performance.md ("Allreduce against MPI"), each row's timed calls
# in runs led by a call of its own (--blocks 3, since 00cc3ae). Run from the repository
# root; outputs land in $OUT (default: beside this script).
set -e
OUT=${OUT:-docs/bench/2026-12-06/runs}
mkdir -p $OUT
ARGS="allreduce -b 4 -e 256M -f 4 --algorithms mpi,auto -n 30 -w 5 --iters-large 6 --warmup-large 3 --force"
.venv/bin/python -m ccoll.speedindex > $OUT/speedindex_start.txt 2>&1
for n in 2 4; do
  timeout 1800 .venv/bin/mpiexec -n $n .venv/bin/python -m mpi4py -m ccoll.cli bench $ARGS \
    --csv $OUT/allreduce_shm_$n.csv --plot $OUT/allreduce_shm_$n.png > $OUT/allreduce_shm_$n.txt 2>&1
done
for spec in "2 1gbit" "4 1gbit" "2 10gbit" "4 10gbit"; do set -- $spec
  timeout 1800 .venv/bin/python jobs/emulated_cluster.py --ranks $1 --rate $2 -- ccoll bench $ARGS \
    --csv $OUT/allreduce_$2_$1.csv --plot $OUT/allreduce_$2_$1.png > $OUT/allreduce_$2_$1.txt 2>&1
done
.venv/bin/python -m ccoll.speedindex > $OUT/speedindex_end.txt 2>&1
date -u > $OUT/done.txt
