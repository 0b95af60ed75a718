"""mpi4py's Allreduce of 4 B with k us of idle Python spin after each call (k = 0..16).

Run as split_probe.py; prints the median time per call for each k on rank 0.
"""
import sys, time, os
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
x = np.ones(1, np.float32); y = np.empty_like(x)
pc = time.perf_counter
def mk(k):
    k = k * 1e-6
    def f():
        comm.Allreduce(x, y)
        if k:
            t = pc() + k
            while pc() < t:
                pass
    return f
def mkpre(k):
    k = k * 1e-6
    def f():
        if k:
            t = pc() + k
            while pc() < t:
                pass
        comm.Allreduce(x, y)
    return f
variants = {f"busy{k}": mk(k) for k in (0, 1, 2, 4, 8, 16)}
res = {k: [] for k in variants}
for r in range(9):
    for k, f in variants.items():
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(1000):
            f()
        res[k].append(comm.allreduce((time.perf_counter() - t0) / 1000, op=MPI.MAX))
if rank == 0:
    import statistics
    for k, v in res.items():
        print(k, f"{statistics.median(v)*1e6:.2f} us")
