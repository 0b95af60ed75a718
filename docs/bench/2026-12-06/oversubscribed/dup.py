import sys, time, math
import numpy as np
from mpi4py import MPI
import ccoll
comm = MPI.COMM_WORLD
ci = ccoll.Communicator(comm, policy="raw", timeout=math.inf)
dup = comm.Dup()
ch = ci._sync.ch.comm if hasattr(ci, "_sync") else None
for size in [int(s) for s in sys.argv[1].split(",")]:
    x = np.random.default_rng(comm.Get_rank()).standard_normal(size // 4).astype(np.float32)
    y = np.empty_like(x); eb = ccoll.REL(1e-3)
    v = {"Allreduce": lambda: comm.Allreduce(x, y, op=MPI.SUM),
         "dup": lambda: dup.Allreduce(x, y, op=MPI.SUM),
         "inf": lambda: ci.allreduce(x, eb, out=y),
         "inf None": lambda: ci.allreduce(x, None, out=y)}
    if ch is not None: v["chcomm"] = lambda: ch.Allreduce(x, y, op=MPI.SUM)
    res = {k: [] for k in v}
    reps = max(2, min(20, (64 << 20) // size))
    for r in range(7):
        for k, f in v.items():
            f()
            for _ in range(reps):
                comm.Barrier(); t0 = time.perf_counter(); f()
                res[k].append(comm.allreduce(time.perf_counter() - t0, MPI.MAX))
    if comm.Get_rank() == 0:
        base = np.median(res["Allreduce"])
        print(f"{size} B: " + "  ".join(f"{k} {np.median(t)*1e6:.0f}us ({base/np.median(t):.2f}x)" for k, t in res.items()), flush=True)
