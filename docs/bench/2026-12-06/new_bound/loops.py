"""Back-to-back loops at 2 ranks, 4 B: where ccoll's time over MPI's goes."""
import sys, time, math
import numpy as np
from mpi4py import MPI
import ccoll
comm = MPI.COMM_WORLD
N = 3000
x = np.ones(int(sys.argv[1]) if len(sys.argv) > 1 else 1, np.float32); y = np.empty_like(x)
ci = ccoll.Communicator(comm, timeout=math.inf)
cd = ccoll.Communicator(comm)
def busy(s):
    t = time.perf_counter() + s
    while time.perf_counter() < t: pass
def loop(f):
    comm.Barrier(); t0 = time.perf_counter()
    for _ in range(N): f()
    return comm.allreduce((time.perf_counter() - t0) / N, MPI.MAX) * 1e6
v = {
 "Allreduce": lambda: comm.Allreduce(x, y, op=MPI.SUM),
 "Iallreduce+Wait": lambda: comm.Iallreduce(x, y, op=MPI.SUM).Wait(),
 "Allreduce+1.4us": lambda: (busy(1.4e-6), comm.Allreduce(x, y, op=MPI.SUM)),
 "ccoll inf None": lambda: ci.allreduce(x, None, out=y),
 "ccoll inf rel": lambda: ci.allreduce(x, ccoll.REL(1e-3), out=y),
 "ccoll dflt rel": lambda: cd.allreduce(x, ccoll.REL(1e-3), out=y),
}
res = {k: [] for k in v}
for r in range(7):
    for k, f in v.items():
        res[k].append(loop(f))
if comm.Get_rank() == 0:
    for k, t in res.items():
        print(f"{k:18s} median {np.median(t):7.2f} us  (min {min(t):.2f})")
