"""How an exact allreduce is waited for, against MPI's blocking call: ways side by side.

Each round times ``--calls`` calls of each way on the same buffers, rounds interleaved;
the median round per call counts, on the slowest rank (speed against ``MPI_Allreduce``
in brackets). The ways:

- ``blocking``: ``MPI_Allreduce``;
- ``wait``: ``MPI_Iallreduce`` and ``MPI_Wait``;
- ``test-spin``: ``MPI_Iallreduce`` tested in a loop that never yields the core;
- ``spin-sleep``: ccoll's wait for a small message under a deadline (a 2 ms spin that
  yields, then sleeps of a growing share of the time waited);
- ``spin``: ccoll's wait for data in the caller's thread (the yielding spin to the end);
- ``flag-beside``: a one-integer ``MPI_Iallreduce`` beside the data's ``MPI_Allreduce``.

With more ranks than cores (4 ranks on 2), run it as

    mpiexec -n 4 python -m mpi4py bench/wait_variants.py --sizes 64K,1M,4M,16M

docs/dev/repeated-calls.md has its output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from repeat_cost import parse_size  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64K,1M,4M,16M", help="bytes per rank (K, M)")
    ap.add_argument("--calls", type=int, default=30, help="calls per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per way (median counts)")
    args = ap.parse_args(argv)

    from mpi4py import MPI

    from ccoll.collectives import waiting
    from ccoll.collectives.node import node_threads
    from ccoll.speedindex import describe, speed_index_on_rank0

    comm = MPI.COMM_WORLD
    node_threads(comm, waiting.Deadline(60.0, "cores"))  # what a Communicator sets up
    index = speed_index_on_rank0(comm)
    if comm.rank == 0:
        print(f"# {describe(index) if index else 'speed index: unavailable'}")
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {comm.size} ranks; "
              f"median of {args.rounds} rounds x {args.calls} calls, slowest rank; us per call")

    def deadline() -> waiting.Deadline:
        return waiting.Deadline(600.0, "bench")

    def blocking(x: np.ndarray, y: np.ndarray) -> None:
        comm.Allreduce(x, y, op=MPI.SUM)

    def wait(x: np.ndarray, y: np.ndarray) -> None:
        comm.Iallreduce(x, y, op=MPI.SUM).Wait()

    def test_spin(x: np.ndarray, y: np.ndarray) -> None:
        req = comm.Iallreduce(x, y, op=MPI.SUM)
        while not req.Test():
            pass

    def spin_sleep(x: np.ndarray, y: np.ndarray) -> None:
        waiting.wait_all([comm.Iallreduce(x, y, op=MPI.SUM)], deadline(), "bench")

    def spin(x: np.ndarray, y: np.ndarray) -> None:
        waiting.wait_all([comm.Iallreduce(x, y, op=MPI.SUM)], deadline(), "bench",
                         bulk=True)

    def flag_beside(x: np.ndarray, y: np.ndarray) -> None:
        flag = np.zeros(1, np.int32)
        req = comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.SUM)
        comm.Allreduce(x, y, op=MPI.SUM)
        req.Wait()

    ways: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
        "blocking": blocking, "wait": wait, "test-spin": test_spin,
        "spin-sleep": spin_sleep, "spin": spin, "flag-beside": flag_beside}
    if comm.rank == 0:
        print("| size | " + " | ".join(ways) + " |")
        print("|---:|" + "---:|" * len(ways))
    for text in args.sizes.split(","):
        nbytes = parse_size(text)
        x = np.random.default_rng(comm.rank).standard_normal(max(1, nbytes // 4))
        x = x.astype(np.float32)
        y = np.empty_like(x)
        times: dict[str, list[float]] = {k: [] for k in ways}
        for f in ways.values():
            for _ in range(3):
                f(x, y)
        for _ in range(args.rounds):
            for name, f in ways.items():
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    f(x, y)
                t = (time.perf_counter() - t0) / args.calls
                times[name].append(comm.allreduce(t, op=MPI.MAX))
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        if comm.rank == 0:
            base = med["blocking"]
            print(f"| {nbytes} | " + " | ".join(f"{v:.0f} ({base / v:.2f}x)"
                                                for v in med.values()) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
