"""Progress engine under MPI: many queued collectives complete in order with exact results.

Run: mpiexec -n K python -m mpi4py -m pytest tests/mpi/test_progress_stress.py
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from mpi4py import MPI

from ccoll.errors import CollectiveError
from ccoll.runtime import progress

# Mixed sizes around common boundaries, from one element to 2**17 (1 MiB in float64).
SIZES = [1, 2, 31, 32, 33, 1000, 1023, 4096, 65537, 131072]
DTYPES = [np.float64, np.float32, np.int32, np.int64]


def _plan(n: int) -> list[tuple[int, type]]:
    rng = np.random.default_rng(1234)  # same plan on every rank
    sizes = rng.choice(SIZES, size=n, p=[0.15, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.05])
    kinds = rng.integers(0, len(DTYPES), size=n)
    return [(int(s), DTYPES[int(d)]) for s, d in zip(sizes, kinds, strict=True)]


def _expected(i: int, n: int, dtype: type, size: int) -> np.ndarray:
    # sum over ranks r of (r + 1) * (i + j % 97): small integers, exact in every dtype
    ramp = (np.arange(n) % 97 + i % 1000).astype(np.int64)
    return (ramp * (size * (size + 1) // 2)).astype(dtype)


def test_thousand_queued_allreduces_complete_in_order(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    ran: list[int] = []

    def task(i: int, n: int, dtype: type) -> tuple[int, np.ndarray]:
        ran.append(i)
        x = ((np.arange(n) % 97 + i % 1000) * (rank + 1)).astype(dtype)
        y = np.empty_like(x)
        comm.Allreduce(x, y, op=MPI.SUM)
        return i, y

    plan = _plan(1000)
    reqs = [progress.submit(task, i, n, dt, comm=comm) for i, (n, dt) in enumerate(plan)]
    for i, (req, (n, dt)) in enumerate(zip(reqs, plan, strict=True)):
        j, y = req.wait(timeout=120)
        assert j == i
        assert y.dtype == dt and y.shape == (n,)
        np.testing.assert_array_equal(y, _expected(i, n, dt, size))
    assert ran == list(range(1000))
    assert comm.allgather(len(ran)) == [1000] * size


def test_engine_and_user_thread_use_mpi_at_once(comm):
    """Needs MPI_THREAD_MULTIPLE: the engine runs collectives on one communicator while the
    user's thread runs its own on another."""
    other = comm.Dup()
    try:
        size = comm.Get_size()
        # mpi4py's first pickled collective on a communicator duplicates it (collectively)
        # while holding the GIL; made from two threads at once on different communicators
        # that deadlocks (one rank's engine thread waits in the duplicate of `comm` holding
        # the GIL its main thread needs to join the duplicate of `other`). Make both here.
        comm.allreduce(0)
        other.allreduce(0)
        reqs = [progress.submit(comm.allreduce, i, comm=comm) for i in range(200)]
        mine = [other.allreduce(i * 10) for i in range(200)]
        assert [r.wait(timeout=120) for r in reqs] == [i * size for i in range(200)]
        assert mine == [i * 10 * size for i in range(200)]
    finally:
        other.Free()


def test_error_in_one_request_reaches_its_waiter_on_every_rank(comm):
    def bad_count():
        x = np.ones(4)
        y = np.empty(4)
        comm.Allreduce(x, y)
        raise CollectiveError("task failed after its allreduce")

    r1 = progress.submit(bad_count, comm=comm)
    r2 = progress.submit(comm.allreduce, 1, comm=comm)
    with pytest.raises(CollectiveError, match="task failed after its allreduce"):
        r1.wait(timeout=60)
    assert r2.wait(timeout=60) == comm.Get_size()


def test_done_callbacks_run_on_the_engine_thread(comm):
    names: list[str] = []
    reqs = [progress.submit(comm.allreduce, 1, comm=comm) for _ in range(10)]
    for r in reqs:
        r.add_done_callback(lambda _r: names.append(threading.current_thread().name))
    for r in reqs:
        r.wait(timeout=60)
    progress.submit(lambda: None).wait(timeout=60)
    assert set(names) <= {"ccoll-progress", threading.current_thread().name}
    assert len(names) == 10
