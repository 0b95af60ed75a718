"""One launch: MPI_Allreduce and ccoll's repeated raw call on the same page-aligned buffers.

Run at 2 ranks, many times (launches.sh): medians of 300 calls each, each after a barrier,
the slowest rank's time, mpi4py's own call and ``ccoll.allreduce(x, eb, out=y)`` in turn,
three rounds. Prints one line: size, MPI's and ccoll's medians per round.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import ccoll
from ccoll.bench import page_aligned

comm = MPI.COMM_WORLD.Dup()
sizes = [int(s) for s in sys.argv[1].split(",")]
cc = ccoll.Communicator(comm)
eb = ccoll.REL(1e-3)


def med(f, n=300):
    for _ in range(20):
        f()
    ts = np.empty(n)
    for i in range(n):
        comm.Barrier()
        t0 = time.perf_counter()
        f()
        ts[i] = time.perf_counter() - t0
    m = np.empty_like(ts)
    comm.Allreduce(ts, m, op=MPI.MAX)
    return float(np.median(m)) * 1e6


for nbytes in sizes:
    x = page_aligned(nbytes // 4, np.float32)
    x[:] = 1
    y = page_aligned(nbytes // 4, np.float32)
    rows = []
    for _ in range(3):
        a = med(lambda: comm.Allreduce(x, y))
        b = med(lambda: cc.allreduce(x, eb, out=y))
        rows.append(f"{a:.1f}/{b:.1f}")
    if comm.Get_rank() == 0:
        print(nbytes, " ".join(rows), flush=True)
