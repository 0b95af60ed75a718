"""What one more pipeline chunk costs the compressed ring, on tiny data (run under MPI).

Times ``ring_allreduce`` of 256 float32 values per rank and block with one chunk per
block and with 8 (``--version`` 1 or 2 streams, homomorphic), the median of 200 calls per
round, the least of 3 rounds, and prints the slowest part as rank 0 sees it: the call with
one chunk and each further chunk's cost (``(t8 - t1) / 7``, what the calibration's
``chunk_overhead`` measures). ``--public`` makes ccoll's kernel launches read and set
numba's thread count through numba's public functions (as before 2026-12-06) instead of
``cpu_threads.counts()``; ``--profile`` prints rank 0's cProfile of 300 one-chunk calls.

    mpiexec -n 2 python -m mpi4py bench/ring_chunk_cost.py --version 2
    mpiexec -n 2 python -m mpi4py bench/ring_chunk_cost.py --version 2 --public
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numba
import numpy as np
from mpi4py import MPI

import ccoll
from ccoll.collectives.ring import ring_allreduce
from ccoll.collectives.waiting import Deadline
from ccoll.runtime import cpu_threads

BLOCK = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", type=int, default=1, choices=(1, 2))
    ap.add_argument("--public", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    c = ccoll.Communicator(comm)
    ch = c._sync.ch
    cpu_threads.counts()
    if args.public:
        cpu_threads._counts = (numba.get_num_threads, numba.set_num_threads)
    data = (np.random.default_rng(comm.rank).laplace(size=BLOCK * n) * 1e-2).astype(np.float32)
    out = np.empty_like(data)

    def call(chunk: int) -> None:
        ring_allreduce(ch, data, out, data.dtype, 1e-4, algorithm="homomorphic",
                       chunk_elems=chunk, deadline=Deadline(None, "ring chunk cost"),
                       version=args.version)

    for chunk in (BLOCK, BLOCK // 8):
        for _ in range(20):
            call(chunk)
    res: dict[int, list[float]] = {}
    for _ in range(3):
        for chunk in (BLOCK, BLOCK // 8):
            ts = []
            for _ in range(200):
                comm.Barrier()
                t0 = time.perf_counter()
                call(chunk)
                ts.append(time.perf_counter() - t0)
            res.setdefault(chunk, []).append(float(np.median(ts)))
    if comm.rank == 0:
        one, eight = min(res[BLOCK]), min(res[BLOCK // 8])
        how = "public" if args.public else "layer"
        print(f"{how} v{args.version} ranks {n}: 1 chunk {one * 1e6:.0f} us, 8 chunks "
              f"{eight * 1e6:.0f} us, per chunk {(eight - one) / 7 * 1e6:.0f} us")
    if args.profile:
        pr = cProfile.Profile()
        comm.Barrier()
        pr.enable()
        for _ in range(300):
            call(BLOCK)
        pr.disable()
        if comm.rank == 0:
            pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    c.close()


if __name__ == "__main__":
    main()
