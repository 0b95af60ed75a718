"""How late a small collective ends beside compute: a blocking MPI wait against ccoll's.

A training step's first bucket reaches each rank at another moment (the ranks' backward
passes do not end together), and ccoll's agreement on it is a small ``MPI_Iallreduce``
(a few hundred bytes) waited for on the progress engine's thread while the backward pass
computes beside it. This times that pattern: every rank runs a loop of 256x256 float32
matrix products (one torch thread) on a thread of its own; the main thread, in rounds,
waits a different time on each rank (0, 30, 60, 90 ms, rotating), then starts a 320-byte
``MPI_Iallreduce`` and waits for it, as:

- ``waitsome``: a blocking ``MPI_Waitsome`` (MPICH spins in it: what the engine did);
- ``ccoll``: :func:`ccoll.collectives.waiting.wait_all` with a deadline (a spin of 2 ms
  that yields the core, then tests with sleeps): what the engine's small waits do;
- ``sleep``: tests with fixed 0.2 ms sleeps.

Per way it prints the time from the last rank's arrival to the end of its call (the wait
the last rank sees: what the small collective adds to a step) over the rounds, and the
products per second of all ranks together. Run on the emulated cluster::

    .venv/bin/python jobs/emulated_cluster.py --ranks 4 --rate 100mbit -- \\
        .venv/bin/python -m mpi4py bench/small_wait_beside_compute.py
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

from ccoll.collectives.waiting import Deadline, wait_all

ROUNDS = 12


def main() -> None:
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    vec, res = np.zeros(40), np.empty(40)
    done = [0]
    stop = threading.Event()

    def burn() -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():
            a @ a
            done[0] += 1

    def waitsome(req: MPI.Request) -> None:
        MPI.Request.Waitsome([req])

    def ccoll(req: MPI.Request) -> None:
        wait_all([req], Deadline(3600.0, "bench"), "small allreduce")

    def sleep(req: MPI.Request) -> None:
        while not req.Test():
            time.sleep(2e-4)

    ways: list[tuple[str, Callable[[MPI.Request], None]]] = [
        ("waitsome", waitsome), ("ccoll", ccoll), ("sleep", sleep)]
    th = threading.Thread(target=burn, daemon=True)
    th.start()
    for name, wait in ways * 2:
        last: list[float] = []
        k0, t_start = done[0], time.perf_counter()
        for i in range(ROUNDS):
            comm.Barrier()
            time.sleep(0.03 * ((rank + i) % size))
            t0 = time.perf_counter()
            wait(comm.Iallreduce(vec, res, op=MPI.MIN))
            waits = comm.allgather(time.perf_counter() - t0)
            last.append(min(waits))  # the last rank to arrive waited least
        rate = comm.allreduce((done[0] - k0) / (time.perf_counter() - t_start))
        if rank == 0:
            q = np.percentile(np.asarray(last) * 1e3, [10, 50, 90])
            print(f"{name:9s} after the last arrival: p10 {q[0]:5.1f}  median {q[1]:5.1f}  "
                  f"p90 {q[2]:5.1f} ms   products/s, all ranks: {rate:7.0f}", flush=True)
    stop.set()
    th.join()


if __name__ == "__main__":
    main()
