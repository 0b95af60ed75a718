"""Format 2's sampled speed factors as each rank measures them, call after call.

The first ``policy="auto"`` call of a signature times both formats' kernels on a sample
of the data (``ccoll.collectives.policy.fits.sampled_format2``); the plan takes the
minimum over ranks of each factor (format 1's seconds over format 2's). This script runs
that sampling alone, ``--calls`` times, on every rank at once (as ranks that share cores
do), on the MiniLM dump tiled to 64 MiB per rank, at a REL bound's per-rank share
(``REL * range / (2 * ranks)``), and prints each rank's gain and factors and their minima::

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py bench/format2_factors.py --rel 1e-3
"""

from __future__ import annotations

import argparse
import os
import sys

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import abkit  # noqa: E402

from ccoll.collectives.codec import api  # noqa: E402
from ccoll.collectives.policy.fits import sampled_format2  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rel", type=float, default=1e-3)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--data", default="datasets/minilm.h5")
    ap.add_argument("--mib", type=float, default=64)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    x, _ = abkit.gradients(args)
    eb = args.rel * float(x.max() - x.min()) / (2 * comm.size)
    mod = api()
    ops = (mod.compress_abs, mod.add, mod.decompress, mod.add_data)
    for call in range(args.calls):
        comm.Barrier()
        f = sampled_format2(x, eb, 4096, ops)
        rows = comm.gather((f.gain, *f.speed))
        if comm.rank == 0:
            fmt = " ".join("(" + ", ".join(f"{v:.2f}" for v in r) + ")" for r in rows)
            mins = ", ".join(f"{min(r[i] for r in rows):.2f}" for i in range(4))
            print(f"call {call}: gain, compress, add, decompress per rank {fmt}; min {mins}",
                  flush=True)


if __name__ == "__main__":
    main()
