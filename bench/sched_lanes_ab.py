"""Do the scheduler's CPU lanes cost the compressed collectives time? A/B in one run.

Times ``Communicator.allreduce(x, policy="compress")`` with the process scheduler's lanes
(the default) and with the private thread per channel (``CCOLL_SCHED=off``), alternating
call by call on one Communicator (the switch is read at each task), so that both see the
same machine load. An iteration's time is the slowest rank's, between two barriers.
Prints, per size and algorithm, the median of each and their ratio (lanes / private).

Run: mpiexec -n 2 python -m mpi4py bench/sched_lanes_ab.py [--sizes 1M,64M] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ccoll  # noqa: E402
from ccoll.collectives import trace  # noqa: E402
from ccoll.gpu_sched import configure  # noqa: E402
from ccoll.gpu_sched.scheduler import yield_to_training  # noqa: E402
from ccoll.units import parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,64M", help="bytes per rank, comma-separated")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--algorithms", default="homomorphic,dar")
    ap.add_argument("--priorities", metavar="LANE=RANK,...",
                    help="configure() the CPU lanes' priority ranks (nice = 5 * rank)")
    ap.add_argument("--training", action="store_true",
                    help="as if a DDP hook were registered: the lanes' default nice values")
    ap.add_argument("--trace", metavar="PREFIX",
                    help="after the timed calls, trace one call per mode to PREFIX-MODE.json")
    a = ap.parse_args()
    if a.priorities:
        ranks = {k: int(v) for k, v in (p.split("=") for p in a.priorities.split(","))}
        configure("cpu", priorities=ranks)
    if a.training:
        yield_to_training()
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    with ccoll.Communicator(comm, policy="compress") as c:
        for size in a.sizes.split(","):
            n = parse_size(size) // 4
            x = (rng.standard_t(3, size=n) * 1e-2).astype(np.float32)
            for alg in a.algorithms.split(","):
                times: dict[str, list[float]] = {"lanes": [], "private": []}
                for it in range(a.warmup + a.iters):
                    order = ("lanes", "private") if it % 2 else ("private", "lanes")
                    for mode in order:
                        os.environ["CCOLL_SCHED"] = "on" if mode == "lanes" else "off"
                        comm.Barrier()
                        t0 = time.perf_counter()
                        c.allreduce(x, eb=ccoll.REL(1e-3), algorithm=alg)
                        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                        if it >= a.warmup:
                            times[mode].append(dt)
                if a.trace:
                    for mode in ("lanes", "private"):
                        os.environ["CCOLL_SCHED"] = "on" if mode == "lanes" else "off"
                        with trace.tracing(trace.start(comm)) as rec:
                            c.allreduce(x, eb=ccoll.REL(1e-3), algorithm=alg)
                        got = trace.gather(comm, rec)
                        if got is not None:
                            path = f"{a.trace}-{comm.size}r-{size}-{alg}-{mode}.json"
                            with open(path, "w") as f:
                                json.dump(trace.chrome([(f"{alg} {mode}", got)]), f)
                if comm.rank == 0:
                    on = statistics.median(times["lanes"])
                    off = statistics.median(times["private"])
                    print(f"{comm.size} ranks {size:>5} {alg:12s} lanes {on * 1e3:9.2f} ms  "
                          f"private {off * 1e3:9.2f} ms  lanes/private {on / off:5.3f}",
                          flush=True)
    os.environ.pop("CCOLL_SCHED", None)


if __name__ == "__main__":
    main()
