"""Time ccoll's repeated allreduce inside and outside its MPI call (fastpath._checked_sum).

Run under the emulated cluster or mpiexec, e.g.
    python jobs/emulated_cluster.py --ranks 2 --rate 1gbit -- .venv/bin/python -m mpi4py split_probe.py
"""
import sys, time
import numpy as np
from mpi4py import MPI
import ccoll
from ccoll.collectives import fastpath
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
cc = ccoll.Communicator(comm, timeout=float("inf"))
x = np.ones(1, np.float32); y = np.empty_like(x)
for _ in range(200):
    cc.allreduce(x, None)
orig = fastpath._checked_sum
acc = [0.0]
pc = time.perf_counter
def wrapped(ch, s, d, dl):
    t = pc()
    r = orig(ch, s, d, dl)
    acc[0] += pc() - t
    return r
fastpath._checked_sum = wrapped
N = 5000
for rnd in range(3):
    comm.Barrier()
    acc[0] = 0.0
    t0 = pc()
    for _ in range(N):
        cc.allreduce(x, None)
    tot = pc() - t0
    print(rank, f"total {tot/N*1e6:.2f} us, in checked_sum {acc[0]/N*1e6:.2f} us, outside {(tot-acc[0])/N*1e6:.2f} us", flush=True)
