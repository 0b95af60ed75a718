"""What error feedback costs the DDP hook per bucket: wall and system time, with and without.

Run under MPI (4 ranks on one machine stand for docs/training.md's MiniLM runs)::

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py bench/ef_cost.py
    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py bench/ef_cost.py --elems 7000000 --profile

Every rank loads the MiniLM gradients of ``datasets/minilm.h5`` (rank ``i``: step ``i mod
4``), cut or tiled to ``--elems`` float32 values (15.5 M: MiniLM's 62 MB bucket under DDP's
default 25 MB cap), and reduces it ``--iters`` times through the hook's own path
(``ccoll.torch.hook._reduce``, what the engine thread runs for a host float32 bucket) on
two hook states, ``REL(--rel)``, ``policy="compress"``, with and without error feedback,
alternating call by call; each call gets the bucket scaled by a new factor, as a new step
would. Rank 0 prints each call's wall time (slowest rank) and its own system time, the
medians from the third call on, and with ``--profile`` a cProfile of its last
error-feedback call; then the speed index of the run (:mod:`ccoll.speedindex`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import resource
import statistics
import time

import numpy as np
from mpi4py import MPI

import ccoll
import ccoll.torch as ct
from ccoll.bench import load_gradients
from ccoll.speedindex import describe, speed_index_on_rank0
from ccoll.torch import hook


def _bucket(rank: int, n: int) -> np.ndarray:
    return np.resize(load_gradients("datasets/minilm.h5", rank), n).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elems", type=int, default=15_500_000)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--rel", type=float, default=1e-3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    x0 = _bucket(comm.rank, args.elems)
    states = {name: ct.CCollHookState(eb=ccoll.REL(args.rel), error_feedback=ef,
                                      policy="compress")
              for name, ef in (("error feedback", True), ("without", False))}
    wall: dict[str, list[float]] = {k: [] for k in states}
    sys_s: dict[str, list[float]] = {k: [] for k in states}
    prof = cProfile.Profile()
    for i in range(args.iters):
        for name, st in states.items():
            x = x0 * np.float32(1.0 + 0.01 * i)
            comm.Barrier()
            ru = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            profile = args.profile and comm.rank == 0 and i == args.iters - 1 and st.error_feedback
            t = time.perf_counter()
            if profile:
                prof.enable()
            hook._reduce(st, x, 0, True)
            if profile:
                prof.disable()
            dt = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
            wall[name].append(dt)
            sys_s[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_stime - ru)
    for st in states.values():
        st.close()
    index = speed_index_on_rank0(comm)
    if comm.rank != 0:
        return
    print(f"{comm.size} ranks, {args.elems} float32 ({args.elems * 4 / 1e6:.1f} MB) per "
          f"rank, REL {args.rel:g}, policy compress, ccoll {ccoll.__version__}")
    for name in states:
        w = [f"{v * 1e3:.0f}" for v in wall[name]]
        s = [f"{v * 1e3:.0f}" for v in sys_s[name]]
        print(f"{name:15s} wall ms {' '.join(w)}  (median from call 3: "
              f"{statistics.median(wall[name][2:]) * 1e3:.0f})")
        print(f"{'':15s} sys ms  {' '.join(s)}  (median from call 3: "
              f"{statistics.median(sys_s[name][2:]) * 1e3:.0f})")
    if args.profile:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
        print(out.getvalue())
    print(describe(index))


if __name__ == "__main__":
    main()
