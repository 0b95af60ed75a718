"""Threads per rank: the cores of each rank's node, and this rank's share of them.

Called once when a :class:`~ccoll.Communicator` is created (collective over its
communicator): the ranks exchange their host and the cores they may run on, and
:func:`ccoll.runtime.cpu_threads.threads_per_rank` gives this rank's thread count from
those of the ranks on its host (see
docs/collectives.md, "Buffers and threads").
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
from mpi4py import MPI

from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.runtime import cpu_threads

__all__ = ["node_cpus", "node_threads"]


def _host_key() -> int:
    """Return a 63-bit digest of this process's host name (``MPI_Get_processor_name``)."""
    name = MPI.Get_processor_name().encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little") >> 1


def node_cpus(comm: MPI.Intracomm, deadline: Deadline) -> list[frozenset[int]]:
    """Return the cores each rank of this rank's host may run on, in rank order.

    Collective: every rank of ``comm`` calls it. Ranks are grouped by host name, exchanged
    with nonblocking collectives under ``deadline`` (``MPI_Comm_split_type`` has no
    nonblocking form: a rank that stopped after the creation's agreement would leave the
    others in it past any timeout). The host, not MPI's shared-memory domain, is what
    shares the cores: on the emulated cluster (``MPIR_CVAR_NOLOCAL``) every rank is its own
    shared-memory domain, yet all run on one machine's cores.
    """
    mine = cpu_threads.allowed_cpus()
    width = np.array([max(mine) + 1], np.int64)
    wait_all([comm.Iallreduce(MPI.IN_PLACE, width, op=MPI.MAX)], deadline,
             "exchanging the cores of this node")
    row = np.zeros(8 + int(width[0]), np.uint8)
    row[:8] = np.frombuffer(np.int64(_host_key()).tobytes(), np.uint8)
    row[8 + np.array(sorted(mine), np.int64)] = 1
    every = np.empty((comm.Get_size(), row.size), np.uint8)
    wait_all([comm.Iallgather(row, every)], deadline, "exchanging the cores of this node")
    host = row[:8].tobytes()
    return [frozenset(np.flatnonzero(r[8:]).tolist()) for r in every if r[:8].tobytes() == host]


def node_threads(comm: MPI.Intracomm, deadline: Deadline) -> tuple[int, str]:
    """Return this rank's threads for ccoll's CPU kernels and where the number comes from.

    Collective over ``comm``; also makes the count the process's (``set_thread_count``).
    """
    node = node_cpus(comm, deadline)
    n, why = cpu_threads.threads_per_rank(
        cpu_threads.allowed_cpus(), node, os.environ, cpu_threads.pool_size())
    explicit = cpu_threads.env_threads(os.environ)[0] is not None
    return cpu_threads.set_thread_count(n, explicit=explicit), why
