"""What the interleaved A/B timings of one allreduce share (bench/*_ab.py).

Arguments ``--mib --iters --rel --data --json``, and each rank's data: one MiniLM gradient
step of ``datasets/minilm.h5`` (rank ``i``: step ``i mod 4``) cut or tiled to ``--mib`` MiB
of float32, with the exact average of all ranks' arrays in float64.
"""

from __future__ import annotations

import argparse
import time
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


class Runs:
    """What :func:`interleave` measured, per variant."""

    def __init__(self, variants: tuple[str, ...]) -> None:
        self.times: dict[str, list[float]] = {v: [] for v in variants}
        self.sent: dict[str, int] = {}
        self.err: dict[str, float] = {}
        self.compressed: dict[str, int] = {v: 0 for v in variants}
        self.reports: dict[str, list] = {v: [] for v in variants}  # the timed calls' reports


def interleave(comm, ccs: dict, x: np.ndarray, exact: np.ndarray, variants: tuple[str, ...],
               iters: int, rel: float) -> Runs:
    """Time ``allreduce(x, REL(rel), op="avg")`` on each Communicator of ``ccs`` and
    ``MPI_Allreduce`` (the variant not in ``ccs``), rotating the order call by call after
    one untimed call of each: the slowest rank's seconds, every rank's bytes in the last
    call, the largest error over the bound on any rank, and the timed calls that compressed.
    """
    import ccoll

    n = comm.Get_size()
    runs = Runs(variants)
    y_mpi = np.empty_like(x)
    k = len(variants)
    for it in range(iters + 1):
        for v in variants[it % k:] + variants[:it % k]:
            comm.Barrier()
            t0 = time.perf_counter()
            if v not in ccs:
                comm.Allreduce(x, y_mpi, op=MPI.SUM)
                y_mpi /= n
            else:
                y = ccs[v].allreduce(x, ccoll.REL(rel), op="avg")
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if it:
                runs.times[v].append(dt)
            if v in ccs:
                rep = ccs[v].last_call
                assert rep is not None
                runs.sent[v] = comm.allreduce(rep.bytes_sent, op=MPI.SUM)
                eb_abs = rep.eb_abs or float(np.max(np.abs(exact))) * 2.0**-24  # raw: MPI's
                runs.err[v] = comm.allreduce(float(np.max(np.abs(y - exact))) / eb_abs,
                                             op=MPI.MAX)
                if it:
                    runs.compressed[v] += int(rep.compressed)
                    runs.reports[v].append(rep)
    raw = 2 * (n - 1) * x.nbytes
    for v in variants:
        if v not in ccs:
            runs.sent[v], runs.err[v] = raw, 0.0
    return runs
