import sys, time, math
import numpy as np
from mpi4py import MPI
import ccoll
from ccoll.collectives import fastpath
comm = MPI.COMM_WORLD
ci = ccoll.Communicator(comm, policy="raw", timeout=math.inf)
ch = ci._sync.ch.comm
acc = [0.0, 0]
real = fastpath._checked_sum
def timed(*a, **k):
    t0 = time.perf_counter(); r = real(*a, **k); acc[0] += time.perf_counter() - t0; acc[1] += 1; return r
fastpath._checked_sum = timed
size = int(sys.argv[1])
x = np.random.default_rng(comm.Get_rank()).standard_normal(size // 4).astype(np.float32)
y = np.empty_like(x); eb = ccoll.REL(1e-3)
for barrier in (True, False):
    for name, f in (("chcomm", lambda: ch.Allreduce(x, y, op=MPI.SUM)), ("ccoll", lambda: ci.allreduce(x, eb, out=y))):
        f(); f()
        acc[0] = 0.0; acc[1] = 0
        tot = 0.0; N = 400
        for _ in range(N):
            if barrier: comm.Barrier()
            t0 = time.perf_counter(); f(); tot += time.perf_counter() - t0
        if comm.Get_rank() == 0:
            print(f"barrier={barrier} {name}: {tot/N*1e6:.1f} us/call, in _checked_sum {acc[0]/max(acc[1],1)*1e6:.1f} us ({acc[1]} calls)")
