"""Ring against recursive halving and doubling: one compressed allreduce, interleaved A/B.

Run under MPI (any rank count; on the emulated cluster too)::

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py bench/schedule_ab.py --iters 7

Every rank loads one MiniLM gradient step of ``datasets/minilm.h5`` (rank ``i``: step
``i mod 4``), cut or tiled to ``--mib`` MiB of float32, and times ``allreduce(x,
REL(--rel), op="avg")`` on two Communicators (``policy="compress"``, ``schedule="ring"``
and ``"halving"``), alternating call by call after one untimed call of each. Rank 0 prints,
per schedule, the median and best of the slowest rank's seconds, the bytes all ranks sent
(and the wire ratio: a raw ring's bytes over them), the error over the bound, and whether
both schedules gave the same output bytes; ``--json`` writes the same.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import abkit  # bench/ is on sys.path when a script here runs
import numpy as np
from mpi4py import MPI

import ccoll

SCHEDULES = ("ring", "halving")


def main() -> None:
    ap = abkit.parser(__doc__.split("\n")[0], "schedule")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    x, exact = abkit.gradients(args)
    ccs = {s: ccoll.Communicator(comm, policy="compress", schedule=s) for s in SCHEDULES}
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    out: dict[str, np.ndarray] = {}
    sent: dict[str, int] = {}
    err: dict[str, float] = {}
    for it in range(args.iters + 1):
        for s in SCHEDULES if it % 2 == 0 else SCHEDULES[::-1]:
            comm.Barrier()
            t0 = time.perf_counter()
            y = ccs[s].allreduce(x, ccoll.REL(args.rel), op="avg")
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if it:
                times[s].append(dt)
            rep = ccs[s].last_call
            assert rep is not None and rep.compressed
            sent[s] = comm.allreduce(rep.bytes_sent, op=MPI.SUM)
            err[s] = float(np.max(np.abs(y - exact))) / rep.eb_abs
            out[s] = y
    same = comm.allreduce(int(out["ring"].tobytes() != out["halving"].tobytes()), op=MPI.SUM)
    for c in ccs.values():
        c.close()
    if r:
        return
    raw = 2 * (n - 1) * x.nbytes
    rows = []
    print(f"# {n} ranks, {args.mib:g} MiB float32 per rank, REL {args.rel:g}, avg; "
          f"{args.iters} calls each, alternating; slowest rank's seconds")
    print("schedule  median_ms  best_ms  bytes_all_ranks  wire_ratio  err/eb")
    for s in SCHEDULES:
        row = {"schedule": s, "ranks": n, "mib": args.mib, "median_s": statistics.median(times[s]),
               "best_s": min(times[s]), "bytes": sent[s], "wire_ratio": raw / sent[s],
               "err_over_eb": err[s], "times_s": times[s]}
        rows.append(row)
        print(f"{s:8s}  {row['median_s'] * 1e3:9.1f}  {row['best_s'] * 1e3:7.1f}  "
              f"{sent[s]:15d}  {row['wire_ratio']:10.2f}  {err[s]:6.3f}")
    print(f"same output bytes on both schedules: {same == 0}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "same_output": same == 0},
                                              indent=1))


if __name__ == "__main__":
    main()
