"""What the average's one rounding costs: a compressed ``op="avg"`` allreduce, two ways.

Host float32 data at a rank count that is not a power of two: each decode takes the sum's
float64 values, divides them by ``N`` and rounds once to float32 (docs/error-bound.md,
"avg"), where the way before decoded to float32 and divided afterwards (two roundings).
Both ways run in the same job, round by round (each first in every other round), on the
same data (``--size`` bytes of each rank's MiniLM gradients, rotated by rank),
``policy="compress"``; the old way is the same
code with the decode's divisor set to 1 (``calls._decode_divisor``). Median and best of
the rounds' mean call time, slowest rank. Rank 0 measures the session's speed index first.

    mpiexec -n 3 python -m mpi4py bench/avg_rounding.py
    mpiexec -n 3 python -m mpi4py bench/avg_rounding.py --size 16M --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    import ccoll
    from ccoll import speedindex
    from ccoll.bench import load_gradients
    from ccoll.collectives import calls
    from ccoll.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("4M"),
                    help="bytes of float32 per rank (default 4M)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per way (default 8)")
    ap.add_argument("--calls", type=int, default=10, help="calls per round (default 10)")
    ap.add_argument("--eb", default="rel:1e-3", help="bound (default rel:1e-3)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    g = load_gradients(os.path.join(root, "datasets", "minilm.h5"), 0)
    n = max(1, args.size // 4)
    x = np.resize(np.roll(g, comm.rank * 1000), n).astype(np.float32)
    index = speedindex.speed_index_on_rank0(comm)
    one = calls._decode_divisor
    ways = {"one rounding (now)": one, "two roundings (before)": lambda p, k: 1}
    times: dict[str, list[float]] = {w: [] for w in ways}
    with ccoll.Communicator(comm, policy="compress") as c:
        eb = ccoll.errorbound.as_bound(args.eb)
        for k in range(args.rounds):
            order = list(ways.items())
            for name, fn in order if k % 2 == 0 else order[::-1]:  # each way first in turn
                calls._decode_divisor = fn
                c.allreduce(x, eb, op="avg")  # its plan, warm
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    c.allreduce(x, eb, op="avg")
                dt = comm.allreduce((time.perf_counter() - t0) / args.calls, op=MPI.MAX)
                times[name].append(dt * 1e3)
    calls._decode_divisor = one
    if comm.rank == 0:
        load = os.getloadavg()
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {comm.size} ranks, "
              f"{n * 4} bytes float32 per rank, eb {args.eb}, load average {load[0]:.1f}")
        if index is not None:
            print(f"# {speedindex.describe(index)}")
        print("| way | median ms | best ms |")
        print("|---|---:|---:|")
        for name, v in times.items():
            print(f"| {name} | {statistics.median(v):.2f} | {min(v):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
