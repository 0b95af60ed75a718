"""What an exact allreduce on a background thread costs the compute beside it: MPI vs gloo.

DDP's hooks average buckets on a thread while the backward pass computes. This runs, on
every rank, a loop of 512x512 float32 matrix products (one torch thread) on the main
thread while another thread makes 5 allreduces of 25 MiB of float32, and reports the
allreduce's median time (slowest rank) and the products per second per rank, for:

- ``mpi``: blocking ``MPI_Allreduce`` (ccoll's exact path without a timeout);
- ``poll``: ``MPI_Iallreduce`` completed by ``MPI_Testall`` with short sleeps;
- ``gloo``: ``torch.distributed.all_reduce`` on a gloo process group (DDP's own);

each alone and beside the loop, twice in turn, then the loop alone. Run on the emulated
cluster::

    .venv/bin/python jobs/emulated_cluster.py --ranks 4 --rate 10gbit -- \\
        .venv/bin/python -m mpi4py bench/allreduce_beside_compute.py
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.torch.process_group import init_process_group_from_mpi

N = 25 * 2**20 // 4
REPS = 5


def main() -> None:
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    init_process_group_from_mpi("gloo")
    x = np.ones(N, np.float32)
    t = torch.ones(N)

    def mpi() -> None:
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)

    def poll() -> None:
        req = comm.Iallreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        wait_all([req], Deadline(None, "allreduce"), "MPI_Iallreduce", poll=True)

    def gloo() -> None:
        dist.all_reduce(t)

    ways: list[tuple[str, Callable[[], None]]] = [("mpi", mpi), ("poll", poll), ("gloo", gloo)]
    for name, fn in ways * 2:
        for beside in (False, True):
            times: list[float] = []

            def loop(fn: Callable[[], None] = fn, times: list[float] = times) -> None:
                for _ in range(REPS):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)

            comm.Barrier()
            a = torch.randn(512, 512)
            th = threading.Thread(target=loop)
            t0 = time.perf_counter()
            th.start()
            k = 0
            while beside and th.is_alive():
                a @ a
                k += 1
            th.join()
            rate = k / (time.perf_counter() - t0)
            rows = comm.gather((float(np.median(times)), rate), 0)
            if rows is not None:
                print(f"{name:5s} {'beside compute' if beside else 'alone':15s} allreduce "
                      f"median {max(r[0] for r in rows) * 1e3:6.0f} ms   products/s per rank "
                      f"{np.mean([r[1] for r in rows]):6.1f}", flush=True)
    comm.Barrier()
    a = torch.randn(512, 512)
    t0 = time.perf_counter()
    k = 0
    while time.perf_counter() - t0 < 2.0:
        a @ a
        k += 1
    rates = comm.gather(k / (time.perf_counter() - t0), 0)
    if rates is not None:
        print(f"compute alone: products/s per rank {np.mean(rates):6.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
