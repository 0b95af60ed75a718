"""Threads per rank: the cores of each rank's node, and this rank's share of them.

Called once when a :class:`~ccoll.Communicator` is created (collective over its
communicator): the ranks that share this rank's node (``MPI_Comm_split_type``, shared
memory) exchange the cores they may run on, and
:func:`ccoll.runtime.cpu_threads.threads_per_rank` gives this rank's thread count (see
docs/collectives.md, "Buffers and threads").
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.runtime import cpu_threads

__all__ = ["node_cpus", "node_threads"]


def node_cpus(comm: MPI.Intracomm, deadline: Deadline) -> list[frozenset[int]]:
    """Return the cores each rank of this rank's node may run on, in node rank order.

    Collective: every rank of ``comm`` calls it. The node communicator is freed before return.
    """
    mine = cpu_threads.allowed_cpus()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        width = np.array([max(mine) + 1], np.int64)
        wait_all([node.Iallreduce(MPI.IN_PLACE, width, op=MPI.MAX)], deadline,
                 "exchanging the cores of this node")
        bits = np.zeros(int(width[0]), np.uint8)
        bits[sorted(mine)] = 1
        every = np.empty((node.Get_size(), bits.size), np.uint8)
        wait_all([node.Iallgather(bits, every)], deadline, "exchanging the cores of this node")
    finally:
        node.Free()  # local in MPICH; pending operations (after a timeout) keep it alive
    return [frozenset(np.flatnonzero(row).tolist()) for row in every]


def node_threads(comm: MPI.Intracomm, deadline: Deadline) -> tuple[int, str]:
    """Return this rank's threads for ccoll's CPU kernels and where the number comes from.

    Collective over ``comm``; also makes the count the process's (``set_thread_count``).
    """
    node = node_cpus(comm, deadline)
    n, why = cpu_threads.threads_per_rank(
        cpu_threads.allowed_cpus(), node, os.environ, cpu_threads.pool_size())
    explicit = cpu_threads.env_threads(os.environ)[0] is not None
    return cpu_threads.set_thread_count(n, explicit=explicit), why
