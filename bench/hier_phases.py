"""Where the time of a two-level allreduce goes: its phases, A/B in one run (MPI ranks).

Run under the emulated cluster (root), e.g.::

    sudo .venv/bin/python jobs/emulated_cluster.py --nodes 2 --ranks-per-node 2 --rate 1gbit \\
        -- .venv/bin/python -m mpi4py bench/hier_phases.py --iters 3

Interleaved iteration by iteration: ``MPI_Allreduce``, ccoll's flat compressed ring
(``ranks_per_node=1``), the two-level allreduce with its node phases through MPI
(``CCOLL_NODE_SHM=0``: float64 ``Reduce_scatter`` and ``Allgatherv``) and through the
node's shared memory (the default). For the two-level calls the trace spans ``node
reduce`` and ``node share`` time the node phases; the rest of the call (the ring between
the nodes, the agreement) is ``other``. Every time is the slowest rank's; the table holds
the median over the iterations. MiniLM gradients (datasets/minilm.h5) tiled to ``--mib``
MiB per rank, REL 1e-3, ``policy="compress"``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import ccoll
from ccoll.bench import _DEFAULT_DATA, load_gradients
from ccoll.collectives import trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rpn", type=int, default=None,
                    help="ranks per node (default: MPI's shared-memory domains)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    x = np.resize(load_gradients(_DEFAULT_DATA, comm.rank), args.mib << 18).astype(np.float32)
    eb = ccoll.REL(1e-3)
    flat = ccoll.Communicator(comm, policy="compress", ranks_per_node=1)
    two_mpi = ccoll.Communicator(comm, policy="compress", ranks_per_node=args.rpn)
    two_shm = ccoll.Communicator(comm, policy="compress", ranks_per_node=args.rpn)
    y = np.empty_like(x)
    times: dict[str, list[dict[str, float]]] = {}

    def slowest(v: float) -> float:
        return float(comm.allreduce(v, op=MPI.MAX))

    def one(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        comm.Barrier()
        with trace.tracing() as rec:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        ph = {"total": t}
        for ev in rec.events:
            if ev[0] in ("node reduce", "node share"):
                ph[ev[0]] = ph.get(ev[0], 0.0) + ev[3] - ev[2]
        ph = {k: slowest(v) for k, v in ph.items()}
        times.setdefault(name, []).append(ph)

    def hier_mpi() -> None:
        os.environ["CCOLL_NODE_SHM"] = "0"  # read when the node's memory is first set up
        try:
            two_mpi.allreduce(x, eb, out=y)
        finally:
            del os.environ["CCOLL_NODE_SHM"]

    runs = [("MPI_Allreduce", lambda: comm.Allreduce(x, y, op=MPI.SUM)),
            ("flat ring", lambda: flat.allreduce(x, eb, out=y)),
            ("two-level, node phases by MPI", hier_mpi),
            ("two-level, node shared memory", lambda: two_shm.allreduce(x, eb, out=y))]
    for _name, fn in runs:  # warm-up: compilation, calibration, node memory
        fn()
    g = two_shm.grouping
    for _ in range(args.iters):
        for name, fn in runs:
            one(name, fn)
    if comm.rank == 0:
        load = os.getloadavg()[0]
        print(f"ccoll from {os.path.dirname(ccoll.__file__)}")
        print(f"{comm.size} ranks, {g.nodes} nodes x {g.ranks_per_node}, {args.mib} MiB per "
              f"rank, {args.iters} iterations, load {load:.1f}; ms, median of the slowest rank")
        print(f"{'':32s} {'total':>8s} {'node reduce':>12s} {'node share':>11s} {'other':>8s}")
        for name, rows in times.items():
            med = {k: statistics.median(r.get(k, 0.0) for r in rows) * 1e3 for k in rows[0]}
            red, sh = med.get("node reduce", 0.0), med.get("node share", 0.0)
            other = med["total"] - red - sh
            print(f"{name:32s} {med['total']:8.1f} {red:12.1f} {sh:11.1f} {other:8.1f}")
    for c in (flat, two_mpi, two_shm):
        c.close()


if __name__ == "__main__":
    main()
