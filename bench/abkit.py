"""What the interleaved A/B timings of one allreduce share (bench/schedule_ab.py, split_ab.py).

Arguments ``--mib --iters --rel --data --json``, and each rank's data: one MiniLM gradient
step of ``datasets/minilm.h5`` (rank ``i``: step ``i mod 4``) cut or tiled to ``--mib`` MiB
of float32, with the exact average of all ranks' arrays in float64.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ccoll.bench import load_gradients

DATA = Path(__file__).resolve().parent.parent / "datasets" / "minilm.h5"


def parser(description: str, what: str) -> argparse.ArgumentParser:
    """The shared arguments; ``what`` names one timed variant (``--iters`` per it)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--mib", type=float, default=64.0, help="MiB of float32 per rank")
    ap.add_argument("--iters", type=int, default=7, help=f"timed calls per {what}")
    ap.add_argument("--rel", type=float, default=1e-3)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--json", help="write the rows here (rank 0)")
    return ap


def gradients(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """This rank's float32 array and the exact float64 average over ``COMM_WORLD``."""
    comm = MPI.COMM_WORLD
    g = load_gradients(args.data, comm.Get_rank())
    count = int(args.mib * (1 << 20)) // 4
    x = np.resize(g, count).astype(np.float32)
    exact = np.empty(count, np.float64)
    comm.Allreduce(x.astype(np.float64), exact, op=MPI.SUM)
    exact /= comm.Get_size()
    return x, exact
