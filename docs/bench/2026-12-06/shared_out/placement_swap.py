"""MPI's own allreduce at one size on two output arrays, and ccoll's on the other: swap them.

Run at 2 ranks on one node after loading the bundled dump (whose allocations move where
later arrays lie, as `ccoll bench` does):

    mpiexec -n 2 python -m mpi4py placement_swap.py [swap]

For 64 KiB, 256 KiB and 1 MiB: x, then MPI's output array, then ccoll's (the order
`ccoll bench` allocated them before both rows shared one); with ``swap`` each takes the
other's. Prints the fastest of 200 interleaved calls of each (the slowest rank's).
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import ccoll
from ccoll import bench

comm = MPI.COMM_WORLD
rank = comm.rank
base = bench.load_gradients("datasets/minilm.h5", rank)
cc = ccoll.Communicator(comm)
for nb in (65536, 262144, 1048576):
    n = nb // 4
    x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    ym = np.empty_like(x)
    ya = np.empty_like(x)
    if sys.argv[1:] == ["swap"]:
        ym, ya = ya, ym

    def fm() -> None:
        comm.Allreduce(x, ym)

    def fa() -> None:
        cc.allreduce(x, "rel:1e-3", out=ya)

    for _ in range(20):
        fm()
        fa()
    tm, ta = [], []
    for _ in range(200):
        comm.Barrier()
        t0 = time.perf_counter()
        fm()
        tm.append(time.perf_counter() - t0)
        comm.Barrier()
        t0 = time.perf_counter()
        fa()
        ta.append(time.perf_counter() - t0)
    m = comm.allreduce(min(tm) * 1e6, op=MPI.MAX)
    a = comm.allreduce(min(ta) * 1e6, op=MPI.MAX)
    if rank == 0:
        print(f"{' '.join(sys.argv[1:]) or 'as allocated'}: {nb} B: MPI {m:.0f} us, "
              f"ccoll {a:.0f} us, ccoll's speed-up {m / a:.2f}x "
              f"({cc.last_call.reason})", flush=True)
cc.close()
