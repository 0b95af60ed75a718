"""Threads per rank: the count a Communicator chooses reaches the threads that run kernels.

Run with 2-4 ranks on one machine (any count works; at one rank the share is the pool).
"""

from __future__ import annotations

import os
from fractions import Fraction

import numba
import numpy as np
import pytest
from mpi4py import MPI

import ccoll
from ccoll.errors import InputError


def _expected(comm: MPI.Intracomm) -> int:
    """This rank's share, worked out here without ccoll's own exchange."""
    mine = sorted(os.sched_getaffinity(0))
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        cpus = node.allgather(mine)
    finally:
        node.Free()
    pool = numba.config.NUMBA_NUM_THREADS
    if os.environ.get("NUMBA_NUM_THREADS", "").strip():
        return pool
    share = sum(Fraction(1, sum(c in other for other in cpus)) for c in mine)
    return max(1, min(pool, int(share)))


def _run_calls(c: ccoll.Communicator) -> None:
    x = np.random.default_rng(c.rank).standard_normal(1 << 18).astype(np.float32)
    c.allreduce(x, policy="compress")
    c.iallreduce(x, policy="compress").wait(timeout=60)
    # One chunk per block: the blocking call runs its tasks on the calling thread (nothing
    # to overlap), so the caller's own launches are certain, not left to timing.
    c.allreduce(x[: c.size * (1 << 12)], policy="compress")


def test_the_share_reaches_every_kernel_thread(comm, launches):
    want = _expected(comm)
    with ccoll.Communicator(comm, chunk_elems=1 << 14) as c:
        assert c.threads == want
        assert f"threads={want} " in repr(c)
        _run_calls(c)
    names = {name for name, _ in launches}
    counts = {n for _, n in launches}
    assert counts == {want}, launches
    # The blocking call's thread (its one-chunk call runs inline) and the scheduler's lanes
    # beside it. The progress engine's thread launches only the decodes it takes while the
    # lanes are busy (timing), so it is not required here; whichever threads launched, all
    # used the share.
    assert "MainThread" in names and "ccoll-lane-compress" in names, names
    assert len(names) >= 2, names
    # The caller's own count is what it was: ccoll set it for its launches only.
    assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS


def test_ccoll_threads_sets_the_count(comm, launches, monkeypatch):
    monkeypatch.setenv("CCOLL_THREADS", "1")
    with ccoll.Communicator(comm, chunk_elems=1 << 14) as c:
        assert c.threads == 1
        _run_calls(c)
    assert {n for _, n in launches} == {1}, launches


def test_a_bad_ccoll_threads_on_one_rank_fails_creation_on_every_rank(comm, launches,
                                                                      monkeypatch):
    if comm.Get_rank() == 0:
        monkeypatch.setenv("CCOLL_THREADS", "lots")
    with pytest.raises(InputError, match="CCOLL_THREADS='lots' is not a thread count"):
        ccoll.Communicator(comm)
    comm.Barrier()  # every rank got here: nobody hangs in the creation
