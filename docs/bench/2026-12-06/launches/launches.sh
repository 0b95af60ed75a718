#!/bin/sh
# MPI's own allreduce and ccoll's repeated raw call, launch after launch (2 ranks, shared
# memory): docs/dev/repeated-calls.md, "From one launch to the next". Run from the root.
D=docs/bench/2026-12-06/launches
.venv/bin/python -m ccoll.speedindex
for i in $(seq 1 12); do
  echo "launch $i"
  timeout 300 .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py $D/launch.py 4,65536,262144
done
.venv/bin/python -m ccoll.speedindex
