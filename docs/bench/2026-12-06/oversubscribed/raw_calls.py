"""Large raw allreduces: MPI's blocking call, its nonblocking one, ccoll raw (default timeout / inf)."""
import sys, time, math
import numpy as np
from mpi4py import MPI
import ccoll
comm = MPI.COMM_WORLD
cd = ccoll.Communicator(comm, policy="raw")
ci = ccoll.Communicator(comm, policy="raw", timeout=math.inf)
for size in [int(s) for s in sys.argv[1].split(",")]:
    x = np.random.default_rng(comm.Get_rank()).standard_normal(size // 4).astype(np.float32)
    y = np.empty_like(x)
    eb = ccoll.REL(1e-3)
    v = {"Allreduce": lambda: comm.Allreduce(x, y, op=MPI.SUM),
         "Iallreduce+Wait": lambda: comm.Iallreduce(x, y, op=MPI.SUM).Wait(),
         "ccoll raw dflt": lambda: cd.allreduce(x, eb, out=y),
         "ccoll raw inf": lambda: ci.allreduce(x, eb, out=y)}
    res = {k: [] for k in v}
    reps = max(2, min(20, (64 << 20) // size))
    for r in range(5):
        for k, f in v.items():
            f()
            ts = []
            for _ in range(reps):
                comm.Barrier(); t0 = time.perf_counter(); f()
                ts.append(comm.allreduce(time.perf_counter() - t0, MPI.MAX))
            res[k] += ts
    if comm.Get_rank() == 0:
        base = np.median(res["Allreduce"])
        print(f"{size} B: " + "  ".join(f"{k} {np.median(t)*1e6:.1f} us ({base/np.median(t):.2f}x)" for k, t in res.items()), flush=True)
