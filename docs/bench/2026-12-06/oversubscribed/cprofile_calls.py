import sys, time, math, cProfile, pstats
import numpy as np
from mpi4py import MPI
import ccoll
comm = MPI.COMM_WORLD
ci = ccoll.Communicator(comm, policy="raw", timeout=math.inf)
size = int(sys.argv[1])
x = np.random.default_rng(comm.Get_rank()).standard_normal(size // 4).astype(np.float32)
y = np.empty_like(x); eb = ccoll.REL(1e-3)
for _ in range(10): ci.allreduce(x, eb, out=y)
pr = cProfile.Profile()
pr.enable()
for _ in range(3000): ci.allreduce(x, eb, out=y)
pr.disable()
if comm.Get_rank() == 0:
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)
