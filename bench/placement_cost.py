"""What copying x into y and MPI_Allreduce(x, y) cost against where y lies relative to x.

Both buffers start page-aligned, y then moved by 0, 16, 64, 256 and 2048 bytes (its
offset from x modulo 4 KiB); medians of 7 rounds, slowest rank, microseconds per call
(docs/dev/repeated-calls.md, "Where the buffers lie"):

    python bench/placement_cost.py
    mpiexec -n 2 python -m mpi4py bench/placement_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI


def pair(n: int, delta: int) -> tuple[np.ndarray, np.ndarray]:
    """Two float32 arrays of ``n`` elements, ``(y - x) mod 4096 == delta`` bytes."""
    buf = np.zeros(2 * n * 4 + 3 * 4096, np.uint8)
    a0 = -buf.ctypes.data % 4096
    b0 = a0 + -(-4 * n // 4096) * 4096 + 4096 + delta
    x = buf[a0:a0 + 4 * n].view(np.float32)
    y = buf[b0:b0 + 4 * n].view(np.float32)
    x[:] = 1.0
    return x, y


def timed(comm: MPI.Intracomm, f: Callable[[], object], calls: int) -> float:
    """Median over 7 rounds of the slowest rank's seconds per call, in microseconds."""
    rounds = []
    for _ in range(7):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        rounds.append(comm.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX))
    return statistics.median(rounds) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4096,65536,262144", help="bytes, comma-separated")
    ap.add_argument("--deltas", default="0,16,64,256,2048", help="offsets (bytes mod 4096)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{comm.Get_size()} rank(s); median of 7 rounds, slowest rank, us per call")
        print("| bytes | (y - x) mod 4096 | np.copyto(y, x) | MPI_Allreduce(x, y) |")
        print("|---:|---:|---:|---:|")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        n = max(1, nbytes // 4)
        for delta in (int(d) for d in args.deltas.split(",")):
            x, y = pair(n, delta)
            calls = 2000 if nbytes <= 65536 else 500
            copy = timed(comm, lambda x=x, y=y: np.copyto(y, x), calls)
            reduce = timed(comm, lambda x=x, y=y: comm.Allreduce(x, y), calls)
            if comm.Get_rank() == 0:
                print(f"| {4 * n} | {delta} | {copy:.2f} | {reduce:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
